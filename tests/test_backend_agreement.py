"""How far DALI's pixels are from Pillow's at every image size from 32 to 512, as a user comparing backends sees
it. The resampling is the same (antialiased bilinear: DALI's ``INTERP_LINEAR`` + ``antialias``, torch's
``interpolate``): on lossless files the two agree within 0.5/255 at every size. On JPEGs the CPU backends decode at
a reduced DCT scale when the image is much larger than the output (the speed-up of the CPU path), and the table in
docs/loader.md gives the measured mean difference per size; this test holds the sample data to it."""

from pathlib import Path

import numpy as np
import pytest
import torch

import gpupipe
from gpupipe.sample_data import make_sample_data

from .common_utils import photo

pytestmark = [
    pytest.mark.skipif("dali" not in gpupipe.available_backends(), reason="needs DALI"),
    pytest.mark.slow,
]
PAGE = Path(__file__).resolve().parents[1] / "docs" / "loader.md"
SIZES = (32, 64, 128, 224, 512)


def _first_batch(root, backend: str, size: int, train: bool) -> torch.Tensor:
    loader = gpupipe.build_loader(
        root,
        backend,
        batch_size=20,
        train=train,
        image_size=size,
        device="cpu",
        num_workers=0,
        normalize=False,
        drop_last=False,
    )
    return next(iter(loader))[0].float()


def _readme_bounds() -> dict[str, dict[int, float]]:
    """docs/loader.md's table: mean |dali - pillow| per pipeline and size, in 1/255."""
    lines = PAGE.read_text().splitlines()

    def cells(start: str) -> list[str]:
        line = next(line for line in lines if line.startswith(start))
        return line.rsplit("\\|", 1)[-1].replace("| image size", "").strip(" |").split(" | ")

    sizes = [int(v) for v in cells("| image size |")]
    return {kind: dict(zip(sizes, map(float, cells(f"| {kind}, mean")), strict=True)) for kind in ("eval", "train")}


def test_dali_resamples_as_pillow_on_lossless_images(tmp_path):
    rng = np.random.default_rng(3)
    for i in range(4):
        (tmp_path / "c0").mkdir(exist_ok=True)
        photo(rng, 360 + 40 * i, 500 - 30 * i).save(tmp_path / "c0" / f"{i}.png")
    for size in SIZES:
        for train in (False, True):
            diff = (_first_batch(tmp_path, "dali", size, train) - _first_batch(tmp_path, "pillow", size, train)).abs()
            assert diff.mean() < 0.5, (size, train, diff.mean())


@pytest.mark.parametrize("train", [False, True], ids=["eval", "train"])
def test_dali_and_pillow_on_jpegs_stay_within_the_readme_bound_per_size(tmp_path_factory, train):
    root = make_sample_data(tmp_path_factory.mktemp("sample"), classes=2, per_class=10)
    bounds = _readme_bounds()["train" if train else "eval"]
    assert set(SIZES) <= set(bounds)
    for size in SIZES:
        diff = (_first_batch(root, "dali", size, train) - _first_batch(root, "pillow", size, train)).abs().mean()
        assert diff <= 1.25 * bounds[size] + 0.1, (size, float(diff), bounds[size])  # 20 images, not the table's 100
