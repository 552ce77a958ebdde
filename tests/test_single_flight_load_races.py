"""Races of the single-flight load protocol around ``begin_load``'s ``woken`` answer.

``begin_load.lua`` answers ``{'woken', <how that load ended>}`` when the caller passes
``replaces=<its previous wait's token>`` and that ``:loadwait`` entry is already gone; the end comes
from ``:loadend``, where every end of a load keeps, per waiter token, what its wake-up carries
(``load_single_flight`` in ``inference/runtime/loads.py`` reports it, R4.2, R7.4).

Two levels, both on a real Redis (database 15) and real listeners, no mocks:
- the scripts alone (``Rig``: one simulated web process, as in tests/test_scheduler.py);
- ``load_single_flight`` itself on an ``AsyncContext``. The test plays the GPU workers with the
  same calls a worker's load task makes (``renew_load`` with its hostname and boot, its liveness
  key, ``finish_load``, the reply key). A waiter that misses its wake-up is a caller whose listener
  is not subscribed (a real ``Listener`` that was never started: a dropped subscription, which
  ``begin_load.lua``'s comment names, "or was just missed"): every look it takes is the timed one.

The two "though the next claim" tests pin that a waiter reads how its load ended from its wake-up or
``:loadend`` (per waiter token), not from the model's *current* ``:load`` hash: a waiter of a lost load
that reads it only after the *next* load was claimed (its wake-up lost, or heard late) answers 503
``worker_lost`` (R7.4) instead of waiting for that next load. The others pin the rest of the ``woken``
answer; the takeover test, the late READY look and the dead-pool reload hold without it.
"""
from __future__ import annotations

import asyncio
import json
import os
import random
import time

import pytest

from audiosite.errors import ModelLoadFailed, ServerBusy
from inference.runtime.context import KEYS
from inference.runtime.loads import Placement, load_single_flight
from inference.scheduler import Keys, LeaseKind, LoadEnd, Scheduler

from .support.bounds import outcome_of, run, within
from .support.rigs import Rig, claim_started_by, live_worker, load_contexts, unique_prefix


async def _changes_of(rig: Rig, action):
    """Run ``action()`` and return (its result, the change notices published meanwhile)."""
    pubsub = rig.redis.pubsub(ignore_subscribe_messages=True)
    await pubsub.subscribe(rig.keys.changes)
    try:
        result = await action()
        await rig.redis.publish(rig.keys.changes, "<end>")  # a marker: everything before it has arrived
        seen = []
        while True:
            message = await within(pubsub.get_message(timeout=1.0), 2)
            if message is None:
                continue
            if message["data"] == "<end>":
                return result, seen
            seen.append(message["data"])
    finally:
        await pubsub.aclose()


