"""The documentation holds together: every relative link in README.md, docs/*.md, CONTRIBUTING.md and bench/README.md
leads to a file that exists and, with ``#anchor``, to a heading or ``<a id>`` there (GitHub's anchor rules); the code
blocks marked ``<!-- runnable -->`` run; and no timing figure sits in gpupipe/'s comments or docstrings, since
measurements go stale there: they live in bench/README.md (CONTRIBUTING.md: Documentation)."""

from __future__ import annotations

import ast
import io
import os
import re
import subprocess
import sys
import tokenize
from collections import Counter
from pathlib import Path

import pytest

from gpupipe.sample_data import make_sample_data

ROOT = Path(__file__).resolve().parents[1]
PAGES = [
    ROOT / "README.md",
    ROOT / "CONTRIBUTING.md",
    ROOT / "bench" / "README.md",
    *sorted((ROOT / "docs").glob("*.md")),
]
RUNNABLE = "<!-- runnable -->"
FENCE = re.compile(r"^(```+|~~~+)\s*([\w+-]*)")
LINK = re.compile(r"!?\[(?:[^\[\]]|\[[^\]]*\])*\]\(\s*<?([^)\s>]+)>?(?:\s+\"[^\"]*\")?\s*\)")
CODE_SPAN = re.compile(r"(`+)(?:(?!\1).)+?\1")


def _prose(text: str) -> list[tuple[int, str]]:
    """(line number, line) of the text outside fenced code blocks, inline code spans blanked."""
    out, fence = [], ""
    for n, line in enumerate(text.splitlines(), 1):
        m = FENCE.match(line.lstrip())
        if m and (not fence or m.group(1).startswith(fence)):
            fence = "" if fence else m.group(1)
            continue
        if not fence:
            out.append((n, CODE_SPAN.sub(lambda s: " " * len(s.group(0)), line)))
    return out


def github_slug(heading: str) -> str:
    """The anchor GitHub gives a heading: markup dropped, lower case, every character but letters, digits, ``_``,
    ``-`` and spaces removed, spaces turned into hyphens."""
    text = re.sub(r"!?\[([^\]]*)\]\([^)]*\)", r"\1", heading)  # a link: its text
    text = re.sub(r"<[^>]+>", "", text)  # inline HTML
    return re.sub(r"[^\w\- ]", "", text.strip().lower()).replace(" ", "-")


def anchors(page: Path) -> set[str]:
    """The anchors of a page: one per heading (repeats numbered -1, -2, ... as GitHub does) and each ``<a id=...>``
    or ``<a name=...>``."""
    found: set[str] = set()
    seen: Counter[str] = Counter()
    fence = ""
    for line in page.read_text().splitlines():  # code spans kept: their text is part of the anchor
        m = FENCE.match(line.lstrip())
        if m and (not fence or m.group(1).startswith(fence)):
            fence = "" if fence else m.group(1)
            continue
        if fence:
            continue
        h = re.match(r"^ {0,3}#{1,6}\s+(.*?)\s*#*\s*$", line)
        if h:
            slug = github_slug(h.group(1))
            found.add(slug if not seen[slug] else f"{slug}-{seen[slug]}")
            seen[slug] += 1
        found.update(re.findall(r"<a\s+(?:id|name)=\"([^\"]+)\"", line))
    return found


def links(page: Path) -> list[tuple[int, str]]:
    """(line, target) of every relative link of a page (web and mail links left out)."""
    return [
        (n, target)
        for n, line in _prose(page.read_text())
        for target in LINK.findall(line)
        if not re.match(r"^[a-z][a-z0-9+.-]*:", target, flags=re.I)
    ]


def test_the_pages_exist_and_the_readme_links_every_docs_page():
    assert (ROOT / "docs").is_dir() and len(PAGES) > 4
    linked = {(ROOT / t.split("#")[0]).resolve() for _, t in links(ROOT / "README.md") if not t.startswith("#")}
    unlinked = [p.name for p in (ROOT / "docs").glob("*.md") if p.resolve() not in linked]
    assert not unlinked, f"README.md links no docs page {unlinked}"


