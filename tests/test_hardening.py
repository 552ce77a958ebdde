"""Hardening: the embedded Redis, allowed hosts, security headers, file modes, the secret key,
the reverse proxy.

Real processes only: ``manage.py serve`` on the embedded default (its own SQLite and redis-server),
the session ``stack`` (PostgreSQL, the test Redis), and nginx in front of it when an nginx binary
is installed (the proxy tests are skipped otherwise).
"""
from __future__ import annotations

import base64
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from pathlib import Path

import httpx
import psutil
import pytest
import redis
import yaml

from audiosite.serverconfig import DEFAULT_CONFIG_PATH, load_config

from .support.bounds import QUICK_S
from .support.processes import ROOT, embedded_env, free_port, kill_process_tree, mode_of, need_program, start_embedded

SECURITY_HEADERS = {
    "x-frame-options": "DENY",
    "x-content-type-options": "nosniff",
    "referrer-policy": "same-origin",
    "cross-origin-opener-policy": "same-origin",
}
FOREIGN_HOST = "rebound.attacker.example"
SAMPLE = ROOT / "samples" / "librispeech_test_clean_6930-75918-0000.wav"


def assert_security_headers(resp: httpx.Response) -> None:
    for name, value in SECURITY_HEADERS.items():
        assert resp.headers.get_list(name) == [value], (resp.request.url, name, resp.headers)


def assert_disallowed_host(resp: httpx.Response) -> None:
    assert resp.status_code == 400, resp.text
    assert resp.headers["content-type"] == "application/json"
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"}
    assert (error["type"], error["code"], error["param"]) == ("invalid_request_error", "disallowed_host", None)
    assert "allowed_hosts" in error["message"]


def raw_redis(socket_path: Path, command: bytes) -> bytes:
    """Send one inline command to a Redis unix socket without authenticating; return the first reply line."""
    with socket.socket(socket.AF_UNIX, socket.SOCK_STREAM) as sock:
        sock.settimeout(QUICK_S)
        sock.connect(str(socket_path))
        sock.sendall(command + b"\r\n")
        reply = b""
        while not reply.endswith(b"\r\n"):
            chunk = sock.recv(4096)
            assert chunk, "the server closed the connection without a reply"
            reply += chunk
    return reply


