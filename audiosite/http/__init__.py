"""Where audiosite overrides framework internals: the HTTP edge's handler, middleware, view base and daphne classes.

Everything else in the project uses the frameworks through their public API.
The modules here subclass or replace framework classes and call or set
undocumented names; each such name is listed below with the framework and the
version it was written against (:data:`FRAMEWORK_PINS`, checked by
``tests/test_framework_pins.py``). When a pinned version changes, re-read each
listed internal in the new version's source, adapt the module, then bump the pin.

``audiosite.http.handler`` — the API's ASGI handler (no thread hop; body bounded):
  Django 5.2.19 (asgiref 3.13.0)
  - ``django.core.handlers.asgi.ASGIHandler.handle`` (re-implemented), ``.read_body`` (re-implemented),
    ``.create_request``, ``.send_response``, ``.listen_for_disconnect``, ``.run_get_response``
  - ``django.core.handlers.base.BaseHandler.load_middleware`` and ``._get_response_async`` (re-implemented),
    ``.get_response_async`` (re-implemented), ``.resolve_request``, ``.make_view_atomic``, ``.check_response``;
    the attributes ``._middleware_chain``, ``._view_middleware``, ``._template_response_middleware``,
    ``._exception_middleware``
  - ``django.http.HttpResponseBase._resource_closers``; ``django.utils.log.log_response``;
    ``django.core.handlers.exception.convert_exception_to_response``
  - ``asgiref.sync.SyncToAsync.thread_sensitive_context`` and ``.context_to_thread_executor``

``audiosite.http.middleware`` — the ``*OnLoop`` middlewares (a ``MiddlewareMixin``'s hooks on the loop):
  Django 5.2.19
  - ``django.utils.deprecation.MiddlewareMixin``: ``process_request`` / ``process_response`` of
    ``SecurityMiddleware``, ``XFrameOptionsMiddleware`` and ``CommonMiddleware`` called directly, on the
    assumption that they are pure computations (no database, no blocking I/O)

``audiosite.http.apiview`` — DRF's ``initial()`` on the event loop for adrf views:
  adrf 0.1.14, djangorestframework 3.18.3
  - ``adrf.views.APIView.async_dispatch`` (re-implemented)
  - ``rest_framework.request.Request._not_authenticated``, ``._authenticator``, ``.__dict__["_user"]``,
    ``.authenticators``
  - ``rest_framework.views.APIView.initial``'s steps called one by one: ``get_format_suffix``,
    ``perform_content_negotiation``, ``determine_version``, ``get_permissions``, ``permission_denied``,
    ``get_throttles``; and ``initialize_request``, ``default_response_headers``, ``handle_exception``,
    ``finalize_response``

``audiosite.http.daphne_server`` — daphne's request, channel, WebSocket protocol and server classes:
  daphne 4.2.3, Twisted 26.10.0, autobahn 26.10.2, channels 4.3.2 (its consumers run under this server)
  - module attributes replaced by ``install()``: ``daphne.http_protocol.WebRequest``,
    ``daphne.server.HTTPFactory``, ``daphne.ws_protocol.WebSocketFactory.protocol``,
    ``daphne.cli.CommandLineInterface.server_class``
  - ``daphne.http_protocol.WebRequest.process``, ``.handle_reply``, ``.connectionLost``, ``.handle_exception``
    (overridden), ``._response_started``
  - ``twisted.web.http.Request._parsePOSTFormSubmission`` (set), ``.gotLength``, ``.handleContentChunk``
    (overridden), ``.content``, ``.channel``, ``.producer``
  - ``twisted.web.http.HTTPChannel._handlingRequest``, ``._waitingForTransport``, ``.length``,
    ``.callLater``; ``connectionMade``, ``dataReceived``, ``allHeadersReceived``, ``allContentReceived``,
    ``connectionLost`` (overridden); ``twisted.web.http._GenericHTTPChannelProtocol``
  - ``daphne.ws_protocol.WebSocketProtocol.serverClose`` (overridden); autobahn's
    ``WebSocketProtocol.sendCloseFrame``
  - ``daphne.server.Server.handle_reply``, ``.run``, ``.listen_success`` (overridden), ``.connections``,
    ``.signal_handlers``, ``.stop``

``audiosite.http.port_gate`` — closing and opening daphne's ports while Redis is out of reach:
  daphne 4.2.3, Twisted 26.10.0
  - ``twisted.internet.tcp.Port.stopListening`` and ``.startListening`` (a stopped port listens again on
    its address), on the ports daphne's ``listen_success`` receives
  - ``twisted.web.http.HTTPChannel.requests``, ``._handlingRequest``, ``.persistent`` (set False to close
    after the request in progress), ``.transport``
"""
from __future__ import annotations

FRAMEWORK_PINS: dict[str, str] = {
    "django": "5.2.19",
    "asgiref": "3.13.0",
    "adrf": "0.1.14",
    "djangorestframework": "3.18.3",
    "daphne": "4.2.3",
    "twisted": "26.10.0",
    "autobahn": "26.10.2",
    "channels": "4.3.2",
}
"""Distribution name (lower-case) → the version whose internals the modules of this package were checked
against (the module doc lists them); ``requirements.txt`` pins the same versions."""
