"""Admission to a model's slots: FIFO tickets, leases and single-flight loads.

Every transition is one Lua script in ``lua/`` (``lib.lua`` is prepended to
each). This module registers the scripts, maps their results to typed values
and exceptions, and implements the async wait of a caller for its grant.

Timeout rule (CONTRACT R3.1): see :func:`effective_timeout_ms`.
"""
from __future__ import annotations

import asyncio
import inspect
import uuid
from dataclasses import dataclass
from pathlib import Path

from .keys import Keys
from .listener import Listener

LUA_DIR = Path(__file__).resolve().parent / "lua"
_LIB = (LUA_DIR / "lib.lua").read_text()
_SCRIPT_NAMES = (
    "enqueue", "cancel", "release", "renew", "reap",
    "begin_load", "renew_load", "finish_load", "mark_unloaded", "snapshot",
    "enqueue_managers", "try_acquire",
)


class SchedulerError(Exception):
    """Base of the scheduler's refusals."""


class AdmissionTimeout(SchedulerError):
    """The ticket was not granted within its effective timeout (R3.2); the ticket is gone."""

    def __init__(self, model_id: str, timeout_ms: int):
        super().__init__(f"model {model_id!r} stayed busy for the whole busy_timeout_ms={timeout_ms}")
        self.model_id = model_id
        self.timeout_ms = timeout_ms


class AdmissionExpired(SchedulerError):
    """The slot granted to this ticket was reclaimed before the waiting process claimed it (R2.5):
    the process stalled for longer than the lease TTL."""

    def __init__(self, model_id: str, lease_ttl_ms: int):
        super().__init__(f"model {model_id!r}: the slot granted to this request was reclaimed because this "
                         f"server process did not claim it within lease_ttl_ms={lease_ttl_ms}")
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


@dataclass(frozen=True)
class Lease:
    """A granted ticket: owns one slot of ``model_id`` (kind 'request') or the
    whole model (kind 'manager') until released or reaped.

    ``lease_id`` equals the ticket id; ``granted_at_ms`` is Redis TIME in ms;
    ``waited_ms`` is how long the caller queued (local monotonic clock).
    """

    model_id: str
    lease_id: str
    granted_at_ms: int
    waited_ms: float
    kind: str = "request"


@dataclass(frozen=True)
class LoadDecision:
    """Outcome of ``begin_load``: ``action`` is 'ready', 'wait' or 'load'.

    For 'ready', ``owner`` is the Celery hostname owning the pool and ``boot``
    its boot id.
    """

    action: str
    owner: str | None = None
    boot: str | None = None


def _text(value) -> str:
    return value.decode() if isinstance(value, bytes) else value


