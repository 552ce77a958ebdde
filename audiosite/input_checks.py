"""Checks at the HTTP edge shared by every route: body length, JSON parsing, plain text, and DRF input fields.

Input serializers (``inference.serializers``, ``registry.serializers``) are
built from the fields below. Every field treats JSON ``null`` and an empty
form value as "not sent", and words its errors with its *field path* (``model``,
``request.audio_base64``, ``request.options.prompt``): the path a client
sent. ``audiosite.errors.invalid_request_from`` turns the first error of a
serializer into our error shape with that path as ``param``.
"""
from __future__ import annotations

import base64
import binascii
import codecs
import math
import re
from collections.abc import Callable, Iterable
from typing import Any, NoReturn

import pybase64
from django.conf import settings
from rest_framework import parsers, serializers
from rest_framework.exceptions import ParseError
from rest_framework.fields import empty
from rest_framework.settings import api_settings
from rest_framework.utils import json as drf_json

from audiosite.errors import InvalidRequest, LengthRequired, PayloadTooLarge, invalid_request_from
from audiosite.serverconfig import MAX_BUSY_TIMEOUT_MS, get_config


def content_length_error(raw: str | bytes, limit: int) -> PayloadTooLarge | None:
    """The 413 for a Content-Length header value (ASCII digits) over ``limit`` bytes, else None.

    Converts no more digits than ``limit`` has: Python refuses to convert
    strings of more than 4300 digits (``ValueError``), and a longer number is
    over any limit anyway. The caller checks that ``raw`` is digits.
    """
    digits = raw.decode("ascii") if isinstance(raw, bytes) else raw
    digits = digits.lstrip("0")
    if len(digits) > len(str(limit)):
        return PayloadTooLarge(f"request body of a {len(digits)}-digit number of bytes exceeds "
                               f"max_request_body_bytes={limit}")
    if int(digits or 0) > limit:
        return PayloadTooLarge(f"request body of {digits} bytes exceeds max_request_body_bytes={limit}")
    return None


def check_length(request, body_optional: bool = False) -> int:
    """The body's Content-Length in bytes; refuse one over ``max_request_body_bytes`` (413).

    Chunked request bodies are not supported (Django would see them as
    empty): a body without Content-Length is refused with 411, unless
    ``body_optional`` and no body was sent at all (then 0). (The API's
    handler has refused an oversize body already, before reading it:
    ``audiosite.http.handler.ApiHandler``.)
    """
    limit = get_config().max_request_body_bytes
    raw = request.META.get("CONTENT_LENGTH")
    if raw in (None, ""):
        if body_optional and not request.META.get("HTTP_TRANSFER_ENCODING"):
            return 0
        raise LengthRequired("Content-Length is required (chunked request bodies are not supported)")
    if not (isinstance(raw, str) and raw.isascii() and raw.isdigit()):
        raise InvalidRequest("Content-Length is not a number")
    too_large = content_length_error(raw, limit)
    if too_large is not None:
        raise too_large
    return int(raw)


# -- JSON bodies --------------------------------------------------------------------------------------

class HugeInteger:
    """An integer literal of a JSON body too long for Python's ``int()`` (more than 4300 digits).

    :class:`JSONParser` puts one where the literal was, and refuses the body
    naming its path; it never reaches a serializer.
    """

    def __init__(self, literal: str):
        self.digits = len(literal.lstrip("-"))

    def __repr__(self) -> str:
        return f"<an integer of {self.digits} digits>"


def _parse_int(literal: str) -> int | HugeInteger:
    try:
        return int(literal)
    except ValueError:  # over sys.get_int_max_str_digits(): refused before any conversion work
        return HugeInteger(literal)


def first_in_json(value: Any, is_bad: Callable[[Any], bool],
                  keys: tuple[str, ...] = ()) -> tuple[tuple[str, ...], Any] | None:
    """The first value or object key inside decoded JSON for which ``is_bad`` is true, else None.

    Returns:
        ``(keys, found)``: the object keys leading to it (list indices are
        skipped; for a bad key, the keys of the object holding it) and the
        offending value or key (a key is passed to ``is_bad`` as ``str``).
    """
    if isinstance(value, dict):
        for key, item in value.items():
            if is_bad(str(key)):
                return keys, str(key)
            found = first_in_json(item, is_bad, (*keys, str(key)))
            if found:
                return found
        return None
    if isinstance(value, list):
        for item in value:
            found = first_in_json(item, is_bad, keys)
            if found:
                return found
        return None
    return (keys, value) if is_bad(value) else None


