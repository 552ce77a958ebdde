"""The teardown mechanism: destroy a model's pool under a held manager lease (R4.5).

``inference.services.model_teardown`` is the one teardown path every caller
uses (unload, unregister, bulk, reconfigure, eviction, idle retirement, the
CLI); it records each step in the database. This module does the Redis and
worker side only.
"""
from __future__ import annotations

import asyncio
import json
import time
import uuid
from dataclasses import dataclass
from enum import StrEnum

from celery.utils import worker_direct

from inference.scheduler import Lease, ModelState

from .context import KEYS, AsyncContext
from .loads import LIVENESS_CHECK_S, await_reply, send_task, until_worker_lost, worker_alive


class TeardownOutcome(StrEnum):
    """What a teardown found: a pool it destroyed, none, or a pool whose worker had stopped beating."""

    DESTROYED = "destroyed"
    NOT_LOADED = "not_loaded"
    WORKER_LOST = "worker_lost"


@dataclass(frozen=True)
class TeardownResult:
    """``outcome``; ``duration_ms`` of the whole teardown; ``error`` when closing the pool raised
    ('' otherwise); ``recorded_pool`` True when there was a pool to account for (a worker was
    asked to destroy it, or its worker had died), so the teardown is an audit step."""

    outcome: TeardownOutcome
    duration_ms: int
    error: str = ""
    recorded_pool: bool = False


async def wait_for_load_in_progress(ctx: AsyncContext, model_id: str) -> None:
    """Return once no live loader is building ``model_id``'s pool (a loader whose worker stopped beating or
    renewing its claim no longer counts, R7.4)."""
    previous = ""  # our last look's token, not woken: unregistered by the next look
    while True:
        token = uuid.uuid4().hex
        wake = ctx.listener.expect(f"load:{token}")
        try:
            wait = await ctx.scheduler.add_load_waiter(ctx.listener, model_id, token, replaces=previous)
            if not wait.waiting:
                return
            claim_left_s = (wait.loader_expires_ms - wait.now_ms) / 1000
            done, _ = await asyncio.wait({wake}, timeout=min(LIVENESS_CHECK_S, max(0.05, claim_left_s)))
            previous = "" if done else token
        finally:
            ctx.listener.forget(f"load:{token}")


async def teardown_held(ctx: AsyncContext, lease: Lease, state: ModelState = ModelState.UNLOADING,
                        ) -> TeardownResult:
    """Unload ``lease.model_id`` while the caller holds its manager ``lease`` (R4.5).

    A load still in progress (its requesters may have left) is waited for,
    not skipped, so its pool is unloaded too. Then: the logical residency is
    cleared first (``state``: ``unloading``, or ``reconfiguring``; owner
    forgotten), the owning worker destroys sessions then weights, and the
    state becomes ``unloaded``. The lease stays held.

    Raises:
        LeaseNotHeld: the lease was reclaimed under the caller (R2.5).
    """
    model_id = lease.model_id
    started = time.monotonic()
    await wait_for_load_in_progress(ctx, model_id)
    owner, boot = await ctx.scheduler.set_state(model_id, state, lease.lease_id)  # the pool, forgotten in one step
    outcome, error, recorded_pool = TeardownOutcome.NOT_LOADED, "", bool(owner and boot)
    if owner and boot:
        outcome = TeardownOutcome.WORKER_LOST
        if await worker_alive(ctx, owner, boot):
            token = uuid.uuid4().hex
            wake = ctx.listener.expect(f"load:{token}")
            try:
                await send_task("inference.unload_model", [model_id, boot, token, ctx.listener.channel],
                                worker_direct(owner))
                await await_reply(ctx, wake, KEYS.load_result(token), lambda: until_worker_lost(ctx, owner, boot))
            finally:
                ctx.listener.forget(f"load:{token}")
            reply = json.loads(await ctx.redis.getdel(KEYS.load_result(token)) or "{}")
            if reply:
                outcome = TeardownOutcome.DESTROYED if reply.get("had_pool") else TeardownOutcome.NOT_LOADED
                error = reply.get("error", "")
    await ctx.scheduler.set_state(model_id, ModelState.UNLOADED, lease.lease_id)
    return TeardownResult(outcome, int((time.monotonic() - started) * 1000), error, recorded_pool)
