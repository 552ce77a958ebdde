"""How a request reaches a loaded session, on both runtimes.

Legacy runtime (R1.1): each model has capacity one, so its lease is a
per-model busy guard. Parallel runtime (R1.3): capacity = the model's
``slots``; the same FIFO admits up to that many requests at once, and each
run borrows one of the pool's sessions on the worker. Managers (unload here;
register/reconfigure later) take the whole model as a barrier (R2.2).

Flow of one request (web process, async, no thread held while waiting):

1. acquire a request lease under the effective busy timeout (R3.1–R3.3);
2. make sure the model is loaded (single flight across processes, R4.2);
3. store the decoded input in Redis (TTL) and send ``run_model`` to the
   owning worker's direct queue;
4. await the ``done:<id>`` wake-up; the worker releases the lease.

The web process renews the lease until the worker reports back. It releases
the lease itself on every path where the worker never took over (refusal,
load failure, lost worker). If the client disconnects after dispatch, the
running step finishes on the worker, which releases the lease (R8.2).
"""
from __future__ import annotations

import asyncio
import json
import logging
import time
import uuid
from dataclasses import dataclass

from celery.utils import worker_direct

from audiosite.celery import app as celery_app
from audiosite.errors import ApplicationError, Conflict, InvalidRequest, ModelLoadFailed, NotFound, ServerBusy
from audiosite.serverconfig import get_config
from inference import audio
from inference.pools import LIVENESS_TTL_MS
from inference.runtime.context import KEYS, AsyncContext
from inference.scheduler import AdmissionExpired, AdmissionOverdue, AdmissionTimeout, effective_timeout_ms

log = logging.getLogger(__name__)

INPUT_TTL_MS = 600000  # decoded input waits at most 10 min for its worker
WATCHDOG_S = LIVENESS_TTL_MS / 1000  # how often a waiter checks that its worker lives


@dataclass
class Outcome:
    """A served request: the adapter's ``result`` plus where and how long.

    Times in ms: ``queue_ms`` waiting for the lease, ``load_ms`` spent loading
    (0 when warm), ``inference_ms`` inside the session.
    """

    result: dict
    queue_ms: float
    load_ms: float
    inference_ms: float
    slot: int
    worker: str


def ceiling_ms(meta: dict | None) -> int:
    """A model's admission ceiling in ms (R3.1): its ``busy_timeout_ms``, else the server's."""
    if meta is not None and meta.get("busy_timeout_ms") is not None:
        return meta["busy_timeout_ms"]
    return get_config().busy_timeout_ms


def _busy(exc: Exception) -> ServerBusy:
    if isinstance(exc, AdmissionExpired):
        return ServerBusy(f"server busy: {exc}", code="grant_expired")
    if isinstance(exc, AdmissionOverdue):
        return ServerBusy(f"server busy: {exc} (overdue fail-fast)", code="overdue")
    return ServerBusy(f"server busy: {exc} (queue timeout)", code="queue_timeout")


async def _send(task_name: str, args: list, queue) -> None:
    await asyncio.to_thread(celery_app.send_task, task_name, args=args, queue=queue)


async def _await_reply(ctx: AsyncContext, wake: asyncio.Future, reply_key: str, keep_waiting,
                       tick_s: float = WATCHDOG_S) -> bool:
    """Wait for a worker's reply: the pushed wake-up, or ``reply_key`` found at a watchdog tick.

    The key check catches a wake-up lost with a dropped subscription. At each
    tick without a reply, ``await keep_waiting()`` decides whether to go on.

    Returns:
        True when the reply is there, False when ``keep_waiting`` said stop.
    """
    while True:
        done, _ = await asyncio.wait({wake}, timeout=tick_s)
        if done or await ctx.redis.exists(reply_key):
            return True
        if not await keep_waiting():
            return False


