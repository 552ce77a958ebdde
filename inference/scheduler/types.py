"""Typed values of the scheduler: states, kinds, decisions and script results.

The enums are ``StrEnum``: each member equals the string the Lua scripts and
the HTTP API use (``ModelState.READY == "ready"``).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import NamedTuple, TypedDict


class ModelState(StrEnum):
    """Lifecycle state of a model as published in Redis (``<base>:load`` field ``state``).

    ``unloaded`` → ``loading`` (single loader, R4.2) → ``ready``; a manager
    moves any state → ``unloading`` or ``reconfiguring`` → ``unloaded``
    (R4.4, R4.5, ``set_state.lua``; beginning again from ``unloading`` or
    ``reconfiguring`` recovers a teardown whose manager died).
    """

    UNLOADED = "unloaded"
    LOADING = "loading"
    READY = "ready"
    UNLOADING = "unloading"
    RECONFIGURING = "reconfiguring"
    FAILED = "failed"
    """Only in snapshots: unloaded after a failed load, until a load succeeds or the entry
    changes (R6.7). Redis keeps ``unloaded`` plus ``failures``/``retry_at_ms``."""


class LeaseKind(StrEnum):
    """``request``: one slot (R2.2). ``manager``: the whole model, a barrier for later tickets.
    ``stream``: one slot, granted only while fewer than its stream cap (the streaming mode's admitted
    count, R9.2) of the model's streams hold slots; a stream waiting for that cap is a barrier like a
    manager (FIFO: nothing behind it overtakes it)."""

    REQUEST = "request"
    MANAGER = "manager"
    STREAM = "stream"


class LoadAction(StrEnum):
    """Decision of ``begin_load.lua`` (R4.2)."""

    READY = "ready"  # loaded on a live worker: dispatch to it
    WAIT = "wait"  # another caller loads: wait for its outcome
    LOAD = "load"  # the caller is now the single loader
    BACKOFF = "backoff"  # the last load failed and its backoff has not passed (R6.7)
    LOST = "lost"  # the worker running the load in progress died; this call ended that load (R7.4)
    WOKEN = "woken"  # the caller's previous wait (``replaces``) was already woken: read how that load ended


class LoadEnd(StrEnum):
    """How a load ended (``finish_load.lua``; the ``ended`` field of a model's ``:load`` hash).

    ``READY``: its pool is published. Without a pool: ``FAILED`` (the worker
    reported a failure; starts the backoff, R6.7), ``WORKER_LOST`` (the loading
    worker died, R7.4) or ``NO_WORKER`` (no worker started it in time).
    """

    READY = "ready"
    FAILED = "failed"
    WORKER_LOST = "worker_lost"
    NO_WORKER = "no_worker"


class LoadEndRecord(NamedTuple):
    """How one load ended, as kept for each of its callers (``:loadend``) and carried by their
    wake-ups: ``ended`` (``LoadEnd``; None when nothing is kept: the record expired or the
    model was unregistered) and the ``error`` recorded with it ('' for ``READY``)."""

    ended: LoadEnd | None
    error: str = ""

    @classmethod
    def parse(cls, text: str | None) -> LoadEndRecord:
        """Read ``'ready'`` or ``'<ended>:<error>'`` (``lua/lib.lua``'s ``wake_load_waiters``); ''/None:
        nothing kept. Raises ValueError on an ``ended`` that is not a ``LoadEnd``."""
        if not text:
            return cls(None)
        ended, _, error = text.partition(":")
        return cls(LoadEnd(ended), error)


class LoadOutcome(StrEnum):
    """Result of ``finish_load.lua``: ``ok``, or ``stale`` when the claim was gone (nothing published)."""

    OK = "ok"
    STALE = "stale"


class LoadLost(StrEnum):
    """``error`` recorded for a load that ended as ``LoadEnd.NO_WORKER``: nobody could take it
    (``NO_LIVE_WORKER``) or nobody took it in time (``NOT_PICKED_UP``). A load whose worker died
    ends as ``LoadEnd.WORKER_LOST`` with the worker's name in its error instead (R7.4)."""

    NO_LIVE_WORKER = "no worker is alive"
    NOT_PICKED_UP = "no worker started the load"


class LoadClaim(StrEnum):
    """How the single load claimed by a token is doing (``load_claim.lua``)."""

    PENDING = "pending"  # claimed, no worker started it yet
    RUNNING = "running"  # a worker started it and renews the claim
    EXPIRED = "expired"  # a worker started it and is gone: stopped renewing or stopped beating (R7.4)
    GONE = "gone"  # the token no longer holds the claim (finished, abandoned or taken over)


class TicketStatus(StrEnum):
    """Where a ticket is, as ``reap.lua`` sees it."""

    QUEUED = "queued"
    GRANTED = "granted"
    GONE = "gone"


@dataclass(frozen=True)
class Lease:
    """A granted ticket: owns one slot of ``model_id`` (kind ``request``) or the
    whole model (kind ``manager``) until released or reaped.

    ``lease_id`` equals the ticket id; ``granted_at_ms`` is Redis TIME in ms
    (0 when the grant was pushed rather than returned); ``waited_ms`` is how
    long the caller queued (local monotonic clock).

    A lease granted at once (``enqueue`` returned it, nobody queued) also
    carries what ``enqueue.lua`` read in the same atomic step, so the caller
    needs no further round trip for it: ``meta_json``, the model's published
    registration (JSON text; "" when it is not registered), and ``ready_on``,
    ``(owner, boot)`` of the pool when the model is ready on a live worker.
    Both are None for a lease granted after queueing (a manager may have run
    in between: read them again).
    """

    model_id: str
    lease_id: str
    granted_at_ms: int
    waited_ms: float
    kind: LeaseKind = LeaseKind.REQUEST
    meta_json: str | None = None
    ready_on: tuple[str, str] | None = None
    dispatched: bool = False


class RunOffer(NamedTuple):
    """A run a request hands over in its grant's own step (``enqueue.lua``), when it is granted at once
    and its model is ready on a live worker (:attr:`Lease.dispatched` then says it went).

    ``expected_meta``: the registration (JSON text, exactly as published) the run was prepared for;
    no other one is dispatched. ``element_for(lease_id)``: the bytes to push on that worker's run
    queue (their format is the caller's, ``inference.runtime.runs.inline_element``);
    ``queue_ttl_ms``: the queue's TTL, refreshed by the push.
    """

    expected_meta: str
    element_for: Callable[[str], bytes]
    queue_ttl_ms: int


@dataclass(frozen=True)
class LoadDecision:
    """Outcome of ``begin_load``; for ``READY``, ``owner`` is the Celery hostname
    owning the pool and ``boot`` its boot id; for ``BACKOFF``, ``retry_in_ms``
    until a load may be tried again and the failed load's ``error``; for
    ``LOST``, ``owner`` is the lost worker's hostname and ``error`` what was
    recorded for the load this call ended; for ``WAIT``, ``left_ms``: how long
    the load in progress stays alive if its worker stops now (-1 while no
    worker has started it); for ``WOKEN``, ``ended`` and ``error``: how the
    load the earlier wait waited for ended (``ended`` None: no longer kept)."""

    action: LoadAction
    owner: str | None = None
    boot: str | None = None
    retry_in_ms: int = 0
    error: str = ""
    left_ms: int = -1
    ended: LoadEnd | None = None


class ClaimStatus(NamedTuple):
    """Result of ``load_claim.lua``: the ``claim``'s state and, while ``RUNNING``, ``left_ms``:
    how long it stays alive if its worker stops now (the claim's or the worker's liveness
    key's expiry, whichever comes first); 0 otherwise. ``host``: the Celery hostname of the
    worker that started the load (``RUNNING``, ``EXPIRED``; '' otherwise)."""

    claim: LoadClaim
    left_ms: int
    host: str = ""


class ReapResult(NamedTuple):
    """Result of ``reap.lua``: leases reclaimed, the earliest remaining lease
    expiry (Redis ms, -1 = none), where the caller's ticket is, and Redis now (ms)."""

    reaped: int
    next_expiry_ms: int
    ticket: TicketStatus
    now_ms: int


class LoadWait(NamedTuple):
    """Result of ``add_load_waiter.lua``: ``waiting`` is True when a live loader
    runs and the waiter was registered; ``loader_expires_ms`` is its claim's expiry."""

    waiting: bool
    loader_expires_ms: int
    now_ms: int


class ProbeVerdict(StrEnum):
    """What ``admission_probe.lua`` says of a request sent now."""

    ADMIT = "admit"          # enqueue it (enqueue.lua decides)
    OVERDUE = "overdue"      # enqueue.lua would refuse it at once (R3.3)
    NOT_FOUND = "not_found"  # the model is not registered


class AdmissionProbe(NamedTuple):
    """Result of ``admission_probe.lua``: the :class:`ProbeVerdict`; the published ``entry`` (None when
    not found); the effective ``timeout_ms`` (R3.1); for ``OVERDUE``, the age of the youngest holder in
    ms (R3.3); ``free``: nobody was queued and a slot was free (a request enqueued now is granted at
    once unless another gets there first; a hint, never a reservation); ``entry_json``: the entry as
    published (JSON text, "" when not found)."""

    verdict: ProbeVerdict
    entry: dict | None
    timeout_ms: int
    age_ms: int
    free: bool
    entry_json: str = ""


class ForgottenWorker(NamedTuple):
    """Result of ``forget_worker.lua``: ``pools``, the ids of the models whose pool was on the worker (now
    unloaded), and ``loads``, those whose load it was running (now ended ``worker_lost``)."""

    pools: list[str]
    loads: list[str]


class SettledPools(NamedTuple):
    """Result of ``settle_lost_pools.lua``: ``(model id, worker hostname)`` pairs of the pools found on dead
    workers (now unloaded) and of the loads whose worker was gone (now ended ``worker_lost``)."""

    pools: list[tuple[str, str]]
    loads: list[tuple[str, str]]


class Census(NamedTuple):
    """Result of ``census.lua``: ``live_workers`` (started workers whose liveness key exists),
    ``worker_starting`` (a supervisor is starting a worker, ``Keys.worker_starting``),
    ``models`` (published registrations) and ``cuda_workers`` (live workers whose sessions get the
    CUDA provider, as each reports with its beat, ``Keys.worker_backend``)."""

    live_workers: int
    worker_starting: bool
    models: int
    cuda_workers: int = 0


class ModelStatus(TypedDict):
    """One model in a snapshot (``snapshot.lua``, R4.7). Counts are integers; times Redis ms.

    ``active_leases``: request leases (admitted requests, including those
    waiting for a load); ``queued``: queued requests (managers not counted);
    ``capacity``: configured slots; ``loaded_capacity``: the loaded pool's
    advertised capacity (0 = not loaded); ``last_used_ms``: end of the last
    work (0 = never). A ``ready`` model whose worker is dead reads ``unloaded``.
    ``retry_at_ms``: when a failed load's backoff ends (0 = no failed load,
    R6.7; ``state`` then reads ``failed``); ``retry_in_ms``: how long until
    then (0 = a load may be tried now). ``worker``: the Celery hostname holding the
    pool (ready) or running the load (loading), else ''. ``use``: the model's
    recent use, the count of requests admitted for it each decayed by half every
    ``use_half_life_ms`` (a float, in requests; R6.1); ``resident_ms``: how long its
    pool has been ready (0 when not ready). ``registration``: the model's published registration
    (``Keys.models_meta``, JSON text) read in the same script, so an entry built from it and the
    state never mixes two configurations; '' when the model is not registered (any more).
    """

    state: ModelState
    active_leases: int
    queued: int
    error: str
    capacity: int
    manager_leases: int
    queued_managers: int
    loaded_capacity: int
    last_used_ms: int
    retry_at_ms: int
    retry_in_ms: int
    worker: str
    use: float
    resident_ms: int
    registration: str


class RequestStats(NamedTuple):
    """A model's request counts and slot hold times (``release.lua``: grant → release, Redis ms).

    ``requests``: request leases released since the model was registered;
    ``held_ms_total``: their summed hold time in ms; ``recent_held_ms``: the
    last (at most 200) hold times in ms, newest first.
    """

    requests: int
    held_ms_total: int
    recent_held_ms: list[int]
