"""Decoding uploads in the web process: where it runs, and how many decoded bytes it may hold at once.

**Two pools.** Decoding is CPU work in libsndfile and soxr, so it runs in
threads of its own, never on the event loop and never in the threads that
send Celery tasks or big Redis values (``inference.runtime.loads``, ``inference.runtime.runs``):

- the *quick* pool (``QUICK_THREADS`` threads) reads headers and decodes
  inputs of at most ``QUICK_DECODE_MAX_SAMPLES`` source samples (frames x
  channels: 65 s of 16 kHz mono, 2.7 s of 384 kHz mono; at most about
  0.2 s of work, Opus being the slowest codec measured);
- the *bulk* pool (``BULK_THREADS``, ``max(2, CPUs)`` threads) decodes
  everything larger.

A few huge uploads (30 min at 384 kHz takes seconds to resample) therefore
occupy the bulk pool only: a short request to any model still finds a quick
thread, instead of waiting behind them. Headers are not read
on the loop in general: a typical header takes 0.07 ms, but a crafted WAV of
8,000 empty chunks (67 KB) keeps libsndfile walking it, through soundfile's
Python I/O callbacks, for about 30 ms.

**A FLAC that does not state its length** (STREAMINFO's total samples 0,
what a streaming encoder writes) has no length to check before decoding, so
its header read counts its frames: a pass over the whole stream with PyAV's
demuxer (``inference.audio.count_flac_frames``, stopped as soon as the count
passes ``max_audio_seconds``: 413, nothing decoded). That pass grows with the
upload, not with a header, so it runs in the bulk pool (the quick pool's read
stops at :class:`inference.audio.LengthNotStated`), and so does its decode,
which reserves the exact counted length like any other and returns at most
that many frames.

**No decoding, no hop.** One kind of upload needs no decoding at all: a WAV
of 16-bit PCM, mono, already at the model's rate (the shipped samples, most
recorders' output), whose samples are sent to the worker as they are. Such a
file, laid out canonically (``inference.audio.plain_pcm16_wav``: ``fmt `` then
``data`` and nothing else, the sizes exact, at most
``QUICK_DECODE_MAX_SAMPLES`` frames), is read on the event loop by
:func:`read_header`, :func:`inspect_and_decode` and :func:`decode`
themselves (a check of two chunk headers, then a view of the ``data``
chunk: microseconds), against about 0.7 ms for the round trip through a
pool thread on a 2-core VM (two thread wake-ups; ``docs/benchmarks.md``).
Every file that needs decoding, mixing or resampling, and every other
layout, goes to the pools as above.

**The budget.** Every decode first reserves its peak
(:func:`inference.audio.decode_peak_bytes`, from the header) plus the copies
made sending its samples (:func:`decoded_bytes_needed`) in the process's
:class:`DecodeBudget` (``max_decoded_bytes_in_flight``); a decode that does
not fit is refused (503 ``decode_budget``, see ``inference.services.audio_input``) rather
than allowed to grow the process. A WAV that needs no decoding reserves only
the copies its 16-bit samples take while they are sent (its samples are a
view of the upload, which is not counted). The reservation is given back once the
samples are in Redis (``inference.runtime.runs.RunInput.release_samples``) or
when the request ends without that (error, refusal, client gone).
"""
from __future__ import annotations

import asyncio
import os
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass

import numpy as np

from audiosite.serverconfig import get_config
from inference import audio

from .runs import send_copies_bytes

QUICK_THREADS = 2
BULK_THREADS = max(2, os.cpu_count() or 1)
QUICK_DECODE_MAX_SAMPLES = 1 << 20

_QUICK_POOL = ThreadPoolExecutor(max_workers=QUICK_THREADS, thread_name_prefix="decode-quick")
_BULK_POOL = ThreadPoolExecutor(max_workers=BULK_THREADS, thread_name_prefix="decode-bulk")


class Reservation:
    """``nbytes`` of a :class:`DecodeBudget`, held until :meth:`release` (idempotent, any thread)."""

    def __init__(self, budget: DecodeBudget, nbytes: int):
        self.budget = budget
        self.nbytes = nbytes
        self._held = True

    def release(self) -> None:
        """Give the bytes back (a second call does nothing)."""
        with self.budget.lock:
            if self._held:
                self._held = False
                self.budget.in_flight_bytes -= self.nbytes


