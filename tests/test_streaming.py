"""Streamed transcription end to end: ``stream=true`` server-sent events on
``POST /v1/audio/transcriptions`` (issue 11, item 1), read by the official SDK and by httpx-sse.

One parallel-runtime stack (PostgreSQL, Redis db 11, daphne + one Celery worker) serves Whisper
tiny.en with 2 slots.
"""
from __future__ import annotations

import io
import json

import httpx
import httpx_sse
import jiwer
import numpy as np
import openai
import pytest
import soundfile

from .helpers import MODEL_S, Stack, run_stack, wav_bytes, words

pytestmark = pytest.mark.stack

MODELS = [
    {"id": "whisper", "family": "whisper", "task": "asr", "slots": 2},
    {"id": "vad", "family": "silero_vad", "task": "vad"},
]


@pytest.fixture(scope="module")
def live(tmp_path_factory) -> Stack:
    yield from run_stack(tmp_path_factory.mktemp("live"), MODELS, redis_db=11, name="live", parallel=True)


def sdk(stack: Stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=MODEL_S)


def two_utterances(speech) -> bytes:
    """Both fixtures one after the other with 1 s of silence between: more than one segment."""
    rate = speech[0].rate
    gap = np.zeros(rate, dtype=np.float32)
    return wav_bytes(np.concatenate([speech[0].samples, gap, speech[1].samples]), rate)


def sse_events(stack: Stack, wav: bytes, **fields) -> list[dict]:
    with httpx.Client(base_url=stack.url, timeout=MODEL_S) as client:
        with httpx_sse.connect_sse(client, "POST", "/v1/audio/transcriptions",
                                   files={"file": ("a.wav", wav)},
                                   data={"model": "whisper", "stream": "true", "language": "en", **fields}) as source:
            assert source.response.status_code == 200
            assert source.response.headers["content-type"].startswith("text/event-stream")
            return [json.loads(event.data) for event in source.iter_sse()]


def test_sse_deltas_concatenate_to_the_done_text_which_equals_the_plain_text(live, speech):
    wav = two_utterances(speech)
    plain = sdk(live).audio.transcriptions.create(model="whisper", file=("a.wav", io.BytesIO(wav)), language="en").text
    events = sse_events(live, wav)
    deltas = [e["delta"] for e in events if e["type"] == "transcript.text.delta"]
    done = events[-1]
    assert done["type"] == "transcript.text.done" and [e["type"] for e in events[:-1]] == ["transcript.text.delta"] * len(deltas)
    assert len(deltas) >= 2, events
    assert "".join(deltas) == done["text"] == plain and done["text"]
    assert done["usage"]["type"] == "duration"
    assert abs(done["usage"]["seconds"] - len(wav_samples(wav)) / speech[0].rate) < 0.01
    assert wer(" ".join(u.text for u in speech), done["text"]) <= 0.15, done["text"]
    live.wait_idle("whisper")


CONTRACTIONS = {"i'm": "i am", "it's": "it is", "don't": "do not", "can't": "cannot", "we're": "we are",
                "you're": "you are", "that's": "that is", "he's": "he is", "she's": "she is"}


def wer(reference: str, hypothesis: str) -> float:
    """Word error rate after lower-casing, dropping punctuation and expanding common contractions (the
    LibriSpeech references spell them out)."""
    def norm(text: str) -> str:
        return " ".join(CONTRACTIONS.get(w, w) for w in words(text.replace("\u2019", "'")).split())
    return jiwer.wer(norm(reference), norm(hypothesis))


def wav_samples(wav: bytes) -> np.ndarray:
    samples, _rate = soundfile.read(io.BytesIO(wav), dtype="float32")
    return samples


def test_the_official_sdk_iterates_the_stream_and_json_bodies_stream_too(live, speech):
    wav = speech[1].wav
    plain = sdk(live).audio.transcriptions.create(model="whisper", file=("a.wav", io.BytesIO(wav)), language="en").text
    stream = sdk(live).audio.transcriptions.create(model="whisper", file=("a.wav", io.BytesIO(wav)), language="en",
                                                   stream=True)
    events = list(stream)
    assert [type(e).__name__ for e in events][-1] == "TranscriptionTextDoneEvent"
    assert "".join(e.delta for e in events[:-1]) == events[-1].text == plain
    assert events[-1].usage.seconds > 0
    with httpx.Client(base_url=live.url, timeout=MODEL_S) as client:
        with httpx_sse.connect_sse(client, "POST", "/v1/audio/transcriptions",
                                   json={"model": "whisper", "stream": True, "language": "en",
                                         "audio": str(live.media_root / f"{speech[1].name}.wav")}) as source:
            as_json = [json.loads(event.data) for event in source.iter_sse()]
    assert as_json[-1] == {"type": "transcript.text.done", "text": plain, "usage": as_json[-1]["usage"]}
    live.wait_idle("whisper")


@pytest.mark.parametrize(("fields", "param"), [({"language": "de"}, "language"), ({"model": "vad"}, "model"),
                                              ({"stream": "maybe"}, "stream")])
def test_a_stream_refused_before_its_headers_is_a_plain_4xx_and_holds_nothing(live, speech, fields, param):
    with httpx.Client(base_url=live.url, timeout=MODEL_S) as client:
        answer = client.post("/v1/audio/transcriptions", files={"file": ("a.wav", speech[0].wav)},
                             data={"model": "whisper", "stream": "true", **fields})
    assert answer.status_code == 400, answer.text
    assert answer.json()["error"]["param"] == param
    live.wait_idle("whisper", timeout_s=10)
