"""``manage.py admission``: the admission table generated from evidence records (R9.2).

Records are written with ``evidence.write`` into a temporary evidence root (records are data: the
tests craft them as a validation run would leave them); the command runs for real and writes a
temporary table file.
"""
from __future__ import annotations

import io
import json
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from inference.validation import evidence

PASSING_F = {ident: evidence.check(evidence.PASS, "framework record") for ident in evidence.FRAMEWORK_IDS}


def record(root: Path, family: str, task: str, counts: dict[int, bool], finished_at: str, *,
           backend: str = "cpu", framework: dict | None = None, failing_check: str = "M2") -> Path:
    """Write a model record: per count, M2 and M3 PASS when ``ready``, else ``failing_check`` FAIL."""
    per_count = {}
    for n, ready in counts.items():
        checks = {"M2": evidence.check(evidence.PASS, {"starts": 3}), "M3": evidence.check(evidence.PASS, {})}
        if not ready:
            checks[failing_check] = evidence.check(evidence.FAIL, {"mismatch": "slot 1"}, "outputs differ")
        per_count[str(n)] = {"model_checks": checks, "admission_ready": ready}
    rec = {"procedure_version": evidence.PROCEDURE_VERSION, "kind": "model",
           "run_id": f"{finished_at.replace(':', '').replace('-', '')}-{family}-{task}-offline-{backend}",
           "started_at": finished_at, "finished_at": finished_at, "duration_s": 1.0,
           "manifest": {"backend": backend, "family": family, "task": task, "mode": "offline",
                        "counts": sorted(counts)},
           "framework_checks": framework if framework is not None else PASSING_F,
           "model_checks": {"M1": evidence.check(evidence.PASS, {})}, "counts": per_count,
           "admission_ready": all(counts.values()), "performance": {}}
    return evidence.write(root, rec)


def framework_record(root: Path, finished_at: str, *, backend: str = "cpu", failing: str | None = None,
                     code_tree: str = "tree-a") -> Path:
    """Write a framework record: F1-F6 PASS, or ``failing`` FAIL."""
    checks = {ident: evidence.check(evidence.FAIL if ident == failing else evidence.PASS, {"tests": 1})
              for ident in evidence.FRAMEWORK_IDS}
    rec = {"procedure_version": evidence.PROCEDURE_VERSION, "kind": "framework",
           "run_id": f"{finished_at.replace(':', '').replace('-', '')}-framework-{backend}",
           "started_at": finished_at, "finished_at": finished_at, "duration_s": 1.0,
           "manifest": {"backend": backend, "revision": {"commit": "c", "dirty": False, "code_tree": code_tree}},
           "framework_checks": checks, "model_checks": {}, "counts": {}, "admission_ready": failing is None,
           "performance": {}}
    return evidence.write(root, rec)


def admission(root: Path, table: Path, *flags: str, backend: str = "cpu") -> str:
    out = io.StringIO()
    call_command("admission", "--backend", backend, "--evidence", str(root), "--table", str(table), *flags, stdout=out)
    return out.getvalue()


def rows(table: Path) -> dict:
    return {k: v for k, v in json.loads(table.read_text()).items() if not k.startswith("_")}


@pytest.fixture
def paths(tmp_path) -> tuple[Path, Path]:
    root = tmp_path / "evidence"
    root.mkdir()
    framework_record(root, "2026-12-01T08:00:00Z")
    framework_record(root, "2026-12-01T08:00:00Z", backend="cuda")
    return root, tmp_path / "cpu.json"


