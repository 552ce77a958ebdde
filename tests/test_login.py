"""Logging in: wrong passwords are throttled, weak passwords are refused, a form's nested JSON is a 400.

Django's test client through the full middleware stack of ``/ui/`` and ``/admin/`` (the session,
CSRF, authentication and django-axes middlewares) on the test PostgreSQL database. Named actors:
``alice`` (a user who mistypes), ``bob`` (another user on the same address).
"""
from __future__ import annotations

import re

import pytest
from axes.models import AccessAttempt
from django.conf import settings
from django.contrib.auth.forms import SetPasswordForm
from django.contrib.auth.models import User
from django.core.management import call_command
from django.test import Client, RequestFactory

from audiosite.errors import InvalidRequest
from audiosite.input_checks import MAX_JSON_DEPTH
from ui import views as ui_views

pytestmark = pytest.mark.django_db

GOOD = "correct horse battery staple"


@pytest.fixture
def users() -> dict[str, User]:
    """Staff, so that the admin's login admits them too."""
    return {name: User.objects.create_user(name, password=GOOD, is_staff=True) for name in ("alice", "bob")}


def _login(client: Client, path: str, username: str, password: str):
    return client.post(path, {"username": username, "password": password}, REMOTE_ADDR="192.0.2.7")


def _logged_in(client: Client) -> bool:
    return "_auth_user_id" in client.session


@pytest.mark.parametrize("path", ["/ui/login/", "/admin/login/"])
def test_after_the_failure_limit_even_the_right_password_gets_429_until_the_lock_is_reset(users, path):
    limit = settings.AXES_FAILURE_LIMIT
    client = Client()
    for attempt in range(limit - 1):
        resp = _login(client, path, "alice", f"wrong-{attempt}")
        assert resp.status_code == 200 and not _logged_in(client), attempt  # the form again, with its error
    locking = _login(client, path, "alice", "wrong-last")
    assert locking.status_code == 429
    resp = _login(client, path, "alice", GOOD)
    assert resp.status_code == 429 and not _logged_in(client)
    assert int(resp["Retry-After"]) == int(settings.AXES_COOLOFF_TIME.total_seconds())
    assert "Too many wrong passwords" in resp.content.decode() and "alice" in resp.content.decode()
    # The lock is the pair (user name, address): bob on the same address is not locked out.
    bob = Client()
    assert _login(bob, path, "bob", GOOD).status_code == 302 and _logged_in(bob)
    # Neither is alice from another address.
    elsewhere = Client()
    resp = elsewhere.post(path, {"username": "alice", "password": GOOD}, REMOTE_ADDR="198.51.100.9")
    assert resp.status_code == 302 and _logged_in(elsewhere)
    call_command("axes_reset_username", "alice")
    assert _login(client, path, "alice", GOOD).status_code == 302 and _logged_in(client)


def test_the_login_page_shows_no_live_status_indicator():
    """The login page opens no status stream, so it must not say "connecting…" forever."""
    page = Client().get("/ui/login/")
    assert page.status_code == 200 and "Log in" in page.content.decode()
    assert "live-state" not in page.content.decode() and "connecting" not in page.content.decode()


def test_a_success_before_the_limit_resets_the_count(users):
    client = Client()
    limit = settings.AXES_FAILURE_LIMIT
    for attempt in range(limit - 1):
        _login(client, "/ui/login/", "alice", f"wrong-{attempt}")
    assert _login(client, "/ui/login/", "alice", GOOD).status_code == 302
    client.logout()
    for attempt in range(limit - 1):
        assert _login(client, "/ui/login/", "alice", f"again-{attempt}").status_code == 200
    assert not AccessAttempt.objects.filter(username="alice", failures_since_start__gte=limit).exists()


@pytest.mark.parametrize("weak", ["short-pw", "password1234", "12345678901234", "alice@example"])
def test_a_weak_password_is_refused_where_a_password_is_set(users, weak):
    """The admin's password forms (and ``createsuperuser``/``changepassword``) run the validators of
    settings.AUTH_PASSWORD_VALIDATORS: too short, common, all digits, like the user's e-mail address."""
    users["alice"].email = "alice@example.com"
    form = SetPasswordForm(users["alice"], {"new_password1": weak, "new_password2": weak})
    assert not form.is_valid()
    assert "new_password2" in form.errors


def test_a_strong_password_is_accepted(users):
    strong = "violet-lamp-orbit-7-quietly"
    form = SetPasswordForm(users["alice"], {"new_password1": strong, "new_password2": strong})
    assert form.is_valid(), form.errors


def _deep(levels: int) -> str:
    return '{"a": ' * levels + "1" + "}" * levels


@pytest.mark.parametrize("levels", [MAX_JSON_DEPTH + 1, 900, 100_000])
def test_a_register_form_with_deeply_nested_options_is_a_400_naming_the_field(levels):
    """The register form's JSON fields: nesting past MAX_JSON_DEPTH is the API's 400 naming the field
    (900 levels parse, then recursive checks hit Python's recursion limit; 100,000 fail in the parser)."""
    request = RequestFactory().post("/ui/manage/register", data={"id": "x", "family": "silero_vad",
                                                                  "load_options": _deep(levels)})
    with pytest.raises(InvalidRequest) as refused:
        ui_views._register_body(request)
    assert refused.value.status == 400 and refused.value.param == "load_options"
    assert re.search(r"nested more than \d+ levels deep", str(refused.value))


def test_a_register_form_with_options_at_the_depth_limit_is_read():
    request = RequestFactory().post("/ui/manage/register", data={"id": "x", "family": "silero_vad",
                                                                  "session_options": _deep(MAX_JSON_DEPTH - 1)})
    body = ui_views._register_body(request)
    depth, value = 0, body["session_options"]
    while isinstance(value, dict):
        depth, value = depth + 1, value["a"]
    assert depth == MAX_JSON_DEPTH - 1
