"""Reads: published registrations and the status snapshot (never reserves anything, R4.7)."""
from __future__ import annotations

import json

from inference.runtime.context import KEYS, AsyncContext


async def model_meta_get(ctx: AsyncContext, model_id: str) -> dict | None:
    """Published metadata of one model, or None when it is not registered."""
    raw = await ctx.redis.hget(KEYS.models_meta, model_id)
    return json.loads(raw) if raw else None


async def model_meta_all(ctx: AsyncContext) -> dict[str, dict]:
    """Published metadata of every model, keyed by id."""
    raw = await ctx.redis.hgetall(KEYS.models_meta)
    return {model_id: json.loads(value) for model_id, value in sorted(raw.items())}


def _entry(meta: dict, status: dict) -> dict:
    return {
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


async def model_status_list(ctx: AsyncContext, model_id: str | None = None) -> list[dict]:
    """Status entries (API.md legacy shape, no slot fields) from one atomic snapshot.

    Args:
        model_id: only this model (empty list when unknown).
    """
    metas = await model_meta_all(ctx)
    if model_id is not None:
        metas = {model_id: metas[model_id]} if model_id in metas else {}
    snapshot = await ctx.scheduler.snapshot(list(metas))
    return [_entry(meta, snapshot[mid]) for mid, meta in metas.items()]
