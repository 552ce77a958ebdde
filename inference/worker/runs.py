"""The worker's run queue: runs arrive as JSON headers on a Redis list, not as Celery messages.

Web processes push one header per run on ``Keys.run_queue(hostname, boot)``
(``inference.runtime.runs.run_on_worker``, or ``enqueue.lua`` with the grant);
the worker's run threads pop them in FIFO order and serve them
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

The pop is reliable (``RunDispatcher``): each element is moved, in the same Redis step, onto the
worker's ``Keys.run_taken`` list and stays there until its run ends, so an element whose pop's
connection broke is found there by the popping thread's next sweep and served then, not lost.
"""
from __future__ import annotations

import logging
import threading
import time
from collections import Counter
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import redis

from audiosite.redis_sockets import redis_socket_kwargs
from inference.runtime.context import KEYS, redis_url, sync_redis_bytes, sync_scheduler
from inference.runtime.runs import INPUT_TTL_MS, RunFailure, split_element

from . import work
from .state import WorkerState

log = logging.getLogger(__name__)

RUN_THREADS_MIN = 256
"""Upper bound of the run thread pool at least (threads are created only when runs wait for one)."""

POP_TIMEOUT_S = 2.0
"""How long one ``BLMOVE`` blocks, in seconds. It returns at once when a run comes or when ``stop``
pushes its wake element, so this bounds only how often an idle worker asks again (each ask wakes
the thread and Redis for nothing) and how late a reader stops if that push failed. The reader's
client waits ``POP_SOCKET_TIMEOUT_S`` for an answer: redis-py's default socket timeout (5 s in
redis-py 8) would cut a longer ``BLMOVE`` as a failure."""

POP_SOCKET_TIMEOUT_S = POP_TIMEOUT_S + 5.0
"""Socket timeout of the reader's client (s): longer than any ``BLMOVE`` it sends, still finite so a
dead connection is noticed."""

POP_RETRY_S = 0.5
"""After a failed ``BLMOVE`` (Redis unreachable, connection broken), how long the reader waits before
it sweeps ``Keys.run_taken`` and asks again."""

SWEEP_EVERY_S = POP_TIMEOUT_S
"""How often (s) the popping thread checks ``Keys.run_taken`` for elements no run thread serves: at
most this plus one ``POP_TIMEOUT_S`` after an element was stranded, well inside the liveness TTL
(``LIVENESS_TTL_MS``, 10 s) after which a sender would give up on a silent worker anyway."""

WAKE_ELEMENT = b"wake"
"""What ``stop_popping`` pushes on the popping end of the run queue to end a blocked ``BLMOVE`` at once
(never a run: run elements are JSON objects). Whoever takes it drops it."""


