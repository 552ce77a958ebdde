"""Inference routes: ``POST /v1/audio/transcriptions`` (and ``/details``), ``POST /v1/audio/speech``,
``GET /v1/audio/voices`` and ``POST /v1/tasks/run``.

Views only translate HTTP to the runtime and back (async: a waiting request
holds no thread): the length check, the input serializer
(``inference.serializers``; its first problem becomes a 400 naming the field
path in ``param``), the checks that need the model, then the service. Field
and option problems are refused before any ticket is taken, and so are audio
problems the container's header shows (the service reads it first); the
audio itself is decoded by the service once the request holds its slot (a
refusal costs no decoding, a queued request holds only its upload), and
audio that then fails to decode gives the lease back with its 400/415.
"""
from __future__ import annotations

import asyncio
import base64
import json
import logging
import os
import time
from collections.abc import Callable
from pathlib import Path

from audiosite.http.apiview import APIView
from django.http import HttpResponse, StreamingHttpResponse
import redis.exceptions
from rest_framework.exceptions import ParseError
from rest_framework.negotiation import BaseContentNegotiation, DefaultContentNegotiation
from rest_framework.response import Response

from audiosite.drain import DRAIN, DrainExpired, refusal
from audiosite.errors import (
    ApplicationError,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    RedisUnavailable,
    ServerBusy,
)
from audiosite.serverconfig import MAX_BUSY_TIMEOUT_MS, get_config
from audiosite.input_checks import check_length, validated
from inference import audio, services, specs, voices
from inference.runtime import metrics
from inference.runtime.context import AsyncContext, async_context
from inference.scheduler import AdmissionProbe

from .serializers import (
    DetailsInputSerializer,
    SpeechInputSerializer,
    TaskRunInputSerializer,
    TranscriptionInputSerializer,
)

log = logging.getLogger(__name__)


def _data(request):
    """The parsed body (a JSON value or a multipart form); its shape is the serializer's check.

    Django's own refusals while parsing (too many form fields or files) propagate as
    ``SuspiciousOperation`` and are rendered by ``audiosite.errors.drf_exception_handler``.
    """
    try:
        return request.data
    except ParseError as exc:
        raise InvalidRequest(f"malformed request body: {exc.detail}") from None
    except (RecursionError, UnicodeDecodeError):
        raise InvalidRequest("malformed request body: nested too deeply or not UTF-8") from None


class EarlyProbe:
    """The admission probe of a request, sent before its body is validated, so that the round trip
    runs while the serializer works (base64 decoding included).

    Sent only when its answer cannot depend on validation: the body names its ``model`` as a string,
    and its ``busy_timeout_ms`` is either a JSON integer in range at the top of the body (which
    takes precedence over the query string and ``request.busy_timeout_ms``) or sent nowhere (not
    at the top, not in ``request``, not in the query string: None). :func:`_model` uses it when the
    validated model id and timeout are the ones probed; a probe nobody uses (the body was refused)
    is awaited by nobody and its outcome dropped. The probe reads and reserves nothing.
    """

    def __init__(self, model_id: str, timeout_ms: int | None):
        self.model_id = model_id
        self.timeout_ms = timeout_ms
        self.task = asyncio.ensure_future(self._probe(model_id, timeout_ms))
        self.task.add_done_callback(_drop_outcome)

    @staticmethod
    async def _probe(model_id: str, timeout_ms: int | None) -> tuple[AsyncContext, AdmissionProbe]:
        ctx = await async_context()
        return ctx, await services.request_probe(ctx, model_id, timeout_ms)

    @staticmethod
    def what_to_probe(body, query_params) -> tuple[str, int | None] | None:
        """``(model id, busy_timeout_ms)`` an early probe may be sent for, given ``body`` (a parsed JSON
        value or form) and the query string, or None when the request needs validating first (class doc)."""
        if not hasattr(body, "get"):
            return None
        model_id, nested = body.get("model"), body.get("request")
        if not isinstance(model_id, str) or not model_id:
            return None
        if TIMEOUT_FIELD in body:
            timeout_ms = body[TIMEOUT_FIELD]
            if type(timeout_ms) is int and 0 <= timeout_ms <= MAX_BUSY_TIMEOUT_MS:
                return model_id, timeout_ms
            return None
        if TIMEOUT_FIELD in query_params or (hasattr(nested, "get") and TIMEOUT_FIELD in nested):
            return None
        return model_id, None

    @classmethod
    async def start(cls, body, query_params) -> EarlyProbe | None:
        """An early probe for the request (:meth:`what_to_probe`), or None.

        Yields to the event loop once, so that the probe's task sends its command before the caller
        goes on with the (synchronous) validation: its round trip then runs meanwhile.
        """
        found = cls.what_to_probe(body, query_params)
        if found is None:
            return None
        early = cls(*found)
        await asyncio.sleep(0)
        return early


