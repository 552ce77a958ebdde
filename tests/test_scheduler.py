"""The scheduler alone (no Django): Lua scripts on a real Redis, async waiters."""
from __future__ import annotations

import asyncio
import logging
import subprocess
import sys
import time

import pytest
import redis
import redis.asyncio as aioredis

from inference.scheduler import (
    AdmissionOverdue,
    AdmissionTimeout,
    ForgottenWorker,
    Keys,
    LeaseKind,
    Listener,
    LoadEnd,
    LoadEndRecord,
    ModelState,
    Scheduler,
    effective_timeout_ms,
)

from .support.bounds import run, within
from .support.processes import ROOT
from .support.rigs import Rig, unique_prefix
from .support.stacks import REDIS_BASE


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
            second = await within(waiter)
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
            await within(asyncio.gather(*tasks))
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
            lease = await within(waiter)
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
            lease = await within(waiter)
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


def test_a_waiter_leaving_after_an_unheard_grant_gives_the_lease_back_in_one_step(redis_client):
    """R8.1/R2.4: a waiter whose grant was pushed but never heard (its subscription gone) and whose client
    then leaves gives the lease back in the same script that looks for its ticket (``cancel.lua`` in its
    'release' mode): the slot is free at once and the next request is granted without waiting."""
    async def scenario():
        keys = Keys(unique_prefix())
        # Leases of 60 s: the waiter's own timer (a reap at the holder's expiry) stays far off, so only the
        # cancellation can end its wait.
        async with Rig(keys, ttl_ms=60000) as rig, Rig(keys, ttl_ms=60000) as deaf:
            holder = await rig.acquire("m", 0)
            waiter = asyncio.create_task(deaf.acquire("m", 0))
            for _ in range(200):
                if await rig.counts("m") == (1, 1):
                    break
                await asyncio.sleep(0.01)
            await deaf.listener._pubsub.unsubscribe()  # the grant will go nowhere
            # UNSUBSCRIBE is only sent: wait until Redis has dropped the subscription, else the grant may
            # still reach the waiter
            for _ in range(200):
                if (await rig.redis.pubsub_numsub(deaf.listener.channel))[0][1] == 0:
                    break
                await asyncio.sleep(0.01)
            else:
                raise AssertionError("Redis kept the waiter's subscription for 2 s after UNSUBSCRIBE")
            assert await rig.scheduler.release("m", holder.lease_id)
            assert await rig.counts("m") == (1, 0)  # granted to the waiter, which does not know it
            waiter.cancel()
            with pytest.raises(asyncio.CancelledError):
                await waiter
            counts = await rig.counts("m")
            later = await rig.acquire("m", 1000)
            return counts, later
    counts, later = run(scenario())
    assert counts == (0, 0) and later.waited_ms < 500


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
            lease_b = await within(first)
            assert not second.done()
            await b.scheduler.release("m", lease_b.lease_id)
            lease_a = await within(second)
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
            # A load that ended without a failure of its own (its worker was lost): no backoff.
            assert await rig.scheduler.finish_load("m", "t1", LoadEnd.WORKER_LOST, error="boom") == "ok"
            await asyncio.wait_for(woken, 1)
            snap = (await rig.scheduler.snapshot(["m"]))["m"]
            assert snap["state"] == "unloaded" and snap["error"] == "boom"
            retry = await rig.scheduler.begin_load(rig.listener, "m", "t3")
            assert retry.action == "load"
            # A worker publishes the pool; it is ready only while its liveness key says so.
            await rig.redis.set(keys.worker_live("w1"), "boot1", px=5000)
            assert await rig.scheduler.finish_load("m", "t3", LoadEnd.READY, owner="w1", boot="boot1") == "ok"
            ready = await rig.scheduler.begin_load(rig.listener, "m", "t4")
            assert (ready.action, ready.owner, ready.boot) == ("ready", "w1", "boot1")
            # R7.4: the worker dies → the model reads unloaded and the next caller loads.
            await rig.redis.delete(keys.worker_live("w1"))
            assert (await rig.scheduler.snapshot(["m"]))["m"]["state"] == "unloaded"
            assert (await rig.scheduler.begin_load(rig.listener, "m", "t5")).action == "load"
            assert await rig.scheduler.finish_load("m", "t1", LoadEnd.READY, owner="w1", boot="x") == "stale"
    run(scenario())


