"""bench/README.md's tables are the committed JSON's (bench/tables.py), and its question table names every script."""

import importlib.util
import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

BENCH = Path(__file__).resolve().parent.parent / "bench"


@pytest.fixture(scope="module")
def tables():
    spec = importlib.util.spec_from_file_location("bench_tables", BENCH / "tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_readme_tables_match_the_json():
    run = subprocess.run([sys.executable, str(BENCH / "tables.py"), "--check"], capture_output=True, text=True)
    assert run.returncode == 0, run.stdout + run.stderr


def test_a_changed_figure_makes_the_readme_stale(tables, tmp_path):
    readme = (BENCH / "README.md").read_text()
    path = next(m.group("path") for m in tables.BLOCK.finditer(readme) if "peers" in m.group("path"))
    rep = json.loads((BENCH / path).read_text())
    rep["results"][0]["images_per_s"] += 1000.0
    (tmp_path / "r.json").write_text(json.dumps(rep))
    stale = readme.replace(f"<!-- table: {path} -->", f"<!-- table: {tmp_path / 'r.json'} -->", 1)
    assert tables.render(stale) != stale


def test_every_block_names_a_committed_report_with_its_machine_and_commit(tables):
    readme = (BENCH / "README.md").read_text()
    blocks = list(tables.BLOCK.finditer(readme))
    assert len(blocks) >= 10
    for m in blocks:
        assert (BENCH / m.group("path")).is_file(), m.group("path")
        first = tables.table(BENCH / m.group("path")).splitlines()[0]
        assert "commit" in first and re.search(r"20\d\d-\d\d-\d\d", first), first


def test_the_question_table_names_every_script():
    readme = (BENCH / "README.md").read_text()
    questions = readme.split("## Which script answers which question", 1)[1].split("\n## ", 1)[0]
    scripts = [p.name for p in BENCH.iterdir() if p.suffix in (".py", ".sh")]
    assert scripts
    missing = [s for s in scripts if f"`{s}" not in questions]
    assert not missing, f"bench/README.md's question table does not name {missing}"
