"""Audio input: soundfile decoding, mono mix, soxr resampling, and refusals."""
from __future__ import annotations

import io
import struct
import threading
import time
import tracemalloc
import wave

import numpy as np
import pytest
import soundfile

from inference import audio

from .support.audio import FIXTURES, flac_without_length, riff_wave, silent_flac, wav_bytes, wav_fmt
from .support.processes import ROOT


def tone(rate: int, seconds: float = 0.5, freq: float = 440.0) -> np.ndarray:
    t = np.arange(int(rate * seconds)) / rate
    return (0.5 * np.sin(2 * np.pi * freq * t)).astype(np.float32)


@pytest.mark.parametrize("fmt, subtype, rate", [("WAV", "PCM_16", 16000), ("FLAC", "PCM_16", 16000),
                                                 ("OGG", "VORBIS", 16000), ("MP3", "MPEG_LAYER_III", 16000),
                                                 ("OGG", "OPUS", 48000)])
def test_containers_decode_to_model_rate(fmt, subtype, rate):
    data = wav_bytes(tone(rate), rate, fmt, subtype)
    samples, source_rate = audio.decode(data, 16000)
    assert source_rate == rate
    assert samples.dtype == np.float32 and samples.ndim == 1
    assert abs(len(samples) - 8000) <= 1200  # lossy codecs add priming/padding frames
    assert 0.2 < np.abs(samples).max() <= 1.0


def test_stereo_is_mixed_to_mono_and_resampled():
    rate = 44100
    left, right = tone(rate, 1.0, 300), tone(rate, 1.0, 300)
    data = wav_bytes(np.stack([left, right], axis=1), rate, "WAV", "FLOAT")
    samples, _ = audio.decode(data, 16000)
    assert len(samples) == 16000
    # The 300 Hz tone survives resampling: its spectrum peaks at 300 Hz.
    spectrum = np.abs(np.fft.rfft(samples))
    assert abs(np.argmax(spectrum) * 16000 / len(samples) - 300) < 2


def test_more_than_eight_channels_are_refused_from_the_header():
    """The channel count is checked before decoding (a block of 65536 frames x 1024 channels
    would be 256 MiB); eight channels (7.1) still decode."""
    rate = 16000
    eight = wav_bytes(np.tile(tone(rate, 0.25)[:, None], (1, 8)), rate, "WAV", "PCM_16")
    samples, _ = audio.decode(eight, rate)
    assert len(samples) == 4000
    nine = wav_bytes(np.zeros((rate, 9), dtype=np.float32), rate, "WAV", "PCM_16")
    with pytest.raises(audio.TooManyChannels, match="the audio has 9 channels; at most 8 are accepted"):
        audio.decode(nine, rate)


def test_audio_over_max_seconds_is_refused_from_the_header_before_decoding():
    """A container that states its length (FLAC) is refused on that length, without decoding a
    block: the message gives the stated duration, which only the header check knows."""
    data = wav_bytes(np.zeros(1000 * 7200, dtype=np.float32), 1000, "FLAC", "PCM_16")  # two hours
    assert len(data) < 1_000_000
    started = time.monotonic()
    with pytest.raises(audio.AudioTooLong, match=r"the audio lasts 7200 s; the limit is max_audio_seconds=60"):
        audio.decode(data, 16000, max_seconds=60)
    assert time.monotonic() - started < 0.5


def test_empty_bytes_are_refused():
    with pytest.raises(audio.EmptyAudio):
        audio.decode(b"", 16000)


def test_zero_frames_are_refused():
    with pytest.raises(audio.EmptyAudio):
        audio.decode(wav_bytes(np.zeros(0, dtype=np.float32), 16000), 16000)


def test_random_bytes_are_undecodable():
    rng = np.random.default_rng(7)
    with pytest.raises(audio.UndecodableAudio):
        audio.decode(rng.bytes(4096), 16000)


def test_truncated_header_is_undecodable():
    data = wav_bytes(tone(16000), 16000)
    with pytest.raises(audio.UndecodableAudio):
        audio.decode(data[:30], 16000)