def huge_integer_keys(value) -> tuple[tuple[str, ...], HugeInteger] | None:
    """The first :class:`HugeInteger` inside decoded JSON, with the object keys leading to it, else None."""
    return first_in_json(value, lambda item: isinstance(item, HugeInteger))


MAX_JSON_DEPTH = 32
"""Deepest nesting of objects and arrays a JSON body or form field may have (the body itself is level 1).
Our deepest legitimate shape, a model entry's options block with a list of objects inside, is 5 levels
deep; the bound keeps every recursive walk of decoded JSON (our checks, DRF, jsonschema) far from
Python's recursion limit, which a value ~900 levels deep reached (a 500)."""


def json_depth_exceeds(value: Any, limit: int = MAX_JSON_DEPTH) -> bool:
    """True when decoded JSON ``value`` nests objects/arrays more than ``limit`` levels deep.

    Iterative (an explicit stack), so it cannot itself hit the recursion limit; it stops at the first
    container below ``limit``, so its cost is bounded by the size of ``value``.
    """
    stack: list[tuple[Any, int]] = [(value, 1)]
    while stack:
        item, depth = stack.pop()
        if isinstance(item, dict):
            children: Iterable[Any] = item.values()
        elif isinstance(item, list):
            children = item
        else:
            continue
        if depth > limit:
            return True
        stack.extend((child, depth + 1) for child in children)
    return False


def check_json_depth(value: Any, name: str | None = None) -> None:
    """Refuse decoded JSON nested deeper than :data:`MAX_JSON_DEPTH`.

    Raises:
        InvalidRequest: 400, ``param`` = ``name`` (the field holding the JSON; None for a whole body).
    """
    if json_depth_exceeds(value):
        where = f"key '{name}'" if name else "the request body"
        raise InvalidRequest(f"{where} is nested more than {MAX_JSON_DEPTH} levels deep", param=name)


class JSONParser(parsers.JSONParser):
    """DRF's JSON parser, except that an integer literal of more than 4300 digits is a 400 naming its field.

    Python's ``json`` converts integer literals with ``int()``, which refuses
    more than ``sys.get_int_max_str_digits()`` digits (4300) with a
    ``ValueError``; DRF would report that as an anonymous parse error. Here the
    literal becomes a :class:`HugeInteger` and the parsed body is refused.

    Raises:
        InvalidRequest: 400, ``param`` = the dotted keys leading to the literal
            (``busy_timeout_ms``, ``request.options.x``; None for a bare number).
        ParseError: the body is not JSON (DRF's 400).
    """

    def parse(self, stream, media_type=None, parser_context=None):
        encoding = (parser_context or {}).get("encoding", settings.DEFAULT_CHARSET)
        try:
            value = drf_json.load(codecs.getreader(encoding)(stream), parse_int=_parse_int,
                                  parse_constant=drf_json.strict_constant if self.strict else None)
        except ValueError as exc:
            raise ParseError(f"JSON parse error - {exc}") from None
        check_json_depth(value)
        found = huge_integer_keys(value)
        if found:
            keys, number = found
            name = ".".join(keys)
            raise InvalidRequest(f"{name or 'the body'} is an integer of {number.digits} digits, far out of range",
                                 param=name or None)
        return value


# -- base64 -------------------------------------------------------------------------------------------

def b64decode_strict(text: str) -> bytes:
    """Bytes of base64 ``text`` (standard alphabet, padded, no whitespace): what
    ``base64.b64decode(text, validate=True)`` accepts and returns.

    Decoded by ``pybase64`` (SIMD; 0.01 ms for the 200 KB of a 3.5 s clip, against 0.38 ms for
    the standard library, measured on this project's 2-core machine). ``pybase64`` refuses a
    little more than the standard library (excess padding such as ``QUJD====``), so text it
    refuses is decoded again by the standard library: the accepted set is the standard library's.

    Raises:
        binascii.Error: not valid base64.
        ValueError: ``text`` holds non-ASCII characters.
    """
    try:
        return pybase64.b64decode(text, validate=True)
    except (binascii.Error, ValueError):
        return base64.b64decode(text, validate=True)


# -- plain text ---------------------------------------------------------------------------------------

TEXT_PROBLEMS = {"unicode": "is not valid Unicode text", "nul": "must not contain NUL characters"}


