"""Model family specs (``model_specs/<family>.json``) and checks against them.

A spec states a family's tasks, modes, model sample rate (Hz), where its
checkpoint ships (a package resource), its advertised capacity per backend,
and JSON Schemas for ``load_options``, ``session_options`` and
``request_options`` (validated with ``jsonschema``, Draft 2020-12).
"""
from __future__ import annotations

import functools
import importlib.resources
import json
from pathlib import Path
from typing import Any

import jsonschema

SPEC_DIR = Path(__file__).resolve().parent.parent / "model_specs"
OPTION_BLOCKS = ("load_options", "session_options", "request_options")


@functools.lru_cache(maxsize=None)
def all_specs() -> dict[str, dict]:
    """Return every spec keyed by family name (read once per process)."""
    found = {}
    for file in sorted(SPEC_DIR.glob("*.json")):
        spec = json.loads(file.read_text())
        found[spec["family"]] = spec
    return found


def get_spec(family: str) -> dict | None:
    """The spec of ``family`` or None when no such family exists."""
    return all_specs().get(family)


def _schema_problems(schema: dict, value: Any, block: str) -> list[str]:
    validator = jsonschema.Draft202012Validator(schema)
    problems = []
    for error in sorted(validator.iter_errors(value), key=lambda e: list(e.path)):
        where = ".".join([block, *[str(p) for p in error.path]])
        problems.append(f"key {where!r}: {error.message}")
    return problems


def check_model_entry(entry: dict) -> list[str]:
    """Check one model entry (``ModelConfig.model_dump()``) against its family spec.

    Returns:
        One message per problem (unknown family, task or mode; an option
        block that fails its schema; a ``path`` that does not exist); empty
        when the entry is valid.
    """
    spec = get_spec(entry["family"])
    if spec is None:
        return [f"key 'family': unknown family {entry['family']!r} (known: {', '.join(sorted(all_specs()))})"]
    problems = []
    task = entry.get("task")
    if task is not None and task not in spec["tasks"]:
        problems.append(f"key 'task': family {spec['family']!r} serves {spec['tasks']}, not {task!r}")
    if entry.get("mode", "offline") not in spec["modes"]:
        problems.append(f"key 'mode': family {spec['family']!r} supports modes {spec['modes']}, not {entry['mode']!r}")
    for block in ("load_options", "session_options"):
        problems.extend(_schema_problems(spec[block], entry.get(block) or {}, block))
    problems.extend(
        _schema_problems(spec["request_options"], entry.get("default_request_options") or {}, "default_request_options")
    )
    path = entry.get("path")
    if path is not None and not Path(path).exists():
        problems.append(f"key 'path': {path!r} does not exist")
    return problems


def request_option_problems(family: str, options: dict) -> list[str]:
    """Validate per-request options against the family's ``request_options`` schema."""
    return _schema_problems(get_spec(family)["request_options"], options, "options")


def request_defaults(family: str) -> dict:
    """The ``default`` of every request option the family's schema declares."""
    props = get_spec(family)["request_options"].get("properties", {})
    return {name: prop["default"] for name, prop in props.items() if "default" in prop}


def resolve_checkpoint(family: str, path: str | None) -> Path:
    """Return the checkpoint path: ``path`` if given, else the spec's package resource.

    Raises:
        FileNotFoundError: the path or the packaged resource does not exist.
    """
    if path:
        resolved = Path(path)
    else:
        default = get_spec(family)["default_checkpoint"]
        resolved = Path(str(importlib.resources.files(default["package"]) / default["resource"]))
    if not resolved.exists():
        raise FileNotFoundError(f"checkpoint {resolved} does not exist")
    return resolved


def default_task(family: str) -> str:
    """The family's first listed task."""
    return get_spec(family)["tasks"][0]