@pytest.mark.parametrize("rate", [500, 400000])
def test_implausible_sample_rate_is_refused(rate):
    data = wav_bytes(np.zeros(64, dtype=np.float32), rate)
    with pytest.raises(audio.ImplausibleAudio) as info:
        audio.decode(data, 16000)
    assert str(rate) in str(info.value)


def test_non_finite_samples_are_refused():
    samples = tone(16000)
    samples[10] = np.nan
    with pytest.raises(audio.ImplausibleAudio):
        audio.decode(wav_bytes(samples, 16000, "WAV", "FLOAT"), 16000)


def test_bytes_roundtrip_without_a_copy_on_the_sending_side():
    """The decoded samples travel to Redis as a view of the decoded array (no extra copy)."""
    samples = tone(16000).astype("<f4")
    view = audio.to_bytes(samples)
    assert view.nbytes == len(view) == samples.nbytes  # redis-py frames the value by len(): bytes, not floats
    assert np.shares_memory(np.frombuffer(view, dtype="<f4"), samples)
    restored = audio.from_bytes(bytes(view))
    assert np.array_equal(restored, samples) and restored.flags.writeable


@pytest.mark.parametrize("fmt", ["WAV", "FLAC", "AIFF"])
def test_16_bit_pcm_at_the_model_rate_travels_as_int16_and_reads_back_to_the_same_floats(fmt):
    """The request path sends mono 16-bit PCM at the model's rate as its int16 samples (half the bytes);
    the worker's float32 are bit for bit what decoding to float32 gives."""
    rng = np.random.default_rng(8)
    ints = np.concatenate([np.array([-32768, 32767, 0, 1, -1], np.int16),
                           rng.integers(-32768, 32768, 3 * audio.BLOCK_FRAMES + 17).astype(np.int16)])
    data = wav_bytes(ints, 16000, fmt, "PCM_16")
    floats, _ = audio.decode(data, 16000)
    kept, _ = audio.decode(data, 16000, keep_pcm16=True)
    assert kept.dtype == np.int16 and np.array_equal(kept, ints)
    assert audio.sample_format(kept) == audio.S16LE and audio.sample_format(floats) == audio.F32LE
    view = audio.to_bytes(kept)
    assert view.nbytes == ints.nbytes and np.shares_memory(np.frombuffer(view, dtype="<i2"), kept)
    restored = audio.from_bytes(bytes(view), audio.S16LE)
    assert restored.dtype == np.float32 and np.array_equal(restored, floats) and restored.flags.writeable


@pytest.mark.parametrize("data, why", [
    (wav_bytes(np.zeros((1600, 2), np.int16), 16000, "WAV", "PCM_16"), "stereo: mixed to mono"),
    (wav_bytes(np.zeros(1600, np.int16), 8000, "WAV", "PCM_16"), "another rate: resampled"),
    (wav_bytes(np.zeros(1600, np.float32), 16000, "WAV", "FLOAT"), "float samples"),
    (wav_bytes(np.zeros(1600, np.float32), 16000, "WAV", "PCM_24"), "24-bit samples"),
])
def test_only_exact_16_bit_pcm_is_kept_as_int16(data, why):
    samples, _ = audio.decode(data, 16000, keep_pcm16=True)
    assert samples.dtype == np.float32, why


_PCM = np.concatenate([np.array([-32768, 32767, 0, 1, -1], np.int16),
                       np.random.default_rng(3).integers(-32768, 32768, 4000).astype(np.int16)])
_LIST = b"INFOISFT" + (14).to_bytes(4, "little") + b"Lavf58.76.100\0"


def _python_wave(samples: np.ndarray, rate: int = 16000) -> bytes:
    out = io.BytesIO()
    with wave.open(out, "wb") as handle:
        handle.setnchannels(1)
        handle.setsampwidth(2)
        handle.setframerate(rate)
        handle.writeframes(samples.tobytes())
    return out.getvalue()


