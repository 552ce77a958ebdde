"""One request: the admission probe, then the lease, the decode, the load and the run on a worker.

Flow of one request (web process, async, no thread held while waiting; the package doc has the rest):
probe (:func:`request_probe`), inspect the audio (``inference.services.audio_input``), acquire the
lease (:func:`_acquire`), check the registration it is bound to (:func:`_bind`), decode, make sure the
model is loaded and hand the run to its worker (:func:`_dispatch`), and map the worker's reply to an
answer or an error (:func:`reply_error`).
"""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass

from audiosite.errors import (ApplicationError, Conflict, InvalidRequest, ModelCrashed, NotFound, RunCancelled,
                              RunDeadline, RunExpired, ServerBusy, WorkerLost)
from audiosite.serverconfig import get_config
from inference import audio, specs
from inference.runtime import leases, loads, metrics, published, runs
from inference.runtime.context import AsyncContext
from inference.scheduler import AdmissionOverdue, AdmissionProbe, Lease, ProbeVerdict, effective_timeout_ms

from .audio_input import AudioInput, audio_decode, audio_inspect_and_decode, audio_inspect
from .loading import model_ensure_loaded


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
    recorded: bool = False  # the worker recorded the answer (metrics.answer_events): the view records nothing


async def _give_back(ctx: AsyncContext, model_id: str, lease_id: str, run_input: runs.RunInput | None) -> None:
    """Release a request lease that no worker took over, and delete the input it sent to Redis, if any."""
    await ctx.scheduler.release(model_id, lease_id)
    if run_input is not None:
        await runs.drop_input(ctx, run_input)


