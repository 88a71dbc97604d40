"""``gpupipe bench`` on the data a user has: a folder ``gpupipe prepare`` wrote, a folder with an unreadable file;
and how long ``--seconds`` makes a run, against the time left it announces."""

import json

import pytest

import gpupipe
from gpupipe.prepare import prepare

from .common_utils import gpupipe_cli, make_folder

CPU_BACKENDS = [b for b in ("pillow", "turbojpeg", "dali") if b in gpupipe.available_backends()]


def _bench(data, tmp_path, *extra):
    return gpupipe_cli(
        "bench",
        "--data",
        data,
        "--device",
        "cpu",
        "--workers",
        0,
        "--batch-size",
        4,
        "--image-size",
        32,
        "--repeats",
        1,
        *extra,
        env={"GPUPIPE_CACHE": str(tmp_path / "cache")},
    )


@pytest.mark.slow
def test_bench_measures_a_prepared_folder_on_every_backend(tmp_path):
    src = make_folder(tmp_path / "src", 2, 4)
    prepare(str(src), str(tmp_path / "shards"), workers=0)
    j = tmp_path / "b.json"
    r = _bench(tmp_path / "shards", tmp_path, "--backends", ",".join(CPU_BACKENDS), "--seconds", 0.2, "--json", j)
    assert r.returncode == 0, r.stderr  # was: No such file or directory: 'shard-000000.tar:00000000.jpg'
    got = {(x["backend"], x["pipeline"]) for x in json.loads(j.read_text())["results"]}
    for b in ["baseline", *CPU_BACKENDS]:
        assert (b, "train") in got and (b, "eval") in got
    assert all(x["megapixels_per_s"] > 0 for x in json.loads(j.read_text())["results"])


@pytest.mark.slow
def test_bench_on_a_folder_with_an_unreadable_file_measures_and_names_it(tmp_path):
    root = make_folder(tmp_path / "data", 2, 3)
    (root / "c00" / "000.jpg").write_bytes(b"not an image")  # the first file: also in the size estimate
    backends = ",".join(b for b in ("pillow", "dali") if b in CPU_BACKENDS)  # dali: its decode job and reference too
    r = _bench(root, tmp_path, "--backends", backends, "--pipelines", "decode,eval", "--seconds", 0.2)
    assert r.returncode == 0, r.stderr  # was: a PIL.UnidentifiedImageError traceback
    assert "Traceback" not in r.stderr
    assert "1 unreadable file(s) left out of the measurements" in r.stderr and "000.jpg" in r.stderr
    assert "gpupipe check" in r.stderr
    plan = next(line for line in r.stderr.splitlines() if "left:" in line)  # what a measurement costs, first
    jobs = 3 if backends == "pillow" else 6  # decode and eval per backend, the baseline, dali's reference
    assert f"{jobs} measurements (backend x pipeline), each: start-up, 1 s warm-up, 1 timed window(s) of 0.2 s" in plan


def test_time_left_is_costed_from_the_start_ups_and_windows_measured(monkeypatch):
    """4 jobs of 2 windows of 0.5 s: the plan's guess first, then what the run measured (start-up 5 s, each window
    2 s with its drain and quiet wait, stopping 1 s per job), not the 0.5 s per window ``--seconds`` times."""
    from gpupipe.bench import eta as eta_module

    clock = [100.0]
    monkeypatch.setattr(eta_module.time, "monotonic", lambda: clock[0])
    eta = eta_module.Eta(jobs=4, warm=1.0, window=0.5, repeats=2)
    guess = 4 * (1.0 + eta_module.GUESS_START_S) + 8 * (0.5 * 3 + eta_module.GUESS_DRAIN_S) + 4 * eta_module.GUESS_END_S
    assert eta.left() == pytest.approx(guess)
    eta.round_of(2)
    for _ in range(2):
        eta.started(5.0)
    for _ in range(4):
        eta.timed(2.0)
    eta.ended(2.0, 2)
    clock[0] += 20.0
    assert eta.left() == pytest.approx(2 * 5.0 + 4 * 2.0 + 2 * 1.0)
    assert eta.fraction() == pytest.approx(20 / (20 + 20))


@pytest.mark.parametrize("model", [None, "test_resnet"])
@pytest.mark.slow
def test_the_estimate_is_no_shorter_than_a_small_real_run(tmp_path, model):
    """The estimate before anything is measured (the run's first progress line) against the run itself: at least as
    long, and within a sane factor. It once said 2 minutes for GPU runs that had not ended after 80-100 s: it left out
    the end-to-end measurements (--model), and guessed start-ups, drains and epoch starts short. Two epochs of 24
    images go by in each window's drain here, and with --model two backends train end to end."""
    import time

    import torch

    from gpupipe.bench import suite
    from gpupipe.bench.records import Config

    data = make_folder(tmp_path / "data", 2, 12)
    cfg = Config(
        str(data),
        ["pillow", "synthetic"],
        ["train"],
        1,
        torch.device("cpu"),
        batch_size=8,
        seconds=0.6,
        repeats=2,
        image_size=32,
        model=model,
    )
    t0 = time.monotonic()
    lines: list[float] = []
    results = suite.run(cfg, progress=lambda text, fraction=None, left=None: lines.append(left))
    actual, planned = time.monotonic() - t0, lines[0]  # what the run says first
    assert len(results) == (3 if model is None else 5)  # baseline, pillow, synthetic; and each trained end to end
    assert suite.estimate(cfg) == pytest.approx(planned, abs=1.0)
    assert actual <= planned <= 10 * actual, (planned, actual)
