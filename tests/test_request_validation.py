"""Request validation: every problem is one 400 whose ``param`` is the field path, never a substring.

The serializers are checked directly (no server); the checks that need the
model (option schemas) and the HTTP rendering go through the test stack.
"""
from __future__ import annotations

import base64
import io

import pytest
from django.http import QueryDict

from audiosite.errors import ERROR_TEXT_MAX_CHARS, ApplicationError, InvalidRequest, clip_text
from audiosite.input_checks import JSONParser, validated
from inference.apis import EarlyProbe
from inference.serializers import SpeechInputSerializer, TaskRunInputSerializer, TranscriptionInputSerializer
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
     "request needs 'audio' (server-local path) or 'audio_base64', or 'text' for a speech model"),
    ({"model": "vad", "request": None}, "request",
     "request must be a JSON object with 'audio', 'audio_base64' or 'text'"),
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


@pytest.mark.parametrize("body, query, probed", [
    ({"model": "vad", "request": {"audio_base64": "QUJD"}}, "", ("vad", None)),
    (QueryDict("model=whisper&language=en"), "", ("whisper", None)),
    ({"model": "vad", "busy_timeout_ms": 5, "request": {"busy_timeout_ms": 9}}, "busy_timeout_ms=7", ("vad", 5)),
    ({"model": "vad", "busy_timeout_ms": 0, "request": {}}, "", ("vad", 0)),
    ({"model": "vad", "busy_timeout_ms": -1, "request": {}}, "", None),
    ({"model": "vad", "busy_timeout_ms": 2**31, "request": {}}, "", None),
    ({"model": "vad", "busy_timeout_ms": 5.0, "request": {}}, "", None),
    ({"model": "vad", "busy_timeout_ms": True, "request": {}}, "", None),
    ({"model": "vad", "busy_timeout_ms": None, "request": {}}, "", None),
    ({"model": "vad", "request": {"busy_timeout_ms": None}}, "", None),
    (QueryDict("model=whisper&busy_timeout_ms="), "", None),
    (QueryDict("model=whisper&busy_timeout_ms=5"), "", None),
    ({"model": "vad", "request": {}}, "busy_timeout_ms=9", None),
    ({"model": 7, "request": {}}, "", None),
    ({"model": "", "request": {}}, "", None),
    ([{"model": "vad"}], "", None),
])
def test_the_admission_probe_is_sent_before_validation_only_when_validation_cannot_change_it(body, query, probed):
    """The early probe is sent for exactly the model and busy_timeout_ms validation will give."""
    assert EarlyProbe.what_to_probe(body, QueryDict(query)) == probed
    if probed is not None and type(body) is dict:  # a JSON body (a QueryDict is a dict too)
        sent = {**body, "request": {"audio": "x", **body["request"]}}
        data = validated(TaskRunInputSerializer(data=sent, context={"query_params": QueryDict(query)}))
        assert (data["model"], data["busy_timeout_ms"]) == probed


@pytest.mark.stack
def test_an_unknown_model_in_a_bad_body_is_refused_for_the_body_first(stack):
    """Validation comes before the registry's answer, also when the probe was sent while the body was validated."""
    with stack.client() as c:
        bad_body = c.post("/v1/tasks/run", json={"model": "nobody", "request": {"audio_base64": "@@"}})
        unknown = c.post("/v1/tasks/run", json={"model": "nobody", "request": {"audio_base64": "QUJD"}})
    assert bad_body.status_code == 400 and bad_body.json()["error"]["param"] == "request.audio_base64"
    assert unknown.status_code == 404 and unknown.json()["error"]["param"] == "model"


@pytest.mark.parametrize("text, param", [
    ('{"model": "vad", "busy_timeout_ms": HUGE}', "busy_timeout_ms"),
    ('{"model": "vad", "request": {"audio": "x", "busy_timeout_ms": -HUGE}}', "request.busy_timeout_ms"),
    ('{"model": "vad", "request": {"options": {"a": [1, {"b": HUGE}]}}}', "request.options.a.b"),
    ('{"id": "m", "slots": HUGE}', "slots"),
    ("HUGE", None),
])
def test_a_json_integer_beyond_pythons_digit_limit_is_a_400_naming_its_field(text, param):
    """``json`` raises ValueError for an integer literal of more than 4300 digits; the parser
    reports it as the field's problem instead of an anonymous parse error."""
    body = text.replace("HUGE", "9" * 5000).encode()
    with pytest.raises(InvalidRequest) as caught:
        JSONParser().parse(io.BytesIO(body), "application/json", {})
    assert (caught.value.status, caught.value.param) == (400, param)
    assert caught.value.message == f"{param or 'the body'} is an integer of 5000 digits, far out of range"
    assert JSONParser().parse(io.BytesIO(b'{"a": 4300, "b": -1}'), "application/json", {}) == {"a": 4300, "b": -1}


