"""One run on a pool, in the process that holds the pool: read its input, run the session, return its reply.

Django-free (no database, no Celery): this runs inside a model's own process
(``inference.worker.pool_process``) or, with ``model_processes`` off, in the
worker process. Whoever calls :func:`execute` sends the reply, releases the
lease and pushes a stream's end frame (``inference.worker.work``): one writer
per run. A streamed run pushes its data frames itself (``push_frame``), so
a stream's audio never crosses a process boundary twice.

Kinds of run (``execute(kind, ...)``): ``run`` (one audio request, the reply
of ``work.run_request``), ``speech`` (``work.stream_speech``: sentences of PCM
frames), ``transcription`` (``work.stream_transcription``: segments).
"""
from __future__ import annotations

import json
import logging
import time
from typing import Any

import numpy as np

from inference import audio
from inference.adapters.base import AudioRequest, Cancelled, InvalidInput, TextRequest, segment_delta
from inference.runtime.context import KEYS, sync_redis_bytes
from inference.runtime.runs import RunFailure
from inference.scheduler import Keys

log = logging.getLogger(__name__)

RUN = "run"
SPEECH = "speech"
TRANSCRIPTION = "transcription"

INPUT_EXPIRED = {"ok": False, "kind": RunFailure.EXPIRED, "message": "the request's input expired before it ran"}
"""The reply of a run whose input key was gone when the worker took it."""

RESULT_TTL_MS = 300000  # a result waits 5 min for its reader

CANCEL_CHECK_EVERY_S = 0.1
"""How often (s) at most a run's ``cancelled()`` asks Redis whether its client left; asked more often,
it answers the last look (an adapter may ask per small step)."""


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


def execute(pool: Any, kind: str, header: dict, inline: Any = None) -> dict:
    """Serve one run of ``kind`` on ``pool`` (an ``inference.worker.pool.Pool``) and return its reply.

    Args:
        header: the run header (``inference.runtime.runs.run_header``, or a stream's header).
        inline: the samples, when they came inside the run queue element (bytes-like), else None
            (they wait in ``Keys.input(request_id)``).

    Returns:
        ``run``: ``{"ok": true, "result", "slot", "inference_ms"}`` or ``{"ok": false, "kind",
        "message"[, "param"]}``; ``speech`` / ``transcription``: the end frame's payload (see
        ``work.stream_speech`` / ``work.stream_transcription``). Never raises for an adapter's failure.
    """
    what = f"{kind} of {header['model_id']}"
    try:
        if kind == SPEECH:
            return stream_speech(pool, header)
        if kind == TRANSCRIPTION:
            return stream_transcription(pool, header)
        return run_audio(pool, header, inline)
    except Exception as exc:  # the adapter refused the input (a 400), or a bug in it: report it, keep going
        return failure(exc, what)


def run_audio(pool: Any, header: dict, inline: Any) -> dict:
    """One audio request (kind ``run``): its samples from ``inline`` or ``Keys.input`` (read and deleted)."""
    request_id = header["request_id"]
    raw = inline if inline is not None else sync_redis_bytes().getdel(KEYS.input(request_id))
    if raw is None:
        return dict(INPUT_EXPIRED)
    request = AudioRequest(audio.from_bytes(raw, header.get("sample_format", audio.F32LE)),
                           int(header["sample_rate_hz"]), {**pool.request_defaults, **header["options"]},
                           cancelled=left_checker(request_id))
    del raw
    with pool.slot() as slot:
        started = time.monotonic()
        result = pool.sessions[slot].run(request)  # InvalidInput: execute's failure() answers it
        inference_ms = (time.monotonic() - started) * 1000
    return {"ok": True, "result": result, "slot": slot, "inference_ms": round(inference_ms, 3)}


BATCH = "batch"
"""The kind of a batched run on a model's pipe: several ``run`` headers served in one session call
(:func:`execute_batch`)."""


