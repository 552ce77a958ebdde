"""The drain of one web process (``audiosite/drain.py``) on a real event loop, without a server: how it
counts connections, cuts views and streams at the deadline, tells watchers (the WebSocket hook) and
refuses a WebSocket handshake. The end-to-end drain (signals, daphne, serve) is in test_operations.py."""
from __future__ import annotations

import asyncio
import time

import pytest

from audiosite.drain import WEBSOCKET_CLOSE_GOING_AWAY, Drain, DrainExpired, tracked
from audiosite.errors import ServerBusy

from .support.bounds import run, within


def test_a_view_still_running_at_the_deadline_is_answered_503_and_its_clean_up_runs():
    drain = Drain()
    cleaned = []

    async def view_work():
        try:
            await asyncio.sleep(3600)
        finally:
            cleaned.append("given back")  # what the services do on a cancellation (a ticket withdrawn, R8.1)

    async def quick_work():
        await asyncio.sleep(0.01)
        return "answer"

    async def scenario():
        cut = asyncio.create_task(drain.bounded(view_work()))
        quick = asyncio.create_task(drain.bounded(quick_work()))
        drain.begin(timeout_ms=50)
        assert await within(quick) == "answer"
        await asyncio.sleep(0.06)
        assert not cut.done()  # the drain itself cuts nothing before expire()
        assert drain.expire() == 1
        with pytest.raises(ServerBusy) as refused:
            await within(cut)
        return refused.value

    error = run(scenario())
    assert (error.status, error.code, error.headers()) == (503, "shutting_down", {"Retry-After": "1"})
    assert cleaned == ["given back"]


def test_a_stream_is_interrupted_at_the_deadline_and_items_before_it_pass():
    drain = Drain()

    async def sentences():
        yield "first"
        await asyncio.sleep(3600)
        yield "never"

    async def scenario():
        got = []
        drain.begin(timeout_ms=0)

        async def consume():
            async for item in drain.until_expired(sentences()):
                got.append(item)

        consumer = asyncio.create_task(consume())
        await asyncio.sleep(0.05)
        drain.expire()
        with pytest.raises(DrainExpired):
            await within(consumer)
        return got

    assert run(scenario()) == ["first"]


def test_watchers_are_told_once_when_the_drain_begins_and_late_ones_at_once():
    drain = Drain()
    told: list[tuple[str, int]] = []

    async def scenario():
        early = drain.watch(lambda notice: told.append(("early", notice.timeout_ms)))

        async def coroutine_watcher(notice):
            told.append(("coroutine", notice.timeout_ms))

        drain.watch(coroutine_watcher)
        gone = drain.watch(lambda notice: told.append(("gone", notice.timeout_ms)))
        gone.close()
        drain.begin(timeout_ms=1234)
        drain.begin(timeout_ms=1)  # idempotent: nobody is told twice
        await asyncio.sleep(0)
        with drain.watch(lambda notice: told.append(("late", notice.timeout_ms))):
            pass
        early.close()

    run(scenario())
    assert sorted(told) == [("coroutine", 1234), ("early", 1234), ("late", 1234)]


def test_wait_returns_when_the_last_connection_ends_and_a_handshake_during_the_drain_is_refused():
    drain = Drain()
    sent: list[dict] = []

    async def scenario():
        done = asyncio.Event()

        async def app(scope, receive, send):
            await done.wait()

        counted = tracked(app, drain)
        request = asyncio.create_task(counted({"type": "http"}, None, None))
        session = asyncio.create_task(counted({"type": "websocket"}, None, None))
        await asyncio.sleep(0.01)
        assert drain.in_flight() == {"http": 1, "websocket": 1}
        drain.begin(timeout_ms=10_000)

        async def receive():
            return {"type": "websocket.connect"}

        async def send(message):
            sent.append(message)

        await within(counted({"type": "websocket"}, receive, send))  # refused, never reaches app
        started = time.monotonic()
        waiting = asyncio.create_task(drain.wait(grace_s=1))
        await asyncio.sleep(0.05)
        assert not waiting.done()
        done.set()
        assert await within(waiting) is True
        await within(asyncio.gather(request, session))
        return time.monotonic() - started

    assert run(scenario()) < 5
    assert sent == [{"type": "websocket.close", "code": WEBSOCKET_CLOSE_GOING_AWAY}]
    assert drain.in_flight() == {}


def test_wait_expires_at_the_deadline_and_gives_up_after_the_grace():
    drain = Drain()

    async def scenario():
        async def stuck(scope, receive, send):
            try:
                await drain.bounded(asyncio.sleep(3600))
            except ServerBusy:
                await asyncio.sleep(3600)  # a connection that outlives even its 503

        task = asyncio.create_task(tracked(stuck, drain)({"type": "http"}, None, None))
        await asyncio.sleep(0.01)
        drain.begin(timeout_ms=100)
        started = time.monotonic()
        clean = await within(drain.wait(grace_s=0.2))
        elapsed = time.monotonic() - started
        task.cancel()
        return clean, elapsed

    clean, elapsed = run(scenario())
    assert clean is False and drain.expired
    assert 0.25 <= elapsed < 2


def test_the_drain_waits_for_watched_sessions_but_not_for_unwatched_websockets():
    """A WebSocket session whose consumer registered a watch holds the drain until it closes its watch
    (it got the notice and closed with 1001); one without a watch (a status stream) holds nothing up:
    the server closes it with 1001 after the drain (audiosite.web)."""
    drain = Drain()

    async def scenario():
        forever = asyncio.Event()
        notices = []

        async def status_stream(scope, receive, send):  # registers no watch
            await forever.wait()

        async def realtime(scope, receive, send):
            closed = asyncio.Event()
            watch = drain.watch(lambda notice: (notices.append(notice), closed.set()))
            try:
                await closed.wait()  # a consumer would send its final event and close 1001 here
            finally:
                watch.close()

        unwatched = asyncio.create_task(tracked(status_stream, drain)({"type": "websocket"}, None, None))
        watched = asyncio.create_task(tracked(realtime, drain)({"type": "websocket"}, None, None))
        await asyncio.sleep(0.01)
        assert drain.busy()
        drain.begin(timeout_ms=10_000)
        assert await within(drain.wait(grace_s=1)) is True
        await within(watched)
        assert drain.in_flight() == {"websocket": 1} and not drain.busy()  # the status stream is still open
        unwatched.cancel()
        return notices

    notices = run(scenario())
    assert len(notices) == 1 and notices[0].timeout_ms == 10_000