def test_a_load_end_wakes_each_waiter_with_how_it_ended_and_keeps_that_for_every_caller(redis_client):
    """R4.2/R7.4: ending a load publishes each waiter's wake-up with the end inline ('<ended>:<error>',
    'ready') and keeps that end for every waiter and the loader in ``:loadend:<token>`` (a minute
    each), where the next claim does not touch it: a caller that reads late still learns how *its*
    load ended; a 'woken' look answers that end."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys) as rig:
            sched = rig.scheduler
            wakes = {token: rig.listener.expect(f"load:{token}") for token in ("w1", "w2")}
            await rig.lost_load("m", "loader", ["w1", "w2"], error="worker gpu0 was lost: oom")
            heard = {token: await within(wake, 2) for token, wake in wakes.items()}
            assert heard == {"w1": "worker_lost:worker gpu0 was lost: oom",
                             "w2": "worker_lost:worker gpu0 was lost: oom"}
            lost = LoadEndRecord(LoadEnd.WORKER_LOST, "worker gpu0 was lost: oom")
            assert [await sched.load_end("m", t) for t in ("w1", "w2", "loader")] == [lost, lost, lost]
            assert all([0 < await rig.redis.pttl(keys.load_end("m", t)) <= 60000 for t in ("w1", "w2", "loader")])
            # The next claim and its failure leave the first load's end to its callers.
            assert (await sched.begin_load(rig.listener, "m", "second")).action == "load"
            wake3 = rig.listener.expect("load:w3")
            assert (await sched.begin_load(rig.listener, "m", "w3")).action == "wait"
            assert await sched.finish_load("m", "second", LoadEnd.FAILED, error="bad graph") == "ok"
            assert await within(wake3, 2) == "failed:bad graph"
            assert await sched.load_end("m", "w1") == lost
            assert await sched.load_end("m", "w3") == LoadEndRecord(LoadEnd.FAILED, "bad graph")
            assert await sched.load_end("m", "never-waited") == LoadEndRecord(None)
            # A wait whose wake-up was lost: its 'woken' look answers the end kept for it.
            assert (await sched.begin_load(rig.listener, "m", "w4", force=True)).action == "load"
            assert (await sched.begin_load(rig.listener, "m", "w5")).action == "wait"
            await rig.redis.set(keys.worker_live("gpu1"), "boot1", px=5000)
            assert await sched.finish_load("m", "w4", LoadEnd.READY, owner="gpu1", boot="boot1") == "ok"
            late = await sched.begin_load(rig.listener, "m", "w6", replaces="w5")
            assert (late.action, late.ended, late.error) == ("woken", LoadEnd.READY, "")
            assert await sched.load_end("m", "w4") == LoadEndRecord(LoadEnd.READY)
    run(scenario())


def test_silent_loader_is_replaced(redis_client):
    """R4.2/R7.4: a loader that stops renewing its claim is replaced after the TTL."""
    async def scenario():
        async with Rig(Keys(unique_prefix()), ttl_ms=300) as rig:
            assert (await rig.scheduler.begin_load(rig.listener, "m", "a")).action == "load"
            assert (await rig.scheduler.begin_load(rig.listener, "m", "b")).action == "wait"
            await asyncio.sleep(0.35)
            assert (await rig.scheduler.begin_load(rig.listener, "m", "c")).action == "load"
            assert await rig.scheduler.finish_load("m", "a", LoadEnd.READY, owner="w", boot="z") == "stale"
    run(scenario())


@pytest.mark.parametrize("death", ["liveness key expired", "hostname restarted with another boot"])
def test_a_load_whose_worker_stops_beating_is_ended_for_every_waiter(redis_client, death):
    """R7.4: a load whose worker's liveness key is gone (or names another boot of that hostname)
    is dead at once, though its claim (a 60 s TTL here) has not expired: the loader's
    ``load_claim`` reads expired, the snapshot reads unloaded, a manager does not wait for it, and
    the next ``begin_load`` ends it (``worker_lost``, no backoff), waking its waiters; the call
    after that loads."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys, ttl_ms=60000) as rig:
            sched, live = rig.scheduler, keys.worker_live("w1")
            await rig.redis.set(live, "boot1", px=5000)
            assert (await sched.begin_load(rig.listener, "m", "t1")).action == "load"
            pending = rig.listener.expect("load:t0")
            assert (await sched.begin_load(rig.listener, "m", "t0")).left_ms == -1  # no worker started it yet
            assert await sched.renew_load("m", "t1", "w1", "boot1") == 1  # the worker started it
            claim = await sched.load_claim("m", "t1")
            # Alive until its liveness key lapses (5 s), sooner than its claim (60 s): look again then.
            assert claim.claim == "running" and 4000 < claim.left_ms <= 5000
            woken = rig.listener.expect("load:t2")
            wait = await sched.begin_load(rig.listener, "m", "t2", replaces="t0")
            assert wait.action == "wait" and 4000 < wait.left_ms <= 5000
            rig.listener.expect("load:manager")
            assert (await sched.add_load_waiter(rig.listener, "m", "manager")).waiting
            if death == "liveness key expired":
                await rig.redis.delete(live)
            else:
                await rig.redis.set(live, "boot2", px=60000)
            assert await sched.load_claim("m", "t1") == ("expired", 0, "w1")
            assert (await sched.snapshot(["m"]))["m"]["state"] == "unloaded"
            assert not (await sched.add_load_waiter(rig.listener, "m", "manager2")).waiting
            lost = await sched.begin_load(rig.listener, "m", "t3")
            assert (lost.action, lost.owner) == ("lost", "w1") and "w1" in lost.error
            await within(woken, 2)
            assert not pending.done()  # t0 was unregistered when t2 replaced it
            load = await rig.redis.hgetall(keys.load("m"))
            assert (load["state"], load["ended"]) == ("unloaded", "worker_lost") and "retry_at_ms" not in load
            assert (await sched.begin_load(rig.listener, "m", "t4")).action == "load"
            assert await sched.finish_load("m", "t1", LoadEnd.READY, owner="w1", boot="boot1") == "stale"
    run(scenario())


