"""The edges of the audio input of ``POST /v1/tasks/run`` (base64 JSON) and
``POST /v1/audio/transcriptions`` (multipart), on a real ``serve --parallel-jobs`` stack.

One stack: Silero VAD at 1 slot with a 500 ms busy timeout, Whisper tiny.en at 1 slot,
``max_audio_seconds`` 8.12 and a decode budget (``max_decoded_bytes_in_flight``) one MiB larger than
the reservation of :func:`budget_probe` (every reservation is over 1 MiB, so one that leaked makes
the probe a 503 ``decode_budget``). Every scenario ends with :func:`drained`: no slot or ticket
left (``GET /v1/models`` and the lease/queue hashes in Redis), no input key, every run queue empty,
then the budget probe is served.

Edges pinned here (``inference/audio.py``):
- ``test_a_streamed_flac_of_unknown_length_is_served_like_the_same_samples_as_wav``: a FLAC whose
  STREAMINFO gives no length (total samples 0, legal, what a streaming encoder writes, e.g. the
  server's own ``/v1/audio/speech`` FLAC encoder) is answered 413 "the audio lasts
  576460752303424 s" on both routes (then a 415 saying the stream states no length: libsndfile,
  through soundfile, cannot read such a stream past its first block; now counted and decoded with
  PyAV).
- ``test_audio_of_exactly_max_audio_seconds_is_served``: the limit is ``int(max_seconds * rate)``
  frames, so with ``max_audio_seconds`` 8.12 a 16 kHz file of exactly 8.12 s (129,920 frames) is 413.
- ``test_a_too_long_refusal_states_a_length_over_the_limit``: the 413's message rounds the length
  (``:.0f``): "the audio lasts 8 s; the limit is max_audio_seconds=8.12".
- ``test_a_one_sample_8khz_wav_is_not_refused_as_too_big_to_decode``: the decode budget's estimate
  counts a full block of resampler output for any file below the model's rate, so under a small
  budget one 8 kHz sample is a 413 "needs about 5.3 MiB ...; send shorter audio" (the resampler's
  chunk is now bounded by the file's own length).
"""
from __future__ import annotations

import asyncio
import base64
import io
import json
import random
import socket
import struct
import threading
import time

import httpx
import numpy as np
import pytest
import soundfile

from inference import audio, services
from inference.runtime.context import KEYS

from .support.audio import FIXTURES, pcm_wav, silent_flac, wav_bytes
from .support.bounds import MODEL_S, run, within
from .support.clients import error_of, mclient, without_timing
from .support.stacks import run_stack

pytestmark = pytest.mark.stack

RATE = 16000
MAX_SECONDS = 8.12


def budget_probe() -> bytes:
    """8 s of 16 kHz silence as FLAC: the request whose reservation is the decode budget minus 1 MiB."""
    return silent_flac(8.0)


def reservation(data: bytes, rate: int = RATE) -> int:
    """What a request with ``data`` reserves in the decode budget (``services.decoded_bytes_needed``)."""
    return services.decoded_bytes_needed(audio.read_header(data, 3600), rate)


BUDGET_BYTES = reservation(budget_probe()) + (1 << 20)
MODELS = [
    {"id": "vad", "family": "silero_vad", "slots": 1, "busy_timeout_ms": 500},
    {"id": "whisper", "family": "whisper", "slots": 1},
]


@pytest.fixture(scope="module")
def estack(tmp_path_factory):
    yield from run_stack(tmp_path_factory.mktemp("audio-edges"), MODELS, redis_db=11, name="audio_edges", parallel=True,
                         extra_config={"max_audio_seconds": MAX_SECONDS,
                                       "max_decoded_bytes_in_flight": BUDGET_BYTES})


# -- audio ---------------------------------------------------------------------------------------------
def speech_pcm() -> np.ndarray:
    """The first LibriSpeech fixture (3.5 s), int16 at 16 kHz."""
    path = sorted(FIXTURES.glob("*.wav"))[0]
    samples, rate = soundfile.read(io.BytesIO(path.read_bytes()), dtype="int16")
    assert rate == RATE
    return samples