def execute_batch(pool: Any, headers: list[dict], inlines: list[Any]) -> list[dict]:
    """Serve several ``run`` requests of one model in one session call; one reply per header, in order.

    Each request's input is read as :func:`run_audio` reads it; one whose input is gone answers
    ``INPUT_EXPIRED`` alone. The others go through the session's ``run_batch`` (requests in, one result
    dict or exception per request out; see ``inference.adapters.silero_vad.VadSession.run_batch``), or,
    for a session without one, through ``run`` one after the other on the same slot. A request whose
    run raised gets its own failure reply (:func:`failure`: ``invalid_input``, ``cancelled``, ``error``)
    while the others are answered normally. Every reply of a served request carries the batch's
    ``slot``, its ``inference_ms`` (the whole call's) and ``batch`` (how many requests the call served).

    Args:
        headers: run headers (``inference.runtime.runs.run_header``) of the same model.
        inlines: per header, its samples (bytes-like) or None (they wait in ``Keys.input``).
    """
    replies: list[dict | None] = [None] * len(headers)
    requests: list[AudioRequest] = []
    places: list[int] = []
    for place, (header, inline) in enumerate(zip(headers, inlines, strict=True)):
        try:
            raw = inline if inline is not None else sync_redis_bytes().getdel(KEYS.input(header["request_id"]))
            if raw is None:
                replies[place] = dict(INPUT_EXPIRED)
                continue
            requests.append(AudioRequest(audio.from_bytes(raw, header.get("sample_format", audio.F32LE)),
                                         int(header["sample_rate_hz"]), {**pool.request_defaults, **header["options"]},
                                         cancelled=left_checker(header["request_id"])))
            places.append(place)
        except Exception as exc:
            replies[place] = failure(exc, f"run of {header['model_id']}")
    if requests:
        with pool.slot() as slot:
            session = pool.sessions[slot]
            started = time.monotonic()
            if hasattr(session, "run_batch"):
                try:
                    results = session.run_batch(requests)
                except Exception as exc:  # the batch call itself failed: every member gets the failure
                    results = [exc] * len(requests)
            else:
                results = []
                for request in requests:
                    try:
                        results.append(session.run(request))
                    except Exception as exc:
                        results.append(exc)
            inference_ms = round((time.monotonic() - started) * 1000, 3)
        for place, result in zip(places, results, strict=True):
            if isinstance(result, Exception):
                replies[place] = failure(result, f"run of {headers[place]['model_id']}")
            else:
                replies[place] = {"ok": True, "result": result, "slot": slot, "inference_ms": inference_ms,
                                  "batch": len(requests)}
    return [reply if reply is not None else dict(INPUT_EXPIRED) for reply in replies]


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
    """The last frame of a streamed run: ``e`` + the JSON reply (see ``work.stream_speech``)."""
    return b"e" + json.dumps(payload).encode()


def stream_speech(pool: Any, header: dict) -> dict:
    """Synthesise ``header["text"]`` sentence by sentence, pushing each as an ``a`` frame (s16le mono PCM
    at the model's rate) as soon as it exists; returns the end frame's payload ``{"ok": true, "slot",
    "inference_ms", "sentences", "phonemes", "samples", "stopped"}``. Stops after the sentence during
    which its web process asked it to (``Keys.stop``) or died (its liveness key is gone)."""
    request_id, channel = header["request_id"], header["channel"]
    stop_key, web_live_key = KEYS.stop(request_id), Keys.process_live(channel)
    client = sync_redis_bytes()
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
        return {"ok": True, "slot": slot, "inference_ms": round((time.monotonic() - started) * 1000, 3),
                "sentences": sentences, "phonemes": phonemes, "samples": samples, "stopped": stopped}


def stream_transcription(pool: Any, header: dict) -> dict:
    """Transcribe ``Keys.input(request_id)`` segment by segment, pushing a ``j`` frame ``{"delta",
    "segment"}`` per segment; returns the end frame's payload ``{"ok": true, "text", "language",
    "duration" (s), "segments" (count), "slot", "inference_ms", "stopped"}`` (``INPUT_EXPIRED`` when the
    input is gone). Stops early as :func:`stream_speech` does."""
    request_id, channel = header["request_id"], header["channel"]
    stop_key, web_live_key = KEYS.stop(request_id), Keys.process_live(channel)
    client = sync_redis_bytes()
    raw = client.getdel(KEYS.input(request_id))
    if raw is None:
        return dict(INPUT_EXPIRED)
    request = AudioRequest(audio.from_bytes(raw, header.get("sample_format", audio.F32LE)),
                           int(header["sample_rate_hz"]), {**pool.request_defaults, **header["options"]})
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
        return {"ok": True, "text": text, "language": stream.language, "duration": stream.duration_s,
                "segments": count, "slot": slot, "inference_ms": round((time.monotonic() - started) * 1000, 3),
                "stopped": stopped}


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
