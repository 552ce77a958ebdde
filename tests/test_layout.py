"""The shape of the code (DESIGN.md "Where code lives"): no import cycle, imports one way.

Reads the source with the ``ast`` module (no import side effects). Every
``import`` counts, wherever it is written, including function-local ones.
"""
from __future__ import annotations

import ast
import re
from pathlib import Path

import pytest

from inference.runtime.startup import UNTESTED_RULES

from .support.processes import ROOT

# The product (what ``serve`` runs) and the tools (management commands only): the validation gate and
# the benchmarks import the product, never the other way.
SERVING_PACKAGES = ("audiosite", "inference", "registry", "ui")
TOOL_PACKAGES = ("gate", "bench")
PACKAGES = SERVING_PACKAGES + TOOL_PACKAGES


def _modules() -> dict[str, Path]:
    found = {}
    for package in PACKAGES:
        for path in (ROOT / package).rglob("*.py"):
            parts = list(path.relative_to(ROOT).with_suffix("").parts)
            if "migrations" in parts:
                continue
            if parts[-1] == "__init__":
                parts = parts[:-1]
            found[".".join(parts)] = path
    return found


MODULES = _modules()


def _tree(path: Path) -> ast.Module:
    """``path``'s syntax tree. CPython 3.11 may raise a spurious ``SystemError`` ("AST constructor
    recursion depth mismatch", python/cpython#106905) when other threads of the process build trees
    meanwhile; a second parse of the same source is then the real answer."""
    source = path.read_text()
    try:
        return ast.parse(source, str(path))
    except SystemError:
        return ast.parse(source, str(path))


def _resolve(name: str) -> str | None:
    """The project module ``name`` refers to (itself, or its closest enclosing project module)."""
    while name:
        if name in MODULES:
            return name
        name = name.rpartition(".")[0]
    return None


