"""Reads: published registrations and the status snapshot (never reserves anything, R4.7)."""
from __future__ import annotations

import json

from inference.runtime import runtime_name
from inference.runtime.context import KEYS, AsyncContext


async def model_meta_get(ctx: AsyncContext, model_id: str) -> dict | None:
    """Published metadata of one model, or None when it is not registered."""
    raw = await ctx.redis.hget(KEYS.models_meta, model_id)
    return json.loads(raw) if raw else None


async def model_meta_all(ctx: AsyncContext) -> dict[str, dict]:
    """Published metadata of every model, keyed by id."""
    raw = await ctx.redis.hgetall(KEYS.models_meta)
    return {model_id: json.loads(value) for model_id, value in sorted(raw.items())}


def _entry(meta: dict, status: dict, parallel: bool) -> dict:
    entry = {
        "id": meta["id"],
        "object": "model",
        "owned_by": "audiosite",
        "family": meta["family"],
        "task": meta["task"],
        "mode": meta["mode"],
        "state": status["state"],
        "loaded": status["state"] == "ready",
        "path": meta["path"],
    }
    if parallel:
        entry.update(
            slots=meta.get("slots") or 1,
            active_slots=status["active_leases"],
            queued_requests=status["queued"],
            max_parallel_slots=status["loaded_capacity"] or None,
        )
    return entry


async def model_status_list(ctx: AsyncContext, model_id: str | None = None) -> list[dict]:
    """Status entries from one atomic snapshot (R4.7).

    Legacy runtime: no slot fields (R1.2). Parallel runtime: also ``slots``
    (configured), ``active_slots`` (request leases, including requests
    admitted while the model loads), ``queued_requests`` (waiting requests;
    managers not counted) and ``max_parallel_slots`` (the loaded pool's
    advertised capacity; null when not loaded).

    Args:
        model_id: only this model (empty list when unknown).
    """
    metas = await model_meta_all(ctx)
    if model_id is not None:
        metas = {model_id: metas[model_id]} if model_id in metas else {}
    snapshot = await ctx.scheduler.snapshot(list(metas))
    parallel = runtime_name() == "parallel"
    return [_entry(meta, snapshot[mid], parallel) for mid, meta in metas.items()]
