"""The metrics and activity row of a request answered 200 by one run, written by the worker that served it
(``metrics.answer_events``): exact under races the web process takes part in.

Counts are read from ``GET /metrics`` (``prometheus_client``'s parser) and rows from the activity list in
Redis (``KEYS.activity``), the same list ``/ui/activity`` shows.
"""
from __future__ import annotations

import asyncio
import json
import os
import re
import signal
import threading

import numpy as np
import pytest

from inference.runtime.context import KEYS

from .support.audio import wav_bytes
from .support.bounds import MODEL_S, QUICK_S, run, until, within
from .support.clients import mclient, operator_token, post
from .support.stacks import FIXTURE_ENV, run_stack, web_pid, worker_pid
from .test_operations import scrape, scrape_when, value

pytestmark = pytest.mark.stack

MODELS = [{"id": "one", "family": "fixture", "slots": 1, "lazy": True},
          {"id": "three", "family": "fixture", "slots": 3, "lazy": True},
          {"id": "three-batched", "family": "fixture", "slots": 3, "max_batch": 3, "batch_window_ms": 100,
           "lazy": True},
          {"id": "frozen", "family": "fixture", "slots": 1, "lazy": True}]


@pytest.fixture(scope="module")
def rstack(tmp_path_factory):
    yield from run_stack(tmp_path_factory.mktemp("records"), MODELS, redis_db=9, name="records", parallel=True,
                         extra_env=FIXTURE_ENV)


def _watch_probe(stack, model_id: str, seen: threading.Event, stop: threading.Event, loop, notify) -> None:
    """Redis ``MONITOR``: call ``notify`` (on ``loop``) at the first admission probe of ``model_id``
    (``admission_probe.lua``: its two keys are the model's base key and the registry hash)."""
    pattern = re.compile(rf"\b2 {re.escape(KEYS.model(model_id))} {re.escape(KEYS.models_meta)} {model_id}\b")
    with stack.redis.monitor() as monitor:
        seen.set()
        for command in monitor.listen():
            if stop.is_set():
                return
            if pattern.search(command["command"]):
                loop.call_soon_threadsafe(notify)
                return


def test_a_request_whose_probe_found_a_free_slot_but_that_waited_records_its_real_queue_wait(rstack):
    """A request with audio too large to ride in its grant (decoded to more than 1 MiB) whose admission
    probe found the slot free, but that another request took before it queued: it waited behind that
    one. The queue wait the worker records (``audiosite_queue_wait_seconds`` and its activity row's
    ``queue_ms``) is the wait its answer reports in ``timing.queue_ms``, not 0."""
    big = wav_bytes(np.zeros(1_000_000, dtype=np.float32) + 0.01, 8000, subtype="PCM_16")  # 16 kHz: 8 MB
    hold_s = 0.4

    async def attempt(c, index: int) -> tuple[dict, dict]:
        loop = asyncio.get_running_loop()
        probed = asyncio.Event()
        ready, stop = threading.Event(), threading.Event()
        watcher = threading.Thread(target=_watch_probe, args=(rstack, "one", ready, stop, loop, probed.set),
                                   daemon=True)
        watcher.start()
        assert ready.wait(QUICK_S)
        try:
            large = asyncio.create_task(post(c, "one", big, tag=f"large-{index}"))
            await within(probed.wait())
            holder = asyncio.create_task(post(c, "one", barrier=f"take-{index}", tag=f"holder-{index}"))
            await until(lambda: rstack.arrived(f"take-{index}") == 1)
            await asyncio.sleep(hold_s)
            rstack.release(f"take-{index}")
            first, _, _ = await within(holder)
            second, _, _ = await within(large)
        finally:
            stop.set()
            rstack.redis.echo("stop-monitor")
            watcher.join(QUICK_S)
        assert first.status_code == 200 and second.status_code == 200, (first.text, second.text[:300])
        return first.json(), second.json()

    async def scenario():
        async with mclient(rstack, None) as c:
            warm, _, _ = await post(c, "one", tag="warm")
            assert warm.status_code == 200, warm.text
            await until(lambda: rstack.redis.llen(KEYS.activity) >= 1)
            for index in range(5):
                _, before, _ = await asyncio.to_thread(scrape, rstack.url)
                rows_before = rstack.redis.llen(KEYS.activity)
                _, large = await attempt(c, index)
                if large["timing"]["queue_ms"] > 0:
                    return before, rows_before, large
                rstack.wait_idle("one")
        raise AssertionError("the large request never found its slot taken after its probe")

    before, rows_before, large = run(scenario())
    waited_s = large["timing"]["queue_ms"] / 1000
    assert waited_s >= hold_s * 0.9, large["timing"]

    def moved(samples, name: str) -> float:
        return value(samples, name, model="one") - value(before, name, model="one")

    _, after = scrape_when(rstack.url, lambda now: moved(now, "audiosite_queue_wait_seconds_count") == 2)
    assert moved(after, "audiosite_queue_wait_seconds_count") == 2
    # the holder was granted at once (0 s): the sum is the large request's wait alone
    assert moved(after, "audiosite_queue_wait_seconds_sum") == pytest.approx(waited_s, abs=0.002), large["timing"]
    rows = [json.loads(text) for text in rstack.redis.lrange(KEYS.activity, 0, rstack.redis.llen(KEYS.activity)
                                                                         - rows_before - 1)]
    waits = sorted(row["queue_ms"] for row in rows)
    assert waits == pytest.approx([0.0, large["timing"]["queue_ms"]], abs=1.0), rows