@pytest.mark.parametrize("data, why", [
    (wav_bytes(_PCM, 16000, "WAV", "PCM_16"), "soundfile's own layout"),
    (wav_bytes(_PCM[:1], 16000, "WAV", "PCM_16"), "one frame"),
    (_python_wave(_PCM), "Python's wave module"),
    (riff_wave((b"fmt ", wav_fmt(extra=b"\0\0")), (b"data", _PCM.tobytes())), "an 18-byte fmt chunk (cbSize 0)"),
])
def test_a_wav_that_needs_no_decoding_is_read_as_is_exactly_as_libsndfile_reads_it(data, why):
    """A 16-bit mono WAV at the model's rate, laid out canonically, is read on the event loop
    (no pool hop) as a view of its data chunk; header and samples are what libsndfile gives."""
    assert audio.plain_pcm16_wav(data, 16000, 1 << 20), why
    header, samples = audio.read_pcm16_as_is(data, 16000, 1800.0, 1 << 20, lambda header: True)
    assert header == audio.read_header(data), why
    decoded, _ = audio.decode(data, 16000, keep_pcm16=True)
    assert samples.dtype == np.int16 and np.array_equal(samples, decoded), why
    assert np.array_equal(audio.from_bytes(bytes(audio.to_bytes(samples)), audio.S16LE), audio.decode(data, 16000)[0])
    assert audio.read_pcm16_as_is(data, 16000, 1800.0, 1 << 20, lambda header: False) == (header, None)


def test_the_shipped_speech_fixtures_are_read_as_is():
    paths = sorted(FIXTURES.glob("*.wav")) + sorted((ROOT / "samples").glob("*.wav"))
    assert paths
    for path in paths:
        data = path.read_bytes()
        header, samples = audio.read_pcm16_as_is(data, 16000, 1800.0, 1 << 20, lambda header: True)
        assert np.array_equal(samples, soundfile.read(path, dtype="int16")[0]), path.name


@pytest.mark.parametrize("data, why", [
    (riff_wave((b"fmt ", wav_fmt()), (b"data", _PCM.tobytes()), (b"LIST", _LIST)),
     "a chunk after the data: libsndfile walks it"),
    (riff_wave((b"fmt ", wav_fmt()), (b"data", _PCM.tobytes()), declared={b"data": _PCM.nbytes + 400}),
     "a data chunk cut short (libsndfile reads what is there)"),
    (riff_wave((b"fmt ", wav_fmt()), (b"data", _PCM.tobytes() + b"\0")), "an odd data size"),
    (riff_wave((b"fmt ", wav_fmt()), (b"data", b"")), "no frames"),
    (riff_wave((b"fmt ", wav_fmt()), (b"LIST", _LIST), (b"data", _PCM.tobytes())),
     "a LIST chunk before the data (ffmpeg)"),
    (riff_wave((b"JUNK", b"\0" * 27), (b"fmt ", wav_fmt()), (b"data", _PCM.tobytes())), "a JUNK chunk before fmt"),
    (riff_wave((b"fmt ", wav_fmt()), (b"fact", b"\0" * 4), (b"data", _PCM.tobytes())), "a fact chunk"),
    (wav_bytes(_PCM, 16000, "WAV", "PCM_16")[:4] + (100).to_bytes(4, "little")
     + wav_bytes(_PCM, 16000, "WAV", "PCM_16")[8:], "a RIFF size field that is not the file's"),
    (riff_wave(*[(b"JUNK", b"")] * 8000, (b"fmt ", wav_fmt()), (b"data", _PCM.tobytes())), "8,000 empty chunks"),
    (riff_wave((b"data", _PCM.tobytes()), (b"fmt ", wav_fmt())), "data before fmt"),
    (riff_wave((b"fmt ", wav_fmt(rate=8000)), (b"data", _PCM.tobytes())), "another rate"),
    (riff_wave((b"fmt ", wav_fmt(channels=2)), (b"data", _PCM.tobytes())), "two channels"),
    (riff_wave((b"fmt ", wav_fmt(bits=8)), (b"data", _PCM.tobytes())), "8-bit"),
    (riff_wave((b"fmt ", wav_fmt(tag=3, bits=32)), (b"data", _PCM.tobytes())), "float"),
    (riff_wave((b"fmt ", wav_fmt(tag=0xFFFE, extra=b"\x16\0" + b"\0" * 22)), (b"data", _PCM.tobytes())),
     "WAVE_FORMAT_EXTENSIBLE"),
    (riff_wave((b"fmt ", struct.pack("<HHIIHH", 1, 1, 16000, 16000, 2, 16))), "a wrong byte rate, no data"),
    (wav_bytes(_PCM, 16000, "FLAC", "PCM_16"), "FLAC"),
    (b"RIFX" + wav_bytes(_PCM, 16000, "WAV", "PCM_16")[4:], "big-endian RIFX"),
    (b"", "empty"),
])
def test_every_other_wav_is_left_to_libsndfile(data, why):
    """Anything but the canonical layout goes to the decode pools, where libsndfile decides (and words the
    refusals); the layout check looks at two chunk headers."""
    assert not audio.plain_pcm16_wav(data, 16000, 1 << 20), why
    assert audio.read_pcm16_as_is(data, 16000, 1800.0, 1 << 20, lambda header: True) is None, why


