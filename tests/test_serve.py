"""The README's first command: ``manage.py serve`` with no database or Redis configured."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import time

import httpx
import psutil
import pytest

from .conftest import ROOT, free_port


def start_embedded(tmp_path, *args: str) -> tuple[subprocess.Popen, object]:
    """``manage.py serve <args>`` with no DATABASE_URL/REDIS_URL, waited until it listens."""
    env = {k: v for k, v in os.environ.items()
           if k not in ("DATABASE_URL", "REDIS_URL") and not k.startswith("AUDIOSITE_")}
    env.update(AUDIOSITE_VAR_DIR=str(tmp_path / "var"), PYTHONUNBUFFERED="1")
    log_path = tmp_path / "serve.log"
    with open(log_path, "wb") as log:
        proc = subprocess.Popen([sys.executable, "manage.py", "serve", *args], cwd=ROOT, env=env,
                                stdout=log, stderr=subprocess.STDOUT)
    deadline = time.monotonic() + 180
    while b"listening on" not in log_path.read_bytes():
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            raise AssertionError(log_path.read_text())
        time.sleep(0.2)
    return proc, log_path


@pytest.mark.stack
def test_serve_on_the_embedded_default_and_stop_on_ctrl_c(tmp_path):
    port = free_port()
    proc, log_path = start_embedded(tmp_path, "--port", str(port))
    try:
        output = log_path.read_text()
        assert f"audiosite listening on http://127.0.0.1:{port}" in output
        assert "embedded redis-server" in output and "sqlite3" in output
        assert (tmp_path / "var" / "audiosite.sqlite3").exists()
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
                "whisper-tiny.en": "ready", "silero-vad": "ready"}

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
    config.write_text('{"lazy_load": true, "models": [{"id": "vad", "family": "silero_vad"}]}')
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
