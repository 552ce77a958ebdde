"""DRF's ``initial()`` on the event loop for ``adrf`` views (authentication awaited, not hopped).

``adrf`` 0.1.14 runs ``APIView.initial`` (content negotiation, authentication,
permissions, throttles) through ``sync_to_async`` on every request: a thread
hop even for a view with nothing to authenticate, and a new thread per request
inside Django's ``ThreadSensitiveContext``. Its "async authenticators" are
called back through ``async_to_sync`` from that thread.

Every view of the API derives from :class:`APIView` here, whose
``async_dispatch`` runs ``initial`` on the event loop whenever that is safe:
every authenticator has an ``aauthenticate`` coroutine, every permission's
``has_permission`` is a coroutine function, and the view has no throttles.
Anything else takes adrf's own path unchanged.

On the event-loop path the view's permissions run first and authenticate when
they need the caller (``await authenticate(request)``), so a permission can
refuse before any credential is looked up (the management gate: management
off → 403 for everyone); authentication always completes before the handler.
"""
from __future__ import annotations

import time
from datetime import UTC, datetime
from inspect import iscoroutinefunction

from adrf.views import APIView as AdrfAPIView
from asgiref.sync import sync_to_async
from rest_framework import exceptions

from audiosite.drain import DRAIN, SAFE_METHODS, refusal
from inference.runtime import metrics


async def authenticate(request):
    """Run the request's authenticators (``aauthenticate``) once; return ``request.user``.

    Same contract as DRF's ``Request._authenticate``: the first authenticator
    returning ``(user, auth)`` wins; an ``APIException`` leaves the request
    unauthenticated and propagates; no match → ``UNAUTHENTICATED_USER``.
    """
    if "_user" in request.__dict__:
        return request.user
    for authenticator in request.authenticators:
        try:
            user_auth = await authenticator.aauthenticate(request)
        except exceptions.APIException:
            request._not_authenticated()
            raise
        if user_auth is not None:
            request._authenticator = authenticator
            request.user, request.auth = user_auth
            return request.user
    request._not_authenticated()
    return request.user


def _on_loop(view, request, permissions) -> bool:
    return (all(iscoroutinefunction(getattr(a, "aauthenticate", None)) for a in request.authenticators)
            and all(iscoroutinefunction(p.has_permission) for p in permissions)
            and not view.get_throttles())


async def _initial(view, request, permissions, *args, **kwargs) -> None:
    """DRF ``APIView.initial`` without blocking calls (see the module doc for the order)."""
    view.format_kwarg = view.get_format_suffix(**kwargs)
    request.accepted_renderer, request.accepted_media_type = view.perform_content_negotiation(request)
    request.version, request.versioning_scheme = view.determine_version(request, *args, **kwargs)
    for permission in permissions:
        if not await permission.has_permission(request, view):
            await authenticate(request)
            view.permission_denied(request, message=getattr(permission, "message", None),
                                   code=getattr(permission, "code", None))
    await authenticate(request)


def request_outcome(status: int) -> str:
    """The ``outcome`` label of ``audiosite_requests_total`` for an HTTP status."""
    if status < 400:
        return "ok"
    if status < 500:
        return "client_error"
    return "rejected" if status == 503 else "error"


class APIView(AdrfAPIView):
    """Base of every API view: ``adrf``'s async view with ``initial`` on the event loop when safe,
    bounded by the process's drain (``audiosite.drain``: an unsafe method is refused 503
    ``shutting_down`` while draining; a handler still running at the drain deadline is cut with that
    503), and, for views with ``counts_requests``, counted in the deployment's metrics
    (``audiosite_requests_total``, and ``audiosite_rejections_total`` for a 503) under
    ``self.metrics_model`` (set by the view once the request names a registered model) and added to
    the UI's activity list (``metrics.activity_soon``: time, model, route, status, error code, queue
    wait, run time, client address and user; never the body). For a streamed answer the row is
    written when its headers are sent. A request served by one run whose worker recorded the answer
    (``metrics.answer_record``; the view passed ``answer=True`` to ``request_run``) is not counted again
    here when it is answered 200."""

    counts_requests = False
    metrics_model = ""

    async def async_dispatch(self, request, *args, **kwargs):
        """``adrf.views.APIView.async_dispatch`` with ``initial`` on the event loop when safe (and the drain
        and metrics of the class doc)."""
        if not self.counts_requests:
            return await self._dispatch(request, *args, **kwargs)
        started = time.monotonic()
        timing = metrics.timing_begin()
        timing.row = {"route": request.path[:200], "client": request.META.get("REMOTE_ADDR") or "", "user": None,
                      "started_unix_ms": time.time() * 1000}
        response = await self._dispatch(request, *args, **kwargs)
        self._count(request, response, timing, (time.monotonic() - started) * 1000)
        return response

    def _username(self) -> str | None:
        user = getattr(getattr(self, "request", None), "_user", None)
        return user.get_username() if user is not None and user.is_authenticated else None

    def _count(self, request, response, timing: metrics.RequestTiming, total_ms: float) -> None:
        status = response.status_code
        if status == 200 and timing.recorded:  # the worker that served it wrote its events and row
            return
        model = self.metrics_model
        data = getattr(response, "data", None)
        error = data.get("error") if isinstance(data, dict) else None
        code = error.get("code") or error.get("type") if isinstance(error, dict) else None
        events = [metrics.count(metrics.REQUESTS, model, request_outcome(status))]
        if status == 503:
            events.append(metrics.count(metrics.REJECTIONS, model, code or "unknown"))
        metrics.record_soon(*events)
        metrics.activity_soon({
            "at": datetime.now(UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
            "model": model, "route": request.path[:200], "status": status, "outcome": request_outcome(status),
            "code": code, "queue_ms": timing.queue_ms, "run_ms": timing.run_ms, "total_ms": round(total_ms, 3),
            "client": request.META.get("REMOTE_ADDR") or "", "user": self._username()})

    async def _dispatch(self, request, *args, **kwargs):
        self.args = args
        self.kwargs = kwargs
        request = self.initialize_request(request, *args, **kwargs)
        self.request = request
        self.headers = self.default_response_headers
        try:
            if DRAIN.draining and request.method not in SAFE_METHODS:
                raise refusal(f"{request.method} {request.path}")
            permissions = self.get_permissions()
            if _on_loop(self, request, permissions):
                await _initial(self, request, permissions, *args, **kwargs)
            else:
                await sync_to_async(self.initial)(request, *args, **kwargs)
            if self.counts_requests and (timing := metrics.timing_current()) is not None and timing.row is not None:
                timing.row["user"] = self._username()  # authenticated now: a worker's row names the user too
            method = request.method.lower()
            handler = getattr(self, method, None) if method in self.http_method_names else None
            if handler is None:
                raise exceptions.MethodNotAllowed(request.method)  # 405, as DRF's http_method_not_allowed
            if iscoroutinefunction(handler):
                response = await DRAIN.bounded(handler(request, *args, **kwargs))
            else:
                response = await sync_to_async(handler)(request, *args, **kwargs)
        except Exception as exc:
            response = self.handle_exception(exc)
        self.response = self.finalize_response(request, response, *args, **kwargs)
        return self.response
