"""The legacy runtime's web side against real Redis, with no worker running."""
from __future__ import annotations

import asyncio
import dataclasses
import os
import time

import pytest

from audiosite.errors import ServerBusy
from inference.runtime.context import KEYS, async_context
from inference.runtime.rpc import load_single_flight
from inference.scheduler import Scheduler

from .helpers import run, within

pytestmark = pytest.mark.skipif(not os.environ.get("REDIS_URL", "").endswith("/15"),
                                reason="needs REDIS_URL on database 15 (scripts/test.sh sets it)")


def test_load_that_no_worker_starts_fails_with_503_and_is_abandoned(redis_client):
    """R7.4: no request waits forever for a worker; the abandoned claim leaves the model unloaded."""
    async def scenario():
        ctx = await async_context()
        started = time.monotonic()
        with pytest.raises(ServerBusy) as info:
            await within(load_single_flight(ctx, "orphan", pickup_timeout_s=1.0), 10)
        elapsed = time.monotonic() - started
        snapshot = await ctx.scheduler.snapshot(["orphan"])
        # A worker that starts the stale task now must refuse to load.
        late = await ctx.scheduler.renew_load("orphan", "any-token", "late-worker")
        await ctx.listener.close()
        return info.value, elapsed, snapshot["orphan"], late
    error, elapsed, status, late = run(scenario())
    assert error.code == "no_worker" and "no worker" in error.message
    assert 0.9 <= elapsed < 3
    assert status["state"] == "unloaded" and status["error"] == "no worker started the load"
    assert late == 0
    # The load task itself is in the Celery queue (Redis db 15), unconsumed.
    assert redis_client.llen("gpu") == 1


def test_load_whose_worker_dies_after_starting_it_fails_with_503_worker_lost(redis_client):
    """R7.4: a worker that started a load and died (it stops renewing its claim) does not leave the
    caller waiting: once the claim expires the caller gets 503 worker_lost and the model is unloaded.

    The dead worker is played by this test: it starts the load exactly as the worker's task does
    (``renew_load`` with its hostname) and then renews no more, as after a SIGKILL.
    """
    async def scenario():
        base = await async_context()
        ctx = dataclasses.replace(base, scheduler=Scheduler(base.redis, KEYS, 1000))  # 1 s claims

        async def worker_that_dies() -> None:
            while True:
                token = await ctx.redis.hget(KEYS.load("doomed"), "loader")
                if token:
                    assert await ctx.scheduler.renew_load("doomed", token, "gpu0@dead") == 1
                    return
                await asyncio.sleep(0.01)

        dying = asyncio.create_task(worker_that_dies())
        started = time.monotonic()
        with pytest.raises(ServerBusy) as info:
            await within(load_single_flight(ctx, "doomed", pickup_timeout_s=1.0), 15)
        elapsed = time.monotonic() - started
        await within(dying, 1)
        status = (await ctx.scheduler.snapshot(["doomed"]))["doomed"]
        await base.listener.close()
        return info.value, elapsed, status
    error, elapsed, status = run(scenario())
    assert error.code == "worker_lost" and "stopped responding" in error.message
    assert 1.0 <= elapsed < 4  # the claim's TTL (1 s) plus at most one watchdog tick (1 s)
    assert status["state"] == "unloaded" and status["error"] == "the loading worker stopped"
