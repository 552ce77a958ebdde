"""How a load's end reaches its waiters, and serve's start-up loads.

1. R7.4 / R4.2: a load's end reaches each waiter in its wake-up (``load:<token>`` LF the outcome) and
   is kept per caller token in ``<base>:loadend:<token>`` (``lua/lib.lua`` ``wake_load_waiters``,
   ``begin_load``'s ``{'woken', outcome}``, ``loads.load_single_flight`` / ``read_load_end_error``).
2. ``manage.py serve`` loads the eager models in its own process (``_preload``: ``models_preload`` on
   an event loop in a thread) and points its Celery app at the Redis it started.

Real Redis, real listeners, real ``serve`` processes; nothing of the project is mocked. The GPU
worker of a load is played, where needed, with exactly the calls its load task makes
(``renew_load``, its liveness key, ``finish_load``, the reply key), as tests/test_single_flight_load_races.py does.

Two edges of the kept ends:
- ``test_a_kept_end_expires_a_minute_after_its_own_end_not_after_the_last_one``: each kept end is a
  key of its own, ``:loadend:<token>``, with its own expiry (one PEXPIRE re-armed on a shared hash at
  every end would drop nothing while the model's loads end more often than once a minute: one entry
  per caller of every load, per request while no worker is alive).
- ``test_a_teardown_waiting_through_several_looks_leaves_one_load_wait_entry``:
  ``teardown.wait_for_load_in_progress`` registers a fresh token at every 2 s look and removes the
  previous one (``add_load_waiter.lua`` takes ``replaces`` as ``begin_load.lua`` does).
"""
from __future__ import annotations

import asyncio
import json
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest
import redis

from audiosite.embedded_redis import EmbeddedRedis
from audiosite.errors import ModelLoadFailed
from inference.runtime.context import KEYS
from inference.runtime.loads import load_single_flight
from inference.runtime.teardown import wait_for_load_in_progress
from inference.scheduler import Keys, LoadEnd, LoadEndRecord

from .support.bounds import outcome_of, run, within
from .support.processes import ROOT, embedded_env, free_port, kill_process_tree
from .support.rigs import Rig, claim_started_by, live_worker, load_contexts, unique_prefix
from .support.stacks import FIXTURE_ENV, drop_stack, prepare_stack


NASTY_ERROR = ("OSError: [Errno 2] No such file: 'C:\\models\\w.onnx'\n"
               "  at load: step 2: ready:no\nfailed:worker_lost:\n\nlast line")


# -- change 1: the end carried and kept ----------------------------------------------------------------
def test_an_error_with_colons_and_newlines_reaches_waiters_and_late_readers_intact(redis_client):
    """R4.2: a failure text with ':' (also 'ready:' / 'failed:' inside it) and newlines (also a blank
    line) is what every waiter reports, whether it hears its wake-up (the inline payload: the
    listener splits the message at the *first* LF only) or missed it (``:loadend``), and what
    ``LoadEndRecord.parse`` reads back (split at the first ':' only)."""
    boot = live_worker(redis_client, "gpu0@ok")

    async def scenario():
        ctx, deaf = await load_contexts(1500)
        await claim_started_by(ctx, "m", "loader", "gpu0@ok", boot)
        hearing = asyncio.create_task(load_single_flight(ctx, "m", pickup_timeout_s=5.0))
        missing = asyncio.create_task(load_single_flight(deaf, "m", pickup_timeout_s=5.0))
        await asyncio.sleep(0.3)
        assert await ctx.redis.hlen(KEYS.model("m") + ":loadwait") == 2
        assert str(await ctx.scheduler.finish_load("m", "loader", LoadEnd.FAILED, "gpu0@ok", boot,
                                                   error=NASTY_ERROR)) == "ok"
        outcomes = [await outcome_of(hearing), await outcome_of(missing)]
        kept = await ctx.scheduler.load_end("m", "loader")
        await ctx.listener.close()
        return outcomes, kept
    outcomes, kept = run(scenario())
    assert kept == LoadEndRecord(LoadEnd.FAILED, NASTY_ERROR)
    for outcome in outcomes:
        assert isinstance(outcome, ModelLoadFailed) and outcome.code == "load_failed", outcome
        assert outcome.message == f"model 'm' failed to load: {NASTY_ERROR}", outcome.message