async def request_probe(ctx: AsyncContext, model_id: str, request_timeout_ms: int | None) -> AdmissionProbe:
    """The admission probe of ``model_id`` for a request, refusing it at once when it would be (R3.3).

    ``model_id`` may be an alias (``ServerConfig.aliases``: OpenAI's names, the configured ones) when no
    model of that id is registered: the probe is then the alias target's (its ``entry`` names the target).

    One Redis round trip (``admission_probe.lua``): a request the model would
    refuse as overdue is answered 503 before anything else is done for it (its
    options are not checked, its audio not decoded). ``run`` still enqueues
    through ``enqueue.lua``, the authority, for every other request.

    Returns:
        The probe: ``entry`` (the published registration, never None here) and ``free`` (pass it to
        :func:`request_run` as ``probe``).

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


async def request_model_resolve(ctx: AsyncContext, model_id: str, request_timeout_ms: int | None) -> dict:
    """The published entry of ``model_id`` for a request (:func:`request_probe`'s ``entry``).

    Raises:
        NotFound, ServerBusy: see :func:`request_probe`.
    """
    probe = await request_probe(ctx, model_id, request_timeout_ms)
    assert probe.entry is not None  # request_probe refuses a missing entry
    return probe.entry


async def request_run(ctx: AsyncContext, meta: dict, audio_input: AudioInput, options: dict,
              request_timeout_ms: int | None, probe: AdmissionProbe | None = None, answer: bool = False) -> Outcome:
    """Serve one offline request (either runtime).

    The short path, when the admission probe found a free slot and nobody
    queued: small audio is decoded with its header before the request queues
    (:func:`audio_inspect_and_decode`: one pool hop instead of two; should the request queue
    after all, it holds its decoded samples, counted in the decode budget, while it waits), and
    the run is offered with the enqueue (``runs.offer_run``): granted at once on a model ready on a
    live worker whose registration is still the probed one, it is on that worker's queue in the
    grant's own step, one round trip instead of two.

    Args:
        meta: published registration of the model.
        audio_input: the uploaded audio, decoded once the request holds its slot (or before it
            queues, above).
        options: validated request options (merged with defaults on the worker).
        request_timeout_ms: the request's ``busy_timeout_ms`` (None = not given).
        probe: the request's admission probe (:func:`request_probe`), for the short path.
        answer: this run's result is the request's answer (a view that makes one run per request): the
            worker that serves it records the answer's metrics and activity row itself
            (``metrics.answer_record``; ``Outcome.recorded``), and the queue wait is observed here only
            when it does not.

    Raises:
        ServerBusy: queue timeout or overdue fail-fast (R3.2, R3.3), the
            worker was lost, or the decode budget is full (``decode_budget``).
        UnsupportedMedia, PayloadTooLarge, InvalidRequest: the audio (see
            :func:`audio_inspect`, before queueing, and :func:`audio_decode`,
            after the grant; the lease is then given back).
        ModelLoadFailed: the model could not be loaded.
        InvalidRequest: the adapter refused the request's options, or the registration does not serve
            offline requests (its ``modes``; ``param`` ``model``).
        NotFound: the model was unregistered while the request waited.
        Conflict: the model changed family or task while the request waited.
    """
    model_id = meta["id"]
    spec = specs.require_spec(meta["family"])  # looked up once for the whole request
    modes = meta.get("modes") or spec["modes"]  # specs.registration_modes, with the spec in hand
    if "offline" not in modes:
        raise InvalidRequest(f"model {model_id!r} serves only streams (its modes: {', '.join(modes)}); "
                             "use its streaming route", param="model")
    timeout_ms = effective_timeout_ms(request_timeout_ms, published.ceiling_ms(meta))
    header, run_input, offered = await _prepare_input(ctx, meta, spec, audio_input, options, probe, answer)
    handover = runs.Handover()
    lease, offered = await _acquire(ctx, model_id, timeout_ms, run_input, offered, handover, answer)
    recorded = False
    try:
        async with ctx.scheduler.keep_alive(model_id, lease.lease_id):
            await _bind(ctx, meta, lease)
            if run_input is None:
                run_input = await audio_decode(audio_input, header, spec, options)
                _answer_record(run_input, meta, answer, lease.waited_ms)
            reply, load_ms = await _dispatch(ctx, model_id, lease, timeout_ms, run_input, offered, handover)
        error = reply_error(model_id, reply, "request")
        if error is not None:
            raise error
        recorded = bool(reply.get("recorded"))
        metrics.timing_note(recorded=recorded)
        return Outcome(reply["result"], lease.waited_ms, load_ms, reply["inference_ms"], reply["slot"],
                       reply["worker"], run_input.audio_ms, recorded)
    finally:
        if answer and not recorded and not (run_input is not None and run_input.recorded_unread):
            # leases.acquire left the granted request's wait to this call (or to the worker that recorded it)
            metrics.record_soon(metrics.observe(metrics.QUEUE_WAIT, lease.waited_ms / 1000, model_id))
        if run_input is not None:
            run_input.release_samples()  # its budget reservation, if the samples never reached Redis
        if not handover.sent:
            await asyncio.shield(_give_back(ctx, model_id, lease.lease_id, run_input))


def _answer_record(run_input: runs.RunInput | None, meta: dict, answer: bool, queue_ms: float) -> None:
    """Put the answer the worker records (``metrics.answer_record``) on ``run_input``, for a request whose
    run is its answer (``answer``) inside an API view that counts requests."""
    if answer and run_input is not None:
        run_input.record = metrics.answer_record(meta["task"], run_input.audio_ms / 1000)
        if run_input.record is not None:
            run_input.record["queue_ms"] = queue_ms


async def _prepare_input(ctx: AsyncContext, meta: dict, spec: dict, audio_input: AudioInput, options: dict,
                         probe: AdmissionProbe | None, answer: bool = False
                         ) -> tuple[audio.AudioHeader, runs.RunInput | None, runs.OfferedRun | None]:
    """The upload's header and, on :func:`request_run`'s short path (a free slot at the probe), its samples decoded
    now and the run offered with the enqueue (None when not offered: large samples, or decoded later). A run
    offered is handed over only when granted at once: its answer record (``answer``) waited 0 ms."""
    if probe is not None and probe.free:
        header, run_input = await audio_inspect_and_decode(audio_input, spec, options)
        _answer_record(run_input, meta, answer, 0.0)
        offered = runs.offer_run(ctx, meta["id"], run_input, probe.entry_json) if run_input is not None else None
        return header, run_input, offered
    return await audio_inspect(audio_input, spec), None, None


async def _acquire(ctx: AsyncContext, model_id: str, timeout_ms: int, run_input: runs.RunInput | None,
                   offered: runs.OfferedRun | None, handover: runs.Handover, answer: bool = False
                   ) -> tuple[Lease, runs.OfferedRun | None]:
    """Acquire the request's lease (the run ``offered`` with the enqueue); returns it and the offer when the
    grant took the run (``handover`` then sent), else None. On failure the samples and the offer are given
    back before the error propagates.

    Raises:
        ServerBusy: queue timeout or overdue fail-fast (R3.2, R3.3); see ``inference.runtime.leases.acquire``.
    """
    try:
        lease = await leases.acquire(ctx, model_id, timeout_ms, offer=offered.offer if offered else None,
                                     observe_wait=not answer)
    except BaseException:
        if run_input is not None:
            run_input.release_samples()
        if offered is not None:
            offered.withdraw(ctx)
        raise
    if run_input is not None and run_input.record is not None:  # dispatched after this wait (0: granted at once)
        run_input.record["queue_ms"] = lease.waited_ms
    if offered is None or run_input is None:
        return lease, offered
    if lease.dispatched:
        offered.taken(run_input, handover)
        return lease, offered
    offered.withdraw(ctx)
    return lease, None


async def _bind(ctx: AsyncContext, meta: dict, lease: Lease) -> None:
    """Check that the registration ``lease`` is bound to is still the one the request was prepared for: a
    manager ahead of it may have unregistered or reconfigured the model (R2.3). A lease granted at once
    carries the registration read in the grant's own step.

    Raises:
        NotFound: the model was unregistered while the request waited.
        Conflict: the model changed family or task while the request waited.
    """
    model_id = meta["id"]
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


async def _dispatch(ctx: AsyncContext, model_id: str, lease: Lease, timeout_ms: int, run_input: runs.RunInput,
                    offered: runs.OfferedRun | None, handover: runs.Handover) -> tuple[dict, float]:
    """Run ``run_input`` on the worker owning the model's pool, loading it first if needed, and return the
    worker's reply with the ms spent loading. A run ``offered`` with the grant is on its worker's queue
    already; a pool lost before its worker took the run is loaded once more.

    Raises:
        ServerBusy: (code ``worker_lost``) the worker stopped responding, or the pool was lost twice.
        ModelLoadFailed, ServerBusy, InsufficientMemory: the load (:func:`model_ensure_loaded`).
    """
    load_ms = 0.0
    ready_on = lease.ready_on
    for attempt in range(2):
        if ready_on is not None:  # ready on a live worker when granted: nothing to load
            placement = loads.Placement(*ready_on, load_ms=0.0)
            ready_on = None
        else:
            left_ms = max(1, timeout_ms - int(lease.waited_ms)) if timeout_ms else 0
            placement = await model_ensure_loaded(ctx, model_id, room_timeout_ms=left_ms)
        load_ms += placement.load_ms
        if attempt == 0 and offered is not None:  # handed over with the grant
            try:
                reply = await runs.run_reply(ctx, run_input.request_id, placement, offered.wake, model_id,
                                             lease.lease_id, run_input)
            finally:
                offered.withdraw(ctx)
        else:
            reply = await runs.run_on_worker(ctx, model_id, lease.lease_id, placement, run_input, handover)
        if reply is None:
            # The owner stopped beating while it ran our request. It may be frozen rather than dead, so its
            # run could still finish and release this lease later: never reuse the lease; give it back
            # and answer 503 (R7.4).
            handover.sent = False
            await ctx.scheduler.mark_unloaded(model_id, placement.boot, "worker lost")
            raise WorkerLost(f"model {model_id!r}: its worker stopped responding; retry")
        if reply.get("kind") == runs.RunFailure.NOT_LOADED:
            # The owner never took the run (its pool is gone): the lease is still ours alone; forget the
            # pool and load again once.
            handover.sent = False
            await ctx.scheduler.mark_unloaded(model_id, placement.boot, "pool lost")
            continue
        return reply, load_ms
    raise WorkerLost(f"model {model_id!r}: its pool was lost twice; retry later")


RUN_FAILURE_BUSY: dict[str, type[ServerBusy]] = {runs.RunFailure.EXPIRED: RunExpired,
                                                 runs.RunFailure.CANCELLED: RunCancelled,
                                                 runs.RunFailure.CRASHED: ModelCrashed,
                                                 runs.RunFailure.DEADLINE: RunDeadline}
"""The 503 of each failed run ``kind`` that is neither the input's fault nor a bug (``runs.RunFailure``;
``not_loaded`` never reaches :func:`reply_error`: its callers load again, or answer ``worker_lost``)."""


def reply_error(model_id: str, reply: dict, serving: str) -> ApplicationError | None:
    """The error a failed run ``reply`` maps to, or None when it succeeded (``serving`` names what it served:
    "request", "turn").

    Returns:
        ``invalid_input`` → InvalidRequest (400, ``param`` from the adapter); ``error`` (an adapter failed
        on valid input: a bug, reported as such) → ApplicationError (500); any other kind (``expired``,
        ``cancelled``) → the ServerBusy whose code is that kind (503, :data:`RUN_FAILURE_BUSY`).
    """
    if reply["ok"]:
        return None
    if reply["kind"] == runs.RunFailure.INVALID_INPUT:
        return InvalidRequest(reply["message"], param=reply.get("param"))
    if reply["kind"] == runs.RunFailure.ERROR:
        return ApplicationError(f"model {model_id!r} failed: {reply['message']}")
    return RUN_FAILURE_BUSY[reply["kind"]](f"model {model_id!r} could not serve the {serving}: {reply['message']}")
