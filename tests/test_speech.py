"""Speech synthesis (family ``piper``) end to end: the OpenAI speech API as the official SDK uses it,
streamed bodies and SSE, voices, determinism, bad input, and slots held by streams (R8.3).

One parallel-runtime stack (PostgreSQL, Redis db 13, daphne + one Celery worker) serves the real
en_US-joe-medium voice with 2 slots (and lazily, with 1 to 4 slots for the slot tests) and Whisper
tiny.en, which listens to what the voice says.
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import threading
import time
import wave

import httpx
import httpx_sse
import jiwer
import numpy as np
import pytest

from .support.audio import decode_speech, words
from .support.bounds import MODEL_S, run, within
from .support.clients import openai_client
from .support.stacks import Stack, run_stack

pytestmark = pytest.mark.stack

RATE = 22050
PRESETS = {"alloy": {"voice": "joe"}, "nova": {"voice": "joe", "options": {"sentence_silence_s": 0.2}}}
SLOT_COUNTS = [1, 2, 3, 4]
TTS_MODELS = [
    {"id": "piper", "family": "piper", "task": "tts", "slots": 2, "voice_presets": PRESETS},
    *[{"id": f"piper{n}", "family": "piper", "task": "tts", "slots": n, "lazy": True} for n in SLOT_COUNTS],
    {"id": "whisper", "family": "whisper", "task": "asr"},
    {"id": "vad", "family": "silero_vad", "task": "vad"},
]
SENTENCES = [
    "Hello world.",
    "The quick brown fox jumps over the lazy dog.",
    "Please call me back after lunch tomorrow.",
    "We walked along the river until the sun went down behind the hills.",
    "Open the window.",
    "My sister bought three red apples and a loaf of bread at the market this morning.",
]
FIVE = ("The first sentence is short. The second one is a little longer than the first. "
        "Here comes the third sentence of this test. The fourth sentence talks about the weather today. "
        "And the fifth sentence ends the story.")


@pytest.fixture(scope="module")
def tts(tmp_path_factory) -> Stack:
    yield from run_stack(tmp_path_factory.mktemp("tts"), TTS_MODELS, redis_db=13, name="tts", parallel=True)


def speak(stack: Stack, text: str, **fields) -> httpx.Response:
    with stack.client() as client:
        return client.post("/v1/audio/speech", json={"model": "piper", "input": text, "voice": "joe", **fields})


def hear(stack: Stack, wav: bytes) -> str:
    return openai_client(stack).audio.transcriptions.create(model="whisper", file=("s.wav", io.BytesIO(wav)),
                                                  language="en").text


@pytest.mark.parametrize("fmt", ["mp3", "opus", "aac", "flac", "wav", "pcm"])
def test_the_sdk_gets_every_response_format_as_mono_speech_at_the_right_rate(tts, fmt):
    client = openai_client(tts)
    text = SENTENCES[3]
    body = client.audio.speech.create(model="piper", voice="alloy", input=text, response_format=fmt,
                                      extra_body={"seed": 11}).content
    with client.audio.speech.with_streaming_response.create(model="piper", voice="alloy", input=text,
                                                            response_format=fmt, extra_body={"seed": 11}) as streamed:
        assert streamed.headers["x-sample-rate"] == str(48000 if fmt == "opus" else RATE)
        chunks = list(streamed.iter_bytes())
    assert b"".join(chunks) == body, "equal requests with a seed give byte-identical bodies"
    pcm = decode_speech(speak(tts, text, response_format="pcm", seed=11).content, "pcm")
    decoded = decode_speech(body, fmt)
    assert decoded.channels == 1
    assert decoded.rate == (48000 if fmt == "opus" else RATE)
    assert abs(len(decoded.samples) / decoded.rate - len(pcm.samples) / RATE) < 0.15
    assert 0.05 < float(np.sqrt(np.mean(decoded.samples ** 2))) < 0.5, "speech, not silence or noise"
    if fmt in ("flac", "wav"):  # lossless: exactly the samples of the raw pcm body
        assert np.array_equal(np.round(decoded.samples * 32768), np.round(pcm.samples * 32768))


def test_whisper_hears_five_sentences_of_different_lengths_back(tts):
    hypotheses, references = [], []
    for sentence in SENTENCES:
        wav = speak(tts, sentence, response_format="wav", seed=3).content
        references.append(words(sentence))
        hypotheses.append(words(hear(tts, wav)))
    error = jiwer.wer(references, hypotheses)
    assert error <= 0.10, list(zip(references, hypotheses, strict=True))


def test_speed_two_gives_about_half_the_duration(tts):
    normal = len(speak(tts, SENTENCES[5], response_format="pcm", seed=5).content)
    fast = len(speak(tts, SENTENCES[5], response_format="pcm", seed=5, speed=2.0,
                     instructions="Speak quickly and cheerfully.").content)  # accepted, ignored by Piper
    assert 0.40 <= fast / normal <= 0.60, fast / normal


def test_a_seed_makes_audio_repeatable_and_no_seed_does_not(tts):
    first = speak(tts, SENTENCES[2], response_format="pcm", seed=123).content
    assert speak(tts, SENTENCES[2], response_format="pcm", seed=123).content == first
    assert speak(tts, SENTENCES[2], response_format="pcm", seed=124).content != first
    unseeded = {speak(tts, SENTENCES[2], response_format="pcm").content for _ in range(2)}
    assert len(unseeded) == 2, "without a seed the voice samples fresh noise per request"


@pytest.mark.parametrize("fmt", ["pcm", "mp3"])
def test_sse_events_parse_and_their_audio_equals_the_plain_body(tts, fmt):
    plain = speak(tts, FIVE, response_format=fmt, seed=9).content
    events = []
    with httpx.Client(base_url=tts.url, timeout=MODEL_S) as client:
        with httpx_sse.connect_sse(client, "POST", "/v1/audio/speech",
                                   json={"model": "piper", "input": FIVE, "voice": "alloy", "seed": 9,
                                         "response_format": fmt, "stream_format": "sse"},
                                   headers={"Accept": "application/octet-stream"}) as source:
            assert source.response.headers["content-type"].startswith("text/event-stream")
            events = [json.loads(event.data) for event in source.iter_sse()]
    deltas = [e for e in events if e["type"] == "speech.audio.delta"]
    assert len(deltas) >= 2 and events[-1]["type"] == "speech.audio.done"
    assert b"".join(base64.b64decode(e["audio"]) for e in deltas) == plain
    usage = events[-1]["usage"]
    assert usage["input_tokens"] == len(FIVE) and usage["output_tokens"] > 0
    assert usage["total_tokens"] == usage["input_tokens"] + usage["output_tokens"]


def test_the_body_streams_first_bytes_before_the_whole_text_is_synthesised(tts):
    speak(tts, "Warm up.", response_format="pcm")
    with httpx.Client(base_url=tts.url, timeout=MODEL_S) as client:
        started = time.monotonic()
        with client.stream("POST", "/v1/audio/speech", json={"model": "piper", "input": FIVE, "voice": "joe",
                                                              "response_format": "mp3", "seed": 1}) as response:
            first_at, size = None, 0
            for chunk in response.iter_raw():
                if chunk and first_at is None:
                    first_at = time.monotonic() - started
                size += len(chunk)
        whole = time.monotonic() - started
    assert response.status_code == 200 and size > 0 and first_at is not None
    assert first_at < 0.6 * whole, (first_at, whole)


def test_voices_are_listed_and_presets_map_openai_names_to_joe(tts):
    with tts.client() as client:
        listed = client.get("/v1/audio/voices", params={"model": "piper"}).json()["voices"]
        by_id = {v["id"]: v for v in listed}
        assert by_id["joe"]["language"] == "en_US" and by_id["joe"]["sample_rate"] == RATE
        assert by_id["alloy"]["preset_of"] == "joe" and by_id["nova"]["options"] == {"sentence_silence_s": 0.2}
        assert client.get("/v1/audio/voices", params={"model": "whisper"}).status_code == 400
        assert client.get("/v1/audio/voices", params={"model": "nobody"}).status_code == 404
    same = speak(tts, SENTENCES[1], response_format="pcm", seed=2).content
    assert speak(tts, SENTENCES[1], response_format="pcm", seed=2, voice="alloy").content == same
    with tts.client() as client:
        default = client.post("/v1/audio/speech", json={"model": "piper", "input": SENTENCES[1], "seed": 2,
                                                         "response_format": "pcm"}).content
        as_object = client.post("/v1/audio/speech", json={"model": "piper", "input": SENTENCES[1], "seed": 2,
                                                           "voice": {"id": "alloy"}, "response_format": "pcm"}).content
    assert default == same and as_object == same


def test_the_sdk_speaks_through_openai_model_names_and_the_default_voices_are_listed(tts):
    """``tts-1``, ``tts-1-hd`` and ``gpt-4o-mini-tts`` stand for the default speech model (the config's first
    ``tts`` entry, ``piper``): the SDK's call with one of them and a seed is byte for byte the call naming
    ``piper``; ``GET /v1/audio/voices`` without a model lists that model's voices."""
    client = openai_client(tts)
    own = client.audio.speech.create(model="piper", voice="alloy", input=SENTENCES[1], response_format="pcm",
                                     extra_body={"seed": 5}).content
    for alias in ("tts-1", "tts-1-hd", "gpt-4o-mini-tts"):
        spoken = client.audio.speech.create(model=alias, voice="alloy", input=SENTENCES[1], response_format="pcm",
                                            extra_body={"seed": 5}).content
        assert spoken == own, alias
    with tts.client() as http:
        default = http.get("/v1/audio/voices").json()
        named = http.get("/v1/audio/voices", params={"model": "piper"}).json()
        via_alias = http.get("/v1/audio/voices", params={"model": "tts-1"}).json()
    assert default["model"] == "piper" and default == named == via_alias
    assert {"alloy", "nova"} <= {v["id"] for v in default["voices"]}


