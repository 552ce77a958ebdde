"""The README's first command: ``manage.py serve`` with no database or Redis configured."""
from __future__ import annotations

import asyncio
import base64
import io
import json
import os
import signal
import time

import httpx
import numpy as np
import psutil
import pytest
import soundfile
from websockets.exceptions import ConnectionClosed
from websockets.sync.client import connect as ws_connect

from audiosite.supervision import RestartBackoff
from inference.runtime.context import KEYS

from .support.audio import wav_bytes
from .support.bounds import MODEL_S, QUICK_S, run, until, within
from .support.clients import body, mclient
from .support.processes import (ROOT, embedded_env, free_port, kill_process_tree, mode_of, start_embedded,
                                start_serve)
from .support.stacks import FIXTURE_ENV, entry_of, events_of, live_workers, run_stack, worker_pids


@pytest.mark.stack
def test_serve_on_the_embedded_default_and_stop_on_ctrl_c(tmp_path):
    port = free_port()
    proc, log_path = start_embedded(tmp_path, "--port", str(port))
    children: list[psutil.Process] = []
    try:
        output = log_path.read_text()
        assert f"audiosite listening on http://127.0.0.1:{port}" in output
        assert "embedded redis-server" in output and "sqlite3" in output
        assert (tmp_path / "var" / "audiosite.sqlite3").exists()
        # Created by serve under its umask 0o077: the var folder and the SQLite files are the owner's only.
        assert mode_of(tmp_path / "var") == 0o700
        for name in ("audiosite.sqlite3", "audiosite.sqlite3-wal", "audiosite.sqlite3-shm", "secret_key"):
            assert mode_of(tmp_path / "var" / name) == 0o600, name
        children = psutil.Process(proc.pid).children(recursive=True)
        names = " ".join(" ".join(c.cmdline()) for c in children)
        assert "redis-server" in names and "celery" in names and "audiosite.web" in names

        sample = ROOT / "samples" / "librispeech_test_clean_6930-75918-0000.wav"
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            resp = c.post("/v1/audio/transcriptions", data={"model": "whisper-tiny.en"},
                          files={"file": (sample.name, sample.read_bytes())})
            assert resp.status_code == 200, resp.text
            assert "returned to its place amidst the tents" in resp.json()["text"].lower()
            vad = c.post("/v1/tasks/run", json={"model": "silero-vad", "request": {
                "audio_base64": __import__("base64").b64encode(sample.read_bytes()).decode()}})
            assert vad.status_code == 200 and vad.json()["segments"]
            listed = c.get("/v1/models").json()["data"]
            assert {m["id"]: m["state"] for m in listed if "alias_of" not in m} == {
                "whisper-tiny.en": "ready", "silero-vad": "ready", "piper-joe": "ready",
                "speaker-embedding": "unloaded", "basic-pitch": "unloaded", "diarization": "unloaded"}
            assert {m["id"]: m["alias_of"] for m in listed if "alias_of" in m} == {
                "whisper-1": "whisper-tiny.en", "gpt-4o-transcribe": "whisper-tiny.en",
                "gpt-4o-mini-transcribe": "whisper-tiny.en", "tts-1": "piper-joe", "tts-1-hd": "piper-joe",
                "gpt-4o-mini-tts": "piper-joe"}
            # The README's speech example on the shipped default: OpenAI's model and voice names, mp3 by default.
            speech = c.post("/v1/audio/speech", json={"model": "tts-1", "voice": "alloy",
                                                       "input": "Hello from audiosite."})
            assert speech.status_code == 200 and speech.headers["content-type"] == "audio/mpeg"
            samples, rate = soundfile.read(io.BytesIO(speech.content))
            assert rate == 22050 and samples.ndim == 1 and len(samples) / rate > 0.5
            # The README's catalogue examples on the shipped default: the lazy models load on first use.
            other = ROOT / "samples" / "librispeech_test_other_7902-96591-0000.wav"
            embedded = c.post("/v1/tasks/run", json={"model": "speaker-embedding", "request": {
                "audio_base64": base64.b64encode(sample.read_bytes()).decode()}})
            assert embedded.status_code == 200 and embedded.json()["dimensions"] == 256, embedded.text
            a, _ = soundfile.read(sample)
            b, _ = soundfile.read(other)
            gap = np.zeros(12800)
            talk = io.BytesIO()
            soundfile.write(talk, np.concatenate([a, gap, b, gap, a, gap, b]), 16000, format="WAV")
            details = c.post("/v1/audio/transcriptions/details", data={
                "model": "whisper-tiny.en", "diarization_model": "diarization"},
                files={"file": ("talk.wav", talk.getvalue())})
            assert details.status_code == 200, details.text
            speakers = [w["speaker"] for w in details.json()["words"]]
            assert len(set(speakers)) == 2 and speakers[0] != speakers[-1], speakers

        # A realtime transcription session on the embedded default: its Channels layer lives on the
        # embedded Redis (unix socket and password); Ctrl-C closes the session with 1001 (R8.4).
        live = ws_connect(f"ws://127.0.0.1:{port}/v1/realtime?intent=transcription", open_timeout=30)
        assert json.loads(live.recv(timeout=30))["type"] == "session.created"
        live.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": 16000}, "turn_detection": None,
            "transcription": {"model": "whisper-tiny.en", "language": "en"}}}}}))
        pcm, pcm_rate = soundfile.read(sample, dtype="int16")
        assert pcm_rate == 16000
        live.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm.tobytes()).decode()}))
        live.send(json.dumps({"type": "input_audio_buffer.commit"}))
        while (event := json.loads(live.recv(timeout=60)))["type"] != \
                "conversation.item.input_audio_transcription.completed":
            assert event["type"] != "error", event
        assert "returned to its place amidst the tents" in event["transcript"].lower()

        proc.send_signal(signal.SIGINT)
        with pytest.raises(ConnectionClosed):
            while True:
                last = json.loads(live.recv(timeout=30))
        assert live.close_code == 1001 and last["error"]["code"] == "session_closed"
        assert proc.wait(timeout=60) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
        assert "audiosite stopped" in log_path.read_text()
    finally:
        kill_process_tree(proc, also=children)


