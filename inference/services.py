"""Decisions about inference: run a request, make sure a model is loaded, make room, evict, retire, tear down.

Views and Celery tasks call these; they use the mechanism of
``inference.runtime`` and record lifecycle steps through ``registry.services``
(the only writer of the database). Flow of one request (web process, async,
no thread held while waiting):

0. read the upload's container header (no frame decoded): a bad header,
   too long, or a decode larger than the whole decode budget is refused
   (400/413/415) before any ticket exists;
1. acquire a request lease under the effective busy timeout (R3.1–R3.3);
   a refusal (fail-fast, timeout) costs no decoding;
2. reserve the decode's peak bytes in this process's decode budget (503
   ``decode_budget`` past it, the lease given back), then decode in a pool of
   its own (``inference.runtime.decoding``); audio that cannot be decoded is
   refused (400/415) and the lease given back;
3. make sure the model is loaded (single flight across processes, R4.2;
   with a residency limit, cold loads pass the cold-load guard and evict, R6);
4. store the input in Redis (TTL) and push the run's header on the owning
   worker's run queue (one round trip; ``inference.runtime.rpc.run_on_worker``);
   the web process then drops the samples and gives back the reservation;
5. await the ``done:<id>`` wake-up; the worker releases the lease.

Decoding after the grant means a queued request holds only its upload, not
the decoded samples (a small compressed file can decode to far more); the
budget bounds what the granted ones hold at once.

The web process renews the lease until the worker reports back, and releases
it itself on every path where the worker never took over (refusal, load
failure, lost worker). If the client disconnects after dispatch, the running
step finishes on the worker, which releases the lease (R8.2).
"""
from __future__ import annotations

import asyncio
import functools
import json
import logging
import time
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
from asgiref.sync import sync_to_async

from audiosite.errors import (
    ApplicationError,
    Conflict,
    InsufficientMemory,
    InvalidRequest,
    NotFound,
    PayloadTooLarge,
    ServerBusy,
    UnsupportedMedia,
)
from audiosite.serverconfig import get_config
from inference import audio, diarization, specs
from inference.runtime import decoding, leases, metrics, published, rpc
from inference.runtime.context import KEYS, AsyncContext
from inference.runtime.teardown import TeardownResult, teardown_held
from inference.scheduler import (
    AdmissionOverdue,
    AdmissionProbe,
    Lease,
    ModelState,
    ProbeVerdict,
    effective_timeout_ms,
)
from registry import records

log = logging.getLogger(__name__)

COUNTED_STATES = (ModelState.READY, ModelState.LOADING)  # R6.2: a model being torn down no longer counts


@dataclass(frozen=True)
class Outcome:
    """A served request: the adapter's ``result`` plus where and how long.

    Times in ms: ``queue_ms`` waiting for the lease, ``load_ms`` spent loading
    (0 when warm), ``inference_ms`` inside the session, ``audio_ms`` the
    decoded input's duration.
    """

    result: dict
    queue_ms: float
    load_ms: float
    inference_ms: float
    slot: int
    worker: str
    audio_ms: float


@dataclass(frozen=True)
class AudioInput:
    """An audio file as uploaded (``data``: its bytes, any container ``inference.audio`` reads) and
    ``param``, the request field it came from (named by decoding errors)."""

    data: bytes
    param: str


def _audio_refusal(exc: audio.AudioError, param: str) -> InvalidRequest:
    """The client error for audio that cannot be served: 415 undecodable, 413 too long, else 400."""
    if isinstance(exc, audio.UndecodableAudio):
        return UnsupportedMedia(str(exc), param=param)
    if isinstance(exc, audio.AudioTooLong):
        return PayloadTooLarge(str(exc), param=param)
    return InvalidRequest(str(exc), param=param)


def _mib(nbytes: int) -> str:
    return f"{nbytes / 2**20:.1f} MiB"


def decoded_bytes_needed(header: audio.AudioHeader, target_rate_hz: int) -> int:
    """Bytes a request with this audio header reserves in the decode budget: the decode's peak
    (:func:`inference.audio.decode_peak_bytes`) plus the copies made sending its samples to Redis
    (:func:`inference.runtime.rpc.send_copies_bytes`; none for large inputs).

    A WAV read as-is (``header.as_is``, ``inference.runtime.decoding``'s module doc) decodes nothing: its
    samples are a view of the upload, which no request counts (it is bounded by
    ``max_request_body_bytes``), so it reserves only the send copies of its 16-bit samples
    (8 s at 16 kHz: 0.5 MB instead of 2.9 MB).
    """
    if header.as_is:
        return rpc.send_copies_bytes(header.frames * audio.INT16_BYTES)
    output_bytes = audio.output_frames_bound(header.frames, header.sample_rate_hz, target_rate_hz) * audio.FLOAT32_BYTES
    return audio.decode_peak_bytes(header, target_rate_hz) + rpc.send_copies_bytes(output_bytes)


async def inspect_audio(audio_input: AudioInput, family: str) -> audio.AudioHeader:
    """Check an upload's container header before the request queues; decode nothing (the header is read
    in the quick pool, or on the event loop for a WAV that needs no decoding: ``decoding.read_header``).

    A request whose audio could never be served is refused here, holding no
    ticket: bad header, too long, or a decode larger than the whole decode
    budget (it could never be admitted, so it is a 413, not a 503).

    Raises:
        UnsupportedMedia: not a container/codec we read (415).
        PayloadTooLarge: stated length over ``max_audio_seconds``, or a decode
            needing more than ``max_decoded_bytes_in_flight`` (413).
        InvalidRequest: empty, no frames, implausible sample rate, more than 8 channels (400).
    """
    config = get_config()
    try:
        header = await decoding.read_header(audio_input.data, specs.require_spec(family)["sample_rate_hz"],
                                            config.max_audio_seconds)
    except audio.AudioError as exc:
        raise _audio_refusal(exc, audio_input.param) from None
    _check_decodable(header, family, audio_input.param)
    return header


def _check_decodable(header: audio.AudioHeader, family: str, param: str) -> None:
    """Refuse (413) audio whose decode needs more than the whole decode budget (see :func:`inspect_audio`)."""
    needed_bytes = decoded_bytes_needed(header, specs.require_spec(family)["sample_rate_hz"])
    budget = decoding.budget()
    if not budget.fits_alone(needed_bytes):
        raise PayloadTooLarge(
            f"decoding this audio ({header.duration_s:.0f} s, {header.channels} channel(s) at "
            f"{header.sample_rate_hz} Hz) needs about {_mib(needed_bytes)}, more than this server decodes at once "
            f"(max_decoded_bytes_in_flight = {_mib(budget.limit_bytes)}); send shorter audio",
            param=param)


