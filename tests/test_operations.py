"""``GET /metrics`` and the graceful drain of ``serve`` and of separately run web processes (R8.4).

Metrics are read with ``prometheus_client``'s own parser and checked with ``promtool check metrics``
(Debian's ``prometheus`` package; .ci/run installs it), clients we did not write. The drain is driven
by real signals (SIGTERM, SIGINT) to a real ``manage.py serve`` or web process, with runs held open
deterministically at fixture barriers (``inference/adapters/fixture_barrier.py``).
"""
from __future__ import annotations

import asyncio
import base64
import json
import platform
import shutil
import signal
import subprocess
import threading
import time
from pathlib import Path

import httpx
import httpx_sse
import numpy as np
import psutil
import pytest
from prometheus_client.parser import text_string_to_metric_families

from inference.runtime.context import KEYS

from .support.audio import wav_bytes
from .support.bounds import MODEL_S, QUICK_S, run, until, within
from .support.clients import body, mclient, openai_client, post
from .support.cluster import run_cluster
from .support.processes import need_program, start_serve
from .support.stacks import FIXTURE_ENV, run_stack

pytestmark = pytest.mark.stack

PROMTOOL = shutil.which("promtool")

Sample = tuple[str, frozenset]


def scrape(url: str) -> tuple[str, dict[Sample, float], dict[str, str]]:
    """``GET <url>/metrics``: the text, every sample ``(name, labels) -> value``, and each family's type."""
    resp = httpx.get(url + "/metrics", timeout=QUICK_S)
    assert resp.status_code == 200, resp.text
    assert resp.headers["content-type"].startswith("text/plain; version=0.0.4")
    samples, types = {}, {}
    for family in text_string_to_metric_families(resp.text):
        types[family.name] = family.type
        for sample in family.samples:
            samples[(sample.name, frozenset(sample.labels.items()))] = sample.value
    return resp.text, samples, types


def value(samples: dict[Sample, float], name: str, **labels: str) -> float:
    """A sample's value (0 when absent: a counter or histogram series that has seen no event yet)."""
    return samples.get((name, frozenset(labels.items())), 0.0)


def scrape_when(url: str, ready, timeout_s: float = 10.0) -> tuple[str, dict[Sample, float]]:
    """Scrape until ``ready(samples)`` (metrics are written just after the answers, not before them)."""
    deadline = time.monotonic() + timeout_s
    while True:
        text, samples, _ = scrape(url)
        if ready(samples) or time.monotonic() > deadline:
            return text, samples
        time.sleep(0.05)


def promtool_check(text: str) -> None:
    promtool = need_program(PROMTOOL, "promtool to check the exposition", "prometheus")
    done = subprocess.run([promtool, "check", "metrics"], input=text, capture_output=True, text=True,
                          timeout=QUICK_S)
    assert done.returncode == 0, done.stdout + done.stderr


COUNTERS = ("audiosite_requests_total", "audiosite_rejections_total", "audiosite_model_loads_total",
            "audiosite_evictions_total")
HISTOGRAMS = ("audiosite_queue_wait_seconds", "audiosite_inference_seconds", "audiosite_model_load_seconds")
GAUGES = ("audiosite_queued_requests", "audiosite_active_slots", "audiosite_slots", "audiosite_model_loaded",
          "audiosite_draining")


# -- metrics on one serve ------------------------------------------------------------------------
METRIC_MODELS = [{"id": "m", "family": "fixture", "slots": 1, "lazy": True},
                 {"id": "idle", "family": "fixture", "slots": 3, "lazy": True}]


@pytest.fixture(scope="module")
def mstack(tmp_path_factory):
    yield from run_stack(tmp_path_factory.mktemp("metrics"), METRIC_MODELS, redis_db=9, name="metrics",
                         parallel=True, extra_env=FIXTURE_ENV)


