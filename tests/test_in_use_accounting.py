"""What a running deployment counts as in use stays true while models are busy, reconfigured or lose
their worker, on one real ``serve --parallel-jobs`` stack (fixture family, management on, a small decode
budget, ``max_audio_seconds`` 60).

1. Decode budget: a WAV read as-is reserves only the send copies of its int16 samples
   (``services.decoded_bytes_needed`` of a header read as-is, ``AudioHeader.as_is``), and every
   reservation is given back whatever the clients do.
2. ``manage.py sync_config`` refuses a file that changes or removes a model in use, writing nothing.
3. ``serve`` forgets a worker that exited (``forget_worker.lua``); a load whose claim was ended is
   recorded once, by whoever ended it (docs/operations.md, "Where code lives"), R7.4.
4. A worker that finishes a load whose claim was ended meanwhile writes nothing (``work.load_pool``).

Models: ``fb`` (eager, 1 slot: budget tests and kills during a run), ``fl`` (lazy, 3 slots, every load held at
the fixture barrier ``L``), ``fs`` (lazy, sync_config). Every budget scenario ends with
:func:`drained`: no slot/ticket/input key/run queue left, then a FLAC whose reservation is the whole
budget minus 1 MiB is served (so no reservation leaked). Each test starts from the same state (the
``settled`` fixture: a live worker, ``fl`` unloaded, nothing held) and leaves the module's configuration
as it found it, so the tests pass in any order.
"""
from __future__ import annotations

import asyncio
import io
import json
import os
import random
import signal
import statistics
import subprocess
import time

import httpx
import numpy as np
import pytest
import soundfile

from inference import audio, services
from inference.runtime.context import KEYS

from .support.audio import FIXTURES, pcm_wav, silent_flac
from .support.bounds import MODEL_S, run, within
from .support.clients import body, error_of, mclient, operator_token
from .support.stacks import FIXTURE_ENV, entry_of, fx, live_workers, run_stack, worker_pid

pytestmark = pytest.mark.stack

RATE = 16000
MAX_SECONDS = 60.0
WORKER_RESTART_DELAY_MS = 20000


def reservation(data: bytes) -> int:
    return services.decoded_bytes_needed(audio.read_header(data, 3600), RATE)


def budget_probe() -> bytes:
    return silent_flac(8.0)


BUDGET_BYTES = reservation(budget_probe()) + (1 << 20)
MODELS = [
    fx("fb", 1),
    dict(fx("fl", 3, load_barrier="L"), lazy=True),
    dict(fx("fs", 1, version="s1"), lazy=True),
]


@pytest.fixture(scope="module")
def astack(tmp_path_factory):
    yield from run_stack(tmp_path_factory.mktemp("in-use"), MODELS, redis_db=9, name="in_use", parallel=True,
                         extra_env=FIXTURE_ENV,
                         extra_config={"ui_management": True, "max_audio_seconds": MAX_SECONDS,
                                       "max_decoded_bytes_in_flight": BUDGET_BYTES,
                                       # serve reloads a killed worker's eager models once the replacement
                                       # beats; a late restart leaves the tests time to see them free
                                       "worker_restart_delay_ms": WORKER_RESTART_DELAY_MS})


@pytest.fixture(scope="module")
def token(astack) -> str:
    return operator_token(astack)


@pytest.fixture(autouse=True)
def settled(astack, token):
    """Every test starts from the same state, whatever ran before it: one live worker (a test may have
    killed the last one), ``fb`` loaded (it serves the near-whole-budget probe of :func:`drained`), ``fl``
    unloaded, nothing held, queued or reserved."""
    wait_for_live_worker(astack)
    _unload_fl(astack, token)

    async def nothing_held():
        async with mclient(astack, None, timeout=MODEL_S) as c:
            await drained(astack, c)
    run(nothing_held())


# -- audio and requests ------------------------------------------------------------------------------
def speech_pcm() -> np.ndarray:
    samples, rate = soundfile.read(io.BytesIO(sorted(FIXTURES.glob("*.wav"))[0].read_bytes()), dtype="int16")
    assert rate == RATE
    return samples


def as_is(seconds: float | None = None, frames: int | None = None) -> bytes:
    frames = frames if frames is not None else round(seconds * RATE)
    wav = pcm_wav(np.resize(speech_pcm(), frames).astype("<i2").tobytes())
    assert audio.plain_pcm16_wav(wav, RATE, 1 << 20)
    return wav


