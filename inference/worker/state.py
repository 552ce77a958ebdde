"""The loaded models of this worker process: its published pools.

A pool holds a model's shared weights and its sessions (one on the legacy
runtime), in a process of its own (``pool_process.ProcessPool``, the default) or, with
``model_processes`` off, in this process (``pool.Pool``). The worker's identity is its Celery
hostname plus a boot id (fresh per process start); ``inference.worker.liveness`` publishes it (R7.4).
"""
from __future__ import annotations

import logging
import threading
import uuid
from collections.abc import Callable

from audiosite.serverconfig import get_config

from .pool import CapacityExceeded, Pool, build_pool
from .pool_process import PoolLoadFailed, ProcessPool

log = logging.getLogger(__name__)

AnyPool = Pool | ProcessPool
"""A published pool: in this process (``Pool``) or in a process of its own (``ProcessPool``)."""

__all__ = ["WORKER", "AnyPool", "CapacityExceeded", "Pool", "PoolLoadFailed", "ProcessPool", "WorkerState"]


class WorkerState:
    """The process-wide registry of pools and this worker's identity."""

    def __init__(self, processes: bool | None = False):
        self.hostname: str | None = None
        self.boot = uuid.uuid4().hex
        self.backend = "cpu"  # what this process's sessions get (set at start, inference.backend.session_backend)
        self.pools: dict[str, AnyPool] = {}
        self.lock = threading.Lock()
        self.processes = processes
        """Pools in processes of their own (True), in this process (False), or as the server
        configuration's ``model_processes`` says (None: the worker's ``WORKER``)."""
        self.on_pool_lost: Callable[[str, str], None] | None = None
        """Called as ``on_pool_lost(model_id, reason)`` when a published pool's process ended unasked
        (before the runs in flight are answered); ``inference.worker.tasks`` sets it."""

    # -- pools ---------------------------------------------------------------------
    def build(self, model_id: str, meta: dict, meta_json: str, barrier: Callable[[str], str] | None = None) -> AnyPool:
        """Build ``model_id``'s pool (in a process of its own when this worker runs model processes, else
        here: ``pool.build_pool``), then publish it locally.

        Args:
            meta: the published registration (``slots`` None = 1; always 1 on the legacy runtime).
            barrier: ``barrier(name)`` for the test family (a model's process makes its own).

        Raises:
            CapacityExceeded: ``slots`` is above the adapter's capacity probe (in-process pools).
            PoolLoadFailed: a model's process could not build its pool (``detail`` names the failure).
            Whatever the adapter raises (in-process pools). Nothing is published then, and the
            sessions created so far are closed before the weights (R7.2).
        """
        processes = get_config().model_processes if self.processes is None else self.processes
        pool: AnyPool
        if processes:
            pool = ProcessPool.start(model_id, meta, meta_json, on_exit=self._process_ended,
                                     fixture=barrier is not None)
        else:
            pool = build_pool(model_id, meta, meta_json, barrier)
        with self.lock:
            old = self.pools.pop(model_id, None)
            self.pools[model_id] = pool
        if old is not None:
            # Close the replaced pool off the load's path: it waits for steps
            # still running on it (a frozen worker's orphans) up to a minute.
            threading.Thread(target=old.close, name=f"close {model_id}", daemon=True).start()
        return pool

    def _process_ended(self, pool: ProcessPool, reason: str) -> None:
        """A model's process ended unasked: unpublish its pool (if still published) and tell ``on_pool_lost``."""
        with self.lock:
            if self.pools.get(pool.model_id) is not pool:
                return  # replaced or removed meanwhile: whoever did that accounts for it
        try:
            if self.on_pool_lost is not None:  # recorded first: a run sent meanwhile meets the dead pool (crashed)
                self.on_pool_lost(pool.model_id, reason)
        finally:
            with self.lock:
                if self.pools.get(pool.model_id) is pool:
                    del self.pools[pool.model_id]

    def discard(self, model_id: str, pool: AnyPool) -> None:
        """Unpublish and close ``pool`` if it is still the published one (a stale load's result)."""
        with self.lock:
            if self.pools.get(model_id) is not pool:
                return
            del self.pools[model_id]
        threading.Thread(target=pool.close, name=f"close {model_id}", daemon=True).start()

    def remove(self, model_id: str) -> AnyPool | None:
        """Unpublish a pool locally and return it (the caller closes it)."""
        with self.lock:
            return self.pools.pop(model_id, None)

    def get(self, model_id: str) -> AnyPool | None:
        """The published pool of ``model_id`` on this worker, or None."""
        with self.lock:
            return self.pools.get(model_id)

    def forget_all(self) -> list[str]:
        """Unpublish every pool and close each in a thread of its own (each waits for the steps still
        running on it, as a replaced pool does): for pools the scheduler no longer knows (Redis lost its
        state). Returns the model ids."""
        with self.lock:
            pools, self.pools = self.pools, {}
        for model_id, pool in pools.items():
            threading.Thread(target=pool.close, name=f"close {model_id}", daemon=True).start()
        return sorted(pools)

    def close_all(self) -> list[str]:
        """Destroy every pool (worker shutdown). Returns the model ids."""
        with self.lock:
            pools, self.pools = self.pools, {}
        closing = [threading.Thread(target=pool.close, name=f"close {model_id}") for model_id, pool in pools.items()]
        for thread in closing:  # side by side: each model's process closes on its own
            thread.start()
        for thread in closing:
            thread.join()
        return list(pools)


WORKER = WorkerState(processes=None)
