"""A test server stack: ``manage.py serve`` run as a user would (daphne + one Celery worker) against a
fresh PostgreSQL database and a Redis database, pinned to the CPU backend so the suite gives the same
answers on a machine with a GPU.

- :class:`Deployment`: what every test deployment offers (``manage.py`` against it, the scheduler's and
  the fixture barriers' Redis keys read through the scheduler's key builder, SQL).
- :func:`run_stack` yields a :class:`Stack`; :func:`prepare_stack` / :func:`drop_stack` make and remove
  its files, database and Redis db (also for :mod:`tests.support.cluster`).
- ``fx``: a management entry of the fixture family (barriers, injected failures).
- ``web_pid`` / ``worker_pid`` / ``worker_pids`` / ``live_workers``: a stack's processes, and the
  workers its Redis counts as alive (liveness key present).
"""
from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import psutil
import psycopg
import redis

from inference.runtime.context import KEYS

from .audio import FIXTURES
from .bounds import MODEL_S
from .processes import ROOT, free_port, kill_process_tree, start_serve

REDIS_BASE = os.environ.get("REDIS_URL", "redis://127.0.0.1:6379/15").rsplit("/", 1)[0]
PG_BASE = os.environ.get("DATABASE_URL", "postgres://postgres@127.0.0.1:5432/audiosite").rsplit("/", 1)[0]
FIXTURE_ENV = {"AUDIOSITE_ENABLE_FIXTURE_FAMILY": "1"}
"""The environment variable that lets a deployment register the fixture family (never in production)."""


class Deployment:
    """What every test deployment offers: its Redis db (``redis``), database (``dsn``) and process
    environment (``env``), ``manage.py`` against them, and the scheduler's and fixture barriers'
    Redis keys read directly. :class:`Stack` (one ``manage.py serve``) and :class:`Cluster`
    (web processes and workers started one by one) are deployments."""

    redis: redis.Redis
    dsn: str
    env: dict

    def manage(self, *args: str, timeout: float = MODEL_S, env: dict | None = None) -> subprocess.CompletedProcess:
        """Run ``manage.py <args>`` against this stack (its database and Redis; ``env`` adds variables)."""
        return subprocess.run([sys.executable, "manage.py", *args], cwd=ROOT, env={**self.env, **(env or {})},
                              capture_output=True, text=True, timeout=timeout)

    def manage_async(self, *args: str) -> subprocess.Popen:
        """Start ``manage.py <args>`` against this stack without waiting."""
        return subprocess.Popen([sys.executable, "manage.py", *args], cwd=ROOT, env=self.env,
                                stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)

    def counters(self, model_id: str) -> dict:
        """Live request leases and queued requests of a model, read straight from Redis (managers not counted)."""
        pipe = self.redis.pipeline(transaction=True)
        pipe.hlen(KEYS.leases(model_id)).zcard(KEYS.queue(model_id)).hlen(KEYS.queued_managers(model_id))
        leases, queued, managers = pipe.execute()
        return {"leases": leases, "queued": queued - managers}

    def managers(self, model_id: str) -> dict:
        """Held and queued manager tickets of a model."""
        return {"held": self.redis.hlen(KEYS.manager_leases(model_id)),
                "queued": self.redis.hlen(KEYS.queued_managers(model_id))}

    # -- barriers of the fixture family (inference/tasks.py: barrier) --
    def arrived(self, name: str) -> int:
        """How many steps have reached fixture barrier ``name`` so far."""
        return int(self.redis.get(KEYS.fixture_arrived(name)) or 0)

    def wait_arrived(self, name: str, count: int = 1, timeout_s: float = 30) -> None:
        """Wait until ``count`` steps have reached barrier ``name``; AssertionError after ``timeout_s`` seconds."""
        deadline = time.monotonic() + timeout_s
        while self.arrived(name) < count:
            if time.monotonic() > deadline:
                raise AssertionError(f"barrier {name!r}: {self.arrived(name)} of {count} arrived")
            time.sleep(0.01)

    def release(self, name: str, count: int = 1, action: str = "go") -> None:
        """Let ``count`` steps waiting at barrier ``name`` go on with ``action`` (``go``, or a failure to inject)."""
        if count > 0:
            self.redis.lpush(KEYS.fixture_release(name), *([action] * count))

    def wait_idle(self, model_id: str, timeout_s: float = 60) -> None:
        """Wait until ``model_id`` holds no request lease and queues no request; AssertionError after ``timeout_s``."""
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if self.counters(model_id) == {"leases": 0, "queued": 0}:
                return
            time.sleep(0.05)
        raise AssertionError(f"{model_id} did not drain: {self.counters(model_id)}")

    def sql(self, query: str, *params) -> list[tuple]:
        """The rows of ``query`` (``%s`` placeholders, ``params``) on this deployment's database."""
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            return conn.execute(query, params).fetchall()


