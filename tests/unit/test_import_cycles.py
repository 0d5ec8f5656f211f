"""No import cycle in src/tether, counting imports inside functions and under TYPE_CHECKING.

A cycle means two modules hold one job between them; the layout in docs/internals.md
depends on imports going one way. Type-only imports count too: an object that must name
what created it does so through a Protocol (tether.app_view.AppView, workflow's StepTask).
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "tether"


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _imports(path: Path, modules: set[str], source: str | None = None) -> set[str]:
    """The tether modules ``path`` imports, anywhere in the file (``source``: its text instead)."""
    this = _module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text() if source is None else source, str(path))
    for node in ast.walk(tree):
        if isinstance(node, ast.Import):
            names = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                base = ".".join([*anchor, base] if base else anchor)
            # `from tether.x import y` may import the module tether.x.y or a name of tether.x
            names = [f"{base}.{a.name}" if f"{base}.{a.name}" in modules else base for a in node.names]
        else:
            continue
        for name in names:
            while name and name not in modules:
                name = name.rpartition(".")[0]
            if name and name != this:
                found.add(name)
    return found


def _modules() -> tuple[list[Path], set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    return paths, {_module_name(p) for p in paths}


def _graph() -> dict[str, set[str]]:
    paths, modules = _modules()
    return {_module_name(p): _imports(p, modules) for p in paths}


def _cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components with more than one module (Tarjan)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(node: str) -> None:
        index[node] = low[node] = len(index)
        stack.append(node)
        on_stack.add(node)
        for other in graph[node]:
            if other not in index:
                visit(other)
                low[node] = min(low[node], low[other])
            elif other in on_stack:
                low[node] = min(low[node], index[other])
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

    for node in sorted(graph):
        if node not in index:
            visit(node)
    return found


def test_the_graph_sees_the_imports_it_must() -> None:
    graph = _graph()
    assert "tether.broker.claims" in graph["tether.worker.claimer"]
    assert "tether.outcomes" in graph["tether.broker.claims"]
    assert len(graph) > 50
    # Imports under TYPE_CHECKING and inside functions count like the others.
    _, modules = _modules()
    handle = PACKAGE / "handle.py"
    typed = "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from tether.app import Tether\n"
    assert "tether.app" in _imports(handle, modules, typed)
    late = "def f():\n    from .worker import main\n"
    assert "tether.worker.main" in _imports(handle, modules, late)


def test_a_cycle_would_be_found() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_src_has_no_import_cycle() -> None:
    assert _cycles(_graph()) == []
