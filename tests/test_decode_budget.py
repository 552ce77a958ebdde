"""On a real stack: the per-process budget of decoded audio in flight, header checks
before queueing, and short requests that do not wait behind huge decodes.

``serve --parallel-jobs`` (daphne + Celery worker, PostgreSQL, Redis db 8) with the fixture family (its
runs cost nothing, so the web process's decoding is what is measured) and Silero VAD, a budget of
128 MiB and ``max_audio_seconds`` 3600 (so the budget, not the length limit, refuses the largest input).
Inputs are FLACs of digital silence: tiny uploads that decode to 64,000 bytes per second at 16 kHz.
"""
from __future__ import annotations

import asyncio
import re
import time

import numpy as np
import pytest

from inference import audio
from inference.runtime.context import KEYS

from .support.audio import flac_without_length, silent_flac, wav_bytes
from .support.bounds import MODEL_S, QUICK_S, run, until, within
from .support.clients import mclient, post
from .support.processes import peak_rss_bytes
from .support.stacks import FIXTURE_ENV, events_of, fx, run_stack, web_pid

pytestmark = pytest.mark.stack

BUDGET_BYTES = 128 * 2**20
MAX_SECONDS = 3600
MODELS = [
    {**fx("cold", slots=4, load_barrier="cold-load"), "lazy": True},
    fx("fx", slots=4),
    {**fx("orphan"), "lazy": True},
    {**fx("orphan-small"), "lazy": True},
    {"id": "vad", "family": "silero_vad"},
]


@pytest.fixture(scope="module")
def bstack(tmp_path_factory):
    yield from run_stack(tmp_path_factory.mktemp("bstack"), MODELS, redis_db=8, name="budget", parallel=True,
                         extra_env=FIXTURE_ENV,
                         extra_config={"max_decoded_bytes_in_flight": BUDGET_BYTES, "max_audio_seconds": MAX_SECONDS})


def reserved_bytes(data: bytes) -> int:
    """What the server reserves for ``data`` (16 kHz mono in, 16 kHz model: no resampling; large inputs
    are sent to Redis without copies, so the decode's peak is the whole reservation)."""
    return audio.decode_peak_bytes(audio.read_header(data, MAX_SECONDS), 16000)


def longest_fitting_frames() -> int:
    """The longest silence (in frames at 16 kHz) whose reservation fits in the whole budget."""
    fixed_bytes = reserved_bytes(silent_flac(1)) - 16000 * audio.FLOAT32_BYTES
    return (BUDGET_BYTES - fixed_bytes) // audio.FLOAT32_BYTES


def assert_error(resp, status: int, err_type: str, code: str | None, message: str) -> dict:
    assert resp.status_code == status, resp.text
    error = resp.json()["error"]
    assert (error["type"], error["code"]) == (err_type, code), error
    assert message in error["message"], error
    return error


