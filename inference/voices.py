"""Voices of speech models: a voice file's own voice plus the registration's ``voice_presets``.

Read without loading weights: a Piper checkpoint ``<voice>.onnx`` has its
``<voice>.onnx.json`` beside it, whose ``dataset`` names the voice (``joe``)
and whose ``language.code`` its language (``en_US``). A preset (API.md
server config) maps another name to a voice plus request options, e.g.
OpenAI's ``alloy`` → ``joe``; ``default_voice_preset`` names the voice used
when a request sends none (else the model's first voice).
"""
from __future__ import annotations

from audiosite.errors import InvalidRequest
from inference import specs


def model_voices(meta: dict) -> list[dict]:
    """Every voice a request to ``meta``'s model may name: the built-in ones, then the presets
    (``{"id", "name", "language", "sample_rate", "preset_of", "options"}``). A checkpoint whose voice
    file cannot be read has no built-in voice here (its load fails and says why: 503 ``load_failed``)."""
    try:
        voices = specs.builtin_voices(meta["family"], meta.get("path"))
    except (OSError, KeyError, ValueError):  # no or a broken <voice>.onnx.json: the load reports it
        voices = []
    by_id = {v["id"]: v for v in voices}
    for name, preset in (meta.get("voice_presets") or {}).items():
        base = by_id.get(preset["voice"], voices[0] if voices else {})
        voices.append({**base, "id": name, "name": name, "preset_of": preset["voice"],
                       "options": preset.get("options", {})})
    return voices


def resolve_voice(meta: dict, voice: str | None) -> tuple[str, dict] | None:
    """``(voice id, preset options)`` for a request's ``voice`` (None = the default); None when unknown.
    A model with no readable voice at all takes any voice without options: its load fails first."""
    voices = model_voices(meta)
    if not voices:
        return voice or "", {}
    if voice is None:
        voice = meta.get("default_voice_preset") or voices[0]["id"]
    for entry in voices:
        if entry["id"] == voice:
            return entry.get("preset_of", entry["id"]), dict(entry.get("options", {}))
    return None


def voice_options(meta: dict, voice: str | None) -> dict:
    """The request options a speech request's ``voice`` brings (a preset's options; ``{}`` for a
    checkpoint voice), for ``/v1/audio/speech``, ``/v1/tasks/run`` and the Wyoming server alike.

    Raises:
        InvalidRequest: an unknown voice (400, ``param`` "voice"; the message names the model's voices).
    """
    resolved = resolve_voice(meta, voice)
    if resolved is None:
        names = ", ".join(v["id"] for v in model_voices(meta))
        raise InvalidRequest(f"voice {voice!r} does not exist for model {meta['id']!r}; voices: {names}",
                             param="voice")
    return resolved[1]
