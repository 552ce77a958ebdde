"""The framework record of the validation gate (gate/framework.py, stress.py).

- the F1–F5 map names only tests the suite really collects (``pytest --collect-only``), so a
  renamed or deleted test fails here instead of silently leaving a check unproven;
- the status rules (pass, fail, skip, missing) on the JUnit XML of a real pytest run of a small
  suite written for the purpose;
- the seeded stress run against a real ``manage.py serve --parallel-jobs`` server keeps every
  invariant, and its answer checker flags what it must.
"""
from __future__ import annotations

import json
import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

from gate import evidence, framework
from gate.stress import answer_problem, run_stress

ROOT = Path(__file__).resolve().parent.parent


def _collected(*args: str, cwd: Path = ROOT) -> list[str]:
    done = subprocess.run([sys.executable, "-m", "pytest", "--collect-only", "-q", "-p", "no:cacheprovider", *args],
                          cwd=cwd, capture_output=True, text=True, timeout=300)
    assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-2000:]
    return [line.strip() for line in done.stdout.splitlines() if "::" in line]


def test_every_mapped_test_exists_in_the_collected_suite():
    nodes = _collected("tests")
    assert len(nodes) > 400  # the whole suite, not a fragment of it
    missing = [m for m in framework.mapped_node_ids() if not any(framework.matches(m, n) for n in nodes)]
    assert missing == []
    assert [s for s in framework.EXPECTED_SKIPS if s not in nodes] == []
    for ident in ("F1", "F2", "F3", "F4", "F5"):
        assert framework.FRAMEWORK_TESTS[ident], ident
        assert all(note.strip() for _, note in framework.FRAMEWORK_TESTS[ident]), ident


def test_a_parametrized_mapping_matches_its_cases_only():
    assert framework.matches("tests/test_a.py::test_x", "tests/test_a.py::test_x[1]")
    assert framework.matches("tests/test_a.py::test_x", "tests/test_a.py::test_x")
    assert not framework.matches("tests/test_a.py::test_x", "tests/test_a.py::test_x_more")
    assert not framework.matches("tests/test_a.py::test_x[1]", "tests/test_a.py::test_x[2]")


SMALL_SUITE = '''
import pytest

def test_passes():
    assert 1 + 1 == 2

def test_fails():
    assert 1 + 1 == 3

def test_skips():
    pytest.skip("needs something absent")

@pytest.mark.parametrize("n", [1, 2])
def test_cases(n):
    assert n in (1, 2)

class TestGroup:
    def test_inside(self):
        assert True
'''


@pytest.fixture(scope="module")
def small_run(tmp_path_factory) -> dict[str, dict]:
    """The outcomes of a real pytest run of SMALL_SUITE, read back from its JUnit XML."""
    tmp = tmp_path_factory.mktemp("small")
    (tmp / "tests").mkdir()
    (tmp / "tests" / "__init__.py").write_text("")
    (tmp / "tests" / "test_small.py").write_text(textwrap.dedent(SMALL_SUITE))
    (tmp / "pytest.ini").write_text("[pytest]\n")
    junit = tmp / "junit.xml"
    subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-p", "no:django",
                    f"--junitxml={junit}", "tests"],
                   cwd=tmp, capture_output=True, timeout=120)
    return framework.parse_junit(junit)


def test_junit_outcomes_are_read_back_under_their_node_ids(small_run):
    outcomes = {node: result["outcome"] for node, result in small_run.items()}
    assert outcomes == {"tests/test_small.py::test_passes": "passed", "tests/test_small.py::test_fails": "failed",
                        "tests/test_small.py::test_skips": "skipped", "tests/test_small.py::test_cases[1]": "passed",
                        "tests/test_small.py::test_cases[2]": "passed",
                        "tests/test_small.py::TestGroup::test_inside": "passed"}
    assert all(result["duration_s"] >= 0 for result in small_run.values())
    assert "== 3" in small_run["tests/test_small.py::test_fails"]["message"]


def test_a_check_passes_only_when_every_mapped_test_passed(small_run):
    small = "tests/test_small.py::"
    status, rows, limits = framework.check_status([(small + "test_passes", "p"), (small + "test_cases", "c"),
                                                   (small + "TestGroup::test_inside", "g")], small_run)
    assert (status, limits) == (evidence.PASS, "")
    assert [len(r["cases"]) for r in rows] == [1, 2, 1]
    status, _, limits = framework.check_status([(small + "test_passes", "p"), (small + "test_fails", "f")], small_run)
    assert status == evidence.FAIL and small + "test_fails" in limits
    status, _, limits = framework.check_status([(small + "test_passes", "p"), (small + "test_skips", "s")], small_run)
    assert status == evidence.PENDING and "a skip is not a pass" in limits
    status, _, _ = framework.check_status([(small + "test_skips", "s")], small_run,
                                          expected_skips={small + "test_skips": "by design"})
    assert status == evidence.PASS
    status, _, limits = framework.check_status([(small + "test_renamed", "r")], small_run)
    assert status == evidence.FAIL and "not found in the run" in limits


def test_a_record_for_a_backend_this_machine_does_not_run_is_refused(tmp_path):
    from inference.backend import resolve_backend

    other = "cuda" if resolve_backend("auto") == "cpu" else "cpu"
    with pytest.raises(ValueError, match=f"backend '{other}' requested"):
        framework.run(other, tmp_path, quick=True)
    assert list(tmp_path.iterdir()) == []


def test_the_answer_checker_flags_500s_bad_shapes_and_503s_without_retry_after():
    shaped = json.dumps({"error": {"message": "m", "type": "server_busy", "param": None, "code": "timeout"}})
    assert answer_problem(200, {}, "{}") is None
    assert answer_problem(503, {"retry-after": "1"}, shaped) is None
    assert answer_problem(500, {}, shaped) == "status 500"
    assert answer_problem(502, {}, "") == "status 502"
    assert answer_problem(503, {}, shaped) == "503 without Retry-After"
    assert answer_problem(400, {}, json.dumps({"detail": "x"})) == "400 not in the error shape"
    assert answer_problem(400, {}, "not json") == "400 not in the error shape"
    assert answer_problem(200, {}, "{}", expect={400}) == "status 200, expected [400]"


def test_a_seeded_stress_run_against_a_real_server_keeps_every_invariant(tmp_path, capsys):
    seed = 20261201
    report = run_stress(seed, 20, workdir=tmp_path)
    printed = capsys.readouterr().out
    assert f"seed {seed}" in printed
    assert report["violations"] == [], json.dumps(report["violations"], indent=1, default=str)[:4000]
    assert report["steps"] == len(report["plan"]) == 20
    assert report["requests"] > 20 and report["managers"] > 0
    assert "500" not in report["statuses"] and report["statuses"].get("200", 0) > 0
    assert json.loads((tmp_path / "stress.json").read_text())["seed"] == seed
