"""Runs on a worker: a run's input, its hand-over on the owning worker's own run queue, and its reply.

A run header carries ids and Redis keys; the decoded samples travel inside the same queue element
or, when large, in ``Keys.input`` (never in a Celery message). The worker's reply is written to a
reply key with a TTL and announced on the caller's process channel (``inference.runtime.loads.await_reply``:
a lost wake-up costs at most one watchdog tick).
"""
from __future__ import annotations

import asyncio
import json
import logging
import uuid
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from inference import audio
from inference.scheduler import RunOffer

from .context import KEYS, AsyncContext, sync_redis_bytes
from .loads import Placement, await_reply, until_worker_lost

log = logging.getLogger(__name__)

INPUT_TTL_MS = 600000  # a request's input waits at most 10 min for its worker
CANCEL_TTL_MS = 600000
"""Expiry (ms) of a run's ``Keys.stop`` marker set by :func:`run_reply` when its caller left: longer
than a run may wait on its worker's queue and run (a run stops within one of its steps). The worker's
reply deletes it."""


class RunFailure(StrEnum):
    """``kind`` of a failed run reply (``{"ok": false, "kind", "message"[, "param"]}``).

    ``NOT_LOADED``: the worker holds no such pool and never took the run (the
    caller keeps the lease); ``INVALID_INPUT``: the adapter refused the
    request (400); ``EXPIRED``: the input key expired before the run (503);
    ``ERROR``: the adapter failed on valid input (500, a bug); ``CANCELLED``: the adapter stopped
    because the run's client left (:func:`run_reply` set ``Keys.stop``; nobody reads this reply);
    ``CRASHED``: the model's process ended during the run (a crash, the OOM killer, or a sibling run
    that passed its deadline; 503 ``model_crashed``); ``DEADLINE``: the run passed its deadline
    (``max_run_ms``) and its model's process was stopped (503 ``run_deadline``, R3.6).
    """

    NOT_LOADED = "not_loaded"
    INVALID_INPUT = "invalid_input"
    EXPIRED = "expired"
    ERROR = "error"
    CANCELLED = "cancelled"
    CRASHED = "crashed"
    DEADLINE = "deadline"


class Handover:
    """Who releases a request lease: the web process until the run task is on the
    worker's queue (``sent`` True), the worker after that (R8.2)."""

    def __init__(self) -> None:
        self.sent = False


class RunInput:
    """What one run needs besides the model: decoded ``samples`` (``(n,)`` float32, or int16 standing
    for float32 ``x / 32768``, see :func:`inference.audio.sample_format`) at ``sample_rate_hz`` and the
    request's validated ``options`` (merged with defaults on the worker).

    The samples go to Redis once, under ``Keys.input(request_id)``, on the first
    :func:`run_on_worker`; the object then forgets them (``samples`` None,
    ``staged`` True) and calls ``on_release`` (the decode budget's release),
    so the web process holds decoded audio only until it is in Redis, not
    while the worker runs. A second dispatch (the first owner answered
    ``not_loaded`` and never touched the input) sends only a new header for
    the same input. ``audio_ms``: the samples' duration.
    """

    def __init__(self, samples: np.ndarray, sample_rate_hz: int, options: dict,
                 on_release: Callable[[], None] | None = None):
        self.samples: np.ndarray | None = samples
        self.sample_format = audio.sample_format(samples)
        self.sample_rate_hz = sample_rate_hz
        self.options = options
        self.audio_ms = len(samples) / sample_rate_hz * 1000
        self.request_id = uuid.uuid4().hex
        self.staged = False
        self.record: dict | None = None  # the answer the worker records (metrics.answer_record), in the header
        # The worker recorded this run's answer, though its client left before the reply was read (run_reply)
        self.recorded_unread = False
        self._on_release = on_release

    def release_samples(self) -> None:
        """Forget the samples and call ``on_release`` once (idempotent): when they are in Redis, or when
        the request ends without handing them over. Call on the event loop."""
        self.samples = None
        on_release, self._on_release = self._on_release, None
        if on_release is not None:
            on_release()


