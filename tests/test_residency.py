"""Residency limits end to end (CONTRACT R6): ``max_loaded_models`` with eviction by recent use
through try-acquire, the cold-load guard, the memory guard and idle retirement, on parallel
``--ui-management`` stacks with the fixture family (Redis dbs 10 and 9).
"""
from __future__ import annotations

import asyncio
import time

import pytest

from .support.bounds import run, until, within
from .support.clients import mclient, post
from .support.stacks import FIXTURE_ENV, entry_of, fx, run_stack

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module", params=[1, 2], ids=["limit1", "limit2"])
def rstack(request, tmp_path_factory):
    """A stack with ``max_loaded_models`` = 1 or 2 and the memory guard on (1 MB headroom)."""
    limit = request.param
    models = [{"id": "keeper", "family": "fixture", "slots": 1, "lazy": True}]
    for stack in run_stack(tmp_path_factory.mktemp(f"rstack{limit}"), models, redis_db=10, name=f"res{limit}",
                           parallel=True, extra_env=FIXTURE_ENV,
                           extra_config={"ui_management": True, "max_loaded_models": limit, "min_free_memory_mb": 1}):
        stack.limit = limit
        done = stack.manage("issue_token", "operator")
        assert done.returncode == 0, done.stderr
        stack.token = done.stdout.strip()
        yield stack


def loaded(stack) -> set[str]:
    with stack.client() as c:
        return {e["id"] for e in c.get("/v1/models").json()["data"] if e["state"] in ("ready", "loading")}


async def reset(op, stack) -> None:
    resp = await op.post("/v1/tasks/unload_all_models")
    assert resp.status_code == 200
    assert loaded(stack) == set()


def test_eviction_picks_the_idle_model_with_the_least_recent_use(rstack):
    """R6.1: at the limit, a cold load evicts the ready, idle model with the least recent use (one, once
    its minimum residency has passed), and no more than needed."""
    limit = rstack.limit

    async def scenario():
        async with mclient(rstack, rstack.token) as op:
            await reset(op, rstack)
            names = [f"lru{i}" for i in range(limit + 1)]
            for name in names:
                assert (await op.post("/v1/models/load", json=fx(name, 1) | {"lazy": True})).status_code == 200
            for name in names[:limit]:
                assert (await post(op, name))[0].status_code == 200
            if limit == 2:
                assert (await post(op, names[0]))[0].status_code == 200  # lru0 is now more recent than lru1
            assert loaded(rstack) == set(names[:limit])
            resp, _, _ = await post(op, names[limit])
            assert resp.status_code == 200
            victim = names[1] if limit == 2 else names[0]
            assert loaded(rstack) == set(names) - {victim}
            assert entry_of(rstack, victim)["state"] == "unloaded"
    run(scenario())
    rows = rstack.sql("SELECT model_id, actor FROM registry_lifecycleevent WHERE event = 'teardown' "
                      "AND actor LIKE 'eviction%%' AND model_id LIKE 'lru%%'")
    assert rows == [(f"lru{1 if rstack.limit == 2 else 0}", f"eviction for lru{rstack.limit}")]


