"""A web process that cannot serve for a while (``refuse_connections_when_unready``): its Redis goes away
and comes back, or it drains; and its realtime sessions across a Redis outage.

On: while the process's scheduler listener has lost its subscription the process refuses connections
and has closed its idle keep-alive ones (what lets nginx's ``proxy_next_upstream error`` pass requests
to another web process); once Redis answers again it accepts and serves on the same address. Off (the
default): it keeps accepting and answers each API request 503 ``redis_unavailable`` in the error shape.
An open realtime session outlives a Redis restart (its Channels layer waits for Redis), and one opened
while Redis is gone gets an ``error`` event ``redis_unavailable`` and close code 1013.

On, it also refuses connections from the start of its drain (SIGTERM) while the request it holds is
answered. On or off, a request whose body is still arriving when the drain begins is answered (503
``shutting_down``) before the process exits.

The Redis tests run their own ``redis-server`` (killed and started again on the same port) and one
``python -m audiosite.web`` process on SQLite, with no worker: the routes used read Redis only. The
drain test runs a web process and a worker as docs/operations.md ("Scale-out") starts them, with a
fixture run held at a barrier. The SSE stream tests run a web process and a worker on the test's own
Redis (``run_cluster``'s ``redis_base``) with Piper and Whisper.
"""
from __future__ import annotations

import asyncio
import base64
import json
import os
import socket
import subprocess
import sys
import time
from pathlib import Path

import httpx
import httpx_sse
import pytest
import redis
import signal
import websockets

from .redis_per_worker import _binary as redis_binary
from .support.audio import load_speech, long_speech
from .support.bounds import QUICK_S, run, until, within
from .support.clients import mclient, post
from .support.cluster import run_cluster
from .support.processes import ROOT, accepts_connections, free_port, kill_process_tree
from .support.stacks import FIXTURE_ENV, assert_no_task_collected

pytestmark = pytest.mark.stack

NOTICE_S = 1.0
"""How soon after Redis goes (or comes back) the port must be closed (or open): the listener sees the
reset at once and retries its subscription every 0.2 s."""


