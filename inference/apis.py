"""Inference routes: ``POST /v1/audio/transcriptions`` and ``POST /v1/tasks/run``.

Views only translate HTTP to the runtime and back (async: a waiting request
holds no thread). Input problems are refused before any ticket is taken, so a
bad request never holds a lease.
"""
from __future__ import annotations

import asyncio
import base64
import binascii
import json
import math
import os
import re
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from adrf.views import APIView
from django.http import HttpResponse
from rest_framework.exceptions import ParseError
from rest_framework.response import Response

from audiosite.errors import InvalidRequest, LengthRequired, NotFound, PayloadTooLarge, UnsupportedMedia
from audiosite.serverconfig import MAX_BUSY_TIMEOUT_MS, get_config
from inference import audio, specs
from inference.runtime import dispatch
from inference.runtime.context import async_context
from registry.selectors import model_meta_get

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")


def check_length(request, body_optional: bool = False) -> int:
    """The body's Content-Length in bytes; refuse one over ``max_request_body_bytes`` (413).

    Chunked request bodies are not supported (Django would see them as
    empty): a body without Content-Length is refused with 411, unless
    ``body_optional`` and no body was sent at all (then 0).
    """
    limit = get_config().max_request_body_bytes
    raw = request.META.get("CONTENT_LENGTH")
    if raw in (None, ""):
        if body_optional and not request.META.get("HTTP_TRANSFER_ENCODING"):
            return 0
        raise LengthRequired("Content-Length is required (chunked request bodies are not supported)")
    if not (isinstance(raw, str) and raw.isascii() and raw.isdigit()):
        raise InvalidRequest("Content-Length is not a number")
    if int(raw) > limit:
        raise PayloadTooLarge(f"request body of {int(raw)} bytes exceeds max_request_body_bytes={limit}")
    return int(raw)


def _data(request) -> dict:
    try:
        data = request.data
    except ParseError as exc:
        raise InvalidRequest(f"malformed request body: {exc.detail}") from None
    except (RecursionError, UnicodeDecodeError):
        raise InvalidRequest("malformed request body: nested too deeply or not UTF-8") from None
    if not hasattr(data, "get"):
        raise InvalidRequest("the request body must be a JSON object or a multipart form")
    return data


def _check_text(value: str, name: str) -> str:
    """Refuse strings that cannot travel as UTF-8 (lone surrogates) or hold NUL characters."""
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        raise InvalidRequest(f"{name} is not valid Unicode text", param=name) from None
    if "\x00" in value:
        raise InvalidRequest(f"{name} must not contain NUL characters", param=name)
    return value


def _field(data, name: str):
    """A present, non-empty field, or None."""
    value = data.get(name)
    return None if value is None or (isinstance(value, str) and value == "") else value


def _str_field(data, name: str) -> str | None:
    value = _field(data, name)
    if value is None:
        return None
    if not isinstance(value, str):
        raise InvalidRequest(f"{name} must be a string", param=name)
    return _check_text(value, name)


def _int_field(value, name: str, minimum: int = 0, maximum: int = MAX_BUSY_TIMEOUT_MS) -> int | None:
    """An integer from JSON (int, or a float with no fraction) or a form (ASCII digits)."""
    if value is None or value == "":
        return None
    number = None
    if isinstance(value, bool):
        number = None
    elif isinstance(value, int):
        number = value
    elif isinstance(value, float) and value.is_integer():
        number = int(value)
    elif isinstance(value, str) and re.fullmatch(r"-?[0-9]+", value.strip()):
        number = int(value.strip())
    if number is None:
        raise InvalidRequest(f"{name} must be an integer", param=name)
    if not minimum <= number <= maximum:
        raise InvalidRequest(f"{name} must be between {minimum} and {maximum}", param=name)
    return number


def _float_field(value, name: str) -> float | None:
    if value is None or value == "":
        return None
    if isinstance(value, bool) or not isinstance(value, (int, float, str)):
        raise InvalidRequest(f"{name} must be a number", param=name)
    try:
        number = float(value)
    except ValueError:
        raise InvalidRequest(f"{name} must be a number", param=name) from None
    if not math.isfinite(number):
        raise InvalidRequest(f"{name} must be a finite number", param=name)
    return number


