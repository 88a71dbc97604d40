"""The small-image recipe ops (``Recipe(crop="pad" | "resize")``, CIFAR's ``RandomCrop(32, padding=4)`` and the
whole image resized) on every CPU-runnable backend: the same boxes, so the same pixels as Pillow's loader within the
backends' usual tolerance, flips included."""

import numpy as np
import pytest
import torch

import gpupipe
from gpupipe.recipe import Recipe

from .common_utils import jpeg_bytes, photo
from .test_nvjpeg import _CpuNvjpegLoader

RECIPES = {
    "pad-zero": Recipe(32, crop="pad", padding=4, padding_mode="zero"),
    "pad-reflect": Recipe(32, crop="pad", padding=4, padding_mode="reflect"),
    "resize": Recipe(64, crop="resize"),
}


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """CIFAR-sized JPEGs, two classes."""
    root = tmp_path_factory.mktemp("tiny")
    rng = np.random.default_rng(8)
    for c in range(2):
        (root / f"c{c}").mkdir()
        for i in range(8):
            (root / f"c{c}" / f"{i}.jpg").write_bytes(jpeg_bytes(photo(rng, 32, 32), quality=95))
    return root


def _epoch(root, backend: str, recipe: Recipe, train: bool = True) -> list[tuple[torch.Tensor, torch.Tensor]]:
    """An epoch's batches, made by ``backend`` itself (no sample left to Pillow's fallback)."""
    kw = dict(batch_size=8, train=train, device="cpu", num_workers=0, normalize=False, seed=5, recipe=recipe)
    if backend == "nvjpeg":  # its batched GPU side, run on the CPU
        loader = _CpuNvjpegLoader(gpupipe.build_loader(root, "pillow", **kw).parts)
    else:
        loader = gpupipe.build_loader(root, backend, **kw)
    batches = [(x.float(), y) for x, y in loader]
    assert loader.fallbacks == 0
    return batches


def _backends() -> list[str]:
    wanted = ("pillow-simd", "turbojpeg", "dali")
    return [b for b in wanted if b in gpupipe.available_backends()] + ["nvjpeg"]


@pytest.mark.parametrize("name", list(RECIPES))
@pytest.mark.parametrize("backend", _backends())
def test_every_backend_makes_pillow_s_small_image_crops(tiny, backend, name):
    recipe = RECIPES[name]
    reference = _epoch(tiny, "pillow", recipe)
    ours = _epoch(tiny, backend, recipe)
    assert len(ours) == len(reference) == 2
    for (x, y), (ref_x, ref_y) in zip(ours, reference, strict=True):
        assert torch.equal(y, ref_y) and x.shape == ref_x.shape == (8, 3, recipe.train_size(0), recipe.train_size(0))
        # a window off by one pixel, a missed flip or the wrong padding costs tens of levels
        assert (x - ref_x).abs().mean(dim=(1, 2, 3)).max() < 1.5


def test_the_pad_crop_reaches_past_the_edges_and_flips(tiny):
    """The pad crop's batches show its padding (zero rows and columns) and its flips."""
    (x, _), *_ = _epoch(tiny, "pillow", RECIPES["pad-zero"])
    dark_rows = (x.amax(dim=(1, 3)) == 0).sum(1)
    assert (dark_rows > 0).any() and (dark_rows <= 4).all()
    (plain, _), *_ = _epoch(tiny, "pillow", Recipe(32, crop="pad", padding=0, flip_p=0.0))
    (flipped, _), *_ = _epoch(tiny, "pillow", Recipe(32, crop="pad", padding=0, flip_p=1.0))
    assert torch.equal(flipped, plain.flip(-1))


@pytest.mark.parametrize("backend", ["dali", "nvjpeg"])
def test_the_eval_of_the_small_recipes_is_the_whole_image_resized(tiny, backend):
    if backend not in _backends():
        pytest.skip(f"needs {backend}")
    recipe = RECIPES["resize"]
    ours, reference = _epoch(tiny, backend, recipe, False), _epoch(tiny, "pillow", recipe, False)
    assert len(ours) == len(reference) == 2
    for (x, y), (ref_x, ref_y) in zip(ours, reference, strict=True):
        assert torch.equal(y, ref_y) and (x - ref_x).abs().mean(dim=(1, 2, 3)).max() < 1.5
