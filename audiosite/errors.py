"""One error hierarchy, one error shape for every route.

Shape (API.md): ``{"error": {"message": str, "type": str, "param": str|null,
"code": str|null}}``. Services raise ``ApplicationError`` subclasses; the DRF
exception handler and the Django 400/404/500 handlers render them. A 503 carries
``Retry-After`` in seconds. Each machine ``code`` is the class attribute of one
subclass (``worker_lost`` is :class:`WorkerLost`, a :class:`ServerBusy`), and an
error is never changed once raised.

Messages and params often quote what the client sent (a model id, an option
key, a path, a schema's view of a value). Every error body is built by
:func:`error_body`, which caps both with :func:`clip_text`, so a 50 MB prompt
never comes back whole.
"""
from __future__ import annotations

import logging

import redis
from django.conf import settings
from django.core.exceptions import (
    DisallowedHost,
    RequestDataTooBig,
    SuspiciousOperation,
    TooManyFieldsSent,
    TooManyFilesSent,
)
from django.http import JsonResponse
from rest_framework import exceptions as drf_exceptions
from rest_framework.response import Response
from rest_framework.settings import api_settings

log = logging.getLogger(__name__)

#: Texts of an error body (``message``, ``param``) longer than this many characters are cut (:func:`clip_text`).
ERROR_TEXT_MAX_CHARS = 400
_CLIP_HEAD_CHARS = 300  # kept from the start of a cut text
_CLIP_TAIL_CHARS = 60  # kept from its end


def clip_text(text: str) -> str:
    """``text`` unchanged if it has at most :data:`ERROR_TEXT_MAX_CHARS` characters, else cut in the middle.

    A cut text keeps its first 300 and last 60 characters around the marker
    ``…[N characters omitted]…`` (under 400 characters in all): the start
    names the field and the problem, the end usually says what was expected,
    and whatever long input the message quoted in between is dropped.
    """
    if len(text) <= ERROR_TEXT_MAX_CHARS:
        return text
    omitted = len(text) - _CLIP_HEAD_CHARS - _CLIP_TAIL_CHARS
    return f"{text[:_CLIP_HEAD_CHARS]}…[{omitted} characters omitted]…{text[-_CLIP_TAIL_CHARS:]}"


def error_body(message: str, err_type: str, param: str | None = None, code: str | None = None) -> dict:
    """The API.md error body; ``message`` and ``param`` are capped with :func:`clip_text`."""
    return {"error": {"message": clip_text(message),
                      "type": err_type,
                      "param": None if param is None else clip_text(param),
                      "code": code}}


#: What an error of a load that ends a committed management transition adds to its message
#: (:meth:`ApplicationError.entry_committed`).
ENTRY_COMMITTED_NOTE = "; the entry is registered and stays unloaded (the next request retries the load)"


class ApplicationError(Exception):
    """Base of every error a client may see; ``status``, ``type`` and ``code`` follow API.md.

    ``code`` (the body's machine code, None for most errors) is a class
    attribute: each code is the code of one small subclass (:class:`WorkerLost`
    is ``worker_lost``), raised instead of repeating the string at raise sites.
    ``message`` and ``param`` are stored capped (:func:`clip_text`), so every
    place that shows them (the API, the admin's messages) shows the short form.

    ``committed`` (keyword ``committed``): the error ends a management
    transition whose entry is committed although it failed (the first load
    failed); the admin then reports the entry as registered, and the message
    ends with :data:`ENTRY_COMMITTED_NOTE`. An error is never changed after
    it is raised: :meth:`entry_committed` makes a new one.
    """

    status = 500
    type = "server_error"
    code: str | None = None

    def __init__(self, message: str, *, param: str | None = None, committed: bool = False):
        message = clip_text(message)
        super().__init__(message)
        self.message = message + ENTRY_COMMITTED_NOTE if committed else message
        self.param = None if param is None else clip_text(param)
        self.committed = committed

    def body(self) -> dict:
        """Return the API.md error body for this error."""
        return error_body(self.message, self.type, self.param, self.code)

    def headers(self) -> dict[str, str]:
        """Extra response headers (``Retry-After`` for 503)."""
        return {}

    def _same_kwargs(self) -> dict:
        """The constructor's keyword arguments (besides ``message`` and ``committed``) that rebuild this error."""
        return {"param": self.param}

    def entry_committed(self) -> ApplicationError:
        """A new error of this class, status, code, param and headers whose ``committed`` is set and whose
        message ends with :data:`ENTRY_COMMITTED_NOTE` (this one is left as it is)."""
        return type(self)(self.message, committed=True, **self._same_kwargs())


