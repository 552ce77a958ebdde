"""Stream leases (``LeaseKind.STREAM``) in the scheduler alone: a model's streams hold at most their stream
cap of its slots (the streaming mode's admitted count, R9.2), the others wait in the one FIFO, and
nothing of a stream that leaves survives."""
from __future__ import annotations

import asyncio
import time

import pytest

from inference.scheduler import AdmissionOverdue, AdmissionTimeout, Keys

from .support.bounds import run, within
from .support.rigs import Rig, unique_prefix


async def _capacity(rig: Rig, model_id: str, slots: int) -> None:
    await rig.scheduler.publish_entry({"id": model_id}, slots)


async def _streams(rig: Rig, model_id: str) -> tuple[int, int]:
    """``(stream leases held, stream tickets queued)`` straight from Redis."""
    return (await rig.redis.hlen(rig.keys.streams(model_id)), await rig.redis.hlen(rig.keys.queued_streams(model_id)))


@pytest.mark.parametrize("slots, cap", [(4, 2), (3, 1), (2, 2)])
def test_streams_beyond_their_cap_wait_and_nothing_behind_them_overtakes(redis_client, slots, cap):
    """At most ``cap`` streams hold slots though more slots are free; a request queued behind a waiting
    stream waits too (FIFO); when a stream ends, the waiting stream goes first, then the request."""
    async def scenario():
        async with Rig(Keys(unique_prefix())) as rig:
            await _capacity(rig, "m", slots)
            held = [await rig.acquire("m", 1000, "stream", cap) for _ in range(cap)]
            assert await _streams(rig, "m") == (cap, 0)
            waiting = asyncio.create_task(rig.acquire("m", 0, "stream", cap))
            await asyncio.sleep(0.05)
            later = asyncio.create_task(rig.acquire("m", 0))
            await asyncio.sleep(0.05)
            assert not waiting.done() and not later.done()
            assert await rig.counts("m") == (cap, 2)
            assert await _streams(rig, "m") == (cap, 1)
            await rig.scheduler.release("m", held.pop(0).lease_id)
            held.append(await within(waiting))
            request = await within(later) if slots > cap else None
            assert await _streams(rig, "m") == (cap, 0)
            if request is None:  # no slot beside the streams: the request waits for one
                await rig.scheduler.release("m", held.pop(0).lease_id)
                request = await within(later)
            for lease in [*held, request]:
                await rig.scheduler.release("m", lease.lease_id)
            assert await rig.counts("m") == (0, 0)
            assert await _streams(rig, "m") == (0, 0)
    run(scenario())


def test_requests_use_the_slots_streams_may_not(redis_client):
    """The cap limits streams only: requests fill the model's other slots beside them."""
    async def scenario():
        async with Rig(Keys(unique_prefix())) as rig:
            await _capacity(rig, "m", 3)
            stream = await rig.acquire("m", 1000, "stream", 1)
            requests = [await rig.acquire("m", 1000) for _ in range(2)]
            assert await rig.counts("m") == (3, 0)
            assert await _streams(rig, "m") == (1, 0)
            for lease in [stream, *requests]:
                await rig.scheduler.release("m", lease.lease_id)
    run(scenario())


def test_a_stream_that_times_out_or_leaves_while_waiting_leaves_nothing(redis_client):
    async def scenario():
        async with Rig(Keys(unique_prefix())) as rig:
            await _capacity(rig, "m", 2)
            held = await rig.acquire("m", 0, "stream", 1)
            with pytest.raises(AdmissionTimeout):
                await rig.acquire("m", 200, "stream", 1)
            leaving = asyncio.create_task(rig.acquire("m", 0, "stream", 1))
            await asyncio.sleep(0.05)
            assert await _streams(rig, "m") == (1, 1)
            leaving.cancel()
            with pytest.raises(asyncio.CancelledError):
                await leaving
            assert await _streams(rig, "m") == (1, 0)
            assert await rig.counts("m") == (1, 0)
            await rig.scheduler.release("m", held.lease_id)
            assert await _streams(rig, "m") == (0, 0)
    run(scenario())


def test_a_stream_fails_fast_when_every_stream_it_waits_for_is_overdue(redis_client):
    """R3.3 for streams: the cap is reached and each running stream ran longer than the timeout → refused
    at once, though a slot is free; a young stream allows bounded waiting."""
    async def scenario():
        async with Rig(Keys(unique_prefix()), ttl_ms=5000) as rig:
            await _capacity(rig, "m", 2)
            old = await rig.acquire("m", 0, "stream", 1)
            await asyncio.sleep(0.35)
            started = time.monotonic()
            with pytest.raises(AdmissionOverdue):
                await rig.acquire("m", 300, "stream", 1)
            assert (time.monotonic() - started) * 1000 < 50
            request = await rig.acquire("m", 300)  # a request is not held to the streams' cap
            await rig.scheduler.release("m", request.lease_id)
            await rig.scheduler.release("m", old.lease_id)
            young = await rig.acquire("m", 0, "stream", 1)
            waiter = asyncio.create_task(rig.acquire("m", 2000, "stream", 1))
            await asyncio.sleep(0.05)
            assert await _streams(rig, "m") == (1, 1)
            await rig.scheduler.release("m", young.lease_id)
            await rig.scheduler.release("m", (await within(waiter)).lease_id)
            assert await _streams(rig, "m") == (0, 0)
    run(scenario())


def test_a_reaped_stream_lease_frees_its_stream_place(redis_client):
    """A stream whose holder stopped renewing is reclaimed after the TTL (R2.5), its place in the cap too."""
    async def scenario():
        async with Rig(Keys(unique_prefix()), ttl_ms=300) as rig:
            await _capacity(rig, "m", 2)
            await rig.acquire("m", 0, "stream", 1)  # never renewed, never released
            lease = await rig.acquire("m", 3000, "stream", 1)
            assert await _streams(rig, "m") == (1, 0)
            await rig.scheduler.release("m", lease.lease_id)
            assert await _streams(rig, "m") == (0, 0)
    run(scenario())


def test_a_stream_lease_needs_a_cap_and_only_a_stream_has_one(redis_client):
    async def scenario():
        async with Rig(Keys(unique_prefix())) as rig:
            with pytest.raises(ValueError):
                await rig.scheduler.acquire(rig.listener, "m", 0, "stream")
            with pytest.raises(ValueError):
                await rig.scheduler.acquire(rig.listener, "m", 0, "request", stream_cap=2)
    run(scenario())
