"""Worker-side session pools: the loaded models of this worker process.

A pool holds a model's shared weights and its sessions (one on the legacy
runtime). The worker's identity is its Celery hostname plus a boot id (fresh
per process start); ``inference.worker.liveness`` publishes it (R7.4).
"""
from __future__ import annotations

import logging
import queue
import threading
import time
import uuid
from contextlib import contextmanager
from dataclasses import dataclass, field
from collections.abc import Callable
from typing import Any

from audiosite.serverconfig import get_config, slot_count
from inference import specs
from inference.adapters import get_adapter
from inference.adapters.base import LoadContext
from inference.backend import resolve_backend

from .memory import release_freed_memory

log = logging.getLogger(__name__)


@dataclass
class Pool:
    """A published pool: shared weights plus one session per slot.

    ``request_defaults`` are the spec's option defaults overlaid with the
    registration's ``default_request_options`` (merged once, at build).

    ``free`` holds the indices of idle slots. Admission (Redis) never grants
    more leases than slots, and a run puts its slot back before its lease is
    released, so a granted run always finds a free slot.
    """

    model_id: str
    meta_json: str
    adapter: Any
    shared: Any
    sessions: list
    capacity: int
    request_defaults: dict = field(default_factory=dict)
    free: queue.SimpleQueue[int] = field(default_factory=queue.SimpleQueue)
    loaded_at: float = field(default_factory=time.time)

    def __post_init__(self):
        for slot in range(len(self.sessions)):
            self.free.put(slot)

    @contextmanager
    def slot(self):
        """Borrow an idle slot index for one run (see class docstring)."""
        index = self.free.get(timeout=5)
        try:
            yield index
        finally:
            self.free.put(index)

    def close(self, wait_s: float = 60.0) -> None:
        """Destroy the sessions, then the shared weights (R4.5 order), then give the memory back.

        First waits (up to ``wait_s``) until no run uses a session: a run that
        outlived its lease (its worker was frozen, R7.4) must not lose its
        session under it. If runs are still going after that, the pool is left
        to the garbage collector instead of being destroyed under them.

        Afterwards the pool holds no session and no weights (``shared`` is
        None), so whoever still holds the pool object keeps nothing large
        alive, and the allocator's free pages go back to the kernel
        (``memory.release_freed_memory``: glibc ``malloc_trim``, a no-op elsewhere).
        """
        deadline = time.monotonic() + wait_s
        taken = 0
        try:
            for _ in range(len(self.sessions)):
                self.free.get(timeout=max(0.0, deadline - time.monotonic()))
                taken += 1
        except queue.Empty:
            log.warning("pool of %s still has %d running step(s) after %.0f s; not destroying it under them",
                        self.model_id, len(self.sessions) - taken, wait_s)
            return
        for session in self.sessions:
            try:
                session.close()
            except Exception:
                log.exception("closing a session of %s failed", self.model_id)
        self.sessions.clear()
        shared, self.shared = self.shared, None
        self.adapter.unload(shared)
        del shared
        trimmed = release_freed_memory()
        log.info("destroyed the pool of %s%s", self.model_id,
                 "; free memory returned to the OS (malloc_trim)" if trimmed else "")


class CapacityExceeded(ValueError):
    """More slots were asked for than the family can run independently (R9.1)."""


class WorkerState:
    """The process-wide registry of pools and this worker's identity."""

    def __init__(self):
        self.hostname: str | None = None
        self.boot = uuid.uuid4().hex
        self.backend = "cpu"  # what this process's sessions get (set at start, inference.backend.session_backend)
        self.pools: dict[str, Pool] = {}
        self.lock = threading.Lock()

    # -- pools ---------------------------------------------------------------------
    def build(self, model_id: str, meta: dict, meta_json: str, barrier: Callable[[str], str] | None = None) -> Pool:
        """Load weights and every slot's session privately, then publish the pool locally.

        Args:
            meta: the published registration (``slots`` None = 1; always 1 on the legacy runtime).
            barrier: ``barrier(name)`` for the test family.

        Raises:
            CapacityExceeded: ``slots`` is above the adapter's capacity probe.
            Whatever the adapter raises. Nothing is published then, and the
            sessions created so far are closed before the weights (R7.2).
        """
        config = get_config()
        spec = specs.get_spec(meta["family"])
        # The count the registry published (R1.1: one on the legacy runtime, also for a registration that
        # keeps the ``slots`` it was given under --parallel-jobs; serve warns about those at start-up).
        slots = slot_count(meta.get("slots"), config.runtime)
        ctx = LoadContext(
            checkpoint=specs.resolve_checkpoint(meta["family"], meta.get("path")),
            backend=resolve_backend(config.backend),
            device=config.device,
            threads=config.threads,
            load_options=meta.get("load_options") or {},
            session_options=meta.get("session_options") or {},
            slots=slots,
            barrier=barrier,
        )
        adapter = get_adapter(meta["family"])
        capacity = adapter.capacity(spec, ctx)
        if slots > capacity:
            raise CapacityExceeded(f"{slots} slots exceed the capacity of {meta['family']} (capacity={capacity})")
        if config.runtime == "parallel" and meta.get("slots") is not None:  # only admitted counts (R9.2)
            problems = specs.slots_problems(meta["family"], meta["task"], meta["mode"], slots, ctx.backend)
            if problems:
                raise CapacityExceeded(problems[0])
        shared = adapter.load(spec, ctx)
        sessions = []
        try:
            for slot in range(slots):
                sessions.append(adapter.new_session(shared, slot))
        except BaseException:
            for session in sessions:
                session.close()
            adapter.unload(shared)
            raise
        defaults = {**specs.request_defaults(meta["family"]), **(meta.get("default_request_options") or {})}
        pool = Pool(model_id, meta_json, adapter, shared, sessions, capacity, defaults)
        with self.lock:
            old = self.pools.pop(model_id, None)
            self.pools[model_id] = pool
        if old is not None:
            # Close the replaced pool off the load's path: it waits for steps
            # still running on it (a frozen worker's orphans) up to a minute.
            threading.Thread(target=old.close, name=f"close {model_id}", daemon=True).start()
        return pool

    def discard(self, model_id: str, pool: Pool) -> None:
        """Unpublish and close ``pool`` if it is still the published one (a stale load's result)."""
        with self.lock:
            if self.pools.get(model_id) is not pool:
                return
            del self.pools[model_id]
        threading.Thread(target=pool.close, name=f"close {model_id}", daemon=True).start()

    def remove(self, model_id: str) -> Pool | None:
        """Unpublish a pool locally and return it (the caller closes it)."""
        with self.lock:
            return self.pools.pop(model_id, None)

    def get(self, model_id: str) -> Pool | None:
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
        for pool in pools.values():
            pool.close()
        return list(pools)


WORKER = WorkerState()
