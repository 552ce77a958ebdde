"""Deployment-wide counters and histograms of ``GET /metrics``, kept in Redis, and their exposition.

Why Redis and not ``prometheus_client``'s multiprocess mode: a deployment is
several web processes and Celery workers, possibly on several hosts
(``docker-compose.yml`` runs them in separate containers, and the workers
serve no HTTP at all). The multiprocess mode sums the processes of one host
that share one folder; a worker container would need its own scrape target
it does not have. Every process of a deployment already shares one Redis, so
each event is one ``HINCRBY`` (a histogram observation: three commands in one
``MULTI``), and any web process's ``/metrics`` shows the deployment's totals
(scrape one, or all and take ``max``; see docs/operations.md). Counters live
as long as the Redis data: they restart from zero with an embedded Redis
(a counter reset, which ``rate()`` handles).

Layout: one HASH per metric (``Keys.metric(name)``); a field is the JSON list
of label values, and for a histogram that plus ``\\tb<i>`` (observations in
bucket ``i`` only, not cumulative: ``i`` = the first bound ≥ the value,
``len(BUCKETS_S)`` for +Inf), ``\\tsum`` (seconds) and ``\\tcount``.

Recording never fails or delays a request: web processes write in a task of
their own (:func:`record_soon`), workers after the reply is sent; a Redis
error is logged and the event lost.
Gauges are not stored: the ``/metrics`` view reads them from one atomic
scheduler snapshot (``snapshot.lua``) when it is scraped.

Every registered model's series are exposed from the first scrape, at 0 for
the label values known in advance (:attr:`Stored.known`), so ``rate()`` and
``increase()`` see a model's first event; the series of a model that is no
longer registered are not exposed, and its fields are deleted when it is
unregistered (:func:`forget_model`).

Process CPU and memory: each web process and worker publishes its own
(``prometheus_client``'s ``ProcessCollector`` reads ``/proc/self``) in a key
with a TTL (:func:`process_publish`), so a dead process's series disappear
once its key expires; ``/metrics`` shows every live process of the
deployment (:func:`read_processes`).
"""
from __future__ import annotations

import asyncio
import bisect
import contextvars
import json
import logging
import os
import platform
import socket
import subprocess
import time
import weakref
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field as dataclass_field
from datetime import UTC, datetime
from pathlib import Path
from enum import StrEnum
from typing import Any

import redis
from prometheus_client import CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily, Metric

from .context import KEYS, async_context

log = logging.getLogger(__name__)

PREFIX = "audiosite_"

BUCKETS_S = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0, 600.0)
"""Upper bounds (seconds) of every histogram's buckets, +Inf added: from 5 ms (a VAD run, a warm queue
grant) to 10 minutes (a long transcription, a large model's first load), roughly ×2–2.5 per step —
Prometheus' default buckets stop at 10 s, too short for audio."""


class Kind(StrEnum):
    COUNTER = "counter"
    HISTOGRAM = "histogram"


def _model_only(model_id: str, task: str) -> list[tuple[str, ...]]:
    return [(model_id,)]


@dataclass(frozen=True)
class Stored:
    """One stored metric: ``name`` without the ``audiosite_`` prefix (and, for a counter, with its ``_total``).

    ``labels`` always start with ``model``. ``known(model_id, task)`` gives the label values a
    registered model's series are exposed with, at 0, before any event (:func:`exposition`)."""

    name: str
    kind: Kind
    labels: tuple[str, ...]
    help: str
    known: Callable[[str, str], list[tuple[str, ...]]] = dataclass_field(default=_model_only)


OUTCOMES = ("ok", "client_error", "rejected", "error")
"""The ``outcome`` values of ``audiosite_requests_total`` (``audiosite.http.apiview.request_outcome``)."""
REJECTION_CODES = ("queue_timeout", "overdue", "shutting_down", "worker_lost", "no_worker", "load_failed",
                   "residency_full", "decode_budget", "insufficient_memory")
"""The 503 codes a registered model's ``audiosite_rejections_total`` series start at 0 with (the codes of
``audiosite.errors.ServerBusy`` raised for requests; another code appears at its first event)."""

REQUESTS = Stored("requests_total", Kind.COUNTER, ("model", "outcome"),
                  "Inference requests answered, by outcome: ok (2xx), client_error (4xx), rejected (503), "
                  "error (other 5xx); a realtime transcription turn counts as one request. model is empty when "
                  "the request named no registered model.",
                  lambda model_id, task: [(model_id, outcome) for outcome in OUTCOMES])
REJECTIONS = Stored("rejections_total", Kind.COUNTER, ("model", "code"),
                    "Inference requests answered 503, by error code (queue_timeout, overdue, shutting_down, "
                    "worker_lost, no_worker, load_failed, residency_full, decode_budget, insufficient_memory, ...).",
                    lambda model_id, task: [(model_id, code) for code in REJECTION_CODES])
MODEL_LOADS = Stored("model_loads_total", Kind.COUNTER, ("model", "outcome"),
                     "Model loads finished by a worker, by outcome (ok, failed).",
                     lambda model_id, task: [(model_id, "ok"), (model_id, "failed")])
