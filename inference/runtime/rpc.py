"""Worker RPC: loads and unloads as Celery tasks, runs on the worker's own run queue;
replies back through Redis keys and a pushed wake-up.

A task or run header carries ids and Redis keys, never audio. Its outcome is written to a
reply key with a TTL and announced on the caller's process channel; a
watchdog tick reads the key anyway, so a lost wake-up costs at most one
tick. The web process never imports a worker module: tasks are sent by name.
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from audiosite.celery import app as celery_app
from audiosite.errors import ApplicationError, ModelLoadFailed, ServerBusy
from inference import audio
from inference.scheduler import (
    LIVENESS_EVERY_S,
    LIVENESS_TTL_MS,
    LoadAction,
    LoadClaim,
    LoadEnd,
    LoadEndRecord,
    LoadLost,
    LoadOutcome,
    RunOffer,
    Scheduler,
)

from .context import KEYS, AsyncContext, sync_redis_bytes

log = logging.getLogger(__name__)

INPUT_TTL_MS = 600000  # a request's input waits at most 10 min for its worker
LIVENESS_CHECK_S = LIVENESS_EVERY_S
"""When a caller waiting on a worker (a run, a load, a teardown) first checks that the worker still
beats, and how often it checks while no worker has started a load, in seconds (one beat, 2 s)."""
CHECK_MARGIN_S = 0.05
"""Added to a deadline read from Redis before looking again, so that Redis has passed it."""
MAX_CHECK_S = LIVENESS_TTL_MS / 1000
"""The longest a waiter goes without looking at its reply key (a lost wake-up costs at most this)."""
NO_WORKER_CHECK_S = 1.0
"""While its load task waits for a worker to start it, the loader checks this often (seconds) that
some worker is alive or being started (``census.lua``); when none is, it gives up at once (R7.4)."""

# Sending a task is a blocking call into kombu; it runs in a small pool of its
# own, never in the executor that decodes audio (R: the request path, item 7).
_SEND_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="celery-send")


async def send_task(task_name: str, args: list, queue) -> None:
    """Publish a Celery task by name on ``queue`` (a queue name or a ``celery.utils.worker_direct`` queue)."""
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(_SEND_POOL, lambda: celery_app.send_task(task_name, args=args, queue=queue))


def next_check_s(left_s: float) -> float:
    """How long to wait before looking again at something that stays alive ``left_s`` more seconds
    unless renewed: just past that deadline, within ``[CHECK_MARGIN_S, MAX_CHECK_S]``."""
    return min(MAX_CHECK_S, max(0.0, left_s) + CHECK_MARGIN_S)


async def await_reply(ctx: AsyncContext, wake: asyncio.Future, reply_key: str,
                      keep_waiting: Callable[[], Awaitable[float | None]],
                      first_check_s: float = LIVENESS_CHECK_S) -> bool:
    """Wait for a worker's reply: the pushed wake-up, or ``reply_key`` found at a check.

    The first check comes after ``first_check_s``; each check without a reply
    awaits ``keep_waiting()``, which returns the seconds until the next check
    (typically the moment the worker's liveness would lapse, see
    :func:`next_check_s`), or None to stop waiting.

    Returns:
        True when the reply is there, False when ``keep_waiting`` said stop.
    """
    wait_s = first_check_s
    while True:
        done, _ = await asyncio.wait({wake}, timeout=wait_s)
        if done or await ctx.redis.exists(reply_key):
            return True
        after_s = await keep_waiting()
        if after_s is None:
            return False
        wait_s = after_s


async def worker_alive_for_s(ctx: AsyncContext, owner: str, boot: str) -> float | None:
    """Seconds left on worker ``owner``'s liveness key while it holds boot id ``boot``; None when the
    key is gone or names another boot: the worker died, froze or restarted (R7.4). One round trip."""
    key = KEYS.worker_live(owner)
    async with ctx.redis.pipeline(transaction=True) as pipe:
        pipe.get(key)
        pipe.pttl(key)
        value, pttl_ms = await pipe.execute()
    if value != boot:
        return None
    return pttl_ms / 1000 if pttl_ms >= 0 else MAX_CHECK_S


async def until_worker_lost(ctx: AsyncContext, owner: str, boot: str) -> float | None:
    """A ``keep_waiting`` for :func:`await_reply`: look again just after worker ``owner``'s liveness
    key would lapse (R7.4: a dead worker is noticed within its liveness TTL), None once it has."""
    left_s = await worker_alive_for_s(ctx, owner, boot)
    return None if left_s is None else next_check_s(left_s)


async def worker_alive(ctx: AsyncContext, owner: str, boot: str) -> bool:
    """True while worker ``owner`` still beats with boot id ``boot`` (R7.4)."""
    return await ctx.redis.get(KEYS.worker_live(owner)) == boot


def worker_lost_while_loading(model_id: str, error: str) -> ServerBusy:
    """The 503 ``worker_lost`` of every caller of a load whose worker died during it (R7.4)."""
    return ServerBusy(f"model {model_id!r}: the worker loading it was lost ({error}); the model is unloaded "
                      "and the next request loads it on a live worker; retry", code="worker_lost", retry_after_s=1)


def load_end_error(model_id: str, end: LoadEndRecord) -> ApplicationError | None:
    """What a caller of a load reports when that load ended without a pool, or None.

    Args:
        end: how the load ended (its wake-up's payload, or the record kept for the caller's token).

    Returns:
        By ``end.ended``: ``worker_lost`` → ServerBusy ``worker_lost`` (R7.4); ``no_worker`` →
        ServerBusy ``no_worker``; ``failed`` → ModelLoadFailed ``load_failed`` (R4.2). None for
        ``ready`` or None (nothing to report: the caller decides again).
    """
    error = end.error or "no detail"
    if end.ended == LoadEnd.WORKER_LOST:
        return worker_lost_while_loading(model_id, error)
    if end.ended == LoadEnd.NO_WORKER:
        return ServerBusy(f"model {model_id!r}: {error}; is a GPU worker running?", code="no_worker")
    if end.ended == LoadEnd.FAILED:
        return ModelLoadFailed(f"model {model_id!r} failed to load: {error}", code="load_failed")
    return None


async def read_load_end_error(ctx: AsyncContext, model_id: str, token: str,
                              end: LoadEndRecord | None = None) -> ApplicationError | None:
    """:func:`load_end_error` of the load that ``token`` waited for or claimed: from ``end`` (what its
    wake-up carried, or ``begin_load``'s 'woken'), else from the record kept for ``token`` (one GET),
    else, when nothing is kept, from the model's ``:load`` hash as it stands (while ``unloaded``).

    The record, not the hash, is what a late reader needs: by the time a wake-up is read, or a lost
    one is made up for by a timed look, the next caller may have claimed the next load (R7.4)."""
    if end is None or end.ended is None:
        end = await ctx.scheduler.load_end(model_id, token)
    if end.ended is None:
        load = await ctx.redis.hgetall(KEYS.load(model_id))
        if load.get("state") == "unloaded" and load.get("ended"):
            end = LoadEndRecord(LoadEnd(load["ended"]), load.get("error") or "")
    return load_end_error(model_id, end)


def backoff_error(model_id: str, retry_in_ms: int, error: str) -> ModelLoadFailed:
    """The 503 ``load_failed`` of a model whose last load failed ``retry_in_ms`` before its next try (R6.7)."""
    retry_after_s = max(1, math.ceil(retry_in_ms / 1000))
    return ModelLoadFailed(f"model {model_id!r} failed to load ({error or 'no detail'}); the next load may be "
                           f"tried in {retry_after_s} s (backoff after failed loads)", code="load_failed",
                           retry_after_s=retry_after_s)


NO_WORKER_GRACE_S = 1.0
"""How long a census showing no live worker and none being started must last before a load gives
up with ``no_worker`` (seconds). A worker that stops deletes its liveness key before it exits, and
``serve`` marks its replacement as starting only once it sees the exit (within 0.2 s)."""


_no_worker_confirmed_at = [float("-inf")]  # time.monotonic() of this process's last confirmation


async def no_worker_coming(ctx: AsyncContext) -> bool:
    """True when no worker is alive and none is being started, twice, ``NO_WORKER_GRACE_S`` apart.

    Returns False at the first census that shows a live or starting worker (one round trip when
    workers are alive, the common case). Once confirmed, later calls within two grace periods
    trust a single census, so requests queued behind the first refusal are refused at once too.
    """
    for attempt in range(2):
        census = await ctx.scheduler.census()
        if census.live_workers or census.worker_starting:
            return False
        if attempt == 0:
            if time.monotonic() - _no_worker_confirmed_at[0] < 2 * NO_WORKER_GRACE_S:
                break
            await asyncio.sleep(NO_WORKER_GRACE_S)
    _no_worker_confirmed_at[0] = time.monotonic()
    return True


def no_live_worker_error(model_id: str) -> ServerBusy:
    """The 503 ``no_worker`` of a load attempted while no worker is alive and none is being started (R7.4)."""
    return ServerBusy(f"model {model_id!r} cannot load: no GPU worker is alive and none is being started "
                      "(GET /health reports \"degraded\"); retry once a worker runs", code="no_worker")


@dataclass(frozen=True)
class Placement:
    """Where a model's pool is loaded: Celery hostname ``owner``, its ``boot`` id, and
    ``load_ms`` spent loading it for this caller (0.0 when it was already loaded)."""

    owner: str
    boot: str
    load_ms: float


LoadLostHook = Callable[[str, str], Awaitable[None]]
"""``hook(worker_hostname, error)``: called by the one caller that ended a load whose worker died."""


async def load_single_flight(ctx: AsyncContext, model_id: str, pickup_timeout_s: float | None = None,
                             force: bool = False, on_load_lost: LoadLostHook | None = None) -> Placement:
    """Return where ``model_id`` is loaded, loading it first if needed (single flight across processes, R4.2).

    Before sending a load task, and every ``NO_WORKER_CHECK_S`` while it
    waits to be picked up, the caller reads the census (``census.lua``): with
    no live worker and none being started (``Keys.worker_starting``, set by
    ``serve`` while it boots or is about to restart one) the load is abandoned
    at once with ``no_worker`` instead of waiting ``pickup_timeout_s`` for
    nobody. While a worker is being started and none is alive, the pickup
    clock does not run: the task waits in the ``gpu`` queue for that worker.

    Args:
        pickup_timeout_s: how long a load task may wait for a live worker to
            start it (default: the lease TTL). Past that, the claim is abandoned.
        force: load even during a failed load's backoff (explicit management load, R6.7).
        on_load_lost: awaited by the caller that ends a load whose worker died
            (exactly one caller does), before it raises: the dead worker
            recorded the load's start and can no longer record its end.

    A caller waiting for another caller's load, and the loader itself, look
    again just after the moment the worker running it would count as dead
    (its liveness key's or its claim's expiry, read from Redis): a load whose
    worker died ends for all of them when its liveness key expires, within the
    worker liveness TTL of its last beat (R7.4), whatever the lease TTL.
    While no worker has started the load they look every ``LIVENESS_CHECK_S``.

    Raises:
        ModelLoadFailed: the load failed; the model stays registered and
            unloaded, and a later request retries (R4.2); or the last load
            failed and its backoff has not passed (R6.7: at once, with the
            time left as ``retry_after_s``).
        ServerBusy: code ``no_worker``: no worker is alive and none is being
            started, or no live worker started the load in time; code
            ``worker_lost``: the worker loading it died (the model is unloaded
            and the next caller loads it on a live worker, R7.4). Callers that
            waited on another caller's load get the same codes.

    Tolerated race: a load task that a worker starts after its claim was
    abandoned sees ``renew_load`` refuse and does nothing.
    """
    if pickup_timeout_s is None:
        pickup_timeout_s = ctx.scheduler.lease_ttl_ms / 1000
    started = time.monotonic()
    loaded_here = False
    waited = False  # this caller waited for a load in progress: if that load is lost, so is this call
    unwoken = ""  # the token of our last 'wait' that was not woken (begin_load unregisters it)
    while True:
        token = uuid.uuid4().hex
        wake = ctx.listener.expect(f"load:{token}")
        try:
            replaced, unwoken = unwoken, ""
            decision = await ctx.scheduler.begin_load(ctx.listener, model_id, token, force, replaces=replaced)
            if decision.action is LoadAction.BACKOFF:
                raise backoff_error(model_id, decision.retry_in_ms, decision.error)
            if decision.action is LoadAction.READY:
                assert decision.owner is not None and decision.boot is not None
                return Placement(decision.owner, decision.boot,
                                 (time.monotonic() - started) * 1000 if loaded_here else 0.0)
            if decision.action is LoadAction.LOST:
                # We found the load in progress dead and ended it (its waiters are woken).
                if on_load_lost is not None:
                    await on_load_lost(decision.owner or "", decision.error)
                if waited:
                    raise worker_lost_while_loading(model_id, decision.error)
                continue  # it was not ours: decide again (we become the loader)
            if decision.action is LoadAction.WAIT:
                # Another caller loads: wake on its outcome, or decide again once its worker
                # would count as dead (begin_load ends a load whose worker is gone, R7.4).
                waited = True
                look_s = LIVENESS_CHECK_S if decision.left_ms < 0 else next_check_s(decision.left_ms / 1000)
                done, _ = await asyncio.wait({wake}, timeout=look_s)
                if not done:
                    unwoken = token
                    continue
            if decision.action in (LoadAction.WAIT, LoadAction.WOKEN):
                # Woken (the wake-up carries how the load ended); WOKEN: our previous wait was woken
                # as it timed out, or its wake-up was lost: begin_load read that wait's kept end.
                if decision.action is LoadAction.WOKEN:
                    waited_token, end = replaced, LoadEndRecord(decision.ended, decision.error)
                else:
                    waited_token, end = token, LoadEndRecord.parse(wake.result())
                error = await read_load_end_error(ctx, model_id, waited_token, end)
                if error is not None:
                    raise error  # that load ended without a pool: it releases everyone who waited (R4.2)
                continue
            loaded_here = True
            if await no_worker_coming(ctx):
                # Nobody would ever start the task (R7.4): say so now, not after the pickup timeout.
                await ctx.scheduler.finish_load(model_id, token, LoadEnd.NO_WORKER, error=LoadLost.NO_LIVE_WORKER)
                raise no_live_worker_error(model_id)
            await send_task("inference.load_model", [model_id, token, ctx.listener.channel], "gpu")
            pickup_since = [time.monotonic()]  # the pickup clock; restarted while only a starting worker exists

            async def load_goes_on(token: str = token, pickup_since: list[float] = pickup_since) -> float | None:
                status = await ctx.scheduler.load_claim(model_id, token)
                claim = status.claim
                if claim is LoadClaim.RUNNING:  # a worker is loading, renewing its claim and beating
                    return next_check_s(status.left_ms / 1000)
                if claim is LoadClaim.PENDING:
                    census = await ctx.scheduler.census()
                    if census.live_workers == 0:
                        if census.worker_starting or not await no_worker_coming(ctx):
                            # The task waits in the queue for that worker: its pickup time starts
                            # once it beats (looked at often enough that it is not eaten by the wait).
                            pickup_since[0] = time.monotonic()
                            return min(NO_WORKER_CHECK_S, pickup_timeout_s / 4)
                        await ctx.scheduler.finish_load(model_id, token, LoadEnd.NO_WORKER,
                                                        error=LoadLost.NO_LIVE_WORKER)
                        raise no_live_worker_error(model_id)
                    pickup_left_s = pickup_timeout_s - (time.monotonic() - pickup_since[0])
                    if pickup_left_s > 0:
                        return min(LIVENESS_CHECK_S, NO_WORKER_CHECK_S, pickup_left_s)
                    await ctx.scheduler.finish_load(model_id, token, LoadEnd.NO_WORKER,
                                                    error=LoadLost.NOT_PICKED_UP)
                    raise ServerBusy(f"model {model_id!r}: no worker started its load within "
                                     f"{pickup_timeout_s:.0f} s; is a GPU worker running?", code="no_worker")
                if claim is LoadClaim.EXPIRED:
                    # The loading worker is gone (R7.4): nobody will answer. End the load for everyone.
                    host = status.host
                    error = Scheduler.lost_load_error(host)
                    ended = await ctx.scheduler.finish_load(model_id, token, LoadEnd.WORKER_LOST, error=error)
                    if ended is LoadOutcome.OK:
                        if on_load_lost is not None:
                            await on_load_lost(host, error)
                        raise worker_lost_while_loading(model_id, error)
                    # Another caller ended it first (and may have cleared the loader's name): say what it recorded.
                    recorded = await read_load_end_error(ctx, model_id, token)
                    raise recorded or worker_lost_while_loading(model_id, error)
                return None  # GONE: finished (its reply is read below) or ended by another caller

            replied = await await_reply(ctx, wake, KEYS.load_result(token), load_goes_on,
                                        first_check_s=min(LIVENESS_CHECK_S, NO_WORKER_CHECK_S, pickup_timeout_s))
            raw = await ctx.redis.getdel(KEYS.load_result(token))
            if not replied and raw is None:
                # Our claim is gone without a reply yet: the load just finished (its reply follows
                # the worker's database write) or another caller found its worker dead. Read the outcome.
                error = await read_load_end_error(ctx, model_id, token)
                if error is not None:
                    raise error
                continue  # ready (begin_load says so) or loading by another: decide again
            outcome = json.loads(raw or '{"ok": false, "error": "lost"}')
            if not outcome["ok"]:
                retry_in_ms = (await ctx.scheduler.snapshot([model_id]))[model_id]["retry_in_ms"]
                raise ModelLoadFailed(f"model {model_id!r} failed to load: {outcome['error']}", code="load_failed",
                                      retry_after_s=max(1, math.ceil(retry_in_ms / 1000)))  # the backoff (R6.7)
        finally:
            ctx.listener.forget(f"load:{token}")


class RunFailure(StrEnum):
    """``kind`` of a failed run reply (``{"ok": false, "kind", "message"[, "param"]}``).

    ``NOT_LOADED``: the worker holds no such pool and never took the run (the
    caller keeps the lease); ``INVALID_INPUT``: the adapter refused the
    request (400); ``EXPIRED``: the input key expired before the run (503);
    ``ERROR``: the adapter failed on valid input (500, a bug); ``CANCELLED``: the adapter stopped
    because the run's client left (:func:`run_reply` set ``Keys.stop``; nobody reads this reply).
    """

    NOT_LOADED = "not_loaded"
    INVALID_INPUT = "invalid_input"
    EXPIRED = "expired"
    ERROR = "error"
    CANCELLED = "cancelled"


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


def _send_blocking(input_key: str, data: memoryview, placement: Placement, header: str) -> None:
    pipe = sync_redis_bytes().pipeline(transaction=False)
    pipe.set(input_key, data, px=INPUT_TTL_MS)
    queue_header(pipe, placement, header)
    pipe.execute()


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
    """Hand ``run_input`` and the run ``header`` to ``placement``'s run queue in one round trip; then
    ``run_input`` forgets its samples.

    With ``inline`` and samples under ``BLOCKING_SEND_MIN_BYTES``, the samples travel inside the
    queue element (:func:`inline_element`): the worker gets them with the header it pops and makes
    no round trip to read them (0.45 ms of a short run on a 2-core machine, docs/benchmarks.md); a
    worker that does not take the run (``not_loaded``) writes them to ``Keys.input(request_id)`` for
    the next dispatch. Otherwise the samples go to ``Keys.input(request_id)`` (TTL ``INPUT_TTL_MS``)
    beside the header; large ones from the array's own memory by a blocking client in a thread.
    Samples already sent by an earlier dispatch are not sent again: their key's TTL is refreshed.
    """
    input_key = KEYS.input(run_input.request_id)
    samples = run_input.samples
    if samples is not None and samples.nbytes >= BLOCKING_SEND_MIN_BYTES:
        await asyncio.get_running_loop().run_in_executor(
            _INPUT_SEND_POOL, _send_blocking, input_key, audio.to_bytes(samples), placement, json.dumps(header))
    else:
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
        return await run_reply(ctx, request_id, placement, wake)
    finally:
        ctx.listener.forget(f"done:{request_id}")


def run_header(ctx: AsyncContext, model_id: str, lease_id: str, run_input: RunInput, held: bool = False) -> dict:
    """The run header of :func:`run_on_worker` without ``boot`` (the queue it is pushed on names the
    worker's boot; :func:`run_on_worker` adds it as a second check)."""
    return {"model_id": model_id, "request_id": run_input.request_id, "lease_id": lease_id,
            "channel": ctx.listener.channel, "sample_rate_hz": run_input.sample_rate_hz,
            "sample_format": run_input.sample_format, "options": run_input.options, "held": held}


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


async def run_reply(ctx: AsyncContext, request_id: str, placement: Placement, wake: asyncio.Future) -> dict | None:
    """Await the reply of a run handed to ``placement``'s worker (by :func:`run_on_worker` or with its
    grant): the worker's reply (see ``inference.worker.work.run_request``), or None when the worker
    died meanwhile. ``wake``: ``listener.expect(f"done:{request_id}")``, registered before the hand-over.

    A caller cancelled while it waits (its client left, R8.2) sets ``Keys.stop(request_id)`` (TTL
    ``CANCEL_TTL_MS``) before the cancellation goes on: an adapter that asks ``cancelled()`` between
    bounded steps stops its run, and the worker gives the lease back with its reply."""
    try:
        answered = await await_reply(ctx, wake, KEYS.result(request_id),
                                     lambda: until_worker_lost(ctx, placement.owner, placement.boot))
    except asyncio.CancelledError:
        try:
            await asyncio.shield(ctx.redis.set(KEYS.stop(request_id), "1", px=CANCEL_TTL_MS))
        except Exception:  # Redis gone or cancelled again: the run then finishes for nobody, as before
            log.warning("could not mark run %s as left by its client", request_id, exc_info=True)
        raise
    if not answered:
        await ctx.redis.delete(KEYS.input(request_id))
        return None
    inline = wake.result() if wake.done() and not wake.cancelled() else None
    if inline is not None:  # carried by the wake-up (inference.worker.work.reply): no round trip
        return json.loads(inline)
    return json.loads(await ctx.redis.getdel(KEYS.result(request_id)))


STOP_TTL_MS = 600000  # a stop request outlives any sentence
# Frames a stream takes from Redis per read: the web process holds at most these (plus the one being
# written) per stream while its client reads slowly; the rest wait in Redis. A speech frame is one
# piece of at most ``inference.adapters.piper.PHONEMES_PER_RUN`` phonemes: up to about 1.4 MB of
# PCM at the slowest pace (speed 0.25), 0.35 MB at speed 1.
FRAMES_PER_READ = 4

CANCEL_TTL_MS = 600000
"""Expiry (ms) of a run's ``Keys.stop`` marker set by :func:`run_reply` when its caller left: longer
than a run may wait on its worker's queue and run (a run stops within one of its steps)."""


class WorkerStream:
    """The frames of one streamed speech run on a worker (``inference.worker.work.stream_speech``).

    The caller keeps (and renews) the run's lease: a stream's slot is held
    until its last byte is written or its client leaves (R8.3). Frames arrive
    on ``Keys.chunks(request_id)``; every push also publishes
    ``chunk:<request_id>`` on this process's channel, so waiting costs no
    polling; a watchdog tick checks that the worker still lives (R7.4).

    Attributes:
        final: the end frame's JSON once read (None before).
    """

    def __init__(self, ctx: AsyncContext, model_id: str, placement: Placement):
        self.ctx = ctx
        self.model_id = model_id
        self.placement = placement
        self.request_id = uuid.uuid4().hex
        self.final: dict | None = None
        self._key = KEYS.chunks(self.request_id)
        self._wake_key = f"chunk:{self.request_id}"
        self._check_s = LIVENESS_CHECK_S  # when to look at the worker's liveness if no frame comes

    async def start(self, lease_id: str, text: str, options: dict) -> None:
        """Push the run header ``{"stream": true, "model_id", "request_id", "lease_id", "boot",
        "channel", "text", "options"}`` on the owning worker's run queue (one round trip)."""
        header = json.dumps({"stream": True, "model_id": self.model_id, "request_id": self.request_id,
                             "lease_id": lease_id, "boot": self.placement.boot,
                             "channel": self.ctx.listener.channel, "text": text, "options": options})
        async with self.ctx.redis_bytes.pipeline(transaction=False) as pipe:
            queue_header(pipe, self.placement, header)
            await pipe.execute()

    async def frames(self) -> list[bytes]:
        """The PCM frames available now, waiting for at least one; empty once the end frame was read.

        Each returned item is a frame without its type byte: s16le mono PCM (``a``, speech) or
        JSON (``j``, a transcription segment). The end frame sets :attr:`final` and ends the stream.

        Raises:
            ServerBusy: (code ``worker_lost``) the worker stopped beating before the end frame.
        """
        while self.final is None:
            wake = self.ctx.listener.expect(self._wake_key)
            try:
                items = await self.ctx.redis_bytes.lpop(self._key, FRAMES_PER_READ)
                if items:
                    audio_frames = []
                    for item in items:
                        if item[:1] == b"e":
                            self.final = json.loads(item[1:])
                            break
                        audio_frames.append(item[1:])
                    return audio_frames
                done, _ = await asyncio.wait({wake}, timeout=self._check_s)
                if not done:
                    # Look again just after the worker's liveness would lapse (R7.4, as for runs).
                    left_s = await worker_alive_for_s(self.ctx, self.placement.owner, self.placement.boot)
                    if left_s is None:
                        raise ServerBusy(f"model {self.model_id!r}: its worker stopped responding mid-stream",
                                         code="worker_lost")
                    self._check_s = next_check_s(left_s)
            finally:
                self.ctx.listener.forget(self._wake_key)
        return []

    async def stop(self, wait_s: float) -> bool:
        """Ask the worker to stop after its current sentence and wait (up to ``wait_s``) for its end frame.

        Returns:
            True when the end frame arrived (the worker's slot is free again).
        """
        if self.final is not None:
            return True
        await self.ctx.redis.set(KEYS.stop(self.request_id), "1", px=STOP_TTL_MS)
        deadline = time.monotonic() + wait_s
        try:
            while self.final is None and time.monotonic() < deadline:
                await asyncio.wait_for(self.frames(), timeout=max(0.01, deadline - time.monotonic()))
        except (TimeoutError, ServerBusy):
            return False
        return True

    async def start_transcription(self, lease_id: str, run_input: RunInput) -> None:
        """Send ``run_input``'s samples and push the header ``{"stream": "transcription", "model_id",
        "request_id", "lease_id", "boot", "channel", "sample_rate_hz", "sample_format", "options"}`` (one round trip,
        see :func:`stage_run`); the worker answers with ``j`` frames of JSON per segment
        (``inference.worker.work.stream_transcription``). The stream's ``request_id`` is the input's."""
        self.request_id = run_input.request_id
        self._key = KEYS.chunks(self.request_id)
        self._wake_key = f"chunk:{self.request_id}"
        header = {"stream": "transcription", "model_id": self.model_id, "request_id": self.request_id,
                  "lease_id": lease_id, "boot": self.placement.boot, "channel": self.ctx.listener.channel,
                  "sample_rate_hz": run_input.sample_rate_hz, "sample_format": run_input.sample_format,
                  "options": run_input.options}
        await stage_run(self.ctx, run_input, self.placement, header)

    async def discard(self, keep_input: bool = False) -> None:
        """Delete what is left of the stream in Redis (frames, stop flag, and an input never taken
        unless ``keep_input``: a run the worker refused ``not_loaded`` is sent again)."""
        keys = [self._key, KEYS.stop(self.request_id)]
        if not keep_input:
            keys.append(KEYS.input(self.request_id))
        await self.ctx.redis.delete(*keys)
