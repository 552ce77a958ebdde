"""What the worker does for each task: load a pool, run one request, destroy a pool.

Outcomes are written to a Redis reply key with a TTL, then announced on the
caller's process channel (see ``inference.runtime.loads`` and ``inference.runtime.runs``). The worker renews
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
from inference.adapters.base import AudioRequest, Cancelled, InvalidInput, TextRequest, segment_delta
from inference.adapters.fixture_barrier import make_barrier
from inference.runtime import metrics
from inference.runtime.context import KEYS, redis_url, sync_redis, sync_redis_bytes, sync_scheduler
from inference.runtime.runs import RunFailure
from inference.scheduler import Keys, LoadEnd, LoadOutcome
from registry import records

from .state import Pool, WorkerState

log = logging.getLogger(__name__)


INPUT_EXPIRED = {"ok": False, "kind": RunFailure.EXPIRED, "message": "the request's input expired before it ran"}
"""The reply of a run whose input key was gone when the worker took it."""


def failure(exc: Exception, what: str) -> dict:
    """The failure reply of a run that raised ``exc``: the adapter refused its input (``invalid_input``,
    a 400 naming ``param``), stopped because its client left (``cancelled``: nobody reads the reply),
    or anything else (``error``: a bug, logged as ``what`` failed)."""
    if isinstance(exc, InvalidInput):
        return {"ok": False, "kind": RunFailure.INVALID_INPUT, "message": str(exc), "param": exc.param}
    if isinstance(exc, Cancelled):
        log.info("%s stopped: %s", what, exc)
        return {"ok": False, "kind": RunFailure.CANCELLED, "message": str(exc)}
    log.exception("%s failed", what)
    return {"ok": False, "kind": RunFailure.ERROR, "message": f"{type(exc).__name__}: {exc}"}

RESULT_TTL_MS = 300000  # a result waits 5 min for its reader

INLINE_REPLY_MAX_CHARS = 8192
"""A reply of at most this many characters of JSON is also carried in its wake-up message (a VAD
result or a short transcript; longer ones are read from their key)."""

INLINE_REPLY_TTL_MS = 30000
"""How long the reply key of an inline reply stays (ms), for a waiter whose wake-up message was
lost (a dropped subscription): it looks within ``inference.runtime.loads.LIVENESS_CHECK_S``, then at
least every liveness TTL (10 s). The reader does not delete it: at 100 short requests per second
about 3,000 keys of a few hundred bytes stay in Redis."""


def reply(channel: str, key: str, wake: str, payload: dict, release: tuple[str, str] | None = None,
          inline: bool = False) -> None:
    """Store ``payload`` (JSON) at ``key`` for ``RESULT_TTL_MS`` and publish ``wake`` on ``channel``.

    Args:
        release: ``(model_id, lease_id)``: release that lease first, in the same round trip
            (a run's end: its slot is free before its sender wakes).
        inline: a run's reply (``wake`` is ``done:<request id>``), see :func:`reply_run`.

    Raises:
        redis.RedisError: the SET or the PUBLISH failed (a failed release is retried alone first).
    """
    if inline:
        reply_run(channel, wake, payload, release)
        return
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


def reply_run(channel: str, wake: str, payload: dict, release: tuple[str, str] | None = None) -> None:
    """Answer a run (``wake`` = ``done:<request id>``) in one step with the check of its stop marker
    (``Scheduler.run_reply``, R8.2): ``release`` (``(model_id, lease_id)``) is released first; when the
    run's client left (``inference.runtime.runs.run_reply`` marked it), nothing is stored (no reply
    key waits for its TTL) and a ``not_loaded`` payload (a run this worker never took) gives the
    sender's lease and input back. Otherwise the reply is stored at ``Keys.result`` and announced:
    one of at most ``INLINE_REPLY_MAX_CHARS`` rides in the wake-up (``wake + "\n" + payload``; the
    reader then needs no GET) and its key stays ``INLINE_REPLY_TTL_MS`` only, for a waiter whose
    wake-up was lost; a longer one is read from its key (``RESULT_TTL_MS``).

    Raises:
        redis.RedisError: the script failed (the caller releases the lease on that path).
    """
    text = json.dumps(payload)
    short = len(text) <= INLINE_REPLY_MAX_CHARS
    sync_scheduler().run_reply(wake.removeprefix("done:"), channel, text, f"{wake}\n{text}" if short else wake,
                               INLINE_REPLY_TTL_MS if short else RESULT_TTL_MS, release,
                               taken=payload.get("kind") != RunFailure.NOT_LOADED)


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
        # nothing: one writer per step (issue 8 item 2).
        if built is not None:
            worker.discard(model_id, built)
        ok, error = False, "the load was abandoned or superseded"
        log.info("load of %s (token %s) finished after its claim was gone; discarded", model_id, token)
    else:
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
                sample_rate_hz: int, options: dict, held: bool = False, sample_format: str = audio.F32LE,
                inline: memoryview | None = None) -> dict:
    """Serve one request on ``pool`` under ``lease_id``, renewing it meanwhile (unless ``held``). The
    caller releases the lease (``reply(..., release=...)`` gives it back in the reply's round trip).

    Args:
        request_id: its samples wait in ``Keys.input(request_id)`` (see ``inference.audio.to_bytes``).
        sample_rate_hz: their rate.
        sample_format: their format (``inference.audio.F32LE`` or ``S16LE``).
        inline: the samples themselves, when they came inside the run queue element
            (``inference.runtime.runs.inline_element``): nothing is read from Redis.
        options: the request's validated options, overlaid on the pool's defaults.
        held: the sender keeps (renews and releases) the lease itself: one decode of a live
            transcription turn, whose lease spans several runs (``inference.realtime``). The
            worker then neither renews nor releases it.

    Returns:
        ``{"ok": true, "result", "slot", "inference_ms", "worker"}`` or
        ``{"ok": false, "kind": "invalid_input"|"expired"|"error", "message"[, "param"]}``.
    """
    try:
        if held:
            return _run(worker, pool, request_id, sample_rate_hz, options, sample_format, inline)
        with sync_scheduler().keep_alive(model_id, lease_id):
            return _run(worker, pool, request_id, sample_rate_hz, options, sample_format, inline)
    except Exception as exc:  # the adapter refused the input (a 400), or a bug in it: report it, keep the worker
        return failure(exc, f"run of {model_id}")


def _run(worker: WorkerState, pool: Pool, request_id: str, sample_rate_hz: int, options: dict,
         sample_format: str, inline: memoryview | None) -> dict:
    raw = inline if inline is not None else sync_redis_bytes().getdel(KEYS.input(request_id))
    if raw is None:
        return dict(INPUT_EXPIRED)
    request = AudioRequest(audio.from_bytes(raw, sample_format), sample_rate_hz, {**pool.request_defaults, **options},
                           cancelled=left_checker(request_id))
    del raw
    with pool.slot() as slot:
        started = time.monotonic()
        result = pool.sessions[slot].run(request)  # InvalidInput: run_request's failure() answers it
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
                stopped = _stopped(client, stop_key, web_live_key)
                if stopped:
                    break
            final = {"ok": True, "slot": slot, "inference_ms": round((time.monotonic() - started) * 1000, 3),
                     "worker": worker.hostname, "sentences": sentences, "phonemes": phonemes,
                     "samples": samples, "stopped": stopped}
    except Exception as exc:  # refused input, or a bug in an adapter: report it, keep the worker
        final = failure(exc, f"speech stream of {header['model_id']}")
    push_frame(channel, request_id, end_frame(final))
    record_inference(header["model_id"], final)


CANCEL_CHECK_EVERY_S = 0.1
"""How often (s) at most a run's ``cancelled()`` asks Redis whether its client left; asked more often,
it answers the last look (an adapter may ask per small step)."""


def left_checker(request_id: str):
    """``AudioRequest.cancelled`` of run ``request_id``: a callable that is True once the web set
    ``Keys.stop(request_id)`` (the run's client left, ``inference.runtime.runs.run_reply``). It looks
    at most every ``CANCEL_CHECK_EVERY_S`` and never raises (a failed look counts as "still wanted":
    the run goes on, as it would without the marker)."""
    client = sync_redis_bytes()
    stop_key = KEYS.stop(request_id)
    state = {"at": 0.0, "left": False}

    def cancelled() -> bool:
        now = time.monotonic()
        if state["left"] or now - state["at"] < CANCEL_CHECK_EVERY_S:
            return bool(state["left"])
        state["at"] = now
        try:
            state["left"] = bool(client.exists(stop_key))
        except Exception:  # redis.RedisError: keep running; the watchdogs cover a lost Redis
            log.warning("could not look for %s's stop marker", request_id, exc_info=True)
        return bool(state["left"])
    return cancelled


def _stopped(client, stop_key: str, web_live_key: str) -> bool:
    """True when the web process asked a stream to stop (``Keys.stop``) or its liveness key is gone."""
    with client.pipeline(transaction=False) as pipe:
        left, web_alive = pipe.exists(stop_key).exists(web_live_key).execute()
    return bool(left) or not web_alive


def stream_transcription(worker: WorkerState, pool: Pool, header: dict) -> None:
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
    request_id, channel = header["request_id"], header["channel"]
    stop_key, web_live_key = KEYS.stop(request_id), Keys.process_live(channel)
    client = sync_redis_bytes()
    final: dict
    try:
        raw = client.getdel(KEYS.input(request_id))
        if raw is None:
            final = dict(INPUT_EXPIRED)
        else:
            request = AudioRequest(audio.from_bytes(raw, header.get("sample_format", audio.F32LE)),
                                   int(header["sample_rate_hz"]),
                                   {**pool.request_defaults, **header["options"]})
            del raw
            with pool.slot() as slot:
                started = time.monotonic()
                stream = pool.sessions[slot].stream(request)
                text, count, stopped = "", 0, False
                for segment in stream:
                    segment.pop("words", None)
                    delta = segment_delta(text, segment["text"])
                    text += delta
                    count += 1
                    push_frame(channel, request_id, b"j" + json.dumps({"delta": delta, "segment": segment}).encode())
                    stopped = _stopped(client, stop_key, web_live_key)
                    if stopped:
                        break
                final = {"ok": True, "text": text, "language": stream.language, "duration": stream.duration_s,
                         "segments": count, "slot": slot,
                         "inference_ms": round((time.monotonic() - started) * 1000, 3),
                         "worker": worker.hostname, "stopped": stopped}
    except Exception as exc:  # refused input, or a bug in an adapter: report it, keep the worker
        final = failure(exc, f"transcription stream of {header['model_id']}")
    push_frame(channel, request_id, end_frame(final))


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

