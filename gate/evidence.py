"""Evidence records of the validation gate (../shared/spec/VALIDATION.md, CONTRACT R9.2).

One JSON file per run, in the shape VALIDATION.md gives::

    {"procedure_version": "audiosite-validation/1",
     "kind": "model" | "framework",
     "run_id": "20261201T153000Z-whisper-asr-offline-cpu",
     "started_at": ISO-8601 UTC, "finished_at": ISO-8601 UTC, "duration_s": float,
     "manifest": {...},                        # manifest() below, plus family/task/mode/counts for kind=model
     "framework_checks": {"F1": Check, ... "F6": Check},
     "model_checks": {"M1": Check, ... "M6": Check},    # whole-run verdicts (kind=model; {} for framework)
     "counts": {"1": {"model_checks": {"M2": Check, ...}, "admission_ready": bool}, ...},
     "admission_ready": bool,
     "performance": {...}}

where ``Check`` is ``{"status": one of STATUSES, "evidence": any JSON, "limits": str}`` and a
NOT_APPLICABLE check carries its reason in ``limits``. A model record's ``framework_checks`` are
copied from the newest framework record of the same backend (each check gets ``record`` and
``code_tree`` keys naming where it came from); with none, every F entry is PENDING.

``admission_ready`` (per count and for the whole run) is true only when every applicable F and M
entry is PASS: "execution finished" is not "validated". Raw outputs and hashes live in the run's
directory beside ``record.json``.

Layout: ``<root>/<backend>/<family>/<task>-<mode>/<run_id>/record.json`` for model runs and
``<root>/<backend>/framework/<run_id>/record.json`` for framework runs, where ``<root>`` is
``model_specs/evidence`` for the committed records (``EVIDENCE_DIR``).
"""
from __future__ import annotations

import datetime as _dt
import hashlib
import json
import os
import platform
import re
import subprocess
from pathlib import Path
from typing import Any

from django.conf import settings

PROCEDURE_VERSION = "audiosite-validation/1"
PASS, FAIL, PENDING, BLOCKED, UNSUPPORTED, NOT_APPLICABLE = (
    "PASS", "FAIL", "PENDING", "BLOCKED", "UNSUPPORTED", "NOT_APPLICABLE")
STATUSES = (PASS, FAIL, PENDING, BLOCKED, UNSUPPORTED, NOT_APPLICABLE)
FRAMEWORK_IDS = ("F1", "F2", "F3", "F4", "F5", "F6")
MODEL_IDS = ("M1", "M2", "M3", "M4", "M5", "M6")
EVIDENCE_DIR = Path(settings.BASE_DIR) / "model_specs" / "evidence"
RECORD_NAME = "record.json"
# What "the code" is for a record: the tracked files that decide behaviour. Records, the
# generated admission tables and docs are left out so committing evidence does not change it.
CODE_PATHS = ("audiosite", "inference", "registry", "ui", "gate", "bench", "manage.py", "requirements.txt",
              "model_specs")
CODE_EXCLUDE = ("model_specs/evidence/", "model_specs/admission/")


class EvidenceError(ValueError):
    """A record that does not have the shape above (the message says where)."""


def check(status: str, evidence: Any = None, limits: str = "") -> dict:
    """One check entry ``{"status", "evidence", "limits"}``.

    Raises:
        EvidenceError: ``status`` is not one of ``STATUSES``, or NOT_APPLICABLE without a reason.
    """
    if status not in STATUSES:
        raise EvidenceError(f"status {status!r} is not one of {', '.join(STATUSES)}")
    if status == NOT_APPLICABLE and not limits:
        raise EvidenceError("NOT_APPLICABLE needs a reason in 'limits'")
    return {"status": status, "evidence": evidence, "limits": limits}


def all_pass(checks: dict) -> bool:
    """True when every entry of ``checks`` is PASS or NOT_APPLICABLE, and there is at least one PASS."""
    statuses = [entry["status"] for entry in checks.values()]
    return PASS in statuses and all(s in (PASS, NOT_APPLICABLE) for s in statuses)


