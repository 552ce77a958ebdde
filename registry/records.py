"""Writes to the database: the only module that changes a ``ModelRegistration``, adds a ``LifecycleEvent``
or issues an ``ApiToken``.

Names follow ``<entity>_<action>``. Functions here are synchronous (Django
ORM); async callers wrap them in ``sync_to_async``. Who calls what: the
management transitions (``registry.services``) save and remove entries; the
manager of a teardown (``inference.services.model_teardown``) records its
steps; the worker records its loads and the pools it loses when it stops.
Each step is recorded by exactly one process. Registrations are also
published to Redis (one JSON per model) so every web and worker process reads
the same metadata without touching the database on the request path.
"""
from __future__ import annotations

import json
import logging
import secrets
from typing import Any

from django.db import DataError, transaction
from django.utils import timezone

from audiosite.errors import InvalidRequest
from audiosite.serverconfig import ModelConfig, ServerConfig, slot_count
from inference import specs
from inference.scheduler import Scheduler

from .models import ApiToken, LifecycleEvent, LifecycleState, ModelRegistration

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
            "voice_presets": {name: preset.model_dump() for name, preset in entry.voice_presets.items()},
            "default_voice_preset": entry.default_voice_preset,
            **({"modes": list(entry.modes)} if entry.modes else {}),
            "max_run_ms": entry.max_run_ms,
            # only when set: rows registered before these keys existed stay unchanged
            **({"max_batch": entry.max_batch} if entry.max_batch is not None else {}),
            **({"batch_window_ms": entry.batch_window_ms} if entry.batch_window_ms is not None else {}),
        },
        "busy_timeout_ms": entry.busy_timeout_ms,
        "slots": entry.slots,
        "lazy": entry.lazy,
    }


def api_token_issue(user, *, revoke_others: bool = False) -> str:
    """Create an API token for ``user`` and return its text: the only time the text exists.

    Only its digest is stored (:class:`registry.models.ApiToken`). The user's
    earlier tokens stay valid unless ``revoke_others`` (then they are deleted
    in the same transaction).
    """
    token = secrets.token_urlsafe(32)  # 256 random bits, 43 URL-safe characters
    with transaction.atomic():
        if revoke_others:
            ApiToken.objects.filter(user=user).delete()
        ApiToken.objects.create(user=user, digest=ApiToken.digest_of(token))
    return token


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


def _entry_changed(row: ModelRegistration, fields: dict) -> bool:
    """Whether saving a config entry's ``fields`` over ``row`` changes it (or takes an API row over)."""
    return any(getattr(row, k) != v for k, v in fields.items()) or row.source != ModelRegistration.Source.CONFIG


def _stale_config_rows(config: ServerConfig):
    """Config-sourced registrations the file no longer lists (a queryset)."""
    listed = [entry.id for entry in config.models]
    return ModelRegistration.objects.filter(source=ModelRegistration.Source.CONFIG).exclude(model_id__in=listed)


def registration_sync_plan(config: ServerConfig) -> dict[str, list[str]]:
    """The report :func:`registration_sync_config` would return for ``config`` now, writing nothing."""
    rows = {row.model_id: row for row in ModelRegistration.objects.filter(model_id__in=[e.id for e in config.models])}
    report: dict[str, list[str]] = {"created": [], "updated": [], "unchanged": [], "removed": []}
    for entry in config.models:
        row = rows.get(entry.id)
        outcome = "created" if row is None else "updated" if _entry_changed(row, _entry_fields(entry)) else "unchanged"
        report[outcome].append(entry.id)
    report["removed"] = list(_stale_config_rows(config).values_list("model_id", flat=True))
    return report


@transaction.atomic
def registration_sync_config(config: ServerConfig, actor: str = "config") -> dict[str, list[str]]:
    """Upsert the config file's models; remove config-sourced rows the file no longer lists.

    Registrations made through the management API are left alone. A config
    entry whose id is held by an API registration takes it over (the file wins).

    Returns:
        ``{"created": [...], "updated": [...], "unchanged": [...], "removed": [...]}`` (model ids).
    """
    report: dict[str, list[str]] = {"created": [], "updated": [], "unchanged": [], "removed": []}
    for entry in config.models:
        fields = _entry_fields(entry)
        row = ModelRegistration.objects.select_for_update().filter(model_id=entry.id).first()
        if row is None:
            ModelRegistration.objects.create(model_id=entry.id, source=ModelRegistration.Source.CONFIG, **fields)
            lifecycle_event_create(entry.id, "register", True, actor=actor, detail=json.dumps(fields))
            report["created"].append(entry.id)
            continue
        if _entry_changed(row, fields):
            for key, value in fields.items():
                setattr(row, key, value)
            row.source = ModelRegistration.Source.CONFIG
            row.state = LifecycleState.UNLOADED
            row.save()
            lifecycle_event_create(entry.id, "update", True, actor=actor, detail=json.dumps(fields))
            report["updated"].append(entry.id)
        else:
            report["unchanged"].append(entry.id)
    stale = _stale_config_rows(config)
    for row in stale:
        lifecycle_event_create(row.model_id, "unregister", True, actor=actor, detail="no longer in the config file")
        report["removed"].append(row.model_id)
    stale.delete()
    return report