class OwnRedis:
    """A redis-server on a fixed free port that the test can kill and start again (state lost)."""

    def __init__(self) -> None:
        self.port = free_port()
        self.url = f"redis://127.0.0.1:{self.port}/0"
        self.proc: subprocess.Popen | None = None

    def start(self) -> None:
        self.proc = subprocess.Popen([redis_binary(), "--port", str(self.port), "--bind", "127.0.0.1",
                                      "--save", "", "--appendonly", "no"],
                                     stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        deadline = time.monotonic() + QUICK_S
        while True:
            try:
                with redis.Redis.from_url(self.url, socket_timeout=1) as client:
                    client.ping()
                return
            except redis.ConnectionError:
                assert time.monotonic() < deadline, "redis-server did not start"
                time.sleep(0.05)

    def kill(self) -> None:
        assert self.proc is not None
        self.proc.kill()
        self.proc.wait(QUICK_S)
        self.proc = None


@pytest.fixture
def own_redis():
    server = OwnRedis()
    server.start()
    yield server
    if server.proc is not None:
        server.kill()


def start_web(tmp: Path, redis_url: str, refuse: bool, registered: bool = False) -> tuple[subprocess.Popen, int]:
    """One web process (no worker) on SQLite in ``tmp``, with ``refuse_connections_when_unready``
    set to ``refuse``; returns it and its port once it accepts. Its one model, a lazy Whisper named
    ``asr``, is never loaded (no worker); ``registered``: ``migrate`` and ``sync_config`` run first, so
    the registry in Redis names it."""
    port = free_port()
    config = tmp / "server.json"
    model = {"id": "asr", "family": "whisper", "task": "asr", "lazy": True}
    config.write_text(json.dumps({"host": "127.0.0.1", "port": port, "backend": "cpu", "models": [model],
                                  "refuse_connections_when_unready": refuse}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("AUDIOSITE_")}
    env.pop("DATABASE_URL", None)
    env.update(REDIS_URL=redis_url, AUDIOSITE_CONFIG=str(config), AUDIOSITE_VAR_DIR=str(tmp / "var"),
               PYTHONUNBUFFERED="1")
    for command in (["migrate", "--verbosity", "0"], ["sync_config"]) if registered else ():
        done = subprocess.run([sys.executable, "manage.py", *command], cwd=ROOT, env=env, capture_output=True,
                              text=True, timeout=QUICK_S * 2)
        assert done.returncode == 0, done.stdout + done.stderr
    log = tmp / "web.log"
    proc = subprocess.Popen([sys.executable, "-m", "audiosite.web", "-b", "127.0.0.1", "-p", str(port),
                             "audiosite.asgi:application"], cwd=ROOT, env=env, stdout=log.open("wb"),
                            stderr=subprocess.STDOUT)
    deadline = time.monotonic() + QUICK_S * 2
    while not accepts_connections("127.0.0.1", port):
        assert proc.poll() is None and time.monotonic() < deadline, log.read_text()
        time.sleep(0.05)
    return proc, port



def wait_for(predicate, timeout_s: float) -> float:
    """Seconds until ``predicate()`` was true (polled every 10 ms); AssertionError past ``timeout_s``."""
    started = time.monotonic()
    while not predicate():
        assert time.monotonic() - started < timeout_s, f"not within {timeout_s} s"
        time.sleep(0.01)
    return time.monotonic() - started


def connection_closed_by_server(sock: socket.socket) -> bool:
    """True once the server closed ``sock`` (a read returns EOF or a reset); False while it is open."""
    sock.setblocking(False)
    try:
        return sock.recv(1) == b""
    except BlockingIOError:
        return False
    except ConnectionResetError:
        return True


def test_on_a_web_process_refuses_connections_while_redis_is_gone_and_serves_once_it_is_back(tmp_path, own_redis):
    """Redis is killed and started again twice: each time the port closes (an idle keep-alive
    connection is closed too) and opens again once the listener has resubscribed, and the process
    serves; its log shows no task of it was freed while pending (the follower of Redis must live as
    long as the process)."""
    proc, port = start_web(tmp_path, own_redis.url, refuse=True)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=QUICK_S) as client:
            assert client.get("/v1/models").status_code == 200
            for cycle in range(2):
                idle = socket.create_connection(("127.0.0.1", port))  # a proxy's idle keep-alive connection
                idle.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n\r\n")
                assert b" 200 " in idle.recv(65536).split(b"\r\n", 1)[0]

                own_redis.kill()
                closed_s = wait_for(lambda: not accepts_connections("127.0.0.1", port), NOTICE_S)
                wait_for(lambda idle=idle: connection_closed_by_server(idle), NOTICE_S)
                idle.close()
                time.sleep(0.5)  # the listener's retries (every 0.2 s) fail meanwhile; still refused
                assert not accepts_connections("127.0.0.1", port)

                own_redis.start()
                opened_s = wait_for(lambda: accepts_connections("127.0.0.1", port), NOTICE_S + 1)
                resp = client.get("/v1/models")
                assert resp.status_code == 200, resp.text
                print(f"cycle {cycle}: port closed {closed_s * 1000:.0f} ms after Redis was killed, open "
                      f"{opened_s * 1000:.0f} ms after it was started again")
        assert proc.poll() is None
        log = (tmp_path / "web.log").read_text()
        assert log.count("refusing connections") == 2 and log.count("accepting connections") >= 2, log[-3000:]
        assert_no_task_collected(log)
    finally:
        kill_process_tree(proc)


def test_on_a_connection_whose_request_headers_straddle_the_closing_is_closed_after_that_request(
        tmp_path, own_redis):
    """A request whose headers are half in when Redis goes (a slow client, a proxy's write split in two):
    once its headers end it is answered (503 ``redis_unavailable``, ``Connection: close``) and the
    connection is then closed, not kept alive for the next request of the outage (Twisted re-reads
    ``persistent`` from each request's headers, which undid the gate's ``persistent = False``)."""
    proc, port = start_web(tmp_path, own_redis.url, refuse=True)
    try:
        straddling = socket.create_connection(("127.0.0.1", port), timeout=QUICK_S)
        straddling.sendall(b"GET /v1/models HTTP/1.1\r\nHost: 127.0.0.1\r\n")
        time.sleep(0.2)  # the first half is in (the channel has a partial request)
        own_redis.kill()
        wait_for(lambda: not accepts_connections("127.0.0.1", port), NOTICE_S)
        straddling.sendall(b"\r\n")
        answer = b""
        while b"\r\n\r\n" not in answer:
            chunk = straddling.recv(65536)
            assert chunk, answer
            answer += chunk
        head = answer.split(b"\r\n\r\n", 1)[0].lower()
        assert head.startswith(b"http/1.1 503 "), answer
        assert b"connection: close" in head.split(b"\r\n"), answer
        wait_for(lambda: connection_closed_by_server(straddling), NOTICE_S)
        straddling.close()
    finally:
        kill_process_tree(proc)


def test_off_a_web_process_keeps_accepting_without_redis_and_answers_503_redis_unavailable(tmp_path, own_redis):
    proc, port = start_web(tmp_path, own_redis.url, refuse=False)
    try:
        with httpx.Client(base_url=f"http://127.0.0.1:{port}", timeout=QUICK_S) as client:
            assert client.get("/v1/models").status_code == 200
            own_redis.kill()
            time.sleep(NOTICE_S)
            for _ in range(3):
                started = time.monotonic()
                resp = client.get("/v1/models")
                assert time.monotonic() - started < 1.0
                assert resp.status_code == 503 and resp.headers.get("Retry-After") == "1", resp.text
                assert resp.json()["error"]["code"] == "redis_unavailable"
            assert accepts_connections("127.0.0.1", port)
            own_redis.start()
            wait_for(lambda: client.get("/v1/models").status_code == 200, QUICK_S)
        assert "refusing connections" not in (tmp_path / "web.log").read_text()
    finally:
        kill_process_tree(proc)


def test_a_realtime_session_outlives_a_redis_restart_and_one_opened_without_redis_is_told_to_retry(
        tmp_path, own_redis):
    """Also: a turn committed while Redis is gone ends with ``…transcription.failed`` ``redis_unavailable``
    (its task's error used to go unread: the client never heard of the turn again)."""
    proc, port = start_web(tmp_path, own_redis.url, refuse=False, registered=True)
    url = f"ws://127.0.0.1:{port}/v1/realtime?intent=transcription"

    async def scenario() -> None:
        async with websockets.connect(url) as ws:
            assert json.loads(await ws.recv())["type"] == "session.created"
            await ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {
                "input": {"turn_detection": None, "transcription": {"model": "asr"}}}}}))
            assert json.loads(await ws.recv())["type"] == "session.updated"
            own_redis.kill()
            await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                      "audio": base64.b64encode(bytes(48000)).decode()}))  # 1 s at 24 kHz
            await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
            assert json.loads(await asyncio.wait_for(ws.recv(), QUICK_S))["type"] == "input_audio_buffer.committed"
            event = json.loads(await asyncio.wait_for(ws.recv(), QUICK_S))
            assert event["type"] == "conversation.item.input_audio_transcription.failed", event
            assert event["error"]["code"] == "redis_unavailable", event
            await asyncio.sleep(NOTICE_S)
            async with websockets.connect(url) as refused:
                event = json.loads(await asyncio.wait_for(refused.recv(), QUICK_S))
                assert event["type"] == "error" and event["error"]["code"] == "redis_unavailable", event
                with pytest.raises(websockets.ConnectionClosed) as closed:
                    await asyncio.wait_for(refused.recv(), QUICK_S)
                assert closed.value.rcvd is not None and closed.value.rcvd.code == 1013
            own_redis.start()
            await asyncio.sleep(NOTICE_S)
            await ws.send(json.dumps({"type": "input_audio_buffer.clear"}))
            event = json.loads(await asyncio.wait_for(ws.recv(), QUICK_S))
            assert event["type"] == "input_audio_buffer.cleared", event

    try:
        run(scenario())
        assert proc.poll() is None
        assert "Exception inside application" not in (tmp_path / "web.log").read_text()
    finally:
        kill_process_tree(proc)