# Inputs of at least this many bytes are sent by a blocking client in a thread of their own: redis-py's
# asyncio connection hands the packed command to ``transport.writelines``, which on Python 3.11 joins it
# into one bytes object and buffers what the socket does not take at once in a bytearray: two copies of
# the samples. The blocking client ``sendall``s the array's own memory. Smaller inputs stay on the loop
# (one round trip without a thread hop; the copies are then at most twice this size).
BLOCKING_SEND_MIN_BYTES = 1 << 20
_INPUT_SEND_POOL = ThreadPoolExecutor(max_workers=2, thread_name_prefix="input-send")


def send_copies_bytes(nbytes: int) -> int:
    """Bytes of transient copies :func:`run_on_worker` makes while sending ``nbytes`` of samples."""
    return 2 * nbytes if nbytes < BLOCKING_SEND_MIN_BYTES else 0


def queue_header(pipe, placement: Placement, header: str | bytes) -> None:
    """Add to ``pipe`` (a sync or async Redis pipeline) the push of a run ``header`` (or a whole
    queue element, :func:`inline_element`) on
    ``placement``'s worker run queue (``Keys.run_queue``), with the queue's TTL refreshed so the
    queue of a worker that died goes away on its own."""
    queue_key = KEYS.run_queue(placement.owner, placement.boot)
    pipe.lpush(queue_key, header)
    pipe.pexpire(queue_key, INPUT_TTL_MS)


def _set_input_blocking(input_key: str, data: memoryview) -> None:
    sync_redis_bytes().set(input_key, data, px=INPUT_TTL_MS)


async def drop_input(ctx: AsyncContext, run_input: RunInput) -> None:
    """Delete ``run_input``'s samples from Redis (a request that ends before a worker took them)."""
    if run_input.staged:
        await ctx.redis.delete(KEYS.input(run_input.request_id))


def inline_element(header: dict, samples: memoryview) -> bytes:
    """A run queue element carrying its input: the JSON ``header`` (with ``"input": "inline"``), a
    newline, then the samples' bytes (``json.dumps`` never writes a raw newline). Inverse:
    :func:`split_element`."""
    return json.dumps({**header, "input": "inline"}).encode() + b"\n" + samples


def split_element(element: bytes) -> tuple[dict, memoryview | None]:
    """A run queue element as ``(header, inline samples or None)`` (see :func:`inline_element`).

    Raises:
        ValueError: not a JSON header (``json.JSONDecodeError``).
    """
    end = element.find(b"\n")
    if end < 0:
        return json.loads(element), None
    return json.loads(element[:end]), memoryview(element)[end + 1:]


async def stage_run(ctx: AsyncContext, run_input: RunInput, placement: Placement, header: dict,
                    inline: bool = False) -> None:
    """Hand ``run_input`` and the run ``header`` to ``placement``'s run queue in one round trip (two
    for large samples); then ``run_input`` forgets its samples.

    With ``inline`` and samples under ``BLOCKING_SEND_MIN_BYTES``, the samples travel inside the
    queue element (:func:`inline_element`): the worker gets them with the header it pops and makes
    no round trip to read them (0.45 ms of a short run on a 2-core machine, docs/benchmarks.md); a
    worker that does not take the run (``not_loaded``) writes them to ``Keys.input(request_id)`` for
    the next dispatch. Otherwise the samples go to ``Keys.input(request_id)`` (TTL ``INPUT_TTL_MS``)
    beside the header; large ones from the array's own memory by a blocking client in a thread, and
    their header follows in a round trip of its own once their decode budget is back.
    Samples already sent by an earlier dispatch are not sent again: their key's TTL is refreshed.
    """
    input_key = KEYS.input(run_input.request_id)
    samples = run_input.samples
    if samples is not None and samples.nbytes >= BLOCKING_SEND_MIN_BYTES:
        await asyncio.get_running_loop().run_in_executor(
            _INPUT_SEND_POOL, _set_input_blocking, input_key, audio.to_bytes(samples))
        del samples
        run_input.staged = True
        # The decode budget goes back before the header is pushed: once the worker has the run, its end
        # can grant the next waiter, whose decode must find these bytes released (with the header sent
        # from the thread, the loop could resume that waiter before this coroutine, and refuse it).
        run_input.release_samples()
        async with ctx.redis_bytes.pipeline(transaction=False) as pipe:
            queue_header(pipe, placement, json.dumps(header))
            await pipe.execute()
        return
    async with ctx.redis_bytes.pipeline(transaction=False) as pipe:
        if samples is not None and inline:
            queue_header(pipe, placement, inline_element(header, audio.to_bytes(samples)))
        else:
            if samples is not None:
                pipe.set(input_key, audio.to_bytes(samples), px=INPUT_TTL_MS)
            else:  # sent by an earlier dispatch, which the worker never took (not_loaded)
                pipe.pexpire(input_key, INPUT_TTL_MS)
            queue_header(pipe, placement, json.dumps(header))
        await pipe.execute()
    del samples
    run_input.staged = True
    run_input.release_samples()


