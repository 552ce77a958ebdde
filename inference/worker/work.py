"""What the worker does for each task: load a pool, run one request, destroy a pool.

Outcomes are written to a Redis reply key with a TTL, then announced on the
caller's process channel (see ``inference.runtime.loads`` and ``inference.runtime.runs``). The worker renews
the lease (or the loader claim) while it works and releases a run's lease
when done, so a web process that dies mid-request strands nothing (R2.5).
Database writes: the worker records its loads (``loading``, the outcome);
teardowns are recorded by their manager (``inference.services.model_teardown``).
"""
from __future__ import annotations

import functools
import json
import logging
import threading
import time

from django.db import connections

from audiosite.serverconfig import DEFAULT_MAX_RUN_MS, RUN_DEADLINE_AUDIO_S, RUN_DEADLINE_TEXT_CHARS
from inference import specs
from inference.adapters.fixture_barrier import make_barrier
from inference.runtime import metrics
from inference.runtime.context import KEYS, redis_url, sync_redis, sync_scheduler
from inference.runtime.runs import RunFailure
from inference.scheduler import LIVENESS_TTL_MS, LoadEnd, LoadOutcome
from registry import records

from . import batching, serving
# Re-exported: what a run does in the pool's process lives in ``serving`` (Django-free).
from .serving import INPUT_EXPIRED, RESULT_TTL_MS, end_frame, failure, left_checker, push_frame  # noqa: F401
from .state import AnyPool, PoolLoadFailed, WorkerState

log = logging.getLogger(__name__)


INLINE_REPLY_MAX_CHARS = 8192
"""A reply of at most this many characters of JSON is also carried in its wake-up message (a VAD
result or a short transcript; longer ones are read from their key)."""

INLINE_REPLY_TTL_MS = 30000
"""How long the reply key of an inline reply stays (ms), for a waiter whose wake-up message was
lost (a dropped subscription): it looks within ``inference.runtime.loads.LIVENESS_CHECK_S``, then at
least every liveness TTL (10 s). The reader does not delete it: at 100 short requests per second
about 3,000 keys of a few hundred bytes stay in Redis."""


def reply(channel: str, key: str, wake: str, payload: dict, release: tuple[str, str] | None = None,
          inline: bool = False) -> bool:
    """Store ``payload`` (JSON) at ``key`` for ``RESULT_TTL_MS`` and publish ``wake`` on ``channel``.

    Args:
        release: ``(model_id, lease_id)``: release that lease first, in the same round trip
            (a run's end: its slot is free before its sender wakes).
        inline: a run's reply (``wake`` is ``done:<request id>``), see :func:`reply_run`.

    Returns:
        False when it was a run's reply its client had left (nothing stored, :func:`reply_run`), else True.

    Raises:
        redis.RedisError: the SET or the PUBLISH failed (a failed release is retried alone first).
    """
    if inline:
        return reply_run(channel, wake, payload, release)
    scheduler = sync_scheduler()
    text = json.dumps(payload)
    with sync_redis().pipeline(transaction=False) as pipe:  # one round trip, run in this order
        if release is not None:
            scheduler.release_in(pipe, *release)
        pipe.set(key, text, px=RESULT_TTL_MS)
        pipe.publish(channel, wake)
        results = pipe.execute(raise_on_error=False)
    if release is not None:
        if isinstance(results[0], Exception):  # e.g. NOSCRIPT after Redis lost its script cache
            log.info("releasing %s with the reply failed (%s); releasing it alone", release, results[0])
            scheduler.release(*release)
        results = results[1:]
    for result in results:
        if isinstance(result, Exception):
            raise result
    return True


def reply_run(channel: str, wake: str, payload: dict, release: tuple[str, str] | None = None) -> bool:
    """Answer a run (``wake`` = ``done:<request id>``) in one step with the check of its stop marker
    (``Scheduler.run_reply``, R8.2): ``release`` (``(model_id, lease_id)``) is released first; when the
    run's client left (``inference.runtime.runs.run_reply`` marked it), nothing is stored (no reply
    key waits for its TTL) and a ``not_loaded`` payload (a run this worker never took) gives the
    sender's lease and input back. Otherwise the reply is stored at ``Keys.result`` and announced:
    one of at most ``INLINE_REPLY_MAX_CHARS`` rides in the wake-up (``wake + "\n" + payload``; the
    reader then needs no GET) and its key stays ``INLINE_REPLY_TTL_MS`` only, for a waiter whose
    wake-up was lost; a longer one is read from its key (``RESULT_TTL_MS``). Returns False when the
    client had left (nothing stored), True when the reply was stored and announced.

    Raises:
        redis.RedisError: the script failed (the caller releases the lease on that path).
    """
    text = json.dumps(payload)
    short = len(text) <= INLINE_REPLY_MAX_CHARS
    return bool(sync_scheduler().run_reply(wake.removeprefix("done:"), channel, text,
                                           f"{wake}\n{text}" if short else wake,
                                           INLINE_REPLY_TTL_MS if short else RESULT_TTL_MS, release,
                                           taken=payload.get("kind") != RunFailure.NOT_LOADED))


