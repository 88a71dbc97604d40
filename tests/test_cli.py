"""The command line (gpupipe/cli.py): info, sample-data; bench in test_bench.py, train in test_train*.py."""

import json
import os
import subprocess
import sys
import typing

import pytest

import gpupipe
from gpupipe.cli import main

from .common_utils import (
    REPO_ROOT,
    gpupipe_cli,
)


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


@pytest.mark.parametrize("classes", ["0", "1"])
def test_sample_data_asks_for_two_classes_at_the_argument(tmp_path, classes, capsys):
    """--classes 0 said 'must be >= 1', then --classes 1 'need at least 2 classes'."""
    with pytest.raises(SystemExit) as e:
        main(["sample-data", str(tmp_path), "--classes", classes])
    assert e.value.code == 2 and f"--classes: must be >= 2, got {classes}" in capsys.readouterr().err


def test_sample_data_val_split_is_held_out_and_folders_are_not_mixed(tmp_path):
    train, val = tmp_path / "sample", tmp_path / "sample-val"
    assert gpupipe_cli("sample-data", train, "--classes", 2, "--per-class", 3).returncode == 0
    r = gpupipe_cli("sample-data", val, "--split", "val", "--classes", 2, "--per-class", 2)
    assert r.returncode == 0 and "val split" in r.stderr
    train_bytes = {p.read_bytes() for p in train.rglob("*.jpg")}
    val_files = sorted(val.rglob("*.jpg"))
    assert len(val_files) == 4 and not train_bytes & {p.read_bytes() for p in val_files}
    assert sorted(p.name for p in val.iterdir() if p.is_dir()) == ["class_00", "class_01"]
    again = gpupipe_cli("sample-data", train, "--classes", 2, "--per-class", 3)  # same settings: kept, cheap
    assert again.returncode == 0
    for args in (("--classes", 3), ("--split", "val", "--classes", 2, "--per-class", 3)):
        r = gpupipe_cli("sample-data", train, "--per-class", 3, *args)
        assert r.returncode == 2 and "other settings" in r.stderr, r.stderr
    (tmp_path / "mine").mkdir()
    (tmp_path / "mine" / "photo.jpg").write_bytes(b"x")
    r = gpupipe_cli("sample-data", tmp_path / "mine")
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
    """The name gpupipe on the package index is another project: README, docs, hints, Dockerfile install by path/URL."""
    import re

    index_install = re.compile(r"""pip install (-U |--upgrade )?["']?gpupipe(\[[^]]*\])?["']?(?! @)(\s|$)""")
    files = [
        REPO_ROOT / "README.md",
        *(REPO_ROOT / "docs").glob("*.md"),
        REPO_ROOT / "docker" / "Dockerfile",
        REPO_ROOT / "Makefile",
        *(REPO_ROOT / "gpupipe").rglob("*.py"),
    ]
    bad = [f"{f.name}: {m.group(0)}" for f in files for m in index_install.finditer(f.read_text())]
    assert not bad


_HEAVY = ("torch", "torchvision", "numpy", "PIL", "timm", "nvidia.dali", "omegaconf")
_IMPORTED_BY = """
import sys, time
from gpupipe.cli import main
start = time.perf_counter()
try:
    main(sys.argv[1:])
except SystemExit:
    pass
print(time.perf_counter() - start, *sorted({m.split(".")[0] for m in sys.modules}), file=sys.stderr)
"""


@pytest.mark.parametrize(
    "args", [["--help"], ["train", "--help"], ["eval", "--help"], ["prepare", "--help"], ["train", "--batchsize", "8"]]
)
def test_help_and_argument_errors_import_nothing_heavy(args):
    """--help and a mistyped flag answer before any heavy import (torch alone takes seconds on a busy machine): a
    structural check, with a wall bound far above the ~0.1 s they take."""
    result = subprocess.run(
        [sys.executable, "-c", _IMPORTED_BY, *args], capture_output=True, text=True, timeout=120, env=_env()
    )
    seconds, *modules = result.stderr.splitlines()[-1].split()
    assert not set(modules) & {m.split(".")[0] for m in _HEAVY}, result.stderr
    assert float(seconds) < 5


def test_a_mistyped_flag_names_the_close_one_and_no_prefix_is_taken():
    typo = gpupipe_cli("train", "--batchsize", "8")
    assert typo.returncode == 2
    assert typo.stderr == (
        "error: unrecognized arguments: --batchsize 8 (--batchsize: did you mean --batch-size?) "
        "(`gpupipe train --help` lists the flags)\n"
    )
    prefix = gpupipe_cli("train", "--epoch", "2", "--print-config")
    assert prefix.returncode == 2 and "--epoch: did you mean --epochs?" in prefix.stderr


def _env() -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


@pytest.mark.slow
def test_a_reader_that_leaves_early_gets_no_error(tmp_path):
    """``gpupipe info --json | head``: the pipe closed before the report is written is no error to print."""
    cmd = f"{sys.executable} -m gpupipe info --json | true; echo $? ${{PIPESTATUS[0]}}"
    r = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True, env=_env(), timeout=300)
    assert r.stderr == "" and r.stdout.split()[-1] == "141"