async def ensure_loaded(ctx: AsyncContext, model_id: str, pickup_timeout_s: float | None = None) -> tuple[str, str, float]:
    """Return ``(owner, boot, load_ms)`` of a loaded pool, loading it if needed (single flight).

    With a residency or memory limit set, a cold load first passes the cold
    load guard (one at a time, FIFO) and makes room (R6.1, R6.5, R6.6); a
    model that is ready, or being loaded by someone else, never touches the
    guard, so warm traffic never waits on it.

    Raises:
        ModelLoadFailed, ServerBusy: see :func:`_load_single_flight`.
        ServerBusy: (code ``residency_full``) not enough models could be evicted.
        InsufficientMemory: the memory guard refused the load.
    """
    if get_config().residency_limited:
        state = (await ctx.scheduler.snapshot([model_id]))[model_id]["state"]
        if state not in ("ready", "loading"):
            from inference.runtime.residency import cold_load_guard, make_room

            async with cold_load_guard(ctx):
                started = time.monotonic()
                await make_room(ctx, model_id)
                owner, boot, load_ms = await _load_single_flight(ctx, model_id, pickup_timeout_s)
                return owner, boot, (time.monotonic() - started) * 1000 if load_ms else 0.0
    return await _load_single_flight(ctx, model_id, pickup_timeout_s)


async def _load_single_flight(ctx: AsyncContext, model_id: str,
                              pickup_timeout_s: float | None = None) -> tuple[str, str, float]:
    """Return ``(owner, boot, load_ms)`` of a loaded pool, loading it if needed (single flight, R4.2).

    Args:
        pickup_timeout_s: how long a load task may wait for a worker to start
            it (default: the lease TTL). Past that, the claim is abandoned.

    Raises:
        ModelLoadFailed: the load failed; the model stays registered and
            unloaded, and a later request retries (R4.2).
        ServerBusy: no worker started the load in time (code ``no_worker``, R7.4).

    Tolerated race: a load task that a worker starts after its claim was
    abandoned sees ``renew_load`` refuse and does nothing.
    """
    if pickup_timeout_s is None:
        pickup_timeout_s = ctx.scheduler.lease_ttl_ms / 1000
    started = time.monotonic()
    loaded_here = False
    while True:
        token = uuid.uuid4().hex
        wake = ctx.listener.expect(f"load:{token}")
        try:
            decision = await ctx.scheduler.begin_load(ctx.listener, model_id, token)
            if decision.action == "ready":
                load_ms = (time.monotonic() - started) * 1000 if loaded_here else 0.0
                return decision.owner, decision.boot, load_ms
            if decision.action == "wait":
                # Another caller loads; wake on its outcome, or re-decide after
                # the watchdog period (a loader that died is replaced).
                done, _ = await asyncio.wait({wake}, timeout=WATCHDOG_S)
                if done:
                    load = await ctx.redis.hgetall(KEYS.model(model_id) + ":load")
                    if load.get("state") == "unloaded" and load.get("error"):
                        # That load failed: it releases everyone who waited for it (R4.2).
                        raise ModelLoadFailed(f"model {model_id!r} failed to load: {load['error']}",
                                              code="load_failed")
                continue
            loaded_here = True
            await _send("inference.load_model", [model_id, token, ctx.listener.channel], "gpu")
            sent_at = time.monotonic()

            async def picked_up_in_time(token=token, sent_at=sent_at) -> bool:
                if await ctx.scheduler.load_picked_up(model_id, token):
                    return True  # a worker is loading and renewing its claim
                if time.monotonic() - sent_at < pickup_timeout_s:
                    return True
                await ctx.scheduler.finish_load(model_id, token, False, error="no worker started the load")
                raise ServerBusy(f"model {model_id!r}: no worker started its load within "
                                 f"{pickup_timeout_s:.0f} s; is a GPU worker running?", code="no_worker")

            await _await_reply(ctx, wake, KEYS.load_result(token), picked_up_in_time,
                               tick_s=min(WATCHDOG_S, pickup_timeout_s))
            outcome = json.loads(await ctx.redis.getdel(KEYS.load_result(token)) or '{"ok": false, "error": "lost"}')
            if not outcome["ok"]:
                raise ModelLoadFailed(f"model {model_id!r} failed to load: {outcome['error']}", code="load_failed")
        finally:
            ctx.listener.forget(f"load:{token}")


