"""gpupipe/recipe.py: the train boxes follow RandomResizedCrop, the eval geometry Resize + CenterCrop, DCT scales."""

import math
import random

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

from gpupipe.recipe import Box, Recipe, dct_scale, key_uniforms


def test_train_box_statistics_match_random_resized_crop():
    """Crop area and aspect-ratio distributions are RandomResizedCrop's (same algorithm, compared by quantiles)."""
    recipe = Recipe(224)
    h, w = 375, 500
    ours = [recipe.train_box(h, w, row) for row in recipe.train_draws(0, 0, range(4000)).tolist()]
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


def test_a_batch_of_boxes_is_each_sample_s_box_to_the_bit():
    """plan_boxes (a whole batch in array ops) == plan (one sample at a time), for any subset and order of keys,
    odd sizes included (thin images take the centre-crop fallback)."""
    recipe, rng = Recipe(224, scale=(0.05, 1.0)), random.Random(1)
    indices = [rng.randrange(10**9) for _ in range(3000)]
    heights = [rng.choice([1, 2, 7, 375, 500, rng.randrange(1, 5000)]) for _ in indices]
    widths = [rng.choice([1, 3, 640, 4000, rng.randrange(1, 5000)]) for _ in indices]
    batch = recipe.plan_boxes(True, 7, 3, indices, heights, widths)
    one = [recipe.plan(True, 7, 3, i)(h, w) for i, h, w in zip(indices, heights, widths, strict=True)]
    assert batch.tolist() == [[b.top, b.left, b.height, b.width, float(b.flip)] for b in one]
    part = recipe.plan_boxes(True, 7, 3, indices[::-7], heights[::-7], widths[::-7])
    assert part.tolist() == batch[::-7].tolist()  # another batch, order and worker: the same boxes
    assert recipe.plan_boxes(True, 7, 4, indices, heights, widths).tolist() != batch.tolist()  # a new epoch
    assert recipe.plan_boxes(True, 8, 3, indices, heights, widths).tolist() != batch.tolist()  # another seed
    evals = recipe.plan_boxes(False, 7, 3, indices[:5], heights[:5], widths[:5])
    assert evals.tolist() == [
        list(vars(recipe.eval_box(h, w)).values()) for h, w in zip(heights[:5], widths[:5], strict=True)
    ]


def test_the_counter_based_draws_are_uniform_and_independent():
    u = key_uniforms(0, 0, range(20000), 3)
    assert u.shape == (20000, 3) and 0 <= u.min() and u.max() < 1
    assert abs(u.mean() - 0.5) < 0.01 and abs(np.corrcoef(u[:, 0], u[:, 1])[0, 1]) < 0.03
    assert abs(np.corrcoef(u[:-1, 0], u[1:, 0])[0, 1]) < 0.03  # neighbouring samples
    assert len({round(x, 12) for x in u[:, 0].tolist()}) == 20000


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
