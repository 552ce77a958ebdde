"""daphne's classes for audiosite, installed by :func:`install` (``python -m audiosite.web`` calls it).

daphne's request class is replaced by :class:`BoundedWebRequest`, which differs in these ways:

- Twisted's own parsing of POST bodies into ``request.args``
  (``parsePOSTFormSubmission``, on by default) is off. Daphne never uses
  those args (the body goes to Django as-is), but Twisted parses a whole
  multipart upload in its reactor thread before the view can refuse it:
  measured, a 300 MB upload held about 4 GB and stalled every other request
  for about 30 s. A malformed multipart body gets the JSON 400 of the API
  instead of Twisted's empty one.
- A body of at most ``IN_MEMORY_BODY_MAX_BYTES`` is received into memory
  rather than a temporary file.
- A streamed response (several body messages: speech, SSE) applies
  backpressure: the request registers a :class:`WriteGate` as the push
  producer of its connection, which Twisted pauses when the connection's send
  buffer is over its ``bufferSize`` (64 KiB) and resumes once it is written
  out. :meth:`DrainingServer.handle_reply` (the application's ``send``) returns
  only once the gate is open again, so the application yields its next chunk
  only then: a client that does not read holds at most 64 KiB plus one body
  message of the web process. A gate that stays closed for
  ``stream_write_timeout_ms`` drops the connection; daphne then tells the
  application (``http.disconnect``), which ends the stream and releases its
  lease. Without it Twisted's buffer grew without bound (two clients that
  never read a speech stream held about 54 MB each, for as long as they
  stayed connected).
- The body is bounded by ``max_request_body_bytes``. Twisted receives a
  request's whole body (spooled to a temporary file past 100 KB) before
  daphne calls the application, and daphne then queues all of it in memory
  at once; so a limit checked by the application comes too late. Here a
  ``Content-Length`` over the limit is answered 413 as soon as the headers
  are in, and a body without one (chunked) is answered 413 as soon as it
  passes the limit; what the client sends after that is read and dropped.

Each connection is a :class:`DeadlineHTTPChannel`: a request's headers and its body each have an
absolute deadline (``request_header_timeout_ms``, ``request_body_timeout_ms``; 408 past either), so a
client dribbling its request a byte at a time cannot hold a connection open. The event loop writes a
heartbeat for ``manage.py serve`` (``audiosite.heartbeat``), which restarts a process whose loop stalls.

WebSockets: the protocol class is :class:`CloseCodeWebSocketProtocol` (it can close with 1009 and
the other server codes of RFC 6455), and daphne's message size limit is set above
``live_ingest.max_chunk_bytes`` (:func:`websocket_limit_bytes`) so that the consumer, not daphne,
answers an oversized message.

The server class is :class:`DrainingServer`, which
drains before it stops (CONTRACT R8.4, ``audiosite.drain``): daphne's own
shutdown cancels every running application instance ("Killed N pending
application instances", clients see reset connections), so the first
SIGTERM or SIGINT no longer stops the reactor. It starts the drain
(``/health`` 503 ``draining``, new calls 503 ``shutting_down``), waits until
every admitted request has been answered (at most ``shutdown_timeout_ms``,
then what is left is answered 503 or ends its stream with an error event),
closes the idle keep-alive connections after their last response was
written (and WebSocket sessions no consumer closed, with code 1001), and
only then stops the reactor (exit code 0). A second signal
stops at once (daphne's own shutdown).
"""
from __future__ import annotations

import asyncio
import gc
import io
import json
import logging
import signal
import time
from typing import Any

import daphne.http_protocol
import daphne.server
import twisted.web.http
import daphne.ws_protocol
from daphne.cli import CommandLineInterface
from daphne.server import Server
from daphne.ws_protocol import WebSocketProtocol
from twisted.internet import reactor  # daphne's asyncio reactor (installed by daphne.server's import)
from twisted.internet.interfaces import IPushProducer
from twisted.internet.protocol import connectionDone
from twisted.python.failure import Failure
from zope.interface import implementer

from audiosite import heartbeat
from audiosite.drain import DRAIN, WEBSOCKET_CLOSE_GOING_AWAY, tracked
from audiosite.errors import PayloadTooLarge, error_body
from audiosite.http.port_gate import DRAINING, GATE, end_keep_alive, follow_redis_start
from audiosite.serverconfig import get_config
from inference.runtime import metrics