@pytest.mark.parametrize("model", ["three", "three-batched"])
def test_concurrent_requests_on_a_multi_slot_model_are_each_recorded_once_with_their_own_wait(rstack, model):
    """Three runs held in the 3 slots and nine requests queued behind them (small audio offered with the
    enqueue, audio decoded to over 1 MiB, some with a user's token, one whose run fails), on a model that
    batches its runs (``max_batch`` 3) or not: once the slots open, the eleven answers 200 and the 500 move
    ``requests_total`` (ok, error), the queue wait (twelve), the inference time and the audio seconds (of
    the eleven) by exactly their sums, and add twelve activity rows, each with its own answer's wait and
    run time, the client's address and no user (a token sent to an inference route names nobody, as
    before)."""
    token = operator_token(rstack)
    big = wav_bytes(np.zeros(320_000, dtype=np.float32) + 0.01, 16000, subtype="FLOAT")  # 1.28 MB decoded
    barrier = f"{model}-fill"

    async def scenario():
        async with mclient(rstack, None) as c, mclient(rstack, token) as t:
            warm, _, _ = await post(c, model, tag="warm")
            assert warm.status_code == 200, warm.text
            await until(lambda: json.loads(rstack.redis.lindex(KEYS.activity, 0))["model"] == model)
            _, before, _ = await asyncio.to_thread(scrape, rstack.url)
            rows_before = rstack.redis.llen(KEYS.activity)
            held = [asyncio.create_task(post(t if i == 0 else c, model, barrier=barrier, tag=f"h{i}"))
                    for i in range(3)]
            # a batch's members pass the barrier one after another in its one session call
            await until(lambda: rstack.arrived(barrier) >= 1 and rstack.counters(model)["leases"] == 3)
            queued = []
            for i in range(9):
                client = t if i % 3 == 0 else c
                audio = (big,) if i % 2 else ()
                queued.append(asyncio.create_task(post(client, model, *audio, tag=f"q{i}", fail=i == 4)))
                await until(lambda n=i + 1: rstack.counters(model)["queued"] == n)
            await asyncio.sleep(0.1)
            rstack.release(barrier, 3)
            answers = [(await within(task))[0] for task in [*held, *queued]]
            failed = answers.pop(3 + 4)
            assert failed.status_code == 500, failed.text
            for resp in answers:
                assert resp.status_code == 200, resp.text[:300]
            return before, rows_before, [resp.json() for resp in answers]

    before, rows_before, bodies = run(scenario())
    n = len(bodies) + 1

    def moved(samples, name: str, **labels: str) -> float:
        return value(samples, name, model=model, **labels) - value(before, name, model=model, **labels)

    _, after = scrape_when(rstack.url, lambda now: (
        moved(now, "audiosite_requests_total", outcome="ok"), moved(now, "audiosite_queue_wait_seconds_count"),
        moved(now, "audiosite_inference_seconds_count"), rstack.redis.llen(KEYS.activity) - rows_before) ==
        (n - 1, n, n - 1, n))
    assert moved(after, "audiosite_requests_total", outcome="ok") == n - 1
    assert moved(after, "audiosite_requests_total", outcome="error") == 1
    assert moved(after, "audiosite_queue_wait_seconds_count") == n
    assert moved(after, "audiosite_inference_seconds_count") == n - 1
    assert rstack.redis.llen(KEYS.activity) - rows_before == n
    rows = [json.loads(text) for text in rstack.redis.lrange(KEYS.activity, 0, n - 1)]
    assert sorted((r["status"], r["outcome"]) for r in rows) == [(200, "ok")] * (n - 1) + [(500, "error")], rows
    assert all((r["model"], r["route"], r["client"]) == (model, "/v1/tasks/run", "127.0.0.1") for r in rows), rows
    served = [r for r in rows if r["status"] == 200]
    assert all(r["total_ms"] >= r["run_ms"] + r["queue_ms"] - 1 for r in served), rows
    assert sorted(round(r["queue_ms"]) for r in served) == sorted(round(b["timing"]["queue_ms"]) for b in bodies)
    assert sorted(round(r["run_ms"], 1) for r in served) == sorted(round(b["timing"]["inference_ms"], 1)
                                                                    for b in bodies)
    waits_s = sum(r["queue_ms"] for r in rows) / 1000
    assert waits_s > 0.1 * 9
    assert moved(after, "audiosite_queue_wait_seconds_sum") == pytest.approx(waits_s, abs=0.001 * n)
    assert moved(after, "audiosite_inference_seconds_sum") == pytest.approx(
        sum(b["timing"]["inference_ms"] for b in bodies) / 1000, abs=0.001 * n)
    assert moved(after, "audiosite_audio_seconds_total", task="fixture") == pytest.approx(
        sum(b["timing"]["audio_duration_ms"] for b in bodies) / 1000, abs=0.001 * n)
    # the inference routes authenticate nobody (no authentication class): a token names no user there
    assert all(r["user"] is None for r in rows), rows


