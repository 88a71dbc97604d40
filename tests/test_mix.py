"""gpupipe.Mix against timm's Mixup: the same draws (one numpy RandomState stream, timm's order) give the same
images and targets; targets are soft and sum to 1."""

import numpy as np
import pytest
import torch

import gpupipe

timm_mixup = pytest.importorskip("timm.data.mixup")


@pytest.mark.parametrize("mode", ["batch", "elem"])
@pytest.mark.parametrize("alphas", [(0.2, 0.0), (0.0, 1.0), (0.8, 1.0)])
def test_matches_timm_mixup(mode, alphas):
    kw = dict(
        mixup_alpha=alphas[0],
        cutmix_alpha=alphas[1],
        prob=0.9,
        switch_prob=0.5,
        mode=mode,
        label_smoothing=0.1,
        num_classes=7,
    )
    ours = gpupipe.Mix(**kw, seed=0)
    theirs = timm_mixup.Mixup(**kw)
    np.random.seed(0)  # timm draws from numpy's global stream; ours from its own RandomState(0): the same numbers
    g = torch.Generator().manual_seed(0)
    for _ in range(20):
        x = torch.randn(8, 3, 16, 12, generator=g)
        y = torch.randint(0, 7, (8,), generator=g)
        xo, to = ours(x, y)
        xt, tt = theirs(x.clone(), y)
        torch.testing.assert_close(xo, xt, rtol=0, atol=0)
        torch.testing.assert_close(to, tt, rtol=0, atol=1e-6)


def test_targets_are_soft_and_sum_to_one():
    mix = gpupipe.Mix(mixup_alpha=0.2, cutmix_alpha=1.0, label_smoothing=0.1, num_classes=5, seed=1)
    x, y = torch.randn(16, 3, 8, 8), torch.arange(16) % 5
    x0 = x.clone()
    mixed = 0
    for _ in range(10):
        xm, t = mix(x, y)
        assert t.shape == (16, 5)
        torch.testing.assert_close(t.sum(1), torch.ones(16))
        assert (t > 0).all() and (t < 1).all()  # smoothed: no hard 0/1
        mixed += not torch.equal(xm, x)
    assert mixed > 0
    assert torch.equal(x, x0)  # the input is not modified


def test_bad_options():
    with pytest.raises(ValueError, match="one > 0"):
        gpupipe.Mix(0.0, 0.0)
    with pytest.raises(ValueError, match="mode"):
        gpupipe.Mix(0.2, mode="pair")
    with pytest.raises(ValueError, match="even"):
        gpupipe.Mix(0.2)(torch.zeros(3, 3, 4, 4), torch.zeros(3, dtype=torch.long))
    with pytest.raises(ValueError, match=r"Mix\(num_classes=10\) got labels 0..15: each in \[0, 10\)"):
        gpupipe.Mix(0.2, num_classes=10)(torch.zeros(4, 3, 4, 4), torch.tensor([0, 1, 15, 2]))  # an IndexError was


@pytest.mark.parametrize("mode", ["batch", "elem"])
@pytest.mark.parametrize("alphas", [(1.0, 0.0), (0.0, 1.0)])
def test_uint8_images_stay_uint8_with_the_float_batchs_targets(mode, alphas):
    """uint8 batches (normalize=False): MixUp gave float32 where CutMix kept uint8, and per element the lambdas were
    cast to uint8 (0 or 1), so the targets were wrong."""
    images = torch.randint(0, 256, (8, 3, 16, 16), dtype=torch.uint8)
    labels = torch.arange(8) % 4
    mix = dict(mixup_alpha=alphas[0], cutmix_alpha=alphas[1], mode=mode, num_classes=4, prob=1.0, seed=3)
    mixed, targets = gpupipe.Mix(**mix)(images, labels)
    as_float, float_targets = gpupipe.Mix(**mix)(images.float(), labels)
    assert mixed.dtype == torch.uint8 and torch.equal(mixed, as_float.round().to(torch.uint8))
    assert targets.dtype == torch.float32 and torch.allclose(targets, float_targets)
    assert not torch.equal(targets, torch.nn.functional.one_hot(labels, 4).float())  # mixed: no lambda cut to 0 or 1
