"""``python manage.py admission``: the admission table of a backend, generated from evidence records.

Reads every record under ``--evidence`` (default ``model_specs/evidence``), builds the table
(``gate/admission.py`` states the rule) and prints the counts it adds or removes
against the current table, each with the record that decides it. ``--write`` writes the table;
``--check`` exits nonzero when the table on disk differs from what the records give (for CI).
A malformed or unbackable record is an error naming its path, and nothing is written.
"""
from __future__ import annotations

import json
from pathlib import Path

from django.core.management.base import BaseCommand, CommandError

from gate import admission, evidence


class Command(BaseCommand):
    help = "Build model_specs/admission/<backend>.json from evidence records; show the diff; --write, --check."

    def add_arguments(self, parser):
        parser.add_argument("--backend", default="cpu", choices=["cpu", "cuda"])
        parser.add_argument("--evidence", default=str(evidence.EVIDENCE_DIR),
                            help="evidence root (default: %(default)s)")
        parser.add_argument("--table", default=None,
                            help="the table file (default: model_specs/admission/<backend>.json)")
        parser.add_argument("--write", action="store_true", help="write the table")
        parser.add_argument("--check", action="store_true", help="exit 1 when the table differs from the records")

    def handle(self, *args, **opts):
        if opts["write"] and opts["check"]:
            raise CommandError("--write and --check exclude each other")
        backend, root = opts["backend"], Path(opts["evidence"])
        path = Path(opts["table"]) if opts["table"] else admission.table_path(backend)
        if not root.is_dir():
            raise CommandError(f"no evidence directory at {root}")
        try:
            table, decisions, framework, other_code = admission.build(root, backend)
            current = admission.read_table(path)
        except evidence.EvidenceError as exc:
            raise CommandError(f"refused, nothing written: {exc}") from None
        # how _about names the root: the same text whatever directory the command runs in
        label = "model_specs/evidence" if root.resolve() == evidence.EVIDENCE_DIR.resolve() else str(root)
        document = admission.render(table, decisions, backend, label, framework)
        where = f" ({framework.record}, code tree {(framework.code_tree or '?')[:12]})" if framework.record else ""
        self.stdout.write(f"framework: {framework.reason}{where}")
        for other in other_code if framework.record else []:
            self.stdout.write(f"note: {other} ran other code than the framework record (code tree differs)")
        lines = admission.diff(current, document, decisions)
        same = current == document
        for key in decisions:
            family, task_mode = key.split(" ", 1)
            self.stdout.write(f"{key:<46} admitted {document[family][task_mode]}")
        if lines:
            self.stdout.write(f"changes against {path}:")
            for line in lines:
                self.stdout.write(f"  {line}")
        elif not same:
            self.stdout.write(f"{path}: same counts; only _about/_sources or layout differ")
        else:
            self.stdout.write(f"{path} is up to date with the records")
        if opts["check"] and not same:
            raise CommandError(f"{path} differs from what the records under {root} give; "
                               f"run `python manage.py admission --backend {backend} --write`")
        if opts["write"]:
            try:
                path.parent.mkdir(parents=True, exist_ok=True)
                path.write_text(json.dumps(document, indent=2) + "\n")
            except OSError as exc:
                raise CommandError(f"cannot write {path}: {exc}") from None
            self.stdout.write(f"wrote {path}")
