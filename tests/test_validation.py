"""The validation gate's model checks (``manage.py validate_slots``, VALIDATION.md M1–M6) on real servers.

Each run starts real ``manage.py serve`` processes (embedded Redis, SQLite, a Celery worker), so these
tests need no PostgreSQL or Redis of the suite. The controllable ``fixture`` family keeps them short:
its answers name the slot that served them, which gives a real mismatch to catch.
"""
from __future__ import annotations

import dataclasses
import json

import pytest
from django.core.management import call_command

from gate import evidence
from gate.model_checks import Plan, run_model_validation, stabilisation
from gate.workloads import get_workload

pytestmark = pytest.mark.stack


def _framework_record(root, status: str) -> None:
    """A framework record for cpu under ``root`` whose F1–F6 all have ``status`` (the model record copies
    them; the framework checks themselves are another command's job)."""
    record = {"procedure_version": evidence.PROCEDURE_VERSION, "kind": "framework",
              "run_id": evidence.run_id("framework", "cpu"), "started_at": evidence.now_iso(),
              "finished_at": evidence.now_iso(), "duration_s": 0.0,
              "manifest": {"backend": "cpu", "revision": evidence.code_revision(),
                           "note": "written by test_validation"},
              "framework_checks": {i: evidence.check(status, None, "test") for i in evidence.FRAMEWORK_IDS},
              "model_checks": {}, "counts": {}, "admission_ready": status == evidence.PASS, "performance": {}}
    evidence.write(root, record)


def test_validate_slots_on_the_fixture_family_passes_each_count_and_writes_one_record(tmp_path, monkeypatch, capsys):
    monkeypatch.setenv("AUDIOSITE_ENABLE_FIXTURE_FAMILY", "1")
    _framework_record(tmp_path, evidence.PASS)
    call_command("validate_slots", "--family", "fixture", "--counts", "1", "2", "--starts", "1",
                 "--memory-cycles", "10", "--out", str(tmp_path))
    printed = capsys.readouterr().out
    records = [r for _, r in evidence.load_all(tmp_path) if r["kind"] == "model"]
    assert len(records) == 1
    record = records[0]
    path = evidence.record_dir(tmp_path, record) / evidence.RECORD_NAME
    assert f"record written to {path}" in printed
    assert record["manifest"]["family"] == "fixture" and record["manifest"]["counts"] == [1, 2]
    assert record["manifest"]["starts"] == 1
    assert record["manifest"]["comparison_rule"]["relaxed_after_mismatch"] is False
    assert set(record["manifest"]["fixtures"]) >= {"speech", "speech_2s", "source_sample"}
    assert all(record["framework_checks"][i]["status"] == evidence.PASS for i in evidence.FRAMEWORK_IDS)
    m1 = record["model_checks"]["M1"]
    assert m1["status"] == evidence.PASS, m1["limits"]
    assert all(v["distinct_answers"] == 1 for v in m1["evidence"]["legacy_serial_variation"].values())
    assert record["model_checks"]["M6"]["status"] == evidence.PASS
    assert set(record["counts"]) == {"1", "2"}
    for n in ("1", "2"):
        checks = record["counts"][n]["model_checks"]
        assert {k: v["status"] for k, v in checks.items()} == dict.fromkeys(("M2", "M3", "M4", "M5"), evidence.PASS), \
            {k: v["limits"] for k, v in checks.items()}
        assert record["counts"][n]["admission_ready"] is True
        start = checks["M2"]["evidence"]["starts"][0]
        assert start["max_active_slots_seen"] == int(n) and start["drained_after"]["drained"]
        assert checks["M5"]["evidence"]["cycles"] == 10
    # the largest count ran ten mixed waves, half of them in reversed admission order
    mixed = record["counts"]["2"]["model_checks"]["M3"]["evidence"]["starts"][0]["waves"]
    assert len(mixed) == 10 and sum(w["reversed"] for w in mixed) == 5
    assert len(record["counts"]["1"]["model_checks"]["M3"]["evidence"]["starts"][0]["waves"]) == 2
    # the load failure was real and the retry served exactly
    retry = record["counts"]["2"]["model_checks"]["M4"]["evidence"]["load_failure_then_retry"]
    assert retry["request_after_failure_status"] == 503 and all(r["exact"] for r in retry["after_retry"])
    # the unloads met a first lazy load in progress (held at the fixture's load barrier)
    for key in ("targeted_unload_during_lazy_load", "bulk_unload_during_lazy_load"):
        during = record["counts"]["2"]["model_checks"]["M4"]["evidence"][key]
        assert during["overlapped_the_load"] is True and during["attempts"][0]["state_when_unload_sent"] == "loading"
    run_dir = path.parent
    logged = [json.loads(line) for line in (run_dir / "requests.jsonl").read_text().splitlines()]
    assert len(logged) == record["raw"]["requests_logged"] and all(e.get("match", True) for e in logged)
    assert sorted(p.stem for p in (run_dir / "outputs" / "reference").iterdir()) == sorted(
        i.name for i in get_workload("fixture").items)
    assert "M4     PASS" in printed and "ready  True" in printed


