"""What the worker does for each task: load a pool, run one request, destroy a pool.

Outcomes are written to a Redis reply key with a TTL, then announced on the
caller's process channel (see ``inference.runtime.rpc``). The worker renews
the lease (or the loader claim) while it works and releases a run's lease
when done, so a web process that dies mid-request strands nothing (R2.5).
Database writes: the worker records its loads (``loading``, the outcome);
teardowns are recorded by their manager (``inference.services.model_teardown``).
"""
from __future__ import annotations

import json
import logging
import time

import numpy as np

from inference import audio, specs
from inference.adapters.base import AudioRequest, InvalidInput, TextRequest
from inference.adapters.fixture_barrier import make_barrier
from inference.runtime import metrics
from inference.runtime.context import KEYS, redis_url, sync_redis, sync_redis_bytes, sync_scheduler
from inference.runtime.rpc import RunFailure
from inference.scheduler import Keys, LoadEnd, LoadOutcome
from registry import services as records

from .state import Pool, WorkerState

log = logging.getLogger(__name__)

RESULT_TTL_MS = 300000  # a result waits 5 min for its reader


def reply(channel: str, key: str, wake: str, payload: dict) -> None:
    """Store ``payload`` (JSON) at ``key`` for ``RESULT_TTL_MS`` and publish ``wake`` on ``channel``."""
    with sync_redis().pipeline(transaction=False) as pipe:  # one round trip; the SET runs first
        pipe.set(key, json.dumps(payload), px=RESULT_TTL_MS)
        pipe.publish(channel, wake)
        pipe.execute()


