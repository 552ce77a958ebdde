"""Each loaded model in a process of its own (``inference.worker.pool_process``): a crash or a run past its
deadline costs only that model. Real ``manage.py serve`` (legacy runtime), real Celery worker, Redis db 1,
PostgreSQL, real Silero VAD and Whisper models beside fixture models.

- A model's process killed (SIGKILL while a run is held in it, SIGSEGV while idle): its request in
  flight gets 503 ``model_crashed``, the model reads ``failed`` with ``last_error`` and one ``crash``
  audit row, its slot is free, the next request after the backoff reloads it; the other models on the
  same worker answer every request of the traffic around the kill exactly as before (same process ids,
  same answers; their latencies before and after are printed).
- A run held at a fixture barrier that is never released ends at its deadline (``max_run_ms``) with
  503 ``run_deadline``, its slot is back at once, and an unload of the wedged model finishes within
  the deadline plus a load.
"""
from __future__ import annotations

import asyncio
import os
import signal
import statistics
import time

import pytest

from inference.runtime.context import KEYS

from .support.audio import FIXTURES
from .support.bounds import MODEL_S, QUICK_S, run, until
from .support.clients import body, error_of, mclient, post, without_timing
from .support.stacks import FIXTURE_ENV, entry_of, events_of, fx, live_workers, run_stack

pytestmark = pytest.mark.stack

DEADLINE_MS = 1500
MODELS = [
    {"id": "vad", "family": "silero_vad"},
    {"id": "asr", "family": "whisper"},
    {"id": "vad-victim", "family": "silero_vad"},
    fx("fx-victim"),
    {**fx("fx-wedged"), "max_run_ms": DEADLINE_MS},
]
SPEECH = (FIXTURES / "librispeech_test_clean_6930-75918-0000.wav").read_bytes()


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from run_stack(tmp_path_factory.mktemp("isolated"), MODELS, redis_db=1, name="isolated",
                         extra_env=FIXTURE_ENV, extra_config={"model_processes": True})


def pool_pids(stack) -> dict[str, int]:
    """Model id -> process id of each model's process on the stack's one worker (``Keys.pool_pids``)."""
    (host,) = live_workers(stack)
    return {model: int(pid) for model, pid in stack.redis.hgetall(KEYS.pool_pids(host)).items()}


async def _traffic(client, model: str, data: bytes, stop: asyncio.Event, log: list) -> None:
    """Requests to ``model`` one after another until ``stop``: ``(sent at, seconds, status, answer)`` each."""
    while not stop.is_set():
        started = time.monotonic()
        resp = await client.post("/v1/tasks/run", json=body(model, data))
        log.append((started, time.monotonic() - started, resp.status_code, without_timing(resp)))


def _latency_ms(log: list, before: bool, at: float) -> float:
    return statistics.median(s for t, s, _, _ in log if (t < at) == before) * 1000


