"""``manage.py serve`` keeps its web process alive (``audiosite.supervision.WebSupervisor``,
``audiosite.heartbeat``; docs/operations.md "Restarts"): a web process whose event loop stops
sending its heartbeat for ``web_stall_timeout_ms`` is killed and replaced, one that dies is
replaced, and the scheduler tickets a dead web process left queued are never granted to it (R7.5).

The stall is real: the web process is stopped with SIGSTOP (its loop stops turning, as a spinning
coroutine's does, while the kernel still completes TCP handshakes on its port).
"""
from __future__ import annotations

import asyncio
import os
import signal
import time

import httpx
import pytest
import redis.asyncio as aioredis

from inference.scheduler import Keys, LeaseKind, Listener, Scheduler

from .support.bounds import QUICK_S, run, until, within
from .support.clients import body, mclient
from .support.processes import process_ended
from .support.stacks import FIXTURE_ENV, run_stack, web_pid

pytestmark = pytest.mark.stack

STALL_MS = 2000  # web_stall_timeout_ms of these stacks (its minimum)
RESTART_MS = 200  # worker_restart_delay_ms: the web process's restart delay too


def _replacement(stack, old_pid: int, timeout_s: float = 90.0) -> int:
    """Wait until serve runs a web process other than ``old_pid`` that answers ``/health`` 200; its pid."""
    deadline = time.monotonic() + timeout_s
    while True:
        assert stack.proc.poll() is None, "serve must keep running:\n" + stack.log_tail()
        assert time.monotonic() < deadline, "no new web process answered:\n" + stack.log_tail()
        try:
            pid = web_pid(stack)
        except AssertionError:
            pid = old_pid
        if pid != old_pid:
            try:
                if httpx.get(stack.url + "/health", timeout=2).status_code == 200:
                    return pid
            except httpx.HTTPError:
                pass
        time.sleep(0.2)


def test_a_web_process_whose_loop_stalls_is_killed_and_replaced_and_http_answers_again(tmp_path):
    """A stalled event loop (SIGSTOP: no heartbeat) is noticed within ``web_stall_timeout_ms`` plus a
    tick, the stopped process is killed (not left behind), a new one is started, and HTTP answers
    again; serve itself keeps running."""
    stacks = run_stack(tmp_path, [{"id": "q", "family": "fixture"}], redis_db=8, name="webstall",
                       extra_env=FIXTURE_ENV,
                       extra_config={"web_stall_timeout_ms": STALL_MS, "worker_restart_delay_ms": RESTART_MS})
    stack = next(stacks)
    try:
        old = web_pid(stack)
        os.kill(old, signal.SIGSTOP)
        stopped_at = time.monotonic()
        new = _replacement(stack, old)
        replaced_s = time.monotonic() - stopped_at
        assert process_ended(old)
        log = stack.log_path.read_text()
        assert f"web process (pid {old}) sent no heartbeat for" in log, stack.log_tail()
        assert f"started web process (pid {new})" in log
        assert replaced_s > STALL_MS / 1000, f"replaced after {replaced_s:.1f} s, before the stall bound"
        with stack.client() as c:
            resp = c.post("/v1/tasks/run", json=body("q"))
            assert resp.status_code == 200, resp.text
    finally:
        next(stacks, None)


