"""The parallel runtime end to end: ``serve --parallel-jobs`` with the fixture
family (barriers, injected failures, which slot/pool/version served) and the
real models at 1..4 slots. Real Redis (db 13), PostgreSQL, Celery worker.
"""
from __future__ import annotations

import asyncio
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest

from inference.runtime.context import KEYS

from .support.audio import padded, wav_bytes
from .support.bounds import MODEL_S, QUICK_S, run, until
from .support.clients import body, mclient, post, without_timing
from .support.processes import ROOT, free_port
from .support.stacks import FIXTURE_ENV, entry_of, run_stack

pytestmark = pytest.mark.stack

COUNTS = [1, 2, 3, 4]
PAR_MODELS = [
    *[{"id": f"fx{n}", "family": "fixture", "slots": n, "load_options": {"version": "v1"}} for n in COUNTS],
    {"id": "fx-cold", "family": "fixture", "slots": 2, "lazy": True,
     "load_options": {"version": "cold", "load_barrier": "cold-load"}},
    {"id": "fx-fail", "family": "fixture", "slots": 2, "lazy": True, "load_options": {"load_barrier": "fail-load"}},
    {"id": "fx-session", "family": "fixture", "slots": 3, "lazy": True, "load_options": {"fail_session": 2}},
    *[{"id": f"whisper{n}", "family": "whisper", "slots": n, "lazy": True} for n in COUNTS],
    *[{"id": f"vad{n}", "family": "silero_vad", "slots": n, "lazy": True} for n in COUNTS],
]

@pytest.fixture(scope="module")
def pstack(tmp_path_factory):
    yield from run_stack(tmp_path_factory.mktemp("pstack"), PAR_MODELS, redis_db=13, name="par", parallel=True,
                         extra_env=FIXTURE_ENV)


def client(pstack, **kw) -> httpx.AsyncClient:
    return mclient(pstack, None, **kw)


# -- start-up and status ------------------------------------------------------------------
def test_status_has_the_parallel_shape_and_the_warning_is_printed_once(pstack):
    """R1.3/R1.5/R4.7: parallel status fields; one experimental warning at start-up."""
    assert pstack.manage("unload_model", "whisper2").returncode == 0  # unloaded, whatever ran before
    with pstack.client() as c:
        health = c.get("/health").json()
        entries = {e["id"]: e for e in c.get("/v1/models").json()["data"]}
    assert health["runtime"] == "parallel"
    assert entries["fx2"] | {} == {**entries["fx2"], "slots": 2, "active_slots": 0, "queued_requests": 0,
                                    "max_parallel_slots": 16, "state": "ready", "loaded": True}
    assert entries["whisper2"]["state"] == "unloaded" and entries["whisper2"]["max_parallel_slots"] is None
    log = pstack.log_path.read_text()
    assert log.count("EXPERIMENTAL: the parallel runtime") == 1
    assert "whisper asr/offline on cpu up to 4 slots" in log
    assert "whisper asr/batch on cpu batch sizes up to 4" in log  # a batch row's count is a batch size


def test_runtime_mismatch_is_refused(pstack):
    """R1.4: a process of the other runtime refuses to start against this deployment's Redis."""
    legacy_env_run = pstack.manage("sync_config")  # stack.env has no AUDIOSITE_PARALLEL_JOBS: legacy
    assert legacy_env_run.returncode != 0
    assert "runs the parallel runtime" in legacy_env_run.stderr
    assert "Start it with the deployment's runtime (--parallel-jobs or AUDIOSITE_PARALLEL_JOBS=1)" in \
        legacy_env_run.stderr  # the remedy first, not deleting the key


