"""gpupipe/recipe.py: the train boxes follow RandomResizedCrop, the eval geometry Resize + CenterCrop, DCT scales."""

import math
import random

import pytest
import torch
from torchvision.transforms import v2

from gpupipe.recipe import Box, Recipe, dct_scale


def test_train_box_statistics_match_random_resized_crop():
    """Crop area and aspect-ratio distributions are RandomResizedCrop's (same algorithm, compared by quantiles)."""
    recipe, rng = Recipe(224), random.Random(0)
    h, w = 375, 500
    ours = [recipe.train_box(h, w, rng) for _ in range(4000)]
    torch.manual_seed(0)
    theirs = [v2.RandomResizedCrop.get_params(torch.empty(3, h, w), [0.08, 1.0], [3 / 4, 4 / 3]) for _ in range(4000)]
    a1 = sorted(b.height * b.width / (h * w) for b in ours)
    a2 = sorted(p[2] * p[3] / (h * w) for p in theirs)
    r1 = sorted(math.log(b.width / b.height) for b in ours)
    r2 = sorted(math.log(p[3] / p[2]) for p in theirs)
    for q in (0.1, 0.25, 0.5, 0.75, 0.9):
        i = int(q * 4000)
        assert abs(a1[i] - a2[i]) < 0.03
        assert abs(r1[i] - r2[i]) < 0.03
    assert all(0 <= b.top and b.top + b.height <= h and 0 <= b.left and b.left + b.width <= w for b in ours)
    assert 0.45 < sum(b.flip for b in ours) / len(ours) < 0.55


@pytest.mark.parametrize("hw", [(375, 500), (500, 375), (224, 224), (257, 1000), (600, 301)])
def test_eval_geometry_is_torchvision_resize_centercrop(hw):
    h, w = hw
    rh, rw, top, left = Recipe(224).eval_offsets(h, w)
    resized = v2.functional.resize(torch.zeros(1, h, w), 256)
    assert (rh, rw) == tuple(resized.shape[1:])
    assert (top, left) == (round((rh - 224) / 2.0), round((rw - 224) / 2.0))


def test_dct_scale_keeps_output_resolution():
    assert dct_scale(Box(0, 0, 1800, 2000), 224) == 8
    assert dct_scale(Box(0, 0, 900, 2000), 224) == 4
    assert dct_scale(Box(0, 0, 447, 2000), 224) == 1
    assert dct_scale(Box(0, 0, 448, 448), 224) == 2


def test_bad_recipe_values():
    with pytest.raises(ValueError, match="scale"):
        Recipe(scale=(0.5, 0.1))
