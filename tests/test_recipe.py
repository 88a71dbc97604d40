"""gpupipe/recipe.py: the train boxes follow RandomResizedCrop, the eval geometry Resize + CenterCrop, DCT scales."""

import math
import random

import numpy as np
import pytest
import torch
from torchvision.transforms import v2

from gpupipe.image import crop_resize
from gpupipe.recipe import IMAGENET_MEAN, Box, Recipe, ResolutionSchedule, dct_scale, key_uniforms


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
        list(vars(recipe.eval_box(h, w)).values())[:5] for h, w in zip(heights[:5], widths[:5], strict=True)
    ]


@pytest.mark.parametrize("recipe", [Recipe(224), Recipe(64, crop="resize"), Recipe(32, crop="pad", flip_p=0.3)])
def test_the_flips_alone_are_the_boxes_flip_column(recipe):
    """Recipe.flips (a set held resized draws only these) == plan_boxes' flip column, train and eval, every crop."""
    indices = list(range(0, 5000, 7))
    sizes = [64] * len(indices)
    for train in (True, False):
        boxes = recipe.plan_boxes(train, 5, 2, indices, sizes, sizes)
        assert recipe.flips(train, 5, 2, indices).tolist() == (boxes[:, 4] > 0.5).tolist()
    assert not Recipe(64, crop="resize", flip_p=0.0).flips(True, 5, 2, indices).any()


def test_a_batch_draws_the_later_attempts_only_for_the_samples_that_need_them(monkeypatch):
    """A batch's boxes draw each sample's first attempts and the flip, and the later attempts only where none of those
    fitted: a few numbers a sample instead of RandomResizedCrop's 41 (the draws were most of the training thread's
    share of a dali batch), with the boxes of all 41 to the bit."""
    import gpupipe.recipe as recipe_module

    recipe, rng = Recipe(224), np.random.default_rng(3)
    n = 2048
    indices, heights, widths = rng.integers(0, 10**9, n), rng.integers(300, 700, n), rng.integers(300, 700, n)
    heights[:20] = 2  # the centre-crop fallback: every attempt drawn
    drawn = []
    real = recipe_module.uniforms

    def counted(keys, stream, count, skip=0):
        drawn.append(len(keys) * count)
        return real(keys, stream, count, skip)

    monkeypatch.setattr(recipe_module, "uniforms", counted)
    boxes = recipe.plan_boxes(True, 1, 2, indices, heights, widths)
    assert sum(drawn) < 15 * n
    monkeypatch.setattr(recipe_module, "uniforms", real)
    assert boxes.tolist() == recipe.train_boxes(heights, widths, recipe.train_draws(1, 2, indices)).tolist()


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


@pytest.mark.parametrize(
    "kw, message",
    [
        ({"scale": (0.5, 0.1)}, r"scale"),
        # a string was read as a per-epoch list: Recipe("224") trained on 2x2, 2x2 then 4x4 images
        ({"size": "224"}, r"size must be a whole number, a ResolutionSchedule or a per-epoch list .*got '224' \(str\)"),
        ({"size": 224.0}, r"size must be a whole number, .*got 224.0 \(float\)"),
        ({"size": True}, r"size must be a whole number, .*got True \(bool\)"),
        ({"size": [32, "64"]}, r"size must be a whole number, got '64' \(str\)"),
        ({"eval_size": "224"}, r"eval_size must be a whole number, got '224' \(str\)"),
        # both failed at the first batch, deep in the device stage: a division by zero, a view of the wrong size
        ({"std": (0, 0, 0)}, r"std must be three numbers \(R, G, B\) above 0, .*; got \(0, 0, 0\)"),
        ({"mean": (0.5, 0.5)}, r"mean must be three numbers \(R, G, B\) in \[0, 1\]"),
        ({"mean": (123.7, 116.3, 103.5)}, r"mean must be three numbers .* on pixels scaled to 0-1"),
        ({"mean": "abc"}, r"mean must be three numbers"),
        ({"flip_p": 1.5}, r"flip_p must be in \[0, 1\], got 1.5"),
        ({"flip_p": -1}, r"flip_p must be in \[0, 1\], got -1"),
    ],
)
def test_bad_recipe_values_are_one_line(kw, message):
    with pytest.raises(ValueError, match=message):
        Recipe(**kw)


