"""The scheduler alone (no Django): Lua scripts on a real Redis, async waiters."""
from __future__ import annotations

import asyncio
import time

import pytest
import redis.asyncio as aioredis

from inference.scheduler import (
    AdmissionOverdue,
    AdmissionTimeout,
    Keys,
    Listener,
    Scheduler,
    effective_timeout_ms,
)

from .conftest import REDIS_BASE, unique_prefix

TTL_MS = 1000


class Rig:
    """One simulated web process: client, scheduler, listener."""

    def __init__(self, keys: Keys, ttl_ms: int = TTL_MS):
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

    async def acquire(self, model_id: str, timeout_ms: int):
        return await self.scheduler.acquire(self.listener, model_id, timeout_ms)

    async def counts(self, model_id: str) -> tuple[int, int]:
        snap = await self.scheduler.snapshot([model_id])
        return snap[model_id]["active_leases"], snap[model_id]["queued"]


def run(coro):
    return asyncio.run(coro)


@pytest.mark.parametrize(
    "request_ms, ceiling_ms, expected",
    [(None, 300000, 300000), (500, 300000, 500), (900000, 300000, 300000), (0, 300000, 300000),
     (None, 0, 0), (0, 0, 0), (700, 0, 700)],
)
def test_effective_timeout_three_layers(request_ms, ceiling_ms, expected):
    """R3.1: request shortens the ceiling only; 0 = unbounded on either side."""
    assert effective_timeout_ms(request_ms, ceiling_ms) == expected


def test_free_model_grants_at_once_and_release_is_idempotent(redis_client):
    """R2.4: a release frees the slot; releasing twice changes nothing."""
    async def scenario():
        async with Rig(Keys(unique_prefix())) as rig:
            lease = await rig.acquire("m", 1000)
            assert await rig.counts("m") == (1, 0)
            assert await rig.scheduler.release("m", lease.lease_id) == 1
            assert await rig.scheduler.release("m", lease.lease_id) == 0
            assert await rig.counts("m") == (0, 0)
    run(scenario())


def test_second_request_waits_and_is_pushed_the_grant(redis_client):
    """R1.1/R3.1: the busy guard serializes; the waiter is woken by the release, not by polling."""
    async def scenario():
        async with Rig(Keys(unique_prefix())) as rig:
            first = await rig.acquire("m", 0)
            waiter = asyncio.create_task(rig.acquire("m", 5000))
            await asyncio.sleep(0.3)
            assert not waiter.done()
            assert await rig.counts("m") == (1, 1)
            released_at = time.monotonic()
            await rig.scheduler.release("m", first.lease_id)
            second = await waiter
            woke_ms = (time.monotonic() - released_at) * 1000
            assert woke_ms < 100, woke_ms
            assert second.waited_ms >= 250
            assert await rig.counts("m") == (1, 0)
            await rig.scheduler.release("m", second.lease_id)
    run(scenario())


def test_waiters_are_granted_in_fifo_order(redis_client):
    """R2.1: order is the order of the atomic enqueue."""
    async def scenario():
        async with Rig(Keys(unique_prefix())) as rig:
            holder = await rig.acquire("m", 0)
            order: list[int] = []

            async def client(i):
                lease = await rig.acquire("m", 0)
                order.append(i)
                await asyncio.sleep(0.01)
                await rig.scheduler.release("m", lease.lease_id)

            tasks = []
            for i in range(8):
                tasks.append(asyncio.create_task(client(i)))
                await asyncio.sleep(0.02)  # enqueue one after the other
            assert (await rig.counts("m"))[1] == 8
            await rig.scheduler.release("m", holder.lease_id)
            await asyncio.gather(*tasks)
            assert order == list(range(8))
            assert await rig.counts("m") == (0, 0)
    run(scenario())