@dataclass
class Stack(Deployment):
    """A running ``manage.py serve`` (``proc``, answering at ``url``, output in ``log_path``) and
    handles to its Redis and database."""

    url: str
    redis: redis.Redis
    dsn: str
    proc: subprocess.Popen
    log_path: Path
    media_root: Path
    env: dict

    def client(self, **kw) -> httpx.Client:
        """A sync client of this stack (timeout ``MODEL_S`` unless ``timeout`` says otherwise)."""
        return httpx.Client(base_url=self.url, timeout=kw.pop("timeout", MODEL_S), **kw)

    def log_tail(self, lines: int = 60) -> str:
        """The last ``lines`` lines of serve's output."""
        return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])


STACK_MAX_BODY_BYTES = 3_000_000


@dataclass
class Setup:
    """The files, database and Redis db of one test deployment, before any process runs.

    ``config`` is the ``server.json`` written at ``config_path``; ``media`` holds copies of the
    speech fixtures (a ``media_roots`` entry); ``db_name`` is a fresh PostgreSQL database at
    ``dsn``; ``redis`` is a client of the flushed Redis db at ``redis_url``; ``env`` is the
    environment every process of the deployment gets (the caller's, minus its AUDIOSITE_*
    variables, plus the database, Redis, var folder and ``extra_env``).
    """

    tmp: Path
    config: dict
    config_path: Path
    media: Path
    db_name: str
    dsn: str
    redis_url: str
    redis: redis.Redis
    env: dict


