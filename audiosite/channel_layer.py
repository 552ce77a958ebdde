"""The Channels layer of the web processes: channels-redis's, waiting out a Redis outage in ``receive``.

channels-redis raises a Redis connection error out of ``receive`` when Redis goes away (a restart, a
network fault). A consumer's dispatch loop (``channels.consumer.AsyncConsumer.__call__``) awaits
``receive`` directly, so that error ended every open realtime session at once: daphne logged
"Exception inside application", closed the socket with 1011, and the consumer's ``disconnect`` never
ran (its turns' leases and its drain watch stayed behind). :class:`RetryingRedisChannelLayer` retries
instead, every :data:`RETRY_S`, until Redis answers; the session goes on meanwhile, and its turns
meet the outage on their own (``redis_unavailable``). Sending (``group_send``, ``send``) still raises.
"""
from __future__ import annotations

import asyncio
import logging

import redis.exceptions
from channels_redis.core import RedisChannelLayer

log = logging.getLogger("audiosite.web")

RETRY_S = 0.5
"""Pause between two attempts of a ``receive`` whose Redis connection failed (s)."""

REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
"""What a Redis that is gone or unreachable raises through redis-py."""


class RetryingRedisChannelLayer(RedisChannelLayer):
    """channels-redis's ``RedisChannelLayer`` whose :meth:`receive` waits for Redis instead of raising."""

    async def receive(self, channel):
        """The next message of ``channel`` (channels-redis's ``receive``), retried every :data:`RETRY_S`
        while Redis cannot be reached. Cancellation passes through at once."""
        warned = False
        while True:
            try:
                return await super().receive(channel)
            except REDIS_DOWN as exc:
                if not warned:
                    log.warning("the Channels layer lost Redis (%s); retrying every %.1f s", exc, RETRY_S)
                    warned = True
                await asyncio.sleep(RETRY_S)
