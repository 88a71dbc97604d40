"""The bench chart: real backends on their own scale with error bars; synthetic as a note."""

import json
import time
from pathlib import Path

import pytest

from gpupipe.bench import report

RESULTS = Path(__file__).resolve().parents[1] / "bench" / "results" / "cpu-photos-1w-2026-11-22.json"


def test_chart_keeps_synthetic_off_the_scale_and_draws_the_spread(tmp_path, monkeypatch):
    pytest.importorskip("matplotlib")
    from matplotlib.figure import Figure

    rep = json.loads(RESULTS.read_text())
    figs = []
    save = Figure.savefig
    monkeypatch.setattr(Figure, "savefig", lambda self, path, **kw: (figs.append(self), save(self, path, **kw)))
    report.plot(rep, tmp_path / "c.png")
    ax = figs[0].axes[0]
    real = [r["images_per_s"] for r in rep["results"] if r["backend"] != "synthetic"]
    synthetic = [r["images_per_s"] for r in rep["results"] if r["backend"] == "synthetic"]
    assert synthetic and ax.get_ylim()[1] < min(synthetic) and ax.get_ylim()[1] >= max(real)
    assert "synthetic" in ax.get_title() and "synthetic" not in [t.get_text() for t in ax.get_legend().get_texts()]
    backends = {r["backend"] for r in rep["results"] if r["backend"] != "synthetic"}
    assert len(ax.containers) >= 2 * len(backends)  # bars and their error bars
    assert (tmp_path / "c.png").read_bytes()[:4] == b"\x89PNG"


def test_cpu_table_explains_dali_reference_and_leaves_out_gpu_only_columns():
    from rich.console import Console

    rep = json.loads(
        (RESULTS.parent / "cpu-photos-augment-1w-2026-11-22.json").read_text()
    )  # CPU, dali + its reference
    assert any(r["backend"] == "dali-reference" for r in rep["results"])
    console = Console(width=250, record=True)
    report.print_table(rep, console)
    text = console.export_text()
    header = next(line for line in text.splitlines() if "pipeline" in line and "backend" in line)
    for empty in ("vs floor", "GPU util", "vs synthetic", "data-wait"):  # no figure in any row of this CPU run
        assert empty not in header
    assert "vs baseline" in header
    words = " ".join(text.split())  # the caption wraps at the table's width
    assert "dali-reference: DALI's own pipeline as its documentation writes it" in words
    assert "baseline: torchvision's Pillow loader + transforms on the same samples" in words


def _busy_report() -> dict:
    rows = [("train", "turbojpeg", 315.0, (99.0, 503.0)), ("train", "dali", 363.0, (238.0, 400.0))]
    rows += [("eval", "turbojpeg", 900.0, (880.0, 950.0)), ("eval", "dali", 500.0, (450.0, 520.0))]
    results = [
        {"pipeline": p, "backend": b, "images_per_s": v, "spread": list(s), "megapixels_per_s": None}
        | {"images_per_s_per_worker": None}
        for p, b, v, s in rows
    ]
    machine = {"cpu": "Intel(R) Xeon(R) Processor with a rather long model name", "cores_usable": 2}
    config = {"data": "data/sample", "workers": 2, "device": "cpu", "batch_size": 64}
    rep = report.report([], machine, config)
    return rep | {"results": results, "load_average": [7.0, 6.5, 5.0], "others_cpu_share": 0.61, "busy": True}


def test_a_busy_run_and_rows_it_cannot_tell_apart_are_said_in_whole_lines():
    """The probe: at load 7 on 2 cores, `turbojpeg 315 (99-503)` vs `dali 363 (238-400)` with no word of either;
    piped, the title and the notes were wrapped at the table's width."""
    import io

    from rich.console import Console

    out = io.StringIO()
    report.print_table(_busy_report(), Console(file=out, width=80, soft_wrap=True))
    lines = out.getvalue().splitlines()
    assert lines[0] == (
        "gpupipe bench — data/sample, Intel(R) Xeon(R) Processor with a rather long model name, 2 worker(s), "
        "device cpu, batch 64, 2 usable cores"
    )
    assert any(
        line.startswith("note: busy machine (other processes took 61% of the CPU time, load average 7.0, ")
        for line in lines
    )
    assert (
        "note: train: dali 363 (238–400) and turbojpeg 315 (99–503) overlap: this run cannot tell them apart" in lines
    )
    assert not any("eval:" in line for line in lines)  # 900 (880-950) vs 500 (450-520): told apart


def test_the_report_names_the_commit_it_measured():
    """`gpupipe bench --json` recorded the machine, the versions and the date, not the code: its tables read "commit not
    recorded" where those of the simulated step and the host budget name theirs."""
    import shutil
    import subprocess

    rep = report.report([], {}, {})
    tree = Path(report.__file__).resolve().parents[2]
    if shutil.which("git") is None or not (tree / ".git").exists():
        assert rep["commit"] is None
        return
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tree, capture_output=True, text=True)
    assert rep["commit"].removesuffix("-dirty") == head.stdout.strip()
    assert rep["commit"]


@pytest.mark.skipif(__import__("shutil").which("git") is None, reason="needs git")
def test_the_commit_recorded_says_where_the_package_differs_from_it(tmp_path):
    """Figures of a tree with changes not committed were recorded as the commit's (the eval figures of a change,
    measured before it was committed, named the commit before it): its files changed, the commit reads ``-dirty``.
    Files beside the package (a README, results) leave it as it is; outside a checkout there is none."""
    import subprocess

    from gpupipe.info import source_commit

    assert source_commit(str(tmp_path)) is None
    package = tmp_path / "pkg"
    package.mkdir()
    (package / "code.py").write_text("x = 1\n")
    (tmp_path / "README.md").write_text("notes\n")

    def git(*args):
        return subprocess.run(["git", "-c", "user.name=t", "-c", "user.email=t@t", *args], cwd=tmp_path, check=True)

    git("init", "-q")
    git("add", ".")
    git("commit", "-qm", "one")
    head = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=tmp_path, capture_output=True, text=True)
    assert source_commit(str(package)) == head.stdout.strip()
    (tmp_path / "README.md").write_text("more notes\n")
    assert source_commit(str(package)) == head.stdout.strip()
    (package / "code.py").write_text("x = 2\n")
    assert source_commit(str(package)) == head.stdout.strip() + "-dirty"


def test_the_cpu_share_of_other_processes():
    start, end = report.CpuTimes(10.0, 100.0, 1.0), report.CpuTimes(60.0, 200.0, 21.0)
    assert report.others_share(start, end) == 0.3  # 50 s busy on the machine, 20 s of them ours, in 100 s of CPU
    assert report.others_share(None, end) is None
    since = report.cpu_times()
    time.sleep(0.1)  # a few clock ticks of the machine's
    assert 0 <= report.report([], {}, {}, since=since)["others_cpu_share"] <= 1
