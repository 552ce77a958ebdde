"""The OpenAI-compatible routes as the official ``openai`` SDK uses them (a client we did not write)."""
from __future__ import annotations

import io

import jiwer
import openai
import pytest

pytestmark = pytest.mark.stack


def _client(stack) -> openai.OpenAI:
    return openai.OpenAI(base_url=f"{stack.url}/v1", api_key="unused", max_retries=0, timeout=60)


def _words(text: str) -> str:
    return " ".join("".join(ch for ch in text.lower() if ch.isalnum() or ch.isspace()).split())


def test_the_sdk_transcribes_in_every_response_format(stack, speech):
    utt = speech[0]
    client = _client(stack)
    plain = client.audio.transcriptions.create(model="whisper", file=("a.wav", io.BytesIO(utt.wav)))
    assert jiwer.wer(_words(utt.text), _words(plain.text)) <= 0.2, plain.text
    text = client.audio.transcriptions.create(model="whisper", file=("a.wav", io.BytesIO(utt.wav)),
                                              response_format="text")
    assert isinstance(text, str) and _words(text) == _words(plain.text)
    verbose = client.audio.transcriptions.create(model="whisper", file=("a.wav", io.BytesIO(utt.wav)),
                                                 response_format="verbose_json",
                                                 timestamp_granularities=["word", "segment"], language="en",
                                                 temperature=0.0)
    assert _words(verbose.text) == _words(plain.text) and verbose.language == "en"
    assert verbose.duration == pytest.approx(len(utt.samples) / utt.rate, abs=0.01)
    assert verbose.words and all(w.start <= w.end for w in verbose.words)
    assert verbose.segments and verbose.segments[-1].end <= verbose.duration + 0.01
    srt = client.audio.transcriptions.create(model="whisper", file=("a.wav", io.BytesIO(utt.wav)),
                                             response_format="srt")
    assert srt.startswith("1\n00:00:")


def test_the_sdk_lists_models_and_maps_our_errors_to_its_exceptions(stack):
    client = _client(stack)
    ids = {model.id for model in client.models.list()}
    assert {"whisper", "vad"} <= ids
    with pytest.raises(openai.NotFoundError) as missing:
        client.audio.transcriptions.create(model="nobody", file=("a.wav", io.BytesIO(b"RIFF")))
    assert missing.value.body["param"] == "model"
    with pytest.raises(openai.BadRequestError) as bad:
        client.audio.transcriptions.create(model="whisper", file=("a.wav", io.BytesIO(b"RIFF")),
                                           response_format="mp4")
    assert bad.value.body["param"] == "response_format"
    with pytest.raises(openai.APIStatusError) as undecodable:
        client.audio.transcriptions.create(model="whisper", file=("a.wav", io.BytesIO(b"not audio" * 100)))
    assert undecodable.value.status_code == 415 and undecodable.value.body["type"] == "invalid_request_error"


def test_the_sdk_reads_request_options_with_include_params(stack):
    """``include_params`` through the SDK's ``extra_query``: each listed model and a retrieved one carry
    ``request_options`` (kept by the SDK in ``model_extra``); a bad value is its BadRequestError."""
    client = _client(stack)
    listed = {model.id: model for model in client.models.list(extra_query={"include_params": "1"})}
    assert "threshold" in listed["vad"].model_extra["request_options"]["properties"]
    retrieved = client.models.retrieve("whisper-1", extra_query={"include_params": "true"})
    assert retrieved.model_extra["request_options"] == listed["whisper"].model_extra["request_options"]
    assert "request_options" not in (client.models.retrieve("vad").model_extra or {})
    with pytest.raises(openai.BadRequestError) as bad:
        client.models.list(extra_query={"include_params": "maybe"})
    assert bad.value.body["param"] == "include_params"


def test_openai_model_names_reach_the_default_transcription_model(stack, speech):
    """``whisper-1``, ``gpt-4o-transcribe`` and ``gpt-4o-mini-transcribe`` stand for the default ASR
    model (the config file's first ``asr`` entry, here ``whisper``): the same text, and the names are
    listed in ``/v1/models`` with ``created`` and ``alias_of``."""
    utt = speech[0]
    client = _client(stack)
    own = client.audio.transcriptions.create(model="whisper", file=("a.wav", io.BytesIO(utt.wav))).text
    for alias in ("whisper-1", "gpt-4o-transcribe", "gpt-4o-mini-transcribe"):
        text = client.audio.transcriptions.create(model=alias, file=("a.wav", io.BytesIO(utt.wav))).text
        assert text == own, alias
    listed = {model.id: model for model in client.models.list()}
    assert listed["whisper-1"].model_extra["alias_of"] == "whisper"
    assert all(isinstance(model.created, int) and model.created > 0 for model in listed.values())
    assert "tts-1" not in listed  # this stack has no speech model: the speech names are not offered
    assert client.models.retrieve("gpt-4o-transcribe").model_extra["alias_of"] == "whisper"
    with pytest.raises(openai.NotFoundError):
        client.audio.transcriptions.create(model="tts-1", file=("a.wav", io.BytesIO(utt.wav)))
