"""The worker's run queue: runs arrive as JSON headers on a Redis list, not as Celery messages.

Web processes push one header per run on ``Keys.run_queue(hostname, boot)``
(``inference.runtime.runs.run_on_worker``, or ``enqueue.lua`` with the grant);
the worker's run threads pop them in FIFO order (``BRPOP``) and serve them
(``work.run_request``, ``work.reply``), one thread popping at a time
(leader/follower): the thread that popped a header first starts another run
thread popping, then serves its header itself, so a run is served by the
thread that received it, with no hand-off between threads on its path.
Admission (Redis) has already bounded how many runs of a model are in
flight, so the pool only needs as many threads as the worker has slots,
plus the one popping.

Why not Celery: a Celery message per run cost about 2 ms to send (kombu in a
thread of the web process) and 2.5 ms to receive (the consumer loop, ack) —
a quarter of a short request's overhead (``docs/benchmarks.md``). Loads and
unloads stay Celery tasks: they are rare and benefit from Celery's routing.

Stopping (warm shutdown, ``stop``): the dispatcher stops popping, runs in
progress finish, and headers still queued are answered ``not_loaded`` (the
worker never took them; their senders still hold the leases and load the
model again elsewhere). A worker killed outright leaves its queue behind:
senders notice the missing liveness key within the TTL (``worker_lost``,
R7.4) and the list expires on its own.
"""
from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis

from inference.runtime.context import KEYS, redis_url, sync_redis_bytes, sync_scheduler
from inference.runtime.runs import INPUT_TTL_MS, RunFailure, split_element

from . import work
from .state import WorkerState

log = logging.getLogger(__name__)

RUN_THREADS_MIN = 256
"""Upper bound of the run thread pool at least (threads are created only when runs wait for one)."""

POP_TIMEOUT_S = 2.0
"""How long one ``BRPOP`` blocks, in seconds. It returns at once when a run comes or when ``stop``
pushes on the wake list, so this bounds only how often an idle worker asks again (each ask wakes
the thread and Redis for nothing) and how late a reader stops if that push failed. The reader's
client waits ``POP_SOCKET_TIMEOUT_S`` for an answer: redis-py's default socket timeout (5 s in
redis-py 8) would cut a longer ``BRPOP`` as a failure."""

POP_SOCKET_TIMEOUT_S = POP_TIMEOUT_S + 5.0
"""Socket timeout of the reader's client (s): longer than any ``BRPOP`` it sends, still finite so a
dead connection is noticed."""

POP_RETRY_S = 0.5
"""After a failed ``BRPOP`` (Redis unreachable), how long the reader waits before it asks again."""

WAKE_TTL_MS = 10_000
"""Expiry of the wake list's element (``Keys.run_queue_wake``), should nobody pop it."""


class RunDispatcher:
    """Pops this worker's run headers and serves them on ``threads`` run threads.

    Args:
        worker: the worker's pools and identity (``hostname`` and ``boot`` must be set).
        threads: run threads (at least the worker's total slot count; ``serve``
            passes the Celery concurrency).
    """

    def __init__(self, worker: WorkerState, threads: int):
        self.worker = worker
        self.queue_key = KEYS.run_queue(worker.hostname or "", worker.boot)
        self.wake_key = KEYS.run_queue_wake(worker.hostname or "", worker.boot)
        # Threads start on demand; admission (Redis) bounds how many runs are in flight, and models
        # registered later through the API may add slots beyond ``threads``: leave room for them.
        self._pool = ThreadPoolExecutor(max_workers=max(threads, RUN_THREADS_MIN) + 1, thread_name_prefix="run")
        self._stop = threading.Event()
        # The popping thread's BRPOP holds one connection of this client's pool while it blocks.
        self._client: Any = redis.Redis.from_url(redis_url(), decode_responses=False,
                                                 socket_timeout=POP_SOCKET_TIMEOUT_S)

    def start(self) -> None:
        """Start popping runs."""
        self._pool.submit(self._lead)

    def _lead(self) -> None:
        """Pop the next element (the only thread popping now); once one came, start the next popping
        thread and serve the run in this one."""
        while not self._stop.is_set():
            try:
                popped = self._client.brpop([self.queue_key, self.wake_key], timeout=POP_TIMEOUT_S)
            except redis.RedisError:
                log.exception("reading the run queue failed; retrying")
                self._stop.wait(POP_RETRY_S)
                continue
            if popped is None or popped[0] == self.wake_key.encode():
                continue  # (woken by stop: the loop's test ends it)
            try:
                self._pool.submit(self._lead)
            except RuntimeError:  # stop() shut the pool down meanwhile: nobody pops any more
                pass
            self._serve(popped[1])
            return

    def _serve(self, raw: bytes) -> None:
        try:
            header, inline = split_element(raw)
            serve_run(self.worker, header, inline)
        except Exception:  # never lose the thread; the sender's watchdog covers a missing reply
            log.exception("serving a run failed")

    def drain(self) -> int:
        """Answer every header still on this worker's queue ``not_loaded`` (after :meth:`stop`; again once
        the liveness key is gone, for senders that pushed in between). Returns how many."""
        refused = 0
        client: Any = redis.Redis.from_url(redis_url(), decode_responses=False)
        try:
            while (raw := client.rpop(self.queue_key)) is not None:
                refuse(*split_element(raw))
                refused += 1
        finally:
            client.close()
        return refused

    def stop_popping(self) -> None:
        """Take no more runs: the popping thread returns at once (its blocked ``BRPOP`` is woken through
        ``wake_key``); runs in progress go on. Safe from any thread, and more than once."""
        self._stop.set()
        try:
            with self._client.pipeline(transaction=False) as pipe:
                pipe.lpush(self.wake_key, b"stop").pexpire(self.wake_key, WAKE_TTL_MS).execute()
        except redis.RedisError:
            log.warning("could not wake the run queue's reader; it stops within %s s", POP_TIMEOUT_S)

    def stop(self) -> int:
        """Stop taking runs, let running ones finish, answer the still-queued ones ``not_loaded``.

        Returns:
            How many queued runs were answered ``not_loaded``.
        """
        self.stop_popping()
        self._pool.shutdown(wait=True)  # the popping thread stops; running runs finish
        self._client.close()
        return self.drain()