def load_pool(worker: WorkerState, model_id: str, token: str) -> dict | None:
    """Build ``model_id``'s pool as the single loader holding ``token`` (R4.2); record the outcome.

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
    except Exception as exc:
        error = f"{type(exc).__name__}: {exc}"
        log.exception("loading %s failed", model_id)
    duration_ms = int((time.monotonic() - started) * 1000)
    ok = not error
    outcome = LoadEnd.READY if ok else LoadEnd.FAILED
    if scheduler.finish_load(model_id, token, outcome, host, worker.boot, error, capacity) is LoadOutcome.STALE:
        # Our claim was replaced or abandoned (an unload, a takeover): publish nothing.
        if built is not None:
            worker.discard(model_id, built)
        ok, error = False, "the load was abandoned or superseded"
        log.info("load of %s (token %s) finished after its claim was gone; discarded", model_id, token)
    try:
        records.registration_record_load(model_id, ok, error=error, duration_ms=duration_ms, actor=host)
    except Exception:
        log.exception("recording a load outcome failed")
    metrics.record_sync(sync_redis(), metrics.count(metrics.MODEL_LOADS, model_id, "ok" if ok else "failed"),
                        metrics.observe(metrics.MODEL_LOAD, duration_ms / 1000, model_id))
    payload: dict = {"ok": True, "owner": worker.hostname, "boot": worker.boot} if ok else {"ok": False, "error": error}
    payload["duration_ms"] = duration_ms
    return payload


def run_request(worker: WorkerState, pool: Pool, model_id: str, request_id: str, lease_id: str,
                sample_rate_hz: int, options: dict) -> dict:
    """Serve one request on ``pool`` under ``lease_id``, renewing it, and release the lease on every path.

    Args:
        request_id: its samples wait in ``Keys.input(request_id)`` (float32, see ``inference.audio.to_bytes``).
        sample_rate_hz: their rate.
        options: the request's validated options, overlaid on the pool's defaults.

    Returns:
        ``{"ok": true, "result", "slot", "inference_ms", "worker"}`` or
        ``{"ok": false, "kind": "invalid_input"|"expired"|"error", "message"[, "param"]}``.
    """
    scheduler = sync_scheduler()
    try:
        with scheduler.keep_alive(model_id, lease_id):
            return _run(worker, pool, request_id, sample_rate_hz, options)
    except Exception as exc:  # a bug in an adapter: report it, keep the worker
        log.exception("run of %s failed", model_id)
        return {"ok": False, "kind": RunFailure.ERROR, "message": f"{type(exc).__name__}: {exc}"}
    finally:
        scheduler.release(model_id, lease_id)


def _run(worker: WorkerState, pool: Pool, request_id: str, sample_rate_hz: int, options: dict) -> dict:
    raw = sync_redis_bytes().getdel(KEYS.input(request_id))
    if raw is None:
        return {"ok": False, "kind": RunFailure.EXPIRED, "message": "the request's input expired before it ran"}
    request = AudioRequest(audio.from_bytes(raw), sample_rate_hz, {**pool.request_defaults, **options})
    del raw
    with pool.slot() as slot:
        started = time.monotonic()
        try:
            result = pool.sessions[slot].run(request)
        except InvalidInput as exc:
            return {"ok": False, "kind": RunFailure.INVALID_INPUT, "message": str(exc), "param": exc.param}
        inference_ms = (time.monotonic() - started) * 1000
    return {"ok": True, "result": result, "slot": slot, "inference_ms": round(inference_ms, 3),
            "worker": worker.hostname}


def record_inference(model_id: str, payload: dict) -> None:
    """Observe a served run's ``inference_ms`` in ``audiosite_inference_seconds`` (after its reply was sent,
    so the answer never waits for it); failed runs are not observed."""
    if payload.get("ok"):
        metrics.record_sync(sync_redis(), metrics.observe(metrics.INFERENCE, payload["inference_ms"] / 1000, model_id))


def push_frame(channel: str, request_id: str, frame: bytes) -> None:
    """Append one frame to a streamed run's ``Keys.chunks`` list (TTL ``RESULT_TTL_MS``) and wake its reader
    with ``chunk:<request_id>`` on ``channel`` (one round trip)."""
    key = KEYS.chunks(request_id)
    with sync_redis_bytes().pipeline(transaction=False) as pipe:
        pipe.rpush(key, frame)
        pipe.pexpire(key, RESULT_TTL_MS)
        pipe.publish(channel, f"chunk:{request_id}")
        pipe.execute()


def end_frame(payload: dict) -> bytes:
    """The last frame of a streamed run: ``e`` + the JSON reply (see :func:`stream_speech`)."""
    return b"e" + json.dumps(payload).encode()


def stream_speech(worker: WorkerState, pool: Pool, header: dict) -> None:
    """Synthesise ``header["text"]`` sentence by sentence, pushing each as a frame as soon as it exists.

    Frames (``Keys.chunks``): ``a`` + s16le mono PCM at the model's rate per
    sentence, then one end frame ``e`` + ``{"ok": true, "slot", "inference_ms",
    "worker", "sentences", "phonemes", "samples", "stopped"}`` or a failure
    ``{"ok": false, "kind", "message"[, "param"]}`` (kinds as ``run_request``).

    The lease stays with the web process, which renews it for the whole
    stream (the slot is held until the last byte is written, R8.3); this
    thread never renews or releases it. After every sentence it stops early
    when the web set ``Keys.stop`` (its client left) or the web process's
    liveness key is gone (it died): at most one sentence is made for nobody.
    """
    request_id, channel = header["request_id"], header["channel"]
    stop_key, web_live_key = KEYS.stop(request_id), Keys.process_live(channel)
    client = sync_redis_bytes()
    final: dict
    try:
        request = TextRequest(header["text"], {**pool.request_defaults, **header["options"]})
        with pool.slot() as slot:
            started = time.monotonic()
            sentences = phonemes = samples = 0
            stopped = False
            for sentence in pool.sessions[slot].stream(request):
                pcm = np.round(np.clip(sentence.samples, -1.0, 1.0) * 32767).astype("<i2")
                push_frame(channel, request_id, b"a" + pcm.tobytes())
                sentences, phonemes, samples = sentences + 1, phonemes + sentence.phonemes, samples + pcm.size
                with client.pipeline(transaction=False) as pipe:
                    left, web_alive = pipe.exists(stop_key).exists(web_live_key).execute()
                stopped = bool(left) or not web_alive
                if stopped:
                    break
            final = {"ok": True, "slot": slot, "inference_ms": round((time.monotonic() - started) * 1000, 3),
                     "worker": worker.hostname, "sentences": sentences, "phonemes": phonemes,
                     "samples": samples, "stopped": stopped}
    except InvalidInput as exc:
        final = {"ok": False, "kind": RunFailure.INVALID_INPUT, "message": str(exc), "param": exc.param}
    except Exception as exc:  # a bug in an adapter: report it, keep the worker
        log.exception("speech stream of %s failed", header["model_id"])
        final = {"ok": False, "kind": RunFailure.ERROR, "message": f"{type(exc).__name__}: {exc}"}
    push_frame(channel, request_id, end_frame(final))
    record_inference(header["model_id"], final)


def destroy_pool(worker: WorkerState, model_id: str) -> dict:
    """Unpublish and close this worker's pool of ``model_id`` (sessions, then weights; R4.5).

    Returns:
        ``{"ok": bool, "had_pool": bool, "duration_ms": int[, "error"]}``; ``error`` when closing raised.
    """
    started = time.monotonic()
    pool = worker.remove(model_id)
    payload: dict = {"ok": True, "had_pool": pool is not None}
    if pool is not None:
        try:
            pool.close()
        except Exception as exc:
            log.exception("closing the pool of %s failed", model_id)
            payload.update(ok=False, error=f"{type(exc).__name__}: {exc}")
    payload["duration_ms"] = int((time.monotonic() - started) * 1000)
    return payload

