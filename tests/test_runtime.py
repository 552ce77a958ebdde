"""The legacy runtime's web side against real Redis, with no worker running."""
from __future__ import annotations

import asyncio
import dataclasses
import json
import logging
import os
import time

import numpy as np
import pytest
import redis

from audiosite.errors import ServerBusy
from audiosite.serverconfig import get_config, install_config
from inference.runtime.context import KEYS, async_context
from inference.runtime.published import legacy_slots_ignored
from inference import audio
from inference.runtime.loads import load_single_flight
from inference.runtime.loads import Placement
from inference.runtime.runs import INPUT_TTL_MS, Handover, RunInput, inline_element, run_on_worker, split_element
from inference.scheduler import LoadEnd, Scheduler
from inference.worker.runs import POP_TIMEOUT_S, RunDispatcher
from inference.worker.state import CapacityExceeded, WorkerState
from inference.worker.work import INLINE_REPLY_TTL_MS, destroy_pool, reply

from .support.bounds import run, within

pytestmark = pytest.mark.skipif(not os.environ.get("REDIS_URL", "").endswith("/15"),
                                reason="needs REDIS_URL on database 15 (scripts/test.sh sets it)")


def _live_worker(redis_client, hostname: str, ttl_ms: int = 30000) -> None:
    """Register ``hostname`` as a live worker exactly as its liveness beat does (and nothing more: it
    consumes no queue)."""
    redis_client.set(KEYS.worker_live(hostname), "boot-" + hostname, px=ttl_ms)
    redis_client.hset(KEYS.worker_pid, hostname, os.getpid())