@pytest.mark.stack
def test_serve_restarts_a_web_process_that_dies_with_the_callers_overrides(tmp_path):
    """If the web process dies, serve starts a new one and keeps running (docs/operations.md,
    "Restarts"); the new one gets the same environment: the caller's own AUDIOSITE_CONFIG_OVERRIDES
    (merged under serve's flags; they used to be replaced, found by a new-user run). Ctrl-C then
    stops everything cleanly."""
    config = tmp_path / "server.json"
    config.write_text('{"backend": "cpu", "lazy_load": true, "worker_restart_delay_ms": 200, '
                      '"models": [{"id": "vad", "family": "silero_vad"}]}')
    port = free_port()
    env = embedded_env(tmp_path, AUDIOSITE_CONFIG_OVERRIDES='{"max_request_body_bytes": 2000}')
    proc, log_path = start_embedded(tmp_path, "--config", str(config), "--port", str(port), env=env)
    children: list[psutil.Process] = []

    def too_big() -> httpx.Response:
        return httpx.post(f"http://127.0.0.1:{port}/v1/tasks/run", content=b"x" * 3000,
                          headers={"content-type": "application/json"}, timeout=QUICK_S)

    try:
        first = too_big()
        assert first.status_code == 413 and "2000" in first.json()["error"]["message"], first.text
        children = psutil.Process(proc.pid).children(recursive=True)
        web = next(c for c in children if "audiosite.web" in " ".join(c.cmdline()))
        web.kill()
        deadline = time.monotonic() + 90
        while "started web process" not in log_path.read_text():
            assert proc.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
            time.sleep(0.2)
        while True:
            try:
                again = too_big()
                break
            except httpx.TransportError:
                assert time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.2)
        assert again.status_code == 413 and "2000" in again.json()["error"]["message"], again.text
        assert f"web process (pid {web.pid}) exited with code -9 (SIGKILL)" in log_path.read_text()
        children = psutil.Process(proc.pid).children(recursive=True)
        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0, log_path.read_text()[-3000:]
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        kill_process_tree(proc, also=children)


