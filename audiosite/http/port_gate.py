"""A web process behind a proxy leaves its rotation while it cannot serve (``refuse_connections_when_unready``).

A web process that cannot reach Redis can admit nothing (every API request it accepts is answered 503
``redis_unavailable``), and one that drains (R8.4, SIGTERM) answers new calls 503 ``shutting_down``. A
proxy without active health checks (open-source nginx) keeps sending such a process its share of the
requests, and passes a request to another upstream only when *connecting* fails (``proxy_next_upstream
error``; a POST that reached an upstream is never sent to a second one). So, with
``refuse_connections_when_unready`` on, the web process makes connecting fail while it is unready:

- it stops listening on its ports (connections are refused) and closes every idle keep-alive
  connection, so that the proxy's cached connections to it are dropped too; a connection with a
  request in progress is closed once that request has been answered (HTTP ``persistent`` off), and
  WebSockets are left open (a drain ends them with its own close frame);
- *Redis*: from the moment its scheduler listener's subscription fails (``Listener.watch_subscription``:
  Redis reset, refused or closed the connection) until the listener has subscribed again; at start, a
  web process that cannot reach Redis closes its ports at its first try and opens them once Redis
  answers (the scheduler context exists). A silent partition (packets dropped, no reset) is not noticed;
- *drain*: from the drain's start until the process exits (admitted requests finish meanwhile).

Off (the default, one web process as ``manage.py serve`` runs it), the port stays open: a client then
gets the error shape instead of a refused connection. docs/operations.md, "Faults between hosts".
"""
from __future__ import annotations

import asyncio
import logging
import weakref
from typing import Any

from inference.runtime.context import async_context

log = logging.getLogger("audiosite.web")

CONTEXT_RETRY_S = 0.5
"""How long to wait before asking Redis again for the scheduler context at start (s)."""
REDIS = "Redis is out of reach"
DRAINING = "draining"
"""The reasons a gate is closed for (:meth:`PortGate.close`)."""


class PortGate:
    """The listening ports and open HTTP channels of one web process, closed while any reason holds.

    Ports are Twisted ``IListeningPort`` objects (``tcp.Port``: ``stopListening`` then
    ``startListening`` binds the same address again); channels are ``twisted.web.http.HTTPChannel``
    instances, kept weakly.
    """

    def __init__(self) -> None:
        self.ports: list[Any] = []
        self.channels: weakref.WeakSet[Any] = weakref.WeakSet()
        self.reasons: set[str] = set()

    @property
    def open(self) -> bool:
        """True while no reason to refuse holds."""
        return not self.reasons

    def add_port(self, port: Any) -> None:
        """A port daphne listens on (closed at once if the gate is closed)."""
        self.ports.append(port)
        if not self.open:
            port.stopListening()

    def close(self, reason: str) -> None:
        """Refuse new connections and close the idle ones, for ``reason`` (:data:`REDIS`, :data:`DRAINING`)."""
        was_open = self.open
        self.reasons.add(reason)
        if not was_open:
            return
        log.warning("%s: refusing connections (refuse_connections_when_unready)", reason)
        for port in self.ports:
            port.stopListening()
        for channel in list(self.channels):
            channel_idle_close(channel)

    def reopen(self, reason: str) -> None:
        """``reason`` no longer holds; listen again on every port once no other one does."""
        if reason not in self.reasons:
            return
        self.reasons.discard(reason)
        if not self.open:
            return
        log.warning("%s no longer: accepting connections", reason)
        for port in self.ports:
            try:
                port.startListening()
            except Exception:  # the address was taken meanwhile: nothing to serve on it
                log.exception("could not listen again on %s", port)


def channel_idle_close(channel: Any) -> None:
    """Close an HTTP channel now if no request is on it, else after the request in progress."""
    transport = getattr(channel, "transport", None)
    if transport is None:
        return
    if not channel.requests and not channel._handlingRequest and not getattr(channel, "partial_request", False):
        transport.loseConnection()
    else:
        end_keep_alive(channel)


def end_keep_alive(channel: Any) -> None:
    """Close ``channel`` once its requests so far have been answered: Twisted's ``persistent`` off, and
    ``Connection: close`` on each answer not yet started. Twisted sets ``persistent`` again from each
    request's headers as they end, so a channel whose request's headers were still arriving is told
    again then (``DeadlineHTTPChannel.allHeadersReceived`` calls this while the gate is closed)."""
    channel.persistent = False  # Twisted closes the connection once this request is done
    for request in list(getattr(channel, "requests", ())):
        if not getattr(request, "startedWriting", True):
            request.responseHeaders.setRawHeaders(b"Connection", [b"close"])


GATE = PortGate()
"""This process's gate (one daphne server per web process)."""

_FOLLOWERS: list[asyncio.Task] = []


def follow_redis_start(gate: PortGate = GATE) -> asyncio.Task:
    """Start :func:`follow_redis` on the running loop and keep its task: the loop holds only weak
    references to tasks, so an unreferenced one waiting for Redis is collected by the next full
    garbage collection (the gate then never closed: its watcher was never registered)."""
    task = asyncio.ensure_future(follow_redis(gate))
    _FOLLOWERS.append(task)
    return task


async def follow_redis(gate: PortGate = GATE) -> None:
    """Keep ``gate`` closed for :data:`REDIS` exactly while this loop's scheduler listener is not
    subscribed (module doc).

    Waits for the scheduler context (retrying every :data:`CONTEXT_RETRY_S`; the gate is closed
    meanwhile), then leaves a watcher on its listener and returns.
    """
    while True:
        try:
            ctx = await async_context()
            break
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            log.warning("Redis is unreachable at start (%s)", exc)
            gate.close(REDIS)
            await asyncio.sleep(CONTEXT_RETRY_S)

    def on_change(subscribed: bool) -> None:
        if subscribed:
            gate.reopen(REDIS)
        else:
            gate.close(REDIS)

    ctx.listener.watch_subscription(on_change)
    on_change(ctx.listener.subscribed)
