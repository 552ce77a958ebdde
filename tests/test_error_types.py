"""Errors as types: each machine ``code`` of the error shape (API.md) is the class attribute of exactly one
``ApplicationError`` subclass, each subclass answers the status, type, code and ``Retry-After`` its raise
sites answered when they passed the code as a string, and no error is changed after it is raised.

No server: the classes, the renderers (``audiosite.errors``) and ``reply_error`` are checked directly; the
routes that raise them are covered by the modules of their behaviour (test_http, test_management, ...).
"""
from __future__ import annotations

import ast
from pathlib import Path

import pytest
import redis

from audiosite import errors
from audiosite.errors import (ENTRY_COMMITTED_NOTE, ApplicationError, DecodeBudgetFull, GrantExpired,
                              HostNotAllowed, InsufficientMemory, ManagePermissionDenied, ManagementDisabled,
                              ModelCrashed, ModelLoadFailed, NoWorker, Overdue, QueueTimeout, RedisUnavailable,
                              ResidencyFull, RunCancelled, RunDeadline, RunExpired, ServerBusy, ShuttingDown,
                              WorkerLost, clip_text, drf_exception_handler, error_body, error_response)
from inference.runtime.runs import RunFailure
from inference.services.request import reply_error

REPO = Path(__file__).resolve().parent.parent
APP_PACKAGES = ("audiosite", "inference", "registry", "ui")

# code → (class, status, type, Retry-After of a default construction or None): what the raise sites
# answered when they wrote ``ServerBusy(..., code="...")``, ``Forbidden(..., code="...")`` and so on.
ANSWERS = {
    "queue_timeout": (QueueTimeout, 503, "server_busy", "1"),
    "overdue": (Overdue, 503, "server_busy", "1"),
    "grant_expired": (GrantExpired, 503, "server_busy", "1"),
    "residency_full": (ResidencyFull, 503, "server_busy", "1"),
    "worker_lost": (WorkerLost, 503, "server_busy", "1"),
    "no_worker": (NoWorker, 503, "server_busy", "1"),
    "expired": (RunExpired, 503, "server_busy", "1"),
    "cancelled": (RunCancelled, 503, "server_busy", "1"),
    "decode_budget": (DecodeBudgetFull, 503, "server_busy", "1"),
    "model_crashed": (ModelCrashed, 503, "server_busy", "1"),
    "run_deadline": (RunDeadline, 503, "server_busy", "1"),
    "shutting_down": (ShuttingDown, 503, "server_busy", "1"),
    "redis_unavailable": (RedisUnavailable, 503, "server_busy", "1"),
    "load_failed": (ModelLoadFailed, 503, "server_busy", "1"),
    "insufficient_memory": (InsufficientMemory, 503, "insufficient_memory", "1"),
    "management_disabled": (ManagementDisabled, 403, "forbidden", None),
    "permission_denied": (ManagePermissionDenied, 403, "forbidden", None),
    "disallowed_host": (HostNotAllowed, 400, "invalid_request_error", None),
}


def _error_classes() -> list[type[ApplicationError]]:
    found, todo = [], [ApplicationError]
    while todo:
        cls = todo.pop()
        found.append(cls)
        todo.extend(cls.__subclasses__())
    return [cls for cls in found if cls.__module__ == errors.__name__]


def test_each_machine_code_is_the_code_of_exactly_one_error_class():
    """Every code set by a class of ``audiosite.errors`` names one class, and the codes are the known ones."""
    owners: dict[str, list[str]] = {}
    for cls in _error_classes():
        if cls.__dict__.get("code") is not None:
            owners.setdefault(cls.__dict__["code"], []).append(cls.__name__)
    assert {code: names for code, names in owners.items() if len(names) > 1} == {}
    assert {code: names[0] for code, names in owners.items()} == \
        {code: answer[0].__name__ for code, answer in ANSWERS.items()}


@pytest.mark.parametrize("code", sorted(ANSWERS))
def test_each_error_class_answers_the_status_type_code_and_headers_of_its_code(code):
    """The body (API.md error shape), status and headers of each class, rendered as the DRF handler does."""
    cls, status, err_type, retry_after = ANSWERS[code]
    error = cls("model 'm': something went wrong; retry")
    assert error.code == code and error.status == status
    assert error.body() == {"error": {"message": "model 'm': something went wrong; retry", "type": err_type,
                                      "param": None, "code": code}}
    response = error_response(error)
    assert response.status_code == status and response.data == error.body()
    assert response.headers.get("Retry-After") == retry_after


def test_a_503_states_its_retry_after_in_whole_seconds():
    """R6.7: a failed load's backoff is its ``Retry-After``; the memory guard asks for 5 s."""
    assert ModelLoadFailed("model 'm' failed to load (x)", retry_after_s=7).headers() == {"Retry-After": "7"}
    assert InsufficientMemory("model 'm' needs more", retry_after_s=5).headers() == {"Retry-After": "5"}


