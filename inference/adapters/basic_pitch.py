"""Music transcription with Spotify's Basic Pitch (ICASSP 2022 "NMP" model, ONNX), notes and MIDI out.

Checkpoint: ``basic_pitch/saved_models/icassp_2022/nmp.onnx`` from the
``basic-pitch`` wheel, installed without its dependencies: the wheel's own
inference and note-creation modules import librosa, resampy and mir_eval
(and TensorFlow for its default model), none of which this server installs,
so we run the graph with our onnxruntime and extract notes here in our own
code, following the algorithm the Basic Pitch paper and package document.

Model I/O (read from the graph): input float32 ``(batch, 43844, 1)`` — one
window of 2 s minus one hop at 22,050 Hz; outputs per window of 172 frames
(hop 256 samples, about 86 frames per second) over the 88 piano keys from
MIDI 21 (A0, 27.5 Hz): ``note`` (frame activation) ``(batch, 172, 88)``,
``onset`` ``(batch, 172, 88)``, and ``contour`` ``(batch, 172, 264)`` (3 bins
per semitone, for pitch bends).

Windowing: the audio is prefixed with 3,840 zero samples (15 frames), cut
into windows every 36,164 samples (so neighbours overlap by 30 frames), and
the first and last 15 frames of every window's output are dropped before
the windows are joined. Frame ``k`` kept from window ``w`` stands for the
audio at sample ``w × 36164 + (k + 15) × 256 − 3840``; we compute each
frame's time from that, so joined windows do not drift.

Note extraction (our reading of Basic Pitch's documented method):

1. optionally add onsets inferred from the frame activations: the smaller of
   the one- and two-frame rises, scaled to the onset map's maximum;
2. onset candidates are local maxima in time of the onset map at or above
   ``onset_threshold``; they are taken latest first;
3. from each onset, a note lasts while the (not yet used) frame activation of
   its key stays at or above ``frame_threshold``, tolerating up to 11 frames
   below it; notes not longer than ``minimum_note_length_ms`` are dropped;
   a kept note's frames (and those of the keys beside it) are marked used;
4. optionally (the "melodia trick") notes without an onset are grown from
   the strongest unused frame activations, forwards and backwards, while
   any unused activation above ``frame_threshold`` remains;
5. a note's velocity is ``round(127 × mean frame activation)``; its pitch
   bends (on request) are, per frame, the offset in thirds of a semitone of
   the strongest contour bin within ±25 bins of the note's own bin, the
   bins weighted by a Gaussian of standard deviation 5 bins.

The MIDI file (on request) is written with ``pretty_midi``: one piano
(program 0) track at ``midi_tempo_bpm``, a pitch bend range of ±2 semitones.
"""
from __future__ import annotations

import base64
import io
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
import pretty_midi
import scipy.signal

from .base import AudioRequest, Cancelled, InvalidInput, LoadContext, spec_capacity
from .silero_vad import providers_for

SAMPLE_RATE_HZ = 22050
FFT_HOP = 256  # samples per output frame
WINDOW_SAMPLES = 2 * SAMPLE_RATE_HZ - FFT_HOP  # 43,844: the graph's fixed input length
WINDOW_FRAMES = 172  # output frames per window
OVERLAP_FRAMES = 30  # frames shared by neighbouring windows (15 dropped on each side)
HALF_OVERLAP = OVERLAP_FRAMES // 2
OVERLAP_SAMPLES = OVERLAP_FRAMES * FFT_HOP
HOP_SAMPLES = WINDOW_SAMPLES - OVERLAP_SAMPLES  # 36,164
KEPT_FRAMES = WINDOW_FRAMES - OVERLAP_FRAMES  # 142 frames kept per window
FRAMES_PER_S = SAMPLE_RATE_HZ // FFT_HOP  # 86: Basic Pitch trims its output at this integer rate
LOWEST_MIDI = 21  # key 0 of the 88 = A0
N_KEYS = 88
CONTOUR_BINS_PER_SEMITONE = 3
PITCH_WHEEL_MIN, PITCH_WHEEL_MAX = -8192, 8191
"""The MIDI pitch wheel's range (a 14-bit value centred on 0; the MIDI 1.0 specification, Pitch Bend Change)."""
ENERGY_TOLERANCE_FRAMES = 11  # frames below frame_threshold a note survives (Basic Pitch default)
BEND_TOLERANCE_BINS = 25  # contour bins searched on either side of a note's bin for its pitch bend
BEND_STD_BINS = 5.0  # standard deviation of the Gaussian weighting those bins
BATCH_WINDOWS = 8  # windows per graph run (bounds the run's memory on long input)
OUTPUTS = ("note", "onset", "contour")
OUTPUT_NAMES = {"note": "StatefulPartitionedCall:1", "onset": "StatefulPartitionedCall:2",
                "contour": "StatefulPartitionedCall:0"}  # as named by the converted graph in the wheel


