"""The legacy runtime's web side against real Redis, with no worker running."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import os
import time

import pytest

from audiosite.errors import ServerBusy
from inference.runtime.context import KEYS, async_context
from inference.runtime.rpc import load_single_flight
from inference.scheduler import Scheduler
from inference.worker.runs import RunDispatcher
from inference.worker.state import WorkerState

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
        late = await ctx.scheduler.renew_load("orphan", "any-token", "late-worker", "late-boot")
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
    (``renew_load`` with its hostname and boot) and then renews no more. Its liveness key stays (a
    frozen worker), so the claim's expiry is what ends the load; a worker killed for real is
    ``tests/test_scale.py::test_a_worker_killed_during_a_load_frees_the_model_within_the_liveness_ttl``.
    """
    async def scenario():
        base = await async_context()
        ctx = dataclasses.replace(base, scheduler=Scheduler(base.redis, KEYS, 1000))  # 1 s claims

        async def worker_that_dies() -> None:
            await ctx.redis.set(KEYS.worker_live("gpu0@dead"), "boot-dead", px=60000)
            while True:
                token = await ctx.redis.hget(KEYS.load("doomed"), "loader")
                if token:
                    assert await ctx.scheduler.renew_load("doomed", token, "gpu0@dead", "boot-dead") == 1
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
    assert error.code == "worker_lost" and "gpu0@dead was lost" in error.message
    assert 1.0 <= elapsed < 4  # the claim's TTL (1 s) plus at most one check (1 s: the pickup timeout)
    assert status["state"] == "unloaded" and status["error"] == "worker gpu0@dead was lost while loading the model"


def _run_header(request_id: str, channel: str, boot: str, model_id: str = "absent") -> bytes:
    return json.dumps({"model_id": model_id, "request_id": request_id, "lease_id": "L" + request_id,
                       "boot": boot, "channel": channel, "sample_rate_hz": 16000, "options": {}}).encode()


def test_a_stopping_worker_answers_its_queued_runs_not_loaded(redis_client):
    """Warm shutdown of the run queue: runs still queued were never taken, so their senders are told
    ``not_loaded`` (they keep their leases and load again elsewhere) instead of waiting for the
    liveness TTL; the queue is left empty."""
    worker = WorkerState()
    worker.hostname = "gpu0@stopping"
    dispatcher = RunDispatcher(worker, threads=2)  # never started: every header stays queued
    queue_key = KEYS.run_queue(worker.hostname, worker.boot)
    pubsub = redis_client.pubsub()
    pubsub.subscribe("test-channel")
    assert pubsub.get_message(timeout=2)["type"] == "subscribe"
    for request_id in ("r1", "r2", "r3"):
        redis_client.lpush(queue_key, _run_header(request_id, "test-channel", worker.boot))
    assert dispatcher.stop(timeout_s=5) == 3
    assert redis_client.llen(queue_key) == 0
    wakes = [pubsub.get_message(timeout=2)["data"] for _ in range(3)]
    assert wakes == ["done:r1", "done:r2", "done:r3"]  # FIFO: the first pushed is answered first
    for request_id in ("r1", "r2", "r3"):
        reply = json.loads(redis_client.get(KEYS.result(request_id)))
        assert reply["ok"] is False and reply["kind"] == "not_loaded"
    pubsub.close()


def test_the_run_dispatcher_pops_its_own_boots_queue_and_refuses_runs_it_holds_no_pool_for(redis_client):
    """A started dispatcher serves headers from its own (hostname, boot) queue only: a header for a
    previous boot of the same hostname stays unserved (its sender hears ``worker_lost`` from the
    liveness check), and a run for a model this worker holds no pool of is answered ``not_loaded``."""
    worker = WorkerState()
    worker.hostname = "gpu0@popping"
    stale_key = KEYS.run_queue(worker.hostname, "an-earlier-boot")
    redis_client.lpush(stale_key, _run_header("stale", "test-channel", "an-earlier-boot"))
    dispatcher = RunDispatcher(worker, threads=2)
    dispatcher.start()
    try:
        redis_client.lpush(KEYS.run_queue(worker.hostname, worker.boot),
                           _run_header("fresh", "test-channel", worker.boot))
        deadline = time.monotonic() + 10
        while redis_client.get(KEYS.result("fresh")) is None:
            assert time.monotonic() < deadline, "the dispatcher did not serve its queue"
            time.sleep(0.02)
    finally:
        assert dispatcher.stop(timeout_s=5) == 0
    assert json.loads(redis_client.get(KEYS.result("fresh")))["kind"] == "not_loaded"
    assert redis_client.get(KEYS.result("stale")) is None and redis_client.llen(stale_key) == 1
