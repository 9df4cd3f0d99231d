"""ember's import graph, read from the source (every import, those inside functions too): no
module imports back one that imports it, and no layer imports one above it
(docs/DESIGN.md, "The layout")."""

from __future__ import annotations

import ast
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1] / "ember"
# the layers, bottom up; the top-level modules (config, defaults, request, ...) are outside them
LAYERS = {"kernels": 0, "distributed": 1, "layers": 2, "models": 3, "loader": 3, "scheduler": 3, "structured": 3,
          "parsers": 3, "spec_decode": 3, "multimodal": 3, "runner": 4, "engine": 5, "server": 6, "router": 6, "bench": 6,
          "lang": 6}


def import_graph(root: Path = ROOT) -> dict[str, set[str]]:
    """{module: the ember modules it imports}."""
    files = {}
    for f in root.rglob("*.py"):
        parts = ("ember", *f.relative_to(root).with_suffix("").parts)
        files[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = f
    graph: dict[str, set[str]] = {}
    for module, f in files.items():
        package = module if f.name == "__init__.py" else module.rsplit(".", 1)[0]
        targets: set[str] = set()
        for node in ast.walk(ast.parse(f.read_text())):
            if isinstance(node, ast.Import):
                targets |= {a.name for a in node.names}
            elif isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    up = package.split(".")[: len(package.split(".")) - node.level + 1]
                    base = ".".join(up + ([base] if base else []))
                targets |= {base} | {f"{base}.{a.name}" for a in node.names}
        graph[module] = {t for t in targets if t in files and t != module}
    return graph


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm)."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    found: list[list[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph[v]:
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.append(w)
                if w == v:
                    break
            if len(component) > 1:
                found.append(sorted(component))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return found


def layer(module: str) -> int | None:
    parts = module.split(".")
    return LAYERS.get(parts[1]) if len(parts) > 1 else None


def climbing(graph: dict[str, set[str]]) -> list[str]:
    return [f"{m} -> {d}" for m, deps in sorted(graph.items()) for d in sorted(deps)
            if layer(m) is not None and layer(d) is not None and layer(d) > layer(m)]


def test_no_module_imports_back_one_that_imports_it():
    assert cycles(import_graph()) == []


def test_no_layer_imports_one_above_it():
    assert climbing(import_graph()) == []


def test_the_checks_see_a_loop_and_a_climb(tmp_path):
    """The two checks on a tree made to fail them: they are not vacuous."""
    pkg = tmp_path / "ember"
    for folder in ("kernels", "engine"):
        (pkg / folder).mkdir(parents=True)
        (pkg / folder / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("")
    (pkg / "kernels" / "a.py").write_text("def f():\n    from ember.engine import b\n")
    (pkg / "engine" / "b.py").write_text("from ember.kernels.a import f\n")
    (pkg / "engine" / "c.py").write_text("from . import b\n")
    graph = import_graph(pkg)
    assert graph["ember.engine.c"] == {"ember.engine", "ember.engine.b"}
    assert cycles(graph) == [["ember.engine.b", "ember.kernels.a"]]
    assert climbing(graph) == ["ember.kernels.a -> ember.engine", "ember.kernels.a -> ember.engine.b"]
    assert set(LAYERS) == {p.name for p in ROOT.iterdir() if p.is_dir() and (p / "__init__.py").exists()}
