"""Residency limits (CONTRACT R6): how many models stay loaded, and when they go.

- ``max_loaded_models`` (R6.1–R6.3): before a cold load beyond the limit, the
  loader evicts least-recently-used models that are ready, hold no lease and
  have an empty queue, by try-acquire (never waiting, never interrupting).
  Models in state ``unloading``/``reconfiguring``/``unloaded`` do not count.
- ``min_free_memory_mb`` (R6.5): refuse a cold load when the model's estimated
  footprint plus this headroom exceeds the available memory that the workers
  publish with their liveness beat (host memory; device memory is not read).
- Cold loads pass one FIFO guard while either limit is set (R6.6): the guard
  is a pseudo model (``Keys.cold_guard``) of capacity one in the same
  scheduler, so waiting is pushed, FIFO and survives process death (R2.5).
- ``idle_unload_ms`` (R6.4) runs on the worker that owns the pool
  (``inference.tasks``), measured from ``last_used_ms`` (end of last work).
"""
from __future__ import annotations

import asyncio
import logging
from contextlib import asynccontextmanager

from audiosite.errors import InsufficientMemory, ServerBusy
from audiosite.serverconfig import get_config
from inference import specs
from inference.runtime.context import KEYS, AsyncContext

log = logging.getLogger(__name__)

COUNTED_STATES = ("ready", "loading")  # R6.2: a model being torn down no longer counts


@asynccontextmanager
async def cold_load_guard(ctx: AsyncContext):
    """Hold the deployment's cold-load guard (one cold load at a time, FIFO, R6.6).

    Waits without bound (the busy timeout bounds admission only, R3.5); the
    lease is renewed while held and released on every path.
    """
    from inference.runtime.dispatch import renewing

    guard = KEYS.cold_guard
    lease = await ctx.scheduler.acquire(ctx.listener, guard, 0)
    try:
        async with renewing(ctx, guard, lease.lease_id):
            yield
    finally:
        await asyncio.shield(ctx.scheduler.release(guard, lease.lease_id))


async def _available_memory_mb(ctx: AsyncContext) -> int | None:
    """Largest available host memory (MB) among live workers, or None when no worker published any."""
    published = await ctx.redis.hgetall(KEYS.worker_memory)
    best = None
    for host, value in published.items():
        if await ctx.redis.exists(KEYS.worker_live(host)):
            best = max(best or 0, int(value))
    return best


async def make_room(ctx: AsyncContext, model_id: str) -> list[str]:
    """Apply the memory guard and evict LRU models so ``model_id`` may load (R6.1, R6.5).

    Call while holding :func:`cold_load_guard`. Evictions already done stay
    done when the call fails (R6.1).

    Returns:
        The evicted model ids, least recently used first.

    Raises:
        InsufficientMemory: estimated footprint + ``min_free_memory_mb`` >
            available memory of the best live worker (R6.5).
        ServerBusy: (code ``residency_full``) fewer models could be evicted
            than needed (all others busy, queued or loading).
    """
    from inference.runtime.dispatch import run_to_completion, with_manager_lease
    from registry.selectors import model_meta_all
    from registry.services import model_teardown

    config = get_config()
    metas = await model_meta_all(ctx)
    meta = metas.get(model_id)
    if meta is None:
        return []
    if config.min_free_memory_mb:
        footprint_mb = specs.estimated_footprint_mb(meta["family"], meta.get("slots") or 1,
                                                   meta.get("load_options"))
        available_mb = await _available_memory_mb(ctx)
        if available_mb is not None and footprint_mb + config.min_free_memory_mb > available_mb:
            raise InsufficientMemory(
                f"model {model_id!r} needs about {footprint_mb} MB plus the {config.min_free_memory_mb} MB "
                f"headroom (min_free_memory_mb), but the workers have {available_mb} MB available",
                code="insufficient_memory", retry_after_s=5)
    evicted: list[str] = []
    if not config.max_loaded_models:
        return evicted
    snapshot = await ctx.scheduler.snapshot([m for m in metas if m != model_id])
    loaded = [m for m, status in snapshot.items() if status["state"] in COUNTED_STATES]
    need = len(loaded) + 1 - config.max_loaded_models
    victims = sorted((m for m in loaded if snapshot[m]["state"] == "ready"), key=lambda m: snapshot[m]["last_used_ms"])
    for victim in victims:
        if need <= 0:
            break
        lease = await ctx.scheduler.try_acquire(victim, "ready")
        if lease is None:  # busy, queued or changed state since the snapshot (R6.1, R6.3)
            continue
        # The teardown finishes (and releases the victim) even if our requester leaves (R4.5).
        await run_to_completion(with_manager_lease(ctx, victim, lease,
                                                   model_teardown(ctx, victim, actor=f"eviction for {model_id}")))
        log.info("evicted %s (least recently used) to load %s", victim, model_id)
        evicted.append(victim)
        need -= 1
    if need > 0:
        raise ServerBusy(
            f"model {model_id!r} cannot load: max_loaded_models={config.max_loaded_models} models are loaded and "
            f"none of them can be evicted now (each is busy, queued or loading)"
            + (f"; evicted {evicted}" if evicted else ""), code="residency_full", retry_after_s=1)
    return evicted
