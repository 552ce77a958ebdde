"""WebSocket consumers (Channels): the realtime transcription socket, and a clean refusal elsewhere.

Consumers only translate frames to and from ``inference.realtime`` (which decides): text frames
are JSON client events, server events go out as JSON text frames. Routed in ``audiosite.asgi``.
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from urllib.parse import parse_qs, urlsplit

from channels.generic.websocket import AsyncWebsocketConsumer
from channels.security.websocket import OriginValidator, WebsocketDenier
from channels_redis.core import RedisChannelLayer
from django.conf import settings
from django.http.request import split_domain_port, validate_host

from audiosite.channel_layer import REDIS_DOWN
from audiosite.drain import DRAIN, WEBSOCKET_CLOSE_GOING_AWAY, DrainNotice
from audiosite.serverconfig import get_config
from audiosite.settings import channel_layer_config
from inference import realtime
from inference.runtime.context import async_context

log = logging.getLogger(__name__)

LIVE_GROUP = "live.sessions"
"""Channels group every open realtime session joins (on the deployment's Redis layer): a
``live.close`` message sent to it closes them all with the given code (e.g. 1001 when the
server goes away)."""

CLOSE_GOING_AWAY = 1001
CLOSE_TOO_BIG = 1009
CLOSE_INTERNAL_ERROR = 1011
CLOSE_TRY_AGAIN_LATER = 1013
CLOSE_NOT_FOUND = 4404
"""Close code (application range) of a WebSocket upgrade on a path that has no WebSocket route."""


class RealtimeConsumer(AsyncWebsocketConsumer):
    """``ws /v1/realtime?intent=transcription``: OpenAI's realtime transcription protocol
    (``inference.realtime.LiveSession``). ``model`` in the query (the beta SDK always sends one)
    is the session's model when it names a registered ASR model. ``intent`` may be omitted; any other intent is refused
    with an ``error`` event and close code 1008. Frames larger than ``live_ingest.max_chunk_bytes``
    get an ``error`` event and close code 1009; binary frames and bad JSON get an ``error`` event
    and the session goes on. Its handshake passed :class:`HostOriginValidator` (``audiosite.asgi``)."""

    session: realtime.LiveSession | None = None
    _drain_task: asyncio.Task | None = None

    async def connect(self) -> None:
        await self.accept()
        query = parse_qs(self.scope.get("query_string", b"").decode("latin-1"))
        intent = (query.get("intent") or ["transcription"])[0]
        try:
            ctx = await async_context()
            model = await realtime.default_model(ctx, (query.get("model") or [None])[0])
            if intent == "transcription" and self.channel_layer is not None:
                await self.channel_layer.group_add(LIVE_GROUP, self.channel_name)
        except REDIS_DOWN as exc:
            await self._refuse_without_redis(exc)
            return
        self.session = realtime.LiveSession(ctx, self.send_event, self.close_with, get_config().live_ingest, model)
        if intent != "transcription":
            await self.session.end(realtime.ClientError(
                f"intent {realtime.shown(intent)} is not served; this server offers ?intent=transcription",
                "invalid_value", param="intent"), 1008)
            return
        # A drain of this web process (SIGTERM, R8.4) ends the session with a final event and 1001;
        # the drain waits for that (until its deadline).
        self._drain_watch = DRAIN.watch(self._on_drain)
        await self.session.start()

    async def receive(self, text_data: str | None = None, bytes_data: bytes | None = None) -> None:
        session = self.session
        if session is None:
            return
        size = len(bytes_data) if bytes_data is not None else len((text_data or "").encode("utf-8", "replace"))
        limit = session.limits.max_chunk_bytes
        if size > limit:
            await session.end(realtime.ClientError(
                f"a frame of {size} bytes exceeds live_ingest.max_chunk_bytes ({limit}); send audio in smaller "
                "appends", "frame_too_large"), CLOSE_TOO_BIG)
            return
        if bytes_data is not None:
            await session.error(realtime.ClientError("binary frames are not supported: send JSON text events",
                                                     "invalid_event"), None)
            return
        try:
            event = json.loads(text_data or "")
        except (ValueError, RecursionError):  # ValueError: not JSON, or an integer of over 4300 digits
            await session.error(realtime.ClientError("the frame is not valid JSON (or holds an integer of "
                                                     "more than 4300 digits)", "invalid_json"), None)
            return
        try:
            await session.handle(event)
        except Exception:
            # A bug, or the client left while its events were being sent: never leave the session's
            # turns (and their slot leases) behind a crashed consumer.
            log.exception("a live session failed; closing it")
            await self._abort()

    async def _refuse_without_redis(self, exc: BaseException) -> None:
        """The session cannot start: Redis is unreachable. An ``error`` event (``server_error``,
        ``redis_unavailable``), then close code 1013 (try again later)."""
        log.warning("refused a live session: Redis is unreachable (%s)", exc)
        await self.send_event({"type": "error", "event_id": f"event_{uuid.uuid4().hex[:20]}", "error": {
            "type": "server_error", "code": "redis_unavailable", "param": None, "event_id": None,
            "message": f"the coordination store (Redis) is unavailable, or this server's connections to it are "
                       f"all in use ({exc}); try again"}})
        await self.close(code=CLOSE_TRY_AGAIN_LATER)

    async def _abort(self) -> None:
        """End this session after an unexpected failure: its turns and leases go, then close 1011."""
        if self.session is not None:
            await self.session.close()
        try:
            await self.close(code=CLOSE_INTERNAL_ERROR)
        except Exception:  # already closed
            pass

    async def _on_drain(self, notice: DrainNotice) -> None:
        """This web process drains: the session's turns end with their transcripts (or ``failed``
        ``shutting_down`` at ``notice.deadline_s``), then close 1001 (``LiveSession.drain``)."""
        if self.session is not None:
            await self.session.drain(notice.deadline_s, WEBSOCKET_CLOSE_GOING_AWAY)

    async def disconnect(self, code: int) -> None:
        try:
            if self.channel_layer is not None:
                try:
                    await self.channel_layer.group_discard(LIVE_GROUP, self.channel_name)
                except REDIS_DOWN as exc:  # the group's entry expires on its own (channels-redis group_expiry)
                    log.info("live session left its group without Redis (%s)", exc)
            if self.session is not None:
                await self.session.close()  # its turns' leases are back (at most one decode step)
        finally:
            # Only now: a drain waits for this watch, so it does not stop the process under a turn's lease.
            watch = getattr(self, "_drain_watch", None)
            if watch is not None:
                watch.close()

    async def send_event(self, event: dict) -> None:
        """Send one server event as a JSON text frame."""
        await self.send(text_data=json.dumps(event))

    async def close_with(self, code: int) -> None:
        """Close the socket with ``code`` (after the session's final event)."""
        await self.close(code=code)

    async def live_close(self, message: dict) -> None:
        """Group message ``{"type": "live.close", "code": int, "reason": str}``: end this session.

        Code 1001 (the server going away, ``serve`` stopping) drains it like its web process's drain
        does (``LiveSession.drain``: open turns get their transcript, or ``failed`` ``shutting_down``, by
        the drain deadline, or ``shutdown_timeout_ms`` from now when this process is not draining);
        any other code ends it at once (``LiveSession.end`` closes its turns even when the client is
        already gone)."""
        if self.session is None:
            return
        code = int(message.get("code", WEBSOCKET_CLOSE_GOING_AWAY))
        reason = message.get("reason") or "the server closed the session"
        if code == WEBSOCKET_CLOSE_GOING_AWAY:
            deadline_s = DRAIN.deadline_s if DRAIN.deadline_s is not None else \
                time.monotonic() + get_config().shutdown_timeout_ms / 1000
            # In a task of its own: this consumer's messages (a disconnect) are still handled meanwhile.
            self._drain_task = asyncio.ensure_future(self.session.drain(deadline_s, code, reason))
        else:
            await self.session.end(realtime.ClientError(reason, "session_closed"), code)


DEFAULT_PORTS = {"http": 80, "ws": 80, "https": 443, "wss": 443}
"""The port an origin or URL without one means, by scheme (RFC 6454 §4)."""


def _header(scope: dict, name: bytes) -> list[str]:
    return [value.decode("latin-1") for key, value in scope.get("headers", []) if key == name]


def same_origin(origin: str, host: str) -> bool:
    """True when the browser ``origin`` (``scheme://host[:port]``) names the server the request reached
    through ``host`` (its ``Host`` header, ``name[:port]``): the same name, and the same port (a
    ``Host`` without a port matches the origin scheme's default port, as behind a TLS proxy on 443).

    The scheme is not compared: the server cannot tell whether a proxy in front of it took TLS."""
    try:
        parsed = urlsplit(origin)
        origin_port = parsed.port or DEFAULT_PORTS.get(parsed.scheme)
    except ValueError:  # a port that is not a number
        return False
    name, port = split_domain_port(host)
    if not parsed.hostname or not name or parsed.scheme not in ("http", "https"):
        return False
    return parsed.hostname == name.strip("[]") and (int(port) if port else DEFAULT_PORTS[parsed.scheme]) == origin_port


class HostOriginValidator:
    """ASGI middleware in front of every WebSocket route: the handshake is refused (HTTP 403, the
    connection never reaches a consumer) when its ``Host`` is not one of ``settings.ALLOWED_HOSTS``
    (the configuration's :meth:`~audiosite.serverconfig.ServerConfig.allowed_host_names`, as Django
    checks it for HTTP), or when it carries an ``Origin`` that is neither the server's own (see
    :func:`same_origin`) nor matched by the configuration's ``allowed_origins`` (patterns as
    Channels' ``OriginValidator`` reads them: ``scheme://host[:port]``, ``scheme://.domain``, ``*``).

    A handshake without ``Origin`` is accepted: browsers always send one, programs (the OpenAI SDKs,
    ``websockets``) do not, and a program is not a cross-site risk. So a page elsewhere (or a DNS name
    rebound to this server) cannot open ``/v1/realtime`` to pin the model's slots, nor read
    ``/ui/ws/status`` with its visitor's cookies.

    Args:
        application: the ASGI application behind it (the WebSocket router).
        allowed_origins: the configured extra origins (read from the configuration when None).
    """

    def __init__(self, application, allowed_origins: list[str] | None = None):
        self.application = application
        self._allowed_origins = allowed_origins

    def allows(self, scope: dict) -> bool:
        """Whether the handshake of ``scope`` (an ASGI ``websocket`` scope) may go on."""
        hosts = _header(scope, b"host")
        if len(hosts) != 1:
            return False
        name, _port = split_domain_port(hosts[0])
        if not name or not validate_host(name, settings.ALLOWED_HOSTS):
            return False
        origins = _header(scope, b"origin")
        if not origins:
            return True
        if len(origins) > 1:
            return False
        if same_origin(origins[0], hosts[0]):
            return True
        allowed = self._allowed_origins if self._allowed_origins is not None else get_config().allowed_origins
        try:
            return OriginValidator(None, allowed).validate_origin(urlsplit(origins[0]))
        except ValueError:  # a port that is not a number
            return False

    async def __call__(self, scope, receive, send):
        if scope["type"] == "websocket" and not self.allows(scope):
            log.info("refused a WebSocket handshake to %s: Host %s, Origin %s", scope.get("path"),
                     _header(scope, b"host")[:1], _header(scope, b"origin")[:1])
            return await WebsocketDenier()(scope, receive, send)
        return await self.application(scope, receive, send)


class NoRouteConsumer(AsyncWebsocketConsumer):
    """Any other WebSocket path: accepted, then closed at once with code 4404 and a reason naming
    the WebSocket routes (no traceback, no 500)."""

    async def connect(self) -> None:
        await self.accept()
        await self.close(code=CLOSE_NOT_FOUND, reason="no WebSocket route here; see /v1/realtime")


async def close_live_sessions(redis_url: str, code: int = CLOSE_GOING_AWAY,
                              reason: str = "the server is shutting down") -> None:
    """Ask every open realtime session of the deployment on ``redis_url`` to end: with ``code`` 1001 each
    drains (its open turns get their transcript, or ``failed`` ``shutting_down`` at the drain deadline),
    then sends a final ``error`` event (``session_closed``) and closes with ``code`` (CONTRACT R8.4:
    WebSocket clients get a close frame with a code). Called by ``serve`` before it stops the web server."""
    layer = RedisChannelLayer(**channel_layer_config(redis_url))
    try:
        await layer.group_send(LIVE_GROUP, {"type": "live.close", "code": code, "reason": reason})
    finally:
        await layer.close_pools()