def test_quick_restart_after_a_killed_worker_reloads_instead_of_dispatching_to_the_dead_one(tmp_path):
    """R7.4: serve and its worker are killed with SIGKILL (so nobody cleans up: the worker's liveness
    key outlives it by up to 10 s) and serve is restarted at once on the same Redis and database: the
    restart forgets the dead local worker, so the first request loads on the new worker and answers
    200 promptly (not 503 worker_lost)."""
    models = [{"id": "rs", "family": "fixture", "slots": 1}]
    stacks = run_stack(tmp_path, models, redis_db=8, name="restart", parallel=True,
                       extra_env={"AUDIOSITE_ENABLE_FIXTURE_FAMILY": "1"})
    stack = next(stacks)
    try:
        silence = wav_bytes(np.zeros(1600, dtype=np.float32), 16000)
        body = {"model": "rs", "request": {"audio_base64": base64.b64encode(silence).decode(), "options": {}}}
        with stack.client() as c:
            assert c.post("/v1/tasks/run", json=body).status_code == 200
        children = psutil.Process(stack.proc.pid).children(recursive=True)
        stack.proc.kill()  # first serve, so that it cannot restart the worker or forget it
        stack.proc.wait(timeout=QUICK_S)
        for child in children:  # its children run in sessions of their own and outlive it
            child.kill()
        psutil.wait_procs(children, timeout=QUICK_S)
        assert stack.redis.keys(KEYS.worker_live_prefix + "*"), "the dead worker's liveness key should still be there"
        log_path = tmp_path / "serve2.log"
        second = start_serve(["--config", str(tmp_path / "server.json"), "--parallel-jobs"], env=stack.env,
                             log_path=log_path, timeout_s=120)
        try:
            started = time.monotonic()
            with stack.client() as c:
                resp = c.post("/v1/tasks/run", json=body)
            assert resp.status_code == 200, resp.text
            assert time.monotonic() - started < 5
            assert b"forgot worker" in log_path.read_bytes()
        finally:
            second.send_signal(signal.SIGINT)
            second.wait(timeout=60)
    finally:
        next(stacks, None)


def test_restart_backoff_doubles_per_quick_exit_up_to_its_ceiling_and_resets_after_a_long_uptime():
    """The restart delay of serve's supervisor (audiosite.supervision): 1 s after the first exit,
    doubling for each exit after less than 60 s up, at most 30 s; an exit after 60 s or more up
    starts from 1 s again."""
    backoff = RestartBackoff(1.0, 30.0)
    assert [backoff.next_delay_s(uptime_s=5) for _ in range(7)] == [1, 2, 4, 8, 16, 30, 30]
    assert backoff.next_delay_s(uptime_s=60) == 1
    assert backoff.next_delay_s(uptime_s=59.9) == 2


def _worker_hostname(stack, pid: int) -> str:
    return next(host for host, recorded in live_workers(stack).items() if int(recorded) == pid)