def prepare_stack(tmp: Path, models: list[dict], *, redis_db: int, name: str, extra_env: dict | None = None,
                  extra_config: dict | None = None, redis_base: str | None = None) -> Setup:
    """Write the configuration, create the database ``audiosite_<name>_<pid>`` (dropped first if a
    crashed run left it) and flush Redis db ``redis_db``.

    The configuration pins ``"backend": "cpu"``, a 3 s lease TTL and a 5 s ``shutdown_timeout_ms``
    (``extra_config`` overrides any key): the tests assert CPU admission tables, ``/health`` backends
    and start-up lines, on any machine. ``redis_base`` (``redis://host:port``) is another Redis than the
    test run's (one the test kills and starts again)."""
    media = tmp / "media"
    media.mkdir()
    for wav in FIXTURES.glob("*.wav"):
        (media / wav.name).write_bytes(wav.read_bytes())
    # shutdown_timeout_ms 5 s: a stack stopped with a run still held somewhere drains for at most 5 s
    # (not the default 30 s) before it is answered 503, so teardowns stay quick.
    config = {"host": "127.0.0.1", "port": free_port(), "backend": "cpu", "lease_ttl_ms": 3000,
              "shutdown_timeout_ms": 5000,
              "media_roots": [str(media)], "max_request_body_bytes": STACK_MAX_BODY_BYTES, "models": models,
              **(extra_config or {})}
    config_path = tmp / "server.json"
    config_path.write_text(json.dumps(config, indent=2))

    db_name = f"audiosite_{name}_{os.getpid()}"
    with psycopg.connect(f"{PG_BASE}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{db_name}" WITH (FORCE)')
        conn.execute(f'CREATE DATABASE "{db_name}"')
    redis_url = f"{redis_base or REDIS_BASE}/{redis_db}"
    client = redis.Redis.from_url(redis_url, decode_responses=True)
    client.flushdb()

    env = {k: v for k, v in os.environ.items() if not k.startswith("AUDIOSITE_")}
    env.update(DATABASE_URL=f"{PG_BASE}/{db_name}", REDIS_URL=redis_url, AUDIOSITE_VAR_DIR=str(tmp / "var"),
               PYTHONUNBUFFERED="1", **(extra_env or {}))
    return Setup(tmp, config, config_path, media, db_name, f"{PG_BASE}/{db_name}", redis_url, client, env)


def drop_stack(setup: Setup) -> None:
    """Flush the deployment's Redis db and drop its database (its processes must be stopped)."""
    setup.redis.flushdb()
    setup.redis.close()
    with psycopg.connect(f"{PG_BASE}/postgres", autocommit=True) as conn:
        conn.execute(f'DROP DATABASE IF EXISTS "{setup.db_name}" WITH (FORCE)')


def run_stack(tmp: Path, models: list[dict], *, redis_db: int, name: str, parallel: bool = False,
              extra_env: dict | None = None, extra_config: dict | None = None):
    """Start ``manage.py serve`` on a fresh PostgreSQL database and Redis db; yield a Stack; stop it.

    See :func:`prepare_stack` for the configuration and environment."""
    setup = prepare_stack(tmp, models, redis_db=redis_db, name=name, extra_env=extra_env, extra_config=extra_config)
    args = ["--config", str(setup.config_path), *(["--parallel-jobs"] if parallel else [])]
    log_path = tmp / "serve.log"
    try:
        proc = start_serve(args, env=setup.env, log_path=log_path)
    except BaseException:
        drop_stack(setup)
        raise
    yield Stack(f"http://127.0.0.1:{setup.config['port']}", setup.redis, setup.dsn, proc, log_path, setup.media,
                setup.env)
    proc.send_signal(signal.SIGINT)
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        kill_process_tree(proc)
    drop_stack(setup)
    assert_no_task_collected(log_path.read_text(errors="replace"))


TASK_COLLECTED = "Task was destroyed but it is pending"
"""What asyncio logs when the garbage collector frees a task still waiting: the loop keeps only weak
references to tasks, so a task nobody references silently stops (the port gate's Redis follower did)."""


def assert_no_task_collected(log_text: str) -> None:
    """AssertionError naming the task when a process's log shows a pending task was collected."""
    at = log_text.find(TASK_COLLECTED)
    assert at < 0, log_text[at:at + 600]

def worker_pid(stack) -> int:
    """The process id of the stack's one worker, from the hash the worker publishes at start (``KEYS.worker_pid``)."""
    pids = list(stack.redis.hgetall(KEYS.worker_pid).values())
    assert len(pids) == 1, f"expected one worker, found {pids}"
    return int(pids[0])


def entry_of(stack, model_id: str) -> dict:
    """``GET /v1/models/<model_id>``'s JSON body."""
    with stack.client() as c:
        return c.get(f"/v1/models/{model_id}").json()


def events_of(stack, model_id: str) -> list[tuple[str, str, str]]:
    """The model's lifecycle audit rows ``(event, outcome, actor)``, oldest first."""
    return stack.sql("SELECT event, outcome, actor FROM registry_lifecycleevent WHERE model_id = %s ORDER BY id",
                     model_id)


def fx(model_id: str, slots: int | None = None, **load_options) -> dict:
    """A ``models`` entry (or management load body) of the fixture family with ``load_options``
    (barriers, injected failures, ``version``; inference/adapters/fixture_barrier.py)."""
    entry = {"id": model_id, "family": "fixture", "load_options": load_options}
    if slots is not None:
        entry["slots"] = slots
    return entry


# -- the processes of a stack ---------------------------------------------------------------------
def web_pid(stack) -> int:
    """The pid of the daphne child (``python -m audiosite.web``) of a stack's ``manage.py serve``."""
    for child in psutil.Process(stack.proc.pid).children(recursive=True):
        if "audiosite.web" in " ".join(_cmdline(child)):
            return child.pid
    raise AssertionError("no daphne child of manage.py serve")


def _cmdline(process: psutil.Process) -> list[str]:
    """``process``'s command line, or [] if it exited since it was listed (serve replaces children)."""
    try:
        return process.cmdline()
    except (psutil.NoSuchProcess, psutil.ZombieProcess):
        return []


def worker_pids(stack) -> list[int]:
    """The pids of the Celery worker children (``celery … worker``) of a stack's ``manage.py serve``."""
    return [child.pid for child in psutil.Process(stack.proc.pid).children(recursive=True)
            if "celery" in " ".join(_cmdline(child))]


def live_workers(stack) -> dict[str, str]:
    """Workers registered in the stack's Redis whose liveness key exists: Celery hostname -> process id."""
    return {host: pid for host, pid in stack.redis.hgetall(KEYS.worker_pid).items()
            if stack.redis.exists(KEYS.worker_live(host))}