def test_a_worker_seen_to_exit_is_forgotten_in_one_step(redis_client):
    """R7.4 (one script per transition): when ``serve`` sees a worker exit, one call
    (``forget_worker.lua``) marks its ready pool unloaded, ends the load it ran as ``worker_lost`` (its
    waiter woken now, no backoff) and deletes its liveness key and registry entries, while the pool of
    another worker and its entries stay as they were."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys, ttl_ms=60000) as rig:
            sched = rig.scheduler
            for host, boot in (("w1", "b1"), ("w2", "b2")):
                await rig.redis.set(keys.worker_live(host), boot, px=60000)
                await rig.redis.hset(keys.worker_pid, host, 100)
                await rig.redis.hset(keys.worker_memory, host, 2048)
            for model_id, host, boot in (("on-w1", "w1", "b1"), ("on-w2", "w2", "b2")):
                assert (await sched.begin_load(rig.listener, model_id, f"t-{model_id}")).action == "load"
                assert await sched.renew_load(model_id, f"t-{model_id}", host, boot) == 1
                assert await sched.finish_load(model_id, f"t-{model_id}", LoadEnd.READY, owner=host, boot=boot) == "ok"
            assert (await sched.begin_load(rig.listener, "loading", "t-load")).action == "load"
            assert await sched.renew_load("loading", "t-load", "w1", "b1") == 1
            woken = rig.listener.expect("load:waiter")
            assert (await sched.begin_load(rig.listener, "loading", "waiter")).action == "wait"
            lost = await sched.forget_worker("w1", ["on-w1", "on-w2", "loading", "never-loaded"])
            status = await sched.snapshot(["on-w1", "on-w2", "loading"])
            load = await rig.redis.hgetall(keys.load("loading"))
            end = (await within(woken, 2)).split("\n")
            left = (await rig.redis.exists(keys.worker_live("w1"), keys.worker_live("w2")),
                    await rig.redis.hkeys(keys.worker_pid), await rig.redis.hkeys(keys.worker_memory))
            return lost, status, load, end, left
    lost, status, load, end, left = run(scenario())
    assert lost == ForgottenWorker(pools=["on-w1"], loads=["loading"])
    assert (status["on-w1"]["state"], status["on-w1"]["error"]) == ("unloaded", "worker lost")
    assert status["on-w2"]["state"] == "ready" and status["loading"]["state"] == "unloaded"
    assert (load["ended"], load["error"]) == ("worker_lost", "worker w1 was lost while loading the model")
    assert "retry_at_ms" not in load and "loader" not in load
    assert end[-1] == "worker_lost:worker w1 was lost while loading the model"
    assert left == (1, ["w2"], ["w2"])


def test_a_starting_worker_drops_departed_workers_and_a_stopping_one_only_its_own_entries(redis_client):
    """R7.4 (one script per change of the worker registry): a worker starting drops the ``worker_pid`` and
    ``worker_memory`` entries of workers whose liveness key is gone; a worker stopping deletes its key and
    entries only while the key still holds its own boot id."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys) as rig:
            sched = rig.scheduler
            for host in ("alive", "gone", "reborn"):
                await rig.redis.hset(keys.worker_pid, host, 1)
                await rig.redis.hset(keys.worker_memory, host, 1024)
            await rig.redis.set(keys.worker_live("alive"), "b1", px=60000)
            await rig.redis.set(keys.worker_live("reborn"), "new-boot", px=60000)
            departed = await sched.forget_departed_workers()
            registry = sorted(await rig.redis.hkeys(keys.worker_pid)), sorted(await rig.redis.hkeys(keys.worker_memory))
            stale_leave = await sched.worker_leave("reborn", "old-boot")  # another boot holds the name now
            own_leave = await sched.worker_leave("alive", "b1")
            left = (await rig.redis.exists(keys.worker_live("alive"), keys.worker_live("reborn")),
                    sorted(await rig.redis.hkeys(keys.worker_pid)))
            return departed, registry, stale_leave, own_leave, left
    departed, registry, stale_leave, own_leave, left = run(scenario())
    assert departed == ["gone"]
    assert registry == (["alive", "reborn"], ["alive", "reborn"])
    assert stale_leave is False and own_leave is True
    assert left == (1, ["reborn"])


def test_a_waiter_looking_again_just_after_the_load_ended_hears_of_that_end(redis_client):
    """R7.4/R4.2: a waiter's timed look and the loader's finding of the dead worker fall on the same
    instant (both wait for the worker's liveness expiry). When the load ends first and the waiter's
    wake-up is not yet read, the waiter's next ``begin_load`` (``replaces`` its unwoken token)
    answers ``woken`` and changes nothing, so the waiter reports that end (``worker_lost``)
    instead of becoming the next loader of a model whose load was lost (seen: a request
    hanging on a reload it started itself, tests/test_scale.py)."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys) as rig:
            sched = rig.scheduler
            await rig.lost_load("m", "loader", ["w1"])
            late = await sched.begin_load(rig.listener, "m", "w2", replaces="w1")
            assert late.action == "woken"
            load = await rig.redis.hgetall(keys.load("m"))
            assert (load["state"], load["ended"]) == ("unloaded", "worker_lost") and "loader" not in load
            # A waiter whose entry is still there (not woken) decides as before; so does a new caller.
            assert (await sched.begin_load(rig.listener, "m", "w3", replaces="")).action == "load"
            assert (await sched.begin_load(rig.listener, "m", "w4", replaces="")).action == "wait"
            assert (await sched.begin_load(rig.listener, "m", "w5", replaces="w4")).action == "wait"
    run(scenario())


def test_a_waiter_deciding_again_leaves_one_load_wait_entry(redis_client):
    """R4.2: a caller that waits for a load looks again every few seconds with a new token; each
    look unregisters its previous token, so the waiters' hash does not grow with the load's length."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys) as rig:
            assert (await rig.scheduler.begin_load(rig.listener, "m", "loader")).action == "load"
            previous = ""
            for look in range(5):
                decision = await rig.scheduler.begin_load(rig.listener, "m", f"w{look}", replaces=previous)
                assert decision.action == "wait"
                previous = f"w{look}"
            assert await rig.redis.hgetall(keys.model("m") + ":loadwait") == {"w4": rig.listener.channel}
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