async def inspect_and_decode_audio(audio_input: AudioInput, family: str,
                                   options: dict) -> tuple[audio.AudioHeader, rpc.RunInput | None]:
    """:func:`inspect_audio` and, for small audio that fits in the decode budget now, :func:`decode_audio`
    too, in one pool hop (``inference.runtime.decoding.inspect_and_decode``; none for a WAV that needs no
    decoding): for a request that will most likely be granted at once. Returns the header and the run's
    input, or None when the audio is to be decoded after the grant as usual.

    Raises:
        UnsupportedMedia, PayloadTooLarge, InvalidRequest: as :func:`inspect_audio` and
            :func:`decode_audio` (no ticket is held yet).
    """
    rate = specs.require_spec(family)["sample_rate_hz"]
    try:
        inspected = await decoding.inspect_and_decode(audio_input.data, rate, get_config().max_audio_seconds,
                                                      lambda header: decoded_bytes_needed(header, rate))
    except audio.AudioError as exc:
        raise _audio_refusal(exc, audio_input.param) from None
    if inspected.samples is None or inspected.reservation is None:
        _check_decodable(inspected.header, family, audio_input.param)
        return inspected.header, None
    return inspected.header, rpc.RunInput(inspected.samples, rate, options, on_release=inspected.reservation.release)


async def decode_audio(audio_input: AudioInput, header: audio.AudioHeader, family: str,
                       options: dict) -> rpc.RunInput:
    """Reserve the decode's bytes in this process's budget, decode ``audio_input`` to mono float32
    ``(n,)`` at the family's rate, and return it as a run's input.

    The reservation goes back when the samples are in Redis (see
    ``inference.runtime.rpc.RunInput``), or here on any error or cancellation.

    Args:
        header: the upload's header, from :func:`inspect_audio`.

    Raises:
        ServerBusy: (code ``decode_budget``, ``Retry-After``) the decode does not fit beside the
            decoded audio this process holds now.
        UnsupportedMedia: the stream cannot be decoded (415).
        InvalidRequest: non-finite samples, or nothing left after resampling (400).
    """
    rate = specs.require_spec(family)["sample_rate_hz"]
    needed_bytes = decoded_bytes_needed(header, rate)
    budget = decoding.budget()
    reservation = budget.reserve(needed_bytes)
    if reservation is None:
        log.info("decode budget: refused %d bytes, %d of %d in flight", needed_bytes, budget.in_flight_bytes,
                 budget.limit_bytes)
        raise ServerBusy(
            f"this server process is busy decoding other audio: {_mib(budget.in_flight_bytes)} of decoded audio in "
            f"flight, this request needs {_mib(needed_bytes)} more, and at most {_mib(budget.limit_bytes)} may be "
            "in flight (max_decoded_bytes_in_flight); retry", code="decode_budget", retry_after_s=1)
    try:
        samples = await decoding.decode(audio_input.data, header, rate, get_config().max_audio_seconds)
    except audio.AudioError as exc:
        reservation.release()
        raise _audio_refusal(exc, audio_input.param) from None
    except BaseException:
        reservation.release()
        raise
    return rpc.RunInput(samples, rate, options, on_release=reservation.release)


async def _give_back(ctx: AsyncContext, model_id: str, lease_id: str, run_input: rpc.RunInput | None) -> None:
    """Release a request lease that no worker took over, and delete the input it sent to Redis, if any."""
    await ctx.scheduler.release(model_id, lease_id)
    if run_input is not None:
        await rpc.drop_input(ctx, run_input)


# -- the one teardown path -------------------------------------------------------------------------

async def model_teardown(ctx: AsyncContext, lease: Lease, actor: str, *,
                         state: ModelState = ModelState.UNLOADING, event: str = "teardown",
                         reason: str = "") -> TeardownResult:
    """Tear down ``lease.model_id``'s pool under its held manager lease, recording each step once (R4.5).

    Every teardown goes through here: HTTP unload, unregister, bulk unload,
    reconfigure, eviction, idle retirement and ``manage.py unload_model``.
    This process (the manager) is the only writer of the steps: the
    registration's state (``state`` first, ``unloaded`` at the end) and one
    audit row ``event`` when there was a pool (``actor``; ``detail`` the
    close error, else ``reason``). The worker only destroys the pool.

    Raises:
        LeaseNotHeld: the manager lease was reclaimed (R2.5).
    """
    model_id = lease.model_id
    await sync_to_async(records.registration_record_state)(model_id, state)
    result = await teardown_held(ctx, lease, state)
    await sync_to_async(records.registration_record_teardown)(
        model_id, ok=not result.error, detail=result.error or reason or str(result.outcome),
        duration_ms=result.duration_ms, actor=actor, event=event, audit=result.recorded_pool)
    return result


async def model_retire_if_idle(ctx: AsyncContext, model_id: str, idle_ms: int) -> bool:
    """Unload ``model_id`` if it has been idle for ``idle_ms`` (R6.4).

    Idle = ready, no lease of any kind, empty queue, and the last work
    (``last_used_ms``, set when a lease is released or a load finishes)
    ended at least ``idle_ms`` ago in Redis time. Takes the manager lease by
    try-acquire, so a busy or queued model is skipped, never interrupted.

    Returns:
        True when the pool was retired.
    """
    lease = await ctx.scheduler.try_acquire(model_id, ModelState.READY, idle_ms)
    if lease is None:
        return False
    await leases.hold(ctx, lease, lambda held: model_teardown(
        ctx, held, "idle retirement", event="idle_retire", reason=f"idle for at least {idle_ms} ms"))
    log.info("retired %s after %d ms idle", model_id, idle_ms)
    return True


# -- loading and residency (R4.2, R6) -------------------------------------------------------------

async def _record_lost_load(model_id: str, host: str, error: str) -> None:
    """Record the end of a load whose worker died (R7.4): the worker wrote its start (state
    ``loading``) and cannot write its outcome, so the web process that ended it does: state
    ``unloaded``, ``last_error``, a failed ``load`` audit row whose actor is the lost worker.

    Tolerated race: a new load may start at once; if its ``loading`` write lands before this
    one, the database reads ``unloaded`` until that load's outcome is written.
    """
    try:
        await sync_to_async(records.registration_record_load)(model_id, False, error=error, actor=host)
    except Exception:  # the caller's 503 matters more than the record
        log.exception("recording the lost load of %s failed", model_id)