def test_metrics_count_known_traffic_exactly_and_gauges_equal_v1_models(mstack):
    """Names and types as API.md "Metrics"; after known traffic every counter moved by exactly its
    share (5 served, 1 refused with a 503, 1 refused with a 400, 1 load), the histograms counted the
    5 granted requests (queue wait, inference) and the load; while one run is held and two wait, the
    gauges are what ``/v1/models`` says; ``promtool check metrics`` accepts the exposition."""
    text, before, types = scrape(mstack.url)
    promtool_check(text)
    for name in COUNTERS:
        assert types[name.removesuffix("_total")] == "counter", name
    for name in HISTOGRAMS:
        assert types[name] == "histogram", name
    for name in GAUGES:
        assert types[name] == "gauge", name
    assert value(before, "audiosite_draining") == 0
    assert value(before, "audiosite_slots", model="idle") == 3

    async def scenario():
        async with mclient(mstack, None) as c:
            for tag in ("a", "b"):
                resp, _, _ = await post(c, "m", tag=tag)
                assert resp.status_code == 200, resp.text
            held = asyncio.create_task(post(c, "m", barrier="m-hold"))
            await until(lambda: mstack.arrived("m-hold") == 1)
            queued = [asyncio.create_task(post(c, "m", tag=f"q{i}")) for i in range(2)]
            await until(lambda: mstack.counters("m")["queued"] == 2)
            refused, _, _ = await post(c, "m", busy_timeout_ms=50)
            assert refused.status_code == 503, refused.text
            bad, _, _ = await post(c, "m", no_such_option=1)
            assert bad.status_code == 400, bad.text

            _, during, _ = await asyncio.to_thread(scrape, mstack.url)
            entries = {e["id"]: e for e in (await c.get("/v1/models")).json()["data"]}
            for model_id, entry in entries.items():
                assert value(during, "audiosite_queued_requests", model=model_id) == entry["queued_requests"]
                assert value(during, "audiosite_active_slots", model=model_id) == entry["active_slots"]
                assert value(during, "audiosite_slots", model=model_id) == entry["slots"]
                assert value(during, "audiosite_model_loaded", model=model_id) == int(entry["loaded"])
            assert (entries["m"]["queued_requests"], entries["m"]["active_slots"], entries["m"]["loaded"]) == \
                (2, 1, True)

            mstack.release("m-hold")
            for task in [held, *queued]:
                resp, _, _ = await within(task)
                assert resp.status_code == 200, resp.text
            return refused.json()["error"]["code"]

    code = run(scenario())

    def moved(samples, name: str, **labels: str) -> float:
        return value(samples, name, **labels) - value(before, name, **labels)

    text, after = scrape_when(mstack.url, lambda now: (
        moved(now, "audiosite_requests_total", model="m", outcome="ok"),
        moved(now, "audiosite_inference_seconds_count", model="m"),
        moved(now, "audiosite_queue_wait_seconds_count", model="m")) == (5, 5, 5))
    promtool_check(text)

    def delta(name: str, **labels: str) -> float:
        return moved(after, name, **labels)

    assert delta("audiosite_requests_total", model="m", outcome="ok") == 5
    assert delta("audiosite_requests_total", model="m", outcome="rejected") == 1
    assert delta("audiosite_requests_total", model="m", outcome="client_error") == 1
    assert delta("audiosite_rejections_total", model="m", code=code) == 1
    assert code in ("queue_timeout", "overdue")
    assert delta("audiosite_model_loads_total", model="m", outcome="ok") == 1
    assert delta("audiosite_model_load_seconds_count", model="m") == 1
    assert delta("audiosite_queue_wait_seconds_count", model="m") == 5
    assert delta("audiosite_inference_seconds_count", model="m") == 5
    assert delta("audiosite_queue_wait_seconds_bucket", model="m", le="+Inf") == 5
    # the two requests that waited behind the held run waited longer than the first two
    assert delta("audiosite_queue_wait_seconds_sum", model="m") > 0
    assert value(after, "audiosite_queued_requests", model="m") == 0
    assert value(after, "audiosite_active_slots", model="m") == 0
    assert value(after, "audiosite_model_loaded", model="idle") == 0


# -- series from the first scrape, processes, build, unregistration -------------------------------
def test_a_served_request_is_recorded_by_the_worker_that_served_it_and_its_web_process_writes_no_metrics(mstack):
    """A request answered 200 by one run: the worker writes its counter, audio seconds, queue wait,
    inference time and activity row (route, client, status, times) in one ``MULTI`` after its reply,
    and the web process sends no command touching the metrics or the activity list for it (Redis
    ``MONITOR``: no such command from a connection named ``audiosite-web``). A request refused 400
    is still recorded by the web process."""
    from inference.runtime.context import WEB_CLIENT_NAME

    metric_keys = (KEYS.metric("requests_total"), KEYS.activity)
    seen: list[dict] = []
    stop = "monitor-stop-" + str(time.monotonic())

    def watch(started: threading.Event) -> None:
        with mstack.redis.monitor() as monitor:
            started.set()
            for command in monitor.listen():
                if stop in command["command"]:
                    return
                if any(key in command["command"] for key in metric_keys):
                    seen.append(command)

    started = threading.Event()
    watcher = threading.Thread(target=watch, args=(started,), daemon=True)
    watcher.start()
    assert started.wait(QUICK_S)
    before = mstack.redis.llen(KEYS.activity)

    async def scenario():
        async with mclient(mstack, None) as c:
            served, _, _ = await post(c, "m", tag="by-worker")
            assert served.status_code == 200, served.text
            await until(lambda: mstack.redis.llen(KEYS.activity) >= before + 1)
            refused, _, _ = await post(c, "m", no_such_option=1)
            assert refused.status_code == 400, refused.text
            await until(lambda: mstack.redis.llen(KEYS.activity) >= before + 2)

    run(scenario())
    mstack.redis.echo(stop)
    watcher.join(QUICK_S)
    names = {client["addr"]: client.get("name", "") for client in mstack.redis.client_list()}
    writers = {(names.get(f"{c['client_address']}:{c['client_port']}", "?"), c["command"].split()[0].upper())
               for c in seen}
    served_row, refused_row = (json.loads(text) for text in mstack.redis.lrange(KEYS.activity, 1, 1) +
                               mstack.redis.lrange(KEYS.activity, 0, 0))
    assert served_row["status"] == 200 and refused_row["status"] == 400, (served_row, refused_row)
    assert (served_row["model"], served_row["route"], served_row["outcome"], served_row["client"]) == \
        ("m", "/v1/tasks/run", "ok", "127.0.0.1"), served_row
    assert served_row["run_ms"] is not None and served_row["total_ms"] >= served_row["run_ms"], served_row
    assert served_row["queue_ms"] == 0.0, served_row  # the slot was free: granted at once
    by_web = {True: [], False: []}
    for c in seen:
        by_web[names.get(f"{c['client_address']}:{c['client_port']}") == WEB_CLIENT_NAME].append(
            c["command"].replace("\\", ""))
    # the web process wrote the refused request's counter and row, nothing of the served one
    assert any("client_error" in c for c in by_web[True]), writers
    assert not any('"ok"' in c for c in by_web[True]), by_web[True]
    # the worker's connection wrote the served one's counter and row
    assert any('"ok"' in c for c in by_web[False]), writers


