"""Registry records on the real database: config sync, publication to Redis, audit log, admin."""
from __future__ import annotations

import hashlib
import importlib
import io
import json

import pytest
from asgiref.sync import async_to_sync
from django.apps import apps as django_apps
from django.contrib.auth.models import User
from django.core.management import call_command
from django.db import connection
from rest_framework.exceptions import AuthenticationFailed
from rest_framework.request import Request
from rest_framework.test import APIRequestFactory

from audiosite.serverconfig import parse_config
from inference.scheduler import Keys, Scheduler
from registry import records
from registry.authentication import AsyncTokenAuthentication
from registry.models import ApiToken, LifecycleEvent, ModelRegistration

from .support.rigs import unique_prefix

pytestmark = pytest.mark.django_db


def config_with(*models):
    return parse_config({"models": list(models)})


def test_sync_creates_updates_and_removes_config_models():
    report = records.registration_sync_config(config_with({"id": "a", "family": "silero_vad"},
                                                           {"id": "b", "family": "whisper", "busy_timeout_ms": 50}))
    assert report["created"] == ["a", "b"]
    b = ModelRegistration.objects.get(model_id="b")
    assert (b.task, b.mode, b.busy_timeout_ms, b.source, b.state) == ("asr", "offline", 50, "config", "unloaded")

    report = records.registration_sync_config(config_with({"id": "a", "family": "silero_vad"},
                                                           {"id": "b", "family": "whisper", "busy_timeout_ms": 70}))
    assert report == {"created": [], "updated": ["b"], "unchanged": ["a"], "removed": []}
    assert ModelRegistration.objects.get(model_id="b").busy_timeout_ms == 70

    report = records.registration_sync_config(config_with({"id": "a", "family": "silero_vad"}))
    assert report["removed"] == ["b"]
    assert list(ModelRegistration.objects.values_list("model_id", flat=True)) == ["a"]
    events = list(LifecycleEvent.objects.order_by("id").values_list("model_id", "event", "outcome"))
    assert events == [("a", "register", "ok"), ("b", "register", "ok"), ("b", "update", "ok"),
                      ("b", "unregister", "ok")]


def test_sync_leaves_api_registrations_alone():
    ModelRegistration.objects.create(model_id="dyn", family="silero_vad", task="vad", source="api")
    records.registration_sync_config(config_with({"id": "a", "family": "silero_vad"}))
    assert set(ModelRegistration.objects.values_list("model_id", flat=True)) == {"a", "dyn"}


def test_publish_writes_metadata_and_marks_changed_models_unloaded(redis_client):
    keys = Keys(unique_prefix())
    scheduler = Scheduler(redis_client, keys, 30000)
    records.registration_sync_config(config_with({"id": "a", "family": "silero_vad"}))
    assert records.registry_publish(scheduler) == ["a"]
    meta = json.loads(redis_client.hget(keys.models_meta, "a"))
    assert meta["family"] == "silero_vad" and meta["task"] == "vad" and meta["path"] is None
    assert redis_client.get(keys.model("a") + ":cap") == "1"
    assert redis_client.get(keys.runtime) == "legacy"
    redis_client.hset(keys.model("a") + ":load", mapping={"state": "ready", "owner": "w", "boot": "b"})
    records.registry_publish(scheduler)  # unchanged: state kept
    assert redis_client.hget(keys.model("a") + ":load", "state") == "ready"
    records.registration_sync_config(config_with({"id": "a", "family": "silero_vad",
                                                   "default_request_options": {"threshold": 0.6}}))
    records.registry_publish(scheduler)
    assert redis_client.hget(keys.model("a") + ":load", "state") == "unloaded"


def test_load_outcomes_are_recorded():
    records.registration_sync_config(config_with({"id": "a", "family": "silero_vad"}))
    records.registration_record_loading("a")
    assert ModelRegistration.objects.get(model_id="a").state == "loading"
    records.registration_record_load("a", False, error="bad file", duration_ms=5)
    row = ModelRegistration.objects.get(model_id="a")
    assert (row.state, row.last_error) == ("unloaded", "bad file")
    records.registration_record_load("a", True, duration_ms=7)
    row = ModelRegistration.objects.get(model_id="a")
    assert (row.state, row.last_error) == ("ready", "") and row.loaded_at is not None
    load_events = LifecycleEvent.objects.filter(event="load").order_by("id")
    assert [(e.outcome, e.duration_ms) for e in load_events] == [("failed", 5), ("ok", 7)]


def test_admin_lists_registrations_and_events(client):
    records.registration_sync_config(config_with({"id": "vad-admin", "family": "silero_vad"}))
    admin = User.objects.create_superuser("root", "root@example.com", "pw")
    client.force_login(admin)
    page = client.get("/admin/registry/modelregistration/")
    assert page.status_code == 200 and b"vad-admin" in page.content
    page = client.get("/admin/registry/lifecycleevent/")
    assert page.status_code == 200 and b"register" in page.content
    # Registrations change only through services: no add page in the admin.
    assert client.get("/admin/registry/modelregistration/add/").status_code == 403