async def ensure_loaded(ctx: AsyncContext, model_id: str, force: bool = False,
                        room_timeout_ms: int | None = None) -> rpc.Placement:
    """Where ``model_id``'s pool is loaded, loading it if needed (single flight, R4.2).

    With a residency or memory limit set, a cold load first passes the cold
    load guard (one at a time, FIFO) and makes room (R6.1, R6.5, R6.6); a
    model that is ready, or being loaded by someone else, never touches the
    guard, so warm traffic never waits on it. A model whose last load failed
    is refused until its backoff ends, before any eviction (R6.7), unless
    ``force`` (an explicit management load).

    Args:
        room_timeout_ms: how long a cold load may wait for the guard and for
            room (R6.1): the request's remaining effective busy timeout; 0 =
            without bound (R3.5); None = the server's ``busy_timeout_ms``
            (management loads).

    Raises:
        ModelLoadFailed, ServerBusy: see ``inference.runtime.rpc.load_single_flight``.
        ServerBusy: (code ``residency_full``) no room was made within ``room_timeout_ms``.
        InsufficientMemory: the memory guard refused the load.
    """
    lost = functools.partial(_record_lost_load, model_id)
    if get_config().residency_limited:
        status = (await ctx.scheduler.snapshot([model_id]))[model_id]
        if status["retry_in_ms"] and not force:  # no eviction on behalf of a load in backoff (R6.7)
            raise rpc.backoff_error(model_id, status["retry_in_ms"], status["error"])
        if status["state"] not in COUNTED_STATES:
            if room_timeout_ms is None:
                room_timeout_ms = get_config().busy_timeout_ms
            deadline_s = time.monotonic() + room_timeout_ms / 1000 if room_timeout_ms > 0 else None
            async with leases.cold_load_guard(ctx, deadline_s) as guard:
                started = time.monotonic()
                status = (await ctx.scheduler.snapshot([model_id]))[model_id]
                if status["retry_in_ms"] and not force:  # failed while we waited for the guard (R6.7)
                    raise rpc.backoff_error(model_id, status["retry_in_ms"], status["error"])
                await make_room(ctx, model_id, deadline_s, guard)
                await guard.check()
                placement = await rpc.load_single_flight(ctx, model_id, force=force, on_load_lost=lost)
                if placement.load_ms:
                    return rpc.Placement(placement.owner, placement.boot, (time.monotonic() - started) * 1000)
                return placement
    return await rpc.load_single_flight(ctx, model_id, force=force, on_load_lost=lost)


@dataclass(frozen=True)
class PreloadResult:
    """One model of :func:`models_preload`: loaded in ``load_ms`` (0 when it was already loaded), or
    ``error`` (the refusal's message; ``load_ms`` None)."""

    model_id: str
    load_ms: float | None
    error: str = ""


async def models_preload(ctx: AsyncContext, model_ids: list[str] | None,
                         on_result: Callable[[PreloadResult], None] | None = None) -> list[PreloadResult]:
    """Load models now, one after the other (``manage.py load_models``; ``serve`` at start-up).

    ``model_ids`` None: every eager (non-lazy) published model. Each load first takes a request
    lease of its model without a bound (the same FIFO and busy guard as a request, so it queues
    behind running work), then :func:`ensure_loaded` with ``force`` (an explicit load passes a
    failed load's backoff, R6.7) while the lease is kept alive, then gives the lease back. A
    failure is reported and the next model is loaded: the model stays registered and loads on its first request.

    Args:
        on_result: called with each result as soon as it is known (progress lines).

    Returns:
        One :class:`PreloadResult` per model, in order; an id that is not registered is a failure.
    """
    metas = await published.meta_all(ctx)
    results = []
    for model_id in published.eager_ids(metas) if model_ids is None else model_ids:
        if model_id not in metas:
            result = PreloadResult(model_id, None, "not registered")
        else:
            lease = await ctx.scheduler.acquire(ctx.listener, model_id, 0)
            try:
                async with ctx.scheduler.keep_alive(model_id, lease.lease_id):  # a load may outlast the lease TTL
                    placement = await ensure_loaded(ctx, model_id, force=True)
                result = PreloadResult(model_id, placement.load_ms)
            except ApplicationError as exc:
                result = PreloadResult(model_id, None, exc.message)
            finally:
                await ctx.scheduler.release(model_id, lease.lease_id)
        results.append(result)
        if on_result is not None:
            on_result(result)
    return results


async def _available_memory_mb(ctx: AsyncContext) -> int | None:
    """Largest available host memory (MB) among live workers, or None when no worker published any."""
    published_mb = await ctx.redis.hgetall(KEYS.worker_memory)
    best = None
    for host, value in published_mb.items():
        if await ctx.redis.exists(KEYS.worker_live(host)):
            best = max(best or 0, int(value))
    return best


ROOM_POLL_S = 0.1
"""While a cold load waits for room (R6.1), how often it looks for an idle model, in seconds.

Only the holder of the cold-load guard polls (one per deployment), with one
snapshot per poll: cheap, and simpler than a wake-up on every release."""


