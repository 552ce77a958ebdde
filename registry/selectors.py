"""Reads: published registrations, the status snapshot (never reserves anything, R4.7), and database facts."""
from __future__ import annotations

import json
import math
from datetime import UTC, datetime

from audiosite.serverconfig import get_config
from inference import specs
from inference.backend import resolve_backend
from inference.runtime.context import AsyncContext
from inference.runtime.metrics import ModelGauges
from inference.runtime.published import ids_all as model_ids_all
from inference.runtime.published import meta_all as model_meta_all
from inference.runtime.published import meta_get as model_meta_get
from inference.scheduler import Census, ModelState, ModelStatus

from .models import LifecycleEvent, ModelRegistration

__all__ = ["deployment_backend", "deployment_census", "lifecycle_event_facets", "lifecycle_events_recent",
           "model_board", "model_board_entry", "model_gauges", "model_meta_all", "model_meta_get",
           "model_request_stats", "model_status_list", "registered_snapshot", "registration_body_of",
           "registration_first_load_published", "registration_get"]


async def deployment_census(ctx: AsyncContext) -> Census:
    """Live workers, whether one is being started, and registered models: one Redis round trip (``census.lua``)."""
    return await ctx.scheduler.census()


def deployment_backend(census: Census, own_backend: str) -> str:
    """``/health``'s ``backend``: 'cuda' when every live worker reports that its sessions get the CUDA
    provider (``census.cuda_workers``, each worker's own probe), 'cpu' when any live worker does not;
    with no live worker, ``own_backend``, this web process's own probe (``serve`` on one machine: the
    same machine as its workers)."""
    if census.live_workers == 0:
        return own_backend
    return "cuda" if census.cuda_workers == census.live_workers else "cpu"


ENTRY_KEYS = ("id", "family", "path", "task", "mode", "modes", "slots", "busy_timeout_ms", "max_run_ms", "max_batch",
              "batch_window_ms", "lazy", "load_options", "session_options", "default_request_options",
              "voice_presets", "default_voice_preset")
"""The keys of a management entry: every key a model entry of the config file can set (``ModelConfig``)."""


def registration_body_of(meta: dict) -> dict:
    """The management body that registers the published entry ``meta`` exactly as it is.

    Every key of :data:`ENTRY_KEYS` whose value is set (None left out: an absent key takes the
    same default, and the legacy runtime refuses any explicit ``slots``, null included, R1.2).
    """
    body = {key: meta[key] for key in ENTRY_KEYS if meta.get(key) is not None}
    return json.loads(json.dumps(body))  # a deep copy: callers may change it


def _utc(epoch_ms: int) -> str:
    """ISO 8601 UTC with milliseconds and a ``Z`` (e.g. ``2026-12-01T10:00:00.250Z``) of a Redis-time ms."""
    return datetime.fromtimestamp(epoch_ms / 1000, UTC).isoformat(timespec="milliseconds").replace(
        "+00:00", "Z")


#: Fields of a status entry that only callers passing the management gate see: the rest of the entry as a
#: management body sets it (``path`` describes the server's filesystem; option blocks may too).
PRIVATE_FIELDS = tuple(key for key in ENTRY_KEYS if key not in ("id", "family", "task", "mode", "modes", "slots"))


async def registered_snapshot(ctx: AsyncContext, model_ids: list[str]) -> dict[str, tuple[dict, ModelStatus]]:
    """Each model's published registration and its status, read together by one ``snapshot.lua`` call
    (R4.7): an entry built from the pair shows one configuration with the state of that same instant,
    never the old configuration with the new pool's state, even while reconfigurations run. Every model
    comes from the same instant too. Models of ``model_ids`` no longer registered at that instant are
    left out; order kept.

    Returns:
        ``{model_id: (registration, status)}``, the registration as :func:`model_meta_get` gives it.
    """
    snapshot = await ctx.scheduler.snapshot(model_ids)
    return {mid: (json.loads(status["registration"]), status) for mid, status in snapshot.items()
            if status["registration"]}


def _entry(meta: dict, status: ModelStatus, parallel: bool, private: bool) -> dict:
    entry = {
        "id": meta["id"],
        "object": "model",
        "created": meta.get("created") or 0,
        "owned_by": "audiosite",
        "family": meta["family"],
        "task": meta["task"],
        "mode": meta["mode"],
        "modes": specs.registration_modes(meta),
        "state": str(status["state"]),
        "loaded": status["state"] == ModelState.READY,
        "last_error": status["error"] or None,
        "retry_at": _utc(status["retry_at_ms"]) if status["retry_at_ms"] else None,
    }
    if private:  # the whole entry, as a management body would set it
        entry["path"] = meta["path"]
        body = registration_body_of(meta)
        entry.update({key: body[key] for key in PRIVATE_FIELDS if key in body})
    if parallel:
        entry.update(
            slots=meta.get("slots") or 1,
            active_slots=status["active_leases"],
            queued_requests=status["queued"],
            max_parallel_slots=status["loaded_capacity"] or None,
            **mode_counts(meta),
        )
    return entry