# -- several slots and managers (parallel runtime) --------------------------------------------
async def _capacity(rig: Rig, model_id: str, slots: int) -> None:
    await rig.scheduler.publish_entry({"id": model_id}, slots)  # as the service publishes a registration


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_consecutive_requests_fill_spare_slots(redis_client, slots):
    """R2.2: up to `slots` requests hold leases at once; the next one queues."""
    async def scenario():
        async with Rig(Keys(unique_prefix())) as rig:
            await _capacity(rig, "m", slots)
            leases = [await rig.acquire("m", 1000) for _ in range(slots)]
            assert await rig.counts("m") == (slots, 0)
            extra = asyncio.create_task(rig.acquire("m", 0))
            await asyncio.sleep(0.05)
            assert await rig.counts("m") == (slots, 1)
            await rig.scheduler.release("m", leases[0].lease_id)
            leases = leases[1:] + [await within(extra)]
            for lease in leases:
                await rig.scheduler.release("m", lease.lease_id)
            assert await rig.counts("m") == (0, 0)
    run(scenario())


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_manager_is_a_barrier_older_work_drains_first_and_later_work_neither_barges_nor_starves(redis_client, slots):
    """R2.2/R2.3: older request, then a manager, then staggered later requests."""
    async def scenario():
        async with Rig(Keys(unique_prefix())) as rig:
            await _capacity(rig, "m", slots)
            events: list[str] = []
            held = [await rig.acquire("m", 0) for _ in range(slots)]  # every slot busy
            older = asyncio.create_task(rig.acquire("m", 0))
            await asyncio.sleep(0.02)
            manager = asyncio.create_task(rig.acquire("m", 0, kind="manager"))
            await asyncio.sleep(0.02)
            later = []
            for _ in range(3):
                later.append(asyncio.create_task(rig.acquire("m", 0)))
                await asyncio.sleep(0.02)
            snap = (await rig.scheduler.snapshot(["m"]))["m"]
            assert (snap["active_leases"], snap["queued"], snap["queued_managers"]) == (slots, 4, 1)
            # One slot frees: the older request takes it; the manager still waits for every lease.
            await rig.scheduler.release("m", held.pop().lease_id)
            older_lease = await asyncio.wait_for(older, 1)
            events.append("older")
            held.append(older_lease)
            # Free slots now exist (slots > 1 case) but later requests may not barge past the manager.
            for lease in held[:-1]:
                await rig.scheduler.release("m", lease.lease_id)
            await asyncio.sleep(0.05)
            assert not manager.done() and not any(t.done() for t in later)
            await rig.scheduler.release("m", older_lease.lease_id)
            manager_lease = await asyncio.wait_for(manager, 1)
            events.append("manager")
            assert not any(t.done() for t in later)
            snap = (await rig.scheduler.snapshot(["m"]))["m"]
            assert (snap["active_leases"], snap["manager_leases"], snap["queued"]) == (0, 1, 3)
            await rig.scheduler.release("m", manager_lease.lease_id)
            later_leases = await asyncio.wait_for(asyncio.gather(*later[:slots]), 1)
            events.append("later")
            for lease in later_leases:
                await rig.scheduler.release("m", lease.lease_id)
            for task in later[slots:]:
                await rig.scheduler.release("m", (await asyncio.wait_for(task, 1)).lease_id)
            assert events == ["older", "manager", "later"]
            assert await rig.counts("m") == (0, 0)
    run(scenario())


def test_overlapping_managers_keep_enqueue_order(redis_client):
    """R2.2: managers are granted one at a time in the order they entered."""
    async def scenario():
        async with Rig(Keys(unique_prefix())) as rig:
            await _capacity(rig, "m", 2)
            request = await rig.acquire("m", 0)
            order: list[int] = []

            async def manager(i):
                lease = await rig.acquire("m", 0, kind="manager")
                order.append(i)
                snap = (await rig.scheduler.snapshot(["m"]))["m"]
                assert snap["manager_leases"] == 1 and snap["active_leases"] == 0
                await asyncio.sleep(0.02)
                await rig.scheduler.release("m", lease.lease_id)

            tasks = []
            for i in range(4):
                tasks.append(asyncio.create_task(manager(i)))
                await asyncio.sleep(0.01)
            await rig.scheduler.release("m", request.lease_id)
            await within(asyncio.gather(*tasks))
            assert order == [0, 1, 2, 3]
    run(scenario())


def test_overdue_fail_fast_with_a_waiting_manager_and_spare_slots(redis_client):
    """R3.3: unoccupied slots are ignored; the only occupied slot is overdue → refused at once."""
    async def scenario():
        async with Rig(Keys(unique_prefix()), ttl_ms=5000) as rig:
            await _capacity(rig, "m", 2)
            holder = await rig.acquire("m", 0)
            manager = asyncio.create_task(rig.acquire("m", 0, kind="manager"))
            await asyncio.sleep(0.3)
            started = time.monotonic()
            with pytest.raises(AdmissionOverdue):
                await rig.acquire("m", 200)
            assert (time.monotonic() - started) * 1000 < 50
            await rig.scheduler.release("m", holder.lease_id)
            await rig.scheduler.release("m", (await within(manager)).lease_id)
    run(scenario())


def test_healthy_and_overdue_slots_allow_bounded_waiting(redis_client):
    """R3.3: one overdue and one healthy occupied slot → the request queues (and times out at its deadline)."""
    async def scenario():
        async with Rig(Keys(unique_prefix()), ttl_ms=5000) as rig:
            await _capacity(rig, "m", 2)
            old = await rig.acquire("m", 0)
            await asyncio.sleep(0.3)
            fresh = await rig.acquire("m", 0)
            started = time.monotonic()
            with pytest.raises(AdmissionTimeout):
                await rig.acquire("m", 200)
            assert 190 <= (time.monotonic() - started) * 1000 < 350
            for lease in (old, fresh):
                await rig.scheduler.release("m", lease.lease_id)
    run(scenario())


