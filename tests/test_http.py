"""End to end through HTTP: daphne + a real Celery worker + Redis + PostgreSQL + real models.

The stack is ``manage.py serve`` itself (see tests/support/stacks.py, ``Stack``), configured with
``lease_ttl_ms`` 3000 and ``max_request_body_bytes`` 3 MB.
"""
from __future__ import annotations

import asyncio
import base64
import re
import time
from datetime import UTC, datetime, timedelta

import httpx
import jiwer
import numpy as np
import pytest

from inference import specs

from .support.audio import long_speech, padded, wav_bytes
from .support.bounds import MODEL_S, run, until
from .support.stacks import STACK_MAX_BODY_BYTES

pytestmark = pytest.mark.stack


def normalise(text: str) -> str:
    return " ".join(re.sub(r"[^a-z0-9 ]+", "", text.lower()).split())


def transcribe(client, data: bytes, model="whisper", filename="a.wav", **fields):
    form = {"model": model, **{k: str(v) for k, v in fields.items()}}
    return client.post("/v1/audio/transcriptions", data=form, files={"file": (filename, data)})


def run_task(client, model: str, data: bytes, **extra):
    return client.post("/v1/tasks/run", json={"model": model, "request": {
        "audio_base64": base64.b64encode(data).decode(), **extra}})


def assert_error(resp, status: int, err_type: str):
    assert resp.status_code == status, (resp.status_code, resp.text)
    body = resp.json()
    assert set(body) == {"error"} and set(body["error"]) == {"message", "type", "param", "code"}
    assert body["error"]["type"] == err_type and body["error"]["message"]
    return body["error"]


# -- service and status ---------------------------------------------------------------
def test_health(stack):
    """``workers``: live GPU workers (``degraded`` with 503 when none: tests/test_serve.py)."""
    with stack.client() as c:
        resp = c.get("/health")
    assert resp.status_code == 200
    assert resp.json() == {"status": "ok", "runtime": "legacy", "backend": "cpu", "models": 5, "workers": 1,
                           "ui": True, "ui_management": False}


def test_models_list_has_the_legacy_shape(stack):
    """R1.2: on the legacy runtime /v1/models carries no slot fields; and no ``path`` for a
    caller who may not manage models."""
    with stack.client() as c:
        body = c.get("/v1/models").json()
        one = c.get("/v1/models/vad").json()
        missing = c.get("/v1/models/nope")
    assert body["object"] == "list"
    entries = {e["id"]: e for e in body["data"] if "alias_of" not in e}
    aliases = {e["id"]: e for e in body["data"] if "alias_of" in e}
    assert set(entries) == {"whisper", "whisper-unbounded", "vad", "vad-lazy", "vad-broken"}
    assert set(aliases) == {"whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe"}  # no speech model here
    for entry in entries.values():
        assert set(entry) == {"id", "object", "created", "owned_by", "family", "task", "mode", "modes", "state",
                              "loaded", "last_error", "retry_at"}  # R6.7's fields, on every entry
    assert entries["whisper"]["modes"] == ["offline", "streaming", "batch"]
    assert entries["vad"]["modes"] == ["offline", "batch"]
    for alias in aliases.values():
        assert alias == {**entries["whisper"], "id": alias["id"], "alias_of": "whisper"}
    assert entries["whisper"]["state"] == "ready" and entries["whisper"]["loaded"] is True
    assert one == entries["vad"]
    assert_error(missing, 404, "not_found")


