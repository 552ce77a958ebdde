"""Audio input: decode with ``soundfile`` (libsndfile: WAV, FLAC, OGG/Vorbis/Opus,
MP3), mix to mono, resample with ``soxr`` to the model's rate. A FLAC whose
STREAMINFO does not state its length (what a streaming encoder writes) is
counted, then decoded, with PyAV (FFmpeg's FLAC decoder): libsndfile cannot read
such a stream past its first block.

All functions raise :class:`AudioError` subclasses, which the web side maps to
400 (empty/implausible) or 415 (undecodable); nothing here knows HTTP.
"""
from __future__ import annotations

import functools
import io
import math
import struct
import threading
from collections.abc import Callable
from dataclasses import dataclass, field
from fractions import Fraction
from typing import Any

import numpy as np
import soundfile
import soxr

MIN_SAMPLE_RATE_HZ = 1000  # below this no real recording exists; a header claiming it is corrupt
MAX_SAMPLE_RATE_HZ = 384000  # highest rate of common audio interfaces
# Most channels a file may have: 7.1 surround is 8. Every model here takes mono, so more channels only
# multiply the decoding work and the memory of one block (BLOCK_FRAMES x channels float32: 2 MiB at 8,
# 256 MiB at the 1024 a WAV header may claim).
MAX_CHANNELS = 8


class AudioError(ValueError):
    """Base of audio input errors."""


class EmptyAudio(AudioError):
    """Zero bytes, or a valid container holding zero frames."""


class UndecodableAudio(AudioError):
    """Not a container/codec libsndfile can read (random bytes, truncated header)."""


class ImplausibleAudio(AudioError):
    """Decodes, but its parameters cannot be real (sample rate out of range, NaN samples)."""


class DecodeCancelled(AudioError):
    """The caller withdrew (``cancel`` was set): decoding stopped between two blocks."""


class AudioTooLong(AudioError):
    """Decodes to more audio than ``max_audio_seconds`` allows (a small file can hold hours of silence)."""


class TooManyChannels(AudioError):
    """The header announces more than :data:`MAX_CHANNELS` channels."""


class LengthNotStated(AudioError):
    """A FLAC whose STREAMINFO does not state its length, met by :func:`read_header` with
    ``count_frames=False``: its length is known only after a pass over the whole stream
    (:func:`read_header` with ``count_frames=True``), which the caller may want to run elsewhere
    (``inference.runtime.decoding`` runs it in its bulk pool)."""


BLOCK_FRAMES = 65536  # frames read per step: the source is never held whole, only one block of it
# soxr's filter tables and buffers besides its input and output arrays: measured under 1 MiB at 384 kHz -> 16 kHz;
# its buffers grow with the chunk it returns (about twice it when upsampling 1 kHz -> 16 kHz), counted separately.
RESAMPLER_TABLES_BYTES = 1 << 20
# libsndfile's decoder state, the bytes it reads from the upload through soundfile's I/O callbacks, and the
# Python objects of a decode: a few KB traced, well under this.
DECODER_STATE_BYTES = 1 << 20
# A FLAC decoded by PyAV (length not stated): FFmpeg's decoded frame, its copy as a numpy array and the
# decoder's own buffers, each at most one FLAC block (a 16-bit field: at most 65,535 frames, FLAC format
# specification) x channels x 4 bytes (FFmpeg decodes over 16 bits to int32), plus its I/O buffers.
FLAC_MAX_BLOCK_FRAMES = 65535
PYAV_FLAC_COPIES = 3
PYAV_STATE_BYTES = 1 << 20
FLOAT32_BYTES = 4
INT16_BYTES = 2  # a 16-bit PCM sample, as a WAV read as-is carries them


@dataclass(frozen=True)
class AudioHeader:
    """What a container's header states, read without decoding a frame (:func:`read_header`).

    ``frames`` is the length at ``sample_rate_hz`` as libsndfile computes it
    from the header (or, for OGG and MP3, from the stream's end); libsndfile
    never returns more frames than this, so it bounds what :func:`decode`
    produces. ``as_is``: read by :func:`read_pcm16_as_is`, a WAV whose samples
    need no decoding at the rate it was read for (they are a view of the
    upload); not part of equality (the same header as libsndfile's).
    ``counted``: a FLAC that does not state its length, whose ``frames`` were
    counted by demuxing it (:func:`read_header`); :func:`decode` reads it with
    PyAV and never returns more frames than counted.
    """

    sample_rate_hz: int
    channels: int
    frames: int
    as_is: bool = field(default=False, compare=False)
    counted: bool = field(default=False, compare=False)

    @property
    def duration_s(self) -> float:
        """The stated length in seconds."""
        return self.frames / self.sample_rate_hz


UNKNOWN_LENGTH_FRAMES = 2**63 - 1
"""What libsndfile reports as the length of a stream that does not state one (``SF_COUNT_MAX``): a FLAC
whose STREAMINFO says 0 total samples ("unknown", which the FLAC format allows and streaming encoders
write, ``SpeechEncoder`` included)."""


