"""The admission table (``model_specs/admission/<backend>.json``) built from evidence records (CONTRACT R9.2).

The server reads only the table (``inference/specs.py``); this module makes the table from the
records under an evidence root (``evidence.py``) so that no count is admitted without a record:

- for every family spec and each of its ``task/mode`` pairs, count 1 is admitted (the serial path:
  R9.2 gates only counts above one);
- a count n > 1 is *validated* when the newest model record of that family, task, mode and backend
  that ran n (newest by ``finished_at``) says ``counts[n].admission_ready``; a newer failing record
  therefore removes a count that an older one admitted;
- admitted = 1 plus the validated counts 2, 3, … up to the first one that is not (consecutive);
- a test-only family (``"test_only": true``, the ``fixture`` family) has no model to check: it keeps
  ``TEST_ONLY_COUNTS``, the counts the framework tests exercise, and is said so in ``_about``.

A record is refused (``evidence.EvidenceError`` naming its path) when it is malformed, names a
family, task or mode that has no spec, runs a count outside 1..16, or says a count is
``admission_ready`` while its own checks (framework checks and the count's model checks) are not
all PASS or NOT_APPLICABLE.

The table's shape: ``{"_about": str, "_sources": {"family task/mode": {"n": decision}},
"<family>": {"<task>/<mode>": [1, 2, …]}}``; keys starting with ``_`` are not families.
"""
from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from inference import specs

from . import evidence

TEST_ONLY_COUNTS = [1, 2, 3, 4]


@dataclass(frozen=True)
class Decision:
    """Why a count is in or out: the deciding record (path relative to the evidence root) or none."""

    count: int
    admitted: bool
    reason: str
    record: str | None = None


def _count_backed(path: Path, record: dict, count: str) -> bool:
    """``counts[count].admission_ready`` of ``record``, after checking the record backs it.

    Raises:
        evidence.EvidenceError: the record says ready while one of its checks is not PASS/NOT_APPLICABLE.
    """
    entry = record["counts"][count]
    if not entry["admission_ready"]:
        return False
    checks = {**record["framework_checks"], **entry.get("model_checks", {})}
    bad = sorted(f"{ident} {c['status']}" for ident, c in checks.items()
                 if c["status"] not in (evidence.PASS, evidence.NOT_APPLICABLE))
    if bad or not checks:
        raise evidence.EvidenceError(f"{path}: counts[{count}] says admission_ready but "
                                     f"{', '.join(bad) if bad else 'it has no checks'}")
    return True


def build(root: Path, backend: str) -> tuple[dict, dict[str, list[Decision]]]:
    """The table for ``backend`` from the records under ``root``, and the decision behind every count.

    Returns:
        ``(table, decisions)`` where ``decisions["family task/mode"]`` lists one ``Decision`` per
        count that any record ran or that is admitted.

    Raises:
        evidence.EvidenceError: a malformed or unbackable record (the message names its path).
    """
    root = Path(root)
    known = specs._read_specs()  # every spec, the test-only family included
    newest: dict[tuple[str, str, int], tuple[Path, bool]] = {}
    for path, record in evidence.load_all(root):  # oldest first: later entries overwrite
        if record["kind"] != "model" or record["manifest"]["backend"] != backend:
            continue
        man = record["manifest"]
        spec = known.get(man["family"])
        if spec is None or man["task"] not in spec["tasks"] or man["mode"] not in spec["modes"]:
            raise evidence.EvidenceError(f"{path}: no family spec serves {man['family']} {man['task']}/{man['mode']}")
        for count in record["counts"]:
            if not 1 <= int(count) <= specs.MAX_SLOTS:
                raise evidence.EvidenceError(f"{path}: count {count} is outside 1..{specs.MAX_SLOTS}")
            ready = _count_backed(path, record, count)
            newest[(man["family"], f"{man['task']}/{man['mode']}", int(count))] = (path, ready)
    table: dict = {}
    decisions: dict[str, list[Decision]] = {}
    for family, spec in sorted(known.items()):
        table[family] = {}
        for task in spec["tasks"]:
            for mode in spec["modes"]:
                key = f"{task}/{mode}"
                if spec.get("test_only"):
                    table[family][key] = list(TEST_ONLY_COUNTS)
                    decisions[f"{family} {key}"] = [Decision(n, True, "test-only family (no model to check)")
                                                    for n in TEST_ONLY_COUNTS]
                    continue
                admitted, rows = [1], [Decision(1, True, "serial path: count 1 needs no record (R9.2)")]
                ran = sorted(n for (f, k, n) in newest if f == family and k == key and n > 1)
                gap = False
                for n in ran:
                    path, ready = newest[(family, key, n)]
                    where = str(path.relative_to(root))
                    if not ready:
                        gap = True
                        rows.append(Decision(n, False, "the newest record that ran it says not admission_ready", where))
                    elif gap or n != admitted[-1] + 1:
                        gap = True
                        rows.append(Decision(n, False, f"ready, but count {admitted[-1] + 1} is not admitted "
                                                       f"(counts must be consecutive)", where))
                    else:
                        admitted.append(n)
                        rows.append(Decision(n, True, "the newest record that ran it says admission_ready", where))
                table[family][key] = admitted
                decisions[f"{family} {key}"] = rows
    return table, decisions