def test_a_cold_load_waits_for_room_and_never_evicts_a_busy_or_queued_model(rstack):
    """R6.1/R6.3: every loaded model is running or has a queued request → a cold request waits under
    its busy timeout (503 ``residency_full`` at its deadline, not at once), interrupting nothing; a
    cold request with time to spare waits until a loaded model becomes idle, then evicts it and runs."""
    limit = rstack.limit

    async def scenario():
        async with mclient(rstack, rstack.token) as op:
            await reset(op, rstack)
            busy = [f"busy{i}" for i in range(limit)]
            for name in busy + ["cold"]:
                assert (await op.post("/v1/models/load", json=fx(name, 1) | {"lazy": True})).status_code == 200
            # busy0 is loaded on behalf of a request that is still running (R6.3) ...
            running = [asyncio.create_task(post(op, busy[0], barrier="ev-run"))]
            await until(lambda: rstack.arrived("ev-run") == 1)
            if limit == 2:  # ... busy1 is idle-but-queued: one request runs, one waits behind it
                running.append(asyncio.create_task(post(op, busy[1], barrier="ev-run2")))
                await until(lambda: rstack.arrived("ev-run2") == 1)
                running.append(asyncio.create_task(post(op, busy[1], tag="queued")))
                await until(lambda: rstack.counters(busy[1])["queued"] == 1)
            started = time.monotonic()
            resp, _, _ = await post(op, "cold", busy_timeout_ms=600)
            waited_s = time.monotonic() - started
            assert resp.status_code == 503, resp.text
            error = resp.json()["error"]
            assert error["type"] == "server_busy" and error["code"] == "residency_full"
            assert "could be evicted" in error["message"] and resp.headers["retry-after"]
            assert 0.5 <= waited_s < 5, waited_s  # it waited for room until its deadline
            assert loaded(rstack) == set(busy) and entry_of(rstack, "cold")["state"] == "unloaded"
            assert rstack.counters("cold") == {"leases": 0, "queued": 0}
            patient = asyncio.create_task(post(op, "cold", busy_timeout_ms=60000))
            await asyncio.sleep(0.8)
            assert not patient.done() and loaded(rstack) == set(busy)  # waiting, nobody interrupted
            rstack.release("ev-run")
            if limit == 2:
                rstack.release("ev-run2")
            for task in running:
                assert (await task)[0].status_code == 200
            resp, _, _ = await within(patient, 30)
            assert resp.status_code == 200, resp.text
            assert "cold" in loaded(rstack) and len(loaded(rstack)) == limit
    run(scenario())
    assert rstack.counters("cold") == {"leases": 0, "queued": 0}


def test_a_wave_of_requests_for_more_models_than_fit_loads_each_model_once(rstack):
    """R6.1 (no thrash; replays of llama.cpp #24849 and #28698): with the limit full of a busy model,
    requests for another model wait for room instead of failing, and the wave is served with each
    model loaded once — the busy model's own queued requests finish before it is evicted."""
    limit = rstack.limit

    async def scenario():
        async with mclient(rstack, rstack.token) as op:
            await reset(op, rstack)
            names = [f"wave{i}" for i in range(limit + 1)]
            for name in names:
                assert (await op.post("/v1/models/load", json=fx(name, 1) | {"lazy": True})).status_code == 200
            first = [asyncio.create_task(post(op, name, barrier="wave-hold", tag=name)) for name in names[:limit]]
            await until(lambda: rstack.arrived("wave-hold") == limit)
            behind = [asyncio.create_task(post(op, name, tag=f"{name}-2")) for name in names[:limit]]
            await until(lambda: all(rstack.counters(n)["queued"] == 1 for n in names[:limit]))
            late = [asyncio.create_task(post(op, names[limit], tag=f"late{i}")) for i in range(3)]
            await asyncio.sleep(0.5)
            assert not any(t.done() for t in late)  # waiting for room, not refused
            rstack.release("wave-hold", count=limit)
            answers = [await within(t, 30) for t in first + behind + late]
            return [a[0] for a in answers]
    answers = run(scenario())
    assert [r.status_code for r in answers] == [200] * len(answers), [r.text for r in answers if r.status_code != 200]
    loads = rstack.sql("SELECT model_id, count(*) FROM registry_lifecycleevent WHERE event = 'load' "
                       "AND model_id LIKE 'wave%%' AND outcome = 'ok' GROUP BY model_id")
    assert sorted(loads) == [(f"wave{i}", 1) for i in range(limit + 1)]