# -- the embedded Redis and file modes (manage.py serve on the embedded default) -------------------
@pytest.mark.stack
def test_the_embedded_redis_and_the_var_folder_belong_to_the_service_user_only(tmp_path):
    """The embedded Redis: no TCP listener, a 0700 socket folder, a 0600 password file, NOAUTH without
    the password, no CONFIG/MODULE/DEBUG with it, the password on no command line and in no log; the
    web and the Celery worker (kombu's redis+socket form) work through it. A var folder and SQLite
    file an older version left readable are narrowed to 0700/0600. A second serve on the same var
    folder is refused instead of taking the socket over."""
    var = tmp_path / "var"
    var.mkdir(mode=0o755)
    os.chmod(var, 0o755)
    (var / "audiosite.sqlite3").touch()
    os.chmod(var / "audiosite.sqlite3", 0o644)  # an empty file is an empty SQLite database
    config = tmp_path / "server.json"
    config.write_text(json.dumps({"backend": "cpu", "lazy_load": True, "allowed_hosts": ["audio.example.test"],
                                  "models": [{"id": "vad", "family": "silero_vad"}]}))
    port = free_port()
    proc, log_path = start_embedded(tmp_path, "--config", str(config), "--port", str(port))
    try:
        redis_dir = var / "redis"
        socket_path = redis_dir / "redis.sock"
        password = (redis_dir / "password").read_text().strip()
        assert re.fullmatch(r"[0-9a-f]{64}", password)

        assert mode_of(var) == 0o700 and mode_of(redis_dir) == 0o700
        for path in (redis_dir / "password", redis_dir / "redis.conf", var / "audiosite.sqlite3",
                     var / "audiosite.sqlite3-wal", var / "audiosite.sqlite3-shm", var / "secret_key"):
            assert mode_of(path) == 0o600, path
        assert mode_of(socket_path) & 0o077 == 0

        children = psutil.Process(proc.pid).children(recursive=True)
        server = next(c for c in children if "redis-server" in " ".join(c.cmdline()))
        assert server.net_connections(kind="inet") == []  # no TCP (or UDP) socket at all
        assert str(socket_path) in {c.laddr for c in server.net_connections(kind="unix")}
        for process in [psutil.Process(proc.pid), *children]:
            assert password not in " ".join(process.cmdline()), process.cmdline()
        log = log_path.read_text()
        assert password not in log
        assert f"embedded redis-server on unix://:***@{socket_path}?db=0" in log

        assert raw_redis(socket_path, b"PING").startswith(b"-NOAUTH")
        assert raw_redis(socket_path, b"GET as:runtime").startswith(b"-NOAUTH")
        client = redis.Redis(unix_socket_path=str(socket_path), password=password, socket_timeout=QUICK_S)
        try:
            assert client.ping()
            for command in (("CONFIG", "GET", "dir"), ("CONFIG", "SET", "dir", "/tmp"), ("MODULE", "LIST"),
                            ("DEBUG", "SLEEP", "0")):
                with pytest.raises(redis.ResponseError, match="unknown command"):
                    client.execute_command(*command)
        finally:
            client.close()
        with pytest.raises(redis.AuthenticationError):
            redis.Redis(unix_socket_path=str(socket_path), password="0" * 64, socket_timeout=QUICK_S).ping()

        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=60) as c:
            # A lazy model: this request sends a load task and a run task through the Celery broker.
            run = c.post("/v1/tasks/run", json={"model": "vad", "request": {
                "audio_base64": base64.b64encode(SAMPLE.read_bytes()).decode()}})
            assert run.status_code == 200 and run.json()["segments"], run.text
            assert c.get("/health", headers={"Host": f"audio.example.test:{port}"}).status_code == 200
            assert_disallowed_host(c.get("/health", headers={"Host": f"{FOREIGN_HOST}:{port}"}))

        second = subprocess.run([sys.executable, "manage.py", "serve", "--config", str(config), "--port",
                                 str(free_port())], cwd=ROOT, env=embedded_env(tmp_path), capture_output=True,
                                text=True, timeout=60)
        assert second.returncode != 0
        assert "another `manage.py serve` uses this var folder" in second.stderr, second.stderr
        assert (redis_dir / "password").read_text().strip() == password  # the running server's is kept

        proc.send_signal(signal.SIGINT)
        assert proc.wait(timeout=60) == 0
    finally:
        kill_process_tree(proc)