TIMEOUT_FIELD = "busy_timeout_ms"


def _drop_outcome(task: asyncio.Task) -> None:
    """Mark an early probe's exception as retrieved (its view may have refused the body first)."""
    if not task.cancelled():
        task.exception()


async def _model(model_id: str, request_timeout_ms: int | None,
                 view: APIView | None = None,
                 early: EarlyProbe | None = None) -> tuple[dict, AsyncContext, AdmissionProbe]:
    """``(meta, ctx, probe)``: the published metadata of ``model_id`` (checked by an input serializer),
    the context, and the admission probe that found it (``services.request_run``'s ``probe``).

    Args:
        view: a view counted in the metrics: its ``metrics_model`` becomes ``model_id`` once the
            model is known to be registered (an unknown id never becomes a label value).
        early: the request's :class:`EarlyProbe`, used when it probed this model with this timeout.

    Raises:
        NotFound: ``model_id`` is not registered (404, ``param`` "model").
        ServerBusy: the model would refuse the request at once (overdue fail-fast, R3.3).
    """
    try:
        if early is not None and (early.model_id, early.timeout_ms) == (model_id, request_timeout_ms):
            ctx, probe = await early.task
        else:
            ctx = await async_context()
            probe = await services.request_probe(ctx, model_id, request_timeout_ms)
    except ServerBusy:  # a refusal of a registered model
        if view is not None:
            view.metrics_model = model_id
        raise
    meta = probe.entry
    assert meta is not None  # request_probe refuses a missing entry
    if view is not None:
        view.metrics_model = meta["id"]
    return meta, ctx, probe


def _read_local(path_value: str, param: str) -> bytes:
    """Bytes of a server-local file that lies inside a configured media root.

    Args:
        path_value: a path of plain text (checked by the input serializer).
        param: its field path, for errors.

    Raises:
        InvalidRequest: no ``media_roots``, a path outside them, not a readable file (400).
        PayloadTooLarge: a file over ``max_request_body_bytes`` (413).
    """
    config = get_config()
    if not config.media_roots:
        raise InvalidRequest("server-local paths are disabled (no media_roots configured)", param=param)
    try:
        resolved = Path(os.path.realpath(path_value))
        roots = [Path(os.path.realpath(root)) for root in config.media_roots]
        if not any(resolved.is_relative_to(root) for root in roots):
            raise InvalidRequest(f"{path_value!r} is outside the configured media_roots", param=param)
        if not resolved.is_file():
            raise InvalidRequest(f"{path_value!r} is not a readable file", param=param)
        if resolved.stat().st_size > config.max_request_body_bytes:
            raise PayloadTooLarge(f"{path_value!r} exceeds max_request_body_bytes={config.max_request_body_bytes}")
        return resolved.read_bytes()
    except (OSError, ValueError) as exc:
        raise InvalidRequest(f"{param} cannot be read: {type(exc).__name__}", param=param) from None




def _check_options(family: str, options: dict, param_of: Callable[[list[str]], str | None]) -> None:
    """Refuse model options that the family's ``request_options`` schema rejects.

    Args:
        param_of: the field path of the option at the given keys inside ``options``.

    Raises:
        InvalidRequest: 400, one ``key '<field path>': <schema message>`` per problem;
            ``param`` is the field path of the first.
    """
    errors = specs.request_option_errors(family, options)
    if errors:
        params = [param_of(keys) for keys, _message in errors]
        message = "; ".join(f"key {param or 'options'!r}: {text}"
                            for param, (_keys, text) in zip(params, errors, strict=True))
        raise InvalidRequest(message, param=params[0])


