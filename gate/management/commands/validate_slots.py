"""``python manage.py validate_slots``: the model checks M1–M6 of the validation gate for one family.

    python manage.py validate_slots --family whisper --counts 1 2 4 [--task asr] [--mode offline]
        [--starts 3] [--backend cpu|cuda] [--out model_specs/evidence] [--memory-cycles 20]

Starts real ``manage.py serve`` processes (embedded Redis, a temporary SQLite file; fresh servers
per count and start; see ``gate/model_checks.py`` for the procedure and
``gate/workloads.py`` for each family's requests and comparison rule), writes one
evidence record (``record.json``, the shape of ``../shared/spec/VALIDATION.md``) with the raw request
log, references and mismatching answers beside it, and prints a table of every check per count and
the record's path. The record's ``counts[n].admission_ready`` is what ``manage.py admission`` reads.
The framework checks F1–F6 are copied from the newest framework record (``validate_slots
--framework``) of the backend under ``model_specs/evidence``; without one they stay PENDING and no
count is admission-ready.
"""
from __future__ import annotations

import logging
import signal
from pathlib import Path

from django.core.management import call_command
from django.core.management.base import BaseCommand, CommandError

from inference import specs
from inference.backend import resolve_backend
from gate import evidence
from gate.batching import BATCH
from gate.model_checks import MEMORY_WINDOW, OFFLINE, Plan, run_model_validation
from gate.streaming import STREAMING
from gate.workloads import get_workload

MODEL_ROWS = ("M1", "M2", "M3", "M4", "M5", "M6")


def _interrupt(signum, frame) -> None:
    raise KeyboardInterrupt(f"signal {signum}")


MODE_CHECKS = {"offline": OFFLINE, "streaming": STREAMING, "batch": BATCH}
"""The procedure of each ``--mode``."""


