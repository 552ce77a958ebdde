"""Print the longest functions of the serving code, longest first (a report for ``scripts/lint.sh``, not a gate).

The serving code is what ``serve`` runs: the packages ``audiosite``, ``inference``, ``registry`` and
``ui``, without tests and migrations. A function's length is its lines from ``def`` (or its first
decorator) to its last line, docstring and comments included (``ast``'s ``lineno``/``end_lineno``);
a nested function counts in its own right and within its parent. DESIGN.md's rule: no serving
function over about 60 lines.

Usage: ``python scripts/longest_functions.py [N]`` (N: how many to print, default 10). Exit status 0.
"""
from __future__ import annotations

import ast
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent
SERVING_PACKAGES = ("audiosite", "inference", "registry", "ui")
LIMIT_LINES = 60
"""DESIGN.md "Where code lives": no serving function over about 60 lines."""


def _serving_files() -> list[Path]:
    """The ``.py`` files of the serving packages, without tests and migrations."""
    return sorted(path for package in SERVING_PACKAGES for path in (ROOT / package).rglob("*.py")
                  if not {"tests", "migrations"} & set(path.relative_to(ROOT).parts)
                  and not path.name.startswith("test_"))


def function_lengths(path: Path) -> list[tuple[int, str]]:
    """``(lines, "path:line qualified.name")`` for every function and method defined in ``path``."""
    tree = ast.parse(path.read_text(), str(path))
    found: list[tuple[int, str]] = []

    def visit(node: ast.AST, prefix: str) -> None:
        for child in ast.iter_child_nodes(node):
            if isinstance(child, (ast.FunctionDef, ast.AsyncFunctionDef)):
                first = min([child.lineno] + [d.lineno for d in child.decorator_list])
                lines = (child.end_lineno or child.lineno) - first + 1
                found.append((lines, f"{path.relative_to(ROOT)}:{child.lineno} {prefix}{child.name}"))
                visit(child, f"{prefix}{child.name}.")
            elif isinstance(child, ast.ClassDef):
                visit(child, f"{prefix}{child.name}.")
            else:
                visit(child, prefix)

    visit(tree, "")
    return found


def main(argv: list[str]) -> int:
    count = int(argv[1]) if len(argv) > 1 else 10
    lengths = sorted((entry for path in _serving_files() for entry in function_lengths(path)), reverse=True)
    over = sum(1 for lines, _ in lengths if lines > LIMIT_LINES)
    print(f"the {count} longest functions of the serving code ({over} over {LIMIT_LINES} lines):")
    for lines, where in lengths[:count]:
        print(f"  {lines:4d}  {where}")
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
