"""Our own speech output reads back: ``POST /v1/audio/speech`` with ``response_format`` ``flac`` (not SSE)
is sent at once with a STREAMINFO stating its length, so libsndfile (``soundfile``) reads every sample;
the SSE flac stream, whose header cannot know its length, is read back by the server's own upload path.

One parallel-runtime stack (PostgreSQL, Redis db 12, daphne + one Celery worker) serves the real
en_US-joe-medium voice and Silero VAD.
"""
from __future__ import annotations

import base64
import io
import json

import numpy as np
import pytest
import soundfile

from inference import audio

from .support.clients import openai_client
from .support.stacks import Stack, run_stack

pytestmark = pytest.mark.stack

RATE = 22050
MODELS = [{"id": "piper", "family": "piper", "task": "tts"}, {"id": "vad", "family": "silero_vad", "task": "vad"}]
TEXT = ("The first sentence is short. The second one is a little longer than the first. "
        "And the third sentence ends the story.")


@pytest.fixture(scope="module")
def tts(tmp_path_factory) -> Stack:
    yield from run_stack(tmp_path_factory.mktemp("flac"), MODELS, redis_db=12, name="flac", parallel=True)


def test_the_sdk_s_flac_states_its_length_and_soundfile_reads_every_sample(tts):
    """The official SDK's speech call with ``response_format="flac"``: the body comes with its
    ``Content-Length`` and a STREAMINFO stating its length, so soundfile reads all of it: exactly the
    samples of the wav response for the same seed (so the same duration), streamed or not."""
    client = openai_client(tts)
    fields = {"model": "piper", "voice": "joe", "input": TEXT, "extra_body": {"seed": 7}}
    response = client.audio.speech.with_raw_response.create(response_format="flac", **fields)
    flac = response.content
    assert response.headers["content-type"] == "audio/flac"
    assert int(response.headers["content-length"]) == len(flac)
    info = soundfile.info(io.BytesIO(flac))
    assert info.frames != audio.UNKNOWN_LENGTH_FRAMES, "STREAMINFO states the length"
    samples, rate = soundfile.read(io.BytesIO(flac), dtype="int16")
    wav, wav_rate = soundfile.read(io.BytesIO(client.audio.speech.create(response_format="wav", **fields).content),
                                   dtype="int16")
    assert rate == wav_rate == RATE
    assert info.frames == len(samples) == len(wav) > 3 * RATE
    assert np.array_equal(samples, wav)
    with client.audio.speech.with_streaming_response.create(response_format="flac", **fields) as streamed:
        assert b"".join(streamed.iter_bytes()) == flac, "equal requests with a seed give byte-identical bodies"


def test_the_sse_flac_stream_is_read_back_by_the_upload_path(tts):
    """``stream_format=sse`` still streams flac as it is made (its STREAMINFO cannot know the length);
    its deltas joined are a FLAC the server's own upload path reads: VAD answers for it exactly what it
    answers for the same audio as a whole flac."""
    with tts.client() as c:
        body = {"model": "piper", "voice": "joe", "input": TEXT, "seed": 7, "response_format": "flac"}
        events = c.post("/v1/audio/speech", json={**body, "stream_format": "sse"})
        assert events.status_code == 200, events.text
        chunks = [json.loads(line[6:]) for line in events.text.splitlines() if line.startswith("data: ")]
        streamed = b"".join(base64.b64decode(e["audio"]) for e in chunks if e["type"] == "speech.audio.delta")
        assert soundfile.info(io.BytesIO(streamed)).frames == audio.UNKNOWN_LENGTH_FRAMES
        whole = c.post("/v1/audio/speech", json=body).content
        answers = []
        for data in (streamed, whole):
            resp = c.post("/v1/tasks/run", json={"model": "vad",
                                                 "request": {"audio_base64": base64.b64encode(data).decode()}})
            assert resp.status_code == 200, resp.text
            answers.append({k: v for k, v in resp.json().items() if k != "timing"})
        assert answers[0] == answers[1]
        assert answers[0]["segments"], answers[0]