def test_a_killed_worker_is_restarted_while_http_goes_on_and_its_client_gets_worker_lost(tmp_path):
    """R7.4 over HTTP with a real ``kill -9``: a request held on the worker (a fixture
    barrier) when the worker is killed gets 503 ``worker_lost`` (not a reset), within one watchdog
    period (10 s) because serve forgets the dead worker at once; serve keeps serving and logs the
    exit; ``/health`` says ``degraded`` (503, ``workers`` 0) until the replacement, started after
    the first backoff delay (1 s), beats; then the next request loads the model on the replacement
    (a new pool on the new hostname) and succeeds. A request to another model sent while ``/health``
    says ``degraded`` (restart pending) is not refused: it waits for the replacement and is served
    by it. The lost pools are recorded in the database."""
    models = [{"id": "held", "family": "fixture"}, {"id": "other", "family": "fixture"}]
    stacks = run_stack(tmp_path, models, redis_db=8, name="sup1", extra_env=FIXTURE_ENV)
    stack = next(stacks)
    try:
        [old_pid] = worker_pids(stack)
        old_host = _worker_hostname(stack, old_pid)
        with stack.client() as c:
            health = c.get("/health")
            assert health.status_code == 200 and health.json()["status"] == "ok" and health.json()["workers"] == 1
            first = c.post("/v1/tasks/run", json=body("held"))
            assert first.status_code == 200, first.text

        async def scenario():
            async with mclient(stack, None, timeout=MODEL_S) as c:
                held = asyncio.create_task(c.post("/v1/tasks/run", json=body("held", barrier="doomed")))
                held.add_done_callback(lambda _: answered_at.append(time.monotonic()))
                await until(lambda: stack.arrived("doomed") == 1, QUICK_S)
                os.kill(old_pid, signal.SIGKILL)
                killed_at = time.monotonic()
                seen = []  # (seconds after the kill, /health status code, body)
                during = None  # a request sent while no worker is alive and the restart is pending
                while not (seen and seen[-1][1] == 200 and during is not None):
                    assert time.monotonic() - killed_at < 120, seen[-5:]
                    resp = await c.get("/health")
                    seen.append((time.monotonic() - killed_at, resp.status_code, resp.json()))
                    if resp.status_code == 503 and during is None:
                        during = asyncio.create_task(c.post("/v1/tasks/run", json=body("other")))
                    await asyncio.sleep(0.05)
                answer = await within(held, QUICK_S)
                return answer, answered_at[0] - killed_at, seen, await within(during, QUICK_S)
        answered_at: list[float] = []
        answer, answer_after_s, seen, during = run(scenario())
        assert answer.status_code == 503, answer.text
        assert answer_after_s < 15, "the waiter should notice within one watchdog period (10 s)"
        error = answer.json()["error"]
        assert (error["type"], error["code"]) == ("server_busy", "worker_lost")
        degraded = [(t, b) for t, code, b in seen if code == 503]
        assert degraded and all(b["status"] == "degraded" and b["workers"] == 0 for _, b in degraded)
        assert degraded[0][0] < 2, "serve should forget the dead worker at once"
        assert degraded[-1][0] >= 1, "the replacement is started after the first backoff delay"
        assert seen[-1][2]["status"] == "ok" and seen[-1][2]["workers"] == 1
        assert stack.proc.poll() is None, "serve must keep running"

        [new_pid] = worker_pids(stack)
        new_host = _worker_hostname(stack, new_pid)
        assert new_pid != old_pid and new_host != old_host
        with stack.client() as c:
            again = c.post("/v1/tasks/run", json=body("held"))
            assert again.status_code == 200, again.text
            assert again.json()["pool_id"] != first.json()["pool_id"]
            assert c.get("/v1/models/held").json()["state"] == "ready"
        assert during.status_code == 200, during.text
        assert stack.redis.hget(KEYS.load("held"), "owner") == new_host
        assert stack.redis.hget(KEYS.load("other"), "owner") == new_host
        log = stack.log_path.read_text()
        assert f"worker {old_host} exited with code -9 (SIGKILL)" in log
        assert "its models held, other are unloaded; restarting it in 1 s" in log
        # serve notices the beat at its next supervision tick, which may come after /health turned ok.
        deadline = time.monotonic() + 10
        while f"worker {new_host} is alive" not in stack.log_path.read_text():
            assert time.monotonic() < deadline, stack.log_path.read_text()[-3000:]
            time.sleep(0.1)
        for model_id in ("held", "other"):
            assert ("unload", "ok", "serve") in events_of(stack, model_id)
    finally:
        next(stacks, None)


