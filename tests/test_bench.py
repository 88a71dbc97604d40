"""``gpupipe bench`` (gpupipe/bench/suite.py through the CLI): options, progress, the table, JSON, chart and the
store ``backend="auto"`` reads; bench/run_gpu.sh."""

import json
import os
import subprocess

import pytest
import torch

import gpupipe
from gpupipe.cli import main

from .common_utils import (
    REPO_ROOT,
    gpupipe_cli,
)


@pytest.mark.parametrize(
    "args, message",
    [
        (["--repeats", "0"], "--repeats: must be >= 1"),
        (["--seconds", "0"], "--seconds: must be > 0"),
        (["--seconds", "-1"], "--seconds: must be > 0"),
        (["--workers", "-2"], "--workers: must be >= 0"),
        (["--image-size", "160,0"], "--image-size: must be >= 1"),
        (["--image-size", "160,x"], "--image-size: expected integers separated by commas"),
    ],
)
def test_bench_rejects_bad_numbers(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bench_backends_auto_is_a_clear_error(folder):
    r = gpupipe_cli("bench", "--data", folder, "--device", "cpu", "--backends", "auto")
    assert r.returncode == 2 and "auto is not a backend" in r.stderr and "None" not in r.stderr


def test_bench_shows_progress_and_time_left_in_a_log(tmp_path, folder):
    r = gpupipe_cli(
        "bench",
        "--data",
        folder,
        "--device",
        "cpu",
        "--workers",
        0,
        "--backends",
        "pillow",
        "--pipelines",
        "decode,eval",
        "--seconds",
        0.2,
        "--repeats",
        2,
        "--batch-size",
        4,
        "--image-size",
        32,
        env={"GPUPIPE_CACHE": str(tmp_path / "cache")},
    )
    assert r.returncode == 0, r.stderr
    lines = [line for line in r.stderr.splitlines() if line.startswith("bench ")]
    assert len(lines) >= 6 and all("left:" in line for line in lines)  # one line per job and window
    assert "eval: pillow, window 2/2" in lines[-1]


def test_run_gpu_script_runs_every_part_after_a_failing_one(tmp_path):
    """bench/run_gpu.sh with a stand-in python whose pytest fails: the bench parts still run, the status is 1."""
    log = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\ncase "$*" in *pytest*) exit 1;; esac\n')
    fake.chmod(0o755)
    r = subprocess.run(
        ["bash", str(REPO_ROOT / "bench" / "run_gpu.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": str(fake), "OUT": str(tmp_path / "out")},
        timeout=60,
    )
    calls = log.read_text().splitlines()
    assert r.returncode == 1 and "part tests failed" in r.stderr
    pipelines = [c.split("--pipelines ")[1].split()[0] for c in calls if "--pipelines" in c]
    assert pipelines == ["decode", "train", "eval", "train", "train"]  # augment, then end-to-end
    assert "--aa rand-m9-mstd0.5-inc1" in calls[-2] and "--model resnet50" in calls[-1]
    assert any("gpupipe.bench.host_budget" in c and "--device cuda" in c for c in calls)


@pytest.mark.parametrize(
    ("call", "parts"), [("1", ["pytest", "host_budget"]), ("2", ["train,eval", "--aa", "--model"])]
)
def test_run_gpu_script_in_two_calls(tmp_path, call, parts):
    """bench/run_gpu.sh 1 and 2: every part in two calls, each part once."""
    log = tmp_path / "calls"
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\n')
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "OUT": str(tmp_path / "out")}
    r = subprocess.run(["bash", str(REPO_ROOT / "bench" / "run_gpu.sh"), call], env=env, timeout=60, check=False)
    calls = log.read_text().splitlines()[1:]  # after sample-data
    assert r.returncode == 0 and len(calls) == len(parts)
    assert all(p in c for p, c in zip(parts, calls, strict=True))


def test_bench_table_json_plot_and_auto(tmp_path, folder, capsys, monkeypatch):
    monkeypatch.setenv("GPUPIPE_CACHE", str(tmp_path / "cache"))
    backends = [b for b in ("pillow", "turbojpeg", "dali", "synthetic") if b in gpupipe.available_backends()]
    j, png = tmp_path / "b.json", tmp_path / "b.png"
    rc = main(
        [
            "bench",
            "--data",
            str(folder),
            "--device",
            "cpu",
            "--workers",
            "1",
            "--backends",
            ",".join(backends),
            "--pipelines",
            "decode,floor,train,eval",
            "--seconds",
            "0.3",
            "--repeats",
            "2",
            "--batch-size",
            "8",
            "--image-size",
            "32",
            "--json",
            str(j),
            "--plot",
            str(png),
        ]
    )
    assert rc == 0
    rep = json.loads(j.read_text())
    got = {(r["backend"], r["pipeline"]) for r in rep["results"]}
    assert {("baseline", "train"), ("baseline", "eval")} <= got
    for b in backends:
        assert (b, "train") in got and (b, "eval") in got
        assert b == "synthetic" or (b, "decode") in got
        assert ((b, "floor") in got) == (b in ("pillow", "turbojpeg"))  # the CPU decoders' train floor
    if "dali" in backends:  # DALI's own pipeline, timed beside the dali backend
        assert {("dali-reference", "train"), ("dali-reference", "eval")} <= got
    for r in rep["results"]:
        assert r["images_per_s"] > 0 and r["workers"] == 1 and r["device"] == "cpu"
        if r["pipeline"] in ("train", "eval"):
            assert r["vs_baseline"] > 0
        assert ("vs_floor" in r) == (r["pipeline"] == "train" and r["backend"] in ("pillow", "turbojpeg"))
    assert {"torch", "cpu", "cores_usable"} <= rep["machine"].keys()
    assert png.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert "img/s" in capsys.readouterr().out
    # backend="auto" now follows the measurement where it is a sure one (a quiet machine, ranges apart), else its rule
    from gpupipe.backends.auto import doubt, rule_of_thumb

    real = set(backends) - {"synthetic"}
    rows = [r | {"busy": rep["busy"]} for r in rep["results"] if r["pipeline"] == "eval" and r["backend"] in real]
    rows.sort(key=lambda r: r["images_per_s"], reverse=True)
    expected = rows[0]["backend"] if doubt(rows) is None else rule_of_thumb(torch.device("cpu"))
    loader = gpupipe.build_loader(folder, "auto", train=False, batch_size=4, num_workers=0, device="cpu")
    assert loader.backend == expected


