"""Services and their scheduler scripts on real Redis (db 15) and PostgreSQL, without a server stack.

What needs no worker is tested here directly: the one teardown path and
who records it, manager-only state transitions, unregistration, publication.
"""
from __future__ import annotations

import asyncio
import os
import threading

import numpy as np
import pytest
from asgiref.sync import sync_to_async
from django.db import connections

from audiosite.errors import InvalidRequest, UnsupportedMedia
from audiosite.serverconfig import parse_config
from inference import audio
from inference import services as inference_services
from inference.runtime import decoding
from inference.runtime.context import KEYS, async_context
from inference.runtime.teardown import TeardownOutcome
from inference.scheduler import (
    AdmissionOverdue,
    InvalidTransition,
    LeaseKind,
    LeaseNotHeld,
    LoadAction,
    LoadEnd,
    LoadOutcome,
    ModelState,
    ProbeVerdict,
    RunOffer,
    effective_timeout_ms,
)
from inference.worker import tasks as worker_tasks
from inference.worker import work
from inference.worker.state import WorkerState
from registry import records
from registry.models import LifecycleEvent, ModelRegistration

from .support.audio import pcm_wav, wav_bytes
from .support.bounds import until
from .support.rigs import live_worker
from .support.stacks import fx

pytestmark = [
    pytest.mark.django_db(transaction=True),
    pytest.mark.skipif(not os.environ.get("REDIS_URL", "").endswith("/15"),
                       reason="needs REDIS_URL on database 15 (scripts/test.sh sets it)"),
]


def _register(model_id: str) -> dict:
    records.registration_sync_config(parse_config({"models": [{"id": model_id, "family": "silero_vad"}]}))
    return ModelRegistration.objects.get(model_id=model_id).as_meta()


def _run(coro_fn):
    async def scenario():
        ctx = await async_context()
        try:
            return await asyncio.wait_for(coro_fn(ctx), 20)
        finally:
            await ctx.listener.close()
            # The services wrote through sync_to_async: close that thread's connection too.
            await sync_to_async(connections.close_all)()
    return asyncio.run(scenario())


def test_teardown_of_a_pool_whose_worker_died_is_recorded_once_by_the_manager(redis_client):
    """One teardown path, one writer: state unloading → unloaded and exactly one audit row, written here."""
    meta = _register("td")

    async def scenario(ctx):
        await ctx.scheduler.publish_entry(meta, 1)
        # A pool that a worker published, and the worker is gone (no liveness key).
        await ctx.redis.hset(KEYS.load("td"), mapping={"state": "ready", "owner": "w@dead", "boot": "b1"})
        lease = await ctx.scheduler.acquire(ctx.listener, "td", 1000, LeaseKind.MANAGER)
        try:
            result = await inference_services.model_teardown(ctx, lease, "tester")
        finally:
            await ctx.scheduler.release("td", lease.lease_id)
        return result, await ctx.redis.hgetall(KEYS.load("td"))

    result, load = _run(scenario)
    assert result.outcome is TeardownOutcome.WORKER_LOST
    assert load["state"] == "unloaded" and "owner" not in load and "boot" not in load
    row = ModelRegistration.objects.get(model_id="td")
    assert row.state == "unloaded" and row.last_error == ""
    events = list(LifecycleEvent.objects.filter(model_id="td").exclude(event="register")
                  .values_list("event", "outcome", "actor"))
    assert events == [("teardown", "ok", "tester")]


def test_teardown_of_an_unloaded_model_changes_state_but_audits_nothing(redis_client):
    meta = _register("cold")

    async def scenario(ctx):
        await ctx.scheduler.publish_entry(meta, 1)
        lease = await ctx.scheduler.acquire(ctx.listener, "cold", 1000, LeaseKind.MANAGER)
        try:
            return await inference_services.model_teardown(ctx, lease, "tester", state=ModelState.RECONFIGURING)
        finally:
            await ctx.scheduler.release("cold", lease.lease_id)

    assert _run(scenario).outcome is TeardownOutcome.NOT_LOADED
    assert ModelRegistration.objects.get(model_id="cold").state == "unloaded"
    assert not LifecycleEvent.objects.filter(model_id="cold", event="teardown").exists()


