"""Worker liveness (R7.4): ``<prefix>worker:<hostname>`` = boot id, refreshed with a TTL.

Every process tells a live owner from a dead one by that key: a worker that
stops beating for ``LIVENESS_TTL_MS`` is considered dead and its pools lost.
Each beat also publishes the host's available memory in MB (psutil's
``available``: memory usable without swapping, MemAvailable on Linux) for the
memory guard (R6.5), the process id in ``Keys.worker_pid``, so ``serve``
can tell a dead local worker from a live one, the backend its sessions get in
``Keys.worker_backend`` (``/health``), and this process's CPU seconds and
resident memory for ``/metrics`` (``inference.runtime.metrics.process_queue``). That hash is also the registry
of workers that ``census.lua`` counts (``/health``, the no-worker fail-fast):
each beat re-adds this worker (a worker whose key expired while it was frozen
reappears at its next beat), and a starting worker removes the entries whose
liveness key is gone, so the hash holds live workers plus those that died
since the last worker start.
"""
from __future__ import annotations

import logging
import os
import threading
from collections.abc import Callable

import psutil

from audiosite.serverconfig import get_config
from inference.backend import session_backend
from inference.runtime import metrics
from inference.scheduler import LIVENESS_EVERY_S, LIVENESS_TTL_MS, Keys, Scheduler

from .state import WorkerState

log = logging.getLogger(__name__)

_stop = threading.Event()


def _beat(redis_client, keys: Keys, worker: WorkerState, hostname: str) -> bool:
    """One beat (one round trip); returns whether Redis still holds the deployment's state (the runtime
    key that ``sync_config`` records and nothing expires or deletes: gone means Redis restarted empty)."""
    available_mb = psutil.virtual_memory().available // (1024 * 1024)
    pipe = redis_client.pipeline(transaction=False)
    pipe.exists(keys.runtime)
    pipe.set(keys.worker_live(hostname), worker.boot, px=LIVENESS_TTL_MS)
    pipe.hset(keys.worker_memory, hostname, available_mb)
    pipe.hset(keys.worker_pid, hostname, os.getpid())
    pipe.hset(keys.worker_backend, hostname, worker.backend)
    pipe.pexpire(keys.pool_pids(hostname), LIVENESS_TTL_MS)  # its models' processes (pool_process)
    metrics.process_queue(pipe, "worker")  # this process's CPU and memory for /metrics
    return bool(pipe.execute()[0])


def liveness_start(worker: WorkerState, hostname: str, scheduler: Scheduler,
                   on_state_lost: Callable[[], None] | None = None) -> None:
    """Name the worker ``hostname``, publish its liveness at once, then every ``LIVENESS_EVERY_S`` in a thread.

    Also drops the registry entries of workers that died without cleaning up
    (``Scheduler.forget_departed_workers``, one script).

    Args:
        scheduler: the process's scheduler on a synchronous client (``sync_scheduler()``).
        on_state_lost: called from the liveness thread after a beat that found Redis without the
            deployment's state (restarted empty), before the next beat; an exception is logged.
    """
    redis_client, keys = scheduler.redis, scheduler.keys
    worker.hostname = hostname
    worker.backend = session_backend(get_config().backend)  # probed once, before the first beat
    _beat(redis_client, keys, worker, hostname)
    departed = scheduler.forget_departed_workers()
    if departed:
        log.info("forgot departed workers %s", ", ".join(departed))

    def loop() -> None:
        while not _stop.wait(LIVENESS_EVERY_S):
            try:
                if not _beat(redis_client, keys, worker, hostname) and on_state_lost is not None:
                    on_state_lost()
            except Exception:
                log.exception("liveness beat failed")

    threading.Thread(target=loop, name="liveness", daemon=True).start()


def liveness_stop(worker: WorkerState, scheduler: Scheduler) -> None:
    """Stop beating and delete the worker's keys if they are still this boot's (``Scheduler.worker_leave``,
    one script)."""
    _stop.set()
    if worker.hostname:
        scheduler.worker_leave(worker.hostname, worker.boot)
