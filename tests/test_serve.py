"""The README's first command: ``manage.py serve`` with no database or Redis configured."""
from __future__ import annotations

import base64
import io
import signal
import subprocess
import sys
import time

import httpx
import numpy as np
import psutil
import pytest
import soundfile

from .helpers import ROOT, free_port, mode_of, run_stack, start_embedded, wav_bytes


@pytest.mark.stack
def test_serve_on_the_embedded_default_and_stop_on_ctrl_c(tmp_path):
    port = free_port()
    proc, log_path = start_embedded(tmp_path, "--port", str(port))
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
            assert {m["id"]: m["state"] for m in c.get("/v1/models").json()["data"]} == {
                "whisper-tiny.en": "ready", "silero-vad": "ready", "piper-joe": "ready"}
            # The README's speech example on the shipped default: an OpenAI voice name, mp3 by default.
            speech = c.post("/v1/audio/speech", json={"model": "piper-joe", "voice": "alloy",
                                                       "input": "Hello from audiosite."})
            assert speech.status_code == 200 and speech.headers["content-type"] == "audio/mpeg"
            samples, rate = soundfile.read(io.BytesIO(speech.content))
            assert rate == 22050 and samples.ndim == 1 and len(samples) / rate > 0.5

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
        assert "audiosite stopped" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


@pytest.mark.stack
def test_serve_stops_everything_and_fails_when_a_child_dies(tmp_path):
    """If the web process dies, serve stops the rest and exits non-zero (docs/operations.md)."""
    config = tmp_path / "server.json"
    config.write_text('{"backend": "cpu", "lazy_load": true, "models": [{"id": "vad", "family": "silero_vad"}]}')
    proc, log_path = start_embedded(tmp_path, "--config", str(config), "--port", str(free_port()))
    try:
        children = psutil.Process(proc.pid).children(recursive=True)
        web = next(c for c in children if "audiosite.web" in " ".join(c.cmdline()))
        web.kill()
        assert proc.wait(timeout=60) != 0
        gone, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
        assert "web exited with code -9" in log_path.read_text()
    finally:
        if proc.poll() is None:
            proc.kill()


def test_quick_restart_after_a_killed_worker_reloads_instead_of_dispatching_to_the_dead_one(tmp_path):
    """R7.4: the worker is killed with SIGKILL (its liveness key outlives it by up to 10 s) and serve
    is restarted at once on the same Redis and database: the restart forgets the dead local worker,
    so the first request loads on the new worker and answers 200 promptly (not 503 worker_lost)."""
    models = [{"id": "rs", "family": "fixture", "slots": 1}]
    stacks = run_stack(tmp_path, models, redis_db=8, name="restart", parallel=True,
                       extra_env={"AUDIOSITE_ENABLE_FIXTURE_FAMILY": "1"})
    stack = next(stacks)
    try:
        silence = wav_bytes(np.zeros(1600, dtype=np.float32), 16000)
        body = {"model": "rs", "request": {"audio_base64": base64.b64encode(silence).decode(), "options": {}}}
        with stack.client() as c:
            assert c.post("/v1/tasks/run", json=body).status_code == 200
        worker = next(p for p in psutil.Process(stack.proc.pid).children(recursive=True)
                      if "celery" in " ".join(p.cmdline()))
        worker.kill()
        stack.proc.wait(timeout=60)  # serve stops when a child dies
        assert stack.redis.keys("as:worker:*"), "the dead worker's liveness key should still be there"
        log_path = tmp_path / "serve2.log"
        argv = [sys.executable, "manage.py", "serve", "--config", str(tmp_path / "server.json"), "--parallel-jobs"]
        with open(log_path, "wb") as log:
            second = subprocess.Popen(argv, cwd=ROOT, env=stack.env, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + 120
            while b"listening on" not in log_path.read_bytes():
                assert second.poll() is None and time.monotonic() < deadline, log_path.read_text()[-3000:]
                time.sleep(0.2)
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