def test_queue_timeout_fires_at_the_deadline_and_drops_the_ticket(redis_client):
    """R3.2: 503-worthy timeout at its deadline, not when the slot frees; queued count drops."""
    async def scenario():
        async with Rig(Keys(unique_prefix())) as rig:
            holder = await rig.acquire("m", 0)
            started = time.monotonic()
            with pytest.raises(AdmissionTimeout):
                await rig.acquire("m", 400)
            elapsed_ms = (time.monotonic() - started) * 1000
            assert 390 <= elapsed_ms < 550, elapsed_ms
            assert await rig.counts("m") == (1, 0)
            await rig.scheduler.release("m", holder.lease_id)
    run(scenario())


def test_overdue_holder_fails_fast(redis_client):
    """R3.3: every occupied slot ran longer than the timeout → refused at once."""
    async def scenario():
        async with Rig(Keys(unique_prefix()), ttl_ms=5000) as rig:
            holder = await rig.acquire("m", 0)
            await asyncio.sleep(0.35)
            started = time.monotonic()
            with pytest.raises(AdmissionOverdue) as info:
                await rig.acquire("m", 300)
            assert (time.monotonic() - started) * 1000 < 50
            assert info.value.age_ms >= 300
            assert await rig.counts("m") == (1, 0)
            # A healthy (not overdue) holder allows bounded waiting instead.
            waiter = asyncio.create_task(rig.acquire("m", 2000))
            await asyncio.sleep(0.05)
            assert (await rig.counts("m"))[1] == 1
            await rig.scheduler.release("m", holder.lease_id)
            lease = await waiter
            await rig.scheduler.release("m", lease.lease_id)
    run(scenario())


def test_timeout_zero_waits_without_bound_and_without_fail_fast(redis_client):
    """R3.5: 0 disables both the wait bound and fail-fast."""
    async def scenario():
        async with Rig(Keys(unique_prefix()), ttl_ms=5000) as rig:
            holder = await rig.acquire("m", 0)
            await asyncio.sleep(0.2)
            waiter = asyncio.create_task(rig.acquire("m", 0))
            await asyncio.sleep(0.6)
            assert not waiter.done()
            await rig.scheduler.release("m", holder.lease_id)
            lease = await waiter
            assert lease.waited_ms >= 550
            await rig.scheduler.release("m", lease.lease_id)
    run(scenario())


def test_lease_of_a_dead_holder_is_reclaimed_after_the_ttl(redis_client):
    """R2.5: a holder that stops renewing loses the slot after lease_ttl_ms; the waiter gets it."""
    async def scenario():
        async with Rig(Keys(unique_prefix()), ttl_ms=800) as rig:
            await rig.acquire("m", 0)  # the holder "dies": never renews, never releases
            started = time.monotonic()
            lease = await rig.acquire("m", 0)
            waited_ms = (time.monotonic() - started) * 1000
            assert 750 <= waited_ms < 1300, waited_ms
            await rig.scheduler.release("m", lease.lease_id)
    run(scenario())


def test_renewed_lease_is_not_reclaimed(redis_client):
    """R2.5: renewal keeps a live holder's lease past the TTL."""
    async def scenario():
        async with Rig(Keys(unique_prefix()), ttl_ms=500) as rig:
            lease = await rig.acquire("m", 0)
            for _ in range(6):
                await asyncio.sleep(0.2)
                assert await rig.scheduler.renew("m", lease.lease_id) == 1
            assert (await rig.scheduler.reap("m"))[0] == 0
            await rig.scheduler.release("m", lease.lease_id)
            assert await rig.scheduler.renew("m", lease.lease_id) == 0
    run(scenario())


def test_cancelled_waiter_loses_its_ticket_at_once(redis_client):
    """R8.1: a waiter whose client leaves is removed from the queue immediately."""
    async def scenario():
        async with Rig(Keys(unique_prefix())) as rig:
            holder = await rig.acquire("m", 0)
            waiter = asyncio.create_task(rig.acquire("m", 0))
            await asyncio.sleep(0.1)
            assert await rig.counts("m") == (1, 1)
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            assert await rig.counts("m") == (1, 0)
            await rig.scheduler.release("m", holder.lease_id)
            assert await rig.counts("m") == (0, 0)
    run(scenario())


