"""The house shape rules, checked by walking marslm/ with ast: small functions, small modules."""

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parent.parent / "marslm"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 450

# Exempt for good: the data tables are data, not logic.
DATA_TABLES = {"data/toy.py", "data/instructions.py"}


def _modules():
    for path in sorted(PACKAGE.rglob("*.py")):
        name = path.relative_to(PACKAGE).as_posix()
        if name in DATA_TABLES:
            continue
        yield name, path


def _long_functions():
    found = set()
    for name, path in _modules():
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
                if node.end_lineno - node.lineno + 1 > MAX_FUNCTION_LINES:
                    found.add(f"{name}:{node.name}")
    return found


def _long_modules():
    return {name for name, path in _modules() if len(path.read_text().splitlines()) > MAX_MODULE_LINES}


def test_no_long_function():
    assert _long_functions() == set()  # split a long one along its phases


def test_no_long_module():
    assert _long_modules() == set()  # split a long one along a seam