def test_state_changes_need_the_held_manager_lease_and_an_allowed_transition(redis_client):
    """set_state.lua: only the manager writes state, and only along the documented transitions."""
    meta = _register("st")

    async def scenario(ctx):
        await ctx.scheduler.publish_entry(meta, 1)
        request = await ctx.scheduler.acquire(ctx.listener, "st", 1000)
        with pytest.raises(LeaseNotHeld):  # a request lease is not a manager lease
            await ctx.scheduler.set_state("st", ModelState.UNLOADING, request.lease_id)
        await ctx.scheduler.release("st", request.lease_id)
        lease = await ctx.scheduler.acquire(ctx.listener, "st", 1000, LeaseKind.MANAGER)
        await ctx.redis.hset(KEYS.load("st"), mapping={"state": "ready", "owner": "w", "boot": "b"})
        with pytest.raises(InvalidTransition):  # a pool is not "unloaded" before its teardown began
            await ctx.scheduler.set_state("st", ModelState.UNLOADED, lease.lease_id)
        await ctx.scheduler.set_state("st", ModelState.UNLOADING, lease.lease_id)
        await ctx.scheduler.set_state("st", ModelState.UNLOADED, lease.lease_id)
        await ctx.scheduler.release("st", lease.lease_id)
        with pytest.raises(LeaseNotHeld):  # released: no more writes with it
            await ctx.scheduler.set_state("st", ModelState.UNLOADING, lease.lease_id)
        return (await ctx.scheduler.snapshot(["st"]))["st"]["state"]

    assert _run(scenario) == ModelState.UNLOADED


def test_a_teardown_whose_manager_died_is_taken_over_by_the_next_manager(redis_client):
    """A web process killed between the two steps of a teardown leaves the state 'unloading' (its lease
    expires, R2.5): the next manager's teardown begins again from there and ends it; nothing is stuck."""
    meta = _register("stuck")

    async def scenario(ctx):
        await ctx.scheduler.publish_entry(meta, 1)
        dead = await ctx.scheduler.acquire(ctx.listener, "stuck", 1000, LeaseKind.MANAGER)
        await ctx.scheduler.set_state("stuck", ModelState.UNLOADING, dead.lease_id)
        await ctx.scheduler.release("stuck", dead.lease_id)  # as the TTL would reclaim it
        lease = await ctx.scheduler.acquire(ctx.listener, "stuck", 1000, LeaseKind.MANAGER)
        try:
            result = await inference_services.model_teardown(ctx, lease, "next manager",
                                                             state=ModelState.RECONFIGURING)
        finally:
            await ctx.scheduler.release("stuck", lease.lease_id)
        return result, (await ctx.scheduler.snapshot(["stuck"]))["stuck"]["state"]

    result, state = _run(scenario)
    assert result.outcome is TeardownOutcome.NOT_LOADED and state == ModelState.UNLOADED
    assert ModelRegistration.objects.get(model_id="stuck").state == "unloaded"


def test_a_stream_granted_after_its_registration_stopped_serving_streams_is_refused_and_gives_its_lease_back(
        redis_client):
    """R9.2 at the grant: a stream waits for the one stream slot of a Whisper registration; meanwhile the
    registration is published again without ``streaming`` in its ``modes``. Once granted, the stream is
    refused (400, ``param`` ``model``) and its lease is back at once; nothing is held afterwards."""
    records.registration_sync_config(parse_config({"models": [{"id": "wstream", "family": "whisper",
                                                                "lazy": True}]}))
    meta = ModelRegistration.objects.get(model_id="wstream").as_meta()

    async def scenario(ctx):
        await ctx.scheduler.publish_entry(meta, 1)
        holder = await inference_services.stream_lease_acquire(ctx, meta, 0)
        waiter = asyncio.create_task(inference_services.stream_lease_acquire(ctx, meta, 0))
        for _ in range(500):
            if (await ctx.scheduler.snapshot(["wstream"]))["wstream"]["queued"] == 1:
                break
            await asyncio.sleep(0.01)
        else:
            raise AssertionError("the second stream did not queue")
        await ctx.scheduler.publish_entry(dict(meta, modes=["offline"]), 1)
        await ctx.scheduler.release("wstream", holder.lease_id)
        outcome = (await asyncio.gather(waiter, return_exceptions=True))[0]
        after = (await ctx.scheduler.snapshot(["wstream"]))["wstream"]
        return outcome, after

    outcome, after = _run(scenario)
    assert isinstance(outcome, InvalidRequest) and outcome.param == "model", outcome
    assert "does not serve streams" in str(outcome)
    assert (after["active_leases"], after["queued"]) == (0, 0)