def test_load_that_no_live_worker_starts_fails_with_503_and_is_abandoned(redis_client):
    """R7.4: no request waits forever for a worker: a live worker that never takes the load task
    costs the pickup timeout, then 503 ``no_worker``; the abandoned claim leaves the model unloaded."""
    _live_worker(redis_client, "gpu0@deaf")

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
    A second caller, waiting on that load rather than loading, gets the same 503 ``worker_lost``
    (not ``load_failed``: CONTRACT R7.4 "every waiter gets 503 worker_lost").

    The dead worker is played by this test: it starts the load exactly as the worker's task does
    (``renew_load`` with its hostname and boot) and then renews no more. Its liveness key stays (a
    frozen worker), so the claim's expiry is what ends the load; a worker killed for real is
    ``tests/test_scale.py::test_a_worker_killed_during_a_load_frees_the_model_within_the_liveness_ttl``.
    """
    async def scenario():
        base = await async_context()
        ctx = dataclasses.replace(base, scheduler=Scheduler(base.redis, KEYS, 1000))  # 1 s claims

        _live_worker(redis_client, "gpu0@dead", ttl_ms=1000)  # it beats no more after this

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
            loader = asyncio.create_task(load_single_flight(ctx, "doomed", pickup_timeout_s=1.0))
            await asyncio.sleep(0.2)  # the second caller comes while the first one's load runs
            waiter = asyncio.create_task(load_single_flight(ctx, "doomed", pickup_timeout_s=1.0))
            waited = (await within(asyncio.gather(waiter, return_exceptions=True), 15))[0]
            await within(loader, 15)
        elapsed = time.monotonic() - started
        await within(dying, 1)
        status = (await ctx.scheduler.snapshot(["doomed"]))["doomed"]
        await base.listener.close()
        return info.value, waited, elapsed, status
    error, waited, elapsed, status = run(scenario())
    assert error.code == "worker_lost" and "gpu0@dead was lost" in error.message
    assert isinstance(waited, ServerBusy) and waited.code == "worker_lost"
    assert 1.0 <= elapsed < 4  # the claim's TTL (1 s) plus at most one check (1 s: the pickup timeout)
    assert status["state"] == "unloaded" and status["error"] == "worker gpu0@dead was lost while loading the model"


def test_with_no_worker_alive_or_starting_a_load_fails_no_worker_at_once(redis_client):
    """R7.4: with no live worker and none being started, a cold load is refused with 503
    ``no_worker`` at once (it sends no task and does not wait the pickup timeout); a worker whose
    registry entry outlived its liveness key counts as dead; the claim is given back without a
    failed-load backoff, so a later load is tried as soon as a worker runs."""
    redis_client.hset(KEYS.worker_pid, "gpu0@gone", 12345)  # its liveness key expired long ago

    async def scenario():
        ctx = await async_context()
        census = await ctx.scheduler.census()
        started = time.monotonic()
        with pytest.raises(ServerBusy) as info:
            await within(load_single_flight(ctx, "nobody", pickup_timeout_s=5.0), 10)
        elapsed = time.monotonic() - started
        status = (await ctx.scheduler.snapshot(["nobody"]))["nobody"]
        await ctx.listener.close()
        return census, info.value, elapsed, status
    census, error, elapsed, status = run(scenario())
    assert census.live_workers == 0 and not census.worker_starting
    assert error.code == "no_worker" and "no GPU worker is alive" in error.message
    assert elapsed < 1.5  # one census, then one more after the grace second (a stopping worker's gap)
    assert status["state"] == "unloaded" and status["retry_in_ms"] == 0
    assert redis_client.llen("gpu") == 0  # nothing was sent


def test_a_load_waits_for_a_worker_being_started_and_no_longer(redis_client):
    """R7.4: while a supervisor announces a worker start (``Keys.worker_starting``) and no
    worker is alive, the load task waits for it, past the pickup timeout (1 s here); once the
    announcement lapses (3 s) with still no worker, the load fails ``no_worker`` within a check
    period (1 s)."""
    redis_client.set(KEYS.worker_starting, "test", px=3000)

    async def scenario():
        ctx = await async_context()
        census = await ctx.scheduler.census()
        started = time.monotonic()
        with pytest.raises(ServerBusy) as info:
            await within(load_single_flight(ctx, "patient", pickup_timeout_s=1.0), 10)
        elapsed = time.monotonic() - started
        await ctx.listener.close()
        return census, info.value, elapsed
    census, error, elapsed = run(scenario())
    assert census.live_workers == 0 and census.worker_starting
    assert error.code == "no_worker" and "none is being started" in error.message
    assert 2.9 <= elapsed < 4.5
    assert redis_client.llen("gpu") == 1  # the task waited in the queue for the announced worker


def test_a_load_announced_to_a_starting_worker_is_taken_by_it(redis_client):
    """R7.4: the other half of the grace: a worker that comes up while the load waits (here
    this test plays it: it beats, then takes the claim and reports the pool ready) serves the load,
    although it arrived after the pickup timeout had passed."""
    redis_client.set(KEYS.worker_starting, "test", px=5000)

    async def scenario():
        ctx = await async_context()

        async def worker_that_boots() -> None:
            await asyncio.sleep(1.5)  # longer than the 1 s pickup timeout
            _live_worker(redis_client, "gpu0@late")
            while not (token := await ctx.redis.hget(KEYS.load("late"), "loader")):
                await asyncio.sleep(0.01)
            assert await ctx.scheduler.renew_load("late", token, "gpu0@late", "boot-gpu0@late") == 1
            assert str(await ctx.scheduler.finish_load("late", token, LoadEnd.READY, "gpu0@late", "boot-gpu0@late",
                                                       capacity=1)) == "ok"
            await ctx.redis.set(KEYS.load_result(token), json.dumps({"ok": True}))

        booting = asyncio.create_task(worker_that_boots())
        placement = await within(load_single_flight(ctx, "late", pickup_timeout_s=1.0), 10)
        await within(booting, 1)
        await ctx.listener.close()
        return placement
    placement = run(scenario())
    assert (placement.owner, placement.boot) == ("gpu0@late", "boot-gpu0@late")


def _run_header(request_id: str, channel: str, boot: str, model_id: str = "absent") -> bytes:
    return json.dumps({"model_id": model_id, "request_id": request_id, "lease_id": "L" + request_id,
                       "boot": boot, "channel": channel, "sample_rate_hz": 16000, "options": {}}).encode()


def test_a_run_queue_element_carries_its_header_and_optionally_its_samples():
    header = {"model_id": "m", "request_id": "r", "options": {"prompt": "two\nlines"}}
    samples = np.linspace(-1, 1, 64, dtype="<f4")
    parsed, inline = split_element(inline_element(header, audio.to_bytes(samples)))
    assert parsed == {**header, "input": "inline"} and inline is not None
    assert np.array_equal(audio.from_bytes(inline), samples)
    assert split_element(json.dumps(header).encode()) == (header, None)


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
    for request_id in ("r1", "r2"):
        redis_client.lpush(queue_key, _run_header(request_id, "test-channel", worker.boot))
    # A run whose samples came inside its queue element: they are left in its input key for the
    # sender's next dispatch, which sends the header alone (runs.stage_run).
    samples = np.arange(-8, 8, dtype="<i2")
    redis_client.lpush(queue_key, inline_element(json.loads(_run_header("r3", "test-channel", worker.boot)),
                                                 audio.to_bytes(samples)))
    assert dispatcher.stop() == 3
    raw = redis.Redis(connection_pool=redis.ConnectionPool(**{**redis_client.connection_pool.connection_kwargs,
                                                              "decode_responses": False}))
    assert raw.get(KEYS.input("r3")) == samples.tobytes() and raw.get(KEYS.input("r1")) is None
    raw.close()
    assert 0 < redis_client.pttl(KEYS.input("r3")) <= INPUT_TTL_MS
    assert redis_client.llen(queue_key) == 0
    wakes = [pubsub.get_message(timeout=2)["data"].partition("\n") for _ in range(3)]
    assert [key for key, _, _ in wakes] == ["done:r1", "done:r2", "done:r3"]  # FIFO: first pushed, first answered
    for (_, _, inline), request_id in zip(wakes, ("r1", "r2", "r3"), strict=True):
        # The short reply rides in the wake-up, and its key keeps a copy for a waiter that missed it.
        stored = redis_client.get(KEYS.result(request_id))
        assert json.loads(inline) == json.loads(stored)
        assert json.loads(stored)["ok"] is False and json.loads(stored)["kind"] == "not_loaded"
        assert 0 < redis_client.pttl(KEYS.result(request_id)) <= INLINE_REPLY_TTL_MS
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
        assert dispatcher.stop() == 0
    assert json.loads(redis_client.get(KEYS.result("fresh")))["kind"] == "not_loaded"
    assert redis_client.get(KEYS.result("stale")) is None and redis_client.llen(stale_key) == 1


def test_an_idle_dispatcher_keeps_its_blocking_pop_quietly_and_stops_at_once(redis_client, caplog):
    """While idle, the popping thread asks again every ``POP_TIMEOUT_S`` on the same connection, with no
    error (its client's socket timeout outlasts the ``BLMOVE``: redis-py's default 5 s cut a 5 s pop
    as a failure, logged a traceback and slept 0.5 s before the next pop, delaying a run that came
    then); ``stop`` wakes it with its wake element, so a warm shutdown never waits for the timeout,
    and leaves neither the queue nor the taken list behind."""
    worker = WorkerState()
    worker.hostname = "gpu0@idle"
    dispatcher = RunDispatcher(worker, threads=2)
    db = str(redis_client.connection_pool.connection_kwargs.get("db", 0))

    def popping() -> set[str]:
        return {c["id"] for c in redis_client.client_list() if c["cmd"] == "blmove" and c["db"] == db}

    with caplog.at_level(logging.INFO, logger="inference.worker.runs"):
        dispatcher.start()
        deadline = time.monotonic() + 5
        while not (first := popping()):  # its BLMOVE blocks now
            assert time.monotonic() < deadline, "the dispatcher never blocked on its queue"
            time.sleep(0.02)
        time.sleep(POP_TIMEOUT_S * 1.6)  # at least one more pop, past the first one's timeout
        assert popping() == first, "the reader reconnected: its BLMOVE failed"
        started = time.monotonic()
        assert dispatcher.stop() == 0
        assert time.monotonic() - started < POP_TIMEOUT_S / 2, "stop waited for the BLMOVE's timeout"
    assert redis_client.exists(KEYS.run_queue(worker.hostname, worker.boot),
                               KEYS.run_taken(worker.hostname, worker.boot)) == 0
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []


def _served_within(redis_client, request_id: str, limit_s: float) -> float:
    started = time.monotonic()
    while redis_client.get(KEYS.result(request_id)) is None:
        assert time.monotonic() - started < limit_s, f"run {request_id} was not served within {limit_s} s"
        time.sleep(0.02)
    return time.monotonic() - started


@pytest.mark.parametrize("broken", [False, True], ids=["idle-sweep", "pop-connection-killed"])
def test_a_taken_run_that_no_thread_serves_is_served_within_the_liveness_ttl(redis_client, broken):
    """R7.4 (reliable pop): an element the pop moved onto the worker's taken list while no run thread
    got it (the pop's reply was lost with its connection) is served by the dispatcher's sweep well
    inside the liveness TTL, after which its sender would otherwise wait in vain (the worker still
    beats). ``pop-connection-killed``: the popping connection is killed (CLIENT KILL) with the element
    stranded, as when a connection breaks at the pop; the failed pop sweeps at once. Nothing stays in
    the queue or the taken list."""
    from inference.scheduler.keys import LIVENESS_TTL_MS
    from inference.worker.runs import POP_RETRY_S, SWEEP_EVERY_S
    worker = WorkerState()
    worker.hostname = "gpu0@stranded-" + ("killed" if broken else "idle")
    taken_key = KEYS.run_taken(worker.hostname, worker.boot)
    dispatcher = RunDispatcher(worker, threads=2)
    db = str(redis_client.connection_pool.connection_kwargs.get("db", 0))
    dispatcher.start()
    try:
        deadline = time.monotonic() + 5
        while not (popping := [c["id"] for c in redis_client.client_list() if c["cmd"] == "blmove" and c["db"] == db]):
            assert time.monotonic() < deadline, "the dispatcher never blocked on its queue"
            time.sleep(0.02)
        redis_client.lpush(taken_key, _run_header("stranded", "test-channel", worker.boot))
        if broken:
            assert redis_client.execute_command("CLIENT", "KILL", "ID", popping[0]) == 1
        waited_s = _served_within(redis_client, "stranded", LIVENESS_TTL_MS / 1000)
        limit_s = POP_RETRY_S + 1.0 if broken else SWEEP_EVERY_S + POP_TIMEOUT_S + 1.0
        assert waited_s < limit_s, waited_s
        redis_client.lpush(KEYS.run_queue(worker.hostname, worker.boot),
                           _run_header("next", "test-channel", worker.boot))
        _served_within(redis_client, "next", 5)  # the reader pops again afterwards
        deadline = time.monotonic() + 2
        while redis_client.llen(taken_key):
            assert time.monotonic() < deadline, redis_client.lrange(taken_key, 0, -1)
            time.sleep(0.02)
    finally:
        assert dispatcher.stop() == 0
    assert json.loads(redis_client.get(KEYS.result("stranded")))["kind"] == "not_loaded"
    assert redis_client.exists(taken_key, KEYS.run_queue(worker.hostname, worker.boot)) == 0


def test_a_stopping_worker_answers_a_stranded_taken_run_not_loaded(redis_client):
    """Warm shutdown with an element left on the taken list by a pop whose reply was lost: the drain
    answers it ``not_loaded`` like a queued run (its sender keeps the lease and loads again)."""
    worker = WorkerState()
    worker.hostname = "gpu0@stopping-stranded"
    dispatcher = RunDispatcher(worker, threads=2)  # never started
    redis_client.lpush(KEYS.run_taken(worker.hostname, worker.boot), _run_header("lost", "test-channel", worker.boot))
    assert dispatcher.stop() == 1
    assert json.loads(redis_client.get(KEYS.result("lost")))["kind"] == "not_loaded"
    assert redis_client.exists(KEYS.run_taken(worker.hostname, worker.boot),
                               KEYS.run_queue(worker.hostname, worker.boot)) == 0


def _peak_rss_mb() -> float:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("VmHWM")) / 1000


def test_the_sync_client_sends_large_samples_without_copying_them(redis_client):
    """R8.4 (memory of decoded audio): the process-wide synchronous clients (the web's input sends in
    a thread, the worker's writes) send a large memoryview as it is. redis-py's default packer with
    hiredis installed copies every argument into one buffer: 64 MB of samples held about 4x that
    at the peak of the send (seen: ``bench_decode_memory`` grew 291 MB against its 150 MB limit)."""
    from inference.runtime.context import sync_redis_bytes
    client = sync_redis_bytes()
    client.ping()
    samples = np.ones(32 * 1024 * 1024, dtype=np.int16)  # 64 MiB, resident before the send
    data = audio.to_bytes(samples)
    with open("/proc/self/clear_refs", "w") as clear:  # reset VmHWM to the current RSS (Linux)
        clear.write("5")
    before = _peak_rss_mb()
    client.set(KEYS.input("copy-check"), data, px=INPUT_TTL_MS)
    grown = _peak_rss_mb() - before
    try:
        assert client.strlen(KEYS.input("copy-check")) == samples.nbytes
        assert grown < 16, f"peak RSS grew {grown:.1f} MB while sending {samples.nbytes / 1e6:.1f} MB"
    finally:
        client.delete(KEYS.input("copy-check"))


def test_the_legacy_runtime_builds_one_session_for_a_registration_that_kept_its_slots():
    """R1.1: on the legacy runtime a worker builds one session for a registration that kept the
    ``slots`` it was given under --parallel-jobs, as serve's start-up warning says (walkthrough
    finding: it built the registration's count and failed the load, CapacityExceeded, 503
    load_failed). On the parallel runtime the same registration is refused as before (R9.2)."""
    meta = {"id": "kept-slots", "family": "silero_vad", "task": "vad", "mode": "offline", "slots": 9}
    config = get_config()
    assert config.runtime == "legacy"
    worker = WorkerState()
    pool = worker.build("kept-slots", meta, json.dumps(meta))
    try:
        assert len(pool.sessions) == 1
    finally:
        destroy_pool(worker, "kept-slots")
    install_config(config.model_copy(update={"runtime": "parallel"}))
    try:
        with pytest.raises(CapacityExceeded):
            WorkerState().build("kept-slots", meta, json.dumps(meta))
    finally:
        install_config(config)


def test_a_legacy_start_names_the_registrations_whose_slots_it_does_not_run():
    """R1.1: a registration made through the API under --parallel-jobs keeps ``slots``; a later legacy
    ``serve`` runs it with one session and says so at start."""
    metas = {"vad2": {"id": "vad2", "slots": 4}, "vad": {"id": "vad", "slots": None}, "one": {"id": "one", "slots": 1}}
    warning = legacy_slots_ignored(metas, "legacy")
    assert warning is not None and warning.endswith(": vad2 (slots=4)"), warning
    assert legacy_slots_ignored(metas, "parallel") is None
    assert legacy_slots_ignored({"vad": {"slots": None}}, "legacy") is None


# -- a run whose client leaves (R8.2): the lease and the reply key ----------------------------------
async def _left_run(ctx, redis_client, worker: WorkerState, request_first: bool, answer) -> tuple[str, dict, bool]:
    """Hand a run to ``worker``'s queue through the web side (``run_on_worker``), then its client leaves
    and the worker answers (``answer(queue_key)``, blocking, the worker's own code), in either order:
    ``request_first`` = the client leaves before the answer, else after the answer was sent but before
    the web process read it (the loop is blocked while the worker answers). Returns the request id,
    the model's snapshot right after, and whether the web side's wait ended in a cancellation."""
    queue_key = KEYS.run_queue(worker.hostname, worker.boot)
    lease = await ctx.scheduler.acquire(ctx.listener, "m", 0)
    run_input = RunInput(np.zeros(1600, dtype="<f4"), 16000, {})
    handover = Handover()
    task = asyncio.create_task(run_on_worker(ctx, "m", lease.lease_id, Placement(worker.hostname, worker.boot, 0.0),
                                             run_input, handover))
    deadline = time.monotonic() + 5
    while redis_client.llen(queue_key) == 0:
        assert time.monotonic() < deadline, "the run never reached the worker's queue"
        await asyncio.sleep(0.01)
    if request_first:
        task.cancel()
        cancelled = await asyncio.gather(task, return_exceptions=True)
        await asyncio.to_thread(answer, queue_key)
    else:
        answer(queue_key)  # blocks the loop: the reply is in Redis, unread, when the client leaves
        task.cancel()
        cancelled = await asyncio.gather(task, return_exceptions=True)
    assert handover.sent  # the run was on the worker's queue: the web process no longer releases the lease itself
    return run_input.request_id, (await ctx.scheduler.snapshot(["m"]))["m"], isinstance(cancelled[0],
                                                                                       asyncio.CancelledError)


@pytest.mark.parametrize("request_first", [True, False], ids=["client-leaves-first", "worker-answers-first"])
def test_a_client_that_leaves_while_its_run_waits_on_a_stopping_worker_gives_its_lease_back_at_once(
        redis_client, request_first):
    """R8.2 with a warm shutdown: a run waits on a worker's queue, its client leaves, and the stopping
    worker answers it ``not_loaded`` (it never took the run, so the lease is still the sender's, and
    the sender is gone): in either order the lease is given back at once (not after lease_ttl_ms),
    and neither the reply, the input nor the stop marker stays in Redis."""
    worker = WorkerState()
    worker.hostname = "gpu0@stopping-" + ("late" if request_first else "early")
    redis_client.set(KEYS.worker_live(worker.hostname), worker.boot, px=30000)
    dispatcher = RunDispatcher(worker, threads=2)  # never started: the run stays queued until stop()
    refused = []

    async def scenario():
        ctx = await async_context()
        outcome = await _left_run(ctx, redis_client, worker, request_first,
                                  lambda _queue: refused.append(dispatcher.stop()))
        await ctx.listener.close()
        return outcome
    request_id, status, cancelled = run(scenario())
    assert refused == [1] and cancelled
    assert status["active_leases"] == 0 and status["queued"] == 0, status
    for key in (KEYS.result(request_id), KEYS.input(request_id), KEYS.stop(request_id)):
        assert redis_client.exists(key) == 0, key


@pytest.mark.parametrize("request_first", [True, False], ids=["client-leaves-first", "worker-answers-first"])
def test_the_reply_of_a_run_whose_client_left_is_not_kept(redis_client, request_first):
    """R8.2: a worker that took a run answers after its client left (or the client leaves after the
    answer was sent but before it was read): the lease is released with the answer, and no reply key
    (``as:out:<id>``) stays in Redis waiting for its TTL, nor the stop marker."""
    worker = WorkerState()
    worker.hostname = "gpu0@answering-" + ("late" if request_first else "early")
    redis_client.set(KEYS.worker_live(worker.hostname), worker.boot, px=30000)

    def answer(queue_key: str) -> None:  # the worker took the run and answers as serve_run does
        header, _samples = split_element(_raw_pop(redis_client, queue_key))
        reply(header["channel"], KEYS.result(header["request_id"]), f"done:{header['request_id']}",
              {"ok": True, "result": {"text": "x" * 9000}}, release=(header["model_id"], header["lease_id"]),
              inline=True)

    async def scenario():
        ctx = await async_context()
        outcome = await _left_run(ctx, redis_client, worker, request_first, answer)
        await ctx.listener.close()
        return outcome
    request_id, status, cancelled = run(scenario())
    assert cancelled
    assert status["active_leases"] == 0 and status["queued"] == 0, status
    for key in (KEYS.result(request_id), KEYS.stop(request_id)):
        assert redis_client.exists(key) == 0, key


def _raw_pop(redis_client, queue_key: str) -> bytes:
    """Pop one run queue element as bytes (a worker's run thread pops it so)."""
    raw = redis.Redis(connection_pool=redis.ConnectionPool(**{**redis_client.connection_pool.connection_kwargs,
                                                              "decode_responses": False}))
    try:
        return raw.rpop(queue_key)
    finally:
        raw.close()