FIRST_MODELS = [{"id": "fx", "family": "fixture", "slots": 1, "lazy": True},
                {"id": "gone", "family": "fixture", "slots": 1, "lazy": True},
                {"id": "asr", "family": "whisper", "task": "asr", "lazy": True}]
ZERO_COUNTERS = (
    [("audiosite_requests_total", {"outcome": o}) for o in ("ok", "client_error", "rejected", "error")]
    + [("audiosite_rejections_total", {"code": c}) for c in ("queue_timeout", "overdue", "shutting_down",
                                                              "worker_lost", "no_worker", "load_failed")]
    + [("audiosite_model_loads_total", {"outcome": o}) for o in ("ok", "failed")]
    + [("audiosite_evictions_total", {})]
    + [(f"{h}_{part}", {}) for h in HISTOGRAMS for part in ("count", "sum")]
    + [(f"{h}_bucket", {"le": "+Inf"}) for h in HISTOGRAMS])
MB = 1024 * 1024


def series_of(samples: dict[Sample, float], model: str) -> list[Sample]:
    return [key for key in samples if ("model", model) in key[1]]


def exposed(samples: dict[Sample, float], name: str, **labels: str) -> float | None:
    """A sample's value, None when the series is not exposed at all."""
    return samples.get((name, frozenset(labels.items())))


def test_the_first_scrape_has_every_model_at_zero_each_process_and_the_build_and_unregistering_drops_a_model(
        tmp_path):
    """From the first scrape after start, every registered model has its series at 0 (requests by
    outcome, rejections by code, loads, evictions, audio seconds with its task, histograms; realtime
    partial decodes for the ASR model only), so ``rate()`` sees the first event; each live web process
    and worker has its CPU seconds and resident memory; ``audiosite_build_info`` names the version,
    python, runtime and backend. Requests add their inputs' durations to ``audio_seconds_total``.
    ``DELETE /v1/models/{id}`` removes that model's series from the exposition and its fields from
    Redis. ``promtool check metrics`` accepts every scrape."""
    stacks = run_stack(tmp_path, FIRST_MODELS, redis_db=8, name="mfirst", parallel=True, extra_env=FIXTURE_ENV,
                       extra_config={"ui_management": True})
    stack = next(stacks)
    try:
        text, first, types = scrape(stack.url)
        promtool_check(text)
        for model_id in ("fx", "gone", "asr"):
            for name, labels in ZERO_COUNTERS:
                assert exposed(first, name, model=model_id, **labels) == 0, (model_id, name, labels)
        for model_id, task in (("fx", "fixture"), ("gone", "fixture"), ("asr", "asr")):
            assert exposed(first, "audiosite_audio_seconds_total", model=model_id, task=task) == 0, model_id
        assert exposed(first, "audiosite_realtime_partial_decodes_total", model="asr") == 0
        assert exposed(first, "audiosite_realtime_partial_decodes_total", model="fx") is None
        assert types["audiosite_audio_seconds"] == types["audiosite_realtime_partial_decodes"] == "counter"

        builds = [dict(labels) for (name, labels), v in first.items() if name == "audiosite_build_info" and v == 1]
        health = httpx.get(stack.url + "/health", timeout=QUICK_S).json()
        assert len(builds) == 1, builds
        assert builds[0]["python"] == platform.python_version()
        assert (builds[0]["runtime"], builds[0]["backend"]) == (health["runtime"], health["backend"])
        assert builds[0]["version"] and builds[0]["version"] != "unknown", builds  # git describe of the checkout

        def processes(samples) -> dict[str, dict[str, float]]:
            found: dict[str, dict[str, float]] = {}
            for (name, labels), v in samples.items():
                if name in ("audiosite_process_cpu_seconds_total", "audiosite_process_resident_memory_bytes"):
                    found.setdefault(dict(labels)["role"], {})[name] = v
            return found

        text, now = scrape_when(stack.url, lambda samples: {"web", "worker"} <= set(processes(samples)))
        promtool_check(text)
        assert types["audiosite_process_cpu_seconds"] == "counter"
        assert types["audiosite_process_resident_memory_bytes"] == "gauge"
        served_pids = {p.pid for p in psutil.Process(stack.proc.pid).children(recursive=True)}
        pids = {int(dict(labels)["process"].rsplit(":", 1)[1]) for (name, labels) in now
                if name.startswith("audiosite_process_")}
        assert len(pids) >= 2 and pids <= served_pids, (pids, served_pids)  # host:pid of serve's children
        for role, values in processes(now).items():
            assert values["audiosite_process_resident_memory_bytes"] > 10 * MB, (role, values)
            assert values["audiosite_process_cpu_seconds_total"] > 0, (role, values)

        async def traffic():
            async with mclient(stack, None) as c:
                for model_id, n in (("fx", 3), ("gone", 1)):
                    for _ in range(n):
                        resp, _, _ = await post(c, model_id)  # TINY: 0.1 s of audio
                        assert resp.status_code == 200, resp.text

        run(traffic())
        _, after = scrape_when(stack.url, lambda samples: (
            value(samples, "audiosite_requests_total", model="fx", outcome="ok"),
            value(samples, "audiosite_requests_total", model="gone", outcome="ok")) == (3, 1))
        assert value(after, "audiosite_audio_seconds_total", model="fx", task="fixture") == pytest.approx(0.3, abs=1e-6)
        assert value(after, "audiosite_audio_seconds_total", model="gone", task="fixture") == pytest.approx(0.1,
                                                                                                            abs=1e-6)
        stored = [f for key in stack.redis.keys(KEYS.metric("*")) if stack.redis.type(key) == "hash"
                  for f in stack.redis.hkeys(key)]
        assert any(f.startswith('["gone"') for f in stored), stored

        token = stack.manage("issue_token", "operator").stdout.strip()
        with stack.client(headers={"Authorization": f"Token {token}"}) as c:
            resp = c.delete("/v1/models/gone")
            assert resp.status_code == 200, resp.text
        text, gone = scrape(stack.url)[:2]
        promtool_check(text)
        assert series_of(gone, "gone") == [], series_of(gone, "gone")
        assert series_of(gone, "fx") and value(gone, "audiosite_requests_total", model="fx", outcome="ok") == 3
        stored = [f for key in stack.redis.keys(KEYS.metric("*")) if stack.redis.type(key) == "hash"
                  for f in stack.redis.hkeys(key)]
        assert not any(f.startswith('["gone"') for f in stored), stored
    finally:
        next(stacks, None)


