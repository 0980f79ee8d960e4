"""The layers of docs/architecture.md, read off the source: which package may import which, and no
import circles between modules, at import time or inside functions."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1] / "marslm"

# package (or module) -> what it must never import, at any depth (function-level imports included)
FORBIDDEN = {
    "marslm.decode": ("marslm.training", "marslm.serve", "marslm.experiments", "marslm.cli"),
    "marslm.training": ("marslm.serve", "marslm.experiments", "marslm.cli", "marslm.decode"),
    "marslm.masks": (
        "marslm.training",
        "marslm.decode",
        "marslm.serve",
        "marslm.experiments",
        "marslm.cli",
        "marslm.modeling",
    ),
    "marslm.adapter": (
        "marslm.training",
        "marslm.decode",
        "marslm.serve",
        "marslm.experiments",
        "marslm.cli",
        "marslm.modeling",
    ),
    "marslm.modeling": ("marslm.training", "marslm.decode", "marslm.serve", "marslm.experiments", "marslm.cli"),
    "marslm.unwrap": ("marslm",),
    "marslm.mars_json": ("marslm.training", "marslm.decode", "marslm.serve", "marslm.experiments", "marslm.cli"),
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


@pytest.mark.parametrize("layer", sorted(FORBIDDEN))
def test_no_layer_imports_one_above_it(layer):
    wrong = []
    for name, path in MODULES.items():
        if _under(name, layer):
            wrong += [f"{name} -> {t}" for t in _imports(path, False) if any(_under(t, f) for f in FORBIDDEN[layer])]
    assert not wrong, wrong


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
    graph = {
        name: {t for t in _imports(path, top_level_only) if t in MODULES and t != name}
        for name, path in MODULES.items()
    }
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
