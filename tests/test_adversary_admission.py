"""Adversary cases for ``manage.py admission`` (hostile or malformed evidence records, table files).

Each test is a reproduction of a failure found against main at a214faa; they fail until fixed.
Records are data: they are crafted in a temporary evidence root the way ``tests/test_admission.py``
crafts them, and the real command runs on them.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from inference.validation import evidence
from tests.test_admission import admission, framework_record, record, rows


@pytest.fixture
def root(tmp_path) -> Path:
    root = tmp_path / "evidence"
    root.mkdir()
    framework_record(root, "2026-12-01T08:00:00Z")
    return root


def _edit(path: Path, change) -> None:
    rec = json.loads(path.read_text())
    change(rec)
    path.write_text(json.dumps(rec))


# --- malformed records: the documented answer is a CommandError naming the path, never a traceback ---

@pytest.mark.parametrize("case", ["record_is_a_list", "counts_is_a_list", "model_checks_is_a_list",
                                  "finished_at_is_a_number", "finished_at_is_nan", "superscript_count",
                                  "count_of_5000_digits"])
def test_a_malformed_record_is_refused_with_its_path(root, tmp_path, case):
    path = record(root, "whisper", "asr", {1: True, 2: True}, "2026-12-01T10:00:00Z")
    if case == "record_is_a_list":
        path.write_text("[1, 2]")
    elif case == "counts_is_a_list":
        _edit(path, lambda r: r.__setitem__("counts", [1, 2]))
    elif case == "model_checks_is_a_list":
        _edit(path, lambda r: r.__setitem__("model_checks", [1]))
    elif case == "finished_at_is_a_number":
        _edit(path, lambda r: r.__setitem__("finished_at", 5))
    elif case == "finished_at_is_nan":
        _edit(path, lambda r: r.__setitem__("finished_at", float("nan")))  # json.dumps writes NaN
    elif case == "superscript_count":  # "²".isdigit() is True, int("²") raises ValueError
        _edit(path, lambda r: r["counts"].__setitem__("²", r["counts"].pop("2")))
    else:  # int() refuses strings over 4300 digits
        _edit(path, lambda r: r["counts"].__setitem__("9" * 5000, r["counts"].pop("2")))
    with pytest.raises(CommandError, match="record.json"):
        admission(root, tmp_path / "cpu.json")


def test_a_record_json_that_is_a_directory_is_refused(root, tmp_path):
    (root / "cpu" / "whisper" / "asr-offline" / "x" / "record.json").mkdir(parents=True)
    with pytest.raises(CommandError, match="record.json"):
        admission(root, tmp_path / "cpu.json")


@pytest.mark.parametrize("content", ["[1]", '{"whisper": [1, 2]}', None])
def test_a_table_file_of_the_wrong_shape_is_a_clear_error(root, tmp_path, content):
    table = tmp_path / "cpu.json"
    if content is None:
        table.mkdir()  # --table names a directory
    else:
        table.write_text(content)
    with pytest.raises(CommandError):
        admission(root, table)


# --- records that claim more than they show ---

def test_a_record_whose_checks_are_all_not_applicable_admits_nothing(root, tmp_path):
    """No PASS anywhere (evidence.all_pass says False) must not validate 2..16."""
    path = record(root, "whisper", "asr", {1: True, 2: True}, "2026-12-01T10:00:00Z")
    na = evidence.check(evidence.NOT_APPLICABLE, None, "not run")

    def change(rec):
        rec["model_checks"] = {ident: na for ident in evidence.MODEL_IDS}
        rec["counts"] = {str(n): {"model_checks": {}, "admission_ready": False} for n in range(1, 17)}
    _edit(path, change)
    admission(root, tmp_path / "cpu.json", "--write")
    assert rows(tmp_path / "cpu.json")["whisper"] == {"asr/offline": [1]}


def test_a_count_with_no_model_checks_of_its_own_is_not_validated(root, tmp_path):
    """Only the run's M1 PASS, the counts carry no M2-M5 at all: nothing shows 2 or 3 slots worked."""
    path = record(root, "whisper", "asr", {1: True, 2: True}, "2026-12-01T10:00:00Z")
    _edit(path, lambda r: r.__setitem__("counts", {str(n): {"admission_ready": False} for n in (1, 2, 3)}))
    admission(root, tmp_path / "cpu.json", "--write")
    assert rows(tmp_path / "cpu.json")["whisper"] == {"asr/offline": [1]}


def test_newest_is_decided_by_time_not_by_the_spelling_of_finished_at(root, tmp_path):
    """A newer failing record written as '2026-12-01 17:00:00+00:00' sorts before '...T16:00:00Z' as text."""
    record(root, "whisper", "asr", {1: True, 2: True}, "2026-12-01T16:00:00Z")
    newer = record(root, "whisper", "asr", {1: True, 2: False}, "2026-12-01T17:00:00Z")
    _edit(newer, lambda r: r.__setitem__("finished_at", "2026-12-01 17:00:00+00:00"))
    admission(root, tmp_path / "cpu.json", "--write")
    assert rows(tmp_path / "cpu.json")["whisper"] == {"asr/offline": [1]}


def test_a_record_finished_in_the_future_is_refused(root, tmp_path):
    """finished_at 9999 would stay 'newest' forever: no later failing run could remove its counts."""
    old = record(root, "whisper", "asr", {1: True, 2: True}, "2026-12-01T16:00:00Z")
    _edit(old, lambda r: r.__setitem__("finished_at", "9999-01-01T00:00:00Z"))
    record(root, "whisper", "asr", {1: True, 2: False}, "2026-12-01T17:00:00Z")
    with pytest.raises(CommandError, match="finished_at"):
        admission(root, tmp_path / "cpu.json")


def test_a_cpu_record_stored_under_the_cuda_folder_does_not_decide_cpu(tmp_path):
    """Layout says <root>/<backend>/...; a cpu framework record under cuda/ still judges cpu."""
    root = tmp_path / "evidence"
    path = framework_record(root, "2026-12-01T08:00:00Z")  # cpu/framework/<id>/record.json
    moved = root / "cuda" / "framework" / path.parent.name / "record.json"
    moved.parent.mkdir(parents=True)
    path.rename(moved)
    record(root, "whisper", "asr", {1: True, 2: True}, "2026-12-01T10:00:00Z")
    try:
        admission(root, tmp_path / "cpu.json", "--write")
    except CommandError:
        return  # refusing the misplaced record is fine too
    assert rows(tmp_path / "cpu.json")["whisper"] == {"asr/offline": [1]}


def test_a_cuda_record_made_without_a_gpu_does_not_admit_cuda_counts(tmp_path):
    """docs/validation.md: a record must be made on the backend it names; manifest.gpu [] says no GPU."""
    root = tmp_path / "evidence"
    framework_record(root, "2026-12-01T08:00:00Z", backend="cuda")
    path = record(root, "whisper", "asr", {1: True, 2: True}, "2026-12-01T10:00:00Z", backend="cuda")
    _edit(path, lambda r: r["manifest"].update(gpu=[], providers=["CPUExecutionProvider"]))
    try:
        admission(root, tmp_path / "cuda.json", "--write", backend="cuda")
    except CommandError:
        return
    assert rows(tmp_path / "cuda.json")["whisper"] == {"asr/offline": [1]}


# --- the committed table ---

def test_the_committed_cpu_table_is_what_the_committed_records_give():
    """main's model_specs/admission/cpu.json is the hand-written table (no _framework) admitting 1..4,
    while no committed framework record passes F1-F6: `admission --check` exits 1 on main."""
    call_command("admission", "--backend", "cpu", "--check")