def test_include_params_adds_each_family_s_request_options_to_the_status_entries(stack):
    """API.md: ``?include_params=1`` (or ``true``) adds ``request_options``, the JSON Schema of the
    options the entry's family takes in a request, to every entry of ``/v1/models`` (aliases too) and
    to ``/v1/models/<id>``; without it the entries are unchanged; any other value is a 400 naming it."""
    with stack.client() as c:
        plain = c.get("/v1/models").json()["data"]
        with_params = c.get("/v1/models", params={"include_params": "1"}).json()["data"]
        one = c.get("/v1/models/vad", params={"include_params": "true"}).json()
        off = c.get("/v1/models/vad", params={"include_params": "0"}).json()
        bad = c.get("/v1/models", params={"include_params": "yes"})
    assert [{k: v for k, v in e.items() if k != "request_options"} for e in with_params] == plain
    for entry in with_params:
        assert entry["request_options"] == specs.get_spec(entry["family"])["request_options"], entry["id"]
    by_id = {e["id"]: e for e in with_params}
    assert {"threshold", "min_silence_duration_ms"} <= set(by_id["vad"]["request_options"]["properties"])
    assert "language" in by_id["whisper-1"]["request_options"]["properties"]  # an alias: its target's
    assert one == by_id["vad"] and "request_options" not in off
    assert_error(bad, 400, "invalid_request_error")
    assert bad.json()["error"]["param"] == "include_params"


def test_unknown_route_is_a_json_404(stack):
    with stack.client() as c:
        assert_error(c.get("/v2/nothing"), 404, "not_found")


# -- transcription ----------------------------------------------------------------------
def test_multipart_transcription_returns_the_reference_words(stack, speech):
    refs, hyps = [], []
    with stack.client() as c:
        for utt in speech:
            resp = transcribe(c, utt.wav)
            assert resp.status_code == 200, resp.text
            body = resp.json()
            assert set(body) == {"text", "timing"}
            assert body["timing"]["audio_duration_ms"] == pytest.approx(len(utt.samples) / 16, abs=1)
            refs.append(normalise(utt.text))
            hyps.append(normalise(body["text"]))
    assert jiwer.wer(refs, hyps) <= 0.20, hyps


def test_response_formats(stack, speech):
    utt = speech[0]
    with stack.client() as c:
        text = transcribe(c, utt.wav, response_format="text")
        srt = transcribe(c, utt.wav, response_format="srt")
        vtt = transcribe(c, utt.wav, response_format="vtt")
        verbose = c.post("/v1/audio/transcriptions", files={"file": ("a.wav", utt.wav)},
                         data={"model": "whisper", "response_format": "verbose_json",
                               "timestamp_granularities[]": ["word", "segment"]})
    assert text.headers["content-type"].startswith("text/plain") and "returned" in text.text.lower()
    assert srt.text.startswith("1\n00:00:00,000 --> 00:00:0") and "returned" in srt.text.lower()
    assert vtt.text.startswith("WEBVTT\n\n00:00:00.000 --> ")
    body = verbose.json()
    assert body["task"] == "transcribe" and body["language"] == "en"
    assert body["duration"] == pytest.approx(3.505, abs=0.01)
    assert body["segments"][0]["start"] == 0.0 and body["segments"][0]["text"]
    assert [w["word"] for w in body["words"]][:2] == ["Concorde", "returned"]


def test_json_body_with_a_server_local_path_inside_media_roots(stack, speech):
    inside = str(stack.media_root / f"{speech[1].name}.wav")
    with stack.client() as c:
        ok = c.post("/v1/audio/transcriptions", json={"model": "whisper", "file": inside})
        outside = c.post("/v1/audio/transcriptions", json={"model": "whisper", "audio": "/etc/passwd"})
        escape = c.post("/v1/audio/transcriptions",
                        json={"model": "whisper", "audio_path": str(stack.media_root / ".." / "server.json")})
        missing = c.post("/v1/audio/transcriptions", json={"model": "whisper", "audio": inside + ".nope"})
    assert ok.status_code == 200 and "cutter" in ok.json()["text"].lower()
    assert "outside" in assert_error(outside, 400, "invalid_request_error")["message"]
    assert "outside" in assert_error(escape, 400, "invalid_request_error")["message"]
    assert_error(missing, 400, "invalid_request_error")
    stack.wait_idle("whisper")