# -- the scripts alone -------------------------------------------------------------------------------
def test_a_late_look_after_a_ready_finish_is_woken_changes_nothing_and_the_next_call_reads_ready(redis_client):
    """R4.2: a waiter whose look comes after the load finished READY (its wake-up unread) is answered
    ``woken`` and nothing changes: no state, no new ``:loadwait`` entry, no change notice; its next
    call (``replaces=''``) reads the pool ready on its live owner."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys) as rig:
            sched = rig.scheduler
            await rig.redis.set(keys.worker_live("w1"), "boot1", px=30000)
            assert (await sched.begin_load(rig.listener, "m", "loader")).action == "load"
            assert (await sched.begin_load(rig.listener, "m", "w1")).action == "wait"
            assert await sched.finish_load("m", "loader", LoadEnd.READY, owner="w1", boot="boot1", capacity=1) == "ok"
            before = await rig.model_keys("m")
            late, notices = await _changes_of(rig, lambda: sched.begin_load(rig.listener, "m", "w2", replaces="w1"))
            assert late.action == "woken"
            assert await rig.model_keys("m") == before and before["loadwait"] == {}
            assert notices == []
            ready = await sched.begin_load(rig.listener, "m", "w3")
            assert (ready.action, ready.owner, ready.boot) == ("ready", "w1", "boot1")
    run(scenario())


def test_two_late_waiters_of_a_lost_load_are_both_woken_and_single_flight_holds_after(redis_client):
    """R4.2/R7.4: two waiters both look late at a load whose worker was lost: both are ``woken``
    (neither becomes a loader; the model stays ``unloaded``/``worker_lost``), and the callers after
    them still get one loader and one waiter."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys) as rig:
            sched = rig.scheduler
            await rig.lost_load("m", "loader", ["w1", "w2"])
            late = await asyncio.gather(sched.begin_load(rig.listener, "m", "w1b", replaces="w1"),
                                        sched.begin_load(rig.listener, "m", "w2b", replaces="w2"))
            assert [d.action for d in late] == ["woken", "woken"]
            load = (await rig.model_keys("m"))["load"]
            assert (load["state"], load["ended"]) == ("unloaded", "worker_lost") and "loader" not in load
            after = await asyncio.gather(*(sched.begin_load(rig.listener, "m", f"n{i}") for i in range(4)))
            assert sorted(d.action for d in after) == ["load", "wait", "wait", "wait"]
    run(scenario())


def test_a_late_look_after_a_new_load_began_is_still_woken_and_leaves_that_claim_alone(redis_client):
    """R4.2: the load a waiter waited for ended and a new caller already claimed the next load before
    the waiter's late look: the look is ``woken`` (its own load did end) and changes nothing: the
    new claim keeps its loader, and the late waiter is not registered on it."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys) as rig:
            sched = rig.scheduler
            await rig.lost_load("m", "first", ["w1"])
            assert (await sched.begin_load(rig.listener, "m", "second")).action == "load"
            before = await rig.model_keys("m")
            assert (await sched.begin_load(rig.listener, "m", "w2", replaces="w1")).action == "woken"
            assert await rig.model_keys("m") == before
            assert before["load"]["loader"] == "second" and before["loadwait"] == {}
    run(scenario())


@pytest.mark.parametrize("state", ["no hash", "loading", "ready", "backoff"])
def test_a_replaces_token_that_was_never_registered_reads_woken_and_changes_nothing(redis_client, state):
    """Edge: ``woken`` says only "that ``:loadwait`` entry is gone", whatever the state: a token that
    never waited (here, in every state) gets it too, and nothing is decided or registered. Safe
    because the only caller (``load_single_flight``) passes the token of its own last unwoken wait
    and, on ``woken``, reads the hash and decides again with ``replaces=''``."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys) as rig:
            sched = rig.scheduler
            await rig.redis.set(keys.worker_live("w1"), "boot1", px=30000)
            if state != "no hash":
                assert (await sched.begin_load(rig.listener, "m", "loader")).action == "load"
            if state == "ready":
                assert await sched.finish_load("m", "loader", LoadEnd.READY, owner="w1", boot="boot1") == "ok"
            if state == "backoff":
                assert await sched.finish_load("m", "loader", LoadEnd.FAILED, error="boom") == "ok"
            before = await rig.model_keys("m")
            assert (await sched.begin_load(rig.listener, "m", "t", replaces="never-waited")).action == "woken"
            assert await rig.model_keys("m") == before
    run(scenario())


