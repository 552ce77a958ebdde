"""Announce each new lifecycle audit row on Redis, so open log pages show it at once.

Rows are written by ``registry.records`` in web processes, workers and management
commands; after the row's transaction commits, its JSON (:func:`event_json`) is
published on ``Keys.audit_events``. The database stays the truth: a notice lost
because Redis is unreachable (or not configured, as in ``manage.py migrate`` on
the embedded default) costs only liveness, and the page shows the row at its next load.
"""
from __future__ import annotations

import json
import logging

from typing import TYPE_CHECKING

from django.conf import settings
from django.db import transaction

from inference.runtime.context import KEYS, sync_redis

if TYPE_CHECKING:
    from registry.models import LifecycleEvent

log = logging.getLogger(__name__)


def event_json(row: LifecycleEvent) -> dict:
    """One audit row as the UI shows it: ``id, model_id, event, outcome, actor, detail, duration_ms``
    and ``created_at`` (ISO 8601 UTC)."""
    return {"id": row.id, "model_id": row.model_id, "event": row.event, "outcome": row.outcome,
            "actor": row.actor, "detail": row.detail, "duration_ms": row.duration_ms,
            "created_at": row.created_at.isoformat(timespec="milliseconds").replace("+00:00", "Z")}


def _publish(payload: str) -> None:
    try:
        sync_redis().publish(KEYS.audit_events, payload)
    except Exception:  # best effort: the row is committed either way
        log.warning("could not announce an audit row on Redis", exc_info=True)


def announce_audit_row(sender, instance: LifecycleEvent, created: bool, **kwargs) -> None:
    """``post_save`` receiver of ``LifecycleEvent`` (connected in ``ui.apps``): after commit, PUBLISH the
    new row's JSON on ``Keys.audit_events``. Without a configured Redis it does nothing."""
    if not created or not settings.REDIS_URL:
        return
    payload = json.dumps(event_json(instance))
    transaction.on_commit(lambda: _publish(payload))