async def make_room(ctx: AsyncContext, model_id: str, deadline_s: float | None = None,
                    guard: leases.GuardHeld | None = None) -> list[str]:
    """Apply the memory guard and evict LRU models so ``model_id`` may load (R6.1, R6.5).

    Call while holding the cold-load guard (``guard``: checked before each
    eviction, so a holder that stalled past the TTL evicts nothing). Victims are models that are
    ready, hold no lease and have an empty queue (try-acquire: never waiting,
    never interrupting, R6.1, R6.3); models being torn down do not count
    (R6.2). When too few can be evicted now, waits for resident models to
    become idle (looking every ``ROOM_POLL_S``) until ``deadline_s``
    (``time.monotonic()`` seconds; None = without bound). Evictions already
    done stay done when the call fails.

    Returns:
        The evicted model ids, least recently used first.

    Raises:
        InsufficientMemory: estimated footprint + ``min_free_memory_mb`` >
            available memory of the best live worker (R6.5).
        ServerBusy: (code ``residency_full``) no room by the deadline (every
            other loaded model stayed busy, queued or loading).
    """
    config = get_config()
    metas = await published.meta_all(ctx)
    meta = metas.get(model_id)
    if meta is None:
        return []
    if config.min_free_memory_mb:
        footprint_mb = specs.estimated_footprint_mb(meta["family"], meta.get("slots") or 1,
                                                   meta.get("load_options"))
        available_mb = await _available_memory_mb(ctx)
        if available_mb is not None and footprint_mb + config.min_free_memory_mb > available_mb:
            raise InsufficientMemory(
                f"model {model_id!r} needs about {footprint_mb} MB plus the {config.min_free_memory_mb} MB "
                f"headroom (min_free_memory_mb), but the workers have {available_mb} MB available",
                code="insufficient_memory", retry_after_s=5)
    evicted: list[str] = []
    if not config.max_loaded_models:
        return evicted
    while True:
        snapshot = await ctx.scheduler.snapshot(list(metas))
        if snapshot[model_id]["state"] in COUNTED_STATES:
            return evicted  # loaded (or loading) by a management load meanwhile: no room needed
        loaded = [m for m, status in snapshot.items() if m != model_id and status["state"] in COUNTED_STATES]
        need = len(loaded) + 1 - config.max_loaded_models
        victims = sorted((m for m in loaded if snapshot[m]["state"] == ModelState.READY),
                         key=lambda m: snapshot[m]["last_used_ms"])
        for victim in victims:
            if need <= 0:
                break
            if guard is not None:
                await guard.check()  # never evict on a guard this process no longer holds (R6.6)
            lease = await ctx.scheduler.try_acquire(victim, ModelState.READY)
            if lease is None:  # busy, queued or changed state since the snapshot (R6.1, R6.3)
                continue
            # The teardown finishes (and releases the victim) even if our requester leaves (R4.5).
            await leases.hold(ctx, lease, lambda held: model_teardown(ctx, held, f"eviction for {model_id}"))
            log.info("evicted %s (least recently used) to load %s", victim, model_id)
            metrics.record_soon(metrics.count(metrics.EVICTIONS, victim))
            evicted.append(victim)
            need -= 1
        if need <= 0:
            return evicted
        left_s = None if deadline_s is None else deadline_s - time.monotonic()
        if left_s is not None and left_s <= 0:
            raise ServerBusy(
                f"model {model_id!r} cannot load: max_loaded_models={config.max_loaded_models} models are loaded "
                f"and none of them became idle within this request's busy timeout (each stayed busy, queued or "
                f"loading)" + (f"; evicted {evicted}" if evicted else ""), code="residency_full", retry_after_s=1)
        await asyncio.sleep(ROOM_POLL_S if left_s is None else min(ROOM_POLL_S, left_s))
        metas = await published.meta_all(ctx)  # registrations may come and go while we wait
        if model_id not in metas:
            return evicted  # unregistered meanwhile: the caller finds out when it loads


# -- one request ---------------------------------------------------------------------------------

async def probe_for_request(ctx: AsyncContext, model_id: str, request_timeout_ms: int | None) -> AdmissionProbe:
    """The admission probe of ``model_id`` for a request, refusing it at once when it would be (R3.3).

    ``model_id`` may be an alias (``ServerConfig.aliases``: OpenAI's names, the configured ones) when no
    model of that id is registered: the probe is then the alias target's (its ``entry`` names the target).

    One Redis round trip (``admission_probe.lua``): a request the model would
    refuse as overdue is answered 503 before anything else is done for it (its
    options are not checked, its audio not decoded). ``run`` still enqueues
    through ``enqueue.lua``, the authority, for every other request.

    Returns:
        The probe: ``entry`` (the published registration, never None here) and ``free`` (pass it to
        :func:`run` as ``probe``).

    Raises:
        NotFound: not registered (404, ``param`` "model").
        ServerBusy: (code ``overdue``) every occupied slot has run longer than the effective timeout.
    """
    config = get_config()
    probe = await ctx.scheduler.admission_probe(model_id, request_timeout_ms, config.busy_timeout_ms)
    if probe.entry is None and (target := config.aliases().get(model_id)):  # an alias (never shadows an id)
        probe = await ctx.scheduler.admission_probe(target, request_timeout_ms, config.busy_timeout_ms)
    if probe.entry is None:
        raise NotFound(f"model {model_id!r} is not registered", param="model")
    if probe.verdict == ProbeVerdict.OVERDUE:
        raise leases.busy_error(AdmissionOverdue(model_id, probe.timeout_ms, probe.age_ms))
    return probe


async def model_for_request(ctx: AsyncContext, model_id: str, request_timeout_ms: int | None) -> dict:
    """The published entry of ``model_id`` for a request (:func:`probe_for_request`'s ``entry``).

    Raises:
        NotFound, ServerBusy: see :func:`probe_for_request`.
    """
    probe = await probe_for_request(ctx, model_id, request_timeout_ms)
    assert probe.entry is not None  # probe_for_request refuses a missing entry
    return probe.entry


