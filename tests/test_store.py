"""The bench store behind backend="auto": rows per backend and pipeline, merged, and a logged choice."""

import logging

import pytest
import torch

import gpupipe
from gpupipe import results as store
from gpupipe.backends.auto import best_backend


def _report(date, *rows):
    return {
        "date": date,
        "results": [
            {"backend": b, "pipeline": p, "device": "cpu", "images_per_s": v, "spread": [v, v]} for b, p, v in rows
        ],
    }


def test_partial_runs_merge_and_auto_says_what_it_chose(tmp_path, folder, monkeypatch, caplog):
    monkeypatch.setenv("GPUPIPE_CACHE", str(tmp_path))
    cpu = torch.device("cpu")
    fast = "turbojpeg" if "turbojpeg" in gpupipe.available_backends() else "pillow"
    store.save_latest(
        _report("2026-01-01", ("pillow", "train", 100.0), (fast, "train", 300.0), ("pillow", "eval", 50.0)),
        str(folder),
        cpu,
    )
    store.save_latest(_report("2026-02-02", ("pillow", "train", 120.0)), str(folder), cpu)  # --backends pillow
    store.save_latest(_report("2026-03-03"), str(folder), cpu)  # --backends synthetic --pipelines decode
    best = best_backend(str(folder), cpu, train=True)
    assert (best["backend"], best["images_per_s"], best["date"]) == (fast, 300.0, "2026-01-01")
    assert best_backend(str(folder), cpu, train=False)["backend"] == "pillow"
    with caplog.at_level(logging.INFO, logger="gpupipe"):
        loader = gpupipe.build_loader(folder, "auto", batch_size=4, num_workers=0, device="cpu")
    assert loader.backend == fast
    assert f"backend auto chose {fast}: 300 img/s (train) in the bench of 2026-01-01" in caplog.text


def test_auto_without_a_bench_states_its_rule(tmp_path, folder, monkeypatch, caplog):
    monkeypatch.setenv("GPUPIPE_CACHE", str(tmp_path))
    with caplog.at_level(logging.INFO, logger="gpupipe"):
        gpupipe.build_loader(folder, "auto", batch_size=4, num_workers=0, device="cpu")
    assert "no bench result for this data and machine, so the rule" in caplog.text


def _rows(*rows, busy=False):
    """A bench report of (backend, img/s, (min, max)) train rows."""
    results = [
        {"backend": b, "pipeline": "train", "device": "cpu", "images_per_s": v, "spread": list(s)} for b, v, s in rows
    ]
    return {"date": "2026-04-04", "busy": busy, "results": results}


@pytest.mark.parametrize(
    "rep, why",
    [
        (_rows(("pillow", 363.0, (238, 400)), ("turbojpeg", 315.0, (99, 503))), "overlap: the bench cannot tell"),
        (_rows(("pillow", 572.0, (560, 580)), ("turbojpeg", 402.0, (400, 410)), busy=True), "ran on a busy machine"),
    ],
)
def test_auto_does_not_trust_overlapping_rows_or_a_busy_bench(tmp_path, folder, monkeypatch, caplog, rep, why):
    """The probe: at load 7 on 2 cores, `turbojpeg 315 (99-503)` vs `dali 363 (238-400)`, and auto chose dali."""
    if "turbojpeg" not in gpupipe.available_backends():
        pytest.skip("the rule of thumb picks turbojpeg only where it is available")
    monkeypatch.setenv("GPUPIPE_CACHE", str(tmp_path))
    store.save_latest(rep, str(folder), torch.device("cpu"))
    with caplog.at_level(logging.INFO, logger="gpupipe"):
        loader = gpupipe.build_loader(folder, "auto", batch_size=4, num_workers=0, device="cpu")
    assert loader.backend == "turbojpeg"  # the rule, not the row that came first
    assert "backend auto chose turbojpeg: the stored bench is no sure guide (" in caplog.text and why in caplog.text
    clear = _rows(("pillow", 572.0, (560, 580)), ("turbojpeg", 402.0, (400, 410)))  # quiet, ranges apart: trusted
    store.save_latest(clear, str(folder), torch.device("cpu"))
    assert gpupipe.build_loader(folder, "auto", batch_size=4, num_workers=0, device="cpu").backend == "pillow"


def test_auto_uses_a_busy_bench_the_user_accepted_and_the_table_says_how_to_get_one(tmp_path, folder, monkeypatch):
    """A run on a shared node is busy; stored with ``gpupipe bench --accept-busy`` its winner is used (and its
    spreads must still be apart). Without the flag the table's note says how to get a usable run."""
    from gpupipe.bench import report

    if "turbojpeg" not in gpupipe.available_backends():
        pytest.skip("the rule of thumb picks turbojpeg only where it is available")
    monkeypatch.setenv("GPUPIPE_CACHE", str(tmp_path))
    build = lambda: gpupipe.build_loader(folder, "auto", batch_size=4, num_workers=0, device="cpu")
    rows = _rows(("pillow", 572.0, (560, 580)), ("turbojpeg", 402.0, (400, 410)), busy=True)
    store.save_latest(rows, str(folder), torch.device("cpu"))
    rule = build().backend
    store.save_latest(rows | {"accept_busy": True}, str(folder), torch.device("cpu"))
    assert build().backend == "pillow" != rule
    overlapping = _rows(("pillow", 363.0, (238, 400)), ("turbojpeg", 315.0, (99, 503)), busy=True)
    store.save_latest(overlapping | {"accept_busy": True}, str(folder), torch.device("cpu"))
    assert build().backend == rule
    busy = {"busy": True, "others_cpu_share": 0.6, "load_average": [3.0, 3.0, 3.0], "results": []}
    (note,) = report.doubts(busy)
    assert (
        "--workers" in note
        and "--seconds" in note
        and "--repeats" in note
        and note.endswith("--accept-busy if the spreads come out apart")
    )
    (kept,) = report.doubts(busy | {"accept_busy": True})
    assert kept.endswith('kept for backend="auto" (--accept-busy)')
    assert report.report([], {}, {}, accept_busy=True)["accept_busy"] is True


def test_bench_takes_accept_busy():
    from gpupipe.cli import build_parser

    args = build_parser().parse_args(["bench", "--accept-busy"])
    assert args.accept_busy is True and build_parser().parse_args(["bench"]).accept_busy is False