def test_error_texts_are_clipped_in_the_middle_with_a_marker():
    """Error messages echoed input unbounded (a 50 MB prompt came back whole)."""
    assert clip_text("x" * ERROR_TEXT_MAX_CHARS) == "x" * ERROR_TEXT_MAX_CHARS
    clipped = clip_text("key 'prompt': '" + "A" * 100_000 + "' is too long")
    assert len(clipped) < ERROR_TEXT_MAX_CHARS
    assert clipped.startswith("key 'prompt': 'AAA") and clipped.endswith("AAA' is too long")
    assert "…[99668 characters omitted]…" in clipped
    error = InvalidRequest("model " + "m" * 10_000, param="request.options." + "k" * 10_000)
    assert len(error.message) < ERROR_TEXT_MAX_CHARS and len(error.param or "") < ERROR_TEXT_MAX_CHARS
    assert error.body()["error"]["message"] == error.message


MANY_QUERY = "&".join(f"q{i}=1" for i in range(1100))  # over DATA_UPLOAD_MAX_NUMBER_FIELDS (1000)


@pytest.mark.stack
def test_inputs_that_break_python_or_django_limits_are_400_in_the_error_shape(stack, speech):
    """Each of these was a 500 (or Django's HTML page, or a 400
    without ``param``)."""
    huge = "9" * 5000  # beyond Python's int() digit limit (4300)
    b64 = base64.b64encode(speech[0].wav).decode()
    json_header = {"content-type": "application/json"}

    def raw(text: str) -> str:
        return text.replace("HUGE", huge).replace("B64", b64)

    with stack.client() as c:
        answers = {
            "huge integer in JSON": c.post("/v1/tasks/run", json={"model": "vad", "busy_timeout_ms": huge,
                                                                   "request": {"audio_base64": ""}}),
            "huge integer in the query": c.post(f"/v1/tasks/run?busy_timeout_ms={huge}",
                                                json={"model": "vad", "request": {"audio_base64": ""}}),
            "huge integer in a form": c.post("/v1/audio/transcriptions", data={"model": "whisper",
                                                                               "busy_timeout_ms": huge},
                                             files={"file": ("a.wav", speech[0].wav)}),
            "huge integer literal in JSON": c.post("/v1/tasks/run", headers=json_header, content=raw(
                '{"model": "vad", "busy_timeout_ms": HUGE, "request": {"audio_base64": "B64"}}')),
            "huge integer literal in request": c.post("/v1/tasks/run", headers=json_header, content=raw(
                '{"model": "vad", "request": {"busy_timeout_ms": HUGE, "audio_base64": "B64"}}')),
            "huge integer literal in an option": c.post("/v1/tasks/run", headers=json_header, content=raw(
                '{"model": "vad", "request": {"options": {"min_speech_duration_ms": HUGE}, "audio_base64": "B64"}}')),
            "huge integer literal in transcription JSON": c.post("/v1/audio/transcriptions", headers=json_header,
                                                                 content=raw('{"model": "whisper", "file": "x", '
                                                                             '"busy_timeout_ms": HUGE}')),
            "too many form fields": c.post("/v1/audio/transcriptions",
                                           data={f"f{i}": "x" for i in range(1200)} | {"model": "whisper"}),
            "too many files": c.post("/v1/audio/transcriptions", data={"model": "whisper"},
                                     files=[(f"f{i}", ("a.wav", b"x")) for i in range(120)]),
            "too many query parameters (transcriptions)": c.post(f"/v1/audio/transcriptions?{MANY_QUERY}",
                                                                 data={"model": "whisper"},
                                                                 files={"file": ("a.wav", speech[0].wav)}),
            "too many query parameters (tasks)": c.post(f"/v1/tasks/run?{MANY_QUERY}",
                                                        json={"model": "vad", "request": {"audio_base64": b64}}),
            "too many query parameters (models)": c.get(f"/v1/models?{MANY_QUERY}"),
            "too many query parameters (one model)": c.get(f"/v1/models/vad?{MANY_QUERY}"),
            "too many query parameters (health)": c.get(f"/health?{MANY_QUERY}"),
            "too many query parameters (management)": c.post(f"/v1/models/unload?{MANY_QUERY}", json={"id": "vad"}),
            "invalid Host header": c.get("/health", headers={"Host": "bad host!"}),
        }
        for model_id in ("whisper", "vad"):
            assert stack.counters(model_id) == {"leases": 0, "queued": 0}
    for name, resp in answers.items():
        assert resp.status_code == 400, (name, resp.status_code, resp.text[:200])
        error = resp.json()["error"]
        assert error["type"] == "invalid_request_error" and error["message"], name
    params = {name: resp.json()["error"]["param"] for name, resp in answers.items()}
    assert params["huge integer in JSON"] == "busy_timeout_ms"
    assert params["huge integer in the query"] == "busy_timeout_ms"
    assert params["huge integer in a form"] == "busy_timeout_ms"
    assert params["huge integer literal in JSON"] == "busy_timeout_ms"
    assert params["huge integer literal in request"] == "request.busy_timeout_ms"
    assert params["huge integer literal in an option"] == "request.options.min_speech_duration_ms"
    assert params["huge integer literal in transcription JSON"] == "busy_timeout_ms"
    for name in answers:
        if name.startswith("too many query"):
            assert answers[name].json()["error"]["message"] == (
                "too many form fields or query parameters (at most 1000 are accepted)"), name
    assert answers["too many files"].json()["error"]["message"] == "too many uploaded files (at most 100 are accepted)"