def test_consecutive_ready_counts_are_added_with_the_record_that_decides(paths):
    root, table = paths
    path = record(root, "silero_vad", "vad", {1: True, 2: True, 3: True, 4: True}, "2026-12-01T10:00:00Z")
    record(root, "whisper", "asr", {1: True, 2: True, 4: True}, "2026-12-01T10:05:00Z")  # 3 never ran
    out = admission(root, table, "--write")
    assert rows(table)["silero_vad"] == {"vad/offline": [1, 2, 3, 4]}
    assert rows(table)["whisper"] == {"asr/offline": [1, 2]}
    assert rows(table)["piper"] == {"tts/offline": [1]}  # no record: one slot
    assert rows(table)["fixture"] == {"fixture/offline": [1, 2, 3, 4]}  # the test-only family
    relative = str(path.relative_to(root))
    assert (f"+ silero_vad vad/offline count 4: the newest record that ran it passes its model checks and the "
            f"newest framework record passes F1-F6 ({relative})") in out
    document = json.loads(table.read_text())
    assert document["_sources"]["silero_vad vad/offline"] == {n: relative for n in ("2", "3", "4")}
    assert "generated" in document["_about"].lower() and "whisper asr/offline" in document["_sources"]
    # the whisper count 4 is ready but cannot be admitted without 3
    assert "whisper asr/offline" in out and "count 4" not in "".join(
        line for line in out.splitlines() if line.startswith("  + whisper"))


def test_a_failing_count_stops_the_counts_above_it(paths):
    root, table = paths
    record(root, "piper", "tts", {1: True, 2: True, 3: False, 4: True}, "2026-12-01T10:00:00Z")
    admission(root, table, "--write")
    assert rows(table)["piper"] == {"tts/offline": [1, 2]}


def test_the_newest_record_of_a_count_wins_and_a_newer_failure_removes_it(paths):
    root, table = paths
    record(root, "whisper", "asr", {1: True, 2: True, 3: True}, "2026-12-01T09:00:00Z")
    admission(root, table, "--write")
    assert rows(table)["whisper"] == {"asr/offline": [1, 2, 3]}
    newer = record(root, "whisper", "asr", {3: False}, "2026-12-01T11:00:00Z")
    out = admission(root, table, "--write")
    assert rows(table)["whisper"] == {"asr/offline": [1, 2]}
    assert (f"- whisper asr/offline count 3: the newest record that ran it has a model check that did not pass "
            f"({newer.relative_to(root)})") in out
    record(root, "whisper", "asr", {3: True}, "2026-12-01T12:00:00Z")  # fixed again, later
    admission(root, table, "--write")
    assert rows(table)["whisper"] == {"asr/offline": [1, 2, 3]}


def test_records_of_another_backend_do_not_count(paths):
    root, table = paths
    record(root, "silero_vad", "vad", {1: True, 2: True}, "2026-12-01T10:00:00Z", backend="cuda")
    admission(root, table, "--write")
    assert rows(table)["silero_vad"] == {"vad/offline": [1]}
    cuda = table.with_name("cuda.json")
    admission(root, cuda, "--write", backend="cuda")
    assert rows(cuda)["silero_vad"] == {"vad/offline": [1, 2]}


@pytest.mark.parametrize("damage", ["not json", "missing key", "unknown family", "ready without passing checks",
                                    "pending framework checks"])
def test_a_record_that_cannot_back_its_counts_is_refused_and_nothing_is_written(paths, damage):
    root, table = paths
    good = record(root, "silero_vad", "vad", {1: True, 2: True}, "2026-12-01T10:00:00Z")
    table.write_text('{"before": "untouched"}')
    if damage == "not json":
        bad = good.parent.parent / "broken" / "record.json"
        bad.parent.mkdir()
        bad.write_text("{ this is not json")
    elif damage == "missing key":
        bad = good.parent.parent / "partial" / "record.json"
        bad.parent.mkdir()
        data = json.loads(good.read_text())
        del data["counts"]
        bad.write_text(json.dumps(data))
    elif damage == "unknown family":
        bad = record(root, "silero_vad", "diarization", {1: True, 2: True}, "2026-12-01T10:01:00Z")
    elif damage == "ready without passing checks":
        bad = record(root, "whisper", "asr", {2: True}, "2026-12-01T10:01:00Z")
        data = json.loads(bad.read_text())
        data["counts"]["2"]["model_checks"]["M2"]["status"] = evidence.FAIL
        bad.write_text(json.dumps(data))
    else:
        pending = {ident: evidence.check(evidence.PENDING, None, "no framework record")
                   for ident in evidence.FRAMEWORK_IDS}
        bad = record(root, "whisper", "asr", {2: True}, "2026-12-01T10:01:00Z", framework=pending)
    with pytest.raises(CommandError) as refused:
        admission(root, table, "--write")
    assert str(bad) in str(refused.value) and "nothing written" in str(refused.value)
    assert table.read_text() == '{"before": "untouched"}'


