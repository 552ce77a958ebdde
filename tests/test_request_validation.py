"""Request validation: every problem is one 400 whose ``param`` is the field path, never a substring.

The serializers are checked directly (no server); the checks that need the
model (option schemas) and the HTTP rendering go through the test stack.
"""
from __future__ import annotations

import base64

import pytest
from django.http import QueryDict

from audiosite.errors import ApplicationError
from audiosite.validation import validated
from inference.serializers import TaskRunInputSerializer, TranscriptionInputSerializer
from registry.serializers import ModelLoadInputSerializer, ModelUnloadInputSerializer, UnloadModelsInputSerializer


def refusal(serializer_class, data, query: str = "") -> tuple[int, str | None, str]:
    with pytest.raises(ApplicationError) as caught:
        validated(serializer_class(data=data, context={"query_params": QueryDict(query)}))
    return caught.value.status, caught.value.param, caught.value.message


@pytest.mark.parametrize("data, param, message", [
    ({"model": "vad", "request": {"audio_base64": "@@"}}, "request.audio_base64",
     "request.audio_base64 is not valid base64"),
    ({"model": "vad", "request": {"audio": 7}}, "request.audio", "request.audio must be a path string"),
    ({"model": "vad", "request": {"audio": "x", "options": []}}, "request.options",
     "request.options must be an object"),
    ({"model": "vad", "request": {"audio": "x", "options": {"prompt": "\ud800"}}}, "request.options.prompt",
     "request.options.prompt is not valid Unicode text"),
    ({"model": "vad", "request": {"audio": "x", "options": {"a": {"b": "x\x00"}}}}, "request.options.a.b",
     "request.options.a.b must not contain NUL characters"),
    ({"model": "vad", "request": {"audio": "x", "busy_timeout_ms": "soon"}}, "request.busy_timeout_ms",
     "request.busy_timeout_ms must be an integer"),
    ({"model": "vad", "request": {"options": {}}}, "request",
     "request needs 'audio' (server-local path) or 'audio_base64'"),
    ({"model": "vad", "request": None}, "request", "request must be a JSON object with 'audio' or 'audio_base64'"),
    ({"model": "vad", "busy_timeout_ms": -1, "request": {"audio": "x"}}, "busy_timeout_ms",
     "busy_timeout_ms must be between 0 and 2147483647"),
    ({"request": {"audio": "x"}}, "model", "model is required"),
    ([1, 2], None, "the request body must be a JSON object or a multipart form"),
    (None, None, "the request body must be a JSON object or a multipart form"),
])
def test_task_run_problems_name_the_field_path(data, param, message):
    assert refusal(TaskRunInputSerializer, data) == (400, param, message)


def test_busy_timeout_ms_comes_from_body_then_query_then_request():
    def timeout(data, query=""):
        serializer = TaskRunInputSerializer(data=data, context={"query_params": QueryDict(query)})
        return validated(serializer)["busy_timeout_ms"]
    inner = {"audio": "x", "busy_timeout_ms": 3}
    assert timeout({"model": "vad", "busy_timeout_ms": 1.0, "request": inner}, "busy_timeout_ms=2") == 1
    assert timeout({"model": "vad", "request": inner}, "busy_timeout_ms=2") == 2
    assert timeout({"model": "vad", "request": inner}) == 3
    assert timeout({"model": "vad", "request": {"audio": "x"}}) is None
    assert refusal(TaskRunInputSerializer, {"model": "vad", "request": inner}, "busy_timeout_ms=1_000") == (
        400, "busy_timeout_ms", "busy_timeout_ms must be an integer")


def test_transcription_form_fields():
    form = QueryDict("model=whisper&timestamp_granularities[]=segment&timestamp_granularities[]=word"
                     "&stream=False&busy_timeout_ms=&temperature=0.5&audio=/media/a.wav", mutable=True)
    data = validated(TranscriptionInputSerializer(data=form, context={"query_params": QueryDict("busy_timeout_ms=9")}))
    assert data["options"] == {"temperature": 0.5, "word_timestamps": True}
    assert (data["stream"], data["busy_timeout_ms"], data["source"]) == (False, 9, ("audio", "/media/a.wav"))
    form = QueryDict("model=whisper&timestamp_granularities[]=words&file=/media/a.wav")
    assert refusal(TranscriptionInputSerializer, form) == (
        400, "timestamp_granularities", "timestamp_granularities must be a list of 'word' and/or 'segment'")
    assert refusal(TranscriptionInputSerializer, {"model": "whisper", "audio_path": ["x"]}) == (
        400, "audio_path", "audio_path must be a path string")