def test_a_model_in_steady_use_is_never_evicted_for_two_models_taking_turns(rstack):
    """R6.1 (eviction by recent use, no thrash): 3 models, limit 2. Client A sends a request every
    200 ms of think time; client BC asks B, then C, then B... 50 ms after each answer (so B is always
    used more recently than A when C comes: least-recently-used eviction took A). A is never evicted
    (one pool serves all its requests, no eviction row names it, every answer 200), while B and C
    evict each other and each of their requests is served within its busy timeout or gets 503
    ``residency_full``."""
    if rstack.limit < 2:
        pytest.skip("the scenario has one steady model beside two taking turns")

    async def client_a(op, stop) -> list:
        answers = []
        while not stop.is_set():
            answers.append(await post(op, "steadyA", tag="A"))
            await asyncio.sleep(0.2)
        return answers

    async def client_bc(op) -> list:
        answers = []
        for turn in range(8):
            model = ("turnB", "turnC")[turn % 2]
            answers.append((model, await post(op, model, busy_timeout_ms=3000)))
            await asyncio.sleep(0.05)
        return answers

    async def scenario():
        async with mclient(rstack, rstack.token) as op:
            await reset(op, rstack)
            for name in ("steadyA", "turnB", "turnC"):
                assert (await op.post("/v1/models/load", json=fx(name, 1) | {"lazy": True})).status_code == 200
            stop = asyncio.Event()
            steady = asyncio.create_task(client_a(op, stop))
            await asyncio.sleep(1)  # A is in steady use before B and C start taking turns
            turns = await within(client_bc(op), 60)
            stop.set()
            return await steady, turns
    steady, turns = run(scenario())
    assert [a[0].status_code for a in steady] == [200] * len(steady), [a[0].text for a in steady]
    assert len({a[0].json()["pool_id"] for a in steady}) == 1  # one pool: A was never evicted nor reloaded
    for model, (resp, started, ended) in turns:
        if resp.status_code != 200:
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "residency_full", resp.text
        assert ended - started < 3 + 1.5, (model, ended - started)  # its busy timeout, plus the HTTP round trip
    served = {model for model, (resp, _, _) in turns if resp.status_code == 200}
    assert served == {"turnB", "turnC"}  # the two took turns in the second slot
    rows = rstack.sql("SELECT model_id FROM registry_lifecycleevent WHERE event = 'teardown' "
                      "AND actor LIKE 'eviction for %%' AND model_id IN ('steadyA', 'turnB', 'turnC')")
    assert rows and ("steadyA",) not in rows, rows


def test_a_cold_request_waits_rather_than_evict_a_model_in_steady_use(rstack):
    """R6.1: limit 1, model A asked every 200 ms of think time (idle in each pause, so least-recently-
    used eviction took it): a cold request for C, with fewer recent requests than A, does not evict
    it; it waits for room and gets 503 ``residency_full`` when its 1.5 s busy timeout ends. A keeps
    its one pool and every answer is 200."""
    if rstack.limit != 1:
        pytest.skip("with room for two models nothing needs evicting")

    async def scenario():
        async with mclient(rstack, rstack.token) as op:
            await reset(op, rstack)
            for name in ("steadyA1", "coldC1"):
                assert (await op.post("/v1/models/load", json=fx(name, 1) | {"lazy": True})).status_code == 200
            stop, steady = asyncio.Event(), []

            async def client_a():
                while not stop.is_set():
                    steady.append(await post(op, "steadyA1"))
                    await asyncio.sleep(0.2)
            a = asyncio.create_task(client_a())
            await asyncio.sleep(1.5)
            cold, started, ended = await post(op, "coldC1", busy_timeout_ms=1500)
            stop.set()
            await within(a, 10)
            return cold, ended - started, steady
    cold, waited_s, steady = run(scenario())
    assert cold.status_code == 503 and cold.json()["error"]["code"] == "residency_full", cold.text
    assert 1.4 <= waited_s < 5, waited_s
    assert [r.status_code for r, _, _ in steady] == [200] * len(steady)
    assert len({r.json()["pool_id"] for r, _, _ in steady}) == 1
    assert entry_of(rstack, "coldC1")["state"] == "unloaded"