def _timing(started: float, outcome: services.Outcome) -> dict:
    """``timing`` of a response: wall time, audio duration, real-time factor
    (wall ÷ audio), and the queue / load / inference parts, all in ms."""
    wall_ms = (time.monotonic() - started) * 1000
    audio_ms = outcome.audio_ms
    metrics.timing_note(queue_ms=outcome.queue_ms, run_ms=outcome.inference_ms)  # the UI's activity row
    return {"wall_ms": round(wall_ms, 3), "audio_duration_ms": round(audio_ms, 3),
            "rtf": round(wall_ms / audio_ms, 4) if audio_ms else None,
            "queue_ms": round(outcome.queue_ms, 3), "load_ms": round(outcome.load_ms, 3),
            "inference_ms": outcome.inference_ms}


def _stamp(seconds: float, sep: str) -> str:
    ms = int(round(seconds * 1000))
    hours, ms = divmod(ms, 3600000)
    minutes, ms = divmod(ms, 60000)
    secs, ms = divmod(ms, 1000)
    return f"{hours:02d}:{minutes:02d}:{secs:02d}{sep}{ms:03d}"


def subtitles(segments: list[dict], kind: str) -> str:
    """SRT or WebVTT text from segments with ``start``/``end`` in seconds."""
    blocks = []
    sep = "," if kind == "srt" else "."
    for index, seg in enumerate(segments, start=1):
        times = f"{_stamp(seg['start'], sep)} --> {_stamp(seg['end'], sep)}"
        blocks.append(f"{index}\n{times}\n{seg['text']}\n" if kind == "srt" else f"{times}\n{seg['text']}\n")
    body = "\n".join(blocks)
    return body if kind == "srt" else "WEBVTT\n\n" + body


class IgnoreAccept(BaseContentNegotiation):
    """Content negotiation that never refuses: the SDK sends ``Accept: application/octet-stream`` for
    every speech request (also for sse), and SSE clients send ``Accept: text/event-stream``, so the
    body's type follows the request's fields only (API.md) and errors are always JSON."""

    def select_parser(self, request, parsers):
        return DefaultContentNegotiation().select_parser(request, parsers)

    def select_renderer(self, request, renderers, format_suffix=None):
        return renderers[0], renderers[0].media_type


class TranscriptionApi(APIView):
    """``POST /v1/audio/transcriptions`` (OpenAI-compatible; input: :class:`TranscriptionInputSerializer`).

    Responds ``{"text", "timing"}`` (json), plain text (text, srt, vtt), or
    verbose_json with ``task, language, duration, segments`` (s) and ``words``.

    With ``stream=true`` (form field or JSON): ``text/event-stream`` of one
    ``transcript.text.delta`` event per decoded segment as the worker decodes
    it, then ``transcript.text.done`` with the whole ``text`` (equal to the
    concatenated deltas and to the non-streamed text) and ``usage``
    ``{"type": "duration", "seconds"}``; ``response_format`` does not change
    the events. A failure after the headers is an ``error`` event, then the
    stream ends; no ``[DONE]`` line. The slot is held until the stream ends
    or the client leaves (R8.3).

    Raises:
        InvalidRequest: bad input, a model of another task, options the model refuses (400).
        NotFound: unknown model (404). PayloadTooLarge (413), UnsupportedMedia (415): see
            ``inference.services.audio_inspect`` and ``audio_decode``.
        ServerBusy: from the runtime (503), ``decode_budget`` included.
    """

    content_negotiation_class = IgnoreAccept  # SSE clients send Accept: text/event-stream
    counts_requests = True

    async def post(self, request):
        started = time.monotonic()
        check_length(request)
        body = _data(request)
        early = await EarlyProbe.start(body, request.query_params)
        data = validated(TranscriptionInputSerializer(data=body, context={"query_params": request.query_params}))
        meta, ctx, probe = await _model(data["model"], data["busy_timeout_ms"], self, early)
        if meta["task"] != "asr":
            raise InvalidRequest(f"model {meta['id']!r} serves task {meta['task']!r}, not transcription", param="model")
        response_format = data["response_format"]
        options = data["options"]
        _check_options(meta["family"], options, TranscriptionInputSerializer.option_param)
        timeout_ms = data["busy_timeout_ms"]
        param, source = data["source"]
        raw = _read_local(source, param) if isinstance(source, str) else source.read()
        if data["stream"]:
            stream = await services.transcription_open(ctx, meta, services.AudioInput(raw, param), options, timeout_ms)
            del raw
            response = StreamingHttpResponse(_transcription_events(stream), content_type="text/event-stream")
            response["Cache-Control"] = "no-cache"
            return response
        outcome = await services.request_run(ctx, meta, services.AudioInput(raw, param), options, timeout_ms, probe,
                                             answer=True)
        if not outcome.recorded:  # the worker recorded it with the answer otherwise
            metrics.record_soon(metrics.audio(meta["id"], meta["task"], outcome.audio_ms / 1000))
        result = outcome.result
        timing = _timing(started, outcome)
        if response_format == "text":
            return HttpResponse(result["text"], content_type="text/plain; charset=utf-8")
        if response_format in ("srt", "vtt"):
            return HttpResponse(subtitles(result["segments"], response_format),
                                content_type="text/plain; charset=utf-8")
        body = {"text": result["text"], "timing": timing}
        if response_format == "verbose_json":
            body.update(task="transcribe", language=result["language"], duration=result["duration"],
                        segments=result["segments"])
            if "words" in result:
                body["words"] = result["words"]
        return Response(body)


