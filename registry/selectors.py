"""Reads: published registrations, the status snapshot (never reserves anything, R4.7), and database facts."""
from __future__ import annotations

from datetime import UTC, datetime

from audiosite.serverconfig import get_config
from inference.runtime.context import AsyncContext
from inference.runtime.metrics import ModelGauges
from inference.runtime.published import meta_all as model_meta_all
from inference.runtime.published import meta_get as model_meta_get
from inference.scheduler import Census, ModelState, ModelStatus

from .models import ModelRegistration

__all__ = ["deployment_census", "model_gauges", "model_meta_all", "model_meta_get", "model_status_list",
           "registration_first_load_published"]


async def deployment_census(ctx: AsyncContext) -> Census:
    """Live workers, whether one is being started, and registered models: one Redis round trip (``census.lua``)."""
    return await ctx.scheduler.census()


def _utc(epoch_ms: int) -> str:
    """ISO 8601 UTC with milliseconds and a ``Z`` (e.g. ``2026-12-01T10:00:00.250Z``) of a Redis-time ms."""
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


#: Fields of a status entry that only callers passing the management gate see (they describe the server's
#: filesystem, not the model's behaviour).
PRIVATE_FIELDS = ("path",)


def _entry(meta: dict, status: ModelStatus, parallel: bool, private: bool) -> dict:
    entry = {
        "id": meta["id"],
        "object": "model",
        "owned_by": "audiosite",
        "family": meta["family"],
        "task": meta["task"],
        "mode": meta["mode"],
        "state": str(status["state"]),
        "loaded": status["state"] == ModelState.READY,
        "last_error": status["error"] or None,
        "retry_at": _utc(status["retry_at_ms"]) if status["retry_at_ms"] else None,
    }
    if private:
        entry["path"] = meta["path"]
    if parallel:
        entry.update(
            slots=meta.get("slots") or 1,
            active_slots=status["active_leases"],
            queued_requests=status["queued"],
            max_parallel_slots=status["loaded_capacity"] or None,
        )
    return entry


async def model_status_list(ctx: AsyncContext, model_id: str | None = None, *,
                            private: bool = False) -> list[dict]:
    """Status entries from one atomic snapshot (R4.7).

    Every entry: ``id, object, owned_by, family, task, mode, state, loaded``,
    ``last_error`` (the last failed load's or lost worker's error, else null) and
    ``retry_at`` (ISO 8601 UTC end of a failed load's backoff, R6.7, else null);
    with ``private`` (the caller passes the management gate) also
    :data:`PRIVATE_FIELDS` (``path``: the checkpoint on the server's disk, or
    None for the family's packaged one). Legacy runtime: no slot fields
    (R1.2). Parallel runtime: also ``slots``
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
    parallel = get_config().runtime == "parallel"
    return [_entry(meta, snapshot[mid], parallel, private) for mid, meta in metas.items()]


async def model_gauges(ctx: AsyncContext) -> list[ModelGauges]:
    """The ``/metrics`` gauges of every registered model, from one atomic snapshot (R4.7).

    The same reads as :func:`model_status_list` (the published registry, then
    ``snapshot.lua``), so on the parallel runtime ``queued``, ``active`` and
    ``slots`` equal ``/v1/models``' ``queued_requests``, ``active_slots`` and
    ``slots`` of the same instant, and ``loaded`` its ``loaded``.
    """
    metas = await model_meta_all(ctx)
    snapshot = await ctx.scheduler.snapshot(list(metas))
    return [ModelGauges(mid, int(snapshot[mid]["queued"]), int(snapshot[mid]["active_leases"]),
                        int(meta.get("slots") or 1), snapshot[mid]["state"] == ModelState.READY)
            for mid, meta in metas.items()]


def registration_first_load_published(model_id: str) -> bool:
    """True when ``model_id`` has ever finished a load (``loaded_at`` set; used by R5.4)."""
    return ModelRegistration.objects.filter(model_id=model_id, loaded_at__isnull=False).exists()