def test_a_wait_dropped_by_unregister_reads_woken_and_resurrects_no_key(redis_client):
    """Edge: ``unregister.lua`` deletes ``:loadwait`` without waking anyone, so the waiter's next look
    is answered ``woken`` although nobody woke it (the script's comment says the load "ended (or
    finished)"; here it was deleted). The answer recreates no key of the unregistered model; the
    caller's next decision is what it was before the change (``load``: ``begin_load`` does not
    look at the registry)."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys) as rig:
            sched = rig.scheduler
            assert (await sched.begin_load(rig.listener, "m", "loader")).action == "load"
            assert (await sched.begin_load(rig.listener, "m", "w1")).action == "wait"
            manager = await within(sched.acquire(rig.listener, "m", 1000, LeaseKind.MANAGER), 10)
            await sched.unregister("m", manager.lease_id)  # raises LeaseNotHeld if not held
            assert (await sched.begin_load(rig.listener, "m", "w2", replaces="w1")).action == "woken"
            assert await rig.model_keys("m") == {"load": {}, "loadwait": {}}
            assert (await sched.begin_load(rig.listener, "m", "w3")).action == "load"
            await sched.release("m", manager.lease_id)
    run(scenario())


def test_a_waiter_whose_entry_survived_a_takeover_waits_for_the_new_claim(redis_client):
    """R4.2: a claim that no worker started and that lapsed is taken over by the next caller; the
    waiters registered on it stay registered (a takeover wakes nobody), so their next look is a
    plain ``wait`` on the new claim, not ``woken``, and the new claim's end wakes them."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys, ttl_ms=300) as rig:
            sched = rig.scheduler
            assert (await sched.begin_load(rig.listener, "m", "silent")).action == "load"
            assert (await sched.begin_load(rig.listener, "m", "w1")).action == "wait"
            await asyncio.sleep(0.35)
            assert (await sched.begin_load(rig.listener, "m", "taker")).action == "load"
            woken = rig.listener.expect("load:w2")
            assert (await sched.begin_load(rig.listener, "m", "w2", replaces="w1")).action == "wait"
            assert await sched.finish_load("m", "taker", LoadEnd.FAILED, error="boom") == "ok"
            await within(woken, 2)
            assert await sched.finish_load("m", "silent", LoadEnd.READY, owner="w", boot="b") == "stale"
    run(scenario())


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_seeded_random_looks_and_ends_answer_woken_exactly_when_the_waited_load_ended(redis_client, seed):
    """R4.2/R7.4, as a model check: five callers look again (``replaces`` = their last unwoken wait,
    as ``load_single_flight`` passes it) while loads are claimed, started by a worker, finished in
    every way, and their workers die (during a load, or under a ready pool). After every step: a
    look is ``woken`` exactly when the load its previous wait was registered on has ended since; at
    most one claim exists; ``:loadwait`` holds exactly the waits not yet ended; a waiter never
    becomes the loader of the load it waits for."""
    rng = random.Random(seed)

    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys, ttl_ms=60000) as rig:
            sched = rig.scheduler
            waits: dict[str, str] = {}  # caller -> token of its wait not yet read back
            ended: dict[str, bool] = {}  # caller -> the load of that wait has ended since
            loader: str | None = None  # the claim's token
            started_by: str | None = None  # the worker running it
            n, seen = 0, set()
            for step in range(500):
                n += 1
                move = rng.random()
                if move < 0.55:  # a caller looks (again)
                    caller = f"c{rng.randrange(5)}"
                    token = f"{caller}-{n}"
                    previous = waits.pop(caller, "")
                    decision = await sched.begin_load(rig.listener, "m", token, replaces=previous)
                    action = str(decision.action)
                    seen.add(action)
                    was_ended = ended.pop(caller, False)
                    assert (action == "woken") == bool(previous and was_ended), (step, caller, action, was_ended)
                    if action == "wait":
                        waits[caller], ended[caller] = token, False
                    elif action == "load":
                        assert loader is None, (step, "two claims", loader, token)
                        loader, started_by = token, None
                    elif action == "lost":
                        assert started_by is not None
                        for other in waits:
                            ended[other] = True
                        loader = started_by = None
                elif move < 0.7 and loader is not None and started_by is None:  # a worker starts it
                    started_by = f"w{n}"
                    await rig.redis.set(keys.worker_live(started_by), "boot", px=60000)
                    assert await sched.renew_load("m", loader, started_by, "boot") == 1
                elif move < 0.8 and started_by is not None:  # that worker dies
                    await rig.redis.delete(keys.worker_live(started_by))
                elif move < 0.88 and loader is not None:  # the claim ends, in any way
                    outcome = rng.choice([LoadEnd.READY, LoadEnd.WORKER_LOST, LoadEnd.NO_WORKER, LoadEnd.FAILED])
                    owner = started_by or "w-ready"
                    await rig.redis.set(keys.worker_live(owner), "boot", px=60000)
                    if outcome is LoadEnd.READY and rng.random() < 0.3:
                        await rig.redis.delete(keys.worker_live(owner))  # a pool whose worker then dies
                    got = await sched.finish_load("m", loader, outcome, owner, "boot", error="x", capacity=1)
                    assert str(got) == "ok", (step, outcome)
                    for other in waits:
                        ended[other] = True
                    loader = started_by = None
                    if outcome is LoadEnd.FAILED:
                        await rig.redis.hdel(keys.load("m"), "retry_at_ms")  # skip the backoff's wait
                elif loader is None:  # the worker of a ready pool dies (the next look loads again)
                    owner = await rig.redis.hget(keys.load("m"), "owner")
                    if owner:
                        await rig.redis.delete(keys.worker_live(owner))
                state = await rig.model_keys("m")
                expected_waits = {t for c, t in waits.items() if not ended[c]}
                assert set(state["loadwait"]) == expected_waits, (step, state["loadwait"], expected_waits)
                assert state["load"].get("loader") == loader, (step, state["load"], loader)
                if loader is not None:
                    assert loader not in expected_waits
            assert {"woken", "wait", "load", "lost", "ready"} <= seen, seen  # every answer was exercised
    run(scenario())


