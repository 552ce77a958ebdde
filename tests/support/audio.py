"""Audio the tests send and read back: the speech fixtures of ``samples/``, WAV/FLAC files built with
soundfile or byte by byte (for layouts no encoder writes), and speech responses decoded by a library
other than their encoder.
"""
from __future__ import annotations

import io
import struct
from collections.abc import Iterable
from dataclasses import dataclass

import numpy as np
import soundfile

from inference import specs
from inference.adapters import get_adapter
from inference.adapters.base import LoadContext

from .processes import ROOT


FIXTURES = ROOT / "samples"
"""The speech the suite uses: two LibriSpeech utterances with their reference transcripts, in the repo
(``samples/README.md``: source and licence), so a clone tests with nothing beside it."""

# -- audio ---------------------------------------------------------------------------------------
@dataclass(frozen=True)
class Utterance:
    """A fixture file: ``wav`` bytes, mono float32 ``samples`` at ``rate`` Hz, reference ``text``."""

    name: str
    wav: bytes
    samples: np.ndarray
    rate: int
    text: str


def load_speech() -> list[Utterance]:
    items = []
    for wav in sorted(FIXTURES.glob("*.wav")):
        data = wav.read_bytes()
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32")
        items.append(Utterance(wav.stem, data, samples, rate, wav.with_suffix(".txt").read_text().strip()))
    return items


def wav_bytes(samples: np.ndarray, rate: int, fmt: str = "WAV", subtype: str | None = None) -> bytes:
    """Encode float32 samples with soundfile."""
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format=fmt, subtype=subtype)
    return buf.getvalue()


def wav_fmt(rate: int = 16000, channels: int = 1, bits: int = 16, tag: int = 1, extra: bytes = b"") -> bytes:
    """The body of a WAVE ``fmt `` chunk (16 bytes: format ``tag``, 1 = integer PCM; ``channels``; ``rate``
    in Hz; byte rate and block align derived from them and ``bits``), then ``extra`` (cbSize and beyond)."""
    align = channels * bits // 8
    return struct.pack("<HHIIHH", tag, channels, rate, rate * align, align, bits) + extra


def riff_wave(*chunks: tuple[bytes, bytes], declared: dict[bytes, int] | None = None,
              riff_size: int | None = None, pad_last: bool = True) -> bytes:
    """A RIFF/WAVE file of ``(chunk id, body)`` chunks in the order given, each padded to an even size
    (the last one only with ``pad_last``: without, an odd last chunk ends the file unpadded).

    ``declared`` maps a chunk id to the size its header states instead of its real size; ``riff_size``
    is the RIFF header's size field (default: the real one). Built byte by byte, so tests can write
    the layouts no encoder writes (a chunk before ``fmt ``, lying sizes, 8,000 empty chunks)."""
    out = b""
    for index, (chunk_id, chunk_body) in enumerate(chunks):
        size = (declared or {}).get(chunk_id, len(chunk_body))
        pad = len(chunk_body) % 2 and (pad_last or index < len(chunks) - 1)
        out += chunk_id + size.to_bytes(4, "little") + chunk_body + (b"\0" if pad else b"")
    return b"RIFF" + (len(out) + 4 if riff_size is None else riff_size).to_bytes(4, "little") + b"WAVE" + out


def pcm_wav(pcm: bytes, rate: int = 16000, channels: int = 1, bits: int = 16, tag: int = 1,
            claim: int | None = None, between: Iterable[tuple[bytes, bytes]] = (), fmt_extra: bytes = b"") -> bytes:
    """A RIFF/WAVE of ``fmt `` (:func:`wav_fmt`, then ``fmt_extra``), the ``between`` chunks, then ``data``
    holding ``pcm`` (raw sample bytes; odd-sized, it ends the file unpadded) whose size field says ``claim``
    (default: its real size). With the defaults the canonical 44-byte-header layout the server reads as-is
    (``inference.audio.plain_pcm16_wav``)."""
    declared = {} if claim is None else {b"data": claim}
    return riff_wave((b"fmt ", wav_fmt(rate, channels, bits, tag, fmt_extra)), *between, (b"data", pcm),
                     declared=declared, pad_last=False)



