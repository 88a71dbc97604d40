"""Per-image augmentation: drawn per sample, the same on every backend and path, timm's distributions."""

import dataclasses
import math
import random
from collections import Counter

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

import gpupipe
from gpupipe.augment import Op, Policy
from gpupipe.recipe import Recipe

from .common_utils import CPU_LOADER_BACKENDS, assert_resume_is_exact

RA = "rand-m9-mstd0.5-inc1"
FULL = Recipe(auto_augment=RA, color_jitter=0.4, re_prob=0.5, re_count=2)


def _loader(folder, backend="pillow", *, recipe=None, train=True, device_path=False, **kw):
    args = dict(batch_size=8, train=train, num_workers=0, normalize=False, device="cpu", seed=3)
    recipe = Recipe(48) if recipe is None else dataclasses.replace(recipe, size=48)
    loader = gpupipe.build_loader(folder, backend, recipe=recipe, **{**args, **kw})
    if device_path and hasattr(loader, "_data"):
        # as on CUDA: the workers only crop; the device stage augments, batched
        loader.placement = dataclasses.replace(loader.placement, augment="device")
        loader._data.augment = None
    return loader


def _pixels(loader):
    return torch.cat([x for x, _ in loader])


def test_defaults_are_off_and_the_crop_stream_is_untouched(folder):
    assert not Policy(Recipe()).active
    plain = _pixels(_loader(folder))
    assert torch.equal(plain, _pixels(_loader(folder, recipe=Recipe(re_prob=0.0))))
    # erasing on: the pixels outside the erased boxes are the plain recipe's (same crops: a separate stream)
    erased = _pixels(_loader(folder, recipe=Recipe(re_prob=1.0, re_mode="const")))
    assert not torch.equal(plain, erased)
    assert (erased != plain).float().mean() < 0.4


def test_bad_policies_raise_value_error():
    for kw in [
        dict(auto_augment="rand-x3"),
        dict(auto_augment="v9"),
        dict(re_mode="noise"),
        dict(re_prob=2.0),
        dict(color_jitter=(0.1, 0.2)),
        dict(re_count=0),
    ]:
        with pytest.raises(ValueError):
            Recipe(**kw)


@pytest.mark.parametrize("aa", [RA, "rand-m9-n3-p1.0-mstd101", "original", "originalr", "trivialaugment"])
def test_one_image_and_a_batch_give_the_same_pixels(aa):
    policy = Policy(Recipe(32, auto_augment=aa, color_jitter=(0.4, 0.4, 0.4, 0.1), re_prob=0.5, re_count=3))
    records = [policy.draw(0, 1, i) for i in range(48)]
    x = torch.randint(0, 256, (48, 3, 32, 32), dtype=torch.uint8, generator=torch.Generator().manual_seed(0))
    batched = policy.apply(x, records)
    one_by_one = torch.stack([policy.apply(x[i : i + 1], [records[i]])[0] for i in range(48)])
    assert torch.equal(batched, one_by_one)
    assert batched.dtype == torch.uint8 and not torch.equal(batched, x)


def test_policy_pickles_for_spawned_workers():
    import pickle

    for aa in (RA, "original", "trivialaugment"):
        policy = Policy(Recipe(auto_augment=aa, color_jitter=0.4, re_prob=0.5))
        assert pickle.loads(pickle.dumps(policy)).draw(0, 1, 2) == policy.draw(0, 1, 2)


def test_worker_path_and_batched_device_path_give_the_same_pixels(folder):
    transforms = v2.RandomErasing(p=0.5, value=0)
    a = _pixels(_loader(folder, recipe=FULL, transforms=transforms))
    b = _pixels(_loader(folder, recipe=FULL, transforms=transforms, device_path=True))
    assert torch.equal(a, b)


def test_resumed_run_with_randaugment_gives_the_same_pixels(folder):
    assert_resume_is_exact(lambda: _loader(folder, recipe=FULL, batch_size=4), epoch=2, batch=3)


@pytest.mark.parametrize("backend", [*CPU_LOADER_BACKENDS, "synthetic"])
def test_the_policy_runs_on_every_backend(folder, backend):
    plain = _pixels(_loader(folder, backend, num_workers=1))
    aug = _pixels(_loader(folder, backend, recipe=FULL, num_workers=1))
    assert aug.shape == plain.shape == (24, 3, 48, 48) and aug.dtype == torch.uint8
    assert (aug.float() - plain.float()).abs().mean() > 5


