"""A web process behind a proxy leaves its rotation while it cannot reach Redis (``refuse_connections_without_redis``).

A web process that cannot reach Redis can admit nothing: every API request it accepts is answered
503 ``redis_unavailable``. A proxy without active health checks (open-source nginx) keeps sending it
its share of the requests, and passes a request to another upstream only when *connecting* fails
(``proxy_next_upstream error``; a POST that reached an upstream is never sent to a second one). So,
with ``refuse_connections_without_redis`` on, the web process makes connecting fail while Redis is
out of reach:

- when its scheduler listener's subscription fails (``Listener.watch_subscription``: Redis reset,
  refused or closed the connection), it stops listening on its ports (connections are refused) and
  closes every idle keep-alive connection, so that the proxy's cached connections to it are dropped
  too; a connection with a request in progress is closed once that request has been answered
  (HTTP ``persistent`` off), and WebSockets are left to their own fate;
- when the listener has subscribed again, it listens again on the same addresses.

At start, a web process that cannot reach Redis closes its ports at its first try and opens them
once Redis answers (the scheduler context exists). A silent
partition (packets dropped, no reset) is not noticed (the listener's ``watch_subscription``).
Off (the default, one web process as ``manage.py serve`` runs it), the port stays open and every
request is answered 503 ``redis_unavailable`` instead: a client then gets the error shape instead of a
refused connection. docs/operations.md, "Faults between hosts".
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


class PortGate:
    """The listening ports and open HTTP channels of one web process, closed and opened together.

    Ports are Twisted ``IListeningPort`` objects (``tcp.Port``: ``stopListening`` then
    ``startListening`` binds the same address again); channels are ``twisted.web.http.HTTPChannel``
    instances, kept weakly.
    """

    def __init__(self) -> None:
        self.ports: list[Any] = []
        self.channels: weakref.WeakSet[Any] = weakref.WeakSet()
        self.open = True
        self._port_calls: list[Any] = []

    def add_port(self, port: Any) -> None:
        """A port daphne listens on (closed at once if the gate is closed)."""
        self.ports.append(port)
        if not self.open:
            self._port_calls.append(port.stopListening())

    def close(self, why: str) -> None:
        """Refuse new connections and close the idle ones (no-op if already closed)."""
        if not self.open:
            return
        self.open = False
        log.warning("%s: refusing connections until it answers again (refuse_connections_without_redis)", why)
        for port in self.ports:
            self._port_calls.append(port.stopListening())
        for channel in list(self.channels):
            channel_idle_close(channel)

    def reopen(self) -> None:
        """Listen again on every port (no-op if open)."""
        if self.open:
            return
        self.open = True
        log.warning("Redis answers again: accepting connections")
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
    if not channel.requests and not channel._handlingRequest and getattr(channel, "_awaiting_request", True):
        transport.loseConnection()
    else:
        channel.persistent = False  # Twisted closes the connection once this request is done


GATE = PortGate()
"""This process's gate (one daphne server per web process)."""


async def follow_redis(gate: PortGate = GATE) -> None:
    """Keep ``gate`` open exactly while this loop's scheduler listener is subscribed (module doc).

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
            gate.close(f"Redis is unreachable at start ({exc})")
            await asyncio.sleep(CONTEXT_RETRY_S)

    def on_change(subscribed: bool) -> None:
        if subscribed:
            gate.reopen()
        else:
            gate.close("lost the connection to Redis")

    ctx.listener.watch_subscription(on_change)
    on_change(ctx.listener.subscribed)