def test_check_passes_on_the_generated_table_and_fails_on_a_hand_edit(paths):
    root, table = paths
    record(root, "silero_vad", "vad", {1: True, 2: True}, "2026-12-01T10:00:00Z")
    with pytest.raises(CommandError, match="differs from what the records"):
        admission(root, table, "--check")  # no table yet
    admission(root, table, "--write")
    assert "up to date" in admission(root, table, "--check")
    document = json.loads(table.read_text())
    document["silero_vad"]["vad/offline"] = [1, 2, 3]  # a count without a record
    table.write_text(json.dumps(document))
    with pytest.raises(CommandError, match="differs"):
        admission(root, table, "--check")
    admission(root, table, "--write")
    assert rows(table)["silero_vad"] == {"vad/offline": [1, 2]}


def test_the_server_reads_the_generated_table_the_same_way(paths):
    """The generated rows keep the shape ``inference/specs.py`` reads (consecutive counts per task/mode)."""
    from inference import specs

    root, table = paths
    record(root, "whisper", "asr", {2: True, 3: True}, "2026-12-01T10:00:00Z")
    admission(root, table, "--write")
    assert specs.consecutive_count(rows(table)["whisper"]["asr/offline"]) == 3
    assert set(rows(table)) == set(specs._read_specs())


def test_framework_checks_are_judged_from_the_newest_framework_record_not_the_models_copy(paths):
    """A model run made before the framework run (its copy of F1-F6 PENDING, its own admission_ready
    false) is admitted once a passing framework record exists; a newer framework record that is not all
    PASS takes every count above one away again, and the output says why."""
    root, table = paths
    pending = {ident: evidence.check(evidence.PENDING, None, "no framework record") for ident in evidence.FRAMEWORK_IDS}
    path = record(root, "silero_vad", "vad", {2: True, 3: True}, "2026-12-01T09:00:00Z", framework=pending)
    data = json.loads(path.read_text())
    for entry in data["counts"].values():
        entry["admission_ready"] = False  # what validate_slots writes while F1-F6 are PENDING
    data["admission_ready"] = False
    path.write_text(json.dumps(data))
    out = admission(root, table, "--write")
    assert rows(table)["silero_vad"] == {"vad/offline": [1, 2, 3]}
    assert "framework: F1-F6 PASS" in out
    assert "note: " in out and str(path.relative_to(root)) in out  # its code tree is not the framework's
    failing = framework_record(root, "2026-12-01T10:00:00Z", failing="F6")
    out = admission(root, table, "--write")
    assert rows(table)["silero_vad"] == {"vad/offline": [1]}
    assert "- silero_vad vad/offline count 2: model checks pass, but the newest framework record has F6 FAIL" in out
    assert str(failing.relative_to(root)) in out
    assert json.loads(table.read_text())["_framework"]["passed"] is False
    framework_record(root, "2026-12-01T11:00:00Z")
    admission(root, table, "--write")
    assert rows(table)["silero_vad"] == {"vad/offline": [1, 2, 3]}


def test_without_a_framework_record_no_count_above_one_is_admitted(tmp_path):
    root = tmp_path / "evidence"
    root.mkdir()
    table = tmp_path / "cpu.json"
    record(root, "whisper", "asr", {2: True}, "2026-12-01T09:00:00Z")
    out = admission(root, table, "--write")
    assert rows(table)["whisper"] == {"asr/offline": [1]}
    assert "no framework record for cpu" in out