class TranscriptionDetailsApi(APIView):
    """``POST /v1/audio/transcriptions/details`` (input: :class:`DetailsInputSerializer`): a
    transcription with ``segments``, ``words`` (seconds and sample offsets) and ``sample_rate``, and,
    with ``diarization_model``, ``speaker_turns`` and a ``speaker`` on every word and segment.

    Raises:
        InvalidRequest: as :class:`TranscriptionApi`; ``diarization_model`` not a diarization pipeline (400).
        NotFound: unknown ``model`` or ``diarization_model`` (404).
        Conflict: the pipeline's component models are missing or of the wrong family (409).
    """

    async def post(self, request):
        started = time.monotonic()
        check_length(request)
        data = validated(DetailsInputSerializer(data=_data(request), context={"query_params": request.query_params}))
        timeout_ms = data["busy_timeout_ms"]
        meta, ctx, _probe = await _model(data["model"], timeout_ms)
        if meta["task"] != "asr":
            raise InvalidRequest(f"model {meta['id']!r} serves task {meta['task']!r}, not transcription", param="model")
        if data["stream"]:
            raise InvalidRequest("transcription details are not streamed; send stream=false", param="stream")
        pipeline = None
        if data.get("diarization_model"):
            try:
                pipeline = await services.request_model_resolve(ctx, data["diarization_model"], timeout_ms)
            except NotFound:
                raise NotFound(f"model {data['diarization_model']!r} is not registered",
                               param="diarization_model") from None
            if pipeline["task"] != "diarization":
                raise InvalidRequest(f"model {pipeline['id']!r} serves task {pipeline['task']!r}, not diarization",
                                     param="diarization_model")
        options = data["options"]
        _check_options(meta["family"], options, DetailsInputSerializer.option_param)
        param, source = data["source"]
        raw = _read_local(source, param) if isinstance(source, str) else source.read()
        outcome = await services.transcription_with_speakers_run(ctx, meta, pipeline, services.AudioInput(raw, param),
                                                          options, timeout_ms)
        metrics.record_soon(*(metrics.audio(m["id"], m["task"], outcome.audio_ms / 1000)
                              for m in (meta, pipeline) if m))  # the pipeline processed the same audio
        return Response({"model": meta["id"], "diarization_model": pipeline["id"] if pipeline else None,
                         **outcome.result, "timing": _timing(started, outcome)})


class TaskRunApi(APIView):
    """``POST /v1/tasks/run``: generic task input (VAD, ASR, TTS, music transcription, speaker embedding,
    diarization; input: :class:`TaskRunInputSerializer`). A pipeline family (diarization) is served by
    ``inference.services.diarization_run``, every other by ``inference.services.request_run``.

    Responds ``{"model", "task", <the task's outputs>, "timing"}``; errors as :class:`TranscriptionApi`.
    """

    counts_requests = True

    async def post(self, request):
        started = time.monotonic()
        check_length(request)
        body = _data(request)
        early = await EarlyProbe.start(body, request.query_params)
        data = validated(TaskRunInputSerializer(data=body, context={"query_params": request.query_params}))
        meta, ctx, probe = await _model(data["model"], data["busy_timeout_ms"], self, early)
        options = data["request"]["options"]
        _check_options(meta["family"], options, lambda keys: ".".join(["request.options", *keys]))
        timeout_ms = data["busy_timeout_ms"]
        if meta["task"] == "tts":
            return await _task_speech(meta, ctx, data, started)
        if data["request"]["source"] is None:
            raise InvalidRequest(f"model {meta['id']!r} serves task {meta['task']!r}: request needs 'audio' or "
                                 "'audio_base64'", param="request.audio_base64")
        param, source = data["request"]["source"]
        raw = source if isinstance(source, bytes) else _read_local(source, param)
        audio_input = services.AudioInput(raw, param)
        if specs.is_pipeline(meta["family"]):
            outcome = await services.diarization_run(ctx, meta, audio_input, options, timeout_ms)
        else:
            outcome = await services.request_run(ctx, meta, audio_input, options, timeout_ms, probe, answer=True)
        if not outcome.recorded:  # the worker recorded it with the answer otherwise
            metrics.record_soon(metrics.audio(meta["id"], meta["task"], outcome.audio_ms / 1000))
        body = {"model": meta["id"], "task": meta["task"], **outcome.result, "timing": _timing(started, outcome)}
        return Response(body)