# -- audio seconds and realtime turns on real models ---------------------------------------------
AUDIO_MODELS = [{"id": "whisper", "family": "whisper", "task": "asr", "slots": 1},
                {"id": "tts", "family": "piper", "task": "tts", "slots": 1}]
COMPLETED = "conversation.item.input_audio_transcription.completed"


def test_audio_seconds_count_inputs_and_speech_and_a_realtime_turn_is_one_request(tmp_path, speech):
    """``audiosite_audio_seconds_total{model,task}`` adds a transcription's input duration (official SDK,
    a speech fixture), a ``/v1/tasks/run`` synthesis's duration and the seconds of PCM a streamed
    ``/v1/audio/speech`` sent (official SDK). A sentence spoken through the official SDK's realtime
    client at real-time pace (server VAD): each completed turn counts as one ``requests_total{outcome="ok"}``
    of its model, its partial decodes in ``realtime_partial_decodes_total`` (not as requests), and
    its audio seconds (the ``usage.seconds`` of its ``completed`` event)."""
    stacks = run_stack(tmp_path, AUDIO_MODELS, redis_db=8, name="maudio", parallel=True)
    stack = next(stacks)
    try:
        _, before, _ = scrape(stack.url)
        client = openai_client(stack)
        utt = speech[0]
        client.audio.transcriptions.create(model="whisper", file=("a.wav", utt.wav), language="en")
        asr_s = len(utt.samples) / utt.rate
        _, now = scrape_when(stack.url, lambda samples: value(samples, "audiosite_audio_seconds_total",
                                                              model="whisper", task="asr") > 0)
        assert value(now, "audiosite_audio_seconds_total", model="whisper", task="asr") == pytest.approx(asr_s,
                                                                                                         abs=1e-3)

        with stack.client() as c:
            resp = c.post("/v1/tasks/run", json={"model": "tts", "request": {"text": "Metrics count seconds."}})
            assert resp.status_code == 200, resp.text
            task_s = resp.json()["duration"]
        raw = client.audio.speech.with_raw_response.create(model="tts", voice="joe", input="And this too.",
                                                           response_format="pcm")
        speech_s = len(raw.content) / 2 / int(raw.headers["x-sample-rate"])
        # a stream's seconds are counted once its last frame is sent, which may be after its request
        _, now = scrape_when(stack.url, lambda samples: value(samples, "audiosite_requests_total", model="tts",
                                                              outcome="ok") == 2 and value(
            samples, "audiosite_audio_seconds_total", model="tts", task="tts") >= task_s + speech_s - 2e-3)
        assert task_s > 0.5 and speech_s > 0.5
        # the PCM response is resampled from the voice's 22.05 kHz: its length agrees to a few samples
        assert value(now, "audiosite_audio_seconds_total", model="tts", task="tts") == pytest.approx(
            task_s + speech_s, abs=2e-3)
        promtool_check(scrape(stack.url)[0])

        _, before, _ = scrape(stack.url)
        spoken = np.concatenate([np.zeros(8000, np.float32), utt.samples, np.zeros(24000, np.float32)])
        pcm = (np.clip(spoken, -1, 1) * 32767).astype("<i2").tobytes()
        step = 16000 * 20 // 1000 * 2  # 20 ms of 16 kHz s16le
        turns: list[float] = []
        with client.realtime.connect(extra_query={"intent": "transcription"}) as conn:
            assert conn.recv().type == "session.created"
            conn.session.update(session={"type": "transcription", "audio": {"input": {  # OpenAI's server VAD
                "format": {"type": "audio/pcm", "rate": 16000},
                "transcription": {"model": "whisper", "language": "en"}}}})
            assert conn.recv().type == "session.updated"
            started = time.monotonic()
            for index in range(0, len(pcm), step):  # real-time pace: the open turn gets partial decodes
                conn.input_audio_buffer.append(audio=base64.b64encode(pcm[index:index + step]).decode())
                time.sleep(max(0.0, started + (index // step + 1) * 0.02 - time.monotonic()))
            opened = 0
            for event in conn:
                opened += event.type == "input_audio_buffer.speech_started"
                assert event.type != "conversation.item.input_audio_transcription.failed", event
                if event.type == COMPLETED:
                    turns.append(event.usage.seconds)
                    if len(turns) == opened:
                        break
        assert turns and len(utt.samples) / utt.rate <= sum(turns) <= len(spoken) / 16000, turns

        def moved(samples, name: str, **labels: str) -> float:
            return value(samples, name, **labels) - value(before, name, **labels)

        text, after = scrape_when(stack.url, lambda samples: moved(samples, "audiosite_requests_total",
                                                                   model="whisper", outcome="ok") >= len(turns))
        promtool_check(text)
        assert moved(after, "audiosite_requests_total", model="whisper", outcome="ok") == len(turns)  # usually 1
        assert moved(after, "audiosite_realtime_partial_decodes_total", model="whisper") >= 1
        assert moved(after, "audiosite_audio_seconds_total", model="whisper", task="asr") == pytest.approx(
            sum(turns), abs=1e-3 * len(turns))
        for outcome in ("client_error", "rejected", "error"):
            assert moved(after, "audiosite_requests_total", model="whisper", outcome=outcome) == 0
    finally:
        next(stacks, None)


# -- metrics summed over two web processes (and the worker) -------------------------------------
def test_metrics_are_the_deployments_sums_on_every_web_process(tmp_path):
    """Two web processes and one worker started one by one (docs/operations.md, "Scale-out"):
    requests through web A and through web B are counted once each, and both web processes
    expose the same totals (the worker's inference and load observations included). Then the
    drain of a separately run web process: SIGTERM to web A while it holds a run → its ``/health``
    is 503 ``draining`` while web B stays 200, a new call to A gets 503 ``shutting_down``, the held
    run is answered 200 once released, and A exits 0."""
    models = [{"id": "s", "family": "fixture", "slots": 2, "lazy": True}]
    clusters = run_cluster(tmp_path, models, redis_db=8, name="msum", webs=2, workers=1, extra_env=FIXTURE_ENV)
    cluster = next(clusters)
    try:
        a, b = cluster.webs
        _, before, _ = scrape(a.url)

        async def traffic():
            async with mclient(a, None) as ca, mclient(b, None) as cb:
                for client, n in ((ca, 3), (cb, 2)):
                    for _ in range(n):
                        resp, _, _ = await post(client, "s")
                        assert resp.status_code == 200, resp.text

        run(traffic())
        series = (("audiosite_requests_total", {"model": "s", "outcome": "ok"}),
                  ("audiosite_inference_seconds_count", {"model": "s"}),
                  ("audiosite_queue_wait_seconds_count", {"model": "s"}))
        _, after_a = scrape_when(a.url, lambda now: all(
            value(now, name, **labels) - value(before, name, **labels) >= 5 for name, labels in series))
        _, after_b, _ = scrape(b.url)
        for name, labels in series:
            assert value(after_a, name, **labels) - value(before, name, **labels) == 5, name
            assert value(after_a, name, **labels) == value(after_b, name, **labels), name
        assert value(after_a, "audiosite_model_loads_total", model="s", outcome="ok") == 1
        assert value(after_b, "audiosite_model_load_seconds_count", model="s") == 1

        async def drain_web_a():
            async with mclient(a, None) as ca, mclient(b, None) as cb:
                held = asyncio.create_task(post(ca, "s", barrier="sum-hold"))
                await until(lambda: cluster.arrived("sum-hold") == 1)
                a.proc.send_signal(signal.SIGTERM)
                await until(lambda: httpx.get(a.url + "/health", timeout=5).status_code == 503)
                health = (await ca.get("/health")).json()
                assert health["status"] == "draining"
                assert (await cb.get("/health")).json()["status"] == "ok"
                refused, started, answered = await post(ca, "s")
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
                assert answered - started < 2 and int(refused.headers["retry-after"]) >= 1
                served, _, _ = await post(cb, "s")
                assert served.status_code == 200, served.text
                assert a.alive()  # still draining: the held run is admitted work
                cluster.release("sum-hold")
                resp, _, _ = await within(held)
                assert resp.status_code == 200, resp.text

        run(drain_web_a())
        assert a.proc.wait(timeout=QUICK_S) == 0
        assert "Killed 0 pending application instances" in a.log_path.read_text()  # daphne cancelled nothing
    finally:
        next(clusters, None)


# -- the drain of serve --------------------------------------------------------------------------
DRAIN_MODELS = [{"id": "d", "family": "fixture", "slots": 1}]


def _serve_again(stack, tmp_path: Path) -> tuple[subprocess.Popen, Path]:
    """A second ``manage.py serve`` on the same configuration, Redis db and database (a restart)."""
    log_path = tmp_path / "serve-again.log"
    proc = start_serve(["--config", str(tmp_path / "server.json"), "--parallel-jobs"], env=stack.env,
                       log_path=log_path, timeout_s=120)
    return proc, log_path


def test_sigterm_drains_running_and_queued_work_inside_the_window_and_exits_0(tmp_path):
    """R8.4 on ``serve`` (SIGTERM, ``shutdown_timeout_ms`` 20 s): with 1 run held and 3 queued, a
    request sent after the signal gets 503 ``shutting_down`` (with ``Retry-After``) at once, a
    management call 503 too, ``/health`` says ``draining`` (503) and ``audiosite_draining`` is 1;
    a write to the admin 503 as well, while reads still answer;
    the running and queued requests all finish 200 once the run is let go; serve exits 0 with
    daphne having cancelled nothing, and the worker warm-shut down (its pool destroyed)."""
    stacks = run_stack(tmp_path, DRAIN_MODELS, redis_db=8, name="drain", parallel=True, extra_env=FIXTURE_ENV,
                       extra_config={"shutdown_timeout_ms": 20000})
    stack = next(stacks)
    try:
        stack.release("d-queued", 3)  # the queued runs pass their barrier at once (counted: arrived)

        async def scenario():
            async with mclient(stack, None, timeout=60) as c:
                held = asyncio.create_task(post(c, "d", barrier="d-hold"))
                await until(lambda: stack.arrived("d-hold") == 1)
                queued = []
                for i in range(3):
                    queued.append(asyncio.create_task(post(c, "d", barrier="d-queued", tag=str(i))))
                    await until(lambda: stack.counters("d")["queued"] == i + 1)
                signalled = time.monotonic()
                stack.proc.send_signal(signal.SIGTERM)
                await until(lambda: httpx.get(stack.url + "/health", timeout=5).status_code == 503)
                health = await c.get("/health")
                assert health.status_code == 503 and health.json()["status"] == "draining"
                refused, started, answered = await post(c, "d")
                assert refused.status_code == 503, refused.text
                assert refused.json()["error"]["type"] == "server_busy"
                assert refused.json()["error"]["code"] == "shutting_down"
                assert int(refused.headers["retry-after"]) >= 1 and answered - started < 2
                manage = await c.post("/v1/models/unload", json={"id": "d"})
                assert manage.status_code == 503 and manage.json()["error"]["code"] == "shutting_down"
                admin = await c.post("/admin/login/", data={"username": "x", "password": "y"})
                assert admin.status_code == 503 and admin.json()["error"]["code"] == "shutting_down"
                assert (await c.get("/v1/models/d")).status_code == 200  # reads still answer
                _, samples, _ = await asyncio.to_thread(scrape, stack.url)
                assert value(samples, "audiosite_draining") == 1
                assert value(samples, "audiosite_queued_requests", model="d") == 3
                assert not held.done() and not any(t.done() for t in queued)
                stack.release("d-hold")
                for task in [held, *queued]:
                    resp, _, _ = await within(task)
                    assert resp.status_code == 200, resp.text
                return signalled

        signalled = run(scenario())
        assert stack.proc.wait(timeout=60) == 0, stack.log_tail()
        assert time.monotonic() - signalled < 20 + 10
        log = stack.log_path.read_text()
        assert "Killed 0 pending application instances" in log, log[-3000:]  # daphne had nothing left to cancel
        assert stack.arrived("d-hold") == 1 and stack.arrived("d-queued") == 3
        assert stack.counters("d") == {"leases": 0, "queued": 0}
    finally:
        next(stacks, None)


def test_a_drain_answers_queued_runs_of_large_inputs_and_leaves_no_samples_in_redis(tmp_path):
    """R8.4 with inputs of 1 MiB or more (59 s of 16 kHz 16-bit audio: sent to Redis from a send
    thread, then the header): with a run held and three such requests queued, SIGTERM; one more such
    request gets 503 ``shutting_down``; once the run is let go the three are answered 200 with their
    whole audio, serve exits 0, and no samples, run queue element or lease is left in Redis."""
    stacks = run_stack(tmp_path, DRAIN_MODELS, redis_db=8, name="drainlarge", parallel=True, extra_env=FIXTURE_ENV,
                       extra_config={"shutdown_timeout_ms": 20000})
    stack = next(stacks)
    rng = np.random.default_rng(3)
    large = wav_bytes((rng.standard_normal(59 * 16000) * 0.1).astype(np.float32), 16000, subtype="PCM_16")
    try:
        stack.release("dl-queued", 3)

        async def scenario():
            async with mclient(stack, None, timeout=60) as c:
                held = asyncio.create_task(post(c, "d", barrier="dl-hold"))
                await until(lambda: stack.arrived("dl-hold") == 1)
                queued = []
                for i in range(3):
                    queued.append(asyncio.create_task(post(c, "d", large, barrier="dl-queued", tag=str(i))))
                    await until(lambda: stack.counters("d")["queued"] == i + 1)
                stack.proc.send_signal(signal.SIGTERM)
                await until(lambda: httpx.get(stack.url + "/health", timeout=5).status_code == 503)
                refused, _, _ = await post(c, "d", large)
                assert refused.status_code == 503 and refused.json()["error"]["code"] == "shutting_down"
                stack.release("dl-hold")
                assert (await within(held))[0].status_code == 200
                for task in queued:
                    resp, _, _ = await within(task)
                    assert resp.status_code == 200, resp.text
                    assert resp.json()["timing"]["audio_duration_ms"] == pytest.approx(59000)
        run(scenario())
        assert stack.proc.wait(timeout=60) == 0, stack.log_tail()
        assert list(stack.redis.scan_iter(KEYS.input("*"))) == []
        assert [k for k in stack.redis.scan_iter(KEYS.run_queue_prefix + "*") if stack.redis.llen(k)] == []
        assert stack.counters("d") == {"leases": 0, "queued": 0}
    finally:
        next(stacks, None)

def test_ctrl_c_with_a_window_too_short_answers_503_and_a_restart_runs_nothing_twice(tmp_path):
    """R8.4 on ``serve`` (Ctrl-C, ``shutdown_timeout_ms`` 1.5 s): the held run and the 3 queued
    requests cannot finish in time: each gets an explicit 503 ``shutting_down`` (no reset) shortly
    after the window, and the queued tickets are gone. Once the held run is let go the worker
    finishes it during its warm shutdown and serve exits 0. A restart on the same Redis and
    database runs none of the queued requests and not the held one again."""
    stacks = run_stack(tmp_path, DRAIN_MODELS, redis_db=8, name="drainshort", parallel=True,
                       extra_env=FIXTURE_ENV, extra_config={"shutdown_timeout_ms": 1500})
    stack = next(stacks)
    try:
        async def scenario():
            async with mclient(stack, None, timeout=60) as c:
                held = asyncio.create_task(post(c, "d", barrier="s-hold"))
                await until(lambda: stack.arrived("s-hold") == 1)
                queued = []
                for i in range(3):
                    queued.append(asyncio.create_task(post(c, "d", barrier=f"s-queued-{i}")))
                    await until(lambda: stack.counters("d")["queued"] == i + 1)
                signalled = time.monotonic()
                stack.proc.send_signal(signal.SIGINT)
                for task in [held, *queued]:
                    resp, _, answered = await within(task)
                    assert resp.status_code == 503, resp.text
                    assert resp.json()["error"]["code"] == "shutting_down", resp.text
                    assert 1.5 <= answered - signalled < 1.5 + 5
                assert stack.counters("d")["queued"] == 0
                stack.release("s-hold")

        run(scenario())
        assert stack.proc.wait(timeout=60) == 0, stack.log_tail()
        assert stack.arrived("s-hold") == 1
        assert [stack.arrived(f"s-queued-{i}") for i in range(3)] == [0, 0, 0]

        again, again_log = _serve_again(stack, tmp_path)
        try:
            with stack.client() as c:
                resp = c.post("/v1/tasks/run", json=body("d", tag="after-restart"))
                assert resp.status_code == 200, resp.text  # serving, and no run of the last life came back
                time.sleep(2)
                assert stack.arrived("s-hold") == 1
                assert [stack.arrived(f"s-queued-{i}") for i in range(3)] == [0, 0, 0]
                assert stack.counters("d") == {"leases": 0, "queued": 0}
        finally:
            again.send_signal(signal.SIGTERM)
            assert again.wait(timeout=60) == 0, again_log.read_text()[-3000:]
    finally:
        next(stacks, None)


def test_a_second_ctrl_c_stops_at_once(tmp_path):
    """A second Ctrl-C during a drain (``shutdown_timeout_ms`` 60 s, a run held open) stops serve at
    once: it exits within a few seconds instead of waiting for the window, and no child survives."""
    stacks = run_stack(tmp_path, DRAIN_MODELS, redis_db=8, name="drainforce", parallel=True,
                       extra_env=FIXTURE_ENV, extra_config={"shutdown_timeout_ms": 60000})
    stack = next(stacks)
    try:
        children = psutil.Process(stack.proc.pid).children(recursive=True)

        async def scenario():
            async with mclient(stack, None, timeout=60) as c:
                held = asyncio.create_task(post(c, "d", barrier="f-hold"))
                await until(lambda: stack.arrived("f-hold") == 1)
                stack.proc.send_signal(signal.SIGINT)
                await until(lambda: httpx.get(stack.url + "/health", timeout=5).status_code == 503)
                forced = time.monotonic()
                stack.proc.send_signal(signal.SIGINT)
                await asyncio.to_thread(stack.proc.wait, 30)
                stopped_s = time.monotonic() - forced
                held.cancel()
                return stopped_s

        stopped_s = run(scenario())
        assert stopped_s < 15, stack.log_tail()
        assert "again: stopping at once" in stack.log_path.read_text()
        _, alive = psutil.wait_procs(children, timeout=10)
        assert not alive, [p.cmdline() for p in alive]
    finally:
        stack.release("f-hold")
        next(stacks, None)


def test_a_speech_stream_cut_by_the_drain_deadline_ends_with_an_error_event(tmp_path):
    """R8.4 for streams: an SSE speech stream (``POST /v1/audio/speech``, read with ``httpx-sse``) still
    going when the window (1 s) ends gets a final ``error`` event with code ``shutting_down`` and then
    ends cleanly (no reset); its slot is given back and serve exits 0."""
    models = [{"id": "tts", "family": "piper", "task": "tts", "slots": 1}]
    stacks = run_stack(tmp_path, models, redis_db=8, name="drainsse", parallel=True,
                       extra_config={"shutdown_timeout_ms": 1000})
    stack = next(stacks)
    try:
        text = " ".join(f"This is sentence number {i} of a long text that takes a while to say." for i in range(50))
        events = []
        with httpx.Client(base_url=stack.url, timeout=60) as c:
            with httpx_sse.connect_sse(c, "POST", "/v1/audio/speech", json={
                    "model": "tts", "input": text, "voice": "joe", "stream_format": "sse"}) as source:
                assert source.response.status_code == 200, source.response.read()
                for event in source.iter_sse():
                    events.append(json.loads(event.data))
                    if len(events) == 1:
                        stack.proc.send_signal(signal.SIGTERM)
        kinds = [e["type"] for e in events]
        assert kinds[0] == "speech.audio.delta" and "speech.audio.done" not in kinds, kinds[-3:]
        assert kinds[-1] == "error" and events[-1]["error"]["code"] == "shutting_down", events[-1]
        assert kinds.count("error") == 1
        assert stack.proc.wait(timeout=60) == 0, stack.log_tail()
        assert stack.counters("tts") == {"leases": 0, "queued": 0}
    finally:
        next(stacks, None)


def test_a_transcription_stream_cut_by_the_drain_deadline_ends_with_an_error_event(tmp_path, speech):
    """R8.4 and R7.3 for a streamed transcription: a ``stream=true`` transcription (``POST
    /v1/audio/transcriptions``, read with ``httpx-sse``) of about 10 min of speech, still being decoded
    when the window (1 s) after SIGTERM ends, has had its ``transcript.text.delta`` events (the signal
    is sent once the first one is read; the slot is held meanwhile), gets no ``transcript.text.done``
    but exactly one final ``error`` event in the API's error shape (``server_busy``, code
    ``shutting_down``), not before the deadline, and then ends cleanly: its chunked body is complete
    (no reset) and daphne cancelled nothing. The slot is given back and serve exits 0."""
    rate = speech[0].rate
    gap = np.zeros(rate, dtype=np.float32)
    tile = np.concatenate([np.concatenate([u.samples, gap]) for u in speech])  # about 7.6 s
    # about 10 min, 20 of faster-whisper's 30 s windows: each takes ~1 s here, and the worker stops the
    # stream after its current window, so the length only bounds how fast a machine may be
    wav = wav_bytes(np.tile(tile, 80), rate)
    models = [{"id": "asr", "family": "whisper", "task": "asr", "slots": 1}]
    stacks = run_stack(tmp_path, models, redis_db=8, name="drainasr", parallel=True,
                       extra_config={"shutdown_timeout_ms": 1000, "max_request_body_bytes": len(wav) + 100_000})
    stack = next(stacks)
    try:
        events, arrived, held, signalled = [], [], None, None
        with httpx.Client(base_url=stack.url, timeout=MODEL_S) as c:
            with httpx_sse.connect_sse(c, "POST", "/v1/audio/transcriptions", files={"file": ("long.wav", wav)},
                                       data={"model": "asr", "stream": "true", "language": "en"}) as source:
                assert source.response.status_code == 200, source.response.read()
                assert source.response.headers["content-type"].startswith("text/event-stream")
                # a chunked body ends with its last chunk: h11 raises if the connection closes before it
                assert source.response.headers.get("transfer-encoding") == "chunked", source.response.headers
                for event in source.iter_sse():  # raises on a reset or an incomplete body
                    events.append(json.loads(event.data))
                    arrived.append(time.monotonic())
                    if signalled is None:
                        signalled = time.monotonic()
                        stack.proc.send_signal(signal.SIGTERM)
                        held = stack.counters("asr")
                    assert arrived[-1] - signalled < QUICK_S, "the stream went on long past the drain deadline"
            assert source.response.is_stream_consumed
        kinds = [e["type"] for e in events]
        assert held == {"leases": 1, "queued": 0}, "the slot is held while the stream is read"
        assert kinds[0] == "transcript.text.delta", kinds
        assert kinds[:-1] == ["transcript.text.delta"] * (len(kinds) - 1), kinds[-3:]  # cut before its done
        assert all(e["delta"].strip() for e in events[:-1]), events[:-1]
        error = events[-1]
        assert kinds[-1] == "error" and set(error) == {"type", "error"}, error
        assert set(error["error"]) == {"message", "type", "param", "code"}, error
        assert error["error"]["type"] == "server_busy" and error["error"]["code"] == "shutting_down", error
        assert "shutting down" in error["error"]["message"], error
        assert arrived[-1] - signalled >= 1.0, "cut before the drain deadline"
        assert stack.proc.wait(timeout=60) == 0, stack.log_tail()
        log = stack.log_path.read_text()
        assert "Killed 0 pending application instances" in log, log[-3000:]  # daphne had nothing left to cancel
        assert stack.counters("asr") == {"leases": 0, "queued": 0}
    finally:
        next(stacks, None)
