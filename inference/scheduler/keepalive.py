"""One lease keep-alive helper for every holder: web requests, managers, streams, worker steps.

A lease (or a loader claim) is reclaimed when its holder stops renewing it
for ``lease_ttl_ms`` (R2.5). A holder that may work longer than that renews
every third of the TTL, so two renewals may fail before the lease is lost.
"""
from __future__ import annotations

import asyncio
import inspect
import logging
import threading
from collections.abc import Callable
from typing import Any

log = logging.getLogger(__name__)


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
        self._thread: threading.Thread | None = None
        self._stop = threading.Event()

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
            except Exception:
                log.exception("renewing %s failed; retrying", self.what)
                continue
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
    def _run_thread(self) -> None:
        while not self._stop.wait(self.every_s):
            try:
                held = self.renew()
            except Exception:
                log.exception("renewing %s failed; retrying", self.what)
                continue
            if not held:
                self._refused()
                return

    def __enter__(self) -> KeepAlive:
        self._thread = threading.Thread(target=self._run_thread, name=f"keep-alive {self.what}", daemon=True)
        self._thread.start()
        return self

    def __exit__(self, *exc) -> None:
        self._stop.set()
        if self._thread is not None:
            self._thread.join()

