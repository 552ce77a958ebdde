"""Registry services on the real database: config sync, publication to Redis, audit log, admin."""
from __future__ import annotations

import json

import pytest
from django.contrib.auth.models import User

from audiosite.serverconfig import parse_config
from inference.scheduler import Keys
from registry import services
from registry.models import LifecycleEvent, ModelRegistration

from .helpers import unique_prefix

pytestmark = pytest.mark.django_db


def config_with(*models):
    return parse_config({"models": list(models)})


def test_sync_creates_updates_and_removes_config_models():
    report = services.registration_sync_config(config_with({"id": "a", "family": "silero_vad"},
                                                           {"id": "b", "family": "whisper", "busy_timeout_ms": 50}))
    assert report["created"] == ["a", "b"]
    b = ModelRegistration.objects.get(model_id="b")
    assert (b.task, b.mode, b.busy_timeout_ms, b.source, b.state) == ("asr", "offline", 50, "config", "unloaded")

    report = services.registration_sync_config(config_with({"id": "a", "family": "silero_vad"},
                                                           {"id": "b", "family": "whisper", "busy_timeout_ms": 70}))
    assert report == {"created": [], "updated": ["b"], "unchanged": ["a"], "removed": []}
    assert ModelRegistration.objects.get(model_id="b").busy_timeout_ms == 70

    report = services.registration_sync_config(config_with({"id": "a", "family": "silero_vad"}))
    assert report["removed"] == ["b"]
    assert list(ModelRegistration.objects.values_list("model_id", flat=True)) == ["a"]
    events = list(LifecycleEvent.objects.order_by("id").values_list("model_id", "event", "outcome"))
    assert events == [("a", "register", "ok"), ("b", "register", "ok"), ("b", "update", "ok"),
                      ("b", "unregister", "ok")]


def test_sync_leaves_api_registrations_alone():
    ModelRegistration.objects.create(model_id="dyn", family="silero_vad", task="vad", source="api")
    services.registration_sync_config(config_with({"id": "a", "family": "silero_vad"}))
    assert set(ModelRegistration.objects.values_list("model_id", flat=True)) == {"a", "dyn"}


def test_publish_writes_metadata_and_marks_changed_models_unloaded(redis_client):
    keys = Keys(unique_prefix())
    services.registration_sync_config(config_with({"id": "a", "family": "silero_vad"}))
    assert services.registry_publish(redis_client, keys) == ["a"]
    meta = json.loads(redis_client.hget(keys.models_meta, "a"))
    assert meta["family"] == "silero_vad" and meta["task"] == "vad" and meta["path"] is None
    assert redis_client.get(keys.model("a") + ":cap") == "1"
    assert redis_client.get(keys.runtime) == "legacy"
    redis_client.hset(keys.model("a") + ":load", mapping={"state": "ready", "owner": "w", "boot": "b"})
    services.registry_publish(redis_client, keys)  # unchanged: state kept
    assert redis_client.hget(keys.model("a") + ":load", "state") == "ready"
    services.registration_sync_config(config_with({"id": "a", "family": "silero_vad",
                                                   "default_request_options": {"threshold": 0.6}}))
    services.registry_publish(redis_client, keys)
    assert redis_client.hget(keys.model("a") + ":load", "state") == "unloaded"


def test_load_outcomes_are_recorded():
    services.registration_sync_config(config_with({"id": "a", "family": "silero_vad"}))
    services.registration_record_loading("a")
    assert ModelRegistration.objects.get(model_id="a").state == "loading"
    services.registration_record_load("a", False, error="bad file", duration_ms=5)
    row = ModelRegistration.objects.get(model_id="a")
    assert (row.state, row.last_error) == ("unloaded", "bad file")
    services.registration_record_load("a", True, duration_ms=7)
    row = ModelRegistration.objects.get(model_id="a")
    assert (row.state, row.last_error) == ("ready", "") and row.loaded_at is not None
    load_events = LifecycleEvent.objects.filter(event="load").order_by("id")
    assert [(e.outcome, e.duration_ms) for e in load_events] == [("failed", 5), ("ok", 7)]


def test_admin_lists_registrations_and_events(client):
    services.registration_sync_config(config_with({"id": "vad-admin", "family": "silero_vad"}))
    admin = User.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(admin)
    page = client.get("/admin/registry/modelregistration/")
    assert page.status_code == 200 and b"vad-admin" in page.content
    page = client.get("/admin/registry/lifecycleevent/")
    assert page.status_code == 200 and b"register" in page.content
    # Registrations change only through services: no add page in the admin.
    assert client.get("/admin/registry/modelregistration/add/").status_code == 403
