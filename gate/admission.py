"""The admission table (``model_specs/admission/<backend>.json``) built from evidence records (CONTRACT R9.2).

The server reads only the table (``inference/specs.py``); this module makes the table from the
records under an evidence root (``evidence.py``) so that no count is admitted without a record:

- for every family spec and each of its ``task/mode`` pairs, count 1 is admitted (the serial path:
  R9.2 gates only counts above one);
- a count n > 1 is *validated* when the newest model record of that family, task, mode and backend
  that ran n (newest by ``finished_at``) has every model check of n (its ``counts[n].model_checks``
  and the run's ``model_checks``) PASS or NOT_APPLICABLE, **and** the newest framework record of the
  backend has F1–F6 all PASS; a newer failing record therefore removes a count that an older one
  admitted, and a newer framework record that is not all PASS removes every count above one;
- the framework checks are judged here, from the newest framework record, not from the copy a model
  record took when it was written: F1–F6 are once per code revision and backend, M1–M6 per family
  and count, so a model run made before the framework run (its copy PENDING, its own
  ``admission_ready`` false) is admitted once a passing framework record exists. The table's
  ``_framework`` names that record and its code tree; a model record whose ``code_tree`` differs
  is listed in the command's output (the code changed between the two runs);
- admitted = 1 plus the validated counts 2, 3, … up to the first one that is not (consecutive);
- a test-only family (``"test_only": true``, the ``fixture`` family) has no model to check: it keeps
  ``TEST_ONLY_COUNTS``, the counts the framework tests exercise, and is said so in ``_about``.

A record is refused (``evidence.EvidenceError`` naming its path) when it is malformed, names a
family, task or mode that has no spec, runs a count outside 1..16, or says a count is
``admission_ready`` while its own checks (framework checks and the count's model checks) are not
all PASS or NOT_APPLICABLE.

The table's shape: ``{"_about": str, "_framework": {"record", "passed", "reason", "code_tree"},
"_sources": {"family task/mode": {"n": decision}},
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


#: The procedure's minimums (../shared/spec/VALIDATION.md): M2 "three fresh server starts per count",
#: M5 "no monotonic growth over >= 20 cycles". A shorter run (CI's, an operator's trial) is evidence
#: of what it ran, but admits nothing.
MIN_STARTS = 3
MIN_MEMORY_CYCLES = 20
RUN_MODEL_IDS = ("M1", "M6")  # judged once per run (scope and quality, modes)
COUNT_MODEL_IDS = ("M2", "M3", "M4", "M5")  # judged per count


def _shortfall(record: dict, count: str) -> str | None:
    """Why the model checks of ``count`` in ``record`` do not validate it, or None when they do.

    Every one of M1 and M6 (the run's) and M2-M5 (the count's own) must be there, each PASS or
    NOT_APPLICABLE, M2 and M3 PASS (concurrency shown, not assumed); the run must meet
    ``MIN_STARTS`` and ``MIN_MEMORY_CYCLES``; a CUDA record must name a GPU (``manifest.gpu``).
    """
    man = record["manifest"]
    entry = record["counts"][count]
    checks = {**{k: record["model_checks"].get(k) for k in RUN_MODEL_IDS},
              **{k: entry.get("model_checks", {}).get(k) for k in COUNT_MODEL_IDS}}
    missing = [k for k, c in checks.items() if c is None]
    if missing:
        return f"no {', '.join(missing)} in the record"
    bad = [f"{k} {c['status']}" for k, c in checks.items()
           if c["status"] not in (evidence.PASS, evidence.NOT_APPLICABLE)]
    bad += [f"{k} {checks[k]['status']}" for k in ("M2", "M3") if checks[k]["status"] != evidence.PASS]
    if bad:
        return "model checks that did not pass: " + ", ".join(sorted(set(bad)))
    starts, cycles = man.get("starts"), man.get("memory_cycles")
    if not (isinstance(starts, int) and starts >= MIN_STARTS and isinstance(cycles, int)
            and cycles >= MIN_MEMORY_CYCLES):
        return (f"a run below the procedure's minimums (starts {starts!r}, memory cycles {cycles!r}; "
                f"needs >= {MIN_STARTS} and >= {MIN_MEMORY_CYCLES})")
    if man["backend"] == "cuda" and not man.get("gpu"):
        return "a cuda record whose manifest names no GPU"
    return None


def _count_backed(path: Path, record: dict, count: str) -> str | None:
    """None when the model checks of ``count`` in ``record`` validate it, else why not (see
    :func:`_shortfall`).

    Raises:
        evidence.EvidenceError: the record says ``admission_ready`` while one of its checks (its copy of
            the framework checks included) is not PASS/NOT_APPLICABLE: a record that contradicts itself.
    """
    entry = record["counts"][count]
    if entry["admission_ready"]:
        checks = {**record["framework_checks"], **record["model_checks"], **entry.get("model_checks", {})}
        bad = sorted(f"{ident} {c['status']}" for ident, c in checks.items()
                     if c["status"] not in (evidence.PASS, evidence.NOT_APPLICABLE))
        if bad or not checks:
            raise evidence.EvidenceError(f"{path}: counts[{count}] says admission_ready but "
                                         f"{', '.join(bad) if bad else 'it has no checks'}")
    return _shortfall(record, count)


@dataclass(frozen=True)
class FrameworkVerdict:
    """The newest framework record of a backend: whether F1–F6 all pass, which record, its code tree."""

    passed: bool
    reason: str
    record: str | None = None
    code_tree: str | None = None


def framework_verdict(root: Path, backend: str) -> FrameworkVerdict:
    """Judge F1–F6 from the newest ``kind="framework"`` record of ``backend`` under ``root``."""
    found = evidence.latest_framework(Path(root), backend)
    if found is None:
        return FrameworkVerdict(False, f"no framework record for {backend} (run validate_slots --framework)")
    path, record = found
    where = str(path.relative_to(root))
    checks = record["framework_checks"]
    missing = [ident for ident in evidence.FRAMEWORK_IDS if ident not in checks]
    bad = sorted(f"{ident} {c['status']}" for ident, c in checks.items() if c["status"] != evidence.PASS)
    tree = record["manifest"].get("revision", {}).get("code_tree")
    if missing or bad:
        problems = ", ".join(bad + [f"{m} missing" for m in missing])
        return FrameworkVerdict(False, f"the newest framework record has {problems}", where, tree)
    return FrameworkVerdict(True, "F1-F6 PASS", where, tree)


def build(root: Path, backend: str) -> tuple[dict, dict[str, list[Decision]], FrameworkVerdict, list[str]]:
    """The table for ``backend`` from the records under ``root``, and the decision behind every count.

    Returns:
        ``(table, decisions, framework, other_code)``: ``decisions["family task/mode"]`` lists one
        ``Decision`` per count that any record ran or that is admitted; ``framework`` is the verdict of
        the newest framework record; ``other_code`` lists the deciding model records (paths relative to
        ``root``) whose code tree differs from that framework record's.

    Raises:
        evidence.EvidenceError: a malformed or unbackable record (the message names its path).
    """
    root = Path(root)
    known = specs._read_specs()  # every spec, the test-only family included
    framework = framework_verdict(root, backend)
    newest: dict[tuple[str, str, int], tuple[Path, str | None]] = {}
    trees: dict[Path, str | None] = {}
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
            shortfall = _count_backed(path, record, count)
            trees[path] = record["manifest"].get("revision", {}).get("code_tree")
            newest[(man["family"], f"{man['task']}/{man['mode']}", int(count))] = (path, shortfall)
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
                first = ("batch size 1 is no batching: it needs no record (R9.2)" if mode == "batch" else
                         "serial path: count 1 needs no record (R9.2)")
                admitted, rows = [1], [Decision(1, True, first)]
                ran = sorted(n for (f, k, n) in newest if f == family and k == key and n > 1)
                gap = False
                for n in ran:
                    path, shortfall = newest[(family, key, n)]
                    where = str(path.relative_to(root))
                    if shortfall:
                        gap = True
                        rows.append(Decision(n, False, f"the newest record that ran it: {shortfall}", where))
                    elif not framework.passed:
                        gap = True
                        rows.append(Decision(n, False, f"model checks pass, but {framework.reason}"
                                                       f"{f' ({framework.record})' if framework.record else ''}",
                                             where))
                    elif gap or n != admitted[-1] + 1:
                        gap = True
                        rows.append(Decision(n, False, f"ready, but count {admitted[-1] + 1} is not admitted "
                                                       f"(counts must be consecutive)", where))
                    else:
                        admitted.append(n)
                        rows.append(Decision(n, True, "the newest record that ran it passes its model checks "
                                                      "and the newest framework record passes F1-F6", where))
                table[family][key] = admitted
                decisions[f"{family} {key}"] = rows
    deciding = {path for path, _shortfall in newest.values()}
    other_code = sorted(str(p.relative_to(root)) for p in deciding if trees.get(p) != framework.code_tree)
    return table, decisions, framework, other_code


def render(table: dict, decisions: dict[str, list[Decision]], backend: str, root_label: str,
           framework: FrameworkVerdict) -> dict:
    """The JSON document to write: ``_about``, ``_framework`` (the framework record judged, whether it
    passes, its code tree), ``_sources`` (the deciding record per admitted count > 1) and the table."""
    sources = {key: {str(d.count): d.record for d in rows if d.admitted and d.record}
               for key, rows in decisions.items()}
    about = (f"Generated by `python manage.py admission --backend {backend} --write` from the evidence records under "
             f"{root_label}/{backend}; do not edit by hand (`--check` fails when this file and the records disagree). "
             f"Count 1 is always admitted (the serial path, R9.2). A count n > 1 is admitted when the newest record "
             f"of the family/task/mode that ran n passes its model checks for n, the newest framework record "
             f"(`_framework`) passes F1-F6, and every smaller count is admitted; `_sources` names the deciding "
             f"record of each. Families without records serve one slot. "
             f"The test-only family `fixture` (AUDIOSITE_ENABLE_FIXTURE_FAMILY=1) keeps {TEST_ONLY_COUNTS}: it has "
             f"no model to check and the framework tests exercise those counts.")
    judged = {"record": framework.record, "passed": framework.passed, "reason": framework.reason,
              "code_tree": framework.code_tree}
    return {"_about": about, "_framework": judged, "_sources": {k: v for k, v in sources.items() if v}, **table}


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
        evidence.EvidenceError: not a readable file, not JSON, or not the table's shape (an object whose
            family keys map ``"task/mode"`` to a list of counts).
    """
    if not path.exists():
        return {}
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise evidence.EvidenceError(f"{path}: not a readable JSON file ({exc})") from None
    if not isinstance(document, dict) or not all(
            isinstance(rows, dict) and all(isinstance(v, list) for v in rows.values())
            for rows in families_of(document).values()):
        raise evidence.EvidenceError(f"{path}: not an admission table (an object of family -> "
                                     "{\"task/mode\": [counts]})")
    return document