def test_a_killed_web_process_is_restarted_and_its_queued_ticket_is_never_granted_to_it(tmp_path):
    """R7.5 at a web process's death: it is waiting for the only slot of ``q`` (held by another live
    process, this test) when it is killed (``kill -9``). serve restarts it, and forgets its scheduler
    channel at once (liveness key, queued tickets), so when the slot is given back nothing is granted
    to the dead process — a grant to nobody would hold the slot for one ``lease_ttl_ms`` (30 s here)."""
    stacks = run_stack(tmp_path, [{"id": "q", "family": "fixture"}], redis_db=8, name="webkill",
                       extra_env=FIXTURE_ENV,
                       extra_config={"lease_ttl_ms": 30000, "worker_restart_delay_ms": RESTART_MS})
    stack = next(stacks)
    keys = Keys("as:")
    try:
        old = web_pid(stack)

        async def scenario():
            client = aioredis.Redis.from_url(stack.env["REDIS_URL"], decode_responses=True)
            scheduler = Scheduler(client, keys, 30000)
            listener = await Listener.start(client, keys.process_channel)
            try:
                lease = await within(scheduler.acquire(listener, "q", 0, LeaseKind.REQUEST))
                async with mclient(stack, None, timeout=QUICK_S) as c:
                    waiting = asyncio.create_task(c.post("/v1/tasks/run", json=body("q")))
                    await until(lambda: stack.counters("q")["queued"] == 1, QUICK_S)
                    os.kill(old, signal.SIGKILL)
                    await until(lambda: "forgot scheduler channel" in stack.log_path.read_text(), QUICK_S)
                    assert f"web process (pid {old}) exited with code -9" in stack.log_path.read_text()
                    await scheduler.release("q", lease.lease_id)
                    after_release = stack.counters("q")
                    try:
                        await within(waiting, QUICK_S)
                    except httpx.HTTPError:
                        pass  # its connection went with the process
                return after_release
            finally:
                await listener.close()
                await client.aclose()

        after_release = run(scenario())
        assert after_release == {"leases": 0, "queued": 0}, \
            f"the dead web process's ticket was granted: {after_release}\n{stack.log_tail()}"
        _replacement(stack, old)
        with stack.client() as c:
            resp = c.post("/v1/tasks/run", json=body("q"))
            assert resp.status_code == 200, resp.text
    finally:
        next(stacks, None)


def test_the_slot_a_killed_web_process_held_is_given_back_at_its_death(tmp_path):
    """R2.5 at a web process's death: its request holds the only slot of ``q`` (run held at a fixture
    barrier on the worker) and another live process (this test) waits for it, when the web process is
    killed (``kill -9``). serve releases the dead process's lease at once (the scheduler records each
    lease's holder channel), so the waiter is granted within seconds instead of when the lease expires
    (``lease_ttl_ms``, 30 s here)."""
    stacks = run_stack(tmp_path, [{"id": "q", "family": "fixture"}], redis_db=8, name="webheld",
                       extra_env=FIXTURE_ENV,
                       extra_config={"lease_ttl_ms": 30000, "worker_restart_delay_ms": RESTART_MS})
    stack = next(stacks)
    keys = Keys("as:")
    try:
        old = web_pid(stack)

        async def scenario():
            client = aioredis.Redis.from_url(stack.env["REDIS_URL"], decode_responses=True)
            scheduler = Scheduler(client, keys, 30000)
            listener = await Listener.start(client, keys.process_channel)
            try:
                async with mclient(stack, None, timeout=QUICK_S) as c:
                    holding = asyncio.create_task(c.post("/v1/tasks/run", json=body("q", barrier="held")))
                    await until(lambda: stack.arrived("held") == 1, QUICK_S)
                    waiter = asyncio.create_task(scheduler.acquire(listener, "q", 0, LeaseKind.REQUEST))
                    await until(lambda: stack.counters("q")["queued"] == 1, QUICK_S)
                    os.kill(old, signal.SIGKILL)
                    killed_at = time.monotonic()
                    lease = await within(waiter, QUICK_S)
                    granted_after_s = time.monotonic() - killed_at
                    await scheduler.release("q", lease.lease_id)
                    try:
                        await within(holding, QUICK_S)
                    except httpx.HTTPError:
                        pass  # its connection went with the process
                return granted_after_s
            finally:
                await listener.close()
                await client.aclose()

        granted_after_s = run(scenario())
        assert granted_after_s < 5, f"the waiter was granted {granted_after_s:.1f} s after the holder's death"
        # serve logs the release after the script that granted the waiter returns: wait for the line
        try:
            run(until(lambda: "1 lease(s) released" in stack.log_path.read_text(), QUICK_S))
        except AssertionError:
            raise AssertionError(f"serve did not log the released lease\n{stack.log_tail()}") from None
    finally:
        stack.release("held")
        next(stacks, None)