def test_two_processes_share_one_queue(redis_client):
    """R2.1: waiters of different processes (listeners) are served in enqueue order."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys) as a, Rig(keys) as b:
            holder = await a.acquire("m", 0)
            first = asyncio.create_task(b.acquire("m", 0))
            await asyncio.sleep(0.05)
            second = asyncio.create_task(a.acquire("m", 0))
            await asyncio.sleep(0.05)
            await a.scheduler.release("m", holder.lease_id)
            lease_b = await first
            assert not second.done()
            await b.scheduler.release("m", lease_b.lease_id)
            lease_a = await second
            await a.scheduler.release("m", lease_a.lease_id)
    run(scenario())


def test_single_flight_load(redis_client):
    """R4.2: one loader; others wait and are woken; failure returns to unloaded and allows retry."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys) as rig:
            first = await rig.scheduler.begin_load(rig.listener, "m", "t1")
            assert first.action == "load"
            woken = rig.listener.expect("load:t2")
            second = await rig.scheduler.begin_load(rig.listener, "m", "t2")
            assert second.action == "wait"
            assert (await rig.scheduler.snapshot(["m"]))["m"]["state"] == "loading"
            assert await rig.scheduler.finish_load("m", "t1", False, error="boom") == "ok"
            await asyncio.wait_for(woken, 1)
            snap = (await rig.scheduler.snapshot(["m"]))["m"]
            assert snap["state"] == "unloaded" and snap["error"] == "boom"
            retry = await rig.scheduler.begin_load(rig.listener, "m", "t3")
            assert retry.action == "load"
            # A worker publishes the pool; it is ready only while its liveness key says so.
            await rig.redis.set(keys.worker_live("w1"), "boot1", px=5000)
            assert await rig.scheduler.finish_load("m", "t3", True, owner="w1", boot="boot1") == "ok"
            ready = await rig.scheduler.begin_load(rig.listener, "m", "t4")
            assert (ready.action, ready.owner, ready.boot) == ("ready", "w1", "boot1")
            # R7.4: the worker dies → the model reads unloaded and the next caller loads.
            await rig.redis.delete(keys.worker_live("w1"))
            assert (await rig.scheduler.snapshot(["m"]))["m"]["state"] == "unloaded"
            assert (await rig.scheduler.begin_load(rig.listener, "m", "t5")).action == "load"
            assert await rig.scheduler.finish_load("m", "t1", True, owner="w1", boot="x") == "stale"
    run(scenario())


def test_silent_loader_is_replaced(redis_client):
    """R4.2/R7.4: a loader that stops renewing its claim is replaced after the TTL."""
    async def scenario():
        async with Rig(Keys(unique_prefix()), ttl_ms=300) as rig:
            assert (await rig.scheduler.begin_load(rig.listener, "m", "a")).action == "load"
            assert (await rig.scheduler.begin_load(rig.listener, "m", "b")).action == "wait"
            await asyncio.sleep(0.35)
            assert (await rig.scheduler.begin_load(rig.listener, "m", "c")).action == "load"
            assert await rig.scheduler.finish_load("m", "a", True, owner="w", boot="z") == "stale"
    run(scenario())


def test_lost_wake_up_is_recovered_at_the_next_lease_expiry(redis_client):
    """R2.5: a waiter whose grant message was lost (dropped subscription) still gets its lease."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys, ttl_ms=600) as holder_rig, Rig(keys, ttl_ms=600) as waiter_rig:
            holder = await holder_rig.acquire("m", 0)
            waiter = asyncio.create_task(waiter_rig.acquire("m", 0))
            await asyncio.sleep(0.1)
            await waiter_rig.listener._pubsub.unsubscribe()  # the wake-up will go nowhere
            await holder_rig.scheduler.release("m", holder.lease_id)
            lease = await asyncio.wait_for(waiter, 2)
            assert lease.waited_ms >= 500  # woken by its own reap timer, not by the message
            assert await waiter_rig.scheduler.release("m", lease.lease_id) == 1
    run(scenario())
