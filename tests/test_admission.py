"""``manage.py admission``: the admission table generated from evidence records (R9.2).

Records are written with ``evidence.write`` into a temporary evidence root (records are data: the
tests craft them as a validation run would leave them); the command runs for real and writes a
temporary table file.
"""
from __future__ import annotations

import json
from pathlib import Path

import pytest
from django.core.management import call_command
from django.core.management.base import CommandError

from gate import evidence

from .support.records import admission, framework_record, record, rows

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
    assert rows(table)["silero_vad"] == {"vad/offline": [1, 2, 3, 4], "vad/batch": [1]}
    assert rows(table)["whisper"] == {"asr/offline": [1, 2], "asr/streaming": [1], "asr/batch": [1]}
    assert rows(table)["piper"] == {"tts/offline": [1], "tts/streaming": [1]}  # no record: one slot
    # the test-only family
    assert rows(table)["fixture"] == {"fixture/offline": [1, 2, 3, 4], "fixture/batch": [1, 2, 3, 4]}
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
    assert rows(table)["piper"] == {"tts/offline": [1, 2], "tts/streaming": [1]}


def test_the_newest_record_of_a_count_wins_and_a_newer_failure_removes_it(paths):
    root, table = paths
    record(root, "whisper", "asr", {1: True, 2: True, 3: True}, "2026-12-01T09:00:00Z")
    admission(root, table, "--write")
    assert rows(table)["whisper"] == {"asr/offline": [1, 2, 3], "asr/streaming": [1], "asr/batch": [1]}
    newer = record(root, "whisper", "asr", {3: False}, "2026-12-01T11:00:00Z")
    out = admission(root, table, "--write")
    assert rows(table)["whisper"] == {"asr/offline": [1, 2], "asr/streaming": [1], "asr/batch": [1]}
    assert (f"- whisper asr/offline count 3: the newest record that ran it: model checks that did not pass: M2 FAIL "
            f"({newer.relative_to(root)})") in out
    record(root, "whisper", "asr", {3: True}, "2026-12-01T12:00:00Z")  # fixed again, later
    admission(root, table, "--write")
    assert rows(table)["whisper"] == {"asr/offline": [1, 2, 3], "asr/streaming": [1], "asr/batch": [1]}


def test_records_of_another_backend_do_not_count(paths):
    root, table = paths
    record(root, "silero_vad", "vad", {1: True, 2: True}, "2026-12-01T10:00:00Z", backend="cuda")
    admission(root, table, "--write")
    assert rows(table)["silero_vad"] == {"vad/offline": [1], "vad/batch": [1]}
    cuda = table.with_name("cuda.json")
    admission(root, cuda, "--write", backend="cuda")
    assert rows(cuda)["silero_vad"] == {"vad/offline": [1, 2], "vad/batch": [1]}


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
    assert rows(table)["silero_vad"] == {"vad/offline": [1, 2], "vad/batch": [1]}


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
    assert rows(table)["silero_vad"] == {"vad/offline": [1, 2, 3], "vad/batch": [1]}
    assert "framework: F1-F6 PASS" in out
    assert "note: " in out and str(path.relative_to(root)) in out  # its code tree is not the framework's
    failing = framework_record(root, "2026-12-01T10:00:00Z", failing="F6")
    out = admission(root, table, "--write")
    assert rows(table)["silero_vad"] == {"vad/offline": [1], "vad/batch": [1]}
    assert "- silero_vad vad/offline count 2: model checks pass, but the newest framework record has F6 FAIL" in out
    assert str(failing.relative_to(root)) in out
    assert json.loads(table.read_text())["_framework"]["passed"] is False
    framework_record(root, "2026-12-01T11:00:00Z")
    admission(root, table, "--write")
    assert rows(table)["silero_vad"] == {"vad/offline": [1, 2, 3], "vad/batch": [1]}


