"""Idle retirement on the worker that owns the pools (R6.4).

A thread with an event loop of its own checks this worker's pools every
``min(1 s, idle_ms / 4)`` and retires the idle ones through
``inference.services.model_retire_if_idle`` (the same teardown path as every
other unload: the manager lease, the teardown RPC, the database records).
"""
from __future__ import annotations

import asyncio
import logging
import threading

from inference import services
from inference.runtime.context import async_context

from .state import WorkerState

log = logging.getLogger(__name__)

_stop = threading.Event()


def retirement_start(worker: WorkerState, idle_ms: int) -> threading.Thread:
    """Start the retirement thread for ``idle_ms`` (> 0)."""
    thread = threading.Thread(target=_retire_forever, args=(worker, idle_ms), name="idle retirement", daemon=True)
    thread.start()
    return thread


def retirement_stop() -> None:
    """Ask the retirement thread to stop after its current check."""
    _stop.set()


def _retire_forever(worker: WorkerState, idle_ms: int) -> None:
    every_s = max(0.05, min(1.0, idle_ms / 4000))
    loop = asyncio.new_event_loop()
    try:
        ctx = loop.run_until_complete(async_context())
        while not _stop.wait(every_s):
            for model_id in list(worker.pools):
                try:
                    loop.run_until_complete(services.model_retire_if_idle(ctx, model_id, idle_ms))
                except Exception:
                    log.exception("idle retirement of %s failed", model_id)
        loop.run_until_complete(ctx.listener.close())
    finally:
        loop.close()