async def run(ctx: AsyncContext, meta: dict, audio_input: AudioInput, options: dict,
              request_timeout_ms: int | None, probe: AdmissionProbe | None = None) -> Outcome:
    """Serve one request (either runtime).

    The short path (issue 8 item 7), when the admission probe found a free slot and nobody
    queued: small audio is decoded with its header before the request queues
    (:func:`inspect_and_decode_audio`: one pool hop instead of two; should the request queue
    after all, it holds its decoded samples, counted in the decode budget, while it waits), and
    the run is offered with the enqueue (``rpc.offer_run``): granted at once on a model ready on a
    live worker whose registration is still the probed one, it is on that worker's queue in the
    grant's own step, one round trip instead of two.

    Args:
        meta: published registration of the model.
        audio_input: the uploaded audio, decoded once the request holds its slot (or before it
            queues, above).
        options: validated request options (merged with defaults on the worker).
        request_timeout_ms: the request's ``busy_timeout_ms`` (None = not given).
        probe: the request's admission probe (:func:`probe_for_request`), for the short path.

    Raises:
        ServerBusy: queue timeout or overdue fail-fast (R3.2, R3.3), the
            worker was lost, or the decode budget is full (``decode_budget``).
        UnsupportedMedia, PayloadTooLarge, InvalidRequest: the audio (see
            :func:`inspect_audio`, before queueing, and :func:`decode_audio`,
            after the grant; the lease is then given back).
        ModelLoadFailed: the model could not be loaded.
        InvalidRequest: the adapter refused the request's options.
        NotFound: the model was unregistered while the request waited.
        Conflict: the model changed family or task while the request waited.
    """
    model_id = meta["id"]
    timeout_ms = effective_timeout_ms(request_timeout_ms, published.ceiling_ms(meta))
    run_input: rpc.RunInput | None = None
    offered: rpc.OfferedRun | None = None
    if probe is not None and probe.free:
        header, run_input = await inspect_and_decode_audio(audio_input, meta["family"], options)
        if run_input is not None:
            offered = rpc.offer_run(ctx, model_id, run_input, probe.entry_json)
    else:
        header = await inspect_audio(audio_input, meta["family"])
    handover = rpc.Handover()
    try:
        lease = await leases.acquire(ctx, model_id, timeout_ms, offer=offered.offer if offered else None)
    except BaseException:
        if run_input is not None:
            run_input.release_samples()
        if offered is not None:
            offered.withdraw(ctx)
        raise
    if offered is not None and run_input is not None:
        if lease.dispatched:
            offered.taken(run_input, handover)
        else:
            offered.withdraw(ctx)
            offered = None
    try:
        async with ctx.scheduler.keep_alive(model_id, lease.lease_id):
            # A manager ahead of us may have unregistered or reconfigured the model (R2.3). A lease
            # granted at once carries the registration and placement read in the grant's own step.
            if lease.meta_json is not None:
                current = json.loads(lease.meta_json) if lease.meta_json else None
            else:
                current = await published.meta_get(ctx, model_id)
            if current is None:
                raise NotFound(f"model {model_id!r} was unregistered while the request waited", param="model")
            if (current["family"], current["task"]) != (meta["family"], meta["task"]):
                raise Conflict(f"model {model_id!r} was reconfigured to {current['family']}/{current['task']} "
                               "while the request waited; its input was prepared for the old family; retry",
                               param="model")
            if run_input is None:
                run_input = await decode_audio(audio_input, header, current["family"], options)
            load_ms = 0.0
            ready_on = lease.ready_on
            for attempt in range(2):
                if ready_on is not None:  # ready on a live worker when granted: nothing to load
                    placement = rpc.Placement(*ready_on, load_ms=0.0)
                    ready_on = None
                else:
                    left_ms = max(1, timeout_ms - int(lease.waited_ms)) if timeout_ms else 0
                    placement = await ensure_loaded(ctx, model_id, room_timeout_ms=left_ms)
                load_ms += placement.load_ms
                if attempt == 0 and offered is not None:  # handed over with the grant
                    try:
                        reply = await rpc.run_reply(ctx, run_input.request_id, placement, offered.wake)
                    finally:
                        offered.withdraw(ctx)
                else:
                    reply = await rpc.run_on_worker(ctx, model_id, lease.lease_id, placement, run_input, handover)
                if reply is None:
                    # The owner stopped beating while it ran our request. It may be
                    # frozen rather than dead, so its run could still finish and
                    # release this lease later: never reuse the lease; give it back
                    # and answer 503 (R7.4).
                    handover.sent = False
                    await ctx.scheduler.mark_unloaded(model_id, placement.boot, "worker lost")
                    raise ServerBusy(f"model {model_id!r}: its worker stopped responding; retry", code="worker_lost")
                if reply.get("kind") == rpc.RunFailure.NOT_LOADED:
                    # The owner never took the run (its pool is gone): the lease is
                    # still ours alone; forget the pool and load again once.
                    handover.sent = False
                    await ctx.scheduler.mark_unloaded(model_id, placement.boot, "pool lost")
                    continue
                break
            else:
                raise ServerBusy(f"model {model_id!r}: its pool was lost twice; retry later", code="worker_lost")
        assert reply is not None  # the loop ends with a reply or raises
        if not reply["ok"]:
            if reply["kind"] == rpc.RunFailure.INVALID_INPUT:
                raise InvalidRequest(reply["message"], param=reply.get("param"))
            if reply["kind"] == rpc.RunFailure.ERROR:  # an adapter failed on valid input: a bug, reported as such
                raise ApplicationError(f"model {model_id!r} failed: {reply['message']}")
            raise ServerBusy(f"model {model_id!r} could not serve the request: {reply['message']}", code=reply["kind"])
        return Outcome(reply["result"], lease.waited_ms, load_ms, reply["inference_ms"], reply["slot"],
                       reply["worker"], run_input.audio_ms)
    finally:
        if run_input is not None:
            run_input.release_samples()  # its budget reservation, if the samples never reached Redis
        if not handover.sent:
            await asyncio.shield(_give_back(ctx, model_id, lease.lease_id, run_input))


# -- pipelines (diarization) ------------------------------------------------------------------------
#
# How a pipeline takes slots. A pipeline registration (family ``diarization``) has no weights; its
# request runs in the web process and calls its component models (``load_options.vad_model`` and
# ``load_options.embedding_model``) exactly as a client would, through ``run``: each component step
# queues in that component's FIFO, holds one of its slots while the worker runs it, and gives it
# back before the next step queues. So:
#
# * a manager (unload, reconfigure, eviction) queued on a component is a barrier for the pipeline
#   as for anyone: the step queued after it waits for it and binds the new pool;
# * the pipeline never holds a slot of one component while it waits for another component, so two
#   pipelines sharing the same two models cannot deadlock (each waits for at most one component
#   slot at a time, and a component slot is held only while a worker runs);
# * the pipeline's own registration is leased first and held (renewed) for the whole request: its
#   slots bound how many diarizations run at once, and a manager on the pipeline (unload,
#   reconfigure, unregister) waits for the diarizations in progress. The only order in which leases
#   are ever held together is pipeline → one component, never the reverse, so there is no cycle.

async def _component(ctx: AsyncContext, pipeline_id: str, role: str, model_id: str, family: str,
                     request_timeout_ms: int | None) -> dict:
    """The published registration of one component, checked (see :func:`diarize`)."""
    try:
        meta = await model_for_request(ctx, model_id, request_timeout_ms)
    except NotFound:
        raise Conflict(f"pipeline {pipeline_id!r} names {role} {model_id!r}, which is not registered",
                       param="model") from None
    if meta["family"] != family:
        raise Conflict(f"pipeline {pipeline_id!r} names {role} {model_id!r} of family {meta['family']!r}; "
                       f"it needs a {family!r} model", param="model")
    return meta


