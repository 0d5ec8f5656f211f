"""No import cycle in src/tether, counting imports inside functions and under TYPE_CHECKING.

A cycle means two modules hold one job between them; the layout in docs/internals.md
depends on imports going one way. One kind of type-only import is allowed, and listed
below: an object annotating what created it (`app: Tether`), while its creator imports it.
"""

from __future__ import annotations

import ast
from pathlib import Path

SRC = Path(__file__).resolve().parents[2] / "src"
PACKAGE = SRC / "tether"

# (module, what it imports only under TYPE_CHECKING): the only type-only edges allowed to
# close a cycle. Each annotates the object that made it: the app (app.py creates tasks,
# handles and workflows), or the task a workflow node was made from (task.node()).
TYPE_ONLY_BACK_REFERENCES = {
    ("tether.handle", "tether.app"),
    ("tether.task", "tether.app"),
    ("tether.workflow.definition", "tether.app"),
    ("tether.workflow.definition", "tether.task"),
    ("tether.workflow.handle", "tether.app"),
}


def _module_name(path: Path) -> str:
    parts = list(path.relative_to(SRC).with_suffix("").parts)
    if parts[-1] == "__init__":
        parts.pop()
    return ".".join(parts)


def _type_only(tree: ast.Module) -> set[int]:
    """ids of the import nodes under an `if TYPE_CHECKING:` block."""
    found: set[int] = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.If) and "TYPE_CHECKING" in ast.unparse(node.test):
            found |= {id(n) for stmt in node.body for n in ast.walk(stmt)}
    return found


def _imports(path: Path, modules: set[str], *, allowed: set[tuple[str, str]]) -> set[str]:
    """The tether modules ``path`` imports, anywhere in the file, but the allowed type-only ones."""
    this = _module_name(path)
    package = this if path.name == "__init__.py" else this.rpartition(".")[0]
    found: set[str] = set()
    tree = ast.parse(path.read_text(), str(path))
    type_only = _type_only(tree)
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
            if name and name != this and not (id(node) in type_only and (this, name) in allowed):
                found.add(name)
    return found


def _graph(allowed: set[tuple[str, str]] = TYPE_ONLY_BACK_REFERENCES) -> dict[str, set[str]]:
    paths = sorted(PACKAGE.rglob("*.py"))
    modules = {_module_name(p) for p in paths}
    graph = {_module_name(p): _imports(p, modules, allowed=allowed) for p in paths}
    return graph


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
    # Type-only imports count unless allowed: without the list, the app's back references
    # close a cycle.
    assert "tether.app" in _graph(allowed=set())["tether.handle"]
    assert _cycles(_graph(allowed=set())) != []


def test_a_cycle_would_be_found() -> None:
    assert _cycles({"a": {"b"}, "b": {"c"}, "c": {"a"}, "d": {"a"}}) == [["a", "b", "c"]]


def test_src_has_no_import_cycle() -> None:
    assert _cycles(_graph()) == []
