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
"""
from __future__ import annotations

import asyncio
import bisect
import json
import logging
import weakref
from collections.abc import Iterable
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import redis
from prometheus_client import CollectorRegistry, generate_latest
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


@dataclass(frozen=True)
class Stored:
    """One stored metric: ``name`` without the ``audiosite_`` prefix (and, for a counter, with its ``_total``)."""

    name: str
    kind: Kind
    labels: tuple[str, ...]
    help: str


REQUESTS = Stored("requests_total", Kind.COUNTER, ("model", "outcome"),
                  "Inference requests answered, by outcome: ok (2xx), client_error (4xx), rejected (503), "
                  "error (other 5xx). model is empty when the request named no registered model.")
REJECTIONS = Stored("rejections_total", Kind.COUNTER, ("model", "code"),
                    "Inference requests answered 503, by error code (queue_timeout, overdue, shutting_down, "
                    "worker_lost, no_worker, load_failed, residency_full, decode_budget, insufficient_memory, ...).")
MODEL_LOADS = Stored("model_loads_total", Kind.COUNTER, ("model", "outcome"),
                     "Model loads finished by a worker, by outcome (ok, failed).")
EVICTIONS = Stored("evictions_total", Kind.COUNTER, ("model",),
                   "Models unloaded to make room under max_loaded_models (least recently used first).")
QUEUE_WAIT = Stored("queue_wait_seconds", Kind.HISTOGRAM, ("model",),
                    "Time a granted inference request waited for its slot (enqueue to grant).")
INFERENCE = Stored("inference_seconds", Kind.HISTOGRAM, ("model",),
                   "Time a request spent in the model's session on the worker (a whole stream for speech).")
MODEL_LOAD = Stored("model_load_seconds", Kind.HISTOGRAM, ("model",),
                    "Time a worker spent loading a model (successful and failed loads).")

STORED = (REQUESTS, REJECTIONS, MODEL_LOADS, EVICTIONS, QUEUE_WAIT, INFERENCE, MODEL_LOAD)


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
            ints[key, field] = ints.get((key, field), 0) + 1
            continue
        assert value is not None
        seconds = max(0.0, float(value))
        for name in (f"{field}\tb{bucket_index(seconds)}", f"{field}\tcount"):
            ints[key, name] = ints.get((key, name), 0) + 1
        floats[key, f"{field}\tsum"] = floats.get((key, f"{field}\tsum"), 0.0) + seconds
    return ints, floats


def _queue(pipe: Any, events: Iterable[Event]) -> None:
    ints, floats = _increments(events)
    for (key, field), amount in ints.items():
        pipe.hincrby(key, field, amount)
    for (key, field), seconds in floats.items():
        pipe.hincrbyfloat(key, field, seconds)


Event = tuple[Stored, tuple[str, ...], float | None]
"""One event: ``(metric, label values, seconds)``; seconds only for a histogram (None for a counter)."""


def count(metric: Stored, *labels: str) -> Event:
    """A counter increment by 1, to pass to :func:`record` / :func:`record_sync`."""
    return metric, tuple(labels), None


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
        self.task: asyncio.Task | None = None
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
    loop = asyncio.get_running_loop()
    batch = _BATCHES.get(loop)
    if batch is None:
        batch = _BATCHES[loop] = _Batch()
    batch.events.extend(events)
    if batch.task is None:
        batch.task = loop.create_task(_flush_later(batch))


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
        if events:
            try:
                async with asyncio.timeout(WRITE_TIMEOUT_S):
                    await _record_events(events)
            except TimeoutError:
                log.warning("metrics: %d event(s) lost: the write took over %g s", len(events), WRITE_TIMEOUT_S)


async def _record_events(events: list[Event]) -> None:
    ctx = await async_context()
    await record(ctx.redis, *events)


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


def record_sync(redis_client: Any, *events: Event) -> None:
    """:func:`record` on a synchronous client (Celery worker threads)."""
    if not events:
        return
    try:
        with redis_client.pipeline(transaction=True) as pipe:
            _queue(pipe, events)
            pipe.execute()
    except redis.RedisError as exc:
        log.warning("metrics: %d event(s) lost: %s", len(events), exc)


async def read_stored(redis_client: Any) -> dict[str, dict[str, str]]:
    """Every stored metric's hash, read in one ``MULTI`` (a consistent cut): ``{name: {field: value}}``."""
    async with redis_client.pipeline(transaction=True) as pipe:
        for metric in STORED:
            pipe.hgetall(KEYS.metric(metric.name))
        rows = await pipe.execute()
    return {metric.name: row or {} for metric, row in zip(STORED, rows, strict=True)}


@dataclass(frozen=True)
class ModelGauges:
    """The gauges of one model from one snapshot: ``queued`` requests (managers not counted),
    ``active`` request leases, configured ``slots``, ``loaded`` (state ready)."""

    model_id: str
    queued: int
    active: int
    slots: int
    loaded: bool


def _stored_family(metric: Stored, rows: dict[str, str]) -> Metric:
    name = PREFIX + metric.name
    if metric.kind is Kind.COUNTER:
        counter = CounterMetricFamily(name, metric.help, labels=list(metric.labels))
        for field, value in sorted(rows.items()):
            counter.add_metric(json.loads(field), int(value))
        return counter
    histogram = HistogramMetricFamily(name, metric.help, labels=list(metric.labels))
    series: dict[str, dict[str, str]] = {}
    for field, value in rows.items():
        labels, _, part = field.partition("\t")
        series.setdefault(labels, {})[part] = value
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


class _Families:
    """A prometheus_client collector that hands out families built beforehand (for one scrape)."""

    def __init__(self, families: list[Metric]):
        self._families = families

    def collect(self) -> Iterable[Metric]:
        return iter(self._families)


def exposition(models: list[ModelGauges], stored: dict[str, dict[str, str]], draining: bool) -> bytes:
    """The Prometheus text exposition of one scrape (served as format 0.0.4, which every Prometheus reads:
    our metric and label names are all legacy-valid, so it is byte for byte the same as 1.0.0).

    Args:
        models: every registered model's gauges, from one atomic snapshot.
        stored: :func:`read_stored`'s answer.
        draining: this web process drains (``audiosite_draining``).
    """
    families = _gauge_families(models, draining) + [_stored_family(m, stored.get(m.name, {})) for m in STORED]
    registry = CollectorRegistry(auto_describe=False)
    registry.register(_Families(families))
    return generate_latest(registry)
