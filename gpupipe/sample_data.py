"""The embedded default data set: photo-like JPEGs at ImageNet-like sizes whose classes a small model can learn.

Generated, not downloaded: each class is a stripe orientation and frequency over smooth colour gradients,
blobs and sensor-like noise, saved at 300-600 px with mixed JPEG quality. Deterministic for a given seed.
"""

from __future__ import annotations

import json
import math
from collections.abc import Callable
from pathlib import Path

import numpy as np
from PIL import Image

DEFAULT_DIR = Path("data/sample")


def photo(rng: np.random.Generator, cls: int, num_classes: int) -> Image.Image:
    """One photo-like image of class ``cls`` of ``num_classes``, 300-600 px on each side, drawn from ``rng``."""
    h, w = (int(v) for v in rng.integers(300, 601, size=2))
    # smooth background (a colour gradient and soft, out-of-focus blobs) at 1/8 size, upscaled: it has no detail
    sh, sw = h // 8 + 1, w // 8 + 1
    y, x = np.mgrid[0:sh, 0:sw].astype(np.float32)
    y /= sh
    x /= sw
    c0, c1 = rng.uniform(0, 255, 3).astype(np.float32), rng.uniform(0, 255, 3).astype(np.float32)
    t = (x * rng.uniform(-1, 1) + y * rng.uniform(-1, 1))[..., None]
    t = (t - t.min()) / max(float(np.ptp(t)), 1e-6)
    bg = c0 * (1 - t) + c1 * t
    for _ in range(int(rng.integers(2, 6))):
        cy, cx, r = rng.uniform(0, 1), rng.uniform(0, 1), rng.uniform(0.05, 0.3)
        mask = np.exp(-((y - cy) ** 2 + (x - cx) ** 2) / (2 * r * r))[..., None]
        bg = bg * (1 - 0.6 * mask) + rng.uniform(0, 255, 3).astype(np.float32) * 0.6 * mask
    bg_img = Image.fromarray(np.clip(bg, 0, 255).astype(np.uint8), "RGB").resize((w, h), Image.Resampling.BILINEAR)
    img: np.ndarray = np.asarray(bg_img, dtype=np.float32)
    # the class: stripes at a class-specific angle and frequency, with a little jitter
    angle = math.pi * cls / num_classes + rng.normal(0, 0.05)
    freq = 6 + 3 * (cls % 3) + rng.normal(0, 0.3)
    yy = np.arange(h, dtype=np.float32)[:, None] / max(h, w)
    xx = np.arange(w, dtype=np.float32)[None, :] / max(h, w)
    stripes = np.sin(2 * math.pi * freq * (xx * math.cos(angle) + yy * math.sin(angle)) + rng.uniform(0, 2 * math.pi))
    img = img + (rng.uniform(35, 60) * stripes)[..., None]
    img += rng.standard_normal(img.shape, dtype=np.float32) * rng.uniform(2, 8)  # sensor noise
    return Image.fromarray(np.clip(img, 0, 255).astype(np.uint8), "RGB")


SPLITS = ("train", "val")
MARKER = ".gpupipe-sample.json"  # the settings a folder was made with: a re-run adds to it only with the same ones


def default_dir(split: str) -> Path:
    return DEFAULT_DIR if split == "train" else DEFAULT_DIR.with_name(f"{DEFAULT_DIR.name}-{split}")


def make_sample_data(
    root: str | Path | None = None,
    classes: int = 10,
    per_class: int = 60,
    seed: int = 0,
    split: str = "train",
    on_image: Callable[[], None] = lambda: None,
) -> Path:
    """Write ``root/class_XX/img_YYYY.jpg`` (``root`` default ``data/sample``, or ``data/sample-val`` for the val
    split). Each split draws its images from its own random streams, so train and val never share an image.

    Files already there are kept, so re-running is cheap; a folder made with other settings (or not by this
    function) is refused rather than mixed into. ``on_image`` is called once per image, written or kept.
    """
    if split not in SPLITS:
        raise ValueError(f"split must be one of {', '.join(SPLITS)}, got {split!r}")
    if classes < 2 or per_class < 1:
        raise ValueError("need at least 2 classes and 1 image per class")
    root = Path(root) if root is not None else default_dir(split)
    settings = {"split": split, "classes": classes, "per_class": per_class, "seed": seed}
    marker = root / MARKER
    if marker.is_file():
        made = json.loads(marker.read_text())
        if made != settings:
            diff = ", ".join(f"{k} {made.get(k)} (now {v})" for k, v in settings.items() if made.get(k) != v)
            raise FileExistsError(
                f"{root} holds sample data made with other settings: {diff}; choose another folder or delete this one"
            )
    elif root.is_dir() and any(root.iterdir()):
        raise FileExistsError(f"{root} exists and was not made by `gpupipe sample-data`: choose another folder")
    root.mkdir(parents=True, exist_ok=True)
    marker.write_text(json.dumps(settings) + "\n")
    for cls in range(classes):
        d = root / f"class_{cls:02d}"
        d.mkdir(exist_ok=True)
        for i in range(per_class):
            path = d / f"img_{i:04d}.jpg"
            if not path.exists():
                # train keeps the streams it always had; val draws from streams of its own
                rng = np.random.default_rng([seed, cls, i] if split == "train" else [seed, cls, i, SPLITS.index(split)])
                img = photo(rng, cls, classes)
                tmp = path.with_suffix(".tmp")
                img.save(tmp, "JPEG", quality=int(rng.integers(70, 96)), subsampling=int(rng.choice([0, 2, 2])))
                tmp.replace(path)
            on_image()
    return root
