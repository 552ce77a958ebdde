"""One pub/sub subscription per process that wakes async waiters.

Waiters register a key (``grant:<ticket>``, ``load:<token>``,
``done:<request id>``) and await it; the Lua scripts and workers publish that
key on the process channel. No waiter holds a thread or its own Redis
connection, and nobody sleeps in a polling loop.

The listener also beats for its process (R7.5): ``<channel>:live`` exists
(TTL ``LIVENESS_TTL_MS``, renewed every fifth of it) while the
process runs. The grant pass skips queued tickets whose channel's key is
gone, so the tickets of a process that died do not each cost a lease TTL.
"""
from __future__ import annotations

import asyncio
import logging
import uuid
from collections.abc import Callable
from typing import Any

import redis.exceptions

from .keys import LIVENESS_TTL_MS, Keys

log = logging.getLogger(__name__)

RESUBSCRIBE_S = 0.2
"""Pause before each attempt to subscribe again after the subscription's connection failed (s)."""


async def raise_if_subscription_broken(pubsub) -> None:
    """Raise ``redis.exceptions.ConnectionError`` (after closing the connection) when the socket of
    ``pubsub`` (a ``redis.asyncio`` PubSub) has failed or reached its end.

    Call it whenever ``get_message`` returned None. redis-py 8.1 answers a blocking read whose socket
    failed with ``ETIMEDOUT`` (TCP keepalive or ``TCP_USER_TIMEOUT`` giving up on a silent network)
    with None instead of an error: on Python 3.11 that ``OSError`` is ``asyncio.TimeoutError``, which
    its read takes for a read timeout. Each further read fails the same way without waiting, so a loop
    that reads again after a None never yields to the event loop and holds the process's CPU for good
    (seen on a web process cut off Redis by a link taken down for 60 s). After this raised, subscribe
    again: the pubsub opens a new connection.
    """
    conn = pubsub.connection
    reader = getattr(conn, "_reader", None)
    if conn is None or reader is None:
        return
    failure = reader.exception()
    if failure is None and not reader.at_eof():
        return
    await conn.disconnect(nowait=True)
    raise redis.exceptions.ConnectionError(f"the subscription's connection failed ({failure or 'closed by Redis'})")


