"""The house's sizes, as docs/architecture.md states them: no module of the package over 600 lines, and
no function whose code (its docstring left out) runs over 80 lines. A module that grows past them is
split by what its parts do; a function, into named steps."""

from __future__ import annotations

import ast
from pathlib import Path

PACKAGE = Path(__file__).resolve().parents[1] / "ds_adabatch"
MODULE_LINES = 600
FUNCTION_LINES = 80


def _code_lines(node: ast.FunctionDef | ast.AsyncFunctionDef) -> int:
    """Lines of a function from its first statement after the docstring to its end."""
    body = node.body
    first = body[0]
    has_doc = (
        isinstance(first, ast.Expr)
        and isinstance(first.value, ast.Constant)
        and isinstance(first.value.value, str)
    )
    start = body[1].lineno if has_doc and len(body) > 1 else first.lineno
    return node.end_lineno - start + 1


def test_no_module_is_over_600_lines():
    sizes = {
        str(p.relative_to(PACKAGE.parent)): len(p.read_text().splitlines()) for p in PACKAGE.rglob("*.py")
    }
    assert len(sizes) > 50, "the package was not found"
    over = {path: n for path, n in sizes.items() if n > MODULE_LINES}
    assert not over, f"modules over {MODULE_LINES} lines (split them by what their parts do): {over}"


def test_no_function_runs_over_80_lines_of_code():
    long = []
    for path in PACKAGE.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (
                isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef))
                and _code_lines(node) > FUNCTION_LINES
            ):
                long.append(
                    f"{path.relative_to(PACKAGE.parent)}:{node.lineno} {node.name} ({_code_lines(node)})"
                )
    assert not long, f"functions over {FUNCTION_LINES} lines of code: {long}"
