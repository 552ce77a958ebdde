"""Every family's request has a bound on worker memory, proved with the worst input the limits allow;
a long run whose client left frees its slot; a diarization's windows are bounded and its clustering
never stalls the web event loop.

One real stack (``manage.py serve``, PostgreSQL, Redis db 2, the packaged models). The stack's
``max_audio_seconds`` is ``MAX_AUDIO_S`` (60 s), not the default 30 min, so the module stays near
two minutes on a 2-core machine (whisper on noise at its widest options would take minutes per
30 min of audio): what grows with the audio's length is the input itself (4 bytes per sample
in the worker, 64 KB per second at 16 kHz; ``docs/operations.md``, "Memory per request"), on top of
the per-request bounds asserted here. Each case first serves a small request of its model (its
one-time allocations), then resets the worker's peak RSS (``/proc/<pid>/clear_refs`` 5) and sends
the worst input; the growth of the peak over the RSS before the request must stay under the
family's bound (``REQUEST_BOUND_MB``, the measured peak with margin, stated in
``docs/operations.md``).
"""
from __future__ import annotations

import asyncio
import base64
import time
from pathlib import Path

import httpx
import numpy as np
import pytest

from .support.audio import wav_bytes
from .support.bounds import MODEL_S, run, until
from .support.clients import error_of
from .support.stacks import Stack, run_stack, web_pid, worker_pid

MAX_AUDIO_S = 60.0
RATE_HZ = 16000
MUSIC_RATE_HZ = 22050
MAX_SEGMENTS = 2000  # speaker_embedding's ``segments`` maxItems
MAX_SEGMENTS_TOTAL_S = 3600  # its ``maxTotalSpanS``

MODELS = [
    {"id": "whisper", "family": "whisper", "task": "asr"},
    {"id": "vad", "family": "silero_vad", "task": "vad"},
    {"id": "emb", "family": "speaker_embedding", "task": "speaker_embedding"},
    {"id": "bp", "family": "basic_pitch", "task": "music_transcription"},
    {"id": "diar", "family": "diarization", "task": "diarization",
     "load_options": {"vad_model": "vad", "embedding_model": "emb"}},
]

REQUEST_BOUND_MB = {"whisper": 300, "silero_vad": 50, "speaker_embedding": 200, "basic_pitch": 350,
                    "basic_pitch_most_notes": 350, "diarization": 200}
"""Peak growth of the worker's RSS over one request of each family, in MB (docs/operations.md, "Memory
per request": measured +173, +0, +55..85, +224 and +1 with this module's inputs). The diarization's is its
component steps' (its pipeline runs nothing on the worker)."""
EXPECTED_STATUS = {"basic_pitch_most_notes": 400}
"""Worst cases refused while running, within the bound: noise at the lowest thresholds passes
``basic_pitch.MAX_NOTES`` (400 naming onset_threshold)."""

DIARIZATION_WEB_BOUND_MB = 100
"""Peak growth of the web process's RSS over the worst diarization (clustering and turns), in MB
(measured +14)."""

DIARIZATION_S = 60.0
"""The worst diarization answers within this many seconds (measured 12 s on a loaded 2-core machine)."""

LOOP_STALL_S = 0.5
"""Longest a ``/health`` may take while the worst diarization runs (the web event loop keeps turning)."""

LEFT_RUN_FREED_S = 3.0
"""A long embedding whose client left gives its slot back within this many seconds (one batch of
32 windows is about 0.2 s; a run asks for the stop marker at most every 0.1 s)."""


@pytest.fixture(scope="module")
def mstack(tmp_path_factory) -> Stack:
    yield from run_stack(tmp_path_factory.mktemp("membounds"), MODELS, redis_db=2, name="membounds",
                         extra_config={"max_audio_seconds": MAX_AUDIO_S, "max_request_body_bytes": 16_000_000})


def noise(seconds: float, rate: int = RATE_HZ, seed: int = 0) -> np.ndarray:
    """Full-scale white noise (the loudest input; just under 1.0 so 16-bit PCM does not clip)."""
    return np.random.default_rng(seed).uniform(-0.99, 0.99, int(seconds * rate)).astype(np.float32)


def speech_of(speech, seconds: float) -> np.ndarray:
    """The fixtures' utterances repeated to exactly ``seconds`` (16 kHz)."""
    parts, total = [], 0
    while total < seconds * RATE_HZ:
        for utt in speech:
            parts.append(utt.samples)
            total += len(utt.samples)
    return np.concatenate(parts)[: int(seconds * RATE_HZ) - 1]


def longest(samples: np.ndarray) -> np.ndarray:
    """``samples`` cut to one sample under ``MAX_AUDIO_S`` (the limit refuses ``int(max * rate)`` frames)."""
    return samples[: int(MAX_AUDIO_S * RATE_HZ) - 1]