def text_problem(value: str) -> str | None:
    """Why ``value`` is not plain text, as a key of :data:`TEXT_PROBLEMS` ("unicode" or "nul"), else None.

    Plain text encodes as UTF-8 (no unpaired surrogates) and holds no NUL
    character: PostgreSQL, Redis and the JSON renderer all need that.
    """
    try:
        value.encode("utf-8")
    except UnicodeEncodeError:
        return "unicode"
    if "\x00" in value:
        return "nul"
    return None


def bad_text_keys(value) -> tuple[tuple[str, ...], str] | None:
    """The first string (key or value) inside decoded JSON that is not plain text, else None.

    Returns:
        ``(keys, text)`` as :func:`first_in_json` gives them.
    """
    return first_in_json(value, lambda item: isinstance(item, str) and text_problem(item) is not None)


def bad_text_path(value, name: str = "") -> tuple[str, str] | None:
    """Like :func:`bad_text_keys`, with the keys as one dotted path (prefixed by ``name``).

    Returns:
        ``(path, text)`` or None when every string is plain text.
    """
    found = bad_text_keys(value)
    if found is None:
        return None
    return ".".join(filter(None, (name, *found[0]))), found[1]


# -- DRF input fields ---------------------------------------------------------------------------------

def field_path(field: serializers.Field) -> str:
    """The dotted path of a bound field from the root serializer, e.g. ``request.options``."""
    names = []
    while field is not None:
        if field.field_name:
            names.append(field.field_name)
        field = field.parent
    return ".".join(reversed(names))


def nested_error(keys: tuple[str, ...], message: str, code: str = "invalid") -> serializers.ValidationError:
    """A ValidationError whose detail nests ``message`` under ``keys`` (so its field path grows by them).

    With no keys the problem is the object's own (``non_field_errors``), which a serializer may raise too.
    """
    detail: object = {api_settings.NON_FIELD_ERRORS_KEY: [serializers.ErrorDetail(message, code=code)]}
    for key in reversed(keys):
        detail = {key: detail}
    return serializers.ValidationError(detail)


def fresh_copy(field: serializers.Field) -> serializers.Field:
    """The copy a serializer makes of each declared field for each instance (DRF's ``Field.__deepcopy__``):
    a new, unbound field from the same constructor arguments, but without deep-copying those arguments.
    Ours are immutable (flags, numbers, text, tuples of choices) or only read (``error_messages``, which
    DRF merges into a dict of each field's own), so the copies share nothing they change. With
    :meth:`InputSerializer.get_fields`, validating a ``/v1/tasks/run`` body takes 112 µs instead of
    225 µs (DRF's generic deep copy was 61 % of it)."""
    return field.__class__(*field._args, **field._kwargs)


class InputField(serializers.Field):
    """Base of our input fields: ``null`` or ``""`` means "not sent"; messages name the field path.

    Error messages are ``str.format`` templates; ``{name}`` is the field
    path. ``blank_is_absent=False`` keeps ``""`` as a value (in ``/v1/tasks/run``
    an empty ``audio_base64`` is empty audio, refused by the decoder).
    """

    default_error_messages = {"required": "{name} is required"}

    def __init__(self, *, blank_is_absent: bool = True, **kwargs):
        self.blank_is_absent = blank_is_absent
        super().__init__(**kwargs)

    @property
    def path(self) -> str:
        return field_path(self)

    def fail(self, key: str, **kwargs: Any) -> NoReturn:
        """Raise the ``ValidationError`` of message ``key`` (DRF's ``Field.fail`` always raises)."""
        super().fail(key, name=self.path, **kwargs)
        raise AssertionError("unreachable: Field.fail raises")

    def validate_empty_values(self, data):
        if data is empty or data is None or (self.blank_is_absent and isinstance(data, str) and data == ""):
            if self.required:
                self.fail("required")
            return True, self.get_default()
        return False, data

    def to_representation(self, value):
        return value


class TextField(InputField):
    """A string of plain text (see :func:`text_problem`)."""

    default_error_messages = {"type": "{name} must be a string",
                              **{key: "{name} " + text for key, text in TEXT_PROBLEMS.items()}}

    def to_internal_value(self, data) -> str:
        if not isinstance(data, str):
            self.fail("type")
        problem = text_problem(data)
        if problem:
            self.fail(problem)
        return data


class ChoiceField(TextField):
    """A string from ``choices``: ``"<name> must be one of a, b, c"``."""

    default_error_messages = {"choice": "{name} must be one of {choices}"}

    def __init__(self, choices: tuple[str, ...], **kwargs):
        self.choices = tuple(choices)
        super().__init__(**kwargs)

    def to_internal_value(self, data) -> str:
        value = super().to_internal_value(data)
        if value not in self.choices:
            self.fail("choice", choices=", ".join(self.choices))
        return value


