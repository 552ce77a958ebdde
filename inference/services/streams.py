"""Streams: admitted requests whose output a worker streams back frame by frame (speech synthesis, and
transcription with ``stream=true``); each holds its lease until its last byte is written or its client
leaves (R8.3)."""
from __future__ import annotations

import json
import logging

import redis.exceptions

from audiosite.errors import ApplicationError, Conflict, InvalidRequest, NotFound, WorkerLost
from audiosite.serverconfig import get_config
from inference import specs
from inference.backend import resolve_backend
from inference.runtime import leases, published, runs, streams
from inference.runtime.context import AsyncContext
from inference.scheduler import Lease, LeaseKind, effective_timeout_ms

from .audio_input import AudioInput, audio_decode, audio_inspect
from .loading import model_ensure_loaded
from .request import RUN_FAILURE_BUSY, reply_error

log = logging.getLogger(__name__)


class _HeldStream:
    """An admitted request whose output a worker is streaming back, frame by frame.

    Holds the request's lease (renewed by a keep-alive) from its opening until
    :meth:`aclose`: the slot is busy until the last byte is written or the
    client leaves (R8.3).
    """

    def __init__(self, ctx: AsyncContext, model_id: str, lease: Lease, keep_alive, stream: streams.WorkerStream,
                 first: list[bytes], load_ms: float):
        self.ctx = ctx
        self.model_id = model_id
        self.lease = lease
        self._keep_alive = keep_alive
        self._stream = stream
        self._pending = first
        self.load_ms = load_ms
        self._closed = False

    @property
    def final(self) -> dict | None:
        """The worker's end frame (None until the run ended)."""
        return self._stream.final

    async def _frames(self):
        """Yield each frame (type byte removed) as the worker produces it.

        Raises:
            ServerBusy: the worker was lost mid-stream (``worker_lost``), the model's process ended
                (``model_crashed``) or the run passed its deadline (``run_deadline``).
            ApplicationError: the adapter failed mid-stream (a bug).
        """
        while self._pending:
            yield self._pending.pop(0)
        while self._stream.final is None:
            for frame in await self._stream.frames():
                yield frame
        final = self._stream.final
        if not final["ok"]:
            if final["kind"] in RUN_FAILURE_BUSY:  # the model's process ended, or the run passed its deadline
                raise RUN_FAILURE_BUSY[final["kind"]](f"model {self.model_id!r} stopped mid-stream: {final['message']}")
            raise ApplicationError(f"model {self.model_id!r} failed mid-stream: {final['message']}")

    async def aclose(self) -> None:
        """End the request: stop the worker after its current step if it is still going (the client
        left), then release the lease. Idempotent; finishes even if the caller is cancelled. Without
        Redis it logs a warning and returns (the lease is reclaimed ``lease_ttl_ms`` after its last
        renewal, R2.5): it runs as the response body ends, where an exception would cut that body short."""
        if self._closed:
            return
        self._closed = True
        try:
            await leases.run_to_completion(self._finish())
        except redis.exceptions.RedisError as exc:
            log.warning("ending a stream of %s without Redis (%s); its lease lapses after lease_ttl_ms",
                        self.model_id, exc)

    async def _finish(self) -> None:
        try:
            if self._stream.final is None:
                await self._stream.stop(self.ctx.scheduler.lease_ttl_ms / 1000)
            await self._stream.discard()
        finally:
            await self._keep_alive.__aexit__(None, None, None)
            await self.ctx.scheduler.release(self.model_id, self.lease.lease_id)


class SpeechStream(_HeldStream):
    """An admitted speech request whose audio is being synthesised on a worker (see :class:`_HeldStream`).

    Iterate :meth:`pcm` for s16le mono PCM blocks at ``sample_rate_hz`` (one
    per sentence), then read ``final`` (the worker's summary: ``sentences``,
    ``phonemes``, ``samples``, ``inference_ms``, ``slot``, ``stopped``).
    """

    sample_rate_hz: int

    async def pcm(self):
        """Yield s16le mono PCM ``bytes`` per sentence as the worker produces them.

        Raises:
            ServerBusy: the worker was lost mid-stream (``worker_lost``), the model's process ended
                (``model_crashed``) or the run passed its deadline (``run_deadline``).
            ApplicationError: the adapter failed mid-stream (a bug).
        """
        async for frame in self._frames():
            yield frame