def task(client: httpx.Client, model: str, data: bytes, **options) -> httpx.Response:
    return client.post("/v1/tasks/run", json={"model": model, "request": {
        "audio_base64": base64.b64encode(data).decode(), "options": options}})


def reset_peak(pid: int) -> int:
    """Reset process ``pid``'s peak RSS (``VmHWM``) to its current RSS; return that RSS in bytes."""
    Path(f"/proc/{pid}/clear_refs").write_text("5")
    return _status_kb(pid, "VmRSS") * 1024


def peak(pid: int) -> int:
    """Process ``pid``'s peak RSS since the last :func:`reset_peak`, in bytes."""
    return _status_kb(pid, "VmHWM") * 1024


def _status_kb(pid: int, field: str) -> int:
    for line in Path(f"/proc/{pid}/status").read_text().splitlines():
        if line.startswith(field + ":"):
            return int(line.split()[1])
    raise AssertionError(f"no {field} in /proc/{pid}/status")


def worst_cases(speech) -> dict[str, tuple[str, bytes, dict]]:
    """Per family: (model, the worst input the limits allow, its widest options)."""
    longest_speech = wav_bytes(speech_of(speech, MAX_AUDIO_S), RATE_HZ)
    music_noise = wav_bytes(noise(MAX_AUDIO_S, MUSIC_RATE_HZ)[: int(MAX_AUDIO_S * MUSIC_RATE_HZ) - 1], MUSIC_RATE_HZ)
    loud = wav_bytes(longest(noise(MAX_AUDIO_S)), RATE_HZ)
    # As many segments as allowed, over the whole audio; the whole input embedded too. Their total
    # (MAX_SEGMENTS x 0.5 s) stays under the time a module can spend: a clip's memory does not grow
    # with its length (windows run in fixed batches), the count is what grows the answer.
    step_s = (MAX_AUDIO_S - 0.5) / MAX_SEGMENTS
    segments = [{"start_s": round(i * step_s, 4), "end_s": round(i * step_s + 0.5, 4)} for i in range(MAX_SEGMENTS)]
    return {
        "whisper": ("whisper", longest_speech, {"beam_size": 10, "word_timestamps": True, "temperature": 0,
                                                "prompt": "word " * 400}),
        "silero_vad": ("vad", loud, {"threshold": 0.05, "min_speech_duration_ms": 0,
                                     "min_silence_duration_ms": 0, "speech_pad_ms": 5000}),
        "speaker_embedding": ("emb", loud, {"whole": True, "segments": segments}),
        # Every threshold at its lowest finds more notes than MAX_NOTES in this much noise: refused (400)
        # within the bound; the widest request still served is the noise at the default thresholds.
        "basic_pitch": ("bp", music_noise, {"include_pitch_bends": True, "midi": True, "minimum_note_length_ms": 0}),
        "basic_pitch_most_notes": ("bp", music_noise, {"onset_threshold": 0.05, "frame_threshold": 0.05,
                                                       "minimum_note_length_ms": 0, "include_pitch_bends": True,
                                                       "midi": True}),
        "diarization": ("diar", longest_speech, {"hop_s": 0.1, "window_s": 0.5, "vad_threshold": 0.05,
                                                 "min_speech_duration_ms": 0, "min_silence_duration_ms": 0,
                                                 "max_speakers": 32}),
    }


@pytest.mark.parametrize("family", [f for f in REQUEST_BOUND_MB if f != "diarization"])
def test_the_worst_allowed_request_of_each_family_stays_under_its_worker_memory_bound(mstack, speech, family):
    """The worker's peak RSS grows by less than the family's bound over its worst allowed request
    (longest audio, loudest input, every option at its limit), and the request is answered 200 (or the
    400 of :data:`EXPECTED_STATUS`: a request past a work limit found while running)."""
    model, data, options = worst_cases(speech)[family]
    pid = worker_pid(mstack)
    with mstack.client(timeout=4 * MODEL_S) as client:
        warm = task(client, model, wav_bytes(speech[0].samples, RATE_HZ))
        assert warm.status_code == 200, warm.text
        base = reset_peak(pid)
        started = time.monotonic()
        resp = task(client, model, data, **options)
        took_s = time.monotonic() - started
    grown_mb = (peak(pid) - base) / 1e6
    print(f"{family}: +{grown_mb:.0f} MB peak over {base / 1e6:.0f} MB in {took_s:.1f} s")
    assert resp.status_code == EXPECTED_STATUS.get(family, 200), resp.text[:400]
    assert grown_mb < REQUEST_BOUND_MB[family], f"{family}: worker peak +{grown_mb:.0f} MB"