@dataclass
class Shared:
    """Immutable weights: one ``InferenceSession`` and its input name."""

    session: ort.InferenceSession
    input_name: str


def frame_times_s(n_frames: int) -> np.ndarray:
    """Start time in seconds of each joined output frame (see the module docstring), float64 ``(n_frames,)``."""
    j = np.arange(n_frames)
    window, k = j // KEPT_FRAMES, j % KEPT_FRAMES
    return (window * HOP_SAMPLES + (k + HALF_OVERLAP) * FFT_HOP - OVERLAP_SAMPLES // 2) / SAMPLE_RATE_HZ


def posteriorgrams(shared: Shared, samples: np.ndarray) -> dict[str, np.ndarray]:
    """Run the graph over overlapping windows and join the outputs.

    Args:
        samples: float32 ``(n,)`` at 22,050 Hz.

    Returns:
        ``note`` and ``onset`` float32 ``(frames, 88)``, ``contour`` float32
        ``(frames, 264)``, ``frames = floor(n × 86 / 22050)`` (at least 1).
    """
    padded = np.concatenate([np.zeros(OVERLAP_SAMPLES // 2, np.float32), samples.astype(np.float32)])
    starts = list(range(0, len(padded), HOP_SAMPLES))
    parts: dict[str, list[np.ndarray]] = {name: [] for name in OUTPUTS}
    for first in range(0, len(starts), BATCH_WINDOWS):
        batch = np.zeros((len(starts[first: first + BATCH_WINDOWS]), WINDOW_SAMPLES, 1), np.float32)
        for row, start in enumerate(starts[first: first + BATCH_WINDOWS]):
            piece = padded[start: start + WINDOW_SAMPLES]
            batch[row, : len(piece), 0] = piece
        outs = shared.session.run([OUTPUT_NAMES[name] for name in OUTPUTS], {shared.input_name: batch})
        for name, out in zip(OUTPUTS, outs, strict=True):
            parts[name].append(out[:, HALF_OVERLAP:-HALF_OVERLAP, :])
    n_frames = max(1, int(np.floor(len(samples) * FRAMES_PER_S / SAMPLE_RATE_HZ)))
    joined = {}
    for name in OUTPUTS:
        stacked = np.concatenate(parts[name])
        joined[name] = stacked.reshape(-1, stacked.shape[-1])[:n_frames]
    return joined


def inferred_onsets(onsets: np.ndarray, frames: np.ndarray) -> np.ndarray:
    """Onsets plus rises of the frame activation (step 1 of the module docstring), same shape."""
    prev1 = np.vstack([np.zeros((1, frames.shape[1])), frames[:-1]])
    prev2 = np.vstack([np.zeros((2, frames.shape[1])), frames[:-2]])
    rise = np.minimum(frames - prev1, frames - prev2)
    rise[rise < 0] = 0
    rise[:2] = 0
    top = rise.max()
    if top > 0:
        rise = rise * (onsets.max() / top)
    return np.maximum(onsets, rise)


def _note_end(energy: np.ndarray, start: int, key: int, frame_threshold: float) -> int:
    """First frame after the note that starts at ``start`` on ``key`` (step 3)."""
    n_frames = energy.shape[0]
    i, below = start + 1, 0
    while i < n_frames - 1 and below < ENERGY_TOLERANCE_FRAMES:
        below = below + 1 if energy[i, key] < frame_threshold else 0
        i += 1
    return i - below


def _clear(energy: np.ndarray, lo: int, hi: int, key: int) -> None:
    energy[lo:hi, max(0, key - 1): key + 2] = 0


MAX_NOTES = 20_000
"""Most notes one request may find (about 11 a second over a 30-minute piece; dense piano music stays well
under it). Noise at the lowest thresholds finds about 1,500 a second: 60 s of it gave 92,167 notes, a
10.8 MB answer and 677 MB of peak memory, and the melodia step's cost grows with notes x frames, so a
request that passes this count is refused (400) instead of running on."""

MAX_MELODIA_STEPS = 2 * MAX_NOTES
"""Most steps of the melodia trick (step 4), each a scan of the whole activation array whether it finds a
note or not: past it the request is refused like one with too many notes."""

CANCEL_CHECK_NOTES = 256
"""The note loops ask :attr:`AudioRequest.cancelled` once per this many notes (each ask may cost a Redis
round trip): a request whose client left stops within that many notes."""


class TooManyNotes(InvalidInput):
    """The audio holds more than :data:`MAX_NOTES` notes at the request's thresholds."""

    def __init__(self) -> None:
        super().__init__(f"the audio holds more than {MAX_NOTES} notes at these thresholds (noise, or thresholds "
                         "too low): raise onset_threshold or frame_threshold, or send shorter audio",
                         param="onset_threshold")


def _counted(notes: list, cancelled: Callable[[], bool]) -> None:
    """Refuse a note list past :data:`MAX_NOTES` and stop a run nobody waits for (every
    :data:`CANCEL_CHECK_NOTES` notes). Raises TooManyNotes or Cancelled."""
    if len(notes) > MAX_NOTES:
        raise TooManyNotes()
    if len(notes) % CANCEL_CHECK_NOTES == 0 and cancelled():
        raise Cancelled("the request's client left")


def extract_notes(frames: np.ndarray, onsets: np.ndarray, *, onset_threshold: float, frame_threshold: float,
                  min_note_frames: int, infer_onsets: bool, melodia_trick: bool,
                  key_range: tuple[int, int] = (0, N_KEYS),
                  cancelled: Callable[[], bool] = lambda: False) -> list[tuple[int, int, int, float]]:
    """Note events from the activations (steps 1–4 of the module docstring).

    Raises:
        TooManyNotes: more than :data:`MAX_NOTES` notes (400: the work grows with them).
        Cancelled: ``cancelled()`` said the client left.

    Args:
        frames, onsets: float32 ``(n_frames, 88)`` in [0, 1].
        min_note_frames: a note must be longer than this many frames.
        key_range: keys ``[lo, hi)`` allowed (from the frequency limits).

    Returns:
        ``(start_frame, end_frame (exclusive), midi_pitch, amplitude in [0, 1])`` per note.
    """
    frames = frames.astype(np.float64).copy()
    onsets = onsets.astype(np.float64).copy()
    lo, hi = key_range
    frames[:, :lo] = frames[:, hi:] = 0
    onsets[:, :lo] = onsets[:, hi:] = 0
    if infer_onsets:
        onsets = inferred_onsets(onsets, frames)
    energy = frames.copy()
    notes: list[tuple[int, int, int, float]] = []
    _add_onset_notes(notes, frames, energy, _onset_peaks(onsets, onset_threshold), frame_threshold,
                     min_note_frames, cancelled)
    if melodia_trick:
        _add_melodia_notes(notes, frames, energy, frame_threshold, min_note_frames, cancelled)
    return sorted(notes, key=lambda n: (n[0], n[2]))


def _onset_peaks(onsets: np.ndarray, onset_threshold: float) -> list[tuple[int, int]]:
    """Step 2: ``(frame, key)`` of the onset map's local maxima in time at or above ``onset_threshold``
    (``onsets``: float64 ``(n_frames, 88)``), latest first."""
    peaks = np.zeros_like(onsets)
    t_idx, k_idx = scipy.signal.argrelmax(onsets, axis=0)
    peaks[t_idx, k_idx] = onsets[t_idx, k_idx]
    starts_t, starts_k = np.nonzero(peaks >= onset_threshold)
    return sorted(zip(starts_t.tolist(), starts_k.tolist(), strict=True), reverse=True)


def _add_onset_notes(notes: list[tuple[int, int, int, float]], frames: np.ndarray, energy: np.ndarray,
                     starts: list[tuple[int, int]], frame_threshold: float, min_note_frames: int,
                     cancelled: Callable[[], bool]) -> None:
    """Step 3: append to ``notes`` the note growing from each onset of ``starts`` in turn, through the
    not yet used activations ``energy`` (float64 ``(n_frames, 88)``, a kept note's frames and its
    neighbour keys' zeroed in place); its amplitude is the mean of ``frames`` over it.

    Raises:
        TooManyNotes, Cancelled: as :func:`_counted`.
    """
    n_frames = frames.shape[0]
    for start, key in starts:
        if start >= n_frames - 1:
            continue
        end = _note_end(energy, start, key, frame_threshold)
        if end - start <= min_note_frames:
            continue
        _clear(energy, start, end, key)
        notes.append((start, end, key + LOWEST_MIDI, float(frames[start:end, key].mean())))
        _counted(notes, cancelled)


def _add_melodia_notes(notes: list[tuple[int, int, int, float]], frames: np.ndarray, energy: np.ndarray,
                       frame_threshold: float, min_note_frames: int, cancelled: Callable[[], bool]) -> None:
    """Step 4 (the melodia trick): while an unused activation in ``energy`` is above ``frame_threshold``,
    grow a note from the strongest (:func:`_grown_span`, zeroing what it covers) and append it to ``notes``
    when longer than ``min_note_frames``.

    Raises:
        TooManyNotes: more than :data:`MAX_MELODIA_STEPS` steps, or as :func:`_counted`.
        Cancelled: ``cancelled()`` said the client left.
    """
    steps = 0
    while energy.max() > frame_threshold:
        steps += 1  # each step scans the whole array: bounded like the notes, found or not
        if steps > MAX_MELODIA_STEPS:
            raise TooManyNotes()
        if steps % CANCEL_CHECK_NOTES == 0 and cancelled():
            raise Cancelled("the request's client left")
        flat = int(np.argmax(energy))
        middle, row = divmod(flat, energy.shape[1])
        first, last = _grown_span(energy, middle, row, frame_threshold)
        if last - first <= min_note_frames:
            continue
        notes.append((first, last, row + LOWEST_MIDI, float(frames[first:last, row].mean())))
        _counted(notes, cancelled)


def _grown_span(energy: np.ndarray, middle: int, row: int, frame_threshold: float) -> tuple[int, int]:
    """Frames ``[first, last)`` of the note grown forwards then backwards from ``energy[middle, row]``
    while fewer than :data:`ENERGY_TOLERANCE_FRAMES` frames in a row fall below ``frame_threshold``;
    every frame visited (and its neighbour keys) is zeroed in ``energy``."""
    n_frames = energy.shape[0]
    energy[middle, row] = 0
    last, below = middle + 1, 0
    while last < n_frames - 1 and below < ENERGY_TOLERANCE_FRAMES:
        below = below + 1 if energy[last, row] < frame_threshold else 0
        _clear(energy, last, last + 1, row)
        last += 1
    last -= below  # exclusive end: drop the trailing frames below the threshold
    first, below = middle - 1, 0
    while first > 0 and below < ENERGY_TOLERANCE_FRAMES:
        below = below + 1 if energy[first, row] < frame_threshold else 0
        _clear(energy, first, first + 1, row)
        first -= 1
    first += below + 1  # first frame at or above the threshold
    return first, last


def pitch_bends(contour: np.ndarray, start: int, end: int, midi_pitch: int) -> list[int]:
    """Per-frame bend of a note in thirds of a semitone (step 5), ``end - start`` ints."""
    centre = (midi_pitch - LOWEST_MIDI) * CONTOUR_BINS_PER_SEMITONE
    lo, hi = max(0, centre - BEND_TOLERANCE_BINS), min(contour.shape[1], centre + BEND_TOLERANCE_BINS + 1)
    offsets = np.arange(lo, hi) - centre
    weights = np.exp(-0.5 * (offsets / BEND_STD_BINS) ** 2)
    best = np.argmax(contour[start:end, lo:hi] * weights, axis=1)
    return [int(o) for o in offsets[best]]


def midi_file(notes: list[dict], tempo_bpm: float) -> bytes:
    """A Standard MIDI File (format 1) of ``notes`` (dicts as returned by :meth:`TranscriptionSession.run`)."""
    pm = pretty_midi.PrettyMIDI(initial_tempo=float(tempo_bpm))
    piano = pretty_midi.Instrument(program=0, name="basic_pitch")
    for note in notes:
        piano.notes.append(pretty_midi.Note(velocity=int(note["velocity"]), pitch=int(note["pitch_midi"]),
                                            start=float(note["start_s"]), end=float(note["end_s"])))
        bends = note.get("pitch_bends") or []
        times = np.linspace(note["start_s"], note["end_s"], len(bends), endpoint=False)
        for t, bend in zip(times, bends, strict=True):
            # ±2 semitones span the wheel's -8192..8191: 4096 per semitone, a bend unit is a third of one.
            # A bend found further out (up to BEND_TOLERANCE_BINS) is clipped to the wheel's end, as
            # Basic Pitch's own note_events_to_midi does; MIDI cannot say more with one note.
            ticks = int(round(4096 * bend / CONTOUR_BINS_PER_SEMITONE))
            piano.pitch_bends.append(pretty_midi.PitchBend(min(PITCH_WHEEL_MAX, max(PITCH_WHEEL_MIN, ticks)),
                                                           float(t)))
    pm.instruments.append(piano)
    out = io.BytesIO()
    pm.write(out)
    return out.getvalue()


def _key_range(min_hz: float | None, max_hz: float | None) -> tuple[int, int]:
    """Keys ``[lo, hi)`` (0-based) whose pitches lie within ``min_hz..max_hz`` (None = no limit)."""
    lo, hi = 0, N_KEYS
    if min_hz is not None:
        lo = max(0, int(np.ceil(pretty_midi.hz_to_note_number(min_hz))) - LOWEST_MIDI)
    if max_hz is not None:
        hi = min(N_KEYS, int(np.floor(pretty_midi.hz_to_note_number(max_hz))) - LOWEST_MIDI + 1)
    return lo, hi


class TranscriptionSession:
    """One slot over the shared graph (no private state)."""

    def __init__(self, shared: Shared, slot: int):
        self.shared = shared
        self.slot = slot

    def run(self, request: AudioRequest) -> dict:
        """Transcribe notes.

        Options: ``onset_threshold``, ``frame_threshold`` (0..1),
        ``minimum_note_length_ms``, ``minimum_frequency_hz`` /
        ``maximum_frequency_hz`` (None = the whole piano), ``infer_onsets``,
        ``melodia_trick``, ``include_pitch_bends``, ``midi`` (add the MIDI
        artifact), ``midi_tempo_bpm``.

        Returns:
            ``{"notes": [{"start_s", "end_s", "pitch_midi", "velocity" (1..127),
            "pitch_bends" (thirds of a semitone per frame, with include_pitch_bends)}],
            "duration" (s), "sample_rate": 22050, "frame_rate_hz",
            "artifacts": [{"name": "transcription.mid", "media_type": "audio/midi",
            "encoding": "base64", "data"}] (with midi)}``; notes sorted by start, then pitch.

        Raises:
            InvalidInput: the frequency limits leave no key; TooManyNotes (400) past :data:`MAX_NOTES`.
            Cancelled: the client left (checked between notes).
        """
        opts = request.options
        key_range = _key_range(opts.get("minimum_frequency_hz"), opts.get("maximum_frequency_hz"))
        if key_range[0] >= key_range[1]:
            raise InvalidInput("minimum_frequency_hz..maximum_frequency_hz covers no piano key (27.5-4186 Hz)",
                               param="maximum_frequency_hz")
        grams = posteriorgrams(self.shared, request.samples)
        min_frames = int(round(float(opts["minimum_note_length_ms"]) / 1000 * SAMPLE_RATE_HZ / FFT_HOP))
        events = extract_notes(grams["note"], grams["onset"], onset_threshold=float(opts["onset_threshold"]),
                               frame_threshold=float(opts["frame_threshold"]), min_note_frames=min_frames,
                               infer_onsets=bool(opts["infer_onsets"]), melodia_trick=bool(opts["melodia_trick"]),
                               key_range=key_range, cancelled=request.cancelled)
        times = frame_times_s(grams["note"].shape[0] + 1)
        notes = []
        for start, end, pitch, amplitude in events:
            note: dict = {"start_s": round(float(times[start]), 4), "end_s": round(float(times[end]), 4),
                          "pitch_midi": pitch, "velocity": max(1, min(127, int(round(127 * amplitude))))}
            if opts.get("include_pitch_bends"):
                note["pitch_bends"] = pitch_bends(grams["contour"], start, end, pitch)
            notes.append(note)
        result: dict = {"notes": notes, "duration": round(len(request.samples) / request.sample_rate_hz, 6),
                        "sample_rate": request.sample_rate_hz, "frame_rate_hz": round(SAMPLE_RATE_HZ / FFT_HOP, 4)}
        if opts.get("midi"):
            data = midi_file(notes, float(opts["midi_tempo_bpm"]))
            result["artifacts"] = [{"name": "transcription.mid", "media_type": "audio/midi", "encoding": "base64",
                                    "data": base64.b64encode(data).decode()}]
        return result

    def close(self) -> None:
        """Nothing private to free."""


class BasicPitchAdapter:
    """Family ``basic_pitch`` (task ``music_transcription``)."""

    family = "basic_pitch"

    def capacity(self, spec: dict, ctx: LoadContext) -> int:
        return spec_capacity(spec, ctx.backend)

    def load(self, spec: dict, ctx: LoadContext) -> Shared:
        """Open the graph once.

        Raises:
            onnxruntime errors on a file that is not ONNX; ValueError on a graph
            without Basic Pitch's input and outputs.
        """
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(ctx.session_options.get("intra_op_num_threads", ctx.threads))
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(str(ctx.checkpoint), options, providers=providers_for(ctx.backend, ctx.device))
        inputs = session.get_inputs()
        names = {o.name for o in session.get_outputs()}
        expected_outputs = set(OUTPUT_NAMES.values())
        if len(inputs) != 1 or list(inputs[0].shape[1:]) != [WINDOW_SAMPLES, 1] or not expected_outputs <= names:
            raise ValueError("not a Basic Pitch graph: expected one input (batch, 43844, 1) and outputs "
                             f"{sorted(OUTPUT_NAMES.values())}")
        return Shared(session, inputs[0].name)

    def new_session(self, shared: Shared, slot: int) -> TranscriptionSession:
        return TranscriptionSession(shared, slot)

    def unload(self, shared: Shared) -> None:
        del shared.session