def test_manager_timeouts(redis_client):
    """R3.4: a manager times out at its deadline, fails fast behind an overdue lease, and 0 waits."""
    async def scenario():
        async with Rig(Keys(unique_prefix()), ttl_ms=5000) as rig:
            await _capacity(rig, "m", 2)
            holder = await rig.acquire("m", 0)
            started = time.monotonic()
            with pytest.raises(AdmissionTimeout):
                await rig.acquire("m", 250, kind="manager")
            assert 240 <= (time.monotonic() - started) * 1000 < 400
            assert (await rig.scheduler.snapshot(["m"]))["m"]["queued_managers"] == 0
            await asyncio.sleep(0.1)  # holder is now older than 300 ms
            with pytest.raises(AdmissionOverdue):
                await rig.acquire("m", 300, kind="manager")
            unbounded = asyncio.create_task(rig.acquire("m", 0, kind="manager"))
            await asyncio.sleep(0.4)
            assert not unbounded.done()
            await rig.scheduler.release("m", holder.lease_id)
            await rig.scheduler.release("m", (await asyncio.wait_for(unbounded, 1)).lease_id)
    run(scenario())


def test_cancelled_manager_barrier_lets_later_requests_use_spare_slots(redis_client):
    """R2.2/R8.1: when a queued manager leaves, the requests behind it are granted at once."""
    async def scenario():
        async with Rig(Keys(unique_prefix())) as rig:
            await _capacity(rig, "m", 2)
            holder = await rig.acquire("m", 0)
            manager = asyncio.create_task(rig.acquire("m", 0, kind="manager"))
            await asyncio.sleep(0.02)
            behind = asyncio.create_task(rig.acquire("m", 0))
            await asyncio.sleep(0.05)
            assert not behind.done()
            manager.cancel()
            with pytest.raises(asyncio.CancelledError):
                await manager
            lease = await asyncio.wait_for(behind, 1)
            for held in (holder, lease):
                await rig.scheduler.release("m", held.lease_id)
    run(scenario())


class QueueModel:
    """Reference model of one model's FIFO admission (R2.2), for the stress test."""

    def __init__(self, capacity: int):
        self.capacity = capacity
        self.queue: list[tuple[int, str]] = []  # (client id, kind) in enqueue order
        self.requests: set[int] = set()
        self.managers: set[int] = set()

    def grantable(self, kind: str) -> bool:
        if self.managers:
            return False
        return not self.requests if kind == "manager" else len(self.requests) < self.capacity

    def enqueue(self, cid: int, kind: str) -> None:
        if not self.queue and self.grantable(kind):
            (self.managers if kind == "manager" else self.requests).add(cid)
        else:
            self.queue.append((cid, kind))

    def grant_pass(self) -> None:
        while self.queue and self.grantable(self.queue[0][1]):
            cid, kind = self.queue.pop(0)
            (self.managers if kind == "manager" else self.requests).add(cid)
            if kind == "manager":
                break

    def release(self, cid: int) -> None:
        self.requests.discard(cid)
        self.managers.discard(cid)
        self.grant_pass()

    def cancel(self, cid: int) -> None:
        self.queue = [(c, k) for c, k in self.queue if c != cid]
        self.grant_pass()


@pytest.mark.parametrize("slots", [1, 2, 4])
def test_seeded_random_stress_keeps_every_invariant(redis_client, slots):
    """F6/R2.1/R2.2/R8.1: a random mix of requests, managers, releases and cancels;
    after every step the real scheduler equals the reference model (FIFO held),
    counters stay within bounds, and everything drains to zero."""
    import random

    seed = 20261130 + slots
    print(f"stress seed {seed}")
    rng = random.Random(seed)

    async def scenario():
        async with Rig(Keys(unique_prefix()), ttl_ms=60000) as rig:
            await _capacity(rig, "m", slots)
            model = QueueModel(slots)
            tasks: dict[int, asyncio.Task] = {}
            kinds: dict[int, str] = {}
            released: set[int] = set()
            for step in range(160):
                waiting = [c for c, _ in model.queue]
                holders = sorted(model.requests | model.managers)
                roll = rng.random()
                if roll < 0.45 or not (waiting or holders):
                    cid = step
                    kinds[cid] = "manager" if rng.random() < 0.2 else "request"
                    tasks[cid] = asyncio.create_task(rig.acquire("m", 0, kind=kinds[cid]))
                    await asyncio.sleep(0.005)  # the enqueue lands before the next step
                    model.enqueue(cid, kinds[cid])
                elif roll < 0.85 and holders:
                    cid = rng.choice(holders)
                    await rig.scheduler.release("m", tasks[cid].result().lease_id)
                    model.release(cid)
                    released.add(cid)
                elif waiting:
                    cid = rng.choice(waiting)
                    tasks[cid].cancel()
                    with pytest.raises(asyncio.CancelledError):
                        await tasks[cid]
                    model.cancel(cid)
                else:
                    continue
                await asyncio.sleep(0.01)  # let pushed grants arrive
                snap = (await rig.scheduler.snapshot(["m"]))["m"]
                holding_now = {c for c, t in tasks.items() if t.done() and not t.cancelled()} - released
                assert holding_now == model.requests | model.managers, (seed, step)
                still_waiting = {c for c, t in tasks.items() if not t.done()}
                assert still_waiting == {c for c, _ in model.queue}, (seed, step)
                assert 0 <= snap["active_leases"] == len(model.requests) <= slots
                assert snap["manager_leases"] == len(model.managers) <= 1
                assert not (snap["manager_leases"] and snap["active_leases"])
                assert snap["queued"] + snap["queued_managers"] == len(model.queue)
            # Drain: release every holder until nothing is held or queued.
            while model.requests or model.managers:
                for cid in sorted(model.requests | model.managers):
                    await rig.scheduler.release("m", tasks[cid].result().lease_id)
                    model.release(cid)
                await asyncio.sleep(0.02)
            snap = (await rig.scheduler.snapshot(["m"]))["m"]
            assert (snap["active_leases"], snap["queued"], snap["manager_leases"], snap["queued_managers"]) == \
                (0, 0, 0, 0)
    run(scenario())