def test_the_worst_diarization_is_bounded_in_time_and_memory_and_keeps_the_web_loop_turning(mstack, speech):
    """Diarization at the smallest ``hop_s`` and window on the longest allowed speech, every VAD option
    at its limit: answered within ``DIARIZATION_S``, the worker's and the web process's peak RSS
    under their bounds, and ``/health`` answering within ``LOOP_STALL_S`` all along (clustering and
    turns run off the event loop)."""
    model, data, options = worst_cases(speech)["diarization"]
    wpid, webpid = worker_pid(mstack), web_pid(mstack)
    with mstack.client(timeout=4 * MODEL_S) as client:
        warm = task(client, model, wav_bytes(speech[0].samples, RATE_HZ))
        assert warm.status_code == 200, warm.text
    base_worker, base_web = reset_peak(wpid), reset_peak(webpid)

    async def scenario():
        async with httpx.AsyncClient(base_url=mstack.url, timeout=4 * MODEL_S) as client:
            started = time.monotonic()
            job = asyncio.ensure_future(client.post("/v1/tasks/run", json={"model": model, "request": {
                "audio_base64": base64.b64encode(data).decode(), "options": options}}))
            health_s = []
            while not job.done():
                at = time.monotonic()
                assert (await client.get("/health")).status_code == 200
                health_s.append(time.monotonic() - at)
                await asyncio.sleep(0.05)
            return await job, time.monotonic() - started, health_s
    resp, took_s, health_s = run(scenario(), 4 * MODEL_S)
    worker_mb, web_mb = (peak(wpid) - base_worker) / 1e6, (peak(webpid) - base_web) / 1e6
    print(f"diarization: {took_s:.1f} s, worker +{worker_mb:.0f} MB, web +{web_mb:.0f} MB, "
          f"slowest /health {max(health_s):.3f} s of {len(health_s)}")
    assert resp.status_code == 200, resp.text[:400]
    assert resp.json()["speaker_turns"]
    assert took_s < DIARIZATION_S
    assert worker_mb < REQUEST_BOUND_MB["diarization"] and web_mb < DIARIZATION_WEB_BOUND_MB
    assert max(health_s) < LOOP_STALL_S


def test_a_long_embedding_whose_client_left_frees_its_slot_within_a_batch(mstack):
    """R8.2: an embedding of the longest audio with segments at their total-duration limit (about a
    minute of work) whose client leaves after 1 s stops at its next batch: the slot is free within
    ``LEFT_RUN_FREED_S``, and the next request is served at once."""
    step_s = (MAX_AUDIO_S - 1.79) / MAX_SEGMENTS
    segments = [{"start_s": round(i * step_s, 4), "end_s": round(i * step_s + 1.79, 4)} for i in range(MAX_SEGMENTS)]
    assert sum(seg["end_s"] - seg["start_s"] for seg in segments) <= MAX_SEGMENTS_TOTAL_S
    data = wav_bytes(longest(noise(MAX_AUDIO_S)), RATE_HZ)

    async def scenario():
        async with httpx.AsyncClient(base_url=mstack.url, timeout=httpx.Timeout(MODEL_S, read=1.0)) as impatient:
            with pytest.raises(httpx.ReadTimeout):
                await impatient.post("/v1/tasks/run", json={"model": "emb", "request": {
                    "audio_base64": base64.b64encode(data).decode(), "options": {"segments": segments}}})
        left_at = time.monotonic()
        assert mstack.counters("emb")["leases"] == 1  # it was running when the client left
        await until(lambda: mstack.counters("emb")["leases"] == 0, timeout_s=30)
        return time.monotonic() - left_at
    freed_s = run(scenario())
    print(f"slot freed {freed_s:.2f} s after the client left")
    assert freed_s < LEFT_RUN_FREED_S
    with mstack.client() as client:
        resp = task(client, "emb", wav_bytes(noise(2.0), RATE_HZ))
    assert resp.status_code == 200, resp.text


def test_segments_over_the_count_or_total_duration_limit_are_refused_before_queueing(mstack):
    """``segments`` beyond ``maxItems`` (2,000) or lasting more than ``maxTotalSpanS`` (3,600 s)
    together is a 400 in the error shape naming ``segments``, and nothing stays held."""
    data = wav_bytes(noise(2.0), RATE_HZ)
    too_many = [{"start_s": 0.0, "end_s": 0.1}] * (MAX_SEGMENTS + 1)
    too_long = [{"start_s": 0.0, "end_s": 1.9}] * 1896  # 3,602.4 s
    with mstack.client() as client:
        for segments, says in ((too_many, "too long"), (too_long, "the limit is 3600 s")):
            error = error_of(task(client, "emb", data, segments=segments), (400,))
            assert "segments" in error["param"] and says in error["message"], error
    assert mstack.counters("emb") == {"leases": 0, "queued": 0}
