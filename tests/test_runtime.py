"""The legacy runtime's web side against real Redis, with no worker running."""
from __future__ import annotations

import os
import time

import pytest

from audiosite.errors import ServerBusy
from inference.runtime.context import async_context
from inference.runtime.rpc import load_single_flight

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