@functools.lru_cache(maxsize=256)
def max_frames_for(max_seconds: float, rate: int) -> int:
    """Most frames at ``rate`` Hz that last no longer than ``max_seconds``: ``floor(max_seconds x rate)``
    computed on the decimal value as written (``Fraction(repr(...))``), so that 8.12 s at 16 kHz allows
    129,920 frames, not the 129,919 of binary ``int(8.12 * 16000)``. Cached: every header check asks,
    with the one configured limit and a handful of rates (4 µs uncached)."""
    return math.floor(Fraction(repr(float(max_seconds))) * rate)


def _seconds_over(frames: int, rate: int, max_seconds: float) -> str:
    """``frames / rate`` in seconds with as few decimals as show it over ``max_seconds`` (at most 9)."""
    seconds = frames / rate
    for digits in range(10):
        text = f"{seconds:.{digits}f}"
        if float(text) > max_seconds:
            return text
    return f"{seconds:.9f}"


def _states_no_length(handle: soundfile.SoundFile) -> bool:
    return int(handle.frames) >= UNKNOWN_LENGTH_FRAMES


def _checked_header(handle: soundfile.SoundFile, max_seconds: float) -> AudioHeader:
    """The header of a stream that states its length (callers check :func:`_states_no_length` first)."""
    return _checked_stated(int(handle.samplerate), int(handle.channels), int(handle.frames), max_seconds)


def _counted_header(handle: soundfile.SoundFile, data: bytes, max_seconds: float, count_frames: bool,
                    cancel: threading.Event | None = None) -> AudioHeader:
    """The header of a stream that does not state its length: a FLAC's is counted (:func:`count_flac_frames`,
    stopped past ``max_seconds``); any other such stream is refused."""
    if handle.format != "FLAC":
        raise UndecodableAudio(
            f"the {handle.format} stream does not state its length, which this server reads only for FLAC; "
            "send it with its length (any encoder writing to a file does) or as WAV")
    rate, channels = int(handle.samplerate), int(handle.channels)
    _checked_stated(rate, channels, 1, max_seconds)  # rate and channels, before any pass over the stream
    if not count_frames:
        raise LengthNotStated("the FLAC stream does not state its length: count its frames")
    frames = count_flac_frames(data, rate, max_frames_for(max_seconds, rate), cancel)
    if frames > max_frames_for(max_seconds, rate):
        raise AudioTooLong(f"the audio lasts more than {max_seconds:g} s (the FLAC stream does not state its "
                           f"length; counted up to the limit); the limit is max_audio_seconds={max_seconds:g}")
    return _checked_stated(rate, channels, frames, max_seconds, counted=True)


def _av_error(exc: Exception) -> UndecodableAudio:
    return UndecodableAudio(f"cannot decode the FLAC stream ({str(exc).strip().rstrip('.')}); "
                            "send WAV, FLAC, OGG (Vorbis/Opus) or MP3")


def count_flac_frames(data: bytes, rate: int, max_frames: int, cancel: threading.Event | None = None) -> int:
    """Frames of a FLAC stream, counted by demuxing it with PyAV (FFmpeg's FLAC parser reads each frame's
    header and block size; no sample is decoded), stopping as soon as the count passes ``max_frames``.

    Holds one packet at a time (a FLAC frame: at most 65,535 frames x 8 channels x 4 bytes compressed).
    Time grows with the packets read: about 2 µs each (30 min of 16 kHz silence from our own encoder,
    25,000 packets: 54 ms), so run it off the event loop.

    Args:
        data: the whole FLAC file.
        rate: its sample rate (STREAMINFO's), in Hz.
        max_frames: stop counting once past this many frames.
        cancel: when set (by another thread), counting stops at the next packet.

    Returns:
        The frames counted (at most ``max_frames`` + one packet's worth; 0 when the metadata is all there is).

    Raises:
        UndecodableAudio: FFmpeg cannot demux it as FLAC.
        DecodeCancelled: ``cancel`` was set.
    """
    import av  # PyAV: imported only by processes that read or write such streams

    try:
        with av.open(io.BytesIO(data), mode="r", format="flac") as container:
            stream = container.streams.audio[0]
            per_tick = Fraction(stream.time_base) * rate if stream.time_base else Fraction(1)
            ticks = 0
            for packet in container.demux(stream):
                if cancel is not None and cancel.is_set():
                    raise DecodeCancelled("decoding was cancelled")
                if packet.size and packet.duration:
                    ticks += packet.duration
                    if ticks * per_tick > max_frames:
                        break
            return math.floor(ticks * per_tick)
    except AudioError:
        raise
    except av.EOFError:  # nothing after the metadata: no frame at all
        return 0
    except (av.FFmpegError, IndexError, ValueError, OSError) as exc:
        raise _av_error(exc) from exc


def _checked_stated(rate: int, channels: int, frames: int, max_seconds: float, as_is: bool = False,
                    counted: bool = False) -> AudioHeader:
    if not MIN_SAMPLE_RATE_HZ <= rate <= MAX_SAMPLE_RATE_HZ:
        raise ImplausibleAudio(
            f"sample rate {rate} Hz is outside the plausible range "
            f"{MIN_SAMPLE_RATE_HZ}..{MAX_SAMPLE_RATE_HZ} Hz"
        )
    if channels > MAX_CHANNELS:
        raise TooManyChannels(f"the audio has {channels} channels; at most {MAX_CHANNELS} are accepted")
    if frames > max_frames_for(max_seconds, rate):
        raise AudioTooLong(f"the audio lasts {_seconds_over(frames, rate, max_seconds)} s; the limit is "
                           f"max_audio_seconds={max_seconds:g}")
    if frames <= 0:
        raise EmptyAudio("the audio file holds no samples")
    return AudioHeader(rate, channels, frames, as_is, counted)


