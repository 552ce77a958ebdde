"""The short request path (eager decode, run offered with its enqueue, inline samples,
int16 transport, EarlyProbe, leader/follower run popping) on a real ``serve --parallel-jobs`` stack.

Fixture family (barriers, sleeps) at 1 and 3 slots, Silero VAD at 1 slot, a small decode budget so that a
leaked reservation shows as a 503 ``decode_budget`` on a request that needs nearly the whole budget. Every
scenario ends by checking the invariants: no slot or queued ticket left (``GET /v1/models``), no input key
(``as:in:*``) and every run queue (``as:runs:*``) empty in Redis.
"""
from __future__ import annotations

import asyncio
import base64
import io
import os
import signal
import time

import httpx
import numpy as np
import pytest
import soundfile

from inference import audio
from inference.runtime.context import KEYS

from .support.audio import FIXTURES, TINY, pcm_wav, silent_flac, wav_bytes
from .support.bounds import MODEL_S, run, within
from .support.clients import mclient, operator_token, post, without_timing
from .support.stacks import FIXTURE_ENV, fx, run_stack, worker_pids

pytestmark = pytest.mark.stack

BUDGET_BYTES = 24 * 2**20
MODELS = [
    fx("one", slots=1),
    fx("multi", slots=3, version="v1"),
    {"id": "vad", "family": "silero_vad", "slots": 1},
]


@pytest.fixture(scope="module")
def astack(tmp_path_factory):
    yield from run_stack(tmp_path_factory.mktemp("adv"), MODELS, redis_db=3, name="adv", parallel=True,
                         extra_env=FIXTURE_ENV,
                         extra_config={"max_decoded_bytes_in_flight": BUDGET_BYTES, "ui_management": True})


@pytest.fixture(scope="module")
def token(astack) -> str:
    return operator_token(astack)


# -- invariants ----------------------------------------------------------------------------------------
def fitting_input() -> bytes:
    """Silence whose reservation (16 kHz mono for a 16 kHz model, sent without copies) is the whole budget
    minus 4 KiB: refused 503 ``decode_budget`` if any earlier reservation leaked (a decode's is over 1 MiB;
    a WAV read as-is reserves the send copies of its samples, 4 bytes a frame: 256 KB for 4 s)."""
    fixed = audio.decode_peak_bytes(audio.read_header(silent_flac(1), 3600), 16000) - 16000 * audio.FLOAT32_BYTES
    frames = (BUDGET_BYTES - (1 << 12) - fixed) // audio.FLOAT32_BYTES
    data = silent_flac(frames / 16000)
    assert audio.decode_peak_bytes(audio.read_header(data, 3600), 16000) <= BUDGET_BYTES
    return data


def assert_error_shape(resp: httpx.Response, statuses: tuple[int, ...]) -> dict:
    assert resp.status_code in statuses, (resp.status_code, resp.text)
    error = resp.json()["error"]
    assert isinstance(error["message"], str) and error["message"] and "type" in error and "code" in error, error
    return error


async def drained(stack, c: httpx.AsyncClient) -> None:
    """Every slot free, no ticket queued, no input key, every run queue empty; then a request needing
    nearly the whole decode budget is served (no reservation leaked)."""
    deadline = time.monotonic() + 20
    while True:
        entries = (await c.get("/v1/models")).json()["data"]
        busy = [(e["id"], e["active_slots"], e["queued_requests"]) for e in entries
                if e.get("active_slots") or e.get("queued_requests")]
        inputs = list(stack.redis.scan_iter(KEYS.input("*")))
        queued = [k for k in stack.redis.scan_iter(KEYS.run_queue_prefix + "*") if stack.redis.llen(k)]
        if not busy and not inputs and not queued:
            break
        assert time.monotonic() < deadline, (busy, inputs, queued)
        await asyncio.sleep(0.05)
    resp, _, _ = await within(post(c, "multi", fitting_input()), MODEL_S)
    assert resp.status_code == 200, resp.text


# -- audio ---------------------------------------------------------------------------------------------
def speech() -> tuple[np.ndarray, int]:
    path = sorted(FIXTURES.glob("*.wav"))[0]
    samples, rate = soundfile.read(io.BytesIO(path.read_bytes()), dtype="float32")
    return samples[: rate * 4], rate


def audio_variants() -> dict[str, bytes]:
    samples, rate = speech()
    assert rate == 16000
    pcm16 = wav_bytes(samples, 16000, subtype="PCM_16")
    pcm = pcm16[44:]
    return {
        "pcm16": pcm16,
        "pcm16_flac": wav_bytes(samples, 16000, fmt="FLAC", subtype="PCM_16"),
        "pcm16_8k": wav_bytes(samples[::2], 8000, subtype="PCM_16"),
        "stereo16": wav_bytes(np.stack([samples, samples * 0.5], axis=1), 16000, subtype="PCM_16"),
        "pcm8": wav_bytes(samples, 16000, subtype="PCM_U8"),
        "float": wav_bytes(samples, 16000, subtype="FLOAT"),
        "truncated": pcm16[:-1001],
        "claims_more": pcm_wav(pcm, claim=len(pcm) * 4),
        "claims_huge": pcm_wav(pcm, claim=0xFFFFFFF0),
    }