async def diarize(ctx: AsyncContext, meta: dict, audio_input: AudioInput, options: dict,
                  request_timeout_ms: int | None) -> Outcome:
    """Serve one diarization request of pipeline ``meta`` (see the comment above for its slots).

    Steps: speech regions from the VAD component; windows over them
    (``inference.diarization.bounded_windows``: at most the embedding family's ``segments`` limits,
    the hop widened when needed); one embedding per window from the embedding component;
    clustering and speaker turns (``inference.diarization.cluster_and_turn``, off the event loop).

    Args:
        options: validated request options (merged here with the spec's and the
            registration's defaults).

    Returns:
        An :class:`Outcome` whose result is ``{"speaker_turns": [{"speaker",
        "start_s", "end_s"}], "speakers": [names], "num_speakers",
        "segments": [speech regions {start_s, end_s}], "duration" (s),
        "sample_rate": 16000}``; its times add up the steps (``queue_ms``
        includes the wait for the pipeline's own slot).

    Raises:
        As :func:`run`; Conflict (409) when a component is not registered or
        is of the wrong family.
    """
    model_id = meta["id"]
    opts = {**specs.request_defaults(meta["family"]), **(meta.get("default_request_options") or {}), **options}
    timeout_ms = effective_timeout_ms(request_timeout_ms, published.ceiling_ms(meta))
    await inspect_audio(audio_input, meta["family"])
    lease = await leases.acquire(ctx, model_id, timeout_ms)
    try:
        async with ctx.scheduler.keep_alive(model_id, lease.lease_id):
            current = await published.meta_get(ctx, model_id)
            if current is None:
                raise NotFound(f"model {model_id!r} was unregistered while the request waited", param="model")
            if current["family"] != meta["family"]:
                raise Conflict(f"model {model_id!r} was reconfigured to {current['family']} while the request "
                               "waited; retry", param="model")
            left_ms = max(1, timeout_ms - int(lease.waited_ms)) if timeout_ms else 0
            placement = await ensure_loaded(ctx, model_id, room_timeout_ms=left_ms)
            parts = current["load_options"]
            vad_meta = await _component(ctx, model_id, "vad_model", parts["vad_model"], "silero_vad",
                                        request_timeout_ms)
            vad = await run(ctx, vad_meta, audio_input, {
                "threshold": opts["vad_threshold"], "min_speech_duration_ms": opts["min_speech_duration_ms"],
                "min_silence_duration_ms": opts["min_silence_duration_ms"]}, request_timeout_ms)
            steps = [vad]
            regions = [(seg["start_s"], seg["end_s"]) for seg in vad.result["segments"]]
            # The windows fit one embedding step within the embedding family's own limits (its
            # segments' count and total duration): the hop widens when they would not.
            seg_limits = specs.require_spec("speaker_embedding")["request_options"]["properties"]["segments"]
            try:
                windows, _hop_s = diarization.bounded_windows(
                    regions, float(opts["window_s"]), float(opts["hop_s"]), max_windows=int(seg_limits["maxItems"]),
                    max_total_s=float(seg_limits["maxTotalSpanS"]))
            except diarization.TooManyRegions as exc:
                raise InvalidRequest(
                    f"the audio has {len(regions)} speech regions, {exc.windows} embedding windows "
                    f"({exc.seconds:.0f} s) even at the widest hop; the limit is {seg_limits['maxItems']} "
                    f"windows lasting {seg_limits['maxTotalSpanS']} s together: raise min_silence_duration_ms or "
                    "min_speech_duration_ms, or send shorter audio", param="min_silence_duration_ms") from None
            turns: list[dict] = []
            if windows:
                embed_meta = await _component(ctx, model_id, "embedding_model", parts["embedding_model"],
                                              "speaker_embedding", request_timeout_ms)
                embedded = await run(ctx, embed_meta, audio_input, {
                    "whole": False, "segments": [{"start_s": s, "end_s": e} for s, e, _ in windows]},
                    request_timeout_ms)
                steps.append(embedded)
                vectors = np.asarray([seg["embedding"] for seg in embedded.result["segments"]], dtype=np.float32)
                turns = await diarization.cluster_and_turn(
                    windows, vectors, regions, num_speakers=opts["num_speakers"],
                    distance_threshold=float(opts["distance_threshold"]), max_speakers=int(opts["max_speakers"]))
    finally:
        await asyncio.shield(ctx.scheduler.release(model_id, lease.lease_id))
    speakers = sorted({turn["speaker"] for turn in turns})
    result = {"speaker_turns": turns, "speakers": speakers, "num_speakers": len(speakers),
              "segments": [{"start_s": s, "end_s": e} for s, e in regions],
              "duration": vad.result["duration"], "sample_rate": vad.result["sample_rate"]}
    return Outcome(result, lease.waited_ms + sum(step.queue_ms for step in steps),
                   placement.load_ms + sum(step.load_ms for step in steps),
                   round(sum(step.inference_ms for step in steps), 3), 0, "web", vad.audio_ms)


async def transcribe_with_speakers(ctx: AsyncContext, asr_meta: dict, pipeline_meta: dict | None,
                                   audio_input: AudioInput, options: dict,
                                   request_timeout_ms: int | None) -> Outcome:
    """Transcribe with word timestamps and, with a diarization pipeline, label words and segments
    with speakers (``/v1/audio/transcriptions/details``).

    The two steps run one after the other, each through its own slots (the transcription's slot is
    given back before the diarization queues), so this never holds two models' slots while waiting.

    Returns:
        An :class:`Outcome` whose result is :func:`inference.diarization.label_words`'s; its times
        add up both steps.

    Raises:
        As :func:`run` and :func:`diarize`.
    """
    asr = await run(ctx, asr_meta, audio_input, {**options, "word_timestamps": True}, request_timeout_ms)
    steps = [asr]
    turns: list[dict] = []
    if pipeline_meta is not None:
        diarized = await diarize(ctx, pipeline_meta, audio_input, {}, request_timeout_ms)
        steps.append(diarized)
        turns = diarized.result["speaker_turns"]
    rate = int(specs.require_spec(asr_meta["family"])["sample_rate_hz"])
    return Outcome(diarization.label_words(asr.result, turns, rate), sum(step.queue_ms for step in steps),
                   sum(step.load_ms for step in steps), round(sum(step.inference_ms for step in steps), 3),
                   asr.slot, asr.worker, asr.audio_ms)


# -- streamed runs (speech synthesis, transcription) ------------------------------------------------