def test_a_failed_model_load_is_a_server_busy():
    """R4.2: a failed load is a 503 ``server_busy`` like every other refusal to serve now."""
    assert issubclass(ModelLoadFailed, ServerBusy)
    error = ModelLoadFailed("model 'm' failed to load: bad checkpoint")
    assert (error.status, error.type, error.code) == (503, "server_busy", "load_failed")


def test_a_code_cannot_be_passed_at_a_raise_site():
    """The code belongs to the class: a raise site that names one as a string is refused."""
    with pytest.raises(TypeError):
        ServerBusy("busy", code="worker_lost")  # type: ignore[call-arg]
    with pytest.raises(TypeError):
        ApplicationError("broken", code="worker_lost")  # type: ignore[call-arg]


def test_a_redis_failure_is_answered_503_redis_unavailable():
    response = drf_exception_handler(redis.exceptions.ConnectionError("refused"), {"view": None})
    assert response.status_code == 503 and response.headers.get("Retry-After") == "1"
    assert response.data == error_body("the coordination store (Redis) is unavailable or overloaded: "
                                       "ConnectionError", "server_busy", code="redis_unavailable")


def test_an_unknown_host_is_answered_400_disallowed_host():
    error = errors.disallowed_host_error("evil.example")
    assert isinstance(error, HostNotAllowed) and error.status == 400 and error.code == "disallowed_host"


@pytest.mark.parametrize("kind, cls, code", [(RunFailure.EXPIRED, RunExpired, "expired"),
                                             (RunFailure.CANCELLED, RunCancelled, "cancelled"),
                                             (RunFailure.CRASHED, ModelCrashed, "model_crashed"),
                                             (RunFailure.DEADLINE, RunDeadline, "run_deadline")])
def test_a_run_that_failed_through_no_fault_of_its_input_is_a_503_named_for_its_kind(kind, cls, code):
    error = reply_error("m", {"ok": False, "kind": str(kind), "message": "the input expired"}, "request")
    assert error is not None and type(error) is cls
    assert error.body() == {"error": {"message": "model 'm' could not serve the request: the input expired",
                                      "type": "server_busy", "param": None, "code": code}}


@pytest.mark.parametrize("raised", [
    ModelLoadFailed("model 'm' failed to load: bad checkpoint", retry_after_s=4),
    InsufficientMemory("model 'm' needs about 900 MB", retry_after_s=5),
    NoWorker("model 'm' cannot load: no GPU worker is alive"),
    ModelLoadFailed("model 'm' failed to load: " + "Traceback line\n" * 200),  # a long worker error, clipped
], ids=["load_failed", "insufficient_memory", "no_worker", "long_message"])
def test_a_load_failure_after_a_committed_registration_is_a_new_error_with_the_same_answer(raised):
    """R4.2/R4.6: the registration's failed first load answers the load's error plus the note that the entry
    stays registered; the error the load raised is left as it was (a new one is raised)."""
    before = (raised.message, raised.committed, raised.body(), raised.headers())
    committed = raised.entry_committed()
    assert committed is not raised
    assert (raised.message, raised.committed, raised.body(), raised.headers()) == before
    assert type(committed) is type(raised) and committed.committed is True
    assert (committed.status, committed.code, committed.headers()) == (raised.status, raised.code, raised.headers())
    # What the admin shows and the lifecycle event records: the load's (clipped) message, then the note whole.
    assert committed.message == raised.message + ENTRY_COMMITTED_NOTE
    # What the API answers: that text clipped once more (as error_body clips every message).
    assert committed.body() == error_body(clip_text(raised.message + ENTRY_COMMITTED_NOTE), raised.type,
                                          None, raised.code)


_ERROR_FIELDS = {"message", "param", "code", "committed", "retry_after_s", "status", "type"}


def _error_field_writes(tree: ast.AST) -> list[str]:
    """``x.<field> = ...`` / ``x.<field> += ...`` outside ``self`` for the fields of an ApplicationError."""
    writes = []
    for node in ast.walk(tree):
        targets = node.targets if isinstance(node, ast.Assign) else [node.target] \
            if isinstance(node, (ast.AugAssign, ast.AnnAssign)) else []
        for target in [t for top in targets for t in (top.elts if isinstance(top, ast.Tuple) else [top])]:
            if (isinstance(target, ast.Attribute) and target.attr in _ERROR_FIELDS
                    and not (isinstance(target.value, ast.Name) and target.value.id == "self")):
                writes.append(f"{ast.unparse(target)} (line {target.lineno})")
    return writes


def test_no_code_changes_an_error_after_it_is_raised():
    """An error's answer is fixed when it is made: nothing in the apps assigns an error's fields from outside
    (``exc.committed = True``, ``exc.message += ...``); a different answer is a new error."""
    writes = {}
    for package in APP_PACKAGES:
        for path in sorted((REPO / package).rglob("*.py")):
            found = _error_field_writes(ast.parse(path.read_text(), str(path)))
            if found:
                writes[str(path.relative_to(REPO))] = found
    assert writes == {}