def test_no_model_is_evicted_for_a_load_in_backoff(rstack):
    """R6.7 with R6.1: a broken model's first load evicts the LRU model (nobody knew it would fail);
    during its backoff, requests for it get 503 load_failed at once and evict nothing (before:
    every request evicted a healthy model and tried again)."""
    limit = rstack.limit

    async def scenario():
        async with mclient(rstack, rstack.token) as op:
            await reset(op, rstack)
            keepers = [f"bk{i}" for i in range(limit)]
            for name in keepers:
                assert (await op.post("/v1/models/load", json=fx(name, 1) | {"lazy": True})).status_code == 200
                assert (await post(op, name))[0].status_code == 200
            assert (await op.post("/v1/models/load", json=fx("bk-broken", 1, fail_load=True) | {"lazy": True})
                    ).status_code == 200
            first, _, _ = await post(op, "bk-broken")
            assert first.status_code == 503 and first.json()["error"]["code"] == "load_failed"
            assert loaded(rstack) == set(keepers[1:])  # the LRU keeper made room for the failed load
            assert (await post(op, keepers[0]))[0].status_code == 200  # back to a full house
            assert loaded(rstack) == set(keepers)
            again, _, _ = await post(op, "bk-broken")
            assert again.status_code == 503 and again.json()["error"]["code"] == "load_failed"
            assert "backoff" in again.json()["error"]["message"] and again.headers["retry-after"]
            assert loaded(rstack) == set(keepers)  # nobody evicted on its behalf
            assert entry_of(rstack, "bk-broken")["state"] == "failed"
    run(scenario())
    loads = rstack.sql("SELECT outcome FROM registry_lifecycleevent WHERE model_id = 'bk-broken' AND event = 'load'")
    assert loads == [("failed",)]


def test_a_request_queued_on_the_guard_behind_a_failing_load_evicts_nothing(rstack):
    """R6.7 with R6.6 : requests for a model wait for the cold-load guard
    while its load fails; the backoff is checked again once the guard is theirs, so the request
    behind gets 503 at once and does not evict the model another cold load put in meanwhile."""
    limit = rstack.limit

    async def scenario():
        async with mclient(rstack, rstack.token) as op:
            await reset(op, rstack)
            busy_models = [f"gbusy{i}" for i in range(limit)]
            for name in busy_models + ["gfail", "gother"]:
                entry = fx(name, 2, load_barrier="gfail-load") if name == "gfail" else fx(name, 1)
                assert (await op.post("/v1/models/load", json=entry | {"lazy": True})).status_code == 200
            busy = [asyncio.create_task(post(op, name, barrier="gbusy-run")) for name in busy_models]
            await until(lambda: rstack.arrived("gbusy-run") == limit)  # the limit is full of busy models
            first = asyncio.create_task(post(op, "gfail", busy_timeout_ms=60000))  # holds the guard, waits for room
            await asyncio.sleep(0.5)
            other = asyncio.create_task(post(op, "gother", busy_timeout_ms=60000))
            await until(lambda: rstack.counters("__coldload__")["queued"] == 1)
            second = asyncio.create_task(post(op, "gfail", busy_timeout_ms=60000))
            await until(lambda: rstack.counters("__coldload__")["queued"] == 2)
            rstack.release("gbusy-run", count=limit)
            for task in busy:
                assert (await within(task, 20))[0].status_code == 200
            await until(lambda: rstack.arrived("gfail-load") == 1)  # one busy model evicted, gfail loading
            rstack.release("gfail-load", action="fail")
            failed = (await within(first, 20))[0]
            assert failed.status_code == 503 and failed.json()["error"]["code"] == "load_failed"
            assert (await within(other, 20))[0].status_code == 200
            refused = (await within(second, 20))[0]
            assert refused.status_code == 503 and "backoff" in refused.json()["error"]["message"], refused.text
            assert "gother" in loaded(rstack)  # not evicted for a load in backoff
    run(scenario())
    events = rstack.sql("SELECT model_id, actor FROM registry_lifecycleevent WHERE event = 'teardown' "
                        "AND actor LIKE 'eviction for gfail%%'")
    assert len(events) == 1  # the one eviction that made room for its first load