class _HeldStream:
    """An admitted request whose output a worker is streaming back, frame by frame.

    Holds the request's lease (renewed by a keep-alive) from its opening until
    :meth:`aclose`: the slot is busy until the last byte is written or the
    client leaves (R8.3).
    """

    def __init__(self, ctx: AsyncContext, model_id: str, lease: Lease, keep_alive, stream: rpc.WorkerStream,
                 first: list[bytes], load_ms: float):
        self.ctx = ctx
        self.model_id = model_id
        self.lease = lease
        self._keep_alive = keep_alive
        self._stream = stream
        self._pending = first
        self.load_ms = load_ms
        self._closed = False

    @property
    def final(self) -> dict | None:
        """The worker's end frame (None until the run ended)."""
        return self._stream.final

    async def _frames(self):
        """Yield each frame (type byte removed) as the worker produces it.

        Raises:
            ServerBusy: the worker was lost mid-stream (``worker_lost``).
            ApplicationError: the adapter failed mid-stream (a bug).
        """
        while self._pending:
            yield self._pending.pop(0)
        while self._stream.final is None:
            for frame in await self._stream.frames():
                yield frame
        final = self._stream.final
        if not final["ok"]:
            raise ApplicationError(f"model {self.model_id!r} failed mid-stream: {final['message']}")

    async def aclose(self) -> None:
        """End the request: stop the worker after its current step if it is still going (the client
        left), then release the lease. Idempotent; finishes even if the caller is cancelled."""
        if self._closed:
            return
        self._closed = True
        await leases.run_to_completion(self._finish())

    async def _finish(self) -> None:
        try:
            if self._stream.final is None:
                await self._stream.stop(self.ctx.scheduler.lease_ttl_ms / 1000)
            await self._stream.discard()
        finally:
            await self._keep_alive.__aexit__(None, None, None)
            await self.ctx.scheduler.release(self.model_id, self.lease.lease_id)


class SpeechStream(_HeldStream):
    """An admitted speech request whose audio is being synthesised on a worker (see :class:`_HeldStream`).

    Iterate :meth:`pcm` for s16le mono PCM blocks at ``sample_rate_hz`` (one
    per sentence), then read ``final`` (the worker's summary: ``sentences``,
    ``phonemes``, ``samples``, ``inference_ms``, ``slot``, ``stopped``).
    """

    sample_rate_hz: int

    async def pcm(self):
        """Yield s16le mono PCM ``bytes`` per sentence as the worker produces them.

        Raises:
            ServerBusy: the worker was lost mid-stream (``worker_lost``).
            ApplicationError: the adapter failed mid-stream (a bug).
        """
        async for frame in self._frames():
            yield frame


class TranscriptionStream(_HeldStream):
    """An admitted transcription whose segments are being decoded on a worker (see :class:`_HeldStream`).

    Iterate :meth:`deltas` for the text each segment adds, as the worker
    decodes it; then ``final`` holds ``text`` (the whole transcript, equal to
    the concatenated deltas and to the non-streamed text), ``duration`` (s of
    audio), ``language``, ``segments``, ``inference_ms``, ``slot``. ``audio_ms``: the input's duration.
    """

    audio_ms: float

    async def deltas(self):
        """Yield ``str`` per decoded segment (empty segments skipped).

        Raises:
            ServerBusy: the worker was lost mid-stream (``worker_lost``).
            ApplicationError: the adapter failed mid-stream (a bug).
        """
        async for frame in self._frames():
            delta = json.loads(frame)["delta"]
            if delta:
                yield delta


async def _stream_open(ctx: AsyncContext, meta: dict, timeout_ms: int, lease: Lease,
                       prepare, start) -> tuple[rpc.WorkerStream, list[bytes], dict, float]:
    """Start a streamed run under ``lease`` (its keep-alive entered): check the model did not change
    while the request waited, ``await prepare(current_meta)`` (e.g. decode the input), load the model,
    ``await start(stream, lease_id)``, and wait for the first frame (or the refusal). A pool lost before the
    worker took the run is loaded once more. Returns ``(stream, first frames, current meta, load_ms)``.

    Raises:
        ServerBusy, ModelLoadFailed, NotFound, Conflict: as :func:`run`.
        InvalidRequest: the adapter refused the request (``param`` names the field).
        ApplicationError: the adapter failed on valid input (a bug).
    """
    model_id = meta["id"]
    current = await published.meta_get(ctx, model_id)
    if current is None:
        raise NotFound(f"model {model_id!r} was unregistered while the request waited", param="model")
    if (current["family"], current["task"]) != (meta["family"], meta["task"]):
        raise Conflict(f"model {model_id!r} was reconfigured to {current['family']}/{current['task']} "
                       "while the request waited; retry", param="model")
    await prepare(current)
    load_ms = 0.0
    for _attempt in range(2):
        left_ms = max(1, timeout_ms - int(lease.waited_ms)) if timeout_ms else 0
        placement = await ensure_loaded(ctx, model_id, room_timeout_ms=left_ms)
        load_ms += placement.load_ms
        stream = rpc.WorkerStream(ctx, model_id, placement)
        try:
            await start(stream, lease.lease_id)
            first = await stream.frames()
        except BaseException:
            await _abandon(ctx, stream)
            raise
        final = stream.final
        if final is not None and not final["ok"] and final["kind"] == rpc.RunFailure.NOT_LOADED:
            await stream.discard(keep_input=True)  # the next dispatch sends only a header for it
            await ctx.scheduler.mark_unloaded(model_id, placement.boot, "pool lost")
            continue
        break
    else:
        raise ServerBusy(f"model {model_id!r}: its pool was lost twice; retry later", code="worker_lost")
    if final is not None and not final["ok"]:
        await stream.discard()
        if final["kind"] == rpc.RunFailure.INVALID_INPUT:
            raise InvalidRequest(final["message"], param=final.get("param"))
        if final["kind"] == rpc.RunFailure.EXPIRED:
            raise ServerBusy(f"model {model_id!r} could not serve the request: {final['message']}", code="expired")
        raise ApplicationError(f"model {model_id!r} failed: {final['message']}")
    return stream, first, current, load_ms


async def _abandon(ctx: AsyncContext, stream: rpc.WorkerStream) -> None:
    """Stop a stream whose opening failed after its header may have been sent, and delete its keys."""
    async def stop() -> None:
        await stream.stop(ctx.scheduler.lease_ttl_ms / 1000)
        await stream.discard()
    await leases.run_to_completion(stop())


async def _opened(ctx: AsyncContext, meta: dict, request_timeout_ms: int | None, prepare, start, make):
    """Admit a streamed request (lease + keep-alive), open it with :func:`_stream_open`, and return
    ``make(lease, keep_alive, stream, first, current, load_ms)``; on any failure (or cancellation)
    the lease is given back before the error propagates."""
    model_id = meta["id"]
    timeout_ms = effective_timeout_ms(request_timeout_ms, published.ceiling_ms(meta))
    lease = await leases.acquire(ctx, model_id, timeout_ms)
    keep_alive = ctx.scheduler.keep_alive(model_id, lease.lease_id)
    await keep_alive.__aenter__()
    try:
        stream, first, current, load_ms = await _stream_open(ctx, meta, timeout_ms, lease, prepare, start)
        return make(lease, keep_alive, stream, first, current, load_ms)
    except BaseException:
        async def give_back() -> None:
            try:
                await keep_alive.__aexit__(None, None, None)
            finally:
                await ctx.scheduler.release(model_id, lease.lease_id)
        await leases.run_to_completion(give_back())
        raise


