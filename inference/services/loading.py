"""Loading and residency (R4.2, R6): make sure a model is loaded, preload models, make room by the memory
guard and eviction (by recent use, or least recently used: the server's ``eviction_policy``)."""
from __future__ import annotations

import asyncio
import functools
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from asgiref.sync import sync_to_async

from audiosite.errors import ApplicationError, InsufficientMemory, ResidencyFull
from audiosite.serverconfig import get_config
from inference import specs
from inference.runtime import leases, loads, metrics, published
from inference.runtime.context import KEYS, AsyncContext
from inference.scheduler import ModelState
from registry import records

from .teardown import model_teardown

log = logging.getLogger(__name__)

COUNTED_STATES = (ModelState.READY, ModelState.LOADING)  # R6.2: a model being torn down no longer counts


async def _record_lost_load(model_id: str, host: str, error: str) -> None:
    """Record the end of a load whose worker died (R7.4): the worker wrote its start (state
    ``loading``) and cannot write its outcome, so the web process that ended it does: state
    ``unloaded``, ``last_error``, a failed ``load`` audit row whose actor is the lost worker.

    Tolerated race: a new load may start at once; if its ``loading`` write lands before this
    one, the database reads ``unloaded`` until that load's outcome is written.
    """
    try:
        await sync_to_async(records.registration_record_load)(model_id, False, error=error, actor=host)
    except Exception:  # the caller's 503 matters more than the record
        log.exception("recording the lost load of %s failed", model_id)


async def model_ensure_loaded(ctx: AsyncContext, model_id: str, force: bool = False,
                        room_timeout_ms: int | None = None) -> loads.Placement:
    """Where ``model_id``'s pool is loaded, loading it if needed (single flight, R4.2).

    With a residency or memory limit set, a cold load first passes the cold
    load guard (one at a time, FIFO) and makes room (R6.1, R6.5, R6.6); a
    model that is ready, or being loaded by someone else, never touches the
    guard, so warm traffic never waits on it. A model whose last load failed
    is refused until its backoff ends, before any eviction (R6.7), unless
    ``force`` (an explicit management load, which also may evict a model whatever
    its recent use: ``residency_make_room``'s ``explicit``).

    Args:
        room_timeout_ms: how long a cold load may wait for the guard and for
            room (R6.1): the request's remaining effective busy timeout; 0 =
            without bound (R3.5); None = the server's ``busy_timeout_ms``
            (management loads).

    Raises:
        ModelLoadFailed, ServerBusy: see ``inference.runtime.loads.load_single_flight``.
        ServerBusy: (code ``residency_full``) no room was made within ``room_timeout_ms``.
        InsufficientMemory: the memory guard refused the load.
    """
    lost = functools.partial(_record_lost_load, model_id)
    if get_config().residency_limited:
        status = (await ctx.scheduler.snapshot([model_id]))[model_id]
        if status["retry_in_ms"] and not force:  # no eviction on behalf of a load in backoff (R6.7)
            raise loads.backoff_error(model_id, status["retry_in_ms"], status["error"])
        if status["state"] not in COUNTED_STATES:
            if room_timeout_ms is None:
                room_timeout_ms = get_config().busy_timeout_ms
            deadline_s = time.monotonic() + room_timeout_ms / 1000 if room_timeout_ms > 0 else None
            async with leases.cold_load_guard(ctx, deadline_s) as guard:
                started = time.monotonic()
                status = (await ctx.scheduler.snapshot([model_id]))[model_id]
                if status["retry_in_ms"] and not force:  # failed while we waited for the guard (R6.7)
                    raise loads.backoff_error(model_id, status["retry_in_ms"], status["error"])
                await residency_make_room(ctx, model_id, deadline_s, guard, explicit=force)
                await guard.check()
                placement = await loads.load_single_flight(ctx, model_id, force=force, on_load_lost=lost)
                if placement.load_ms:
                    return loads.Placement(placement.owner, placement.boot, (time.monotonic() - started) * 1000)
                return placement
    return await loads.load_single_flight(ctx, model_id, force=force, on_load_lost=lost)


@dataclass(frozen=True)
class PreloadResult:
    """One model of :func:`models_preload`: loaded in ``load_ms`` (0 when it was already loaded), or
    ``error`` (the refusal's message; ``load_ms`` None)."""

    model_id: str
    load_ms: float | None
    error: str = ""


