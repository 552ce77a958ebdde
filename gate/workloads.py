"""Per-family workloads of the validation gate and the performance report, in one place.

A workload says, for one family: how to register it (task, load options, the components of a
pipeline family), the requests a run sends (inputs of different lengths from ``samples/``, and
options from the family's ``request_options`` in ``model_specs/<family>.json``), which output fields
are volatile (left out of the exact comparison, each with its reason), an invalid request, and a
registration that fails at load time (the recovery check M4).

The comparison rule is fixed here, before any run, and recorded in each evidence record's manifest:
the JSON answer minus the named volatile fields must be equal byte for byte (text exactly, audio as
the same base64 bytes, floats as the same JSON numbers). It is never relaxed after a mismatch.

Inputs are WAV files (16-bit PCM, mono) built in memory from the shipped LibriSpeech sample
(``samples/librispeech_test_clean_6930-75918-0000.wav``, 16 kHz, 3.5 s) by slicing, padding,
concatenating and scaling; their SHA-256 go into the manifest. Music transcription also gets a
synthetic plucked melody (22,050 Hz) made by :func:`melody`.
"""
from __future__ import annotations

import base64
import functools
import hashlib
import io
import json
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import soundfile
from django.conf import settings

SAMPLE = Path(settings.BASE_DIR) / "samples" / "librispeech_test_clean_6930-75918-0000.wav"
TIMING_REASON = "wall-clock and queue times of this request (ms): vary with load by design"


@dataclass(frozen=True)
class Item:
    """One request of a workload.

    Attributes:
        name: unique within the workload (used in raw-output file names).
        source: an input name of :func:`inputs` (audio families) or the text to speak (``tts``).
        options: ``request.options`` (validated against the family's ``request_options``).
        route: how a streaming workload sends it (``gate/streaming.py``): ``"sse"`` (``POST
            /v1/audio/transcriptions`` with ``stream=true``), ``"realtime"`` (a turn over ``/v1/realtime``),
            ``"speech"`` (``POST /v1/audio/speech`` with ``stream_format=sse``); ``"run"`` (``POST
            /v1/tasks/run``) for offline workloads.
    """

    name: str
    source: str
    options: dict = field(default_factory=dict)
    route: str = "run"


@dataclass(frozen=True)
class Workload:
    """What the gate sends to one family and how it compares answers.

    Attributes:
        family / task / mode: the registration's family, task and mode.
        items: the requests (at least 4, so a 4-slot wave has 4 different ones).
        volatile: output field -> why it may differ between equal requests (never compared).
        load_options: the registration's ``load_options``.
        components: extra registrations a pipeline needs (their ``slots`` follow the count).
        text_input: the family takes ``request.text`` (tts) instead of audio.
        invalid: a request body's ``request`` part that must get a 4xx.
        bad_load: how to make a registration that fails at load: ``"file"`` (a garbage checkpoint
            file), ``"directory"`` (an empty checkpoint folder) or a dict of ``load_options``.
        hold_load: a load option that holds the load at a named barrier (the fixture family's
            ``load_barrier``), so an unload can be sent while a load is surely in progress; None for
            real models (their own load time is the window).
        bad_component: for a pipeline, a component registration that gets the garbage checkpoint file;
            ``bad_load`` then names it among the pipeline's components, so the first request fails
            to load that component (a real load failure; the pipeline itself has no weights).
        batch_invalid_options: request options that pass the web process's checks but make the model
            refuse the request (a 4xx raised inside the session call), for the batch run's "a bad request
            in a batch fails alone" (``gate/batching.py``); None when the family has none.
    """

    family: str
    task: str
    items: tuple[Item, ...]
    volatile: dict
    mode: str = "offline"
    load_options: dict = field(default_factory=dict)
    components: tuple[dict, ...] = ()
    text_input: bool = False
    invalid: dict = field(default_factory=lambda: {"audio_base64": base64.b64encode(b"not audio at all" * 64).decode()})
    bad_load: str | dict = "file"
    hold_load: str | None = None
    bad_component: dict | None = None
    batch_invalid_options: dict | None = None

    def registration(self, model_id: str, slots: int | None, **extra) -> dict:
        """The ``server.json`` / ``POST /v1/models/load`` entry for ``model_id`` (no ``slots`` key when
        ``slots`` is None: the legacy runtime refuses an explicit count)."""
        entry = {"id": model_id, "family": self.family, "task": self.task, "mode": self.mode, **extra}
        if self.load_options and "load_options" not in extra:
            entry["load_options"] = dict(self.load_options)
        if slots is not None:
            entry["slots"] = slots
        return entry

    def component_registrations(self, slots: int | None) -> list[dict]:
        """The pipeline's component registrations (empty for a single-model family)."""
        out = []
        for comp in self.components:
            entry = dict(comp)
            if slots is not None:
                entry["slots"] = slots
            out.append(entry)
        return out

    def body(self, model_id: str, item: Item) -> dict:
        """The ``POST /v1/tasks/run`` body of ``item`` for ``model_id``."""
        request: dict = {"options": dict(item.options)}
        if self.text_input:
            request["text"] = item.source
        else:
            request["audio_base64"] = base64.b64encode(inputs()[item.source]).decode()
        return {"model": model_id, "request": request}

    def comparable(self, payload: dict) -> dict:
        """``payload`` without the volatile fields and ``model`` (top level; the rule named in the manifest)."""
        return {k: v for k, v in payload.items() if k not in self.volatile and k != "model"}

    def rule(self) -> dict:
        """The comparison rule as recorded in the manifest."""
        if self.mode == "streaming":
            return {"compare": "each stream's result (whisper: the final text of transcript.text.done or of the "
                               "realtime turn's completed event; piper: SHA-256 and length of the PCM of every "
                               "speech.audio.delta joined) equal byte for byte to the offline answer of the same "
                               "input and options (whisper: POST /v1/audio/transcriptions without stream; piper: "
                               "POST /v1/tasks/run, its WAV's PCM); the stream's deltas joined in order must equal "
                               "its final text (else the result carries stream_problem and differs)",
                    "volatile_fields": {"timing": TIMING_REASON, "usage": "not compared"},
                    "relaxed_after_mismatch": False}
        return {"compare": "JSON answer of POST /v1/tasks/run minus the volatile fields, equal byte for byte "
                           "(canonical JSON, sorted keys); HTTP status 200 required",
                "identity_field": {"model": "echoes the registration id; the gate sends the same workload to "
                                            "several ids (recovery checks), so it is left out"},
                "volatile_fields": self.volatile, "relaxed_after_mismatch": False}


