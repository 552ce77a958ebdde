"""Several web processes and Celery workers on one Redis and database, started one by one as a
distributed deployment runs them (docs/operations.md, "Scale-out").
"""
from __future__ import annotations

import os
import secrets
import signal
import socket
import subprocess
import sys
import time
import uuid
from dataclasses import dataclass
from pathlib import Path

import httpx

from inference.management.commands.serve import worker_argv
from inference.runtime.context import KEYS

from .bounds import QUICK_S
from .processes import ROOT, free_port
from .stacks import Deployment, Setup, drop_stack, prepare_stack


@dataclass
class Member:
    """One process of a :class:`Cluster`: ``role`` 'web' or 'worker'; ``name`` is a web process's
    base URL or a worker's Celery hostname; its output goes to ``log_path``."""

    role: str
    name: str
    proc: subprocess.Popen
    log_path: Path

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def url(self) -> str:
        """A web process's base URL (so :func:`mclient` takes a member as it takes a stack)."""
        return self.name

    def alive(self) -> bool:
        return self.proc.poll() is None

    def log_tail(self, lines: int = 40) -> str:
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


WORKER_CONCURRENCY = 32  # what `serve` gives a worker of a few small models (one thread per slot + loads)
MEMBER_START_S = 120.0  # one process's start-up on a busy two-core machine (Django and Celery imports)


class Cluster(Deployment):
    """Web processes (``python -m audiosite.web``) and Celery GPU workers started one by one, the
    way a distributed deployment runs them (docs/operations.md, "Scale-out"), all on one Redis db
    and one PostgreSQL database, with one configuration file (``AUDIOSITE_CONFIG``).

    ``webs`` and ``workers`` list the members started by this cluster that have not been killed;
    :meth:`kill` sends SIGKILL, :meth:`ensure` starts replacements.
    """

    def __init__(self, setup: Setup):
        self.setup = setup
        self.redis = setup.redis
        self.dsn = setup.dsn
        self.env = setup.env
        self.webs: list[Member] = []
        self.workers: list[Member] = []
        self._started = 0

    # -- processes --
    def _spawn(self, role: str, name: str, argv: list[str]) -> Member:
        self._started += 1
        log_path = self.setup.tmp / f"{self._started:02d}-{role}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(argv, cwd=ROOT, env=self.env, stdout=log, stderr=subprocess.STDOUT)
        return Member(role, name, proc, log_path)

    def spawn_web(self) -> Member:
        """Start a web process on a free port (not waited for: see :meth:`wait_ready`)."""
        port = free_port()
        return self._spawn("web", f"http://127.0.0.1:{port}", [
            sys.executable, "-m", "audiosite.web", "-b", "127.0.0.1", "-p", str(port), "audiosite.asgi:application"])

    def spawn_worker(self) -> Member:
        """Start a Celery GPU worker with a unique hostname (not waited for: see :meth:`wait_ready`)."""
        hostname = f"w{self._started + 1}-{uuid.uuid4().hex[:6]}@{socket.gethostname()}"
        return self._spawn("worker", hostname, worker_argv(hostname, WORKER_CONCURRENCY))

    def wait_ready(self, member: Member, timeout_s: float = MEMBER_START_S) -> None:
        """Wait until ``member`` serves: a web process answers ``/health`` 200; a worker beats
        (its liveness key) and Celery reports it ready (consuming). Raises AssertionError with the
        member's output if it exits or the bound passes; then adds it to ``webs`` or ``workers``."""
        deadline = time.monotonic() + timeout_s
        while True:
            if not member.alive():
                raise AssertionError(f"{member.role} {member.name} exited:\n{member.log_tail()}")
            if time.monotonic() > deadline:
                member.proc.kill()
                member.proc.wait(timeout=QUICK_S)
                raise AssertionError(f"{member.role} {member.name} not ready in {timeout_s:g} s:\n"
                                     f"{member.log_tail()}")
            if member.role == "web":
                try:
                    if httpx.get(member.name + "/health", timeout=2).status_code == 200:
                        break
                except httpx.HTTPError:
                    pass
            elif self.redis.exists(KEYS.worker_live(member.name)) and \
                    b" ready." in member.log_path.read_bytes():
                break
            time.sleep(0.2)
        (self.webs if member.role == "web" else self.workers).append(member)

    def ensure(self, webs: int = 2, workers: int = 2) -> None:
        """Forget members that died, then start (in parallel) and wait for replacements up to
        ``webs`` web processes and ``workers`` workers."""
        self.webs = [m for m in self.webs if m.alive()]
        self.workers = [m for m in self.workers if m.alive()]
        spawned = [self.spawn_web() for _ in range(webs - len(self.webs))] + \
                  [self.spawn_worker() for _ in range(workers - len(self.workers))]
        try:
            for member in spawned:
                self.wait_ready(member)
        finally:
            for member in spawned:  # those that never became ready: stopped, not leaked
                if member not in self.webs + self.workers and member.alive():
                    member.proc.kill()
                    member.proc.wait(timeout=QUICK_S)

    def kill(self, member: Member) -> float:
        """``kill -9`` ``member`` (SIGKILL, no clean-up of any kind), reap it and forget it.

        Returns:
            ``time.monotonic()`` right after the signal was sent.
        """
        os.kill(member.pid, signal.SIGKILL)
        killed_at = time.monotonic()
        member.proc.wait(timeout=QUICK_S)
        for members in (self.webs, self.workers):
            if member in members:
                members.remove(member)
        return killed_at

    def kill_after_a_beat(self, member: Member) -> float:
        """:meth:`kill` a worker right after it refreshed its liveness key (at most one beat, 2 s,
        from now), so the key outlives it by almost the whole TTL: the worst case for anyone
        waiting to notice the death. Returns the time of the kill (``time.monotonic()``)."""
        key = KEYS.worker_live(member.name)
        deadline = time.monotonic() + QUICK_S
        while self.redis.pttl(key) < 9600:  # a beat sets a 10 s TTL every 2 s
            assert time.monotonic() < deadline, f"{member.name} does not beat"
            time.sleep(0.005)
        return self.kill(member)

    def worker(self, hostname: str) -> Member:
        """The live worker member named ``hostname``."""
        return next(m for m in self.workers if m.name == hostname)

    def stop(self) -> None:
        """SIGTERM every member still running (web processes first, then workers: Celery's warm
        shutdown), SIGKILL whatever is left after 30 s."""
        for member in self.webs + self.workers:
            if member.alive():
                member.proc.send_signal(signal.SIGTERM)
                try:
                    member.proc.wait(timeout=30)
                except subprocess.TimeoutExpired:
                    member.proc.kill()
                    member.proc.wait(timeout=QUICK_S)

    # -- what Redis says --
    def load_field(self, model_id: str, field: str) -> str | None:
        """A field of a model's lifecycle hash ``KEYS.load`` (``state``, ``owner``, ``loader_host``…)."""
        return self.redis.hget(KEYS.load(model_id), field)

    def process_channels(self, model_id: str) -> list[str]:
        """The reply channels of a model's queued tickets, in FIFO order (one per ticket)."""
        tickets = self.redis.zrange(KEYS.queue(model_id), 0, -1)
        return [self.redis.hget(KEYS.model(model_id) + ":chan", t) for t in tickets]


