"""Middleware of the API stack (``settings.API_MIDDLEWARE``): async only, no thread hop.

Django runs a sync-capable ``MiddlewareMixin`` under ASGI by sending each of
its hooks through ``sync_to_async`` (a thread hop per hook, and a new thread
per request inside Django's ``ThreadSensitiveContext``). The API routes need
only two of the site's middlewares, and both are pure computations on the
request and response (no database, no blocking I/O): their hooks can run on
the event loop as they are. :class:`OnLoop` does exactly that, so the API
keeps the same response headers (``X-Content-Type-Options``,
``Referrer-Policy``, ``Cross-Origin-Opener-Policy``, ``Content-Length``) as
before. Sessions, CSRF, authentication and messages stay in
``settings.MIDDLEWARE``, which serves the admin (see ``audiosite.handlers``).
"""
from __future__ import annotations

from asgiref.sync import markcoroutinefunction
from django.middleware.common import CommonMiddleware
from django.middleware.security import SecurityMiddleware


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