# -- load_single_flight on a real AsyncContext ---------------------------------------------------------


async def _take_the_next_claim(ctx, model_id: str, host: str, boot: str, previous: str | None = None) -> str:
    """As worker ``host``'s load task: wait for a claim (other than ``previous``) and start it."""
    while True:
        token = await ctx.redis.hget(KEYS.load(model_id), "loader")
        if token and token != previous:
            assert await ctx.scheduler.renew_load(model_id, token, host, boot) == 1
            return token
        await asyncio.sleep(0.01)


async def _finish_ready(ctx, model_id: str, token: str, host: str, boot: str) -> None:
    """As the worker's load task ends well: publish the pool, then the reply for its caller."""
    assert str(await ctx.scheduler.finish_load(model_id, token, LoadEnd.READY, host, boot, capacity=1)) == "ok"
    await ctx.redis.set(KEYS.load_result(token), json.dumps({"ok": True, "owner": host, "boot": boot}), px=60000)


LOST_ERROR = "worker gpu0@dying was lost while loading the model"


async def _deaf_waiter_of_a_started_load(host: str, boot: str, pickup_timeout_s: float, loader: str = "loader"):
    """A load claimed (``loader``) and started by worker ``host``, and a caller with a deaf listener
    waiting for it (0.3 s in, registered): returns ``(ctx, its load_single_flight task)``."""
    ctx, deaf = await load_contexts(1500)
    await claim_started_by(ctx, "m", loader, host, boot)
    waiter = asyncio.create_task(load_single_flight(deaf, "m", pickup_timeout_s=pickup_timeout_s))
    await asyncio.sleep(0.3)
    return ctx, waiter


async def _slow_ready_load(ctx, token: str, host: str, boot: str) -> None:
    """Worker ``host``'s load of claim ``token`` of ``m``: renewed and beating, ready after 4 s."""
    for _ in range(8):
        await asyncio.sleep(0.5)
        assert await ctx.scheduler.renew_load("m", token, host, boot) == 1
    await _finish_ready(ctx, "m", token, host, boot)