def test_a_web_process_and_a_worker_of_the_other_runtime_exit_at_start(pstack):
    """R1.4: a web process (``python -m audiosite.web``) and a Celery worker, each started on the legacy
    runtime against this parallel deployment's Redis, exit 1 naming the runtime recorded: the web
    process never opens its port, the worker never announces itself (no pid, no liveness key) nor takes
    a task, and the deployment serves on."""
    from inference.management.commands.serve import worker_argv  # noqa: PLC0415 (Django set up by now)
    port = free_port()
    web = subprocess.run([sys.executable, "-m", "audiosite.web", "-b", "127.0.0.1", "-p", str(port),
                          "audiosite.asgi:application"], cwd=ROOT, env=pstack.env, capture_output=True, text=True,
                         timeout=MODEL_S)
    assert web.returncode == 1, web.stderr[-2000:]
    assert "this web process cannot start" in web.stderr and "runs the parallel runtime" in web.stderr
    workers = pstack.redis.hgetall(KEYS.worker_pid)
    worker = subprocess.run(worker_argv("mismatched@test", 1), cwd=ROOT, env=pstack.env, capture_output=True,
                            text=True, timeout=MODEL_S)
    output = worker.stdout + worker.stderr
    assert worker.returncode == 1, output[-2000:]
    assert "worker mismatched@test cannot start" in output and "runs the parallel runtime" in output
    assert "is alive" not in output and "ready." not in output  # neither announced nor consuming
    assert pstack.redis.hgetall(KEYS.worker_pid) == workers
    assert not pstack.redis.exists(KEYS.worker_live("mismatched@test"))

    async def served():
        async with client(pstack) as c:
            return (await post(c, "fx1"))[0].status_code
    assert run(served()) == 200


# -- FIFO admission -------------------------------------------------------------------------
@pytest.mark.parametrize("n", COUNTS)
def test_sixteen_queued_requests_are_admitted_in_fifo_order(pstack, n):
    """R2.1/R2.2: consecutive requests fill the n slots; 16 more queue and start strictly in order."""
    model = f"fx{n}"

    async def scenario():
        async with client(pstack) as c:
            holders = [asyncio.create_task(post(c, model, barrier=f"h{n}")) for _ in range(n)]
            await until(lambda: pstack.arrived(f"h{n}") == n)  # all n run at the same time
            entry = entry_of(pstack, model)
            assert (entry["active_slots"], entry["queued_requests"]) == (n, 0)
            queued = []
            for i in range(16):
                queued.append(asyncio.create_task(post(c, model, barrier=f"q{n}-{i}", tag=str(i))))
                await until(lambda: pstack.counters(model)["queued"] == i + 1)
            assert entry_of(pstack, model)["queued_requests"] == 16
            pstack.release(f"h{n}", n)
            for i in range(16):
                running = set(range(i, min(16, i + n)))
                await until(lambda: all(pstack.arrived(f"q{n}-{j}") for j in running))
                assert not any(pstack.arrived(f"q{n}-{j}") for j in range(i + n, 16)), "a later request barged"
                pstack.release(f"q{n}-{i}")
                resp, _, _ = await queued[i]
                assert resp.status_code == 200 and resp.json()["tag"] == str(i)
            for task in holders:
                assert (await task)[0].status_code == 200
            slots_used = {(await q)[0].json()["slot"] for q in queued}
            assert slots_used == set(range(n))
    run(scenario())
    pstack.wait_idle(model)


@pytest.mark.parametrize("n", COUNTS)
def test_manager_barrier_older_drains_first_later_bind_the_new_pool(pstack, n):
    """R2.2/R2.3: older queued request, then a manager (unload), then staggered later requests."""
    model = f"fx{n}"

    async def scenario():
        async with client(pstack) as c:
            holders = [asyncio.create_task(post(c, model, barrier=f"mh{n}")) for _ in range(n)]
            await until(lambda: pstack.arrived(f"mh{n}") == n)
            older = asyncio.create_task(post(c, model, barrier=f"older{n}", tag="older"))
            await until(lambda: pstack.counters(model)["queued"] == 1)
            manager = pstack.manage_async("unload_model", model)
            await until(lambda: pstack.managers(model)["queued"] == 1)
            later = []
            for i in range(3):
                later.append(asyncio.create_task(post(c, model, tag=f"later{i}")))
                await asyncio.sleep(0.05)
            await until(lambda: pstack.counters(model)["queued"] == 4)
            pstack.release(f"mh{n}", 1)  # one slot frees: the older request takes it
            await until(lambda: pstack.arrived(f"older{n}") == 1)
            pstack.release(f"mh{n}", n - 1)  # spare slots now, but the manager is a barrier
            for task in holders:
                assert (await task)[0].status_code == 200
            await asyncio.sleep(0.2)
            assert manager.poll() is None and not any(t.done() for t in later)
            assert pstack.counters(model)["queued"] == 3
            pstack.release(f"older{n}")
            older_resp = (await older)[0].json()
            out, _ = await asyncio.to_thread(manager.communicate, timeout=60)
            assert manager.returncode == 0 and "pool destroyed" in out
            later_resps = [(await t)[0] for t in later]
            assert all(r.status_code == 200 for r in later_resps)
            holder_pool = (await holders[0])[0].json()["pool_id"]
            assert older_resp["pool_id"] == holder_pool
            new_pools = {r.json()["pool_id"] for r in later_resps}
            assert len(new_pools) == 1 and holder_pool not in new_pools
            assert min(r.json()["started_ns"] for r in later_resps) > older_resp["finished_ns"]
    run(scenario())
    pstack.wait_idle(model)