def flac_of(wav: bytes) -> bytes:
    samples, rate = soundfile.read(io.BytesIO(wav), dtype="int16")
    buf = io.BytesIO()
    soundfile.write(buf, samples, rate, format="FLAC", subtype="PCM_16")
    return buf.getvalue()


async def task(c: httpx.AsyncClient, model: str, data: bytes = b"", **options) -> httpx.Response:
    payload = body(model, data or as_is(0.1), **options)
    return await within(c.post("/v1/tasks/run", json=payload), MODEL_S)


async def drained(stack, c: httpx.AsyncClient, probe: bool = True) -> None:
    deadline = time.monotonic() + 30
    while True:
        entries = (await c.get("/v1/models")).json()["data"]
        busy = [(e["id"], e["active_slots"], e["queued_requests"]) for e in entries
                if e["active_slots"] or e["queued_requests"]]
        inputs = list(stack.redis.scan_iter(KEYS.input("*")))
        queued = [k for k in stack.redis.scan_iter(KEYS.run_queue_prefix + "*") if stack.redis.llen(k)]
        counts = {m["id"]: stack.counters(m["id"]) for m in MODELS}
        held = {model: n for model, n in counts.items() if n != {"leases": 0, "queued": 0}}
        if not busy and not inputs and not queued and not held:
            break
        assert time.monotonic() < deadline, (busy, inputs, queued, held)
        await asyncio.sleep(0.05)
    if probe:
        resp = await task(c, "fb", budget_probe())
        assert resp.status_code == 200, resp.text


def sync(stack, path) -> subprocess.CompletedProcess:
    return stack.manage("sync_config", env={"AUDIOSITE_PARALLEL_JOBS": "1", "AUDIOSITE_CONFIG": str(path)})


def config_file(stack, tmp_path, name: str, edit) -> str:
    config = json.loads((stack.log_path.parent / "server.json").read_text())
    config["models"] = [dict(m) for m in config["models"]]
    edit(config)
    path = tmp_path / f"{name}.json"
    path.write_text(json.dumps(config))
    return str(path)


def written_state(stack) -> tuple:
    """What a refused sync_config must leave untouched: registrations, audit rows, published registry."""
    return (stack.sql("SELECT model_id, family, options, busy_timeout_ms, slots, lazy, source, state, updated_at "
                      "FROM registry_modelregistration ORDER BY model_id"),
            stack.sql("SELECT count(*) FROM registry_lifecycleevent"),
            stack.redis.hgetall(KEYS.models_meta))


def load_rows(stack, model_id: str) -> list[tuple[str, str]]:
    return stack.sql("SELECT outcome, actor FROM registry_lifecycleevent WHERE model_id = %s AND event = 'load' "
                     "ORDER BY id", model_id)


def db_state(stack, model_id: str) -> str:
    return stack.sql("SELECT state FROM registry_modelregistration WHERE model_id = %s", model_id)[0][0]


async def unload(op: httpx.AsyncClient, model_id: str) -> None:
    resp = await within(op.post("/v1/models/unload", json={"id": model_id}), MODEL_S)
    assert resp.status_code == 200, resp.text


# -- the decode budget and WAVs read as-is ----------------------------------------------------------
def test_as_is_and_flac_flood_with_clients_leaving_leaves_nothing_reserved(astack):
    """Many concurrent uploads (as-is WAVs of 0.1-8 s and FLACs of the same audio) to a 1-slot model
    whose slot is held on a run barrier, under a budget that holds one 8 s FLAC decode; a third of the
    clients leave at random moments. Every answer is a 200 or a documented refusal in the error shape
    (no 500); afterwards nothing is held or reserved (the near-whole-budget probe is served)."""
    rng = random.Random(4)
    wavs = [as_is(s) for s in (0.1, 1.0, 3.0, 8.0)]
    datas = wavs + [flac_of(w) for w in wavs]

    async def scenario():
        async with mclient(astack, None, timeout=MODEL_S) as c:
            held = asyncio.create_task(task(c, "fb", wavs[0], barrier="flood"))
            await asyncio.to_thread(astack.wait_arrived, "flood", astack.arrived("flood") + 1)
            tasks = []
            for _ in range(36):
                data = rng.choice(datas)
                tasks.append(asyncio.create_task(task(c, "fb", data, busy_timeout_ms=rng.choice([0, 800, 5000]))))
                await asyncio.sleep(rng.random() * 0.02)
            leaving = rng.sample(tasks, 12)

            async def leave(t):
                await asyncio.sleep(rng.random() * 1.0)
                t.cancel()
            await asyncio.gather(*(leave(t) for t in leaving))
            await asyncio.sleep(0.5)
            astack.release("flood")
            results = await within(asyncio.gather(held, *tasks, return_exceptions=True), MODEL_S)
            for result in results:
                if isinstance(result, asyncio.CancelledError):
                    continue
                assert isinstance(result, httpx.Response), repr(result)
                if result.status_code != 200:
                    error_of(result, (503,))
            await drained(astack, c)
    run(scenario())


