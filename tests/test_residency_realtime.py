"""A realtime turn whose model must wait for residency room (R6.1, ``max_loaded_models`` 1) and whose
client leaves meanwhile (R8.2): its lease goes back at once and nothing is evicted or loaded for it.
A parallel stack (Redis db 12) with a Whisper model and a fixture model held at a barrier."""
from __future__ import annotations

import asyncio
import base64
import json
import time

import numpy as np
import pytest
import websockets

from .support.bounds import run, until, within
from .support.clients import mclient, post
from .support.stacks import FIXTURE_ENV, Stack, entry_of, fx, run_stack

pytestmark = pytest.mark.stack

MODELS = [{"id": "w", "family": "whisper", "task": "asr", "slots": 1, "lazy": True},
          fx("busy", 1) | {"lazy": True}]


@pytest.fixture(scope="module")
def stack(tmp_path_factory) -> Stack:
    yield from run_stack(tmp_path_factory.mktemp("residency_realtime"), MODELS, redis_db=12,
                         name="residency_realtime", parallel=True, extra_env=FIXTURE_ENV,
                         extra_config={"max_loaded_models": 1})


def _loaded(stack: Stack) -> set[str]:
    with stack.client() as c:
        return {e["id"] for e in c.get("/v1/models").json()["data"] if e["state"] in ("ready", "loading")}


def test_a_realtime_turn_waiting_for_room_gives_its_lease_back_when_its_client_leaves(stack, speech):
    """R6.1/R8.2: the only resident model runs a request (held at a barrier), so a realtime turn on the
    unloaded Whisper model waits for room holding its lease; its client closes the socket: the lease
    is back within 2 s (not at the turn's busy timeout), and once the running request ends (the
    fixture model idle, evictable) nothing is evicted and Whisper is not loaded for nobody."""
    pcm = (np.clip(speech[0].samples, -1, 1) * 32767).astype("<i2").tobytes()

    async def scenario() -> float:
        async with mclient(stack, None) as client:
            running = asyncio.create_task(post(client, "busy", barrier="rt-room"))
            await until(lambda: stack.arrived("rt-room") == 1)
            assert _loaded(stack) == {"busy"}
            url = stack.url.replace("http://", "ws://") + "/v1/realtime?intent=transcription"
            async with websockets.connect(url) as ws:
                await ws.send(json.dumps({"type": "session.update", "session": {"type": "transcription", "audio": {
                    "input": {"format": {"type": "audio/pcm", "rate": 16000},
                              "transcription": {"model": "w", "language": "en"}, "turn_detection": None}}}}))
                await ws.send(json.dumps({"type": "input_audio_buffer.append",
                                          "audio": base64.b64encode(pcm).decode()}))
                await ws.send(json.dumps({"type": "input_audio_buffer.commit"}))
                await until(lambda: stack.counters("w")["leases"] == 1)
                await asyncio.sleep(0.5)  # the turn waits for room (the guard's loop) with its lease
                assert stack.counters("w")["leases"] == 1 and _loaded(stack) == {"busy"}
            left = time.monotonic()
            while stack.counters("w") != {"leases": 0, "queued": 0}:
                assert time.monotonic() - left < 2.0, stack.counters("w")
                await asyncio.sleep(0.02)
            released_s = time.monotonic() - left
            stack.release("rt-room")
            resp, _, _ = await within(running, 30)
            assert resp.status_code == 200, resp.text
            await asyncio.sleep(1.5)  # many rounds of the room poll (0.1 s): a waiter would have evicted
            return released_s

    released_s = run(scenario())
    assert released_s < 2.0
    assert _loaded(stack) == {"busy"} and entry_of(stack, "w")["state"] == "unloaded"
    assert stack.counters("w") == {"leases": 0, "queued": 0}
    assert stack.counters("__coldload__") == {"leases": 0, "queued": 0}, "the cold-load guard is still held"
    assert stack.sql("SELECT model_id FROM registry_lifecycleevent WHERE event = 'teardown' "
                     "AND actor LIKE 'eviction%%'") == []
