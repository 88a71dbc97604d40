"""The public entry points: ``build_loader`` and ``read_image``."""

from __future__ import annotations

import dataclasses
import logging
import os
import re
from collections.abc import Callable, Sequence
from typing import cast

import numpy as np
import torch

from ._files import read_regular
from ._options import Cache
from ._system import as_device, cores_per_rank, default_workers, resolve_device, usable_cores
from ._warn import warn_user
from .augment import Policy, SampleAugment
from .augment.sample import TransformsMode
from .backends import BackendName, BackendSpec, check_name, get, names, require_backend
from .backends.auto import choose_auto
from .backends.held import held_loader
from .data.device import DeviceStage
from .data.loader import DataLoaderSettings, Loader, LoaderParts, OnError
from .data.sampler import ShardSampler, window_mixing
from .errors import MissingFileError
from .recipe import DefaultSize, Recipe, is_whole
from .sources.dataset import check_sendable
from .sources.open import Source, open_source
from .sources.scan import ImageList

_ROW = re.compile(r"^.*?:\d+: ")  # a missing row is named "list.csv:LINE: path"

__all__ = ["as_device", "build_loader", "read_image", "usable_cores"]

_log = logging.getLogger(__name__)  # the "gpupipe" logger's: each loader built, at DEBUG


def _check_missing(dataset: ImageList, on_error: str) -> None:
    """A file list's rows that name no file: an error up front (``on_error="raise"``), else a warning (the loader
    skips them, listed in ``loader.skipped``)."""
    if not dataset.missing:
        return
    rows = "; ".join(dataset.missing[:3]) + (
        f" and {len(dataset.missing) - 3} more" if len(dataset.missing) > 3 else ""
    )
    if not all(os.path.isabs(_ROW.sub("", row, count=1)) for row in dataset.missing):
        rows += f" (relative paths are read from the list's folder, {dataset.root})"
    if on_error == "raise":
        raise MissingFileError(f"{len(dataset.missing)} file(s) in the list do not exist: {rows}")
    warn_user(f"{len(dataset.missing)} file(s) in the list do not exist and will be skipped: {rows}")


def _resolve_device(device: str | torch.device | None) -> torch.device:
    return resolve_device(device)  # the one rule (train, DDP and the CLI use it too)


def _resolve_rank(rank: int | None, world_size: int | None) -> tuple[int, int]:
    dist = torch.distributed
    if rank is None and world_size is None and dist.is_available() and dist.is_initialized():
        return dist.get_rank(), dist.get_world_size()
    rank, world_size = _whole("rank", rank) or 0, _whole("world_size", world_size)
    if world_size is None:
        world_size = 1
    elif world_size < 1:
        raise ValueError(f"world_size must be >= 1, got {world_size}")
    return rank, world_size