def test_as_is_files_around_the_send_path_switch_are_served_intact_and_release_all(astack):
    """As-is WAVs on both sides of the 1 MiB send switch (524,287 and 524,288 frames) and up to the
    as-is maximum (1,048,576 frames, 65.5 s: over max_audio_seconds 60 -> 413), queued behind a held
    run together with a FLAC needing most of the budget: each is served with its own length (its
    samples reached the worker whole) or refused 413 in the error shape; nothing is left."""
    cases = {"below": as_is(frames=(1 << 19) - 1), "at": as_is(frames=1 << 19), "40s": as_is(40.0),
             "59s": as_is(59.0)}

    async def scenario():
        async with mclient(astack, None, timeout=MODEL_S) as c:
            held = asyncio.create_task(task(c, "fb", cases["below"], barrier="switch"))
            await asyncio.to_thread(astack.wait_arrived, "switch", astack.arrived("switch") + 1)
            queued = {name: asyncio.create_task(task(c, "fb", data)) for name, data in cases.items()}
            queued["flac"] = asyncio.create_task(task(c, "fb", budget_probe()))
            await asyncio.sleep(0.5)
            astack.release("switch")
            assert (await held).status_code == 200
            for name, t in queued.items():
                resp = await t
                assert resp.status_code == 200, (name, resp.status_code, resp.text[:300])
                if name in cases:
                    frames = len(cases[name]) - 44
                    assert resp.json()["timing"]["audio_duration_ms"] == pytest.approx(frames / 2 / RATE * 1000), name
            too_long = as_is(frames=1 << 20)
            error_of(await task(c, "fb", too_long), (413,))
            await drained(astack, c)
    run(scenario())



def test_clients_leaving_around_the_send_of_large_samples_leave_no_samples_and_no_budget_held(astack):
    """Inputs of 1 MiB or more are written to Redis from a send thread, then their decode budget goes
    back, then their header is pushed. A 59 s as-is WAV (1.9 MB of samples) waits behind a run held on
    a barrier of the one-slot ``fb``; the barrier opens and its client leaves at a moment spread over
    the time from the opening to its answer (measured first), so clients leave during each of those
    steps. Afterwards no samples remain in Redis (their TTL is 10 min: a leftover would be seen),
    nothing is held, and the budget is whole (``drained`` serves a request needing most of it)."""
    rng = random.Random(7)
    data = as_is(59.0)

    async def queued_behind_barrier(c: httpx.AsyncClient, name: str) -> tuple[asyncio.Task, asyncio.Task]:
        held = asyncio.create_task(task(c, "fb", barrier=name))
        await asyncio.to_thread(astack.wait_arrived, name, astack.arrived(name) + 1)
        large = asyncio.create_task(task(c, "fb", data))
        await asyncio.sleep(0.3)  # uploaded, parsed and queued
        return held, large

    async def scenario():
        async with mclient(astack, None, timeout=MODEL_S) as c:
            took_s = []
            for i in range(3):
                held, large = await queued_behind_barrier(c, f"large-{i}")
                opened = time.monotonic()
                astack.release(f"large-{i}")
                assert (await large).status_code == 200 and (await held).status_code == 200
                took_s.append(time.monotonic() - opened)
            whole_s = statistics.median(took_s)
            for i in range(30):
                held, large = await queued_behind_barrier(c, f"leave-{i}")
                astack.release(f"leave-{i}")
                await asyncio.sleep(rng.random() * whole_s)
                large.cancel()
                await asyncio.gather(large, return_exceptions=True)
                assert (await held).status_code == 200
            await drained(astack, c)
    run(scenario())