async def _worker_alive(ctx: AsyncContext, owner: str, boot: str) -> bool:
    return await ctx.redis.get(KEYS.worker_live(owner)) == boot


async def _dispatch(ctx: AsyncContext, model_id: str, lease_id: str, owner: str, boot: str,
                    samples, sample_rate_hz: int, options: dict, handover: dict) -> dict | None:
    """Send one run to ``owner`` and await its outcome; None when the worker died meanwhile.

    Sets ``handover["sent"] = True`` once the task is on the worker's queue:
    from then on the worker releases the lease, unless it answers ``not_loaded``.
    """
    request_id = uuid.uuid4().hex
    header = json.dumps({"sample_rate_hz": sample_rate_hz, "options": options}).encode()
    await ctx.redis_bytes.set(KEYS.input(request_id), header + b"\n" + audio.to_bytes(samples), px=INPUT_TTL_MS)
    wake = ctx.listener.expect(f"done:{request_id}")
    try:
        send = asyncio.ensure_future(_send("inference.run_model",
                                           [model_id, request_id, lease_id, boot, ctx.listener.channel],
                                           worker_direct(owner)))
        try:
            await asyncio.shield(send)
        except asyncio.CancelledError:
            # The client left while the task was being sent: the send goes on
            # in its thread; once it is on the queue the worker owns the lease.
            try:
                await send
                handover["sent"] = True
            except Exception:
                pass
            raise
        handover["sent"] = True
        if not await _await_reply(ctx, wake, KEYS.result(request_id), lambda: _worker_alive(ctx, owner, boot)):
            await ctx.redis.delete(KEYS.input(request_id))
            return None
        return json.loads(await ctx.redis.getdel(KEYS.result(request_id)))
    finally:
        ctx.listener.forget(f"done:{request_id}")


async def _renew_forever(ctx: AsyncContext, model_id: str, lease_id: str) -> None:
    every_s = ctx.scheduler.lease_ttl_ms / 3000
    while True:
        await asyncio.sleep(every_s)
        if not await ctx.scheduler.renew(model_id, lease_id):
            return


async def infer(ctx: AsyncContext, meta: dict, samples, sample_rate_hz: int, options: dict,
                request_timeout_ms: int | None) -> Outcome:
    """Serve one request (either runtime).

    Args:
        meta: published registration of the model.
        samples: float32 ``(n,)`` at ``sample_rate_hz`` (the family's rate).
        options: validated request options (merged with defaults on the worker).
        request_timeout_ms: the request's ``busy_timeout_ms`` (None = not given).

    Raises:
        ServerBusy: queue timeout or overdue fail-fast (R3.2, R3.3), or the
            worker was lost twice.
        ModelLoadFailed: the model could not be loaded.
        InvalidRequest: the adapter refused the request's options.
        NotFound: the model was unregistered while the request waited.
        Conflict: the model changed family or task while the request waited.
    """
    model_id = meta["id"]
    timeout_ms = effective_timeout_ms(request_timeout_ms, ceiling_ms(meta))
    try:
        lease = await ctx.scheduler.acquire(ctx.listener, model_id, timeout_ms)
    except (AdmissionExpired, AdmissionOverdue, AdmissionTimeout) as exc:
        raise _busy(exc) from None
    renewer = asyncio.create_task(_renew_forever(ctx, model_id, lease.lease_id))
    handover = {"sent": False}
    try:
        # A manager ahead of us may have unregistered or reconfigured the model (R2.3).
        current = await ctx.redis.hget(KEYS.models_meta, model_id)
        if current is None:
            raise NotFound(f"model {model_id!r} was unregistered while the request waited", param="model")
        current = json.loads(current)
        if (current["family"], current["task"]) != (meta["family"], meta["task"]):
            raise Conflict(f"model {model_id!r} was reconfigured to {current['family']}/{current['task']} while "
                           "the request waited; its input was prepared for the old family; retry", param="model")
        load_ms = 0.0
        for _attempt in range(2):
            owner, boot, spent = await ensure_loaded(ctx, model_id)
            load_ms += spent
            reply = await _dispatch(ctx, model_id, lease.lease_id, owner, boot, samples, sample_rate_hz, options,
                                    handover)
            if reply is None:
                # The owner stopped beating while it ran our request. It may be
                # frozen rather than dead, so its run could still finish and
                # release this lease later: never reuse the lease; give it back
                # and answer 503 (R7.4).
                handover["sent"] = False
                await ctx.scheduler.mark_unloaded(model_id, boot, "worker lost")
                raise ServerBusy(f"model {model_id!r}: its worker stopped responding; retry", code="worker_lost")
            if reply.get("kind") == "not_loaded":
                # The owner never took the run (its pool is gone): the lease is
                # still ours alone; forget the pool and load again once.
                handover["sent"] = False
                await ctx.scheduler.mark_unloaded(model_id, boot, "pool lost")
                continue
            break
        else:
            raise ServerBusy(f"model {model_id!r}: its pool was lost twice; retry later", code="worker_lost")
        if not reply["ok"]:
            if reply["kind"] == "invalid_input":
                raise InvalidRequest(reply["message"], param=reply.get("param"))
            if reply["kind"] == "error":  # an adapter failed on valid input: a bug, reported as such
                raise ApplicationError(f"model {model_id!r} failed: {reply['message']}")
            raise ServerBusy(f"model {model_id!r} could not serve the request: {reply['message']}", code=reply["kind"])
        return Outcome(reply["result"], lease.waited_ms, load_ms, reply["inference_ms"], reply["slot"], reply["worker"])
    finally:
        renewer.cancel()
        if not handover["sent"]:
            await asyncio.shield(ctx.scheduler.release(model_id, lease.lease_id))


