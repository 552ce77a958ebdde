"""Celery's cold shutdown (SIGQUIT; what ``serve``'s second Ctrl-C sends a worker) ends the worker.

It sends no ``worker_shutdown`` signal, so the run dispatcher is told to stop popping from
``worker_shutting_down`` (``inference.worker.tasks``); before, its popping thread (not a daemon)
kept the process from exiting, and serve killed it after ``FORCED_STOP_S`` (the adversary's
finding of 2026-12-02). R8.4: a second signal stops at once.
"""
from __future__ import annotations

import signal
import subprocess
import time

import httpx
import pytest

from .helpers import FIXTURE_ENV, QUICK_S, body, run_cluster, run_stack

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
        began = time.monotonic()
        stack.proc.send_signal(signal.SIGINT)
        time.sleep(0.05)
        stack.proc.send_signal(signal.SIGINT)
        stack.proc.wait(timeout=30)
        took = time.monotonic() - began
        log = stack.log_path.read_text()
        assert "killing it" not in log, log[-3000:]
        assert took < 4, took
    finally:
        next(stacks, None)