def test_numpy_sides_and_listed_stats_are_taken_as_python_ones():
    recipe = Recipe(np.int64(32), eval_size=np.int32(40), mean=[0.5, 0.5, 0.5], std=np.array([0.25, 0.25, 0.25]))
    assert recipe.size == 32 and type(recipe.size) is int and type(recipe.eval_size) is int
    assert recipe.mean == (0.5, 0.5, 0.5) and recipe.std == (0.25, 0.25, 0.25) and hash(recipe)
    assert Recipe([np.int64(16), 24]).size == (16, 24) and Recipe(mean=list(IMAGENET_MEAN)) == Recipe()


def test_a_resolution_schedule_follows_ffcv_rounded_down_to_the_step():
    """FFCV's get_resolution: the start size up to start_epoch, the end size from end_epoch, linear in between;
    here rounded down to the step, and the ends exact even off the step."""
    ramp = ResolutionSchedule(start=160, end=224, start_epoch=1, end_epoch=5, step=32)
    assert [ramp.at(e) for e in range(7)] == [160, 160, 160, 192, 192, 224, 224]  # 176 -> 160, 208 -> 192
    ffcv = ResolutionSchedule(start=160, end=192, start_epoch=2, end_epoch=13, step=32)
    assert [ffcv.at(e) for e in (0, 2, 12, 13, 40)] == [160, 160, 160, 192, 192]
    odd = ResolutionSchedule(start=150, end=250, start_epoch=0, end_epoch=20, step=32)
    assert [odd.at(e) for e in (0, 1, 2, 10, 19, 20)] == [150, 150, 160, 192, 224, 250]  # 155 -> 128, kept >= 150
    down = ResolutionSchedule(start=224, end=160, start_epoch=0, end_epoch=2, step=32)
    assert [down.at(e) for e in range(3)] == [224, 192, 160]


def test_a_recipe_size_may_be_a_schedule_or_a_list_and_eval_has_its_own():
    listed = Recipe(size=[16, 24, 32])
    assert listed.size == (16, 24, 32) and [listed.train_size(e) for e in range(5)] == [16, 24, 32, 32, 32]
    assert listed.eval_side == 32 and listed.resize_size == round(32 / 0.875)  # the last size, by default
    ramp = Recipe(size=ResolutionSchedule(160, 192, 0, 4), eval_size=224)
    assert ramp.side(True, 0) == 160 and ramp.side(True, 4) == 192 and ramp.side(False, 0) == 224
    assert ramp.eval_box(300, 400) == Recipe(224).eval_box(300, 400)
    assert Recipe(size=ResolutionSchedule(160, 192, 0, 4)).eval_side == 192
    assert Recipe(224, eval_size=256).eval_offsets(300, 400) == Recipe(256).eval_offsets(300, 400)
    assert hash(listed) == hash(Recipe(size=(16, 24, 32)))


@pytest.mark.parametrize(
    "make, message",
    [
        (lambda: ResolutionSchedule(0, 192), "sizes must be >= 1"),
        (lambda: ResolutionSchedule(160, 192, step=0), "step must be >= 1"),
        (lambda: ResolutionSchedule(160, 192, 5, 2), "start_epoch <= end_epoch"),
        (lambda: Recipe(size=[]), "at least one size"),
        (lambda: Recipe(size=[32, 0]), "image_size must be >= 1"),
        (lambda: Recipe(32, eval_size=0), "eval_size must be >= 1"),
    ],
)
def test_a_bad_schedule_is_one_line(make, message):
    with pytest.raises(ValueError, match=message):
        make()


def test_the_crop_boxes_do_not_depend_on_the_size():
    """A schedule changes the output side only: each sample's box is a function of (seed, epoch, index)."""
    small, large = Recipe(size=[16, 16]), Recipe(224)
    assert (
        small.plan_boxes(True, 3, 1, range(50), [300] * 50, [400] * 50)
        == large.plan_boxes(True, 3, 1, range(50), [300] * 50, [400] * 50)
    ).all()


