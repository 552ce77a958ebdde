"""The graceful drain of one web process (CONTRACT R8.4): readiness off, new work refused, admitted work bounded.

One :class:`Drain` per process (:data:`DRAIN`), driven by the ASGI server
(``audiosite.http.daphne_server`` calls :meth:`Drain.begin` on the first SIGTERM or SIGINT
and :meth:`Drain.wait` before it stops daphne). While it drains:

1. ``/health`` answers 503 ``"status": "draining"`` (readiness first: a load
   balancer stops sending) and ``audiosite_draining`` reads 1;
2. every API call with an unsafe method (POST, PUT, PATCH, DELETE:
   inference and management alike) is refused at once with 503
   ``server_busy`` code ``shutting_down`` and ``Retry-After``
   (:func:`refusal`); reads (``GET /v1/models``, ``/metrics``, voices) still
   answer, so an operator can watch the drain;
3. work admitted before the signal (running, or queued for a slot) goes on;
   :meth:`Drain.wait` returns as soon as no HTTP request is being answered
   (:func:`tracked` counts them) and no watched session (:meth:`Drain.watch`)
   is open any more; WebSocket sessions that registered no watch (a status
   stream, say) hold nothing up: the server closes them with 1001 at the end;
4. at the deadline (``shutdown_timeout_ms`` after the signal) what is still
   in a view is cancelled and answered 503 ``shutting_down``
   (:meth:`Drain.bounded`: a queued ticket is withdrawn, R8.1; a run handed
   to a worker finishes there and the worker releases its lease, R8.2), and
   a streaming body ends with a final error event (:meth:`Drain.until_expired`).
   Nothing is reset: every client gets an answer.

WebSocket consumers (and anything else holding a long session) take part
through :meth:`Drain.watch`: the callback runs once when the drain begins,
with a :class:`DrainNotice`; it should send its client a final event and
close with code 1001 ("going away") before ``notice.deadline_s``.

Everything here runs on the web process's one event loop; no locking.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import logging
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import dataclass
from typing import Any, TypeVar

from audiosite.errors import ShuttingDown

log = logging.getLogger(__name__)

_OUTCOMES: set[asyncio.Future] = set()
"""Watchers' coroutines in progress: the loop keeps only weak references to tasks, so an unreferenced
one can be collected while it waits."""


def _run_outcome(outcome: Awaitable[Any]) -> None:
    """Run a watcher's awaitable ``outcome`` to its end, referenced meanwhile."""
    task = asyncio.ensure_future(outcome)
    _OUTCOMES.add(task)
    task.add_done_callback(_OUTCOMES.discard)

T = TypeVar("T")

SHUTTING_DOWN_RETRY_AFTER_S = 1
"""``Retry-After`` (s) of a ``shutting_down`` refusal: behind a load balancer another web process answers
at once; a lone ``serve`` is back once restarted."""

WEBSOCKET_CLOSE_GOING_AWAY = 1001
"""RFC 6455 §7.4.1: the endpoint is going away (server shutdown). The code a drained WebSocket closes with."""


def refusal(what: str = "this request") -> ShuttingDown:
    """The 503 ``server_busy`` (code ``shutting_down``, ``Retry-After``) of work refused or cut by a drain."""
    return ShuttingDown(f"the server is shutting down: {what} was not served; retry (another instance, or after "
                        "the restart)", retry_after_s=SHUTTING_DOWN_RETRY_AFTER_S)


SAFE_METHODS = ("GET", "HEAD", "OPTIONS")
"""Methods still served while a process drains (reads); every other method is refused 503 ``shutting_down``."""


async def send_refusal(send: Callable[[dict], Awaitable[None]], what: str) -> None:
    """Answer an ASGI HTTP request with :func:`refusal`'s 503 (API error shape, ``Retry-After``), as raw ASGI
    messages (for the paths Django's full handler serves: the admin)."""
    error = refusal(what)
    body = json.dumps(error.body(), separators=(",", ":")).encode()
    headers = [(b"content-type", b"application/json"), (b"content-length", str(len(body)).encode()),
               *((name.lower().encode(), value.encode()) for name, value in error.headers().items())]
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


