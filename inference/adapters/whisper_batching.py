"""Several Whisper transcriptions decoded in shared CTranslate2 calls (native batching of ``whisper``).

faster-whisper's ``WhisperModel.transcribe`` decodes one request: per 30 s window it encodes the
window's log-Mel features and calls ``ctranslate2.models.Whisper.generate`` with one prompt, then
moves its ``seek`` by the timestamps it got back. Rather than rewrite that loop for a batch, each
request of a batch runs the unmodified ``transcribe`` on a thread of its own, over a shallow copy of
the model whose CTranslate2 object is a :class:`_MemberModel`. Its ``encode`` only keeps the window's
features; its ``generate`` waits at the batch's :class:`GenerateRendezvous` until every member still
decoding has a window waiting, then one call per group of compatible windows decodes them all: the
features stacked ``(k, n_mels, 3000)`` float32, one prompt per window (CTranslate2 encodes a batch of
features itself; ``ctranslate2.models.Whisper.generate``, "features").

Windows are compatible when their ``generate`` keyword arguments are equal and the
``<|startoftranscript|>`` token sits at the same place in their prompts (CTranslate2 refuses a batch
otherwise: "requires the <|startoftranscript|> token to be at the same position in all batches"; a
request's ``prompt`` option moves it). A window decoded by sampling (``temperature`` > 0) is decoded
alone, as it would be serially. So each request's answer is the one ``transcribe`` gives it alone
(measured: identical text and timestamps on CPU int8, tiny.en, for clips of 2 to 34 s with and without
prompts and beam sizes 1 and 5; ``tests/test_batching.py`` compares them). A request's own failure
(an unsupported language, a prompt too long) raises on its own thread before any ``generate`` and
leaves the batch; a batched call that raises is made again window by window, so a failure stays with
the request that caused it. ``detect_language`` and ``align`` (word timestamps) run on the member's
own window, unbatched.
"""
from __future__ import annotations

import copy
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
from faster_whisper import WhisperModel
from faster_whisper.transcribe import get_ctranslate2_storage

from .base import Cancelled

SOT_TOKEN = "<|startoftranscript|>"


@dataclass
class _Window:
    """One member's pending ``generate``: its window's features ``(1, n_mels, frames)`` float32, its one
    prompt (token ids), the call's keyword arguments, and, once decoded, its result or exception."""

    features: np.ndarray
    prompt: list[int]
    options: dict
    group: tuple
    done: bool = False
    result: Any = None
    error: BaseException | None = None


@dataclass
class GenerateRendezvous:
    """The meeting point of one batch's ``generate`` calls.

    Args:
        members: how many requests (threads) take part.
        model: the shared ``ctranslate2.models.Whisper`` that makes the batched calls.
        sot_id: the token id of ``<|startoftranscript|>`` (the prompts are grouped by its position).

    A round runs when every member that has not finished waits with a window: the last one to arrive
    makes the calls (one per group, :meth:`_decode`) while the others wait, so no member's Python work
    overlaps a call it could have joined. ``sizes`` lists how many windows each call decoded.
    """

    members: int
    model: Any
    sot_id: int
    finished: int = 0
    pending: list[_Window] = field(default_factory=list)
    sizes: list[int] = field(default_factory=list)
    cond: threading.Condition = field(default_factory=threading.Condition)

    def finish(self) -> None:
        """A member is done (answered, failed or left): a round no longer waits for it."""
        with self.cond:
            self.finished += 1
            self._run_round_if_complete()

    def generate(self, features: np.ndarray, prompt: list[int], options: dict) -> Any:
        """Decode one window in the next round; returns its ``WhisperGenerationResult``.

        Raises:
            whatever CTranslate2 raised for this window decoded alone.
        """
        sot_at = prompt.index(self.sot_id) if self.sot_id in prompt else -1
        sampled = float(options.get("sampling_temperature") or 0) > 0
        group = (sot_at, repr(sorted(options.items())), id(features) if sampled else 0)
        window = _Window(features, prompt, options, group)
        with self.cond:
            self.pending.append(window)
            self._run_round_if_complete()
            while not window.done:
                self.cond.wait()
        if window.error is not None:
            raise window.error
        return window.result

    def _run_round_if_complete(self) -> None:
        """Under ``cond``: decode the pending windows once no unfinished member is still working."""
        if not self.pending or len(self.pending) + self.finished < self.members:
            return
        windows, self.pending = self.pending, []
        groups: dict[tuple, list[_Window]] = {}
        for window in windows:
            groups.setdefault(window.group, []).append(window)
        try:
            for group in groups.values():
                self._decode(group)
        except BaseException as exc:  # never leave a member waiting for a window nobody will decode
            for window in windows:
                if not window.done:
                    window.error, window.done = exc, True
            raise
        finally:
            self.cond.notify_all()

    def _decode(self, windows: list[_Window]) -> None:
        """One ``generate`` for ``windows`` (same options and SOT position); on an exception, each window
        alone, so only the window that fails carries the error."""
        try:
            results = self._generate(windows)
        except Exception as exc:
            if len(windows) == 1:
                windows[0].error, windows[0].done = exc, True
            else:
                for window in windows:
                    self._decode([window])
            return
        self.sizes.append(len(windows))
        for window, result in zip(windows, results, strict=True):
            window.result, window.done = result, True

    def _generate(self, windows: list[_Window]) -> list:
        features = np.ascontiguousarray(np.concatenate([w.features for w in windows]))
        return self.model.generate(get_ctranslate2_storage(features), [w.prompt for w in windows],
                                   **windows[0].options)