def test_unregister_removes_the_entry_only_for_the_manager(redis_client):
    meta = _register("gone")

    async def scenario(ctx):
        await ctx.scheduler.publish_entry(meta, 2)
        lease = await ctx.scheduler.acquire(ctx.listener, "gone", 1000, LeaseKind.MANAGER)
        with pytest.raises(LeaseNotHeld):
            await ctx.scheduler.unregister("gone", "not-a-lease")
        assert await ctx.redis.hexists(KEYS.models_meta, "gone")
        await ctx.scheduler.unregister("gone", lease.lease_id)
        await ctx.scheduler.release("gone", lease.lease_id)
        return (await ctx.redis.hexists(KEYS.models_meta, "gone"),
                await ctx.redis.exists(KEYS.load("gone"), KEYS.capacity("gone")))

    assert _run(scenario) == (False, 0)


def test_the_admission_probe_reads_the_entry_and_refuses_exactly_when_enqueue_would(redis_client):
    """One round trip for a refusal: admission_probe.lua returns the entry and the verdict
    enqueue.lua would give at that instant (R3.3), with the effective timeout of R3.1."""
    meta = dict(_register("probe"), busy_timeout_ms=None)
    ceilings = {"probe-own": 100, "probe-zero": 0}

    async def scenario(ctx):
        await ctx.scheduler.publish_entry(meta, 1)
        for model_id, own in ceilings.items():
            await ctx.scheduler.publish_entry(dict(meta, id=model_id, busy_timeout_ms=own), 1)
        missing = await ctx.scheduler.admission_probe("nobody", None, 300)
        free_before: dict = {}
        # R3.1, the same table as effective_timeout_ms: the request's value against the model's ceiling.
        timeouts = {}
        for model_id, ceiling in (("probe", 300), ("probe-own", 100), ("probe-zero", 0)):
            for request in (None, 0, 50, 200):
                probe = await ctx.scheduler.admission_probe(model_id, request, 300)
                timeouts[(model_id, request)] = (probe.timeout_ms, effective_timeout_ms(request, ceiling),
                                                 probe.verdict)
                free_before[(model_id, request)] = probe.free
        holder = await ctx.scheduler.acquire(ctx.listener, "probe", 0)
        young = await ctx.scheduler.admission_probe("probe", 5000, 300)
        await asyncio.sleep(0.12)
        old = await ctx.scheduler.admission_probe("probe", 100, 300)
        with pytest.raises(AdmissionOverdue):  # enqueue.lua agrees at once
            await ctx.scheduler.acquire(ctx.listener, "probe", 100)
        unbounded = await ctx.scheduler.admission_probe("probe", 0, 0)
        await ctx.scheduler.release("probe", holder.lease_id)
        return missing, timeouts, young, old, unbounded, free_before

    missing, timeouts, young, old, unbounded, free_before = _run(scenario)
    assert missing.verdict == "not_found" and missing.entry is None and not missing.free
    assert all(probe_free for probe_free in free_before.values()), free_before  # nobody holds or waits
    assert not young.free and not old.free and not unbounded.free  # the one slot is held
    assert all(got == want and verdict == ProbeVerdict.ADMIT for got, want, verdict in timeouts.values()), timeouts
    assert young.verdict == "admit" and young.entry["id"] == "probe"  # the holder is younger than 5 s
    assert old.verdict == "overdue" and old.timeout_ms == 100 and old.age_ms > 100
    assert unbounded.verdict == "admit"  # 0 = unbounded: no fail-fast (R3.5)