# -- /v1/tasks/run -------------------------------------------------------------------------
def test_tasks_run_vad_segments_skip_the_padding(stack, speech):
    utt = speech[0]
    pad_s = 2.0
    with stack.client() as c:
        resp = run_task(c, "vad", wav_bytes(padded(utt, pad_s), 16000))
        by_path = c.post("/v1/tasks/run", json={"model": "vad", "request": {
            "audio": str(stack.media_root / f"{utt.name}.wav"), "options": {"threshold": 0.6}}})
    assert resp.status_code == 200, resp.text
    body = resp.json()
    assert body["model"] == "vad" and body["task"] == "vad" and body["sample_rate"] == 16000
    segments = body["segments"]
    assert segments[0]["start_s"] >= pad_s - 0.1
    assert segments[-1]["end_s"] <= pad_s + len(utt.samples) / 16000 + 0.1
    speech_s = sum(s["end_s"] - s["start_s"] for s in segments)
    assert speech_s >= 0.7 * len(utt.samples) / 16000
    assert by_path.status_code == 200 and by_path.json()["segments"]


def test_tasks_run_asr(stack, speech):
    with stack.client() as c:
        resp = run_task(c, "whisper", speech[1].wav, options={"language": "en", "beam_size": 5})
    body = resp.json()
    assert resp.status_code == 200 and normalise(body["text"]) == "im from the cutter lying off the coast"
    assert body["segments"] and body["timing"]["inference_ms"] > 0


def test_digital_silence_is_200_and_empty(stack):
    silence = wav_bytes(np.zeros(32000, dtype=np.float32), 16000)
    with stack.client() as c:
        asr = transcribe(c, silence, response_format="verbose_json")
        vad = run_task(c, "vad", silence)
    assert asr.status_code == 200 and asr.json()["text"] == "" and asr.json()["segments"] == []
    assert vad.status_code == 200 and vad.json()["segments"] == []


# -- bad input: 4xx, never 500, nothing left held ---------------------------------------
def _truncated(speech):
    return speech[0].wav[:40]