def mode_counts(meta: dict) -> dict:
    """Per mode the registration serves, the largest slot count admitted here (``admitted_slots_by_mode``,
    R9.1/R9.2: capacity and admission table together), and, when it serves streams, ``max_streams``:
    how many of its streams hold slots at once (``inference.specs.stream_slot_count``)."""
    backend = resolve_backend(get_config().backend)  # cached after the first call
    modes = specs.registration_modes(meta)
    out: dict = {"admitted_slots_by_mode": {mode: specs.largest_slot_count(meta["family"], meta["task"], mode, backend)
                                            for mode in modes}}
    if "streaming" in modes:
        out["max_streams"] = specs.stream_slot_count(meta["family"], meta["task"], meta.get("slots") or 1, backend)
    return out


async def model_status_list(ctx: AsyncContext, model_id: str | None = None, *,
                            private: bool = False, include_params: bool = False) -> list[dict]:
    """Status entries from one atomic snapshot (R4.7).

    Every entry: ``id, object, owned_by, family, task, mode, modes`` (the modes it serves: its own or
    its family's), ``state, loaded``,
    ``last_error`` (the last failed load's or lost worker's error, else null) and
    ``retry_at`` (ISO 8601 UTC end of a failed load's backoff, R6.7, else null);
    with ``private`` (the caller passes the management gate) also
    :data:`PRIVATE_FIELDS` (``path``: the checkpoint on the server's disk, or
    None for the family's packaged one; the option blocks, voice presets,
    ``busy_timeout_ms`` and ``lazy`` when set: the entry a management body
    would send back unchanged). Legacy runtime: no slot fields
    (R1.2). Parallel runtime: also ``slots``
    (configured), ``active_slots`` (request leases, including requests
    admitted while the model loads), ``queued_requests`` (waiting requests;
    managers not counted), ``max_parallel_slots`` (the loaded pool's
    advertised capacity; null when not loaded) and :func:`mode_counts`
    (``admitted_slots_by_mode``, ``max_streams``).

    Every entry has ``created`` (Unix seconds of the registration; 0 when unknown), as OpenAI's model
    object does. With ``include_params`` every entry also has ``request_options``: the JSON Schema of
    the options its family takes in a request (``model_specs/<family>.json``; ``{}`` when none).
    After the registered models come the aliases (``ServerConfig.aliases``, those whose target is
    registered and whose name is no registered id), each a copy of its target's entry with its own
    ``id`` and ``alias_of`` (the target's id).

    Args:
        model_id: only this model or alias (empty list when unknown).
    """
    all_ids = await model_ids_all(ctx)  # ids only: the registrations come with the snapshot
    registered = set(all_ids)
    config = get_config()
    aliases = {alias: target for alias, target in config.aliases().items()
               if alias not in registered and target in registered}
    if model_id is None:
        ids, shown_aliases = all_ids, aliases
    elif model_id in registered:
        ids, shown_aliases = [model_id], {}
    elif model_id in aliases:
        ids, shown_aliases = [aliases[model_id]], {model_id: aliases[model_id]}
    else:
        return []
    parallel = config.runtime == "parallel"
    entries = {mid: _entry(meta, status, parallel, private)
               for mid, (meta, status) in (await registered_snapshot(ctx, ids)).items()}
    if include_params:
        for entry in entries.values():
            entry["request_options"] = (specs.get_spec(entry["family"]) or {}).get("request_options") or {}
    listed = [entries[mid] for mid in ids if mid in entries] if model_id is None or model_id in registered else []
    return listed + [{**entries[target], "id": alias, "alias_of": target}
                     for alias, target in sorted(shown_aliases.items()) if target in entries]


async def model_board(ctx: AsyncContext) -> list[dict]:
    """The UI's status board: every model's ``/v1/models`` entry plus what an operator watches, from
    the same one atomic snapshot (R4.7); never the private fields.

    Each entry is :func:`model_status_list`'s (without ``path``) with, on both runtimes:
    ``slots`` (configured; 1 on legacy), ``active_slots``, ``queued_requests``,
    ``max_parallel_slots`` (null while not loaded), ``admitted_slots`` (N: slot counts 1..N may be
    configured here, the advertised capacity and the admission table together), ``queued_managers``, ``worker`` (Celery
    hostname holding or loading the pool, else null) and ``last_used_at`` (ISO 8601 UTC end of
    the last work, else null), and :func:`mode_counts`. Ordered by id.
    """
    snapshot = await registered_snapshot(ctx, await model_ids_all(ctx))
    return [_board_entry(meta, status) for meta, status in snapshot.values()]


