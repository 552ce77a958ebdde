"""Voices of a speech registration whose checkpoint has no readable voice file (``inference/voices.py``):
the request is not refused by the voice lookup with a 500; its load fails and says why (503
``load_failed``, shown on real servers by ``validate_slots --mode streaming``'s M4 for piper)."""
from __future__ import annotations

import pytest

from audiosite.errors import InvalidRequest
from inference import voices


def test_a_checkpoint_without_a_voice_file_has_no_voices_and_takes_any_voice_without_options(tmp_path):
    broken = tmp_path / "broken.onnx"
    broken.write_bytes(b"not a model" * 8)  # no broken.onnx.json beside it
    meta = {"id": "bad", "family": "piper", "path": str(broken)}
    assert voices.model_voices(meta) == []
    assert voices.voice_options(meta, None) == {}
    assert voices.voice_options(meta, "joe") == {}


def test_the_packaged_voice_still_refuses_an_unknown_voice():
    meta = {"id": "piper", "family": "piper", "path": None}
    assert [v["id"] for v in voices.model_voices(meta)] == ["joe"]
    with pytest.raises(InvalidRequest, match="voices: joe"):
        voices.voice_options(meta, "nobody")
