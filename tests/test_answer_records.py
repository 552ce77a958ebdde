"""The metrics and activity row of a request answered 200 by one run, written by the worker that served it
(``metrics.answer_events``): exact under races the web process takes part in.

Counts are read from ``GET /metrics`` (``prometheus_client``'s parser) and rows from the activity list in
Redis (``KEYS.activity``), the same list ``/ui/activity`` shows.
"""
from __future__ import annotations

import asyncio
import json
import re
import threading

import numpy as np
import pytest

from inference.runtime.context import KEYS

from .support.audio import wav_bytes
from .support.bounds import QUICK_S, run, until, within
from .support.clients import mclient, post
from .support.stacks import FIXTURE_ENV, run_stack
from .test_operations import scrape, scrape_when, value

pytestmark = pytest.mark.stack

MODELS = [{"id": "one", "family": "fixture", "slots": 1, "lazy": True}]


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
