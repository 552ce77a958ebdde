"""What several benchmarks share: the speech sample, the ``/v1/tasks/run`` body and a quantile."""
from __future__ import annotations

import base64
from pathlib import Path

from django.conf import settings

#: A LibriSpeech utterance shipped in ``samples/`` (16 kHz mono WAV).
SAMPLE = Path(settings.BASE_DIR) / "samples" / "librispeech_test_clean_6930-75918-0000.wav"


def quantile(values: list[float], q: float) -> float:
    """The ``q`` quantile (0..1) of ``values`` by nearest rank (no interpolation), in their unit.

    Raises:
        IndexError: ``values`` is empty.
    """
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(round(q * (len(ordered) - 1))))]


def task_body(model: str, wav: bytes, **extra) -> dict:
    """The JSON body of ``POST /v1/tasks/run`` for ``model`` with ``wav`` (any audio file's bytes) as
    base64; ``extra`` become the request's ``options``, except ``busy_timeout_ms``, which goes to the
    body's top level."""
    timeout = extra.pop("busy_timeout_ms", None)
    body = {"model": model, "request": {"audio_base64": base64.b64encode(wav).decode(), "options": extra}}
    if timeout is not None:
        body["busy_timeout_ms"] = timeout
    return body