def _bool_field(value, name: str) -> bool:
    if value is None or value == "":
        return False
    if isinstance(value, bool):
        return value
    if isinstance(value, str) and value.lower() in ("true", "1", "false", "0"):
        return value.lower() in ("true", "1")
    raise InvalidRequest(f"{name} must be true or false", param=name)


def _is_text(value: str) -> bool:
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return False
    return "\x00" not in value


def bad_text_path(value, name: str = "") -> tuple[str, str] | None:
    """The first string (key or value) inside decoded JSON that is not plain text, else None.

    Plain text encodes as UTF-8 (no unpaired surrogates) and holds no NUL
    character: PostgreSQL, Redis and the JSON renderer all need that.

    Returns:
        ``(path, text)``: the dotted path of the value (for a bad key, the
        path of the object holding it) and the offending string.
    """
    if isinstance(value, str):
        return None if _is_text(value) else (name, value)
    if isinstance(value, dict):
        for key, item in value.items():
            if not _is_text(str(key)):
                return name, str(key)
            found = bad_text_path(item, f"{name}.{key}" if name else str(key))
            if found:
                return found
    elif isinstance(value, list):
        for item in value:
            found = bad_text_path(item, name)
            if found:
                return found
    return None


def _check_strings(value, name: str) -> None:
    """Apply :func:`_check_text` to every string inside ``value`` (options blocks)."""
    found = bad_text_path(value, name)
    if found:
        _check_text(found[1], found[0])


def _busy_timeout(request, data) -> int | None:
    value = data.get("busy_timeout_ms")
    if value is None:
        value = request.query_params.get("busy_timeout_ms")
    return _int_field(value, "busy_timeout_ms")


async def _model(model_id) -> tuple[dict, object]:
    if not model_id:
        raise InvalidRequest("model is required", param="model")
    if not isinstance(model_id, str):
        raise InvalidRequest("model must be a string", param="model")
    _check_text(model_id, "model")
    ctx = await async_context()
    meta = await model_meta_get(ctx, model_id)
    if meta is None:
        raise NotFound(f"model {model_id!r} is not registered", param="model")
    return meta, ctx


def _read_local(path_value, param: str) -> bytes:
    """Bytes of a server-local file that lies inside a configured media root."""
    config = get_config()
    if not isinstance(path_value, str):
        raise InvalidRequest(f"{param} must be a path string", param=param)
    _check_text(path_value, param)
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


# Audio decoding has its own bounded pool: never asyncio's default executor, which also sends the
# Celery tasks (a burst of uploads must not delay a dispatch). Threads start on demand and stay.
_DECODE_POOL = ThreadPoolExecutor(max_workers=max(2, os.cpu_count() or 1), thread_name_prefix="decode")


async def _decode(data: bytes, family: str, param: str):
    rate = specs.get_spec(family)["sample_rate_hz"]
    try:
        samples, _source_rate = await asyncio.get_running_loop().run_in_executor(
            _DECODE_POOL, audio.decode, data, rate, get_config().max_audio_seconds)
    except audio.UndecodableAudio as exc:
        raise UnsupportedMedia(str(exc), param=param) from None
    except audio.AudioTooLong as exc:
        raise PayloadTooLarge(str(exc), param=param) from None
    except audio.AudioError as exc:
        raise InvalidRequest(str(exc), param=param) from None
    return samples, rate


def _check_options(family: str, options: dict) -> None:
    _check_strings(options, "options")
    problems = specs.request_option_problems(family, options)
    if problems:
        raise InvalidRequest("; ".join(problems), param="options")


def _timing(started: float, n_samples: int, rate: int, outcome: dispatch.Outcome) -> dict:
    """``timing`` of a response: wall time, audio duration, real-time factor
    (wall ÷ audio), and the queue / load / inference parts, all in ms."""
    wall_ms = (time.monotonic() - started) * 1000
    audio_ms = n_samples / rate * 1000
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


