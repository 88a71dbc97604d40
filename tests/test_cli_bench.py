import json
import os
import subprocess
import sys
import typing
from pathlib import Path

import pytest

import gpupipe
from gpupipe.cli import main

ROOT = Path(__file__).resolve().parents[1]


def test_info_json(capsys):
    assert main(["info", "--json"]) == 0
    info = json.loads(capsys.readouterr().out)
    assert info["backends"]["pillow"] == "available"
    keys = {"torch", "torchvision", "pil", "pil_simd", "pil_libjpeg_turbo", "turbojpeg_library", "dali", "cores_usable"}
    assert keys <= info["machine"].keys()


def test_sample_data_is_an_imagefolder_of_jpegs(tmp_path):
    assert main(["sample-data", str(tmp_path), "--classes", "3", "--per-class", "2"]) == 0
    data = gpupipe.build_loader(tmp_path, "pillow", batch_size=2, train=False, num_workers=0, device="cpu").dataset
    assert data.classes == ["class_00", "class_01", "class_02"] and len(data) == 6
    from PIL import Image

    for path, _ in data.samples:
        with Image.open(path) as im:
            assert im.format == "JPEG" and 300 <= min(im.size) and max(im.size) <= 600


def _gpupipe(*args, **kw):
    """``python -m gpupipe ...`` as a user runs it, output to pipes (not a terminal)."""
    env = {**os.environ, "PYTHONPATH": str(ROOT), **kw.pop("env", {})}
    return subprocess.run(
        [sys.executable, "-m", "gpupipe", *map(str, args)], capture_output=True, text=True, env=env, timeout=600, **kw
    )


def test_sample_data_val_split_is_held_out_and_folders_are_not_mixed(tmp_path):
    train, val = tmp_path / "sample", tmp_path / "sample-val"
    assert _gpupipe("sample-data", train, "--classes", 2, "--per-class", 3).returncode == 0
    r = _gpupipe("sample-data", val, "--split", "val", "--classes", 2, "--per-class", 2)
    assert r.returncode == 0 and "val split" in r.stderr
    train_bytes = {p.read_bytes() for p in train.rglob("*.jpg")}
    val_files = sorted(val.rglob("*.jpg"))
    assert len(val_files) == 4 and not train_bytes & {p.read_bytes() for p in val_files}
    assert sorted(p.name for p in val.iterdir() if p.is_dir()) == ["class_00", "class_01"]
    again = _gpupipe("sample-data", train, "--classes", 2, "--per-class", 3)  # same settings: kept, cheap
    assert again.returncode == 0
    for args in (("--classes", 3), ("--split", "val", "--classes", 2, "--per-class", 3)):
        r = _gpupipe("sample-data", train, "--per-class", 3, *args)
        assert r.returncode == 2 and "other settings" in r.stderr, r.stderr
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "photo.jpg").write_bytes(b"x")
    r = _gpupipe("sample-data", tmp_path / "mine")
    assert r.returncode == 2 and "not made by `gpupipe sample-data`" in r.stderr


def test_sample_data_reports_progress_per_image(tmp_path):
    from gpupipe.sample_data import make_sample_data

    ticks = []
    make_sample_data(tmp_path / "d", 2, 3, on_image=lambda: ticks.append(1))
    assert len(ticks) == 6


def test_info_names_each_library_and_reads_well(capsys, monkeypatch):
    assert main(["info"]) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line for line in out.splitlines() if line.strip()}
    assert "{" not in lines["dali"]  # not a raw dict
    assert "pil_libjpeg_turbo" in lines and "turbojpeg_library" in lines
    if "turbojpeg" in gpupipe.available_backends():
        assert "libturbojpeg" in lines["turbojpeg_library"]  # the file the turbojpeg backend loaded
    from gpupipe import info

    class Foreign:
        version = "0.2.0"
        metadata: typing.ClassVar = {"Summary": "Streaming multiprocessing pipelines"}

        def read_text(self, name):
            return None

    monkeypatch.setattr(info, "distribution", lambda name: Foreign())
    assert "another project" in info.install_info()["problem"]
    assert main(["info"]) == 0
    assert "warning:" in capsys.readouterr().err


def test_no_install_command_asks_the_index_for_gpupipe():
    """The name gpupipe on the package index is another project: README, hints and Dockerfile install by path/URL."""
    import re

    index_install = re.compile(r"""pip install (-U |--upgrade )?["']?gpupipe(\[[^]]*\])?["']?(?! @)(\s|$)""")
    files = [ROOT / "README.md", ROOT / "docker" / "Dockerfile", ROOT / "Makefile", *(ROOT / "gpupipe").rglob("*.py")]
    bad = [f"{f.name}: {m.group(0)}" for f in files for m in index_install.finditer(f.read_text())]
    assert not bad


@pytest.mark.parametrize(
    "args, message",
    [
        (["--repeats", "0"], "--repeats: must be >= 1"),
        (["--seconds", "0"], "--seconds: must be > 0"),
        (["--seconds", "-1"], "--seconds: must be > 0"),
        (["--workers", "-2"], "--workers: must be >= 0"),
    ],
)
def test_bench_rejects_bad_numbers(args, message, capsys):
    with pytest.raises(SystemExit) as e:
        main(["bench", *args])
    assert e.value.code == 2 and message in capsys.readouterr().err


def test_bench_backends_auto_is_a_clear_error(folder):
    r = _gpupipe("bench", "--data", folder, "--device", "cpu", "--backends", "auto")
    assert r.returncode == 2 and "auto is not a backend" in r.stderr and "None" not in r.stderr


def test_bench_shows_progress_and_time_left_in_a_log(tmp_path, folder):
    r = _gpupipe(
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
        ["bash", str(ROOT / "bench" / "run_gpu.sh")],
        capture_output=True,
        text=True,
        env={**os.environ, "PYTHON": str(fake), "OUT": str(tmp_path / "out")},
        timeout=60,
    )
    calls = log.read_text().splitlines()
    assert r.returncode == 1 and "part tests failed" in r.stderr
    pipelines = [c.split("--pipelines ")[1].split()[0] for c in calls if "bench" in c]
    assert pipelines == ["decode", "train", "eval", "train"]  # the last: end-to-end
    assert "--model resnet50" in calls[-1]


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
    # backend="auto" now follows the measurement
    real = set(backends) - {"synthetic"}
    best = max(
        (r for r in rep["results"] if r["pipeline"] == "eval" and r["backend"] in real), key=lambda r: r["images_per_s"]
    )["backend"]
    loader = gpupipe.build_loader(folder, "auto", train=False, batch_size=4, num_workers=0, device="cpu")
    assert loader.backend == best


def test_bench_rejects_unavailable_backend(folder):
    if "nvjpeg" in gpupipe.available_backends():
        pytest.skip("CUDA is here")
    assert main(["bench", "--data", str(folder), "--device", "cpu", "--backends", "nvjpeg"]) == 2