class Listener:
    """Dispatches messages of one pub/sub channel to asyncio futures.

    Create one per event loop with :meth:`start`; ``channel`` is where
    publishers send. A message that arrives before its waiter registered is
    kept (bounded) so no wake-up is lost to that race.

    Args:
        redis: a ``redis.asyncio.Redis`` client (decode_responses=True).
        channel_prefix: e.g. ``Keys.process_channel``; a random process id is appended.
    """

    _EARLY_MAX = 4096

    def __init__(self, redis, channel: str, liveness_ttl_ms: int = LIVENESS_TTL_MS):
        self.redis = redis
        self.channel = channel
        self.liveness_ttl_ms = liveness_ttl_ms
        self._futures: dict[str, asyncio.Future] = {}
        self._early: dict[str, None] = {}
        self._task: asyncio.Task | None = None
        self._beat_task: asyncio.Task | None = None
        self._pubsub: Any = None  # redis.asyncio PubSub, set by start()
        self.loop: Any = None  # the event loop of start(); asyncio.AbstractEventLoop
        self.subscribed = True
        """False from the moment the subscription's connection failed until a resubscribe went out."""
        self._subscription_watchers: list[Callable[[bool], None]] = []

    @classmethod
    async def start(cls, redis, channel_for, liveness_ttl_ms: int = LIVENESS_TTL_MS) -> Listener:
        """Subscribe (confirmed before returning), start dispatching and beating.

        Args:
            redis: async Redis client.
            channel_for: callable mapping a fresh process id to its channel name.
            liveness_ttl_ms: TTL of the process's liveness key (renewed every fifth of it;
                shorter only in tests).
        """
        listener = cls(redis, channel_for(uuid.uuid4().hex), liveness_ttl_ms)
        listener.loop = asyncio.get_running_loop()
        listener._pubsub = redis.pubsub(ignore_subscribe_messages=True)
        await listener._pubsub.subscribe(listener.channel)
        await listener._beat()  # alive before the first ticket names this channel (R7.5)
        listener._task = asyncio.create_task(listener._run(), name=f"listener {listener.channel}")
        listener._beat_task = asyncio.create_task(listener._beat_loop(), name=f"liveness {listener.channel}")
        return listener

    async def _beat(self) -> None:
        await self.redis.set(Keys.process_live(self.channel), "1", px=self.liveness_ttl_ms)

    async def _beat_loop(self) -> None:
        failing = False
        while True:
            await asyncio.sleep(self.liveness_ttl_ms / 5000)  # five beats per TTL, as the workers'
            try:
                await self._beat()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # Redis trouble: the next beat retries; waiters re-check their tickets
                if not failing:  # once per outage, not every beat
                    log.warning("liveness beat of %s failed (%s); retrying every beat", self.channel, exc)
                failing = True
                continue
            if failing:
                log.warning("liveness beat of %s succeeded again", self.channel)
            failing = False

    async def _run(self) -> None:
        while True:
            try:
                message = await self._pubsub.get_message(timeout=None)
                if message is None:
                    await raise_if_subscription_broken(self._pubsub)
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # connection trouble: resubscribe and go on
                if self.subscribed:
                    log.warning("listener %s lost its subscription (%s); resubscribing every %.1f s", self.channel,
                                exc, RESUBSCRIBE_S)
                self._set_subscribed(False)
                await self._resubscribe()
                continue
            if message is None or message.get("type") != "message":
                continue
            self._deliver(message["data"])

    async def _resubscribe(self) -> None:
        """Subscribe again, every :data:`RESUBSCRIBE_S` until it succeeds; only then read again. A read
        in between would let redis-py reconnect and resubscribe on its own once Redis is back, without
        ``subscribed`` (and the port gate, ``audiosite.http.port_gate``) ever hearing of it."""
        while True:
            await asyncio.sleep(RESUBSCRIBE_S)
            try:
                await self._pubsub.subscribe(self.channel)
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                log.debug("resubscribe failed: %s", exc)
                continue
            log.warning("listener %s subscribed again", self.channel)
            self._set_subscribed(True)
            return

    def watch_subscription(self, callback: Callable[[bool], None]) -> None:
        """Call ``callback(False)`` on the event loop when the subscription's connection fails (Redis
        gone, reset or refused) and ``callback(True)`` once a resubscribe has been sent on a new one;
        the listener retries every 0.2 s meanwhile. Calls only on a change; a callback that raises is
        logged and kept. A silent partition (no reset, no refusal) is not seen here."""
        self._subscription_watchers.append(callback)

    def _set_subscribed(self, subscribed: bool) -> None:
        if subscribed == self.subscribed:
            return
        self.subscribed = subscribed
        for callback in list(self._subscription_watchers):
            try:
                callback(subscribed)
            except Exception:
                log.exception("subscription watcher %r failed", callback)

    def _deliver(self, message: str) -> None:
        # A message is a key, or a key, a newline and an inline payload (see ``expect``).
        key, _, inline = message.partition("\n")
        future = self._futures.pop(key, None)
        if future is not None:
            if not future.done():
                future.set_result(inline or None)
            return
        self._early[key] = None
        if len(self._early) > self._EARLY_MAX:
            self._early.pop(next(iter(self._early)))

    def expect(self, key: str) -> asyncio.Future:
        """Register interest in ``key`` before the action that leads to its publication.

        Returns:
            A future resolved when ``key`` is published: to the payload the publisher put after
            the key (``"<key>\\n<payload>"``, e.g. a run's reply), or None (a bare key, or a
            message that came before this call: its payload is not kept).
        """
        future = self.loop.create_future()
        if key in self._early:
            self._early.pop(key)
            future.set_result(None)
        else:
            self._futures[key] = future
        return future

    def forget(self, key: str) -> None:
        """Drop interest in ``key`` (the waiter stopped waiting)."""
        future = self._futures.pop(key, None)
        if future is not None and not future.done():
            future.cancel()
        self._early.pop(key, None)

    async def close(self) -> None:
        """Stop dispatching and beating, and unsubscribe (the liveness key expires on its own)."""
        for task in (self._task, self._beat_task):
            if task:
                task.cancel()
                try:
                    await task
                except (asyncio.CancelledError, Exception):
                    pass
        if self._pubsub is not None:
            await self._pubsub.aclose()