def render(table: dict, decisions: dict[str, list[Decision]], backend: str, root_label: str) -> dict:
    """The JSON document to write: ``_about``, ``_sources`` (the deciding record per admitted count > 1)
    and the table."""
    sources = {key: {str(d.count): d.record for d in rows if d.admitted and d.record}
               for key, rows in decisions.items()}
    about = (f"Generated by `python manage.py admission --backend {backend} --write` from the evidence records under "
             f"{root_label}/{backend}; do not edit by hand (`--check` fails when this file and the records disagree). "
             f"Count 1 is always admitted (the serial path, R9.2). A count n > 1 is admitted when the newest record "
             f"of the family/task/mode that ran n says counts[n].admission_ready and every smaller count is "
             f"admitted; `_sources` names the deciding record of each. Families without records serve one slot. "
             f"The test-only family `fixture` (AUDIOSITE_ENABLE_FIXTURE_FAMILY=1) keeps {TEST_ONLY_COUNTS}: it has "
             f"no model to check and the framework tests exercise those counts.")
    return {"_about": about, "_sources": {k: v for k, v in sources.items() if v}, **table}


def families_of(document: dict) -> dict:
    """The family rows of a table document (keys starting with ``_`` left out)."""
    return {k: v for k, v in document.items() if not k.startswith("_")}


def diff(current: dict, new: dict, decisions: dict[str, list[Decision]]) -> list[str]:
    """One line per count added or removed between two tables' family rows, with the deciding reason."""
    lines = []
    keys = sorted({f"{f} {k}" for t in (current, new) for f, rows in families_of(t).items() for k in rows})
    for key in keys:
        family, task_mode = key.split(" ", 1)
        old = set(families_of(current).get(family, {}).get(task_mode, []))
        now = set(families_of(new).get(family, {}).get(task_mode, []))
        why = {d.count: d for d in decisions.get(key, [])}
        for n in sorted(now - old):
            d = why.get(n)
            lines.append(f"+ {key} count {n}: {d.reason if d else ''}{f' ({d.record})' if d and d.record else ''}")
        for n in sorted(old - now):
            d = why.get(n)
            reason = f"{d.reason}{f' ({d.record})' if d.record else ''}" if d else "no record ran it"
            lines.append(f"- {key} count {n}: {reason}")
    return lines


def table_path(backend: str) -> Path:
    """Where the server reads the table of ``backend``."""
    return specs.ADMISSION_DIR / f"{backend}.json"


def read_table(path: Path) -> dict:
    """The current table at ``path`` ({} when there is none).

    Raises:
        evidence.EvidenceError: the file is not JSON.
    """
    if not path.exists():
        return {}
    try:
        return json.loads(path.read_text())
    except ValueError as exc:
        raise evidence.EvidenceError(f"{path}: not JSON ({exc})") from None