def test_audio_decoded_before_queueing_gives_its_budget_back_when_the_request_queues_and_leaves(redis_client):
    """The probe saw a free slot, so the request decoded its (small) audio with the header in one pool hop
    before it queued; another request took the slot first, and the client left while
    queued: the ticket goes (R8.1) and so does the decode budget's reservation, and a 415 found in that hop
    holds nothing."""
    meta = _register("eager")
    wav = wav_bytes(np.zeros(16000, dtype=np.float32), 16000, "WAV", "PCM_16")

    async def scenario(ctx):
        await ctx.scheduler.publish_entry(meta, 1)
        probe = await inference_services.request_probe(ctx, "eager", None)
        holder = await ctx.scheduler.acquire(ctx.listener, "eager", 0)  # someone else gets there first
        budget = decoding.budget()
        request = asyncio.ensure_future(inference_services.request_run(
            ctx, probe.entry, inference_services.AudioInput(wav, "file"), {}, 0, probe=probe))
        queued = None
        for _ in range(200):
            await asyncio.sleep(0.01)
            queued = (await ctx.scheduler.snapshot(["eager"]))["eager"]
            if queued["queued"] == 1:
                break
        held_while_queued = budget.in_flight_bytes
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        after = (await ctx.scheduler.snapshot(["eager"]))["eager"]
        with pytest.raises(UnsupportedMedia):
            await inference_services.request_run(
                ctx, probe.entry, inference_services.AudioInput(b"RIFF" + b"x" * 64, "file"), {}, 0, probe=probe)
        refused = (await ctx.scheduler.snapshot(["eager"]))["eager"]
        await ctx.scheduler.release("eager", holder.lease_id)
        return probe, queued, held_while_queued, after, refused, budget.in_flight_bytes

    probe, queued, held_while_queued, after, refused, in_flight = _run(scenario)
    assert probe.free and queued is not None and queued["queued"] == 1
    assert held_while_queued > 0  # decoded before it queued: its reservation waits with it
    assert after["queued"] == 0 and after["active_leases"] == 1  # only the other holder
    assert refused["queued"] == 0 and refused["active_leases"] == 1
    assert in_flight == 0


def test_a_load_ended_as_lost_is_recorded_once_though_its_frozen_worker_finishes_it_later(redis_client,
                                                                                          monkeypatch):
    """One writer per step: a worker frozen in a load past its claim is counted lost (R7.4)
    by a web process, which records the failed ``load`` and the state ``unloaded``. When the worker wakes
    and finishes, ``finish_load`` says its claim is stale: it discards the pool and writes nothing (a second
    failed ``load`` row and state write could say ``unloaded`` over a newer load that was ready).
    The worker is ``inference.worker.work.load_pool`` itself, run in a
    thread and held in the fixture family's load barrier while the claim is ended."""
    monkeypatch.setenv("AUDIOSITE_ENABLE_FIXTURE_FAMILY", "1")
    records.registration_sync_config(parse_config(
        {"models": [fx("stalled", load_barrier="stalled-load")]}))
    meta = ModelRegistration.objects.get(model_id="stalled").as_meta()
    host = "gpu0@frozen"
    worker = WorkerState()
    worker.hostname = host
    live_worker(redis_client, host)
    lost = f"worker {host} was lost while loading the model"
    outcome: list = []

    def frozen_worker(token: str) -> None:
        try:
            outcome.append(work.load_pool(worker, "stalled", token))
        finally:
            connections.close_all()

    async def scenario(ctx):
        await ctx.scheduler.publish_entry(meta, 1)
        token = "frozen-load"
        decision = await ctx.scheduler.begin_load(ctx.listener, "stalled", token, False)
        assert decision.action is LoadAction.LOAD
        thread = threading.Thread(target=frozen_worker, args=(token,))
        thread.start()
        await until(lambda: redis_client.get(KEYS.fixture_arrived("stalled-load")) == "1", 10)
        # What the web process does when the claim lapses (load_single_flight, services.loading._record_lost_load).
        assert await ctx.scheduler.finish_load("stalled", token, LoadEnd.WORKER_LOST, error=lost) is LoadOutcome.OK
        await sync_to_async(records.registration_record_load)("stalled", False, error=lost, actor=host)
        redis_client.lpush(KEYS.fixture_release("stalled-load"), "go")
        await asyncio.to_thread(thread.join, 10)
        return (await ctx.scheduler.snapshot(["stalled"]))["stalled"]

    status = _run(scenario)
    assert outcome and outcome[0]["ok"] is False and "abandoned or superseded" in outcome[0]["error"]
    assert worker.get("stalled") is None and status["state"] == "unloaded"
    rows = list(LifecycleEvent.objects.filter(model_id="stalled", event="load")
                .values_list("outcome", "detail", "actor"))
    assert rows == [("failed", lost, host)]
    registration = ModelRegistration.objects.get(model_id="stalled")
    assert (registration.state, registration.last_error) == ("unloaded", lost)