#: A body whose declared length is at most this is received into memory; a longer one, or one of
#: unknown length (chunked), is spooled to a temporary file as Twisted does (bytes). Twisted's own
#: threshold is 100 KB, so every short clip sent as base64 JSON or multipart (a 3.5 s WAV is 150 KB)
#: paid for creating, writing, reading and deleting a file (a system call each; measured 0.19 ms
#: against 0.12 ms in memory for 150 KB on this machine's /tmp, more where /tmp is a slow disk).
#: Daphne holds the whole body in memory once it is in anyway; this only moves that moment earlier
#: for bodies of at most 1 MiB.
IN_MEMORY_BODY_MAX_BYTES = 1 << 20

log = logging.getLogger("audiosite.web")

#: After a 413, how long the connection stays open (reading and dropping what the client still
#: sends, so that our answer is not lost to a TCP reset) before it is closed, in seconds.
REFUSAL_LINGER_S = 2.0


@implementer(IPushProducer)
class WriteGate:
    """The push producer of one streamed response (module doc): closed while the connection's send buffer
    is full. Twisted calls ``pauseProducing`` / ``resumeProducing`` (interface ``IPushProducer``);
    :meth:`wait_open` is awaited by the application's ``send``."""

    def __init__(self) -> None:
        self._open = asyncio.Event()
        self._open.set()
        self._stopped = False

    def pauseProducing(self) -> None:  # noqa: N802 (Twisted's interface)
        if not self._stopped:  # a write after the connection was lost must not close the gate again
            self._open.clear()

    def resumeProducing(self) -> None:  # noqa: N802 (Twisted's interface)
        self._open.set()

    def stopProducing(self) -> None:  # noqa: N802 (Twisted's interface: the connection is going away)
        """Open for good: nothing is sent any more, so no later write may close the gate and make the
        application's ``send`` wait for a buffer that will never drain."""
        self._stopped = True
        self._open.set()

    async def wait_open(self, timeout_s: float) -> bool:
        """True once the send buffer has room (at once, without suspending, if it has); False after
        ``timeout_s`` (s).

        ``asyncio.timeout`` rather than ``asyncio.wait_for``: on Python 3.11 ``wait_for`` can swallow a
        cancellation that arrives as its inner wait completes, and the handler cancels a streamed
        response's send task when its client leaves: a swallowed cancel left the stream running (and
        its lease held) until daphne killed it 10 s later.
        """
        if self._open.is_set():
            return True
        try:
            async with asyncio.timeout(timeout_s):
                await self._open.wait()
        except TimeoutError:
            return False
        return True