class InvalidRequest(ApplicationError):
    """400: bad field, bad count, bad audio, unsupported option."""

    status = 400
    type = "invalid_request_error"


class PayloadTooLarge(InvalidRequest):
    """413: body over ``max_request_body_bytes``, or audio over ``max_audio_seconds``."""

    status = 413


class LengthRequired(InvalidRequest):
    """411: a request body without Content-Length (chunked uploads are not supported)."""

    status = 411


class UnsupportedMedia(InvalidRequest):
    """415: audio container or codec that cannot be decoded."""

    status = 415


class NotFound(ApplicationError):
    """404: unknown model id or route."""

    status = 404
    type = "not_found"


class Forbidden(ApplicationError):
    """403: management disabled (``ui_management`` off) or the caller lacks ``registry.manage_models``."""

    status = 403
    type = "forbidden"


class Conflict(ApplicationError):
    """409: a state conflict that cannot queue (e.g. the model changed family while a request waited)."""

    status = 409
    type = "conflict"


class ServerBusy(ApplicationError):
    """503 ``server_busy``: the server cannot serve this now; ``Retry-After`` is ``retry_after_s`` (seconds, ≥ 1).

    Raised as one of its subclasses, each with its own ``code``.
    """

    status = 503
    type = "server_busy"

    def __init__(self, message: str, *, retry_after_s: int = 1, committed: bool = False):
        super().__init__(message, committed=committed)
        self.retry_after_s = retry_after_s

    def headers(self) -> dict[str, str]:
        return {"Retry-After": str(self.retry_after_s)}

    def _same_kwargs(self) -> dict:
        return {"retry_after_s": self.retry_after_s}


class QueueTimeout(ServerBusy):
    """503 ``queue_timeout``: no slot was granted within the request's busy timeout (R3.2)."""

    code = "queue_timeout"


class Overdue(ServerBusy):
    """503 ``overdue``: the queue ahead would not let this request start within its timeout (fail-fast, R3.3)."""

    code = "overdue"


class GrantExpired(ServerBusy):
    """503 ``grant_expired``: the slot granted to this request expired before the request took it."""

    code = "grant_expired"


class ResidencyFull(ServerBusy):
    """503 ``residency_full``: ``max_loaded_models`` are loaded and none could be evicted in time (busy, or
    under ``eviction_policy`` ``recent_use`` in more use or inside its minimum residency, R6.1), or this
    process lost its turn for a cold load (R6.6)."""

    code = "residency_full"


class WorkerLost(ServerBusy):
    """503 ``worker_lost``: the worker running or loading the model stopped responding, or its pool was
    lost twice (R7.4)."""

    code = "worker_lost"


class NoWorker(ServerBusy):
    """503 ``no_worker``: no GPU worker is alive, none is being started, or none picked up the load (R7.4)."""

    code = "no_worker"


class RunExpired(ServerBusy):
    """503 ``expired``: the request's input expired on the worker before it ran (run kind ``expired``)."""

    code = "expired"


class RunCancelled(ServerBusy):
    """503 ``cancelled``: the worker stopped the run because its client left (run kind ``cancelled``)."""

    code = "cancelled"


class ModelCrashed(ServerBusy):
    """503 ``model_crashed``: the model's process ended during the run (a crash, the OOM killer, or another
    run of the model that passed its deadline); the model is recorded failed and reloads on demand
    (run kind ``crashed``)."""

    code = "model_crashed"


class RunDeadline(ServerBusy):
    """503 ``run_deadline``: the run passed its deadline (the registration's ``max_run_ms``, scaled by
    input length) and its model's process was stopped (run kind ``deadline``, R3.6)."""

    code = "run_deadline"


class DecodeBudgetFull(ServerBusy):
    """503 ``decode_budget``: this process already holds ``max_decoded_bytes_in_flight`` of decoded audio."""

    code = "decode_budget"


class ShuttingDown(ServerBusy):
    """503 ``shutting_down``: the process drains; work it did not start is refused or cut."""

    code = "shutting_down"


