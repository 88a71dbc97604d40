"""The baseline most users run today, timed beside every backend: torchvision's ImageFolder (its samples, its Pillow
loader) + RandomResizedCrop/Flip/ToTensor/Normalize (train) or Resize/CenterCrop (eval), float maths on the CPU, the
same DataLoader workers. It reads any source gpupipe reads (a folder, a CSV list, shards), and leaves an unreadable
file out of its batch instead of failing the run."""

from __future__ import annotations

import io
import warnings
from collections.abc import Callable, Iterator

import torch
from PIL import Image

from ..image import default_max_pixels
from ..sources.open import open_source
from ..sources.scan import ImageList
from .records import Config


def _open_or_none(dataset: ImageList, i: int) -> Image.Image | None:
    """torchvision's ``pil_loader`` (RGB), for a file or a shard member; None for a file Pillow cannot read or an image
    over the pixel limit (the loaders leave both out: the baseline times the same samples)."""
    try:
        source = dataset.samples[i][0] if dataset.reads_files else io.BytesIO(dataset.read(i))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore", Image.DecompressionBombWarning)  # judged here, against the loaders' limit
            with Image.open(source) as img:
                if img.width * img.height > default_max_pixels():
                    return None
                return img.convert("RGB")
    except (OSError, ValueError, Image.DecompressionBombError):
        return None


class _BaselineSet(torch.utils.data.Dataset):
    """``torchvision.datasets.ImageFolder`` (the same samples, its Pillow loader), for any source gpupipe reads (a
    folder, a CSV list, shards); an unreadable file is left out of its batch instead of failing the run."""

    def __init__(self, dataset: ImageList, transform: Callable):
        self.dataset, self.transform = dataset, transform

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, i: int):
        img = _open_or_none(self.dataset, i)
        return None if img is None else (self.transform(img), self.dataset.samples[i][1])


def _collate_readable(items: list):
    readable = [it for it in items if it is not None]
    return torch.utils.data.default_collate(readable) if readable else None


def baseline_counts(cfg: Config, train: bool) -> Iterator[int]:
    """What most users run today: ImageFolder + Pillow + torchvision transforms, float maths on the CPU."""
    from torchvision import transforms as T

    norm = T.Normalize((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))
    s = cfg.image_size
    tf = (
        T.Compose([T.RandomResizedCrop(s), T.RandomHorizontalFlip(), T.ToTensor(), norm])
        if train
        else T.Compose([T.Resize(round(s / 0.875)), T.CenterCrop(s), T.ToTensor(), norm])
    )
    ds = _BaselineSet(open_source(cfg.data), tf)
    cuda = cfg.device.type == "cuda"
    dl = torch.utils.data.DataLoader(
        ds,
        batch_size=cfg.batch_size,
        shuffle=train,
        num_workers=cfg.workers,
        pin_memory=cuda,
        persistent_workers=cfg.workers > 0,
        collate_fn=_collate_readable,
    )
    while True:  # epoch after epoch
        for batch in dl:
            if batch is not None:  # None: no file of the batch was readable
                batch[0].to(cfg.device, non_blocking=cuda)
                yield len(batch[1])