def test_tasks_run_synthesises_text_for_a_tts_model(tts):
    with tts.client() as client:
        answer = client.post("/v1/tasks/run", json={"model": "piper",
                                                    "request": {"text": SENTENCES[1], "options": {"seed": 2}}})
    assert answer.status_code == 200, answer.text
    result = answer.json()
    assert result["task"] == "tts" and result["sample_rate"] == RATE and result["sentences"] == 1
    wav = base64.b64decode(result["audio"])
    assert decode_speech(wav, "wav").samples.size == round(result["duration"] * RATE)
    # A whole file: its header gives the real sizes (Python's wave reads the frame count from it).
    with wave.open(io.BytesIO(wav)) as reader:
        assert (reader.getnframes(), reader.getframerate(), reader.getnchannels()) == \
            (round(result["duration"] * RATE), RATE, 1)
    assert words(hear(tts, wav)) == words(SENTENCES[1])


BAD = [
    ({"input": ""}, "input"),
    ({"input": "a" * 5000}, "input"),
    ({"voice": "nobody"}, "voice"),
    ({"speed": 0}, "speed"),
    ({"speed": 9}, "speed"),
    ({"response_format": "ogg"}, "response_format"),
    ({"stream_format": "video"}, "stream_format"),
    ({"model": "whisper"}, "model"),
    ({"input": "...", "voice": "joe"}, "input"),
]