@pytest.mark.stack
def test_error_bodies_quote_long_input_clipped(stack, speech):
    """An error message quoting what the client sent is cut to under 400 characters, with a marker;
    so is a ``param`` made of the client's keys."""
    long_text = "A" * 1_000_000
    with stack.client() as c:
        answers = [
            c.post("/v1/audio/transcriptions", data={"model": "whisper", "prompt": long_text},
                   files={"file": ("a.wav", speech[0].wav)}),  # the option schema: "'AAAA…' is too long"
            c.post("/v1/tasks/run", json={"model": "m" + long_text, "request": {"audio_base64": ""}}),
            c.post("/v1/tasks/run", json={"model": "vad", "request": {"options": {"k" + long_text: 1},
                                                                      "audio_base64": ""}}),
            c.get("/v1/" + "p" * 8_000),
        ]
    for resp in answers:
        assert 400 <= resp.status_code < 500, resp.text[:300]
        error = resp.json()["error"]
        assert len(error["message"]) < 400 and " characters omitted]…" in error["message"], error["message"]
        assert error["param"] is None or len(error["param"]) < 400
    assert answers[0].json()["error"]["param"] == "prompt"
    assert answers[0].json()["error"]["message"].endswith("AAAA' is too long")


def test_speech_input_limits_and_defaults():
    ok = validated(SpeechInputSerializer(data={"model": "tts", "input": "é" * 4096}, context={"query_params": {}}))
    assert (ok["voice"], ok["speed"], ok["response_format"], ok["stream_format"], ok["seed"]) == (
        None, 1.0, "mp3", "audio", None)
    assert validated(SpeechInputSerializer(data={"model": "tts", "input": "Hi", "voice": {"id": "alloy"}},
                                           context={"query_params": {}}))["voice"] == "alloy"
    cases = [
        ({"input": "é" * 4097}, "input", "input must have 1 to 4096 characters, not 4097"),
        ({"input": "   "}, "input", "input must have 1 to 4096 characters, not 0"),
        ({"input": "Hi", "speed": 0.2}, "speed", "speed must be between 0.25 and 4.0, not 0.2"),
        ({"input": "Hi", "speed": "fast"}, "speed", "speed must be a number"),
        ({"input": "Hi", "voice": {"name": "x"}}, "voice", 'voice must be a voice name or an object {"id": name}'),
        ({"input": "Hi", "seed": -1}, "seed", "seed must be between 0 and 2147483646"),
    ]
    for change, param, message in cases:
        assert refusal(SpeechInputSerializer, {"model": "tts", **change}) == (400, param, message)