def build_loader(
    root: Source,
    backend: BackendName | str = "pillow",  # or a name registered with gpupipe.backends.register
    *,
    batch_size: int = 256,
    train: bool = True,
    image_size: int | None = None,
    device: str | torch.device | None = None,
    num_workers: int | None = None,
    seed: int = 0,
    drop_last: bool | None = None,
    shuffle_window: int | None = None,
    normalize: bool = True,
    rank: int | None = None,
    world_size: int | None = None,
    on_error: OnError = "raise",
    recipe: Recipe | None = None,
    transforms: Callable[[torch.Tensor], torch.Tensor] | Sequence[Callable] | None = None,
    transforms_mode: TransformsMode = "image",
    channels_last: bool = False,
    max_pixels: int | None = None,
    pin_memory: bool | None = None,
    prefetch_factor: int | None = None,
    persistent_workers: bool | None = None,
    allow_outside_root: bool = False,
    class_to_idx: dict[str, int] | None = None,
    cache: Cache | None = None,
) -> Loader:
    """A loader yielding ``(images, labels)`` on ``device``: images (N,3,S,S) float32 normalized (uint8 with
    ``normalize=False``), labels int64 (N,). Every backend gives the same recipe, labels and batch contract.

    Args:
        root: an ImageFolder directory, or a CSV file list (``path,label``, paths relative to the file), or tar
            shards: a folder written by ``gpupipe prepare``, or WebDataset ``.tar`` shards (a path, a glob, braces
            ``train-{000000..000009}.tar``, or a list);
            shards may be at a URL (``s3://bucket/train``, ``gs://...``), or a :class:`gpupipe.Remote` for its
            storage options, cache folder and retries.
        backend: ``pillow``, ``pillow-simd``, ``turbojpeg``, ``dali``, ``nvjpeg``, ``synthetic`` or ``auto``
            (the fastest in the latest ``gpupipe bench`` result for this machine and data, else a stated rule).
        train: the train recipe (random resized crop + flip, shuffled) or the eval one (resize + centre crop, in order).
        image_size: the output side ``S``; ``None``: ``recipe.size`` (224 unless the recipe was given a size).
        device: where batches are delivered; ``None`` picks CUDA when available.
        num_workers: decode workers (or DALI threads); ``None``: the usable cores shared among the node's ranks, less
            one on CUDA (the training thread's), where the workers also run at a lower priority (nice +10).
        seed: shuffling and augmentation seed; with ``set_epoch`` the order changes every epoch.
        drop_last: ``None`` means True for train, False for eval.
        shuffle_window: shards or Parquet (its row groups as shards, file after file), train only: ``K`` shuffles
            each epoch by shards rather than globally: the shards in a random order (seeded by ``seed`` and the
            epoch), ``K`` at a time, the samples of each ``K`` shards shuffled among themselves, and each rank a
            contiguous part of the epoch (as Mosaic streaming's and litdata's orders), so a batch touches at most
            ``K`` shards (``2K`` across a group's end). For shards or Parquet files at a URL larger than the node's
            shard cache (``Remote(cache_limit=)``): the group's ``K`` shards are fetched once per node and the next
            group's read ahead, instead of about a request per sample. The shards must each hold a random part of
            the set (``gpupipe prepare --order shuffled``); shards written class by class get a warning. ``None``:
            the global shuffle. A folder or CSV list (no shards) refuses it.
        normalize: ImageNet mean/std on the device (float32); ``False`` gives uint8.
        rank, world_size: the shard to read; ``None`` takes them from ``torch.distributed`` when initialised.
        on_error: ``"raise"`` a :class:`gpupipe.DecodeError` naming the file, or ``"skip"`` it (see ``loader.skipped``).
        recipe: the recipe's scale, ratio, crop_pct, mean, std and size (a recipe built without a size takes
            ``image_size``; a size that differs from ``image_size`` is an error), or its augmentation policies
            (``auto_augment``, ``color_jitter``, ``re_prob``; train loaders only).
        transforms: a callable, a list of them or a ``Compose`` (e.g. torchvision v2 transforms), given uint8
            (3,S,S) images before normalization, for every backend.
        transforms_mode: ``"image"``: each image on its own (independent, per-sample reproducible draws; a Python
            call per image); ``"batch"``: once per (N,3,S,S) uint8 batch on the device (one draw for the batch).
        channels_last: deliver batches in ``torch.channels_last`` memory format.
        max_pixels: refuse images with more pixels (checked from the header); default PIL's limit.
        pin_memory, prefetch_factor, persistent_workers: DataLoader settings of the backends that decode in DataLoader
            workers (pillow, pillow-simd, turbojpeg; nvjpeg: the last two); ``None`` picks what suits the device.
            Set for a backend that does not use them (dali, synthetic), or without workers, they are refused.
        allow_outside_root: let a CSV list name files outside its folder.
        class_to_idx: label with these classes (a training set's, for its held-out set); see
            :func:`gpupipe.sources.open.open_source`.
        cache: ``"device"`` decodes the whole set once, held as uint8 on ``device``, and makes every epoch's
            batches there by indexing it (no workers, no decode after the first); ``"host"`` holds it in host memory
            (page-locked with CUDA). A set that does not fit is refused up front with its size. See
            :mod:`gpupipe.backends.held`.
    """
    name = check_name(backend)
    batch_size, num_workers, image_size = _check(on_error, batch_size, num_workers, recipe, image_size)
    _check_root(root)
    seed = _seed(seed)
    _flags(train=train, normalize=normalize, channels_last=channels_last, allow_outside_root=allow_outside_root)
    _flags(optional=True, drop_last=drop_last, pin_memory=pin_memory, persistent_workers=persistent_workers)
    dev = _resolve_device(device)
    dataset = open_source(root, allow_outside_root=allow_outside_root, class_to_idx=class_to_idx)
    _check_missing(dataset, on_error)
    if name == "auto":
        name = choose_auto(dataset.root, dev, train)
    spec = require_backend(name)
    if dev.type not in spec.devices:
        raise ValueError(f"backend {name!r} delivers batches on {' or '.join(spec.devices)}, not {dev.type!r}")
    workers = default_workers(dev) if num_workers is None else num_workers
    check_sendable(dataset, workers)
    dataloader = _dataloader_settings(spec, dev, workers, pin_memory, prefetch_factor, persistent_workers)
    recipe = _sized_recipe(recipe, image_size, batch_size, train)
    rank, world_size = _resolve_rank(rank, world_size)
    drop_last = _drop_last(drop_last, train)
    sampler = _sampler(dataset, batch_size, train, seed, (rank, world_size), drop_last, shuffle_window)
    augment = SampleAugment(Policy(recipe) if train else None, seed, transforms, transforms_mode)
    stage = DeviceStage(dev, recipe, normalize=normalize, channels_last=channels_last, augment=augment)
    stage.host_threads = max(1, cores_per_rank() - (0 if cache is not None else workers))  # what workers leave
    parts = LoaderParts(dataset, sampler, stage, recipe, on_error, seed, workers, max_pixels, dataloader)
    loader = held_loader(parts, spec, cache) if cache is not None else spec.make_loader(parts)
    _log.debug("built %r (rank %d of %d, seed %d, on_error=%r)", loader, rank, world_size, seed, on_error)
    return loader


