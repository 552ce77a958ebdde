"""A pool in the process that runs it: a model's shared weights and its sessions (one on the legacy
runtime), and how it is built.

This module knows nothing of Django or Celery: it runs in a model's own process
(``inference.worker.pool_process``, the default) or, with ``model_processes`` off, in the worker
process itself (``inference.worker.state``).
"""
from __future__ import annotations

import logging
import queue
import time
from collections.abc import Callable
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from audiosite.serverconfig import get_config, slot_count
from inference import specs
from inference.adapters import get_adapter
from inference.adapters.base import LoadContext
from inference.backend import resolve_backend

from . import serving
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

    pid = None
    """Not a process of its own (see ``inference.worker.pool_process.ProcessPool.pid``)."""

    @property
    def slots(self) -> int:
        """How many runs of the model may hold a lease at once (its sessions)."""
        return len(self.sessions)

    def execute(self, kind: str, header: dict, inline=None, deadline_s: float | None = None) -> dict:
        """Serve one run in this process (``serving.execute``). ``deadline_s`` cannot be enforced here (a
        thread cannot be stopped): runs past their deadline are stopped only in a model's own process."""
        return serving.execute(self, kind, header, inline)

    def execute_batch(self, headers: list[dict], inlines: list, deadline_s: float | None = None) -> list[dict]:
        """Serve several runs in one session call in this process (``serving.execute_batch``; ``deadline_s``
        is not enforced here, as for :meth:`execute`)."""
        return serving.execute_batch(self, headers, inlines)

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



def build_pool(model_id: str, meta: dict, meta_json: str, barrier: Callable[[str], str] | None = None) -> Pool:
    """Load weights and every slot's session privately (in the calling process); nothing is published.

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
    if config.runtime == "parallel":  # batch sizes only where they are admitted (R9.2), slots stated or not
        batch_problem = specs.batch_size_problem(meta["family"], meta["task"], meta.get("max_batch"), ctx.backend)
        if batch_problem:
            raise CapacityExceeded(batch_problem)
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
    return Pool(model_id, meta_json, adapter, shared, sessions, capacity, defaults)