def load_pool(worker: WorkerState, model_id: str, token: str) -> dict | None:
    """Build ``model_id``'s pool as the single loader holding ``token`` (R4.2); record the outcome in the
    database, unless the claim was ended meanwhile by someone who records that end (stale: the pool is
    discarded and nothing is written).

    Returns:
        The reply payload ``{"ok": true, "owner", "boot", "duration_ms"}`` or
        ``{"ok": false, "error", "duration_ms"}``; None when the claim was
        abandoned or replaced before the load started (nothing done).
    """
    scheduler = sync_scheduler()
    host = worker.hostname or ""
    if not scheduler.renew_load(model_id, token, host, worker.boot):
        log.info("load of %s (token %s) was abandoned or replaced before it started; skipping", model_id, token)
        return None
    started = time.monotonic()
    meta_json = sync_redis().hget(KEYS.models_meta, model_id)
    try:
        records.registration_record_loading(model_id)
    except Exception:
        log.exception("recording the start of a load failed")
    error, capacity, built = "", 0, None
    barrier = make_barrier(redis_url(), KEYS) if specs.fixture_family_enabled() else None
    try:
        if meta_json is None:
            raise LookupError(f"model {model_id!r} is no longer registered")
        with scheduler.keep_load_claim(model_id, token, host, worker.boot):
            built = worker.build(model_id, json.loads(meta_json), meta_json, barrier=barrier)
            capacity = built.capacity
    except PoolLoadFailed as exc:  # the model's process logged the failure itself
        error = exc.detail
        log.error("loading %s failed: %s", model_id, error)
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        log.exception("loading %s failed", model_id)
    duration_ms = int((time.monotonic() - started) * 1000)
    ok = not error
    outcome = LoadEnd.READY if ok else LoadEnd.FAILED
    stale = scheduler.finish_load(model_id, token, outcome, host, worker.boot, error, capacity) is LoadOutcome.STALE
    if stale:
        # Our claim was ended by someone who records that end: a web process that counted this worker
        # lost (R7.4; inference.services.loading._record_lost_load writes the failed load) or a manager whose
        # teardown began (set_state.lua; its teardown writes the states). Publish nothing and write
        # nothing: one writer per step.
        if built is not None:
            worker.discard(model_id, built)
        ok, error = False, "the load was abandoned or superseded"
        log.info("load of %s (token %s) finished after its claim was gone; discarded", model_id, token)
    else:
        if built is not None and built.pid is not None:
            publish_pool_pid(worker, model_id, built.pid)
        try:
            records.registration_record_load(model_id, ok, error=error, duration_ms=duration_ms, actor=host)
        except Exception:
            log.exception("recording a load outcome failed")
    metrics.record_sync(sync_redis(), metrics.count(metrics.MODEL_LOADS, model_id, "ok" if ok else "failed"),
                        metrics.observe(metrics.MODEL_LOAD, duration_ms / 1000, model_id))
    payload: dict = {"ok": True, "owner": worker.hostname, "boot": worker.boot} if ok else {"ok": False, "error": error}
    payload["duration_ms"] = duration_ms
    return payload


def run_deadline_s(pool: AnyPool, kind: str, header: dict) -> float | None:
    """The deadline of one run in seconds (R3.6), or None where it cannot be enforced (a pool in the
    worker process: a thread cannot be stopped).

    The registration's ``max_run_ms`` (else ``DEFAULT_MAX_RUN_MS``) covers ``RUN_DEADLINE_AUDIO_S`` of
    input; a longer input scales it in proportion (its ``audio_ms`` in the header; a speech run's text
    against ``RUN_DEADLINE_TEXT_CHARS``). The test and pipeline families' run time does not grow with
    their input: their deadline is ``max_run_ms`` as it is.
    """
    if pool.pid is None:
        return None
    family, max_run_ms = _deadline_terms(pool.meta_json)
    scale = 1.0
    if family not in FIXED_RUN_TIME_FAMILIES:
        if kind == serving.SPEECH:
            scale = len(header.get("text", "")) / RUN_DEADLINE_TEXT_CHARS
        else:
            scale = float(header.get("audio_ms") or 0) / (RUN_DEADLINE_AUDIO_S * 1000)
    return max_run_ms * max(1.0, scale) / 1000