def test_without_a_framework_record_no_count_above_one_is_admitted(tmp_path):
    root = tmp_path / "evidence"
    root.mkdir()
    table = tmp_path / "cpu.json"
    record(root, "whisper", "asr", {2: True}, "2026-12-01T09:00:00Z")
    out = admission(root, table, "--write")
    assert rows(table)["whisper"] == {"asr/offline": [1], "asr/streaming": [1], "asr/batch": [1]}
    assert "no framework record for cpu" in out


# -- hostile and malformed evidence ----------------------------------------------------------------

def _edit(path: Path, change) -> None:
    rec = json.loads(path.read_text())
    change(rec)
    path.write_text(json.dumps(rec))


@pytest.fixture
def root(tmp_path) -> Path:
    """An evidence root holding one passing cpu framework record."""
    root = tmp_path / "evidence"
    root.mkdir()
    framework_record(root, "2026-12-01T08:00:00Z")
    return root


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
    assert rows(tmp_path / "cpu.json")["whisper"] == {"asr/offline": [1], "asr/streaming": [1], "asr/batch": [1]}


def test_a_count_with_no_model_checks_of_its_own_is_not_validated(root, tmp_path):
    """Only the run's M1 PASS, the counts carry no M2-M5 at all: nothing shows 2 or 3 slots worked."""
    path = record(root, "whisper", "asr", {1: True, 2: True}, "2026-12-01T10:00:00Z")
    _edit(path, lambda r: r.__setitem__("counts", {str(n): {"admission_ready": False} for n in (1, 2, 3)}))
    admission(root, tmp_path / "cpu.json", "--write")
    assert rows(tmp_path / "cpu.json")["whisper"] == {"asr/offline": [1], "asr/streaming": [1], "asr/batch": [1]}


def test_newest_is_decided_by_time_not_by_the_spelling_of_finished_at(root, tmp_path):
    """A newer failing record written as '2026-12-01 17:00:00+00:00' sorts before '...T16:00:00Z' as text."""
    record(root, "whisper", "asr", {1: True, 2: True}, "2026-12-01T16:00:00Z")
    newer = record(root, "whisper", "asr", {1: True, 2: False}, "2026-12-01T17:00:00Z")
    _edit(newer, lambda r: r.__setitem__("finished_at", "2026-12-01 17:00:00+00:00"))
    admission(root, tmp_path / "cpu.json", "--write")
    assert rows(tmp_path / "cpu.json")["whisper"] == {"asr/offline": [1], "asr/streaming": [1], "asr/batch": [1]}


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
    assert rows(tmp_path / "cpu.json")["whisper"] == {"asr/offline": [1], "asr/streaming": [1], "asr/batch": [1]}


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
    assert rows(tmp_path / "cuda.json")["whisper"] == {"asr/offline": [1], "asr/streaming": [1], "asr/batch": [1]}


# --- the committed table ---

def test_the_committed_cpu_table_is_what_the_committed_records_give():
    """main's model_specs/admission/cpu.json is the hand-written table (no _framework) admitting 1..4,
    while no committed framework record passes F1-F6: `admission --check` exits 1 on main."""
    call_command("admission", "--backend", "cpu", "--check")


def test_each_mode_is_admitted_by_its_own_records(paths):
    """A streaming record admits the streaming row only; the offline row keeps what offline records give, and
    a mode the family does not declare is refused."""
    root, table = paths
    record(root, "whisper", "asr", {1: True, 2: True}, "2026-12-01T10:00:00Z")
    record(root, "whisper", "asr", {1: True, 2: True, 3: True, 4: True}, "2026-12-01T10:05:00Z", mode="streaming")
    record(root, "piper", "tts", {1: True, 2: True, 3: False}, "2026-12-01T10:06:00Z", mode="streaming")
    admission(root, table, "--write")
    assert rows(table)["whisper"] == {"asr/offline": [1, 2], "asr/streaming": [1, 2, 3, 4], "asr/batch": [1]}
    assert rows(table)["piper"] == {"tts/offline": [1], "tts/streaming": [1, 2]}
    record(root, "silero_vad", "vad", {1: True, 2: True}, "2026-12-01T10:07:00Z", mode="streaming")
    with pytest.raises(CommandError, match="no family spec serves silero_vad vad/streaming"):
        admission(root, table, "--write")