class RedisUnavailable(ServerBusy):
    """503 ``redis_unavailable``: the coordination store (Redis) failed or is overloaded."""

    code = "redis_unavailable"


class ModelLoadFailed(ServerBusy):
    """503 ``server_busy`` with code ``load_failed``: a model load failed, not by the caller's fault
    (a bad checkpoint on disk).

    The model stays registered and unloaded, and a later request retries the
    load (R4.2) once the failed load's backoff has passed (R6.7;
    ``retry_after_s`` → ``Retry-After``).
    """

    code = "load_failed"


class InsufficientMemory(ServerBusy):
    """503 ``insufficient_memory`` (type and code): the memory guard refused a load (R6.5)."""

    type = "insufficient_memory"
    code = "insufficient_memory"


class ManagementDisabled(Forbidden):
    """403 ``management_disabled``: management is off (``ui_management``)."""

    code = "management_disabled"


class ManagePermissionDenied(Forbidden):
    """403 ``permission_denied``: the caller lacks ``registry.manage_models`` (or is not signed in)."""

    code = "permission_denied"


class HostNotAllowed(InvalidRequest):
    """400 ``disallowed_host``: the ``Host`` header is not a name of this server (``allowed_hosts``)."""

    code = "disallowed_host"


def invalid_request_from(detail) -> InvalidRequest:
    """Our error for the first problem in a DRF ``ValidationError`` detail (a serializer's ``errors``).

    The first problem follows the serializer's field order (nested serializers
    included). ``param`` is its field path: the dict keys leading to it
    joined by dots (``request.audio_base64``), without ``non_field_errors``
    (a problem of a whole object names that object; of the whole body, None)
    and without list indices. The message is the field's own. A problem
    with code ``payload_too_large`` becomes :class:`PayloadTooLarge` (413).
    """
    keys: list[str] = []
    while isinstance(detail, (dict, list)) and detail:
        if isinstance(detail, dict):
            key, detail = next(iter(detail.items()))
            if isinstance(key, str) and key != api_settings.NON_FIELD_ERRORS_KEY:
                keys.append(key)
        else:
            detail = detail[0]
    error_class = PayloadTooLarge if getattr(detail, "code", None) == "payload_too_large" else InvalidRequest
    return error_class(str(detail) or "invalid request", param=".".join(keys) or None)


def error_response(error: ApplicationError) -> Response:
    """Render ``error`` as a DRF response."""
    return Response(error.body(), status=error.status, headers=error.headers())


def django_limit_error(exc: SuspiciousOperation) -> InvalidRequest:
    """Our error for a request Django refuses while reading it (``SuspiciousOperation``).

    ``RequestDataTooBig`` (a body over ``DATA_UPLOAD_MAX_MEMORY_SIZE``) is a
    413; too many form fields or query parameters (``TooManyFieldsSent``,
    over ``DATA_UPLOAD_MAX_NUMBER_FIELDS``), too many files
    (``TooManyFilesSent``, over ``DATA_UPLOAD_MAX_NUMBER_FILES``) and any
    other suspicious request (an invalid ``Host`` header, say) are a 400.
    """
    if isinstance(exc, RequestDataTooBig):
        return PayloadTooLarge("the request body is too large")
    if isinstance(exc, TooManyFieldsSent):
        return InvalidRequest(f"too many form fields or query parameters (at most "
                              f"{settings.DATA_UPLOAD_MAX_NUMBER_FIELDS} are accepted)")
    if isinstance(exc, TooManyFilesSent):
        return InvalidRequest(f"too many uploaded files (at most {settings.DATA_UPLOAD_MAX_NUMBER_FILES} "
                              f"are accepted)")
    return InvalidRequest(f"bad request: {exc}" if str(exc) else "bad request")


_DRF_MAP = {
    400: ("invalid_request_error", InvalidRequest),
    401: ("authentication_error", None),
    403: ("forbidden", None),
    404: ("not_found", NotFound),
    405: ("invalid_request_error", None),
    406: ("invalid_request_error", None),
    413: ("invalid_request_error", PayloadTooLarge),
    415: ("invalid_request_error", UnsupportedMedia),
}