FIXED_RUN_TIME_FAMILIES = frozenset({"fixture", "diarization"})
"""Families whose run time does not grow with their input (their deadline is not scaled)."""


@functools.lru_cache(maxsize=256)
def _deadline_terms(meta_json: str) -> tuple[str, int]:
    """``(family, max_run_ms)`` of a published registration (its JSON; parsed once per registration)."""
    meta = json.loads(meta_json) if meta_json else {}
    return str(meta.get("family", "")), int(meta.get("max_run_ms") or DEFAULT_MAX_RUN_MS)


def run_request(worker: WorkerState, pool: AnyPool, model_id: str, lease_id: str, header: dict,
                held: bool = False, inline: memoryview | None = None) -> dict:
    """Serve one request on ``pool`` under ``lease_id``, renewing it meanwhile (unless ``held``). The
    caller releases the lease (``reply(..., release=...)`` gives it back in the reply's round trip).

    Args:
        header: the run header (``inference.runtime.runs.run_header``): its samples wait in
            ``Keys.input(request_id)`` (see ``inference.audio.to_bytes``) at ``sample_rate_hz`` in
            ``sample_format``, unless they came ``inline``; ``options`` are overlaid on the pool's defaults.
        inline: the samples themselves, when they came inside the run queue element
            (``inference.runtime.runs.inline_element``): nothing is read from Redis.
        held: the sender keeps (renews and releases) the lease itself: one decode of a live
            transcription turn, whose lease spans several runs (``inference.realtime``). The
            worker then neither renews nor releases it.

    Returns:
        ``{"ok": true, "result", "slot", "inference_ms", "worker"}`` or
        ``{"ok": false, "kind": "invalid_input"|"expired"|"error"|"crashed"|"deadline", "message"[, "param"]}``.
    """
    deadline_s = run_deadline_s(pool, serving.RUN, header)
    try:
        if held:
            payload = pool.execute(serving.RUN, header, inline, deadline_s)
        else:  # a registration with max_batch > 1 shares the session call with runs granted close by
            with sync_scheduler().keep_alive(model_id, lease_id):
                payload = batching.execute_run(pool, header, inline, deadline_s)
    except Exception as exc:  # a bug on the worker's side: report it, keep the worker
        return failure(exc, f"run of {model_id}")
    if payload.get("ok"):
        payload["worker"] = worker.hostname
    return payload


def record_answer(model_id: str, payload: dict, record: dict | None) -> None:
    """After a run's reply: with ``record`` (the header's, ``metrics.answer_record``; pass it only when the
    reply was stored, so its sender answers 200), the answer's events and activity row
    (``metrics.answer_events``) in one write; otherwise only the inference time (:func:`record_inference`)."""
    if record is None or not payload.get("ok"):
        record_inference(model_id, payload)
        return
    events, row = metrics.answer_events(model_id, record, payload["inference_ms"])
    metrics.record_sync(sync_redis(), *events, rows=[row])


def record_inference(model_id: str, payload: dict) -> None:
    """Observe a served run's ``inference_ms`` in ``audiosite_inference_seconds`` (after its reply was sent,
    so the answer never waits for it); failed runs are not observed."""
    if payload.get("ok"):
        metrics.record_sync(sync_redis(), metrics.observe(metrics.INFERENCE, payload["inference_ms"] / 1000, model_id))


def stream_speech(worker: WorkerState, pool: AnyPool, header: dict) -> None:
    """Synthesise ``header["text"]`` sentence by sentence, pushing each as a frame as soon as it exists.

    Frames (``Keys.chunks``): ``a`` + s16le mono PCM at the model's rate per
    sentence (pushed by the pool's process, ``serving.stream_speech``), then one end frame ``e`` +
    ``{"ok": true, "slot", "inference_ms", "worker", "sentences", "phonemes", "samples", "stopped"}``
    or a failure ``{"ok": false, "kind", "message"[, "param"]}`` (kinds as ``run_request``), pushed
    here.

    The lease stays with the web process, which renews it for the whole
    stream (the slot is held until the last byte is written, R8.3); this
    thread never renews or releases it. After every sentence it stops early
    when the web set ``Keys.stop`` (its client left) or the web process's
    liveness key is gone (it died): at most one sentence is made for nobody.
    """
    final = _stream(worker, pool, serving.SPEECH, header)
    push_frame(header["channel"], header["request_id"], end_frame(final))
    record_inference(header["model_id"], final)