class DecodeBudget:
    """Bytes of decoded audio one web process may hold at once: at most ``limit_bytes`` (0 = no limit).

    A reservation is taken before a decode starts and given back once its
    samples are in Redis, or on any error or cancellation, so
    ``in_flight_bytes`` counts decodes queued in a pool, running, and
    decoded samples not yet handed over.

    Thread safety: reservations are taken on the event loop and, for an eager
    decode (:func:`inspect_and_decode`), in a quick-pool thread, and given back
    on either; ``lock`` makes each check-and-update one step.
    """

    def __init__(self, limit_bytes: int):
        self.limit_bytes = limit_bytes
        self.in_flight_bytes = 0
        self.lock = threading.Lock()

    def fits_alone(self, nbytes: int) -> bool:
        """Whether a decode of ``nbytes`` could ever be admitted (it fits in the empty budget)."""
        return not self.limit_bytes or nbytes <= self.limit_bytes

    def reserve(self, nbytes: int) -> Reservation | None:
        """Reserve ``nbytes``, or return None when they do not fit beside what is in flight now."""
        with self.lock:
            if self.limit_bytes and self.in_flight_bytes + nbytes > self.limit_bytes:
                return None
            self.in_flight_bytes += nbytes
        return Reservation(self, nbytes)


def decoded_bytes_needed(header: audio.AudioHeader, target_rate_hz: int) -> int:
    """Bytes a request with this audio header reserves in the decode budget: the decode's peak
    (:func:`inference.audio.decode_peak_bytes`) plus the copies made sending its samples to Redis
    (:func:`inference.runtime.runs.send_copies_bytes`; none for large inputs).

    A WAV read as-is (``header.as_is``, module doc) decodes nothing: its samples are a view of the
    upload, which no request counts (it is bounded by ``max_request_body_bytes``), so it reserves only
    the send copies of its 16-bit samples (8 s at 16 kHz: 0.5 MB instead of 2.9 MB).
    """
    if header.as_is:
        return send_copies_bytes(header.frames * audio.INT16_BYTES)
    output_bytes = audio.output_frames_bound(header.frames, header.sample_rate_hz, target_rate_hz) * audio.FLOAT32_BYTES
    return audio.decode_peak_bytes(header, target_rate_hz) + send_copies_bytes(output_bytes)


_budget: DecodeBudget | None = None
_budget_made = threading.Lock()


def budget() -> DecodeBudget:
    """This process's budget (``max_decoded_bytes_in_flight`` of the server configuration): one object,
    also when its first callers are two decode threads at once (an eager decode reserves from one)."""
    global _budget
    if _budget is None:
        with _budget_made:
            if _budget is None:
                _budget = DecodeBudget(get_config().max_decoded_bytes_in_flight)
    return _budget


async def read_header(data: bytes, target_rate_hz: int, max_seconds: float) -> audio.AudioHeader:
    """:func:`inference.audio.read_header`, in the quick pool; on the event loop for a WAV that needs no
    decoding at ``target_rate_hz`` (module doc).

    Raises:
        inference.audio.AudioError: see :func:`inference.audio.read_header`.
    """
    found = audio.read_pcm16_as_is(data, target_rate_hz, max_seconds, QUICK_DECODE_MAX_SAMPLES, _leave)
    if found is not None:
        return found[0]
    try:
        return await asyncio.get_running_loop().run_in_executor(_QUICK_POOL, audio.read_header, data, max_seconds,
                                                                False)
    except audio.LengthNotStated:
        return await _counted_header(data, max_seconds)


async def _counted_header(data: bytes, max_seconds: float) -> audio.AudioHeader:
    """:func:`inference.audio.read_header` counting the frames of a FLAC that does not state its length, in
    the bulk pool (module doc); a cancelled caller stops the count at its next packet."""
    cancel = threading.Event()
    try:
        return await asyncio.get_running_loop().run_in_executor(_BULK_POOL, audio.read_header, data, max_seconds,
                                                                True, cancel)
    except asyncio.CancelledError:
        cancel.set()
        raise


def _leave(header: audio.AudioHeader) -> bool:
    return False


def _take(header: audio.AudioHeader) -> bool:
    return True


def _as_is(data: bytes, target_rate_hz: int, max_seconds: float) -> Inspected | None:
    """:func:`inspect_and_decode` on the event loop for a WAV that needs no decoding (module doc), else None;
    its samples are taken only when :func:`decoded_bytes_needed` fits in the budget now (then reserved)."""
    reserved: list[Reservation] = []

    def admit(header: audio.AudioHeader) -> bool:
        spent = budget()
        needed_bytes = decoded_bytes_needed(header, target_rate_hz)
        reservation = spent.reserve(needed_bytes) if spent.fits_alone(needed_bytes) else None
        if reservation is not None:
            reserved.append(reservation)
        return reservation is not None

    found = audio.read_pcm16_as_is(data, target_rate_hz, max_seconds, QUICK_DECODE_MAX_SAMPLES, admit)
    if found is None:
        return None
    header, samples = found
    return Inspected(header) if samples is None else Inspected(header, samples, reserved[0])