EVICTIONS = Stored("evictions_total", Kind.COUNTER, ("model",),
                   "Models unloaded to make room under max_loaded_models (by eviction_policy).")
AUDIO_SECONDS = Stored("audio_seconds_total", Kind.COUNTER, ("model", "task"),
                       "Seconds of audio processed: the decoded input of answered requests (asr, vad, embedding, "
                       "diarization, music) and of completed realtime turns; for tts the speech synthesised.",
                       lambda model_id, task: [(model_id, task)])
REALTIME_PARTIALS = Stored("realtime_partial_decodes_total", Kind.COUNTER, ("model",),
                           "Partial decodes of open realtime transcription turns (their deltas; not requests).",
                           lambda model_id, task: [(model_id,)] if task == "asr" else [])
QUEUE_WAIT = Stored("queue_wait_seconds", Kind.HISTOGRAM, ("model",),
                    "Time a granted inference request waited for its slot (enqueue to grant).")
INFERENCE = Stored("inference_seconds", Kind.HISTOGRAM, ("model",),
                   "Time a request spent in the model's session on the worker (a whole stream for speech).")
MODEL_LOAD = Stored("model_load_seconds", Kind.HISTOGRAM, ("model",),
                    "Time a worker spent loading a model (successful and failed loads).")

BATCH_CALLS = Stored("batch_calls_total", Kind.COUNTER, ("model", "size"),
                     "Session calls of a model that batches (max_batch > 1), by how many requests the call served "
                     "(size 1: a run no other joined within batch_window_ms).",
                     lambda model_id, task: [])

STORED = (REQUESTS, REJECTIONS, MODEL_LOADS, EVICTIONS, AUDIO_SECONDS, REALTIME_PARTIALS, QUEUE_WAIT, INFERENCE,
          MODEL_LOAD, BATCH_CALLS)


def _field(labels: Iterable[str]) -> str:
    return json.dumps(list(labels), separators=(",", ":"))


def bucket_index(seconds: float) -> int:
    """Index of the bucket an observation of ``seconds`` falls in (``len(BUCKETS_S)`` = +Inf only)."""
    return bisect.bisect_left(BUCKETS_S, seconds)


def _increments(events: Iterable[Event]) -> tuple[dict[tuple[str, str], int], dict[tuple[str, str], float]]:
    """``events`` summed per hash field: ``(integer increments, float increments)``, each keyed by
    ``(Redis key, field)``, so a batch of any size costs one command per distinct field."""
    ints: dict[tuple[str, str], int] = {}
    floats: dict[tuple[str, str], float] = {}
    for metric, labels, value in events:
        assert len(labels) == len(metric.labels), (metric.name, labels)
        key, field = KEYS.metric(metric.name), _field(labels)
        if metric.kind is Kind.COUNTER:
            if value is None:
                ints[key, field] = ints.get((key, field), 0) + 1
            else:  # an amount (audio seconds): always HINCRBYFLOAT on that field
                floats[key, field] = floats.get((key, field), 0.0) + max(0.0, float(value))
            continue
        assert value is not None
        seconds = max(0.0, float(value))
        for name in (f"{field}\tb{bucket_index(seconds)}", f"{field}\tcount"):
            ints[key, name] = ints.get((key, name), 0) + 1
        floats[key, f"{field}\tsum"] = floats.get((key, f"{field}\tsum"), 0.0) + seconds
    return ints, floats


def _queue(pipe: Any, events: Iterable[Event]) -> None:
    events = list(events)
    ints, floats = _increments(events)
    for (key, field), amount in ints.items():
        pipe.hincrby(key, field, amount)
    for (key, field), seconds in floats.items():
        pipe.hincrbyfloat(key, field, seconds)
    _queue_minute(pipe, events)


# -- the last hour, minute by minute (the model page's chart) -------------------------------------
MINUTE_METRICS = ("queue_wait_seconds", "inference_seconds")
"""The histograms also kept per minute for an hour: queue wait and time in the model."""
MINUTES_KEPT = 61
"""Minutes a per-minute hash lives (its EXPIRE), so the last hour is always complete."""


