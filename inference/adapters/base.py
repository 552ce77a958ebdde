"""The adapter interface: how a model family becomes sessions.

An adapter knows nothing about HTTP, Redis or Django. It turns a checkpoint
into immutable shared weights (:meth:`Adapter.load`) and per-slot sessions
with private mutable state (:meth:`Adapter.new_session`).
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Protocol

import numpy as np


class InvalidInput(ValueError):
    """The request cannot be served as asked (e.g. a language the checkpoint lacks).

    ``param`` names the offending request field. The web side turns it into
    400 ``invalid_request_error``.
    """

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


@dataclass
class AudioRequest:
    """One inference request.

    Attributes:
        samples: mono audio, shape ``(n,)``, dtype float32, range about [-1, 1],
            already at the model's ``sample_rate_hz``.
        sample_rate_hz: the rate of ``samples`` (the family spec's rate).
        options: request options, already validated against the spec and
            merged with the model's ``default_request_options`` and spec defaults.
    """

    samples: np.ndarray
    sample_rate_hz: int
    options: dict[str, Any] = field(default_factory=dict)
    cancelled: Callable[[], bool] = field(default=lambda: False, compare=False, repr=False)
    """True once nobody waits for the answer any more (its client left, R8.2): an adapter whose run
    takes long asks between bounded steps and raises :class:`Cancelled` (the worker sets it from the
    web's stop marker, ``Keys.stop(request_id)``). Each call may cost a Redis round trip."""


class Cancelled(Exception):
    """Raised by an adapter that stopped a run because :attr:`AudioRequest.cancelled` said nobody waits."""


@dataclass(frozen=True)
class TextRequest:
    """One synthesis request.

    Attributes:
        text: the input text (plain Unicode, 1..4096 characters checked by the web side).
        options: validated options merged with the spec and registration defaults:
            ``length_scale`` (> 0, 1 = the voice's pace), ``noise_scale``, ``noise_w``,
            ``sentence_silence_s`` (s of silence after each sentence), ``speaker``
            (speaker index), ``speed`` (0.25..4, a time stretch that keeps the pitch), ``seed``
            (int 0..2**31-2 or None = random).
    """

    text: str
    options: dict


@dataclass(frozen=True)
class LoadContext:
    """What a load needs besides the spec.

    Attributes:
        checkpoint: resolved checkpoint file or folder.
        backend: 'cpu' or 'cuda'.
        device: device index for 'cuda'.
        threads: intra-op threads per session.
        load_options / session_options: validated option blocks of the registration.
        slots: how many sessions the pool will create (1 on the legacy runtime).
        barrier: ``barrier(name)`` blocks until a controller releases ``name``
            (used by the test family only; None elsewhere).
    """

    checkpoint: Path | None
    backend: str
    device: int
    threads: int
    load_options: dict[str, Any]
    session_options: dict[str, Any]
    slots: int = 1
    barrier: Any = None


class Session(Protocol):
    """One slot: private mutable state over shared weights."""

    def run(self, request: AudioRequest) -> dict:
        """Serve one request; returns a JSON-serialisable result dict."""

    def close(self) -> None:
        """Free the session's private state."""


class Adapter(Protocol):
    """A model family."""

    family: str

    def capacity(self, spec: dict, ctx: LoadContext) -> int:
        """Advertised number of independent sessions (1..16) for this backend."""

    def load(self, spec: dict, ctx: LoadContext) -> Any:
        """Build the immutable shared weights. Raises on a bad checkpoint."""

    def new_session(self, shared: Any, slot: int) -> Session:
        """A fresh session for slot ``slot`` (0-based) over ``shared``."""

    def unload(self, shared: Any) -> None:
        """Free the shared weights (after every session was closed)."""


def joined_text(segments: list[dict]) -> str:
    """The transcript of ``segments`` (dicts with ``text``, already stripped): the non-empty texts
    joined by one space. A streamed transcription's deltas concatenate to exactly this (see
    :func:`segment_delta`)."""
    return " ".join(s["text"] for s in segments if s["text"])


def segment_delta(text_so_far: str, text: str) -> str:
    """The delta a streamed transcription sends for a segment of (stripped) ``text`` after the
    transcript ``text_so_far``: the text, after one space unless nothing came before; empty for an
    empty segment. Appending every delta builds :func:`joined_text` of the segments."""
    if not text:
        return ""
    return text if not text_so_far else " " + text


def spec_capacity(spec: dict, backend: str) -> int:
    """The spec's advertised capacity for ``backend`` (1 when not listed)."""
    return int(spec.get("capacity", {}).get(backend, 1))
