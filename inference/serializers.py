"""Input serializers of the inference routes (API.md "Inference").

They check what a request says without knowing the model: types, ranges,
plain text, base64, and which audio source was sent. What depends on the
model (its task and mode, the family's option schema) and reading a
server-local file (``media_roots``) are checked by the views once the
model is known. Errors name the field path (``audiosite.input_checks``).
"""
from __future__ import annotations

import binascii

from django.core.files.uploadedfile import UploadedFile
from rest_framework import serializers
from rest_framework.fields import empty

from audiosite.input_checks import (BooleanField, ChoiceField, InputField, InputSerializer, IntegerField,
                                  NumberField, ObjectField, TextField, b64decode_strict, text_problem)
from audiosite.serverconfig import get_config

RESPONSE_FORMATS = ("json", "text", "srt", "vtt", "verbose_json")
TIMESTAMP_GRANULARITIES = ("word", "segment")


class LocalPathField(TextField):
    """A server-local path (plain text). Whether it may be read (``media_roots``) is the view's check."""

    default_error_messages = {"type": "{name} must be a path string"}


class AudioFileField(LocalPathField):
    """``file``: an uploaded file (multipart) or a server-local path (JSON or a form value).

    Returns the ``UploadedFile`` or the path. An upload over
    ``max_request_body_bytes`` fails with code ``payload_too_large`` (413).
    """

    default_error_messages = {"payload_too_large": "{name} of {size} bytes exceeds max_request_body_bytes={limit}"}

    def to_internal_value(self, data) -> UploadedFile | str:
        if isinstance(data, UploadedFile):
            limit = get_config().max_request_body_bytes
            if data.size > limit:
                self.fail("payload_too_large", size=data.size, limit=limit)
            return data
        return super().to_internal_value(data)


class Base64Field(InputField):
    """Base64 text (standard alphabet, padded; no whitespace) → the decoded bytes
    (:func:`audiosite.input_checks.b64decode_strict`)."""

    default_error_messages = {"type": "{name} must be a string", "base64": "{name} is not valid base64"}

    def to_internal_value(self, data) -> bytes:
        if not isinstance(data, str):
            self.fail("type")
        try:
            return b64decode_strict(data)
        except (binascii.Error, ValueError):  # ValueError: non-ASCII text
            self.fail("base64")


class GranularitiesField(InputField):
    """``timestamp_granularities``: a list of ``word`` and/or ``segment`` (default empty).

    JSON: a list under ``timestamp_granularities`` (or ``timestamp_granularities[]``).
    Multipart (as the OpenAI SDK sends it): repeated ``timestamp_granularities[]``
    fields (or repeated ``timestamp_granularities``).
    """

    default_error_messages = {"type": "{name} must be a list of 'word' and/or 'segment'"}

    def __init__(self, **kwargs):
        kwargs.setdefault("default", list)
        super().__init__(**kwargs)

    def get_value(self, dictionary):
        name, listed = self.field_name, f"{self.field_name}[]"
        if hasattr(dictionary, "getlist"):  # a form
            return dictionary.getlist(listed) or dictionary.getlist(name) or empty
        return dictionary.get(name, dictionary.get(listed, empty))

    def to_internal_value(self, data) -> list[str]:
        if not isinstance(data, list) or any(g not in TIMESTAMP_GRANULARITIES for g in data):
            self.fail("type")
        return list(data)


class BusyTimeoutInput(InputSerializer):
    """Base of the inference inputs: ``model`` and ``busy_timeout_ms`` (ms, 0..MAX_BUSY_TIMEOUT_MS).

    ``busy_timeout_ms`` comes from the body, else from the query string
    (pass ``context={"query_params": request.query_params}``); None when
    neither sends it (the model's ceiling applies).
    """

    body_message = "the request body must be a JSON object or a multipart form"

    model = TextField()

    def busy_timeout_from_query(self) -> int | None:
        """``busy_timeout_ms`` of the query string, validated like the body field."""
        field = self.fields["busy_timeout_ms"]
        try:
            return field.run_validation(field.get_value(self.context.get("query_params", {})))
        except serializers.ValidationError as exc:
            raise serializers.ValidationError({"busy_timeout_ms": exc.detail}) from None


