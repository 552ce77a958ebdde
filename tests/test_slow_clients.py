"""A client that sends its request slowly is cut off by the web process itself (``audiosite.web``
``DeadlineHTTPChannel``; docs/operations.md, limits): its headers must all be in within
``request_header_timeout_ms`` of its first byte (or of the connection's start), its body within
``request_body_timeout_ms`` of the end of its headers; past either it gets 408 ``request_timeout``
(API error shape) and the connection is closed. A byte every 200 ms keeps Twisted's idle timeout
from ever firing, so without these deadlines such a connection stays open for good.
"""
from __future__ import annotations

import json
import socket
import time

import pytest

from .support.clients import body
from .support.stacks import run_stack

pytestmark = pytest.mark.stack

HEADER_MS = 1500
BODY_MS = 2500
MARGIN_S = 2.0  # a loaded two-core machine: the timer, the write, the close
DRIP_EVERY_S = 0.2


@pytest.fixture(scope="module")
def slow_stack(tmp_path_factory):
    tmp = tmp_path_factory.mktemp("slow")
    yield from run_stack(tmp, [{"id": "vad", "family": "silero_vad", "task": "vad", "lazy": True}],
                         redis_db=8, name="slow",
                         extra_config={"request_header_timeout_ms": HEADER_MS, "request_body_timeout_ms": BODY_MS})


def _dribble(stack, head: bytes, drip: bytes, limit_s: float) -> tuple[float, bytes]:
    """Connect, send ``head``, then ``drip`` one byte every ``DRIP_EVERY_S`` until the server closes the
    connection or ``limit_s`` passes; the seconds from the connection to the close, and what was read."""
    host, port = stack.url.rsplit("//", 1)[1].split(":")
    with socket.create_connection((host, int(port)), timeout=limit_s) as sock:
        started = time.monotonic()
        sock.sendall(head)
        data = b""
        for byte in drip:
            if time.monotonic() - started > limit_s:
                raise AssertionError(f"the connection was still open after {limit_s:g} s")
            try:
                sock.sendall(bytes([byte]))
            except (BrokenPipeError, ConnectionResetError):
                break
            sock.settimeout(DRIP_EVERY_S)
            try:
                chunk = sock.recv(65536)
            except TimeoutError:
                continue
            except ConnectionResetError:
                break
            if not chunk:
                break
            data += chunk
        sock.settimeout(limit_s)
        try:
            while chunk := sock.recv(65536):
                data += chunk
        except (ConnectionResetError, TimeoutError):
            pass
        return time.monotonic() - started, data


def _assert_408(data: bytes, part: str) -> None:
    head, _, rest = data.partition(b"\r\n\r\n")
    assert head.startswith(b"HTTP/1.1 408 "), data[:300]
    error = json.loads(rest)["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "request_timeout", error
    assert part in error["message"], error


def test_headers_dribbled_a_byte_at_a_time_get_408_and_the_connection_closes_at_the_header_deadline(slow_stack):
    head = b"POST /v1/tasks/run HTTP/1.1\r\nHost: 127.0.0.1\r\n"
    elapsed_s, data = _dribble(slow_stack, head, b"X-Slow: " + b"a" * 4000, limit_s=HEADER_MS / 1000 + 20)
    assert HEADER_MS / 1000 - 0.1 <= elapsed_s <= HEADER_MS / 1000 + MARGIN_S, elapsed_s
    _assert_408(data, "headers")


def test_a_connection_that_sends_nothing_is_closed_at_the_header_deadline(slow_stack):
    elapsed_s, data = _dribble(slow_stack, b"", b"", limit_s=HEADER_MS / 1000 + 20)
    assert elapsed_s <= HEADER_MS / 1000 + MARGIN_S, elapsed_s
    _assert_408(data, "headers")


def test_a_body_dribbled_a_byte_at_a_time_gets_408_and_the_connection_closes_at_the_body_deadline(slow_stack):
    payload = json.dumps(body("vad")).encode()
    head = (f"POST /v1/tasks/run HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
            f"Content-Length: {len(payload)}\r\n\r\n").encode()
    elapsed_s, data = _dribble(slow_stack, head, payload, limit_s=BODY_MS / 1000 + 20)
    assert BODY_MS / 1000 - 0.1 <= elapsed_s <= BODY_MS / 1000 + MARGIN_S, elapsed_s
    _assert_408(data, "body")


def test_requests_sent_at_once_on_one_keep_alive_connection_are_not_cut(slow_stack):
    """The deadlines bound sending, not answering: requests on one connection, each well within the
    deadlines, spaced by more than the header deadline, are all answered."""
    with slow_stack.client() as c:
        for _ in range(2):
            assert c.get("/health").status_code == 200
            time.sleep(HEADER_MS / 1000 + 0.5)
        assert c.get("/health").status_code == 200
