"""Streams are served at most at their mode's admitted count (R9.2): a Whisper model with 3 slots whose
admission table admits ``asr/streaming`` only at 1..2 never runs more than 2 streams (SSE transcriptions
and realtime turns) at once; the others wait in its FIFO and get the same answers. A registration whose
``modes`` leave out ``streaming`` refuses streams, and one whose ``modes`` leave out ``offline`` refuses
file requests. ``/v1/models`` shows the admitted counts per mode.

One parallel stack (Redis db 6) reads its own admission table (``AUDIOSITE_ADMISSION_DIR``)."""
from __future__ import annotations

import asyncio
import base64
import json
import time

import httpx
import numpy as np
import pytest
import websockets

from inference import specs
from inference.runtime.context import KEYS

from .support.bounds import MODEL_S, run
from .support.stacks import Stack, run_stack

pytestmark = pytest.mark.stack

MODELS = [
    {"id": "w", "family": "whisper", "task": "asr", "slots": 3},
    {"id": "w-offline", "family": "whisper", "task": "asr", "modes": ["offline"]},
    {"id": "w-streams", "family": "whisper", "task": "asr", "mode": "streaming", "modes": ["streaming"], "lazy": True},
]
TABLE = {"whisper": {"asr/offline": [1, 2, 3, 4], "asr/streaming": [1, 2]}}


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Stack:
    tmp = tmp_path_factory.mktemp("stream_admission")
    (tmp / "admission").mkdir()
    (tmp / "admission" / "cpu.json").write_text(json.dumps(TABLE))
    (tmp / "stack").mkdir()
    yield from run_stack(tmp / "stack", MODELS, redis_db=6, name="stream_admission", parallel=True,
                         extra_env={specs.ADMISSION_DIR_ENV: str(tmp / "admission")})


async def _sse_text(client: httpx.AsyncClient, wav: bytes, model: str = "w") -> tuple[int, str]:
    """Stream one transcription; ``(status, final text)`` (the text is the error body on a refusal)."""
    async with client.stream("POST", "/v1/audio/transcriptions", files={"file": ("a.wav", wav)},
                             data={"model": model, "stream": "true", "language": "en"}) as resp:
        body = (await resp.aread()).decode()
    if resp.status_code != 200:
        return resp.status_code, body
    events = [json.loads(line[5:]) for line in body.splitlines() if line.startswith("data:")]
    return 200, next(e["text"] for e in events if e["type"] == "transcript.text.done")


async def _realtime_text(stack: Stack, samples: np.ndarray, model: str = "w") -> dict:
    """One manual-commit realtime turn of 16 kHz ``samples``: its completed (or failed) event."""
    pcm = (np.clip(samples, -1, 1) * 32767).astype("<i2").tobytes()
    async with websockets.connect(stack.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription") as ws:
        await ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {"input": {
            "format": {"type": "audio/pcm", "rate": 16000}, "transcription": {"model": model, "language": "en"},
            "turn_detection": None}}}}))
        await ws.send(json.dumps({"type": "input_audio_buffer.append", "audio": base64.b64encode(pcm).decode()}))
        await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
        async for message in ws:
            event = json.loads(message)
            if event["type"].startswith("conversation.item.input_audio_transcription.") and \
                    not event["type"].endswith(".delta"):
                return event
    raise AssertionError("the session closed before the turn's transcript")


def test_streams_beyond_the_admitted_streaming_count_wait_and_answer_the_same(stack, speech):
    """Three SSE streams and a realtime turn sent together on 3 slots: at most 2 hold slots at once (Redis
    ``:streams``, polled every 5 ms, and ``active_slots``), 2 at some moment, and every answer equals the
    non-streamed one."""
    utt = speech[0]
    with stack.client() as client:
        offline = client.post("/v1/audio/transcriptions", files={"file": ("a.wav", utt.wav)},
                              data={"model": "w", "language": "en"}).json()["text"]

    async def scenario():
        most = {"streams": 0, "leases": 0}
        done = asyncio.Event()

        async def watch() -> None:
            while not done.is_set():
                most["streams"] = max(most["streams"], stack.redis.hlen(KEYS.streams("w")))
                most["leases"] = max(most["leases"], stack.redis.hlen(KEYS.leases("w")))
                await asyncio.sleep(0.005)

        watcher = asyncio.create_task(watch())
        async with httpx.AsyncClient(base_url=stack.url, timeout=MODEL_S) as client:
            answers = await asyncio.gather(*[_sse_text(client, utt.wav) for _ in range(3)],
                                           _realtime_text(stack, utt.samples))
        done.set()
        await watcher
        return answers, most

    started = time.monotonic()
    answers, most = run(scenario())
    assert [a for a in answers[:3]] == [(200, offline)] * 3, answers
    assert answers[3]["type"].endswith(".completed") and answers[3]["transcript"] == offline, answers[3]
    assert most == {"streams": 2, "leases": 2}, (most, time.monotonic() - started)
    stack.wait_idle("w", timeout_s=10)
    assert stack.redis.hlen(KEYS.streams("w")) == 0 and stack.redis.hlen(KEYS.queued_streams("w")) == 0


def test_the_status_shows_the_admitted_counts_per_mode(stack):
    with stack.client() as client:
        entry = client.get("/v1/models/w").json()
        offline_only = client.get("/v1/models/w-offline").json()
    assert entry["modes"] == ["offline", "streaming", "batch"]
    # this stack's table has no asr/batch row: batch size 1 (no batching) is all that is admitted
    assert entry["admitted_slots_by_mode"] == {"offline": 4, "streaming": 2, "batch": 1}
    assert entry["max_streams"] == 2 and entry["slots"] == 3
    assert offline_only["modes"] == ["offline"]
    assert offline_only["admitted_slots_by_mode"] == {"offline": 4} and "max_streams" not in offline_only


def test_a_registration_without_streaming_refuses_streams(stack, speech):
    async def scenario():
        async with httpx.AsyncClient(base_url=stack.url, timeout=MODEL_S) as client:
            sse = await _sse_text(client, speech[0].wav, model="w-offline")
        turn = await _realtime_text(stack, speech[0].samples, model="w-offline")
        return sse, turn

    (status, body), turn = run(scenario())
    assert status == 400 and json.loads(body)["error"]["param"] == "model", body
    assert "does not serve streams" in json.loads(body)["error"]["message"]
    assert turn["type"].endswith(".failed") and turn["error"]["type"] == "invalid_request_error", turn
    stack.wait_idle("w-offline", timeout_s=10)


def test_a_streams_only_registration_refuses_offline_requests(stack, speech):
    """R9.2: a registration whose ``modes`` leave out ``offline`` answers a plain (file) transcription 400
    naming the model, before it queues or loads anything."""
    with stack.client() as client:
        resp = client.post("/v1/audio/transcriptions", files={"file": ("a.wav", speech[0].wav)},
                           data={"model": "w-streams", "language": "en"})
        entry = client.get("/v1/models/w-streams").json()
    assert resp.status_code == 400 and resp.json()["error"]["param"] == "model", resp.text
    assert "serves only streams" in resp.json()["error"]["message"]
    assert entry["state"] == "unloaded" and stack.counters("w-streams") == {"leases": 0, "queued": 0}
