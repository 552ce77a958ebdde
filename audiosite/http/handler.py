"""HTTP entry of the web process: the API on a lean async handler, the admin on Django's own.

Profiled under daphne (``docs/benchmarks.md``), Django's ``ASGIHandler``
spent most of a ``GET /health`` on thread hops: every sync-capable
middleware hook, the ``request_started`` signal and ``response.close()``
(which sends ``request_finished``) run through ``sync_to_async``, and since
each request runs in its own ``ThreadSensitiveContext`` the first hop starts
a fresh executor thread that is joined when the request ends.

:func:`http_application` routes by path:

- the admin (and the future ``/ui/``, and static files) go to Django's
  unchanged ``ASGIHandler`` with ``settings.MIDDLEWARE`` (sessions, CSRF,
  authentication, messages);
- everything else (the API, and its JSON 404) goes to :class:`ApiHandler`:
  ``settings.API_MIDDLEWARE`` (async only, see ``audiosite.http.middleware``) and
  the request signals sent on the event loop. A request that does no
  thread-sensitive sync work starts no thread and makes no hop. One that does
  (a database write during an eviction, say) gets Django's per-request
  thread as before, and ``response.close()`` (``request_finished`` →
  ``close_old_connections``) runs in that same thread, so its database
  connection is closed exactly as under Django's handler.

:class:`ApiHandler` also bounds the body it reads: a ``Content-Length`` over
``max_request_body_bytes`` is answered 413 before a single body message is
received, and a body without one is read only up to that limit (then 413)
instead of being buffered whole. (Under daphne, ``audiosite.http.daphne_server`` refuses the
same bodies earlier still, while Twisted receives them; this guard keeps the
handler safe under any ASGI server.)
"""
from __future__ import annotations

import asyncio
import tempfile

from asgiref.sync import SyncToAsync, iscoroutinefunction, sync_to_async
from django.conf import settings
from django.core import signals
from django.core.exceptions import ImproperlyConfigured, RequestAborted
from django.core.handlers.asgi import ASGIHandler, get_script_prefix
from django.core.handlers.exception import convert_exception_to_response
from django.http import JsonResponse
from django.urls import set_script_prefix, set_urlconf
from django.utils.log import log_response
from django.utils.module_loading import import_string

from audiosite.drain import DRAIN, SAFE_METHODS, send_refusal
from audiosite.errors import PayloadTooLarge
from audiosite.serverconfig import get_config
from audiosite.input_checks import content_length_error


def _used_a_thread() -> bool:
    """True when this request's ``ThreadSensitiveContext`` has started its executor thread."""
    context = SyncToAsync.thread_sensitive_context.get(None)
    return context is not None and context in SyncToAsync.context_to_thread_executor


class BodyTooLarge(Exception):
    """Raised by :meth:`ApiHandler.read_body` when the body grows past the limit; ``error`` is the 413."""

    def __init__(self, error: PayloadTooLarge):
        super().__init__(error.message)
        self.error = error


def declared_too_large(scope: dict, limit_bytes: int) -> PayloadTooLarge | None:
    """The 413 for an ASGI HTTP ``scope`` whose ``Content-Length`` exceeds ``limit_bytes``, else None.

    A missing or non-numeric header is not this function's business (the
    view answers 411 or 400).
    """
    for name, value in scope.get("headers", ()):
        if name.lower() == b"content-length":
            value = value.strip()
            return content_length_error(value, limit_bytes) if value.isdigit() else None
    return None


