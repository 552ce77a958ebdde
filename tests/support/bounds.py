"""Bounds on waiting: every await and scenario of a test ends in an AssertionError naming its bound,
not at pytest's 600 s timeout.

``QUICK_S`` bounds a request expecting a quick answer, ``MODEL_S`` one that loads or runs a real model
(Whisper, Silero), ``SCENARIO_S`` a whole :func:`run` scenario (all in seconds).
"""
from __future__ import annotations

import asyncio
import time


# Bounds: a test expecting a quick answer fails after QUICK_S, not at pytest's 600 s timeout;
# requests that load or run a real model (Whisper, Silero) get MODEL_S.
QUICK_S = 30.0
MODEL_S = 60.0
SCENARIO_S = 120.0


async def within(aw, seconds: float = QUICK_S):
    """Await ``aw`` (a coroutine, task or future) for at most ``seconds``; an AssertionError names the bound."""
    bound = asyncio.timeout(seconds)
    try:
        async with bound:
            return await aw
    except TimeoutError:
        if bound.expired():
            raise AssertionError(f"not done within {seconds:g} s") from None
        raise


def run(coro, seconds: float = SCENARIO_S):
    """Run an async scenario to completion, bounded as a whole (each await inside has its own bound)."""
    return asyncio.run(within(coro, seconds))


async def until(predicate, timeout_s: float = 20.0):
    """Poll ``predicate()`` every 10 ms until it is true; AssertionError after ``timeout_s`` seconds."""
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise AssertionError("condition not reached in time")
        await asyncio.sleep(0.01)


async def outcome_of(task, seconds: float = 10):
    """What ``task`` returned or raised, within ``seconds``."""
    return (await within(asyncio.gather(task, return_exceptions=True), seconds))[0]

