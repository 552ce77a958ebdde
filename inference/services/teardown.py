"""The one teardown path: tear down a model's pool under its manager lease, recording each step once (R4.5),
and retire a model that has been idle (R6.4)."""
from __future__ import annotations

import logging

from asgiref.sync import sync_to_async

from inference.runtime import leases
from inference.runtime.context import AsyncContext
from inference.runtime.teardown import TeardownResult, teardown_held
from inference.scheduler import Lease, ModelState
from registry import records

log = logging.getLogger(__name__)


async def model_teardown(ctx: AsyncContext, lease: Lease, actor: str, *,
                         state: ModelState = ModelState.UNLOADING, event: str = "teardown",
                         reason: str = "") -> TeardownResult:
    """Tear down ``lease.model_id``'s pool under its held manager lease, recording each step once (R4.5).

    Every teardown goes through here: HTTP unload, unregister, bulk unload,
    reconfigure, eviction, idle retirement and ``manage.py unload_model``.
    This process (the manager) is the only writer of the steps: the
    registration's state (``state`` first, ``unloaded`` at the end) and one
    audit row ``event`` when there was a pool (``actor``; ``detail`` the
    close error, else ``reason``). The worker only destroys the pool.

    Raises:
        LeaseNotHeld: the manager lease was reclaimed (R2.5).
    """
    model_id = lease.model_id
    await sync_to_async(records.registration_record_state)(model_id, state)
    result = await teardown_held(ctx, lease, state)
    await sync_to_async(records.registration_record_teardown)(
        model_id, ok=not result.error, detail=result.error or reason or str(result.outcome),
        duration_ms=result.duration_ms, actor=actor, event=event, audit=result.recorded_pool)
    return result


async def model_retire_if_idle(ctx: AsyncContext, model_id: str, idle_ms: int) -> bool:
    """Unload ``model_id`` if it has been idle for ``idle_ms`` (R6.4).

    Idle = ready, no lease of any kind, empty queue, and the last work
    (``last_used_ms``, set when a lease is released or a load finishes)
    ended at least ``idle_ms`` ago in Redis time. Takes the manager lease by
    try-acquire, so a busy or queued model is skipped, never interrupted.

    Returns:
        True when the pool was retired.
    """
    lease = await ctx.scheduler.try_acquire(model_id, ModelState.READY, idle_ms)
    if lease is None:
        return False
    await leases.hold(ctx, lease, lambda held: model_teardown(
        ctx, held, "idle retirement", event="idle_retire", reason=f"idle for at least {idle_ms} ms"))
    log.info("retired %s after %d ms idle", model_id, idle_ms)
    return True