BAD_INPUTS = [
    ("empty file", lambda c, s: transcribe(c, b""), 400),
    ("random bytes", lambda c, s: transcribe(c, np.random.default_rng(1).bytes(20000)), 415),
    ("truncated header", lambda c, s: transcribe(c, _truncated(s)), 415),
    ("rate 500 Hz", lambda c, s: transcribe(c, wav_bytes(np.zeros(500, dtype=np.float32), 500)), 400),
    ("rate 400 kHz", lambda c, s: transcribe(c, wav_bytes(np.zeros(4000, dtype=np.float32), 400000)), 400),
    ("oversize body", lambda c, s: transcribe(c, b"\0" * (STACK_MAX_BODY_BYTES + 1000)), 413),
    ("missing file", lambda c, s: c.post("/v1/audio/transcriptions", data={"model": "whisper"}), 400),
    ("missing model", lambda c, s: c.post("/v1/audio/transcriptions", files={"file": ("a.wav", s[0].wav)}), 400),
    ("negative busy_timeout_ms", lambda c, s: transcribe(c, s[0].wav, busy_timeout_ms=-1), 400),
    ("text busy_timeout_ms", lambda c, s: transcribe(c, s[0].wav, busy_timeout_ms="soon"), 400),
    ("bad response_format", lambda c, s: transcribe(c, s[0].wav, response_format="xml"), 400),
    ("bad temperature", lambda c, s: transcribe(c, s[0].wav, temperature="hot"), 400),
    ("unsupported language", lambda c, s: transcribe(c, s[0].wav, language="de"), 400),
    ("vad model on transcriptions", lambda c, s: transcribe(c, s[0].wav, model="vad"), 400),
    ("malformed JSON", lambda c, s: c.post("/v1/tasks/run", content=b"{nope",
                                           headers={"content-type": "application/json"}), 400),
    ("JSON array body", lambda c, s: c.post("/v1/tasks/run", json=[1, 2]), 400),
    ("task without request", lambda c, s: c.post("/v1/tasks/run", json={"model": "vad"}), 400),
    ("bad base64", lambda c, s: c.post("/v1/tasks/run", json={"model": "vad", "request": {"audio_base64": "@@"}}), 400),
    ("unknown option", lambda c, s: run_task(c, "vad", s[0].wav, options={"treshold": 0.5}), 400),
    ("option out of range", lambda c, s: run_task(c, "vad", s[0].wav, options={"threshold": 7}), 400),
    ("path without media root match", lambda c, s: c.post("/v1/tasks/run", json={
        "model": "vad", "request": {"audio": "/etc/hostname"}}), 400),
    # Each of these once gave a 500, a hang or a silent accept.
    ("lone surrogate model id", lambda c, s: _raw_json(c, '{"model": "\\ud800", "request": {"audio": "x"}}'), 400),
    ("NUL in path", lambda c, s: c.post("/v1/tasks/run", json={"model": "vad", "request": {
        "audio": str(STACK_MEDIA[0] / "a\x00b.wav")}}), 400),
    ("path too long", lambda c, s: c.post("/v1/tasks/run", json={"model": "vad", "request": {
        "audio": str(STACK_MEDIA[0] / ("a" * 5000))}}), 400),
    ("surrogate in prompt", lambda c, s: _raw_json(c, '{"model": "whisper", "request": {"audio_base64": "'
                                                   + base64.b64encode(s[0].wav).decode()
                                                   + '", "options": {"prompt": "\\ud800"}}}'), 400),
    ("deeply nested JSON", lambda c, s: _raw_json(c, "[" * 100000 + "]" * 100000), 400),
    ("options 900 levels deep (parses, then any recursive check would hit the recursion limit)",
     lambda c, s: _raw_json(c, '{"model": "vad", "request": {"audio": "x", "options": '
                            + '{"a": ' * 900 + "1" + "}" * 900 + "}}"), 400),
    ("options 33 levels deep (one over MAX_JSON_DEPTH)",
     lambda c, s: _raw_json(c, '{"model": "vad", "request": {"audio": "x", "options": '
                            + '{"a": ' * 31 + "1" + "}" * 31 + "}}"), 400),
    ("granularities not a list", lambda c, s: c.post("/v1/audio/transcriptions", json={
        "model": "whisper", "file": "x", "timestamp_granularities": 1}), 400),
    ("temperature nan", lambda c, s: transcribe(c, s[0].wav, temperature="nan"), 400),
    ("temperature boolean", lambda c, s: c.post("/v1/audio/transcriptions", json={
        "model": "whisper", "file": "x", "temperature": True}), 400),
    ("response_format list", lambda c, s: c.post("/v1/audio/transcriptions", json={
        "model": "whisper", "file": "x", "response_format": []}), 400),
    ("stream object", lambda c, s: c.post("/v1/audio/transcriptions", json={
        "model": "whisper", "file": "x", "stream": {}}), 400),
    ("options list", lambda c, s: run_task(c, "vad", s[0].wav, options=[]), 400),
    ("busy_timeout_ms with underscores", lambda c, s: transcribe(c, s[0].wav, busy_timeout_ms="1_000"), 400),
    ("busy_timeout_ms astronomically large", lambda c, s: c.post("/v1/tasks/run", json={
        "model": "vad", "busy_timeout_ms": 10 ** 400, "request": {"audio": "x"}}), 400),
    ("one sample at 384 kHz", lambda c, s: transcribe(c, wav_bytes(np.zeros(1, dtype=np.float32), 384000)), 400),
    ("chunked body without length", lambda c, s: c.post("/v1/tasks/run", content=iter([b'{"model": "vad"}']),
                                                        headers={"content-type": "application/json"}), 411),
    ("multipart without boundary", lambda c, s: c.post("/v1/audio/transcriptions", content=b"--x\r\n\r\n",
                                                      headers={"content-type": "multipart/form-data"}), 400),
    ("nine channels (over the cap of 8)", lambda c, s: transcribe(
        c, wav_bytes(np.zeros((1600, 9), dtype=np.float32), 16000, "WAV", "PCM_16")), 400),
    ("an hour of compressed silence (over max_audio_seconds)", lambda c, s: transcribe(
        c, wav_bytes(np.zeros(16000 * 3600, dtype=np.float32), 16000, "FLAC", "PCM_16"), filename="a.flac"), 413),
]

