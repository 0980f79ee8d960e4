"""The layers of docs/architecture.md, read off the source: which package may import which, and no
import circles between modules, at import time or inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "marslm"

# package (or module) -> what it must never reach, through any chain of imports (function-level
# imports included): a layer may import only what sits below it in docs/architecture.md.
TOOLING = ("marslm.eval", "marslm.bench", "marslm.demo", "marslm.cli")
FORBIDDEN = {
    "marslm.decode": ("marslm.training", "marslm.serve", *TOOLING),
    "marslm.training": ("marslm.decode", "marslm.serve", *TOOLING),
    "marslm.masks": ("marslm.training", "marslm.decode", "marslm.serve", "marslm.modeling", *TOOLING),
    "marslm.adapter": ("marslm.training", "marslm.decode", "marslm.serve", "marslm.modeling", *TOOLING),
    "marslm.modeling": ("marslm.training", "marslm.decode", "marslm.serve", *TOOLING),
    "marslm.mars_json": ("marslm.training", "marslm.decode", "marslm.serve", "marslm.modeling", *TOOLING),
    "marslm.data": ("marslm.training", "marslm.decode", "marslm.serve", "marslm.modeling", *TOOLING),
    "marslm.unwrap": ("marslm",),
    "marslm.serve": ("marslm.eval", "marslm.demo", "marslm.cli"),
    "marslm.eval": ("marslm.serve", "marslm.bench", "marslm.demo", "marslm.cli"),
    "marslm.bench": ("marslm.demo", "marslm.cli"),
}


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT.parent).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imports(path: Path, top_level_only: bool) -> set[str]:
    """Every marslm module ``path`` imports (relative imports resolved)."""
    name = _module_name(path)
    package = name if path.name == "__init__.py" else name.rsplit(".", 1)[0]
    tree = ast.parse(path.read_text())
    nodes = tree.body if top_level_only else list(ast.walk(tree))
    found = set()
    for node in nodes:
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")
                base = base[: len(base) - node.level + 1]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            found.add(target)
            found.update(f"{target}.{alias.name}" for alias in node.names)
        elif isinstance(node, ast.Import):
            found.update(alias.name for alias in node.names)
    return {t for t in found if t.startswith("marslm")}


MODULES = {_module_name(p): p for p in ROOT.rglob("*.py")}


def _under(name: str, package: str) -> bool:
    return name == package or name.startswith(package + ".")


def _reach(name: str, graph: dict[str, set[str]]) -> dict[str, str]:
    """Every module ``name`` reaches, each with the chain that reaches it."""
    chains, todo = {name: name}, [name]
    while todo:
        here = todo.pop()
        for nxt in sorted(graph.get(here, ())):
            if nxt not in chains:
                chains[nxt] = f"{chains[here]} -> {nxt}"
                todo.append(nxt)
    return chains


def _graph(top_level_only: bool) -> dict[str, set[str]]:
    """Module -> the marslm modules it imports (``from pkg import name`` counts as ``pkg.name``)."""
    return {
        name: {t for t in _imports(path, top_level_only) if t in MODULES and t != name}
        for name, path in MODULES.items()
    }


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_layer_reaches_one_above_it(layer):
    graph = _graph(top_level_only=False)
    wrong = []
    for name in MODULES:
        if _under(name, layer):
            wrong += [
                chain
                for target, chain in _reach(name, graph).items()
                if not _under(target, layer) and any(_under(target, f) for f in FORBIDDEN[layer])
            ]
    assert not wrong, wrong[:5]


def test_only_the_cli_reaches_the_demos():
    graph = _graph(top_level_only=False)
    wrong = [
        chain
        for name in MODULES
        if not (_under(name, "marslm.cli") or _under(name, "marslm.demo"))
        for target, chain in _reach(name, graph).items()
        if _under(target, "marslm.demo")
    ]
    assert not wrong, wrong[:5]


def test_only_the_cli_imports_the_cli():
    wrong = [
        f"{name} -> {t}"
        for name, path in MODULES.items()
        if not _under(name, "marslm.cli")
        for t in _imports(path, False)
        if _under(t, "marslm.cli")
    ]
    assert not wrong, wrong


@pytest.mark.parametrize("top_level_only", [True, False], ids=["at-import-time", "inside-functions-too"])
def test_no_import_circles(top_level_only):
    graph = _graph(top_level_only)
    state: dict[str, int] = {}
    cycle: list[str] = []

    def visit(node: str, stack: list[str]) -> bool:
        state[node] = 1
        for nxt in graph[node]:
            if state.get(nxt) == 1:
                cycle.extend(stack[stack.index(nxt) :] + [nxt])
                return True
            if state.get(nxt) is None and visit(nxt, stack + [nxt]):
                return True
        state[node] = 2
        return False

    for start in graph:
        if state.get(start) is None and visit(start, [start]):
            break
    assert not cycle, " -> ".join(cycle)
