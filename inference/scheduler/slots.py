"""Admission to a model's slots: FIFO tickets, leases and single-flight loads.

Every transition is one Lua script in ``lua/`` (``lib.lua`` is prepended to
each). This module registers the scripts, maps their results to typed values
and exceptions, and implements the async wait of a caller for its grant.

Timeout rule (CONTRACT R3.1): see :func:`effective_timeout_ms`.
"""
from __future__ import annotations

import asyncio
import inspect
import json
import uuid
from collections.abc import Awaitable, Callable
from pathlib import Path
from typing import Any

from .keepalive import KeepAlive
from .keys import LIVENESS_TTL_MS, Keys
from .listener import Listener
from .types import (
    AdmissionProbe,
    Census,
    ForgottenWorker,
    ClaimStatus,
    Lease,
    LeaseKind,
    LoadAction,
    LoadClaim,
    LoadDecision,
    LoadEnd,
    LoadEndRecord,
    LoadOutcome,
    LoadWait,
    ModelState,
    ModelStatus,
    ProbeVerdict,
    ReapResult,
    RunOffer,
    RequestStats,
    SettledPools,
    TicketStatus,
)

LUA_DIR = Path(__file__).resolve().parent / "lua"
_SCRIPT_NAMES = (
    "enqueue", "cancel", "release", "renew", "reap",
    "begin_load", "renew_load", "finish_load", "mark_unloaded", "snapshot",
    "enqueue_managers", "try_acquire", "set_state", "add_load_waiter",
    "publish_entry", "publish_registry", "unregister", "claim_runtime", "load_claim", "admission_probe",
    "census", "forget_worker", "forget_departed", "worker_leave", "forget_process", "run_left", "run_reply",
    "settle_lost_pools", "pool_failed",
)
# Read and assembled once per process (``lib.lua`` prepended to each script).
_SOURCES = {name: (LUA_DIR / "lib.lua").read_text() + "\n" + (LUA_DIR / f"{name}.lua").read_text()
            for name in _SCRIPT_NAMES}


USE_HALF_LIFE_MS = 10000
"""Default half-life of a model's recent-use count (``lua/lib.lua``'s ``use_now``), in ms: the server's
``use_half_life_ms`` (``audiosite.serverconfig``) overrides it."""

TICKET_CHECK_S = LIVENESS_TTL_MS / 1000
"""A queued waiter looks at its ticket (``reap.lua``) at least this often, in seconds (R7.5)."""


def _held(reply: Any) -> bool:
    """A script's 1/0 answer (held, renewed, changed) as a bool."""
    return int(reply) == 1


def _then(result: Any, convert: Callable[[Any], Any]) -> Any:
    """``convert(result)``; with an async client ``result`` is an awaitable, and so is the return value."""
    if inspect.isawaitable(result):
        async def settle(pending: Awaitable[Any] = result) -> Any:
            return convert(await pending)
        return settle()
    return convert(result)


class SchedulerError(Exception):
    """Base of the scheduler's refusals."""


class LeaseNotHeld(SchedulerError):
    """A manager operation named a lease that is not held (it was reaped, R2.5, or never granted)."""

    def __init__(self, model_id: str, operation: str):
        super().__init__(f"model {model_id!r}: {operation} refused: the manager lease is no longer held")
        self.model_id = model_id


class InvalidTransition(SchedulerError):
    """``set_state`` was asked for a lifecycle transition that ``set_state.lua`` does not allow."""

    def __init__(self, model_id: str, state: str):
        super().__init__(f"model {model_id!r}: no transition to {state!r} from its current state")
        self.model_id = model_id


class RuntimeMismatch(SchedulerError):
    """Another runtime is already recorded for this deployment (R1.4)."""


class AdmissionTimeout(SchedulerError):
    """The ticket was not granted within its effective timeout (R3.2); the ticket is gone."""

    def __init__(self, model_id: str, timeout_ms: int):
        super().__init__(f"model {model_id!r} stayed busy for the whole busy_timeout_ms={timeout_ms}")
        self.model_id = model_id
        self.timeout_ms = timeout_ms


class AdmissionExpired(SchedulerError):
    """This waiter's ticket is gone without a grant it could use: the slot granted to it was
    reclaimed before the process claimed it (R2.5), or the ticket was dropped as a dead process's
    (R7.5) — either way this process stalled for longer than the lease or liveness TTL."""

    def __init__(self, model_id: str, lease_ttl_ms: int):
        super().__init__(f"model {model_id!r}: this request's place in the queue was lost because this server "
                         f"process stalled (a slot granted to it is reclaimed after lease_ttl_ms={lease_ttl_ms}, "
                         f"a queued ticket after the {LIVENESS_TTL_MS} ms process liveness TTL)")
        self.model_id = model_id


class AdmissionOverdue(SchedulerError):
    """Fail-fast (R3.3): every occupied slot has run longer than the effective timeout."""

    def __init__(self, model_id: str, timeout_ms: int, age_ms: int):
        super().__init__(
            f"model {model_id!r} is busy with work that has run {age_ms} ms, longer than "
            f"busy_timeout_ms={timeout_ms}; refusing at once instead of queueing"
        )
        self.model_id = model_id
        self.timeout_ms = timeout_ms
        self.age_ms = age_ms


