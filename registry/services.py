"""Writes to the registry: the only module that changes a ``ModelRegistration``.

Names follow ``<entity>_<action>``. Every transition writes a
``LifecycleEvent``. Registrations are also published to Redis (one JSON per
model in ``as:models``) so every web and worker process reads the same
metadata without touching the database on the request path.
"""
from __future__ import annotations

import json
import logging

from django.db import transaction
from django.utils import timezone

from audiosite.serverconfig import ModelConfig, ServerConfig
from inference import specs

from .models import LifecycleEvent, LifecycleState, ModelRegistration

log = logging.getLogger(__name__)


def _entry_fields(entry: ModelConfig) -> dict:
    return {
        "family": entry.family,
        "task": entry.task or specs.default_task(entry.family),
        "mode": entry.mode,
        "path": entry.path or "",
        "options": {
            "load_options": entry.load_options,
            "session_options": entry.session_options,
            "default_request_options": entry.default_request_options,
        },
        "busy_timeout_ms": entry.busy_timeout_ms,
        "slots": entry.slots,
        "lazy": entry.lazy,
    }


def lifecycle_event_create(model_id: str, event: str, ok: bool, *, actor: str = "", detail: str = "",
                           duration_ms: int | None = None) -> LifecycleEvent:
    """Append one audit row."""
    return LifecycleEvent.objects.create(
        model_id=model_id,
        event=event,
        outcome=LifecycleEvent.Outcome.OK if ok else LifecycleEvent.Outcome.FAILED,
        actor=actor,
        detail=detail[:4000],
        duration_ms=duration_ms,
    )


@transaction.atomic
def registration_sync_config(config: ServerConfig, actor: str = "config") -> dict[str, list[str]]:
    """Upsert the config file's models; remove config-sourced rows the file no longer lists.

    Registrations made through the management API are left alone. A config
    entry whose id is held by an API registration takes it over (the file wins).

    Returns:
        ``{"created": [...], "updated": [...], "unchanged": [...], "removed": [...]}`` (model ids).
    """
    report: dict[str, list[str]] = {"created": [], "updated": [], "unchanged": [], "removed": []}
    listed = set()
    for entry in config.models:
        listed.add(entry.id)
        fields = _entry_fields(entry)
        row = ModelRegistration.objects.select_for_update().filter(model_id=entry.id).first()
        if row is None:
            ModelRegistration.objects.create(model_id=entry.id, source=ModelRegistration.Source.CONFIG, **fields)
            lifecycle_event_create(entry.id, "register", True, actor=actor, detail=json.dumps(fields))
            report["created"].append(entry.id)
            continue
        changed = any(getattr(row, k) != v for k, v in fields.items()) or row.source != ModelRegistration.Source.CONFIG
        if changed:
            for key, value in fields.items():
                setattr(row, key, value)
            row.source = ModelRegistration.Source.CONFIG
            row.state = LifecycleState.UNLOADED
            row.save()
            lifecycle_event_create(entry.id, "update", True, actor=actor, detail=json.dumps(fields))
            report["updated"].append(entry.id)
        else:
            report["unchanged"].append(entry.id)
    stale = ModelRegistration.objects.filter(source=ModelRegistration.Source.CONFIG).exclude(model_id__in=listed)
    for row in stale:
        lifecycle_event_create(row.model_id, "unregister", True, actor=actor, detail="no longer in the config file")
        report["removed"].append(row.model_id)
    stale.delete()
    return report


def registry_publish(redis_client, keys, runtime: str = "legacy") -> list[str]:
    """Publish every registration to Redis, replacing what was there (one MULTI).

    Each model's slot count is its ``slots`` (1 when unset; always 1 on the
    legacy runtime). A model whose published metadata changed is marked
    unloaded so the next request loads the new configuration. The runtime
    name is recorded in ``as:runtime`` (see :func:`runtime_claim`).

    Args:
        redis_client: synchronous ``redis.Redis`` (decode_responses=True).
        keys: ``inference.scheduler.Keys``.

    Returns:
        The published model ids.
    """
    rows = list(ModelRegistration.objects.all())
    previous = redis_client.hgetall(keys.models_meta)
    pipe = redis_client.pipeline(transaction=True)
    pipe.delete(keys.models_meta)
    for row in rows:
        meta = json.dumps(row.as_meta(), sort_keys=True)
        pipe.hset(keys.models_meta, row.model_id, meta)
        pipe.set(keys.model(row.model_id) + ":cap", (row.slots or 1) if runtime == "parallel" else 1)
        if previous.get(row.model_id) not in (None, meta):
            pipe.hset(keys.model(row.model_id) + ":load", mapping={"state": "unloaded", "error": "configuration changed"})
    pipe.set(keys.runtime, runtime)
    pipe.execute()
    return [row.model_id for row in rows]


def registration_record_load(model_id: str, ok: bool, *, error: str = "", duration_ms: int | None = None,
                             actor: str = "") -> None:
    """Record the outcome of a load: state ready/unloaded, last error, an audit row."""
    updates = {"state": LifecycleState.READY if ok else LifecycleState.UNLOADED, "last_error": "" if ok else error,
               "updated_at": timezone.now()}
    if ok:
        updates["loaded_at"] = timezone.now()
    ModelRegistration.objects.filter(model_id=model_id).update(**updates)
    lifecycle_event_create(model_id, "load", ok, actor=actor, detail=error, duration_ms=duration_ms)


def registration_record_loading(model_id: str, actor: str = "") -> None:
    """Record that a load started (state ``loading``)."""
    ModelRegistration.objects.filter(model_id=model_id).update(state=LifecycleState.LOADING, updated_at=timezone.now())


def registration_record_lost(model_ids: list[str], reason: str, actor: str = "") -> None:
    """Record that loaded pools are gone (worker stopped or died): state ``unloaded``."""
    if not model_ids:
        return
    ModelRegistration.objects.filter(model_id__in=model_ids).update(
        state=LifecycleState.UNLOADED, last_error=reason, updated_at=timezone.now()
    )
    for model_id in model_ids:
        lifecycle_event_create(model_id, "unload", True, actor=actor, detail=reason)


class RuntimeMismatch(Exception):
    """Another runtime is already recorded for this deployment (R1.4)."""


def runtime_claim(redis_client, keys, runtime: str) -> None:
    """Record ``runtime`` for the deployment, or refuse when another one is recorded (R1.4).

    Raises:
        RuntimeMismatch: Redis already records a different runtime; every
            process of one deployment must run the same runtime.
    """
    redis_client.set(keys.runtime, runtime, nx=True)
    recorded = redis_client.get(keys.runtime)
    if recorded != runtime:
        raise RuntimeMismatch(
            f"this deployment runs the {recorded} runtime (recorded in Redis key {keys.runtime}); "
            f"refusing to start a {runtime} process. Stop every process, delete that key, and start all "
            "processes with the same runtime."
        )


def registration_record_unload(model_id: str, ok: bool, *, detail: str = "", duration_ms: int | None = None,
                               actor: str = "") -> None:
    """Record an unload: state ``unloaded`` and an audit row."""
    ModelRegistration.objects.filter(model_id=model_id).update(
        state=LifecycleState.UNLOADED, last_error="" if ok else detail, updated_at=timezone.now()
    )
    lifecycle_event_create(model_id, "unload", ok, actor=actor, detail=detail, duration_ms=duration_ms)