async def models_preload(ctx: AsyncContext, model_ids: list[str] | None,
                         on_result: Callable[[PreloadResult], None] | None = None) -> list[PreloadResult]:
    """Load models now, one after the other (``manage.py load_models``; ``serve`` at start-up).

    ``model_ids`` None: every eager (non-lazy) published model. Each load first takes a request
    lease of its model without a bound (the same FIFO and busy guard as a request, so it queues
    behind running work), then :func:`model_ensure_loaded` with ``force`` (an explicit load passes a
    failed load's backoff, R6.7) while the lease is kept alive, then gives the lease back. A
    failure is reported and the next model is loaded: the model stays registered and loads on its first request.

    Args:
        on_result: called with each result as soon as it is known (progress lines).

    Returns:
        One :class:`PreloadResult` per model, in order; an id that is not registered is a failure.
    """
    metas = await published.meta_all(ctx)
    results = []
    for model_id in published.eager_ids(metas) if model_ids is None else model_ids:
        if model_id not in metas:
            result = PreloadResult(model_id, None, "not registered")
        else:
            lease = await ctx.scheduler.acquire(ctx.listener, model_id, 0)
            try:
                async with ctx.scheduler.keep_alive(model_id, lease.lease_id):  # a load may outlast the lease TTL
                    placement = await model_ensure_loaded(ctx, model_id, force=True)
                result = PreloadResult(model_id, placement.load_ms)
            except ApplicationError as exc:
                result = PreloadResult(model_id, None, exc.message)
            finally:
                await ctx.scheduler.release(model_id, lease.lease_id)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


async def _available_memory_mb(ctx: AsyncContext) -> int | None:
    """Largest available host memory (MB) among live workers, or None when no worker published any."""
    published_mb = await ctx.redis.hgetall(KEYS.worker_memory)
    best = None
    for host, value in published_mb.items():
        if await ctx.redis.exists(KEYS.worker_live(host)):
            best = max(best or 0, int(value))
    return best


ROOM_POLL_S = 0.1
"""While a cold load waits for room (R6.1), how often it looks for an idle model, in seconds.

Only the holder of the cold-load guard polls (one per deployment), with one
snapshot per poll: cheap, and simpler than a wake-up on every release."""


async def residency_make_room(ctx: AsyncContext, model_id: str, deadline_s: float | None = None,
                              guard: leases.GuardHeld | None = None, explicit: bool = False) -> list[str]:
    """Apply the memory guard and evict models so ``model_id`` may load (R6.1, R6.5).

    Call while holding the cold-load guard (``guard``: checked before each
    eviction, so a holder that stalled past the TTL evicts nothing). Victims are models that are
    ready, hold no lease and have an empty queue (try-acquire: never waiting,
    never interrupting, R6.1, R6.3); models being torn down do not count
    (R6.2). Which of them, by the server's ``eviction_policy``: ``recent_use``
    (the default) takes the one with the lowest recent use (``ModelStatus.use``:
    requests admitted, decayed by half every ``use_half_life_ms``), and only one
    loaded at least ``min_residency_ms`` ago whose use is below ``model_id``'s
    demand (its own use, the highest seen since this call began, so a victim that
    stops being used falls below it as its count decays; an ``explicit``
    management load has unbounded demand); ``lru`` takes the least recently used at
    once. When too few can be evicted now, waits (looking every ``ROOM_POLL_S``) until
    ``deadline_s`` (``time.monotonic()`` seconds; None = without bound). Evictions
    already done stay done when the call fails.

    Returns:
        The evicted model ids, in eviction order.

    Raises:
        InsufficientMemory: estimated footprint + ``min_free_memory_mb`` >
            available memory of the best live worker (R6.5).
        ServerBusy: (code ``residency_full``) no room by the deadline (every
            other loaded model stayed busy, queued, loading, in more use than
            ``model_id`` or inside its minimum residency).
    """
    config = get_config()
    metas = await published.meta_all(ctx)
    meta = metas.get(model_id)
    if meta is None:
        return []
    if config.min_free_memory_mb:
        await _check_memory(ctx, model_id, meta, config.min_free_memory_mb)
    evicted: list[str] = []
    if not config.max_loaded_models:
        return evicted
    demand = 0.0
    while True:
        snapshot = await ctx.scheduler.snapshot(list(metas))
        if snapshot[model_id]["state"] in COUNTED_STATES:
            return evicted  # loaded (or loading) by a management load meanwhile: no room needed
        demand = max(demand, snapshot[model_id]["use"])
        if await _evict(ctx, model_id, snapshot, None if explicit else demand, guard, evicted) <= 0:
            return evicted
        left_s = None if deadline_s is None else deadline_s - time.monotonic()
        if left_s is not None and left_s <= 0:
            raise ResidencyFull(_residency_full_message(model_id, evicted), retry_after_s=1)
        await asyncio.sleep(ROOM_POLL_S if left_s is None else min(ROOM_POLL_S, left_s))
        metas = await published.meta_all(ctx)  # registrations may come and go while we wait
        if model_id not in metas:
            return evicted  # unregistered meanwhile: the caller finds out when it loads