def test_a_wav_read_as_is_is_refused_with_read_header_s_words():
    data = wav_bytes(np.zeros(16000 * 3, np.int16), 16000, "WAV", "PCM_16")
    with pytest.raises(audio.AudioTooLong) as as_is:
        audio.read_pcm16_as_is(data, 16000, 2.0, 1 << 20, lambda header: True)
    with pytest.raises(audio.AudioTooLong) as libsndfile:
        audio.read_header(data, 2.0)
    assert str(as_is.value) == str(libsndfile.value)
    assert audio.read_pcm16_as_is(data, 16000, 1800.0, 16000, lambda header: True) is None  # over max_frames


def test_an_unknown_sample_format_is_refused():
    with pytest.raises(ValueError, match="unknown sample format"):
        audio.from_bytes(b"\0\0", "u8")


def test_a_cancelled_decode_stops_at_the_next_block():
    """A client that leaves while its audio decodes frees the decoder (an
    abandoned decode must not keep the shared pool busy for its whole length)."""
    rate = 48000
    data = wav_bytes(np.zeros((rate * 240, 2), dtype=np.float32), rate, fmt="FLAC", subtype="PCM_16")  # 4 min
    started = time.monotonic()
    audio.decode(data, 16000)
    full_s = time.monotonic() - started

    cancel = threading.Event()
    outcome: dict = {}

    def decode() -> None:
        try:
            audio.decode(data, 16000, cancel=cancel)
            outcome["result"] = "finished"
        except audio.DecodeCancelled:
            outcome["result"] = "cancelled"

    thread = threading.Thread(target=decode)
    started = time.monotonic()
    thread.start()
    time.sleep(full_s / 10)
    cancel.set()
    thread.join(timeout=full_s * 2)
    cancelled_s = time.monotonic() - started
    assert outcome == {"result": "cancelled"}
    assert cancelled_s < full_s / 2, (cancelled_s, full_s)


@pytest.mark.parametrize("source_rate", [1000, 8000, 11025, 22050, 44100, 48000, 96000, 384000])
@pytest.mark.parametrize("frames", [1, 4095, audio.BLOCK_FRAMES, 3 * audio.BLOCK_FRAMES + 17])
def test_the_output_bound_holds_for_what_soxr_returns(source_rate, frames):
    """decode() sizes its output once from the header (output_frames_bound): soxr's streaming resampler
    never returns more, and at most a few samples fewer, so no sample is lost and nothing is regrown."""
    rng = np.random.default_rng(frames)
    data = wav_bytes((0.1 * rng.standard_normal(frames)).astype(np.float32), source_rate, "WAV", "FLOAT")
    bound = audio.output_frames_bound(frames, source_rate, 16000)
    try:
        samples, _ = audio.decode(data, 16000)
    except audio.EmptyAudio:  # one frame at 384 kHz yields no sample at 16 kHz
        assert bound <= 1
        return
    assert bound - 2 <= len(samples) <= bound
    assert samples.base is not None and samples.base.shape[0] == bound  # a view of the one output array


