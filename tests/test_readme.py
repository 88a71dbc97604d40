"""The Python examples of the README and docs/ that need names from their text, run as a user runs them after
``make demo`` (the sample data under ``data/``), with the default workers (every usable core: 2 in CI). Only the batch
size is capped (the data here is 24 images) and the names a snippet leaves to the reader (``model``, ``resuming``,
...) are given; the GPU-only, Lightning, Accelerate and object-storage snippets have their own tests
(test_lightning.py, test_accelerate.py, test_remote.py), and the whole blocks marked runnable run in test_docs.py."""

from __future__ import annotations

import re
import shutil
from pathlib import Path

import pytest
import torch

import gpupipe
from gpupipe.sample_data import make_sample_data

ROOT = Path(__file__).resolve().parents[1]
PAGES = [ROOT / "README.md", *sorted((ROOT / "docs").glob("*.md"))]


def _blocks() -> list[str]:
    return [b for page in PAGES for b in re.findall(r"^```python\n(.*?)^```", page.read_text(), flags=re.S | re.M)]


def _block(first_line: str) -> str:
    """The Python block of the README or a docs/ page that starts with ``first_line``."""
    found = [b for b in _blocks() if b.lstrip().startswith(first_line)]
    assert len(found) == 1, f"the README and docs/ have {len(found)} Python blocks starting {first_line!r}"
    return found[0]


@pytest.fixture()
def demo(tmp_path, monkeypatch):
    """A folder laid out as after ``make demo`` (smaller), as the working directory; batches capped at 8 images."""
    make_sample_data(tmp_path / "data" / "sample", classes=3, per_class=8)
    for name in ("unlabeled", "labeled"):
        shutil.copytree(tmp_path / "data" / "sample", tmp_path / "data" / name)
    monkeypatch.chdir(tmp_path)
    build = gpupipe.build_loader

    def small_batches(*args, **kw):
        return build(*args, **{**kw, "batch_size": min(kw.get("batch_size", 256), 8)})

    monkeypatch.setattr(gpupipe, "build_loader", small_batches)
    return tmp_path


def _tiny_model() -> torch.nn.Module:
    return torch.nn.Sequential(torch.nn.AdaptiveAvgPool2d(4), torch.nn.Flatten(), torch.nn.Linear(48, 3))


def test_the_backend_switch_example_runs(demo, capsys):
    exec(_block("import gpupipe\n\nloader = gpupipe.build_loader("), {})  # runs as pasted: no name left to give
    assert "['class_00', 'class_01', 'class_02']" in capsys.readouterr().out


def test_the_read_image_example_runs(demo):
    lines = _block("img = gpupipe.read_image(").splitlines()
    if not torch.cuda.is_available():
        lines = [line for line in lines if '"cuda"' not in line]
    path = "data/sample/class_00/img_0000.jpg"
    scope = {"gpupipe": gpupipe, "jpeg_bytes": Path(path).read_bytes()}
    for line in lines:
        if "turbojpeg" in line and "turbojpeg" not in gpupipe.available_backends():
            line = line.replace("turbojpeg", "pillow")
        exec(line, scope)
    assert scope["img"].dtype == torch.uint8 and scope["img"].shape[0] == 3


def test_the_policy_example_runs(demo):
    code = _block('recipe = gpupipe.Recipe(auto_augment="rand-m9-mstd0.5-inc1"')
    if "turbojpeg" not in gpupipe.available_backends():
        code = code.replace('"turbojpeg"', '"pillow"')
    scope = {"gpupipe": gpupipe}
    exec(code, scope)
    images, _ = next(iter(scope["loader"]))
    assert images.dtype == torch.float32


def test_the_fixmatch_loop_runs_with_the_default_workers(demo):
    """The loop as printed (its imports included), every batch of an epoch, on the default device and workers."""
    model = _tiny_model()
    scope = {"model": model}
    exec(_block("import torch\nimport gpupipe\nfrom gpupipe import Recipe"), scope)
    cta = scope["cta"]
    assert cta.rates != [1.0] * len(cta.rates)  # the probe batches moved the weights
    assert len(scope["probe"].records) == len(scope["yp"])


def test_the_checkpointing_example_runs(demo):
    loader = gpupipe.build_loader("data/sample", device="cpu", image_size=32)
    scope = {"torch": torch, "loader": loader, "epochs": 2, "resuming": False, "model": _tiny_model()}
    exec(_block('checkpoint = torch.load("ckpt.pt")'), scope)
    assert scope["epoch"] == 1
