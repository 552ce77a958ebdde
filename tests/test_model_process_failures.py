"""Failures around the models' own processes (``model_processes``, ``inference.worker.pool_process``) that
the isolation tests (``tests/test_model_processes.py``) do not provoke, and a registration whose modes
leave a speech model nothing to serve. Real ``manage.py serve --parallel-jobs``, real Celery worker,
Redis db 4, PostgreSQL, the packaged Piper voice beside fixture models.

- The worker's fork server (the process every model's process is forked from) killed: no model's
  process ended, so their runs in flight and their next requests are answered as before.
- A raw-audio speech response (no SSE) whose model's process is killed mid-stream ends at once (a
  short body or a broken connection), not when the client's own timeout runs out.
- A speech registration with ``modes: ["offline"]`` is either refused or serves speech.
- A registration with the largest ``max_run_ms`` it may state serves an input longer than 30 s (the
  deadline scales past what a pipe's poll accepts), and no later request of that model is answered
  with the samples of an earlier one.
- An unload of a model whose process is frozen (SIGSTOP: a native hang) while idle finishes within its
  run deadline plus a few seconds, as for a model wedged in a run (R3.6), not after ``CLOSE_WAIT_S``.
- (Expected to fail: no load has a deadline) a model whose process froze during its load: the request
  waiting for it and an unload are answered within bounded time.
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import numpy as np
import psutil
import pytest

from inference.runtime.context import KEYS

from .support.audio import load_speech, wav_bytes
from .support.bounds import MODEL_S, QUICK_S, run, until
from .support.clients import body, mclient, operator_token, post, without_timing
from .support.stacks import FIXTURE_ENV, entry_of, fx, live_workers, run_stack, worker_pid

pytestmark = pytest.mark.stack

MODELS = [
    fx("fx", slots=2),
    fx("fx-idle"),
    {**fx("fx-later"), "lazy": True},
    {**fx("fx-frozen"), "max_run_ms": 1500},
    {**fx("fx-load-frozen", load_barrier="load-frozen"), "lazy": True},
    {"id": "vad", "family": "silero_vad", "task": "vad"},
    {"id": "vad-unhurried", "family": "silero_vad", "task": "vad", "max_run_ms": 2_147_483_647},
    {"id": "piper", "family": "piper", "task": "tts", "lazy": True},
]
LONG_TEXT = " ".join(f"This is sentence number {n} of a long answer that keeps the voice busy." for n in range(40))


@pytest.fixture(scope="module")
def stack(tmp_path_factory):
    yield from run_stack(tmp_path_factory.mktemp("process_failures"), MODELS, redis_db=4, name="process_failures",
                         parallel=True, extra_env=FIXTURE_ENV,
                         extra_config={"model_processes": True, "ui_management": True})


@pytest.fixture(scope="module")
def token(stack) -> str:
    return operator_token(stack)


def pool_pids(stack) -> dict[str, int]:
    """Model id -> process id of each model's process on the stack's one worker (``Keys.pool_pids``)."""
    (host,) = live_workers(stack)
    return {model: int(pid) for model, pid in stack.redis.hgetall(KEYS.pool_pids(host)).items()}


def served(stack, payload: dict) -> None:
    """Send ``payload`` to ``/v1/tasks/run`` until it is answered 200 (a model another test left failed
    is loaded again once its backoff is over, R6.7); AssertionError after ``QUICK_S``."""
    deadline = time.monotonic() + QUICK_S
    with stack.client() as c:
        while (resp := c.post("/v1/tasks/run", json=payload)).status_code != 200:
            assert resp.status_code == 503 and time.monotonic() < deadline, resp.text
            time.sleep(0.25)


def fork_server(stack) -> psutil.Process:
    """The worker's ``multiprocessing`` fork server (its child whose command line runs ``forkserver``)."""
    found = [child for child in psutil.Process(worker_pid(stack)).children()
             if "forkserver" in " ".join(child.cmdline())]
    assert len(found) == 1, found
    return found[0]