def as_float(pcm: np.ndarray) -> np.ndarray:
    return pcm.astype(np.float32) / 32768


def streamed_flac(pcm: np.ndarray, rate: int = RATE) -> bytes:
    """``pcm`` as FLAC written to a non-seekable sink, by the encoder of ``/v1/audio/speech``
    (``response_format=flac``): its STREAMINFO says 0 total samples ("unknown", FLAC format spec)."""
    encoder = audio.SpeechEncoder("flac", rate)
    return encoder.encode(pcm.astype("<i2").tobytes()) + encoder.finish()


# -- requests ------------------------------------------------------------------------------------------
def task_body(model: str, data: bytes, **extra) -> dict:
    return {"model": model, "request": {"audio_base64": base64.b64encode(data).decode()}, **extra}


async def task_run(c: httpx.AsyncClient, model: str, data: bytes, **extra) -> httpx.Response:
    return await within(c.post("/v1/tasks/run", json=task_body(model, data, **extra)), MODEL_S)


async def transcribe(c: httpx.AsyncClient, data: bytes, **fields) -> httpx.Response:
    return await within(c.post("/v1/audio/transcriptions", data={"model": "whisper", **fields},
                               files={"file": ("audio.bin", data)}), MODEL_S)


async def drained(stack, c: httpx.AsyncClient) -> None:
    """No slot, lease or ticket of any model is left (status and Redis), no input key, every run queue is
    empty; then the budget probe (whose reservation is the budget minus 1 MiB) is served on both models,
    so no decode reservation leaked."""
    deadline = time.monotonic() + 30
    while True:
        entries = (await c.get("/v1/models")).json()["data"]
        busy = [(e["id"], e["active_slots"], e["queued_requests"]) for e in entries
                if e["active_slots"] or e["queued_requests"]]
        counts = {m["id"]: stack.counters(m["id"]) for m in MODELS}
        held = {model: n for model, n in counts.items() if n != {"leases": 0, "queued": 0}}
        inputs = list(stack.redis.scan_iter(KEYS.input("*")))
        queued = [k for k in stack.redis.scan_iter(KEYS.run_queue_prefix + "*") if stack.redis.llen(k)]
        if not busy and not held and not inputs and not queued:
            break
        assert time.monotonic() < deadline, (busy, held, inputs, queued)
        await asyncio.sleep(0.05)
    probe = budget_probe()
    resp = await task_run(c, "vad", probe)
    assert resp.status_code == 200, resp.text
    resp = await transcribe(c, probe)
    assert resp.status_code == 200, resp.text


# -- findings ------------------------------------------------------------------------------------------
def test_a_streamed_flac_of_unknown_length_is_served_like_the_same_samples_as_wav(estack):
    """A STREAMINFO total of 0 samples means "unknown" (FLAC format specification; streaming encoders
    write it, the server's own /v1/audio/speech FLAC encoder included). libsndfile reports 2^63-1 frames
    for it and cannot read it past its first block; the server counts its frames and decodes it with
    PyAV, so both routes answer exactly what they answer for the same samples as WAV (it was a 415, and
    before that a 413 "the audio lasts 576460752303424 s"); nothing is left held."""
    pcm = speech_pcm()
    flac = streamed_flac(pcm)
    assert soundfile.info(io.BytesIO(flac)).frames == audio.UNKNOWN_LENGTH_FRAMES

    async def scenario():
        async with mclient(estack, None, timeout=MODEL_S) as c:
            wav = pcm_wav(pcm.tobytes())
            for reference, resp in ((await task_run(c, "vad", wav), await task_run(c, "vad", flac)),
                                    (await transcribe(c, wav), await transcribe(c, flac))):
                assert reference.status_code == resp.status_code == 200, resp.text[:300]
                assert without_timing(resp.json()) == without_timing(reference.json())
            await drained(estack, c)

    run(scenario())


