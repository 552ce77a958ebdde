"""Starting a web process and a worker while their Redis accepts connections but does not answer
(its process stopped: a frozen host, a ``CLIENT PAUSE``, a long script). Each waits for Redis as for
one that cannot be reached ("waiting for Redis …", up to 60 s, docs/operations.md "Scale-out") and
starts whole once it answers; neither starts half set up nor gives up at redis-py's 5 s read timeout.

The test runs its own ``redis-server`` (stopped with SIGSTOP, so the other tests' Redis is untouched),
one ``python -m audiosite.web`` and one Celery worker on SQLite, started as ``manage.py serve`` starts them.
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time

import httpx
import pytest
import redis

from inference.runtime.context import KEYS

from .redis_per_worker import _binary as redis_binary
from .support.bounds import QUICK_S
from .support.processes import ROOT, accepts_connections, free_port, kill_process_tree

pytestmark = pytest.mark.stack

FROZEN_S = 8.0
"""How long Redis does not answer at least, from the moment both processes started waiting: past
redis-py's 5 s read timeout."""


def wait_until(predicate, timeout_s: float) -> None:
    """Poll ``predicate()`` every 50 ms; AssertionError when it is still false after ``timeout_s``."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        assert time.monotonic() < deadline, f"not within {timeout_s} s"
        time.sleep(0.05)


def test_a_web_process_and_a_worker_started_while_redis_does_not_answer_wait_and_start_whole(tmp_path):
    """Redis stopped (SIGSTOP) for 8 s while a web process and a worker start: both keep waiting (their
    logs say so; neither exits), and once Redis answers the web process serves ``/health`` and the
    worker announces itself (its pid and liveness key in Redis, "is alive" in its log)."""
    from inference.management.commands.serve import worker_argv  # noqa: PLC0415 (Django set up by now)
    redis_port, web_port = free_port(), free_port()
    redis_url = f"redis://127.0.0.1:{redis_port}/0"
    server = subprocess.Popen([redis_binary(), "--port", str(redis_port), "--bind", "127.0.0.1", "--save", "",
                               "--appendonly", "no"], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    started: list[subprocess.Popen] = []
    try:
        wait_until(lambda: accepts_connections("127.0.0.1", redis_port), QUICK_S)
        config = tmp_path / "server.json"
        config.write_text(json.dumps({"host": "127.0.0.1", "port": web_port, "backend": "cpu",
                                      "models": [{"id": "asr", "family": "whisper", "task": "asr", "lazy": True}]}))
        env = {k: v for k, v in os.environ.items() if not k.startswith("AUDIOSITE_")}
        env.pop("DATABASE_URL", None)
        env.update(REDIS_URL=redis_url, AUDIOSITE_CONFIG=str(config), AUDIOSITE_VAR_DIR=str(tmp_path / "var"),
                   PYTHONUNBUFFERED="1")
        done = subprocess.run([sys.executable, "manage.py", "migrate", "--verbosity", "0"], cwd=ROOT, env=env,
                              capture_output=True, text=True, timeout=QUICK_S * 2)
        assert done.returncode == 0, done.stdout + done.stderr
        server.send_signal(signal.SIGSTOP)
        logs = {"web": tmp_path / "web.log", "worker": tmp_path / "worker.log"}
        for name, argv in (("web", [sys.executable, "-m", "audiosite.web", "-b", "127.0.0.1", "-p", str(web_port),
                                    "audiosite.asgi:application"]),
                           ("worker", worker_argv("startwait@test", 1))):
            started.append(subprocess.Popen(argv, cwd=ROOT, env=env, stdout=logs[name].open("wb"),
                                            stderr=subprocess.STDOUT))
        # Each logs its wait once its first attempt failed (a read timeout: 5 s after it asked, itself
        # seconds after the start on a loaded machine); then it keeps waiting instead of exiting.
        for name, proc in zip(logs, started, strict=True):
            wait_until(lambda log=logs[name], proc=proc: proc.poll() is not None
                       or "waiting for Redis" in log.read_text(errors="replace"), QUICK_S * 2)
        time.sleep(FROZEN_S - 5)
        for name, proc in zip(logs, started, strict=True):
            text = logs[name].read_text(errors="replace")
            assert proc.poll() is None, f"the {name} exited while Redis did not answer:\n{text[-3000:]}"
            assert "waiting for Redis" in text, f"{name}:\n{text[-3000:]}"
        assert not accepts_connections("127.0.0.1", web_port)
        server.send_signal(signal.SIGCONT)
        wait_until(lambda: accepts_connections("127.0.0.1", web_port), QUICK_S * 2)
        assert httpx.get(f"http://127.0.0.1:{web_port}/health", timeout=QUICK_S).status_code == 200
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        wait_until(lambda: client.exists(KEYS.worker_live("startwait@test")) == 1, QUICK_S * 2)
        wait_until(lambda: "is alive" in logs["worker"].read_text(errors="replace"), QUICK_S)
        assert str(started[1].pid) in client.hgetall(KEYS.worker_pid).values()
        assert all(proc.poll() is None for proc in started)
    finally:
        for proc in started:
            kill_process_tree(proc)
        server.send_signal(signal.SIGCONT)
        server.kill()
        server.wait(QUICK_S)