class TranscriptionInputSerializer(BusyTimeoutInput):
    """``POST /v1/audio/transcriptions``: a multipart form (OpenAI) or a JSON object.

    Validated data: ``model``; ``response_format`` (default ``json``);
    ``stream`` (bool); ``busy_timeout_ms`` (int ms or None); ``options``
    (the model options built from ``language``, ``prompt``, ``temperature``
    and ``timestamp_granularities``: ``word`` sets ``word_timestamps``); and
    ``source``: ``(param, value)`` with an ``UploadedFile`` or a server-local
    path, taken from the upload ``file``, else the first of ``audio``,
    ``audio_path``, ``file`` sent.
    """

    response_format = ChoiceField(RESPONSE_FORMATS, default="json")
    stream = BooleanField(default=False)
    language = TextField(required=False)
    prompt = TextField(required=False)
    temperature = NumberField(required=False)
    timestamp_granularities = GranularitiesField()
    busy_timeout_ms = IntegerField(default=None)
    file = AudioFileField(required=False)
    audio = LocalPathField(required=False)
    audio_path = LocalPathField(required=False)

    #: The field that carries each model option (for ``param`` of an option the model refuses).
    OPTION_FIELDS = {"language": "language", "prompt": "prompt", "temperature": "temperature",
                     "word_timestamps": "timestamp_granularities"}

    def validate(self, attrs: dict) -> dict:
        if attrs["busy_timeout_ms"] is None:
            attrs["busy_timeout_ms"] = self.busy_timeout_from_query()
        options = {name: attrs[name] for name in ("language", "prompt", "temperature") if name in attrs}
        if "word" in attrs["timestamp_granularities"]:
            options["word_timestamps"] = True
        attrs["options"] = options
        if isinstance(attrs.get("file"), UploadedFile):
            attrs["source"] = ("file", attrs["file"])
        else:
            name = next((k for k in ("audio", "audio_path", "file") if k in attrs), None)
            if name is None:
                raise serializers.ValidationError(
                    {"file": "file is required (multipart upload, or a server-local path in JSON)"})
            attrs["source"] = (name, attrs[name])
        return attrs

    @classmethod
    def option_param(cls, keys: list[str]) -> str | None:
        """The field path of a model option (``keys`` inside the options block), None for the whole block."""
        return cls.OPTION_FIELDS.get(keys[0]) if keys else None


class DetailsInputSerializer(TranscriptionInputSerializer):
    """``POST /v1/audio/transcriptions/details``: the transcription input plus ``diarization_model``
    (optional: the id of a ``diarization`` pipeline whose speaker turns label the words; without it
    ``speaker_turns`` is empty). Word timestamps are always on; ``response_format`` and ``stream``
    are accepted as for transcriptions but the answer is always JSON (``stream=true`` is refused)."""

    diarization_model = TextField(required=False)


MAX_SPEECH_INPUT_CHARS = 4096  # OpenAI's limit for /v1/audio/speech (API.md)
SPEECH_RESPONSE_FORMATS = ("mp3", "opus", "aac", "flac", "wav", "pcm")
STREAM_FORMATS = ("audio", "sse")
MIN_SPEED, MAX_SPEED = 0.25, 4.0  # OpenAI's range


class SpeechTextField(TextField):
    """``input``: plain text of 1..``MAX_SPEECH_INPUT_CHARS`` characters (code points)."""

    default_error_messages = {"length": "{name} must have 1 to {limit} characters, not {count}"}

    def to_internal_value(self, data) -> str:
        text = super().to_internal_value(data)
        if not text.strip() or len(text) > MAX_SPEECH_INPUT_CHARS:
            self.fail("length", limit=MAX_SPEECH_INPUT_CHARS, count=len(text) if text.strip() else 0)
        return text