async def speech_open(ctx: AsyncContext, meta: dict, text: str, options: dict,
                      request_timeout_ms: int | None) -> SpeechStream:
    """Admit a speech request and start its synthesis; returns once its first sentence (or refusal) is there.

    Waiting for the first frame before answering means a request the model
    refuses (e.g. text without phonemes) still gets its 400 before any
    response header is sent.

    Args:
        meta: the published registration of a ``tts`` model.
        text: the input text (checked by the view: 1..4096 characters).
        options: validated request options (merged with defaults on the worker).

    Raises:
        ServerBusy, ModelLoadFailed, NotFound, Conflict: as :func:`run`.
        InvalidRequest: the adapter refused the request (``param`` names the field).
        ApplicationError: the adapter failed on valid input (a bug).
    """
    async def prepare(current: dict) -> None:
        return None

    async def start(stream: rpc.WorkerStream, lease_id: str) -> None:
        await stream.start(lease_id, text, options)

    def make(lease, keep_alive, stream, first, current, load_ms) -> SpeechStream:
        opened = SpeechStream(ctx, meta["id"], lease, keep_alive, stream, first, load_ms)
        opened.sample_rate_hz = int(specs.require_spec(current["family"])["sample_rate_hz"])
        return opened

    return await _opened(ctx, meta, request_timeout_ms, prepare, start, make)


async def transcription_open(ctx: AsyncContext, meta: dict, audio_input: AudioInput, options: dict,
                             request_timeout_ms: int | None) -> TranscriptionStream:
    """Admit a transcription to be streamed segment by segment (``stream=true``); returns once its
    first segment (or the end, or a refusal) is there, so a refused request still gets its 4xx
    before any response header.

    The audio is inspected before the request queues and decoded once it holds
    its slot, as in :func:`run`; the samples go to the worker with the run's
    header, and each segment comes back as a frame as soon as it is decoded.

    Raises:
        UnsupportedMedia, PayloadTooLarge, InvalidRequest: the audio (see :func:`inspect_audio`, :func:`decode_audio`).
        ServerBusy, ModelLoadFailed, NotFound, Conflict: as :func:`run`.
        InvalidRequest: the adapter refused the request's options (``param`` names the field).
        ApplicationError: the adapter failed on valid input (a bug).
    """
    header = await inspect_audio(audio_input, meta["family"])
    prepared: list[rpc.RunInput] = []

    async def prepare(current: dict) -> None:
        prepared.append(await decode_audio(audio_input, header, current["family"], options))

    async def start(stream: rpc.WorkerStream, lease_id: str) -> None:
        await stream.start_transcription(lease_id, prepared[0])

    def make(lease, keep_alive, stream, first, current, load_ms) -> TranscriptionStream:
        opened = TranscriptionStream(ctx, meta["id"], lease, keep_alive, stream, first, load_ms)
        opened.audio_ms = prepared[0].audio_ms
        return opened

    try:
        return await _opened(ctx, meta, request_timeout_ms, prepare, start, make)
    finally:
        if prepared:
            prepared[0].release_samples()  # its budget reservation, if the samples never reached Redis


# -- one decode of a live transcription turn (inference.realtime) -----------------------------------

async def decode_held(ctx: AsyncContext, model_id: str, lease: Lease, samples, sample_rate_hz: int, options: dict,
                      timeout_ms: int) -> dict:
    """Transcribe ``samples`` (float32 ``(n,)`` at ``sample_rate_hz``) on ``model_id``'s pool under a
    request ``lease`` that the caller holds and renews across several runs (a live turn, R8.3); the
    worker neither renews nor releases it (a ``held`` run, ``inference.runtime.rpc.run_on_worker``).

    The model is loaded first if needed (a turn after an unload reloads it); a pool lost before the
    worker took the run is loaded once more. The caller must not release the lease while this runs:
    cancelled, it still waits for the worker's reply (the decode finishes: at most one decode
    step, R8.2), then re-raises.

    Args:
        timeout_ms: the turn's effective busy timeout, bounding a cold load's wait for room.

    Returns:
        The adapter's result (``text``, ``segments``, ``language``, ``duration``).

    Raises:
        ServerBusy: the worker was lost (``worker_lost``), or could not load (``no_worker``, ``residency_full``).
        ModelLoadFailed: the model could not be loaded.
        InvalidRequest: the adapter refused the options (e.g. a language the checkpoint lacks).
        ApplicationError: the adapter failed on valid input (a bug).
    """
    run_input = rpc.RunInput(samples, sample_rate_hz, options)
    task = asyncio.ensure_future(_decode_held(ctx, model_id, lease, run_input, timeout_ms))
    try:
        return await asyncio.shield(task)
    except asyncio.CancelledError:
        try:
            await task
        except Exception:
            pass
        raise


async def _decode_held(ctx: AsyncContext, model_id: str, lease: Lease, run_input: rpc.RunInput,
                       timeout_ms: int) -> dict:
    try:
        for _attempt in range(2):
            left_ms = max(1, timeout_ms - int(lease.waited_ms)) if timeout_ms else 0
            placement = await ensure_loaded(ctx, model_id, room_timeout_ms=left_ms)
            reply = await rpc.run_on_worker(ctx, model_id, lease.lease_id, placement, run_input, rpc.Handover(),
                                            held=True)
            if reply is None:
                await ctx.scheduler.mark_unloaded(model_id, placement.boot, "worker lost")
                raise ServerBusy(f"model {model_id!r}: its worker stopped responding; retry", code="worker_lost")
            if reply.get("kind") == rpc.RunFailure.NOT_LOADED:
                await ctx.scheduler.mark_unloaded(model_id, placement.boot, "pool lost")
                continue
            break
        else:
            raise ServerBusy(f"model {model_id!r}: its pool was lost twice; retry later", code="worker_lost")
        if not reply["ok"]:
            if reply["kind"] == rpc.RunFailure.INVALID_INPUT:
                raise InvalidRequest(reply["message"], param=reply.get("param"))
            if reply["kind"] == rpc.RunFailure.ERROR:
                raise ApplicationError(f"model {model_id!r} failed: {reply['message']}")
            raise ServerBusy(f"model {model_id!r} could not serve the turn: {reply['message']}", code=reply["kind"])
        return reply["result"]
    finally:
        run_input.release_samples()
        await rpc.drop_input(ctx, run_input)
