"""One lease keep-alive helper for every holder: web requests, managers, streams, worker steps.

A lease (or a loader claim) is reclaimed when its holder stops renewing it
for ``lease_ttl_ms`` (R2.5). A holder that may work longer than that renews
every third of the TTL, so two renewals may fail before the lease is lost.
"""
from __future__ import annotations

import asyncio
import heapq
import inspect
import itertools
import logging
import threading
import time
from collections.abc import Callable
from typing import Any

import redis.exceptions

log = logging.getLogger(__name__)

REDIS_DOWN = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
"""What a renewal raises while Redis is gone or unreachable: one warning per outage, not a traceback
per renewal (every lease held renews every third of the TTL)."""


class KeepAlive:
    """Renew a lease while a block runs: ``async with`` on an event loop, ``with`` in a thread.

    Args:
        renew: no-argument callable; returns truthy while the lease is still
            held (the scheduler's ``renew``/``renew_load``), or an awaitable of
            that (async Redis client; use ``async with`` then).
        every_s: seconds between renewals (usually ``lease_ttl_ms / 3000``).
        what: a name for log lines.

    A refused renewal (the lease was reclaimed) stops the renewals and is
    logged; ``lost`` is then True. A failed renewal (Redis error) is logged
    and retried at the next period. Exiting the block stops renewing; it
    never releases the lease (the holder does that).
    """

    def __init__(self, renew: Callable[[], Any], every_s: float, what: str = "lease"):
        self.renew = renew
        self.every_s = every_s
        self.what = what
        self.lost = False
        self._task: asyncio.Task | None = None
        self._stop = threading.Event()
        self._renewing = threading.Lock()  # held by a renewal in progress (thread mode)
        self._failing = False  # the last renewal failed for want of Redis (warned once)

    def _renew_failed(self, exc: Exception) -> None:
        """A renewal raised (called in its ``except``): Redis out of reach is logged once per outage, in
        one line; anything else with its traceback."""
        if not isinstance(exc, REDIS_DOWN):
            log.exception("renewing %s failed; retrying", self.what)
        elif not self._failing:
            log.warning("renewing %s failed (%s); retrying every %.1f s", self.what, exc, self.every_s)
        self._failing = isinstance(exc, REDIS_DOWN)

    def _renewed(self) -> None:
        if self._failing:
            log.warning("renewing %s succeeded again", self.what)
        self._failing = False

    def _refused(self) -> None:
        self.lost = True
        log.warning("renewal of %s refused: it was reclaimed", self.what)

    # -- on an event loop ------------------------------------------------------
    async def _loop(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            try:
                held = self.renew()
                if inspect.isawaitable(held):
                    held = await held
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                self._renew_failed(exc)
                continue
            self._renewed()
            if not held:
                self._refused()
                return

    async def __aenter__(self) -> KeepAlive:
        self._task = asyncio.create_task(self._loop(), name=f"keep-alive {self.what}")
        return self

    async def __aexit__(self, *exc) -> None:
        if self._task is not None:
            self._task.cancel()

    # -- in a thread -------------------------------------------------------------
    def _renew_in_thread(self) -> bool:
        """One renewal for :class:`_ThreadRenewer`; False once this keep-alive is over (exited or refused)."""
        with self._renewing:
            if self._stop.is_set():
                return False
            try:
                held = self.renew()
            except Exception as exc:
                self._renew_failed(exc)
                return True
            self._renewed()
            if not held:
                self._refused()
                return False
            return True

    def __enter__(self) -> KeepAlive:
        _THREAD_RENEWER.add(self)
        return self

    def __exit__(self, *exc) -> None:
        with self._renewing:  # waits for a renewal in progress: none happens after the block
            self._stop.set()


class _ThreadRenewer:
    """One daemon thread renewing every thread-mode :class:`KeepAlive` of the process when it is due.

    A worker serves many short runs; starting and joining a thread per run
    cost about 0.2 ms each (py-spy). Here ``__enter__`` only pushes
    ``(due, keep-alive)`` on a heap. Renewals run one after another on this
    thread (a renewal is one Redis round trip, well under the period of a
    third of the lease TTL). A keep-alive that exited is dropped when it
    comes due.
    """

    def __init__(self):
        self._cond = threading.Condition()
        self._heap: list[tuple[float, int, KeepAlive]] = []
        self._order = itertools.count()  # ties in ``due`` never compare two KeepAlives
        self._thread: threading.Thread | None = None

    def add(self, keep_alive: KeepAlive) -> None:
        with self._cond:
            heapq.heappush(self._heap, (time.monotonic() + keep_alive.every_s, next(self._order), keep_alive))
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="keep-alive renewer", daemon=True)
                self._thread.start()
            if self._heap[0][2] is keep_alive:  # due before everything else: the renewer must wake earlier
                self._cond.notify()

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._heap or self._heap[0][0] > time.monotonic():
                    self._cond.wait(None if not self._heap else self._heap[0][0] - time.monotonic())
                due: list[KeepAlive] = []
                now = time.monotonic()
                while self._heap and self._heap[0][0] <= now:
                    due.append(heapq.heappop(self._heap)[2])
            for keep_alive in due:
                if keep_alive._renew_in_thread():
                    with self._cond:
                        heapq.heappush(self._heap, (time.monotonic() + keep_alive.every_s, next(self._order),
                                                    keep_alive))


_THREAD_RENEWER = _ThreadRenewer()
