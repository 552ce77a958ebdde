"""Loads on a worker (single flight across processes, R4.2), and the wait for any worker's reply.

A load is a Celery task sent by name (``inference.load_model`` on the ``gpu`` queue; the web process
never imports a worker module) that carries ids and Redis keys. Its outcome is written to a reply key
with a TTL and announced on the caller's process channel; a watchdog tick reads the key anyway, so a
lost wake-up costs at most one tick. The same wait (:func:`await_reply`, with the worker liveness
checks of :func:`until_worker_lost`) serves runs (``inference.runtime.runs``), streams
(``inference.runtime.streams``) and teardowns (``inference.runtime.teardown``).
"""
from __future__ import annotations

import asyncio
import json
import logging
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from typing import NoReturn
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass

from audiosite.celery import app as celery_app
from audiosite.errors import ApplicationError, ModelLoadFailed, NoWorker, WorkerLost
from inference.scheduler import (
    ClaimStatus,
    LIVENESS_EVERY_S,
    LIVENESS_TTL_MS,
    LoadAction,
    LoadClaim,
    LoadDecision,
    LoadEnd,
    LoadEndRecord,
    LoadLost,
    LoadOutcome,
    Scheduler,
)

from .context import KEYS, AsyncContext

log = logging.getLogger(__name__)

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


def worker_lost_while_loading(model_id: str, error: str) -> WorkerLost:
    """The 503 ``worker_lost`` of every caller of a load whose worker died during it (R7.4)."""
    return WorkerLost(f"model {model_id!r}: the worker loading it was lost ({error}); the model is unloaded "
                      "and the next request loads it on a live worker; retry", retry_after_s=1)


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
        return NoWorker(f"model {model_id!r}: {error}; is a GPU worker running?")
    if end.ended == LoadEnd.FAILED:
        return ModelLoadFailed(f"model {model_id!r} failed to load: {error}")
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
                           f"tried in {retry_after_s} s (backoff after failed loads)", retry_after_s=retry_after_s)


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


def no_live_worker_error(model_id: str) -> NoWorker:
    """The 503 ``no_worker`` of a load attempted while no worker is alive and none is being started (R7.4)."""
    return NoWorker(f"model {model_id!r} cannot load: no GPU worker is alive and none is being started "
                    "(GET /health reports \"degraded\"); retry once a worker runs")


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
    if pickup_timeout_s is None:
        pickup_timeout_s = ctx.scheduler.lease_ttl_ms / 1000
    return await SingleFlightLoad(ctx, model_id, pickup_timeout_s, force, on_load_lost).placement()


