"""CPU cost per image of each augmentation policy, and of user transforms per image vs per batch.

Times what a decode worker adds after the crop (one uint8 image at a time: draw the record, apply it), on one
thread, for each policy; then the batched path (what the device stage does) on the CPU, per image; then
torchvision v2 user transforms called per image vs once per batch. Medians of ``--repeats`` windows.

    python bench/augment_cost.py --size 224 --seconds 1
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from torchvision.transforms import v2

from gpupipe.augment import Policy, SampleAugment
from gpupipe.recipe import Recipe

POLICIES = {
    "rand-m9-mstd0.5-inc1": dict(auto_augment="rand-m9-mstd0.5-inc1"),
    "original (AutoAugment)": dict(auto_augment="original"),
    "trivialaugment": dict(auto_augment="trivialaugment"),
    "ctaugment (FixMatch's n2 d0.99 t0.8)": dict(auto_augment="ctaugment"),
    "color_jitter 0.4": dict(color_jitter=0.4),
    "re_prob 0.25 pixel": dict(re_prob=0.25),
    "re_prob 1.0 pixel": dict(re_prob=1.0),
    "rand-m9 + reprob 0.25 (timm recipe)": dict(auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25),
}


def _rate(fn, seconds: float, repeats: int, per_call: int) -> float:
    """Median microseconds per image over ``repeats`` windows of ``seconds / repeats``."""
    fn()  # warm-up
    out = []
    for _ in range(repeats):
        t0, n = time.perf_counter(), 0
        while time.perf_counter() - t0 < seconds / repeats:
            fn()
            n += per_call
        out.append((time.perf_counter() - t0) / n * 1e6)
    return statistics.median(out)


def _call(t, img):
    try:
        return t(img)
    except ValueError:  # timm's PosterizeIncreasing at level 10 asks Pillow >= 10 for 0 bits, which it refuses
        return img


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--size", type=int, default=224)
    ap.add_argument("--batch", type=int, default=64)
    ap.add_argument("--seconds", type=float, default=1.0, help="per figure")
    ap.add_argument("--repeats", type=int, default=3)
    args = ap.parse_args()
    torch.set_num_threads(1)  # one decode worker's core
    g = torch.Generator().manual_seed(0)
    images = torch.randint(0, 256, (args.batch, 3, args.size, args.size), dtype=torch.uint8, generator=g)
    counter = iter(range(10**9))

    print(f"CPU, 1 thread, {args.size}x{args.size} uint8; microseconds per image (median of {args.repeats})")
    print(f"{'policy':38} {'worker (1 image)':>17} {'batched (' + str(args.batch) + ')':>14}")
    for name, kw in POLICIES.items():
        aug = SampleAugment(Policy(Recipe(args.size, **kw)), seed=0)

        def one(aug=aug):
            i = next(counter)
            aug.one(images[i % args.batch], 0, i)

        def batch(aug=aug):
            base = next(counter) * args.batch
            keys = torch.tensor([(0, base + j) for j in range(args.batch)])
            aug.batch(images, keys)

        print(
            f"{name:38} {_rate(one, args.seconds, args.repeats, 1):17.0f} "
            f"{_rate(batch, args.seconds, args.repeats, args.batch):14.0f}"
        )

    try:
        from PIL import Image
        from timm.data.auto_augment import auto_augment_transform, rand_augment_transform
    except ImportError:
        pass
    else:  # the reference: timm's PIL ops, one image at a time
        pil = Image.fromarray(images[0].permute(1, 2, 0).numpy())
        hp = {"translate_const": int(args.size * 0.45), "img_mean": (124, 116, 104)}
        for name, t in (
            ("timm PIL rand-m9-mstd0.5-inc1", rand_augment_transform("rand-m9-mstd0.5-inc1", dict(hp))),
            ("timm PIL original (AutoAugment)", auto_augment_transform("original", dict(hp))),
        ):
            print(f"{name:38} {_rate(lambda t=t: _call(t, pil), args.seconds, args.repeats, 1):17.0f}")

    print("\nuser transforms=v2.Compose([RandomErasing(1.0), ColorJitter(0.4, 0.4, 0.4)])")
    t = v2.Compose([v2.RandomErasing(p=1.0), v2.ColorJitter(0.4, 0.4, 0.4)])
    per_image = SampleAugment(None, 0, t, "image")
    per_batch = SampleAugment(None, 0, t, "batch")
    keys = torch.tensor([(0, j) for j in range(args.batch)])
    rate_image = _rate(lambda: per_image.batch(images, keys), args.seconds, args.repeats, args.batch)
    rate_batch = _rate(lambda: per_batch.batch(images, None), args.seconds, args.repeats, args.batch)
    print(f"{'per image (default)':38} {rate_image:17.0f}")
    print(f"{'per batch (transforms_mode=batch)':38} {rate_batch:17.0f}")


if __name__ == "__main__":
    main()