def drf_exception_handler(exc: Exception, context: dict) -> Response:
    """DRF ``EXCEPTION_HANDLER``: every error leaves in the API.md shape.

    ``ApplicationError`` renders itself; a serializer's ``ValidationError``
    becomes one ``invalid_request_error`` naming the first bad field (see
    :func:`invalid_request_from`); DRF's other errors (parse errors,
    method not allowed) map to their status with the documented type; Django's
    refusals while reading the request (too many query parameters, form fields
    or files; see :func:`django_limit_error`) are a 400 or 413; anything else
    is a bug and becomes a logged 500 ``server_error``.
    """
    if isinstance(exc, ApplicationError):
        return error_response(exc)
    if isinstance(exc, SuspiciousOperation):  # raised where the view reads request.GET / .data
        return error_response(django_limit_error(exc))
    if isinstance(exc, drf_exceptions.ValidationError):  # an input serializer refused the body
        return error_response(invalid_request_from(exc.detail))
    if isinstance(exc, drf_exceptions.APIException):
        status = exc.status_code
        err_type = _DRF_MAP.get(status, ("server_error", None))[0]
        detail = exc.detail
        if isinstance(detail, dict):
            message = "; ".join(f"{k}: {v}" for k, v in detail.items())
        elif isinstance(detail, list):
            message = "; ".join(str(v) for v in detail)
        else:
            message = str(detail)
        body = error_body(message, err_type)
        headers = {"WWW-Authenticate": exc.auth_header} if getattr(exc, "auth_header", None) else None
        return Response(body, status=status, headers=headers)
    if isinstance(exc, RecursionError):  # a parser fed absurdly nested JSON
        return error_response(InvalidRequest("the request body is nested too deeply"))
    if isinstance(exc, redis.exceptions.RedisError):
        log.error("coordination store error in %s: %s", context.get("view"), exc)
        busy = RedisUnavailable(f"the coordination store (Redis) is unavailable or overloaded: "
                                f"{type(exc).__name__}")
        return error_response(busy)
    log.exception("unhandled error in %s", context.get("view"))
    return Response(error_body("internal server error", "server_error"), status=500)


class OnlyServerErrors(logging.Filter):
    """Logging filter for ``django.request``: keep HTTP 500 records (bugs), drop expected 4xx/503."""

    def filter(self, record: logging.LogRecord) -> bool:
        return getattr(record, "status_code", 500) == 500


HOST_ECHO_MAX_CHARS = 200


def disallowed_host_error(host: str) -> HostNotAllowed:
    """400 for a ``Host`` header this server does not answer to (``ALLOWED_HOSTS``, DNS rebinding).

    ``host`` is the raw header; at most ``HOST_ECHO_MAX_CHARS`` of it are echoed.
    """
    shown = host if len(host) <= HOST_ECHO_MAX_CHARS else host[:HOST_ECHO_MAX_CHARS] + "…"
    return HostNotAllowed(
        f"the Host header {shown!r} is not a name of this server; an operator can add it to "
        "'allowed_hosts' in the server configuration")


def bad_request_view(request, exception=None) -> JsonResponse:
    """Django ``handler400``: a request Django itself refuses outside a DRF view (an invalid
    ``Host`` header, too many query parameters, ...: ``SuspiciousOperation``), in the API.md shape;
    ``RequestDataTooBig`` is a 413 (see :func:`django_limit_error`)."""
    if isinstance(exception, DisallowedHost):
        error: ApplicationError = disallowed_host_error(request.META.get("HTTP_HOST", ""))
    elif isinstance(exception, SuspiciousOperation):
        error = django_limit_error(exception)
    else:
        error = InvalidRequest(f"bad request: {exception}" if exception else "bad request")
    return JsonResponse(error.body(), status=error.status, json_dumps_params={"separators": (",", ":")})


def not_found_view(request, exception=None) -> JsonResponse:
    """Django ``handler404``: unknown route in the API.md shape."""
    body = NotFound(f"no route for {request.method} {request.path}").body()
    return JsonResponse(body, status=404, json_dumps_params={"separators": (",", ":")})


def server_error_view(request) -> JsonResponse:
    """Django ``handler500``: an uncaught exception outside DRF (a bug)."""
    body = error_body("internal server error", "server_error")
    return JsonResponse(body, status=500, json_dumps_params={"separators": (",", ":")})