def test_killing_the_fork_server_leaves_every_models_process_and_its_runs_alone(stack):
    """SIGKILL of the fork server (about 230 MB resident: the OOM killer may pick it) while a run of
    ``fx`` is held in its model's process and ``fx-idle`` is loaded and idle: no model's process ended,
    so the held run is answered 200 once released, ``fx-idle`` answers its next request from the same
    process, and both models still read ``ready``; a model loaded afterwards gets a process from a new
    fork server."""
    async def scenario():
        async with mclient(stack, None, timeout=MODEL_S) as c:
            for model in ("fx", "fx-idle"):
                await asyncio.to_thread(served, stack, body(model))
            before = pool_pids(stack)
            held = asyncio.create_task(post(c, "fx", barrier="held-over-fork-server"))
            await until(lambda: stack.arrived("held-over-fork-server") == 1, QUICK_S)
            fork_server(stack).kill()
            await asyncio.sleep(0.5)
            alive = {model: psutil.pid_exists(pid) for model, pid in before.items()}
            stack.release("held-over-fork-server")
            resp, _, _ = await held
            idle = await c.post("/v1/tasks/run", json=body("fx-idle"))
            later = await c.post("/v1/tasks/run", json=body("fx-later"))  # its load needs a new fork server
            return before, alive, resp, idle, later

    before, alive, held, idle, later = run(scenario())
    assert later.status_code == 200, later.text
    assert held.status_code == 200, (alive, held.text)
    assert idle.status_code == 200, (alive, idle.text)
    for model in ("fx", "fx-idle"):
        assert entry_of(stack, model)["state"] == "ready", entry_of(stack, model)
        assert pool_pids(stack)[model] == before[model]
        assert stack.counters(model) == {"leases": 0, "queued": 0}


@pytest.mark.parametrize("response_format", ["wav", "mp3"])
def test_a_raw_speech_stream_whose_models_process_dies_ends_at_once(stack, response_format):
    """A speech response without SSE (``response_format`` wav or mp3, streamed sentence by sentence) whose
    model's process is SIGKILLed after its first bytes: its body ends within a few seconds of the kill
    (short, or with a broken connection: its headers were out), not when the client's read timeout
    (here 60 s) runs out; the lease is back and the next request is served."""
    served(stack, {"model": "piper", "request": {"text": "Warm up."}})  # the voice loaded before the clock starts

    async def scenario():
        pid = pool_pids(stack)["piper"]
        received, killed_at, outcome = 0, None, "complete"
        async with httpx.AsyncClient(base_url=stack.url, timeout=httpx.Timeout(MODEL_S, read=60)) as c:
            try:
                request = {"model": "piper", "input": LONG_TEXT, "voice": "joe", "response_format": response_format}
                async with c.stream("POST", "/v1/audio/speech", json=request) as resp:
                    assert resp.status_code == 200
                    async for chunk in resp.aiter_bytes():
                        received += len(chunk)
                        if killed_at is None:
                            os.kill(pid, signal.SIGKILL)
                            killed_at = time.monotonic()
            except httpx.ReadTimeout:
                outcome = "read timeout"
            except httpx.TransportError as exc:
                outcome = f"broken: {exc!r}"
        return received, outcome, time.monotonic() - (killed_at or time.monotonic())

    received, outcome, after_kill_s = run(scenario())
    print(f"\n{response_format}: {received} bytes, {outcome}, ended {after_kill_s:.1f} s after the kill")
    assert outcome != "read timeout" and after_kill_s < 10, (outcome, after_kill_s)
    stack.wait_idle("piper", timeout_s=10)
    served(stack, {"model": "piper", "request": {"text": "Again."}})  # after the crash's backoff (R6.7)


def test_a_speech_registration_with_only_the_offline_mode_is_refused_or_serves_speech(stack, token):
    """``modes: ["offline"]`` for a piper registration: the management API either refuses it (400 naming
    ``modes``) or the registration it accepted serves speech (a ``/v1/tasks/run`` answered at once and
    ``POST /v1/audio/speech``): an accepted registration that refuses every request it can get is
    neither."""
    async def scenario():
        async with mclient(stack, token, timeout=MODEL_S) as c:
            registered = await c.post("/v1/models/load", json={
                "id": "piper-offline", "family": "piper", "task": "tts", "modes": ["offline"], "lazy": True})
            if registered.status_code != 200:
                return registered, None, None
            whole = await c.post("/v1/tasks/run", json={"model": "piper-offline", "request": {"text": "Hello there."}})
            speech = await c.post("/v1/audio/speech", json={
                "model": "piper-offline", "input": "Hello there.", "voice": "joe", "response_format": "wav"})
            return registered, whole, speech

    registered, whole, speech = run(scenario())
    if registered.status_code != 200:
        assert registered.status_code == 400 and registered.json()["error"]["param"] == "modes", registered.text
        return
    assert whole.status_code == 200, whole.text
    assert speech.status_code == 200, speech.text