def _sized_recipe(recipe: Recipe | None, image_size: int | None, batch_size: int, train: bool) -> Recipe:
    """The loader's recipe: ``recipe`` (or the default one) at ``image_size`` where it was built without a size."""
    recipe = recipe or Recipe()
    if image_size is not None and isinstance(recipe.size, DefaultSize):  # a recipe built without a size takes it
        recipe = dataclasses.replace(recipe, size=image_size)  # 0 or less: Recipe's one-line error
    recipe.check_fits(batch_size, train)  # before any worker asks shared memory for it
    if not train and recipe.policies:
        warn_user(
            f"an eval loader applies no augmentation policy: the recipe's {', '.join(recipe.policies)} ignored "
            "(they apply to train loaders; pass recipe.for_eval() to say so)",
        )
    return recipe


def _sampler(
    dataset: ImageList,
    batch_size: int,
    train: bool,
    seed: int,
    rank_world: tuple[int, int],
    drop_last: bool,
    window: int | None,
) -> ShardSampler:
    """The loader's order. Train: every rank takes the same number of steps (DDP needs it); eval: every sample
    exactly once, no padding. The source is told the order, to read as it suits (shards or Parquet at a URL: through
    the node's cache or by range, with a warning when neither suits it)."""
    shards = None
    if window is not None:
        shards = dataset.shard_of
        if shards is None:
            raise ValueError(
                f"shuffle_window={window} shuffles groups of shards and {dataset.root} has none (an ImageFolder or a "
                "CSV list reads each file on its own; gpupipe prepare writes shards): leave it None"
            )
        if why := window_mixing(shards, np.asarray(dataset.targets, np.int64), window, batch_size):
            warn_user(f"{dataset.root}: {why}")
    rank, world_size = rank_world
    sampler = ShardSampler(
        len(dataset),
        batch_size,
        shuffle=train,
        seed=seed,
        rank=rank,
        world_size=world_size,
        drop_last=drop_last,
        equal_steps=train,
        shards=shards,
        window=window,
        shard_files=dataset.shard_files if window is not None else None,
    )
    dataset.plan_reads(sampler)
    return sampler


def _check(
    on_error: str, batch_size: int, num_workers: int | None, recipe: Recipe | None, image_size: int | None
) -> tuple[int, int | None, int | None]:
    """The arguments that are wrong whatever the data and the backend; the counts as ints (numpy's too)."""
    batch_size = cast(int, _whole("batch_size", batch_size, optional=False))
    num_workers, image_size = _whole("num_workers", num_workers), _whole("image_size", image_size)
    if recipe is not None and not isinstance(recipe, Recipe):
        raise ValueError(f"recipe must be a gpupipe.Recipe, got {type(recipe).__name__} (Recipe(**settings) makes one)")
    if on_error not in ("raise", "skip"):
        raise ValueError(f"on_error must be 'raise' or 'skip', got {on_error!r}")
    if batch_size < 1:
        raise ValueError(f"batch_size must be >= 1, got {batch_size}")
    if num_workers is not None and num_workers < 0:
        raise ValueError(f"num_workers must be >= 0, got {num_workers}")
    if recipe is not None and image_size is not None and image_size != recipe.size:
        if not isinstance(recipe.size, DefaultSize):  # both set: which one was meant is not ours to guess
            raise ValueError(f"image_size={image_size} and recipe.size={recipe.size} disagree: set one of them")
    return batch_size, num_workers, image_size


def _whole(name: str, value: object, optional: bool = True) -> int | None:
    """A whole-number argument as an int (numpy's integers too; ``True`` is no size, ``"224"`` or ``2.5`` no count):
    one line naming it otherwise."""
    if value is None and optional:
        return None
    if is_whole(value):
        return int(value)
    valid = "a whole number" + (" or None" if optional else "")
    raise ValueError(f"{name} must be {valid}, got {value!r} ({type(value).__name__})")


def _flags(optional: bool = False, **flags: object) -> None:
    """Yes/no arguments: ``"no"`` or ``"False"`` would be taken as true, ``0``/``1`` as a count; one line naming the
    argument instead."""
    for name, value in flags.items():
        if isinstance(value, (bool, np.bool_)) or (value is None and optional):
            continue
        valid = "True or False" + (" (or None)" if optional else "")
        raise ValueError(f"{name} must be {valid}, got {value!r} ({type(value).__name__})")


