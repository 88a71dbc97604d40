"""``gpupipe bench`` (gpupipe/bench/suite.py through the CLI): options, progress, the table, JSON, chart and the
store ``backend="auto"`` reads; bench/run_gpu.sh."""

import json
import os
import subprocess
import sys

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


def test_bench_backends_auto_is_a_clear_error(folder, capsys):
    assert main(["bench", "--data", str(folder), "--device", "cpu", "--backends", "auto"]) == 2
    err = capsys.readouterr().err
    assert "auto is not a backend" in err and "None" not in err


def test_a_backend_listed_twice_is_measured_once():
    """``--backends pillow,pillow`` measured pillow twice, then said the two pillow rows overlapped."""
    import torch

    from gpupipe.cli import _bench_backends

    assert _bench_backends("pillow,synthetic,pillow", torch.device("cpu"))[0] == ["pillow", "synthetic"]


@pytest.mark.slow
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


def _run_gpu(tmp_path, *args: str, fail: str = "-no-such-") -> tuple[subprocess.CompletedProcess, list[str], list]:
    """bench/run_gpu.sh with a stand-in python that logs its arguments, prints a row, and fails (exit 3) for calls
    naming ``fail``; (the run, its calls, the part's rows). The data are there already (made by an earlier part)."""
    log, out = tmp_path / "calls", tmp_path / "out"
    (tmp_path / "data").mkdir()
    (tmp_path / "data" / ".complete").touch()
    fake = tmp_path / "python"
    fake.write_text(f'#!/bin/sh\necho "$*" >> {log}\ncase "$*" in *{fail}*) exit 3;; esac\necho \'{{"what": "r"}}\'\n')
    fake.chmod(0o755)
    env = {**os.environ, "PYTHON": str(fake), "OUT": str(out), "DATA": str(tmp_path / "data")}
    r = subprocess.run(
        ["bash", str(REPO_ROOT / "bench" / "run_gpu.sh"), *args],
        env=env,
        timeout=60,
        check=False,
        capture_output=True,
        text=True,
    )
    rows = [json.loads(line) for f in out.glob("*.jsonl") for line in f.read_text().splitlines()]
    return r, log.read_text().splitlines(), rows


@pytest.mark.parametrize(
    ("part", "steps"),
    [
        ("1", ["pytest -m gpu", "loader", "nvjpeg", "loader", "pillow", "loader", "turbojpeg"]),
        ("2", ["e2e", "synthetic", "e2e", "pillow", "e2e", "turbojpeg", "e2e", "nvjpeg"]),
        (
            "3",
            [
                "loader",
                "dali",
                "dali-own",
                "e2e",
                "dali",
                "dali-own",
                "--model",
                "train --data",
                "--precision fp16",
                "train-wait",
                "train --data",
                "--precision bf16",
                "train-wait",
                "memory",
            ],
        ),
        ("4", ["gpupipe.bench.cifar_alexnet", "--device cuda", "--batch 64 --size 227", "--json"]),
    ],
)
def test_run_gpu_script_runs_each_part_in_fresh_processes_under_timeouts(tmp_path, part, steps):
    """The GPU check in four parts (parts 1 and 2 without DALI): each measurement its own process, each a row of the
    part's JSON, which is collected with the device, date and versions at the end."""
    r, calls, rows = _run_gpu(tmp_path, part)
    assert r.returncode == 0, r.stderr
    measured = " | ".join(calls[:-1])
    at = 0
    for s in steps:  # in this order
        at = measured.index(s, at) + len(s)
    assert calls[-1].startswith("bench/gpu_check.py collect") and rows and all(row == {"what": "r"} for row in rows)
    assert all("dali" not in c for c in calls) or part == "3"
    script = (REPO_ROOT / "bench" / "run_gpu.sh").read_text()
    assert 'out=$(timeout --kill-after=10 "$limit" "$@"' in script  # every step's command under timeout


def test_run_gpu_script_goes_on_after_a_failing_step_and_says_so(tmp_path):
    r, calls, rows = _run_gpu(tmp_path, "1", fail="pillow")
    assert r.returncode == 1
    assert any("turbojpeg" in c for c in calls)  # the next step ran
    assert {"what": "loader pillow", "failed": "exit 3", "device": "cuda"} in rows


@pytest.mark.slow
def test_run_gpu_script_part_2_runs_small_on_the_cpu(tmp_path):
    """--cpu: the real steps, small, on the CPU (the script's check where there is no GPU)."""
    env = {**os.environ, "OUT": str(tmp_path / "out"), "DATA": str(tmp_path / "data"), "PYTHON": sys.executable}
    r = subprocess.run(
        ["bash", str(REPO_ROOT / "bench" / "run_gpu.sh"), "--cpu", "2"],
        env=env,
        timeout=600,
        capture_output=True,
        text=True,
        check=False,
    )
    assert r.returncode == 0, r.stderr
    (result,) = (tmp_path / "out").glob("gpu-check-part2-cpu-*.json")
    report = json.loads(result.read_text())
    assert {"device", "date", "commit", "versions", "rows"} <= report.keys() and "torch" in report["versions"]
    assert [row["backend"] for row in report["rows"]] == ["synthetic", "pillow", "turbojpeg"]
    assert all(row["images_per_s"] > 0 and 0 <= row["data_wait"] <= 1 for row in report["rows"])