class SingleFlightLoad:
    """One caller of :func:`load_single_flight`: decides with ``begin_load`` until the model is ready
    (or the load ends without a pool), with one method per :class:`~inference.scheduler.LoadAction`.

    Each method returns the :class:`Placement` (``READY``), or None to decide again, or raises.

    Attributes:
        waited: this caller waited for a load in progress: if that load is lost, so is this call.
        unwoken: the token of the last ``WAIT`` that was not woken (the next ``begin_load`` replaces it).
        replaced: the token the current decision replaced (read by ``WOKEN``).
        pickup_since_s: ``time.monotonic()`` from which the load task's pickup clock runs; restarted
            while only a starting worker exists.
    """

    def __init__(self, ctx: AsyncContext, model_id: str, pickup_timeout_s: float, force: bool,
                 on_load_lost: LoadLostHook | None):
        self.ctx = ctx
        self.model_id = model_id
        self.pickup_timeout_s = pickup_timeout_s
        self.force = force
        self.on_load_lost = on_load_lost
        self.started_s = time.monotonic()
        self.loaded_here = False
        self.waited = False
        self.unwoken = ""
        self.replaced = ""
        self.pickup_since_s = 0.0
        self._actions = {LoadAction.BACKOFF: self.backoff, LoadAction.READY: self.ready, LoadAction.LOST: self.lost,
                         LoadAction.WAIT: self.wait, LoadAction.WOKEN: self.woken, LoadAction.LOAD: self.load}

    async def placement(self) -> Placement:
        """Decide (``begin_load``) and act until the model is ready; see :func:`load_single_flight`."""
        while True:
            token = uuid.uuid4().hex
            wake = self.ctx.listener.expect(f"load:{token}")
            try:
                self.replaced, self.unwoken = self.unwoken, ""
                decision = await self.ctx.scheduler.begin_load(self.ctx.listener, self.model_id, token, self.force,
                                                               replaces=self.replaced)
                placement = await self._actions[decision.action](decision, token, wake)
                if placement is not None:
                    return placement
            finally:
                self.ctx.listener.forget(f"load:{token}")

    async def backoff(self, decision: LoadDecision, token: str, wake: asyncio.Future) -> Placement | None:
        """The last load failed and its backoff has not passed (R6.7)."""
        raise backoff_error(self.model_id, decision.retry_in_ms, decision.error)

    async def ready(self, decision: LoadDecision, token: str, wake: asyncio.Future) -> Placement | None:
        """Loaded on a live worker; ``load_ms`` counts from this call's start when it loaded the model."""
        assert decision.owner is not None and decision.boot is not None
        return Placement(decision.owner, decision.boot,
                         (time.monotonic() - self.started_s) * 1000 if self.loaded_here else 0.0)

    async def lost(self, decision: LoadDecision, token: str, wake: asyncio.Future) -> Placement | None:
        """We found the load in progress dead and ended it (its waiters are woken)."""
        if self.on_load_lost is not None:
            await self.on_load_lost(decision.owner or "", decision.error)
        if self.waited:
            raise worker_lost_while_loading(self.model_id, decision.error)
        return None  # it was not ours: decide again (we become the loader)

    async def wait(self, decision: LoadDecision, token: str, wake: asyncio.Future) -> Placement | None:
        """Another caller loads: wake on its outcome, or decide again once its worker would count as dead
        (begin_load ends a load whose worker is gone, R7.4)."""
        self.waited = True
        look_s = LIVENESS_CHECK_S if decision.left_ms < 0 else next_check_s(decision.left_ms / 1000)
        done, _ = await asyncio.wait({wake}, timeout=look_s)
        if not done:
            self.unwoken = token
            return None
        return await self._ended(token, LoadEndRecord.parse(wake.result()))  # the wake-up carries how it ended

    async def woken(self, decision: LoadDecision, token: str, wake: asyncio.Future) -> Placement | None:
        """Our previous wait was woken as it timed out, or its wake-up was lost: begin_load read that
        wait's kept end."""
        return await self._ended(self.replaced, LoadEndRecord(decision.ended, decision.error))

    async def _ended(self, waited_token: str, end: LoadEndRecord) -> Placement | None:
        """After a wait: raise how the load it waited for ended without a pool, else None (decide again)."""
        error = await read_load_end_error(self.ctx, self.model_id, waited_token, end)
        if error is not None:
            raise error  # that load ended without a pool: it releases everyone who waited (R4.2)
        return None

    async def load(self, decision: LoadDecision, token: str, wake: asyncio.Future) -> Placement | None:
        """We are the single loader: send the load task and await its reply (or its worker's loss)."""
        ctx, model_id = self.ctx, self.model_id
        self.loaded_here = True
        if await no_worker_coming(ctx):
            # Nobody would ever start the task (R7.4): say so now, not after the pickup timeout.
            await ctx.scheduler.finish_load(model_id, token, LoadEnd.NO_WORKER, error=LoadLost.NO_LIVE_WORKER)
            raise no_live_worker_error(model_id)
        await send_task("inference.load_model", [model_id, token, ctx.listener.channel], "gpu")
        self.pickup_since_s = time.monotonic()
        await await_reply(ctx, wake, KEYS.load_result(token), lambda: self._load_goes_on(token),
                          first_check_s=min(LIVENESS_CHECK_S, NO_WORKER_CHECK_S, self.pickup_timeout_s))
        raw = await ctx.redis.getdel(KEYS.load_result(token))
        if raw is None:
            # Our claim is gone without a reply yet: the load just finished (its reply follows
            # the worker's database write), or another caller or serve found its worker dead and woke
            # us. Read the outcome.
            error = await read_load_end_error(ctx, model_id, token)
            if error is not None:
                raise error
            return None  # ready (begin_load says so) or loading by another: decide again
        outcome = json.loads(raw or '{"ok": false, "error": "lost"}')
        if not outcome["ok"]:
            retry_in_ms = (await ctx.scheduler.snapshot([model_id]))[model_id]["retry_in_ms"]
            raise ModelLoadFailed(f"model {model_id!r} failed to load: {outcome['error']}",
                                  retry_after_s=max(1, math.ceil(retry_in_ms / 1000)))  # the backoff (R6.7)
        return None  # loaded: begin_load says where

    async def _load_goes_on(self, token: str) -> float | None:
        """The loader's ``keep_waiting`` (:func:`await_reply`): seconds until it looks again, None once
        the claim is gone (finished, or ended by another caller); raises when the load is lost."""
        status = await self.ctx.scheduler.load_claim(self.model_id, token)
        if status.claim is LoadClaim.RUNNING:  # a worker is loading, renewing its claim and beating
            return next_check_s(status.left_ms / 1000)
        if status.claim is LoadClaim.PENDING:
            return await self._pending(token)
        if status.claim is LoadClaim.EXPIRED:
            await self._expired(token, status)
        return None  # GONE: finished (its reply is read by load) or ended by another caller

    async def _pending(self, token: str) -> float:
        """No worker has started the load yet: how long until the next look, or raise ``no_worker``."""
        ctx, model_id = self.ctx, self.model_id
        census = await ctx.scheduler.census()
        if census.live_workers == 0:
            if census.worker_starting or not await no_worker_coming(ctx):
                # The task waits in the queue for that worker: its pickup time starts
                # once it beats (looked at often enough that it is not eaten by the wait).
                self.pickup_since_s = time.monotonic()
                return min(NO_WORKER_CHECK_S, self.pickup_timeout_s / 4)
            await ctx.scheduler.finish_load(model_id, token, LoadEnd.NO_WORKER, error=LoadLost.NO_LIVE_WORKER)
            raise no_live_worker_error(model_id)
        pickup_left_s = self.pickup_timeout_s - (time.monotonic() - self.pickup_since_s)
        if pickup_left_s > 0:
            return min(LIVENESS_CHECK_S, NO_WORKER_CHECK_S, pickup_left_s)
        await ctx.scheduler.finish_load(model_id, token, LoadEnd.NO_WORKER, error=LoadLost.NOT_PICKED_UP)
        raise NoWorker(f"model {model_id!r}: no worker started its load within "
                       f"{self.pickup_timeout_s:.0f} s; is a GPU worker running?")

    async def _expired(self, token: str, status: ClaimStatus) -> NoReturn:
        """The loading worker is gone (R7.4): nobody will answer. End the load for everyone, and raise."""
        host = status.host
        error = Scheduler.lost_load_error(host)
        ended = await self.ctx.scheduler.finish_load(self.model_id, token, LoadEnd.WORKER_LOST, error=error)
        if ended is LoadOutcome.OK:
            if self.on_load_lost is not None:
                await self.on_load_lost(host, error)
            raise worker_lost_while_loading(self.model_id, error)
        # Another caller ended it first (and may have cleared the loader's name): say what it recorded.
        recorded = await read_load_end_error(self.ctx, self.model_id, token)
        raise recorded or worker_lost_while_loading(self.model_id, error)