def test_with_no_worker_alive_queued_and_new_requests_fail_no_worker_at_once(tmp_path):
    """R7.4: the worker is killed (``kill -9``) while one request runs on it and
    three wait behind it (legacy runtime: one session), and its restart is 60 s away
    (``worker_restart_delay_ms``), so no worker is alive or about to start. The running request gets
    503 ``worker_lost``; the three queued ones are then each granted in turn and refused 503
    ``no_worker`` at once (before this change each waited ``lease_ttl_ms``, 10 s here, for a worker
    to pick its load task up); a new request gets the same at once; ``/health`` says ``degraded``.
    Ctrl-C during the pending restart stops serve promptly and cleanly (no restart)."""
    stacks = run_stack(tmp_path, [{"id": "q", "family": "fixture"}], redis_db=8, name="sup2",
                       extra_env=FIXTURE_ENV,
                       extra_config={"lease_ttl_ms": 10000, "worker_restart_delay_ms": 60000,
                                     "worker_restart_max_delay_ms": 60000})
    stack = next(stacks)
    try:
        [pid] = worker_pids(stack)

        async def scenario():
            async with mclient(stack, None, timeout=MODEL_S) as c:
                running = asyncio.create_task(c.post("/v1/tasks/run", json=body("q", barrier="lost")))
                await until(lambda: stack.arrived("lost") == 1, QUICK_S)
                queued = [asyncio.create_task(c.post("/v1/tasks/run", json=body("q", tag=str(i)))) for i in range(3)]
                await until(lambda: stack.counters("q")["queued"] == 3, QUICK_S)
                os.kill(pid, signal.SIGKILL)
                killed_at = time.monotonic()
                first = await within(running, QUICK_S)
                first_at = time.monotonic()
                rest = await within(asyncio.gather(*queued), QUICK_S)
                rest_at = time.monotonic()
                health = await c.get("/health")
                started = time.monotonic()
                fresh = await c.post("/v1/tasks/run", json=body("q"))
                fresh_s = time.monotonic() - started
                return first, first_at - killed_at, rest, rest_at - first_at, health, fresh, fresh_s
        first, first_after_s, rest, rest_after_first_s, health, fresh, fresh_s = run(scenario())
        assert first.status_code == 503 and first.json()["error"]["code"] == "worker_lost", first.text
        assert first_after_s < 15
        for resp in (*rest, fresh):
            assert resp.status_code == 503, resp.text
            assert resp.json()["error"]["code"] == "no_worker" and resp.headers["retry-after"] == "1"
        assert rest_after_first_s < 2, f"three queued requests took {rest_after_first_s:.1f} s (not one TTL each)"
        assert fresh_s < 1
        assert health.status_code == 503 and health.json()["status"] == "degraded" and health.json()["workers"] == 0
        assert stack.counters("q") == {"leases": 0, "queued": 0}
        assert stack.redis.llen("gpu") == 0, "no load task was sent to the missing worker"
        assert "restarting it in 60 s" in stack.log_path.read_text()
        assert worker_pids(stack) == [] and stack.proc.poll() is None

        stack.proc.send_signal(signal.SIGINT)
        assert stack.proc.wait(timeout=QUICK_S) == 0
        assert "started worker" not in stack.log_path.read_text()
    finally:
        next(stacks, None)