@pytest.mark.parametrize("layout", ["wav read as-is", "wav with a LIST chunk", "flac"])
def test_a_wav_read_as_is_waits_in_the_queue_holding_only_its_send_copies(redis_client, layout):
    """A request that decoded before it queued keeps its reservation while it waits (previous test). A
    WAV read as-is decoded nothing (its samples are a view of the upload): it holds only the two copies
    its 16-bit samples take while sent (4 bytes a frame), not a float32 decode's peak, so a burst of such
    uploads to a busy model does not fill the budget that granted requests need (8 s clips reserving a
    float32 decode's 2.9 MB each would fill a 3.9 MB budget). The same samples in any other
    layout reserve their decode's peak. Every reservation goes back when the client leaves (a decode
    already running in its thread: when that thread is done)."""
    meta = _register("asis")
    pcm = (np.arange(8 * 16000) * 37 % 65536 - 32768).astype(np.int16).tobytes()
    data = {"wav read as-is": pcm_wav(pcm),
            "wav with a LIST chunk": pcm_wav(pcm, between=[(b"LIST", b"INFO")]),
            "flac": wav_bytes(np.frombuffer(pcm, np.int16) / 32768, 16000, "FLAC", "PCM_16")}[layout]

    async def scenario(ctx):
        await ctx.scheduler.publish_entry(meta, 1)
        probe = await inference_services.request_probe(ctx, "asis", None)
        holder = await ctx.scheduler.acquire(ctx.listener, "asis", 0)
        budget = decoding.budget()
        before = budget.in_flight_bytes
        request = asyncio.ensure_future(inference_services.request_run(
            ctx, probe.entry, inference_services.AudioInput(data, "file"), {}, 0, probe=probe))
        await until(lambda: budget.in_flight_bytes > before, 10)
        held = budget.in_flight_bytes - before
        request.cancel()
        with pytest.raises(asyncio.CancelledError):
            await request
        await ctx.scheduler.release("asis", holder.lease_id)
        # a decode still running in its pool thread keeps its reservation until that thread is done
        await until(lambda: budget.in_flight_bytes == before, 10)
        return probe, held, budget.in_flight_bytes - before

    probe, held, left = _run(scenario)
    assert probe.free and left == 0
    assert audio.plain_pcm16_wav(data, 16000, decoding.QUICK_DECODE_MAX_SAMPLES) == (layout == "wav read as-is")
    if layout == "wav read as-is":
        assert held == 4 * 8 * 16000  # int16 samples, copied twice while sent (runs.send_copies_bytes)
    else:
        header = audio.read_header(data, 3600)
        assert held == inference_services.decoded_bytes_needed(header, 16000) > 5 * 4 * 8 * 16000