class TranscriptionStream(_HeldStream):
    """An admitted transcription whose segments are being decoded on a worker (see :class:`_HeldStream`).

    Iterate :meth:`deltas` for the text each segment adds, as the worker
    decodes it; then ``final`` holds ``text`` (the whole transcript, equal to
    the concatenated deltas and to the non-streamed text), ``duration`` (s of
    audio), ``language``, ``segments``, ``inference_ms``, ``slot``. ``audio_ms``: the input's duration.
    """

    audio_ms: float

    async def deltas(self):
        """Yield ``str`` per decoded segment (empty segments skipped).

        Raises:
            ServerBusy: the worker was lost mid-stream (``worker_lost``), the model's process ended
                (``model_crashed``) or the run passed its deadline (``run_deadline``).
            ApplicationError: the adapter failed mid-stream (a bug).
        """
        async for frame in self._frames():
            delta = json.loads(frame)["delta"]
            if delta:
                yield delta


async def stream_lease_acquire(ctx: AsyncContext, meta: dict, timeout_ms: int) -> Lease:
    """Take a stream's slot of the published registration ``meta``: a lease of kind ``stream``, of which at
    most ``inference.specs.stream_slot_count`` (its slots, capped by the streaming mode's admitted count,
    R9.2) are held at once; the others wait in the model's FIFO under ``timeout_ms`` as usual.

    The modes are checked again once the lease is granted: a reconfiguration that removed ``streaming``
    while the stream waited refuses it then (the lease is given back first).

    Raises:
        InvalidRequest: the registration does not serve streams (its ``modes``; ``param`` ``model``).
        ServerBusy: admission timeout, fail-fast or an expired grant (R3.2–R3.4).
    """
    _require_streaming(meta)
    backend = resolve_backend(get_config().backend)  # cached after the first call
    cap = specs.stream_slot_count(meta["family"], meta["task"], int(meta.get("slots") or 1), backend)
    lease = await leases.acquire(ctx, meta["id"], timeout_ms, LeaseKind.STREAM, stream_cap=cap)
    try:
        current = await published.meta_get(ctx, meta["id"])
        if current is not None and current["family"] == meta["family"]:
            _require_streaming(current)  # a changed family is refused later, with the 409 of every request
    except BaseException:
        await leases.run_to_completion(ctx.scheduler.release(meta["id"], lease.lease_id))
        raise
    return lease


def _require_streaming(meta: dict) -> None:
    """Raise InvalidRequest (``param`` ``model``) unless the registration ``meta`` serves streams."""
    modes = specs.registration_modes(meta)
    if "streaming" not in modes:
        raise InvalidRequest(f"model {meta['id']!r} does not serve streams (its modes: {', '.join(modes)})",
                             param="model")


async def _stream_open(ctx: AsyncContext, meta: dict, timeout_ms: int, lease: Lease,
                       prepare, start) -> tuple[streams.WorkerStream, list[bytes], dict, float]:
    """Start a streamed run under ``lease`` (its keep-alive entered): check the model did not change
    while the request waited, ``await prepare(current_meta)`` (e.g. decode the input), load the model,
    ``await start(stream, lease_id)``, and wait for the first frame (or the refusal). A pool lost before the
    worker took the run is loaded once more. Returns ``(stream, first frames, current meta, load_ms)``.

    Raises:
        ServerBusy, ModelLoadFailed, NotFound, Conflict: as :func:`request_run`.
        InvalidRequest: the adapter refused the request (``param`` names the field).
        ApplicationError: the adapter failed on valid input (a bug).
    """
    model_id = meta["id"]
    current = await published.meta_get(ctx, model_id)
    if current is None:
        raise NotFound(f"model {model_id!r} was unregistered while the request waited", param="model")
    if (current["family"], current["task"]) != (meta["family"], meta["task"]):
        raise Conflict(f"model {model_id!r} was reconfigured to {current['family']}/{current['task']} "
                       "while the request waited; retry", param="model")
    await prepare(current)
    load_ms = 0.0
    for _attempt in range(2):
        left_ms = max(1, timeout_ms - int(lease.waited_ms)) if timeout_ms else 0
        placement = await model_ensure_loaded(ctx, model_id, room_timeout_ms=left_ms)
        load_ms += placement.load_ms
        stream = streams.WorkerStream(ctx, model_id, placement)
        try:
            await start(stream, lease.lease_id)
            first = await stream.frames()
        except BaseException:
            await _abandon(ctx, stream)
            raise
        final = stream.final
        if final is not None and not final["ok"] and final["kind"] == runs.RunFailure.NOT_LOADED:
            await stream.discard(keep_input=True)  # the next dispatch sends only a header for it
            await ctx.scheduler.mark_unloaded(model_id, placement.boot, "pool lost")
            continue
        break
    else:
        raise WorkerLost(f"model {model_id!r}: its pool was lost twice; retry later")
    if final is not None and not final["ok"]:
        await stream.discard()
        error = reply_error(model_id, final, "request")  # 400, 503 (expired, crashed, deadline...), else 500
        assert error is not None
        raise error
    return stream, first, current, load_ms


