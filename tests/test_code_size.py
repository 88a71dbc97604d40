"""The size rules of CONTRIBUTING.md, checked (``make lint`` runs this file): no function over 60 lines (its
docstring aside), no module over 400 lines unless a comment at its top says why (``# Over 400 lines: <reason>`` in its
first 5 lines). Complexity (<= 10) is ruff's C90."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gpupipe"
MAX_FUNCTION_LINES = 60
MAX_MODULE_LINES = 400


def long_functions(source: str, limit: int = MAX_FUNCTION_LINES) -> list[tuple[str, int]]:
    """(name, lines) of each function or method longer than ``limit`` lines: the lines after its ``def`` line (the
    rest of its signature and its body), less its docstring."""
    out = []
    for node in ast.walk(ast.parse(source)):
        if not isinstance(node, (ast.FunctionDef, ast.AsyncFunctionDef)):
            continue
        lines = (node.end_lineno or node.lineno) - node.lineno
        first = node.body[0]
        if isinstance(first, ast.Expr) and isinstance(first.value, ast.Constant) and isinstance(first.value.value, str):
            lines -= (first.end_lineno or first.lineno) - first.lineno + 1
        if lines > limit:
            out.append((node.name, lines))
    return out


def too_long_without_reason(source: str, limit: int = MAX_MODULE_LINES) -> bool:
    lines = source.splitlines()
    return len(lines) > limit and not any(line.startswith("# Over 400 lines:") for line in lines[:5])


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_function_over_60_lines():
    found = [
        f"{path.relative_to(PACKAGE)}: {name} ({n} lines)"
        for path in _modules()
        for name, n in long_functions(path.read_text())
    ]
    assert not found, "functions over 60 lines: " + "; ".join(found)


def test_no_module_over_400_lines_without_a_reason():
    found = [str(path.relative_to(PACKAGE)) for path in _modules() if too_long_without_reason(path.read_text())]
    assert not found, "modules over 400 lines with no '# Over 400 lines: <reason>' at the top: " + ", ".join(found)


@pytest.mark.parametrize(
    "body, expected",
    [
        ("    x = 1\n" * 60, []),
        ("    x = 1\n" * 61, [("f", 61)]),
        ('    """Doc\n    string."""\n' + "    x = 1\n" * 59, []),  # the docstring is not counted
    ],
)
def test_the_function_rule_counts_lines(body, expected):
    assert long_functions("def f():\n" + body) == expected


def test_the_module_rule_wants_a_reason():
    text = '"""Doc."""\n' + "x = 1\n" * 400
    assert too_long_without_reason(text)
    assert not too_long_without_reason("# Over 400 lines: one algorithm, read top to bottom\n" + text)
