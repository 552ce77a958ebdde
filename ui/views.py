"""Pages and form actions of the browser UI (``/ui/``). Views translate HTTP ↔ services only.

Pages: the dashboard (live status, management controls), one page per model
(configuration, lifecycle events, request counts and slot hold times), the
lifecycle log and the playground. Who sees what (README, "The browser UI"):

- ``ui`` off: every UI route answers 404 (``/`` too).
- not logged in: with ``ui_anonymous`` = ``status`` the dashboard and the
  playground, read only; with ``none`` the login page. The model pages and the
  lifecycle log (actors, paths, error details) need a login in either case.
- logged in without ``registry.manage_models``, or ``ui_management`` off: status only.
- ``ui_management`` on and the permission: the management controls too.

Form actions (POST, CSRF-protected by Django's middleware) call the same
services as the management API (``registry.services``) and answer JSON: the
service's result, or the API's error body with the API's status (400 with
``capacity=N``, 404, 503 …), shown by the page next to the control. Without
``ui_management`` or the permission they answer 403 whatever the form says.
Actions are async views: a manager waits for older requests (a barrier) without
holding a thread.
"""
from __future__ import annotations

import json
import re
from pathlib import Path
from typing import Any

from asgiref.sync import sync_to_async
from django.conf import settings
from django.contrib.auth.views import LoginView, redirect_to_login
from django.http import FileResponse, Http404, HttpRequest, HttpResponse, HttpResponseRedirect, JsonResponse
from django.shortcuts import render
from django.views.decorators.http import require_GET, require_POST

from audiosite.errors import (ApplicationError, InvalidRequest, ManagementDisabled, ManagePermissionDenied,
                              NotFound)
from audiosite.serverconfig import get_config
from audiosite.input_checks import MAX_JSON_DEPTH, check_json_depth, validated
from inference import specs
from inference.backend import resolve_backend
from inference.runtime import metrics
from inference.runtime.context import async_context
from registry import services
from registry.permissions import MANAGEMENT_DISABLED, may_manage
from registry.selectors import (
    lifecycle_event_facets,
    lifecycle_events_recent,
    model_board,
    model_board_entry,
    model_meta_all,
    model_meta_get,
    model_request_stats,
    registration_body_of,
    registration_get,
)
from registry.serializers import ModelLoadInputSerializer

from .signals import event_json

def _ui_on() -> None:
    if not get_config().ui:
        raise Http404("the browser UI is turned off (\"ui\": false)")


async def _viewer(request: HttpRequest) -> tuple[Any, bool]:
    """The request's user (resolved on the loop, so templates never query) and whether they may manage."""
    user = await request.auser()
    request.user = user  # the auth context processor then reads the resolved user, not a lazy query
    manage = get_config().ui_management and await sync_to_async(may_manage)(user)
    return user, manage


def _anonymous_refused(request: HttpRequest, user, login_always: bool = False) -> HttpResponse | None:
    """The login redirect for a visitor who may not see this page anonymously, else None."""
    if user.is_authenticated:
        return None
    if login_always or get_config().ui_anonymous == "none":
        return redirect_to_login(request.get_full_path())
    return None


async def _page_access(request: HttpRequest, login_always: bool = False) -> tuple[bool, HttpResponse | None]:
    """What every page checks first: 404 with the UI off, then the viewer.

    Returns:
        ``(manage, refused)``: whether the viewer may manage, and the login redirect when the page
        may not be shown to them (``login_always``: pages with actors and paths), else None.

    Raises:
        Http404: the UI is off.
    """
    _ui_on()
    user, manage = await _viewer(request)
    return manage, _anonymous_refused(request, user, login_always)


def _families() -> dict[str, dict]:
    """Per family: its tasks and the option defaults its spec declares (shown in the register form)."""
    out = {}
    for name, spec in sorted(specs.all_specs().items()):
        blocks = {}
        for block in ("load_options", "session_options"):
            props = spec.get(block, {}).get("properties", {})
            blocks[block] = {key: prop["default"] for key, prop in props.items() if "default" in prop}
        blocks["default_request_options"] = specs.request_defaults(name)
        out[name] = {"tasks": spec["tasks"], "defaults": blocks, "description": spec.get("description", "")}
    return out


def _page(request: HttpRequest, template: str, context: dict) -> HttpResponse:
    config = get_config()
    base = {"runtime": config.runtime, "ui_management": config.ui_management}
    return render(request, template, {**base, **context})


class UiLoginView(LoginView):
    """Django's login page in the UI's look (``/ui/login/``); 404 with the UI off."""

    template_name = "ui/login.html"
    extra_context = {"title": "Log in", "static_page": True}  # no live status stream, so no "connecting…"

    def dispatch(self, request, *args, **kwargs):
        _ui_on()
        return super().dispatch(request, *args, **kwargs)