def test_a_waiter_that_missed_the_wake_up_of_a_lost_load_reports_worker_lost_at_its_look(redis_client):
    """R7.4: the load a caller waits for is ended ``worker_lost`` (as ``serve`` ends the load of a worker
    it saw die) and the caller's wake-up is lost: at its timed look it answers 503 ``worker_lost``; it
    sends no load task and does not become the next loader (before the change it did, and then
    answered ``no_worker`` or waited on its own reload)."""
    boot = live_worker(redis_client, "gpu0@dying")

    async def scenario():
        started = time.monotonic()
        ctx, waiter = await _deaf_waiter_of_a_started_load("gpu0@dying", boot, 1.0)
        assert str(await ctx.scheduler.finish_load("m", "loader", LoadEnd.WORKER_LOST, error=LOST_ERROR)) == "ok"
        outcome = await outcome_of(waiter)
        elapsed = time.monotonic() - started
        load = await ctx.redis.hgetall(KEYS.load("m"))
        await ctx.listener.close()
        return outcome, elapsed, load
    outcome, elapsed, load = run(scenario())
    assert isinstance(outcome, ServerBusy) and outcome.code == "worker_lost", outcome
    assert 1.3 <= elapsed < 3, elapsed  # its timed look (the claim's 1.5 s), not a wake-up
    assert (load["state"], load["ended"]) == ("unloaded", "worker_lost") and "loader" not in load
    assert redis_client.llen("gpu") == 0  # it sent no load task


def test_a_waiter_that_missed_the_wake_up_of_a_ready_load_gets_that_pool(redis_client):
    """R4.2: the load finished READY and the waiter's wake-up was lost: its late look (``woken``), the
    hash read and the next decision give it the pool on its owner (``load_ms`` 0: not loaded here),
    with no load task sent."""
    boot = live_worker(redis_client, "gpu0@ok")

    async def scenario():
        ctx, waiter = await _deaf_waiter_of_a_started_load("gpu0@ok", boot, 1.0)
        await _finish_ready(ctx, "m", "loader", "gpu0@ok", boot)
        placement = await within(waiter, 10)
        await ctx.listener.close()
        return placement
    placement = run(scenario())
    assert placement == Placement("gpu0@ok", boot, 0.0)
    assert redis_client.llen("gpu") == 0


def test_a_waiter_that_missed_the_wake_up_of_a_failed_load_reports_that_failure(redis_client):
    """R4.2: a failed load releases everyone: a waiter whose wake-up was lost reports ``load_failed``
    at its late look, sends no load task and starts no load."""
    boot = live_worker(redis_client, "gpu0@ok")

    async def scenario():
        ctx, waiter = await _deaf_waiter_of_a_started_load("gpu0@ok", boot, 1.0)
        assert str(await ctx.scheduler.finish_load("m", "loader", LoadEnd.FAILED, "gpu0@ok", boot,
                                                   error="OSError: no such file")) == "ok"
        outcome = await outcome_of(waiter)
        load = await ctx.redis.hgetall(KEYS.load("m"))
        await ctx.listener.close()
        return outcome, load
    outcome, load = run(scenario())
    assert isinstance(outcome, ModelLoadFailed) and outcome.code == "load_failed", outcome
    assert "no such file" in outcome.message
    assert (load["state"], load["ended"]) == ("unloaded", "failed") and "loader" not in load
    assert redis_client.llen("gpu") == 0