BAD_AUDIO = {
    "zero_data": (pcm_wav(b""), 400),
    "garbage": (os.urandom(3000), 415),
    "header_only": (pcm_wav(b"")[:30], 415),
}


def test_a_burst_of_mixed_audio_on_a_one_slot_model_answers_as_when_idle(astack):
    """Twenty-odd simultaneous VAD requests (16-bit at the model's rate, so the int16 transport; FLAC; 8 kHz;
    stereo; 8-bit; float; truncated; headers claiming more frames than present) plus bad audio and bad base64,
    all at once on a 1-slot model: each good one gets exactly the result it gets alone on an idle server, each
    bad one its 4xx, nothing 500 or hangs, and the stack is drained afterwards."""
    variants = audio_variants()

    async def scenario():
        async with mclient(astack, None, timeout=MODEL_S) as c:
            alone = {}
            for name, data in variants.items():
                resp, _, _ = await post(c, "vad", data)
                assert resp.status_code == 200, (name, resp.text)
                alone[name] = without_timing(resp)
            assert alone["pcm16"]["segments"], alone["pcm16"]
            # the same samples through the int16 transport whatever the container or its stated length
            assert alone["pcm16"] == alone["pcm16_flac"] == alone["claims_more"] == alone["claims_huge"]
            jobs = [(name, post(c, "vad", data)) for name, data in variants.items() for _ in range(2)]
            jobs += [(name, post(c, "vad", data)) for name, (data, _) in BAD_AUDIO.items()]
            bad_b64 = [base64.b64encode(TINY).decode() + "==", " " + base64.b64encode(TINY).decode(),
                       base64.b64encode(TINY).decode()[:-1] + "é"]
            for text in bad_b64:
                jobs.append(("b64", c.post("/v1/tasks/run", json={"model": "vad", "request": {"audio_base64": text}})))
            results = await within(asyncio.gather(*(job for _, job in jobs)), MODEL_S)
            for (name, _), got in zip(jobs, results, strict=True):
                resp = got[0] if isinstance(got, tuple) else got
                if name in variants:
                    assert resp.status_code == 200, (name, resp.text)
                    assert without_timing(resp) == alone[name], name
                elif name in BAD_AUDIO:
                    assert_error_shape(resp, (BAD_AUDIO[name][1],))
                else:
                    assert assert_error_shape(resp, (400,))["param"] == "request.audio_base64"
            await drained(astack, c)

    run(scenario())


def test_odd_busy_timeouts_never_give_a_500(astack):
    """``busy_timeout_ms`` as floats, strings, booleans, null, negative, huge, in the body and the query at once,
    nested in ``request``: each request is served (200) or refused with a 400 in the error shape naming the
    field, whichever EarlyProbe path it takes; never a 500."""
    b64 = base64.b64encode(TINY).decode()

    def req(**extra) -> dict:
        nested = extra.pop("nested", None)
        request = {"audio_base64": b64}
        if nested is not None:
            request["busy_timeout_ms"] = nested
        return {"model": "one", "request": request, **extra}

    cases = [
        ("", req(busy_timeout_ms=500.0), 200), ("", req(busy_timeout_ms=500.5), 400),
        ("", req(busy_timeout_ms="500"), None), ("", req(busy_timeout_ms=True), 400),
        ("", req(busy_timeout_ms=None), 200), ("", req(busy_timeout_ms=-1), 400),
        ("", req(busy_timeout_ms=10**30), 400), ("", req(busy_timeout_ms=1e308), 400),
        ("?busy_timeout_ms=abc", req(busy_timeout_ms=500), 200), ("?busy_timeout_ms=abc", req(), 400),
        ("?busy_timeout_ms=500", req(busy_timeout_ms=None), 200), ("?busy_timeout_ms=5.5", req(nested=7), 400),
        ("?busy_timeout_ms=0", req(nested="x"), None), ("", req(nested=[1]), 400), ("", req(nested={"a": 1}), 400),
        ("?busy_timeout_ms=500&busy_timeout_ms=600", req(), 200), ("", req(busy_timeout_ms=[500]), 400),
        ("", {"model": ["one"], "request": {"audio_base64": b64}}, 400),
        ("", {"model": "nope", "busy_timeout_ms": 5, "request": {"audio_base64": b64}}, 404),
        ("", {"model": "nope", "busy_timeout_ms": 5, "request": {"audio_base64": "!"}}, 400),
    ]

    async def scenario():
        async with mclient(astack, None) as c:
            for query, payload, status in cases:
                resp = await c.post(f"/v1/tasks/run{query}", json=payload)
                assert resp.status_code < 500, (query, payload.get("busy_timeout_ms"), resp.text)
                if status is not None:
                    assert resp.status_code == status, (query, payload, resp.text)
                if resp.status_code != 200:
                    assert_error_shape(resp, (400, 404))
            await drained(astack, c)

    run(scenario())


