"""The streaming procedure's own rules (``gate/streaming.py``) without servers: what a stream's result is, when
M6 of a streaming run passes, and that the streaming workloads are valid requests of their families.
The procedure against real servers is the committed runs' (docs/validation.md, "Streaming runs")."""
from __future__ import annotations

from gate import evidence
from gate.model_checks import Plan
from gate.streaming import VICTIMS, _text_result, streaming_admits_streaming_only
from gate.workloads import STREAMING_WORKLOADS, digest, get_workload
from inference import specs


def test_a_transcription_stream_matches_only_when_its_deltas_join_to_its_final_text():
    exact = _text_result(["Concorde returned", " to its place."], "Concorde returned to its place.")
    offline = _text_result(["Concorde returned to its place."], "Concorde returned to its place.")
    assert exact == offline and digest(exact) == digest(offline)
    reordered = _text_result([" to its place.", "Concorde returned"], "Concorde returned to its place.")
    assert "stream_problem" in reordered and digest(reordered) != digest(offline)
    assert "stream_problem" in _text_result(["Concorde"], None)


def _record(with_waves: bool) -> dict:
    m4 = {"disconnect_mid_stream": [{"how": "close"}, {"how": "reset"}]} if with_waves else {}
    return {"counts": {str(n): {"model_checks": {"M4": evidence.check(evidence.PASS, m4)}} for n in (1, 2)}}


def test_streaming_evidence_admits_streaming_only_and_needs_the_disconnect_waves():
    plan = Plan("whisper", "asr", "streaming", [1, 2], 3, "cpu", None, 20)  # type: ignore[arg-type]
    spec = specs.require_spec("whisper")
    passed = streaming_admits_streaming_only(plan, spec, _record(True))
    assert passed["status"] == evidence.PASS
    assert passed["evidence"]["streaming"].startswith("validated by this run")
    assert passed["evidence"]["offline"].startswith("not validated")
    assert streaming_admits_streaming_only(plan, spec, _record(False))["status"] == evidence.FAIL


def test_the_streaming_workloads_and_their_victims_are_valid_requests():
    for family, workload in STREAMING_WORKLOADS.items():
        assert get_workload(family, "streaming") is workload
        assert "streaming" in specs.require_spec(family)["modes"]
        assert len({item.name for item in workload.items}) == len(workload.items) >= 4
        for item in workload.items:
            assert item.route in ("sse", "realtime", "speech")
            assert specs.request_option_errors(family, item.options) == [], (family, item)
        for victim in VICTIMS[family]:
            assert specs.request_option_errors(family, victim.options) == [], (family, victim)
    assert {i.route for i in STREAMING_WORKLOADS["whisper"].items} == {"sse", "realtime"}