def _speech_options(meta: dict, voice: str | None, extra: dict) -> dict:
    """Request options of a speech request: the voice preset's options, then ``extra`` (speed, seed).

    Raises:
        InvalidRequest: an unknown voice (400, ``param`` "voice"; the message names the voices).
    """
    return {**voices.voice_options(meta, voice), **extra}


def _usage(text: str, final: dict | None) -> dict:
    """``usage`` of a finished speech response: input tokens = characters, output tokens = phonemes
    synthesised (Piper has no tokens; these are its nearest units)."""
    output = int((final or {}).get("phonemes", 0))
    return {"input_tokens": len(text), "output_tokens": output, "total_tokens": len(text) + output}


async def _speech_body(stream: services.SpeechStream, fmt: str, sse: bool, text: str):
    """The response body: encoded audio chunks as sentences arrive (or their SSE events); the lease is
    released when the last byte was handed out or the client left (R8.3). At a drain's deadline
    (``audiosite.drain``) an SSE stream ends with an error event (code ``shutting_down``), raw audio ends
    short; the worker stops after its current sentence either way."""
    try:
        encoder = audio.SpeechEncoder(fmt, stream.sample_rate_hz)
        async for pcm in DRAIN.until_expired(_speech_pcm(stream)):
            chunk = encoder.encode(pcm)
            if chunk:
                yield _sse_delta(chunk) if sse else chunk
        tail = encoder.finish()
        if tail:
            yield _sse_delta(tail) if sse else tail
        if sse:
            done = {"type": "speech.audio.done", "usage": _usage(text, stream.final)}
            yield f"data: {json.dumps(done)}\n\n".encode()
    except (ApplicationError, DrainExpired, redis.exceptions.RedisError) as exc:
        # headers are out: an SSE stream ends with an error event; raw audio just ends short (no reset)
        error = _stream_error(exc)
        if sse:
            yield f"data: {json.dumps({'type': 'error', 'error': error.body()['error']})}\n\n".encode()
        elif isinstance(exc, ApplicationError):
            raise
        elif not isinstance(exc, DrainExpired):
            raise error from exc
    finally:
        await stream.aclose()


def _stream_error(exc: BaseException) -> ApplicationError:
    """What ends a stream whose headers are out: ``exc`` itself (an ``ApplicationError``), 503
    ``redis_unavailable`` for a Redis failure (so an SSE client still gets its error event and a
    complete body), or the drain's ``shutting_down`` (``DrainExpired``)."""
    if isinstance(exc, ApplicationError):
        return exc
    if isinstance(exc, redis.exceptions.RedisError):
        log.warning("a stream lost Redis: %s", exc)
        return RedisUnavailable(f"the coordination store (Redis) is unavailable or overloaded: {type(exc).__name__}")
    return refusal("the rest of this stream")


async def _speech_file(stream: services.SpeechStream, fmt: str) -> bytes:
    """The whole body of a speech response sent at once (``flac`` without SSE): every sentence encoded
    into one file whose header states its length (FLAC's STREAMINFO total samples and MD5, filled in at
    the end: ``audio.SpeechEncoder`` ``whole``), so that libsndfile reads it; the lease is released when
    the last sentence arrived or the client left (R8.3). Holds the encoded file until it is sent (at most
    ``MAX_SPEECH_WORK_S`` of audio; FLAC keeps about half of the 16-bit PCM).

    Raises:
        ServerBusy: a drain's deadline passed before the last sentence (``shutting_down``; headers are
            not out yet, so it is an error response, not a short body), or the worker was lost.
        ApplicationError: the adapter failed mid-stream (a bug).
    """
    try:
        encoder = audio.SpeechEncoder(fmt, stream.sample_rate_hz, whole=True)
        async for pcm in DRAIN.until_expired(_speech_pcm(stream)):
            encoder.encode(pcm)
        return encoder.finish()
    except DrainExpired:
        raise refusal("this speech") from None
    finally:
        await stream.aclose()


