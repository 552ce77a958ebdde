"""Model families. ``get_adapter(family)`` imports an adapter only when used."""
from __future__ import annotations

import importlib

_FAMILIES = {
    "silero_vad": ("inference.adapters.silero_vad", "SileroVadAdapter"),
    "whisper": ("inference.adapters.whisper", "WhisperAdapter"),
    "piper": ("inference.adapters.piper", "PiperAdapter"),
    "speaker_embedding": ("inference.adapters.speaker_embedding", "SpeakerEmbeddingAdapter"),
    "basic_pitch": ("inference.adapters.basic_pitch", "BasicPitchAdapter"),
    "diarization": ("inference.adapters.pipeline", "PipelineAdapter"),
    "fixture": ("inference.adapters.fixture", "FixtureAdapter"),
}


def get_adapter(family: str):
    """Return the adapter instance of ``family``.

    Raises:
        KeyError: unknown family.
    """
    module_name, class_name = _FAMILIES[family]
    return getattr(importlib.import_module(module_name), class_name)()
