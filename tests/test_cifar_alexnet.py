"""gpupipe/bench/cifar_alexnet.py: the write-up's CIFAR-10 loader beside gpupipe's, alone and under a simulated step;
and examples/cifar10_alexnet.py, the same run trained."""

import importlib.util
import json
from pathlib import Path

import pytest
import torch

from gpupipe.bench import cifar_alexnet
from gpupipe.bench.cifar import make_cifar10

EXAMPLE = Path(__file__).resolve().parent.parent / "examples" / "cifar10_alexnet.py"


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    return make_cifar10(tmp_path_factory.mktemp("cifar"), 40)


def test_help_says_what_the_bench_is_and_what_each_flag_does(capsys):
    """The description was the docstring's first line, cut mid-sentence; the step's settings had no help."""
    with pytest.raises(SystemExit):
        cifar_alexnet.main(["--help"])
    out = " ".join(capsys.readouterr().out.split())
    assert "at its 227 px and batch 64, alone and under a simulated training step. positional arguments" in out
    flags = ["--count", "--workers", "--backends", "--device", "--batch", "--size", "--seconds", "--steps"]
    for flag in [*flags, "--step-ms", "--cpu-share"]:
        said = out.rsplit(f" {flag} ", 1)[1].split(" --", 1)[0]  # the options' list, not the usage line
        assert "(default " in said, (flag, said)


@pytest.mark.slow
def test_a_run_writes_every_row_and_the_machine(root, tmp_path, capsys):
    out = tmp_path / "results" / "cifar-alexnet.json"
    argv = [str(root), "--workers", "0", "--backends", "pillow", "--batch", "8", "--size", "40"]
    cifar_alexnet.main([*argv, "--seconds", "0", "--steps", "2", "--step-ms", "1", "--json", str(out)])
    report = json.loads(out.read_text())
    assert report["kind"] == "cifar-alexnet" and report["images"] == 40 and report["config"]["size"] == 40
    assert {"cpu", "torch", "torchvision", "dali"} <= set(report["machine"]) and report["date"].endswith("Z")
    assert [(r["loader"], r["workers"]) for r in report["results"]] == [
        ("torchvision", 0),
        ("pillow", 0),
        ("cache=device", 0),
    ]
    for row in report["results"]:
        assert "failed" not in row, row
        assert row["img_s"] > 0 and row["first_batch_s"] > 0 and 0 <= row["data_wait"] <= 1
    assert set(report["ratios"]) == {
        "pillow (0 workers) / torchvision (0 workers)",
        "cache=device (0 workers) / torchvision (0 workers)",
    }
    assert "cache=device  0 workers:" in capsys.readouterr().out


def test_ratios_compare_like_workers_and_the_cache_with_each():
    rows = [
        {"loader": "torchvision", "workers": 0, "img_s": 40.0},
        {"loader": "torchvision", "workers": 2, "img_s": 600.0},
        {"loader": "pillow", "workers": 0, "img_s": 100.0},
        {"loader": "pillow", "workers": 2, "img_s": 1200.0},
        {"loader": "dali", "workers": 2, "failed": "ModuleNotFoundError: no DALI"},
        {"loader": "cache=device", "workers": 0, "img_s": 3000.0},
    ]
    assert cifar_alexnet.ratios(rows) == {
        "pillow (0 workers) / torchvision (0 workers)": 2.5,
        "pillow (2 workers) / torchvision (2 workers)": 2.0,
        "cache=device (0 workers) / torchvision (0 workers)": 75.0,
        "cache=device (0 workers) / torchvision (2 workers)": 5.0,
    }


def test_a_loader_that_fails_is_a_row_saying_why(root):
    s = cifar_alexnet.Settings(batch=8, size=40, seconds=0, steps=1, step_ms=1)
    report = cifar_alexnet.run(root, s, [0], ["no-such-backend"], torch.device("cpu"))
    failed = report["results"][1]
    assert failed["loader"] == "no-such-backend" and failed["failed"].startswith("ValueError: ")
    assert "\n" not in failed["failed"]


@pytest.mark.slow
def test_the_example_trains_a_few_steps_on_the_cpu(root, capsys):
    spec = importlib.util.spec_from_file_location("cifar10_alexnet", EXAMPLE)
    example = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(example)
    example.main([str(root), "--epochs", "1", "--steps", "1", "--batch-size", "4", "--device", "cpu"])
    out = capsys.readouterr().out
    assert "epoch 0: loss " in out and "4 images in" in out and "1 epochs in" in out