def test_a_woken_waiter_whose_pool_died_meanwhile_loads_once_and_does_not_loop(redis_client):
    """R7.4, no livelock: the load finished READY, then its worker died before the waiter's late look
    (wake-up lost). ``woken`` → the hash reads ``ready`` → the next call finds the owner dead, marks it
    unloaded and makes this caller the loader; a live worker serves that one load and the caller gets
    its pool. One task sent, the caller's time bounded."""
    boot = live_worker(redis_client, "gpu0@short")
    survivor_boot = live_worker(redis_client, "gpu1@survivor")

    async def scenario():
        started = time.monotonic()
        ctx, waiter = await _deaf_waiter_of_a_started_load("gpu0@short", boot, 5.0)
        await _finish_ready(ctx, "m", "loader", "gpu0@short", boot)
        await ctx.redis.delete(KEYS.worker_live("gpu0@short"))  # and it dies at once
        token = await within(_take_the_next_claim(ctx, "m", "gpu1@survivor", survivor_boot, previous="loader"), 10)
        await _finish_ready(ctx, "m", token, "gpu1@survivor", survivor_boot)
        placement = await within(waiter, 10)
        elapsed = time.monotonic() - started
        await ctx.listener.close()
        return placement, elapsed
    placement, elapsed = run(scenario())
    assert (placement.owner, placement.boot) == ("gpu1@survivor", survivor_boot) and placement.load_ms > 0
    assert elapsed < 5, elapsed
    assert redis_client.llen("gpu") == 1  # its one load task


@pytest.mark.parametrize("round_", range(3))
def test_loader_and_waiters_looking_at_the_same_liveness_expiry_all_answer_worker_lost(redis_client, round_):
    """R7.4 (the scale test's race, at the runtime level): a worker starts a load, beats once more
    (liveness key, 1 s), and dies. The loader and six waiters (three of them deaf: their wake-up is
    lost) all look again just after that expiry, so their looks and the end of the load interleave.
    Every one answers 503 ``worker_lost`` within about the liveness TTL, exactly one of them ends
    the load (``on_load_lost`` once), and no second load task is sent."""
    live_worker(redis_client, "gpu1@idle")  # a live worker that takes no task: census says "alive"

    async def scenario():
        ctx, deaf = await load_contexts(30000)  # the claim outlives the test: the liveness key decides
        ended_by: list[str] = []

        async def lost(host: str, error: str) -> None:
            ended_by.append(host)

        loader = asyncio.create_task(load_single_flight(ctx, "m", pickup_timeout_s=5.0, on_load_lost=lost))
        token = await within(_take_the_next_claim(ctx, "m", "gpu0@doomed", "boot-doomed"), 5)
        # Its last beat: the key lapses in 1 s and is never renewed.
        await ctx.redis.set(KEYS.worker_live("gpu0@doomed"), "boot-doomed", px=1000)
        beat_at = time.monotonic()
        await ctx.redis.hset(KEYS.worker_pid, "gpu0@doomed", os.getpid())
        waiters = []
        for i in range(6):
            waiters.append(asyncio.create_task(
                load_single_flight(deaf if i % 2 else ctx, "m", pickup_timeout_s=5.0, on_load_lost=lost)))
            await asyncio.sleep(0.02 * (round_ + 1))
        outcomes = await within(asyncio.gather(loader, *waiters, return_exceptions=True), 15)
        elapsed = time.monotonic() - beat_at
        load = await ctx.redis.hgetall(KEYS.load("m"))
        await ctx.listener.close()
        return token, outcomes, elapsed, ended_by, load
    token, outcomes, elapsed, ended_by, load = run(scenario())
    codes = [getattr(o, "code", repr(o)) for o in outcomes]
    assert codes == ["worker_lost"] * 7, codes
    assert ended_by == ["gpu0@doomed"], ended_by
    assert elapsed < 3, elapsed  # the 1 s key plus looks just past it (well under two check periods)
    assert (load["state"], load["ended"]) == ("unloaded", "worker_lost") and "loader" not in load
    assert redis_client.llen("gpu") == 1  # only the first load's task