def _queue_minute(pipe: Any, events: list[Event]) -> None:
    """The same observations of :data:`MINUTE_METRICS` into this minute's hash (``Keys.metric_minute``):
    fields ``<metric>\t<model>\tb<i>`` / ``\tsum`` / ``\tcount`` as the all-time hashes, expiring after
    :data:`MINUTES_KEPT` minutes. A few commands in the same ``MULTI``; nothing when there is no such event."""
    timed = [(metric, labels, value) for metric, labels, value in events
             if metric.kind is Kind.HISTOGRAM and metric.name in MINUTE_METRICS and value is not None]
    if not timed:
        return
    key = KEYS.metric_minute(int(time.time() // 60))
    for metric, labels, value in timed:
        seconds = max(0.0, float(value))
        head = f"{metric.name}\t{labels[0]}"
        pipe.hincrby(key, f"{head}\tb{bucket_index(seconds)}", 1)
        pipe.hincrby(key, f"{head}\tcount", 1)
        pipe.hincrbyfloat(key, f"{head}\tsum", seconds)
    pipe.expire(key, MINUTES_KEPT * 60)


def _minute_summary(fields: dict[str, str], name: str, model_id: str) -> dict | None:
    head = f"{name}\t{model_id}\t"
    count = int(fields.get(head + "count", 0) or 0)
    if not count:
        return None
    buckets = [int(fields.get(f"{head}b{i}", 0) or 0) for i in range(len(BUCKETS_S) + 1)]
    seen, p95_s = 0, None
    for i, n in enumerate(buckets):
        seen += n
        if seen >= 0.95 * count:
            p95_s = BUCKETS_S[i] if i < len(BUCKETS_S) else None
            break
    return {"count": count, "mean_ms": round(float(fields[head + "sum"]) / count * 1000, 3),
            "p95_le_ms": None if p95_s is None else p95_s * 1000}


async def minutes_recent(redis_client: Any, model_id: str, minutes: int = 60) -> list[dict]:
    """Queue wait and run time of ``model_id`` minute by minute over the last ``minutes`` (oldest first):
    ``{"minute": ISO 8601 UTC start, "queue": summary | None, "run": summary | None}``, a summary being
    ``{"count", "mean_ms", "p95_le_ms"}`` (``p95_le_ms``: the upper bound of the bucket holding the 95th
    percentile, None beyond the last bound). One round trip."""
    now = int(time.time() // 60)
    span = range(now - minutes + 1, now + 1)
    async with redis_client.pipeline(transaction=False) as pipe:
        for minute in span:
            pipe.hgetall(KEYS.metric_minute(minute))
        rows = await pipe.execute()
    out = []
    for minute, fields in zip(span, rows, strict=True):
        fields = {(k.decode() if isinstance(k, bytes) else k): v for k, v in (fields or {}).items()}
        out.append({"minute": datetime.fromtimestamp(minute * 60, UTC).isoformat().replace("+00:00", "Z"),
                    "queue": _minute_summary(fields, "queue_wait_seconds", model_id),
                    "run": _minute_summary(fields, "inference_seconds", model_id)})
    return out


Event = tuple[Stored, tuple[str, ...], float | None]
"""One event: ``(metric, label values, value)``: seconds for a histogram; for a counter None (add 1) or the
amount to add (:func:`audio`)."""


def count(metric: Stored, *labels: str) -> Event:
    """A counter increment by 1, to pass to :func:`record` / :func:`record_sync`."""
    return metric, tuple(labels), None


def audio(model_id: str, task: str, seconds: float) -> Event:
    """``seconds`` of audio processed by ``model_id`` (of ``task``) added to ``audiosite_audio_seconds_total``."""
    return AUDIO_SECONDS, (model_id, task), seconds


def realtime_turn(model_id: str, status: int, code: str | None = None, seconds: float = 0.0) -> tuple[Event, ...]:
    """The events of a realtime transcription turn that ended, counted as one request of ``model_id``:
    ``requests_total`` with the outcome of HTTP ``status`` (200 for a ``completed`` turn, the error's
    status for a ``failed`` one, as ``audiosite.http.apiview.request_outcome``), ``rejections_total`` with
    ``code`` for a 503, and ``seconds`` of audio (the turn's, when it was transcribed). ``model_id`` is ""
    when the turn named no registered model."""
    outcome = "ok" if status < 400 else "client_error" if status < 500 else "rejected" if status == 503 else "error"
    events = [count(REQUESTS, model_id, outcome)]
    if status == 503:
        events.append(count(REJECTIONS, model_id, code or "unknown"))
    if seconds > 0:
        events.append(audio(model_id, "asr", seconds))
    return tuple(events)


def realtime_partial(model_id: str) -> Event:
    """One partial decode of an open realtime turn of ``model_id`` (``audiosite_realtime_partial_decodes_total``)."""
    return count(REALTIME_PARTIALS, model_id)


def observe(metric: Stored, seconds: float, *labels: str) -> Event:
    """A histogram observation of ``seconds`` (negative values count as 0)."""
    return metric, tuple(labels), seconds


async def record(redis_client: Any, *events: Event) -> None:
    """Store ``events`` in one ``MULTI`` (one round trip) on an asyncio client; errors are logged, not raised."""
    if not events:
        return
    try:
        async with redis_client.pipeline(transaction=True) as pipe:
            _queue(pipe, events)
            await pipe.execute()
    except redis.RedisError as exc:
        log.warning("metrics: %d event(s) lost: %s", len(events), exc)


#: How long a web process keeps counter and histogram events before it writes them, in one
#: ``MULTI``, to the deployment's Redis hashes. Writing each answer's events on its own cost a
#: Redis round trip per request on the event loop (the 503 fail-fast ratio of ``bench_latency``
#: went from 1.45 to 1.6, docs/benchmarks.md); a scrape now lags by at most this much.
FLUSH_INTERVAL_S = 0.1


class _Batch:
    """Events waiting on one event loop for their write (see :func:`record_soon`): ``task`` sleeps
    ``FLUSH_INTERVAL_S`` and then writes; ``lock`` is held by the write in flight, so writes run one
    at a time and in the order they asked for it (``asyncio.Lock`` wakes its waiters first come,
    first served), and acquiring it is how :func:`flush` waits for a write in flight. A waiter for
    the lock always yields to the event loop until the holder releases it, so nothing here waits
    in a loop that may not yield (awaiting a finished task returns without yielding: a ``while``
    loop over one spins the web process's event loop at 100 % CPU for good)."""

    def __init__(self) -> None:
        self.events: list[Event] = []
        self.activity: list[dict] = []
        self.task: asyncio.Task | None = None
        self.early: asyncio.Task | None = None  # the sooner write of activity rows (activity_soon)
        self.written_at = float("-inf")  # loop time the last write that had something to write began
        self.lock = asyncio.Lock()


_BATCHES: weakref.WeakKeyDictionary[asyncio.AbstractEventLoop, _Batch] = weakref.WeakKeyDictionary()


def record_soon(*events: Event) -> None:
    """Queue ``events`` on this event loop's batch; they are written together, at most
    ``FLUSH_INTERVAL_S`` later, by :func:`record` in a task of their own, so that a request's answer
    never waits for its metrics (call it on the web process's event loop).

    A scrape sees an answer's events within ``FLUSH_INTERVAL_S`` plus one round trip (tests poll);
    :func:`flush` writes what is queued at once and waits for a write in flight (the drain calls it
    before the process stops).
    """
    if not events:
        return
    batch = _batch()
    batch.events.extend(events)
    if batch.task is None and batch.early is None:  # an early write pending carries them sooner
        batch.task = asyncio.get_running_loop().create_task(_flush_later(batch))


def _batch() -> _Batch:
    """This event loop's batch."""
    loop = asyncio.get_running_loop()
    batch = _BATCHES.get(loop)
    if batch is None:
        batch = _BATCHES[loop] = _Batch()
    return batch


async def _flush_later(batch: _Batch) -> None:
    try:
        await asyncio.sleep(FLUSH_INTERVAL_S)
    except asyncio.CancelledError:
        return  # flush() took over: it writes the events itself
    if batch.task is asyncio.current_task():
        batch.task = None
    await _write(batch)


WRITE_TIMEOUT_S = 5.0
"""A batch write that has not ended this long after it began is given up (its events are lost, logged):
the web process's connections to Redis have no socket timeout, so without it a Redis that stops answering
would hold every later write, and ``flush()`` at the drain, for good, while the events piled up."""


async def _write(batch: _Batch) -> None:
    """Write the batch's queued events, after any write already in flight (one at a time, in order).

    The events are taken once the lock is held, so a write carries everything queued up to its turn
    and a write whose turn finds nothing queued costs nothing. A write is bounded by ``WRITE_TIMEOUT_S``."""
    async with batch.lock:
        events, batch.events = batch.events, []
        answered, batch.activity = batch.activity, []
        if events or answered:
            batch.written_at = asyncio.get_running_loop().time()
            try:
                async with asyncio.timeout(WRITE_TIMEOUT_S):
                    await _record_events(events, answered)
            except TimeoutError:
                log.warning("metrics: %d event(s) lost: the write took over %g s", len(events), WRITE_TIMEOUT_S)


async def _record_events(events: list[Event], answered: list[dict]) -> None:
    ctx = await async_context()
    if not answered:
        await record(ctx.redis, *events)
        return
    try:
        async with ctx.redis.pipeline(transaction=True) as pipe:
            _queue(pipe, events)
            _queue_activity(pipe, answered)
            await pipe.execute()
    except redis.RedisError as exc:
        log.warning("metrics: %d event(s) and %d activity row(s) lost: %s", len(events), len(answered), exc)


async def flush() -> None:
    """Write the events :func:`record_soon` queued on this event loop now, and return once every
    write of this loop's batch, in flight or new, has ended (no-op when there is none)."""
    batch = _BATCHES.get(asyncio.get_running_loop())
    if batch is None:
        return
    # The timer is cancelled, not awaited: one created but not yet started ends at its first step
    # with CancelledError (its coroutine never runs), which awaiting it would raise here.
    task, batch.task = batch.task, None
    if task is not None:
        task.cancel()
    await _write(batch)  # first come, first served: every write that asked before has ended first


# -- the activity view's rows: the last answered requests ------------------------------------------
ACTIVITY_KEEP = 200
"""How many answered requests the activity list keeps (``Keys.activity``); older ones are trimmed in the
same write. A row is about 250 bytes of JSON, so the list stays under ~50 kB."""
ACTIVITY_FLUSH_S = 0.03
"""How long an activity row waits for its write (seconds): shorter than ``FLUSH_INTERVAL_S`` so that the
activity view shows an answer within the issue's 200 ms; it writes the metric events queued so far with it.
Under traffic that is at most one more write per 30 ms per web process (the batches still sum)."""


ACTIVITY_SOON_S = 0.001
"""How long an activity row waits for its write when no write began in the last ``ACTIVITY_FLUSH_S``
(seconds): the answer's bytes leave first (the reactor writes them on its next turn), and the web
process, still awake from the answer, sends the write without waking from a 30 ms sleep for it (each
such wake-up costs CPU on a slow-waking machine, docs/benchmarks.md "Waking up costs")."""


@dataclass
class RequestTiming:
    """The parts of one request's time the activity row shows, noted as the request goes (ms; None when
    the request never got that far): ``queue_ms`` enqueue → grant of its slot, ``run_ms`` time in the
    model's session on the worker.

    ``row``: what the API view knows of the request for its activity row (``route``, ``client``,
    ``user``, ``started_unix_ms``: wall clock at its start), for :func:`answer_record`.
    ``recorded``: the worker that served the request recorded its answer (:func:`answer_events`):
    the view records no request, audio, queue-wait event nor row of its own for a 2xx answer."""

    queue_ms: float | None = None
    run_ms: float | None = None
    row: dict | None = None
    recorded: bool = False


_TIMING: contextvars.ContextVar[RequestTiming | None] = contextvars.ContextVar("audiosite_request_timing",
                                                                              default=None)


def timing_begin() -> RequestTiming:
    """Start noting the current request's timing (the API view, before its handler runs): tasks the
    handler starts share the returned object, so what they note is seen here."""
    timing = RequestTiming()
    _TIMING.set(timing)
    return timing


def timing_current() -> RequestTiming | None:
    """The current request's timing (:func:`timing_begin`), or None outside a request that began one."""
    return _TIMING.get()


def timing_note(*, queue_ms: float | None = None, run_ms: float | None = None, recorded: bool = False) -> None:
    """Note a part of the current request's timing (no-op outside a request that began one); ``recorded``:
    the worker recorded the answer (:class:`RequestTiming`)."""
    timing = _TIMING.get()
    if timing is None:
        return
    if recorded:
        timing.recorded = True
    if queue_ms is not None:
        timing.queue_ms = round(float(queue_ms), 3)
    if run_ms is not None:
        timing.run_ms = round(float(run_ms), 3)


def answer_record(task: str, audio_seconds: float) -> dict | None:
    """What a worker needs to record the answer of the current request itself (:func:`answer_events`), or
    None outside an API view that counts requests. It travels in the run's header (``record``): the
    worker writes the answer's events with its own write after the reply, so the web process makes no
    metrics write for a served request (10 % of its CPU per silero_vad request, docs/benchmarks.md).

    ``audio_seconds``: the decoded input's duration; ``queue_ms`` is filled in by the caller once the
    request's slot is granted (0 for a run handed over with its grant: granted at once)."""
    timing = _TIMING.get()
    if timing is None or timing.row is None:
        return None
    return {**timing.row, "task": task, "audio_s": audio_seconds, "queue_ms": 0.0}


def answer_events(model_id: str, record: dict, inference_ms: float) -> tuple[list[Event], dict]:
    """The events and the activity row of a request answered 200 by a run of ``model_id`` (on the worker
    that ran it; ``record`` from :func:`answer_record`): ``requests_total`` ok, the audio seconds, the
    queue wait and the inference time, and a row as ``audiosite.http.apiview`` writes (``at`` and
    ``total_ms`` from this process's wall clock at the reply, against the web process's
    ``started_unix_ms``: hosts whose clocks differ skew ``total_ms`` by that much)."""
    now_ms = time.time() * 1000
    queue_ms = float(record.get("queue_ms") or 0.0)
    events = [count(REQUESTS, model_id, "ok"), audio(model_id, str(record["task"]), float(record["audio_s"])),
              observe(QUEUE_WAIT, queue_ms / 1000, model_id), observe(INFERENCE, inference_ms / 1000, model_id)]
    row = {"at": datetime.fromtimestamp(now_ms / 1000, UTC).isoformat(timespec="milliseconds").replace("+00:00", "Z"),
           "model": model_id, "route": record.get("route", ""), "status": 200, "outcome": "ok", "code": None,
           "queue_ms": round(queue_ms, 3), "run_ms": round(float(inference_ms), 3),
           "total_ms": round(max(0.0, now_ms - float(record.get("started_unix_ms") or now_ms)), 3),
           "client": record.get("client", ""), "user": record.get("user")}
    return events, row


def activity_soon(row: dict) -> None:
    """Queue one answered request for the activity list, written with this loop's metric events (at most
    ``ACTIVITY_FLUSH_S`` later, the same ``MULTI``) and announced on ``Keys.activity_events``. That write
    takes the place of the batch's ``FLUSH_INTERVAL_S`` timer (cancelled; events queued while it is
    pending start none), so an answered request costs one ``MULTI``, not two. It waits only
    ``ACTIVITY_SOON_S`` when the last write began ``ACTIVITY_FLUSH_S`` ago or more, else until then:
    at most one write per ``ACTIVITY_FLUSH_S`` while answers arrive.

    ``row``: JSON-able, ``{"at": ISO 8601 UTC, "model", "route", "status", "outcome", "code",
    "queue_ms", "run_ms", "total_ms", "client"}`` (``audiosite.http.apiview``); never a request body."""
    batch = _batch()
    batch.activity.append(row)
    if batch.early is None:
        loop = asyncio.get_running_loop()
        wait_s = max(ACTIVITY_SOON_S, batch.written_at + ACTIVITY_FLUSH_S - loop.time())
        batch.early = loop.create_task(_write_early(batch, wait_s))
    if batch.task is not None:  # the early write takes every event queued so far, sooner than the timer
        task, batch.task = batch.task, None
        task.cancel()


async def _write_early(batch: _Batch, wait_s: float) -> None:
    try:
        await asyncio.sleep(wait_s)
    finally:
        batch.early = None
    await _write(batch)


def _queue_activity(pipe: Any, rows: list[dict]) -> None:
    texts = [json.dumps(row, separators=(",", ":")) for row in rows]
    pipe.lpush(KEYS.activity, *texts)
    pipe.ltrim(KEYS.activity, 0, ACTIVITY_KEEP - 1)
    pipe.publish(KEYS.activity_events, "[" + ",".join(texts) + "]")


async def activity_recent(redis_client: Any, limit: int = ACTIVITY_KEEP) -> list[dict]:
    """The last ``limit`` answered requests, newest first (the rows of :func:`activity_soon`)."""
    texts = await redis_client.lrange(KEYS.activity, 0, max(0, limit - 1))
    return [json.loads(text) for text in texts]


def record_sync(redis_client: Any, *events: Event, rows: list[dict] | None = None) -> None:
    """:func:`record` on a synchronous client (Celery worker threads); ``rows``: activity rows written in the
    same ``MULTI`` and announced as :func:`activity_soon`'s are."""
    if not events and not rows:
        return
    try:
        with redis_client.pipeline(transaction=True) as pipe:
            _queue(pipe, events)
            if rows:
                _queue_activity(pipe, rows)
            pipe.execute()
    except redis.RedisError as exc:
        log.warning("metrics: %d event(s) and %d activity row(s) lost: %s", len(events), len(rows or ()), exc)


async def read_stored(redis_client: Any) -> dict[str, dict[str, str]]:
    """Every stored metric's hash, read in one ``MULTI`` (a consistent cut): ``{name: {field: value}}``."""
    async with redis_client.pipeline(transaction=True) as pipe:
        for metric in STORED:
            pipe.hgetall(KEYS.metric(metric.name))
        rows = await pipe.execute()
    return {metric.name: row or {} for metric, row in zip(STORED, rows, strict=True)}


async def forget_model(redis_client: Any, model_id: str) -> int:
    """Delete every stored series of ``model_id`` (an unregistered model: its fields in every metric's
    hash), so a later registration under the same id starts from 0. Returns the number of fields deleted.

    Two round trips (``HKEYS`` of every hash, then one ``HDEL`` per hash). An event of the model written
    after this (an answer in flight at the unregistration) is kept but not exposed while the id is
    unregistered (:func:`exposition` shows registered models only). A Redis error is logged, not raised
    (the unregistration it follows is done): 0 is returned.
    """
    keys = [KEYS.metric(metric.name) for metric in STORED]
    try:
        async with redis_client.pipeline(transaction=False) as pipe:
            for key in keys:
                pipe.hkeys(key)
            rows = await pipe.execute()
        doomed = {key: [f for f in fields if _model_of(f) == model_id] for key, fields in zip(keys, rows, strict=True)}
        doomed = {key: fields for key, fields in doomed.items() if fields}
        if doomed:
            async with redis_client.pipeline(transaction=True) as pipe:
                for key, fields in doomed.items():
                    pipe.hdel(key, *fields)
                await pipe.execute()
    except redis.RedisError as exc:
        log.warning("metrics: the series of %s were not deleted: %s", model_id, exc)
        return 0
    return sum(len(fields) for fields in doomed.values())


def _model_of(field: str) -> str | None:
    """The ``model`` label (the first) of a stored field, None when the field is not ours."""
    try:
        labels = json.loads(field.partition("\t")[0])
    except ValueError:
        return None
    return labels[0] if isinstance(labels, list) and labels and isinstance(labels[0], str) else None


@dataclass(frozen=True)
class ModelGauges:
    """The gauges of one model from one snapshot: ``queued`` requests (managers not counted),
    ``active`` request leases, configured ``slots``, ``loaded`` (state ready); ``task`` its
    registration's task (the ``task`` label of its zero ``audio_seconds_total`` series)."""

    model_id: str
    queued: int
    active: int
    slots: int
    loaded: bool
    task: str = ""


def _stored_family(metric: Stored, rows: dict[str, str], models: dict[str, str]) -> Metric:
    """One stored metric's family: its stored series whose model is registered (``models``: id -> task)
    or "" (a request that named none), plus each registered model's known series at 0."""
    name = PREFIX + metric.name
    series: dict[str, dict[str, str]] = {}
    for field, value in rows.items():
        labels, _, part = field.partition("\t")
        series.setdefault(labels, {})[part] = value
    series = {labels: parts for labels, parts in series.items()
              if (model := _model_of(labels)) == "" or model in models}
    for model_id, task in models.items():
        for known in metric.known(model_id, task):
            series.setdefault(_field(known), {})
    if metric.kind is Kind.COUNTER:
        counter = CounterMetricFamily(name, metric.help, labels=list(metric.labels))
        for labels, parts in sorted(series.items()):
            counter.add_metric(json.loads(labels), float(parts.get("", 0)))
        return counter
    histogram = HistogramMetricFamily(name, metric.help, labels=list(metric.labels))
    for labels, parts in sorted(series.items()):
        cumulative, buckets = 0, []
        for index, bound in enumerate(BUCKETS_S):
            cumulative += int(parts.get(f"b{index}", 0))
            buckets.append((repr(bound), cumulative))
        total = int(parts.get("count", 0))
        buckets.append(("+Inf", total))
        histogram.add_metric(json.loads(labels), buckets, float(parts.get("sum", 0.0)))
    return histogram


def _gauge_families(models: list[ModelGauges], draining: bool) -> list[Metric]:
    families = {
        "queued_requests": ("Requests waiting for a slot of the model (managers not counted).", "queued"),
        "active_slots": ("Slots of the model occupied by request leases (admitted requests included).", "active"),
        "slots": ("Slots configured for the model.", "slots"),
        "model_loaded": ("1 while the model's pool is loaded (state ready), else 0.", "loaded"),
    }
    out: list[Metric] = []
    for name, (text, attribute) in families.items():
        gauge = GaugeMetricFamily(PREFIX + name, text, labels=["model"])
        for model in models:
            gauge.add_metric([model.model_id], float(getattr(model, attribute)))
        out.append(gauge)
    out.append(GaugeMetricFamily(PREFIX + "draining", "1 while the answering web process drains (shutting down), "
                                 "else 0.", value=1.0 if draining else 0.0))
    return out


# -- process CPU and memory of every web process and worker ---------------------------------------
PROCESS_TTL_MS = 15000
"""Life of a process's published sample (ms): a process that stops publishing (dead, frozen) leaves
``/metrics`` this long after its last sample. Three web samples (``PROCESS_EVERY_S``) or seven worker
liveness beats (``inference.scheduler.LIVENESS_EVERY_S``, 2 s) fit in it."""
PROCESS_EVERY_S = 5.0
"""How often a web process publishes its sample (s); a worker publishes at each liveness beat."""

_PROCESS_SAMPLES = {"process_cpu_seconds_total": "cpu_seconds", "process_resident_memory_bytes": "resident_bytes"}


def _processes_key() -> str:
    """SET of ``"<role>\\t<process>"`` of every process that has published (some may have expired)."""
    return KEYS.metric("processes")


def _process_key(member: str) -> str:
    return KEYS.metric("process:" + member)


def process_label() -> str:
    """This process's ``process`` label: ``<host name>:<pid>`` (a container's host name is its id). Not
    ``instance``: Prometheus sets that label on every series to the scraped target."""
    return f"{socket.gethostname()}:{os.getpid()}"


def process_sample() -> dict[str, float]:
    """This process's ``{"cpu_seconds": user + system CPU seconds, "resident_bytes": RSS in bytes}``, read
    by ``prometheus_client``'s ``ProcessCollector`` from ``/proc/self`` (empty where there is no ``/proc``)."""
    sample: dict[str, float] = {}
    for family in ProcessCollector(registry=None).collect():
        for point in family.samples:
            if point.name in _PROCESS_SAMPLES:
                sample[_PROCESS_SAMPLES[point.name]] = float(point.value)
    return sample


def process_queue(pipe: Any, role: str) -> None:
    """Queue on ``pipe`` (sync or asyncio) the publication of this process's sample under ``role``
    (``web`` or ``worker``): ``SET`` of its key with ``PROCESS_TTL_MS`` and ``SADD`` to the index."""
    sample = process_sample()
    if not sample:
        return
    member = f"{role}\t{process_label()}"
    pipe.set(_process_key(member), json.dumps(sample), px=PROCESS_TTL_MS)
    pipe.sadd(_processes_key(), member)


async def _publish_web_forever() -> None:
    while True:
        try:
            ctx = await async_context()
            async with ctx.redis.pipeline(transaction=False) as pipe:
                process_queue(pipe, "web")
                await pipe.execute()
        except Exception as exc:  # Redis down: the sample expires, the next one comes back
            log.warning("metrics: publishing this process's CPU and memory failed: %s", exc)
        await asyncio.sleep(PROCESS_EVERY_S)


_PUBLISHERS: list[asyncio.Task] = []


def process_publish_start() -> asyncio.Task:
    """Start publishing this web process's sample every ``PROCESS_EVERY_S`` on the running event loop
    (daphne's reactor calls it once it runs; the worker publishes from its liveness beat instead)."""
    task = asyncio.ensure_future(_publish_web_forever())
    _PUBLISHERS.append(task)  # the loop keeps only weak references to tasks
    return task


@dataclass(frozen=True)
class ProcessSample:
    """One live process's published sample: ``role`` (web, worker), ``process`` (host:pid), its CPU
    seconds and resident memory in bytes."""

    role: str
    process: str
    cpu_seconds: float
    resident_bytes: float


async def read_processes(redis_client: Any) -> list[ProcessSample]:
    """Every live process's sample (two round trips; a third drops the index entries whose key expired).

    Raises:
        redis.RedisError: Redis could not be reached.
    """
    members = sorted(await redis_client.smembers(_processes_key()))
    if not members:
        return []
    values = await redis_client.mget([_process_key(m) for m in members])
    out, gone = [], []
    for member, value in zip(members, values, strict=True):
        if value is None:
            gone.append(member)
            continue
        role, _, label = member.partition("\t")
        sample = json.loads(value)
        out.append(ProcessSample(role, label, float(sample.get("cpu_seconds", 0.0)),
                                 float(sample.get("resident_bytes", 0.0))))
    if gone:
        await redis_client.srem(_processes_key(), *gone)
    return out


def _process_families(processes: list[ProcessSample]) -> list[Metric]:
    cpu = CounterMetricFamily(PREFIX + "process_cpu_seconds", "User and system CPU time of each live web "
                              "process and worker of the deployment, in seconds.", labels=["role", "process"])
    rss = GaugeMetricFamily(PREFIX + "process_resident_memory_bytes", "Resident memory of each live web process "
                            "and worker of the deployment, in bytes.", labels=["role", "process"])
    for process in processes:
        cpu.add_metric([process.role, process.process], process.cpu_seconds)
        rss.add_metric([process.role, process.process], process.resident_bytes)
    return [cpu, rss]


# -- build information ---------------------------------------------------------------------------
VERSION_ENV = "AUDIOSITE_VERSION"
"""Environment variable naming the deployed version (an image build sets it: ``.git`` is not in images)."""

_version: str | None = None


def version() -> str:
    """The ``version`` label of ``audiosite_build_info``: ``$AUDIOSITE_VERSION`` when set, else ``git
    describe --always --dirty`` of the checkout (a short commit id, ``-dirty`` with local changes),
    else "unknown". Computed once per process (the first call runs git: call it off the event loop)."""
    global _version
    if _version is None:
        _version = os.environ.get(VERSION_ENV, "").strip() or _git_describe() or "unknown"
    return _version


def _git_describe() -> str | None:
    root = Path(__file__).resolve().parents[2]
    if not (root / ".git").exists():
        return None
    try:
        done = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=root, capture_output=True,
                              text=True, timeout=5, check=False)
    except (OSError, subprocess.SubprocessError):
        return None
    if done.returncode != 0:
        return None
    return done.stdout.strip() or None


@dataclass(frozen=True)
class BuildInfo:
    """The labels of ``audiosite_build_info``: ``version`` (:func:`version`), ``python`` (e.g. 3.11.2),
    ``runtime`` (``parallel`` or ``legacy``, the config's) and ``backend`` (the inference backend resolved,
    as ``/health``)."""

    version: str
    runtime: str
    backend: str
    python: str = platform.python_version()


def _build_family(build: BuildInfo) -> Metric:
    info = GaugeMetricFamily(PREFIX + "build_info", "Always 1; its labels name what is running: version (git "
                             "describe or AUDIOSITE_VERSION), python, runtime and backend.",
                             labels=["version", "python", "runtime", "backend"])
    info.add_metric([build.version, build.python, build.runtime, build.backend], 1.0)
    return info


class _Families:
    """A prometheus_client collector that hands out families built beforehand (for one scrape)."""

    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return iter(self._families)


def exposition(models: list[ModelGauges], stored: dict[str, dict[str, str]], draining: bool,
               processes: list[ProcessSample] | None = None, build: BuildInfo | None = None) -> bytes:
    """The Prometheus text exposition of one scrape (served as format 0.0.4, which every Prometheus reads:
    our metric and label names are all legacy-valid, so it is byte for byte the same as 1.0.0).

    Args:
        models: every registered model's gauges, from one atomic snapshot. Only these models' stored
            series are exposed (and those of model ""), each with its known series at 0 when it has none.
        stored: :func:`read_stored`'s answer.
        draining: this web process drains (``audiosite_draining``).
        processes: :func:`read_processes`' answer.
        build: ``audiosite_build_info``'s labels (the family is left out when None).
    """
    registered = {model.model_id: model.task for model in models}
    families = _gauge_families(models, draining)
    families += [_stored_family(m, stored.get(m.name, {}), registered) for m in STORED]
    families += _process_families(processes or [])
    if build is not None:
        families.append(_build_family(build))
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)