def test_the_header_is_read_without_decoding_and_checked_like_decode_checks_it():
    """read_header: rate, channels and stated length; the same refusals as decode, no frame decoded."""
    header = audio.read_header(wav_bytes(np.zeros((48000, 2), dtype=np.float32), 48000), 1800)
    assert header == audio.AudioHeader(sample_rate_hz=48000, channels=2, frames=48000)
    assert header.duration_s == 1.0
    two_hours = wav_bytes(np.zeros(1000 * 7200, dtype=np.float32), 1000, "FLAC", "PCM_16")
    with pytest.raises(audio.AudioTooLong, match="the audio lasts 7200 s"):
        audio.read_header(two_hours, 60)
    with pytest.raises(audio.TooManyChannels):
        audio.read_header(wav_bytes(np.zeros((16000, 9), dtype=np.float32), 16000), 60)
    with pytest.raises(audio.EmptyAudio):
        audio.read_header(wav_bytes(np.zeros(0, dtype=np.float32), 16000), 60)
    with pytest.raises(audio.UndecodableAudio):
        audio.read_header(np.random.default_rng(7).bytes(4096), 60)
    with pytest.raises(audio.ImplausibleAudio):
        audio.read_header(wav_bytes(np.zeros(64, dtype=np.float32), 400000), 60)


@pytest.mark.parametrize("rate, channels, fmt, subtype, seconds", [
    (16000, 1, "FLAC", "PCM_16", 60), (48000, 2, "FLAC", "PCM_16", 60), (8000, 8, "WAV", "PCM_16", 60),
    (44100, 2, "OGG", "VORBIS", 60),
    # shorter than one block, resampled: the estimate bounds the resampler's chunk by the file's length
    (8000, 1, "WAV", "PCM_16", 0.5), (1000, 1, "WAV", "PCM_16", 0.01), (22050, 2, "FLAC", "PCM_16", 2)])
def test_decoding_allocates_the_output_once_and_stays_within_its_estimate(rate, channels, fmt, subtype, seconds):
    """Copies on the path: the Python-visible allocations of a decode peak at the output
    array plus one block's buffers (no list of pieces, no concatenated copy), and decode_peak_bytes, what
    the web process reserves, covers them. tracemalloc sees numpy's buffers, not libsndfile's or soxr's
    own (those are in the estimate's resampler allowance)."""
    buf = io.BytesIO()
    rng = np.random.default_rng(rate)
    piece_s = min(10, seconds)
    with soundfile.SoundFile(buf, "w", rate, channels, format=fmt, subtype=subtype) as out:
        for _ in range(round(seconds / piece_s)):
            out.write((0.1 * rng.standard_normal((round(rate * piece_s), channels))).astype(np.float32))
    data = buf.getvalue()
    header = audio.read_header(data, 1800)
    tracemalloc.start()
    try:
        samples, _ = audio.decode(data, 16000)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    block_bytes = audio.BLOCK_FRAMES * channels * 4
    assert samples.nbytes <= peak_bytes < samples.nbytes + 3 * block_bytes + (4 << 20)
    assert peak_bytes <= audio.decode_peak_bytes(header, 16000)


# -- a FLAC that does not state its length -------------------------------------------------------------

def _noise_flac(rate: int, channels: int, subtype: str, frames: int) -> bytes:
    rng = np.random.default_rng(rate + channels)
    return wav_bytes((0.1 * rng.standard_normal((frames, channels))).astype(np.float32), rate, "FLAC", subtype)


@pytest.mark.parametrize("rate, channels, subtype", [
    (16000, 1, "PCM_16"), (22050, 1, "PCM_16"), (44100, 2, "PCM_24"), (8000, 1, "PCM_S8"), (48000, 6, "PCM_16")])
