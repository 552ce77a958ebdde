"""The metrics batching of web processes (``inference/runtime/metrics.py``).

``flush()`` is what the drain awaits before the process stops (audiosite/web.py). It must return
only once every event queued by ``record_soon`` is in Redis. An adversarial run found (against
a214faa, fixed since) that when the batch's timer task has already taken the events and is in the
middle of its write, ``flush()`` saw no task and no events and returned at once; the process then
stopped with the write in flight. A ``CLIENT PAUSE ... WRITE`` on the real Redis holds that write
open so the window is deterministic.
"""
from __future__ import annotations

import asyncio
import os

import pytest

from inference.runtime import metrics
from inference.runtime.context import KEYS, async_context

from .helpers import run

pytestmark = pytest.mark.skipif(not os.environ.get("REDIS_URL", "").endswith("/15"),
                                reason="needs REDIS_URL on database 15 (scripts/test.sh sets it)")

PAUSE_MS = 600


def test_flush_waits_for_a_batch_write_already_in_flight(redis_client):
    field = '["adv-model","ok"]'
    key = KEYS.metric(metrics.REQUESTS.name)

    async def scenario():
        ctx = await async_context()
        await ctx.redis.ping()  # connections made before the pause
        redis_client.execute_command("CLIENT", "PAUSE", PAUSE_MS, "WRITE")
        metrics.record_soon(metrics.count(metrics.REQUESTS, "adv-model", "ok"))
        # the timer fires after FLUSH_INTERVAL_S and its MULTI then waits on the pause
        await asyncio.sleep(metrics.FLUSH_INTERVAL_S + 0.15)
        await metrics.flush()  # what the drain does just before stop()
        seen = redis_client.hget(key, field)  # a read: not held by a WRITE pause
        await asyncio.sleep(PAUSE_MS / 1000)  # let the write land before the loop closes
        await ctx.listener.close()
        return seen

    seen = run(scenario())
    assert seen == "1", f"flush() returned while the batch write was in flight (counter was {seen!r})"
