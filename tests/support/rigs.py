"""The scheduler driven directly, without a server: :class:`Rig` is one simulated web process on Redis
database 15 (async client, scheduler, listener); the others drive ``load_single_flight`` on this
process's real ``AsyncContext`` (a worker registered as its liveness beat does, deaf listeners).
"""
from __future__ import annotations

import asyncio
import dataclasses
import os
import uuid
from collections.abc import Iterable

import redis.asyncio as aioredis

from inference.runtime.context import KEYS as RUNTIME_KEYS
from inference.runtime.context import async_context
from inference.scheduler import Keys, Listener, LoadEnd, Scheduler

from .bounds import QUICK_S, within
from .stacks import REDIS_BASE


def unique_prefix() -> str:
    """A Redis key prefix no other test uses (``t<8 hex digits>:``)."""
    return f"t{uuid.uuid4().hex[:8]}:"



RIG_TTL_MS = 1000
GRANT_MARGIN_S = 5.0
"""How long past a request's own timeout a test waits for the scheduler's answer (grant or 503)."""


class Rig:
    """One simulated web process on Redis database 15: ``redis`` (async, str replies), ``scheduler``
    (``ttl_ms`` leases and claims) and a started ``listener`` (``async with``)."""

    def __init__(self, keys: Keys, ttl_ms: int = RIG_TTL_MS):
        self.keys = keys
        self.ttl_ms = ttl_ms

    async def __aenter__(self):
        self.redis = aioredis.Redis.from_url(f"{REDIS_BASE}/15", decode_responses=True)
        self.scheduler = Scheduler(self.redis, self.keys, self.ttl_ms)
        self.listener = await Listener.start(self.redis, self.keys.process_channel)
        return self

    async def __aexit__(self, *exc):
        await self.listener.close()
        await self.redis.aclose()

    async def acquire(self, model_id: str, timeout_ms: int, kind: str = "request", stream_cap: int = 0):
        """The scheduler's ``acquire`` through this rig's listener, bounded: a grant (or refusal) that never
        comes fails the test after the request's own timeout plus ``GRANT_MARGIN_S`` (``QUICK_S`` for an
        unbounded request, ``timeout_ms`` 0) with an AssertionError naming the bound, not at the
        scenario's or pytest's limit."""
        bound_s = QUICK_S if timeout_ms == 0 else timeout_ms / 1000 + GRANT_MARGIN_S
        return await within(self.scheduler.acquire(self.listener, model_id, timeout_ms, kind, stream_cap=stream_cap),
                            bound_s)

    async def counts(self, model_id: str) -> tuple[int, int]:
        """``(active leases, queued)`` of ``model_id``."""
        snap = await self.scheduler.snapshot([model_id])
        return snap[model_id]["active_leases"], snap[model_id]["queued"]

    async def lost_load(self, model_id: str, loader: str, waiters: Iterable[str], error: str = "worker w was lost"):
        """``loader`` claims a load of ``model_id``, each of ``waiters`` waits for it, then it is ended
        ``worker_lost`` (its worker died, R7.4): the waiters' wake-ups are published (unread)."""
        assert (await self.scheduler.begin_load(self.listener, model_id, loader)).action == "load"
        for waiter in waiters:
            assert (await self.scheduler.begin_load(self.listener, model_id, waiter)).action == "wait"
        assert await self.scheduler.finish_load(model_id, loader, LoadEnd.WORKER_LOST, error=error) == "ok"

    async def model_keys(self, model_id: str) -> dict[str, dict]:
        """Every Redis hash of the model's load protocol, as it stands."""
        return {"load": await self.redis.hgetall(self.keys.load(model_id)),
                "loadwait": await self.redis.hgetall(self.keys.model(model_id) + ":loadwait")}


# -- load_single_flight on this process's real AsyncContext -----------------------------------------
def live_worker(redis_client, hostname: str, ttl_ms: int = 30000) -> str:
    """Register ``hostname`` as a live worker exactly as its liveness beat does (the ``as:`` keys of
    ``inference.runtime.context.KEYS``); returns its boot id."""
    boot = "boot-" + hostname
    redis_client.set(RUNTIME_KEYS.worker_live(hostname), boot, px=ttl_ms)
    redis_client.hset(RUNTIME_KEYS.worker_pid, hostname, os.getpid())
    return boot


async def load_contexts(claim_ttl_ms: int):
    """This loop's web-process context with ``claim_ttl_ms`` claims, and the same process with a deaf
    listener: one never subscribed, so it hears no wake-up and only looks on its timer."""
    base = await async_context()
    ctx = dataclasses.replace(base, scheduler=Scheduler(base.redis, RUNTIME_KEYS, claim_ttl_ms))
    deaf = Listener(base.redis, RUNTIME_KEYS.process_channel("deaf-" + unique_prefix()))
    deaf.loop = asyncio.get_running_loop()
    return ctx, dataclasses.replace(ctx, listener=deaf)


async def claim_started_by(ctx, model_id: str, token: str, host: str, boot: str, force: bool = False) -> None:
    """Claim the load as a caller would (``token``), and start it as worker ``host``'s load task does."""
    assert (await ctx.scheduler.begin_load(ctx.listener, model_id, token, force)).action == "load"
    assert await ctx.scheduler.renew_load(model_id, token, host, boot) == 1


