"""The barrier protocol of the controllable test family ``fixture`` (tests and validation tools only).

A held step (load, run or teardown) waits at a named barrier until a
controller lets it through. Protocol (Redis, key names from ``Keys``):
INCR ``fixture_arrived(name)`` and PUBLISH ``arrived:<name>`` on
``fixture_events``, then BLPOP ``fixture_release(name)``; the controller
LPUSHes one item per waiter it lets through: ``go``, or ``fail`` to make the
held step raise. The worker hands :func:`make_barrier` to the adapter as
``LoadContext.barrier``; the adapter itself knows nothing of Redis.
"""
from __future__ import annotations

import functools
from collections.abc import Callable

import redis

from inference.scheduler import Keys

BARRIER_TIMEOUT_S = 120


@functools.cache
def make_barrier(redis_url: str, keys: Keys) -> Callable[[str], str]:
    """Return ``barrier(name) -> action`` bound to the deployment's Redis (one per process and URL).

    ``barrier`` blocks until released and returns 'go' or 'fail'.

    Raises (from ``barrier``):
        TimeoutError: nobody released it within ``BARRIER_TIMEOUT_S`` (120 s).
    """
    # A socket timeout that outlasts the BLPOP (redis-py's default is 5 s).
    client = redis.Redis.from_url(redis_url, decode_responses=True, socket_timeout=BARRIER_TIMEOUT_S + 10)

    def barrier(name: str) -> str:
        client.incr(keys.fixture_arrived(name))
        client.publish(keys.fixture_events, f"arrived:{name}")
        item = client.blpop([keys.fixture_release(name)], timeout=BARRIER_TIMEOUT_S)
        if item is None:
            raise TimeoutError(f"barrier {name!r} was not released within {BARRIER_TIMEOUT_S} s")
        return str(item[1])

    return barrier