def test_an_empty_error_is_reported_as_no_detail_not_as_nothing_kept(redis_client):
    """Edge of the '<ended>:<error>' text: an empty error gives 'failed:' (not ''), so the end is
    still kept and read (``ended`` FAILED, not None), by a hearing and a late waiter alike."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys) as rig:
            sched = rig.scheduler
            wake = rig.listener.expect("load:w1")
            assert (await sched.begin_load(rig.listener, "m", "loader")).action == "load"
            assert (await sched.begin_load(rig.listener, "m", "w1")).action == "wait"
            assert (await sched.begin_load(rig.listener, "m", "w2")).action == "wait"
            assert await sched.finish_load("m", "loader", LoadEnd.NO_WORKER, error="") == "ok"
            heard = await within(wake, 2)
            late = await sched.begin_load(rig.listener, "m", "w3", replaces="w2")
            return heard, late, await sched.load_end("m", "w2")
    heard, late, kept = run(scenario())
    assert heard == "no_worker:"
    assert LoadEndRecord.parse(heard) == LoadEndRecord(LoadEnd.NO_WORKER, "")
    assert (late.action, late.ended, late.error) == ("woken", LoadEnd.NO_WORKER, "")
    assert kept == LoadEndRecord(LoadEnd.NO_WORKER, "")


def test_many_waiters_on_several_processes_each_hear_the_end_and_each_keep_it(redis_client):
    """R4.2 at scale: 600 waiters spread over three web processes (listeners); one end (one script
    run) wakes every one of them with the outcome inline and keeps the outcome for each token and
    the loader; ``:loadwait`` is gone after, and every record expires (<= 60 s each)."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys) as a, Rig(keys) as b, Rig(keys) as c:
            rigs = [a, b, c]
            sched = a.scheduler
            assert (await sched.begin_load(a.listener, "m", "loader")).action == "load"
            wakes = {}
            for i in range(600):
                rig = rigs[i % 3]
                token = f"w{i}"
                wakes[token] = rig.listener.expect(f"load:{token}")
                assert (await rig.scheduler.begin_load(rig.listener, "m", token)).action == "wait"
            assert await sched.finish_load("m", "loader", LoadEnd.WORKER_LOST, error="gpu0: lost") == "ok"
            heard = await within(asyncio.gather(*wakes.values()), 10)
            names = [name async for name in a.redis.scan_iter(match=keys.model("m") + ":loadend:*", count=1000)]
            ends = {name: await a.redis.get(name) for name in names}
            ttls = [await a.redis.pttl(name) for name in names]
            return heard, ends, ttls, await a.redis.exists(keys.model("m") + ":loadwait")
    heard, ends, ttls, loadwait = run(scenario())
    assert set(heard) == {"worker_lost:gpu0: lost"} and len(heard) == 600
    assert len(ends) == 601 and set(ends.values()) == {"worker_lost:gpu0: lost"}
    assert all(0 < pttl <= 60000 for pttl in ttls) and not loadwait