SEED_LIMIT = 1 << 40  # a seed's magnitude below it: the sampler's generator takes seed x 1000003 + epoch, 64 bits


def _seed(seed: object) -> int:
    """The seed as an int (numpy's integers too: a seed drawn with numpy is one); anything else is one line."""
    if is_whole(seed) and abs(int(seed)) < SEED_LIMIT:
        return int(seed)
    raise ValueError(f"seed must be a whole number between -2**40 and 2**40, got {seed!r} ({type(seed).__name__})")


def _drop_last(drop_last: bool | None, train: bool) -> bool:
    """``drop_last`` as the sampler takes it: an eval loader delivers every sample once, its last batch short."""
    if drop_last and not train:
        warn_user(
            "drop_last=True on an eval loader is ignored: an eval loader delivers every sample exactly once, its last "
            "batch short (leave drop_last unset; drop a short batch in the loop if a fixed shape is needed)",
        )
    return train and drop_last is not False


def _check_root(root: object) -> None:
    """The data argument: a number or nothing is no source (``open_source`` would fail on it in a raw
    ``TypeError``)."""
    if root is None or isinstance(root, (bool, int, float, complex)):
        raise ValueError(
            f"root must be the data: a folder, a CSV list, shards, a URL, a list of them or a dataset; got {root!r} "
            f"({type(root).__name__})"
        )
    if isinstance(root, (list, tuple)) and not root:
        raise ValueError(
            "root is an empty list: no data (a list names shards or Parquet files, or holds (image, label) items)"
        )


def _dataloader_settings(
    spec: BackendSpec,
    device: torch.device,
    workers: int,
    pin_memory: bool | None,
    prefetch_factor: int | None,
    persistent_workers: bool | None,
) -> DataLoaderSettings:
    """The DataLoader settings for ``spec``: ``None`` picks what suits the device; a setting the backend does not
    use, or that means nothing without workers, is refused when it was set."""
    asked = {"pin_memory": pin_memory, "prefetch_factor": prefetch_factor, "persistent_workers": persistent_workers}
    unused = [k for k, v in asked.items() if v is not None and k not in spec.dataloader_settings]
    if unused:
        uses = spec.dataloader_settings
        why = f"of the DataLoader settings it uses only {', '.join(uses)}" if uses else "it runs no DataLoader"
        raise ValueError(f"backend {spec.name!r} does not use {', '.join(unused)} ({why}); leave it unset")
    if workers == 0 and (prefetch_factor is not None or persistent_workers):
        raise ValueError("prefetch_factor and persistent_workers=True need worker processes: num_workers > 0")
    return DataLoaderSettings(
        pin_memory=device.type == "cuda" if pin_memory is None else pin_memory,
        prefetch_factor=4 if prefetch_factor is None else prefetch_factor,
        persistent_workers=True if persistent_workers is None else persistent_workers,
    )


def read_image(
    src: str | os.PathLike | bytes,
    backend: str = "pillow",
    *,
    max_pixels: int | None = None,
    device: str | torch.device | None = None,
) -> torch.Tensor:
    """Decode one image to a ``torch.uint8`` tensor (3, H, W): RGB, EXIF orientation applied, on ``device`` (the
    CPU unless told otherwise, whatever the backend).

    ``backend`` is any decoding backend: ``pillow``, ``pillow-simd``, ``turbojpeg``, ``nvjpeg`` (decodes on CUDA)
    or ``dali`` (a one-image DALI pipeline, on ``device``: slow to start, for checks rather than loops).
    """
    target = None if device is None else _resolve_device(device)  # checked before the file is read, as build_loader's
    name = check_name(backend)
    decoders = [n for n in names() if get(n).read is not None]
    if name not in decoders:
        why = " (auto picks a loader's backend from a bench of a data set)" if name == "auto" else ""
        raise ValueError(f"read_image needs a decoding backend: one of {', '.join(decoders)}, not {backend!r}{why}")
    spec = require_backend(name)
    assert spec.read is not None  # a decoder, by the check above
    if isinstance(src, (bytes, bytearray, memoryview)):
        data, path = bytes(src), "<bytes>"
    elif isinstance(src, (str, os.PathLike)):
        path = os.fspath(src)
        try:
            data = read_regular(path)  # a folder, a fifo or a device: one OSError naming what it is
        except FileNotFoundError:
            raise MissingFileError(f"{path}: no such file") from None
    else:
        raise ValueError(f"read_image needs a file's path or its bytes, got {type(src).__name__}")
    return spec.read(data, path, max_pixels, torch.device("cpu") if target is None else target)