def adapter_session(family: str):
    """Slot 0's session of ``family``'s packaged checkpoint, loaded in this process on the CPU with one
    thread and default options (for comparing the server's answers with a direct adapter call)."""
    ctx = LoadContext(specs.resolve_checkpoint(family, None), "cpu", 0, 1, {}, {})
    adapter = get_adapter(family)
    return adapter.new_session(adapter.load(specs.get_spec(family), ctx), 0)



def padded(utt: Utterance, seconds: float = 1.5) -> np.ndarray:
    """The utterance with ``seconds`` of digital silence before and after."""
    pad = np.zeros(int(seconds * utt.rate), dtype=np.float32)
    return np.concatenate([pad, utt.samples, pad])


def long_speech(speech: list[Utterance], seconds: float) -> bytes:
    """A WAV of the fixtures repeated to about ``seconds`` (a slow Whisper request)."""
    parts, total = [], 0.0
    while total < seconds:
        for utt in speech:
            parts.append(utt.samples)
            total += len(utt.samples) / utt.rate
    return wav_bytes(np.concatenate(parts), speech[0].rate)


TINY = wav_bytes(np.zeros(1600, dtype=np.float32), 16000)


def silent_flac(seconds: float, rate: int = 16000, channels: int = 1) -> bytes:
    """A 16-bit FLAC of ``round(seconds * rate)`` frames of digital silence (compresses to almost nothing:
    30 min of 16 kHz mono is 89 KB), written in 10 s pieces so no long array is ever built."""
    buf = io.BytesIO()
    piece = np.zeros((rate * 10, channels), dtype=np.float32)
    left = round(seconds * rate)
    with soundfile.SoundFile(buf, "w", rate, channels, format="FLAC", subtype="PCM_16") as out:
        while left > 0:
            out.write(piece[:left])
            left -= min(left, len(piece))
    return buf.getvalue()


def flac_without_length(flac: bytes) -> bytes:
    """``flac`` with STREAMINFO's total samples set to 0, "unknown" (FLAC format specification: the 36 bits
    after the rate, channels and bits per sample, bytes 21-25 of a file starting with ``fLaC`` and its
    STREAMINFO block), as a streaming encoder writes it; everything else unchanged."""
    data = bytearray(flac)
    assert data[:4] == b"fLaC" and data[4] & 0x7F == 0, "fLaC then a STREAMINFO block"
    data[21] &= 0xF0
    data[22:26] = bytes(4)
    return bytes(data)



# -- speech output -------------------------------------------------------------------------------
def words(text: str) -> str:
    """Lower-case words without punctuation, for WER."""
    return " ".join("".join(ch for ch in text.lower() if ch.isalnum() or ch.isspace() or ch == "'").split())


@dataclass(frozen=True)
class Decoded:
    """Decoded speech: float32 mono ``samples`` at ``rate`` Hz, ``channels`` as the file says, and the decoder."""

    samples: np.ndarray
    rate: int
    channels: int
    decoder: str


def decode_speech(data: bytes, fmt: str, pcm_rate: int = 22050) -> Decoded:
    """Decode a speech response with a library other than its encoder (PyAV's FFmpeg) where one exists.

    mp3, opus (Ogg), wav: libsndfile (``soundfile``). flac (libsndfile reads it too, its length stated:
    tests/test_speech_flac_reads_back.py) and aac (which libsndfile does not read at all) go through
    PyAV, and the flac test compares the result sample by sample with the raw pcm response. pcm: raw
    s16le at ``pcm_rate``.
    """
    if fmt == "pcm":
        return Decoded(np.frombuffer(data, "<i2").astype(np.float32) / 32768, pcm_rate, 1, "numpy")
    if fmt in ("mp3", "opus", "wav"):
        samples, rate = soundfile.read(io.BytesIO(data), dtype="float32", always_2d=True)
        return Decoded(samples[:, 0], rate, samples.shape[1], "libsndfile")
    import av

    parts, rate, channels = [], 0, 0
    with av.open(io.BytesIO(data)) as container:
        for frame in container.decode(audio=0):
            rate, channels = frame.sample_rate, frame.layout.nb_channels
            array = frame.to_ndarray()
            planar = frame.format.is_planar
            parts.append(array.reshape(channels, -1)[0] if planar else array.reshape(-1, channels)[:, 0])
    samples = np.concatenate(parts).astype(np.float32)
    if np.issubdtype(parts[0].dtype, np.integer):
        samples /= 32768
    return Decoded(samples, rate, channels, "pyav")