@pytest.mark.parametrize("keep_pcm16", [False, True])
def test_a_flac_that_does_not_state_its_length_decodes_to_the_samples_of_the_same_flac_with_its_length(
        rate, channels, subtype, keep_pcm16):
    """A STREAMINFO total of 0 samples means "unknown" (FLAC format specification; streaming encoders write
    it). libsndfile cannot read such a stream past its first block; the server counts it, then decodes it
    with PyAV, to exactly the samples libsndfile gives for the same stream with its length stated
    (mono 16-bit at the model's rate as int16, the rest mixed and resampled)."""
    frames = 3 * audio.BLOCK_FRAMES + 123  # several blocks, the last one short
    stated = _noise_flac(rate, channels, subtype, frames)
    unstated = flac_without_length(stated)
    assert soundfile.info(io.BytesIO(unstated)).frames == audio.UNKNOWN_LENGTH_FRAMES
    header = audio.read_header(unstated, 1800)
    assert header == audio.read_header(stated, 1800) == audio.AudioHeader(rate, channels, frames)
    assert header.counted
    expected, _ = audio.decode(stated, 16000, keep_pcm16=keep_pcm16)
    for given in (None, header):
        samples, source_rate = audio.decode(unstated, 16000, keep_pcm16=keep_pcm16, header=given)
        assert source_rate == rate
        assert samples.dtype == expected.dtype
        assert np.array_equal(samples, expected)


def test_our_own_streamed_flac_is_read_back_sample_for_sample():
    """The speech endpoint's streamed flac (``SpeechEncoder`` writing to a socket: length not stated)
    decodes to the int16 samples it was made of."""
    pcm = (3000 * np.random.default_rng(5).standard_normal(50000)).astype("<i2")
    encoder = audio.SpeechEncoder("flac", 16000)
    flac = encoder.encode(pcm.tobytes()) + encoder.finish()
    assert soundfile.info(io.BytesIO(flac)).frames == audio.UNKNOWN_LENGTH_FRAMES
    samples, _ = audio.decode(flac, 16000, keep_pcm16=True)
    assert np.array_equal(samples, pcm)


def test_a_flac_that_does_not_state_its_length_is_counted_only_up_to_max_seconds():
    """An unstated length is counted by demuxing, stopped as soon as the count passes ``max_audio_seconds``
    (413's AudioTooLong, nothing decoded); without ``count_frames`` the header read stops at
    LengthNotStated after checking rate and channels; a stream of 0 frames is empty."""
    unstated = flac_without_length(silent_flac(1800))
    assert audio.read_header(unstated, 1800).frames == 1800 * 16000
    started = time.perf_counter()
    with pytest.raises(audio.AudioTooLong, match="more than 60 s .* max_audio_seconds=60"):
        audio.read_header(unstated, 60)
    assert time.perf_counter() - started < 0.5, "stopped at the limit, not at the end of the stream"
    with pytest.raises(audio.AudioTooLong, match="max_audio_seconds=60"):
        audio.decode(unstated, 16000, 60)
    with pytest.raises(audio.LengthNotStated):
        audio.read_header(unstated, 1800, count_frames=False)
    with pytest.raises(audio.EmptyAudio):
        audio.read_header(flac_without_length(silent_flac(1))[:42], 1800)


def test_a_cancelled_count_stops_at_the_next_packet():
    cancel = threading.Event()
    cancel.set()
    with pytest.raises(audio.DecodeCancelled):
        audio.read_header(flac_without_length(silent_flac(10)), 1800, cancel=cancel)


def test_a_flac_that_does_not_state_its_length_decodes_within_its_estimate():
    """The decode of a counted FLAC allocates its output once (the counted length) plus PyAV's blocks,
    within decode_peak_bytes (what the web process reserves)."""
    unstated = flac_without_length(_noise_flac(48000, 2, "PCM_16", 48000 * 60))
    header = audio.read_header(unstated, 1800)
    tracemalloc.start()
    try:
        samples, _ = audio.decode(unstated, 16000, header=header)
        _, peak_bytes = tracemalloc.get_traced_memory()
    finally:
        tracemalloc.stop()
    assert samples.nbytes <= peak_bytes <= audio.decode_peak_bytes(header, 16000)