def registry_start(config: ServerConfig, scheduler: Scheduler) -> tuple[dict[str, list[str]], list[str]]:
    """What every start runs (``manage.py sync_config``, ``manage.py serve``): claim the deployment's
    runtime (R1.4), upsert the config file's models (:func:`registration_sync_config`) and publish
    every registration (:func:`registry_publish`).

    Returns:
        ``(report, published ids)``: the upsert's report and the ids now published.

    Raises:
        RuntimeMismatch: the deployment's Redis runs the other runtime (nothing is written).
    """
    scheduler.claim_runtime(config.runtime)
    report = registration_sync_config(config)
    return report, registry_publish(scheduler, config.runtime)


def registry_start_summary(report: dict[str, list[str]], published: list[str]) -> str:
    """The line a start prints about the registry (:func:`registry_start`'s result)."""
    return (f"registry: created {report['created']}, updated {report['updated']}, removed {report['removed']}; "
            f"published {len(published)} model(s)")


def registry_publish(scheduler: Scheduler, runtime: str = "legacy") -> list[str]:
    """Publish every registration to Redis, replacing what was there (one script, ``publish_registry.lua``).

    Each model's slot count is its ``slots`` (1 when unset; always 1 on the
    legacy runtime). A model whose published metadata changed is marked
    unloaded so the next request loads the new configuration. The runtime
    name is recorded too (R1.4).

    Args:
        scheduler: the process's scheduler on a synchronous client (``sync_scheduler()``).
        runtime: 'legacy' or 'parallel'.

    Returns:
        The published model ids.
    """
    rows = list(ModelRegistration.objects.all())
    entries = [(row.as_meta(), slot_count(row.slots, runtime)) for row in rows]
    scheduler.publish_registry(entries, runtime)
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


def registration_record_loading(model_id: str) -> None:
    """Record that a load started (state ``loading``; the load's outcome adds the audit row)."""
    registration_record_state(model_id, LifecycleState.LOADING)


def registration_record_lost(model_ids: list[str], reason: str, actor: str = "") -> None:
    """Record that loaded pools are gone (worker stopped or died): state ``unloaded``."""
    if not model_ids:
        return
    ModelRegistration.objects.filter(model_id__in=model_ids).update(
        state=LifecycleState.UNLOADED, last_error=reason, updated_at=timezone.now()
    )
    for model_id in model_ids:
        lifecycle_event_create(model_id, "unload", True, actor=actor, detail=reason)


def registration_record_crash(model_id: str, error: str, actor: str = "") -> None:
    """Record that a loaded model's process ended unasked (a crash, or killed for a run past its deadline,
    R3.6): state ``unloaded``, ``last_error`` = ``error``, and a failed ``crash`` audit row."""
    ModelRegistration.objects.filter(model_id=model_id).update(
        state=LifecycleState.UNLOADED, last_error=error, updated_at=timezone.now())
    lifecycle_event_create(model_id, "crash", False, actor=actor, detail=error)


def registration_record_state(model_id: str, state: str, error: str | None = None) -> None:
    """Record a lifecycle state of a registration (e.g. the first step of a teardown); no audit row."""
    updates = {"state": state, "updated_at": timezone.now()}
    if error is not None:
        updates["last_error"] = error
    ModelRegistration.objects.filter(model_id=model_id).update(**updates)


def registration_record_teardown(model_id: str, *, ok: bool, detail: str, duration_ms: int, actor: str,
                                 event: str = "teardown", audit: bool = True) -> None:
    """Record the end of a teardown: state ``unloaded``, and one audit row ``event`` when ``audit``.

    Args:
        ok: False when closing the pool raised (``detail`` is then the error, kept as ``last_error``).
        event: ``teardown``, or ``idle_retire`` for idle retirement (R6.4).
        audit: False when there was no pool to account for (nothing to audit).
    """
    ModelRegistration.objects.filter(model_id=model_id).update(
        state=LifecycleState.UNLOADED, last_error="" if ok else detail, updated_at=timezone.now())
    if audit:
        lifecycle_event_create(model_id, event, ok, actor=actor, detail=detail, duration_ms=duration_ms)


def registration_meta_of(entry: ModelConfig, source: Any) -> dict:
    """The metadata ``entry`` would publish once saved (``ModelRegistration.as_meta`` of an unsaved row)."""
    return ModelRegistration(model_id=entry.id, source=source, **_entry_fields(entry)).as_meta()


def registration_save(entry: ModelConfig, actor: str, event: str, state: str) -> ModelRegistration:
    """Create or update the row of ``entry`` (state ``state`` for an update) and add one audit row ``event``.

    Raises:
        InvalidRequest: the database refuses a value (e.g. out of range): the caller's fault, 400.
    """
    try:
        return _registration_save(entry, actor, event, state)
    except DataError as exc:
        raise InvalidRequest(f"the entry cannot be stored: {str(exc).splitlines()[0]}") from None


@transaction.atomic
def _registration_save(entry: ModelConfig, actor: str, event: str, state: str) -> ModelRegistration:
    fields = _entry_fields(entry)
    row = ModelRegistration.objects.select_for_update().filter(model_id=entry.id).first()
    if row is None:
        row = ModelRegistration.objects.create(model_id=entry.id, source=ModelRegistration.Source.API, **fields)
    else:
        for key, value in fields.items():
            setattr(row, key, value)
        row.state = state
        row.save()
    lifecycle_event_create(entry.id, event, True, actor=actor, detail=json.dumps(fields))
    return row


@transaction.atomic
def registration_remove(model_id: str, actor: str, duration_ms: int) -> None:
    """Delete the row of ``model_id`` and add the audit row ``unregister``."""
    ModelRegistration.objects.filter(model_id=model_id).delete()
    lifecycle_event_create(model_id, "unregister", True, actor=actor, duration_ms=duration_ms)