class Command(BaseCommand):
    help = "Validation gate, model checks M1-M6 for one family at several slot counts (writes an evidence record)."

    def add_arguments(self, parser):
        parser.add_argument("--family", help="model family (model_specs/<family>.json)")
        parser.add_argument("--task", help="task (default: the family's first)")
        parser.add_argument("--mode", default="offline", choices=sorted(MODE_CHECKS),
                            help="mode (default offline); with batch, each count is a batch size (gate/batching.py)")
        parser.add_argument("--counts", type=int, nargs="+", default=[1, 2, 4], help="slot counts to validate")
        parser.add_argument("--starts", type=int, default=3, help="fresh server starts per count (default 3)")
        parser.add_argument("--backend", choices=("cpu", "cuda"), default="cpu")
        parser.add_argument("--out", default=None,
                            help="evidence root (default model_specs/evidence, as admission and validate_framework)")
        parser.add_argument("--memory-cycles", type=int, default=20, help="M5 cycles (default 20, at least 10)")
        parser.add_argument("--strict", action="store_true",
                            help="exit 1 unless every model check of every count passes (CI; F1-F6 not judged)")
        parser.add_argument("--framework", action="store_true",
                            help="the framework record F1-F6 instead (runs manage.py validate_framework)")

    def handle(self, *args, **opts):
        opts["out"] = str(Path(opts["out"]) if opts["out"] else evidence.EVIDENCE_DIR)
        for name in ("httpx", "httpx2"):  # the openai SDK logs every request of a streaming run through httpx2
            logging.getLogger(name).setLevel(logging.WARNING)
        if opts["framework"]:
            # the framework checks F1-F6 are their own command
            try:
                return call_command("validate_framework", "--backend", opts["backend"], "--out", opts["out"],
                                    stdout=self.stdout, stderr=self.stderr)
            except CommandError as exc:
                if "Unknown command" in str(exc):
                    raise CommandError("the framework checks (manage.py validate_framework) are not part of "
                                       "this build") from None
                raise

        family = opts["family"]
        if not family:
            raise CommandError("--family is required (one of: " + ", ".join(sorted(specs.all_specs())) + ")")
        if family == "fixture" and not specs.fixture_family_enabled():
            raise CommandError("the fixture family is test-only: set AUDIOSITE_ENABLE_FIXTURE_FAMILY=1")
        spec = specs.get_spec(family)
        if spec is None:
            raise CommandError(f"unknown family {family!r}; known: {', '.join(sorted(specs.all_specs()))}")
        try:
            # a batch run sends the offline workload (gate/batching.py); a mode the family lacks is refused below
            workload = get_workload(family, opts["mode"] if opts["mode"] == "streaming" else "offline")
        except KeyError as exc:
            raise CommandError(str(exc.args[0])) from None
        task = opts["task"] or spec["tasks"][0]
        if task not in spec["tasks"]:
            raise CommandError(f"family {family} serves tasks {spec['tasks']}, not {task!r}")
        counts = sorted(set(opts["counts"]))
        if any(n < 1 or n > specs.MAX_SLOTS for n in counts):
            raise CommandError(f"--counts must be 1..{specs.MAX_SLOTS}")
        if opts["starts"] < 1:
            raise CommandError("--starts must be at least 1")
        if opts["memory_cycles"] < MEMORY_WINDOW:
            raise CommandError(f"--memory-cycles must be at least {MEMORY_WINDOW} (the M5 window)")
        plan = Plan(family, task, opts["mode"], counts, opts["starts"], opts["backend"], Path(opts["out"]),
                    opts["memory_cycles"])
        if opts["mode"] not in spec.get("modes", []):  # also keeps the run folder inside --out
            raise CommandError(f"family {family} serves modes {spec.get('modes')}, not {opts['mode']!r}")
        found = resolve_backend("auto")
        if opts["backend"] != found:
            raise CommandError(f"backend {opts['backend']!r} requested but this machine runs models on {found!r}; "
                               "a record must be made on the backend it names")
        self.stdout.write(f"validate_slots: {family} {task}/{opts['mode']} on {opts['backend']}, counts {counts}, "
                          f"{opts['starts']} start(s) per count, {opts['memory_cycles']} memory cycles")
        # SIGTERM (a CI timeout, kill, systemd) unwinds like Ctrl-C, so the servers of the run are stopped
        previous = signal.signal(signal.SIGTERM, _interrupt)
        try:
            path, record = run_model_validation(plan, workload, print_line=self.stdout.write,
                                                checks=MODE_CHECKS[opts["mode"]])
        except evidence.EvidenceError as exc:
            raise CommandError(f"an evidence record cannot be read: {exc}") from None
        except KeyboardInterrupt:
            raise CommandError("interrupted: the run's servers were stopped; no record was written") from None
        finally:
            signal.signal(signal.SIGTERM, previous)
        self.print_table(record)
        self.stdout.write(f"record written to {path} (run took {record['duration_s']} s)")
        if opts["strict"]:
            failed = sorted({f"{ident} at count {n}" for n, entry in record["counts"].items()
                             for ident, check in {**record["model_checks"], **entry["model_checks"]}.items()
                             if check["status"] not in (evidence.PASS, evidence.NOT_APPLICABLE)})
            if failed:
                raise CommandError("--strict: model checks that did not pass: " + ", ".join(failed))

    def print_table(self, record: dict) -> None:
        counts = list(record["counts"])
        width = 16
        self.stdout.write("entry  " + "".join(f"{'count ' + n:<{width}}" for n in counts))
        for ident in evidence.FRAMEWORK_IDS:
            status = record["framework_checks"][ident]["status"]
            self.stdout.write(f"{ident:<7}" + "".join(f"{status:<{width}}" for _ in counts))
        for ident in MODEL_ROWS:
            cells = []
            for n in counts:
                entry = record["counts"][n]["model_checks"].get(ident) or record["model_checks"][ident]
                cells.append(f"{entry['status']:<{width}}")
            self.stdout.write(f"{ident:<7}" + "".join(cells))
        ready = [str(record["counts"][n]["admission_ready"]) for n in counts]
        self.stdout.write("ready  " + "".join(f"{r:<{width}}" for r in ready))
        for n in counts:
            blocked = record["counts"][n].get("blocked_by") or []
            if not record["counts"][n]["admission_ready"] and blocked:
                self.stdout.write(f"count {n} not admission-ready: {', '.join(blocked)} did not pass")
        framework = [entry for ident, entry in record["framework_checks"].items() if entry["status"] != evidence.PASS]
        if framework:
            source = framework[0].get("record") or "none"
            self.stdout.write(f"framework checks from record {source}: {framework[0]['limits'][:300]}"
                              f" (manage.py admission judges F1-F6 again from the newest framework record)")
        for n in counts:
            for ident, entry in record["counts"][n]["model_checks"].items():
                if entry["status"] not in (evidence.PASS, evidence.NOT_APPLICABLE) and entry["limits"]:
                    self.stdout.write(f"count {n} {ident}: {entry['limits'][:400]}")