def test_overdue_fail_fast_with_a_waiting_manager_and_a_spare_slot(pstack):
    """R3.3: the only occupied slot is overdue; the spare slot is blocked by the manager → 503 at once."""
    async def scenario():
        async with client(pstack) as c:
            holder = asyncio.create_task(post(c, "fx2", barrier="od"))
            await until(lambda: pstack.arrived("od") == 1)
            manager = pstack.manage_async("unload_model", "fx2")
            await until(lambda: pstack.managers("fx2")["queued"] == 1)
            await asyncio.sleep(0.4)
            resp, started, ended = await post(c, "fx2", busy_timeout_ms=300)
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "overdue"
            assert (ended - started) * 1000 < 250
            pstack.release("od")
            assert (await holder)[0].status_code == 200
            await asyncio.to_thread(manager.communicate, timeout=60)
            assert manager.returncode == 0
    run(scenario())
    pstack.wait_idle("fx2")


def test_request_timeouts_at_the_deadline_and_zero(pstack):
    """R3.2/R3.5 on the parallel runtime (capacity one still uses the new scheduler, R1.3)."""
    async def scenario():
        async with client(pstack) as c:
            holder = asyncio.create_task(post(c, "fx1", barrier="to"))
            await until(lambda: pstack.arrived("to") == 1)
            resp, started, ended = await post(c, "fx1", busy_timeout_ms=500)
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "queue_timeout"
            assert 480 <= (ended - started) * 1000 < 900
            assert pstack.counters("fx1") == {"leases": 1, "queued": 0}
            patient = asyncio.create_task(post(c, "fx1", busy_timeout_ms=0))
            await asyncio.sleep(0.8)
            assert not patient.done()
            pstack.release("to")
            assert (await holder)[0].status_code == 200
            assert (await patient)[0].status_code == 200
    run(scenario())
    pstack.wait_idle("fx1")


def test_manager_timeouts_and_zero(pstack):
    """R3.4: a manager times out at its deadline, fails fast behind an overdue slot, 0 waits."""
    async def scenario():
        async with client(pstack, timeout=MODEL_S) as c:  # the holder waits through three manage commands
            holder = asyncio.create_task(post(c, "fx1", barrier="mt"))
            await until(lambda: pstack.arrived("mt") == 1)
            # The command needs 1.5-3 s to start (Django; over 7 s on a loaded 2-core machine), so the
            # holder's age when the manager enqueues stays well under this timeout: a queue timeout,
            # not an overdue refusal.
            started = time.monotonic()
            timed = await asyncio.to_thread(pstack.manage, "unload_model", "fx1", "--timeout-ms", "12000")
            elapsed = time.monotonic() - started
            assert timed.returncode != 0 and "queue timeout" in timed.stderr, timed.stderr
            assert elapsed >= 12.0
            assert pstack.managers("fx1") == {"held": 0, "queued": 0}
            fast = await asyncio.to_thread(pstack.manage, "unload_model", "fx1", "--timeout-ms", "300")
            assert fast.returncode != 0 and "overdue" in fast.stderr
            patient = pstack.manage_async("unload_model", "fx1", "--timeout-ms", "0")
            await until(lambda: pstack.managers("fx1")["queued"] == 1)
            await asyncio.sleep(0.5)
            assert patient.poll() is None
            pstack.release("mt")
            assert (await holder)[0].status_code == 200
            await asyncio.to_thread(patient.communicate, timeout=60)
            assert patient.returncode == 0
    run(scenario())
    pstack.wait_idle("fx1")