def test_a_model_in_slow_teardown_does_not_count_toward_the_limit(rstack):
    """R6.2: while A's teardown is held, A no longer counts: loading B under the limit does not
    evict the unrelated loaded model C (limit 2), and B loads at once (limit 1)."""
    limit = rstack.limit

    async def scenario():
        async with mclient(rstack, rstack.token) as op:
            await reset(op, rstack)
            assert (await op.post("/v1/models/load", json=fx("tdA", 1, teardown_barrier="tdA-down"))).status_code == 200
            for name in ("tdB", "tdC"):
                assert (await op.post("/v1/models/load", json=fx(name, 1) | {"lazy": True})).status_code == 200
            if limit == 2:
                assert (await post(op, "tdC"))[0].status_code == 200
            assert loaded(rstack) == ({"tdA", "tdC"} if limit == 2 else {"tdA"})
            unload = asyncio.create_task(op.post("/v1/models/unload", json={"id": "tdA"}))
            await until(lambda: rstack.arrived("tdA-down") == 1)
            assert entry_of(rstack, "tdA")["state"] == "unloading"
            resp, _, _ = await post(op, "tdB")
            assert resp.status_code == 200, resp.text
            assert loaded(rstack) == ({"tdB", "tdC"} if limit == 2 else {"tdB"})
            rstack.release("tdA-down")
            assert (await unload).status_code == 200
    run(scenario())


def test_warm_traffic_progresses_while_a_cold_load_holds_the_guard(rstack):
    """R6.6: model A's cold load is held (it owns the cold-load guard); requests to the loaded model
    B keep being served; a second cold load (C) does not start until A's finishes."""
    if rstack.limit < 2:
        pytest.skip("needs room for two loaded models")

    async def scenario():
        async with mclient(rstack, rstack.token) as op:
            await reset(op, rstack)
            assert (await op.post("/v1/models/load", json=fx("warmB", 1))).status_code == 200
            for name, barrier in (("coldA", "coldA-load"), ("coldC", "coldC-load")):
                payload = fx(name, 1, load_barrier=barrier) | {"lazy": True}
                assert (await op.post("/v1/models/load", json=payload)).status_code == 200
            first = asyncio.create_task(post(op, "coldA"))
            await until(lambda: rstack.arrived("coldA-load") == 1)
            second = asyncio.create_task(post(op, "coldC"))
            for _ in range(5):
                started = time.monotonic()
                resp, _, _ = await post(op, "warmB")
                assert resp.status_code == 200 and time.monotonic() - started < 2
            assert rstack.arrived("coldC-load") == 0  # the second cold load waits on the guard
            rstack.release("coldA-load")
            assert (await first)[0].status_code == 200
            # then C loads, evicting the least recently used idle model (limit 2).
            await until(lambda: rstack.arrived("coldC-load") == 1)
            rstack.release("coldC-load")
            assert (await second)[0].status_code == 200
    run(scenario())


def test_memory_guard_refuses_a_load_that_does_not_fit(rstack):
    """R6.5: estimated footprint + min_free_memory_mb above the workers' available memory → 503
    insufficient_memory; the entry stays registered and unloaded; a small model loads."""
    async def scenario():
        async with mclient(rstack, rstack.token) as op:
            await reset(op, rstack)
            resp = await op.post("/v1/models/load", json=fx("huge", 1, footprint_mb=10 ** 9))
            assert resp.status_code == 503, resp.text
            error = resp.json()["error"]
            assert error["type"] == "insufficient_memory" and "min_free_memory_mb" in error["message"]
            assert resp.headers["retry-after"]
            assert entry_of(rstack, "huge")["state"] == "unloaded"
            resp = await op.post("/v1/models/load", json=fx("small", 1, footprint_mb=1))
            assert resp.status_code == 200 and resp.json()["loaded"] is True
    run(scenario())


# -- idle retirement (R6.4) ------------------------------------------------------------------------
IDLE_MS = 1500


@pytest.fixture(scope="module")
def istack(tmp_path_factory):
    models = [{"id": "idle1", "family": "fixture", "slots": 2}, {"id": "idle2", "family": "fixture", "slots": 1},
              {"id": "idle-slow", "family": "fixture", "slots": 1, "lazy": True,
               "load_options": {"teardown_barrier": "idle-down"}}]
    yield from run_stack(tmp_path_factory.mktemp("istack"), models, redis_db=9, name="idle", parallel=True,
                         extra_env=FIXTURE_ENV, extra_config={"idle_unload_ms": IDLE_MS})


