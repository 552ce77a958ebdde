"""The worker's run-queue pop is reliable (R7.4, ``inference.worker.runs``): a run whose pop was
carried out by Redis but whose reply was lost with the popping connection is still answered, within
the liveness TTL, and leaves no lease, ticket or key behind. A parallel stack (Redis db 13) with one
fixture model."""
from __future__ import annotations

import asyncio
import os
import signal
import time

import pytest

from inference.runtime.context import KEYS
from inference.scheduler.keys import LIVENESS_TTL_MS

from .support.bounds import run, until, within
from .support.clients import mclient, post
from .support.stacks import FIXTURE_ENV, Stack, fx, live_workers, run_stack, worker_pids

pytestmark = pytest.mark.stack


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Stack:
    yield from run_stack(tmp_path_factory.mktemp("run_queue_pop"), [fx("m", 1)], redis_db=13,
                         name="run_queue_pop", parallel=True, extra_env=FIXTURE_ENV)


def _popping(stack: Stack) -> list[str]:
    db = str(stack.redis.connection_pool.connection_kwargs.get("db", 0))
    return [c["id"] for c in stack.redis.client_list() if c["cmd"] == "blmove" and c["db"] == db]


def _run_lists(stack: Stack) -> dict[str, int]:
    keys = [*stack.redis.scan_iter(KEYS.run_queue_prefix + "*"), *stack.redis.scan_iter(KEYS.prefix + "runtaken:*")]
    return {key: stack.redis.llen(key) for key in keys if stack.redis.llen(key)}


def test_a_run_whose_pop_reply_is_lost_with_its_connection_is_answered_within_the_liveness_ttl(stack):
    """R7.4: the worker is paused (SIGSTOP) while blocked in its pop and its popping connection is
    killed (CLIENT KILL); a request comes and its element is moved from the worker's queue onto its
    taken list, as Redis does for a pop whose reply is then lost with its connection (a reply cannot
    be lost on cue from outside Redis, so the test makes that move itself); the worker resumes
    (SIGCONT) and finds its pop's connection broken. The request is answered 200 (the sweep after the
    failed pop serves the run) well within the liveness TTL, the worker is never declared lost, and no
    lease, ticket, queue or taken list is left in Redis."""
    [pid] = worker_pids(stack)
    [host] = [host for host, live_pid in live_workers(stack).items() if live_pid == str(pid)]
    boot = stack.redis.get(KEYS.worker_live(host))
    queue, taken = KEYS.run_queue(host, boot), KEYS.run_taken(host, boot)

    async def scenario() -> float:
        async with mclient(stack, None) as client:
            assert (await post(client, "m"))[0].status_code == 200  # loaded, warm
            # blocked in its pop again, the warm run's element gone from the taken list
            await until(lambda: len(_popping(stack)) == 1 and _run_lists(stack) == {})
            popper = _popping(stack)[0]
            os.kill(pid, signal.SIGSTOP)
            try:
                assert stack.redis.execute_command("CLIENT", "KILL", "ID", popper) == 1
                request = asyncio.create_task(post(client, "m"))
                # Paused at most ~5 s: its last beat keeps the liveness key (10 s TTL) alive meanwhile.
                deadline = time.monotonic() + 5
                while _run_lists(stack) != {queue: 1}:
                    assert time.monotonic() < deadline, (_run_lists(stack), stack.counters("m"))
                    await asyncio.sleep(0.01)
                assert stack.redis.lmove(queue, taken, "RIGHT", "LEFT") is not None
                assert _run_lists(stack) == {taken: 1}
            finally:
                os.kill(pid, signal.SIGCONT)
            resumed = time.monotonic()
            resp, _, _ = await within(request, LIVENESS_TTL_MS / 1000)
            answered_s = time.monotonic() - resumed
            assert resp.status_code == 200, resp.text
            return answered_s

    answered_s = run(scenario())
    assert answered_s < LIVENESS_TTL_MS / 1000 / 2, answered_s
    stack.wait_idle("m", timeout_s=5)
    assert stack.counters("m") == {"leases": 0, "queued": 0}
    deadline = time.monotonic() + 3  # the run's thread removes its element just after its reply
    while _run_lists(stack):
        assert time.monotonic() < deadline, _run_lists(stack)
        time.sleep(0.02)
    assert str(pid) in live_workers(stack).values()  # never declared lost