async def _speech_pcm(stream: services.SpeechStream):
    """``stream.pcm()`` (s16le mono blocks), adding the seconds it synthesised to
    ``audiosite_audio_seconds_total`` once it ends, also when it is cut short (a drain, a client gone)."""
    samples = 0
    try:
        async for pcm in stream.pcm():
            samples += len(pcm) // 2
            yield pcm
    finally:
        if samples:
            metrics.record_soon(metrics.audio(stream.model_id, "tts", samples / stream.sample_rate_hz))


def sse_event(event: dict) -> bytes:
    """One server-sent event carrying ``event`` as JSON on its ``data:`` line."""
    return f"data: {json.dumps(event)}\n\n".encode()


async def _transcription_events(stream: services.TranscriptionStream):
    """The SSE body of a streamed transcription; the lease is released when the last event was handed
    out or the client left (R8.3). A failure after the headers becomes an ``error`` event (R7.3), and so
    does a drain's deadline (``audiosite.drain``, code ``shutting_down``; R8.4: cut, never reset)."""
    try:
        async for delta in DRAIN.until_expired(stream.deltas()):
            yield sse_event({"type": "transcript.text.delta", "delta": delta})
        final = stream.final or {}
        metrics.record_soon(metrics.audio(stream.model_id, "asr", stream.audio_ms / 1000))
        yield sse_event({"type": "transcript.text.done", "text": final.get("text", ""),
                         "usage": {"type": "duration", "seconds": round(stream.audio_ms / 1000, 3)}})
    except (ApplicationError, DrainExpired, redis.exceptions.RedisError) as exc:
        yield sse_event({"type": "error", "error": _stream_error(exc).body()["error"]})
    finally:
        await stream.aclose()


def _sse_delta(chunk: bytes) -> bytes:
    event = {"type": "speech.audio.delta", "audio": base64.b64encode(chunk).decode("ascii")}
    return f"data: {json.dumps(event)}\n\n".encode()


class SpeechApi(APIView):
    """``POST /v1/audio/speech`` (OpenAI-compatible; input: :class:`SpeechInputSerializer`).

    Responds with the audio in ``response_format`` (``pcm``: raw s16le mono at
    the rate in ``X-Sample-Rate``), sent sentence by sentence as it is
    synthesised, except ``flac``, sent at once with ``Content-Length`` once the
    whole text is synthesised, so that its STREAMINFO states its length
    (:func:`_speech_file`); with ``stream_format=sse`` (chosen by that field only, never by
    ``Accept``) ``text/event-stream`` of ``speech.audio.delta`` events (base64
    of the chunk in ``response_format``) then ``speech.audio.done`` with ``usage``.

    Raises:
        InvalidRequest: bad input, unknown voice, a model that is not ``tts``,
            options the model refuses, text without anything to say (400).
        NotFound (404), ServerBusy (503): as the other inference routes.
    """

    content_negotiation_class = IgnoreAccept

    counts_requests = True

    async def post(self, request):
        check_length(request)
        data = validated(SpeechInputSerializer(data=_data(request), context={"query_params": request.query_params}))
        meta, ctx, _probe = await _model(data["model"], data["busy_timeout_ms"], self)
        if meta["task"] != "tts":
            raise InvalidRequest(f"model {meta['id']!r} serves task {meta['task']!r}, not speech synthesis",
                                 param="model")
        extra = {"speed": data["speed"]}
        if data["seed"] is not None:
            extra["seed"] = data["seed"]
        options = _speech_options(meta, data["voice"], extra)
        _check_options(meta["family"], options, lambda keys: keys[0] if keys else None)
        stream = await services.speech_open(ctx, meta, data["input"], options, data["busy_timeout_ms"])
        fmt, sse = data["response_format"], data["stream_format"] == "sse"
        response: HttpResponse | StreamingHttpResponse
        if fmt == "flac" and not sse:
            body = await _speech_file(stream, fmt)
            response = HttpResponse(body, content_type=audio.speech_content_type(fmt))
            response["Content-Length"] = str(len(body))
        else:
            response = StreamingHttpResponse(_speech_body(stream, fmt, sse, data["input"]),
                                             content_type="text/event-stream" if sse else
                                             audio.speech_content_type(fmt))
        response["X-Sample-Rate"] = str(audio.speech_output_rate(fmt, stream.sample_rate_hz))
        response["Cache-Control"] = "no-cache"
        return response


