"""Pipelines (diarization): requests served in the web process through their component models' slots.

``diarization_run`` serves a ``diarization`` pipeline (VAD component, embedding component, clustering);
``transcription_with_speakers_run`` a transcription labelled with speakers (``/v1/audio/transcriptions/details``).
"""
from __future__ import annotations

import asyncio

import numpy as np

from audiosite.errors import Conflict, InvalidRequest, NotFound
from inference import diarization, specs
from inference.runtime import leases, published
from inference.runtime.context import AsyncContext
from inference.scheduler import effective_timeout_ms

from .audio_input import AudioInput, audio_inspect
from .loading import model_ensure_loaded
from .request import Outcome, request_model_resolve, request_run

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
    """The published registration of one component, checked (see :func:`diarization_run`)."""
    try:
        meta = await request_model_resolve(ctx, model_id, request_timeout_ms)
    except NotFound:
        raise Conflict(f"pipeline {pipeline_id!r} names {role} {model_id!r}, which is not registered",
                       param="model") from None
    if meta["family"] != family:
        raise Conflict(f"pipeline {pipeline_id!r} names {role} {model_id!r} of family {meta['family']!r}; "
                       f"it needs a {family!r} model", param="model")
    return meta


async def diarization_run(ctx: AsyncContext, meta: dict, audio_input: AudioInput, options: dict,
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
        As :func:`request_run`; Conflict (409) when a component is not registered or
        is of the wrong family.
    """
    model_id = meta["id"]
    opts = {**specs.request_defaults(meta["family"]), **(meta.get("default_request_options") or {}), **options}
    timeout_ms = effective_timeout_ms(request_timeout_ms, published.ceiling_ms(meta))
    await audio_inspect(audio_input, specs.require_spec(meta["family"]))
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
            placement = await model_ensure_loaded(ctx, model_id, room_timeout_ms=left_ms)
            steps, regions, turns = await _speaker_turns(ctx, model_id, current["load_options"], audio_input, opts,
                                                         request_timeout_ms)
    finally:
        await asyncio.shield(ctx.scheduler.release(model_id, lease.lease_id))
    vad = steps[0]
    speakers = sorted({turn["speaker"] for turn in turns})
    result = {"speaker_turns": turns, "speakers": speakers, "num_speakers": len(speakers),
              "segments": [{"start_s": s, "end_s": e} for s, e in regions],
              "duration": vad.result["duration"], "sample_rate": vad.result["sample_rate"]}
    return Outcome(result, lease.waited_ms + sum(step.queue_ms for step in steps),
                   placement.load_ms + sum(step.load_ms for step in steps),
                   round(sum(step.inference_ms for step in steps), 3), 0, "web", vad.audio_ms)


async def _speaker_turns(ctx: AsyncContext, pipeline_id: str, parts: dict, audio_input: AudioInput, opts: dict,
                         request_timeout_ms: int | None
                         ) -> tuple[list[Outcome], list[tuple[float, float]], list[dict]]:
    """The component steps of :func:`diarization_run` (pipeline ``pipeline_id``, its ``load_options`` ``parts``):
    speech regions from the VAD component, then, when there are windows, their embeddings from the embedding
    component, clustered into speaker turns. Returns ``(steps' outcomes (VAD first), regions
    [(start_s, end_s)], turns)``."""
    vad_meta = await _component(ctx, pipeline_id, "vad_model", parts["vad_model"], "silero_vad", request_timeout_ms)
    vad = await request_run(ctx, vad_meta, audio_input, {
        "threshold": opts["vad_threshold"], "min_speech_duration_ms": opts["min_speech_duration_ms"],
        "min_silence_duration_ms": opts["min_silence_duration_ms"]}, request_timeout_ms)
    steps = [vad]
    regions = [(seg["start_s"], seg["end_s"]) for seg in vad.result["segments"]]
    windows = _embedding_windows(regions, opts)
    turns: list[dict] = []
    if windows:
        embed_meta = await _component(ctx, pipeline_id, "embedding_model", parts["embedding_model"],
                                      "speaker_embedding", request_timeout_ms)
        embedded = await request_run(ctx, embed_meta, audio_input, {
            "whole": False, "segments": [{"start_s": s, "end_s": e} for s, e, _ in windows]},
            request_timeout_ms)
        steps.append(embedded)
        vectors = np.asarray([seg["embedding"] for seg in embedded.result["segments"]], dtype=np.float32)
        turns = await diarization.cluster_and_turn(
            windows, vectors, regions, num_speakers=opts["num_speakers"],
            distance_threshold=float(opts["distance_threshold"]), max_speakers=int(opts["max_speakers"]))
    return steps, regions, turns


def _embedding_windows(regions: list[tuple[float, float]], opts: dict) -> list:
    """The embedding windows over the speech ``regions`` (``inference.diarization.bounded_windows``): they fit
    one embedding step within the embedding family's own limits (its segments' count and total duration);
    the hop widens when they would not.

    Raises:
        InvalidRequest: even the widest hop gives too many windows (``param`` min_silence_duration_ms).
    """
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
    return windows


async def transcription_with_speakers_run(ctx: AsyncContext, asr_meta: dict, pipeline_meta: dict | None,
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
        As :func:`request_run` and :func:`diarization_run`.
    """
    asr = await request_run(ctx, asr_meta, audio_input, {**options, "word_timestamps": True}, request_timeout_ms)
    steps = [asr]
    turns: list[dict] = []
    if pipeline_meta is not None:
        diarized = await diarization_run(ctx, pipeline_meta, audio_input, {}, request_timeout_ms)
        steps.append(diarized)
        turns = diarized.result["speaker_turns"]
    rate = int(specs.require_spec(asr_meta["family"])["sample_rate_hz"])
    return Outcome(diarization.label_words(asr.result, turns, rate), sum(step.queue_ms for step in steps),
                   sum(step.load_ms for step in steps), round(sum(step.inference_ms for step in steps), 3),
                   asr.slot, asr.worker, asr.audio_ms)