async def model_board_entry(ctx: AsyncContext, model_id: str) -> tuple[dict, dict] | None:
    """One model's published registration and its :func:`model_board` entry, from one snapshot (R4.7:
    the configuration a page shows and the state beside it are of the same instant); None when
    ``model_id`` is not registered."""
    pair = (await registered_snapshot(ctx, [model_id])).get(model_id)
    return None if pair is None else (pair[0], _board_entry(*pair))


def _board_entry(meta: dict, status: ModelStatus) -> dict:
    backend = resolve_backend(get_config().backend)  # cached after the first call
    entry = _entry(meta, status, False, False)
    entry.update(
        slots=meta.get("slots") or 1,
        active_slots=status["active_leases"],
        queued_requests=status["queued"],
        max_parallel_slots=status["loaded_capacity"] or None,
        admitted_slots=specs.largest_slot_count(meta["family"], meta["task"], meta["mode"], backend),
        queued_managers=status["queued_managers"],
        **mode_counts(meta),
        worker=status["worker"] or None,
        last_used_at=_utc(status["last_used_ms"]) if status["last_used_ms"] else None,
    )
    return entry


async def model_request_stats(ctx: AsyncContext, model_id: str) -> dict:
    """Request count and slot hold times of one model (grant → release, ms; ``release.lua``).

    Returns:
        ``{"requests", "mean_held_ms", "recent": n, "p50_held_ms", "p95_held_ms", "max_held_ms"}``;
        the percentiles are over the last (at most 200) requests, nearest-rank, None when there were none.
    """
    stats = await ctx.scheduler.request_stats(model_id)
    recent = sorted(stats.recent_held_ms)

    def rank(p: float) -> int | None:  # nearest-rank percentile
        return recent[max(0, math.ceil(len(recent) * p / 100) - 1)] if recent else None

    return {"requests": stats.requests,
            "mean_held_ms": round(stats.held_ms_total / stats.requests, 1) if stats.requests else None,
            "recent": len(recent), "p50_held_ms": rank(50), "p95_held_ms": rank(95),
            "max_held_ms": recent[-1] if recent else None}


IN_USE_STATES = (ModelState.READY, ModelState.LOADING, ModelState.UNLOADING, ModelState.RECONFIGURING)


def models_in_use(statuses: dict[str, ModelStatus]) -> list[str]:
    """The ids among ``statuses`` (a scheduler snapshot) that a live deployment is using: a pool ready on a
    live worker or a load running (the snapshot reads those of dead workers as unloaded), a teardown in
    progress, or requests and managers holding or waiting for it."""
    return [model_id for model_id, status in statuses.items()
            if status["state"] in IN_USE_STATES or status["active_leases"] or status["queued"]
            or status["manager_leases"] or status["queued_managers"]]


def registration_get(model_id: str) -> ModelRegistration | None:
    """The database row of ``model_id`` or None."""
    return ModelRegistration.objects.filter(model_id=model_id).first()


def lifecycle_events_recent(model_id: str | None = None, event: str | None = None,
                            limit: int = 200) -> list[LifecycleEvent]:
    """The newest audit rows first, optionally of one model and/or one event kind."""
    rows = LifecycleEvent.objects.all()
    if model_id:
        rows = rows.filter(model_id=model_id)
    if event:
        rows = rows.filter(event=event)
    return list(rows[:limit])


def lifecycle_event_facets() -> dict[str, list[str]]:
    """The distinct ``models`` and ``events`` of the audit log, sorted (the log page's filter choices)."""
    rows = LifecycleEvent.objects.order_by()
    return {"models": sorted(rows.values_list("model_id", flat=True).distinct()),
            "events": sorted(rows.values_list("event", flat=True).distinct())}


async def model_gauges(ctx: AsyncContext) -> list[ModelGauges]:
    """The ``/metrics`` gauges of every registered model, from one atomic snapshot (R4.7).

    The same read as :func:`model_status_list` (:func:`registered_snapshot`), so on the parallel
    runtime ``queued``, ``active`` and ``slots`` equal ``/v1/models``' ``queued_requests``,
    ``active_slots`` and ``slots`` of the same instant, and ``loaded`` its ``loaded``.
    """
    snapshot = await registered_snapshot(ctx, await model_ids_all(ctx))
    return [ModelGauges(mid, int(status["queued"]), int(status["active_leases"]), int(meta.get("slots") or 1),
                        status["state"] == ModelState.READY, str(meta.get("task") or ""))
            for mid, (meta, status) in snapshot.items()]


def registration_first_load_published(model_id: str) -> bool:
    """True when ``model_id`` has ever finished a load (``loaded_at`` set; used by R5.4)."""
    return ModelRegistration.objects.filter(model_id=model_id, loaded_at__isnull=False).exists()