def test_the_budget_refuses_decodes_that_do_not_fit_and_gives_every_reservation_back(bstack):
    """Four granted requests of 780 s each (50 MB decoded) to a model whose load is held: two reserve and
    decode, and wait for the load holding their samples; the other two get 503 ``decode_budget`` with
    ``Retry-After`` at once, their leases given back, the message showing the two reservations in flight.
    Once the load goes on the two are served. Then a request whose samples are in Redis and whose run is
    held no longer counts: another large one is admitted beside it. Last, the longest input that fits the
    whole budget is admitted (within 4 bytes): had any reservation leaked, it would be refused."""
    medium = silent_flac(780)
    medium_bytes = reserved_bytes(medium)
    assert 2 * medium_bytes <= BUDGET_BYTES < 3 * medium_bytes
    large = silent_flac(1200)
    assert reserved_bytes(large) <= BUDGET_BYTES < 2 * reserved_bytes(large)
    fitting = silent_flac(longest_fitting_frames() / 16000)
    assert 0 <= BUDGET_BYTES - reserved_bytes(fitting) < audio.FLOAT32_BYTES

    async def scenario():
        async with mclient(bstack, None, timeout=MODEL_S) as c:
            tasks = [asyncio.create_task(post(c, "cold", medium)) for _ in range(4)]
            done: set = set()
            while len(done) < 2:
                finished, _ = await within(asyncio.wait(set(tasks) - done, return_when=asyncio.FIRST_COMPLETED))
                done |= finished
            await until(lambda: bstack.arrived("cold-load") == 1)
            assert len(done) == 2
            for task in done:
                resp, _, _ = task.result()
                error = assert_error(resp, 503, "server_busy", "decode_budget", "max_decoded_bytes_in_flight")
                assert resp.headers["retry-after"] == "1"
                in_flight_mib = float(re.search(r"([0-9.]+) MiB of decoded audio in flight", error["message"])[1])
                assert abs(in_flight_mib - 2 * medium_bytes / 2**20) < 0.1, error["message"]
            assert bstack.counters("cold") == {"leases": 2, "queued": 0}
            bstack.release("cold-load")
            for task in set(tasks) - done:
                resp, _, _ = await within(task)
                assert resp.status_code == 200, resp.text
                assert resp.json()["samples"] == 780 * 16000
            bstack.wait_idle("cold")

            held = asyncio.create_task(post(c, "fx", large, barrier="budget-run"))
            await until(lambda: bstack.arrived("budget-run") == 1)
            beside, _, _ = await within(post(c, "fx", large))
            assert beside.status_code == 200, beside.text
            bstack.release("budget-run")
            resp, _, _ = await within(held)
            assert resp.status_code == 200, resp.text

            resp, _, _ = await within(post(c, "fx", fitting))
            assert resp.status_code == 200, resp.text
            assert resp.json()["samples"] == longest_fitting_frames()
        bstack.wait_idle("fx")

    run(scenario())


def test_audio_that_could_never_be_served_is_refused_from_its_header_before_it_queues(bstack):
    """With every slot of the model busy, these are answered at once instead of after the busy timeout,
    and queue nothing: a decode larger than the whole budget by one sample (413 naming the key), audio longer than
    ``max_audio_seconds`` (413), bytes that are no audio (415), nine channels (400)."""
    too_big = silent_flac((longest_fitting_frames() + 1) / 16000)
    assert reserved_bytes(too_big) > BUDGET_BYTES
    cases = [
        (too_big, 413, "max_decoded_bytes_in_flight"),
        (silent_flac(MAX_SECONDS + 10), 413, f"max_audio_seconds={MAX_SECONDS}"),
        (np.random.default_rng(9).bytes(4096), 415, "cannot decode the audio"),
        (wav_bytes(np.zeros((16000, 9), dtype=np.float32), 16000), 400, "at most 8 are accepted"),
    ]

    async def scenario():
        async with mclient(bstack, None) as c:
            holders = [asyncio.create_task(post(c, "fx", barrier="busy")) for _ in range(4)]
            await until(lambda: bstack.arrived("busy") == 4)
            for data, status, message in cases:
                started = time.monotonic()
                resp, _, _ = await within(post(c, "fx", data, busy_timeout_ms=20000))
                assert time.monotonic() - started < 5, "refused only after waiting"
                error = assert_error(resp, status, "invalid_request_error", None, message)
                assert error["param"] == "request.audio_base64"
                assert bstack.counters("fx") == {"leases": 4, "queued": 0}
            bstack.release("busy", 4)
            for task in holders:
                resp, _, _ = await within(task)
                assert resp.status_code == 200, resp.text
        bstack.wait_idle("fx")

    run(scenario())


def test_short_requests_to_another_model_keep_their_latency_while_huge_decodes_run(bstack):
    """Four 5-minute 384 kHz FLACs (seconds of resampling each, more than the decode
    threads there are) to one model; meanwhile short Silero requests to another model, one after the
    other, each answered well within 2 s (alone about 20 ms). Before the quick decode pool, each of them
    waited for the huge decodes ahead of it in the one shared pool."""
    heavy = silent_flac(300, rate=384000)

    async def scenario():
        async with mclient(bstack, None, timeout=MODEL_S) as c:
            warm, _, _ = await within(post(c, "vad"))
            assert warm.status_code == 200, warm.text
            heavies = [asyncio.create_task(post(c, "fx", heavy)) for _ in range(4)]
            await asyncio.sleep(0.3)  # the four are granted and decoding
            short: list[tuple[float, float]] = []
            while not all(task.done() for task in heavies):
                resp, started, ended = await within(post(c, "vad"))
                assert resp.status_code == 200, resp.text
                short.append((ended - started, ended))
                await asyncio.sleep(0.2)
            results = [await within(task) for task in heavies]
        for resp, _, _ in results:
            assert resp.status_code == 200, resp.text
        last_heavy_s = max(ended for _, _, ended in results)
        during = [latency for latency, ended in short if ended < last_heavy_s]
        assert len(during) >= 5, (short, last_heavy_s)
        assert max(during) < 2.0, during

    run(scenario(), QUICK_S * 4)