async def unload(ctx: AsyncContext, model_id: str, timeout_ms: int = 0, actor: str = "") -> str:
    """Unload ``model_id`` as a manager (R4.5), on either runtime.

    Waits behind every older request (and is a barrier for later ones, R2.2),
    then runs :func:`unload_held` and releases the manager lease. Idempotent.

    Args:
        timeout_ms: manager admission bound (0 = wait without bound, R3.4).

    Returns:
        See :func:`unload_held`.

    Raises:
        ServerBusy: admission timeout or fail-fast (R3.4).
    """
    return await run_as_manager(ctx, model_id, timeout_ms, lambda: unload_held(ctx, model_id, actor))


async def run_as_manager(ctx: AsyncContext, model_id: str, timeout_ms: int, transition):
    """Take ``model_id``'s manager lease, then run ``transition()`` to completion under it.

    The caller may leave while the manager is queued (the ticket is withdrawn);
    once the lease is granted, ``transition()`` runs to its end and the lease
    is released after it (see :func:`run_to_completion`).

    Args:
        timeout_ms: manager admission bound (0 = unbounded, R3.4).
        transition: a no-argument callable returning the coroutine to run.

    Returns:
        What the transition returns.

    Raises:
        ServerBusy: admission timeout or fail-fast (R3.4); whatever the transition raises.
    """
    lease = await acquire_manager(ctx, model_id, timeout_ms)
    return await run_to_completion(with_manager_lease(ctx, model_id, lease, transition()))


_DETACHED: set[asyncio.Task] = set()


async def run_to_completion(coro):
    """Await ``coro`` in its own task that a caller's cancellation does not stop.

    A transition that holds a manager lease must finish (and release the
    lease itself) even when the client that asked for it disconnects:
    releasing the lease while a teardown still runs would let requests in
    beside a half-destroyed pool (R4.5). Cancellation before the lease is
    granted is not affected (the ticket is simply withdrawn).

    Returns:
        What ``coro`` returns; its exception is re-raised.
    """
    task = asyncio.ensure_future(coro)
    _DETACHED.add(task)
    task.add_done_callback(_settle_detached)
    return await asyncio.shield(task)


def _settle_detached(task: asyncio.Task) -> None:
    """Forget a finished transition; log the outcome its departed caller can no longer hear."""
    _DETACHED.discard(task)
    if not task.cancelled() and task.exception() is not None:
        exc = task.exception()
        log.info("a management transition ended with %s: %s", type(exc).__name__, getattr(exc, "message", exc))