@pytest.mark.parametrize("serializer_class, data, param, message", [
    (ModelUnloadInputSerializer, {"id": "a", "force": True}, "force",
     "unknown key(s) ['force']; this route takes ['id']"),
    (ModelUnloadInputSerializer, {"id": ""}, "id", "key 'id': a model id (string) is required"),
    (UnloadModelsInputSerializer, {"model_ids": ["a", 1]}, "model_ids",
     "key 'model_ids': a list of model ids (strings) is required"),
    (UnloadModelsInputSerializer, {"model_ids": ["a", "\udfff"]}, "model_ids",
     "text in the body may not contain NUL characters or unpaired UTF-16 surrogates"),
    (ModelLoadInputSerializer, {"id": "a", "\ud800": 1}, None,
     "text in the body may not contain NUL characters or unpaired UTF-16 surrogates"),
    (ModelLoadInputSerializer, "a", None, "the body must be a JSON object"),
])
def test_management_bodies_name_the_key(serializer_class, data, param, message):
    assert refusal(serializer_class, data) == (400, param, message)


def test_a_model_entry_passes_on_as_sent():
    entry = {"id": "a", "family": "fixture", "slots": "2", "load_options": {"x": [1]}}
    assert validated(ModelLoadInputSerializer(data=entry)) == entry
    assert refusal(ModelLoadInputSerializer, {**entry, "flavour": 1})[:2] == (400, "flavour")


@pytest.mark.stack
def test_http_errors_carry_the_field_path(stack, speech):
    """Through the server: the serializer's path, and the option schema's (checked once the model is known)."""
    audio_b64 = base64.b64encode(speech[0].wav).decode()
    with stack.client() as c:
        bad_base64 = c.post("/v1/tasks/run", json={"model": "vad", "request": {"audio_base64": "@@"}})
        bad_option = c.post("/v1/tasks/run", json={"model": "vad", "request": {
            "audio_base64": audio_b64, "options": {"threshold": 7}}})
        bad_temperature = c.post("/v1/audio/transcriptions", data={"model": "whisper", "temperature": "3"},
                                 files={"file": ("a.wav", speech[0].wav)})
    assert bad_base64.status_code == 400
    assert bad_base64.json()["error"]["param"] == "request.audio_base64"
    error = bad_option.json()["error"]
    assert bad_option.status_code == 400 and error["param"] == "request.options.threshold"
    assert error["message"].startswith("key 'request.options.threshold': 7 is greater than the maximum")
    error = bad_temperature.json()["error"]
    assert bad_temperature.status_code == 400 and error["param"] == "temperature", error


@pytest.mark.stack
def test_inputs_that_break_python_or_django_limits_are_400_in_the_error_shape(stack):
    """Found by an adversarial run: each of these was a 500 (or Django's HTML page)."""
    huge = "9" * 5000  # beyond Python's int() digit limit (4300)
    with stack.client() as c:
        answers = {
            "huge integer in JSON": c.post("/v1/tasks/run", json={"model": "vad", "busy_timeout_ms": huge,
                                                                   "request": {"audio_base64": ""}}),
            "huge integer in the query": c.post(f"/v1/tasks/run?busy_timeout_ms={huge}",
                                                json={"model": "vad", "request": {"audio_base64": ""}}),
            "too many form fields": c.post("/v1/audio/transcriptions",
                                           data={f"f{i}": "x" for i in range(1200)} | {"model": "whisper"}),
            "invalid Host header": c.get("/health", headers={"Host": "bad host!"}),
        }
    for name, resp in answers.items():
        assert resp.status_code == 400, (name, resp.status_code, resp.text[:200])
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], name
    assert answers["huge integer in JSON"].json()["error"]["param"] == "busy_timeout_ms"