def stream_transcription(worker: WorkerState, pool: AnyPool, header: dict) -> None:
    """Transcribe the input of ``header`` segment by segment, pushing each segment as soon as it is decoded.

    Input: float32 samples in ``Keys.input(request_id)`` at ``header["sample_rate_hz"]``.
    Frames (``Keys.chunks``): ``j`` + ``{"delta", "segment"}`` per segment (``delta`` is the text
    to append to the transcript so far, see ``inference.adapters.base.segment_delta``), then
    one end frame ``e`` + ``{"ok": true, "text", "language", "duration" (s), "segments" (count),
    "slot", "inference_ms", "worker", "stopped"}`` or a failure ``{"ok": false, "kind",
    "message"[, "param"]}`` (kinds as :func:`run_request`).

    The lease stays with the web process (held for the whole stream, R8.3), as for
    :func:`stream_speech`; after every segment the run stops early when the web asked it to or died.
    """
    final = _stream(worker, pool, serving.TRANSCRIPTION, header)
    push_frame(header["channel"], header["request_id"], end_frame(final))


def _stream(worker: WorkerState, pool: AnyPool, kind: str, header: dict) -> dict:
    """The end frame's payload of a streamed run of ``kind`` (its data frames pushed meanwhile)."""
    try:
        final = pool.execute(kind, header, None, run_deadline_s(pool, kind, header))
    except Exception as exc:  # a bug on the worker's side: report it, keep the worker
        final = failure(exc, f"{kind} stream of {header['model_id']}")
    if final.get("ok"):
        final["worker"] = worker.hostname
    return final


def pool_lost(worker: WorkerState, model_id: str, reason: str) -> None:
    """Record that ``model_id``'s process ended unasked (a crash, the OOM killer, a run past its deadline):
    in Redis at once (``Scheduler.pool_failed``: state ``failed``, ``last_error``, the load backoff; the
    next request after it loads again), then in the database in a thread of its own (state
    ``unloaded``, ``last_error``, a failed ``crash`` audit row), so the runs in flight are answered
    without waiting for the database. Nothing is written when the pool was no longer the published
    one in Redis (a teardown had begun, or the worker was counted lost)."""
    error = f"the model's process ended: {reason}"
    try:
        changed = sync_scheduler().pool_failed(model_id, worker.boot, error)
        forget_pool_pid(worker, model_id)
    except Exception:
        log.exception("recording the end of %s's process in Redis failed", model_id)
        changed = True
    if not changed:
        return

    def record() -> None:
        try:
            records.registration_record_crash(model_id, error, actor=worker.hostname or "")
        except Exception:
            log.exception("recording the end of %s's process failed", model_id)
        finally:
            connections.close_all()
    threading.Thread(target=record, name=f"record crash {model_id}", daemon=True).start()


def publish_pool_pid(worker: WorkerState, model_id: str, pid: int) -> None:
    """Name ``model_id``'s process in ``Keys.pool_pids`` (for operators and tests; its TTL follows the
    worker's liveness beat)."""
    key = KEYS.pool_pids(worker.hostname or "")
    with sync_redis().pipeline(transaction=False) as pipe:
        pipe.hset(key, model_id, pid).pexpire(key, LIVENESS_TTL_MS).execute()


def forget_pool_pid(worker: WorkerState, model_id: str) -> None:
    """Remove ``model_id``'s process from ``Keys.pool_pids`` (it exited)."""
    sync_redis().hdel(KEYS.pool_pids(worker.hostname or ""), model_id)


def destroy_pool(worker: WorkerState, model_id: str) -> dict:
    """Unpublish and close this worker's pool of ``model_id`` (sessions, then weights; R4.5).

    Returns:
        ``{"ok": bool, "had_pool": bool, "duration_ms": int[, "error"]}``; ``error`` when closing raised.
    """
    started = time.monotonic()
    pool = worker.remove(model_id)
    payload: dict = {"ok": True, "had_pool": pool is not None}
    if pool is not None and pool.pid is not None:
        forget_pool_pid(worker, model_id)
    if pool is not None:
        try:
            pool.close()
        except Exception as exc:
            log.exception("closing the pool of %s failed", model_id)
            payload.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    payload["duration_ms"] = int((time.monotonic() - started) * 1000)
    return payload