@pytest.mark.parametrize("page", PAGES, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_leads_somewhere(page):
    dead = []
    for n, target in links(page):
        path, _, anchor = target.partition("#")
        dest = (page.parent / path).resolve() if path else page
        where = f"{page.relative_to(ROOT)}:{n}: {target}"
        if not dest.exists():
            dead.append(f"{where} (no such file)")
        elif anchor and dest.suffix == ".md" and anchor not in anchors(dest):
            dead.append(f"{where} (no such anchor in {dest.name})")
    assert not dead, "dead links:\n" + "\n".join(dead)


def test_the_anchor_rules_are_githubs():
    assert github_slug("Progressive resizing: `gpupipe.ResolutionSchedule`") == (
        "progressive-resizing-gpupiperesolutionschedule"
    )
    assert github_slug("Object storage: `s3://`, `gs://`, any fsspec URL") == "object-storage-s3-gs-any-fsspec-url"
    assert github_slug("The `backend=` switch") == "the-backend-switch"
    assert github_slug("With [Lightning](x.md) & Accelerate") == "with-lightning--accelerate"


# ---- the runnable blocks ------------------------------------------------------------------------------------------


def runnable_blocks() -> list[tuple[str, str, str]]:
    """(where, language, code) of each fenced block right after a ``<!-- runnable -->`` line."""
    out = []
    for page in PAGES:
        lines = page.read_text().splitlines()
        for i, line in enumerate(lines[:-1]):
            m = FENCE.match(lines[i + 1])
            if line.strip() == RUNNABLE and m:
                end = next(j for j in range(i + 2, len(lines)) if lines[j].startswith(m.group(1)))
                out.append((f"{page.relative_to(ROOT)}:{i + 2}", m.group(2), "\n".join(lines[i + 2 : end]) + "\n"))
    return out


def test_the_runnable_marker_is_used():
    blocks = runnable_blocks()
    assert len(blocks) >= 3, blocks
    assert {lang for _, lang, _ in blocks} <= {"python", "bash"}


@pytest.fixture(scope="module")
def demo_folder(tmp_path_factory):
    """A folder laid out as after ``make demo`` (a smaller sample: 4 classes x 16, and 4 x 4 held out)."""
    root = tmp_path_factory.mktemp("demo")
    make_sample_data(root / "data" / "sample", classes=4, per_class=16)
    make_sample_data(root / "data" / "sample-val", classes=4, per_class=4, split="val")
    return root


@pytest.mark.slow  # each block in a fresh interpreter that imports torch
@pytest.mark.parametrize("where,lang,code", runnable_blocks(), ids=[w for w, _, _ in runnable_blocks()])
def test_a_runnable_block_runs(demo_folder, where, lang, code):
    """Each block in a fresh process, in the demo folder, with this tree's gpupipe and the environment's commands."""
    env = {
        **os.environ,
        "PYTHONPATH": os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")])),
        "PATH": os.pathsep.join([str(Path(sys.executable).parent), os.environ.get("PATH", "")]),
    }
    argv = [sys.executable, "-c", code] if lang == "python" else ["bash", "-euo", "pipefail", "-c", code]
    run = subprocess.run(argv, cwd=demo_folder, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, f"{where} exited {run.returncode}:\n{run.stdout[-2000:]}\n{run.stderr[-3000:]}"


# ---- no timing figures in gpupipe/ --------------------------------------------------------------------------------

# A measured duration or rate: a number (or range, "~", "about") followed by a time unit below the second or a
# throughput, or "N x faster/slower". Settings are not measurements: a number right after "every", "to", "within",
# "after", "at most", "up to", "capped at", "timeout", "deadline" or "interval" is a setting's value and not matched.
_NUMBER = r"(?<![\w.])~?\d[\d,]*(?:\.\d+)?(?:\s?[-–]\s?\d[\d,]*(?:\.\d+)?)?"
_SETTING = r"(?<!every )(?<!to )(?<!within )(?<!after )(?<!at most )(?<!up to )(?<!capped at )(?<!timeout )"
_SETTING += r"(?<!deadline )(?<!interval )(?<!timeout of )(?<!deadline of )"
TIMING = re.compile(
    _SETTING
    + _NUMBER
    + r"(?:\s?(?:ns|us|µs|ms|img/s|images/s|[kKMG]i?B/s)\b|\s?s per\b|\s?x\s+(?:faster|slower|quicker|as fast))"
)

# Figures that may stay in gpupipe/ (none): (path, the figure as matched).
TEMPORARY_ALLOW: set[tuple[str, str]] = set()


def _notes(path: Path) -> list[tuple[int, str]]:
    """(line, text) of a module's comments and docstrings (string statements), one entry per physical line."""
    source = path.read_text()
    out = [
        (tok.start[0], tok.string)
        for tok in tokenize.generate_tokens(io.StringIO(source).readline)
        if tok.type == tokenize.COMMENT
    ]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Expr) and isinstance(node.value, ast.Constant) and isinstance(node.value.value, str):
            out += [(node.lineno + i, line) for i, line in enumerate(node.value.value.splitlines())]
    return out


def timing_figures() -> list[tuple[str, int, str, str]]:
    """(path, line, figure, line text) of each timing figure in gpupipe/'s comments and docstrings."""
    found = []
    for path in sorted((ROOT / "gpupipe").rglob("*.py")):
        rel = str(path.relative_to(ROOT))
        for n, text in _notes(path):
            found += [(rel, n, m.group(0).strip(), text.strip()) for m in TIMING.finditer(text)]
    return found


def test_no_timing_figure_in_the_package_comments():
    new = [f"{p}:{n}: {fig!r} in: {text}" for p, n, fig, text in timing_figures() if (p, fig) not in TEMPORARY_ALLOW]
    assert not new, (
        "timing figures in comments or docstrings (say what and why instead; the figure, if it matters, goes in "
        "bench/README.md):\n" + "\n".join(new)
    )


def test_the_temporary_allow_list_holds_only_figures_still_there():
    there = {(p, fig) for p, _, fig, _ in timing_figures()}
    assert TEMPORARY_ALLOW <= there, f"reworded: remove from TEMPORARY_ALLOW {sorted(TEMPORARY_ALLOW - there)}"


@pytest.mark.parametrize(
    "text,hit",
    [
        ("costs 0.5-1.5 ms (unmapping)", "0.5-1.5 ms"),
        ("~0.14 ms per 224x224 image", "~0.14 ms"),
        ("150-400 img/s", "150-400 img/s"),
        ("12.6 s per 100k samples", "12.6 s per"),
        ("3.5x faster than Pillow", "3.5x faster"),
        ("samples every 100 ms while it runs", None),
        ("a poll that backs off to 10 ms", None),
        ("each worker killed after 5 s", None),
        ("a 2 x 1 TIFF", None),
        ("capped at 30 s", None),
    ],
)
def test_the_timing_rule(text, hit):
    m = TIMING.search(text)
    assert (m.group(0).strip() if m else None) == hit


# ---- CONTRIBUTING.md's map of the code -----------------------------------------------------------------------------


_MAP_NAMES = re.compile(r"((?:[\w.]+(?:/|\.py|\.c))(?:, [\w.]+(?:/|\.py|\.c))*)(?:\s|$)")


def layout_map() -> list[str]:
    """The paths under gpupipe/ that CONTRIBUTING.md's Layout block names, as written (repeats kept). An entry is a
    line indented less than 10 spaces that starts with the files (``a.py``, ``b.c``) or the folder (``name/``) it is
    about, several separated by ``, ``; each two spaces of indent are one folder deeper. Deeper lines go on with the
    entry above (its words name no file)."""
    text = (ROOT / "CONTRIBUTING.md").read_text().split("## Layout", 1)[1]
    block = text.split("```", 2)[1]
    found, folders = [], []
    for line in block.splitlines():
        indent = len(line) - len(line.lstrip(" "))
        if not line.strip() or indent >= 10:
            continue
        depth, names = indent // 2, _MAP_NAMES.match(line.strip())
        assert names, f"CONTRIBUTING.md's layout: an entry that names no file or folder: {line!r}"
        for name in names.group(1).split(", "):
            path = "/".join([*folders[:depth], name])
            if name.endswith("/"):
                folders = [*folders[:depth], name.rstrip("/")]
            if path.startswith("gpupipe/") and path != "gpupipe/":
                found.append(path)
    return found


def test_the_layout_map_names_every_module_once_and_nothing_else():
    """Every module under gpupipe/ (Python or C) is on the map (a package's ``__init__.py`` may go unnamed, but
    gpupipe's own), once, and every file or folder it names exists: a move or a new module updates the map in the same
    change."""
    named = layout_map()
    sources = [*(ROOT / "gpupipe").rglob("*.py"), *(ROOT / "gpupipe").rglob("*.c")]
    tree = {str(p.relative_to(ROOT)) for p in sources if "__pycache__" not in p.parts}
    faces = {p for p in tree if p.endswith("/__init__.py") and p != "gpupipe/__init__.py"}
    files = [p for p in named if p.endswith((".py", ".c"))]
    assert not [p for p in named if not (ROOT / p).exists()], "the map names what is not there"
    assert sorted(tree - faces - set(files)) == [], "modules missing from CONTRIBUTING.md's layout"
    assert [p for p, n in Counter(named).items() if n > 1] == [], "named twice in CONTRIBUTING.md's layout"