def test_audio_of_exactly_max_audio_seconds_is_served(estack):
    """``max_audio_seconds`` refuses longer audio (README); audio of exactly that length is not longer.
    8.12 * 16000 is 129919.99999999999 in binary floating point, and the check was
    ``frames > int(max_seconds * rate)``: a 16 kHz WAV of exactly 8.12 s (129,920 frames) got 413. One
    frame more is still a 413."""
    frames = round(MAX_SECONDS * RATE)
    assert frames == 129920 and int(MAX_SECONDS * RATE) == frames - 1
    assert audio.max_frames_for(MAX_SECONDS, RATE) == frames
    pcm = np.resize(speech_pcm(), frames)

    async def scenario():
        async with mclient(estack, None, timeout=MODEL_S) as c:
            over = pcm_wav(np.resize(pcm, frames + 1).tobytes())
            error_of(await task_run(c, "vad", over), (413,))
            error_of(await transcribe(c, over), (413,))
            exact = pcm_wav(pcm.tobytes())
            for resp in (await task_run(c, "vad", exact), await transcribe(c, exact)):
                assert resp.status_code == 200, (resp.status_code, resp.text[:300])
                assert resp.json()["timing"]["audio_duration_ms"] == pytest.approx(MAX_SECONDS * 1000)
            await drained(estack, c)

    run(scenario())