@pytest.mark.parametrize(("change", "param"), BAD, ids=[p + str(i) for i, (_c, p) in enumerate(BAD)])
def test_bad_input_is_a_400_in_the_error_shape_and_leaves_the_slot_free(tts, change, param):
    payload = {"model": "piper", "input": "Hello there.", "voice": "alloy", **change}
    with tts.client() as client:
        answer = client.post("/v1/audio/speech", json=payload)
    assert answer.status_code == 400, answer.text
    error = answer.json()["error"]
    assert error["type"] == "invalid_request_error" and error["param"] == param
    if param == "voice":
        assert "joe" in error["message"] and "alloy" in error["message"]
    tts.wait_idle("piper", timeout_s=10)


def test_non_utf8_bodies_are_refused_with_400(tts):
    with tts.client() as client:
        answer = client.post("/v1/audio/speech", content=b'{"model":"piper","input":"caf\xe9"}',
                             headers={"content-type": "application/json"})
    assert answer.status_code == 400 and answer.json()["error"]["type"] == "invalid_request_error"
    tts.wait_idle("piper", timeout_s=10)


@pytest.mark.parametrize("n", SLOT_COUNTS)
def test_concurrent_streams_equal_serial_ones_at_each_admitted_slot_count(tts, n):
    """R9.2/R9.3: n concurrent seeded requests on n slots give byte-identical bodies to the serial ones,
    in either order, and really overlap (n leases held at once)."""
    model = f"piper{n}"
    inputs = [(SENTENCES[(i + 2) % len(SENTENCES)], 40 + i) for i in range(max(n, 2))]

    async def scenario():
        async with httpx.AsyncClient(base_url=tts.url, timeout=MODEL_S) as client:
            async def one(text: str, seed: int) -> bytes:
                answer = await client.post("/v1/audio/speech", json={"model": model, "input": text, "seed": seed,
                                                                       "response_format": "pcm"})
                assert answer.status_code == 200, answer.text
                return answer.content
            serial = [await within(one(text, seed), MODEL_S) for text, seed in inputs]
            peak = 0

            async def watch():
                nonlocal peak
                while True:
                    peak = max(peak, tts.counters(model)["leases"])
                    await asyncio.sleep(0.005)
            watcher = asyncio.create_task(watch())
            waves = [await within(asyncio.gather(*[one(text, seed) for text, seed in order]), MODEL_S)
                     for order in (inputs, inputs[::-1])]
            watcher.cancel()
            return serial, waves, peak

    serial, waves, peak = run(scenario())
    assert waves[0] == serial and waves[1] == serial[::-1]
    assert peak == n, f"{peak} of {n} slots were busy at once"
    tts.wait_idle(model, timeout_s=10)