class Scheduler:
    """The scheduler's operations on one Redis.

    Args:
        redis: ``redis.Redis`` (worker threads) or ``redis.asyncio.Redis`` (web);
            with an async client every operation returns an awaitable.
        keys: key layout.
        lease_ttl_ms: a lease whose holder does not renew it for this long is
            reclaimed (R2.5).
    """

    def __init__(self, redis, keys: Keys, lease_ttl_ms: int):
        self.redis = redis
        self.keys = keys
        self.lease_ttl_ms = lease_ttl_ms
        self._scripts = {
            name: redis.register_script(_LIB + "\n" + (LUA_DIR / f"{name}.lua").read_text())
            for name in _SCRIPT_NAMES
        }

    def _run(self, name: str, keys: list[str], args: list):
        return self._scripts[name](keys=keys, args=args)

    # -- leases ---------------------------------------------------------------
    def release(self, model_id: str, lease_id: str):
        """Give a lease back (idempotent). Returns 1 if it was held, else 0."""
        return self._run("release", [self.keys.model(model_id)], [lease_id, self.lease_ttl_ms])

    def renew(self, model_id: str, lease_id: str):
        """Extend a lease by the TTL. Returns 1, or 0 when it was already reclaimed."""
        return self._run("renew", [self.keys.model(model_id)], [lease_id, self.lease_ttl_ms])

    def reap(self, model_id: str, ticket: str = ""):
        """Reclaim expired leases and grant.

        Returns ``[reaped, next_expiry_ms|-1, status]``; ``status`` is the state of
        ``ticket`` ('queued', 'granted' or 'gone'; 'gone' when no ticket is given).
        """
        return self._run("reap", [self.keys.model(model_id)], [self.lease_ttl_ms, ticket])

    # -- loads ----------------------------------------------------------------
    def renew_load(self, model_id: str, token: str, host: str):
        """Extend the single loader's claim (``host`` = the worker loading). Returns 1 if still the loader."""
        return self._run("renew_load", [self.keys.model(model_id)], [token, self.lease_ttl_ms, host])

    async def load_picked_up(self, model_id: str, token: str) -> bool:
        """True when a worker has started the load claimed by ``token`` (async client)."""
        fields = await self.redis.hmget(self.keys.model(model_id) + ":load", ["loader", "loader_host"])
        return _text(fields[0]) == token and bool(fields[1])

    def finish_load(self, model_id: str, token: str, ok: bool, owner: str = "", boot: str = "", error: str = "",
                    capacity: int = 0):
        """Publish a load's outcome and wake its waiters. Returns 'ok' or 'stale'.

        ``capacity`` is the loaded pool's advertised capacity (shown as
        ``max_parallel_slots`` while the model is loaded).
        """
        return self._run(
            "finish_load", [self.keys.model(model_id)],
            [token, "ready" if ok else "failed", owner, boot, error, capacity],
        )

    def mark_unloaded(self, model_id: str, boot: str, error: str):
        """Record that the pool loaded under ``boot`` is gone. Returns 1 if state changed."""
        return self._run("mark_unloaded", [self.keys.model(model_id)], [boot, error])

    def set_state(self, model_id: str, state: str, error: str = ""):
        """Record a lifecycle state chosen by a manager holding the model's exclusive lease.

        'unloading', 'reconfiguring' and 'unloaded' also forget the owner, so
        the logical residency is cleared first (R4.5).
        """
        key = self.keys.model(model_id) + ":load"
        if state in ("unloading", "reconfiguring", "unloaded"):
            pipe = self.redis.pipeline(transaction=True)
            pipe.hset(key, mapping={"state": state, "error": error})
            pipe.hdel(key, "owner", "boot", "loader", "loader_expires_ms", "loader_host")
            return pipe.execute()
        return self.redis.hset(key, mapping={"state": state, "error": error})

    def set_capacity(self, model_id: str, slots: int):
        """Set the number of slots of a model (1 on the legacy runtime)."""
        return self.redis.set(self.keys.model(model_id) + ":cap", slots)

    # -- async admission (web processes) --------------------------------------
    async def acquire(self, listener: Listener, model_id: str, timeout_ms: int, kind: str = "request") -> Lease:
        """Enter the model's FIFO queue and wait for a slot (request) or the whole model (manager).

        Args:
            listener: this process's :class:`Listener` (same event loop).
            model_id: the model.
            timeout_ms: effective busy timeout (R3.1); 0 = unbounded.
            kind: 'request' (one slot, R2.2) or 'manager' (exclusive: waits for
                every older lease; a barrier for later tickets).

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
        loop = asyncio.get_running_loop()
        started = loop.time()
        deadline = started + timeout_ms / 1000 if timeout_ms > 0 else None
        ticket = uuid.uuid4().hex
        base = self.keys.model(model_id)
        grant_key = f"grant:{ticket}"
        future = listener.expect(grant_key)
        enqueue = asyncio.ensure_future(
            self._run("enqueue", [base, self.keys.seq], [ticket, listener.channel, timeout_ms, self.lease_ttl_ms, kind])
        )
        try:
            reply = await asyncio.shield(enqueue)
        except BaseException:
            # The caller left (or Redis failed) while the enqueue was in flight:
            # let it finish, then undo whatever it did, so no ticket or lease survives.
            listener.forget(grant_key)
            await self._abandon(enqueue, model_id, ticket)
            raise
        status = _text(reply[0])
        if status == "granted":
            listener.forget(grant_key)
            return Lease(model_id, ticket, int(reply[1]), 0.0, kind)
        if status == "overdue":
            listener.forget(grant_key)
            raise AdmissionOverdue(model_id, timeout_ms, int(reply[1]))
        # Delay until the earliest lease could be reclaimed, in Redis time (R2.5).
        reap_in_s = (int(reply[1]) - int(reply[3])) / 1000 if int(reply[1]) > 0 else None
        settled = False
        try:
            while True:
                wait_s = None if deadline is None else max(0.0, deadline - loop.time())
                reap_first = reap_in_s is not None and (wait_s is None or reap_in_s + 0.05 < wait_s)
                if reap_first:
                    wait_s = max(0.0, reap_in_s) + 0.05  # a small margin lets Redis TIME pass the expiry
                done, _ = await asyncio.wait({future}, timeout=wait_s)
                if done:
                    settled = True
                    return Lease(model_id, ticket, 0, (loop.time() - started) * 1000, kind)
                if reap_first:
                    reaped = await self.reap(model_id, ticket)
                    reap_in_s = (int(reaped[1]) - int(reaped[3])) / 1000 if int(reaped[1]) > 0 else None
                    status = _text(reaped[2])
                    if status == "granted":  # the wake-up was lost (dropped subscription)
                        settled = True
                        return Lease(model_id, ticket, 0, (loop.time() - started) * 1000, kind)
                    if status == "gone":  # granted, never noticed, and reclaimed
                        settled = True
                        raise AdmissionExpired(model_id, self.lease_ttl_ms)
                    continue
                outcome = _text(await self._run("cancel", [base], [ticket, self.lease_ttl_ms]))
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

    def try_acquire(self, model_id: str, state: str = "ready", idle_ms: int = 0):
        """Take the model's manager lease only if it is free right now (R6.1, R6.4).

        Never waits and never interrupts: the result is None when the model is
        not in ``state``, holds any lease, has anything queued, or (``idle_ms``
        > 0) finished its last work less than ``idle_ms`` ms ago (Redis clock).

        Returns:
            :class:`Lease` or None; with an async client, an awaitable of it.
        """
        lease = Lease(model_id, uuid.uuid4().hex, 0, 0.0, "manager")
        granted = self._run("try_acquire", [self.keys.model(model_id)],
                            [lease.lease_id, self.lease_ttl_ms, state, idle_ms])
        if inspect.isawaitable(granted):
            async def settle():
                return lease if int(await granted) else None
            return settle()
        return lease if int(granted) else None

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
        for (model_id, ticket), now in zip(tickets.items(), granted):
            future = loop.create_future()
            lease = Lease(model_id, ticket, 0, 0.0, "manager")
            if int(now):
                listener.forget(f"grant:{ticket}")
                future.set_result(lease)
            else:
                waits[model_id].add_done_callback(
                    lambda done, f=future, lease=lease: f.cancelled() or f.done() or f.set_result(lease))
            out[model_id] = future
        return out

    async def abandon(self, model_id: str, ticket: str) -> None:
        """Give up a ticket or lease wherever it is (queued, granted or gone)."""
        await self._abandon(None, model_id, ticket)

    async def _abandon(self, enqueue, model_id: str, ticket: str) -> None:
        """Remove ``ticket`` wherever it is (queue or lease), shielded from cancellation; best effort."""
        async def undo():
            if enqueue is not None:
                try:
                    await enqueue
                except Exception:
                    pass
            try:
                outcome = _text(await self._run("cancel", [self.keys.model(model_id)], [ticket, self.lease_ttl_ms]))
                if outcome == "granted":
                    await self.release(model_id, ticket)
            except Exception:
                # Redis is unreachable: the lease (if any) expires after its TTL (R2.5).
                pass
        await asyncio.shield(asyncio.ensure_future(undo()))

    async def begin_load(self, listener: Listener, model_id: str, token: str) -> LoadDecision:
        """Single-flight load decision (R4.2); see ``lua/begin_load.lua``.

        For 'wait', the caller must have called ``listener.expect(f"load:{token}")``
        before this call to be woken.
        """
        reply = await self._run(
            "begin_load",
            [self.keys.model(model_id), self.keys.worker_live_prefix],
            [token, listener.channel, self.lease_ttl_ms],
        )
        action = _text(reply[0])
        if action == "ready":
            return LoadDecision("ready", _text(reply[1]), _text(reply[2]))
        return LoadDecision(action)

    async def snapshot(self, model_ids: list[str]) -> dict[str, dict]:
        """One atomic read of every model's state and counters (R4.7).

        Returns:
            ``{model_id: {"state": str, "active_leases": int (request leases),
            "queued": int (queued requests), "error": str, "capacity": int,
            "manager_leases": int, "queued_managers": int, "loaded_capacity": int (0 = not loaded),
            "last_used_ms": int (Redis-clock ms at the end of the last work; 0 = never)}}``.
        """
        if not model_ids:
            return {}
        keys = [self.keys.model(m) for m in model_ids] + [self.keys.worker_live_prefix]
        result = self._run("snapshot", keys, [])
        if inspect.isawaitable(result):
            result = await result
        return {
            model_id: {"state": _text(row[0]), "active_leases": int(row[1]), "queued": int(row[2]),
                       "error": _text(row[3]), "capacity": int(row[4]), "manager_leases": int(row[5]),
                       "queued_managers": int(row[6]), "loaded_capacity": int(row[7]),
                       "last_used_ms": int(row[8])}
            for model_id, row in zip(model_ids, result)
        }