def test_an_unload_of_a_model_whose_idle_process_is_frozen_finishes_within_its_deadline(stack, token):
    """``fx-frozen`` (``max_run_ms`` 1500) loaded and idle, its process stopped with SIGSTOP (what a hang in
    native code looks like from outside): ``POST /v1/models/unload`` answers 200 within the deadline plus
    10 s, the model reads ``unloaded`` and a request sent after the unload is served by a new process.
    (Measured before: 180 s, ``CLOSE_WAIT_S``, with every request behind the unload waiting.) The
    process is continued at the end whatever happened, so nothing stays frozen."""
    served(stack, body("fx-frozen"))
    pid = pool_pids(stack)["fx-frozen"]
    os.kill(pid, signal.SIGSTOP)
    try:
        async def scenario():
            async with mclient(stack, token, timeout=MODEL_S) as c:
                started = time.monotonic()
                try:
                    unload = await asyncio.wait_for(c.post("/v1/models/unload", json={"id": "fx-frozen"}), 1.5 + 10)
                except TimeoutError:
                    return None, time.monotonic() - started
                return unload, time.monotonic() - started

        unload, took = run(scenario())
    finally:
        if psutil.pid_exists(pid):
            os.kill(pid, signal.SIGCONT)
    assert unload is not None, f"the unload had not finished {took:.1f} s after it was sent"
    assert unload.status_code == 200, unload.text
    assert entry_of(stack, "fx-frozen")["state"] == "unloaded"
    with stack.client() as c:
        assert c.post("/v1/tasks/run", json=body("fx-frozen")).status_code == 200
    assert pool_pids(stack)["fx-frozen"] != pid


def test_the_largest_max_run_ms_serves_long_inputs_and_never_answers_with_another_requests_result(stack):
    """``vad-unhurried`` states ``max_run_ms`` 2147483647 (the largest accepted). A request of 31.5 s of
    speech scales that deadline past what the pipe's poll accepts (measured: 500 ``OverflowError:
    timeout is too large``, the samples already sent and the pipe put back with the reply unread).
    Then a request of the 3.5 s utterance must get its own answer, equal to ``vad``'s, not the result
    of the long request left on the pipe (measured: ``duration`` 31.545 and 9 segments)."""
    utterance = load_speech()[0]
    short = wav_bytes(utterance.samples, utterance.rate)
    long = wav_bytes(np.tile(utterance.samples, 9), utterance.rate)
    with stack.client() as c:
        expected = without_timing(c.post("/v1/tasks/run", json=body("vad", short)))
        served(stack, body("vad-unhurried", short))
        long_answer = c.post("/v1/tasks/run", json=body("vad-unhurried", long))
        time.sleep(1)  # the long run's samples were handed over: give its reply time to arrive
        answers = [without_timing(c.post("/v1/tasks/run", json=body("vad-unhurried", short))) for _ in range(2)]
    for answer in answers:
        assert {**answer, "model": "vad"} == expected, (answer.get("duration"), expected.get("duration"))
    assert long_answer.status_code == 200, long_answer.text
    stack.wait_idle("vad-unhurried", timeout_s=10)


@pytest.mark.xfail(strict=True, reason="a load has no deadline: ProcessPool.start waits for the model's process's "
                   "'ready' without a bound (the worker keeps renewing the load claim), and an unload waits for a "
                   "load in progress (R4.5), so a process frozen or hung in native code while loading wedges the "
                   "model's requests and its unload until the worker restarts")
def test_a_model_whose_process_freezes_during_its_load_answers_its_request_and_unloads_in_bounded_time(stack, token):
    """``fx-load-frozen``'s load held at a barrier in its new process, which is then stopped (SIGSTOP: what a
    hang in native code at load looks like) and the barrier released: the request that started the load
    (``busy_timeout_ms`` 3000) and a ``POST /v1/models/unload`` sent then must both be answered within 20 s.
    (Measured: neither was.) The process is continued at the end, so the load finishes and the unload
    runs."""
    async def scenario():
        async with mclient(stack, token, timeout=MODEL_S * 2) as c:
            request = asyncio.create_task(c.post("/v1/tasks/run", json={**body("fx-load-frozen"),
                                                                        "busy_timeout_ms": 3000}))
            await until(lambda: stack.arrived("load-frozen") == 1, QUICK_S)
            serving = set(pool_pids(stack).values())
            loading = [child for child in fork_server(stack).children() if child.pid not in serving]
            assert len(loading) == 1, loading
            loading[0].suspend()  # SIGSTOP
            try:
                stack.release("load-frozen")
                unload = asyncio.create_task(c.post("/v1/models/unload", json={"id": "fx-load-frozen"}))
                done, _ = await asyncio.wait({request, unload}, timeout=20)
            finally:
                loading[0].resume()  # SIGCONT: the load goes on to its end, then the unload
            await asyncio.gather(request, unload, return_exceptions=True)
            return request in done, unload in done

    request_answered, unload_answered = run(scenario())
    assert request_answered, "the request waiting for the frozen load had no answer after 20 s"
    assert unload_answered, "the unload had not finished 20 s after it was sent"
