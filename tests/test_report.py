"""The bench chart: real backends on their own scale with error bars; synthetic as a note."""

import json
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