class IntegerField(InputField):
    """An integer in ``[minimum, maximum]``: a JSON int, a float without fraction, or ASCII digits (forms).

    Booleans are not integers. Defaults to the busy-timeout range ``0..MAX_BUSY_TIMEOUT_MS``.
    """

    default_error_messages = {
        "type": "{name} must be an integer",
        "range": "{name} must be between {minimum} and {maximum}",
    }

    def __init__(self, *, minimum: int = 0, maximum: int = MAX_BUSY_TIMEOUT_MS, **kwargs):
        self.minimum, self.maximum = minimum, maximum
        super().__init__(**kwargs)

    def to_internal_value(self, data) -> int:
        number: int | None = None
        if isinstance(data, bool):
            number = None
        elif isinstance(data, int):
            number = data
        elif isinstance(data, float) and data.is_integer():
            number = int(data)
        elif isinstance(data, str) and re.fullmatch(r"-?[0-9]+", data.strip()):
            digits = data.strip().lstrip("-").lstrip("0")
            if len(digits) > len(str(max(abs(self.minimum), abs(self.maximum)))):
                self.fail("range", minimum=self.minimum, maximum=self.maximum)  # before int(): Python
                # refuses to convert strings of more than 4300 digits (ValueError)
            number = int(data.strip())
        if number is None:
            self.fail("type")
        if not self.minimum <= number <= self.maximum:
            self.fail("range", minimum=self.minimum, maximum=self.maximum)
        return number


class NumberField(InputField):
    """A finite number: a JSON int or float, or a numeric string (forms). Booleans are not numbers."""

    default_error_messages = {"type": "{name} must be a number", "finite": "{name} must be a finite number"}

    def to_internal_value(self, data) -> float:
        if isinstance(data, bool) or not isinstance(data, (int, float, str)):
            self.fail("type")
        try:
            number = float(data)
        except ValueError:
            self.fail("type")
        except OverflowError:  # an integer beyond the float range
            self.fail("finite")
        if not math.isfinite(number):
            self.fail("finite")
        return number


class BooleanField(InputField):
    """A JSON boolean, or ``true``/``1``/``false``/``0`` (any case) from a form."""

    default_error_messages = {"type": "{name} must be true or false"}

    def to_internal_value(self, data) -> bool:
        if isinstance(data, bool):
            return data
        if isinstance(data, str) and data.lower() in ("true", "1", "false", "0"):
            return data.lower() in ("true", "1")
        self.fail("type")


class ObjectField(InputField):
    """A JSON object whose keys and strings are all plain text (an options block); ``null`` is ``{}``.

    A bad string deep inside is reported at its own path, e.g.
    ``request.options.prompt is not valid Unicode text``.
    """

    default_error_messages = {"type": "{name} must be an object"}

    def __init__(self, **kwargs):
        kwargs.setdefault("default", dict)
        super().__init__(**kwargs)

    def to_internal_value(self, data) -> dict:
        if not isinstance(data, dict):
            self.fail("type")
        found = bad_text_keys(data)
        if found:
            keys, text = found
            name = ".".join((self.path, *keys))
            raise nested_error(keys, f"{name} {TEXT_PROBLEMS[text_problem(text) or 'unicode']}")
        return data


class InputSerializer(serializers.Serializer):
    """Base of the input serializers: a body that is not an object is refused with ``body_message``."""

    body_message = "the request body must be a JSON object"

    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        for key in ("invalid", "null", "required"):
            self.error_messages[key] = self.body_message

    def get_fields(self) -> dict:
        """DRF's ``Serializer.get_fields`` (a copy of each declared field for this instance, nested
        serializers included), through :func:`fresh_copy` instead of ``copy.deepcopy``."""
        return {name: fresh_copy(field) for name, field in self._declared_fields.items()}

    def validate_empty_values(self, data):
        if data is None:  # a JSON null (DRF would report a null body as "No data provided")
            raise nested_error((), self.body_message, code="null")
        return super().validate_empty_values(data)


def validated(serializer: serializers.Serializer) -> dict:
    """``serializer.validated_data``, or our error for its first problem.

    Raises:
        InvalidRequest: 400 with ``param`` = the field path (see ``audiosite.errors.invalid_request_from``).
        PayloadTooLarge: 413 for a field problem with code ``payload_too_large``.
    """
    if not serializer.is_valid():
        raise invalid_request_from(serializer.errors)
    return serializer.validated_data
