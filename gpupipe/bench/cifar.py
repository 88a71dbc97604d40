"""CIFAR-10-format bench data: 32x32 images cut from the photo-like sample images, written in CIFAR-10's own python
pickle layout, and the torchvision ``CIFAR10`` that reads it.

``make_cifar10(root, count)`` writes ``root/cifar-10-batches-py/``: ``data_batch_1`` .. ``data_batch_5`` (``count``
train images between them), ``test_batch`` (a fifth as many) and ``batches.meta``, each a pickled dict as the
downloaded files hold (``data``: (N, 3072) uint8, the red, green and blue planes of each image in turn; ``labels``;
``filenames``; ``batch_label``; the meta's ``label_names``), and ``made-by-gpupipe.json`` (the count and seed)
that tells this set from the downloaded one. Each image is a random crop (half to all of the area)
of one of a pool of generated photos of its class (:mod:`gpupipe.sample_data`), downscaled to 32x32 as CIFAR's were,
so its pixels have a photo's texture, edges and noise. torchvision's own ``CIFAR10`` reads the files unchanged but
checks them against the downloaded set's MD5 digests; :class:`CIFAR10Files` is that class with the digests left
out (files present is enough), every other line torchvision's.

    python -m gpupipe.bench.cifar data/cifar --count 10000
"""

from __future__ import annotations

import argparse
import json
import pickle
from pathlib import Path
from typing import ClassVar

import numpy as np
from PIL import Image
from torchvision.datasets import CIFAR10

from .._files import write_atomic
from ..errors import run_script
from ..sample_data import photo

BASE = "cifar-10-batches-py"
CLASSES = ["airplane", "automobile", "bird", "cat", "deer", "dog", "frog", "horse", "ship", "truck"]
TRAIN_FILES = [f"data_batch_{k}" for k in range(1, 6)]
MADE = "made-by-gpupipe.json"  # beside the batch files: the set is this module's, not the downloaded one
PHOTOS_PER_CLASS = 12  # the pool each class's images are cut from (fewer for a small set: one per 100 images)


class CIFAR10Files(CIFAR10):
    """``torchvision.datasets.CIFAR10`` for CIFAR-10-format files other than the downloaded ones: the same reading,
    items and transforms, without the MD5 digests of the downloaded set (``check_integrity`` with no digest asks
    only that the file exists)."""

    train_list: ClassVar[list] = [[name, None] for name in TRAIN_FILES]
    test_list: ClassVar[list] = [["test_batch", None]]
    meta: ClassVar[dict] = {**CIFAR10.meta, "md5": None}


def _thumbnails(rng: np.random.Generator, labels: np.ndarray, pool: list[list[Image.Image]]) -> np.ndarray:
    """(N, 32, 32, 3) uint8: for each label, a random crop of a random photo of its class, downscaled to 32x32."""
    out = np.empty((len(labels), 32, 32, 3), np.uint8)
    for i, label in enumerate(labels):
        img = pool[label][int(rng.integers(len(pool[label])))]
        w, h = img.size
        side = int(min(w, h) * rng.uniform(0.7, 1.0))
        top, left = int(rng.integers(h - side + 1)), int(rng.integers(w - side + 1))
        box = (left, top, left + side, top + side)
        out[i] = np.asarray(img.resize((32, 32), Image.Resampling.BOX, box=box))
    return out


def _batch(images: np.ndarray, labels: np.ndarray, name: str, first: int) -> bytes:
    """One batch file's bytes, as CIFAR-10's read in Python 3 (``encoding="latin1"``): a pickled dict, images as
    (N, 3072) planes."""
    entry = {
        "batch_label": name,
        "labels": [int(v) for v in labels],
        "data": np.ascontiguousarray(images.transpose(0, 3, 1, 2).reshape(len(images), 3072)),
        "filenames": [f"photo_{first + i:06d}.png" for i in range(len(images))],
    }
    return pickle.dumps(entry, protocol=2)


def make_cifar10(root: str | Path, count: int = 10_000, seed: int = 0) -> Path:
    """Write ``count`` train images (in five batch files) and ``count // 5`` test images under
    ``root/cifar-10-batches-py``, balanced over the ten classes; returns ``root``. Deterministic for a seed."""
    if count < 5:
        raise ValueError(f"count must be at least 5 (one image per train batch file), got {count}")
    rng = np.random.default_rng(seed)
    per_class = max(1, min(PHOTOS_PER_CLASS, count // 100))
    pool = [[photo(rng, c, len(CLASSES)) for _ in range(per_class)] for c in range(len(CLASSES))]
    folder = Path(root) / BASE
    folder.mkdir(parents=True, exist_ok=True)
    splits = [(name, part) for name, part in zip(TRAIN_FILES, np.array_split(np.arange(count), 5), strict=True)]
    splits.append(("test_batch", np.arange(count, count + max(1, count // 5))))
    for name, part in splits:
        labels = rng.permutation(part % len(CLASSES))
        label = "testing batch 1 of 1" if name == "test_batch" else f"training batch {name[-1]} of 5"
        write_atomic(folder / name, _batch(_thumbnails(rng, labels, pool), labels, label, int(part[0])))
    meta = {"num_cases_per_batch": -(-count // 5), "label_names": CLASSES, "num_vis": 3072}
    write_atomic(folder / MADE, json.dumps({"count": count, "seed": seed}).encode())
    write_atomic(folder / "batches.meta", pickle.dumps(meta, protocol=2))
    return Path(root)


def cifar10(root: str | Path, **kwargs) -> CIFAR10:
    """torchvision's ``CIFAR10(root, **kwargs)``, or :class:`CIFAR10Files` for a set :func:`make_cifar10` wrote."""
    made = (Path(root) / BASE / MADE).is_file()
    return CIFAR10Files(root, **kwargs) if made else CIFAR10(root, **kwargs)


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("root", type=Path, help="written to ROOT/cifar-10-batches-py")
    p.add_argument("--count", type=int, default=10_000, help="train images (test: a fifth as many)")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    make_cifar10(args.root, args.count, args.seed)
    print(f"{args.root / BASE}: {args.count} train and {max(1, args.count // 5)} test images")


if __name__ == "__main__":
    run_script(main)