def test_erasing_boxes_flips_and_jitter_differ_within_a_batch():
    policy = Policy(Recipe(auto_augment=None, color_jitter=0.5, re_prob=1.0))
    records = [policy.draw(0, 0, i) for i in range(8)]
    boxes = {op.args[:4] for r in records for op in r if op.name == "Erase"}
    brightness = [op.args[0] for r in records for op in r if op.name == "Brightness"]
    assert len(boxes) == 8
    assert min(brightness) < 0.8 and max(brightness) > 1.2  # ColorJitter(0.5): U(0.5, 1.5), per image


@pytest.mark.parametrize("device_path", [False, True])
def test_user_transforms_draw_per_image(folder, device_path):
    """The issue's three complaints: one box for the batch, all-or-none flips, one brightness for the batch."""
    eval_kw = dict(train=False, device_path=device_path)
    plain = _pixels(_loader(folder, **eval_kw))[:8]
    erased = _pixels(_loader(folder, transforms=v2.RandomErasing(p=1.0, value=0), **eval_kw))[:8]
    boxes = {tuple(torch.nonzero((e != p).any(0)).amin(0).tolist()) for e, p in zip(erased, plain, strict=True)}
    assert len(boxes) > 4
    flipped = _pixels(_loader(folder, transforms=v2.Compose([v2.RandomHorizontalFlip()]), **eval_kw))[:8]
    n_flipped = sum(torch.equal(f, p.flip(-1)) for f, p in zip(flipped, plain, strict=True))
    assert 0 < n_flipped < 8
    bright = _pixels(_loader(folder, transforms=[v2.ColorJitter(brightness=0.5)], **eval_kw))[:8]
    ratios = [(b.float().mean() / p.float().mean()).item() for b, p in zip(bright, plain, strict=True)]
    assert max(ratios) - min(ratios) > 0.2
    again = _pixels(_loader(folder, transforms=[v2.ColorJitter(brightness=0.5)], **eval_kw))[:8]
    assert torch.equal(bright, again)  # seeded per sample: reproducible


def test_batch_mode_transforms_draw_once_per_batch(folder):
    plain = _pixels(_loader(folder, train=False))[:8]
    erased = _pixels(
        _loader(folder, train=False, transforms=v2.RandomErasing(p=1.0, value=0), transforms_mode="batch")
    )[:8]
    masks = (erased != plain).any(1)
    assert all(torch.equal(masks[0] | m, masks[0] | masks[1]) for m in masks)  # one box
    with pytest.raises(ValueError, match="transforms_mode"):
        _loader(folder, transforms_mode="each")


def test_pixel_noise_is_the_normalised_normal():
    recipe = Recipe(32, re_prob=1.0, re_mode="pixel")
    policy = Policy(recipe)
    x = torch.zeros(1, 3, 32, 32, dtype=torch.uint8)
    out = policy.apply(x, [(Op("Erase", (0, 0, 32, 32, 12345)),)]).float()
    z = (out / 255 - torch.tensor(recipe.mean).view(1, 3, 1, 1)) / torch.tensor(recipe.std).view(1, 3, 1, 1)
    assert abs(z.mean()) < 0.05 and abs(z.std() - 1) < 0.05  # N(0, 1) after normalisation (3,072 values)


def _timm_draws(config: str, n: int) -> list[tuple[str, tuple]]:
    """timm's RandAugment, instrumented: the (op, level args) each call would apply."""
    from PIL import Image
    from timm.data.auto_augment import rand_augment_transform

    ra = rand_augment_transform(config, {"translate_const": 100, "img_mean": (124, 116, 104)})
    seen: list[tuple[str, tuple]] = []
    for op in ra.ops:
        level_fn, name = op.level_fn, op.name
        op.aug_fn = lambda img, *args, _n=name, **kw: seen.append((_n, args)) or img
        op.level_fn = level_fn
    img = Image.new("RGB", (4, 4))
    random.seed(0)
    np.random.seed(0)
    for _ in range(n):
        ra(img)
    return seen


@pytest.mark.parametrize("config", [RA, pytest.param("rand-m7-n3-mstd1-p0.7", marks=pytest.mark.slow)])
def test_randaugment_op_choice_and_magnitudes_match_timm(config):
    """Over 20,000 images: each op's frequency within 0.01 of timm's (about 4 standard errors), and its argument's
    distribution within a two-sample Kolmogorov-Smirnov distance of 0.08 of timm's (~1,300 draws per op and side:
    the 0.1 % critical value is ~0.076)."""
    pytest.importorskip("timm")
    n = 20_000
    theirs = _timm_draws(config, n)
    policy = Policy(Recipe(224, auto_augment=config))
    ours = [(op.name, op.args) for i in range(n) for op in policy.draw(0, 0, i)]
    ct, co = Counter(name for name, _ in theirs), Counter(name for name, _ in ours)
    assert ct.keys() == co.keys() and len(ct) == 15
    for name in ct:
        assert abs(ct[name] / n - co[name] / n) < 0.01, name
        if not next(a for nm, a in theirs if nm == name):  # AutoContrast, Equalize, Invert: no argument
            continue
        t = np.sort([a[0] for nm, a in theirs if nm == name])
        o = np.sort([a[0] for nm, a in ours if nm == name])
        grid = np.concatenate([t, o])
        ks = np.abs(np.searchsorted(t, grid, "right") / len(t) - np.searchsorted(o, grid, "right") / len(o)).max()
        assert ks < 0.08, (name, ks)