class VoiceField(InputField):
    """``voice``: a voice name, or ``{"id": name}`` (OpenAI's custom-voice object) → the name."""

    default_error_messages = {"type": "{name} must be a voice name or an object {{\"id\": name}}"}

    def to_internal_value(self, data) -> str:
        if isinstance(data, dict) and set(data) == {"id"}:
            data = data["id"]
        if not isinstance(data, str) or not data or text_problem(data) or len(data) > 128:
            self.fail("type")
        return data


class TaskRequestSerializer(InputSerializer):
    """``request`` of ``POST /v1/tasks/run``: ``{"audio_base64" | "audio" | "text", "options", "busy_timeout_ms"}``.

    Validated data: ``options`` (an object of plain text, default ``{}``;
    the family's schema is the view's check); ``busy_timeout_ms`` (int ms or
    None); ``source``: ``(param, bytes)`` for ``audio_base64`` (preferred
    when both are sent) or ``(param, path)`` for ``audio``; or, for a speech
    model, ``text`` (1..4096 characters) and ``source`` None. Which of them
    the model needs is the view's check.
    """

    body_message = "request must be a JSON object with 'audio', 'audio_base64' or 'text'"

    options = ObjectField()
    busy_timeout_ms = IntegerField(default=None)
    audio_base64 = Base64Field(required=False, blank_is_absent=False)
    audio = LocalPathField(required=False, blank_is_absent=False)
    text = SpeechTextField(required=False, blank_is_absent=False)

    def validate(self, attrs: dict) -> dict:
        name = next((k for k in ("audio_base64", "audio") if k in attrs), None)
        if name is None and "text" not in attrs:
            raise serializers.ValidationError(
                "request needs 'audio' (server-local path) or 'audio_base64', or 'text' for a speech model")
        attrs["source"] = (self.fields[name].path, attrs[name]) if name else None
        return attrs


class TaskRunInputSerializer(BusyTimeoutInput):
    """``POST /v1/tasks/run``: ``{"model", "request": {...}, "busy_timeout_ms"}`` (JSON).

    Validated data: ``model``, ``request`` (see :class:`TaskRequestSerializer`)
    and ``busy_timeout_ms``: from the body, else the query string, else
    ``request.busy_timeout_ms`` (int ms or None).
    """

    request = TaskRequestSerializer()
    busy_timeout_ms = IntegerField(default=None)

    def validate(self, attrs: dict) -> dict:
        if attrs["busy_timeout_ms"] is None:
            attrs["busy_timeout_ms"] = self.busy_timeout_from_query()
        if attrs["busy_timeout_ms"] is None:
            attrs["busy_timeout_ms"] = attrs["request"]["busy_timeout_ms"]
        return attrs


class SpeechInputSerializer(BusyTimeoutInput):
    """``POST /v1/audio/speech`` (JSON, as the OpenAI SDK sends it).

    Validated data: ``model``; ``input`` (1..4096 characters); ``voice`` (a name
    or None = the model's default); ``speed`` (0.25..4, default 1);
    ``instructions`` (accepted; Piper voices ignore it); ``response_format``
    (default mp3); ``stream_format`` (``audio`` default | ``sse``); ``seed``
    (0..2**31-2 or None); ``language`` (accepted; a voice speaks its own);
    ``busy_timeout_ms`` (body, else query string; None = the model's ceiling).
    """

    input = SpeechTextField()
    voice = VoiceField(required=False, default=None)
    speed = NumberField(required=False, default=1.0)
    instructions = TextField(required=False)
    response_format = ChoiceField(SPEECH_RESPONSE_FORMATS, default="mp3")
    stream_format = ChoiceField(STREAM_FORMATS, default="audio")
    seed = IntegerField(required=False, default=None, minimum=0, maximum=2**31 - 2)
    language = TextField(required=False)
    busy_timeout_ms = IntegerField(default=None)

    def validate_speed(self, value: float) -> float:
        if not MIN_SPEED <= value <= MAX_SPEED:
            raise serializers.ValidationError(f"speed must be between {MIN_SPEED} and {MAX_SPEED}, not {value}")
        return value

    def validate(self, attrs: dict) -> dict:
        if attrs["busy_timeout_ms"] is None:
            attrs["busy_timeout_ms"] = self.busy_timeout_from_query()
        return attrs