@dataclass(frozen=True)
class Inspected:
    """What :func:`inspect_and_decode` found: the upload's ``header`` and, when it decoded it at once,
    the ``samples`` (as :func:`decode` returns them) with the budget ``reservation`` they hold."""

    header: audio.AudioHeader
    samples: np.ndarray | None = None
    reservation: Reservation | None = None


def _inspect_and_decode(data: bytes, target_rate_hz: int, max_seconds: float, cancel: threading.Event) -> Inspected:
    header = audio.read_header(data, max_seconds, False)
    if header.frames * header.channels > QUICK_DECODE_MAX_SAMPLES:
        return Inspected(header)
    needed_bytes = decoded_bytes_needed(header, target_rate_hz)
    spent = budget()
    if not spent.fits_alone(needed_bytes):
        return Inspected(header)
    reservation = spent.reserve(needed_bytes)
    if reservation is None:
        return Inspected(header)
    try:
        samples, _source_rate_hz = audio.decode(data, target_rate_hz, max_seconds, cancel, True)
    except BaseException:
        reservation.release()
        raise
    return Inspected(header, samples, reservation)


async def inspect_and_decode(data: bytes, target_rate_hz: int, max_seconds: float) -> Inspected:
    """Read the header of ``data`` and, when it is small, decode it too: one quick-pool hop instead of
    :func:`read_header` now and :func:`decode` after the grant (for a request that will most likely be
    granted at once: ``admission_probe.lua``'s ``free``); no hop at all for a WAV that needs no decoding
    (module doc).

    Decodes only inputs of at most ``QUICK_DECODE_MAX_SAMPLES`` source samples whose
    :func:`decoded_bytes_needed` fits in the budget now (reserved before decoding, as :func:`decode`'s
    caller does); otherwise returns the header alone and the caller decodes later as usual. A
    cancelled caller stops the decoder at its next block, and samples decoded for a caller that
    is gone give their reservation back.

    Raises:
        inference.audio.AudioError: see :func:`inference.audio.read_header` and :func:`inference.audio.decode`.
    """
    inspected = _as_is(data, target_rate_hz, max_seconds)
    if inspected is not None:
        return inspected
    cancel = threading.Event()
    future = _QUICK_POOL.submit(_inspect_and_decode, data, target_rate_hz, max_seconds, cancel)
    try:
        return await asyncio.wrap_future(future)
    except asyncio.CancelledError:
        cancel.set()
        future.add_done_callback(_release_abandoned)
        raise
    except audio.LengthNotStated:  # counted in the bulk pool, decoded after the grant (module doc)
        return Inspected(await _counted_header(data, max_seconds))


def _release_abandoned(future: Future) -> None:
    """Done callback of an eager decode whose caller left: give back what it reserved, if anything."""
    if not future.cancelled() and future.exception() is None:
        reservation = future.result().reservation
        if reservation is not None:
            reservation.release()


async def decode(data: bytes, header: audio.AudioHeader, target_rate_hz: int, max_seconds: float) -> np.ndarray:
    """Decode ``data`` (whose header is ``header``) to mono ``(n,)`` at ``target_rate_hz``, in the quick
    pool when it is small, else (and for a FLAC whose length was counted: module doc) in the bulk pool.
    The caller holds the reservation.

    The samples are float32, or int16 where that is exact (mono 16-bit PCM at the target rate,
    :func:`inference.audio.decode`'s ``keep_pcm16``): half the bytes to send to the worker, which
    reads them back as the same float32 values (:func:`inference.audio.from_bytes`). A WAV that needs
    no decoding (module doc) is taken on the event loop: a view of its ``data`` chunk.

    A cancelled caller (client gone) stops the decoder at its next block.

    Raises:
        inference.audio.AudioError: see :func:`inference.audio.decode`.
    """
    found = audio.read_pcm16_as_is(data, target_rate_hz, max_seconds, QUICK_DECODE_MAX_SAMPLES, _take)
    if found is not None and found[1] is not None:
        return found[1]
    quick = header.frames * header.channels <= QUICK_DECODE_MAX_SAMPLES and not header.counted
    pool = _QUICK_POOL if quick else _BULK_POOL
    cancel = threading.Event()
    try:
        samples, _source_rate_hz = await asyncio.get_running_loop().run_in_executor(
            pool, audio.decode, data, target_rate_hz, max_seconds, cancel, True, header)
    except asyncio.CancelledError:
        cancel.set()
        raise
    return samples