def test_trivialaugment_matches_torchvision_space():
    policy = Policy(Recipe(auto_augment="trivialaugment"))
    names = Counter()
    rot = []
    for i in range(7000):
        r = policy.draw(0, 0, i)
        names[r[0].name if r else "Identity"] += 1
        rot += [op.args[0] for op in r if op.name == "Rotate"]
    assert len(names) == 14 and all(abs(c / 7000 - 1 / 14) < 0.02 for c in names.values())
    assert max(map(abs, rot)) <= 135.0 and math.isclose(abs(np.mean(rot)), 0, abs_tol=8)


@pytest.mark.gpu
def test_cuda_device_path_matches_the_cpu_workers(folder):
    cpu = _pixels(_loader(folder, recipe=FULL)).float()
    cuda = _pixels(_loader(folder, recipe=FULL, device="cuda")).cpu().float()
    assert (cuda - cpu).abs().mean() < 1.0  # same draws; float rounding differs between devices
    synth = _pixels(_loader(folder, "synthetic", recipe=FULL, device="cuda"))
    assert synth.is_cuda and synth.shape == (24, 3, 48, 48)


def _bench(tmp_path, folder, monkeypatch, *flags: str) -> list[dict]:
    """``gpupipe bench`` on pillow, train pipeline, tiny and short, with ``flags``: the JSON report's rows."""
    import json

    from gpupipe.cli import main

    monkeypatch.setenv("GPUPIPE_CACHE", str(tmp_path / "cache"))
    j = tmp_path / "b.json"
    rc = main(
        [
            "bench",
            "--data",
            str(folder),
            "--device",
            "cpu",
            "--workers",
            "0",
            "--backends",
            "pillow",
            "--pipelines",
            "train",
            "--seconds",
            "0.2",
            "--repeats",
            "1",
            "--batch-size",
            "8",
            "--image-size",
            "32",
            *flags,
            "--json",
            str(j),
        ]
    )
    assert rc == 0
    return json.loads(j.read_text())["results"]


@pytest.mark.parametrize("aa", [RA, "ctaugment"])
@pytest.mark.slow
def test_bench_adds_an_augment_pipeline(tmp_path, folder, monkeypatch, aa):
    rows = _bench(tmp_path, folder, monkeypatch, "--aa", aa, "--reprob", "0.25")
    got = {(r["backend"], r["pipeline"]) for r in rows}
    assert {("pillow", "train"), ("pillow", "augment")} <= got


@pytest.mark.slow
def test_bench_reports_each_policys_cost_beside_the_others(tmp_path, folder, monkeypatch, capsys):
    rows = _bench(tmp_path, folder, monkeypatch, "--aa", "ctaugment", "--aa", RA)
    train = next(r for r in rows if r["pipeline"] == "train" and r["backend"] == "pillow")
    augment = {r["policy"]: r for r in rows if r["pipeline"] == "augment"}
    assert list(augment) == ["ctaugment", RA]  # one row per policy, in the order asked
    for r in augment.values():
        assert r["backend"] == "pillow"
        want = 1000 / r["images_per_s"] - 1000 / train["images_per_s"]
        assert r["cost_ms_per_image"] == pytest.approx(want)
    out = capsys.readouterr().out
    assert "augment: ctaugment" in out and f"augment: {RA}" in out and "ms/img vs train" in out


def test_a_scheduled_epoch_draws_its_erasing_boxes_for_its_own_side():
    """Erasing boxes follow the epoch's image side (a resolution schedule), not the first epoch's."""
    policy, n = Policy(Recipe(size=[64, 16], re_prob=1.0)), 200
    for side in (64, 16):
        (erase,) = policy.plan(0, np.ones(n, np.int64), np.arange(n), size=side)
        top, left, h, w = erase.args[erase.code >= 0, :4].T
        assert (top + h <= side).all() and (left + w <= side).all() and (h > side / 4).any()