# -- sync_config on a running deployment ----------------------------------------------------------
def test_sync_config_of_an_unchanged_file_succeeds_while_models_are_busy(astack, tmp_path):
    """An unchanged file is applied (exit 0, nothing updated) while ``fb`` is loaded and running a held
    request with another queued behind it."""
    same = config_file(astack, tmp_path, "same", lambda cfg: None)

    async def scenario():
        async with mclient(astack, None, timeout=MODEL_S) as c:
            held = asyncio.create_task(task(c, "fb", barrier="sync-same"))
            await asyncio.to_thread(astack.wait_arrived, "sync-same", astack.arrived("sync-same") + 1)
            behind = asyncio.create_task(task(c, "fb"))
            await asyncio.sleep(0.3)
            done = await asyncio.to_thread(sync, astack, same)
            astack.release("sync-same")
            assert (await held).status_code == 200 and (await behind).status_code == 200
            return done
    done = run(scenario())
    assert done.returncode == 0, done.stderr
    assert "updated []" in done.stdout and "removed []" in done.stdout, done.stdout


def test_sync_config_refuses_a_loading_model_and_a_removed_loaded_model_writing_nothing(astack, token, tmp_path):
    """A model whose load is held on its barrier (``fl``) and a loaded model the file removes (``fb``) are
    in use: exit 1, the model named, no registration, audit row or published entry written; the load then
    completes with the old configuration."""
    changed = config_file(astack, tmp_path, "changed-fl", lambda cfg: cfg["models"][1]["load_options"].update(
        version="changed"))
    removed = config_file(astack, tmp_path, "removed-fb", lambda cfg: cfg["models"].pop(0))

    async def scenario():
        async with mclient(astack, token, timeout=MODEL_S) as c:
            arrived = astack.arrived("L")
            loading = asyncio.create_task(task(c, "fl"))
            await asyncio.to_thread(astack.wait_arrived, "L", arrived + 1)
            before = written_state(astack)
            refused = await asyncio.to_thread(sync, astack, changed)
            after = written_state(astack)
            gone = await asyncio.to_thread(sync, astack, removed)
            after_removed = written_state(astack)
            astack.release("L")
            resp = await loading
            assert resp.status_code == 200 and resp.json()["config_version"] == "v0", resp.text
            await unload(c, "fl")
            return before, refused, after, gone, after_removed
    before, refused, after, gone, after_removed = run(scenario())
    assert refused.returncode == 1 and "['fl']" in refused.stderr and "Nothing was written" in refused.stderr, \
        (refused.stdout, refused.stderr)
    assert gone.returncode == 1 and "['fb']" in gone.stderr, (gone.stdout, gone.stderr)
    assert before == after == after_removed


def test_sync_config_may_take_over_an_api_registration_identical_to_the_file(astack, token, tmp_path):
    """A model registered through the API (``api1``, loaded) that the file now lists with the same
    configuration: the refusal (if any) names it and writes nothing; once it is unloaded the file is applied
    and the model's source becomes the config file."""
    entry = fx("api1", 1, version="a1")
    listed = config_file(astack, tmp_path, "listed", lambda cfg: cfg["models"].append(entry))

    async def scenario():
        async with mclient(astack, token, timeout=MODEL_S) as op:
            resp = await within(op.post("/v1/models/load", json=entry), MODEL_S)
            assert resp.status_code == 200 and resp.json()["loaded"] is True, resp.text
            before = written_state(astack)
            first = await asyncio.to_thread(sync, astack, listed)
            if first.returncode == 1:
                assert "['api1']" in first.stderr and written_state(astack) == before, first.stderr
                await unload(op, "api1")
                second = await asyncio.to_thread(sync, astack, listed)
                assert second.returncode == 0, second.stderr
            # restore the module's file (api1 removed again: it is config-sourced now and idle)
            await unload(op, "api1")
            restore = await asyncio.to_thread(sync, astack, astack.log_path.parent / "server.json")
            assert restore.returncode == 0, restore.stderr
            return first
    run(scenario())


