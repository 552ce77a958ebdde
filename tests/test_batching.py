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
import json
import os
import re
import subprocess
import sys
import time

import httpx
import numpy as np
import pytest
from django.conf import settings

from audiosite.serverconfig import ConfigError, parse_config
from inference.adapters.base import AudioRequest, Cancelled

from .support.audio import adapter_session, load_speech, padded, wav_bytes
from .support.bounds import MODEL_S, run, until
from .support.clients import body, error_of, without_timing
from .support.stacks import FIXTURE_ENV, run_stack

RATE_HZ = 16000
WINDOW_MS = 1000
MODELS = [
    {"id": "vad", "family": "silero_vad", "task": "vad", "slots": 4},
    {"id": "vad-b", "family": "silero_vad", "task": "vad", "slots": 4, "max_batch": 4,
     "batch_window_ms": WINDOW_MS},
    {"id": "fxb", "family": "fixture", "slots": 3, "max_batch": 3, "batch_window_ms": WINDOW_MS},
    {"id": "fx1", "family": "fixture", "slots": 3},
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
    text = httpx.get(stack.url + "/metrics", timeout=MODEL_S).text
    found = re.findall(rf'audiosite_batch_calls_total\{{model="{re.escape(model_id)}",size="(\d+)"\}} (\S+)', text)
    return {int(size): int(float(value)) for size, value in found}


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
    calls = {size: n - before.get(size, 0) for size, n in batch_calls(bstack, "vad-b").items()}
    assert sum(size * n for size, n in calls.items()) == 4, calls  # every request went through the batcher
    assert any(size > 1 and n for size, n in calls.items()), calls  # and at least one call served several
    for model in ("vad", "vad-b"):
        bstack.wait_idle(model, timeout_s=10)


def test_a_failing_request_in_a_batch_fails_alone_with_its_typed_error(bstack):
    """R9.3: in a batch of three fixture runs (one session call: every member reports the same slot), the
    one asking for an injected failure gets its own 500 in the error shape while the other two are
    answered 200; no lease remains."""
    payloads = [body("fxb", tag="a"), body("fxb", fail=True, tag="bad"), body("fxb", tag="c")]
    first, bad, third = run(concurrently(bstack, "fxb", payloads))
    assert first.status_code == 200 and third.status_code == 200, (first.text, third.text)
    assert bad.status_code == 500, bad.text
    assert bad.json()["error"]["message"] and "injected" in bad.json()["error"]["message"]
    a, c = first.json(), third.json()
    assert (a["tag"], c["tag"]) == ("a", "c")
    assert a["slot"] == c["slot"] and a["pool_id"] == c["pool_id"]  # one session served both
    assert batch_calls(bstack, "fxb").get(3, 0) >= 1
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
    [(options,)] = bstack.sql("SELECT options FROM registry_modelregistration WHERE model_id = %s", "vad-c")
    assert options["max_batch"] == 2 and options["batch_window_ms"] == 20, options


def test_validate_slots_refuses_the_batch_mode_before_starting_anything(tmp_path):
    """R9.2, R9.3: ``validate_slots --mode batch`` stops with an error naming the reason (a batch runs on
    slots admitted for the registration's mode) and writes no record."""
    env = {k: v for k, v in os.environ.items() if k not in ("REDIS_URL", "DATABASE_URL")}
    done = subprocess.run([sys.executable, "manage.py", "validate_slots", "--family", "silero_vad", "--mode", "batch",
                           "--counts", "2", "--out", str(tmp_path / "out")], cwd=settings.BASE_DIR, env=env,
                          capture_output=True, text=True, timeout=MODEL_S)
    assert done.returncode != 0
    assert "mode 'batch' admits no slot count of its own" in done.stderr + done.stdout
    assert not (tmp_path / "out").exists() or not any((tmp_path / "out").rglob("record.json"))


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
    assert [answer(r) for r in run(concurrently(inproc_stack, "vad-b", payloads))] == serial
    first, bad, third = run(concurrently(inproc_stack, "fxb", [body("fxb", tag="a"), body("fxb", fail=True),
                                                               body("fxb", tag="c")]))
    assert (first.status_code, bad.status_code, third.status_code) == (200, 500, 200)
    assert first.json()["slot"] == third.json()["slot"]
    calls = batch_calls(inproc_stack, "vad-b")
    assert any(size > 1 for size in calls) and batch_calls(inproc_stack, "fxb").get(3, 0) >= 1, calls
    for model in ("vad", "vad-b", "fxb"):
        inproc_stack.wait_idle(model, timeout_s=10)
