"""The controllable test family ``fixture`` (no weights; enabled only by
``AUDIOSITE_ENABLE_FIXTURE_FAMILY=1``).

Load options: ``version`` (echoed as ``config_version``), ``load_barrier``
(hold the load there), ``load_ms`` (the load sleeps that long: a real model's
load time, without its CPU), ``teardown_barrier`` (hold the unload there),
``fail_load`` (raise while loading), ``fail_session`` (raise while creating
that slot's session). Request options: ``barrier`` (hold the run there),
``fail`` (raise inside the run), ``tag`` (echoed), ``sleep_ms`` (busy time).

Barriers are waited on through ``LoadContext.barrier(name)``, a callable
the worker provides (it talks to Redis; this module does not). It returns
the controller's action: 'go', or 'fail' to make the held load or run raise.
"""
from __future__ import annotations

import threading
import time
import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from .base import AudioRequest, LoadContext, spec_capacity


class InjectedFailure(RuntimeError):
    """A failure the test asked for."""


@dataclass
class Shared:
    """The 'weights': an id per load, the configuration version, and a record of destruction order."""

    pool_id: str
    version: str
    barrier: Callable[[str], str] | None
    teardown_barrier: str | None
    fail_session: int | None = None
    events: list = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock)


class FixtureSession:
    """One slot; reports who served the request."""

    def __init__(self, shared: Shared, slot: int):
        self.shared = shared
        self.slot = slot
        self.served = 0  # private mutable state (R9.3)

    def run(self, request: AudioRequest) -> dict:
        """Serve one request.

        Returns:
            ``{"text", "segments": [], "slot", "pool_id", "config_version", "tag",
            "served_by_this_slot", "started_ns", "finished_ns"}`` (ns: worker
            monotonic clock, comparable within one worker process).

        Raises:
            InjectedFailure: ``fail`` was set.
        """
        opts = request.options
        started = time.monotonic_ns()
        if opts.get("barrier") and self.shared.barrier and self.shared.barrier(opts["barrier"]) == "fail":
            raise InjectedFailure(f"injected failure at barrier {opts['barrier']!r}")
        if opts.get("sleep_ms"):
            time.sleep(opts["sleep_ms"] / 1000)
        if opts.get("fail"):
            raise InjectedFailure("injected inference failure")
        self.served += 1
        return {"text": f"fixture {opts.get('tag') or ''}".strip(), "segments": [], "slot": self.slot,
                "pool_id": self.shared.pool_id, "config_version": self.shared.version, "tag": opts.get("tag"),
                "served_by_this_slot": self.served, "samples": len(request.samples),
                "started_ns": started, "finished_ns": time.monotonic_ns()}

    def close(self) -> None:
        with self.shared.lock:
            self.shared.events.append(f"close session {self.slot}")


class FixtureAdapter:
    """Family ``fixture`` (task ``fixture``)."""

    family = "fixture"

    def capacity(self, spec: dict, ctx: LoadContext) -> int:
        return spec_capacity(spec, ctx.backend)

    def load(self, spec: dict, ctx: LoadContext) -> Shared:
        opts = ctx.load_options
        if opts.get("load_barrier") and ctx.barrier(opts["load_barrier"]) == "fail":
            raise InjectedFailure(f"injected load failure at barrier {opts['load_barrier']!r}")
        if opts.get("fail_load"):
            raise InjectedFailure("injected load failure")
        if opts.get("load_ms"):
            time.sleep(opts["load_ms"] / 1000)
        return Shared(uuid.uuid4().hex[:12], opts.get("version", "v0"), ctx.barrier, opts.get("teardown_barrier"),
                      opts.get("fail_session"))

    def new_session(self, shared: Shared, slot: int) -> FixtureSession:
        """A session for ``slot``; raises InjectedFailure when ``fail_session`` names it."""
        if shared.fail_session == slot:
            raise InjectedFailure(f"injected failure creating the session of slot {slot}")
        return FixtureSession(shared, slot)

    def unload(self, shared: Shared) -> None:
        if shared.teardown_barrier:
            if shared.barrier:
                shared.barrier(shared.teardown_barrier)  # a teardown cannot be refused: 'fail' also proceeds
        with shared.lock:
            shared.events.append("unload weights")