# -- a frozen worker finishing a load whose claim was ended ----------------------------------------
def test_a_worker_frozen_past_liveness_during_a_load_is_recorded_once_and_the_model_loads_again(astack):
    """SIGSTOP the worker while it holds ``fl``'s load at its barrier, for longer than the liveness TTL:
    the waiting request gets 503 ``worker_lost``; SIGCONT and release: exactly one failed ``load`` row,
    state ``unloaded`` in the database and in Redis; the next request loads again and is served."""
    async def scenario():
        async with mclient(astack, None, timeout=MODEL_S) as c:
            assert entry_of(astack, "fl")["state"] == "unloaded"
            rows0 = load_rows(astack, "fl")
            pid = worker_pid(astack)
            arrived = astack.arrived("L")
            waiting = asyncio.create_task(task(c, "fl", busy_timeout_ms=0))
            await asyncio.to_thread(astack.wait_arrived, "L", arrived + 1)
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                resp = await within(waiting, 25)
                await asyncio.sleep(max(0.0, 11.0 - (time.monotonic() - stopped)))
            finally:
                os.kill(pid, signal.SIGCONT)
            assert error_of(resp, (503,))["code"] == "worker_lost", resp.text
            astack.release("L")
            await asyncio.sleep(3.0)  # the woken worker finishes the stale load and beats again
            new_rows = load_rows(astack, "fl")[len(rows0):]
            assert [o for o, _ in new_rows] == ["failed"], new_rows
            assert db_state(astack, "fl") == "unloaded"
            assert entry_of(astack, "fl")["state"] == "unloaded"
            again = asyncio.create_task(task(c, "fl"))
            await asyncio.to_thread(astack.wait_arrived, "L", arrived + 2)
            astack.release("L")
            resp = await again
            assert resp.status_code == 200, resp.text
            assert [o for o, _ in load_rows(astack, "fl")[len(rows0):]] == ["failed", "ok"]
            assert db_state(astack, "fl") == "ready"
    run(scenario())


def wait_for_live_worker(stack, timeout_s: float = 60.0) -> None:
    """Wait until the stack has a worker whose liveness key exists (``serve`` restarts a killed one)."""
    deadline = time.monotonic() + timeout_s
    while not live_workers(stack):
        assert time.monotonic() < deadline, "no live worker"
        time.sleep(0.2)


def test_the_database_follows_redis_when_a_worker_stops_beating_with_an_idle_pool(astack):
    """R7.4: the worker freezes (SIGSTOP) past its liveness TTL while ``fb``'s pool is idle on it and no
    request comes: the database stops saying ``ready`` within the TTL plus a few seconds (serve settles
    the lost pool: state ``unloaded``, ``last_error`` naming the worker, an ``unload`` row), as Redis and
    the status API say; after SIGCONT the eager ``fb`` loads again by itself and is served."""
    async def scenario():
        async with mclient(astack, None, timeout=MODEL_S) as c:
            assert (await task(c, "fb")).status_code == 200
            assert db_state(astack, "fb") == "ready"
            pid = worker_pid(astack)
            os.kill(pid, signal.SIGSTOP)
            stopped = time.monotonic()
            try:
                while db_state(astack, "fb") == "ready":
                    assert time.monotonic() - stopped < 10 + 5, "the database still says ready"
                    await asyncio.sleep(0.2)
                settled_after_s = time.monotonic() - stopped
                assert entry_of(astack, "fb")["state"] == "unloaded"
            finally:
                os.kill(pid, signal.SIGCONT)
            assert db_state(astack, "fb") == "unloaded" and settled_after_s > 8, settled_after_s
            row = astack.sql("SELECT last_error FROM registry_modelregistration WHERE model_id = 'fb'")[0][0]
            assert "stopped beating" in row, row
            deadline = time.monotonic() + 30
            while db_state(astack, "fb") != "ready":  # eager: serve loads it again once the worker beats
                assert time.monotonic() < deadline, "fb was not loaded again"
                await asyncio.sleep(0.2)
            assert (await task(c, "fb")).status_code == 200
    run(scenario())


def _unload_fl(stack, token):
    async def scenario():
        async with mclient(stack, token, timeout=MODEL_S) as op:
            if entry_of(stack, "fl")["state"] != "unloaded":
                await unload(op, "fl")
    run(scenario())