def canonical(payload: dict) -> bytes:
    """Canonical JSON bytes (sorted keys, no spaces) of a comparable answer."""
    return json.dumps(payload, sort_keys=True, separators=(",", ":"), ensure_ascii=False).encode()


def digest(payload: dict) -> str:
    """Hex SHA-256 of :func:`canonical`."""
    return hashlib.sha256(canonical(payload)).hexdigest()


def _wav(samples: np.ndarray, rate_hz: int) -> bytes:
    buffer = io.BytesIO()
    soundfile.write(buffer, samples, rate_hz, format="WAV", subtype="PCM_16")
    return buffer.getvalue()


def melody(rate_hz: int = 22050) -> np.ndarray:
    """A synthetic melody for music transcription: eight plucked tones (three harmonics of the
    equal-tempered pitch, A4 = 440 Hz; 5 ms attack, exponential decay e^(-3t)), shape ``(n,)`` float32
    at ``rate_hz``, about 5 s long."""
    notes = [(0.3, 60, 0.5), (0.9, 64, 0.5), (1.5, 67, 0.5), (2.1, 72, 0.7), (2.9, 62, 0.5), (3.5, 69, 0.6),
             (4.2, 55, 0.5), (4.8, 76, 0.5)]
    total = np.zeros(int(5.5 * rate_hz), np.float32)
    for onset_s, pitch, length_s in notes:
        t = np.arange(int(length_s * rate_hz)) / rate_hz
        hz = 440.0 * 2 ** ((pitch - 69) / 12)
        tone = sum(np.sin(2 * np.pi * hz * k * t) / k for k in (1, 2, 3)) * np.exp(-3 * t) * np.minimum(1.0, t / 0.005)
        start = int(onset_s * rate_hz)
        total[start:start + len(t)] += (0.25 * tone).astype(np.float32)
    return total


