"""Validation evidence records written as a validation run would leave them (in a temporary evidence
root), and the ``admission`` command run on them (tests/test_admission.py, tests/test_validate_slots_cli.py).
"""
from __future__ import annotations

import io
import json
from pathlib import Path

from django.core.management import call_command

from gate import evidence


# -- evidence records and the admission command (tests/test_admission.py, tests/test_validate_slots_cli.py) --
# Records are data: tests craft them as a validation run would leave them, in a temporary evidence root.

PASSING_F = {ident: evidence.check(evidence.PASS, "framework record") for ident in evidence.FRAMEWORK_IDS}


def record(root: Path, family: str, task: str, counts: dict[int, bool], finished_at: str, *,
           backend: str = "cpu", framework: dict | None = None, failing_check: str = "M2",
           mode: str = "offline") -> Path:
    """Write a model record of a full run (3 starts, 20 memory cycles): M1 and M6 PASS for the run, per
    count M2-M5 PASS when ``ready``, else ``failing_check`` FAIL."""
    per_count = {}
    for n, ready in counts.items():
        checks = {ident: evidence.check(evidence.PASS, {"starts": 3}) for ident in ("M2", "M3", "M4", "M5")}
        if not ready:
            checks[failing_check] = evidence.check(evidence.FAIL, {"mismatch": "slot 1"}, "outputs differ")
        per_count[str(n)] = {"model_checks": checks, "admission_ready": ready}
    rec = {"procedure_version": evidence.PROCEDURE_VERSION, "kind": "model",
           "run_id": f"{finished_at.replace(':', '').replace('-', '')}-{family}-{task}-{mode}-{backend}",
           "started_at": finished_at, "finished_at": finished_at, "duration_s": 1.0,
           "manifest": {"backend": backend, "family": family, "task": task, "mode": mode,
                        "counts": sorted(counts), "starts": 3, "memory_cycles": 20,
                        "gpu": ["a GPU (test record)"] if backend == "cuda" else []},
           "framework_checks": framework if framework is not None else PASSING_F,
           "model_checks": {"M1": evidence.check(evidence.PASS, {}), "M6": evidence.check(evidence.PASS, {})},
           "counts": per_count,
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
    """Run ``manage.py admission`` on an evidence root and a table file; its output."""
    out = io.StringIO()
    call_command("admission", "--backend", backend, "--evidence", str(root), "--table", str(table), *flags, stdout=out)
    return out.getvalue()


def rows(table: Path) -> dict:
    """The family rows of a table file (keys starting with ``_`` left out)."""
    return {k: v for k, v in json.loads(table.read_text()).items() if not k.startswith("_")}




