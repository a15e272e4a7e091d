"""Layers that point one way: command lines -> training / serving / evaluation -> inference /
weights -> model / data -> kernels -> parallel -> execution -> runtime / config. Read from the
source (ast), so a new import cycle, an import up the layers or a private name taken from another module
fails here, by name."""

from __future__ import annotations

import ast
import pathlib

import pytest

ROOT = pathlib.Path(__file__).resolve().parents[1]
PACKAGE = ROOT / "llm_jax"

# A module may import its own package and the packages of lower rank, never one of equal or
# higher rank. The command lines (llm_jax/*.py) and the benchmarks sit on top.
RANKS = {
    "config": 0, "runtime": 0,
    "execution": 0.25,  # the ExecutionConfig, built on config's FrozenConfig
    "(package root)": 0.5,  # llm_jax/__init__.py: its public names, loaded lazily
    "parallel": 1,
    "kernels": 2,
    "model": 3, "data": 3,
    "inference": 4, "weights": 4,
    "training": 5, "serving": 5, "evaluation": 5,
    "bench": 6, "(command lines)": 6,
}


def module_name(path: pathlib.Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def layer(module: str) -> str:
    """'model' for llm_jax.model.attention; 'config' for llm_jax.config; the CLIs share one."""
    parts = module.split(".")
    if len(parts) == 1:
        return "(package root)"
    if (PACKAGE / parts[1]).is_dir():
        return parts[1]
    return parts[1] if parts[1] in RANKS else "(command lines)"


def imports(source: str, module: str) -> list[tuple[str, str | None, int]]:
    """(imported module, imported name or None, line) for every llm_jax import in `source`."""
    found = []
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom) and node.level == 0 and node.module \
                and node.module.split(".")[0] == "llm_jax":
            for alias in node.names:
                submodule = f"{node.module}.{alias.name}"
                path = PACKAGE.parent / submodule.replace(".", "/")
                if path.with_suffix(".py").exists() or path.is_dir():
                    found.append((submodule, None, node.lineno))  # `from pkg import module`
                else:
                    found.append((node.module, alias.name, node.lineno))
        elif isinstance(node, ast.Import):
            found += [(a.name, None, node.lineno) for a in node.names
                      if a.name.split(".")[0] == "llm_jax"]
    return found


def import_graph() -> dict[str, list[tuple[str, str | None, int]]]:
    return {module_name(f): imports(f.read_text(encoding="utf-8"), module_name(f))
            for f in sorted(PACKAGE.rglob("*.py"))}


def upward_imports(graph) -> list[str]:
    bad = []
    for module, edges in graph.items():
        for target, _, line in edges:
            a, b = layer(module), layer(target)
            if a != b and RANKS[b] >= RANKS[a]:
                bad.append(f"{module}:{line} imports {target} ({a} may not import {b})")
    return bad


def private_imports(graph) -> list[str]:
    return [f"{module}:{line} imports the private {target}.{name}"
            for module, edges in graph.items() for target, name, line in edges
            if name is not None and name.startswith("_") and target != module]


def cycles(graph) -> list[list[str]]:
    """Every strongly connected component of more than one module (Tarjan)."""
    edges = {m: sorted({t for t, _, _ in e if t in graph and t != m}) for m, e in graph.items()}
    index, low, stack, on_stack, found = {}, {}, [], set(), []

    def visit(v):
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in edges[v]:
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

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return found


def test_every_package_has_a_rank():
    assert {layer(m) for m in import_graph()} <= set(RANKS)


def test_no_import_points_up_the_layers():
    assert upward_imports(import_graph()) == []


def test_no_import_cycle_between_modules():
    assert cycles(import_graph()) == []


def test_no_private_name_is_imported_from_another_module():
    assert private_imports(import_graph()) == []


@pytest.mark.parametrize("source, expected", [
    ("from llm_jax.training.loop import train", "llm_jax.kernels.x:1 imports llm_jax.training.loop"),
    ("from llm_jax import model", "llm_jax.kernels.x:1 imports llm_jax.model"),
])
def test_an_upward_import_is_caught(source, expected):
    graph = {"llm_jax.kernels.x": imports(source, "llm_jax.kernels.x")}
    assert [b.split(" (")[0] for b in upward_imports(graph)] == [expected]


def test_a_cycle_and_a_private_import_are_caught():
    graph = {"llm_jax.model.a": imports("from llm_jax.model.b import _f", "llm_jax.model.a"),
             "llm_jax.model.b": imports("import llm_jax.model.a", "llm_jax.model.b")}
    assert cycles(graph) == [["llm_jax.model.a", "llm_jax.model.b"]]
    assert private_imports(graph) == ["llm_jax.model.a:1 imports the private llm_jax.model.b._f"]


def test_no_test_file_imports_another():
    """Shared test code lives in tests/helpers.py (and conftest.py fixtures), never in a test."""
    bad = []
    for f in sorted(ROOT.glob("tests/**/*.py")):
        for node in ast.walk(ast.parse(f.read_text(encoding="utf-8"))):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) else [])
            bad += [f"{f.relative_to(ROOT)}:{node.lineno} imports {n}" for n in names
                    if n.split(".")[-1].startswith(("test_", "conftest"))]
    assert bad == []


def test_a_lazy_import_says_why():
    """An llm_jax import inside a function is never there to dodge a cycle; one kept for
    start-up cost says so on its line. (bench/ imports its contenders lazily throughout: each
    subcommand loads only what it runs.)"""
    bad = []
    for f in sorted(PACKAGE.rglob("*.py")):
        if f.parent.name == "bench":
            continue
        lines = f.read_text(encoding="utf-8").splitlines()
        for node in ast.walk(ast.parse("\n".join(lines))):
            if isinstance(node, (ast.Import, ast.ImportFrom)) and node.col_offset > 0 \
                    and "llm_jax" in ast.unparse(node) and "#" not in lines[node.lineno - 1]:
                bad.append(f"{module_name(f)}:{node.lineno}: {ast.unparse(node)}")
    assert bad == []