@pytest.mark.parametrize("refuse", [False, True], ids=["off", "on"])
def test_a_request_whose_body_is_still_arriving_when_the_drain_begins_is_answered_shutting_down(
        tmp_path, own_redis, refuse):
    """SIGTERM while half of a POST's body (400 KB declared) is in and nothing else is served: the process
    waits for the rest, answers 503 ``shutting_down`` (R8.4: every client gets an answer) and then exits 0.
    The drain counted only complete requests, so it closed this connection unanswered at once."""
    proc, port = start_web(tmp_path, own_redis.url, refuse=refuse)
    try:
        body = b'{"model":"asr","request":{"audio_base64":"' + b"A" * 400_000 + b'"}}'
        upload = socket.create_connection(("127.0.0.1", port), timeout=QUICK_S)
        upload.sendall(b"POST /v1/tasks/run HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n" % len(body) + body[:200_000])
        time.sleep(0.3)  # the first half is in
        proc.send_signal(signal.SIGTERM)
        time.sleep(0.5)
        upload.sendall(body[200_000:])
        answer = b""
        while chunk := upload.recv(65536):
            answer += chunk
        upload.close()
        head, _, payload = answer.partition(b"\r\n\r\n")
        assert head.startswith(b"HTTP/1.1 503 "), answer[:300]
        assert json.loads(payload)["error"]["code"] == "shutting_down", payload
        assert proc.wait(QUICK_S) == 0
    finally:
        kill_process_tree(proc)