@pytest.mark.parametrize("model_processes", [False, True], ids=["pools_in_the_worker", "pools_in_model_processes"])
def test_a_worker_killed_during_a_load_frees_the_load_at_once_and_the_replacement_loads(tmp_path, model_processes):
    """R7.4, the load clause, over HTTP with a real ``kill -9``: a lazy model's first request makes
    the worker load it, held at a load barrier; the worker is killed there. The request gets 503
    ``worker_lost`` within about a second (serve ends the dead worker's load claim as lost and that
    end wakes the request, the load's caller, instead of leaving it to look again when the worker's
    liveness would lapse or the claim expire after ``lease_ttl_ms``, 10 s here), whether the pool was
    loading in the worker or in a model process of its own; the model is ``unloaded`` with no
    failed-load backoff; once the replacement is alive, the next request loads the model on it and
    succeeds — nothing else was restarted."""
    models = [{"id": "slow", "family": "fixture", "lazy": True, "load_options": {"load_barrier": "cold"}}]
    stacks = run_stack(tmp_path, models, redis_db=8, name="sup3", extra_env=FIXTURE_ENV,
                       extra_config={"lease_ttl_ms": 10000, "model_processes": model_processes})
    stack = next(stacks)
    try:
        [old_pid] = worker_pids(stack)
        web_before = [p.pid for p in psutil.Process(stack.proc.pid).children() if p.pid != old_pid]

        async def scenario():
            async with mclient(stack, None, timeout=MODEL_S) as c:
                loading = asyncio.create_task(c.post("/v1/tasks/run", json=body("slow")))
                await until(lambda: stack.arrived("cold") == 1, QUICK_S)
                os.kill(old_pid, signal.SIGKILL)
                killed_at = time.monotonic()
                answer = await within(loading, QUICK_S)
                return answer, time.monotonic() - killed_at, (await c.get("/v1/models/slow")).json()
        answer, answer_after_s, entry = run(scenario())
        assert answer.status_code == 503, answer.text
        assert answer.json()["error"]["code"] == "worker_lost"
        assert answer_after_s < 3, f"answered {answer_after_s:.1f} s after the kill"
        assert entry["state"] == "unloaded" and entry["retry_at"] is None

        deadline = time.monotonic() + 120
        while not live_workers(stack):
            assert time.monotonic() < deadline and stack.proc.poll() is None, stack.log_tail()
            time.sleep(0.1)
        stack.release("cold")  # the replacement's load waits at the same barrier
        with stack.client() as c:
            resp = c.post("/v1/tasks/run", json=body("slow"))
            assert resp.status_code == 200, resp.text
        assert stack.arrived("cold") == 2
        assert [p.pid for p in psutil.Process(stack.proc.pid).children() if p.pid not in worker_pids(stack)] \
            == web_before, "only the worker was restarted"
    finally:
        next(stacks, None)


def test_after_a_worker_restart_the_eager_models_it_held_load_again_by_themselves(tmp_path):
    """R7.4 with serve's restart: a worker holding an eager and a lazy model is killed (``kill -9``); once
    its replacement beats, serve loads the eager model again on it without any request (logged, a new
    ``load`` row, state ``ready`` in Redis and the database), while the lazy one stays unloaded until
    asked."""
    models = [{"id": "eager", "family": "fixture"}, {"id": "lazy", "family": "fixture", "lazy": True}]
    stacks = run_stack(tmp_path, models, redis_db=8, name="sup4", extra_env=FIXTURE_ENV)
    stack = next(stacks)
    try:
        with stack.client() as c:
            for model_id in ("eager", "lazy"):
                assert c.post("/v1/tasks/run", json=body(model_id)).status_code == 200
        loads_before = events_of(stack, "eager").count(("load", "ok", stack.redis.hget(KEYS.load("eager"), "owner")))
        [old_pid] = worker_pids(stack)
        old_host = _worker_hostname(stack, old_pid)
        os.kill(old_pid, signal.SIGKILL)
        deadline = time.monotonic() + 60
        while not (stack.redis.hget(KEYS.load("eager"), "state") == "ready"
                   and stack.redis.hget(KEYS.load("eager"), "owner") not in (None, old_host)):
            assert time.monotonic() < deadline, stack.log_path.read_text()[-3000:]
            time.sleep(0.1)
        new_host = stack.redis.hget(KEYS.load("eager"), "owner")
        assert new_host == _worker_hostname(stack, worker_pids(stack)[0])
        assert "loading again the eager model(s) a lost worker held: eager" in stack.log_path.read_text()
        assert loads_before == 1
        # the worker writes the database after the scheduler says ready
        while not (("load", "ok", new_host) in events_of(stack, "eager") and
                   stack.sql("SELECT state FROM registry_modelregistration WHERE model_id = 'eager'") == [("ready",)]):
            assert time.monotonic() < deadline, (events_of(stack, "eager"), stack.log_path.read_text()[-3000:])
            time.sleep(0.1)
        assert stack.redis.hget(KEYS.load("lazy"), "state") == "unloaded"
        assert entry_of(stack, "lazy")["state"] == "unloaded"
    finally:
        next(stacks, None)