def test_a_client_that_leaves_after_its_reply_was_stored_is_recorded_once(rstack):
    """The worker stores a run's reply and records the answer (counter, queue wait, row) while its web
    process is stopped (SIGSTOP); the client then leaves, and the web process, resumed, finds its client
    gone before it read the reply (the reply is deleted unread). The request's queue wait is observed
    once (the worker's), and it has one activity row, not a second one from the web process."""
    pid = web_pid(rstack)

    async def scenario():
        async with mclient(rstack, None) as c:
            warm, _, _ = await post(c, "one", tag="warm-left")
            assert warm.status_code == 200, warm.text
            await until(lambda: json.loads(rstack.redis.lindex(KEYS.activity, 0))["route"] == "/v1/tasks/run")
            _, before, _ = await asyncio.to_thread(scrape, rstack.url)
            rows_before = rstack.redis.llen(KEYS.activity)
            async with mclient(rstack, None) as leaving:
                task = asyncio.create_task(post(leaving, "one", barrier="left-after-store", tag="left"))
                await until(lambda: rstack.arrived("left-after-store") == 1)
                os.kill(pid, signal.SIGSTOP)
                try:
                    task.cancel()
                    await asyncio.gather(task, return_exceptions=True)
                    await asyncio.sleep(0.2)
                    rstack.release("left-after-store")
                    await until(lambda: rstack.redis.llen(KEYS.activity) == rows_before + 1)  # the worker's row
                finally:
                    os.kill(pid, signal.SIGCONT)
            await asyncio.sleep(1.0)
            return before, rows_before

    before, rows_before = run(scenario())
    rstack.wait_idle("one")
    _, after, _ = scrape(rstack.url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, model="one", **labels) - value(before, name, model="one", **labels)

    rows = [json.loads(text) for text in rstack.redis.lrange(KEYS.activity, 0,
                                                             rstack.redis.llen(KEYS.activity) - rows_before - 1)]
    assert moved("audiosite_queue_wait_seconds_count") == 1, rows
    assert len(rows) == 1, rows
    assert moved("audiosite_requests_total", outcome="ok") == 1, rows


def test_a_run_whose_worker_froze_past_its_liveness_is_recorded_once_as_the_503_its_client_got(rstack):
    """The worker freezes (SIGSTOP) past its liveness TTL while a run is held at a barrier: the client
    gets 503 ``worker_lost``. The worker then resumes and the run finishes: its late reply is not stored
    and the worker records nothing of the answer, so the request counts once, as rejected (one row,
    status 503), with its queue wait observed once."""
    async def scenario():
        async with mclient(rstack, None, timeout=MODEL_S) as c:
            warm, _, _ = await post(c, "frozen", tag="warm-frozen")
            assert warm.status_code == 200, warm.text
            await until(lambda: json.loads(rstack.redis.lindex(KEYS.activity, 0))["model"] == "frozen")
            _, before, _ = await asyncio.to_thread(scrape, rstack.url)
            rows_before = rstack.redis.llen(KEYS.activity)
            pid = worker_pid(rstack)
            task = asyncio.create_task(post(c, "frozen", barrier="frozen-run", tag="frozen"))
            await until(lambda: rstack.arrived("frozen-run") == 1)
            os.kill(pid, signal.SIGSTOP)
            try:
                resp, _, _ = await within(task, 25)
            finally:
                os.kill(pid, signal.SIGCONT)
            assert resp.status_code == 503 and resp.json()["error"]["code"] == "worker_lost", resp.text
            rstack.release("frozen-run")
            await asyncio.sleep(3.0)  # the woken worker finishes the run and replies to nobody
            return before, rows_before

    before, rows_before = run(scenario())
    _, after, _ = scrape(rstack.url)

    def moved(name: str, **labels: str) -> float:
        return value(after, name, model="frozen", **labels) - value(before, name, model="frozen", **labels)

    rows = [json.loads(text) for text in rstack.redis.lrange(KEYS.activity, 0,
                                                             rstack.redis.llen(KEYS.activity) - rows_before - 1)]
    assert [(r["model"], r["status"], r["code"]) for r in rows] == [("frozen", 503, "worker_lost")], rows
    assert moved("audiosite_requests_total", outcome="ok") == 0
    assert moved("audiosite_requests_total", outcome="rejected") == 1
    assert moved("audiosite_queue_wait_seconds_count") == 1
    assert moved("audiosite_audio_seconds_total", task="fixture") == 0