def test_killing_one_models_process_changes_nothing_for_the_other_models(stack):
    """R7.6: SIGKILL of ``fx-victim``'s process while a run is held in it, under steady traffic to ``vad``
    and ``asr`` (real models) on the same worker: the held request gets 503 ``model_crashed``; the
    victim reads ``failed`` with its ``last_error`` and a ``crash`` row, holds no lease, and the next
    request after the backoff reloads it in a new process; every request of the other two models
    before, during and after the kill is answered 200 with the same answer, by the same processes.
    Then ``vad-victim`` (a real model) gets SIGSEGV while idle: failed, then reloaded, same answer."""
    async def scenario():
        async with mclient(stack, None, timeout=MODEL_S) as c:
            expected = {m: without_timing(await c.post("/v1/tasks/run", json=body(m, SPEECH)))
                        for m in ("vad", "asr", "vad-victim")}
            before = pool_pids(stack)
            stop, logs = asyncio.Event(), {"vad": [], "asr": []}
            loops = [asyncio.create_task(_traffic(c, m, SPEECH, stop, logs[m])) for m in logs]
            held = asyncio.create_task(post(c, "fx-victim", barrier="victim-held"))
            await until(lambda: stack.arrived("victim-held") == 1, QUICK_S)
            await until(lambda: all(len(log) >= 3 for log in logs.values()), MODEL_S)  # traffic before the kill
            killed_at = time.monotonic()
            os.kill(before["fx-victim"], signal.SIGKILL)
            resp, _, answered = await held
            await until(lambda: all(sum(t > killed_at for t, _, _, _ in log) >= 3 for log in logs.values()),
                        MODEL_S)  # traffic after the kill
            stop.set()
            await asyncio.gather(*loops)
            return expected, before, logs, resp, answered - killed_at, killed_at

    expected, before, logs, resp, answer_s, killed_at = run(scenario())
    assert resp.status_code == 503 and error_of(resp, (503,))["code"] == "model_crashed", resp.text
    assert "SIGKILL" in resp.json()["error"]["message"]
    print(f"\nthe held request was answered {answer_s * 1000:.0f} ms after the kill")
    for model, log in logs.items():
        assert [status for _, _, status, _ in log] == [200] * len(log)
        assert all(answer == expected[model] for _, _, _, answer in log), model
        print(f"{model}: {len(log)} requests, median latency {_latency_ms(log, True, killed_at):.1f} ms before "
              f"the kill, {_latency_ms(log, False, killed_at):.1f} ms after")
    entry = entry_of(stack, "fx-victim")
    assert entry["state"] == "failed" and "SIGKILL" in entry["last_error"], entry
    assert stack.counters("fx-victim") == {"leases": 0, "queued": 0}
    assert ("crash", "failed") in [(e, o) for e, o, _ in events_of(stack, "fx-victim")]
    after = pool_pids(stack)
    assert "fx-victim" not in after
    assert {m: after[m] for m in ("vad", "asr")} == {m: before[m] for m in ("vad", "asr")}

    time.sleep(1.1)  # the first failure's backoff (1 s, R6.7)
    with stack.client() as c:
        assert c.post("/v1/tasks/run", json=body("fx-victim")).status_code == 200
        assert pool_pids(stack)["fx-victim"] != before["fx-victim"]
        os.kill(before["vad-victim"], signal.SIGSEGV)
        until_failed = time.monotonic() + QUICK_S
        while entry_of(stack, "vad-victim")["state"] != "failed":
            assert time.monotonic() < until_failed, entry_of(stack, "vad-victim")
            time.sleep(0.05)
        assert "SIGSEGV" in entry_of(stack, "vad-victim")["last_error"]
        time.sleep(1.1)
        again = c.post("/v1/tasks/run", json=body("vad-victim", SPEECH))
        assert again.status_code == 200 and without_timing(again) == expected["vad-victim"]
        assert entry_of(stack, "vad")["state"] == "ready" and pool_pids(stack)["vad"] == before["vad"]


def test_a_run_held_past_its_deadline_ends_with_its_slot_back_and_an_unload_finishes(stack):
    """R3.6: a run of ``fx-wedged`` (``max_run_ms`` 1500) held at a barrier nobody releases gets 503
    ``run_deadline`` at its deadline, its lease is back at once and the model reads ``failed``; after
    the backoff the next request reloads it; then, with a run wedged again, a management unload
    (which waits for that run's lease) finishes within the deadline plus a load, and the model reads
    ``unloaded``."""
    with stack.client() as c:
        started = time.monotonic()
        resp = c.post("/v1/tasks/run", json=body("fx-wedged", barrier="never-released"))
        elapsed = time.monotonic() - started
    assert error_of(resp, (503,))["code"] == "run_deadline", resp.text
    assert DEADLINE_MS / 1000 <= elapsed < DEADLINE_MS / 1000 + 2, elapsed
    assert stack.counters("fx-wedged") == {"leases": 0, "queued": 0}
    entry = entry_of(stack, "fx-wedged")
    assert entry["state"] == "failed" and "deadline of 1500 ms" in entry["last_error"], entry

    time.sleep(1.1)  # the backoff of the first failure (R6.7)

    async def scenario():
        async with mclient(stack, None, timeout=MODEL_S) as c:
            wedged = asyncio.create_task(post(c, "fx-wedged", barrier="wedged-again"))
            await until(lambda: stack.arrived("wedged-again") == 1, QUICK_S)
            started = time.monotonic()
            unload = await asyncio.to_thread(stack.manage, "unload_model", "fx-wedged")
            took = time.monotonic() - started
            resp, _, _ = await wedged
            return unload, took, resp

    unload, took, wedged = run(scenario())
    assert unload.returncode == 0, unload.stderr
    assert error_of(wedged, (503,))["code"] == "run_deadline"
    # The command starts Django (1.5-3 s), then waits for the wedged run's deadline; no load is needed.
    assert took < DEADLINE_MS / 1000 + 8, took
    assert entry_of(stack, "fx-wedged")["state"] in ("unloaded", "failed")
    assert stack.counters("fx-wedged") == {"leases": 0, "queued": 0}
    assert "fx-wedged" not in pool_pids(stack)