def test_a_side_whose_batch_cannot_fit_the_machine_is_refused_up_front(folder):
    """--image-size 100000 (or --eval-size, or a schedule's end) was accepted; a worker then asked for 240 GB of shared
    memory per batch, the run blamed /dev/shm and left the file there. Refused by build_loader, before any worker,
    with the memory a batch needs."""
    import os

    import gpupipe
    from gpupipe.recipe import Recipe, ResolutionSchedule

    shm = set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()
    kw = dict(batch_size=8, num_workers=2, device="cpu")
    for made in (
        lambda: gpupipe.build_loader(folder, "pillow", image_size=100_000, **kw),
        lambda: gpupipe.build_loader(folder, "pillow", train=False, recipe=Recipe(size=64, eval_size=100_000), **kw),
        lambda: gpupipe.build_loader(folder, "pillow", recipe=Recipe(size=ResolutionSchedule(64, 100_000, 0, 3)), **kw),
    ):
        with pytest.raises(
            ValueError, match=r"100000: a batch of 8 images at 100000x100000 needs 1117.6 GiB of memory"
        ):
            made()
    if os.path.isdir("/dev/shm"):
        assert not {f for f in set(os.listdir("/dev/shm")) - shm if f.startswith("torch_")}
    with pytest.raises(ValueError) as e:
        Recipe(size=2048).check_fits(64, train=True, memory=2 << 30)
    assert str(e.value) == (
        "image_size (--image-size) 2048: a batch of 64 images at 2048x2048 needs 3.8 GiB of memory (uint8 pixels and "
        "their float32 copy), more than this machine's 2.0 GiB; take a smaller side or batch size"
    )
    Recipe(size=224).check_fits(256, train=True, memory=16 << 30)  # ImageNet's: 0.2 GiB


@pytest.mark.parametrize("fill, mode", [("zero", "constant"), ("reflect", "reflect")])
def test_the_pad_crop_is_torchvision_random_crop_with_padding(fill, mode):
    """``crop="pad"``: each box, cut from the image, is ``v2.RandomCrop(32, padding=4, padding_mode=...)``'s crop at
    the same offsets (the image padded, then cut), and every offset from 0 to 8 is drawn, flips half the time."""
    recipe = Recipe(32, crop="pad", padding=4, padding_mode=fill)
    image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    padded = v2.functional.pad(image, [4], padding_mode=mode)
    boxes = recipe.plan_boxes(True, 3, 0, range(400), [32] * 400, [32] * 400)
    plans = recipe.plans(True, 3, [(0, i) for i in range(400)])
    assert [plan(32, 32) for plan in plans[:20]] == [Box(*b[:4], bool(b[4]), fill) for b in boxes[:20].tolist()]
    assert set(boxes[:, 0].tolist()) == set(boxes[:, 1].tolist()) == set(range(-4, 5))
    assert 0.4 < boxes[:, 4].mean() < 0.6 and (boxes[:, 2:4] == 32).all()
    for box in boxes[:40].tolist():
        top, left = int(box[0]) + 4, int(box[1]) + 4  # RandomCrop's offsets in the padded image
        want = v2.functional.crop(padded, top, left, 32, 32)
        got = torch.from_numpy(crop_resize(image.permute(1, 2, 0).numpy(), Box(*box[:4], False, fill), (32, 32), 32))
        assert torch.equal(got, want)


def test_the_resize_crop_is_the_whole_image_in_train_and_eval():
    """``crop="resize"``: torchvision's ``Resize(227)`` of a square image, train (with its flips) and eval alike."""
    recipe = Recipe(227, crop="resize")
    boxes = recipe.plan_boxes(True, 0, 0, range(100), [32] * 100, [32] * 100)
    assert (boxes[:, :4] == [0, 0, 32, 32]).all() and 0.3 < boxes[:, 4].mean() < 0.7
    assert recipe.eval_box(32, 32) == Box(0, 0, 32, 32) and recipe.eval_offsets(32, 32) == (227, 227, 0, 0)
    image = torch.randint(0, 256, (3, 32, 32), dtype=torch.uint8)
    got = torch.from_numpy(crop_resize(image.permute(1, 2, 0).numpy(), recipe.eval_box(32, 32), (32, 32), 227))
    want = v2.functional.resize(image, 227, antialias=True)
    assert (got.int() - want.int()).abs().max() <= 1


def test_a_pad_crop_larger_than_the_padded_image_is_refused():
    with pytest.raises(ValueError, match="a 20-pixel side padded by 4 is smaller than the crop 32"):
        Recipe(32, crop="pad").train_box(20, 40, [0.5] * 41)
    with pytest.raises(ValueError, match="reflect padding 4 needs image sides above it, got 4"):
        Recipe(8, crop="pad", padding_mode="reflect").plan_boxes(True, 0, 0, [0], [4], [30])
    with pytest.raises(ValueError, match="crop must be one of random-resized, pad, resize"):
        Recipe(crop="centre")  # type: ignore[arg-type]