def test_a_waiter_of_a_lost_load_reports_worker_lost_though_a_new_load_began_before_its_look(redis_client):
    """R7.4 ("a worker dead during a load frees it within the liveness TTL, every waiter 503
    ``worker_lost``"): a load waiter whose timed look falls after the loader ended the load, and
    after the next caller claimed the next load, reports the end of *its* load.

    The load a caller waits for is ended ``worker_lost``; its wake-up is lost; before its timed look a
    new request claims the next load, which the surviving worker starts and which takes a while (a
    big model, or the scale test's load barrier). The late look is ``woken`` with the end kept for
    its token (``worker_lost``). Before the fix the caller read the *current* ``:load`` hash
    (``loading``: the new claim had deleted ``ended``), found no error, registered as a waiter of
    the new load and answered what that one gave, seconds later (here its pool after 4 s).
    """
    dying_boot = live_worker(redis_client, "gpu0@dying")
    survivor_boot = live_worker(redis_client, "gpu1@survivor")

    async def scenario():
        ctx, waiter = await _deaf_waiter_of_a_started_load("gpu0@dying", dying_boot, 5.0, loader="first")
        assert str(await ctx.scheduler.finish_load("m", "first", LoadEnd.WORKER_LOST, error=LOST_ERROR)) == "ok"
        ended_at = time.monotonic()
        newcomer = asyncio.create_task(load_single_flight(ctx, "m", pickup_timeout_s=5.0))
        token = await within(_take_the_next_claim(ctx, "m", "gpu1@survivor", survivor_boot, previous="first"), 5)

        loading = asyncio.create_task(_slow_ready_load(ctx, token, "gpu1@survivor", survivor_boot))
        outcome = await outcome_of(waiter, 15)
        answered_s = time.monotonic() - ended_at
        await within(asyncio.gather(loading, newcomer), 15)
        await ctx.listener.close()
        return outcome, answered_s
    outcome, answered_s = run(scenario())
    assert isinstance(outcome, ServerBusy) and outcome.code == "worker_lost", \
        f"the waiter of the lost load answered {outcome!r} {answered_s:.1f} s after that load ended"
    assert answered_s < 2.5, answered_s  # at its timed look (the 1.5 s claim), not after the next load


def test_a_woken_waiter_of_a_lost_load_reports_worker_lost_though_the_next_claim_precedes_its_read(redis_client):
    """R7.4 ("every waiter 503 ``worker_lost``"), on the wake-up path: the waiter *hears* its wake-up
    only after the next claim reached Redis (another web process's request arriving as the load is
    ended; here this test's event loop is busy with the end and the claim, so the listener reads
    the wake-up after both). The wake-up carries ``worker_lost``, which the waiter answers at
    once. Before the fix it read the ``:load`` hash (``loading``), waited for the next load and
    answered what that one gave: not the ``worker_lost`` of the load it waited for, and not
    within the liveness TTL."""
    dying_boot = live_worker(redis_client, "gpu0@dying")
    survivor_boot = live_worker(redis_client, "gpu1@survivor")
    blocking = Scheduler(redis_client, KEYS, 1500)  # synchronous: the event loop runs nothing meanwhile

    async def scenario():
        ctx, _ = await load_contexts(1500)
        await claim_started_by(ctx, "m", "first", "gpu0@dying", dying_boot)
        waiter = asyncio.create_task(load_single_flight(ctx, "m", pickup_timeout_s=5.0))
        await asyncio.sleep(0.3)
        assert redis_client.hlen(KEYS.model("m") + ":loadwait") == 1  # it waits, registered
        assert str(blocking.finish_load("m", "first", LoadEnd.WORKER_LOST, error=LOST_ERROR)) == "ok"
        ended_at = time.monotonic()
        assert (await ctx.scheduler.begin_load(ctx.listener, "m", "second")).action == "load"
        assert await ctx.scheduler.renew_load("m", "second", "gpu1@survivor", survivor_boot) == 1

        loading = asyncio.create_task(_slow_ready_load(ctx, "second", "gpu1@survivor", survivor_boot))
        outcome = await outcome_of(waiter, 15)
        answered_s = time.monotonic() - ended_at
        await within(loading, 15)
        await ctx.listener.close()
        return outcome, answered_s
    outcome, answered_s = run(scenario())
    assert isinstance(outcome, ServerBusy) and outcome.code == "worker_lost", \
        f"the waiter of the lost load answered {outcome!r} {answered_s:.1f} s after that load ended"
