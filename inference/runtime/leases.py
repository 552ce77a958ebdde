"""Leases on the web side: admission errors, manager transitions, the cold-load guard.

A manager (register, reconfigure, unload, unregister, bulk unload, eviction,
idle retirement) holds a model's exclusive lease while its transition runs
(R2.2); once granted, the transition runs to its end even if its caller
leaves (R4.5), and the lease is renewed meanwhile (R2.5) and released after.
"""
from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Awaitable, Callable
from contextlib import asynccontextmanager
from typing import TypeVar

from audiosite.errors import GrantExpired, Overdue, QueueTimeout, ResidencyFull, ServerBusy
from inference.scheduler import AdmissionExpired, AdmissionOverdue, AdmissionTimeout, Lease, LeaseKind, RunOffer

from . import metrics
from .context import KEYS, AsyncContext

log = logging.getLogger(__name__)

T = TypeVar("T")


def busy_error(exc: Exception) -> ServerBusy:
    """The 503 ``server_busy`` of an admission refusal, with its ``code``.

    ``AdmissionExpired`` → ``grant_expired``; ``AdmissionOverdue`` →
    ``overdue`` (R3.3); ``AdmissionTimeout`` → ``queue_timeout`` (R3.2).
    """
    if isinstance(exc, AdmissionExpired):
        return GrantExpired(f"server busy: {exc}")
    if isinstance(exc, AdmissionOverdue):
        return Overdue(f"server busy: {exc} (overdue fail-fast)")
    return QueueTimeout(f"server busy: {exc} (queue timeout)")


async def acquire(ctx: AsyncContext, model_id: str, timeout_ms: int,
                  kind: LeaseKind = LeaseKind.REQUEST, offer: RunOffer | None = None, stream_cap: int = 0,
                  observe_wait: bool = True) -> Lease:
    """Take a request slot, a stream slot (``stream_cap``: the most streams of the model at once) or the
    manager lease of ``model_id`` under ``timeout_ms`` (0 = unbounded), handing ``offer`` to the worker in
    the same step when it can (``inference.scheduler.Scheduler.acquire``).

    A granted request's wait is observed in ``audiosite_queue_wait_seconds`` (unless ``observe_wait`` is
    False: the caller observes it, or the worker that answers it does, ``metrics.answer_events``).

    Raises:
        ServerBusy: admission timeout, fail-fast or an expired grant (R3.2–R3.4).
    """
    try:
        lease = await ctx.scheduler.acquire(ctx.listener, model_id, timeout_ms, kind, offer, stream_cap)
    except (AdmissionExpired, AdmissionOverdue, AdmissionTimeout) as exc:
        raise busy_error(exc) from None
    if kind is not LeaseKind.MANAGER:
        if observe_wait:
            metrics.record_soon(metrics.observe(metrics.QUEUE_WAIT, lease.waited_ms / 1000, model_id))
        metrics.timing_note(queue_ms=lease.waited_ms)  # the activity row of the request (ui)
    return lease


_DETACHED: set[asyncio.Task] = set()


async def run_to_completion(coro: Awaitable[T]) -> T:
    """Await ``coro`` in its own task that a caller's cancellation does not stop.

    A transition that holds a manager lease must finish (and release the
    lease itself) even when the client that asked for it disconnects:
    releasing the lease while a teardown still runs would let requests in
    beside a half-destroyed pool (R4.5).

    Returns:
        What ``coro`` returns; its exception is re-raised.
    """
    task = asyncio.ensure_future(coro)
    _DETACHED.add(task)
    task.add_done_callback(_settle_detached)
    return await asyncio.shield(task)


def _settle_detached(task: asyncio.Task) -> None:
    """Forget a finished transition; log the outcome its departed caller can no longer hear."""
    _DETACHED.discard(task)
    if not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        log.info("a management transition ended with %s: %s", type(exc).__name__, getattr(exc, "message", exc))


async def hold(ctx: AsyncContext, lease: Lease, transition: Callable[[Lease], Awaitable[T]]) -> T:
    """Run ``transition(lease)`` to completion under a granted manager ``lease``.

    The lease is renewed while the transition runs and released after it on
    every path; the caller's cancellation does not stop it (see
    :func:`run_to_completion`).
    """
    async def held() -> T:
        try:
            async with ctx.scheduler.keep_alive(lease.model_id, lease.lease_id):
                return await transition(lease)
        finally:
            await asyncio.shield(ctx.scheduler.release(lease.model_id, lease.lease_id))
    return await run_to_completion(held())


async def run_as_manager(ctx: AsyncContext, model_id: str, timeout_ms: int,
                         transition: Callable[[Lease], Awaitable[T]]) -> T:
    """Take ``model_id``'s manager lease (a barrier, R2.2), then :func:`hold` it for ``transition``.

    The caller may leave while the manager is queued (the ticket is withdrawn, R8.1).

    Raises:
        ServerBusy: admission timeout or fail-fast (R3.4); whatever the transition raises.
    """
    lease = await acquire(ctx, model_id, timeout_ms, LeaseKind.MANAGER)
    return await hold(ctx, lease, transition)


@asynccontextmanager
async def cold_load_guard(ctx: AsyncContext, deadline_s: float | None = None):
    """Hold the deployment's cold-load guard (one cold load at a time, FIFO, R6.6).

    The guard is a pseudo model (``Keys.cold_guard``) of capacity one in the
    same scheduler. Waits until ``deadline_s`` (``time.monotonic()`` seconds;
    None = without bound): the holder may itself be waiting for room (R6.1),
    and that wait is bounded by the cold request's busy timeout. No overdue
    fail-fast here (a guard held long is not a stuck slot). The lease is
    renewed while held and released on every path.

    Raises:
        ServerBusy: (code ``residency_full``) the deadline passed before the guard was ours.
    """
    guard = KEYS.cold_guard
    waiting = ctx.scheduler.acquire(ctx.listener, guard, 0)
    if deadline_s is None:
        lease = await waiting
    else:
        try:
            async with asyncio.timeout(max(0.0, deadline_s - time.monotonic())):
                lease = await waiting
        except TimeoutError:  # the ticket is gone (the cancelled acquire withdrew it, R8.1)
            raise ResidencyFull("the server is at max_loaded_models and the cold loads ahead of this request "
                                "did not finish within its busy timeout") from None
    try:
        async with ctx.scheduler.keep_alive(guard, lease.lease_id):
            yield GuardHeld(ctx, lease)
    finally:
        await asyncio.shield(ctx.scheduler.release(guard, lease.lease_id))


class GuardHeld:
    """The cold-load guard as its holder sees it: :meth:`check` before each step that needs it
    (an eviction, the load), because a holder that stalled past the lease TTL has lost it to the
    next cold load (R6.6)."""

    def __init__(self, ctx: AsyncContext, lease: Lease):
        self._ctx = ctx
        self._lease = lease

    async def check(self) -> None:
        """Renew the guard's lease now (one round trip).

        Raises:
            ServerBusy: (code ``residency_full``) the lease was reclaimed: another cold load has the guard.
        """
        if not await self._ctx.scheduler.renew(self._lease.model_id, self._lease.lease_id):
            raise ResidencyFull("this server process stalled past the lease TTL and lost its turn for a cold load; "
                                "retry")

