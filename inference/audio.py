"""Audio input: decode with ``soundfile`` (libsndfile: WAV, FLAC, OGG/Vorbis/Opus,
MP3), mix to mono, resample with ``soxr`` to the model's rate.

All functions raise :class:`AudioError` subclasses, which the web side maps to
400 (empty/implausible) or 415 (undecodable); nothing here knows HTTP.
"""
from __future__ import annotations

import io

import numpy as np
import soundfile
import soxr

MIN_SAMPLE_RATE_HZ = 1000  # below this no real recording exists; a header claiming it is corrupt
MAX_SAMPLE_RATE_HZ = 384000  # highest rate of common audio interfaces


class AudioError(ValueError):
    """Base of audio input errors."""


class EmptyAudio(AudioError):
    """Zero bytes, or a valid container holding zero frames."""


class UndecodableAudio(AudioError):
    """Not a container/codec libsndfile can read (random bytes, truncated header)."""


class ImplausibleAudio(AudioError):
    """Decodes, but its parameters cannot be real (sample rate out of range, NaN samples)."""


def decode(data: bytes, target_rate_hz: int) -> tuple[np.ndarray, int]:
    """Decode an audio file in memory to mono float32 at ``target_rate_hz``.

    Args:
        data: the file's bytes.
        target_rate_hz: the model's sample rate.

    Returns:
        ``(samples, source_rate_hz)``: float32 ``(n,)`` in about [-1, 1] at
        ``target_rate_hz``, and the file's own rate.

    Raises:
        EmptyAudio: no bytes, or no frames.
        UndecodableAudio: libsndfile cannot open or read it.
        ImplausibleAudio: sample rate outside 1 kHz..384 kHz, or non-finite samples.
    """
    if not data:
        raise EmptyAudio("the audio file is empty (0 bytes)")
    try:
        with soundfile.SoundFile(io.BytesIO(data)) as handle:
            rate = int(handle.samplerate)
            if not MIN_SAMPLE_RATE_HZ <= rate <= MAX_SAMPLE_RATE_HZ:
                raise ImplausibleAudio(
                    f"sample rate {rate} Hz is outside the plausible range "
                    f"{MIN_SAMPLE_RATE_HZ}..{MAX_SAMPLE_RATE_HZ} Hz"
                )
            frames = handle.read(dtype="float32", always_2d=True)
    except AudioError:
        raise
    except (soundfile.LibsndfileError, RuntimeError, ValueError, TypeError) as exc:
        reason = getattr(exc, "error_string", None) or str(exc)
        raise UndecodableAudio(
            f"cannot decode the audio ({reason.strip().rstrip('.')}); send WAV, FLAC, OGG (Vorbis/Opus) or MP3"
        ) from exc
    if frames.shape[0] == 0:
        raise EmptyAudio("the audio file holds no samples")
    if not np.isfinite(frames).all():
        raise ImplausibleAudio("the audio holds non-finite samples (NaN or infinity)")
    mono = frames.mean(axis=1, dtype=np.float32) if frames.shape[1] > 1 else frames[:, 0]
    return resample(mono, rate, target_rate_hz), rate


def resample(samples: np.ndarray, source_rate_hz: int, target_rate_hz: int) -> np.ndarray:
    """Resample float32 ``(n,)`` with soxr (VHQ); returns contiguous float32 ``(m,)``."""
    if source_rate_hz == target_rate_hz:
        return np.ascontiguousarray(samples, dtype=np.float32)
    out = soxr.resample(samples, source_rate_hz, target_rate_hz, quality="VHQ")
    return np.ascontiguousarray(out, dtype=np.float32)


def to_bytes(samples: np.ndarray) -> bytes:
    """Serialise float32 ``(n,)`` for a Redis input key (raw little-endian float32)."""
    return np.ascontiguousarray(samples, dtype="<f4").tobytes()


def from_bytes(data: bytes) -> np.ndarray:
    """Inverse of :func:`to_bytes`."""
    return np.frombuffer(data, dtype="<f4").copy()