def test_a_batch_run_registers_each_batch_size_with_room_for_two_batches_and_shows_them(tmp_path, monkeypatch):
    """R9.3, VALIDATION.md M6: ``validate_slots --mode batch`` at count 2 registers the model with
    ``max_batch`` 2 and 4 slots; its concurrent waves (M2, M3) equal the serial references, M2 sees all
    4 slots busy at once (two batches of 2 running together), M4's batch wave is served by calls of 2
    (from ``/metrics``), and M6 says batch evidence admits batch sizes only."""
    monkeypatch.setenv("AUDIOSITE_ENABLE_FIXTURE_FAMILY", "1")
    _framework_record(tmp_path, evidence.PASS)
    call_command("validate_slots", "--family", "fixture", "--mode", "batch", "--counts", "2", "--starts", "1",
                 "--memory-cycles", "10", "--out", str(tmp_path))
    [record] = [r for _, r in evidence.load_all(tmp_path) if r["kind"] == "model"]
    assert record["manifest"]["mode"] == "batch"
    checks = record["counts"]["2"]["model_checks"]
    assert {k: v["status"] for k, v in checks.items()} == dict.fromkeys(("M2", "M3", "M4", "M5"), evidence.PASS), \
        {k: v["limits"] for k, v in checks.items()}
    assert checks["M2"]["evidence"]["starts"][0]["max_active_slots_seen"] == 4
    batch = checks["M4"]["evidence"]["batch"]
    assert (batch["batch_size"], batch["slots"]) == (2, 4) and batch["wave"]["calls_by_size"].get("2"), batch
    assert all(batch["wave"]["exact"])
    assert batch["bad_request_in_batch"].startswith(evidence.NOT_APPLICABLE)  # the fixture has no such request
    assert record["model_checks"]["M6"]["status"] == evidence.PASS
    assert record["counts"]["2"]["admission_ready"] is True


def test_a_count_whose_answers_differ_from_the_serial_reference_fails(tmp_path, monkeypatch):
    """The fixture's answers carry the serving slot. A workload that does not declare ``slot`` volatile
    passes at one slot (always slot 0) and must fail at two, where the second slot serves some requests;
    without a framework record the F entries stay PENDING, so no count is admission-ready."""
    monkeypatch.setenv("AUDIOSITE_ENABLE_FIXTURE_FAMILY", "1")
    base = get_workload("fixture")
    strict = dataclasses.replace(base, volatile={k: v for k, v in base.volatile.items() if k != "slot"})
    _, record = run_model_validation(Plan("fixture", "fixture", "offline", [2], 1, "cpu", tmp_path, 10), strict,
                                     print_line=lambda line: None)
    assert record["model_checks"]["M1"]["status"] == evidence.PASS  # one slot: every answer says slot 0
    count = record["counts"]["2"]
    assert count["model_checks"]["M2"]["status"] == evidence.FAIL
    assert "differs from the serial reference" in count["model_checks"]["M2"]["limits"]
    assert count["admission_ready"] is False and "M2" in count["blocked_by"]
    assert record["admission_ready"] is False
    if evidence.latest_framework(evidence.EVIDENCE_DIR, "cpu") is None:
        assert record["framework_checks"]["F1"]["status"] == evidence.PENDING
    run_dir = evidence.record_dir(tmp_path, record)
    assert any((run_dir / "outputs" / "mismatch").iterdir())


def test_the_memory_verdict_follows_its_rule():
    flat = [500.0 + (i % 2) * 0.5 for i in range(20)]
    assert stabilisation(flat)["stable"] is True
    growing = [500.0 + 3 * i for i in range(20)]  # +3 MB per cycle: 15 MB between the window's halves
    verdict = stabilisation(growing)
    assert verdict["stable"] is False and verdict["trend_mb"] == 15.0
    assert stabilisation(flat[:5])["stable"] is False