def test_a_wake_up_heard_before_expect_loses_its_payload_but_the_kept_end_answers(redis_client):
    """The listener's early path (a message before ``expect``: kept as a bare key, the payload
    dropped) resolves the wait to None; the kept end for that token still says how the load
    ended (what ``read_load_end_error`` falls back to)."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys) as rig:
            sched = rig.scheduler
            assert (await sched.begin_load(rig.listener, "m", "loader")).action == "load"
            assert (await sched.begin_load(rig.listener, "m", "w1")).action == "wait"  # no expect yet
            assert await sched.finish_load("m", "loader", LoadEnd.FAILED, error="bad: graph") == "ok"
            await asyncio.sleep(0.2)  # the wake-up arrives: nobody expects it yet
            early = await within(rig.listener.expect("load:w1"), 2)
            return early, await sched.load_end("m", "w1")
    early, kept = run(scenario())
    assert early is None
    assert kept == LoadEndRecord(LoadEnd.FAILED, "bad: graph")


def test_a_teardown_waiting_for_a_load_returns_on_its_end_payload_and_all(redis_client):
    """R4.5: a teardown waiting for a load in progress (``add_load_waiter``) is woken by the end, now
    a message with a payload: it returns at once (not at its next look) for a failed end and for a
    ready one."""
    boot = live_worker(redis_client, "gpu0@ok")

    async def scenario():
        ctx, _ = await load_contexts(30000)
        took = []
        for outcome in (LoadEnd.FAILED, LoadEnd.READY):
            token = f"loader-{outcome}"
            await claim_started_by(ctx, "m", token, "gpu0@ok", boot, force=True)  # past the failure's backoff
            waiting = asyncio.create_task(wait_for_load_in_progress(ctx, "m"))
            await asyncio.sleep(0.3)
            assert not waiting.done()
            ended_at = time.monotonic()
            assert str(await ctx.scheduler.finish_load("m", token, outcome, "gpu0@ok", boot, error="x: y\nz",
                                                       capacity=1)) == "ok"
            await within(waiting, 5)
            took.append(time.monotonic() - ended_at)
            await ctx.redis.hset(KEYS.load("m"), mapping={"state": "unloaded"})
        await ctx.listener.close()
        return took
    took = run(scenario())
    assert all(t < 0.5 for t in took), took  # woken, not its 2 s look


def test_a_teardown_waiting_through_several_looks_leaves_one_load_wait_entry(redis_client):
    """R4.5 / the ``replaces`` rule of begin_load ("a waiter that decides again every few seconds
    leaves one ':loadwait' entry, not one per look"): a teardown waiting for a long load looks
    again every ``LIVENESS_CHECK_S`` (2 s) with a fresh token and never unregisters the previous
    one, so each look added a ``:loadwait`` entry; at the end every stale entry also got a PUBLISH
    to a listener that forgot it (kept in its early-message set) and a ``:loadend`` record. Each
    look now replaces the previous one (``add_load_waiter``'s ``replaces``)."""
    boot = live_worker(redis_client, "gpu0@ok")

    async def scenario():
        ctx, _ = await load_contexts(30000)
        await claim_started_by(ctx, "m", "loader", "gpu0@ok", boot)
        waiting = asyncio.create_task(wait_for_load_in_progress(ctx, "m"))
        await asyncio.sleep(6.5)  # four looks of a teardown waiting for a slow load
        entries = await ctx.redis.hlen(KEYS.model("m") + ":loadwait")
        assert str(await ctx.scheduler.finish_load("m", "loader", LoadEnd.READY, "gpu0@ok", boot,
                                                   capacity=1)) == "ok"
        await within(waiting, 5)
        records = len([name async for name in ctx.redis.scan_iter(match=KEYS.model("m") + ":loadend:*")])
        await ctx.listener.close()
        return entries, records
    entries, records = run(scenario())
    assert entries == 1, f"one teardown left {entries} :loadwait entries after ~6.5 s (one per look)"
    assert records <= 2, records  # the loader's and the teardown's


def test_a_loader_whose_pending_claim_was_taken_over_reports_the_takers_failure(redis_client):
    """R4.2: a caller's claim lapsed before any worker started it and another caller took it over;
    the taker's load fails. The first caller (no record kept for its token: its load never ended)
    reads the model's hash, not a stale 'ready', and answers ``load_failed`` with that error; it
    does not become a loader again."""
    live_worker(redis_client, "gpu1@idle")  # the census sees a live worker: the task waits in the queue

    async def scenario():
        ctx, _ = await load_contexts(600)
        first = asyncio.create_task(load_single_flight(ctx, "m", pickup_timeout_s=30.0))
        await asyncio.sleep(0.8)  # its claim (0.6 s) lapsed: nobody picked the task up
        assert (await ctx.scheduler.begin_load(ctx.listener, "m", "taker")).action == "load"
        assert str(await ctx.scheduler.finish_load("m", "taker", LoadEnd.FAILED, error="boom: bad")) == "ok"
        outcome = await outcome_of(first, 15)
        await ctx.listener.close()
        return outcome
    outcome = run(scenario())
    assert isinstance(outcome, ModelLoadFailed) and outcome.code == "load_failed", outcome
    assert "boom: bad" in outcome.message
    assert redis_client.llen("gpu") == 1  # the first caller's one task


def test_unregister_then_reregister_of_the_same_id_keeps_no_end_of_the_old_registration(redis_client):
    """A load end racing the unregister (arriving after it) is stale and records nothing; the ends
    kept before the unregister stay for their minute (each is read only by its own caller, and
    tokens are never reused: a caller of the old registration still learns how its load ended);
    the model registered again under the same id loads normally."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys) as rig:
            sched = rig.scheduler
            await rig.lost_load("m", "l1", ["w1"])
            assert (await sched.begin_load(rig.listener, "m", "l2", force=True)).action == "load"
            assert (await sched.begin_load(rig.listener, "m", "w2")).action == "wait"
            manager = await rig.acquire("m", 1000, kind="manager")
            await sched.unregister("m", manager.lease_id)
            stale = await sched.finish_load("m", "l2", LoadEnd.FAILED, error="late")
            after = {"load": await rig.redis.hgetall(keys.load("m"))}
            await sched.release("m", manager.lease_id)
            again = await sched.begin_load(rig.listener, "m", "l3")
            return stale, after, again, [await sched.load_end("m", t) for t in ("w1", "l1", "w2", "l2")]
    stale, after, again, kept = run(scenario())
    assert str(stale) == "stale"
    assert after == {"load": {}}
    assert again.action == "load"
    lost = LoadEndRecord(LoadEnd.WORKER_LOST, "worker w was lost")
    assert kept == [lost, lost, LoadEndRecord(None), LoadEndRecord(None)]


def test_a_kept_end_expires_a_minute_after_its_own_end_not_after_the_last_one(redis_client):
    """R7.4's ":loadend, kept a minute" (``Scheduler.load_end``: "kept for a minute after that end"):
    the end of a load kept for its callers must not outlive that minute just because later loads of
    the model keep ending, or the kept ends would grow without bound on a model whose loads end
    more often than once a minute (a deployment with no live worker ends one load per request,
    ``no_worker``; an LRU-evicting one re-loads models all day).

    Here: load A ends (no worker); a second later load B ends. A's record keeps its own expiry
    (at most a minute minus that second), B's is a fresh minute: each record expires on its own."""
    async def scenario():
        keys = Keys(unique_prefix())
        async with Rig(keys, ttl_ms=60000) as rig:
            sched = rig.scheduler
            assert (await sched.begin_load(rig.listener, "m", "A")).action == "load"
            assert await sched.finish_load("m", "A", LoadEnd.NO_WORKER, error="no live worker") == "ok"
            await asyncio.sleep(1.0)
            assert (await sched.begin_load(rig.listener, "m", "B")).action == "load"
            assert await sched.finish_load("m", "B", LoadEnd.NO_WORKER, error="no live worker") == "ok"
            return (await rig.redis.pttl(keys.load_end("m", "A")), await rig.redis.pttl(keys.load_end("m", "B")),
                    await sched.load_end("m", "A"))
    a_ttl_ms, b_ttl_ms, kept_a = run(scenario())
    assert kept_a == LoadEndRecord(LoadEnd.NO_WORKER, "no live worker")
    assert 0 < a_ttl_ms <= 60000 - 900, a_ttl_ms  # not re-armed by B's end
    assert 60000 - 500 < b_ttl_ms <= 60000, b_ttl_ms


# -- change 2: serve's own start-up loads ---------------------------------------------------------------
def _start_serve(config_path, env, log_path) -> subprocess.Popen:
    with open(log_path, "wb") as log:
        return subprocess.Popen([sys.executable, "manage.py", "serve", "--config", str(config_path)], cwd=ROOT,
                                env=env, stdout=log, stderr=subprocess.STDOUT)


def _wait_for(predicate, proc: subprocess.Popen, log_path, timeout_s: float = 180.0) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if proc.poll() is not None or time.monotonic() > deadline:
            kill_process_tree(proc)
            raise AssertionError("serve: condition not reached\n" + log_path.read_text(errors="replace")[-4000:])
        time.sleep(0.1)


def _stop_and_collect(proc: subprocess.Popen, sig: int, timeout_s: float = 60.0):
    """Send ``sig`` to serve and wait: returns (exit code, seconds it took, descendants still alive)."""
    children = psutil.Process(proc.pid).children(recursive=True)
    sent = time.monotonic()
    proc.send_signal(sig)
    try:
        code = proc.wait(timeout=timeout_s)
    except subprocess.TimeoutExpired:
        code = None
    took = time.monotonic() - sent
    _, alive = psutil.wait_procs(children, timeout=5)
    return code, took, alive



HELD = [{"id": "a-held", "family": "fixture", "load_options": {"load_barrier": "boot"}},
        {"id": "b-after", "family": "fixture"}]  # serve loads the eager models in id order


@pytest.mark.stack
@pytest.mark.parametrize("sig", [signal.SIGTERM, signal.SIGINT])
def test_a_signal_during_the_start_up_loads_stops_serve_promptly_leaving_no_process_nor_lease(tmp_path, sig):
    """R8.4 at start-up: serve is loading its eager models (``_preload``, the first one held at a load
    barrier on the worker) when SIGTERM / Ctrl-C comes. It stops within the worker's stop budget
    (``shutdown_timeout_ms`` 5 s, plus daphne's drain), exits 0 saying "audiosite stopped", leaves
    no child process, gives the start-up load's request lease back (no lease, no queued ticket),
    loads nothing after the signal, and never says it listens."""
    setup = prepare_stack(tmp_path, HELD, redis_db=5, name="boot_signal", extra_env=FIXTURE_ENV)
    log_path = tmp_path / "serve.log"
    proc = _start_serve(setup.config_path, setup.env, log_path)
    try:
        _wait_for(lambda: int(setup.redis.get(KEYS.fixture_arrived("boot")) or 0) == 1, proc, log_path)
        code, took, alive = _stop_and_collect(proc, sig)
        output = log_path.read_text(errors="replace")
        leases = {m: (setup.redis.hlen(KEYS.leases(m)), setup.redis.zcard(KEYS.queue(m)))
                  for m in ("a-held", "b-after")}
        after_state = setup.redis.hget(KEYS.load("b-after"), "state")
    finally:
        kill_process_tree(proc)
        drop_stack(setup)
    assert code == 0, output[-3000:]
    assert took < 15, f"serve took {took:.1f} s to stop\n" + output[-3000:]
    assert not alive, [p.cmdline() for p in alive]
    assert "audiosite stopped" in output and "listening on" not in output
    assert leases == {"a-held": (0, 0), "b-after": (0, 0)}, leases
    assert after_state in (None, "unloaded"), f"{after_state=}\n" + output[-4000:]  # no load began after the signal
    assert "Traceback" not in output, output[-3000:]


@pytest.mark.stack
def test_a_start_up_load_longer_than_the_lease_ttl_keeps_its_lease_and_finishes(tmp_path):
    """R2.5 at start-up: serve's start-up load holds a request lease of its model (``models_preload``)
    and keeps it alive while the load runs: a load held on the worker for twice the 3 s lease TTL
    still holds exactly that one lease (not reaped, so no request could take the slot meanwhile),
    and once the load goes on, serve loads the next model, listens and holds no lease."""
    setup = prepare_stack(tmp_path, HELD, redis_db=5, name="boot_ttl", extra_env=FIXTURE_ENV)
    log_path = tmp_path / "serve.log"
    proc = _start_serve(setup.config_path, setup.env, log_path)
    try:
        _wait_for(lambda: int(setup.redis.get(KEYS.fixture_arrived("boot")) or 0) == 1, proc, log_path)
        time.sleep(2 * setup.config["lease_ttl_ms"] / 1000)
        held = setup.redis.hlen(KEYS.leases("a-held"))
        seconds, micros = setup.redis.time()
        expiries = setup.redis.zrange(KEYS.model("a-held") + ":expiry", 0, -1, withscores=True)
        left_ms = [expires_at - (seconds * 1000 + micros // 1000) for _lease, expires_at in expiries]
        setup.redis.lpush(KEYS.fixture_release("boot"), "go")
        _wait_for(lambda: b"listening on" in log_path.read_bytes(), proc, log_path, 60)
        after = {m: setup.redis.hlen(KEYS.leases(m)) for m in ("a-held", "b-after")}
        states = {m: setup.redis.hget(KEYS.load(m), "state") for m in ("a-held", "b-after")}
        code, _took, alive = _stop_and_collect(proc, signal.SIGINT)
    finally:
        kill_process_tree(proc)
        drop_stack(setup)
    assert held == 1 and len(left_ms) == 1 and left_ms[0] > 0, (held, left_ms)  # renewed, not expired
    assert after == {"a-held": 0, "b-after": 0} and states == {"a-held": "ready", "b-after": "ready"}, (after, states)
    assert code == 0 and not alive


@pytest.mark.stack
def test_a_model_failing_its_start_up_load_is_printed_and_serve_goes_on_serving(tmp_path):
    """serve's start-up loads: a model whose load fails (the worker raises) is printed ("loading bad
    failed: ...", the failures line) and serve goes on: it listens, the other eager models are
    ready, the failed one stays registered and unloaded with its error; the next model after it
    is still loaded."""
    models = [{"id": "bad", "family": "fixture", "load_options": {"fail_load": True}},
              {"id": "good", "family": "fixture"}]
    setup = prepare_stack(tmp_path, models, redis_db=6, name="boot_fail", extra_env=FIXTURE_ENV)
    log_path = tmp_path / "serve.log"
    proc = _start_serve(setup.config_path, setup.env, log_path)
    try:
        _wait_for(lambda: b"listening on" in log_path.read_bytes(), proc, log_path)
        with httpx.Client(base_url=f"http://127.0.0.1:{setup.config['port']}", timeout=30) as c:
            states = {m["id"]: m["state"] for m in c.get("/v1/models").json()["data"]}
            bad = c.get("/v1/models/bad").json()
        code, took, alive = _stop_and_collect(proc, signal.SIGINT)
        output = log_path.read_text(errors="replace")
    finally:
        kill_process_tree(proc)
        drop_stack(setup)
    assert "loading bad failed: model 'bad' failed to load: InjectedFailure: injected load failure" in output, output
    assert "1 model(s) failed to load; they stay registered and load on first request" in output
    assert "loaded good in" in output
    assert states == {"bad": "failed", "good": "ready"}, states  # 'failed': unloaded, in its backoff
    assert "injected load failure" in json.dumps(bad), bad
    assert code == 0 and not alive, output[-3000:]


@pytest.mark.stack
def test_on_the_embedded_default_start_up_loads_use_the_embedded_redis_and_a_signal_mid_load_stops_cleanly(tmp_path):
    """No REDIS_URL: serve starts its own Redis, and its start-up loads (sent by serve's own Celery
    app) reach the worker through it: the first eager model loads ("loaded first in"), the second
    is held at a load barrier; SIGTERM then stops serve within its budget, exit 0, with no process
    left (the embedded redis-server included) and its socket gone."""
    models = [{"id": "first", "family": "fixture"},
              {"id": "second-held", "family": "fixture", "load_options": {"load_barrier": "boot"}}]
    config = {"host": "127.0.0.1", "port": free_port(), "backend": "cpu", "lease_ttl_ms": 3000,
              "shutdown_timeout_ms": 5000, "models": models}
    config_path = tmp_path / "server.json"
    config_path.write_text(json.dumps(config))
    env = embedded_env(tmp_path, **FIXTURE_ENV)
    log_path = tmp_path / "serve.log"
    proc = _start_serve(config_path, env, log_path)
    embedded = EmbeddedRedis.under(tmp_path / "var")
    try:
        _wait_for(lambda: b"embedded redis-server" in log_path.read_bytes(), proc, log_path)
        client = redis.Redis.from_url(embedded.url(), decode_responses=True)
        try:
            _wait_for(lambda: int(client.get(KEYS.fixture_arrived("boot")) or 0) == 1, proc, log_path)
            first_state = client.hget(KEYS.load("first"), "state")
        finally:
            client.close()
        code, took, alive = _stop_and_collect(proc, signal.SIGTERM)
        output = log_path.read_text(errors="replace")
    finally:
        kill_process_tree(proc)
    assert "loaded first in" in output and first_state == "ready", output[-3000:]
    assert code == 0, output[-3000:]
    assert took < 15, f"serve took {took:.1f} s to stop\n" + output[-3000:]
    assert not alive, [p.cmdline() for p in alive]
    assert not embedded.answering()
    assert "Traceback" not in output, output[-3000:]


@pytest.mark.stack
def test_manage_load_models_still_loads_reports_and_counts_failures_beside_a_running_serve(tmp_path):
    """``manage.py load_models`` (now a thin wrapper of ``models_preload``) against a running serve:
    a lazy model named on the command line loads ("loaded lazy in"), an unknown id and a failing
    model are reported on stderr with the failures line, exit code 0; with no id it loads every
    eager model (already loaded: "loaded eager in 0 ms")."""
    models = [{"id": "eager", "family": "fixture"},
              {"id": "lazy", "family": "fixture", "lazy": True},
              {"id": "broken", "family": "fixture", "lazy": True, "load_options": {"fail_load": True}}]
    setup = prepare_stack(tmp_path, models, redis_db=7, name="boot_lazy", extra_env=FIXTURE_ENV)
    log_path = tmp_path / "serve.log"
    proc = _start_serve(setup.config_path, setup.env, log_path)
    env = {**setup.env, "AUDIOSITE_CONFIG": str(setup.config_path), "DJANGO_SETTINGS_MODULE": "audiosite.settings"}
    try:
        _wait_for(lambda: b"listening on" in log_path.read_bytes(), proc, log_path)
        named = subprocess.run([sys.executable, "manage.py", "load_models", "lazy", "nope", "broken"], cwd=ROOT,
                               env=env, capture_output=True, text=True, timeout=120)
        default = subprocess.run([sys.executable, "manage.py", "load_models"], cwd=ROOT, env=env,
                                 capture_output=True, text=True, timeout=120)
        state = setup.redis.hget(KEYS.load("lazy"), "state")
        code, took, alive = _stop_and_collect(proc, signal.SIGINT)
    finally:
        kill_process_tree(proc)
        drop_stack(setup)
    assert named.returncode == 0, named.stdout + named.stderr
    assert "loaded lazy in" in named.stdout and state == "ready", named.stdout + named.stderr
    assert "loading nope failed: not registered" in named.stderr
    assert "loading broken failed: model 'broken' failed to load" in named.stderr
    assert "2 model(s) failed to load" in named.stderr
    assert default.returncode == 0 and default.stdout.strip() == "loaded eager in 0 ms", default.stdout + default.stderr
    assert code == 0 and not alive
