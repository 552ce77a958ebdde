"""Requests to a test server: JSON bodies of ``/v1/tasks/run``, bounded async clients, the official
OpenAI SDK, the documented error shape checked, and one HTTP/1.1 exchange written by hand on a socket
(for bodies no HTTP client would send: a false Content-Length).
"""
from __future__ import annotations

import base64
import select
import socket
import time
from collections.abc import Iterable
from dataclasses import dataclass

import httpx
import openai

from .audio import TINY
from .bounds import MODEL_S, QUICK_S


def without_timing(answer: dict | httpx.Response) -> dict:
    """An answer's JSON body (given as a dict or a response) without ``timing``, which differs between two
    runs of the same request: what must be equal when outputs are compared."""
    payload = answer.json() if isinstance(answer, httpx.Response) else answer
    return {key: value for key, value in payload.items() if key != "timing"}


def error_of(resp: httpx.Response, statuses: tuple[int, ...]) -> dict:
    """The ``error`` of a refusal whose status is one of ``statuses``, checked against the documented shape
    (``message``, ``type``, ``param``, ``code``; a 503 is ``server_busy`` with ``Retry-After``, any other an
    ``invalid_request_error``)."""
    assert resp.status_code in statuses, (resp.status_code, resp.text[:400])
    error = resp.json()["error"]
    assert set(error) == {"message", "type", "param", "code"} and error["message"], error
    if resp.status_code == 503:
        assert error["type"] == "server_busy" and "retry-after" in resp.headers, (error, resp.headers)
    else:
        assert error["type"] == "invalid_request_error", error
    return error


def openai_client(stack) -> openai.OpenAI:
    """The official OpenAI SDK pointed at ``stack`` (no retries; a model-sized timeout)."""
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=MODEL_S)



# -- requests to a stack ---------------------------------------------------------------------------
def body(model: str, data: bytes = TINY, **options) -> dict:
    timeout = options.pop("busy_timeout_ms", None)
    payload = {"model": model, "request": {"audio_base64": base64.b64encode(data).decode(), "options": options}}
    if timeout is not None:
        payload["busy_timeout_ms"] = timeout
    return payload


async def post(client: httpx.AsyncClient, model: str, data: bytes = TINY, **options):
    started = time.monotonic()
    resp = await client.post("/v1/tasks/run", json=body(model, data, **options))
    return resp, started, time.monotonic()


def operator_token(deployment) -> str:
    """A fresh management token for user ``operator`` from the deployment's ``manage.py issue_token``
    (a stack or a cluster); AssertionError with its stderr if the command fails."""
    done = deployment.manage("issue_token", "operator")
    assert done.returncode == 0, done.stderr
    return done.stdout.strip()


def mclient(stack, token: str | None, **kw) -> httpx.AsyncClient:
    """An async client of ``stack`` (with ``token`` for the management routes). Its timeout bounds
    every request, also one awaited later through a task: QUICK_S unless ``timeout`` says otherwise;
    ``headers`` add to (or replace) the token's."""
    headers = {**({"Authorization": f"Token {token}"} if token else {}), **kw.pop("headers", {})}
    return httpx.AsyncClient(base_url=stack.url, timeout=kw.pop("timeout", QUICK_S), headers=headers,
                             limits=httpx.Limits(max_connections=64), **kw)



@dataclass
class RawAnswer:
    """What :func:`raw_exchange` saw: the answer's ``status`` (0 if none) and ``body``, the body bytes
    the client had sent when the answer arrived, and the seconds from the first byte sent to the answer."""

    status: int
    body: bytes
    sent_bytes: int
    elapsed_s: float


def raw_exchange(stack, head: bytes, chunks: Iterable[bytes], timeout_s: float = QUICK_S) -> RawAnswer:
    """Write ``head`` (request line and headers, ending in a blank line) then ``chunks`` to a socket,
    as a client that stops sending once the server answers; read the answer until the server closes.

    Every socket operation and the whole exchange are bounded by ``timeout_s``.
    """
    host, port = stack.url.rsplit("//", 1)[1].split(":")
    deadline = time.monotonic() + timeout_s
    sent = 0
    with socket.create_connection((host, int(port)), timeout=timeout_s) as sock:
        started = time.monotonic()
        sock.sendall(head)
        answered_at = None
        try:
            for chunk in chunks:
                if select.select([sock], [], [], 0)[0]:
                    break  # the server answered early: stop sending
                if time.monotonic() > deadline:
                    raise AssertionError(f"still sending after {timeout_s:g} s")
                sock.sendall(chunk)
                sent += len(chunk)
        except (BrokenPipeError, ConnectionResetError):
            pass  # the server closed its side; its answer may still be readable
        data = b""
        try:
            while time.monotonic() < deadline:
                piece = sock.recv(65536)
                if answered_at is None:
                    answered_at = time.monotonic()
                if not piece:
                    break
                data += piece
                if b"\r\n\r\n" in data:
                    head_text, _, rest = data.partition(b"\r\n\r\n")
                    length = next((int(line.split(b":", 1)[1]) for line in head_text.split(b"\r\n")
                                   if line.lower().startswith(b"content-length:")), None)
                    if length is not None and len(rest) >= length:
                        break
        except (TimeoutError, ConnectionResetError):
            pass
    elapsed = (answered_at or time.monotonic()) - started
    if not data.startswith(b"HTTP/1."):
        return RawAnswer(0, data, sent, elapsed)
    head_text, _, body_bytes = data.partition(b"\r\n\r\n")
    return RawAnswer(int(head_text.split(b" ", 2)[1]), body_bytes, sent, elapsed)


