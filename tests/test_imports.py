"""No import cycles in gpupipe (``make lint`` runs this file).

The graph is static: every ``import``/``from ... import`` in a module's source counts, wherever it is (module level,
inside functions, under ``if TYPE_CHECKING:``), so a deferred import cannot hide a cycle. ``from a import b`` is an
edge to ``a.b`` when that is a module, else to ``a``; importing ``a.b.c`` from outside package ``a.b`` is also an edge
to ``a.b`` (Python runs its ``__init__`` first), while a package's own modules importing each other are not edges to
the package itself (it is already being imported). Modules outside the package are left out.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parent.parent / "gpupipe"


def _module_name(root: Path, path: Path) -> str:
    parts = list(path.relative_to(root.parent).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def _imported(node: ast.Import | ast.ImportFrom, base: list[str], modules: set[str]) -> list[str]:
    """The modules one import statement names (as modules of the package where they are)."""
    if isinstance(node, ast.Import):
        return [a.name for a in node.names]
    src = ".".join(base[: len(base) - node.level + 1] + ([node.module] if node.module else [])) if node.level else ""
    src = src or node.module or ""
    return [f"{src}.{a.name}" if f"{src}.{a.name}" in modules else src for a in node.names]


def _prefixes(name: str) -> list[str]:
    parts = name.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts) + 1)]


def import_graph(root: Path) -> dict[str, set[str]]:
    """module -> the package's modules it imports (see the module docstring for what counts)."""
    files = {_module_name(root, p): p for p in root.rglob("*.py")}
    graph: dict[str, set[str]] = {}
    for mod, path in files.items():
        base = mod.split(".") if path.name == "__init__.py" else mod.split(".")[:-1]
        own = set(_prefixes(mod))  # this module and the packages already being imported around it
        edges: set[str] = set()
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if not isinstance(node, (ast.Import, ast.ImportFrom)):
                continue
            for target in _imported(node, base, set(files)):
                edges.update(p for p in _prefixes(target) if p in files and p not in own)
        graph[mod] = edges
    return graph


def _reachable(graph: dict[str, set[str]], start: str) -> set[str]:
    seen: set[str] = set()
    todo = list(graph.get(start, ()))
    while todo:
        node = todo.pop()
        if node not in seen:
            seen.add(node)
            todo.extend(graph.get(node, ()))
    return seen


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Each group of modules that import one another, directly or not (a module reaching itself)."""
    reach = {m: _reachable(graph, m) for m in graph}
    found: list[list[str]] = []
    for m in sorted(graph):
        if m in reach[m] and not any(m in c for c in found):
            found.append(sorted(n for n in reach[m] if m in reach.get(n, ())))
    return found


def test_gpupipe_has_no_import_cycle():
    graph = import_graph(PACKAGE)
    assert "gpupipe.api" in graph and "gpupipe.backends.registry" in graph  # the graph is the real package's
    assert "gpupipe.data.loader" in graph["gpupipe.backends.cpu"]
    assert not cycles(graph), "import cycles: " + "; ".join(" <-> ".join(c) for c in cycles(graph))


def _write(root: Path, files: dict[str, str]) -> Path:
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(text)
    return root / "pkg"


@pytest.mark.parametrize(
    "files, cycle",
    [
        # a deferred import inside a function
        ({"pkg/__init__.py": "", "pkg/a.py": "from . import b\n", "pkg/b.py": "def f():\n    from .a import x\n"},
         ["pkg.a", "pkg.b"]),
        # a TYPE_CHECKING import, through a subpackage's __init__
        ({"pkg/__init__.py": "",
          "pkg/a.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from .sub.c import X\n",
          "pkg/sub/__init__.py": "from .c import X\n", "pkg/sub/c.py": "import pkg.a\n"},
         ["pkg.a", "pkg.sub", "pkg.sub.c"]),
    ],
)  # fmt: skip
def test_a_cycle_is_found(tmp_path, files, cycle):
    assert cycles(import_graph(_write(tmp_path, files))) == [cycle]


def test_a_package_importing_its_own_modules_is_no_cycle(tmp_path):
    files = {"pkg/__init__.py": "from . import a\n", "pkg/a.py": "from . import b\n", "pkg/b.py": "X = 1\n"}
    assert cycles(import_graph(_write(tmp_path, files))) == []
