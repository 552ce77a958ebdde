"""Real ``manage.py serve`` child processes for the validation gate and the performance report.

Each :class:`Server` is a whole one-machine deployment (daphne, one Celery worker, an embedded
Redis, a SQLite file) started in its own working folder, as an operator would start it. The
validation gate (``validate_slots``) and ``bench_slots`` talk to it over HTTP only.
"""
from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import psutil
import redis
from django.conf import settings
from django.core.management.base import CommandError

from audiosite.embedded_redis import EmbeddedRedis

START_TIMEOUT_S = 180


def free_port() -> int:
    """A TCP port on 127.0.0.1 that was free a moment ago (the OS picks it)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def kill_process_tree(proc: subprocess.Popen) -> None:
    """SIGKILL ``proc`` and its descendants (found while ``proc`` still lives: ``serve`` starts each
    child in a session of its own, so killing ``serve`` alone leaves them running), and reap them."""
    try:
        descendants = psutil.Process(proc.pid).children(recursive=True)
    except psutil.Error:
        descendants = []
    proc.kill()
    for child in descendants:
        try:
            child.kill()
        except psutil.Error:
            continue
    proc.wait(timeout=10)
    psutil.wait_procs(descendants, timeout=10)


class Server:
    """One ``manage.py serve`` child on a private embedded Redis and SQLite file.

    Args:
        workdir: an empty folder; ``server.json``, ``serve.log`` and ``var/`` are made there.
        models: the ``models`` list of ``server.json``.
        parallel: start with ``--parallel-jobs`` (else the legacy runtime).
        extra_config: more top-level ``server.json`` keys (e.g. ``ui_management``).
        extra_env: more environment variables for the child (e.g. ``AUDIOSITE_ADMISSION_DIR``).
        checkout: the repository checkout whose ``manage.py`` runs (default this one; ``bench_compare``
            runs another's with this interpreter).

    Raises:
        CommandError: the server did not print ``listening on`` within ``START_TIMEOUT_S`` or
            died first (the end of its log is in the message).
    """

    token: str = ""  # a management API token, once ``issue_token`` was called

    def __init__(self, workdir: Path, models: list[dict], parallel: bool, extra_config: dict | None = None,
                 extra_env: dict | None = None, checkout: Path | None = None):
        self.workdir = workdir
        self.port = free_port()
        config = {"port": self.port, "lazy_load": True, "lease_ttl_ms": 5000, "models": models, **(extra_config or {})}
        (workdir / "server.json").write_text(json.dumps(config))
        env = {k: v for k, v in os.environ.items() if k not in ("DATABASE_URL", "REDIS_URL")
               and not k.startswith("AUDIOSITE_")}
        env.update(AUDIOSITE_VAR_DIR=str(workdir / "var"), PYTHONUNBUFFERED="1", AUDIOSITE_ENABLE_FIXTURE_FAMILY="1",
                   **(extra_env or {}))
        argv = [sys.executable, "manage.py", "serve", "--config", str(workdir / "server.json")]
        if parallel:
            argv.append("--parallel-jobs")
        self.log = workdir / "serve.log"
        self.started = time.monotonic()
        self.proc = subprocess.Popen(argv, cwd=checkout or settings.BASE_DIR, env=env, stdout=open(self.log, "wb"),
                                     stderr=subprocess.STDOUT)
        deadline = time.monotonic() + START_TIMEOUT_S
        try:
            while b"listening on" not in self.log.read_bytes():
                if self.proc.poll() is not None or time.monotonic() > deadline:
                    raise CommandError("a server did not start:\n" + self.log.read_text()[-3000:])
                time.sleep(0.2)
        except BaseException:  # also Ctrl-C or validate_slots' SIGTERM while it starts: no orphan
            self.stop()
            raise
        self.start_s = time.monotonic() - self.started
        try:
            self.redis_url = EmbeddedRedis.under(workdir / "var").url()
        except OSError as exc:
            self.stop()
            raise CommandError(f"a server left no embedded Redis password ({exc}):\n"
                               + self.log.read_text()[-3000:]) from None
        self.redis: Any = redis.Redis.from_url(self.redis_url, decode_responses=True)  # replies are str
        self.url = f"http://127.0.0.1:{self.port}"
        self.env = {**env, "REDIS_URL": self.redis_url,
                    "DATABASE_URL": f"sqlite:///{workdir / 'var' / 'audiosite.sqlite3'}"}
        if parallel:
            self.env["AUDIOSITE_PARALLEL_JOBS"] = "1"

    def issue_token(self, user: str) -> str:
        """``manage.py issue_token <user>`` against this server's database: the user's API token
        (also kept in ``self.token``).

        Raises:
            CommandError: the command failed (its stderr is the message).
        """
        done = subprocess.run([sys.executable, "manage.py", "issue_token", user], cwd=settings.BASE_DIR,
                              env=self.env, capture_output=True, text=True)
        if done.returncode:
            raise CommandError(done.stderr)
        self.token = done.stdout.strip()
        return self.token

    def worker(self) -> psutil.Process:
        """The Celery worker child (the process that owns the loaded pools).

        Raises:
            CommandError: no such child (the worker died and was not restarted yet).
        """
        return self._child("celery", "worker")

    def web(self) -> psutil.Process:
        """The web process child (``python -m audiosite.web``, daphne).

        Raises:
            CommandError: no such child.
        """
        return self._child("audiosite.web", "web")

    def _child(self, needle: str, what: str) -> psutil.Process:
        for child in psutil.Process(self.proc.pid).children(recursive=True):
            try:
                if needle in " ".join(child.cmdline()):
                    return child
            except psutil.Error:
                continue
        raise CommandError(f"no {what} process found")

    def tree_rss_bytes(self) -> int:
        """Resident set size of ``serve`` and every child (web, worker, Redis) in bytes."""
        total = 0
        try:
            procs = [psutil.Process(self.proc.pid), *psutil.Process(self.proc.pid).children(recursive=True)]
        except psutil.Error:
            return 0
        for proc in procs:
            try:
                total += proc.memory_info().rss
            except psutil.Error:
                continue
        return total

    def stop(self) -> None:
        """Ctrl-C (SIGINT: drain, then stop everything ``serve`` started); after 60 s, kill ``serve`` and
        every process it started (each runs in a session of its own, so killing ``serve`` alone would
        leave them running: a loaded machine's test run once left two whole stacks so)."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGINT)
            try:
                self.proc.wait(timeout=60)
            except subprocess.TimeoutExpired:
                kill_process_tree(self.proc)
            except BaseException:  # interrupted while waiting (a second Ctrl-C, SIGTERM): the server has
                try:  # its SIGINT; give it the same time to drain, then go on
                    self.proc.wait(timeout=60)
                except subprocess.TimeoutExpired:
                    kill_process_tree(self.proc)
                raise