async def with_manager_lease(ctx: AsyncContext, model_id: str, lease, coro):
    """Run ``coro`` while renewing the manager ``lease``; release the lease on every path."""
    try:
        async with renewing(ctx, model_id, lease.lease_id):
            return await coro
    finally:
        await asyncio.shield(ctx.scheduler.release(model_id, lease.lease_id))


async def acquire_manager(ctx: AsyncContext, model_id: str, timeout_ms: int):
    """Take ``model_id``'s exclusive manager lease (a barrier, R2.2) under ``timeout_ms`` (0 = unbounded).

    Raises:
        ServerBusy: admission timeout or fail-fast (R3.4).
    """
    try:
        return await ctx.scheduler.acquire(ctx.listener, model_id, timeout_ms, kind="manager")
    except (AdmissionExpired, AdmissionOverdue, AdmissionTimeout) as exc:
        raise _busy(exc) from None


class renewing:
    """``async with renewing(ctx, model_id, lease_id):`` keeps a lease renewed while the block runs."""

    def __init__(self, ctx: AsyncContext, model_id: str, lease_id: str):
        self.args = (ctx, model_id, lease_id)
        self.task: asyncio.Task | None = None

    async def __aenter__(self):
        self.task = asyncio.create_task(_renew_forever(*self.args))
        return self

    async def __aexit__(self, *exc):
        self.task.cancel()
        return False


async def unload_held(ctx: AsyncContext, model_id: str, actor: str = "", state: str = "unloading") -> str:
    """Unload ``model_id`` while the caller holds its manager lease (R4.5).

    A load still in progress (its requesters may have left) is waited for, not
    skipped, so its pool is unloaded too. Clears the logical residency first
    (``state``: ``unloading``, or ``reconfiguring`` for a reconfiguration;
    owner forgotten), has the owning worker destroy sessions then weights,
    and records ``unloaded``. The lease stays held.

    Returns:
        'destroyed' (a pool was destroyed), 'not_loaded' (there was none), or
        'worker_lost' (the owner stopped beating; its pool dies with it).
    """
    await _wait_for_load_in_progress(ctx, model_id)
    load = await ctx.redis.hgetall(KEYS.model(model_id) + ":load")
    owner, boot = load.get("owner"), load.get("boot")
    await ctx.scheduler.set_state(model_id, state)
    outcome = "not_loaded"
    if owner and boot:
        outcome = "worker_lost"
    if owner and boot and await _worker_alive(ctx, owner, boot):
        token = uuid.uuid4().hex
        wake = ctx.listener.expect(f"load:{token}")
        try:
            await _send("inference.unload_model", [model_id, boot, token, ctx.listener.channel, actor],
                        worker_direct(owner))
            await _await_reply(ctx, wake, KEYS.load_result(token), lambda: _worker_alive(ctx, owner, boot))
        finally:
            ctx.listener.forget(f"load:{token}")
        reply = json.loads(await ctx.redis.getdel(KEYS.load_result(token)) or "{}")
        outcome = "destroyed" if reply.get("had_pool") else ("not_loaded" if reply else "worker_lost")
    await ctx.scheduler.set_state(model_id, "unloaded")
    return outcome


async def _wait_for_load_in_progress(ctx: AsyncContext, model_id: str) -> None:
    """Block while a live loader is building the model's pool (its claim keeps being renewed)."""
    key = KEYS.model(model_id) + ":load"
    while True:
        load = await ctx.redis.hgetall(key)
        if load.get("state") != "loading" or not load.get("loader"):
            return
        token = uuid.uuid4().hex
        wake = ctx.listener.expect(f"load:{token}")
        try:
            await ctx.redis.hset(KEYS.model(model_id) + ":loadwait", token, ctx.listener.channel)
            await asyncio.wait({wake}, timeout=WATCHDOG_S)
        finally:
            ctx.listener.forget(f"load:{token}")
        load = await ctx.redis.hgetall(key)
        if load.get("state") == "loading" and int(load.get("loader_expires_ms") or 0) < \
                int((await ctx.redis.time())[0]) * 1000:
            return  # the loader died: nothing to wait for