# -- building blocks for bulk unload and eviction (R5, R6) -----------------------------------------
def test_bulk_manager_publication_orders_overlapping_and_reversed_selections(redis_client):
    """R5.1/R5.2: one atomic publication per bulk call; overlapping calls in either selection
    order are served in publication order on every shared model, without deadlock; unrelated
    models keep serving requests at once."""
    async def scenario():
        async with Rig(Keys(unique_prefix())) as rig:
            request_b = await rig.acquire("b", 0)  # b is busy, a is idle
            first = await rig.scheduler.acquire_many(rig.listener, ["a", "b"])
            second = await rig.scheduler.acquire_many(rig.listener, ["b", "a"])  # reversed selection
            assert first["a"].done() and not first["b"].done()
            assert not second["a"].done() and not second["b"].done()
            unrelated = await asyncio.wait_for(rig.acquire("c", 100), 0.2)  # never waits on bulk work
            await rig.scheduler.release("c", unrelated.lease_id)
            order: list[str] = []
            for name, futures in (("first", first), ("second", second)):
                for model_id, future in futures.items():
                    future.add_done_callback(lambda _f, n=name, m=model_id: order.append(f"{n}:{m}"))
            await rig.scheduler.release("a", (await first["a"]).lease_id)
            await asyncio.wait_for(second["a"], 1)
            await rig.scheduler.release("a", second["a"].result().lease_id)
            await rig.scheduler.release("b", request_b.lease_id)
            await asyncio.wait_for(first["b"], 1)
            assert not second["b"].done()
            await rig.scheduler.release("b", first["b"].result().lease_id)
            await asyncio.wait_for(second["b"], 1)
            await rig.scheduler.release("b", second["b"].result().lease_id)
            assert order.index("first:b") < order.index("second:b")
            for model_id in ("a", "b", "c"):
                snap = (await rig.scheduler.snapshot([model_id]))[model_id]
                assert (snap["active_leases"], snap["queued"], snap["manager_leases"], snap["queued_managers"]) == \
                    (0, 0, 0, 0)
    run(scenario())


def test_try_acquire_takes_only_a_ready_idle_model_and_never_waits(redis_client):
    """R6.1/R6.4: eviction and idle retirement never wait and never interrupt work."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys) as rig:
            assert await rig.scheduler.try_acquire("m") is None  # not loaded (state unloaded)
            await rig.redis.hset(keys.model("m") + ":load", mapping={"state": "ready"})
            busy = await rig.acquire("m", 0)
            started = time.monotonic()
            assert await rig.scheduler.try_acquire("m") is None  # a request holds a slot
            assert time.monotonic() - started < 0.05
            waiter = asyncio.create_task(rig.acquire("m", 0))
            await asyncio.sleep(0.02)
            await rig.scheduler.release("m", busy.lease_id)
            queued_then_held = await within(waiter)
            assert await rig.scheduler.try_acquire("m") is None
            await rig.scheduler.release("m", queued_then_held.lease_id)
            lease = await rig.scheduler.try_acquire("m")
            assert lease is not None and lease.kind == "manager"
            blocked = asyncio.create_task(rig.acquire("m", 0))
            await asyncio.sleep(0.05)
            assert not blocked.done()  # the evicting manager holds the model
            await rig.scheduler.release("m", lease.lease_id)
            await rig.scheduler.release("m", (await within(blocked)).lease_id)
    run(scenario())


def test_recent_use_counts_admitted_requests_decays_and_bounds_eviction_by_try_acquire(redis_client):
    """R6.1 (eviction by recent use): each request admitted for a registered model adds one to its
    recent use, which halves every ``use_half_life_ms``; managers and unregistered models count
    nothing. try_acquire for an eviction refuses a model whose pool is younger than the minimum
    residency, or whose use is not below the asker's demand, and takes it once both hold."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys) as rig:
            scheduler = Scheduler(rig.redis, keys, rig.ttl_ms, use_half_life_ms=1000)
            await rig.redis.hset(keys.models_meta, "m", "{}")
            await rig.redis.set(keys.worker_live("w"), "boot1", px=30000)
            assert (await scheduler.begin_load(rig.listener, "m", "tok")).action == "load"
            assert await scheduler.finish_load("m", "tok", LoadEnd.READY, "w", "boot1", capacity=1) == "ok"
            for _ in range(3):
                lease = await within(scheduler.acquire(rig.listener, "m", 0))
                await scheduler.release("m", lease.lease_id)
            manager = await within(scheduler.acquire(rig.listener, "m", 0, LeaseKind.MANAGER))
            await scheduler.release("m", manager.lease_id)
            unregistered = await within(scheduler.acquire(rig.listener, "other", 0))
            await scheduler.release("other", unregistered.lease_id)
            status = (await scheduler.snapshot(["m", "other"]))
            assert 2.8 < status["m"]["use"] <= 3.0 and status["other"]["use"] == 0, status
            assert status["m"]["state"] == "ready" and 0 <= status["m"]["resident_ms"] < 1000
            assert await scheduler.try_acquire("m", min_resident_ms=60000) is None  # too recently loaded
            assert await scheduler.try_acquire("m", below_use=2.5) is None  # in more use than the asker
            await asyncio.sleep(0.6)  # 3 requests decay to about 3 * 2^-0.6 = 1.98
            later = (await scheduler.snapshot(["m"]))["m"]
            assert 1.6 < later["use"] < 2.1 and later["resident_ms"] >= 600, later
            lease = await scheduler.try_acquire("m", min_resident_ms=500, below_use=2.5)
            assert lease is not None and lease.kind == "manager"
            await scheduler.release("m", lease.lease_id)
    run(scenario())


