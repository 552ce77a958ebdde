"""How the server reads an admission table (``inference/specs.py``, ``inference/runtime/startup.py``)
and ``AUDIOSITE_ADMISSION_DIR``: each failure below is answered at start-up with a message.

Repro by hand (each fails at start-up, see the report):
  AUDIOSITE_ADMISSION_DIR=/nonexistent manage.py serve --parallel-jobs --config <silero_vad slots 2>
  -> "2 slots are not validated ... (model_specs/admission/cpu.json)": names a file it did not read,
     and a missing folder silently means "nothing validated".
"""
from __future__ import annotations

import json

import pytest

from inference import specs
from inference.runtime import startup


@pytest.fixture
def admission_dir(tmp_path, monkeypatch):
    folder = tmp_path / "admission"
    folder.mkdir()
    monkeypatch.setenv(specs.ADMISSION_DIR_ENV, str(folder))
    specs._admission_table.cache_clear()
    yield folder
    specs._admission_table.cache_clear()


def test_the_refusal_names_the_table_it_read(admission_dir):
    (admission_dir / "cpu.json").write_text(json.dumps({"silero_vad": {"vad/offline": [1]}}))
    problem = specs.slots_count_problem("silero_vad", "vad", "offline", 2, "cpu")
    assert problem is not None
    assert str(admission_dir / "cpu.json") in problem, problem


def test_a_missing_admission_dir_is_an_error_not_an_empty_table(tmp_path, monkeypatch):
    monkeypatch.setenv(specs.ADMISSION_DIR_ENV, str(tmp_path / "no-such-folder"))
    specs._admission_table.cache_clear()
    try:
        with pytest.raises(Exception, match="no-such-folder"):
            specs.admitted_counts("silero_vad", "vad", "offline", "cpu")
    finally:
        specs._admission_table.cache_clear()


@pytest.mark.parametrize("table", ['{"silero_vad": {"vad": [1, 2]}}', '{"silero_vad": [1, 2]}', "not json"])
def test_a_malformed_table_is_a_clear_error_naming_the_file(admission_dir, table):
    """A malformed table is an error naming the file (it was a bare ValueError/AttributeError/
    JSONDecodeError from experimental_warning(), and serve said only "web exited with code 1")."""
    (admission_dir / "cpu.json").write_text(table)
    try:
        startup.experimental_warning()
    except Exception as exc:  # noqa: BLE001 - the point is which exception and what it says
        assert "cpu.json" in str(exc), f"{type(exc).__name__}: {exc}"