def test_the_audit_log_is_view_only_in_the_admin_even_for_a_superuser(client):
    """Audit rows could be deleted (and bulk-deleted) in the admin; now view only."""
    records.registration_sync_config(config_with({"id": "vad-audit", "family": "silero_vad"}))
    row = LifecycleEvent.objects.get(model_id="vad-audit")
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    base = "/admin/registry/lifecycleevent/"
    assert client.get(f"{base}{row.pk}/change/").status_code == 200  # the view page
    assert client.get(f"{base}{row.pk}/delete/").status_code == 403
    assert client.post(f"{base}{row.pk}/delete/", {"post": "yes"}).status_code == 403
    assert client.post(f"{base}{row.pk}/change/", {"model_id": "x", "event": "y"}).status_code == 403
    assert client.get(f"{base}add/").status_code == 403
    listing = client.get(base)
    assert b"delete_selected" not in listing.content
    client.post(base, {"action": "delete_selected", "_selected_action": [str(row.pk)], "post": "yes"})
    assert LifecycleEvent.objects.filter(pk=row.pk).exists()
    assert LifecycleEvent.objects.get(pk=row.pk).model_id == "vad-audit"


def _token_request(header: str):
    return Request(APIRequestFactory().get("/v1/models", HTTP_AUTHORIZATION=header))


def test_api_tokens_are_stored_as_sha256_digests_and_found_by_digest():
    """Tokens were stored in plain text. Only the SHA-256 is kept; both lookups hash first."""
    user = User.objects.create_user("op")
    token = records.api_token_issue(user)
    assert len(token) >= 43  # 256 random bits
    (stored,) = ApiToken.objects.values_list("digest", flat=True)
    assert stored == hashlib.sha256(token.encode()).hexdigest() != token
    assert not ApiToken.objects.filter(digest__contains=token).exists()
    auth = AsyncTokenAuthentication()
    assert async_to_sync(auth.aauthenticate)(_token_request(f"Token {token}"))[0] == user
    assert auth.authenticate(_token_request(f"Token {token}"))[0] == user
    for wrong in (stored, token[:-1], token + "x"):
        with pytest.raises(AuthenticationFailed):
            async_to_sync(auth.aauthenticate)(_token_request(f"Token {wrong}"))
        with pytest.raises(AuthenticationFailed):
            auth.authenticate(_token_request(f"Token {wrong}"))
    user.is_active = False
    user.save()
    with pytest.raises(AuthenticationFailed, match="inactive"):
        async_to_sync(auth.aauthenticate)(_token_request(f"Token {token}"))


def test_issue_token_prints_a_new_token_once_and_rotate_revokes_the_others():
    def issue(*args: str) -> str:
        out, err = io.StringIO(), io.StringIO()
        call_command("issue_token", "op", *args, stdout=out, stderr=err)
        assert "shown only once" in err.getvalue()
        return out.getvalue().strip()

    auth = AsyncTokenAuthentication()
    first, second = issue(), issue()
    assert first != second
    for token in (first, second):
        user, _ = auth.authenticate(_token_request(f"Token {token}"))
        assert user.username == "op" and user.has_perm("registry.manage_models")
    third = issue("--rotate")
    assert auth.authenticate(_token_request(f"Token {third}"))[0].username == "op"
    for token in (first, second):
        with pytest.raises(AuthenticationFailed):
            auth.authenticate(_token_request(f"Token {token}"))
    assert ApiToken.objects.count() == 1


def test_the_admin_lists_tokens_without_showing_them_and_can_revoke(client):
    token = records.api_token_issue(User.objects.create_user("op"))
    row = ApiToken.objects.get()
    client.force_login(User.objects.create_superuser("root", "root@example.com", "pw"))
    pages = [client.get("/admin/registry/apitoken/"), client.get(f"/admin/registry/apitoken/{row.pk}/change/")]
    for page in pages:
        assert page.status_code == 200 and b"op" in page.content
        assert token.encode() not in page.content and row.digest.encode() not in page.content
    assert client.get("/admin/registry/apitoken/add/").status_code == 403
    assert client.post(f"/admin/registry/apitoken/{row.pk}/delete/", {"post": "yes"}).status_code == 302
    assert not ApiToken.objects.exists()


def test_the_migration_hashes_plain_text_tokens_of_drf_authtoken_and_deletes_them():
    """A database from before token hashing has DRF's ``authtoken_token`` (plain keys); its tokens keep
    working after the data step, and no key is left in that table."""
    user = User.objects.create_user("legacy")
    key = "0123456789abcdef0123456789abcdef01234567"
    with connection.cursor() as cursor:  # the table as DRF's authtoken created it (rolled back with the test)
        cursor.execute("CREATE TABLE authtoken_token (key varchar(40) PRIMARY KEY, "
                       "created timestamp with time zone NOT NULL, user_id integer NOT NULL)")
        cursor.execute("INSERT INTO authtoken_token VALUES (%s, '2020-01-02T03:04:05Z', %s)", [key, user.pk])
    migration = importlib.import_module("registry.migrations.0003_apitoken")
    with connection.schema_editor() as editor:
        migration.hash_legacy_tokens(django_apps, editor)
    with connection.cursor() as cursor:
        cursor.execute("SELECT count(*) FROM authtoken_token")
        assert cursor.fetchone() == (0,)
    row = ApiToken.objects.get()
    assert (row.digest, row.user, row.created_at.year) == (ApiToken.digest_of(key), user, 2020)
    assert AsyncTokenAuthentication().authenticate(_token_request(f"Token {key}"))[0] == user