async def run_on_worker(ctx: AsyncContext, model_id: str, lease_id: str, placement: Placement,
                        run_input: RunInput, handover: Handover, held: bool = False) -> dict | None:
    """Hand one run to the owning worker and await its reply; None when the worker died meanwhile.

    One round trip hands it over (:func:`stage_run`): a JSON header ``{"model_id",
    "request_id", "lease_id", "boot", "channel", "sample_rate_hz",
    "sample_format", "options", "held"}`` is pushed on the worker's run queue
    (``Keys.run_queue(owner, boot)``), which its run threads pop
    (``inference.worker.runs``), with the samples inside the same queue element
    (:func:`inline_element`) or, when they are large, in ``Keys.input`` (TTL
    ``INPUT_TTL_MS``, sent from the array's own memory, see
    ``BLOCKING_SEND_MIN_BYTES``). Then ``run_input`` forgets its samples
    (:meth:`RunInput.release_samples`); a second call for the same input sends
    only the header and refreshes the TTL of ``Keys.input``, where the worker
    that refused the first one left the samples. No Celery message per run:
    that hop cost about 5 ms of the 20 ms overhead of a short request
    (docs/benchmarks.md).

    Args:
        handover: set to sent once the header is on the worker's queue (the
            worker then releases the lease).
        held: the caller keeps renewing and releases the lease itself (one decode of a live
            transcription turn, whose lease spans several runs); the worker neither renews nor
            releases it, and ``handover`` means only that the input is the worker's.

    Returns:
        The worker's reply (see ``inference.worker.work.run_request``), or None.
    """
    request_id = run_input.request_id
    header = run_header(ctx, model_id, lease_id, run_input, held)
    header["boot"] = placement.boot
    wake = ctx.listener.expect(f"done:{request_id}")

    try:
        send = asyncio.ensure_future(stage_run(ctx, run_input, placement, header, inline=True))
        try:
            await asyncio.shield(send)
        except asyncio.CancelledError:
            # The client left while the run was being handed over: the push goes on;
            # once it is on the queue the worker owns the lease.
            try:
                await send
                handover.sent = True
            except Exception:
                pass
            raise
        handover.sent = True
        return await run_reply(ctx, request_id, placement, wake, model_id, "" if held else lease_id, run_input)
    finally:
        ctx.listener.forget(f"done:{request_id}")


def run_header(ctx: AsyncContext, model_id: str, lease_id: str, run_input: RunInput, held: bool = False) -> dict:
    """The run header of :func:`run_on_worker` without ``boot`` (the queue it is pushed on names the
    worker's boot; :func:`run_on_worker` adds it as a second check)."""
    header = {"model_id": model_id, "request_id": run_input.request_id, "lease_id": lease_id,
              "channel": ctx.listener.channel, "sample_rate_hz": run_input.sample_rate_hz,
              "sample_format": run_input.sample_format, "options": run_input.options, "held": held,
              "audio_ms": round(run_input.audio_ms)}
    if run_input.record is not None:
        header["record"] = run_input.record
    return header


@dataclass
class OfferedRun:
    """A short run offered with its enqueue (:func:`offer_run`): the scheduler's ``offer`` and the
    wake-up its reply comes by, registered before the enqueue that may hand the run over."""

    offer: RunOffer
    wake: asyncio.Future
    request_id: str

    def withdraw(self, ctx: AsyncContext) -> None:
        """Stop waiting for this run's reply by its offer (not handed over, or the reply is in)."""
        ctx.listener.forget(f"done:{self.request_id}")

    def taken(self, run_input: RunInput, handover: Handover) -> None:
        """Record that ``enqueue.lua`` pushed the run with its grant (``Lease.dispatched``): the worker
        owns the lease and the samples (a worker that does not take the run leaves them in
        ``Keys.input``, as after :func:`stage_run`)."""
        handover.sent = True
        run_input.staged = True
        run_input.release_samples()