def test_a_client_leaving_mid_stream_frees_the_slot_after_its_sentence(tts):
    long_text = " ".join(f"This is sentence number {i} of a long story that nobody will hear to its end."
                         for i in range(40))
    other: dict = {}

    def neighbour():
        other["body"] = speak(tts, SENTENCES[3], response_format="pcm", seed=31).content

    expected = speak(tts, SENTENCES[3], response_format="pcm", seed=31).content
    tts.wait_idle("piper", timeout_s=10)
    with httpx.Client(base_url=tts.url, timeout=MODEL_S) as client:
        with client.stream("POST", "/v1/audio/speech", json={"model": "piper", "input": long_text,
                                                              "response_format": "pcm"}) as response:
            assert response.status_code == 200
            got = next(response.iter_raw())
            assert got
            assert tts.counters("piper")["leases"] == 1, "the stream holds its slot while it is read"
            thread = threading.Thread(target=neighbour)
            thread.start()
            left_at = time.monotonic()
    # The client is gone: the worker stops after its current sentence and the lease comes back,
    # long before the 40 sentences (about 2 minutes of audio) could have been synthesised.
    thread.join(MODEL_S)
    tts.wait_idle("piper", timeout_s=10)
    assert time.monotonic() - left_at < 10
    assert other["body"] == expected, "the neighbour's audio is untouched"