def login_locked(request: HttpRequest, original_response: HttpResponse | None,
                 credentials: dict | None) -> HttpResponse:
    """The answer to a login of a locked-out user name and address (django-axes' ``AXES_LOCKOUT_CALLABLE``):
    429 with ``Retry-After`` (seconds, the whole ``AXES_COOLOFF_TIME``) and a page saying how to lift it,
    on the UI's and the admin's login pages alike (settings.py, "Login throttling")."""
    cooloff_s = int(settings.AXES_COOLOFF_TIME.total_seconds())
    username = (credentials or {}).get("username") or request.POST.get("username", "")
    context = {"title": "Log in", "username": str(username)[:150], "cooloff_minutes": max(1, cooloff_s // 60),
               "static_page": True}
    response = render(request, "ui/login_locked.html", context, status=429)
    response["Retry-After"] = str(cooloff_s)
    return response


async def root(request: HttpRequest) -> HttpResponse:
    """``/``: to the dashboard (404 with the UI off)."""
    _ui_on()
    return HttpResponseRedirect("/ui/")


@require_GET
async def dashboard(request: HttpRequest) -> HttpResponse:
    """``/ui/``: every model's live status; management controls for a permitted user."""
    manage, refused = await _page_access(request)
    if refused:
        return refused
    ctx = await async_context()
    board = await model_board(ctx)
    return _page(request, "ui/dashboard.html", {
        "manage": manage, "families": _families(), "board_json": board, "title": "Models"})


@require_GET
async def model_detail(request: HttpRequest, model_id: str) -> HttpResponse:
    """``/ui/models/<id>``: configuration, recent lifecycle events, request counts and hold times."""
    manage, refused = await _page_access(request, login_always=True)
    if refused:
        return refused
    ctx = await async_context()
    found = await model_board_entry(ctx, model_id)  # configuration and state of one instant (R4.7)
    if found is None:
        raise Http404(f"model {model_id!r} is not registered")
    meta, entry = found
    stats = await model_request_stats(ctx, model_id)
    row = await sync_to_async(registration_get)(model_id)
    events = [event_json(e) for e in await sync_to_async(lifecycle_events_recent)(model_id, None, 50)]
    return _page(request, "ui/model.html", {
        "model": entry, "model_id": model_id, "manage": manage,
        "config_json": json.dumps(registration_body_of(meta), indent=2), "registration": row,
        "admitted_by_mode": _admitted_by_mode(meta), "registration_mode": meta.get("mode"),
        "minutes": await metrics.minutes_recent(ctx.redis, model_id),
        "stats": stats, "events": events, "title": model_id})


def _admitted_by_mode(meta: dict) -> dict[str, int]:
    """Per mode the model's family supports: N, the largest slot count 1..N admitted here
    (``specs.largest_slot_count``: capacity and admission table together)."""
    backend = resolve_backend(get_config().backend)
    family, task = meta["family"], meta["task"]
    modes = (specs.get_spec(family) or {}).get("modes", [meta.get("mode", "offline")])
    return {mode: specs.largest_slot_count(family, task, mode, backend) for mode in modes}


@require_GET
async def model_minutes(request: HttpRequest, model_id: str) -> JsonResponse:
    """``/ui/models/<id>/minutes``: the model page's chart data (``metrics.minutes_recent``: queue wait and
    run time per minute over the last hour), refreshed by the page each minute. Needs a login."""
    _ui_on()
    user = await request.auser()
    if not user.is_authenticated:
        return JsonResponse({"error": {"message": "log in to read a model's timings", "type": "authentication_error",
                                       "param": None, "code": None}}, status=401)
    ctx = await async_context()
    if await model_meta_get(ctx, model_id) is None:
        raise Http404(f"model {model_id!r} is not registered")
    return JsonResponse(await metrics.minutes_recent(ctx.redis, model_id), safe=False)


@require_GET
async def lifecycle_log(request: HttpRequest) -> HttpResponse:
    """``/ui/log``: the audit rows, newest first, filtered by ``model`` and ``event``; new rows arrive live."""
    manage, refused = await _page_access(request, login_always=True)
    if refused:
        return refused
    model_id = request.GET.get("model", "").strip()
    event = request.GET.get("event", "").strip()
    rows = await sync_to_async(lifecycle_events_recent)(model_id or None, event or None, 500)
    kinds = await sync_to_async(lifecycle_event_facets)()
    ctx = await async_context()
    return _page(request, "ui/log.html", {
        "events": [event_json(e) for e in rows], "model_filter": model_id, "event_filter": event,
        "model_ids": sorted(set(await model_meta_all(ctx)) | set(kinds["models"])),
        "event_kinds": kinds["events"], "manage": manage, "title": "Lifecycle log"})


@require_GET
async def activity(request: HttpRequest) -> HttpResponse:
    """``/ui/activity``: the last requests answered (``inference.runtime.metrics.activity_recent``), newest
    first, filtered in the page by model and outcome; new ones arrive live. Needs a login (client addresses)."""
    manage, refused = await _page_access(request, login_always=True)
    if refused:
        return refused
    ctx = await async_context()
    rows = await metrics.activity_recent(ctx.redis)
    return _page(request, "ui/activity.html", {
        "requests": rows, "model_ids": sorted(await model_meta_all(ctx)), "outcomes": metrics.OUTCOMES,
        "model_filter": request.GET.get("model", "").strip(), "outcome_filter": request.GET.get("outcome", "").strip(),
        "keep": metrics.ACTIVITY_KEEP, "manage": manage, "title": "Activity"})


@require_GET
async def playground(request: HttpRequest) -> HttpResponse:
    """``/ui/playground``: try each task (transcribe, voice activity, speech) against the public API."""
    manage, refused = await _page_access(request)
    if refused:
        return refused
    ctx = await async_context()
    board = await model_board(ctx)
    by_task: dict[str, list[str]] = {}
    for entry in board:
        by_task.setdefault(entry["task"], []).append(entry["id"])
    return _page(request, "ui/playground.html", {"by_task": by_task, "manage": manage, "title": "Playground"})


SAMPLE_WAV = Path(__file__).resolve().parent.parent / "samples" / "librispeech_test_clean_6930-75918-0000.wav"
OTHER_SAMPLE_WAV = SAMPLE_WAV.with_name("librispeech_test_other_7902-96591-0000.wav")
"""A second reader: the playground compares two speakers and diarizes the two samples one after the other."""


@require_GET
async def sample(request: HttpRequest) -> FileResponse:
    """``/ui/sample.wav``: the shipped LibriSpeech sample (CC BY 4.0, ``samples/README.md``) for the playground."""
    _ui_on()
    return FileResponse(open(SAMPLE_WAV, "rb"), content_type="audio/wav", filename=SAMPLE_WAV.name)


@require_GET
async def sample_other(request: HttpRequest) -> FileResponse:
    """``/ui/sample-other.wav``: the second shipped LibriSpeech sample (another reader; CC BY 4.0)."""
    _ui_on()
    return FileResponse(open(OTHER_SAMPLE_WAV, "rb"), content_type="audio/wav", filename=OTHER_SAMPLE_WAV.name)


# -- form actions -------------------------------------------------------------------------------
def _error(exc: ApplicationError) -> JsonResponse:
    return JsonResponse(exc.body(), status=exc.status, headers=exc.headers())


async def _manager(request: HttpRequest) -> str:
    """The acting user's name, or Forbidden (403) when management is off or the user lacks the permission."""
    if not get_config().ui_management:
        raise ManagementDisabled(MANAGEMENT_DISABLED)
    user = await request.auser()
    if not user.is_authenticated:
        raise ManagePermissionDenied("log in with a user holding registry.manage_models to manage models")
    if not await sync_to_async(may_manage)(user):
        raise ManagePermissionDenied(f"user {user.get_username()!r} lacks the registry.manage_models permission")
    return user.get_username()


async def _registered(ctx, model_id: str) -> None:
    """Raise NotFound (404, ``param`` id, as the API's management routes answer) unless ``model_id`` is
    registered."""
    if await model_meta_get(ctx, model_id) is None:
        raise NotFound(f"model {model_id!r} is not registered", param="id")


def _int_field(request: HttpRequest, name: str) -> int | None:
    raw = request.POST.get(name, "").strip()
    if not raw:
        return None
    # ASCII digits with at most one leading minus: str.isdigit() also accepts '²' and other scripts' digits.
    if not re.fullmatch(r"-?[0-9]{1,12}", raw):
        raise InvalidRequest(f"key '{name}': {raw[:40]!r} is not an integer", param=name)
    return int(raw)


def _json_field(request: HttpRequest, name: str) -> dict:
    raw = request.POST.get(name, "").strip()
    if not raw:
        return {}
    try:
        value = json.loads(raw)
    except (json.JSONDecodeError, ValueError) as exc:
        raise InvalidRequest(f"key '{name}': not valid JSON ({exc})", param=name) from None
    except RecursionError:
        raise InvalidRequest(f"key '{name}' is nested more than {MAX_JSON_DEPTH} levels deep", param=name) from None
    check_json_depth(value, name)
    if not isinstance(value, dict):
        raise InvalidRequest(f"key '{name}': a JSON object is required", param=name)
    return value


def _register_body(request: HttpRequest) -> dict:
    """The management body of the register form: the fields the user filled in, as the API takes them."""
    body: dict[str, Any] = {"id": request.POST.get("id", "").strip(), "family": request.POST.get("family", "").strip()}
    if task := request.POST.get("task", "").strip():
        body["task"] = task
    slots = _int_field(request, "slots")
    if slots is not None:
        body["slots"] = slots
    timeout = _int_field(request, "busy_timeout_ms")
    if timeout is not None:
        body["busy_timeout_ms"] = timeout
    if request.POST.get("lazy"):
        body["lazy"] = True
    for text in ("mode", "path", "default_voice_preset"):
        if value := request.POST.get(text, "").strip():
            body[text] = value
    for block in ("load_options", "session_options", "default_request_options", "voice_presets"):
        if value := _json_field(request, block):
            body[block] = value
    return validated(ModelLoadInputSerializer(data=body))


async def _act(request: HttpRequest, action) -> JsonResponse:
    try:
        actor = await _manager(request)
        ctx = await async_context()
        return JsonResponse({"ok": True, "result": await action(ctx, actor)})
    except ApplicationError as exc:
        return _error(exc)


@require_POST
async def register(request: HttpRequest) -> JsonResponse:
    """Register a new model (``POST /v1/models/load`` with a new id)."""
    _ui_on()

    async def action(ctx, actor):
        return await services.model_register_or_reconfigure(ctx, _register_body(request), actor)
    return await _act(request, action)


@require_POST
async def resize(request: HttpRequest, model_id: str) -> JsonResponse:
    """Reconfigure the slot count: ``{"id", "slots"}`` (only the count changes; R4.4: 400 leaves it as it was)."""
    _ui_on()

    async def action(ctx, actor):
        await _registered(ctx, model_id)
        slots = _int_field(request, "slots")
        if slots is None:
            raise InvalidRequest("key 'slots': a slot count is required", param="slots")
        return await services.model_register_or_reconfigure(ctx, {"id": model_id, "slots": slots}, actor)
    return await _act(request, action)


@require_POST
async def load(request: HttpRequest, model_id: str) -> JsonResponse:
    """Load: ``POST /v1/models/load {"id"}``, the registration as it is (a lazy entry stays unloaded)."""
    _ui_on()

    async def action(ctx, actor):
        await _registered(ctx, model_id)
        return await services.model_register_or_reconfigure(ctx, {"id": model_id}, actor)
    return await _act(request, action)


def _configure_body(request: HttpRequest, model_id: str) -> dict:
    """The management body of the model page's configuration form: the JSON object of its ``entry``
    field, whose ``id`` (when given) must be the page's model."""
    body = _json_field(request, "entry")
    if body.get("id", model_id) != model_id:
        raise InvalidRequest(f"key 'id': the entry of {model_id!r} cannot change its id", param="id")
    return validated(ModelLoadInputSerializer(data={**body, "id": model_id}))


@require_POST
async def configure(request: HttpRequest, model_id: str) -> JsonResponse:
    """Reconfigure from the model page: the keys of the edited entry applied to the registration
    (``POST /v1/models/load``; keys left out keep their values)."""
    _ui_on()

    async def action(ctx, actor):
        await _registered(ctx, model_id)
        return await services.model_register_or_reconfigure(ctx, _configure_body(request, model_id), actor)
    return await _act(request, action)


@require_POST
async def unload(request: HttpRequest, model_id: str) -> JsonResponse:
    """Unload one model (``POST /v1/models/unload``)."""
    _ui_on()

    async def action(ctx, actor):
        outcome = await services.model_unload(ctx, model_id, actor)
        return {"id": outcome["id"], "loaded": outcome["loaded"]}
    return await _act(request, action)


@require_POST
async def unregister(request: HttpRequest, model_id: str) -> JsonResponse:
    """Unregister (``DELETE /v1/models/{id}``)."""
    _ui_on()

    async def action(ctx, actor):
        return await services.model_unregister(ctx, model_id, actor)
    return await _act(request, action)


@require_POST
async def bulk_unload(request: HttpRequest) -> JsonResponse:
    """Unload the ticked models (``model_ids``), or every model with ``all`` (the bulk unload routes, R5)."""
    _ui_on()

    async def action(ctx, actor):
        if request.POST.get("all"):
            return await services.models_bulk_unload(ctx, None, actor)
        ids = [i for i in request.POST.getlist("model_ids") if i]
        if not ids:
            raise InvalidRequest("tick at least one model", param="model_ids")
        return await services.models_bulk_unload(ctx, ids, actor)
    return await _act(request, action)

