"""Per-process Redis clients, scheduler and listener, built from Django settings.

The async objects are bound to the event loop that created them (redis-py's
asyncio pool is loop-bound), so one set exists per running loop.
"""
from __future__ import annotations

import asyncio
import functools
from dataclasses import dataclass
from typing import Any

import redis
from redis.connection import Encoder, PythonRespSerializer
import redis.asyncio as aioredis
from redis.asyncio.connection import AbstractConnection
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured

from audiosite.redis_sockets import redis_socket_kwargs
from audiosite.serverconfig import get_config
from inference.scheduler import Keys, Listener, Scheduler

KEYS = Keys(prefix="as:")


def redis_url() -> str:
    """``settings.REDIS_URL``.

    Raises:
        ImproperlyConfigured: unset, and no ``manage.py serve`` runs an embedded Redis in this var folder
            (``AUDIOSITE_VAR_DIR``; settings.py finds that one by itself).
    """
    if not settings.REDIS_URL:
        raise ImproperlyConfigured(
            "REDIS_URL is not set and no `manage.py serve` runs an embedded Redis in "
            f"{settings.VAR_DIR}: start serve first (from this folder, with the same AUDIOSITE_VAR_DIR), "
            "or set REDIS_URL to the deployment's Redis")
    return settings.REDIS_URL


SYNC_BUFFER_CUTOFF_BYTES = 6000
"""Arguments longer than this are written to the socket as they are, not joined into one buffer
(redis-py's own default cutoff)."""


@functools.cache
def _sync_client(decode_responses: bool) -> redis.Redis:
    # redis-py packs the commands of a synchronous connection with hiredis when hiredis is
    # installed, and hiredis copies every argument into one packed buffer: a 57.6 MB sample upload
    # (30 min of 16-bit audio) held about 225 MB more at its peak while it was sent (measured,
    # redis 8.1 + hiredis 3.5; bench_decode_memory: 291 MB growth, FAIL). redis-py's Python packer
    # sends a large argument or a memoryview as it is, as its asyncio connections always do.
    # Replies are still parsed by hiredis.
    packer = PythonRespSerializer(SYNC_BUFFER_CUTOFF_BYTES, Encoder("utf-8", "strict", decode_responses).encode)
    return redis.Redis.from_url(redis_url(), decode_responses=decode_responses, command_packer=packer,
                                **redis_socket_kwargs(redis_url()))


# redis-py's annotations cannot tell a decode_responses=True client (str) from a bytes one,
# so the clients below are typed Any where their replies are used as text.
def sync_redis() -> Any:
    """A process-wide synchronous client (thread-safe pool), decoding to str."""
    return _sync_client(True)


def sync_redis_bytes() -> Any:
    """A process-wide synchronous client that returns bytes (audio input keys)."""
    return _sync_client(False)


@functools.cache
def sync_scheduler() -> Scheduler:
    """Scheduler on the synchronous client (worker threads, management commands)."""
    return Scheduler(sync_redis(), KEYS, get_config().lease_ttl_ms, get_config().use_half_life_ms)


@dataclass
class AsyncContext:
    """What an async view needs: clients, scheduler and this loop's listener."""

    redis: Any  # redis.asyncio.Redis, decode_responses=True
    redis_bytes: Any  # redis.asyncio.Redis returning bytes
    scheduler: Scheduler
    listener: Listener


_contexts: dict[int, AsyncContext] = {}

# Connections per web process and how long a caller may wait for one. A
# burst beyond the pool waits for a free connection instead of failing
# (redis-py's default pool raises MaxConnectionsError at 100).
ASYNC_POOL_CONNECTIONS = 256
WEB_CLIENT_NAME = "audiosite-web"  # CLIENT LIST shows which connections are ours
ASYNC_POOL_WAIT_S = 30
REDIS_CONNECT_TIMEOUT_S = 5


class _ReopenReset(AbstractConnection):
    """A pooled connection that was reset or closed from the other side (the network, Redis, a proxy)
    while it sat idle is opened again before a command goes out on it, instead of failing that
    command: redis-py's check when the pool hands a connection out misses such a socket, so after a
    Redis restart or a network fault each idle connection of the pool cost one request a 503
    ``redis_unavailable`` later, whenever it was next used (seen on the multi-host rig,
    ``tests/test_multihost.py``). Nothing of this command was sent on the dead socket, so opening
    again cannot run it twice; a reconnect that fails still raises ``ConnectionError`` at once."""

    async def send_packed_command(self, command, check_health: bool = True) -> None:
        writer, reader = self._writer, self._reader
        if writer is not None and (writer.transport.is_closing() or (reader is not None and reader.at_eof())):
            await self.disconnect(nowait=True)
        await super().send_packed_command(command, check_health)


_REOPENING: dict[type, type] = {}


def _reopening(base: type) -> type:
    """``base`` (the connection class redis-py chose for the URL: TCP, TLS or unix socket) with
    :class:`_ReopenReset` in front of it (one class per base)."""
    if base not in _REOPENING:
        _REOPENING[base] = type(f"Reopening{base.__name__}", (_ReopenReset, base), {})
    return _REOPENING[base]


def _blocking_pool(decode_responses: bool) -> aioredis.BlockingConnectionPool:
    # No per-command socket timeout (redis-py 8 defaults to 5 s): on Python 3.11 it sends every
    # command through asyncio.wait_for, one extra task per command (profiled: a visible share of a
    # fail-fast 503). A refused or dropped connection still fails at once; connecting is bounded.
    pool = aioredis.BlockingConnectionPool.from_url(
        redis_url(), max_connections=ASYNC_POOL_CONNECTIONS, timeout=ASYNC_POOL_WAIT_S,
        decode_responses=decode_responses, client_name=WEB_CLIENT_NAME,
        socket_timeout=None, socket_connect_timeout=REDIS_CONNECT_TIMEOUT_S, **redis_socket_kwargs(redis_url()))
    pool.connection_class = _reopening(pool.connection_class)
    return pool


async def async_context() -> AsyncContext:
    """The context of the running event loop (created on first use)."""
    loop = asyncio.get_running_loop()
    ctx = _contexts.get(id(loop))
    if ctx is not None and ctx.listener.loop is loop:
        return ctx
    client = aioredis.Redis(connection_pool=_blocking_pool(True))
    client_bytes = aioredis.Redis(connection_pool=_blocking_pool(False))
    listener = await Listener.start(client, KEYS.process_channel)
    ctx = _contexts.get(id(loop))
    if ctx is not None and ctx.listener.loop is loop:  # another coroutine won the race
        await listener.close()
        return ctx
    scheduler = Scheduler(client, KEYS, get_config().lease_ttl_ms, get_config().use_half_life_ms)
    ctx = AsyncContext(client, client_bytes, scheduler, listener)
    _contexts[id(loop)] = ctx
    return ctx
