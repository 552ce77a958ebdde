"""Middleware of the API stack (``settings.API_MIDDLEWARE``): async only, no thread hop.

Django runs a sync-capable ``MiddlewareMixin`` under ASGI by sending each of
its hooks through ``sync_to_async`` (a thread hop per hook, and a new thread
per request inside Django's ``ThreadSensitiveContext``). The API routes need
only two of the site's middlewares, and both are pure computations on the
request and response (no database, no blocking I/O): their hooks can run on
the event loop as they are. :class:`OnLoop` does exactly that, so the API
sends the same response headers as the admin (``X-Content-Type-Options``,
``Referrer-Policy``, ``Cross-Origin-Opener-Policy``, ``X-Frame-Options``,
``Content-Length``). :class:`AllowedHostOnLoop` refuses a foreign ``Host``
header (``settings.ALLOWED_HOSTS``) with a 400 in the API's error shape.
Sessions, CSRF, authentication and messages stay in ``settings.MIDDLEWARE``,
which serves the admin (see ``audiosite.http.handler``).
"""
from __future__ import annotations

from asgiref.sync import markcoroutinefunction
from django.core.exceptions import DisallowedHost
from django.http import JsonResponse
from django.middleware.clickjacking import XFrameOptionsMiddleware
from django.middleware.common import CommonMiddleware
from django.middleware.security import SecurityMiddleware

from audiosite.errors import disallowed_host_error


class OnLoop:
    """Run a CPU-only ``MiddlewareMixin`` subclass's hooks on the event loop.

    Only ``process_request`` and ``process_response`` are supported; a
    wrapped class must not touch the database or block. Subclasses name the
    class in ``wrapped``.
    """

    sync_capable = False
    async_capable = True
    wrapped: type

    def __init__(self, get_response):
        self.get_response = get_response
        self.inner = self.wrapped(get_response)
        for hook in ("process_view", "process_exception", "process_template_response"):
            if hasattr(self.inner, hook):
                raise TypeError(f"{self.wrapped.__name__}.{hook} is not supported on the event loop")
        markcoroutinefunction(self)

    async def __call__(self, request):
        response = None
        if hasattr(self.inner, "process_request"):
            response = self.inner.process_request(request)
        response = response or await self.get_response(request)
        if hasattr(self.inner, "process_response"):
            response = self.inner.process_response(request, response)
        return response


class SecurityOnLoop(OnLoop):
    """``django.middleware.security.SecurityMiddleware`` (header settings ``SECURE_*``)."""

    wrapped = SecurityMiddleware


class CommonOnLoop(OnLoop):
    """``django.middleware.common.CommonMiddleware`` (``Content-Length``, ``DISALLOWED_USER_AGENTS``)."""

    wrapped = CommonMiddleware


class FrameOptionsOnLoop(OnLoop):
    """``django.middleware.clickjacking.XFrameOptionsMiddleware`` (``X-Frame-Options``, ``X_FRAME_OPTIONS``)."""

    wrapped = XFrameOptionsMiddleware


class AllowedHostOnLoop:
    """Answer 400 ``invalid_request_error`` (code ``disallowed_host``) to a ``Host`` not in ``ALLOWED_HOSTS``.

    Django checks the header only where something calls ``request.get_host()``
    and turns the refusal into a logged ``SuspiciousOperation`` rendered by
    ``handler400`` in a thread (or Django's HTML page with ``DEBUG`` on). This
    check runs first on every API request, on the event loop, and answers in
    the API's error shape whatever ``DEBUG`` says. Middleware outside it
    (security headers) still decorates the refusal.
    """

    sync_capable = False
    async_capable = True

    def __init__(self, get_response):
        self.get_response = get_response
        markcoroutinefunction(self)

    async def __call__(self, request):
        try:
            request.get_host()
        except DisallowedHost:
            error = disallowed_host_error(request.META.get("HTTP_HOST", ""))
            return JsonResponse(error.body(), status=error.status, json_dumps_params={"separators": (",", ":")})
        return await self.get_response(request)