class RunDispatcher:
    """Pops this worker's run elements and serves them on ``threads`` run threads.

    The pop is reliable: ``BLMOVE`` moves each element from ``Keys.run_queue`` onto ``Keys.run_taken``
    in one Redis step, the thread that serves it removes it there when the run ends (``LREM``), and the
    popping thread sweeps that list every ``SWEEP_EVERY_S`` (and after any failed pop): an element
    there that no thread of this process holds was moved by a pop whose reply never arrived (its
    connection broke), so it is served now. Elements are told apart by their bytes (each holds its
    own request id).

    Args:
        worker: the worker's pools and identity (``hostname`` and ``boot`` must be set).
        threads: run threads (at least the worker's total slot count; ``serve``
            passes the Celery concurrency).
    """

    def __init__(self, worker: WorkerState, threads: int):
        self.worker = worker
        self.queue_key = KEYS.run_queue(worker.hostname or "", worker.boot)
        self.taken_key = KEYS.run_taken(worker.hostname or "", worker.boot)
        # Threads start on demand; admission (Redis) bounds how many runs are in flight, and models
        # registered later through the API may add slots beyond ``threads``: leave room for them.
        self._pool = ThreadPoolExecutor(max_workers=max(threads, RUN_THREADS_MIN) + 1, thread_name_prefix="run")
        self._stop = threading.Event()
        # The popping thread's BLMOVE holds one connection of this client's pool while it blocks.
        self._client: Any = redis.Redis.from_url(redis_url(), decode_responses=False,
                                                 socket_timeout=POP_SOCKET_TIMEOUT_S,
                                                 **redis_socket_kwargs(redis_url()))
        # Elements of ``taken_key`` a thread of this process holds (serving, or served and not yet removed).
        self._held: Counter[bytes] = Counter()
        self._unremoved: list[bytes] = []  # served, but their LREM failed: the next sweep removes them
        self._lock = threading.Lock()
        self._swept_at = 0.0
        self._sweep_all = True

    def start(self) -> None:
        """Start popping runs."""
        self._pool.submit(self._lead)

    def _lead(self) -> None:
        """Pop the next element (the only thread popping now); once one came, start the next popping
        thread and serve the run in this one. Between pops, sweep ``taken_key`` when due."""
        while not self._stop.is_set():
            if self._sweep_all or time.monotonic() - self._swept_at >= SWEEP_EVERY_S:
                try:
                    self._sweep()
                except redis.RedisError:
                    log.exception("sweeping the taken runs failed; retrying")
                    self._stop.wait(POP_RETRY_S)
                    continue
            try:
                with self._client.pipeline(transaction=False) as pipe:
                    # Redis runs the PEXPIRE once the BLMOVE returns: a list it created gets its TTL at once.
                    pipe.blmove(self.queue_key, self.taken_key, POP_TIMEOUT_S, "RIGHT", "LEFT")
                    pipe.pexpire(self.taken_key, INPUT_TTL_MS)
                    raw, _ = pipe.execute()
            except redis.RedisError:
                log.exception("reading the run queue failed; retrying")
                self._sweep_all = True  # the element of a pop whose reply was lost waits in taken_key
                self._stop.wait(POP_RETRY_S)
                continue
            if raw is None:
                continue
            if raw == WAKE_ELEMENT:  # woken by stop: the loop's test ends it
                self._drop_wake()
                continue
            self._hold(raw)
            try:
                self._pool.submit(self._lead)
            except RuntimeError:  # stop() shut the pool down meanwhile: nobody pops any more
                pass
            self._serve(raw)
            return

    def _hold(self, raw: bytes) -> None:
        with self._lock:
            self._held[raw] += 1

    def _drop_wake(self) -> None:
        try:
            self._client.lrem(self.taken_key, 1, WAKE_ELEMENT)
        except redis.RedisError:  # the next sweep drops it
            self._sweep_all = True

    def _sweep(self) -> None:
        """Remove what finished runs left in ``taken_key`` and serve (in pool threads) the elements there
        that no thread of this process holds. Only the popping thread sweeps, and only it adds to
        ``_held``; a run's end removes its element before it leaves ``_held``: so an element read from
        the list and missing from the snapshot taken before the read is held by nobody.

        Raises:
            redis.RedisError: Redis unreachable (the caller retries).
        """
        with self._lock:
            unremoved, self._unremoved = self._unremoved, []
        for done, raw in enumerate(unremoved):
            try:
                self._client.lrem(self.taken_key, 1, raw)
            except redis.RedisError:
                with self._lock:
                    self._unremoved.extend(unremoved[done:])
                raise
            self._forget(raw)
        with self._lock:
            held = Counter(self._held)
        if not self._sweep_all:
            with self._client.pipeline(transaction=False) as pipe:
                count, _ = pipe.llen(self.taken_key).pexpire(self.taken_key, INPUT_TTL_MS).execute()
            if count <= held.total():
                self._swept_at = time.monotonic()
                return
        stranded = Counter(self._client.lrange(self.taken_key, 0, -1)) - held
        self._sweep_all = False
        self._swept_at = time.monotonic()
        for raw in stranded.elements():
            if raw == WAKE_ELEMENT:
                self._drop_wake()
                continue
            log.warning("a run taken from the queue was served by no thread (its pop's connection broke?); "
                        "serving it now")
            self._hold(raw)
            try:
                self._pool.submit(self._serve, raw)
            except RuntimeError:  # stopping: drain() answers it not_loaded
                self._release(raw, served=False)

    def _serve(self, raw: bytes) -> None:
        try:
            header, inline = split_element(raw)
            serve_run(self.worker, header, inline)
        except Exception:  # never lose the thread; the sender's watchdog covers a missing reply
            log.exception("serving a run failed")
        finally:
            self._release(raw, served=True)

    def _release(self, raw: bytes, served: bool) -> None:
        """The run of ``raw`` ended (``served``) or was never started: remove its element from
        ``taken_key`` (a served one whose removal fails is removed by the next sweep, never run again),
        then forget it."""
        if served:
            try:
                self._client.lrem(self.taken_key, 1, raw)
            except redis.RedisError:
                log.warning("could not remove a finished run from %s; the next sweep does", self.taken_key)
                with self._lock:
                    self._unremoved.append(raw)
                return
        self._forget(raw)

    def _forget(self, raw: bytes) -> None:
        with self._lock:
            self._held[raw] -= 1
            if self._held[raw] <= 0:
                del self._held[raw]

    def drain(self) -> int:
        """Answer every run still on this worker's queue ``not_loaded`` (after :meth:`stop`; again once
        the liveness key is gone, for senders that pushed in between), and every element of
        ``taken_key`` no run served (a pop whose reply was lost). Returns how many."""
        refused = 0
        client: Any = redis.Redis.from_url(redis_url(), decode_responses=False)
        try:
            while (raw := client.rpop(self.queue_key)) is not None:
                if raw != WAKE_ELEMENT:
                    refuse(*split_element(raw))
                    refused += 1
            with self._lock:
                served = Counter(self._held)  # after stop(), only served runs whose removal failed
                self._held.clear()
                self._unremoved.clear()
            for raw in client.lrange(self.taken_key, 0, -1):
                if served[raw] > 0:
                    served[raw] -= 1
                elif raw != WAKE_ELEMENT:
                    refuse(*split_element(raw))
                    refused += 1
                client.lrem(self.taken_key, 1, raw)
        finally:
            client.close()
        return refused

    def stop_popping(self) -> None:
        """Take no more runs: the popping thread returns at once (its blocked ``BLMOVE`` takes the
        ``WAKE_ELEMENT`` pushed on the queue's popping end); runs in progress go on. Safe from any
        thread, and more than once."""
        self._stop.set()
        try:
            with self._client.pipeline(transaction=False) as pipe:
                pipe.rpush(self.queue_key, WAKE_ELEMENT).pexpire(self.queue_key, INPUT_TTL_MS).execute()
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

    A header with ``record`` (``inference.runtime.metrics.answer_record``: the run is its request's
    answer) gets a served reply marked ``"recorded": true``; once that reply is stored, this worker
    writes the request's metrics and activity row (``work.record_answer``) and its sender writes none.
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
    record = header.get("record")  # the sender left its answer's metrics to this worker (metrics.answer_record)
    replied = stored = False
    try:
        payload = work.run_request(worker, pool, model_id, lease_id, header, held=held, inline=inline)
        if record is not None and payload.get("ok"):
            payload["recorded"] = True  # so the sender records nothing of its own for this answer
        # A held run's lease stays with its sender (a live turn spans several runs).
        stored = work.reply(header["channel"], KEYS.result(request_id), f"done:{request_id}", payload,
                            release=None if held else (model_id, lease_id), inline=True)
        replied = True
    finally:
        if not replied and not held:  # the lease goes back on every path (R2.5 would reclaim it only after the TTL)
            sync_scheduler().release(model_id, lease_id)
    work.record_answer(model_id, payload, record if stored else None)
