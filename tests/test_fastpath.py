"""The request path: hot API routes start no thread; the admin keeps its middleware.

The thread check watches the daphne process's thread ids (``/proc/<pid>/task``)
while requests run: Django's stock handler starts an executor thread per
request (the admin, as a control, must show that), the API handler must not.
"""
from __future__ import annotations

import base64
import os
import threading
from pathlib import Path

import pytest

from .support.audio import FIXTURES
from .support.stacks import web_pid

pytestmark = pytest.mark.skipif(not Path("/proc/self/task").exists(), reason="needs Linux /proc")


def _new_threads_during(pid: int, send) -> set[int]:
    """Thread ids of ``pid`` that appear while ``send()`` runs (polled without pause)."""
    before = {int(t) for t in os.listdir(f"/proc/{pid}/task")}
    seen: set[int] = set()
    done = threading.Event()

    def watch() -> None:
        while not done.is_set():
            try:
                seen.update(int(t) for t in os.listdir(f"/proc/{pid}/task"))
            except FileNotFoundError:
                pass

    watcher = threading.Thread(target=watch)
    watcher.start()
    try:
        send()
    finally:
        done.set()
        watcher.join()
    return seen - before


def test_hot_routes_start_no_thread_per_request_and_the_admin_control_does(stack):
    pid = web_pid(stack)
    wav = sorted(FIXTURES.glob("*.wav"))[0].read_bytes()
    vad = {"model": "vad", "request": {"audio_base64": base64.b64encode(wav).decode()}}
    with stack.client() as c:
        def hot(n: int) -> None:
            for i in range(n):
                for resp in (c.get("/health"), c.get("/v1/models"), c.get("/v1/models/vad"), c.get("/nope")):
                    assert resp.status_code in (200, 404), resp.text
                if i % 10 == 0:
                    assert c.post("/v1/tasks/run", json=vad).status_code == 200
                    resp = c.post("/v1/audio/transcriptions", data={"model": "nope"}, files={"file": ("a.wav", wav)})
                    assert resp.status_code == 404

        def admin(n: int) -> None:
            for _ in range(n):
                assert c.get("/admin/login/").status_code == 200

        hot(20)  # warm the executors that are shared on purpose (decode pool, Celery send)
        admin(2)
        started = _new_threads_during(pid, lambda: hot(50))  # 200 status reads + 10 inference
        control = _new_threads_during(pid, lambda: admin(20))
    assert len(started) <= 2, f"hot routes started {len(started)} threads"
    assert len(control) >= 5, f"the check saw only {len(control)} threads for 20 admin requests"


def test_admin_login_still_needs_csrf_and_the_api_does_not_set_cookies(stack):
    with stack.client() as c:
        resp = c.post("/admin/login/", data={"username": "x", "password": "y"})
        assert resp.status_code == 403 and "CSRF" in resp.text
        page = c.get("/admin/login/")
        assert "csrftoken" in page.cookies
        health = c.get("/health")
        assert "set-cookie" not in health.headers
        assert health.headers["x-content-type-options"] == "nosniff"
        assert health.headers["content-length"] == str(len(health.content))


def test_gate_off_answers_403_before_looking_at_credentials(stack):
    """docs/operations.md: ``ui_management`` off → 403 for everyone, an invalid token included."""
    with stack.client(headers={"Authorization": "Token " + "0" * 40}) as c:
        resp = c.post("/v1/models/unload", json={"id": "vad"})
        assert resp.status_code == 403 and resp.json()["error"]["type"] == "forbidden"
