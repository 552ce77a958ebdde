"""Worker RPC: loads and unloads as Celery tasks, runs on the worker's own run queue;
replies back through Redis keys and a pushed wake-up.

A task or run header carries ids and Redis keys, never audio. Its outcome is written to a
reply key with a TTL and announced on the caller's process channel; a
watchdog tick reads the key anyway, so a lost wake-up costs at most one
tick. The web process never imports a worker module: tasks are sent by name.
"""
from __future__ import annotations

import asyncio
import json
import math
import time
import uuid
from collections.abc import Awaitable, Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum

import numpy as np

from audiosite.celery import app as celery_app
from audiosite.errors import ModelLoadFailed, ServerBusy
from inference import audio
from inference.scheduler import LIVENESS_TTL_MS, LoadAction, LoadClaim

from .context import KEYS, AsyncContext

INPUT_TTL_MS = 600000  # a request's input waits at most 10 min for its worker
WATCHDOG_S = LIVENESS_TTL_MS / 1000  # how often a waiter checks that its worker lives

# Sending a task is a blocking call into kombu; it runs in a small pool of its
# own, never in the executor that decodes audio (R: the request path, item 7).
_SEND_POOL = ThreadPoolExecutor(max_workers=4, thread_name_prefix="celery-send")


async def send_task(task_name: str, args: list, queue) -> None:
    """Publish a Celery task by name on ``queue`` (a queue name or a ``celery.utils.worker_direct`` queue)."""
    loop = asyncio.get_running_loop()
    await loop.run_in_executor(_SEND_POOL, lambda: celery_app.send_task(task_name, args=args, queue=queue))


async def await_reply(ctx: AsyncContext, wake: asyncio.Future, reply_key: str,
                      keep_waiting: Callable[[], Awaitable[bool]], tick_s: float = WATCHDOG_S) -> bool:
    """Wait for a worker's reply: the pushed wake-up, or ``reply_key`` found at a watchdog tick.

    At each tick without a reply, ``await keep_waiting()`` decides whether to go on.

    Returns:
        True when the reply is there, False when ``keep_waiting`` said stop.
    """
    while True:
        done, _ = await asyncio.wait({wake}, timeout=tick_s)
        if done or await ctx.redis.exists(reply_key):
            return True
        if not await keep_waiting():
            return False


async def worker_alive(ctx: AsyncContext, owner: str, boot: str) -> bool:
    """True while worker ``owner`` still beats with boot id ``boot`` (R7.4)."""
    return await ctx.redis.get(KEYS.worker_live(owner)) == boot


def backoff_error(model_id: str, retry_in_ms: int, error: str) -> ModelLoadFailed:
    """The 503 ``load_failed`` of a model whose last load failed ``retry_in_ms`` before its next try (R6.7)."""
    retry_after_s = max(1, math.ceil(retry_in_ms / 1000))
    return ModelLoadFailed(f"model {model_id!r} failed to load ({error or 'no detail'}); the next load may be "
                           f"tried in {retry_after_s} s (backoff after failed loads)", code="load_failed",
                           retry_after_s=retry_after_s)


@dataclass(frozen=True)
class Placement:
    """Where a model's pool is loaded: Celery hostname ``owner``, its ``boot`` id, and
    ``load_ms`` spent loading it for this caller (0.0 when it was already loaded)."""

    owner: str
    boot: str
    load_ms: float