def test_a_socket_path_too_long_for_unix_sockets_is_refused_with_a_message(tmp_path):
    deep = tmp_path / ("d" * 60) / ("e" * 60)
    done = subprocess.run([sys.executable, "manage.py", "serve", "--port", str(free_port())], cwd=ROOT,
                          env={**embedded_env(tmp_path), "AUDIOSITE_VAR_DIR": str(deep)},
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "over the 100-byte limit of unix sockets" in done.stderr and "AUDIOSITE_VAR_DIR" in done.stderr


# -- allowed hosts and security headers (the session stack, bound to 127.0.0.1) --------------------
@pytest.mark.parametrize("method, path", [("GET", "/health"), ("GET", "/v1/models"), ("GET", "/v1/models/vad"),
                                          ("GET", "/nope"), ("POST", "/v1/tasks/run"), ("GET", "/admin/login/")])
def test_a_foreign_host_gets_400_in_the_error_shape_with_the_security_headers(stack, method, path):
    """DNS rebinding: a page whose name now resolves to this server sends its own name as Host."""
    with stack.client() as c:
        resp = c.request(method, path, headers={"Host": FOREIGN_HOST},
                         json={"model": "vad", "request": {"audio_base64": ""}} if method == "POST" else None)
    assert_disallowed_host(resp)
    assert_security_headers(resp)
    assert stack.counters("vad") == {"leases": 0, "queued": 0}


@pytest.mark.parametrize("host", ["127.0.0.1", "localhost", "[::1]", "LOCALHOST"])
def test_the_bound_hosts_names_are_allowed_with_and_without_a_port(stack, host):
    port = stack.url.rsplit(":", 1)[1]
    with stack.client() as c:
        for value in (host, f"{host}:{port}"):
            resp = c.get("/health", headers={"Host": value})
            assert resp.status_code == 200, (value, resp.text)


def test_security_headers_are_on_every_response(stack):
    """API responses (ApiHandler, API_MIDDLEWARE) and admin pages (Django's handler, MIDDLEWARE) alike,
    errors included."""
    with stack.client() as c:
        responses = [c.get("/health"), c.get("/v1/models"), c.get("/v1/models/vad"), c.get("/v1/models/nope"),
                     c.get("/nope"), c.post("/v1/tasks/run", json={}), c.delete("/health"),
                     c.get("/admin/login/"), c.get("/admin/")]
    assert [r.status_code for r in responses] == [200, 200, 200, 404, 404, 400, 405, 200, 302]
    for resp in responses:
        assert_security_headers(resp)


# -- the secret key ---------------------------------------------------------------------------------
def _import_settings(tmp_path: Path, **env: str) -> subprocess.CompletedProcess:
    """Import the settings in a fresh interpreter (what every process does first)."""
    full = {k: v for k, v in os.environ.items() if not k.startswith("AUDIOSITE_")}
    full.update(AUDIOSITE_VAR_DIR=str(tmp_path / "var"), **env)
    return subprocess.run([sys.executable, "-c", "import audiosite.settings as s; print(len(s.SECRET_KEY))"],
                          cwd=ROOT, env=full, capture_output=True, text=True, timeout=60)


@pytest.mark.parametrize("key, debug, refusal", [
    ("change-me", "0", "is the placeholder 'change-me'"),
    ("CHANGEME", "0", "is the placeholder 'CHANGEME'"),
    ("django-insecure-" + "x1y2z3" * 8, "0", "is the placeholder"),
    ("short-but-not-a-placeholder", "0", "is 27 characters long (at least 32 are needed)"),
    ("ab" * 30, "0", "has fewer than 5 distinct characters"),
    ("change-me", "1", None),
    ("Vq3l8-w0H9m2ZpK1x7RtYcB4nD6sE5fG", "0", None),
])
def test_a_placeholder_or_weak_secret_key_is_refused_unless_debug(tmp_path, key, debug, refusal):
    done = _import_settings(tmp_path, AUDIOSITE_SECRET_KEY=key, AUDIOSITE_DEBUG=debug)
    if refusal is None:
        assert done.returncode == 0, done.stderr
    else:
        assert done.returncode != 0
        assert "refusing to start: the secret key (AUDIOSITE_SECRET_KEY) " + refusal in done.stderr, done.stderr


def test_without_a_key_one_is_generated_once_with_mode_0600_and_an_empty_key_file_is_refused(tmp_path):
    first = _import_settings(tmp_path)
    assert first.returncode == 0, first.stderr
    key_file = tmp_path / "var" / "secret_key"
    assert mode_of(tmp_path / "var") == 0o700 and mode_of(key_file) == 0o600
    key = key_file.read_text()
    assert _import_settings(tmp_path).returncode == 0 and key_file.read_text() == key
    key_file.write_text("")
    empty = _import_settings(tmp_path)
    assert empty.returncode != 0 and f"the secret key ({key_file}) is empty" in empty.stderr


def test_serve_refuses_to_start_with_the_placeholder_secret(tmp_path):
    """The old docker-compose value: serve stops before it starts anything (no child, no var folder)."""
    started = time.monotonic()
    done = subprocess.run([sys.executable, "manage.py", "serve", "--port", str(free_port())], cwd=ROOT,
                          env=embedded_env(tmp_path, AUDIOSITE_SECRET_KEY="change-me"),
                          capture_output=True, text=True, timeout=60)
    assert done.returncode != 0
    assert "refusing to start: the secret key (AUDIOSITE_SECRET_KEY) is the placeholder 'change-me'" in done.stderr
    assert not (tmp_path / "var").exists()
    assert time.monotonic() - started < QUICK_S


# -- docker-compose and the reverse proxy -------------------------------------------------------------
def test_compose_puts_nginx_in_front_requires_a_secret_and_a_public_host_and_restarts_what_exits():
    text = (ROOT / "docker-compose.yml").read_text()
    compose = yaml.safe_load(text)
    services = compose["services"]
    assert "ports" not in services["web"] and services["web"]["expose"] == ["8080"]
    published = [name for name, service in services.items() if "ports" in service]
    assert published == ["proxy"]
    assert services["proxy"]["image"].startswith("nginx:")
    assert services["web"]["restart"] == services["worker"]["restart"] == "unless-stopped"  # exit 1 at start-up
    mount = services["proxy"]["volumes"][0].split(":")
    assert (ROOT / mount[0]).is_file() and mount[1] == "/etc/nginx/conf.d/default.conf"
    env = compose["x-app"]["environment"]
    assert env["AUDIOSITE_SECRET_KEY"].startswith("${AUDIOSITE_SECRET_KEY:?")
    assert "change-me" not in text
    # Compose substitutes the variable; the result must be a valid configuration under the 0.0.0.0 rule.
    overrides = json.loads(re.sub(r"\$\{AUDIOSITE_PUBLIC_HOST:\?[^}]*\}", "audio.example.com",
                                  env["AUDIOSITE_CONFIG_OVERRIDES"]))
    config = load_config(DEFAULT_CONFIG_PATH, overrides)
    assert config.host == "0.0.0.0" and "audio.example.com" in config.allowed_host_names()


NGINX = shutil.which("nginx") or next((p for p in ("/usr/sbin/nginx",) if os.path.exists(p)), None)


@pytest.fixture
def proxy(stack, tmp_path):
    """nginx with deploy/nginx/audiosite.conf in front of the stack (upstream and listen address replaced)."""
    nginx = need_program(NGINX, "nginx to run deploy/nginx/audiosite.conf", "nginx-light")
    site = (ROOT / "deploy" / "nginx" / "audiosite.conf").read_text()
    port = free_port()
    upstream = stack.url.removeprefix("http://")
    assert site.count("server web:8080 ") == 1 and site.count("listen 8080;") == 1
    site = site.replace("server web:8080 ", f"server {upstream} ").replace("listen 8080;", f"listen 127.0.0.1:{port};")
    (tmp_path / "site.conf").write_text(site)
    temp = {name: tmp_path / name for name in ("body", "proxy", "fastcgi", "uwsgi", "scgi")}
    main = "\n".join([
        "user root;" if os.geteuid() == 0 else "",
        "worker_processes 1;",
        f"pid {tmp_path / 'nginx.pid'};",
        f"error_log {tmp_path / 'error.log'} info;",
        "events { worker_connections 64; }",
        "http {",
        "  access_log off;",
        *(f"  {name}_temp_path {path};" if name != "body" else f"  client_body_temp_path {path};"
          for name, path in temp.items()),
        f"  include {tmp_path / 'site.conf'};",
        "}",
    ])
    (tmp_path / "nginx.conf").write_text(main)
    check = subprocess.run([nginx, "-t", "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf")],
                           capture_output=True, text=True, timeout=QUICK_S)
    assert check.returncode == 0, check.stderr
    proc = subprocess.Popen([nginx, "-p", str(tmp_path), "-c", str(tmp_path / "nginx.conf"), "-g", "daemon off;"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    deadline = time.monotonic() + QUICK_S
    while True:
        try:
            socket.create_connection(("127.0.0.1", port), timeout=1).close()
            break
        except OSError:
            assert proc.poll() is None and time.monotonic() < deadline, (tmp_path / "error.log").read_text()
            time.sleep(0.05)
    yield f"http://127.0.0.1:{port}"
    proc.terminate()
    try:
        proc.wait(timeout=QUICK_S)
    except subprocess.TimeoutExpired:
        proc.kill()
        proc.wait()


def test_the_proxy_forwards_the_host_and_refuses_oversize_bodies_in_the_error_shape(stack, proxy):
    with httpx.Client(base_url=proxy, timeout=QUICK_S) as c:
        health = c.get("/health")
        assert health.status_code == 200 and health.json()["status"] == "ok"
        assert_security_headers(health)  # the app's, once each: nginx adds none to proxied responses
        assert_disallowed_host(c.get("/health", headers={"Host": FOREIGN_HOST}))  # Host reaches the app
    port = int(proxy.rsplit(":", 1)[1])
    # 200 MB announced, nothing sent: nginx answers from the header, before reading any body.
    with socket.create_connection(("127.0.0.1", port), timeout=QUICK_S) as sock:
        sock.sendall(b"POST /v1/tasks/run HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                     b"Content-Length: 200000000\r\n\r\n")
        reply = b""
        while b"\r\n\r\n" not in reply or not reply.rstrip().endswith(b"}"):
            chunk = sock.recv(65536)
            if not chunk:
                break
            reply += chunk
    head, _, payload = reply.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 413"), reply
    assert b"content-type: application/json" in head.lower() and b"x-frame-options: deny" in head.lower()
    error = json.loads(payload.decode())["error"]
    assert (error["type"], set(error)) == ("invalid_request_error", {"message", "type", "param", "code"})


def test_the_proxy_drops_stalled_clients_and_never_hands_them_to_daphne(stack, proxy):
    """A client that stops sending its header is closed after client_header_timeout (10 s); one that
    stops sending its body after client_body_timeout (15 s), and daphne never sees that request
    (nginx forwards a request only once its whole body has arrived)."""
    port = int(proxy.rsplit(":", 1)[1])
    marker = f"/stalled-{uuid.uuid4().hex}"
    outcome: dict[str, tuple[float, bytes]] = {}

    def stall(name: str, sent: bytes) -> None:
        with socket.create_connection(("127.0.0.1", port), timeout=40) as sock:
            sock.sendall(sent)
            started = time.monotonic()
            reply = b""
            while chunk := sock.recv(4096):
                reply += chunk
            outcome[name] = (time.monotonic() - started, reply)

    threads = [
        threading.Thread(target=stall, args=("header", b"GET /health HTTP/1.1\r\nHost: 127.0.0.1\r\n")),
        threading.Thread(target=stall, args=("body", f"POST {marker} HTTP/1.1\r\nHost: 127.0.0.1\r\n"
                                                     "Content-Length: 1000\r\n\r\n".encode() + b"x" * 10)),
    ]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join(timeout=60)
    assert set(outcome) == {"header", "body"}
    header_s, header_reply = outcome["header"]
    body_s, body_reply = outcome["body"]
    assert 9 <= header_s <= 14 and b"200 OK" not in header_reply, outcome
    assert 14 <= body_s <= 19, outcome
    assert body_reply == b"" or body_reply.startswith(b"HTTP/1.1 408"), body_reply
    assert marker not in stack.log_path.read_text(errors="replace")


def test_the_proxy_passes_the_ui_status_websocket_through(stack, proxy):
    """deploy/nginx/audiosite.conf upgrades /ui/ws/: the handshake reaches daphne (101) and the
    first live status message comes back through nginx."""
    port = int(proxy.rsplit(":", 1)[1])
    with socket.create_connection(("127.0.0.1", port), timeout=QUICK_S) as sock:
        sock.sendall(f"GET /ui/ws/status HTTP/1.1\r\nHost: 127.0.0.1:{port}\r\nUpgrade: websocket\r\n"
                     f"Connection: Upgrade\r\nSec-WebSocket-Key: dGhlIHNhbXBsZSBub25jZQ==\r\n"
                     f"Sec-WebSocket-Version: 13\r\nOrigin: http://127.0.0.1:{port}\r\n\r\n".encode())
        data = b""
        deadline = time.monotonic() + QUICK_S
        while b'"type": "status"' not in data and time.monotonic() < deadline:
            chunk = sock.recv(65536)
            if not chunk:
                break
            data += chunk
    assert data.startswith(b"HTTP/1.1 101"), data[:200]
    assert b'"type": "status"' in data and b'"id": "whisper"' in data