_DOOMED_PROCESS = """
import asyncio, sys
import redis.asyncio as aioredis
from inference.scheduler import Keys, Listener, Scheduler

async def main(url, prefix):
    client = aioredis.Redis.from_url(url, decode_responses=True)
    keys = Keys(prefix)
    listener = await Listener.start(client, keys.process_channel, liveness_ttl_ms=1000)
    scheduler = Scheduler(client, keys, int(sys.argv[3]))
    waiters = [asyncio.create_task(scheduler.acquire(listener, "m", 0)) for _ in range(4)]
    await asyncio.sleep(0.3)
    print("queued", flush=True)
    await asyncio.gather(*waiters)

asyncio.run(main(sys.argv[1], sys.argv[2]))
"""
LAPSE_TTL_MS = 2000
"""The lease TTL of the lapse tests: long beside the scheduling noise of a loaded machine (a wait of
one TTL measured 1.82 s with a 1 s TTL), so one TTL is told from two with room to spare."""


def test_tickets_of_a_killed_web_process_are_skipped_not_granted_one_ttl_each(redis_client):
    """R7.5: a web process killed (SIGKILL) with 4 tickets queued strands nothing: once its liveness
    key expires, the grant pass drops its tickets, and the next live waiter is granted as soon as the
    holder releases (it is not made to wait while each orphan is granted in turn and lapses, a lease
    TTL each)."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys, ttl_ms=5000) as rig:  # the holder outlives the wait below
            holder = await rig.acquire("m", 0)
            doomed = subprocess.Popen([sys.executable, "-c", _DOOMED_PROCESS, f"{REDIS_BASE}/15", keys.prefix,
                                       "1000"], cwd=ROOT, stdout=subprocess.PIPE, text=True)
            try:
                line = await within(asyncio.to_thread(doomed.stdout.readline), 20)
                assert line.strip() == "queued"
                assert await rig.counts("m") == (1, 4)
            finally:
                doomed.kill()  # SIGKILL: its tickets stay queued, nobody cancels them
                doomed.wait(10)
            live = asyncio.create_task(rig.acquire("m", 0))
            await asyncio.sleep(1.3)  # the dead process's liveness key (1 s TTL) expires
            assert await rig.counts("m") == (1, 5)
            released_at = time.monotonic()
            await rig.scheduler.release("m", holder.lease_id)
            lease = await within(live, 2)
            assert time.monotonic() - released_at < 0.5
            assert await rig.counts("m") == (1, 0)  # the orphans were dropped, not granted
            await rig.scheduler.release("m", lease.lease_id)
    run(scenario())


def test_a_process_killed_just_before_the_release_costs_at_most_one_lease_ttl(redis_client):
    """R7.5 bound: when the holder releases before the killed process's liveness key has expired, its
    first ticket is granted (the process still looked alive) and its lease lapses after the TTL; the
    other three are dropped by that reclaim's grant pass, so a live waiter waits about one TTL, not four."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys, ttl_ms=LAPSE_TTL_MS) as rig:
            holder = await rig.acquire("m", 0)
            doomed = subprocess.Popen([sys.executable, "-c", _DOOMED_PROCESS, f"{REDIS_BASE}/15", keys.prefix,
                                       str(LAPSE_TTL_MS)],
                                      cwd=ROOT, stdout=subprocess.PIPE, text=True)
            try:
                assert (await within(asyncio.to_thread(doomed.stdout.readline), 20)).strip() == "queued"
            finally:
                doomed.kill()
                doomed.wait(10)
            live = asyncio.create_task(rig.acquire("m", 0))
            await asyncio.sleep(0.1)
            released_at = time.monotonic()
            await rig.scheduler.release("m", holder.lease_id)  # the first orphan is granted: still "alive"
            lease = await within(live, 5)
            waited_s = time.monotonic() - released_at
            assert 0.9 <= waited_s / (LAPSE_TTL_MS / 1000) < 1.8, waited_s  # one lease TTL, not two or four
            assert await rig.counts("m") == (1, 0)
            await rig.scheduler.release("m", lease.lease_id)
    run(scenario())


def test_an_unload_keeps_the_error_of_a_failed_load_while_its_backoff_is_remembered(redis_client):
    """R6.7 : an unload's state changes do not wipe ``error`` of a failed
    load whose backoff is still remembered (status kept ``failed`` with ``last_error`` null)."""
    async def scenario():
        async with Rig(Keys(unique_prefix())) as rig:
            sched = rig.scheduler
            decision = await sched.begin_load(rig.listener, "m", "t1")
            assert decision.action == "load"
            assert await sched.renew_load("m", "t1", "w1", "boot1") == 1
            assert await sched.finish_load("m", "t1", LoadEnd.FAILED, owner="w1", boot="boot1",
                                           error="broken weights") == "ok"
            manager = await rig.acquire("m", 0, "manager")
            await sched.set_state("m", ModelState.UNLOADING, manager.lease_id)
            await sched.set_state("m", ModelState.UNLOADED, manager.lease_id)
            await sched.release("m", manager.lease_id)
            status = (await sched.snapshot(["m"]))["m"]
            assert status["state"] == "failed" and status["error"] == "broken weights" and status["retry_at_ms"]
    run(scenario())