def test_bench_rejects_unavailable_backend(folder):
    if "nvjpeg" in gpupipe.available_backends():
        pytest.skip("CUDA is here")
    assert main(["bench", "--data", str(folder), "--device", "cpu", "--backends", "nvjpeg"]) == 2


def test_windows_wait_for_the_other_jobs_prefetch_to_stop(monkeypatch):
    """The machine is busy for three polls (another job's workers refilling), then quiet: the window waits for it."""
    from gpupipe.bench import suite

    hz = os.sysconf("SC_CLK_TCK")
    busy = iter([0, hz, 2 * hz, 3 * hz, 3 * hz, 3 * hz])  # 1 core busy per 0.2 s poll... then nothing more
    polls = []
    monkeypatch.setattr(suite, "_cpu_busy", lambda: (int(next(busy) * 0.2), 0))
    monkeypatch.setattr(suite.time, "sleep", polls.append)
    suite._wait_quiet(limit=60.0)
    assert len(polls) == 4  # three busy intervals, then the quiet one
    polls.clear()
    monkeypatch.setattr(suite, "_cpu_busy", lambda: None)  # no /proc/stat: no wait
    suite._wait_quiet(limit=60.0)
    assert polls == []


def test_bench_data_takes_shards_and_urls(tmp_path, folder, s3, monkeypatch, capsys):
    """``--data`` accepts what build_loader accepts: a prepared folder on a disk and on a local S3 server, with the
    torchvision baseline run over the same bytes."""
    from gpupipe.prepare import prepare

    monkeypatch.setenv("GPUPIPE_CACHE", str(tmp_path / "cache"))
    local = tmp_path / "prepared"
    prepare(folder, local)
    url = s3.upload(local, "bench")
    for data in (local, url):
        args = ["--device", "cpu", "--workers", "0", "--backends", "pillow", "--pipelines", "eval"]
        args += ["--seconds", "0.2", "--repeats", "1", "--batch-size", "4", "--image-size", "32"]
        assert main(["bench", "--data", str(data), *args, "--json", str(tmp_path / "r.json")]) == 0
        rows = json.loads((tmp_path / "r.json").read_text())["results"]
        assert {r["backend"] for r in rows} == {"baseline", "pillow"} and all(r["images_per_s"] > 0 for r in rows)


def test_several_image_sizes_give_a_row_each_timed_in_the_same_rounds(folder, tmp_path, capsys, monkeypatch):
    """--image-size 16,24: train, floor and eval at each size, each against the baseline at its own size; decode
    (full size) once; a size column in the table."""
    monkeypatch.setenv("GPUPIPE_CACHE", str(tmp_path / "cache"))
    j = tmp_path / "r.json"
    args = ["bench", "--data", str(folder), "--device", "cpu", "--workers", "0", "--backends", "pillow"]
    args += ["--pipelines", "decode,floor,train,eval", "--seconds", "0.2", "--repeats", "1", "--batch-size", "4"]
    assert main([*args, "--image-size", "16,24", "--json", str(j)]) == 0
    rep = json.loads(j.read_text())
    got = sorted((r["backend"], r["pipeline"], r.get("image_size")) for r in rep["results"])
    sized = [(b, p, s) for b in ("baseline", "pillow") for p in ("eval", "floor", "train") for s in (16, 24)]
    assert got == sorted([("pillow", "decode", None), *(t for t in sized if t[:2] != ("baseline", "floor"))])
    assert all(r["vs_baseline"] > 0 for r in rep["results"] if r["pipeline"] in ("train", "eval"))
    assert all("vs_floor" in r for r in rep["results"] if (r["backend"], r["pipeline"]) == ("pillow", "train"))
    assert rep["config"]["image_size"] == [16, 24] and "16 px" in capsys.readouterr().out


def test_a_backend_that_cannot_run_is_a_row_saying_why_and_the_rest_are_measured(folder, tmp_path, capsys):
    if "nvjpeg" in gpupipe.available_backends():
        pytest.skip("CUDA is here")
    args = ["--device", "cpu", "--workers", "0", "--backends", "nvjpeg,pillow", "--pipelines", "eval"]
    args += ["--seconds", "0.2", "--repeats", "1", "--batch-size", "4", "--image-size", "32"]
    assert main(["bench", "--data", str(folder), *args, "--json", str(tmp_path / "r.json")]) == 0
    rep = json.loads((tmp_path / "r.json").read_text())
    assert {r["backend"] for r in rep["results"]} == {"baseline", "pillow"}
    assert "CUDA" in rep["unavailable"]["nvjpeg"]
    out = " ".join(capsys.readouterr().out.split())
    assert "nvjpeg │ unavailable: needs a CUDA GPU" in out or "nvjpeg unavailable" in out, out
