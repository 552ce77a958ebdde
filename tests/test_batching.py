"""Native batching (``max_batch``, ``batch_window_ms``): runs of one model granted within the window share
one session call, and each request is still answered, failed, cancelled and counted on its own.

One real stack (``manage.py serve --parallel-jobs``, each model in a process of its own, PostgreSQL,
Redis db 8, the packaged Silero VAD graph and the fixture family): ``vad`` is registered without
batching, ``vad-b`` with ``max_batch`` 4 and a 1 s window, ``fxb`` (fixture) with ``max_batch`` 3.
A second stack (Redis db 9) runs the pools inside the worker process (``model_processes`` off). The
config checks run without a stack.
"""
from __future__ import annotations

import asyncio
import concurrent.futures
import functools
import io
import json
import re
import time

import httpx
import numpy as np
import psutil
import pytest

from audiosite.serverconfig import ConfigError, parse_config
from inference import specs
from inference.adapters.base import AudioRequest, Cancelled, InvalidInput
from inference.adapters.whisper_batching import transcribe_together
from gate.batching import batch_calls_in, calls_counted
from inference.runtime.context import KEYS

from .support.audio import adapter_session, load_speech, padded, wav_bytes
from .support.bounds import MODEL_S, run, until
from .support.clients import body, error_of, openai_client, operator_token, without_timing
from .support.stacks import FIXTURE_ENV, live_workers, run_stack

RATE_HZ = 16000
WINDOW_MS = 1000
MODELS = [
    {"id": "vad", "family": "silero_vad", "task": "vad", "slots": 4},
    {"id": "vad-b", "family": "silero_vad", "task": "vad", "slots": 4, "max_batch": 4,
     "batch_window_ms": WINDOW_MS},
    {"id": "fxb", "family": "fixture", "slots": 3, "max_batch": 3, "batch_window_ms": WINDOW_MS},
    {"id": "fx1", "family": "fixture", "slots": 3},
    {"id": "asr-b", "family": "whisper", "slots": 2, "max_batch": 2, "batch_window_ms": WINDOW_MS, "lazy": True},
]


@pytest.fixture(scope="module")
def bstack(tmp_path_factory):
    yield from run_stack(tmp_path_factory.mktemp("batching"), MODELS, redis_db=8, name="batching", parallel=True,
                         extra_env=FIXTURE_ENV, extra_config={"ui_management": True, "model_processes": True})


def inputs() -> list[bytes]:
    """Four different VAD inputs: the two fixture utterances, each with and without 1.5 s of silence
    around it (speech, silence and their edges)."""
    speech = load_speech()
    clips = [padded(u) for u in speech] + [u.samples for u in speech]
    return [wav_bytes(c, RATE_HZ) for c in clips]


def answer(resp: httpx.Response) -> dict:
    """A 200's body without what differs between two models or runs (``timing``, ``model``)."""
    assert resp.status_code == 200, resp.text[:400]
    return {k: v for k, v in without_timing(resp).items() if k != "model"}


def batch_calls(stack, model_id: str) -> dict[int, int]:
    """``audiosite_batch_calls_total`` of ``model_id`` from ``/metrics``: {size: calls}."""
    return batch_calls_in(httpx.get(stack.url + "/metrics", timeout=MODEL_S).text).get(model_id, {})


def calls_since(stack, model_id: str, before: dict[int, int], requests: int) -> dict[int, int]:
    """The batch calls of ``model_id`` counted since ``before`` once they cover ``requests`` requests
    (the worker counts a call after handing out its replies, so the count can trail the answers)."""
    async def read() -> dict[int, int]:
        return batch_calls(stack, model_id)
    return run(calls_counted(read, before, requests))


async def concurrently(stack, model: str, payloads: list[dict]) -> list[httpx.Response]:
    async with httpx.AsyncClient(base_url=stack.url, timeout=MODEL_S) as client:
        return list(await asyncio.gather(*(client.post("/v1/tasks/run", json=p) for p in payloads)))