async def _abandon(ctx: AsyncContext, stream: streams.WorkerStream) -> None:
    """Stop a stream whose opening failed after its header may have been sent, and delete its keys."""
    async def stop() -> None:
        await stream.stop(ctx.scheduler.lease_ttl_ms / 1000)
        await stream.discard()
    await leases.run_to_completion(stop())


async def _opened(ctx: AsyncContext, meta: dict, request_timeout_ms: int | None, prepare, start, make):
    """Admit a streamed request (lease + keep-alive), open it with :func:`_stream_open`, and return
    ``make(lease, keep_alive, stream, first, current, load_ms)``; on any failure (or cancellation)
    the lease is given back before the error propagates."""
    model_id = meta["id"]
    timeout_ms = effective_timeout_ms(request_timeout_ms, published.ceiling_ms(meta))
    lease = await stream_lease_acquire(ctx, meta, timeout_ms)
    keep_alive = ctx.scheduler.keep_alive(model_id, lease.lease_id)
    await keep_alive.__aenter__()
    try:
        stream, first, current, load_ms = await _stream_open(ctx, meta, timeout_ms, lease, prepare, start)
        return make(lease, keep_alive, stream, first, current, load_ms)
    except BaseException:
        async def give_back() -> None:
            try:
                await keep_alive.__aexit__(None, None, None)
            finally:
                await ctx.scheduler.release(model_id, lease.lease_id)
        await leases.run_to_completion(give_back())
        raise


async def speech_open(ctx: AsyncContext, meta: dict, text: str, options: dict,
                      request_timeout_ms: int | None) -> SpeechStream:
    """Admit a speech request and start its synthesis; returns once its first sentence (or refusal) is there.

    Waiting for the first frame before answering means a request the model
    refuses (e.g. text without phonemes) still gets its 400 before any
    response header is sent.

    Args:
        meta: the published registration of a ``tts`` model.
        text: the input text (checked by the view: 1..4096 characters).
        options: validated request options (merged with defaults on the worker).

    Raises:
        ServerBusy, ModelLoadFailed, NotFound, Conflict: as :func:`request_run`.
        InvalidRequest: the adapter refused the request (``param`` names the field).
        ApplicationError: the adapter failed on valid input (a bug).
    """
    async def prepare(current: dict) -> None:
        return None

    async def start(stream: streams.WorkerStream, lease_id: str) -> None:
        await stream.start(lease_id, text, options)

    def make(lease, keep_alive, stream, first, current, load_ms) -> SpeechStream:
        opened = SpeechStream(ctx, meta["id"], lease, keep_alive, stream, first, load_ms)
        opened.sample_rate_hz = int(specs.require_spec(current["family"])["sample_rate_hz"])
        return opened

    return await _opened(ctx, meta, request_timeout_ms, prepare, start, make)


async def transcription_open(ctx: AsyncContext, meta: dict, audio_input: AudioInput, options: dict,
                             request_timeout_ms: int | None) -> TranscriptionStream:
    """Admit a transcription to be streamed segment by segment (``stream=true``); returns once its
    first segment (or the end, or a refusal) is there, so a refused request still gets its 4xx
    before any response header.

    The audio is inspected before the request queues and decoded once it holds
    its slot, as in :func:`request_run`; the samples go to the worker with the run's
    header, and each segment comes back as a frame as soon as it is decoded.

    Raises:
        UnsupportedMedia, PayloadTooLarge, InvalidRequest: the audio (see :func:`audio_inspect`, :func:`audio_decode`).
        ServerBusy, ModelLoadFailed, NotFound, Conflict: as :func:`request_run`.
        InvalidRequest: the adapter refused the request's options (``param`` names the field).
        ApplicationError: the adapter failed on valid input (a bug).
    """
    spec = specs.require_spec(meta["family"])  # the family stays the same until the run starts (_stream_open)
    header = await audio_inspect(audio_input, spec)
    prepared: list[runs.RunInput] = []

    async def prepare(current: dict) -> None:
        prepared.append(await audio_decode(audio_input, header, spec, options))

    async def start(stream: streams.WorkerStream, lease_id: str) -> None:
        await stream.start_transcription(lease_id, prepared[0])

    def make(lease, keep_alive, stream, first, current, load_ms) -> TranscriptionStream:
        opened = TranscriptionStream(ctx, meta["id"], lease, keep_alive, stream, first, load_ms)
        opened.audio_ms = prepared[0].audio_ms
        return opened

    try:
        return await _opened(ctx, meta, request_timeout_ms, prepare, start, make)
    finally:
        if prepared:
            prepared[0].release_samples()  # its budget reservation, if the samples never reached Redis