def _residency_full_message(model_id: str, evicted: list[str]) -> str:
    """The message of :func:`residency_make_room`'s 503 ``residency_full``, naming what kept each model."""
    config = get_config()
    if config.eviction_policy == "lru":
        why = "none of them became idle (each stayed busy, queued or loading)"
    else:
        why = (f"none of them could be evicted: each stayed busy, queued or loading, had more recent requests "
               f"than {model_id!r} (eviction_policy recent_use), or was loaded less than "
               f"min_residency_ms={config.min_residency_ms} ago")
    return (f"model {model_id!r} cannot load: max_loaded_models={config.max_loaded_models} models are loaded "
            f"and {why} within this request's busy timeout" + (f"; evicted {evicted}" if evicted else ""))


async def _check_memory(ctx: AsyncContext, model_id: str, meta: dict, min_free_memory_mb: int) -> None:
    """The memory guard of :func:`residency_make_room` (R6.5).

    Raises:
        InsufficientMemory: estimated footprint + ``min_free_memory_mb`` > available memory of the best
            live worker (none published: no refusal).
    """
    footprint_mb = specs.estimated_footprint_mb(meta["family"], meta.get("slots") or 1, meta.get("load_options"))
    available_mb = await _available_memory_mb(ctx)
    if available_mb is not None and footprint_mb + min_free_memory_mb > available_mb:
        raise InsufficientMemory(
            f"model {model_id!r} needs about {footprint_mb} MB plus the {min_free_memory_mb} MB "
            f"headroom (min_free_memory_mb), but the workers have {available_mb} MB available",
            retry_after_s=5)


async def _evict(ctx: AsyncContext, model_id: str, snapshot: dict, demand: float | None,
                 guard: leases.GuardHeld | None, evicted: list[str]) -> int:
    """One pass of :func:`residency_make_room`'s eviction over ``snapshot``: tear down idle ready models in
    the policy's order until ``model_id`` fits within ``max_loaded_models``; each victim is appended to
    ``evicted``. ``demand``: ``model_id``'s demand (None = unbounded). Returns how many more must go
    (<= 0: room made)."""
    config = get_config()
    loaded = [m for m, status in snapshot.items() if m != model_id and status["state"] in COUNTED_STATES]
    need = len(loaded) + 1 - config.max_loaded_models
    ready = [m for m in loaded if snapshot[m]["state"] == ModelState.READY]
    if config.eviction_policy == "lru":
        victims, checks = sorted(ready, key=lambda m: snapshot[m]["last_used_ms"]), dict[str, Any]()
    else:  # the least used first; among equals, the least recently used
        victims = sorted(ready, key=lambda m: (snapshot[m]["use"], snapshot[m]["last_used_ms"]))
        checks = {"min_resident_ms": config.min_residency_ms, "below_use": demand}
    for victim in victims:
        if need <= 0:
            break
        if guard is not None:
            await guard.check()  # never evict on a guard this process no longer holds (R6.6)
        lease = await ctx.scheduler.try_acquire(victim, ModelState.READY, **checks)
        if lease is None:  # busy, queued, changed state, in more use or too recently loaded (R6.1, R6.3)
            continue
        # The teardown finishes (and releases the victim) even if our requester leaves (R4.5).
        await leases.hold(ctx, lease, lambda held: model_teardown(ctx, held, f"eviction for {model_id}"))
        log.info("evicted %s (%s, recent use %.2f) to load %s", victim, config.eviction_policy,
                 snapshot[victim]["use"], model_id)
        metrics.record_soon(metrics.count(metrics.EVICTIONS, victim))
        evicted.append(victim)
        need -= 1
    return need