def _undecodable(exc: Exception) -> UndecodableAudio:
    reason = getattr(exc, "error_string", None) or str(exc)
    return UndecodableAudio(
        f"cannot decode the audio ({reason.strip().rstrip('.')}); send WAV, FLAC, OGG (Vorbis/Opus) or MP3")


def read_header(data: bytes, max_seconds: float = 1800.0, count_frames: bool = True,
                cancel: threading.Event | None = None) -> AudioHeader:
    """Open ``data`` and check its header, decoding no frame.

    Usually well under a millisecond (30 min OGG/Opus and MP3 included), but
    libsndfile walks every chunk of a WAV through soundfile's Python I/O
    callbacks: 8,000 empty chunks (67 KB) take about 30 ms. Call it off the
    event loop.

    A FLAC whose STREAMINFO says 0 total samples (length not stated, legal,
    what a streaming encoder writes) is counted with ``count_frames``
    (:func:`count_flac_frames`: a pass over the whole stream, stopped past
    ``max_seconds``; the header then has ``counted``), else refused with
    :class:`LengthNotStated` after its rate and channels were checked.

    Raises:
        EmptyAudio: no bytes, or a header stating zero frames.
        UndecodableAudio: libsndfile cannot open it, or FFmpeg cannot demux a FLAC to count; a stream other
            than FLAC that does not state its length.
        ImplausibleAudio: sample rate outside 1 kHz..384 kHz.
        TooManyChannels: more than :data:`MAX_CHANNELS` channels.
        AudioTooLong: a stated (or counted) length over ``max_seconds``.
        LengthNotStated: a FLAC that does not state its length, without ``count_frames``.
        DecodeCancelled: ``cancel`` was set while counting.
    """
    if not data:
        raise EmptyAudio("the audio file is empty (0 bytes)")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as handle:
            if _states_no_length(handle):
                return _counted_header(handle, data, max_seconds, count_frames, cancel)
            return _checked_header(handle, max_seconds)
    except AudioError:
        raise
    except (soundfile.LibsndfileError, RuntimeError, ValueError, TypeError) as exc:
        raise _undecodable(exc) from exc