class _MemberModel:
    """The CTranslate2 model as one member's ``transcribe`` sees it: ``encode`` keeps the features,
    ``generate`` goes through the rendezvous, ``detect_language`` and ``align`` encode the member's own
    window; every other attribute is the real model's."""

    def __init__(self, rendezvous: GenerateRendezvous, cancelled: Callable[[], bool]):
        self._rendezvous = rendezvous
        self._cancelled = cancelled

    def encode(self, features, to_cpu: bool = False) -> _Features:
        return _Features(np.array(features, dtype=np.float32, copy=True))

    def generate(self, features: _Features, prompts: list[list[int]], **options) -> list:
        if self._cancelled():
            raise Cancelled("the request's client left")
        assert len(prompts) == 1, "faster-whisper's transcribe decodes one prompt per call"
        return [self._rendezvous.generate(features.array, list(prompts[0]), options)]

    def detect_language(self, features: _Features, *args, **kwargs):
        return self._rendezvous.model.detect_language(self._encoded(features), *args, **kwargs)

    def align(self, features: _Features, *args, **kwargs):
        return self._rendezvous.model.align(self._encoded(features), *args, **kwargs)

    def _encoded(self, features: _Features):
        if features.encoded is None:
            features.encoded = self._rendezvous.model.encode(get_ctranslate2_storage(features.array))
        return features.encoded

    def __getattr__(self, name: str) -> Any:
        return getattr(self._rendezvous.model, name)


@dataclass
class _Features:
    """A window's features as ``encode`` was given them, ``(1, n_mels, frames)`` float32, and their
    encoder output once ``detect_language`` or ``align`` needed it."""

    array: np.ndarray
    encoded: Any = None


def transcribe_together(model: WhisperModel, members: Sequence[tuple[Callable[[WhisperModel], Any], Callable[[], bool]]]
                        ) -> tuple[list[Any], list[int]]:
    """Run each member's transcription on its own thread, their ``generate`` calls batched.

    Args:
        model: the loaded model (shared with the other slots; it is not changed).
        members: per request, ``(transcribe, cancelled)``: ``transcribe(model_view)`` does the whole
            request over the model it is given and returns its answer; ``cancelled()`` is asked before
            each window (a request whose client left raises :class:`Cancelled` there and leaves).

    Returns:
        ``(outcomes, sizes)``: per member its answer or the exception it raised, in order; and how many
        windows each batched ``generate`` decoded.
    """
    sot_id = model.hf_tokenizer.token_to_id(SOT_TOKEN)
    rendezvous = GenerateRendezvous(len(members), model.model, sot_id)
    outcomes: list[Any] = [None] * len(members)

    def work(index: int) -> None:
        transcribe, cancelled = members[index]
        view = copy.copy(model)
        view.model = _MemberModel(rendezvous, cancelled)
        try:
            outcomes[index] = transcribe(view)
        except Exception as exc:
            outcomes[index] = exc
        finally:
            rendezvous.finish()

    threads = [threading.Thread(target=work, args=(i,), name=f"whisper batch member {i}", daemon=True)
               for i in range(len(members))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return outcomes, rendezvous.sizes