def run_cluster(tmp: Path, models: list[dict], *, redis_db: int, name: str, webs: int = 2, workers: int = 2,
                parallel: bool = True, extra_env: dict | None = None, extra_config: dict | None = None,
                redis_base: str | None = None):
    """Start a :class:`Cluster` of ``webs`` web processes and ``workers`` workers; yield it; stop it.

    Done as an operator would without ``serve`` (docs/operations.md, "Scale-out"): one
    configuration file for every process (``AUDIOSITE_CONFIG``), one secret key, the runtime
    (``AUDIOSITE_PARALLEL_JOBS``), ``manage.py migrate`` and ``manage.py sync_config`` once, then
    the processes, then ``manage.py load_models`` (the non-lazy models). See :func:`prepare_stack`
    for the configuration, database and Redis db (``redis_base``: on another Redis than the test run's).
    """
    setup = prepare_stack(tmp, models, redis_db=redis_db, name=name, extra_env=extra_env, extra_config=extra_config,
                          redis_base=redis_base)
    setup.env.update(DJANGO_SETTINGS_MODULE="audiosite.settings", AUDIOSITE_CONFIG=str(setup.config_path),
                     AUDIOSITE_SECRET_KEY=secrets.token_urlsafe(50), HF_HUB_OFFLINE="1")
    if parallel:
        setup.env["AUDIOSITE_PARALLEL_JOBS"] = "1"
    cluster = Cluster(setup)
    try:
        for command in (["migrate", "--verbosity", "0"], ["sync_config"]):
            done = cluster.manage(*command, timeout=MEMBER_START_S)
            assert done.returncode == 0, done.stdout + done.stderr
        cluster.ensure(webs, workers)
        done = cluster.manage("load_models", timeout=MEMBER_START_S)
        assert done.returncode == 0, done.stdout + done.stderr
        yield cluster
    finally:
        cluster.stop()
        drop_stack(setup)


