"""Request bodies are refused before they are read whole.

A ``Content-Length`` over ``max_request_body_bytes`` gets its 413 as soon as
the headers are in, and a body without one (chunked) gets its 413 as soon as
it passes the limit, without the web process buffering it. In a real server
this is daphne's request class (``audiosite.http.daphne_server``), because Twisted receives a
whole body before the application is called; ``ApiHandler`` does the same for
any ASGI server, checked here by driving it with ASGI messages.
"""
from __future__ import annotations

import asyncio
import json

import pytest

from audiosite.http.handler import ApiHandler
from audiosite.serverconfig import get_config

from .support.bounds import QUICK_S, run, within
from .support.clients import raw_exchange
from .support.processes import peak_rss_bytes
from .support.stacks import STACK_MAX_BODY_BYTES, web_pid

MIB = 1024 * 1024


def _assert_413(status: int, body: bytes, limit: int) -> None:
    assert status == 413, body[:300]
    error = json.loads(body)["error"]
    assert error["type"] == "invalid_request_error" and error["param"] is None
    assert f"max_request_body_bytes={limit}" in error["message"]


@pytest.mark.stack
@pytest.mark.parametrize("path, extra", [("/v1/tasks/run", b"Content-Type: application/json\r\n"),
                                         ("/v1/audio/transcriptions",  # as curl uploads a large file
                                          b"Content-Type: multipart/form-data; boundary=x\r\nExpect: 100-continue\r\n"),
                                         ("/admin/login/", b"Content-Type: application/x-www-form-urlencoded\r\n")])
def test_a_declared_10_gb_body_is_refused_at_once_without_waiting_for_it(stack, path, extra):
    """Before: Twisted waited for the 10 GB (here: until the client gave up), spooling what came to disk."""
    head = (f"POST {path} HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Length: 10000000000\r\n".encode()
            + extra + b"\r\n")
    answer = raw_exchange(stack, head, [b'{"mo'], timeout_s=10)
    _assert_413(answer.status, answer.body, STACK_MAX_BODY_BYTES)
    assert answer.elapsed_s < 2.0, answer.elapsed_s
    with stack.client() as c:
        assert c.get("/health").status_code == 200


@pytest.mark.stack
def test_a_chunked_body_past_the_limit_is_refused_while_it_streams_and_is_not_buffered(stack):
    """Before: the whole 128 MiB was received, then queued in the web process's memory (daphne hands the
    body to the application in one go), then refused with 411. Now the 413 comes once the limit (3 MB) is
    passed, and the peak RSS of the web process grows by far less than the body."""
    pid = web_pid(stack)
    with open(f"/proc/{pid}/clear_refs", "w") as refs:
        refs.write("5")  # reset the peak RSS (VmHWM) to the current RSS
    baseline = peak_rss_bytes(pid)
    piece = b"x" * MIB
    frame = b"%x\r\n" % len(piece) + piece + b"\r\n"
    body_mib = 128
    head = (b"POST /v1/tasks/run HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            b"Transfer-Encoding: chunked\r\n\r\n")
    answer = raw_exchange(stack, head, [*([frame] * body_mib), b"0\r\n\r\n"], timeout_s=QUICK_S)
    _assert_413(answer.status, answer.body, STACK_MAX_BODY_BYTES)
    assert answer.sent_bytes < body_mib * MIB // 4, answer.sent_bytes  # answered while the body streamed
    growth = peak_rss_bytes(pid) - baseline
    assert growth < 24 * MIB, f"the web process's peak RSS grew by {growth / MIB:.0f} MiB"
    with stack.client() as c:
        assert c.get("/health").status_code == 200


# -- ApiHandler under any ASGI server ------------------------------------------------------------------

def _scope(path: str, headers: list[tuple[bytes, bytes]]) -> dict:
    return {"type": "http", "asgi": {"version": "3.0"}, "http_version": "1.1", "method": "POST", "scheme": "http",
            "path": path, "raw_path": path.encode(), "root_path": "", "query_string": b"", "headers": headers,
            "client": ("127.0.0.1", 5000), "server": ("127.0.0.1", 8080)}


async def _call(scope: dict, receive) -> tuple[int, bytes]:
    sent: list[dict] = []

    async def send(message: dict) -> None:
        sent.append(message)

    await within(ApiHandler()(scope, receive, send), QUICK_S)
    status = next(m["status"] for m in sent if m["type"] == "http.response.start")
    return status, b"".join(m.get("body", b"") for m in sent if m["type"] == "http.response.body")


def test_the_api_handler_refuses_a_declared_oversize_body_without_receiving_any_of_it():
    limit = get_config().max_request_body_bytes
    headers = [(b"content-type", b"application/json"), (b"content-length", b"10000000000")]
    received = 0

    async def receive() -> dict:
        nonlocal received
        received += 1
        return {"type": "http.request", "body": b"{}", "more_body": True}

    status, body = run(_call(_scope("/v1/tasks/run", headers), receive))
    _assert_413(status, body, limit)
    assert received == 0
    huge = [(b"content-length", b"9" * 5000)]  # beyond Python's int() digit limit: still a 413, not a 500
    status, body = run(_call(_scope("/v1/tasks/run", huge), receive))
    assert status == 413 and received == 0, body


def test_the_api_handler_stops_reading_a_streamed_body_at_the_limit():
    limit = get_config().max_request_body_bytes
    piece = b"x" * (4 * MIB)
    received = 0

    async def endless() -> dict:
        nonlocal received
        received += 1
        await asyncio.sleep(0)
        return {"type": "http.request", "body": piece, "more_body": True}

    status, body = run(_call(_scope("/v1/tasks/run", [(b"content-type", b"application/json")]), endless))
    _assert_413(status, body, limit)
    assert received == limit // len(piece) + 1  # the message that crossed the limit was the last one read


def test_the_api_handler_still_reads_a_body_within_the_limit():
    messages = [{"type": "http.request", "body": b'{"model": ', "more_body": True},
                {"type": "http.request", "body": b'"vad"}', "more_body": False}]

    async def receive() -> dict:
        return messages.pop(0) if messages else {"type": "http.disconnect"}

    headers = [(b"content-type", b"application/json"), (b"content-length", b"16")]
    status, body = run(_call(_scope("/v1/tasks/run", headers), receive))
    assert status == 400, body  # the view read the body: the serializer refuses it for lack of 'request'
    assert json.loads(body)["error"]["param"] == "request"