async def load_single_flight(ctx: AsyncContext, model_id: str, pickup_timeout_s: float | None = None,
                             force: bool = False) -> Placement:
    """Return where ``model_id`` is loaded, loading it first if needed (single flight across processes, R4.2).

    Args:
        pickup_timeout_s: how long a load task may wait for a worker to start
            it (default: the lease TTL). Past that, the claim is abandoned.
        force: load even during a failed load's backoff (explicit management load, R6.7).

    Raises:
        ModelLoadFailed: the load failed; the model stays registered and
            unloaded, and a later request retries (R4.2); or the last load
            failed and its backoff has not passed (R6.7: at once, with the
            time left as ``retry_after_s``).
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
            decision = await ctx.scheduler.begin_load(ctx.listener, model_id, token, force)
            if decision.action is LoadAction.BACKOFF:
                raise backoff_error(model_id, decision.retry_in_ms, decision.error)
            if decision.action is LoadAction.READY:
                assert decision.owner is not None and decision.boot is not None
                return Placement(decision.owner, decision.boot,
                                 (time.monotonic() - started) * 1000 if loaded_here else 0.0)
            if decision.action is LoadAction.WAIT:
                # Another caller loads: wake on its outcome, or decide again after
                # the watchdog period (a loader that died is replaced).
                done, _ = await asyncio.wait({wake}, timeout=WATCHDOG_S)
                if done:
                    load = await ctx.redis.hgetall(KEYS.load(model_id))
                    if load.get("state") == "unloaded" and load.get("error"):
                        # That load failed: it releases everyone who waited for it (R4.2).
                        raise ModelLoadFailed(f"model {model_id!r} failed to load: {load['error']}",
                                              code="load_failed")
                continue
            loaded_here = True
            await send_task("inference.load_model", [model_id, token, ctx.listener.channel], "gpu")
            sent_at = time.monotonic()

            async def load_goes_on(token: str = token, sent_at: float = sent_at) -> bool:
                claim = await ctx.scheduler.load_claim(model_id, token)
                if claim is LoadClaim.RUNNING:
                    return True  # a worker is loading and renewing its claim
                if claim is LoadClaim.PENDING:
                    if time.monotonic() - sent_at < pickup_timeout_s:
                        return True
                    await ctx.scheduler.finish_load(model_id, token, False, error="no worker started the load")
                    raise ServerBusy(f"model {model_id!r}: no worker started its load within "
                                     f"{pickup_timeout_s:.0f} s; is a GPU worker running?", code="no_worker")
                if claim is LoadClaim.EXPIRED:
                    # The loading worker stopped renewing its claim (R7.4): nobody will answer.
                    await ctx.scheduler.finish_load(model_id, token, False, error="the loading worker stopped")
                    raise ServerBusy(f"model {model_id!r}: the worker loading it stopped responding; retry",
                                     code="worker_lost")
                return False  # GONE: finished (its reply is read below) or taken over (decide again)

            replied = await await_reply(ctx, wake, KEYS.load_result(token), load_goes_on,
                                        tick_s=min(WATCHDOG_S, pickup_timeout_s))
            raw = await ctx.redis.getdel(KEYS.load_result(token))
            if not replied and raw is None:
                # Our claim is gone without a reply yet: the load just finished (its reply follows
                # the worker's database write) or another loader took over. Read the outcome.
                load = await ctx.redis.hgetall(KEYS.load(model_id))
                if load.get("state") == "unloaded" and load.get("error"):
                    raise ModelLoadFailed(f"model {model_id!r} failed to load: {load['error']}", code="load_failed")
                continue  # ready (begin_load says so) or loading by another: decide again
            outcome = json.loads(raw or '{"ok": false, "error": "lost"}')
            if not outcome["ok"]:
                raise ModelLoadFailed(f"model {model_id!r} failed to load: {outcome['error']}", code="load_failed")
        finally:
            ctx.listener.forget(f"load:{token}")


class RunFailure(StrEnum):
    """``kind`` of a failed run reply (``{"ok": false, "kind", "message"[, "param"]}``).

    ``NOT_LOADED``: the worker holds no such pool and never took the run (the
    caller keeps the lease); ``INVALID_INPUT``: the adapter refused the
    request (400); ``EXPIRED``: the input key expired before the run (503);
    ``ERROR``: the adapter failed on valid input (500, a bug).
    """

    NOT_LOADED = "not_loaded"
    INVALID_INPUT = "invalid_input"
    EXPIRED = "expired"
    ERROR = "error"


class Handover:
    """Who releases a request lease: the web process until the run task is on the
    worker's queue (``sent`` True), the worker after that (R8.2)."""

    def __init__(self) -> None:
        self.sent = False


@dataclass(frozen=True)
class RunInput:
    """What one run needs besides the model: decoded ``samples`` (float32 ``(n,)``) at
    ``sample_rate_hz`` and the request's validated ``options`` (merged with defaults on the worker)."""

    samples: np.ndarray
    sample_rate_hz: int
    options: dict


async def run_on_worker(ctx: AsyncContext, model_id: str, lease_id: str, placement: Placement,
                        run_input: RunInput, handover: Handover) -> dict | None:
    """Hand one run to the owning worker and await its reply; None when the worker died meanwhile.

    One round trip hands it over: the samples go to ``Keys.input`` (a view of
    the decoded array, no copy; TTL ``INPUT_TTL_MS``) and a JSON header
    ``{"model_id", "request_id", "lease_id", "boot", "channel",
    "sample_rate_hz", "options"}`` is pushed on the worker's run queue
    (``Keys.run_queue(owner, boot)``), which its run dispatcher pops
    (``inference.worker.runs``). No Celery message per run: that hop cost
    about 5 ms of the 20 ms overhead of a short request (docs/benchmarks.md).

    Args:
        handover: set to sent once the header is on the worker's queue (the
            worker then releases the lease).

    Returns:
        The worker's reply (see ``inference.worker.work.run_request``), or None.
    """
    request_id = uuid.uuid4().hex
    header = json.dumps({"model_id": model_id, "request_id": request_id, "lease_id": lease_id,
                         "boot": placement.boot, "channel": ctx.listener.channel,
                         "sample_rate_hz": run_input.sample_rate_hz, "options": run_input.options})
    queue_key = KEYS.run_queue(placement.owner, placement.boot)
    wake = ctx.listener.expect(f"done:{request_id}")

    async def push() -> None:
        async with ctx.redis_bytes.pipeline(transaction=False) as pipe:
            pipe.set(KEYS.input(request_id), audio.to_bytes(run_input.samples), px=INPUT_TTL_MS)
            pipe.lpush(queue_key, header)
            pipe.pexpire(queue_key, INPUT_TTL_MS)  # a dead worker's queue goes away on its own
            await pipe.execute()

    try:
        send = asyncio.ensure_future(push())
        try:
            await asyncio.shield(send)
        except asyncio.CancelledError:
            # The client left while the run was being handed over: the push goes on;
            # once it is on the queue the worker owns the lease.
            try:
                await send
                handover.sent = True
            except Exception:
                pass
            raise
        handover.sent = True
        if not await await_reply(ctx, wake, KEYS.result(request_id),
                                 lambda: worker_alive(ctx, placement.owner, placement.boot)):
            await ctx.redis.delete(KEYS.input(request_id))
            return None
        return json.loads(await ctx.redis.getdel(KEYS.result(request_id)))
    finally:
        ctx.listener.forget(f"done:{request_id}")