def offer_run(ctx: AsyncContext, model_id: str, run_input: RunInput, meta_json: str) -> OfferedRun | None:
    """Offer a short run to the enqueue, to be handed over with its grant (``enqueue.lua``): its queue
    element carries the samples (:func:`inline_element`). None for samples of
    ``BLOCKING_SEND_MIN_BYTES`` or more, which go to their input key as usual.

    Args:
        meta_json: the registration (as published) the run was prepared for.
    """
    samples = run_input.samples
    if samples is None or samples.nbytes >= BLOCKING_SEND_MIN_BYTES:
        return None
    data = audio.to_bytes(samples)
    offer = RunOffer(meta_json, lambda lease_id: inline_element(run_header(ctx, model_id, lease_id, run_input), data),
                     INPUT_TTL_MS)
    return OfferedRun(offer, ctx.listener.expect(f"done:{run_input.request_id}"), run_input.request_id)


async def run_reply(ctx: AsyncContext, request_id: str, placement: Placement, wake: asyncio.Future,
                    model_id: str, lease_id: str, run_input: RunInput | None = None) -> dict | None:
    """Await the reply of a run handed to ``placement``'s worker (by :func:`run_on_worker` or with its
    grant): the worker's reply (see ``inference.worker.work.run_request``), or None when the worker
    died meanwhile (its stop marker is then set, as for a client that left: a worker that was only
    frozen stores no late reply and records no answer for it). ``wake``:
    ``listener.expect(f"done:{request_id}")``, registered before the hand-over.

    A caller cancelled while it waits (its client left, R8.2) runs ``Scheduler.run_left`` before the
    cancellation goes on, one step against the worker's reply (``Scheduler.run_reply``): a reply
    already there is deleted unread, and a ``not_loaded`` one (a stopping worker never took the run)
    gives ``lease_id`` of ``model_id`` back at once; otherwise ``Keys.stop(request_id)`` (TTL
    ``CANCEL_TTL_MS``) names the lease: an adapter that asks ``cancelled()`` between bounded steps
    stops its run, the worker's reply is not stored, and a ``not_loaded`` one gives the lease back.
    ``lease_id`` '': a held run (its caller releases the lease itself). A reply deleted unread whose
    worker recorded the answer (``run_left``'s 'recorded') sets ``run_input.recorded_unread``: its
    sender records nothing more of the request (``inference.services.request.request_run``)."""
    answered = False
    try:
        answered = await await_reply(ctx, wake, KEYS.result(request_id),
                                     lambda: until_worker_lost(ctx, placement.owner, placement.boot))
        if not answered:
            # A frozen worker may still finish the run: its late reply, to a sender that answers 503, is then
            # neither stored nor recorded (the stop marker; '': the sender gives its lease back itself).
            await ctx.scheduler.run_left(model_id, request_id, "", CANCEL_TTL_MS)
            await ctx.redis.delete(KEYS.input(request_id))
            return None
        inline = wake.result() if wake.done() and not wake.cancelled() else None
        if inline is not None:  # carried by the wake-up (inference.worker.work.reply): no round trip
            return json.loads(inline)
        return json.loads(await ctx.redis.getdel(KEYS.result(request_id)))
    except asyncio.CancelledError:
        outcome = await asyncio.shield(_client_left(ctx, model_id, request_id, lease_id, answered))
        if outcome == "recorded" and run_input is not None:
            run_input.recorded_unread = True
        raise


async def _client_left(ctx: AsyncContext, model_id: str, request_id: str, lease_id: str,
                       answered: bool) -> str | None:
    """``run_reply``'s caller was cancelled (its client left): ``Scheduler.run_left`` (a reply there is
    deleted unread; else the stop marker). When the reply had already come (``answered``: the client left
    while it was being read), the stop marker that step may set for a reply read meanwhile is deleted:
    no run is left to stop. Redis errors are logged (the run then finishes for nobody). Returns
    ``run_left``'s outcome, None when it failed."""
    try:
        outcome = await ctx.scheduler.run_left(model_id, request_id, lease_id, CANCEL_TTL_MS)
        if answered and outcome == "marked":
            await ctx.redis.delete(KEYS.stop(request_id))
        return outcome
    except Exception:  # Redis gone: the run then finishes for nobody, as before
        log.warning("could not mark run %s as left by its client", request_id, exc_info=True)
        return None