# -- loading ------------------------------------------------------------------------------------
def test_concurrent_cold_requests_publish_one_pool_and_all_wait_for_it(pstack):
    """R4.2: requests admitted during the load count as active and wait for the one initialization."""
    assert pstack.manage("unload_model", "fx-cold").returncode == 0  # cold, whatever ran before
    before = pstack.arrived("cold-load")
    loads_sql = "SELECT outcome FROM registry_lifecycleevent WHERE model_id = %s AND event = 'load' ORDER BY id"
    loads_before = pstack.sql(loads_sql, "fx-cold")

    async def scenario():
        async with client(pstack) as c:
            tasks = [asyncio.create_task(post(c, "fx-cold")) for _ in range(3)]
            await until(lambda: pstack.arrived("cold-load") == before + 1)
            await until(lambda: pstack.counters("fx-cold") == {"leases": 2, "queued": 1})
            entry = entry_of(pstack, "fx-cold")
            assert (entry["state"], entry["active_slots"], entry["queued_requests"]) == ("loading", 2, 1)
            assert entry["max_parallel_slots"] is None
            await asyncio.sleep(0.3)
            assert pstack.arrived("cold-load") == before + 1  # nobody else started a load
            pstack.release("cold-load")
            return [(await t)[0] for t in tasks]
    responses = run(scenario())
    assert [r.status_code for r in responses] == [200, 200, 200]
    assert len({r.json()["pool_id"] for r in responses}) == 1
    assert {r.json()["config_version"] for r in responses} == {"cold"}
    assert pstack.sql(loads_sql, "fx-cold") == [*loads_before, ("ok",)]
    pstack.wait_idle("fx-cold")


def test_failed_load_releases_everyone_and_a_retry_works(pstack):
    """R4.2/R7.2/R6.7: a failed load publishes nothing and fails every request admitted to wait for
    it; the request queued behind them gets 503 load_failed at once (the backoff), starting no load;
    the model reads ``failed``; after the backoff a request retries the load, which works."""
    async def scenario():
        async with client(pstack) as c:
            admitted = [asyncio.create_task(post(c, "fx-fail")) for _ in range(2)]
            await until(lambda: pstack.arrived("fail-load") == 1)
            queued = asyncio.create_task(post(c, "fx-fail", tag="queued"))
            await until(lambda: pstack.counters("fx-fail") == {"leases": 2, "queued": 1})
            pstack.release("fail-load", action="fail")
            failed = [(await t)[0] for t in admitted] + [(await queued)[0]]
            assert pstack.arrived("fail-load") == 1  # the backoff started no second load
            entry = entry_of(pstack, "fx-fail")
            assert (entry["state"], entry["active_slots"], entry["queued_requests"]) == ("failed", 0, 0)
            assert entry["last_error"] and entry["retry_at"]
            await asyncio.sleep(1.1)  # the first backoff is 1 s
            retry = asyncio.create_task(post(c, "fx-fail", tag="retry"))
            await until(lambda: pstack.arrived("fail-load") == 2)
            pstack.release("fail-load")
            return failed, (await retry)[0]
    failed, retry = run(scenario())
    for resp in failed:
        assert resp.status_code == 503 and resp.json()["error"]["code"] == "load_failed"
    assert "backoff" in failed[-1].json()["error"]["message"] and failed[-1].headers["retry-after"] == "1"
    assert retry.status_code == 200 and retry.json()["tag"] == "retry"
    assert entry_of(pstack, "fx-fail")["state"] == "ready"
    loads = pstack.sql("SELECT outcome FROM registry_lifecycleevent WHERE model_id = %s AND event = 'load' ORDER BY id",
                       "fx-fail")
    assert loads == [("failed",), ("ok",)]
    pstack.wait_idle("fx-fail")


def test_failed_session_creation_publishes_nothing(pstack):
    """R7.2: the third slot's session cannot be created → nothing published, the model stays unloaded
    (read ``failed`` with the error, R6.7; the second request, in the backoff, names the same error)."""
    with pstack.client() as c:
        for _ in range(2):
            resp = c.post("/v1/tasks/run", json=body("fx-session"))
            assert resp.status_code == 503 and "slot 2" in resp.json()["error"]["message"]
    entry = entry_of(pstack, "fx-session")
    assert entry["state"] == "failed" and entry["loaded"] is False and "slot 2" in entry["last_error"]
    assert pstack.counters("fx-session") == {"leases": 0, "queued": 0}


def test_inference_failure_releases_its_slot_and_other_slots_keep_working(pstack):
    """R7.3: an adapter failure is reported (500: it is a bug by definition), its slot is freed."""
    async def scenario():
        async with client(pstack) as c:
            healthy = asyncio.create_task(post(c, "fx2", barrier="healthy"))
            await until(lambda: pstack.arrived("healthy") == 1)
            failed, _, _ = await post(c, "fx2", fail=True)
            assert failed.status_code == 500 and failed.json()["error"]["type"] == "server_error"
            assert pstack.counters("fx2")["leases"] == 1
            ok, _, _ = await post(c, "fx2")
            assert ok.status_code == 200
            pstack.release("healthy")
            assert (await healthy)[0].status_code == 200
    run(scenario())
    pstack.wait_idle("fx2")