class VoicesApi(APIView):
    """``GET /v1/audio/voices[?model=<id>]`` → ``{"model", "voices": [{"id", "name", "language", "sample_rate", …}]}``.

    Presets carry ``preset_of`` (the voice they stand for) and their ``options``. Without ``model``:
    the default speech model's voices (``ServerConfig.default_model("tts")``); an alias names its target.

    Raises:
        InvalidRequest: a model that is not ``tts``, or no ``model`` while no default speech model is set (400).
        NotFound: unknown model (404).
    """

    async def get(self, request):
        model_id = request.query_params.get("model") or get_config().default_model("tts")
        if not model_id:
            raise InvalidRequest("model is required (?model=<id>): no default speech model is configured",
                                 param="model")
        meta, _ctx, _probe = await _model(model_id, None)
        if meta["task"] != "tts":
            raise InvalidRequest(f"model {meta['id']!r} serves task {meta['task']!r}: it has no voices",
                                 param="model")
        return Response({"model": meta["id"], "voices": voices.model_voices(meta)})


WAV_BASE64_STEP_BYTES = 3 << 20  # a multiple of 3: the steps' base64 texts join into the whole one


def _wav_base64(parts: list[bytes], sample_rate_hz: int) -> tuple[str, int]:
    """``(base64 of the WAV file of the s16le PCM parts, its sample count)``; ``parts`` is emptied.

    Run in a thread: the longest answer (1800 s of speech, ``MAX_SPEECH_WORK_S``) is 79 MB of PCM, and
    base64 holds the GIL while it runs, so it goes in steps of ``WAV_BASE64_STEP_BYTES`` between which
    the event loop's thread gets the GIL back.
    """
    pcm = b"".join(parts)
    parts.clear()
    samples = len(pcm) // 2
    wav = memoryview(audio.wav_bytes(pcm, sample_rate_hz))
    del pcm
    text = "".join(base64.b64encode(wav[i:i + WAV_BASE64_STEP_BYTES]).decode("ascii")
                   for i in range(0, len(wav), WAV_BASE64_STEP_BYTES))
    return text, samples


async def _task_speech(meta: dict, ctx: AsyncContext, data: dict, started: float) -> Response:
    """``/v1/tasks/run`` for a ``tts`` model: the whole text synthesised, answered at once as
    ``{"audio": base64 WAV (s16le mono, its RIFF and data sizes filled in), "sample_rate", "duration" (s),
    "sentences", "timing"}``."""
    req = data["request"]
    if "text" not in req:
        raise InvalidRequest(f"model {meta['id']!r} synthesises speech: request needs 'text'", param="request.text")
    options = dict(req["options"])
    stream = await services.speech_open(ctx, meta, req["text"], options, data["busy_timeout_ms"])
    parts = []
    try:
        async for pcm in _speech_pcm(stream):
            parts.append(pcm)
        final = stream.final or {}
    finally:
        await stream.aclose()
    wav_base64, samples = await asyncio.to_thread(_wav_base64, parts, stream.sample_rate_hz)
    wall_ms = (time.monotonic() - started) * 1000
    duration_s = samples / stream.sample_rate_hz
    return Response({"model": meta["id"], "task": "tts", "audio": wav_base64,
                     "format": "wav", "sample_rate": stream.sample_rate_hz, "duration": round(duration_s, 6),
                     "sentences": final.get("sentences"),
                     "timing": {"wall_ms": round(wall_ms, 3), "audio_duration_ms": round(duration_s * 1000, 3),
                                "rtf": round(wall_ms / (duration_s * 1000), 4) if samples else None,
                                "queue_ms": round(stream.lease.waited_ms, 3), "load_ms": round(stream.load_ms, 3),
                                "inference_ms": final.get("inference_ms")}})