def _imports(module: str, path: Path) -> list[tuple[str, int, bool]]:
    """``(imported project module, line, function-local?)`` for every import in ``path``."""
    tree = _tree(path)
    package = module if path.name == "__init__.py" else module.rpartition(".")[0]
    local_lines = {node.lineno for fn in ast.walk(tree) if isinstance(fn, (ast.FunctionDef, ast.AsyncFunctionDef))
                   for node in ast.walk(fn) if isinstance(node, (ast.Import, ast.ImportFrom))}
    out = []
    for node in ast.walk(tree):
        targets: list[str] = []
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")
                anchor = anchor[: len(anchor) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            # ``from pkg import name``: a submodule when one exists, else the package itself.
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
        for target in targets:
            resolved = _resolve(target)
            if resolved and resolved != module:
                out.append((resolved, node.lineno, node.lineno in local_lines))
    return out


GRAPH = {module: _imports(module, path) for module, path in MODULES.items()}


def _cycles() -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found = []
    counter = [0]

    def visit(node: str) -> None:
        index[node] = low[node] = counter[0]
        counter[0] += 1
        stack.append(node)
        on_stack.add(node)
        for target, _, _ in GRAPH[node]:
            if target not in index:
                visit(target)
                low[node] = min(low[node], low[target])
            elif target in on_stack:
                low[node] = min(low[node], index[target])
        if low[node] == index[node]:
            component = []
            while True:
                member = stack.pop()
                on_stack.discard(member)
                component.append(member)
                if member == node:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for module in sorted(GRAPH):
        if module not in index:
            visit(module)
    return found


def _reach(start: str) -> set[str]:
    seen, todo = set(), [start]
    while todo:
        module = todo.pop()
        if module in seen:
            continue
        seen.add(module)
        todo.extend(target for target, _, _ in GRAPH[module])
    return seen


def test_the_graph_sees_the_project():
    """The checks below are only as good as the graph: it must know the layers and their edges."""
    assert {"inference.services", "inference.services.request", "inference.scheduler.slots", "inference.runtime.loads",
            "inference.runtime.runs", "inference.runtime.streams", "inference.worker.tasks",
            "registry.records", "registry.services", "audiosite.asgi", "gate.model_checks",
            "bench.reference.asgi"} <= set(MODULES)
    assert any(t == "inference.scheduler" for t, _, _ in GRAPH["inference.runtime.loads"])
    assert any(t == "inference.runtime.runs" for t, _, _ in GRAPH["inference.services.request"])
    assert any(t == "inference.services" for t, _, _ in GRAPH["registry.services"])


def test_no_import_cycle_among_the_project_modules():
    assert _cycles() == []


def test_no_function_local_import_of_project_code():
    """A function-local import of our own code is how cycles hide; none is left."""
    local = [f"{m}:{line} -> {t}" for m, edges in GRAPH.items() for t, line, inside in edges if inside]
    assert local == []


@pytest.mark.parametrize("layer, forbidden", [
    ("inference.scheduler", ("django", "audiosite", "registry", "inference.runtime", "inference.services",
                             "inference.worker", "inference.adapters", "celery", "rest_framework")),
    ("inference.runtime", ("registry", "inference.services", "inference.worker", "inference.adapters",
                           "rest_framework", "adrf")),
    ("inference.adapters", ("django", "audiosite", "registry", "inference.runtime", "inference.services",
                            "inference.worker", "rest_framework", "celery")),
    ("registry.records", ("inference.services", "inference.runtime", "registry.services", "rest_framework")),
    *((package, TOOL_PACKAGES) for package in SERVING_PACKAGES),
    ("gate", ("bench",)),
])
def test_imports_run_one_way(layer, forbidden):
    """views → services → runtime → scheduler; worker → adapters; the scheduler knows no Django;
    the runtime never imports ``registry``; adapters know nothing of HTTP or Django; the serving code
    never imports the tools (``gate``, ``bench``); the gate never imports the benchmarks."""
    offending = []
    for module, path in MODULES.items():
        if module != layer and not module.startswith(layer + "."):
            continue
        tree = _tree(path)
        for node in ast.walk(tree):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            offending += [f"{module}:{node.lineno} imports {n}" for n in names
                          if any(n == f or n.startswith(f + ".") for f in forbidden)]
        offending += [f"{module} imports {t}" for t, _, _ in GRAPH[module]
                      if any(t == f or t.startswith(f + ".") for f in forbidden)]
    assert offending == []


# Framework internals are overridden in one place (audiosite.http, whose module doc lists them); the
# command that runs daphne (audiosite.web) may name daphne; the benchmark's stock reference view
# (bench.reference) is a plain adrf view.
FRAMEWORK_INTERNALS = ("daphne", "twisted", "autobahn", "zope", "adrf", "django.core.handlers")
MAY_IMPORT_FRAMEWORK_INTERNALS = ("audiosite.http", "audiosite.web", "bench.reference")


def test_framework_internals_are_imported_only_under_audiosite_http():
    offending = []
    for module, path in MODULES.items():
        if any(module == m or module.startswith(m + ".") for m in MAY_IMPORT_FRAMEWORK_INTERNALS):
            continue
        for node in ast.walk(_tree(path)):
            names = []
            if isinstance(node, ast.Import):
                names = [a.name for a in node.names]
            elif isinstance(node, ast.ImportFrom) and not node.level and node.module:
                names = [node.module]
            offending += [f"{module}:{node.lineno} imports {n}" for n in names
                          if any(n == f or n.startswith(f + ".") for f in FRAMEWORK_INTERNALS)]
    assert offending == []
    assert "audiosite.http.handler" in MODULES and "audiosite.http.daphne_server" in MODULES


# The one model adapter the web process runs itself: Silero VAD finds the turns of a live transcription
# (inference/realtime.py, docs/operations.md "Streamed transcription"); every model that serves requests
# runs on a worker.
WEB_ADAPTERS = {"inference.adapters.base", "inference.adapters.silero_vad"}


def test_the_web_process_imports_no_worker_module():
    web = _reach("audiosite.asgi") | _reach("audiosite.urls")
    assert "inference.services" in web  # the graph does follow the request path
    assert sorted(m for m in web if m.startswith("inference.worker")) == []
    assert sorted(m for m in web if m.startswith("inference.adapters") and m not in WEB_ADAPTERS) == []


def test_the_start_up_warning_names_exactly_the_untested_rules_of_the_contract():
    """R1.5: the warning lists the rules labelled U in docs/contract.md (a constant, not parsed at start-up)."""
    labelled_u = []
    for line in (ROOT / "docs" / "contract.md").read_text().splitlines():
        cells = [c.strip() for c in line.split("|")]
        if len(cells) > 3 and re.match(r"^R\d", cells[1]) and cells[3] == "U":
            labelled_u.append(cells[1])
    assert labelled_u == list(UNTESTED_RULES)