def output_frames_bound(frames: int, source_rate_hz: int, target_rate_hz: int) -> int:
    """Most samples :func:`decode` returns for ``frames`` source frames: ``ceil(frames x target / source)``.

    soxr's streaming resampler, flushed at the end, returns exactly that many
    or fewer (checked for 1 kHz..384 kHz sources, 8..48 kHz targets, tests/test_audio.py).
    """
    if source_rate_hz == target_rate_hz:
        return frames
    return -(-frames * target_rate_hz // source_rate_hz)


def _chunk_frames_bound(source_rate_hz: int, target_rate_hz: int, frames: int = BLOCK_FRAMES) -> int:
    """Most samples one ``resample_chunk`` call returns for one block of a file of ``frames`` frames: it
    may release samples held back from earlier blocks (at the end, up to about 45,000 source frames'
    worth), so twice a block's worth; a file shorter than a block has one block, of its own length."""
    return -(-2 * min(BLOCK_FRAMES, frames) * target_rate_hz // source_rate_hz)


def decode_peak_bytes(header: AudioHeader, target_rate_hz: int) -> int:
    """Most bytes :func:`decode` holds at once for a file with ``header``, an honest upper bound.

    :func:`decode` allocates its float32 output once, at its final size
    (:func:`output_frames_bound`), and otherwise only per-block buffers that
    it reuses: the read buffer (``BLOCK_FRAMES x channels`` float32), the mono
    mix (``BLOCK_FRAMES`` float32, multichannel only), the finiteness mask
    (one byte per sample of a block) and, when resampling, one chunk returned
    by soxr (copied into the output, then dropped), soxr's own buffers (about
    twice that chunk) and its filter tables (:data:`RESAMPLER_TABLES_BYTES`),
    plus :data:`DECODER_STATE_BYTES` for libsndfile and small objects. The
    upload itself (the caller's ``data``) is not counted: it is held anyway.
    Example: 30 min of 16 kHz mono for a 16 kHz model is 115.2 MB of output
    plus 1.4 MB. A FLAC decoded by PyAV (``header.counted``) adds
    :data:`PYAV_FLAC_COPIES` FLAC blocks (:data:`FLAC_MAX_BLOCK_FRAMES` x
    channels x 4 bytes) and :data:`PYAV_STATE_BYTES` (1.8 MB for mono).
    """
    rate = header.sample_rate_hz
    total = output_frames_bound(header.frames, rate, target_rate_hz) * FLOAT32_BYTES + DECODER_STATE_BYTES
    if header.counted:
        total += PYAV_FLAC_COPIES * FLAC_MAX_BLOCK_FRAMES * header.channels * FLOAT32_BYTES + PYAV_STATE_BYTES
    total += BLOCK_FRAMES * header.channels * (FLOAT32_BYTES + 1)  # read buffer and finiteness mask
    if header.channels > 1:
        total += BLOCK_FRAMES * FLOAT32_BYTES
    if rate != target_rate_hz:
        total += 3 * _chunk_frames_bound(rate, target_rate_hz, header.frames) * FLOAT32_BYTES + RESAMPLER_TABLES_BYTES
    return total


def decode(data: bytes, target_rate_hz: int, max_seconds: float = 1800.0,
           cancel: threading.Event | None = None, keep_pcm16: bool = False,
           header: AudioHeader | None = None) -> tuple[np.ndarray, int]:
    """Decode an audio file in memory to mono float32 at ``target_rate_hz``.

    The header is checked before any frame is decoded (:func:`read_header`'s
    checks). Decoding then streams block by block (``BLOCK_FRAMES`` frames:
    mix to mono, soxr's streaming resampler, VHQ) into one output array
    allocated at its final size from the header's frame count, so the only
    large allocation is the result itself (:func:`decode_peak_bytes`): no
    list of pieces, no concatenation. libsndfile returns at most the frames
    its header states, so a file cannot decode to more than its header (and
    ``max_seconds``) announced.

    Args:
        data: the file's bytes.
        target_rate_hz: the model's sample rate.
        max_seconds: longest accepted audio, in seconds.
        cancel: when set (by another thread), decoding stops at the next block:
            a client that left frees the decoder.
        keep_pcm16: when the file is mono 16-bit PCM (``subtype`` ``PCM_16``) at
            ``target_rate_hz``, return its int16 samples as they are: exactly the
            float32 result times :data:`PCM16_SCALE` (see :func:`is_pcm16_exact`),
            in half the bytes (what a web process sends to its worker).
        header: :func:`read_header`'s answer for ``data``, if the caller has it: for a FLAC that does not
            state its length, its counted ``frames`` (the output's size and the most frames decoded) are
            used instead of counting again. A FLAC that does not state its length is decoded by PyAV
            (FFmpeg), block by block as any other file: the same samples libsndfile gives for the same
            stream with its length stated (tests/test_audio.py).

    Returns:
        ``(samples, source_rate_hz)``: contiguous float32 ``(n,)`` in about
        [-1, 1] at ``target_rate_hz`` (a view of the output array, which may
        be a few samples longer, or longer still when the stream ended before
        its stated length), or int16 ``(n,)`` with ``keep_pcm16`` (above), and
        the file's own rate.

    Raises:
        EmptyAudio: no bytes, no frames, or nothing left after resampling.
        UndecodableAudio: libsndfile cannot open or read it (FFmpeg, a FLAC that does not state its length).
        ImplausibleAudio: sample rate outside 1 kHz..384 kHz, or non-finite samples.
        TooManyChannels: more than :data:`MAX_CHANNELS` channels.
        AudioTooLong: more than ``max_seconds`` of audio.
        DecodeCancelled: ``cancel`` was set.
    """
    if not data:
        raise EmptyAudio("the audio file is empty (0 bytes)")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as handle:
            samples, frames, header = _decode_opened(handle, data, target_rate_hz, max_seconds, cancel,
                                                     keep_pcm16, header)
    except AudioError:
        raise
    except (soundfile.LibsndfileError, RuntimeError, ValueError, TypeError) as exc:
        raise _undecodable(exc) from exc
    _check_yield(frames, samples, target_rate_hz)
    return samples, header.sample_rate_hz


def _decode_opened(handle: soundfile.SoundFile, data: bytes, target_rate_hz: int, max_seconds: float,
                   cancel: threading.Event | None, keep_pcm16: bool,
                   header: AudioHeader | None) -> tuple[np.ndarray, int, AudioHeader]:
    """:func:`decode`'s work on the open ``handle`` of ``data``: check (or, for a FLAC that does not state
    its length, count unless ``header`` already holds that count) the header, then decode block by block,
    through PyAV for such a FLAC and libsndfile otherwise.

    Returns:
        ``(samples, frames decoded, header)``: as :func:`_decode_blocks` gives them, and the checked header.

    Raises:
        AudioError: the subclasses :func:`decode` lists.
        soundfile.LibsndfileError, RuntimeError, ValueError, TypeError: libsndfile's and FFmpeg's own
            errors (:func:`decode` maps them to :class:`UndecodableAudio`).
    """
    if _states_no_length(handle):
        if header is None or not header.counted or header != _checked_stated(
                int(handle.samplerate), int(handle.channels), header.frames, max_seconds):
            header = _counted_header(handle, data, max_seconds, True, cancel)
        pcm16 = keep_pcm16 and is_pcm16_exact(handle, header, target_rate_hz)
        with _FlacReader(data, header) as reader:
            samples, frames = _decode_blocks(reader, header, target_rate_hz, max_seconds, cancel, pcm16)
    else:
        header = _checked_header(handle, max_seconds)
        pcm16 = keep_pcm16 and is_pcm16_exact(handle, header, target_rate_hz)
        samples, frames = _decode_blocks(handle, header, target_rate_hz, max_seconds, cancel, pcm16)
    return samples, frames, header


def _check_yield(frames: int, samples: np.ndarray, target_rate_hz: int) -> None:
    """Refuse a decode that yielded nothing: ``frames`` source frames decoded, ``samples`` the output.

    Raises:
        EmptyAudio: no frame decoded, or nothing left after resampling to ``target_rate_hz``.
    """
    if frames == 0:
        raise EmptyAudio("the audio file holds no samples")
    if samples.size == 0:
        raise EmptyAudio(f"the audio is too short to yield any sample at {target_rate_hz} Hz")


PCM16_SCALE = 32768
"""libsndfile reads 16-bit PCM as float32 ``x / 0x8000`` (its default normalisation): a power of
two, so int16 samples and their float32 reading convert into each other exactly."""


def is_pcm16_exact(handle: soundfile.SoundFile, header: AudioHeader, target_rate_hz: int) -> bool:
    """Whether the file's decoded float32 samples are exactly its int16 samples / :data:`PCM16_SCALE`
    with nothing else done to them: 16-bit PCM (WAV, FLAC, AIFF, ...), mono, already at
    ``target_rate_hz`` (no mix, no resampling). Checked bit for bit by tests/test_audio.py."""
    return handle.subtype == "PCM_16" and header.channels == 1 and header.sample_rate_hz == target_rate_hz


def _decode_blocks(handle: soundfile.SoundFile | _FlacReader, header: AudioHeader, target_rate_hz: int,
                   max_seconds: float, cancel: threading.Event | None,
                   pcm16: bool = False) -> tuple[np.ndarray, int]:
    """The body of :func:`decode`: ``(samples, source frames read)``; int16 samples when ``pcm16``
    (the caller checked :func:`is_pcm16_exact`: no mix, no resampling, no non-finite value possible)."""
    rate, channels = header.sample_rate_hz, header.channels
    max_frames = max_frames_for(max_seconds, rate)
    if pcm16:
        return _read_pcm16(handle, header, max_frames, max_seconds, cancel)
    out = np.empty(output_frames_bound(header.frames, rate, target_rate_hz), dtype=np.float32)
    block_buffer = np.empty((BLOCK_FRAMES, channels), dtype=np.float32)
    finite_mask = np.empty((BLOCK_FRAMES, channels), dtype=bool)
    mono_buffer = np.empty(BLOCK_FRAMES, dtype=np.float32) if channels > 1 else None
    stream = None if rate == target_rate_hz else soxr.ResampleStream(rate, target_rate_hz, 1, "float32", "VHQ")
    filled = frames = 0
    while True:
        if cancel is not None and cancel.is_set():
            raise DecodeCancelled("decoding was cancelled")
        block = handle.read(BLOCK_FRAMES, dtype="float32", always_2d=True, out=block_buffer)
        count = block.shape[0]
        if count == 0:
            break
        frames += count
        if frames > max_frames:  # libsndfile stops at the stated length; kept in case one ever does not
            raise AudioTooLong(f"the audio lasts more than max_audio_seconds={max_seconds:g}")
        if not np.isfinite(block, out=finite_mask[:count]).all():
            raise ImplausibleAudio("the audio holds non-finite samples (NaN or infinity)")
        if mono_buffer is None:
            mono = block[:, 0]  # (count, 1) C-ordered: its only column is contiguous
        else:
            mono = np.mean(block, axis=1, dtype=np.float32, out=mono_buffer[:count])
        if stream is None:
            out, filled = _append(out, filled, mono)
        else:
            out, filled = _append(out, filled, stream.resample_chunk(mono, last=False))
    if stream is not None:
        out, filled = _append(out, filled, stream.resample_chunk(np.zeros(0, dtype=np.float32), last=True))
    return out[:filled], frames


def _read_pcm16(handle: soundfile.SoundFile | _FlacReader, header: AudioHeader, max_frames: int, max_seconds: float,
                cancel: threading.Event | None) -> tuple[np.ndarray, int]:
    """Mono 16-bit PCM at the target rate read as int16 ``(n,)``, block by block into one output
    array sized from the header (as :func:`_decode_blocks`); ``(samples, frames read)``."""
    out = np.empty(header.frames, dtype=np.int16)
    filled = 0
    while filled < out.shape[0]:
        if cancel is not None and cancel.is_set():
            raise DecodeCancelled("decoding was cancelled")
        count = handle.buffer_read_into(out[filled:filled + BLOCK_FRAMES], dtype="int16")
        if count == 0:
            break
        filled += count
        if filled > max_frames:
            raise AudioTooLong(f"the audio lasts more than max_audio_seconds={max_seconds:g}")
    return out[:filled], filled


class _FlacReader:
    """A FLAC stream that does not state its length, decoded by PyAV and read as :func:`_decode_blocks` reads
    a ``soundfile.SoundFile``: ``read`` (float32 ``(count, channels)`` into ``out``) and ``buffer_read_into``
    (int16, mono), in blocks of any size, the same values libsndfile gives (integers / 2^15 for 16-bit
    and 8-bit audio, which FFmpeg widens to int16; / 2^31 for more bits, which it widens to int32 by
    shifting left: 24-bit x / 2^23, as libsndfile).

    Returns at most ``header.frames`` frames (the counted length) and stops decoding there. Holds one
    decoded FFmpeg frame (a FLAC block, at most 65,535 frames x channels) at a time.

    Raises (from its reads):
        UndecodableAudio: FFmpeg cannot decode a block, or a block changes the rate or channel count.
    """

    def __init__(self, data: bytes, header: AudioHeader):
        import av

        self._av = av
        self._header = header
        self._left = header.frames
        self._piece: np.ndarray | None = None  # (n, channels) int16 or int32, a decoded block
        self._offset = 0
        try:
            self._container = av.open(io.BytesIO(data), mode="r", format="flac")
            self._blocks = self._container.decode(audio=0)
        except (av.FFmpegError, IndexError, ValueError, OSError) as exc:
            raise _av_error(exc) from exc

    def __enter__(self) -> _FlacReader:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self._container.close()

    def _next_piece(self) -> bool:
        try:
            frame = next(self._blocks, None)
        except (self._av.FFmpegError, ValueError, OSError) as exc:
            raise _av_error(exc) from exc
        if frame is None:
            return False
        channels = frame.layout.nb_channels
        if frame.sample_rate != self._header.sample_rate_hz or channels != self._header.channels:
            raise UndecodableAudio(
                f"the FLAC stream changes from {self._header.channels} channel(s) at {self._header.sample_rate_hz} "
                f"Hz to {channels} at {frame.sample_rate} Hz; send it as WAV")
        array = frame.to_ndarray()
        self._piece = array.reshape(channels, -1).T if frame.format.is_planar else array.reshape(-1, channels)
        self._offset = 0
        return True

    def _fill(self, out: np.ndarray) -> int:
        """Copy up to ``len(out)`` frames into ``out`` (``(n, channels)``); returns how many."""
        count = 0
        while count < out.shape[0] and self._left > 0:
            if self._piece is None or self._offset >= self._piece.shape[0]:
                if not self._next_piece():
                    break
            assert self._piece is not None
            take = min(out.shape[0] - count, self._piece.shape[0] - self._offset, self._left)
            piece = self._piece[self._offset:self._offset + take]
            target = out[count:count + take]
            if out.dtype == np.float32:
                target[...] = piece
                target *= np.float32(1 / PCM16_SCALE if piece.dtype == np.int16 else 2.0 ** -31)
            elif piece.dtype == out.dtype:
                target[...] = piece
            else:
                raise UndecodableAudio("the FLAC stream's samples are not 16-bit as its header says")
            self._offset += take
            self._left -= take
            count += take
        return count

    def read(self, frames: int, dtype: str = "float32", always_2d: bool = True,
             out: np.ndarray | None = None) -> np.ndarray:
        """Up to ``frames`` frames as float32 ``(count, channels)``, in ``out`` when given (soundfile's call)."""
        if out is None:
            out = np.empty((frames, self._header.channels), dtype=np.float32)
        return out[:self._fill(out[:frames])]

    def buffer_read_into(self, out: np.ndarray, dtype: str = "int16") -> int:
        """Up to ``len(out)`` frames of a mono 16-bit stream as int16 into ``out`` ``(n,)``; returns how many."""
        return self._fill(out.reshape(-1, 1))


def _append(out: np.ndarray, filled: int, piece: np.ndarray) -> tuple[np.ndarray, int]:
    """Copy ``piece`` into ``out`` after its first ``filled`` samples; ``(out, filled)`` afterwards.

    ``out`` is sized by :func:`output_frames_bound`, which soxr never exceeds;
    should it ever, the output grows (one copy) rather than lose samples.
    """
    end = filled + piece.shape[0]
    if end > out.shape[0]:
        grown = np.empty(max(end, out.shape[0] + out.shape[0] // 8), dtype=np.float32)
        grown[:filled] = out[:filled]
        out = grown
    out[filled:end] = piece
    return out, end


def resample(samples: np.ndarray, source_rate_hz: int, target_rate_hz: int) -> np.ndarray:
    """Resample float32 ``(n,)`` with soxr (VHQ); returns contiguous float32 ``(m,)``."""
    if source_rate_hz == target_rate_hz:
        return np.ascontiguousarray(samples, dtype=np.float32)
    out = soxr.resample(samples, source_rate_hz, target_rate_hz, quality="VHQ")
    return np.ascontiguousarray(out, dtype=np.float32)


F32LE, S16LE = "f32le", "s16le"
"""Sample formats of a Redis input key: little-endian float32, or little-endian int16 standing for
float32 ``x / PCM16_SCALE`` (16-bit PCM decoded with ``keep_pcm16``: half the bytes, same values)."""


def _plain_pcm16_layout(data: bytes, target_rate_hz: int, max_frames: int) -> tuple[int, int] | None:
    """``(offset of the samples, frames)`` of a WAV in the layout of :func:`plain_pcm16_wav`, else None."""
    size_all = len(data)
    if (size_all < 46 or data[0:4] != b"RIFF" or data[8:16] != b"WAVE" + b"fmt "
            or struct.unpack_from("<I", data, 4)[0] != size_all - 8):
        return None
    (fmt_size,) = struct.unpack_from("<I", data, 16)
    if fmt_size not in (16, 18):
        return None
    if struct.unpack_from("<HHIIHH", data, 20) != (1, 1, target_rate_hz, 2 * target_rate_hz, 2, 16):
        return None
    data_header = 20 + fmt_size
    if size_all < data_header + 8 or data[data_header:data_header + 4] != b"data":
        return None
    (size,) = struct.unpack_from("<I", data, data_header + 4)
    if size % 2 or not 0 < size // 2 <= max_frames or data_header + 8 + size != size_all:
        return None
    return data_header + 8, size // 2


def plain_pcm16_wav(data: bytes, target_rate_hz: int, max_frames: int) -> bool:
    """Whether ``data`` is a WAV whose samples need no decoding at ``target_rate_hz``, in the one layout
    read without libsndfile (:func:`read_pcm16_as_is`): ``RIFF`` with a size field of exactly the file's
    length - 8, ``WAVE``, then a ``fmt `` chunk of 16 or 18 bytes stating integer PCM (tag 1), one
    channel, 16 bits, ``target_rate_hz`` (and the byte rate and block alignment that implies), then at
    once a ``data`` chunk of 1..``max_frames`` frames that ends exactly where the file ends. That is the
    layout soundfile, Python's ``wave`` and sox write.

    Any other chunk (``LIST``, ``fact``, ``PEAK``, ``acid``, ...) sends the file to libsndfile: libsndfile
    parses some of them and may then refuse the file or read it otherwise (an adversary's test found
    ``PEAK`` before ``fmt `` refused, short ``fact``/``smpl`` chunks refused, an ``acid`` chunk shifting
    the samples: ``tests/test_wav_read_as_is.py``), and only libsndfile's answer counts. A constant-time
    check of two chunk headers, whatever ``data`` holds. Layout source: the RIFF WAVE format
    (Microsoft/IBM, 1991).
    """
    return _plain_pcm16_layout(data, target_rate_hz, max_frames) is not None


def read_pcm16_as_is(data: bytes, target_rate_hz: int, max_seconds: float, max_frames: int,
                     admit: Callable[[AudioHeader], bool]) -> tuple[AudioHeader, np.ndarray | None] | None:
    """Read a WAV whose samples need no decoding (:func:`plain_pcm16_wav`): its header and its int16
    samples ``(n,)``, the same header checks (and messages) as :func:`read_header` and the same samples
    as :func:`decode` with ``keep_pcm16`` (tests/test_audio.py compares both with libsndfile). The layout
    check has read every field there is to read, so the samples are the ``data`` chunk itself: a
    read-only view of ``data``, no copy (microseconds, so that the caller may do it on its event loop).

    Args:
        max_frames: most frames a file read here may have.
        admit: called with the checked header before the samples are taken; False leaves them (the
            caller could not reserve their bytes).

    Returns:
        None when ``data`` is not such a file (decode it as usual, which also reports why it is bad);
        else ``(header, samples)``, samples None when ``admit`` said no.

    Raises:
        AudioError: a checked header refused (too long), as :func:`read_header` would.
    """
    layout = _plain_pcm16_layout(data, target_rate_hz, max_frames)
    if layout is None:
        return None
    offset, frames = layout
    header = _checked_stated(target_rate_hz, 1, frames, max_seconds, as_is=True)
    if not admit(header):
        return header, None
    return header, np.frombuffer(data, dtype="<i2", count=frames, offset=offset)


def sample_format(samples: np.ndarray) -> str:
    """:data:`S16LE` for int16 samples (from :func:`decode` with ``keep_pcm16``), else :data:`F32LE`."""
    return S16LE if samples.dtype == np.int16 else F32LE


def to_bytes(samples: np.ndarray) -> memoryview:
    """A byte view of ``(n,)`` samples for a Redis input key, in :func:`sample_format`'s format.

    No copy when ``samples`` already is contiguous little-endian float32 or
    int16 (what :func:`decode` returns): the view shares the array's memory,
    and redis-py writes it to the socket as it is. Inverse: :func:`from_bytes`.
    """
    dtype = "<i2" if sample_format(samples) == S16LE else "<f4"
    return np.ascontiguousarray(samples, dtype=dtype).data.cast("B")


def from_bytes(data: bytes | memoryview, fmt: str = F32LE) -> np.ndarray:
    """Inverse of :func:`to_bytes`: a writable float32 ``(n,)`` array (one copy of ``data``).

    ``fmt`` :data:`S16LE`: the int16 samples scaled by ``1 / PCM16_SCALE`` (exact: the same float32
    values :func:`decode` gives without ``keep_pcm16``).

    Raises:
        ValueError: an unknown ``fmt``.
    """
    if fmt == F32LE:
        return np.frombuffer(data, dtype="<f4").copy()
    if fmt == S16LE:
        out = np.frombuffer(data, dtype="<i2").astype(np.float32)
        out *= np.float32(1 / PCM16_SCALE)
        return out
    raise ValueError(f"unknown sample format {fmt!r}")


# -- speech output -----------------------------------------------------------------------------------

SPEECH_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
"""``response_format`` values of ``POST /v1/audio/speech`` (API.md); mp3 is OpenAI's default."""

# format -> (FFmpeg muxer, FFmpeg encoder, fixed output rate in Hz or None = the input's rate,
#            MIME type, bit rate in bit/s or None = lossless). Opus runs at 48 kHz only among the
#            rates a 22,050 Hz voice could map to. 64 kbit/s mono is transparent enough for speech
#            (libmp3lame's own default at 22,050 Hz is 32 kbit/s).
_CONTAINERS: dict[str, tuple[str, str, int | None, str, int | None]] = {
    "mp3": ("mp3", "libmp3lame", None, "audio/mpeg", 64000),
    "opus": ("ogg", "libopus", 48000, "audio/ogg", 48000),
    "aac": ("adts", "aac", None, "audio/aac", 64000),
    "flac": ("flac", "flac", None, "audio/flac", None),
    "wav": ("wav", "pcm_s16le", None, "audio/wav", None),
}


def speech_content_type(fmt: str) -> str:
    """The MIME type of a ``response_format`` (``pcm``: ``audio/pcm``, raw s16le)."""
    return "audio/pcm" if fmt == "pcm" else _CONTAINERS[fmt][3]


def speech_output_rate(fmt: str, sample_rate_hz: int) -> int:
    """The sample rate (Hz) a client decodes from ``fmt`` when the model produces ``sample_rate_hz``."""
    return (_CONTAINERS[fmt][2] if fmt != "pcm" else None) or sample_rate_hz


def wav_bytes(pcm: bytes, sample_rate_hz: int) -> bytes:
    """A whole WAV file (16-bit mono) of s16le ``pcm`` at ``sample_rate_hz``, written by soundfile
    into memory, so its RIFF and ``data`` sizes are the real ones (a :class:`SpeechEncoder` writes a
    streaming header with unknown sizes, as a response sent while it is made must).

    Raises:
        ValueError: ``pcm`` is not a whole number of 2-byte samples.
    """
    if len(pcm) % 2:
        raise ValueError("s16le PCM has an even number of bytes")
    out = io.BytesIO()
    soundfile.write(out, np.frombuffer(pcm, dtype="<i2"), sample_rate_hz, format="WAV", subtype="PCM_16")
    return out.getvalue()


class _Sink:
    """A write-only, non-seekable byte sink for PyAV: muxers then write streaming headers
    (no length fields patched at the end), so every byte can be sent as soon as it exists."""

    def __init__(self) -> None:
        self._parts: list[bytes] = []

    def write(self, data) -> int:
        self._parts.append(bytes(data))
        return len(data)

    def take(self) -> bytes:
        out = b"".join(self._parts)
        self._parts.clear()
        return out


class SpeechEncoder:
    """Incremental encoder of 16-bit mono PCM into a ``response_format`` with PyAV (bundled FFmpeg).

    ``encode(pcm)`` returns the bytes ready so far (possibly empty: encoders
    buffer whole frames); ``finish()`` flushes and returns the rest. The
    concatenation of all returned bytes is one playable file/stream. ``pcm``
    passes the bytes through unchanged (raw s16le at the model's rate).

    Streamed (the default), the muxer writes to a non-seekable sink, so a
    header written before the audio exists says "length unknown" (FLAC's
    STREAMINFO: 0 total samples, which libsndfile cannot read past its first
    block; WAV: sizes 0xFFFFFFFF, which it reads). With ``whole``, ``encode``
    returns nothing and ``finish`` returns the whole file, its header
    completed by the muxer at the end (FLAC: total samples, min/max frame
    sizes and the MD5 of the audio), from a seekable buffer holding the
    encoded bytes until then.

    Args:
        fmt: one of :data:`SPEECH_FORMATS`.
        sample_rate_hz: rate of the PCM given to ``encode`` (the model's, e.g. 22,050).
        whole: encode the whole file before returning any byte (above).

    Raises:
        KeyError: an unknown ``fmt`` (callers validate it first).
    """

    def __init__(self, fmt: str, sample_rate_hz: int, whole: bool = False):
        self.fmt = fmt
        self.sample_rate_hz = sample_rate_hz
        self.whole = whole
        if fmt == "pcm":
            return
        import av  # PyAV: imported only by processes that encode

        muxer, codec, rate, _mime, bit_rate = _CONTAINERS[fmt]
        self._av = av
        self._sink: _Sink | io.BytesIO = io.BytesIO() if whole else _Sink()
        # bitexact: no random Ogg serial number or encoder version tag, so equal audio gives equal bytes
        self._container = av.open(self._sink, mode="w", format=muxer, options={"fflags": "+bitexact"})
        stream: Any = self._container.add_stream(codec, rate=rate or sample_rate_hz, layout="mono")
        if bit_rate:
            stream.bit_rate = bit_rate
        self._stream = stream
        self._resampler = av.AudioResampler(format=stream.codec_context.format, layout="mono",
                                            rate=rate or sample_rate_hz)
        self._pts = 0

    def _mux(self, frame) -> None:
        for out in self._resampler.resample(frame):
            for packet in self._stream.encode(out):
                self._container.mux(packet)

    def encode(self, pcm: bytes) -> bytes:
        """Encode a block of s16le mono samples; returns the encoded bytes available now."""
        if self.fmt == "pcm":
            return pcm
        samples = np.frombuffer(pcm, dtype="<i2")
        if samples.size == 0:
            return b""
        frame = self._av.AudioFrame.from_ndarray(samples.reshape(1, -1), format="s16", layout="mono")
        frame.sample_rate = self.sample_rate_hz
        frame.pts = self._pts
        self._pts += samples.size
        self._mux(frame)
        return self._taken()

    def _taken(self) -> bytes:
        return b"" if isinstance(self._sink, io.BytesIO) else self._sink.take()

    def finish(self) -> bytes:
        """Flush the encoder and close the container; returns the last bytes."""
        if self.fmt == "pcm":
            return b""
        self._mux(None)
        for packet in self._stream.encode(None):
            self._container.mux(packet)
        self._container.close()
        if isinstance(self._sink, io.BytesIO):
            return self._sink.getvalue()
        return self._sink.take()