class ApiHandler(ASGIHandler):
    """Django's ``ASGIHandler`` for the API: async-only middleware, no hop unless the view needs one,
    and a body bounded by ``max_request_body_bytes`` (see the module doc)."""

    def load_middleware(self, is_async: bool = True) -> None:
        """Build the chain from ``settings.API_MIDDLEWARE`` (async-only middleware, no view hooks)."""
        self._view_middleware: list = []
        self._template_response_middleware: list = []
        self._exception_middleware: list = []
        handler = convert_exception_to_response(self._get_response_async)
        for path in reversed(settings.API_MIDDLEWARE):
            middleware = import_string(path)
            if getattr(middleware, "sync_capable", True) or not getattr(middleware, "async_capable", False):
                raise ImproperlyConfigured(f"API_MIDDLEWARE takes async-only middleware; {path} is not")
            instance = middleware(handler)
            if any(hasattr(instance, hook) for hook in ("process_view", "process_exception",
                                                        "process_template_response")):
                raise ImproperlyConfigured(f"API_MIDDLEWARE: {path} has a view hook; use plain __call__")
            handler = convert_exception_to_response(instance)
        self._middleware_chain = handler

    async def get_response_async(self, request):
        """Django's ``BaseHandler.get_response_async`` with the 4xx/5xx log line written on the loop.

        Django sends every response with status >= 400 to ``log_response`` through
        ``sync_to_async`` (a hop to the default executor): for a 503 fail-fast that hop was most of
        the difference to ``/health`` (profiled). Our ``LOGGING`` keeps only real 500s from
        ``django.request`` (``audiosite.errors.OnlyServerErrors``), so for every other status the
        call builds one record and drops it; a real 500 writes one line to stderr.
        """
        set_urlconf(settings.ROOT_URLCONF)
        response = await self._middleware_chain(request)
        response._resource_closers.append(request.close)
        if response.status_code >= 400:
            log_response("%s: %s", response.reason_phrase, request.path, response=response, request=request)
        return response

    async def _get_response_async(self, request):
        """Resolve, call the view, render: Django's version without the view hooks (API_MIDDLEWARE
        has none) and with the response rendered on the event loop instead of in a thread.

        API views render JSON or text (DRF ``Response``), which is computation only; Django
        would send every ``render()`` through ``sync_to_async``, starting the request's thread.
        """
        callback, callback_args, callback_kwargs = self.resolve_request(request)
        view = self.make_view_atomic(callback)
        if not iscoroutinefunction(view):
            view = sync_to_async(view, thread_sensitive=True)
        response = await view(request, *callback_args, **callback_kwargs)
        self.check_response(response, callback)
        render = getattr(response, "render", None)
        if callable(render):
            response = await render() if iscoroutinefunction(render) else render()
        if asyncio.iscoroutine(response):
            raise RuntimeError("Response is still a coroutine.")
        return response

    async def read_body(self, receive, limit_bytes: int | None = None):
        """The request body as a file (in memory up to ``FILE_UPLOAD_MAX_MEMORY_SIZE``, then on disk).

        Django's ``read_body``, bounded: once the ``http.request`` messages
        carry more than ``limit_bytes`` bytes (None: no bound), reading stops.

        Raises:
            RequestAborted: the client disconnected.
            BodyTooLarge: more than ``limit_bytes`` bytes arrived (nothing more is read).
        """
        body_file = tempfile.SpooledTemporaryFile(max_size=settings.FILE_UPLOAD_MAX_MEMORY_SIZE, mode="w+b")
        received_bytes = 0
        while True:
            message = await receive()
            if message["type"] == "http.disconnect":
                body_file.close()
                raise RequestAborted()
            chunk = message.get("body", b"")
            received_bytes += len(chunk)
            if limit_bytes is not None and received_bytes > limit_bytes:
                body_file.close()
                raise BodyTooLarge(PayloadTooLarge(
                    f"request body of more than {limit_bytes} bytes exceeds max_request_body_bytes={limit_bytes}"))
            body_file.write(chunk)
            if not message.get("more_body", False):
                break
        body_file.seek(0)
        return body_file

    async def handle(self, scope, receive, send):
        """Django's ``ASGIHandler.handle`` with the request signals sent without a hop, and the body
        bounded by ``max_request_body_bytes`` (413 before or while reading it; see the module doc)."""
        body_file = await self._bounded_body(scope, receive, send)
        if body_file is None:
            return
        set_script_prefix(get_script_prefix(scope))
        # Receivers are Django's close_old_connections / reset_queries: on the event loop thread
        # there is never an open connection, so they return at once.
        signals.request_started.send(sender=self.__class__, scope=scope)
        request, error_response = self.create_request(scope, body_file)
        if request is None:
            body_file.close()
            await self.send_response(error_response, send)
            await self._close(error_response)
            return

        async def process_request(request, send):
            response = await self.run_get_response(request)
            try:
                await self.send_response(response, send)
            except asyncio.CancelledError:
                pass
            return response

        tasks = [
            asyncio.create_task(self.listen_for_disconnect(receive)),
            asyncio.create_task(process_request(request, send)),
        ]
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)
        for task in tasks:
            if task.done():
                try:
                    task.result()
                except RequestAborted:
                    pass
                except AssertionError:
                    body_file.close()
                    raise
            else:
                task.cancel()
                try:
                    await task
                except asyncio.CancelledError:
                    pass
        try:
            response = tasks[1].result()
        except asyncio.CancelledError:
            if _used_a_thread():
                await signals.request_finished.asend(sender=self.__class__)
            else:
                signals.request_finished.send(sender=self.__class__)
        else:
            await self._close(response)
        body_file.close()

    async def _bounded_body(self, scope, receive, send):
        """The request body as a file (:meth:`read_body`), or None once the request needs no more: the
        client left, or its body is over ``max_request_body_bytes`` and the 413 has been sent."""
        limit_bytes = get_config().max_request_body_bytes
        too_large = declared_too_large(scope, limit_bytes)
        if too_large is None:
            try:
                return await self.read_body(receive, limit_bytes)
            except RequestAborted:
                return None
            except BodyTooLarge as over:
                too_large = over.error
        refusal = JsonResponse(too_large.body(), status=too_large.status, json_dumps_params={"separators": (",", ":")})
        await self.send_response(refusal, send)
        return None

    @staticmethod
    async def _close(response) -> None:
        """``response.close()`` (sends ``request_finished``): in the request's thread if it has one."""
        if _used_a_thread():
            await sync_to_async(response.close)()
        else:
            response.close()


def _full_stack_prefixes() -> tuple[str, ...]:
    static = "/" + settings.STATIC_URL.lstrip("/")
    return tuple(settings.FULL_STACK_PATH_PREFIXES) + (static,)


def http_application(django_handler: ASGIHandler):
    """The ASGI ``http`` app: admin-like paths → ``django_handler``; the rest → :class:`ApiHandler`.

    While the process drains (``audiosite.drain``), a write to an admin-like path is answered 503
    ``shutting_down`` here (the API views refuse their own, see ``audiosite.http.apiview``).
    """
    api_handler = ApiHandler()
    prefixes = _full_stack_prefixes()

    async def app(scope, receive, send):
        if scope["path"].startswith(prefixes):
            if DRAIN.draining and scope["method"] not in SAFE_METHODS:  # the admin's writes during a drain
                return await send_refusal(send, f"{scope['method']} {scope['path']}")
            return await django_handler(scope, receive, send)
        return await api_handler(scope, receive, send)

    return app