class BoundedWebRequest(daphne.http_protocol.WebRequest):
    """daphne's ``WebRequest`` without Twisted's form parsing, with a bounded body, and with backpressure
    on streamed responses (module doc)."""

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.write_gate: WriteGate | None = None
        self._parsePOSTFormSubmission = False  # twisted.web.http.Request's documented switch
        self._body_bytes = 0
        self._refused = False
        self._linger_call = None

    @staticmethod
    def _limit_bytes() -> int:
        return get_config().max_request_body_bytes

    def gotLength(self, length: int | None) -> None:
        """Twisted: the headers are in; ``length`` is the declared body size in bytes (None: chunked)."""
        limit = self._limit_bytes()
        if length is not None and length > limit:
            self.requestHeaders.removeHeader(b"Expect")  # no "100 Continue" after the refusal
            self.content = io.BytesIO()
            self._refuse(PayloadTooLarge(f"request body of {length} bytes exceeds max_request_body_bytes={limit}"))
            return
        if length is not None and length <= IN_MEMORY_BODY_MAX_BYTES:
            self.content = io.BytesIO()  # Twisted would spool anything over 100 KB to a temporary file
            return
        super().gotLength(length)

    def handleContentChunk(self, data: bytes) -> None:
        """Twisted: the next piece of the body (after de-chunking); dropped once the request is refused."""
        if self._refused:
            return
        self._body_bytes += len(data)
        limit = self._limit_bytes()
        if self._body_bytes > limit:
            self.content.close()
            self.content = io.BytesIO()
            self._refuse(PayloadTooLarge(f"request body of more than {limit} bytes exceeds "
                                         f"max_request_body_bytes={limit}"))
            return
        super().handleContentChunk(data)

    def process(self):
        """daphne: hand the complete request to the application, unless it was refused."""
        if self._refused:
            return None
        return super().process()

    def _refuse(self, error: PayloadTooLarge) -> None:
        """Answer ``error`` (413, API error shape) at once and end the connection.

        The write side is closed after the answer; the read side stays open for
        :data:`REFUSAL_LINGER_S` so the client can read the answer before the
        connection is aborted (closing a socket with unread input would reset
        the connection and could destroy the answer in flight).
        """
        self._refused = True
        body = json.dumps(error.body(), separators=(",", ":")).encode()
        head = (f"HTTP/1.1 {error.status} Payload Too Large\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        transport = self.channel.transport
        transport.write(head + body)
        half_close = getattr(transport, "loseWriteConnection", None)
        if half_close is None:
            transport.loseConnection()
            return
        half_close()
        self._linger_call = self.channel.callLater(REFUSAL_LINGER_S, transport.abortConnection)

    def handle_reply(self, message):
        """daphne: one ASGI message of the response. The first body message with ``more_body`` registers
        the :class:`WriteGate` (closed at once if the transport is already full: Twisted's documented
        ``HTTPChannel._waitingForTransport``); the last one unregisters it before the request finishes
        (Twisted logs a producer left registered at the end of a request)."""
        is_body = message.get("type") == "http.response.body"
        if is_body and not self.finished and getattr(self, "channel", None) is not None:
            if message.get("more_body") and self.write_gate is None:
                self.write_gate = WriteGate()
                self.registerProducer(self.write_gate, True)
                if getattr(self.channel, "_waitingForTransport", False):
                    self.write_gate.pauseProducing()
            elif not message.get("more_body") and self.producer is not None:
                self.unregisterProducer()
        super().handle_reply(message)

    def drop_slow_client(self) -> None:
        """End the connection of a client that stopped reading (the send buffer is dropped)."""
        channel = getattr(self, "channel", None)
        if channel is not None and channel.transport is not None:
            channel.transport.abortConnection()

    def handle_exception(self, exception) -> None:
        """daphne: the application raised. Before the response started, daphne's own 500. After it (a
        streamed body cut by a failure, e.g. the model's process ended mid-speech), the connection is
        closed without ending the body, so the client sees it cut short (a chunked body without its last
        chunk) at once instead of waiting for bytes that will never come."""
        if not self._response_started:
            super().handle_exception(exception)
            return
        log.warning("a streamed response was cut by %s: closing its connection", type(exception).__name__)
        channel = getattr(self, "channel", None)
        if channel is not None and channel.transport is not None:
            channel.transport.loseConnection()

    def connectionLost(self, reason) -> None:
        if self._linger_call is not None and self._linger_call.active():
            self._linger_call.cancel()
        if self.write_gate is not None:
            self.write_gate.stopProducing()
            if self.producer is not None and getattr(self, "channel", None) is not None:
                self.unregisterProducer()
        super().connectionLost(reason)


class DeadlineHTTPChannel(twisted.web.http.HTTPChannel):
    """Twisted's HTTP/1.1 channel with two absolute deadlines per request (a client that dribbles its
    request a byte at a time resets Twisted's idle timeout forever, and daphne sets none of its own):

    - headers: from the connection's start, or from the first byte of a later request on it, until the
      end of its headers, at most ``request_header_timeout_ms``;
    - body: from the end of the headers until the end of the body, at most ``request_body_timeout_ms``.

    Past a deadline the client gets 408 in the API error shape (code ``request_timeout``) and the
    connection is closed (aborted after ``REFUSAL_LINGER_S`` if the client does not read). A deadline
    never fires while a request is being answered (a pipelined next request waits for it); a WebSocket,
    once upgraded, no longer goes through this channel.
    """

    def __init__(self) -> None:
        super().__init__()
        self._deadline_call = None
        self._awaiting_request = True  # the next byte begins a request's headers
        self.partial_request = False  # bytes of a request arrived and its body is not complete yet

    def connectionMade(self) -> None:  # noqa: N802 (Twisted's interface)
        super().connectionMade()
        GATE.channels.add(self)  # closed when idle if Redis goes out of reach (audiosite.http.port_gate)
        self._arm("headers", get_config().request_header_timeout_ms)
        self._awaiting_request = False

    def dataReceived(self, data: bytes) -> None:  # noqa: N802 (Twisted's interface)
        if self._awaiting_request and self._deadline_call is None:
            self._arm("headers", get_config().request_header_timeout_ms)
        self._awaiting_request = False
        self.partial_request = True
        super().dataReceived(data)

    def allHeadersReceived(self) -> None:  # noqa: N802 (Twisted's interface)
        self._disarm()
        super().allHeadersReceived()  # sets ``persistent`` from this request's headers
        if not GATE.open:  # refusing connections: this one closes after its answer (audiosite.http.port_gate)
            end_keep_alive(self)
        if self.length != 0 and self.transport is not None:  # a body follows (a length, or chunked: None)
            self._arm("body", get_config().request_body_timeout_ms)

    def allContentReceived(self) -> None:  # noqa: N802 (Twisted's interface)
        self._disarm()
        self._awaiting_request = True
        self.partial_request = False
        super().allContentReceived()

    def connectionLost(self, reason: Failure = connectionDone) -> None:  # noqa: N802 (Twisted's interface)
        self._disarm()
        super().connectionLost(reason)

    def _arm(self, part: str, timeout_ms: int) -> None:
        self._disarm()
        call_later: Any = self.callLater  # TimeoutMixin's: the reactor's callLater
        self._deadline_call = call_later(timeout_ms / 1000, self._expired, part, timeout_ms)

    def _disarm(self) -> None:
        if self._deadline_call is not None and self._deadline_call.active():
            self._deadline_call.cancel()
        self._deadline_call = None

    def _expired(self, part: str, timeout_ms: int) -> None:
        self._deadline_call = None
        if self._handlingRequest:  # answering an earlier request: the next one's deadline waits for it
            self._arm(part, timeout_ms)
            return
        transport: Any = self.transport
        if transport is None:
            return
        setting = "request_header_timeout_ms" if part == "headers" else "request_body_timeout_ms"
        log.warning("closed a connection whose request %s took over %d ms (%s)", part, timeout_ms, setting)
        body = json.dumps(error_body(f"the request's {part} did not arrive within {timeout_ms} ms ({setting})",
                                     "invalid_request_error", None, "request_timeout"),
                          separators=(",", ":")).encode()
        transport.write((f"HTTP/1.1 408 Request Timeout\r\nContent-Type: application/json\r\n"
                         f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode() + body)
        self.dataReceived = lambda data: None  # type: ignore[method-assign]  # what else comes is dropped
        transport.loseConnection()
        call_later: Any = self.callLater
        call_later(REFUSAL_LINGER_S, transport.abortConnection)


class DeadlineHTTPFactory(daphne.http_protocol.HTTPFactory):
    """daphne's HTTP factory whose connections use :class:`DeadlineHTTPChannel` (Twisted builds each
    connection's protocol as ``_GenericHTTPChannelProtocol(HTTPChannel())``; the same with ours)."""

    def protocol(self):  # Twisted calls self.protocol() to build one
        return twisted.web.http._GenericHTTPChannelProtocol(DeadlineHTTPChannel())


SERVER_CLOSE_CODES = frozenset({1001, 1008, 1009, 1011, 1013})
"""RFC 6455 close codes (section 7.4.1) a server sends besides 1000: going away, policy violation,
message too big, internal error, try again later. autobahn's public ``sendClose`` refuses them
(it admits only 1000 and 3000-4999); they go out through its frame-level ``sendCloseFrame``."""


class CloseCodeWebSocketProtocol(daphne.ws_protocol.WebSocketProtocol):
    """daphne's WebSocket protocol, able to close with the protocol codes of :data:`SERVER_CLOSE_CODES`
    (``live_ingest`` limits close with 1009; daphne would raise on it and drop the socket with 1011)."""

    def serverClose(self, code=None):
        if code in SERVER_CLOSE_CODES:
            self.sendCloseFrame(code=code, isReply=False)
            return
        super().serverClose(code)


WS_FRAME_HEADROOM = 16
"""daphne drops (without a close frame) a WebSocket message over its own size limit before the
application sees it. Its limit is set to this many times ``live_ingest.max_chunk_bytes`` (at least
16 MiB), so a message over ``max_chunk_bytes`` reaches the consumer, which answers it with an
``error`` event and close code 1009; only a message past daphne's limit is cut off unanswered."""


def websocket_limit_bytes() -> int:
    """daphne's WebSocket message and frame size limit (see :data:`WS_FRAME_HEADROOM`), in bytes."""
    return max(16 * 1024 * 1024, WS_FRAME_HEADROOM * get_config().live_ingest.max_chunk_bytes)


#: After the deadline cut what was left (``audiosite.drain``), how long the answers may take to be written
#: before the server stops anyway, in seconds.
EXPIRY_GRACE_S = 5.0
#: How long idle keep-alive connections may take to close (their last response flushed), in seconds.
CLOSE_GRACE_S = 2.0
DRAIN_SIGNALS = (signal.SIGTERM, signal.SIGINT)
ARRIVING_POLL_S = 0.02
"""How often a drain looks whether the requests still arriving when it began have been answered (s)."""


def freeze_loaded_objects() -> None:
    """Move every object alive when the server starts (modules, Django's URL and settings objects, the
    loaded application: about 150,000) into the collector's permanent generation (``gc.freeze``, Python
    docs of the ``gc`` module), so no later collection scans them again. A full collection of this
    process took 83 ms with them on a 2-CPU machine (``gc.callbacks`` timing), a pause every request in
    flight would wait out; the objects of requests are still collected as before."""
    gc.collect()
    gc.freeze()


class DrainingServer(Server):
    """daphne's ``Server`` that drains on the first SIGTERM/SIGINT and stops at once on the second.

    Twisted's own signal handlers (which stop the reactor at once) are not
    installed; ours go on the asyncio loop under the reactor when it starts.
    The application is wrapped by :func:`audiosite.drain.tracked`, so the
    drain knows when the last request has been answered.
    """

    def __init__(self, application, *args, **kwargs):
        super().__init__(tracked(application), *args, **kwargs)
        self._drain_signals: bool = kwargs.get("signal_handlers", True)
        self.signal_handlers = False  # Twisted's would stop the reactor (and kill the apps) at once
        self._drain_task: asyncio.Task | None = None

    async def handle_reply(self, protocol, message):
        """daphne: the application's ``send``. After a body message of a streamed response, wait until
        the connection's send buffer has room (module doc); past ``stream_write_timeout_ms`` drop the
        client (the application then gets ``http.disconnect``)."""
        await super().handle_reply(protocol, message)
        gate = getattr(protocol, "write_gate", None)
        if gate is None or message.get("type") != "http.response.body" or not message.get("more_body"):
            return
        timeout_ms = get_config().stream_write_timeout_ms
        if not await gate.wait_open(timeout_ms / 1000):
            log.warning("dropped a client that read nothing of its streamed response for %d ms "
                        "(stream_write_timeout_ms)", timeout_ms)
            protocol.drop_slow_client()

    def run(self):
        if self._drain_signals:
            reactor.callWhenRunning(self._install_signal_handlers)
        reactor.callWhenRunning(heartbeat.start)  # serve's liveness check of this loop (audiosite.heartbeat)
        reactor.callWhenRunning(metrics.process_publish_start)  # this process's CPU and memory for /metrics
        reactor.callWhenRunning(freeze_loaded_objects)
        if get_config().refuse_connections_when_unready:
            reactor.callWhenRunning(follow_redis_start)
        super().run()

    def listen_success(self, port):
        """daphne: a port is listening; :data:`GATE` keeps it to close and open it again."""
        super().listen_success(port)
        GATE.add_port(port)

    def _install_signal_handlers(self) -> None:
        loop = asyncio.get_event_loop()
        for signum in DRAIN_SIGNALS:
            loop.add_signal_handler(signum, self._on_signal, signum)

    def _on_signal(self, signum: int) -> None:
        name = signal.Signals(signum).name
        if self._drain_task is None:
            log.warning("received %s: draining (shutdown_timeout_ms=%d); a second signal stops at once",
                        name, get_config().shutdown_timeout_ms)
            self._drain_task = asyncio.ensure_future(self._drain_then_stop())
        else:
            log.warning("received %s again: stopping now", name)
            self.stop()

    async def _drain_then_stop(self) -> None:
        started = time.monotonic()
        try:
            if get_config().refuse_connections_when_unready:  # a proxy sends new requests elsewhere
                GATE.close(DRAINING)
            DRAIN.begin(get_config().shutdown_timeout_ms)
            clean = await DRAIN.wait(EXPIRY_GRACE_S)
            clean = await self._answer_requests_on_their_way() and clean
            await self._close_connections()
            await metrics.flush()  # the counters of the last answers (record_soon batches them)
            log.warning("drain %s after %.1f s; stopping", "done" if clean else "cut short", time.monotonic() - started)
        except Exception:
            log.exception("drain failed; stopping")
        self.stop()

    def _requests_unanswered(self) -> int:
        """HTTP requests begun (their request line is in) and not answered yet: daphne's ``connections``
        holds each from its first line until it finishes. Those still arriving (headers or body on the
        way in) are not yet counted by the drain (``tracked`` sees a request once it is complete)."""
        return sum(1 for protocol, details in self.connections.items()
                   if isinstance(protocol, daphne.http_protocol.WebRequest) and "disconnected" not in details)

    async def _answer_requests_on_their_way(self) -> bool:
        """Once admitted work is done, wait (until the drain's deadline) for the requests that were still
        arriving when the drain began (an upload's body, say) to arrive and be answered: an unsafe one
        503 ``shutting_down``, a read as usual. Closing their connections earlier left those clients
        without an answer. Returns False if some were still unanswered at the deadline."""
        assert DRAIN.deadline_s is not None
        while self._requests_unanswered():
            if time.monotonic() >= DRAIN.deadline_s:
                log.warning("drain: %d request(s) still arriving at the deadline; closing their connections",
                            self._requests_unanswered())
                return False
            await asyncio.sleep(ARRIVING_POLL_S)
        return await DRAIN.wait(EXPIRY_GRACE_S)

    async def _close_connections(self) -> None:
        """Close every open connection once its pending output is written (Twisted's ``loseConnection``);
        a WebSocket still open (one whose consumer registered no drain watch) gets a close frame with
        code 1001 ("going away") first."""
        for protocol in list(self.connections):
            transport = getattr(protocol, "transport", None)
            if isinstance(protocol, WebSocketProtocol):
                try:
                    if isinstance(protocol, CloseCodeWebSocketProtocol):  # autobahn's sendClose refuses 1001
                        protocol.serverClose(code=WEBSOCKET_CLOSE_GOING_AWAY)
                    else:
                        protocol.sendClose(code=WEBSOCKET_CLOSE_GOING_AWAY, reason="server shutting down")
                    continue
                except Exception:  # not open any more: just drop the transport
                    log.debug("close frame not sent", exc_info=True)
            if transport is not None:
                transport.loseConnection()
        deadline = time.monotonic() + CLOSE_GRACE_S
        while time.monotonic() < deadline and any("disconnected" not in details
                                                  for details in self.connections.values()):
            await asyncio.sleep(0.02)


def install() -> None:
    """Install :class:`BoundedWebRequest` as daphne's request class, :class:`DeadlineHTTPFactory` as its
    HTTP factory, :class:`CloseCodeWebSocketProtocol` as its WebSocket protocol and :class:`DrainingServer`
    as its command line's server (module attributes daphne reads when it builds them; see
    ``audiosite.http``). Call before daphne's ``CommandLineInterface`` runs."""
    daphne.http_protocol.WebRequest = BoundedWebRequest  # read by daphne's HTTPFactory.buildProtocol
    daphne.server.HTTPFactory = DeadlineHTTPFactory  # daphne's Server builds its factory from this name
    daphne.ws_protocol.WebSocketFactory.protocol = CloseCodeWebSocketProtocol  # built per WebSocket connection
    CommandLineInterface.server_class = DrainingServer


def daphne_argv(argv: list[str]) -> list[str]:
    """``argv`` (daphne's command line) with daphne's WebSocket size limits set to
    :func:`websocket_limit_bytes` unless given."""
    limit = str(websocket_limit_bytes())
    for flag in ("--websocket-max-message-size", "--websocket-max-frame-size"):
        if flag not in argv:
            argv = [flag, limit, *argv]
    return argv