STOP_TTL_MS = 600000  # a stop request outlives any sentence


class WorkerStream:
    """The frames of one streamed speech run on a worker (``inference.worker.work.stream_speech``).

    The caller keeps (and renews) the run's lease: a stream's slot is held
    until its last byte is written or its client leaves (R8.3). Frames arrive
    on ``Keys.chunks(request_id)``; every push also publishes
    ``chunk:<request_id>`` on this process's channel, so waiting costs no
    polling; a watchdog tick checks that the worker still lives (R7.4).

    Attributes:
        final: the end frame's JSON once read (None before).
    """

    def __init__(self, ctx: AsyncContext, model_id: str, placement: Placement):
        self.ctx = ctx
        self.model_id = model_id
        self.placement = placement
        self.request_id = uuid.uuid4().hex
        self.final: dict | None = None
        self._key = KEYS.chunks(self.request_id)
        self._wake_key = f"chunk:{self.request_id}"

    async def start(self, lease_id: str, text: str, options: dict) -> None:
        """Push the run header ``{"stream": true, "model_id", "request_id", "lease_id", "boot",
        "channel", "text", "options"}`` on the owning worker's run queue (one round trip)."""
        header = json.dumps({"stream": True, "model_id": self.model_id, "request_id": self.request_id,
                             "lease_id": lease_id, "boot": self.placement.boot,
                             "channel": self.ctx.listener.channel, "text": text, "options": options})
        queue_key = KEYS.run_queue(self.placement.owner, self.placement.boot)
        async with self.ctx.redis_bytes.pipeline(transaction=False) as pipe:
            pipe.lpush(queue_key, header)
            pipe.pexpire(queue_key, INPUT_TTL_MS)
            await pipe.execute()

    async def frames(self) -> list[bytes]:
        """The PCM frames available now, waiting for at least one; empty once the end frame was read.

        Each returned item is s16le mono PCM (the ``a`` type byte removed). The
        end frame sets :attr:`final` and ends the stream.

        Raises:
            ServerBusy: (code ``worker_lost``) the worker stopped beating before the end frame.
        """
        while self.final is None:
            wake = self.ctx.listener.expect(self._wake_key)
            try:
                items = await self.ctx.redis_bytes.lpop(self._key, 64)
                if items:
                    audio_frames = []
                    for item in items:
                        if item[:1] == b"e":
                            self.final = json.loads(item[1:])
                            break
                        audio_frames.append(item[1:])
                    return audio_frames
                done, _ = await asyncio.wait({wake}, timeout=WATCHDOG_S)
                if not done and not await worker_alive(self.ctx, self.placement.owner, self.placement.boot):
                    raise ServerBusy(f"model {self.model_id!r}: its worker stopped responding mid-stream",
                                     code="worker_lost")
            finally:
                self.ctx.listener.forget(self._wake_key)
        return []

    async def stop(self, wait_s: float) -> bool:
        """Ask the worker to stop after its current sentence and wait (up to ``wait_s``) for its end frame.

        Returns:
            True when the end frame arrived (the worker's slot is free again).
        """
        if self.final is not None:
            return True
        await self.ctx.redis.set(KEYS.stop(self.request_id), "1", px=STOP_TTL_MS)
        deadline = time.monotonic() + wait_s
        try:
            while self.final is None and time.monotonic() < deadline:
                await asyncio.wait_for(self.frames(), timeout=max(0.01, deadline - time.monotonic()))
        except (TimeoutError, ServerBusy):
            return False
        return True

    async def discard(self) -> None:
        """Delete what is left of the stream in Redis (frames, stop flag)."""
        await self.ctx.redis.delete(self._key, KEYS.stop(self.request_id))