def test_a_too_long_refusal_states_a_length_over_the_limit(estack):
    """The 413 for audio over ``max_audio_seconds`` states a length over the limit (it rounded to whole
    seconds: "the audio lasts 8 s; the limit is max_audio_seconds=8.12")."""
    over = pcm_wav(np.resize(speech_pcm(), round(MAX_SECONDS * RATE) + RATE // 10).tobytes())  # 8.22 s

    async def scenario():
        async with mclient(estack, None, timeout=MODEL_S) as c:
            for resp in (await task_run(c, "vad", over), await transcribe(c, over)):
                message = error_of(resp, (413,))["message"]
                stated = float(message.split("lasts ", 1)[1].split(" s", 1)[0])
                assert stated > MAX_SECONDS, message

    run(scenario())


def test_a_one_sample_8khz_wav_is_not_refused_as_too_big_to_decode(estack):
    """Under this budget (about 3.8 MiB) a WAV of one 8 kHz sample is served: the decode budget's
    estimate bounds the resampler's chunk by the file's own length (it counted three whole 65,536-frame
    blocks of output for any file below the model's rate: 5.3 MiB for one sample at 8 kHz, 26 MiB at
    1 kHz, so a 413 "send shorter audio" that shorter audio could not help)."""
    one = pcm_wav(b"\x10\x00", rate=8000)
    assert reservation(one) < BUDGET_BYTES

    async def scenario():
        async with mclient(estack, None, timeout=MODEL_S) as c:
            assert (await task_run(c, "vad", pcm_wav(b"\x10\x00"))).status_code == 200
            for resp in (await task_run(c, "vad", one), await transcribe(c, one)):
                assert resp.status_code == 200, (resp.status_code, resp.text[:300])

    run(scenario())


# -- odd but legal audio at the boundaries (regression: these pass) ------------------------------------
def fmt18(pcm: bytes) -> bytes:
    """A WAV whose ``fmt `` chunk is 18 bytes (cbSize 0), otherwise in the as-is layout."""
    return pcm_wav(pcm, fmt_extra=struct.pack("<H", 0))


def boundary_cases() -> dict[str, tuple[bytes, int]]:
    """name -> (file, expected status) for both routes."""
    pcm = speech_pcm()
    raw = pcm.tobytes()
    f32 = as_float(pcm)
    return {
        "zero_length_data": (pcm_wav(b""), 400),
        "odd_data_1_byte": (pcm_wav(b"\x01"), 400),
        "odd_data_3_bytes": (pcm_wav(b"\x10\x00\x20"), 200),
        "odd_data_speech_plus_1": (pcm_wav(raw + b"\x01"), 200),
        "one_sample": (pcm_wav(b"\x10\x00"), 200),
        "one_sample_at_48k": (pcm_wav(b"\x10\x00", rate=48000), 400),  # nothing left at 16 kHz: "too short"
        "header_says_44k1": (pcm_wav(raw, rate=44100), 200),
        "byte_rate_mismatch": (pcm_wav(raw)[:28] + struct.pack("<I", 1234) + pcm_wav(raw)[32:], 200),
        "fmt_18_bytes": (fmt18(raw), 200),
        "rate_999": (pcm_wav(raw[:4000], rate=999), 400),
        "rate_384001": (pcm_wav(raw, rate=384001), 400),
        "stereo": (pcm_wav(raw, channels=2), 200),
        "stereo_half_frame": (pcm_wav(raw[:-2], channels=2), 200),
        "nine_channels": (pcm_wav(raw[:18000], channels=9), 400),
        "unsigned_8_bit": (wav_bytes(f32, RATE, subtype="PCM_U8"), 200),
        "float32": (wav_bytes(f32, RATE, subtype="FLOAT"), 200),
        "float_nan": (pcm_wav(np.full(1000, np.nan, np.float32).tobytes(), bits=32, tag=3), 400),
        "data_claims_4x": (pcm_wav(raw, claim=4 * len(raw)), 200),
        "data_claims_4x_plus_1": (pcm_wav(raw, claim=4 * len(raw) + 1), 200),
        "data_claims_ffffffff": (pcm_wav(raw, claim=0xFFFFFFFF), 200),
        "data_claims_0": (pcm_wav(raw, claim=0), 400),
        "list_before_data": (pcm_wav(raw, between=[(b"LIST", b"INFO")]), 200),
        "flac_one_sample": (wav_bytes(np.zeros(1, np.float32), RATE, "FLAC", "PCM_16"), 200),
        "garbage": (b"RIFF" + bytes(range(256)) * 8, 415),
    }


SAME_AS_SPEECH = ("odd_data_speech_plus_1", "data_claims_4x", "data_claims_4x_plus_1", "data_claims_ffffffff",
                  "list_before_data", "byte_rate_mismatch", "fmt_18_bytes")


def test_odd_but_legal_audio_gets_its_answer_on_both_routes(estack):
    """Each boundary file gets the same status on /v1/tasks/run (base64, VAD and Whisper) and on
    /v1/audio/transcriptions (multipart, Whisper): 200, or its 4xx in the documented shape, never a
    500; a data chunk that claims more than the file holds (or has an odd byte) reads as the same speech.
    Then nothing is left held."""
    cases = boundary_cases()

    async def scenario():
        async with mclient(estack, None, timeout=MODEL_S) as c:
            speech = pcm_wav(speech_pcm().tobytes())
            reference = {"vad": without_timing(await task_run(c, "vad", speech)),
                         "whisper": (await transcribe(c, speech)).json()["text"]}
            for name, (data, status) in cases.items():
                answers = {"vad": await task_run(c, "vad", data), "whisper-task": await task_run(c, "whisper", data),
                           "whisper-multipart": await transcribe(c, data)}
                for route, resp in answers.items():
                    assert resp.status_code == status, (name, route, resp.status_code, resp.text[:300])
                    if status != 200:
                        error = error_of(resp, (status,))
                        assert error["param"] in ("file", "request.audio_base64"), (name, route, error)
                if name in SAME_AS_SPEECH:
                    assert without_timing(answers["vad"]) == reference["vad"], name
                    assert answers["whisper-multipart"].json()["text"] == reference["whisper"], name
            await drained(estack, c)

    run(scenario())


# -- concurrency, clients that leave (regression: these pass) ------------------------------------------
def burst_variants() -> dict[str, bytes]:
    pcm = speech_pcm()
    long = np.resize(pcm, 8 * RATE)
    return {
        "plain_3s": pcm_wav(pcm.tobytes()),
        "plain_8s": pcm_wav(long.tobytes()),
        "plain_1_sample": pcm_wav(b"\x01\x00"),
        "flac_3s": wav_bytes(as_float(pcm), RATE, "FLAC", "PCM_16"),
        "wav_with_list": pcm_wav(pcm.tobytes(), between=[(b"LIST", b"INFO")]),
        "wav_claims_more": pcm_wav(pcm.tobytes(), claim=4 * pcm.nbytes),
        "stereo": pcm_wav(pcm.tobytes(), channels=2),
        "zero_length": pcm_wav(b""),
        "garbage": b"RIFF" + bytes(200),
    }


EXPECTED_REFUSALS = {"zero_length": 400, "garbage": 415}


def test_thirty_plain_wavs_at_once_on_a_one_slot_model_with_clients_leaving(estack):
    """Three rounds of 30 requests written at once on raw sockets to the 1-slot VAD (busy timeout 500 ms):
    plain WAVs read as-is (3 s, 8 s, 1 sample) mixed with FLAC and WAVs for libsndfile; a third of the
    clients close their socket 20..600 ms after sending. Every answer is 200, the input's 400/415, or a
    503 (queue_timeout, overdue or decode_budget) with Retry-After; none is a 500. Then nothing is held."""
    variants = burst_variants()
    host, port = estack.url.rsplit("//", 1)[1].split(":")

    def exchange(data: bytes, leave_s: float | None, start: threading.Barrier, out: list) -> None:
        body = json.dumps(task_body("vad", data)).encode()
        head = (f"POST /v1/tasks/run HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: application/json\r\n"
                f"Content-Length: {len(body)}\r\nConnection: close\r\n\r\n").encode()
        with socket.create_connection((host, int(port)), timeout=MODEL_S) as sock:
            start.wait(timeout=30)
            sock.sendall(head + body)
            if leave_s is not None:
                time.sleep(leave_s)
                return
            answer = b""
            while piece := sock.recv(65536):
                answer += piece
        out.append(answer)

    async def scenario():
        rng = random.Random(3)
        async with mclient(estack, None, timeout=MODEL_S) as c:
            for _round in range(3):
                picks = [rng.choice(list(variants)) for _ in range(30)]
                leaves = [rng.choice([None, None, 0.02, 0.1, 0.3, 0.6]) for _ in picks]
                start = threading.Barrier(len(picks))
                outs: list[list[bytes]] = [[] for _ in picks]
                threads = [threading.Thread(target=exchange, args=(variants[name], leave, start, out))
                           for name, leave, out in zip(picks, leaves, outs, strict=True)]
                for thread in threads:
                    thread.start()
                def join_all() -> None:
                    for thread in threads:
                        thread.join()
                await within(asyncio.to_thread(join_all), MODEL_S)
                for name, leave, out in zip(picks, leaves, outs, strict=True):
                    if leave is not None:
                        continue
                    assert out and out[0].startswith(b"HTTP/1.1 "), (name, out)
                    head, _, body = out[0].partition(b"\r\n\r\n")
                    status = int(head.split(b" ", 2)[1])
                    if status == 200:
                        assert name not in EXPECTED_REFUSALS, name
                        continue
                    headers = dict(line.decode().split(": ", 1) for line in head.split(b"\r\n")[1:])
                    resp = httpx.Response(status, headers=headers, content=body)
                    if name in EXPECTED_REFUSALS:
                        error_of(resp, (EXPECTED_REFUSALS[name], 503))
                    else:
                        code = error_of(resp, (503,))["code"]
                        assert code in ("queue_timeout", "overdue", "decode_budget"), (name, code)
                await drained(estack, c)

    run(scenario(), 300)


def test_clients_leaving_mid_upload_and_mid_inference_leave_nothing_held(estack):
    """Whisper (1 slot, about 1-2 s per 8 s input): multipart uploads cut off mid-body; plain-WAV uploads
    whose clients leave while queued or while their run is on the worker (0.2..3 s); streamed
    transcriptions left after their first event; base64 uploads to VAD cut off mid-body. The model keeps
    its one lease until the running step ends, then everything is given back and both models serve."""
    pcm = speech_pcm()
    long = pcm_wav(np.resize(pcm, 8 * RATE).tobytes())
    host, port = estack.url.rsplit("//", 1)[1].split(":")
    boundary = "audioedgesboundary"
    multipart = (f"--{boundary}\r\nContent-Disposition: form-data; name=\"model\"\r\n\r\nwhisper\r\n"
                 f"--{boundary}\r\nContent-Disposition: form-data; name=\"file\"; filename=\"a.wav\"\r\n"
                 "Content-Type: audio/wav\r\n\r\n").encode() + long + f"\r\n--{boundary}--\r\n".encode()
    json_body = json.dumps(task_body("vad", long)).encode()

    def cut_off(path: str, body: bytes, content_type: str, fraction: float) -> None:
        head = (f"POST {path} HTTP/1.1\r\nHost: {host}:{port}\r\nContent-Type: {content_type}\r\n"
                f"Content-Length: {len(body)}\r\n\r\n").encode()
        with socket.create_connection((host, int(port)), timeout=MODEL_S) as sock:
            sock.sendall(head + body[: int(len(body) * fraction)])

    async def leave_after(c: httpx.AsyncClient, seconds: float) -> str:
        try:
            resp = await asyncio.wait_for(c.post("/v1/audio/transcriptions", data={"model": "whisper"},
                                                 files={"file": ("a.wav", long)}), seconds)
            return str(resp.status_code) + ("" if resp.status_code == 200 else ":" + resp.json()["error"]["code"])
        except TimeoutError:
            return "left"

    async def stream_one_event(c: httpx.AsyncClient) -> str:
        async with c.stream("POST", "/v1/audio/transcriptions", data={"model": "whisper", "stream": "true"},
                            files={"file": ("a.wav", long)}) as resp:
            async for line in resp.aiter_lines():
                if line.startswith("data:"):
                    return "streamed"
        return "ended"

    async def scenario():
        async with mclient(estack, None, timeout=MODEL_S) as c:
            for fraction in (0.0, 0.1, 0.5, 0.99):
                await asyncio.to_thread(cut_off, "/v1/audio/transcriptions", multipart,
                                        f"multipart/form-data; boundary={boundary}", fraction)
                await asyncio.to_thread(cut_off, "/v1/tasks/run", json_body, "application/json", fraction)
            outcomes = await within(asyncio.gather(
                *(leave_after(c, s) for s in (0.2, 0.5, 1.0, 1.5, 2.0, 3.0)),
                *(stream_one_event(c) for _ in range(2))), MODEL_S * 2)
            assert all(o in ("left", "200", "streamed", "ended") for o in outcomes), outcomes
            await drained(estack, c)

    run(scenario(), 300)


def test_concurrent_large_uploads_under_a_small_decode_budget(estack):
    """The budget holds about one 8 s decode beside small ones. Ten 8 s uploads to each model at once
    (plain WAV read as-is, FLAC, 48 kHz WAV, stereo): each is served, or refused 503 ``decode_budget``
    (or queue_timeout/overdue on the VAD) with Retry-After, never a 500; a file needing more than the
    whole budget is a 413 from its header. Afterwards nothing stays reserved (the probe that needs the
    budget minus 1 MiB is served)."""
    pcm = np.resize(speech_pcm(), 8 * RATE)
    uploads = {
        "plain": pcm_wav(pcm.tobytes()),
        "flac": wav_bytes(as_float(pcm), RATE, "FLAC", "PCM_16"),
        "stereo": pcm_wav(np.repeat(pcm, 2).tobytes(), channels=2),
        "wav_48k_4s": wav_bytes(np.repeat(as_float(pcm[: 4 * RATE]), 3), 48000, subtype="PCM_16"),
    }
    too_big = silent_flac(8.0, rate=48000, channels=8)
    assert reservation(too_big) > BUDGET_BYTES
    for name in uploads:
        assert reservation(uploads[name]) <= BUDGET_BYTES < 2 * reservation(uploads[name]), name

    async def scenario():
        async with mclient(estack, None, timeout=MODEL_S) as c:
            for resp in (await task_run(c, "vad", too_big), await transcribe(c, too_big)):
                error_of(resp, (413,))
            names = list(uploads) * 3
            calls = [task_run(c, "vad", uploads[n]) for n in names] + [transcribe(c, uploads[n]) for n in names[:10]]
            answers = await within(asyncio.gather(*calls), MODEL_S * 3)
            codes = set()
            for resp in answers:
                if resp.status_code != 200:
                    codes.add(error_of(resp, (503,))["code"])
            assert codes <= {"decode_budget", "queue_timeout", "overdue"}, codes
            await drained(estack, c)

    run(scenario(), 300)