STACK_MEDIA: list = []  # filled by the autouse fixture below


@pytest.fixture(autouse=True)
def _media_root(stack):
    STACK_MEDIA[:] = [stack.media_root]


def _raw_json(client, text: str):
    return client.post("/v1/tasks/run", content=text.encode(), headers={"content-type": "application/json"})


@pytest.mark.parametrize("name, send, status", BAD_INPUTS, ids=[b[0] for b in BAD_INPUTS])
def test_bad_input_is_refused_and_leaves_the_model_free(stack, speech, name, send, status):
    """Every bad input gets its 4xx in the documented shape, never a 500, and nothing stays held (R2.4)."""
    with stack.client() as c:
        resp = send(c, speech)
        assert_error(resp, status, "invalid_request_error")
        for model_id in ("whisper", "vad"):
            assert stack.counters(model_id) == {"leases": 0, "queued": 0}
        # Free afterwards: a request that may not wait at all is served at once.
        follow = run_task(c, "vad", speech[0].wav, busy_timeout_ms=1)
        assert follow.status_code == 200, follow.text


def test_unknown_model_is_404_on_every_inference_route(stack, speech):
    with stack.client() as c:
        assert_error(transcribe(c, speech[0].wav, model="ghost"), 404, "not_found")
        assert_error(run_task(c, "ghost", speech[0].wav), 404, "not_found")


# -- the busy guard (R3) -----------------------------------------------------------------
async def _post_task(client: httpx.AsyncClient, model: str, data: bytes,
                     **extra) -> tuple[httpx.Response, float, float]:
    started = time.monotonic()
    resp = await client.post("/v1/tasks/run", json={"model": model, "request": {
        "audio_base64": base64.b64encode(data).decode(), **extra}})
    return resp, started, time.monotonic()


@pytest.fixture(scope="module")
def slow_audio(speech) -> bytes:
    """About 40 s of speech: a few seconds of Whisper work even on a fast CPU (12 s once took < 0.75 s)."""
    return long_speech(speech, 40)


def test_second_request_waits_for_the_first(stack, speech, slow_audio):
    """R1.1: two concurrent requests to one model are served one after the other."""
    async def scenario():
        async with httpx.AsyncClient(base_url=stack.url, timeout=MODEL_S) as c:
            first = asyncio.create_task(_post_task(c, "whisper", slow_audio))
            await until(lambda: stack.counters("whisper")["leases"] == 1)
            second = asyncio.create_task(_post_task(c, "whisper", speech[0].wav))
            await until(lambda: stack.counters("whisper")["queued"] == 1)
            (r1, _, end1), (r2, start2, end2) = await asyncio.gather(first, second)
            assert r1.status_code == 200 and r2.status_code == 200, (r1.text, r2.text)
            assert end2 > end1
            assert r2.json()["timing"]["queue_ms"] > 500
            assert "concorde" in r2.json()["text"].lower()
    run(scenario())
    stack.wait_idle("whisper")


def test_busy_timeout_gives_503_at_the_deadline(stack, speech, slow_audio):
    """R3.2: 503 server_busy at the deadline, with Retry-After; its ticket is gone at once."""
    async def scenario():
        async with httpx.AsyncClient(base_url=stack.url, timeout=MODEL_S) as c:
            first = asyncio.create_task(_post_task(c, "whisper", slow_audio))
            await until(lambda: stack.counters("whisper")["leases"] == 1)
            resp, started, ended = await _post_task(c, "whisper", speech[0].wav, busy_timeout_ms=800)
            elapsed_ms = (ended - started) * 1000
            error = assert_error(resp, 503, "server_busy")
            assert error["code"] == "queue_timeout" and "busy_timeout_ms=800" in error["message"]
            assert resp.headers["retry-after"] == "1"
            assert 750 <= elapsed_ms < 1500, elapsed_ms
            assert stack.counters("whisper") == {"leases": 1, "queued": 0}
            assert not first.done()
            r1, _, _ = await first
            assert r1.status_code == 200
    run(scenario())
    stack.wait_idle("whisper")


