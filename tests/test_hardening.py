"""Issue 9 hardening: the embedded Redis, file modes, allowed hosts, security headers.

Real processes only: ``manage.py serve`` on the embedded default (its own SQLite and redis-server)
and the session ``stack`` (PostgreSQL, the test Redis).
"""
from __future__ import annotations

import base64
import json
import os
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import psutil
import pytest
import redis

from .helpers import QUICK_S, ROOT, embedded_env, free_port, mode_of, start_embedded

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
        if proc.poll() is None:
            proc.kill()


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
