"""String options and help shared by the API and the command line, in a module that imports nothing heavy: the CLI
builds its parser from them without importing torch (``gpupipe --version`` stays quick)."""

from __future__ import annotations

import argparse
from typing import Literal, NamedTuple

OnError = Literal["raise", "skip"]  # an unreadable sample: stop naming it, or leave it out and count it
EraseMode = Literal["pixel", "rand", "const"]  # random erasing's fill: per-pixel noise, one colour per box, zeros
ERASE_MODES: tuple[EraseMode, ...] = ("pixel", "rand", "const")

# the train crop: RandomResizedCrop (ImageNet's), a crop of the image padded on each side (CIFAR's RandomCrop(size,
# padding)), or the whole image resized (Resize of an int on a square image); and how the padding is filled
CropMode = Literal["random-resized", "pad", "resize"]
CROP_MODES: tuple[CropMode, ...] = ("random-resized", "pad", "resize")
PaddingMode = Literal["zero", "reflect"]
PADDING_MODES: tuple[PaddingMode, ...] = ("zero", "reflect")

# build_loader(cache=...): the set decoded once and held on the loader's device, or in host memory
Cache = Literal["device", "host"]
CACHES: tuple[Cache, ...] = ("device", "host")

PrecisionName = Literal["fp32", "bf16", "fp16"]  # gpupipe train --precision
BUILTIN_BACKENDS = ("pillow", "pillow-simd", "turbojpeg", "dali", "nvjpeg", "synthetic")  # the registry's, in order


class PrepareDefaults(NamedTuple):
    """``gpupipe prepare``'s defaults (``PrepareOptions``'), here so that the CLI states them without importing it."""

    quality: int = 90
    shard_size: int = 512 * 2**20
    subsampling: Literal["keep", "420"] = "keep"
    order: Literal["source", "shuffled"] = "source"


PREPARE_DEFAULTS = PrepareDefaults()

ALLOW_OUTSIDE_ROOT_HELP = (
    "trust the data set to name files outside it: a CSV list's relative paths leaving its folder, links out of an "
    "ImageFolder or to folders in it (absolute CSV paths are always fine)"
)


def at_least(low: float, kind: type = int, strict: bool = False):
    """An argparse type: ``kind(text)``, refused below ``low`` (or at it, ``strict``) with one line."""

    def parse(text: str):
        value = kind(text)
        if value < low or (strict and not value > low):
            raise argparse.ArgumentTypeError(f"must be {'>' if strict else '>='} {low}, got {text}")
        return value

    parse.__name__ = kind.__name__  # argparse names a value it cannot convert by it: "invalid int value: 'x'"
    return parse


def positive_ints(text: str) -> list[int]:
    """An argparse type: one size or several, ``160,192,224``, each an integer >= 1."""
    try:
        sizes = [int(part) for part in text.split(",")]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected integers separated by commas, got {text}") from None
    if min(sizes) < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text}")
    return sizes