def test_on_a_draining_web_process_refuses_connections_and_answers_the_request_it_holds(tmp_path):
    """SIGTERM to a web process holding a fixture run at a barrier: its port refuses connections within
    a second (a proxy would send new requests elsewhere) and its idle keep-alive connection is closed,
    while the held request is still answered 200 once released; then the process exits 0."""
    models = [{"id": "held", "family": "fixture", "slots": 1, "lazy": True}]
    clusters = run_cluster(tmp_path, models, redis_db=8, name="unready", webs=1, workers=1, extra_env=FIXTURE_ENV,
                           extra_config={"refuse_connections_when_unready": True})
    cluster = next(clusters)
    try:
        (web,) = cluster.webs
        address = httpx.URL(web.url)

        async def scenario() -> None:
            async with mclient(web, None) as client:
                assert (await post(client, "held"))[0].status_code == 200
                idle = socket.create_connection((address.host, address.port))
                held = asyncio.create_task(post(client, "held", barrier="unready-hold"))
                await until(lambda: cluster.arrived("unready-hold") == 1)
                web.proc.send_signal(signal.SIGTERM)
                await until(lambda: not accepts_connections(address.host, address.port), 1.0)
                await until(lambda: connection_closed_by_server(idle), 1.0)
                idle.close()
                assert web.proc.poll() is None and not held.done()
                cluster.release("unready-hold")
                resp, _, _ = await within(held)
                assert resp.status_code == 200, resp.text

        run(scenario())
        assert web.proc.wait(QUICK_S) == 0
        assert cluster.counters("held") == {"leases": 0, "queued": 0}
    finally:
        next(clusters, None)



@pytest.mark.parametrize("route", ["speech", "transcription"])
def test_an_sse_stream_that_loses_redis_ends_with_an_error_event_redis_unavailable(tmp_path, own_redis, route):
    """A web process and a worker on the test's own Redis; an SSE stream (speech from ``piper``, or a
    streamed transcription from ``asr`` of 25 s of speech) whose Redis is killed after its first event:
    the stream ends within 15 s with a last event ``{"type": "error", "error": {"code":
    "redis_unavailable", …}}`` and a complete chunked body, and the web process logs no unhandled
    exception ("Exception inside application")."""
    models = [{"id": "piper", "family": "piper", "task": "tts", "lazy": route != "speech"},
              {"id": "asr", "family": "whisper", "task": "asr", "lazy": route != "transcription"}]
    clusters = run_cluster(tmp_path, models, redis_db=0, name="sse_outage", webs=1, workers=1,
                           redis_base=own_redis.url.rsplit("/", 1)[0])
    cluster = next(clusters)
    try:
        (web,) = cluster.webs
        if route == "speech":
            text = " ".join(f"This is sentence number {n} of a long answer that keeps the voice busy."
                            for n in range(30))
            request = {"method": "POST", "url": "/v1/audio/speech",
                       "json": {"model": "piper", "input": text, "voice": "joe", "stream_format": "sse"}}
        else:
            request = {"method": "POST", "url": "/v1/audio/transcriptions",
                       "data": {"model": "asr", "stream": "true"},
                       "files": {"file": ("speech.wav", long_speech(load_speech(), 25))}}

        async def scenario() -> tuple[list[dict], float]:
            events: list[dict] = []
            killed_at = None
            async with httpx.AsyncClient(base_url=web.url, timeout=httpx.Timeout(QUICK_S, read=15)) as client:
                async with httpx_sse.aconnect_sse(client, **request) as source:  # an SSE parser we did not write
                    assert source.response.status_code == 200
                    async for sse in source.aiter_sse():
                        events.append(sse.json())
                        if killed_at is None:
                            own_redis.kill()
                            killed_at = time.monotonic()
            return events, time.monotonic() - (killed_at or time.monotonic())

        events, after_kill_s = run(scenario())
        assert events[-1]["type"] == "error", events[-1]["type"]
        assert events[-1]["error"]["code"] == "redis_unavailable", events[-1]
        assert after_kill_s < 15
        assert "Exception inside application" not in web.log_path.read_text()
    finally:
        if own_redis.proc is None:
            own_redis.start()  # the teardown flushes the db
        next(clusters, None)