class TranscriptionApi(APIView):
    """``POST /v1/audio/transcriptions`` (OpenAI-compatible)."""

    async def post(self, request):
        started = time.monotonic()
        check_length(request)
        data = _data(request)
        meta, ctx = await _model(_field(data, "model"))
        if meta["task"] != "asr":
            raise InvalidRequest(f"model {meta['id']!r} serves task {meta['task']!r}, not transcription", param="model")
        response_format = _str_field(data, "response_format") or "json"
        if response_format not in RESPONSE_FORMATS:
            raise InvalidRequest(f"response_format must be one of {', '.join(RESPONSE_FORMATS)}", param="response_format")
        if _bool_field(data.get("stream"), "stream"):
            raise InvalidRequest("stream=true needs a model in mode 'streaming'; this model is offline", param="stream")
        options = {}
        for name in ("language", "prompt"):
            value = _str_field(data, name)
            if value is not None:
                options[name] = value
        temperature = _float_field(data.get("temperature"), "temperature")
        if temperature is not None:
            options["temperature"] = temperature
        if hasattr(data, "getlist"):
            granularities = data.getlist("timestamp_granularities[]") or data.getlist("timestamp_granularities")
        else:
            granularities = data.get("timestamp_granularities", data.get("timestamp_granularities[]")) or []
        if not isinstance(granularities, list) or any(g not in ("word", "segment") for g in granularities):
            raise InvalidRequest("timestamp_granularities must be a list of 'word' and/or 'segment'",
                                 param="timestamp_granularities")
        if "word" in granularities:
            options["word_timestamps"] = True
        _check_options(meta["family"], options)
        timeout_ms = _busy_timeout(request, data)
        upload = request.FILES.get("file") if hasattr(request, "FILES") else None
        if upload is not None:
            limit = get_config().max_request_body_bytes
            if upload.size > limit:
                raise PayloadTooLarge(f"file of {upload.size} bytes exceeds max_request_body_bytes={limit}")
            raw = upload.read()
            param = "file"
        else:
            path_value = next((data.get(k) for k in ("audio", "audio_path", "file") if data.get(k)), None)
            if path_value is None:
                raise InvalidRequest("file is required (multipart upload, or a server-local path in JSON)", param="file")
            raw = _read_local(path_value, "file")
            param = "file"
        samples, rate = await _decode(raw, meta["family"], param)
        outcome = await dispatch.infer(ctx, meta, samples, rate, options, timeout_ms)
        result = outcome.result
        timing = _timing(started, len(samples), rate, outcome)
        if response_format == "text":
            return HttpResponse(result["text"], content_type="text/plain; charset=utf-8")
        if response_format in ("srt", "vtt"):
            return HttpResponse(subtitles(result["segments"], response_format), content_type="text/plain; charset=utf-8")
        body = {"text": result["text"], "timing": timing}
        if response_format == "verbose_json":
            body.update(task="transcribe", language=result["language"], duration=result["duration"],
                        segments=result["segments"])
            if "words" in result:
                body["words"] = result["words"]
        return Response(body)


class TaskRunApi(APIView):
    """``POST /v1/tasks/run``: generic task input (VAD, ASR)."""

    async def post(self, request):
        started = time.monotonic()
        check_length(request)
        data = _data(request)
        meta, ctx = await _model(_field(data, "model"))
        task_request = data.get("request")
        if not isinstance(task_request, dict):
            raise InvalidRequest("request must be a JSON object with 'audio' or 'audio_base64'", param="request")
        options = task_request.get("options")
        options = {} if options is None else options
        if not isinstance(options, dict):
            raise InvalidRequest("request.options must be an object", param="request.options")
        _check_options(meta["family"], options)
        timeout_ms = _busy_timeout(request, data)
        if timeout_ms is None:
            timeout_ms = _int_field(task_request.get("busy_timeout_ms"), "busy_timeout_ms")
        if task_request.get("audio_base64") is not None:
            encoded = task_request["audio_base64"]
            if not isinstance(encoded, str):
                raise InvalidRequest("request.audio_base64 must be a string", param="request.audio_base64")
            try:
                raw = base64.b64decode(encoded, validate=True)
            except (binascii.Error, ValueError):
                raise InvalidRequest("request.audio_base64 is not valid base64", param="request.audio_base64") from None
            param = "request.audio_base64"
        elif task_request.get("audio") is not None:
            raw = _read_local(task_request["audio"], "request.audio")
            param = "request.audio"
        else:
            raise InvalidRequest("request needs 'audio' (server-local path) or 'audio_base64'", param="request")
        samples, rate = await _decode(raw, meta["family"], param)
        outcome = await dispatch.infer(ctx, meta, samples, rate, options, timeout_ms)
        body = {"model": meta["id"], "task": meta["task"], **outcome.result,
                "timing": _timing(started, len(samples), rate, outcome)}
        return Response(body)