class DrainExpired(Exception):
    """Raised by :meth:`Drain.until_expired` when the drain deadline passes before the next item."""


@dataclass(frozen=True)
class DrainNotice:
    """What a :meth:`Drain.watch` callback is told: ``deadline_s`` (``time.monotonic()`` seconds) by
    which its session must have ended, and ``timeout_ms`` (``shutdown_timeout_ms``)."""

    deadline_s: float
    timeout_ms: int


class Watch:
    """A registration made by :meth:`Drain.watch`; :meth:`close` (or leaving the ``with``) removes it."""

    def __init__(self, drain: Drain, callback: Callable[[DrainNotice], Any]):
        self._drain = drain
        self.callback = callback

    def close(self) -> None:
        self._drain._watches.discard(self)
        self._drain._signal_change()

    def __enter__(self) -> Watch:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class Drain:
    """The drain state of this process (see the module doc). Tests and the server use :data:`DRAIN`."""

    def __init__(self) -> None:
        self.draining = False
        self.expired = False
        self.deadline_s: float | None = None
        self.timeout_ms = 0
        self._in_flight: dict[str, int] = {}
        self._bounded: set[asyncio.Task] = set()
        self._cut: set[asyncio.Task] = set()
        self._watches: set[Watch] = set()
        self._changed: asyncio.Event | None = None
        self._expired_event: asyncio.Event | None = None

    # -- what the server calls -------------------------------------------------------------------
    def begin(self, timeout_ms: int) -> None:
        """Start draining (idempotent): readiness off, new unsafe calls refused, watchers told, deadline set.

        Args:
            timeout_ms: how long admitted work may still take (``shutdown_timeout_ms``), ≥ 0.
        """
        if self.draining:
            return
        self.draining = True
        self.timeout_ms = timeout_ms
        self.deadline_s = time.monotonic() + timeout_ms / 1000
        notice = DrainNotice(self.deadline_s, timeout_ms)
        for watch in list(self._watches):
            try:
                outcome = watch.callback(notice)
                if inspect.isawaitable(outcome):
                    _run_outcome(outcome)
            except Exception:
                log.exception("a drain watcher failed")
        self._signal_change()

    def expire(self) -> int:
        """The deadline passed: cut what is still in a view (503) or streaming (final error event).

        Returns:
            How many views were cut.
        """
        self.expired = True
        for task in list(self._bounded):
            self._cut.add(task)
            task.cancel()
        if self._expired_event is not None:
            self._expired_event.set()
        return len(self._cut)

    def in_flight(self) -> dict[str, int]:
        """Connections being served now, by ASGI scope type (``http``, ``websocket``); zeros omitted."""
        return {kind: n for kind, n in self._in_flight.items() if n}

    def busy(self) -> bool:
        """True while an HTTP request is being answered or a watched session (:meth:`watch`) is open:
        what the drain waits for. Unwatched WebSocket sessions do not count."""
        return bool(self._in_flight.get("http")) or bool(self._watches)

    async def wait(self, grace_s: float) -> bool:
        """Wait until nothing is served any more; at the deadline :meth:`expire`, then wait ``grace_s`` more.

        Returns:
            True when everything ended (False: something outlived the grace; the server stops anyway).
        """
        assert self.deadline_s is not None, "begin() first"
        if await self._idle_by(self.deadline_s):
            return True
        cut = self.expire()
        log.warning("drain: shutdown_timeout_ms=%d passed with %s in flight; %d view(s) answered 503 shutting_down",
                    self.timeout_ms, self.in_flight(), cut)
        return await self._idle_by(time.monotonic() + grace_s)

    async def _idle_by(self, deadline_s: float) -> bool:
        while self.busy():
            left_s = deadline_s - time.monotonic()
            if left_s <= 0:
                return False
            changed = self._event()
            changed.clear()
            try:
                await asyncio.wait_for(changed.wait(), left_s)
            except TimeoutError:
                return not self.busy()
        return True

    # -- what the application uses ---------------------------------------------------------------
    def watch(self, callback: Callable[[DrainNotice], Any]) -> Watch:
        """Register ``callback(notice)`` (a function or coroutine function) to run once when the drain begins.

        For WebSocket consumers: register on connect, close the returned :class:`Watch` on
        disconnect; on the notice send the client a final event and close with
        :data:`WEBSOCKET_CLOSE_GOING_AWAY`. The drain waits (until its deadline) for every open
        watch to be closed. A callback registered during a drain runs at once.
        """
        watch = Watch(self, callback)
        self._watches.add(watch)
        if self.draining and self.deadline_s is not None:
            outcome = callback(DrainNotice(self.deadline_s, self.timeout_ms))
            if inspect.isawaitable(outcome):
                _run_outcome(outcome)
        return watch

    async def bounded(self, aw: Awaitable[T]) -> T:
        """Await ``aw`` (a view's work) in the current task; if the drain deadline cuts it, raise the 503.

        The cut is a cancellation of the current task, exactly what a client
        disconnect does (so the services' clean-up paths apply: a queued
        ticket is withdrawn, a lease not yet handed to a worker is given back).

        Raises:
            ServerBusy: (code ``shutting_down``) the deadline passed first.
        """
        if self.expired:  # only reads get this far now (unsafe calls are refused first): short, not cut
            return await aw
        task = asyncio.current_task()
        assert task is not None
        self._bounded.add(task)
        try:
            return await aw
        except asyncio.CancelledError:
            if task in self._cut:
                task.uncancel()
                raise refusal("this request, admitted before the drain, did not finish within "
                              f"shutdown_timeout_ms={self.timeout_ms} and") from None
            raise
        finally:
            self._bounded.discard(task)
            self._cut.discard(task)

    async def until_expired(self, items: AsyncIterator[T]) -> AsyncIterator[T]:
        """Yield from ``items`` until the drain deadline passes; then raise :class:`DrainExpired`.

        For streamed bodies: the caller turns the exception into its final
        error event and ends the body normally (no reset). ``items`` is not
        closed here.
        """
        iterator = aiter(items)
        while True:
            if self.expired:
                raise DrainExpired()
            step = asyncio.ensure_future(anext(iterator))
            expired = asyncio.ensure_future(self._expired().wait())
            try:
                await asyncio.wait({step, expired}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                expired.cancel()
            if not step.done():
                step.cancel()
                try:
                    await step
                except (asyncio.CancelledError, StopAsyncIteration):
                    pass
                raise DrainExpired()
            try:
                item = step.result()
            except StopAsyncIteration:
                return
            yield item

    # -- bookkeeping -----------------------------------------------------------------------------
    def _event(self) -> asyncio.Event:
        if self._changed is None:
            self._changed = asyncio.Event()
        return self._changed

    def _expired(self) -> asyncio.Event:
        if self._expired_event is None:
            self._expired_event = asyncio.Event()
            if self.expired:
                self._expired_event.set()
        return self._expired_event

    def _signal_change(self) -> None:
        if self._changed is not None:
            self._changed.set()

    def _enter(self, kind: str) -> None:
        self._in_flight[kind] = self._in_flight.get(kind, 0) + 1

    def _leave(self, kind: str) -> None:
        self._in_flight[kind] -= 1
        self._signal_change()


DRAIN = Drain()
"""This process's drain."""


def tracked(app: Callable[..., Awaitable[None]], drain: Drain = DRAIN) -> Callable[..., Awaitable[None]]:
    """Wrap an ASGI application so ``drain`` counts the HTTP and WebSocket connections it serves.

    An HTTP connection counts from its request until the application returns
    (the response sent); a WebSocket one for its whole session. A WebSocket
    handshake arriving during a drain is refused (close before accept: the
    server answers HTTP 403) without reaching ``app``.
    """
    async def counted(scope: dict, receive: Callable, send: Callable) -> None:
        kind = scope.get("type", "")
        if kind not in ("http", "websocket"):
            return await app(scope, receive, send)
        if kind == "websocket" and drain.draining:  # no new session: refuse the handshake (HTTP 403)
            await receive()  # websocket.connect
            await send({"type": "websocket.close", "code": WEBSOCKET_CLOSE_GOING_AWAY})
            return None
        drain._enter(kind)
        try:
            return await app(scope, receive, send)
        finally:
            drain._leave(kind)

    return counted