def test_request_behind_an_overdue_holder_fails_fast(stack, speech, slow_audio):
    """R3.3: the holder has run longer than the timeout → 503 at once, reason stated."""
    async def scenario():
        async with httpx.AsyncClient(base_url=stack.url, timeout=MODEL_S) as c:
            first = asyncio.create_task(_post_task(c, "whisper", slow_audio))
            await until(lambda: stack.counters("whisper")["leases"] == 1)
            await asyncio.sleep(1.0)
            resp, started, ended = await _post_task(c, "whisper", speech[0].wav, busy_timeout_ms=500)
            elapsed_ms = (ended - started) * 1000
            error = assert_error(resp, 503, "server_busy")
            assert error["code"] == "overdue" and "overdue" in error["message"]
            assert elapsed_ms < 300, elapsed_ms
            assert not first.done()
            assert (await first)[0].status_code == 200
    run(scenario())
    stack.wait_idle("whisper")


def test_timeout_zero_waits_without_bound(stack, speech, slow_audio):
    """R3.5: under a model ceiling of 0 a request without a bound waits however long it takes."""
    async def scenario():
        async with httpx.AsyncClient(base_url=stack.url, timeout=MODEL_S) as c:
            first = asyncio.create_task(_post_task(c, "whisper-unbounded", slow_audio))
            await until(lambda: stack.counters("whisper-unbounded")["leases"] == 1)
            await asyncio.sleep(1.0)
            resp, _, end2 = await _post_task(c, "whisper-unbounded", speech[0].wav)
            r1, _, end1 = await first
            assert r1.status_code == 200 and resp.status_code == 200, resp.text
            assert end2 > end1
    run(scenario())
    stack.wait_idle("whisper-unbounded")


def test_client_that_leaves_while_queued_loses_its_ticket(stack, speech, slow_audio):
    """R8.1: disconnect while queued → the ticket is gone at once; its work never runs."""
    async def scenario():
        async with httpx.AsyncClient(base_url=stack.url, timeout=MODEL_S) as c:
            first = asyncio.create_task(_post_task(c, "whisper", slow_audio))
            await until(lambda: stack.counters("whisper")["leases"] == 1)
            async with httpx.AsyncClient(base_url=stack.url, timeout=httpx.Timeout(MODEL_S, read=0.5)) as impatient:
                with pytest.raises(httpx.ReadTimeout):
                    await _post_task(impatient, "whisper", speech[0].wav)
            left_at = time.monotonic()
            await until(lambda: stack.counters("whisper")["queued"] == 0, timeout_s=2)
            assert time.monotonic() - left_at < 1.0
            assert not first.done()
            assert (await first)[0].status_code == 200
    run(scenario())
    stack.wait_idle("whisper")


def test_client_that_leaves_while_running_does_not_strand_the_lease(stack, speech, slow_audio):
    """R8.2: the running step finishes on the worker, then the lease is released; the next request works."""
    async def scenario():
        async with httpx.AsyncClient(base_url=stack.url, timeout=httpx.Timeout(MODEL_S, read=1.0)) as impatient:
            with pytest.raises(httpx.ReadTimeout):
                await _post_task(impatient, "whisper", slow_audio)
        left_at = time.monotonic()
        # The step is not pre-empted: the lease stays held while the worker runs ...
        assert stack.counters("whisper")["leases"] == 1
        # ... and the worker releases it when the run ends (it renews it meanwhile).
        await until(lambda: stack.counters("whisper")["leases"] == 0, timeout_s=60)
        async with httpx.AsyncClient(base_url=stack.url, timeout=MODEL_S) as c:
            resp, _, _ = await _post_task(c, "whisper", speech[0].wav, busy_timeout_ms=1)
            assert resp.status_code == 200, resp.text
        return time.monotonic() - left_at
    held_s = run(scenario())
    assert held_s > 0.5  # it really ran on after the client left
    stack.wait_idle("whisper")