def not_loaded(model_id: str) -> dict:
    """The reply to a run this worker never took: its sender keeps the lease and loads again."""
    return {"ok": False, "kind": RunFailure.NOT_LOADED, "message": f"model {model_id!r} is not loaded on this worker"}


def refuse(header: dict, inline: memoryview | None = None) -> None:
    """Answer a run this worker never took ``not_loaded``: by reply key, or by end frame for a stream.

    Samples that came ``inline`` (inside the queue element) are first left in ``Keys.input(request_id)``
    (TTL ``INPUT_TTL_MS``), where the sender's next dispatch expects them (``inference.runtime.runs.stage_run``).
    """
    if inline is not None:
        sync_redis_bytes().set(KEYS.input(header["request_id"]), inline, px=INPUT_TTL_MS)
    if header.get("stream"):
        work.push_frame(header["channel"], header["request_id"], work.end_frame(not_loaded(header["model_id"])))
    else:
        work.reply(header["channel"], KEYS.result(header["request_id"]), f"done:{header['request_id']}",
                   not_loaded(header["model_id"]), inline=True)


def serve_run(worker: WorkerState, header: dict, inline: memoryview | None = None) -> None:
    """Serve the run described by ``header`` (see ``inference.runtime.runs.run_on_worker``) and reply.

    Reply in ``Keys.result(request_id)``, wake-up ``done:<request_id>`` on the
    sender's channel: ``work.run_request``'s payload, or ``not_loaded`` when
    this worker holds no pool of the model (the sender keeps the lease). A
    speech stream (``header["stream"]``, from ``inference.runtime.streams.WorkerStream``)
    answers with frames instead (``work.stream_speech``), and so does a streamed transcription
    (``header["stream"] == "transcription"``, ``work.stream_transcription``). A ``held`` run is one
    decode of a live transcription turn whose lease the sender keeps (``work.run_request``).
    """
    model_id, request_id = header["model_id"], header["request_id"]
    pool = worker.get(model_id)
    # A run handed over with its grant (enqueue.lua) names no boot: its queue's key names this one.
    if pool is None or header.get("boot", worker.boot) != worker.boot:
        refuse(header, inline)
        return
    if header.get("stream") == "transcription":
        work.stream_transcription(worker, pool, header)
        return
    if header.get("stream"):
        work.stream_speech(worker, pool, header)
        return
    lease_id, held = header["lease_id"], bool(header.get("held"))
    replied = False
    try:
        payload = work.run_request(worker, pool, model_id, lease_id, header, held=held, inline=inline)
        # A held run's lease stays with its sender (a live turn spans several runs).
        work.reply(header["channel"], KEYS.result(request_id), f"done:{request_id}", payload,
                   release=None if held else (model_id, lease_id), inline=True)
        replied = True
    finally:
        if not replied and not held:  # the lease goes back on every path (R2.5 would reclaim it only after the TTL)
            sync_scheduler().release(model_id, lease_id)
    work.record_inference(model_id, payload)