def test_lease_renewals_during_a_redis_outage_log_one_warning_each_not_a_traceback_per_renewal(caplog):
    """A lease held while its Redis is gone (killed; a redis-server of the test's own) keeps renewing every
    third of its TTL (here 0.1 s), in an async block and in a thread: each keep-alive logs one warning line
    for the outage (no traceback), not ``renewing … failed`` with a traceback every 0.1 s."""
    from .test_web_port_when_unready import OwnRedis

    server = OwnRedis()
    server.start()

    async def scenario():
        client = aioredis.Redis.from_url(server.url, decode_responses=True)
        keys = Keys(unique_prefix())
        listener = await Listener.start(client, keys.process_channel)
        scheduler = Scheduler(client, keys, 300)
        blocking = Scheduler(redis.Redis.from_url(server.url, decode_responses=True), keys, 300)  # a worker's
        try:
            held = await scheduler.acquire(listener, "m", 0)
            threaded = await scheduler.acquire(listener, "n", 0)
            with caplog.at_level(logging.DEBUG, logger="inference.scheduler.keepalive"):
                with blocking.keep_alive("n", threaded.lease_id):
                    async with scheduler.keep_alive("m", held.lease_id):
                        server.kill()
                        await asyncio.sleep(1.0)  # about ten renewals of each lease fail
        finally:
            await listener.close()
            await client.aclose()

    try:
        run(scenario())
    finally:
        if server.proc is not None:
            server.kill()
    records = [r for r in caplog.records if r.name == "inference.scheduler.keepalive" and r.levelno >= logging.INFO]
    assert [(r.levelno, r.exc_info) for r in records] == [(logging.WARNING, None)] * 2, \
        [r.getMessage() for r in records]
    assert sorted(r.getMessage().split(" failed")[0].rsplit(" ", 1)[1] for r in records) == ["m", "n"]


class SwitchRelay:
    """A TCP relay to Redis in the test's event loop whose next connections can be cut at once (``mode``
    ``refuse``: accepted and closed, as a Redis that is gone) or forwarded (``forward``); ``drop_one``
    cuts the next connection only, then forwards. ``refused`` counts the connections cut."""

    def __init__(self, upstream: tuple[str, int]):
        self.upstream = upstream
        self.mode = "forward"
        self.refused = 0
        self.open: set[asyncio.StreamWriter] = set()
        self.server: asyncio.AbstractServer | None = None

    async def start(self) -> int:
        self.server = await asyncio.start_server(self._serve, "127.0.0.1", 0)
        return self.server.sockets[0].getsockname()[1]

    def cut_all(self) -> None:
        for writer in list(self.open):
            writer.transport.abort()

    async def _serve(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter) -> None:
        if self.mode != "forward":
            self.mode = "forward" if self.mode == "drop_one" else self.mode
            self.refused += 1
            writer.transport.abort()
            return
        up_reader, up_writer = await asyncio.open_connection(*self.upstream)
        self.open.update((writer, up_writer))

        async def pipe(source: asyncio.StreamReader, sink: asyncio.StreamWriter) -> None:
            try:
                while data := await source.read(65536):
                    sink.write(data)
            except OSError:
                pass
            finally:
                sink.transport.abort()

        await asyncio.gather(pipe(reader, up_writer), pipe(up_reader, writer))
        self.open.difference_update((writer, up_writer))

    async def close(self) -> None:
        self.cut_all()
        if self.server is not None:
            self.server.close()


def test_a_listener_whose_redis_comes_back_reports_itself_subscribed_again(redis_client):
    """A listener (connected as a web process's, with a client name, through a relay) whose Redis goes
    away, and whose first attempt to subscribe again is cut while the next connection goes through
    (Redis coming back between the two, or still loading for the first): within 2 s ``subscribed`` is
    True again and a message published then reaches its waiter. (Measured before: the read after the
    failed attempt reconnected the pubsub by itself, which resubscribed it, and then blocked reading:
    messages arrived but ``subscribed`` stayed False for good, so a web process with
    ``refuse_connections_when_unready`` kept its port closed, ``audiosite.http.port_gate``.)"""
    async def scenario():
        relay = SwitchRelay(("127.0.0.1", redis_client.connection_pool.connection_kwargs["port"]))
        port = await relay.start()
        db = redis_client.connection_pool.connection_kwargs.get("db", 0)
        pool = aioredis.BlockingConnectionPool.from_url(  # as a web process's (inference.runtime.context)
            f"redis://127.0.0.1:{port}/{db}", decode_responses=True, client_name="listener-test",
            socket_timeout=None, socket_connect_timeout=2)
        client = aioredis.Redis(connection_pool=pool)
        listener = await Listener.start(client, Keys(unique_prefix()).process_channel, liveness_ttl_ms=600_000)
        try:
            relay.mode = "refuse"
            relay.cut_all()
            refused = relay.refused
            deadline = time.monotonic() + 2
            while relay.refused < refused + 3:  # the listener is retrying: between two of its attempts now
                assert time.monotonic() < deadline, "the listener did not try to subscribe again"
                await asyncio.sleep(0.01)
            await asyncio.sleep(0.05)
            assert not listener.subscribed
            relay.mode = "drop_one"  # the next attempt fails, the one after goes through
            deadline = time.monotonic() + 2
            while not listener.subscribed:
                assert time.monotonic() < deadline, "not subscribed 2 s after Redis came back"
                await asyncio.sleep(0.01)
            woken = listener.expect("probe")
            await asyncio.to_thread(redis_client.publish, listener.channel, "probe")
            await within(woken, 2)
        finally:
            await listener.close()
            await client.aclose()
            await relay.close()

    run(scenario())