# -- loading ---------------------------------------------------------------------------------
def test_lazy_model_loads_once_for_concurrent_cold_requests(stack, speech):
    """R4.2: single flight; both requests are served by the one published pool."""
    with stack.client() as c:
        assert c.get("/v1/models/vad-lazy").json()["state"] == "unloaded"

    async def scenario():
        async with httpx.AsyncClient(base_url=stack.url, timeout=MODEL_S) as c:
            return await asyncio.gather(*[_post_task(c, "vad-lazy", speech[0].wav) for _ in range(3)])
    results = run(scenario())
    assert [r.status_code for r, _, _ in results] == [200, 200, 200]
    loads = stack.sql("SELECT outcome FROM registry_lifecycleevent WHERE model_id = %s AND event = 'load'", "vad-lazy")
    assert loads == [("ok",)]
    with stack.client() as c:
        entry = c.get("/v1/models/vad-lazy").json()
    assert entry["state"] == "ready" and entry["loaded"] is True
    assert stack.sql("SELECT state FROM registry_modelregistration WHERE model_id = %s", "vad-lazy") == [("ready",)]
    stack.wait_idle("vad-lazy")


def test_failed_load_leaves_the_model_registered_and_retries(stack, speech):
    """R4.2/R7.2/R6.7: nothing published, everyone released; the failure is remembered (state
    ``failed``, ``last_error``, ``retry_at``) and requests get 503 at once with ``Retry-After`` until
    the backoff ends (1 s, then 2 s); then the next request retries the load."""
    with stack.client() as c:
        first = run_task(c, "vad-broken", speech[0].wav)
        error = assert_error(first, 503, "server_busy")
        assert error["code"] == "load_failed" and "failed to load" in error["message"]
        entry = c.get("/v1/models/vad-broken").json()
        assert entry["state"] == "failed" and entry["loaded"] is False
        assert "failed" in entry["last_error"].lower() or "error" in entry["last_error"].lower(), entry
        retry_at = datetime.fromisoformat(entry["retry_at"].replace("Z", "+00:00"))
        assert timedelta(0) < retry_at - datetime.now(UTC) <= timedelta(seconds=1.5)
        assert stack.counters("vad-broken") == {"leases": 0, "queued": 0}
        in_backoff = run_task(c, "vad-broken", speech[0].wav)
        error = assert_error(in_backoff, 503, "server_busy")
        assert error["code"] == "load_failed" and "backoff" in error["message"]
        assert in_backoff.headers["retry-after"] == "1"
        loads = stack.sql("SELECT outcome FROM registry_lifecycleevent WHERE model_id = %s AND event = 'load'",
                          "vad-broken")
        assert loads == [("failed",)]  # the refusal in backoff tried nothing
        time.sleep(max(0.0, (retry_at - datetime.now(UTC)).total_seconds()) + 0.1)
        second = run_task(c, "vad-broken", speech[0].wav)
        assert assert_error(second, 503, "server_busy")["code"] == "load_failed"
        entry = c.get("/v1/models/vad-broken").json()
        later = datetime.fromisoformat(entry["retry_at"].replace("Z", "+00:00"))
        assert timedelta(seconds=1.5) < later - datetime.now(UTC) <= timedelta(seconds=2.5)  # doubled
        assert stack.counters("vad-broken") == {"leases": 0, "queued": 0}
    loads = stack.sql("SELECT outcome FROM registry_lifecycleevent WHERE model_id = %s AND event = 'load'",
                      "vad-broken")
    assert loads == [("failed",), ("failed",)]
    row = stack.sql("SELECT state, last_error FROM registry_modelregistration WHERE model_id = %s", "vad-broken")
    assert row[0][0] == "unloaded" and row[0][1]
