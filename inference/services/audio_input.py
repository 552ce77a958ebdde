"""Audio input of a request: check an upload's header before it queues, decode it within the decode budget.

A request's audio is inspected before any ticket exists (a bad header, too long, or a decode larger
than the whole decode budget: 400/413/415) and decoded once it holds its slot (or, on the short path,
with its header when it will most likely be granted at once). The decode reserves its bytes in this
process's budget (``inference.runtime.decoding``; 503 ``decode_budget`` past it) until its samples are
in Redis. Every function takes the model family's ``spec`` (``inference.specs.require_spec``), looked
up once per request by its caller.
"""
from __future__ import annotations

import logging
from dataclasses import dataclass

from audiosite.errors import DecodeBudgetFull, InvalidRequest, PayloadTooLarge, UnsupportedMedia
from audiosite.serverconfig import get_config
from inference import audio
from inference.runtime import decoding, runs
from inference.runtime.decoding import decoded_bytes_needed

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class AudioInput:
    """An audio file as uploaded (``data``: its bytes, any container ``inference.audio`` reads) and
    ``param``, the request field it came from (named by decoding errors)."""

    data: bytes
    param: str


def _audio_refusal(exc: audio.AudioError, param: str) -> InvalidRequest:
    """The client error for audio that cannot be served: 415 undecodable, 413 too long, else 400."""
    if isinstance(exc, audio.UndecodableAudio):
        return UnsupportedMedia(str(exc), param=param)
    if isinstance(exc, audio.AudioTooLong):
        return PayloadTooLarge(str(exc), param=param)
    return InvalidRequest(str(exc), param=param)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


async def audio_inspect(audio_input: AudioInput, spec: dict) -> audio.AudioHeader:
    """Check an upload's container header before the request queues; decode nothing (the header is read
    in the quick pool, or on the event loop for a WAV that needs no decoding: ``decoding.read_header``).

    A request whose audio could never be served is refused here, holding no
    ticket: bad header, too long, or a decode larger than the whole decode
    budget (it could never be admitted, so it is a 413, not a 503).

    Args:
        spec: the model family's spec (its ``sample_rate_hz`` is the rate the audio is decoded to).

    Raises:
        UnsupportedMedia: not a container/codec we read (415).
        PayloadTooLarge: stated length over ``max_audio_seconds``, or a decode
            needing more than ``max_decoded_bytes_in_flight`` (413).
        InvalidRequest: empty, no frames, implausible sample rate, more than 8 channels (400).
    """
    config = get_config()
    try:
        header = await decoding.read_header(audio_input.data, spec["sample_rate_hz"], config.max_audio_seconds)
    except audio.AudioError as exc:
        raise _audio_refusal(exc, audio_input.param) from None
    _check_decodable(header, spec["sample_rate_hz"], audio_input.param)
    return header


def _check_decodable(header: audio.AudioHeader, rate_hz: int, param: str) -> None:
    """Refuse (413) audio whose decode at ``rate_hz`` needs more than the whole decode budget (see
    :func:`audio_inspect`)."""
    needed_bytes = decoded_bytes_needed(header, rate_hz)
    budget = decoding.budget()
    if not budget.fits_alone(needed_bytes):
        raise PayloadTooLarge(
            f"decoding this audio ({header.duration_s:.0f} s, {header.channels} channel(s) at "
            f"{header.sample_rate_hz} Hz) needs about {_mib(needed_bytes)}, more than this server decodes at once "
            f"(max_decoded_bytes_in_flight = {_mib(budget.limit_bytes)}); send shorter audio",
            param=param)


async def audio_inspect_and_decode(audio_input: AudioInput, spec: dict,
                                   options: dict) -> tuple[audio.AudioHeader, runs.RunInput | None]:
    """:func:`audio_inspect` and, for small audio that fits in the decode budget now, :func:`audio_decode`
    too, in one pool hop (``inference.runtime.decoding.inspect_and_decode``; none for a WAV that needs no
    decoding): for a request that will most likely be granted at once. Returns the header and the run's
    input, or None when the audio is to be decoded after the grant as usual.

    Raises:
        UnsupportedMedia, PayloadTooLarge, InvalidRequest: as :func:`audio_inspect` and
            :func:`audio_decode` (no ticket is held yet).
    """
    rate = spec["sample_rate_hz"]
    try:
        inspected = await decoding.inspect_and_decode(audio_input.data, rate, get_config().max_audio_seconds)
    except audio.AudioError as exc:
        raise _audio_refusal(exc, audio_input.param) from None
    if inspected.samples is None or inspected.reservation is None:
        _check_decodable(inspected.header, rate, audio_input.param)
        return inspected.header, None
    return inspected.header, runs.RunInput(inspected.samples, rate, options, on_release=inspected.reservation.release)


async def audio_decode(audio_input: AudioInput, header: audio.AudioHeader, spec: dict,
                       options: dict) -> runs.RunInput:
    """Reserve the decode's bytes in this process's budget, decode ``audio_input`` to mono float32
    ``(n,)`` at the family's rate (``spec["sample_rate_hz"]``), and return it as a run's input.

    The reservation goes back when the samples are in Redis (see
    ``inference.runtime.runs.RunInput``), or here on any error or cancellation.

    Args:
        header: the upload's header, from :func:`audio_inspect`.

    Raises:
        ServerBusy: (code ``decode_budget``, ``Retry-After``) the decode does not fit beside the
            decoded audio this process holds now.
        UnsupportedMedia: the stream cannot be decoded (415).
        InvalidRequest: non-finite samples, or nothing left after resampling (400).
    """
    rate = spec["sample_rate_hz"]
    needed_bytes = decoded_bytes_needed(header, rate)
    budget = decoding.budget()
    reservation = budget.reserve(needed_bytes)
    if reservation is None:
        log.info("decode budget: refused %d bytes, %d of %d in flight", needed_bytes, budget.in_flight_bytes,
                 budget.limit_bytes)
        raise DecodeBudgetFull(
            f"this server process is busy decoding other audio: {_mib(budget.in_flight_bytes)} of decoded audio in "
            f"flight, this request needs {_mib(needed_bytes)} more, and at most {_mib(budget.limit_bytes)} may be "
            "in flight (max_decoded_bytes_in_flight); retry", retry_after_s=1)
    try:
        samples = await decoding.decode(audio_input.data, header, rate, get_config().max_audio_seconds)
    except audio.AudioError as exc:
        reservation.release()
        raise _audio_refusal(exc, audio_input.param) from None
    except BaseException:
        reservation.release()
        raise
    return runs.RunInput(samples, rate, options, on_release=reservation.release)