def test_a_run_offered_with_its_enqueue_goes_to_the_ready_worker_only_when_granted_at_once(redis_client):
    """enqueue.lua hands an offered run to the worker in the grant's own step exactly when
    the request is granted at once, the model is ready on a live worker, and its registration is the one the
    run was prepared for; otherwise nothing is pushed and the caller stages the run itself. A caller that
    leaves while such an enqueue is in flight does not release the lease: the worker owns it."""
    meta = _register("offer")
    element = b'{"lease": "?"}\n\x00\x01'

    async def scenario(ctx):
        await ctx.scheduler.publish_entry(meta, 2)
        probe = await ctx.scheduler.admission_probe("offer", None, 300)
        queue = KEYS.run_queue("w@offer", "boot-1")

        def offer(expected=probe.entry_json):
            return RunOffer(expected, lambda lease_id: element.replace(b"?", lease_id.encode()), 60000)

        not_ready = await ctx.scheduler.acquire(ctx.listener, "offer", 0, offer=offer())
        await ctx.redis.set(KEYS.worker_live("w@offer"), "boot-1", px=30000)
        await ctx.redis.hset(KEYS.load("offer"), mapping={"state": "ready", "owner": "w@offer", "boot": "boot-1"})
        stale = await ctx.scheduler.acquire(ctx.listener, "offer", 0, offer=offer(probe.entry_json + " "))
        await ctx.scheduler.release("offer", stale.lease_id)
        sent = await ctx.scheduler.acquire(ctx.listener, "offer", 0, offer=offer())
        pushed = await ctx.redis_bytes.lrange(queue, 0, -1)
        ttl = await ctx.redis.pttl(queue)
        # Both slots are held now: a third request queues, and its offer is not pushed when it is granted later.
        queued = asyncio.ensure_future(ctx.scheduler.acquire(ctx.listener, "offer", 0, offer=offer()))
        await asyncio.sleep(0.2)
        await ctx.scheduler.release("offer", not_ready.lease_id)
        later = await asyncio.wait_for(queued, 5)
        after_queueing = await ctx.redis.llen(queue)
        for lease in (sent, later):
            await ctx.scheduler.release("offer", lease.lease_id)
        # The caller leaves while a dispatching enqueue is in flight: the lease stays, held for the worker.
        leaving = asyncio.ensure_future(ctx.scheduler.acquire(ctx.listener, "offer", 0, offer=offer()))
        await asyncio.sleep(0)
        leaving.cancel()
        with pytest.raises(asyncio.CancelledError):
            await leaving
        await asyncio.sleep(0.2)
        held = (await ctx.scheduler.snapshot(["offer"]))["offer"]["active_leases"]
        return not_ready, stale, sent, pushed, ttl, later, after_queueing, held

    not_ready, stale, sent, pushed, ttl, later, after_queueing, held = _run(scenario)
    assert not not_ready.dispatched and not_ready.ready_on is None  # not loaded: nothing pushed
    assert not stale.dispatched and stale.ready_on == ("w@offer", "boot-1")  # another registration
    assert sent.dispatched and pushed == [element.replace(b"?", sent.lease_id.encode())]
    assert 0 < ttl <= 60000
    assert not later.dispatched and after_queueing == 1  # granted after queueing: the caller stages it
    assert held == 1


def test_a_starting_worker_settles_what_dead_workers_left_in_redis_and_the_database(redis_client):
    """R7.4 without serve: a worker, as it starts, settles the pools whose worker's liveness key is gone
    and the loads whose worker is gone, once: Redis and the database say ``unloaded`` (an ``unload`` row
    naming the dead worker in ``last_error``; a failed ``load`` row whose actor is the dead worker); a
    pool on a live worker is untouched; a second look changes nothing."""
    ids = ("on-dead", "on-live", "loading-dead")
    records.registration_sync_config(parse_config({"models": [{"id": i, "family": "silero_vad"} for i in ids]}))
    metas = {model_id: ModelRegistration.objects.get(model_id=model_id).as_meta() for model_id in ids}
    live_boot = live_worker(redis_client, "w@live")
    for model_id in ("on-dead", "on-live"):
        records.registration_record_state(model_id, "ready")
    records.registration_record_state("loading-dead", "loading")

    async def publish(ctx):
        for meta in metas.values():
            await ctx.scheduler.publish_entry(meta, 1)
    _run(publish)
    redis_client.hset(KEYS.load("on-dead"), mapping={"state": "ready", "owner": "w@dead", "boot": "b1"})
    redis_client.hset(KEYS.load("on-live"), mapping={"state": "ready", "owner": "w@live", "boot": live_boot})
    redis_client.hset(KEYS.load("loading-dead"), mapping={"state": "loading", "loader": "tok", "loader_host": "w@dead",
                                                          "loader_boot": "b1", "loader_expires_ms": 2 ** 50})
    worker_tasks._settle_lost_pools()
    worker_tasks._settle_lost_pools()  # nothing left to settle: no second row
    assert redis_client.hget(KEYS.load("on-dead"), "state") == "unloaded"
    assert redis_client.hget(KEYS.load("on-live"), "state") == "ready"
    assert redis_client.hmget(KEYS.load("loading-dead"), "state", "ended") == ["unloaded", "worker_lost"]
    states = dict(ModelRegistration.objects.values_list("model_id", "state"))
    assert (states["on-dead"], states["on-live"], states["loading-dead"]) == ("unloaded", "ready", "unloaded")
    assert "w@dead stopped beating" in ModelRegistration.objects.get(model_id="on-dead").last_error

    def rows(model_id):
        return list(LifecycleEvent.objects.filter(model_id=model_id).exclude(event="register")
                    .values_list("event", "outcome"))
    assert rows("on-dead") == [("unload", "ok")] and rows("on-live") == []
    assert list(LifecycleEvent.objects.filter(model_id="loading-dead", event="load")
                .values_list("outcome", "actor")) == [("failed", "w@dead")]