def test_clients_leaving_at_every_stage_leave_nothing_held(astack):
    """On the 1-slot model: a run held at a barrier (fast path: handed over with its grant) whose client
    leaves while it runs; a dozen requests queued behind it (holding eagerly decoded samples or not) whose
    clients leave after 10..300 ms; clients that leave right after sending on an idle model. Once the barrier
    opens, every slot, ticket, input key and reservation is given back, and the model serves at once."""
    async def leaving(c: httpx.AsyncClient, after_s: float, **options) -> None:
        try:
            await asyncio.wait_for(post(c, "one", TINY, **options), after_s)
        except (TimeoutError, httpx.HTTPError):
            pass

    async def scenario():
        async with mclient(astack, None, timeout=MODEL_S) as c:
            holder = asyncio.create_task(leaving(c, 1.0, barrier="adv-hold"))
            await asyncio.to_thread(astack.wait_arrived, "adv-hold", 1)
            queued = [asyncio.create_task(leaving(c, 0.01 + 0.03 * i)) for i in range(10)]
            queued += [asyncio.create_task(leaving(c, 0.3, tag=f"q{i}")) for i in range(4)]
            await within(asyncio.gather(holder, *queued))
            astack.release("adv-hold")
            resp, _, _ = await within(post(c, "one", TINY, tag="after"))
            assert resp.status_code == 200 and resp.json()["tag"] == "after", resp.text
            for i in range(8):  # leave right after sending, on an idle model: the grant hands the run over
                await leaving(c, 0.001 * i, barrier="adv-quick")
            await asyncio.sleep(0.3)
            astack.release("adv-quick", astack.arrived("adv-quick"))
            await drained(astack, c)

    run(scenario())


def test_management_while_requests_fly_on_a_multi_slot_model(astack, token):
    """Forty requests to the 3-slot model (short sleeps) while it is unloaded, reconfigured (slots and
    version change) and unregistered then registered again: each request is served (200) or refused with
    a clear 503/404/409; none is a 500 or hangs; afterwards the stack is drained."""
    async def scenario():
        async with mclient(astack, None, timeout=MODEL_S) as c, mclient(astack, token, timeout=MODEL_S) as op:
            async def one(i: int):
                await asyncio.sleep(0.01 * i)
                resp, _, _ = await post(c, "multi", TINY, sleep_ms=30, tag=f"m{i}")
                return resp

            async def manage():
                await asyncio.sleep(0.05)
                steps = [op.post("/v1/models/unload", json={"id": "multi"}),
                         op.post("/v1/models/load", json=fx("multi", slots=2, version="v2")),
                         op.delete("/v1/models/multi"),
                         op.post("/v1/models/load", json=fx("multi", slots=3, version="v1"))]
                out = []
                for step in steps:
                    out.append(await step)
                    await asyncio.sleep(0.05)
                return out

            results = await within(asyncio.gather(manage(), *(one(i) for i in range(40))), MODEL_S)
            for resp in results[0]:
                assert resp.status_code < 300, resp.text
            for resp in results[1:]:
                if resp.status_code != 200:
                    assert_error_shape(resp, (404, 409, 503))
            await drained(astack, c)

    run(scenario())


def test_zz_a_worker_killed_mid_run_on_the_fast_path_gives_503_and_recovers(astack):
    """On the 3-slot model two runs are held at a barrier (both handed over with their grants) and the worker is
    killed with SIGKILL. Both clients get 503 ``worker_lost`` within the liveness TTL (not a hang, not a 500),
    ``serve`` starts a new worker, the next request is served, and nothing stays held."""
    async def scenario():
        async with mclient(astack, None, timeout=MODEL_S) as c:
            held = [asyncio.create_task(post(c, "multi", TINY, barrier="adv-kill")) for _ in range(2)]
            await asyncio.to_thread(astack.wait_arrived, "adv-kill", 2)
            pids = worker_pids(astack)
            assert pids
            for pid in pids:
                os.kill(pid, signal.SIGKILL)
            killed = time.monotonic()
            for task in held:
                resp, _, done = await within(task, 40)
                assert assert_error_shape(resp, (503,))["code"] == "worker_lost", resp.text
                assert done - killed < 20
            deadline = time.monotonic() + MODEL_S
            while True:
                resp, _, _ = await post(c, "multi", TINY, tag="back")
                if resp.status_code == 200:
                    break
                assert resp.status_code == 503 and time.monotonic() < deadline, resp.text
                await asyncio.sleep(0.5)
            await drained(astack, c)

    run(scenario(), 180)