def test_the_batched_graph_gives_each_clip_its_serial_probabilities_and_drops_a_cancelled_one():
    """R9.3: ``VadSession.probabilities_many`` over clips of different lengths gives each exactly its
    serial ``probabilities`` (no tolerance needed: measured identical), and a clip whose ``cancelled``
    turns true leaves the batch with :class:`Cancelled` while the others finish."""
    session = adapter_session("silero_vad")
    clips = [padded(u) for u in load_speech()] + [u.samples[: RATE_HZ // 3] for u in load_speech()]
    serial = [session.probabilities(c) for c in clips]
    batched = session.probabilities_many(clips, [lambda: False] * len(clips))
    for one, many in zip(serial, batched, strict=True):
        assert isinstance(many, np.ndarray) and np.array_equal(one, many)
    asked = {"n": 0}

    def leaves_at_third_step() -> bool:
        asked["n"] += 1
        return asked["n"] > 2
    mixed = session.probabilities_many(clips[:2], [lambda: False, leaves_at_third_step])
    assert np.array_equal(mixed[0], serial[0]) and isinstance(mixed[1], Cancelled)
    results = session.run_batch([AudioRequest(c, RATE_HZ, {"threshold": 0.5, "min_speech_duration_ms": 250,
                                                            "min_silence_duration_ms": 100, "speech_pad_ms": 30})
                                 for c in clips[:2]])
    assert results[0]["segments"] and results[0]["segments"] == session.run(
        AudioRequest(clips[0], RATE_HZ, {"threshold": 0.5, "min_speech_duration_ms": 250,
                                         "min_silence_duration_ms": 100, "speech_pad_ms": 30}))["segments"]


def test_batched_whisper_answers_equal_serial_ones_and_a_failing_or_leaving_request_goes_alone():
    """R9.3: ``WhisperSession.run_batch`` over requests of different lengths (one of two 30 s windows) and
    options (a prompt, beam size 1, word timestamps) gives each exactly its serial ``run`` answer (no
    tolerance: measured identical); windows with equal options share ``generate`` calls. A request with
    an unsupported language fails alone with :class:`InvalidInput`, and one whose client left raises
    :class:`Cancelled` while the others are answered."""
    session = adapter_session("whisper")
    first, second = (u.samples for u in load_speech())
    long_clip = np.concatenate([padded(load_speech()[0])] * 5)  # about 35 s: two windows
    cases = [(first, {}), (second, {}), (padded(load_speech()[1]), {}), (long_clip, {}),
             (first, {"prompt": "Concorde and the tents."}), (second, {"beam_size": 1}),
             (first, {"word_timestamps": True})]
    requests = [AudioRequest(clip, RATE_HZ, options) for clip, options in cases]
    serial = [session.run(r) for r in requests]
    assert len(serial[3]["segments"]) > 1 and serial[3]["duration"] > 30
    members = [(functools.partial(session._answer, request=r), r.cancelled) for r in requests]
    outcomes, sizes = transcribe_together(session.model, members)
    assert outcomes == serial
    assert max(sizes) >= 3, sizes  # the four requests without options decoded their first windows together
    assert sum(sizes) >= len(cases) + 1, sizes  # every window was decoded, the long clip's second one too
    refused = AudioRequest(first, RATE_HZ, {"language": "de"})
    leaving = AudioRequest(second, RATE_HZ, {}, cancelled=lambda: True)
    mixed = session.run_batch([requests[0], refused, leaving, requests[1]])
    assert mixed[0] == serial[0] and mixed[3] == serial[1]
    assert isinstance(mixed[1], InvalidInput) and mixed[1].param == "language"
    assert isinstance(mixed[2], Cancelled)


def test_batched_answers_equal_serial_answers_and_nothing_stays_held(bstack):
    """R9.3, R2.5: four different requests sent together to ``vad-b`` (max_batch 4) are served in shared
    session calls, and each answer is identical to the one ``vad`` (no batching) gives the same input
    alone; afterwards no lease or queue entry of either model remains."""
    payloads = [body("vad-b", data) for data in inputs()]
    with bstack.client() as client:
        serial = [answer(client.post("/v1/tasks/run", json={**p, "model": "vad"})) for p in payloads]
    before = batch_calls(bstack, "vad-b")
    batched = [answer(r) for r in run(concurrently(bstack, "vad-b", payloads))]
    assert batched == serial
    assert any(seg for a in serial for seg in a["segments"])  # the comparison covers found speech
    calls = calls_since(bstack, "vad-b", before, 4)
    assert sum(size * n for size, n in calls.items()) == 4, calls  # every request went through the batcher
    assert any(size > 1 and n for size, n in calls.items()), calls  # and at least one call served several
    for model in ("vad", "vad-b"):
        bstack.wait_idle(model, timeout_s=10)


def test_whisper_batches_through_the_server_answer_as_alone_and_a_refused_language_fails_alone(bstack):
    """R9.3 through HTTP: two different transcriptions sent together to ``asr-b`` (whisper, ``max_batch`` 2)
    share one session call and each answer equals the one the same model gives it alone; a request
    whose ``language`` the English-only checkpoint refuses, batched with a healthy one, gets its own 400
    ``invalid_input`` naming ``language`` while the other is answered exactly; nothing stays held."""
    datas = [u.wav for u in load_speech()]
    with bstack.client() as client:
        serial = [answer(client.post("/v1/tasks/run", json=body("asr-b", d))) for d in datas]
    assert all(a["text"] for a in serial)
    before = batch_calls(bstack, "asr-b")
    together = run(concurrently(bstack, "asr-b", [body("asr-b", d) for d in datas]))
    assert [answer(r) for r in together] == serial
    refused, healthy = run(concurrently(bstack, "asr-b", [
        body("asr-b", datas[0], language="de"), body("asr-b", datas[1])]))
    error = error_of(refused, (400,))
    assert error["param"] == "language", error
    assert answer(healthy) == serial[1]
    calls = calls_since(bstack, "asr-b", before, 4)
    assert calls.get(2, 0) == 2, calls  # both pairs were one call each
    bstack.wait_idle("asr-b", timeout_s=10)


def test_official_sdk_transcriptions_sent_together_are_batched_and_answered_as_alone(bstack):
    """R9.3 with a client we did not write: two ``openai`` SDK transcriptions
    (``client.audio.transcriptions.create``, multipart) of different speech sent together to ``asr-b``
    share one session call, and each text equals the one the SDK gets for the same file alone."""
    client = openai_client(bstack)

    def transcribe(utt) -> str:
        return client.audio.transcriptions.create(model="asr-b", file=("a.wav", io.BytesIO(utt.wav))).text
    speech = load_speech()
    alone = [transcribe(u) for u in speech]
    assert all(alone), alone
    before = batch_calls(bstack, "asr-b")
    with concurrent.futures.ThreadPoolExecutor(len(speech)) as pool:
        together = list(pool.map(transcribe, speech))
    assert together == alone
    assert calls_since(bstack, "asr-b", before, len(speech)) == {2: 1}
    bstack.wait_idle("asr-b", timeout_s=10)


def test_a_failing_request_in_a_batch_fails_alone_with_its_typed_error(bstack):
    """R9.3: in a batch of three fixture runs (one session call: every member reports the same slot), the
    one asking for an injected failure gets its own 500 in the error shape while the other two are
    answered 200; no lease remains."""
    payloads = [body("fxb", tag="a"), body("fxb", fail=True, tag="bad"), body("fxb", tag="c")]
    before = batch_calls(bstack, "fxb")
    first, bad, third = run(concurrently(bstack, "fxb", payloads))
    assert first.status_code == 200 and third.status_code == 200, (first.text, third.text)
    assert bad.status_code == 500, bad.text
    assert bad.json()["error"]["message"] and "injected" in bad.json()["error"]["message"]
    a, c = first.json(), third.json()
    assert (a["tag"], c["tag"]) == ("a", "c")
    assert a["slot"] == c["slot"] and a["pool_id"] == c["pool_id"]  # one session served both
    assert calls_since(bstack, "fxb", before, 3) == {3: 1}
    bstack.wait_idle("fxb", timeout_s=10)


def test_without_max_batch_concurrent_runs_use_their_own_slots_and_no_batch_call(bstack):
    """R9.3 (defaults): ``fx1`` and ``vad`` set no ``max_batch`` (1, window 0): three concurrent fixture runs
    each run on a slot of its own, and neither model makes a batch call."""
    answers = run(concurrently(bstack, "fx1", [body("fx1", sleep_ms=300, tag=str(i)) for i in range(3)]))
    slots = {r.json()["slot"] for r in answers}
    assert len(slots) == 3, [r.text for r in answers]
    run(concurrently(bstack, "vad", [body("vad", data) for data in inputs()]))
    assert batch_calls(bstack, "fx1") == {} and batch_calls(bstack, "vad") == {}
    bstack.wait_idle("fx1", timeout_s=10)


def test_a_client_leaving_a_batch_leaves_alone_and_the_others_are_answered(bstack):
    """R8.2, R9.3: three long VAD requests share one batch; the client of one leaves after 1 s. Its run
    leaves the batch (its lease is released before the others finish), the other two are answered
    with exactly their serial answers, and every counter is zero afterwards."""
    speech = load_speech()
    long_clips = [np.tile(padded(u), 8)[: 80 * RATE_HZ] for u in speech]
    long_clips.append(long_clips[0][::-1].copy())
    datas = [wav_bytes(c, RATE_HZ) for c in long_clips]
    with bstack.client() as client:
        serial = [answer(client.post("/v1/tasks/run", json=body("vad", d))) for d in datas[:2]]

    async def scenario():
        async with httpx.AsyncClient(base_url=bstack.url, timeout=MODEL_S) as patient, \
                httpx.AsyncClient(base_url=bstack.url, timeout=httpx.Timeout(MODEL_S, read=1.0)) as impatient:
            async def leaver():
                with pytest.raises(httpx.ReadTimeout):
                    await impatient.post("/v1/tasks/run", json=body("vad-b", datas[2]))
                left_at = time.monotonic()
                await until(lambda: bstack.counters("vad-b")["leases"] <= 2, timeout_s=10)
                return left_at, time.monotonic()
            stayers = [patient.post("/v1/tasks/run", json=body("vad-b", d)) for d in datas[:2]]
            *answers, (left_at, freed_at) = await asyncio.gather(*stayers, leaver())
            return answers, left_at, freed_at, time.monotonic()
    answers, left_at, freed_at, done_at = run(scenario())
    print(f"lease freed {freed_at - left_at:.2f} s after the client left; others done {done_at - left_at:.2f} s")
    assert [answer(r) for r in answers] == serial
    assert freed_at - left_at < 1.0
    bstack.wait_idle("vad-b", timeout_s=10)


def test_batch_keys_are_checked_against_the_family_and_bounds():
    """R1.1: ``max_batch`` above 1 needs a family whose spec serves ``batch`` (and a registration whose
    ``modes`` keep it); ``max_batch`` and ``batch_window_ms`` are bounded; silero_vad accepts them."""
    good = {"id": "v", "family": "silero_vad", "max_batch": 8, "batch_window_ms": 5}
    assert parse_config({"models": [good]}).models[0].max_batch == 8
    with pytest.raises(ConfigError) as info:
        parse_config({"models": [
            {"id": "e", "family": "speaker_embedding", "max_batch": 2},
            {"id": "w", "family": "silero_vad", "max_batch": 2, "modes": ["offline"]},
            {"id": "x", "family": "speaker_embedding", "max_batch": 1},
        ]})
    joined = "\n".join(info.value.problems)
    assert "(id 'e'): key 'max_batch': family 'speaker_embedding' does not batch" in joined
    assert "(id 'w'): key 'max_batch': the registration's modes ['offline'] leave out 'batch'" in joined
    assert "(id 'x')" not in joined  # 1 is no batching: any family
    with pytest.raises(ConfigError) as info:
        parse_config({"models": [{"id": "z", "family": "silero_vad", "max_batch": 0},
                                 {"id": "y", "family": "silero_vad", "max_batch": 65},
                                 {"id": "u", "family": "silero_vad", "max_batch": 2, "batch_window_ms": 10001}]})
    assert [p.split(":")[0] + ":" + p.split(":")[1] for p in info.value.problems] == [
        "models[0] (id 'z'): key 'max_batch'", "models[1] (id 'y'): key 'max_batch'",
        "models[2] (id 'u'): key 'batch_window_ms'"], info.value.problems


def test_the_management_api_registers_and_shows_batch_keys(bstack):
    """R1.1: ``POST /v1/models/load`` accepts ``max_batch``/``batch_window_ms`` for a batching family and
    refuses ``max_batch`` 2 for one that does not batch with 400 naming ``max_batch``."""
    done = bstack.manage("issue_token", "operator")
    assert done.returncode == 0, done.stderr
    headers = {"Authorization": f"Token {done.stdout.strip()}"}
    with bstack.client(headers=headers) as client:
        ok = client.post("/v1/models/load", json={"id": "vad-c", "family": "silero_vad", "max_batch": 2,
                                                   "batch_window_ms": 20, "lazy": True})
        assert ok.status_code in (200, 201, 202), ok.text
        refused = client.post("/v1/models/load", json={"id": "emb-b", "family": "speaker_embedding",
                                                       "max_batch": 2, "lazy": True})
        error = error_of(refused, (400,))
        assert error["param"] == "max_batch", error
        # R9.2: a batch size above the admitted ones is refused before anything changes, new id or registered
        top = specs.admitted_counts("silero_vad", "vad", "batch", "cpu")
        too_big = client.post("/v1/models/load", json={"id": "vad-big", "family": "silero_vad",
                                                       "max_batch": top + 1, "lazy": True})
        assert error_of(too_big, (400,))["param"] == "max_batch", too_big.text
        assert "admitted batch sizes are 1.." in too_big.json()["error"]["message"]
        assert client.get("/v1/models/vad-big").status_code == 404
        resized = client.post("/v1/models/load", json={"id": "vad-b", "max_batch": top + 1})
        assert error_of(resized, (400,))["param"] == "max_batch", resized.text
        assert answer(client.post("/v1/tasks/run", json=body("vad-b", inputs()[0])))["segments"]
    [(options,)] = bstack.sql("SELECT options FROM registry_modelregistration WHERE model_id = %s", "vad-c")
    assert options["max_batch"] == 2 and options["batch_window_ms"] == 20, options
    [(options,)] = bstack.sql("SELECT options FROM registry_modelregistration WHERE model_id = %s", "vad-b")
    assert options["max_batch"] == 4, options  # the refused reconfiguration changed nothing


def test_a_batch_size_above_the_admitted_batch_sizes_is_refused_on_the_parallel_runtime():
    """R9.2, R9.3: on the parallel runtime a ``max_batch`` above the largest batch size of the family's
    ``<task>/batch`` admission row is refused, naming ``max_batch`` and the admitted sizes; the
    legacy runtime (one session per model: nothing to batch) does not judge it."""
    top = specs.admitted_counts("silero_vad", "vad", "batch", "cpu")
    assert top >= 2  # the committed records admit batching of silero_vad
    entry = {"id": "v", "family": "silero_vad", "slots": 4, "max_batch": top + 1}
    with pytest.raises(ConfigError) as info:
        parse_config({"backend": "cpu", "models": [entry]}, parallel=True)
    [problem] = info.value.problems
    assert f"key 'max_batch': batches of {top + 1} are not validated for silero_vad vad/batch on cpu" in problem
    assert f"admitted batch sizes are 1..{top}" in problem
    assert parse_config({"backend": "cpu", "models": [{**entry, "max_batch": top}]}, parallel=True)
    legacy = {k: v for k, v in entry.items() if k != "slots"}  # the legacy runtime refuses any slots key
    assert parse_config({"backend": "cpu", "models": [legacy]}).models[0].max_batch == top + 1


def test_the_admin_reconfigure_page_accepts_and_checks_batch_keys(bstack):
    """R1.1 via the Django admin: the reconfigure page saves ``max_batch``/``batch_window_ms`` of a
    batching family and shows the ``max_batch`` problem of one that does not batch (nothing saved)."""
    made = bstack.manage("shell", "--no-imports", "-c", (
        "from django.contrib.auth.models import User\n"
        "u, _ = User.objects.get_or_create(username='badmin')\n"
        "u.is_staff = u.is_superuser = True; u.set_password('pw-badmin-1'); u.save()"))
    assert made.returncode == 0, made.stderr
    done = bstack.manage("issue_token", "operator")
    with bstack.client(headers={"Authorization": f"Token {done.stdout.strip()}"}) as api:
        for model_id, family in (("vad-adm", "silero_vad"), ("emb-adm", "speaker_embedding")):
            resp = api.post("/v1/models/load", json={"id": model_id, "family": family, "lazy": True})
            assert resp.status_code == 200, resp.text

    def csrf(c: httpx.Client, url: str) -> str:
        return re.search(r'name="csrfmiddlewaretoken" value="([^"]+)"', c.get(url).text).group(1)

    def page_of(model_id: str) -> str:
        pk = bstack.sql("SELECT id FROM registry_modelregistration WHERE model_id = %s", model_id)[0][0]
        return f"/admin/registry/modelregistration/{pk}/reconfigure/"

    with bstack.client(follow_redirects=False) as c:
        resp = c.post("/admin/login/?next=/admin/", data={"username": "badmin", "password": "pw-badmin-1",
                                                           "csrfmiddlewaretoken": csrf(c, "/admin/login/")})
        assert resp.status_code == 302, resp.text[:500]
        page = page_of("vad-adm")
        good = json.dumps({"id": "vad-adm", "family": "silero_vad", "lazy": True, "max_batch": 3,
                           "batch_window_ms": 7})
        resp = c.post(page, data={"entry": good, "csrfmiddlewaretoken": csrf(c, page)})
        assert resp.status_code == 302, resp.text[:2000]
        page = page_of("emb-adm")
        bad = json.dumps({"id": "emb-adm", "family": "speaker_embedding", "lazy": True, "max_batch": 2})
        resp = c.post(page, data={"entry": bad, "csrfmiddlewaretoken": csrf(c, page)})
        assert resp.status_code == 200 and "max_batch" in resp.text and "does not batch" in resp.text
    options = {m: o for m, o in bstack.sql(
        "SELECT model_id, options FROM registry_modelregistration WHERE model_id IN ('vad-adm', 'emb-adm')")}
    assert (options["vad-adm"]["max_batch"], options["vad-adm"]["batch_window_ms"]) == (3, 7)
    assert "max_batch" not in options["emb-adm"]


@pytest.fixture(scope="module")
def inproc_stack(tmp_path_factory):
    yield from run_stack(tmp_path_factory.mktemp("batching-inproc"), MODELS[:3], redis_db=9, name="batching_inproc",
                         parallel=True, extra_env=FIXTURE_ENV, extra_config={"model_processes": False})


def test_pools_in_the_worker_process_batch_the_same_way(inproc_stack):
    """R9.3 with ``model_processes`` off (pools inside the worker process): batched VAD
    answers equal the unbatched model's, and a failing fixture run in a batch fails alone."""
    payloads = [body("vad-b", data) for data in inputs()]
    with inproc_stack.client() as client:
        serial = [answer(client.post("/v1/tasks/run", json={**p, "model": "vad"})) for p in payloads]
    before = {model: batch_calls(inproc_stack, model) for model in ("vad-b", "fxb")}
    assert [answer(r) for r in run(concurrently(inproc_stack, "vad-b", payloads))] == serial
    first, bad, third = run(concurrently(inproc_stack, "fxb", [body("fxb", tag="a"), body("fxb", fail=True),
                                                               body("fxb", tag="c")]))
    assert (first.status_code, bad.status_code, third.status_code) == (200, 500, 200)
    assert first.json()["slot"] == third.json()["slot"]
    calls = calls_since(inproc_stack, "vad-b", before["vad-b"], len(payloads))
    assert any(size > 1 for size in calls), calls
    assert calls_since(inproc_stack, "fxb", before["fxb"], 3) == {3: 1}
    for model in ("vad", "vad-b", "fxb"):
        inproc_stack.wait_idle(model, timeout_s=10)


def asr_pid(stack, model_id: str = "asr-b") -> int:
    """The process id of ``model_id``'s process on the stack's one worker (``Keys.pool_pids``)."""
    (host,) = live_workers(stack)
    return int(stack.redis.hget(KEYS.pool_pids(host), model_id))


async def leave_after(stack, payload: dict, seconds: float) -> None:
    """Send ``payload`` and leave (close the connection) after ``seconds`` without an answer."""
    async with httpx.AsyncClient(base_url=stack.url, timeout=httpx.Timeout(MODEL_S, read=seconds)) as client:
        with pytest.raises(httpx.ReadTimeout):
            await client.post("/v1/tasks/run", json=payload)


def test_whisper_runs_whose_clients_all_left_keep_their_slots_until_their_calls_end(bstack):
    """R8.2, R2.5: two long transcriptions (100 s) sent 1.5 s apart to ``asr-b`` (slots 2) run as two calls of
    one request each, on both of the model's pipes; both clients leave while the calls go on. A short
    request sent next must be answered 200 with its serial answer: while no member is left to hold a
    batch's lease, its call still occupies a session, so the lease may only be freed when the call
    ends (otherwise the new request is granted a slot whose session is busy and fails 500 ``no free
    slot``)."""
    short = load_speech()[0].wav
    with bstack.client() as client:
        serial = answer(client.post("/v1/tasks/run", json=body("asr-b", short)))
    long_clip = np.tile(padded(load_speech()[0]), 15)[: 100 * RATE_HZ]
    long_wav = wav_bytes(long_clip[::2].copy(), RATE_HZ // 2)  # 100 s at 8 kHz: within the stack's body limit

    async def scenario():
        first = asyncio.create_task(leave_after(bstack, body("asr-b", long_wav), 3.0))
        await asyncio.sleep(1.5)  # the first batch's window (1 s) closed: the second is a call of its own
        await asyncio.gather(first, leave_after(bstack, body("asr-b", long_wav), 3.0))
        async with httpx.AsyncClient(base_url=bstack.url, timeout=MODEL_S) as client:
            return await client.post("/v1/tasks/run", json=body("asr-b", short))
    assert answer(run(scenario())) == serial
    bstack.wait_idle("asr-b", timeout_s=60)


def test_a_whisper_batch_member_leaving_mid_decode_leaves_alone_and_no_thread_stays(bstack):
    """R8.2, R9.3: a 60 s transcription (two 30 s windows) and another 60 s one share a batch of
    ``asr-b``; the first's client leaves after 3 s. Its lease is freed within 1 s, the other is answered
    exactly as alone, and after four more batches of two the model's process has as many threads as
    before them (the members' threads and the rendezvous leave nothing behind)."""
    speech = load_speech()
    clip = np.tile(padded(speech[0]), 10)[: 60 * RATE_HZ]
    stay, leave = wav_bytes(clip, RATE_HZ), wav_bytes(clip[::-1].copy(), RATE_HZ)
    with bstack.client() as client:
        serial = answer(client.post("/v1/tasks/run", json=body("asr-b", stay)))
    bstack.wait_idle("asr-b", timeout_s=60)
    threads_before = psutil.Process(asr_pid(bstack)).num_threads()

    async def scenario():
        async def leaver():
            await leave_after(bstack, body("asr-b", leave), 3.0)
            left_at = time.monotonic()
            await until(lambda: bstack.counters("asr-b")["leases"] <= 1, timeout_s=10)
            return time.monotonic() - left_at
        async with httpx.AsyncClient(base_url=bstack.url, timeout=MODEL_S) as client:
            return await asyncio.gather(client.post("/v1/tasks/run", json=body("asr-b", stay)), leaver())
    stayed, freed_s = run(scenario())
    assert answer(stayed) == serial
    assert freed_s < 1.0, freed_s
    bstack.wait_idle("asr-b", timeout_s=60)
    short = [u.wav for u in speech]
    with bstack.client() as client:
        alone = [answer(client.post("/v1/tasks/run", json=body("asr-b", d))) for d in short]
    for _ in range(4):
        assert [answer(r) for r in run(concurrently(bstack, "asr-b", [body("asr-b", d) for d in short]))] == alone
    bstack.wait_idle("asr-b", timeout_s=60)
    assert psutil.Process(asr_pid(bstack)).num_threads() <= threads_before


def test_a_batch_closes_once_every_slot_joined_and_a_single_slot_model_never_waits_for_the_window(bstack):
    """R9.3: ``max_batch`` above ``slots`` changes nothing. ``vad-s2`` (slots 2, ``max_batch`` 4) and
    ``vad-s1`` (slots 1, ``max_batch`` 4), both with a 4 s ``batch_window_ms``: two concurrent requests to
    ``vad-s2`` are one batch of 2 that runs as soon as both joined, and a request to ``vad-s1`` runs at
    once without a batch call; every answer equals the unbatched ``vad``'s and each takes well under the
    window (seconds)."""
    headers = {"Authorization": f"Token {operator_token(bstack)}"}
    with bstack.client(headers=headers) as api:
        for model_id, slots in (("vad-s2", 2), ("vad-s1", 1)):
            resp = api.post("/v1/models/load", json={"id": model_id, "family": "silero_vad", "task": "vad",
                                                      "slots": slots, "max_batch": 4, "batch_window_ms": 4000})
            assert resp.status_code == 200, resp.text
    datas = inputs()[:2]
    with bstack.client() as client:
        serial = [answer(client.post("/v1/tasks/run", json=body("vad", d))) for d in datas]
        started = time.monotonic()
        alone = client.post("/v1/tasks/run", json=body("vad-s1", datas[0]))
        alone_s = time.monotonic() - started
    started = time.monotonic()
    pair = run(concurrently(bstack, "vad-s2", [body("vad-s2", d) for d in datas]))
    pair_s = time.monotonic() - started
    assert answer(alone) == serial[0] and [answer(r) for r in pair] == serial
    assert alone_s < 2.0 and pair_s < 2.0, (alone_s, pair_s)
    assert calls_since(bstack, "vad-s2", {}, 2) == {2: 1} and batch_calls(bstack, "vad-s1") == {}
    for model_id in ("vad-s1", "vad-s2"):
        bstack.wait_idle(model_id, timeout_s=10)


def test_calls_whose_clients_all_left_keep_one_lease_each_until_they_end(bstack):
    """R8.2, R2.5, deterministic (fixture barriers): three ``fxb`` runs sent 1.3 s apart (slots 3, window
    1 s) are three calls of one run each, all held at barrier ``orphans`` on the model's three sessions;
    all three clients leave. Each call still occupies a session, so each keeps its lease (3 held, 1 s
    after the last client left; freeing them would let admission grant runs that find no free session
    and fail 500 ``no free slot``). Released, the calls end, the leases go and the next run is 200."""
    async def scenario():
        leavers = []
        for count in (1, 2, 3):
            leavers.append(asyncio.create_task(leave_after(bstack, body("fxb", barrier="orphans"), 2.5)))
            await asyncio.to_thread(bstack.wait_arrived, "orphans", count, 10)
        await asyncio.gather(*leavers)
    run(scenario())
    time.sleep(1.0)
    held = bstack.counters("fxb")["leases"]
    bstack.release("orphans", 3)
    assert held == 3
    bstack.wait_idle("fxb", timeout_s=10)
    with bstack.client() as client:
        resp = client.post("/v1/tasks/run", json=body("fxb", tag="after"))
    assert resp.status_code == 200 and resp.json()["tag"] == "after", resp.text
    bstack.wait_idle("fxb", timeout_s=10)
