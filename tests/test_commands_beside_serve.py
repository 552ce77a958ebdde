"""``manage.py`` commands run beside a ``manage.py serve`` on the embedded default find its private
Redis by themselves (the var folder's socket and password), with no ``REDIS_URL`` to set; without a
running serve they say how to reach one.

Real processes: ``serve`` on SQLite and its embedded Redis under ``tmp/var``, and the commands as a
user runs them in another shell (same folder, same environment, no ``REDIS_URL``).
"""
from __future__ import annotations

import json
import signal
import subprocess
import sys

import httpx

from .support.bounds import QUICK_S
from .support.processes import ROOT, embedded_env, free_port, kill_process_tree, start_embedded


def _manage(tmp_path, *args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env=embedded_env(tmp_path),
                          capture_output=True, text=True, timeout=120)


def test_unload_and_load_commands_reach_the_embedded_redis_of_a_running_serve(tmp_path):
    config = tmp_path / "server.json"
    config.write_text(json.dumps({"backend": "cpu", "models": [{"id": "vad", "family": "silero_vad"}]}))
    port = free_port()
    proc, log_path = start_embedded(tmp_path, "--config", str(config), "--port", str(port))
    try:
        url = f"http://127.0.0.1:{port}"
        assert httpx.get(f"{url}/v1/models/vad", timeout=QUICK_S).json()["state"] == "ready"
        done = _manage(tmp_path, "unload_model", "vad")
        assert done.returncode == 0, done.stderr
        assert "unloaded vad" in done.stdout
        assert httpx.get(f"{url}/v1/models/vad", timeout=QUICK_S).json()["state"] == "unloaded"
        done = _manage(tmp_path, "load_models", "vad")
        assert done.returncode == 0, done.stderr
        assert httpx.get(f"{url}/v1/models/vad", timeout=QUICK_S).json()["state"] == "ready"
        assert "password" not in done.stdout + done.stderr
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            kill_process_tree(proc)
    # With serve stopped, the command says what it needs instead of a traceback.
    done = _manage(tmp_path, "unload_model", "vad")
    assert done.returncode != 0
    assert "no `manage.py serve` runs an embedded Redis" in done.stderr and "Traceback" not in done.stderr
    assert log_path.exists()