def test_idle_retirement_counts_from_the_end_of_work_and_ignores_status_reads(istack):
    """R6.4: a model whose request runs longer than idle_unload_ms is not retired while it works;
    it is retired about idle_unload_ms after the work ends (not before), while status reads poll it
    all along; afterwards the next request loads it again."""
    async def scenario():
        async with mclient(istack, None) as c:
            resp, _, _ = await post(c, "idle1")  # make sure it is loaded
            assert resp.status_code == 200
            work = asyncio.create_task(post(c, "idle1", sleep_ms=IDLE_MS + 1000))
            await until(lambda: istack.counters("idle1")["leases"] == 1)
            while not work.done():
                assert entry_of(istack, "idle1")["state"] == "ready"  # busy: never retired
                await asyncio.sleep(0.1)
            resp, _, ended = await work
            assert resp.status_code == 200
            retired_at = None
            while time.monotonic() - ended < IDLE_MS / 1000 + 3:
                if entry_of(istack, "idle1")["state"] == "unloaded":  # status reads are not activity
                    retired_at = time.monotonic()
                    break
                await asyncio.sleep(0.05)
            assert retired_at is not None, "not retired"
            idle_s = retired_at - ended
            assert IDLE_MS / 1000 - 0.2 <= idle_s <= IDLE_MS / 1000 + 1.5, idle_s
            resp, _, _ = await post(c, "idle1")
            assert resp.status_code == 200 and resp.json()["slot"] in (0, 1)
    run(scenario())
    rows = istack.sql("SELECT event, actor FROM registry_lifecycleevent WHERE model_id = 'idle1' "
                      "AND event = 'idle_retire'")
    assert rows and rows[0] == ("idle_retire", "idle retirement")


def test_idle_retirement_skips_a_model_with_queued_work(istack):
    """R6.4: a model that keeps receiving requests is never retired; an idle one next to it is."""
    async def scenario():
        async with mclient(istack, None) as c:
            for name in ("idle1", "idle2"):
                assert (await post(c, name))[0].status_code == 200
            deadline = time.monotonic() + IDLE_MS / 1000 * 2
            while time.monotonic() < deadline:
                assert (await post(c, "idle1", sleep_ms=100))[0].status_code == 200
                assert entry_of(istack, "idle1")["state"] == "ready"
            assert entry_of(istack, "idle2")["state"] == "unloaded"
    run(scenario())


def test_a_slow_idle_retirement_stays_exclusive_past_the_lease_ttl(istack):
    """R6.4/R4.5/R2.5: a retirement whose teardown outlasts lease_ttl_ms (3 s here) keeps its manager
    lease renewed: a request sent meanwhile waits for the teardown and is then served by a new pool;
    the state ends ready with exactly one pool."""
    async def scenario():
        async with mclient(istack, None) as c:
            first, _, _ = await post(c, "idle-slow")
            assert first.status_code == 200
            await until(lambda: istack.arrived("idle-down") == 1, timeout_s=10)  # retirement started
            await asyncio.sleep(4)  # longer than the lease TTL
            assert istack.managers("idle-slow")["held"] == 1
            waiting = asyncio.create_task(post(c, "idle-slow"))
            await asyncio.sleep(0.5)
            assert not waiting.done()
            istack.release("idle-down")
            resp, _, _ = await waiting
            assert resp.status_code == 200 and resp.json()["pool_id"] != first.json()["pool_id"]
            entry = entry_of(istack, "idle-slow")
            assert entry["state"] == "ready" and entry["loaded"] is True
            istack.release("idle-down")  # let its next retirement pass
    run(scenario())
    loads = istack.sql("SELECT count(*) FROM registry_lifecycleevent WHERE model_id = 'idle-slow' AND event = 'load'")
    assert loads == [(2,)]