@pytest.mark.slow
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


def test_bench_rejects_unavailable_backend(folder, capsys, monkeypatch):
    if "nvjpeg" in gpupipe.available_backends():
        pytest.skip("CUDA is here")
    monkeypatch.delenv("GPUPIPE_TRACEBACK", raising=False)
    assert main(["bench", "--data", str(folder), "--device", "cpu", "--backends", "nvjpeg"]) == 2
    err = capsys.readouterr().err.strip().splitlines()  # one line, as any other mistake (it lacked "error: ")
    assert len(err) == 1 and err[0].startswith("error: nvjpeg: needs a CUDA GPU"), err


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


@pytest.mark.slow
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


@pytest.mark.slow
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


@pytest.mark.slow  # a bench run
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


def test_the_gpu_modes_time_train_alone_and_fit_one_ten_minute_call(monkeypatch):
    """``--model`` and a policy time the loaders in the train pipeline only (their rows are read against it), unless
    ``--pipelines`` says more: the GPU check's two runs, every backend, on a 16-core GPU machine's defaults (15
    workers, batch 256, 9,600 photos), are then planned at under 9 minutes each (about 7 and 5), where decode, train
    and eval would make them about 14 and 9."""
    import dataclasses

    from gpupipe.bench import suite
    from gpupipe.bench.records import Config, bench_pipelines, policy_recipes

    assert bench_pipelines(None, None, False) == ["decode", "train", "eval"]
    assert bench_pipelines(None, "resnet50", False) == ["train"]
    assert bench_pipelines(None, None, True) == ["train", "augment"]
    assert bench_pipelines("decode,train", "resnet50", True) == ["decode", "train", "augment"]

    class Photos(list):
        reads_files = True

    monkeypatch.setattr(suite, "open_source", lambda data: Photos(range(9600)))
    cuda = torch.device("cuda")
    augment = Config("photos", ["dali", "nvjpeg", "turbojpeg"], bench_pipelines(None, None, True), 15, cuda, 256, 8, 2)
    augment.recipes = policy_recipes(224, ["rand-m9-mstd0.5-inc1"], None, 0.25)
    model = Config("photos", ["dali", "turbojpeg", "synthetic"], bench_pipelines(None, "resnet50", False), 15, cuda)
    model = dataclasses.replace(model, batch_size=256, seconds=6, repeats=1, model="resnet50")
    for cfg in (augment, model):
        assert suite.estimate(cfg) < 540
        every = dataclasses.replace(cfg, pipelines=["decode", "train", "eval", *cfg.pipelines[1:]])
        assert suite.estimate(every) > 1.5 * suite.estimate(cfg), (suite.estimate(every), suite.estimate(cfg))


@pytest.mark.slow  # a bench run, stopped as it starts its first measurement
def test_ctrl_c_on_bench_is_one_line(folder, tmp_path):
    """Ctrl-C (SIGINT to the process group, as a terminal sends it) as the backend starts: one line and exit 130, no
    traceback from the main process (DALI's pipeline was in its frames), its workers or DALI's threads."""
    import signal

    backend = "dali" if "dali" in gpupipe.available_backends() else "pillow"
    log = tmp_path / "stderr.txt"
    args = ["--data", folder, "--backends", backend, "--pipelines", "decode", "--device", "cpu", "--workers", "1"]
    args += ["--seconds", "60", "--repeats", "1", "--image-size", "32"]
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT), "XDG_CACHE_HOME": str(tmp_path / "cache")}
    with open(log, "w") as err:
        run = subprocess.Popen(
            [sys.executable, "-m", "gpupipe", "bench", *map(str, args)],
            stdout=subprocess.DEVNULL,
            stderr=err,
            env=env,
            start_new_session=True,
        )
        try:
            while f"decode: starting {backend}" not in log.read_text() and run.poll() is None:
                try:  # start-up and a 15 s warm-up (a quarter of --seconds) follow: the signal lands in them
                    run.wait(0.05)
                except subprocess.TimeoutExpired:
                    pass
            os.killpg(run.pid, signal.SIGINT)
            run.wait(120)
        finally:
            run.kill()
    lines = log.read_text().splitlines()
    assert run.returncode == 130 and "Traceback" not in log.read_text(), lines
    assert lines[-1] == "interrupted: stopped before the end: no table and no result were saved"
