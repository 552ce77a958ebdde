"""Celery's cold shutdown (SIGQUIT; what ``serve``'s second Ctrl-C sends a worker) ends the worker.

It sends no ``worker_shutdown`` signal, so the run dispatcher is told to stop popping from
``worker_shutting_down`` (``inference.worker.tasks``); otherwise its popping thread (not a daemon)
would keep the process from exiting, and serve would kill it after ``FORCED_STOP_S``. A run in
progress would do the same (Python joins the run threads at exit): a cold shutdown abandons it, as Celery's
does, and the process ends with ``os._exit``. R8.4: a second signal stops at once.
"""
from __future__ import annotations

import signal
import subprocess
import threading
import time

import httpx
import pytest

from inference.scheduler import LIVENESS_EVERY_S, LIVENESS_TTL_MS

from .support.bounds import QUICK_S
from .support.clients import body
from .support.cluster import run_cluster
from .support.stacks import FIXTURE_ENV, run_stack

REDIS_DB = 10
MODELS = [{"id": "q", "family": "fixture", "slots": 2}]


@pytest.mark.stack
def test_a_standalone_worker_exits_on_its_cold_shutdown(tmp_path):
    """A separately run worker (distributed deployment) that served a run gets SIGQUIT: it exits
    within 15 s on its own (no supervisor kills it here)."""
    gen = run_cluster(tmp_path, MODELS, redis_db=REDIS_DB, name="cold1", webs=1, workers=1, extra_env=FIXTURE_ENV)
    cluster = next(gen)
    try:
        [worker] = cluster.workers
        with httpx.Client(base_url=cluster.webs[0].url, timeout=40) as client:
            assert client.post("/v1/tasks/run", json=body("q")).status_code == 200
        worker.proc.send_signal(signal.SIGQUIT)
        try:
            worker.proc.wait(timeout=15)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            worker.proc.wait(timeout=QUICK_S)
            raise AssertionError("the worker did not exit within 15 s of SIGQUIT:\n" + worker.log_tail(60)) from None
    finally:
        next(gen, None)


@pytest.mark.stack
def test_a_second_ctrl_c_stops_the_worker_by_its_cold_shutdown_not_a_kill(tmp_path):
    """serve's second Ctrl-C sends SIGQUIT and kills only what is still up 5 s later: an idle
    worker is gone before that on its own."""
    stacks = run_stack(tmp_path, MODELS, redis_db=REDIS_DB, name="cold2", parallel=True, extra_env=FIXTURE_ENV)
    stack = next(stacks)
    try:
        took, log = _ctrl_c_twice(stack, pause_s=0.05)
        assert "killing it" not in log, log[-3000:]
        assert took < 4, took
    finally:
        next(stacks, None)


def _ctrl_c_twice(stack, pause_s: float) -> tuple[float, str]:
    """Send ``serve`` SIGINT, then again ``pause_s`` later; wait for it to exit. Returns the seconds from
    the first signal to the exit and serve's log."""
    began = time.monotonic()
    stack.proc.send_signal(signal.SIGINT)
    time.sleep(pause_s)
    stack.proc.send_signal(signal.SIGINT)
    stack.proc.wait(timeout=30)
    return time.monotonic() - began, stack.log_path.read_text()


def _run_in_background(url: str, answers: list) -> threading.Thread:
    """POST a fixture run held at the barrier ``cold`` (never released) from a thread; its answer, or the
    exception the client raised, goes to ``answers`` with the monotonic time it came."""
    def send() -> None:
        try:
            with httpx.Client(base_url=url, timeout=40) as client:
                answers.append((client.post("/v1/tasks/run", json=body("q", barrier="cold")), time.monotonic()))
        except httpx.HTTPError as exc:
            answers.append((exc, time.monotonic()))
    thread = threading.Thread(target=send, daemon=True)
    thread.start()
    return thread


@pytest.mark.stack
def test_a_cold_shutdown_abandons_a_run_in_progress_and_its_sender_gets_worker_lost(tmp_path):
    """A separately run worker gets SIGQUIT while one of its runs is held in the adapter: it exits with
    Celery's cold exit code 1 within a few seconds (not when the run would end), and the web process
    answers that run's client 503 ``worker_lost`` (R7.4) soon: the worker deleted its liveness key on
    the way out (had it only expired, the answer could not come before ``LIVENESS_TTL_MS`` minus one
    beat interval, 8 s, after the signal); the lease is given back."""
    gen = run_cluster(tmp_path, MODELS, redis_db=REDIS_DB, name="cold3", webs=1, workers=1, extra_env=FIXTURE_ENV)
    cluster = next(gen)
    try:
        [worker] = cluster.workers
        answers: list = []
        sender = _run_in_background(cluster.webs[0].url, answers)
        cluster.wait_arrived("cold", timeout_s=QUICK_S)
        began = time.monotonic()
        worker.proc.send_signal(signal.SIGQUIT)
        try:
            code = worker.proc.wait(timeout=10)
        except subprocess.TimeoutExpired:
            worker.proc.kill()
            worker.proc.wait(timeout=QUICK_S)
            raise AssertionError("the worker did not exit within 10 s of SIGQUIT:\n" + worker.log_tail(60)) from None
        took = time.monotonic() - began
        assert code == 1 and took < 4, (code, took, worker.log_tail(30))
        assert "cold shutdown: exiting now" in worker.log_path.read_text()
        sender.join(timeout=30)
        [(answer, answered_at)] = answers
        assert isinstance(answer, httpx.Response) and answer.status_code == 503, answer
        assert answered_at - began < LIVENESS_TTL_MS / 1000 - LIVENESS_EVERY_S - 1, answered_at - began
        assert answer.json()["error"]["code"] == "worker_lost", answer.text
        cluster.wait_idle("q", timeout_s=QUICK_S)
    finally:
        next(gen, None)


@pytest.mark.stack
def test_a_second_ctrl_c_during_a_run_in_progress_stops_everything_without_a_kill(tmp_path):
    """serve's second Ctrl-C while a run is held in the adapter: every child is gone within 4 s and
    none had to be killed (before: the worker waited for its run until serve killed it 5 s later)."""
    stacks = run_stack(tmp_path, MODELS, redis_db=REDIS_DB, name="cold4", parallel=True, extra_env=FIXTURE_ENV)
    stack = next(stacks)
    try:
        answers: list = []
        _run_in_background(stack.url, answers)
        stack.wait_arrived("cold", timeout_s=QUICK_S)
        took, log = _ctrl_c_twice(stack, pause_s=0.3)
        assert "killing it" not in log, log[-3000:]
        assert "cold shutdown: exiting now" in log, log[-3000:]
        assert took < 4, took
    finally:
        next(stacks, None)