def test_a_flac_that_does_not_state_its_length_is_counted_refused_past_the_limit_and_served_within_it(bstack):
    """A FLAC whose STREAMINFO says 0 total samples ("unknown", what a streaming encoder writes; it was a 415)
    is counted before it queues: one just over ``max_audio_seconds`` (3,601 s of silence, 181 KB of FLAC that
    would decode to 230 MB of float32) is a 413 naming the limit while the web process's peak RSS grows by
    under 16 MiB (the count stops at the limit and decodes nothing); 780 s within the limit are served with
    every sample, and their reservation (the counted length's) is given back: the longest input that fits
    the whole budget is admitted afterwards."""
    within_limit = flac_without_length(silent_flac(780))
    over_limit = flac_without_length(silent_flac(MAX_SECONDS + 1))
    fitting = silent_flac(longest_fitting_frames() / 16000)
    pid = web_pid(bstack)

    async def scenario():
        async with mclient(bstack, None, timeout=MODEL_S) as c:
            resp, _, _ = await within(post(c, "fx", within_limit))
            assert resp.status_code == 200, resp.text
            assert resp.json()["samples"] == 780 * 16000
            with open(f"/proc/{pid}/clear_refs", "w") as refs:
                refs.write("5")  # reset the peak RSS (VmHWM) to the current RSS
            baseline = peak_rss_bytes(pid)
            resp, _, _ = await within(post(c, "fx", over_limit))
            assert_error(resp, 413, "invalid_request_error", None, f"max_audio_seconds={MAX_SECONDS}")
            growth = peak_rss_bytes(pid) - baseline
            assert growth < 16 * 2**20, f"the web process's peak RSS grew by {growth / 2**20:.0f} MiB"
            resp, _, _ = await within(post(c, "fx", fitting))
            assert resp.status_code == 200, resp.text
        bstack.wait_idle("fx")

    run(scenario())


@pytest.mark.parametrize("model_id, seconds", [("orphan", 120), ("orphan-small", 2)],
                         ids=["large-input-key", "small-inline"])
def test_a_run_whose_worker_lost_the_pool_is_served_again_from_the_input_already_in_redis(bstack, model_id,
                                                                                          seconds):
    """The web process drops decoded samples once they are in Redis, so the retry after a ``not_loaded``
    reply (the published owner holds no pool: here a model marked ready on the live worker that never
    loaded it) must not need them: the model is loaded and the same input key is dispatched again. The
    answer counts every sample, and no input key is left behind. 120 s decode to 3.8 MB of int16, sent
    to their input key by the blocking client from the array's memory; 2 s travel inside the run queue
    element, and the refusing worker leaves them in the input key for the second dispatch."""
    [worker_key] = bstack.redis.keys(KEYS.worker_live_prefix + "*")
    bstack.redis.hset(KEYS.load(model_id), mapping={"state": "ready", "owner": worker_key.split(":", 2)[2],
                                                            "boot": bstack.redis.get(worker_key)})
    data = silent_flac(seconds)

    async def scenario():
        async with mclient(bstack, None, timeout=MODEL_S) as c:
            resp, _, _ = await within(post(c, model_id, data))
            assert resp.status_code == 200, resp.text
            assert resp.json()["samples"] == seconds * 16000
            assert resp.json()["timing"]["load_ms"] > 0  # loaded after the not_loaded reply: the second dispatch

    run(scenario())
    assert [event for event, _, _ in events_of(bstack, model_id)] == ["register", "load"]
    assert bstack.redis.keys(KEYS.input("*")) == []
