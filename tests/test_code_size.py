"""The size rules of CONTRIBUTING.md, checked (``make lint`` runs this file): no function over 60 lines (its
docstring aside); modules are rooms of one concept, not of a line count, and each says which in its docstring.
Complexity (<= 10) is ruff's C90."""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gpupipe"
MAX_FUNCTION_LINES = 60


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


def concept(source: str) -> str | None:
    """The first sentence of a module's docstring: the one concept it holds (None: it says none). A package's face
    (an ``__init__.py`` that only hands names on) and ``__main__.py`` need none."""
    doc = ast.get_docstring(ast.parse(source))
    return doc.split(". ")[0].strip() if doc else None


def _modules() -> list[Path]:
    return sorted(PACKAGE.rglob("*.py"))


def test_no_function_over_60_lines():
    found = [
        f"{path.relative_to(PACKAGE)}: {name} ({n} lines)"
        for path in _modules()
        for name, n in long_functions(path.read_text())
    ]
    assert not found, "functions over 60 lines: " + "; ".join(found)


def test_every_module_says_the_concept_it_holds():
    found = [
        str(path.relative_to(PACKAGE))
        for path in _modules()
        if path.name not in ("__init__.py", "__main__.py") and not concept(path.read_text())
    ]
    assert not found, "modules with no docstring saying what they hold: " + ", ".join(found)


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


def test_the_module_rule_wants_a_docstring():
    assert concept("x = 1\n" * 1000) is None
    assert concept('"""The node\'s shard cache. Long."""\n' + "x = 1\n" * 1000) == "The node's shard cache"