# -- serve forgets a killed worker -------------------------------------------------------------------
def test_a_worker_killed_during_a_held_load_ends_it_for_every_caller_and_records_it(astack, token):
    """kill -9 the worker while it holds ``fl``'s load at its barrier with two more callers waiting on
    that load: every caller gets 503 ``worker_lost`` within 3 s, /v1/models says unloaded, the database
    says so too (not ``loading``) with exactly one failed ``load`` row (docs/operations.md: a load whose
    claim was ended is recorded by whoever ended it); the replacement loads it on the next request."""

    async def scenario():
        async with mclient(astack, None, timeout=MODEL_S) as c:
            rows0 = load_rows(astack, "fl")
            pid = worker_pid(astack)
            arrived = astack.arrived("L")
            callers = [asyncio.create_task(task(c, "fl", busy_timeout_ms=0))]
            await asyncio.to_thread(astack.wait_arrived, "L", arrived + 1)
            callers += [asyncio.create_task(task(c, "fl", busy_timeout_ms=0)) for _ in range(2)]
            await asyncio.sleep(0.5)
            os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            answers = await within(asyncio.gather(*callers), 20)
            took = time.monotonic() - killed
            codes = [error_of(a, (503,))["code"] for a in answers]
            return rows0, codes, took, arrived
    rows0, codes, took, arrived = run(scenario())
    assert codes == ["worker_lost"] * 3, codes
    assert took < 3.0, took
    assert entry_of(astack, "fl")["state"] == "unloaded"
    state, new_rows = db_state(astack, "fl"), load_rows(astack, "fl")[len(rows0):]

    async def reload():  # the replacement loads it again
        await asyncio.to_thread(wait_for_live_worker, astack)
        async with mclient(astack, None, timeout=MODEL_S) as c:
            again = asyncio.create_task(task(c, "fl"))
            await asyncio.to_thread(astack.wait_arrived, "L", arrived + 2)
            astack.release("L")
            resp = await again
            assert resp.status_code == 200, resp.text
    run(reload())
    assert db_state(astack, "fl") == "ready"
    assert (state, [o for o, _ in new_rows]) == ("unloaded", ["failed"]), (state, new_rows)


def test_a_worker_killed_during_a_run_unloads_once_and_sync_config_counts_the_model_free(astack, token, tmp_path):
    """kill -9 the worker while it runs a held ``fb`` request: the request gets 503 ``worker_lost``, /v1/models
    says unloaded, the database has exactly one new ``unload`` row (actor serve) and state ``unloaded``; the
    model of the dead worker is not in use, so sync_config applies a file changing it; the replacement loads
    it (new configuration) on the next request."""
    changed = config_file(astack, tmp_path, "changed-fb", lambda cfg: cfg["models"][0]["load_options"].update(
        version="after-kill"))

    async def scenario():
        async with mclient(astack, None, timeout=MODEL_S) as c:
            assert (await task(c, "fb")).status_code == 200
            unloads0 = astack.sql("SELECT count(*) FROM registry_lifecycleevent WHERE model_id='fb' AND event='unload'")
            pid = worker_pid(astack)
            held = asyncio.create_task(task(c, "fb", barrier="kill-run"))
            await asyncio.to_thread(astack.wait_arrived, "kill-run", astack.arrived("kill-run") + 1)
            os.kill(pid, signal.SIGKILL)
            resp = await within(held, 15)
            assert error_of(resp, (503,))["code"] == "worker_lost", resp.text
            assert entry_of(astack, "fb")["state"] == "unloaded"
            await drained(astack, c, probe=False)
            unloads = astack.sql("SELECT count(*) FROM registry_lifecycleevent WHERE model_id='fb' AND event='unload'")
            assert unloads[0][0] - unloads0[0][0] == 1, (unloads0, unloads)
            assert db_state(astack, "fb") == "unloaded"
            done = await asyncio.to_thread(sync, astack, changed)
            assert done.returncode == 0, done.stderr
            await asyncio.to_thread(wait_for_live_worker, astack)
            resp = await task(c, "fb")
            assert resp.status_code == 200 and resp.json()["config_version"] == "after-kill", resp.text
    try:
        run(scenario())
    finally:
        restore_module_config(astack, token)


def restore_module_config(stack, token) -> None:
    """Apply the module's own ``server.json`` again (``fb`` unloaded first: a loaded model the file changes
    is in use and sync_config would refuse it), then load ``fb`` as the other tests expect it."""
    async def unload_fb():
        async with mclient(stack, token, timeout=MODEL_S) as op:
            if entry_of(stack, "fb")["state"] != "unloaded":
                await unload(op, "fb")
    wait_for_live_worker(stack)
    run(unload_fb())
    done = sync(stack, stack.log_path.parent / "server.json")
    assert done.returncode == 0, done.stderr