def effective_timeout_ms(request_ms: int | None, ceiling_ms: int) -> int:
    """Combine a request's ``busy_timeout_ms`` with the model ceiling (R3.1).

    Args:
        request_ms: the request's value (None = not given), ≥ 0.
        ceiling_ms: the model's ``busy_timeout_ms`` (itself defaulting to the
            server's), ≥ 0; 0 = unbounded.

    Returns:
        Milliseconds; 0 = unbounded (no wait bound, no fail-fast). A request can
        only shorten the ceiling; a request's 0 is still capped by a non-zero
        ceiling; under a ceiling of 0 the request's own bound holds.
    """
    if request_ms is None:
        return ceiling_ms
    if ceiling_ms == 0:
        return request_ms
    if request_ms == 0:
        return ceiling_ms
    return min(request_ms, ceiling_ms)


def _settle_with(future: asyncio.Future, lease: Lease) -> Callable[[asyncio.Future], None]:
    """A done-callback that resolves ``future`` with ``lease`` unless it is already settled."""
    def settle(_done: asyncio.Future) -> None:
        if not future.done():
            future.set_result(lease)
    return settle


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Scheduler:
    """The scheduler's operations on one Redis.

    Args:
        redis: ``redis.Redis`` (worker threads, commands) or ``redis.asyncio.Redis``
            (web); with an async client every operation returns an awaitable.
        keys: key layout.
        lease_ttl_ms: a lease whose holder does not renew it for this long is
            reclaimed (R2.5).
        use_half_life_ms: half-life of each model's recent-use count (the decayed
            count of requests admitted, R6.1), in ms.

    Script sources are read once per process; each instance binds them to
    its client (one instance per client: see ``inference.runtime.context``).
    """

    def __init__(self, redis, keys: Keys, lease_ttl_ms: int, use_half_life_ms: int = USE_HALF_LIFE_MS):
        self.redis = redis
        self.keys = keys
        self.lease_ttl_ms = lease_ttl_ms
        self.use_half_life_ms = use_half_life_ms
        self._scripts = {name: redis.register_script(source) for name, source in _SOURCES.items()}
        self._release_loaded = False  # release_in: loaded on this client's server (sync clients only)

    def _run(self, name: str, keys: list[str], args: list):
        return self._scripts[name](keys=keys, args=args)

    # -- leases ---------------------------------------------------------------
    def release(self, model_id: str, lease_id: str):
        """Give a lease back (idempotent). Returns True if it was held, else False (an awaitable of it with
        an async client)."""
        return _then(self._run("release", [self.keys.model(model_id)], [lease_id, self.lease_ttl_ms]), _held)

    def release_in(self, pipe, model_id: str, lease_id: str) -> None:
        """Queue :meth:`release` on ``pipe`` (a pipeline of this instance's synchronous client), by its
        SHA: its reply in the pipeline's results is :meth:`release`'s, or ``NoScriptError`` if Redis
        lost its script cache (the script is loaded once per instance before the first use)."""
        script = self._scripts["release"]
        if not self._release_loaded:
            self.redis.script_load(script.script)
            self._release_loaded = True
        pipe.evalsha(script.sha, 1, self.keys.model(model_id), lease_id, self.lease_ttl_ms)

    def renew(self, model_id: str, lease_id: str):
        """Extend a lease by the TTL. Returns True, or False when it was already reclaimed (an awaitable of it
        with an async client)."""
        return _then(self._run("renew", [self.keys.model(model_id)], [lease_id, self.lease_ttl_ms]), _held)

    def run_left(self, model_id: str, request_id: str, lease_id: str, stop_ttl_ms: int):
        """The client of run ``request_id`` left while its web process waited for the reply (R8.2), in one
        step with the worker's reply (``run_left.lua``; :meth:`run_reply` is the other side).

        Args:
            lease_id: the sender's request lease of ``model_id``, still its own until a worker takes the
                run ('' for a held run, whose lease the sender releases itself).
            stop_ttl_ms: expiry of the stop marker set when no reply is there yet.

        Returns:
            'answered' (a reply was there, unread: deleted; a ``not_loaded`` one also gave the lease and the
            input back), 'recorded' (the same, for a reply whose worker recorded the answer's metrics
            itself: its ``recorded`` was true) or 'marked' (``Keys.stop`` set, naming the lease); an
            awaitable of it with an async client.
        """
        keys = [self.keys.result(request_id), self.keys.stop(request_id), self.keys.input(request_id),
                self.keys.model(model_id)]
        return _then(self._run("run_left", keys, [lease_id, stop_ttl_ms, self.lease_ttl_ms]), _text)

    def run_reply(self, request_id: str, channel: str, reply_json: str, wake_message: str, ttl_ms: int,
                  release: tuple[str, str] | None, taken: bool = True):
        """A worker's reply to run ``request_id`` (``run_reply.lua``), unless its client left (R8.2).

        Args:
            channel: the sender's pub/sub channel; ``wake_message`` is published there.
            reply_json: the reply, stored at ``Keys.result(request_id)`` for ``ttl_ms``.
            release: ``(model_id, lease_id)`` released first (a run's end), or None.
            taken: False for a run the worker never took (``not_loaded``): its lease is still the
                sender's, so when the client left the lease its stop marker names is given back, with
                the run's input.

        Returns:
            True when the reply was stored and published, False when its client had left (nothing
            stored; the stop marker deleted). An awaitable of it with an async client.
        """
        model_key, lease_id = (self.keys.model(release[0]), release[1]) if release else ("", "")
        keys = [self.keys.result(request_id), self.keys.stop(request_id), self.keys.input(request_id), model_key]
        return _then(self._run("run_reply", keys, [reply_json, wake_message, channel, ttl_ms, lease_id,
                                                   self.lease_ttl_ms, "0" if taken else "1"]), _held)

    def keep_alive(self, model_id: str, lease_id: str) -> KeepAlive:
        """A :class:`KeepAlive` renewing ``lease_id`` every third of the TTL (``async with`` or ``with``)."""
        return KeepAlive(lambda: self.renew(model_id, lease_id), self.lease_ttl_ms / 3000,
                         f"lease {lease_id[:8]} of {model_id}")

    def keep_load_claim(self, model_id: str, token: str, host: str, boot: str) -> KeepAlive:
        """A :class:`KeepAlive` renewing the single loader's claim (``with`` in a worker thread)."""
        return KeepAlive(lambda: self.renew_load(model_id, token, host, boot), self.lease_ttl_ms / 3000,
                         f"load claim {token[:8]} of {model_id}")

    def reap(self, model_id: str, ticket: str = ""):
        """Reclaim expired leases and grant (R2.5).

        Returns:
            :class:`ReapResult` (an awaitable of it with an async client);
            ``ticket`` is ``GONE`` when no ticket is given.
        """
        return _then(self._run("reap", [self.keys.model(model_id)], [self.lease_ttl_ms, ticket]),
                     lambda r: ReapResult(int(r[0]), int(r[1]), TicketStatus(_text(r[2])), int(r[3])))

    # -- loads ----------------------------------------------------------------
    def renew_load(self, model_id: str, token: str, host: str, boot: str):
        """Extend the single loader's claim. Returns True if still the loader (an awaitable of it with an async
        client).

        ``host`` and ``boot`` name the worker loading (its Celery hostname and
        boot id): while the claim lasts, the load counts as dead as soon as that
        worker's liveness key is gone (R7.4), not only when the claim expires.
        """
        return _then(self._run("renew_load", [self.keys.model(model_id)], [token, self.lease_ttl_ms, host, boot]),
                     _held)

    def load_claim(self, model_id: str, token: str):
        """How the load claimed by ``token`` is doing: :class:`ClaimStatus` (an awaitable of it with an async
        client)."""
        return _then(self._run("load_claim", [self.keys.model(model_id), self.keys.worker_live_prefix], [token]),
                     lambda r: ClaimStatus(LoadClaim(_text(r[0])), int(r[1]), _text(r[2])))

    def finish_load(self, model_id: str, token: str, outcome: LoadEnd, owner: str = "", boot: str = "",
                    error: str = "", capacity: int = 0):
        """Publish a load's ``outcome`` (see :class:`LoadEnd`) and wake its waiters.

        ``owner``/``boot`` name the worker holding the pool (``READY``);
        ``error`` is recorded for any other outcome; ``capacity`` is the loaded
        pool's advertised capacity (shown as ``max_parallel_slots`` while the
        model is loaded). Only ``FAILED`` starts the backoff (R6.7).

        Returns:
            :class:`LoadOutcome` (``STALE``: the claim was gone, nothing published).
        """
        return _then(self._run("finish_load", [self.keys.model(model_id)],
                               [token, str(LoadEnd(outcome)), owner, boot, error, capacity]),
                     lambda r: LoadOutcome(_text(r)))

    def mark_unloaded(self, model_id: str, boot: str, error: str):
        """Record that the pool loaded under ``boot`` is gone. Returns True if the state changed (an awaitable
        of it with an async client)."""
        return _then(self._run("mark_unloaded", [self.keys.model(model_id)], [boot, error]), _held)

    def pool_failed(self, model_id: str, boot: str, error: str):
        """Record that the pool loaded under ``boot`` ended unasked (its process crashed or was killed for a run
        past its deadline, R3.6): state ``failed`` with ``error`` and the load backoff, as a failed load
        (R6.7; ``pool_failed.lua``). Only a ``ready`` state with that boot changes. Returns True if it
        changed (an awaitable of it with an async client)."""
        return _then(self._run("pool_failed", [self.keys.model(model_id)], [boot, error]), _held)

    def forget_worker(self, hostname: str, model_ids: list[str]) -> ForgottenWorker:
        """Forget a worker known to be gone, in one step (``forget_worker.lua``, R7.4): its ready pools of
        ``model_ids`` (pass every registered model) become unloaded, a load it ran ends ``worker_lost``
        (waiters woken now, no backoff; the error is :meth:`lost_load_error`), and its liveness key and
        registry entries are deleted.

        Returns:
            :class:`ForgottenWorker`: the models whose pool was on that worker, and those whose load it
            ran (an awaitable of it with an async client).
        """
        bases = {self.keys.model(model_id): model_id for model_id in model_ids}
        return _then(self._run("forget_worker", [self.keys.worker_live(hostname), self.keys.worker_pid,
                                                 self.keys.worker_memory, *bases],
                               [hostname, "worker lost", self.lost_load_error(hostname)]),
                     lambda r: ForgottenWorker([bases[_text(b)] for b in r[0]], [bases[_text(b)] for b in r[1]]))

    def settle_lost_pools(self, model_ids: list[str]):
        """Write down in Redis what dead workers left on ``model_ids`` (``settle_lost_pools.lua``, R7.4): a
        ``ready`` pool whose worker's liveness key is gone (or names another boot) becomes unloaded, a load
        whose worker is gone ends ``worker_lost`` (waiters woken, no backoff; error :meth:`lost_load_error`).
        Each change is made once, by whoever sees it first, so the caller that gets it records it.

        Returns:
            :class:`SettledPools` (an awaitable of it with an async client).
        """
        bases = {self.keys.model(model_id): model_id for model_id in model_ids}

        def settled(reply) -> SettledPools:
            return SettledPools(*([(bases[_text(base)], _text(host)) for base, host in group] for group in reply))
        return _then(self._run("settle_lost_pools", [self.keys.worker_live_prefix, *bases], ["worker lost"]),
                     settled)

    def forget_process(self, channel: str, model_ids: list[str]):
        """Give back at once what a dead web process held (``forget_process.lua``, R7.5/R2.5): its liveness
        key is deleted, its queued tickets on ``model_ids`` (pass every registered model) are dropped and
        every lease granted to it there is released (the grant pass then serves the next waiters).

        Args:
            channel: the process's pub/sub channel (its ``Listener.channel``).
            model_ids: the models to look at.

        Returns:
            ``(tickets dropped, leases released)`` (an awaitable of it with an async client).
        """
        bases = [self.keys.model(model_id) for model_id in model_ids]
        return _then(self._run("forget_process", [Keys.process_live(channel), *bases], [channel, self.lease_ttl_ms]),
                     lambda r: (int(r[0]), int(r[1])))

    def forget_departed_workers(self) -> list[str]:
        """Drop the registry entries (``worker_pid``, ``worker_memory``, ``worker_backend``) of workers
        whose liveness key is gone, in one step (``forget_departed.lua``). Returns their hostnames (an
        awaitable of them with an async client). Tolerated race: a worker only frozen past its TTL
        re-adds itself at its next beat."""
        return _then(self._run("forget_departed", [self.keys.worker_pid, self.keys.worker_memory,
                                                   self.keys.worker_live_prefix, self.keys.worker_backend], []),
                     lambda hosts: [_text(host) for host in hosts])

    def worker_leave(self, hostname: str, boot: str) -> bool:
        """A stopping worker deletes its liveness key and registry entries, if the key still holds ``boot``
        (``worker_leave.lua``). Returns True when they were deleted (an awaitable of it with an async client)."""
        return _then(self._run("worker_leave", [self.keys.worker_live(hostname), self.keys.worker_pid,
                                                self.keys.worker_memory], [hostname, boot]), _held)

    @staticmethod
    def lost_load_error(hostname: str) -> str:
        """The error of a load whose worker ``hostname`` was lost (R7.4), as every path records it."""
        return f"worker {hostname} was lost while loading the model"

    def add_load_waiter(self, listener: Listener, model_id: str, token: str, replaces: str = ""):
        """Register ``token`` to be woken (``load:<token>``) when the running load ends (R4.5).

        Call ``listener.expect(f"load:{token}")`` first. ``replaces``: the caller's token of its
        previous look that was not woken, unregistered first (one entry per waiter, not per look).

        Returns:
            :class:`LoadWait`; ``waiting`` False when no live loader runs (nothing registered).
        """
        return _then(self._run("add_load_waiter", [self.keys.model(model_id), self.keys.worker_live_prefix],
                               [token, listener.channel, replaces]),
                     lambda r: LoadWait(_text(r[0]) == "wait", int(r[1]), int(r[2])))

    # -- lifecycle writes of a manager ------------------------------------------
    def _checked(self, model_id: str, operation: str, reply) -> None:
        outcome = _text(reply)
        if outcome == "not_held":
            raise LeaseNotHeld(model_id, operation)
        if outcome == "bad_transition":
            raise InvalidTransition(model_id, operation)

    def set_state(self, model_id: str, state: ModelState, lease_id: str, error: str = ""):
        """Record a lifecycle state as the manager holding ``lease_id`` (``set_state.lua``).

        ``unloading`` and ``reconfiguring`` begin a teardown and forget the
        owner (the logical residency is cleared first, R4.5); ``unloaded`` ends it.

        Returns:
            ``(owner, boot)`` of the pool the model had when the state was set (Celery hostname and
            boot id; ``("", "")`` when it had none), read in the same step: the pool a teardown
            begun now must destroy (an awaitable of it with an async client).

        Raises:
            LeaseNotHeld: the manager lease was reclaimed.
            InvalidTransition: not an allowed transition from the current state.
        """
        def pool(reply) -> tuple[str, str]:
            if isinstance(reply, list):
                return _text(reply[1]), _text(reply[2])
            self._checked(model_id, f"set_state {state}", reply)
            raise AssertionError(f"set_state.lua answered {reply!r}")  # _checked raised for every other answer
        return _then(self._run("set_state", [self.keys.model(model_id)], [str(state), error, lease_id]), pool)

    def publish_entry(self, meta: dict, slots: int, lease_id: str = "", reset: bool = False):
        """Publish one registration and its slot count together (``publish_entry.lua``, R4.7).

        Args:
            meta: the registration (JSON-serializable; ``meta["id"]`` is the model id).
            slots: the slot count the scheduler admits (1 on the legacy runtime).
            lease_id: the caller's manager lease ('' only at start-up).
            reset: also mark the model ``unloaded`` (a new or changed entry).

        Raises:
            LeaseNotHeld: ``lease_id`` was given and is no longer held.
        """
        model_id = meta["id"]
        return _then(self._run("publish_entry", [self.keys.model(model_id), self.keys.models_meta],
                               [model_id, json.dumps(meta, sort_keys=True), slots, lease_id, "1" if reset else "0"]),
                     lambda r: self._checked(model_id, "publish", r))

    def unregister(self, model_id: str, lease_id: str):
        """Remove a registration and its lifecycle state as the manager holding ``lease_id``.

        Raises:
            LeaseNotHeld: the manager lease was reclaimed.
        """
        return _then(self._run("unregister", [self.keys.model(model_id), self.keys.models_meta],
                               [model_id, lease_id]),
                     lambda r: self._checked(model_id, "unregister", r))

    def publish_registry(self, entries: list[tuple[dict, int]], runtime: str):
        """Replace the whole published registry (start-up sync) and record the runtime.

        Args:
            entries: ``(meta, slots)`` per model.
            runtime: 'legacy' or 'parallel'.

        Returns:
            The number of published entries (an awaitable with an async client).
        """
        keys = [self.keys.models_meta, self.keys.runtime] + [self.keys.model(m["id"]) for m, _ in entries]
        args: list = [runtime]
        for meta, slots in entries:
            args += [meta["id"], json.dumps(meta, sort_keys=True), slots]
        return _then(self._run("publish_registry", keys, args), int)

    def claim_runtime(self, runtime: str):
        """Record ``runtime`` for the deployment, or refuse when another one is recorded (R1.4).

        Raises:
            RuntimeMismatch: Redis already records a different runtime.
        """
        def check(recorded) -> None:
            recorded = _text(recorded)
            if recorded != runtime:
                raise RuntimeMismatch(
                    f"this deployment runs the {recorded} runtime (recorded in Redis key {self.keys.runtime}); "
                    f"refusing to start a {runtime} process. Start it with the deployment's runtime ("
                    + ("--parallel-jobs or AUDIOSITE_PARALLEL_JOBS=1" if recorded == "parallel" else
                       "without --parallel-jobs and AUDIOSITE_PARALLEL_JOBS")
                    + "); to change the deployment's runtime instead, stop every process, delete that key, and start "
                    "them all with the new one.")
        return _then(self._run("claim_runtime", [self.keys.runtime], [runtime]), check)

    # -- async admission (web processes) --------------------------------------
    async def acquire(self, listener: Listener, model_id: str, timeout_ms: int,
                      kind: LeaseKind = LeaseKind.REQUEST, offer: RunOffer | None = None,
                      stream_cap: int = 0) -> Lease:
        """Enter the model's FIFO queue and wait for a slot (request) or the whole model (manager).

        Args:
            listener: this process's :class:`Listener` (same event loop).
            model_id: the model.
            timeout_ms: effective busy timeout (R3.1); 0 = unbounded.
            kind: ``REQUEST`` (one slot, R2.2) or ``MANAGER`` (exclusive: waits for
                every older lease; a barrier for later tickets).
            offer: a request's run, pushed on its worker's queue in the same step when the
                grant comes at once and the model is ready (:class:`RunOffer`); the lease
                then says ``dispatched`` and the worker releases it.
            stream_cap: for ``STREAM`` (>= 1): the most streams of the model that may hold
                slots at once; the stream waits in the FIFO until fewer do.

        Returns:
            The granted :class:`Lease` (the caller must release it on every path).

        Raises:
            AdmissionOverdue: refused at once (R3.3).
            AdmissionTimeout: not granted by the deadline; the ticket is gone (R3.2).
            asyncio.CancelledError: the caller went away; the ticket is gone (R8.1)
                or, if the grant won the race, the lease is released.

        Tolerated race: a grant published while the waiter times out is settled
        by ``cancel.lua`` (atomic), which reports 'granted'; the lease is then used.
        """
        kind = LeaseKind(kind)
        if (kind is LeaseKind.STREAM) != (stream_cap >= 1):
            raise ValueError(f"a stream lease needs a stream cap >= 1, and only a stream has one "
                             f"({kind}, {stream_cap})")
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + timeout_ms / 1000 if timeout_ms > 0 else None
        ticket = uuid.uuid4().hex
        grant_key = f"grant:{ticket}"
        future = listener.expect(grant_key)
        reply = await self._enqueue(listener, grant_key, model_id, ticket, timeout_ms, kind, offer, stream_cap)
        status = _text(reply[0])
        if status == "granted":
            listener.forget(grant_key)
            owner, boot = _text(reply[3]), _text(reply[4])
            return Lease(model_id, ticket, int(reply[1]), 0.0, kind, meta_json=_text(reply[2]),
                         ready_on=(owner, boot) if owner else None, dispatched=bool(int(reply[5])))
        if status == "overdue":
            listener.forget(grant_key)
            raise AdmissionOverdue(model_id, timeout_ms, int(reply[1]))
        # Delay until the earliest lease could be reclaimed, in Redis time (R2.5).
        reap_in_s = (int(reply[1]) - int(reply[3])) / 1000 if int(reply[1]) > 0 else None
        return await self._await_grant(listener, future, grant_key, model_id, ticket, timeout_ms, kind,
                                       started, deadline, reap_in_s)

    async def _enqueue(self, listener: Listener, grant_key: str, model_id: str, ticket: str, timeout_ms: int,
                       kind: LeaseKind, offer: RunOffer | None, stream_cap: int = 0) -> list:
        """:meth:`acquire`'s first step: ``enqueue.lua`` puts ``ticket`` in ``model_id``'s FIFO queue (and
        pushes ``offer``'s run on its worker's queue when the grant comes at once); returns the script's
        reply (``[status, ...]``: 'granted', 'overdue' or 'queued').

        Raises:
            BaseException: whatever interrupted the enqueue (the caller left, Redis failed), after the
                grant wake-up is forgotten and what the enqueue did is undone (no ticket or lease survives).
        """
        keys = [self.keys.model(model_id), self.keys.seq, self.keys.models_meta, self.keys.worker_live_prefix]
        kind_arg = f"{kind}:{stream_cap}" if kind is LeaseKind.STREAM else str(kind)
        args: list[Any] = [ticket, listener.channel, timeout_ms, self.lease_ttl_ms, kind_arg, model_id,
                           self.use_half_life_ms]
        if offer is not None:
            keys.append(self.keys.run_queue_prefix)
            args += [offer.expected_meta, offer.element_for(ticket), offer.queue_ttl_ms]
        enqueue = asyncio.ensure_future(self._run("enqueue", keys, args))
        try:
            return await asyncio.shield(enqueue)
        except BaseException:
            # The caller left (or Redis failed) while the enqueue was in flight:
            # let it finish, then undo whatever it did, so no ticket or lease survives.
            listener.forget(grant_key)
            await self._abandon(enqueue, model_id, ticket)
            raise

    @staticmethod
    def _next_wait(now: float, deadline: float | None, reap_in_s: float | None) -> tuple[float, bool]:
        """How long a queued waiter waits for its grant before looking again, in seconds, and whether it then
        reaps (``reap.lua``) rather than gives up: until the earliest lease could be reclaimed (plus 50 ms)
        when that comes before ``deadline`` (loop time, None = unbounded), else until ``deadline``; never
        longer than :data:`TICKET_CHECK_S`, after which it reaps."""
        wait_s = None if deadline is None else max(0.0, deadline - now)
        reap_first = reap_in_s is not None and (wait_s is None or reap_in_s + 0.05 < wait_s)
        if reap_in_s is not None and reap_first:
            wait_s = max(0.0, reap_in_s) + 0.05  # a small margin lets Redis TIME pass the expiry
        if wait_s is None or wait_s > TICKET_CHECK_S:
            # Look at the ticket at least this often: a ticket dropped as a dead
            # process's while this one stalled (R7.5) would otherwise wait forever.
            wait_s, reap_first = TICKET_CHECK_S, True
        return wait_s, reap_first

    async def _await_grant(self, listener: Listener, future: asyncio.Future, grant_key: str, model_id: str,
                           ticket: str, timeout_ms: int, kind: LeaseKind, started: float, deadline: float | None,
                           reap_in_s: float | None) -> Lease:
        """:meth:`acquire`'s wait for a queued ticket: the grant's wake-up (``future``), a reap when the
        earliest lease could be reclaimed or the ticket is due a look, and ``cancel.lua`` at the deadline.

        Returns:
            The granted :class:`Lease`, its wait measured from ``started`` (loop time).

        Raises:
            AdmissionExpired: granted, never noticed, and reclaimed.
            AdmissionTimeout: not granted by ``deadline``; the ticket is gone (R3.2).
            asyncio.CancelledError: the caller went away; the ticket is gone (R8.1).
        """
        loop = asyncio.get_running_loop()
        base = self.keys.model(model_id)
        settled = False
        try:
            while True:
                wait_s, reap_first = self._next_wait(loop.time(), deadline, reap_in_s)
                done, _ = await asyncio.wait({future}, timeout=wait_s)
                if done:
                    settled = True
                    return Lease(model_id, ticket, 0, (loop.time() - started) * 1000, kind)
                if reap_first:
                    reaped = await self.reap(model_id, ticket)
                    reap_in_s = (reaped.next_expiry_ms - reaped.now_ms) / 1000 if reaped.next_expiry_ms > 0 else None
                    if reaped.ticket is TicketStatus.GRANTED:  # the wake-up was lost (dropped subscription)
                        settled = True
                        return Lease(model_id, ticket, 0, (loop.time() - started) * 1000, kind)
                    if reaped.ticket is TicketStatus.GONE:  # granted, never noticed, and reclaimed
                        settled = True
                        raise AdmissionExpired(model_id, self.lease_ttl_ms)
                    continue
                outcome = _text(await self._run("cancel", [base], [ticket, self.lease_ttl_ms, ""]))
                settled = True
                if outcome == "granted":
                    return Lease(model_id, ticket, 0, (loop.time() - started) * 1000, kind)
                raise AdmissionTimeout(model_id, timeout_ms)
        except BaseException:
            if not settled:  # caller gone (R8.1) or Redis failed mid-wait: leave nothing behind
                await self._abandon(None, model_id, ticket)
            raise
        finally:
            listener.forget(grant_key)

    def admission_probe(self, model_id: str, request_timeout_ms: int | None, server_ceiling_ms: int):
        """The published entry of ``model_id`` and whether a request sent now would be refused at once.

        One round trip, nothing reserved (``admission_probe.lua``): a web process
        refuses an overdue request (R3.3) before parsing its audio, and otherwise
        has the entry it needs. :meth:`acquire` stays the authority.

        Args:
            request_timeout_ms: the request's ``busy_timeout_ms`` (None = not given).
            server_ceiling_ms: the server's ``busy_timeout_ms`` (a model without its own).

        Returns:
            :class:`AdmissionProbe` (an awaitable of it with an async client).
        """
        request = -1 if request_timeout_ms is None else request_timeout_ms
        return _then(self._run("admission_probe", [self.keys.model(model_id), self.keys.models_meta],
                               [model_id, request, server_ceiling_ms]),
                     lambda r: AdmissionProbe(ProbeVerdict(_text(r[0])),
                                              json.loads(_text(r[1])) if _text(r[1]) else None,
                                              int(r[2]), int(r[3]), bool(int(r[4])), _text(r[1])))

    def try_acquire(self, model_id: str, state: ModelState = ModelState.READY, idle_ms: int = 0,
                    min_resident_ms: int = 0, below_use: float | None = None):
        """Take the model's manager lease only if it is free right now (R6.1, R6.4).

        Never waits and never interrupts: the result is None when the model is
        not in ``state``, holds any lease, has anything queued, or (``idle_ms``
        > 0) finished its last work less than ``idle_ms`` ms ago (Redis clock).
        Eviction by recent use (R6.1) also asks, in the same step, that its pool has
        been ready for at least ``min_resident_ms`` ms and that its recent-use count
        (decayed requests, ``ModelStatus.use``) is below ``below_use`` (None = any).

        Returns:
            :class:`Lease` or None; with an async client, an awaitable of it.
        """
        lease = Lease(model_id, uuid.uuid4().hex, 0, 0.0, LeaseKind.MANAGER)
        bound = "" if below_use is None else repr(float(below_use))
        return _then(self._run("try_acquire", [self.keys.model(model_id)],
                               [lease.lease_id, self.lease_ttl_ms, str(state), idle_ms, min_resident_ms, bound,
                                self.use_half_life_ms]),
                     lambda granted: lease if int(granted) else None)

    async def acquire_many(self, listener: Listener, model_ids: list[str],
                           tickets_out: dict[str, str] | None = None) -> dict[str, asyncio.Future]:
        """Publish a manager ticket on every model in one atomic step (bulk, R5.1/R5.2).

        Args:
            model_ids: distinct model ids (the caller removes duplicates).
            tickets_out: if given, filled with ``{model_id: ticket}`` before
                publication, so the caller can :meth:`abandon` tickets whose
                futures are still pending.

        Returns:
            ``{model_id: future}``; each future resolves to that model's manager
            :class:`Lease` when granted (at once for idle models). Bulk managers
            wait without bound (R3.4). Cancel the futures' consumers with
            :meth:`abandon` for every model not yet released.
        """
        tickets = {model_id: uuid.uuid4().hex for model_id in model_ids}
        if tickets_out is not None:
            tickets_out.update(tickets)
        waits = {model_id: listener.expect(f"grant:{ticket}") for model_id, ticket in tickets.items()}
        keys = [self.keys.model(m) for m in model_ids] + [self.keys.seq]
        try:
            granted = await self._run("enqueue_managers", keys,
                                      [listener.channel, self.lease_ttl_ms, *tickets.values()])
        except BaseException:
            for model_id, ticket in tickets.items():
                listener.forget(f"grant:{ticket}")
                await self._abandon(None, model_id, ticket)
            raise
        loop = asyncio.get_running_loop()
        out: dict[str, asyncio.Future] = {}
        for (model_id, ticket), now in zip(tickets.items(), granted, strict=True):
            future = loop.create_future()
            lease = Lease(model_id, ticket, 0, 0.0, LeaseKind.MANAGER)
            if int(now):
                listener.forget(f"grant:{ticket}")
                future.set_result(lease)
            else:
                waits[model_id].add_done_callback(_settle_with(future, lease))
            out[model_id] = future
        return out

    def keep_bulk(self, pending: dict[str, asyncio.Future], tickets: dict[str, str]) -> KeepAlive:
        """A :class:`KeepAlive` (``async with``) for a bulk manager's tickets (R5, R2.5).

        Each period: renews the leases already granted that wait their turn
        (futures done), and reaps for tickets still queued, settling a future
        whose grant wake-up was lost. ``pending`` and ``tickets`` are those of
        :meth:`acquire_many`; the caller removes a model from ``pending`` when
        its own keep-alive takes over.
        """
        async def tend() -> bool:
            for model_id, future in list(pending.items()):
                if future.done():
                    await self.renew(model_id, tickets[model_id])
                    continue
                reaped = await self.reap(model_id, tickets[model_id])
                if reaped.ticket is TicketStatus.GRANTED and not future.done():  # the wake-up was lost
                    future.set_result(Lease(model_id, tickets[model_id], 0, 0.0, LeaseKind.MANAGER))
            return True
        return KeepAlive(tend, self.lease_ttl_ms / 3000, "bulk manager tickets")

    async def abandon(self, model_id: str, ticket: str) -> None:
        """Give up a ticket or lease wherever it is (queued, granted or gone), in one step."""
        await self._abandon(None, model_id, ticket)

    async def _abandon(self, enqueue, model_id: str, ticket: str) -> None:
        """Remove ``ticket`` wherever it is (queue or lease), shielded from cancellation; best effort."""
        async def undo():
            if enqueue is not None:
                try:
                    reply = await enqueue
                    if _text(reply[0]) == "granted" and len(reply) > 5 and int(reply[5]):
                        return  # the run went to its worker with the grant: the worker releases the lease
                except Exception:
                    pass
            try:  # one step: out of the queue, or released if the grant won the race (cancel.lua)
                await self._run("cancel", [self.keys.model(model_id)], [ticket, self.lease_ttl_ms, "release"])
            except Exception:
                # Redis is unreachable: the lease (if any) expires after its TTL (R2.5).
                pass
        await asyncio.shield(asyncio.ensure_future(undo()))

    async def begin_load(self, listener: Listener, model_id: str, token: str, force: bool = False,
                         replaces: str = "") -> LoadDecision:
        """Single-flight load decision (R4.2); see ``lua/begin_load.lua``.

        For 'wait', the caller must have called ``listener.expect(f"load:{token}")``
        before this call to be woken. ``force``: load even during a failed load's
        backoff (an explicit management load, R6.7). ``replaces``: the caller's
        token of an earlier 'wait' that was not woken, unregistered first; when that
        wait was woken meanwhile (its wake-up late or lost), the decision is
        ``WOKEN``, with how that load ended (``ended``, ``error``), and nothing changed.
        """
        reply = await self._run(
            "begin_load",
            [self.keys.model(model_id), self.keys.worker_live_prefix],
            [token, listener.channel, self.lease_ttl_ms, "1" if force else "0", replaces],
        )
        action = LoadAction(_text(reply[0]))
        if action is LoadAction.READY:
            return LoadDecision(action, _text(reply[1]), _text(reply[2]))
        if action is LoadAction.BACKOFF:
            return LoadDecision(action, retry_in_ms=int(reply[1]), error=_text(reply[2]))
        if action is LoadAction.LOST:
            return LoadDecision(action, owner=_text(reply[2]), error=_text(reply[1]))
        if action is LoadAction.WAIT:
            return LoadDecision(action, left_ms=int(reply[1]))
        if action is LoadAction.WOKEN:
            end = LoadEndRecord.parse(_text(reply[1]))
            return LoadDecision(action, ended=end.ended, error=end.error)
        return LoadDecision(action)

    async def load_end(self, model_id: str, token: str) -> LoadEndRecord:
        """How the load that ``token`` waited for (``begin_load``'s 'wait') or claimed ('load')
        ended, as kept in ``:loadend:<token>`` for a minute after that end; ``ended`` None when
        nothing is kept (the load has not ended, or its record expired). One GET."""
        return LoadEndRecord.parse(await self.redis.get(self.keys.load_end(model_id, token)))

    async def request_stats(self, model_id: str) -> RequestStats:
        """The model's request count and slot hold times (``release.lua`` records them; read only).

        Returns:
            :class:`RequestStats` (hold times in ms, newest first).
        """
        pipe = self.redis.pipeline(transaction=True)
        pipe.hgetall(self.keys.request_stats(model_id))
        pipe.lrange(self.keys.hold_times(model_id), 0, -1)
        stats, held = await pipe.execute()
        return RequestStats(int(stats.get("requests", 0)), int(stats.get("held_ms", 0)), [int(v) for v in held])

    def census(self):
        """Live workers, whether one is being started, and registered models, in one read (``census.lua``).

        Used by ``/health`` and before a cold load (R7.4): with no live worker
        and none being started, a load would wait for nobody.

        Returns:
            :class:`Census` (an awaitable of it with an async client).
        """
        return _then(self._run("census", [self.keys.worker_pid, self.keys.worker_live_prefix,
                                          self.keys.worker_starting, self.keys.models_meta,
                                          self.keys.worker_backend], []),
                     lambda r: Census(int(r[0]), int(r[1]) == 1, int(r[2]), int(r[3])))

    async def snapshot(self, model_ids: list[str]) -> dict[str, ModelStatus]:
        """One atomic read of every model's state, counters and published registration (R4.7).

        Returns:
            ``{model_id: ModelStatus}`` (see :class:`ModelStatus`).
        """
        if not model_ids:
            return {}
        keys = [self.keys.model(m) for m in model_ids] + [self.keys.worker_live_prefix, self.keys.models_meta]
        result = self._run("snapshot", keys, [self.use_half_life_ms, *model_ids])
        if inspect.isawaitable(result):
            result = await result
        return {
            model_id: {"state": ModelState(_text(row[0])), "active_leases": int(row[1]), "queued": int(row[2]),
                       "error": _text(row[3]), "capacity": int(row[4]), "manager_leases": int(row[5]),
                       "queued_managers": int(row[6]), "loaded_capacity": int(row[7]),
                       "last_used_ms": int(row[8]), "retry_at_ms": int(row[9]), "retry_in_ms": int(row[10]),
                       "worker": _text(row[11]), "use": float(_text(row[12])), "resident_ms": int(row[13]),
                       "registration": _text(row[14])}
            for model_id, row in zip(model_ids, result, strict=True)
        }
