"""A batch's draws at once (counter-based, per sample) and its ops as few calls per family (gpupipe/augment/plan.py,
fused.py): the same per-image results as each op's own kernel, the same draws in any batch, few device launches."""

import numpy as np
import pytest
import torch

from gpupipe.augment import OPS, Op, Policy, SampleAugment
from gpupipe.augment.fused import _AFFINE, _POINT
from gpupipe.bench.host_budget import META, _OpCounter
from gpupipe.data.device import DeviceStage
from gpupipe.data.loader import Batch
from gpupipe.recipe import Recipe

RA_ERASE = Recipe(224, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25)


def _arg(name: str, rng: np.random.Generator) -> tuple[float, ...]:
    """An argument in the op's range (the level functions' and TrivialAugment's)."""
    if name in ("AutoContrast", "Invert"):
        return ()
    ranges = {"Posterize": (0, 9), "Solarize": (0, 257), "SolarizeAdd": (0, 129), "Rotate": (-135, 135)}
    key = next((k for k in ranges if name.startswith(k) and (k != "Solarize" or name != "SolarizeAdd")), None)
    if key is not None:
        return (float(rng.integers(*ranges[key])),)
    if name in ("TranslateX", "TranslateY"):
        return (float(rng.uniform(-20, 20)),)
    if name.startswith(("Shear", "Translate")):
        return (float(rng.uniform(-0.45, 0.45)),)
    return (float(rng.uniform(0.1, 1.9)),)  # the blends' factors


@pytest.mark.parametrize("family", ["point", "affine"])
def test_a_family_call_gives_each_image_its_own_ops_result(family):
    """Every op of the family on one batch, one call: each image as the op's own kernel makes it (the pointwise ops
    and blends to the bit; the warps' coordinates are worked out on the host, so a value may round the other way)."""
    names = list(_POINT if family == "point" else _AFFINE)
    policy = Policy(Recipe(40, auto_augment="rand-m9"))
    rng = np.random.default_rng(1)
    x = torch.randint(
        0, 256, (3 * len(names), 3, 40, 48), dtype=torch.uint8, generator=torch.Generator().manual_seed(0)
    )
    records = [(Op(names[i % len(names)], _arg(names[i % len(names)], rng)),) for i in range(len(x))]
    records[5] = ()  # an image without an op here keeps its pixels
    fused = policy.apply(x, records)
    own = torch.stack(
        [
            OPS[r[0].name].kernel(x[i : i + 1], torch.tensor([r[0].args], dtype=torch.float64), policy.context)[0]
            if r
            else x[i]
            for i, r in enumerate(records)
        ]
    )
    diff = (fused.int() - own.int()).abs()
    if family == "point":
        assert torch.equal(fused, own)
    else:
        assert diff.max() <= 1 and (diff > 0).float().mean() < 1e-3
    assert torch.equal(fused[5], x[5])


def test_a_samples_draws_do_not_depend_on_its_batch():
    policy = Policy(Recipe(64, auto_augment="rand-m9-mstd0.5-n3", re_prob=0.5, re_count=2))
    epochs, indices = np.array([3, 3, 4, 3, 9]), np.array([17, 2, 17, 40, 0])
    plan = policy.plan(11, epochs, indices)
    from gpupipe.augment.plan import records

    batch = records(plan, len(epochs))
    alone = [policy.draw(11, e, i) for e, i in zip(epochs.tolist(), indices.tolist(), strict=True)]
    reversed_batch = records(policy.plan(11, epochs[::-1], indices[::-1]), len(epochs))[::-1]
    assert batch == alone == reversed_batch
    assert batch[0] != batch[2]  # another epoch, another draw
    assert policy.draw(12, 3, 17) != batch[0]  # another seed


def test_randaugment_and_erasing_on_the_device_stage_launch_few_kernels():
    """rand-m9 + erasing, 256 images: a few calls per op position (not per (op, position) group), each a few dozen
    kernels at most; the count does not grow with the batch."""
    stage = DeviceStage(META, RA_ERASE, augment=SampleAugment(Policy(RA_ERASE), 0))
    counts = []
    for n in (64, 256):
        images = torch.zeros(n, 3, 224, 224, dtype=torch.uint8)
        keys = torch.stack([torch.full((n,), 1), torch.arange(n)], 1)
        stage.upload(Batch(images, torch.arange(n), "NCHW", keys=keys))  # the constants, made once
        with _OpCounter() as counter:
            stage.upload(Batch(images, torch.arange(n), "NCHW", keys=keys))
        counts.append(counter.launches)
    assert max(counts) <= 230 and abs(counts[0] - counts[1]) <= 40  # 204 at 256 images (main before: 808)


def test_sharpness_is_exact_under_the_callers_autocast():
    """Its smoothing is a convolution: autocast (bfloat16 here, float16 on CUDA) would round the sums."""
    policy = Policy(Recipe(32))
    x = torch.randint(0, 256, (4, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(2))
    records = [(Op("Sharpness", (1.9,)),)] * 4
    plain = policy.apply(x, records)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        assert torch.equal(policy.apply(x, records), plain)


def _ks(a: np.ndarray, b: np.ndarray) -> float:
    a, b = np.sort(a), np.sort(b)
    grid = np.concatenate([a, b])
    return float(np.abs(np.searchsorted(a, grid, "right") / len(a) - np.searchsorted(b, grid, "right") / len(b)).max())


def test_erasing_boxes_match_timms():
    """timm's ``RandomErasing`` (prob 0.5, one box) against our batch draw over 3,000 images of 64 px: the share
    erased within 0.04, and each box's height, width, top and left within a Kolmogorov-Smirnov distance of 0.06 (the
    0.1 % critical value at ~1,500 boxes a side is about 0.07)."""
    pytest.importorskip("timm")
    import random

    from timm.data.random_erasing import RandomErasing

    n, size = 3000, 64
    erasing = RandomErasing(probability=0.5, mode="const", device="cpu")
    random.seed(0)
    theirs = []
    for _ in range(n):
        img = torch.ones(3, size, size)
        erasing._erase(img, 3, size, size, img.dtype)
        zero = torch.nonzero(img[0] == 0)
        if len(zero):
            (top, left), (bottom, right) = zero.amin(0).tolist(), zero.amax(0).tolist()
            theirs.append((top, left, bottom - top + 1, right - left + 1))
    records = Policy(Recipe(size, re_prob=0.5)).plan(0, np.zeros(n, np.int64), np.arange(n))[0]
    ours = records.args[records.code >= 0, :4]
    assert abs(len(theirs) / n - len(ours) / n) < 0.04
    t = np.asarray(theirs, np.float64)
    for j, name in enumerate(("top", "left", "height", "width")):
        assert _ks(t[:, j], ours[:, j]) < 0.06, name