@functools.cache
def inputs() -> dict[str, bytes]:
    """Every input WAV by name (bytes). Speech from the shipped sample (16 kHz, 3.505 s):

    - ``speech``: the whole sample; ``speech_2s``: its first 2.0 s;
    - ``speech_x2``: the sample twice (7.0 s); ``speech_pad``: 0.5 s of silence, then the sample from 0.5 s;
    - ``speech_quiet``: 1.0 s to the end at half the amplitude;
    - ``speech_x10``: the sample ten times (35 s: two of Whisper's 30 s windows, so a stream of it has
      a step left after its first segments);
    - ``melody``: :func:`melody` at 22,050 Hz.
    """
    x, rate = soundfile.read(SAMPLE, dtype="float32")
    return {"speech": _wav(x, rate), "speech_2s": _wav(x[: 2 * rate], rate),
            "speech_x2": _wav(np.concatenate([x, x]), rate),
            "speech_pad": _wav(np.concatenate([np.zeros(rate // 2, np.float32), x[rate // 2:]]), rate),
            "speech_quiet": _wav(0.5 * x[rate:], rate), "speech_x10": _wav(np.tile(x, 10), rate),
            "melody": _wav(melody(22050), 22050)}


def fixtures_manifest(workload: Workload) -> dict:
    """Name -> ``{"sha256", "bytes"}`` of the inputs ``workload`` uses (texts for tts), plus the sample."""
    used = sorted({item.source for item in workload.items})
    out: dict[str, dict]
    if workload.text_input:
        out = {f"text:{i}": {"text": text, "sha256": hashlib.sha256(text.encode()).hexdigest()}
               for i, text in enumerate(used)}
    else:
        out = {name: {"sha256": hashlib.sha256(inputs()[name]).hexdigest(), "bytes": len(inputs()[name])}
               for name in used}
    out["source_sample"] = {"path": str(SAMPLE.relative_to(settings.BASE_DIR)),
                            "sha256": hashlib.sha256(SAMPLE.read_bytes()).hexdigest()}
    return out


_TEXTS = ("Concorde returned to its place amidst the tents.",
          "Hello there.",
          "The validation gate runs real servers. Every answer is compared with a serial reference, byte for byte.",
          "A short one, then a pause; and a longer clause that keeps going for a while before it stops.",
          "Four slots, four voices, one model.")

WORKLOADS: dict[str, Workload] = {
    "whisper": Workload(
        "whisper", "asr",
        items=(Item("speech", "speech"), Item("short_beam1", "speech_2s", {"beam_size": 1}),
               Item("long_words", "speech_x2", {"word_timestamps": True}),
               Item("pad_prompt", "speech_pad", {"prompt": "Concorde, tents."}),
               Item("quiet_en", "speech_quiet", {"language": "en", "beam_size": 2})),
        volatile={"timing": TIMING_REASON}, bad_load="directory",
        batch_invalid_options={"language": "de"}),  # tiny.en is English-only: the session refuses it
    "silero_vad": Workload(
        "silero_vad", "vad",
        items=(Item("speech", "speech"), Item("short_t03", "speech_2s", {"threshold": 0.3}),
               Item("long", "speech_x2", {"min_silence_duration_ms": 50, "speech_pad_ms": 0}),
               Item("pad_t07", "speech_pad", {"threshold": 0.7, "min_speech_duration_ms": 100}),
               Item("quiet", "speech_quiet", {"speech_pad_ms": 100})),
        volatile={"timing": TIMING_REASON}),
    "piper": Workload(
        "piper", "tts", text_input=True,
        # seed fixed in every item: seed null draws fresh noise by design (model_specs/piper.json)
        items=(Item("concorde", _TEXTS[0], {"seed": 1}),
               Item("hello_slow", _TEXTS[1], {"seed": 2, "length_scale": 1.2}),
               Item("long_pause", _TEXTS[2], {"seed": 3, "noise_scale": 0.5, "sentence_silence_s": 0.2}),
               Item("clause_fast", _TEXTS[3], {"seed": 4, "speed": 1.25}),
               Item("four", _TEXTS[4], {"seed": 5, "noise_w": 0.6})),
        volatile={"timing": TIMING_REASON}, invalid={"text": "", "options": {}}),
    "speaker_embedding": Workload(
        "speaker_embedding", "speaker_embedding",
        items=(Item("speech", "speech"), Item("short", "speech_2s"),
               Item("long_segments", "speech_x2", {"segments": [{"start_s": 0.5, "end_s": 2.0},
                                                                  {"start_s": 3.0, "end_s": 6.5}]}),
               Item("pad_segment_only", "speech_pad", {"whole": False, "segments": [{"start_s": 1.0, "end_s": 3.0}]}),
               Item("quiet", "speech_quiet")),
        volatile={"timing": TIMING_REASON}),
    "basic_pitch": Workload(
        "basic_pitch", "music_transcription",
        items=(Item("melody", "melody"), Item("speech", "speech", {"onset_threshold": 0.6}),
               Item("melody_midi", "melody", {"midi": True, "include_pitch_bends": True}),
               Item("melody_band", "melody", {"minimum_frequency_hz": 200.0, "melodia_trick": False}),
               Item("long", "speech_x2", {"frame_threshold": 0.4})),
        volatile={"timing": TIMING_REASON}),
    "diarization": Workload(
        "diarization", "diarization",
        load_options={"vad_model": "val-vad", "embedding_model": "val-emb"},
        components=({"id": "val-vad", "family": "silero_vad", "task": "vad"},
                    {"id": "val-emb", "family": "speaker_embedding", "task": "speaker_embedding"}),
        items=(Item("speech", "speech"), Item("long_one", "speech_x2", {"num_speakers": 1}),
               Item("pad_window", "speech_pad", {"window_s": 1.0, "hop_s": 0.5}),
               Item("quiet_threshold", "speech_quiet", {"distance_threshold": 0.4}),
               Item("long_vad", "speech_x2", {"vad_threshold": 0.6, "min_silence_duration_ms": 200})),
        volatile={"timing": TIMING_REASON},
        bad_component={"id": "val-vad-broken", "family": "silero_vad", "task": "vad"},
        bad_load={"vad_model": "val-vad-broken", "embedding_model": "val-emb"}),
    "fixture": Workload(
        "fixture", "fixture", load_options={"version": "v1"},
        items=(Item("a", "speech", {"tag": "a", "sleep_ms": 300}),
               Item("b", "speech_2s", {"tag": "b", "sleep_ms": 150}),
               Item("c", "speech_x2", {"tag": "c"}), Item("d", "speech_pad", {"tag": "d", "sleep_ms": 50}),
               Item("e", "speech_quiet", {"tag": "e", "sleep_ms": 200})),
        volatile={"timing": TIMING_REASON,
                  "slot": "which slot served the request: any free slot may (CONTRACT R2)",
                  "pool_id": "a fresh id per load by design (tells loads apart)",
                  "served_by_this_slot": "a per-slot counter: depends on which slot served",
                  "started_ns": "worker monotonic clock at run start",
                  "finished_ns": "worker monotonic clock at run end"},
        bad_load={"version": "v1", "fail_load": True}, hold_load="load_barrier"),
}


#: Streaming workloads (``validate_slots --mode streaming``). Options are those each route takes (the SSE
#: route: language, prompt, temperature; a realtime session: language, prompt; speech: speed, seed), so the
#: offline answer of the same input (``gate/streaming.py``, ``offline``) is defined with the same options.
STREAMING_WORKLOADS: dict[str, Workload] = {
    "whisper": Workload(
        "whisper", "asr", mode="streaming",
        items=(Item("sse_speech", "speech", {}, "sse"),
               Item("rt_short_en", "speech_2s", {"language": "en"}, "realtime"),
               Item("sse_long_en", "speech_x2", {"language": "en"}, "sse"),
               Item("rt_pad_prompt", "speech_pad", {"prompt": "Concorde, tents."}, "realtime"),
               Item("sse_quiet_prompt", "speech_quiet", {"prompt": "Concorde.", "temperature": 0}, "sse")),
        volatile={}, bad_load="directory"),
    "piper": Workload(
        "piper", "tts", text_input=True, mode="streaming",
        items=(Item("concorde", _TEXTS[0], {"seed": 1}, "speech"),
               Item("hello_slow", _TEXTS[1], {"seed": 2, "speed": 0.8}, "speech"),
               Item("long_pause", _TEXTS[2], {"seed": 3}, "speech"),
               Item("clause_fast", _TEXTS[3], {"seed": 4, "speed": 1.25}, "speech"),
               Item("four", _TEXTS[4], {"seed": 5}, "speech")),
        volatile={}, invalid={"text": "", "options": {}}),
}


def get_workload(family: str, mode: str = "offline") -> Workload:
    """The workload of ``family`` in ``mode`` (``offline``: :data:`WORKLOADS`; ``streaming``:
    :data:`STREAMING_WORKLOADS`).

    Raises:
        KeyError: no workload for that family and mode (the message lists the known ones).
    """
    table = STREAMING_WORKLOADS if mode == "streaming" else WORKLOADS
    try:
        return table[family]
    except KeyError:
        raise KeyError(f"no {mode} validation workload for family {family!r}; known: "
                       f"{', '.join(sorted(table))}") from None