def now_iso() -> str:
    """The current UTC time as ISO 8601 with seconds (``2026-12-01T15:30:00Z``)."""
    return _dt.datetime.now(_dt.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")


def run_id(*parts: str) -> str:
    """``<UTC timestamp>-<parts joined by '-'>``, e.g. ``20261201T153000Z-whisper-asr-offline-cpu``."""
    stamp = _dt.datetime.now(_dt.UTC).strftime("%Y%m%dT%H%M%SZ")
    return "-".join([stamp, *parts])


def sha256_file(path: Path) -> str:
    """Hex SHA-256 of a file's bytes (read in 1 MiB blocks)."""
    digest = hashlib.sha256()
    with open(path, "rb") as handle:
        for block in iter(lambda: handle.read(1 << 20), b""):
            digest.update(block)
    return digest.hexdigest()


def _git(*args: str) -> str:
    try:
        return subprocess.run(["git", *args], cwd=settings.BASE_DIR, capture_output=True, text=True,
                              check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return ""


def code_revision() -> dict:
    """The code a run exercised: ``{"commit", "dirty", "code_tree"}``.

    ``commit`` is ``git rev-parse HEAD`` ('' outside a checkout); ``dirty`` is true when tracked
    files under ``CODE_PATHS`` (minus ``CODE_EXCLUDE``: a record being written is not a code change)
    differ from it; ``code_tree`` is a SHA-256 over the path and bytes of
    every file under ``CODE_PATHS`` as it is on disk (tracked files, minus ``CODE_EXCLUDE``), so two
    records with the same ``code_tree`` ran the same code whatever commits lie between them.
    """
    listed = _git("ls-files", "--", *CODE_PATHS).splitlines()
    digest = hashlib.sha256()
    base = Path(settings.BASE_DIR)
    for name in sorted(listed):
        if name.startswith(CODE_EXCLUDE) or not (base / name).is_file():
            continue
        digest.update(name.encode() + b"\0")
        digest.update(hashlib.sha256((base / name).read_bytes()).digest())
    status = _git("status", "--porcelain", "--untracked-files=no", "--", *CODE_PATHS).splitlines()
    changed = [line.split(maxsplit=1)[-1].split(" -> ")[-1] for line in status if line.strip()]
    return {"commit": _git("rev-parse", "HEAD"),
            "dirty": any(not name.startswith(CODE_EXCLUDE) for name in changed),
            "code_tree": digest.hexdigest()}


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor()


def _gpus() -> list[str]:
    try:
        done = subprocess.run(["nvidia-smi", "--query-gpu=name,memory.total,driver_version", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.TimeoutExpired):
        return []
    return [line.strip() for line in done.stdout.splitlines() if line.strip()] if done.returncode == 0 else []


def manifest(backend: str, **extra: Any) -> dict:
    """The scope of a run: code revision, backend and onnxruntime providers, threads, OS, CPU, GPU.

    ``extra`` (family, task, mode, counts, checkpoint, options, fixtures, …) is merged in.
    """
    import onnxruntime

    return {"backend": backend,
            "providers": onnxruntime.get_available_providers(),
            "revision": code_revision(),
            "threads": {"cpu_count": os.cpu_count(),
                        "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS", "")},
            "os": platform.platform(), "python": platform.python_version(),
            "cpu": _cpu_model(), "gpu": _gpus(),
            "packages": {name: _version(name) for name in ("onnxruntime", "onnxruntime-gpu", "faster-whisper",
                                                          "ctranslate2", "numpy", "django")},
            **extra}


def _version(name: str) -> str:
    from importlib import metadata

    try:
        return metadata.version(name)
    except metadata.PackageNotFoundError:
        return ""


#: A record may say it finished at most this long after the clock of the machine reading it (clock skew
#: between machines); later is refused: a record dated in the future would stay "newest" for ever.
FUTURE_SLACK = _dt.timedelta(days=1)
_COUNT_KEY = re.compile(r"[0-9]{1,2}")  # ASCII digits only: "²".isdigit() is true, int("²") fails


def finished(record: dict) -> _dt.datetime:
    """A record's ``finished_at`` as an aware UTC datetime (ISO 8601 with an offset or ``Z``).

    Raises:
        EvidenceError: not a string, not ISO 8601, no UTC offset, or later than now + ``FUTURE_SLACK``.
    """
    value = record.get("finished_at")
    try:
        when = _dt.datetime.fromisoformat(value) if isinstance(value, str) else None
    except ValueError:
        when = None
    if when is None or when.tzinfo is None:
        raise EvidenceError(f"record {record.get('run_id', '?')}: finished_at {value!r} is not an ISO 8601 "
                            "time with a UTC offset")
    if when > _dt.datetime.now(_dt.UTC) + FUTURE_SLACK:
        raise EvidenceError(f"record {record.get('run_id', '?')}: finished_at {value!r} is in the future")
    return when.astimezone(_dt.UTC)


def validate(record: dict) -> None:
    """Check a record's shape: keys and their types, ``finished_at``, statuses, per-count entries (count
    keys of one or two ASCII digits), and a framework record's ``manifest.revision.code_tree``.

    Raises:
        EvidenceError: the first problem found.
    """
    if not isinstance(record, dict):
        raise EvidenceError(f"a record must be a JSON object, not {type(record).__name__}")
    for key in ("procedure_version", "kind", "run_id", "manifest", "framework_checks", "model_checks",
                "counts", "admission_ready", "performance"):
        if key not in record:
            raise EvidenceError(f"record {record.get('run_id', '?')}: missing key {key!r}")
    for key in ("manifest", "framework_checks", "model_checks", "counts"):
        if not isinstance(record[key], dict):
            raise EvidenceError(f"record {record['run_id']}: {key} must be an object")
    finished(record)
    if record["kind"] == "framework" and not isinstance(record["manifest"].get("revision"), dict) or (
            record["kind"] == "framework" and "code_tree" not in record["manifest"]["revision"]):
        raise EvidenceError(f"record {record['run_id']}: a framework record needs manifest.revision.code_tree")
    if record["kind"] not in ("model", "framework"):
        raise EvidenceError(f"record {record['run_id']}: kind must be 'model' or 'framework'")
    if "backend" not in record["manifest"]:
        raise EvidenceError(f"record {record['run_id']}: manifest has no backend")
    if record["kind"] == "model":
        for key in ("family", "task", "mode", "counts"):
            if key not in record["manifest"]:
                raise EvidenceError(f"record {record['run_id']}: manifest has no {key!r}")
    blocks = [("framework_checks", record["framework_checks"]), ("model_checks", record["model_checks"])]
    for count, entry in record["counts"].items():
        if not _COUNT_KEY.fullmatch(count) or not isinstance(entry, dict) or "admission_ready" not in entry \
                or not isinstance(entry.get("model_checks", {}), dict):
            raise EvidenceError(f"record {record['run_id']}: counts[{count!r}] needs an integer key "
                                f"and admission_ready")
        blocks.append((f"counts[{count}].model_checks", entry.get("model_checks", {})))
    for where, checks in blocks:
        for ident, entry in checks.items():
            if not isinstance(entry, dict) or entry.get("status") not in STATUSES:
                raise EvidenceError(f"record {record['run_id']}: {where}.{ident} has no valid status")
            if entry["status"] == NOT_APPLICABLE and not entry.get("limits"):
                raise EvidenceError(f"record {record['run_id']}: {where}.{ident} is NOT_APPLICABLE without a reason")


def record_dir(root: Path, record: dict) -> Path:
    """Where a record lives under ``root`` (see the module docstring's layout)."""
    man = record["manifest"]
    if record["kind"] == "framework":
        return root / man["backend"] / "framework" / record["run_id"]
    return root / man["backend"] / man["family"] / f"{man['task']}-{man['mode']}" / record["run_id"]


def write(root: Path, record: dict) -> Path:
    """Validate and write ``record`` as ``record.json`` in its run directory; returns the file path.

    Raises:
        EvidenceError: the record's shape is wrong (nothing is written).
    """
    validate(record)
    folder = record_dir(root, record)
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / RECORD_NAME
    path.write_text(json.dumps(record, indent=1, sort_keys=False) + "\n")
    return path


def load_all(root: Path) -> list[tuple[Path, dict]]:
    """Every record under ``root`` as ``(path, record)``, oldest ``finished_at`` first.

    Raises:
        EvidenceError: a file is not JSON or not a valid record (its path is in the message).
    """
    found = []
    for path in sorted(Path(root).rglob(RECORD_NAME)):
        if not path.is_file():
            raise EvidenceError(f"{path}: not a file")
        try:
            record = json.loads(path.read_text())
        except ValueError as exc:
            raise EvidenceError(f"{path}: not JSON ({exc})") from None
        try:
            validate(record)
        except EvidenceError as exc:
            raise EvidenceError(f"{path}: {exc}") from None
        expected = record_dir(Path(root), record) / RECORD_NAME
        if path != expected:
            raise EvidenceError(f"{path}: stored outside its place; a {record['kind']} record of backend "
                                f"{record['manifest'].get('backend')!r} belongs at {expected}")
        found.append((path, record))
    return sorted(found, key=lambda item: (finished(item[1]), str(item[0])))


def latest_framework(root: Path, backend: str) -> tuple[Path, dict] | None:
    """The newest framework record for ``backend`` under ``root``, or None."""
    records = [(p, r) for p, r in load_all(root) if r["kind"] == "framework" and r["manifest"]["backend"] == backend]
    return records[-1] if records else None


def framework_checks_for(root: Path, backend: str) -> dict:
    """F1–F6 for a model record: copied from the newest framework record of ``backend`` (each entry
    gains ``record``, its path relative to ``root``, and ``code_tree``), else all PENDING."""
    found = latest_framework(root, backend)
    if found is None:
        return {ident: check(PENDING, None, f"no framework record for backend {backend} under {root}")
                for ident in FRAMEWORK_IDS}
    path, record = found
    tree = record["manifest"]["revision"]["code_tree"]
    return {ident: {**record["framework_checks"].get(ident, check(PENDING, None, "missing in the framework record")),
                    "record": str(path.relative_to(root)), "code_tree": tree}
            for ident in FRAMEWORK_IDS}