# -- real models: concurrent outputs equal serial outputs ---------------------------------------
def _inputs(speech) -> list[bytes]:
    a, b = speech[0], speech[1]
    return [a.wav, b.wav, wav_bytes(padded(b, 1.0), 16000),
            wav_bytes(np.concatenate([b.samples, a.samples]), 16000)]


@pytest.mark.parametrize("family", ["whisper", "vad"])
@pytest.mark.parametrize("n", COUNTS)
def test_concurrent_outputs_equal_serial_outputs(pstack, speech, family, n):
    """R9.3/M2: n concurrent requests on n slots give exactly the serial outputs (text, segments)."""
    model = f"{family}{n}"
    inputs = _inputs(speech)[:n] if n > 1 else _inputs(speech)[:2]

    async def scenario():
        async with client(pstack, timeout=MODEL_S) as c:  # real models: loads and inference
            serial = [without_timing((await post(c, model, data))[0].json()) for data in inputs]
            peak = 0

            async def watch():
                nonlocal peak
                while True:
                    peak = max(peak, pstack.counters(model)["leases"])
                    await asyncio.sleep(0.005)
            watcher = asyncio.create_task(watch())
            waves = []
            for order in (inputs, inputs[::-1]):
                results = await asyncio.gather(*[post(c, model, data) for data in order])
                waves.append([without_timing(r[0].json()) for r in results])
            watcher.cancel()
            return serial, waves, peak
    serial, waves, peak = run(scenario())
    assert all("segments" in s for s in serial)
    assert waves[0] == serial
    assert waves[1] == serial[::-1]
    if family == "whisper":
        assert peak == min(n, len(inputs))  # the requests really overlapped
    pstack.wait_idle(model)


# -- hostile and edge inputs -----------------------------------------------------------------------
def _kill_web_subscriptions(pstack) -> int:
    """Drop the web process's pub/sub connection(s), as a network blip would (they resubscribe)."""
    killed = 0
    for client_info in pstack.redis.client_list():
        if client_info.get("name") == "audiosite-web" and int(client_info.get("sub", 0)) > 0 \
                and client_info.get("db") == "13":
            killed += pstack.redis.execute_command("CLIENT", "KILL", "ID", client_info["id"])
    return killed


def test_a_lost_completion_wake_up_does_not_hang_the_request(pstack):
    """R7.3/R2.4: if the `done:` message is lost with a dropped subscription, the waiter still
    finds the result at its next watchdog check (10 s) instead of hanging."""
    async def scenario():
        async with client(pstack) as c:
            task = asyncio.create_task(post(c, "fx2", barrier="lost-done"))
            await until(lambda: pstack.arrived("lost-done") == 1)
            assert _kill_web_subscriptions(pstack) >= 1
            pstack.release("lost-done")  # the completion is published while the listener reconnects
            started = time.monotonic()
            resp, _, _ = await asyncio.wait_for(task, 30)
            return resp, time.monotonic() - started
    resp, waited_s = run(scenario())
    assert resp.status_code == 200
    assert waited_s < 15
    pstack.wait_idle("fx2")


def test_unload_waits_for_a_load_in_progress_instead_of_skipping_it(pstack):
    """F2/R4.5: an unload that finds an orphaned load in progress waits for it and unloads its pool;
    nothing stays loaded and no second load starts."""
    assert pstack.manage("unload_model", "fx-cold").returncode == 0
    before = pstack.arrived("cold-load")

    async def scenario():
        async with client(pstack, timeout=httpx.Timeout(QUICK_S, read=1.0)) as c:
            with pytest.raises(httpx.ReadTimeout):
                await post(c, "fx-cold")  # starts the load, then the client leaves
        await until(lambda: pstack.arrived("cold-load") == before + 1)
        await until(lambda: pstack.counters("fx-cold") == {"leases": 0, "queued": 0})
        manager = pstack.manage_async("unload_model", "fx-cold")
        await asyncio.sleep(2.5)
        assert manager.poll() is None  # waiting for the load, not skipping it
        pstack.release("cold-load")
        out, _ = await asyncio.to_thread(manager.communicate, timeout=60)
        return manager.returncode, out
    code, out = run(scenario())
    assert code == 0 and "pool destroyed" in out
    assert entry_of(pstack, "fx-cold")["state"] == "unloaded"
    assert pstack.arrived("cold-load") == before + 1
