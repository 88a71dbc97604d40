"""The one dataset scan that feeds every backend: torchvision ImageFolder semantics, or a CSV file list."""

from __future__ import annotations

import csv
import os
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from torchvision.datasets.folder import IMG_EXTENSIONS, find_classes, make_dataset


@dataclass
class ImageList:
    """What a loader reads: ``samples`` as (name, label) in dataset order, and the class names.

    Every backend gets a sample's encoded bytes through :meth:`read` (a file here; a tar member for sharded sets),
    so a new storage layout is a subclass, not a change to each backend. ``sizes`` holds each sample's upright
    (height, width) when the layout records them (a prepared set), so loaders need not read headers at start-up.
    """

    root: str
    samples: list[tuple[str, int]]
    classes: list[str]
    class_to_idx: dict[str, int] = field(default_factory=dict)
    sizes: list[tuple[int, int]] | None = None

    def __len__(self) -> int:
        return len(self.samples)

    def read(self, index: int) -> bytes:
        """The encoded bytes of sample ``index``; ``OSError`` when they cannot be read."""
        with open(self.samples[index][0], "rb") as f:
            return f.read()

    @property
    def targets(self) -> list[int]:
        return [label for _, label in self.samples]


def scan(root: str | os.PathLike | Sequence[str | os.PathLike], *, allow_outside_root: bool = False) -> ImageList:
    """Scan an ImageFolder directory (``root/<class>/**/<image>``) or a CSV file list (``path,label``); tar shards
    (a folder written by ``gpupipe prepare``, a ``.tar``, a glob or a list of them) go to :mod:`.shards`.

    Directory scans reuse torchvision's own ``find_classes``/``make_dataset``, so ``classes``,
    ``class_to_idx`` and the ``samples`` order equal ``torchvision.datasets.ImageFolder(root)`` exactly.
    CSV paths are relative to the CSV's folder and may not leave it unless ``allow_outside_root``.
    """
    from .shards import is_shard_source, scan_shards  # defer: shards imports ImageList from here

    if is_shard_source(root):
        return scan_shards(root)
    path = Path(root)
    if path.is_dir():
        classes, class_to_idx = find_classes(str(path))
        samples = make_dataset(str(path), class_to_idx, extensions=IMG_EXTENSIONS)
        return ImageList(str(path), samples, classes, class_to_idx)
    if path.is_file() and path.suffix.lower() in (".csv", ".txt"):
        return _scan_csv(path, allow_outside_root)
    if not path.exists():
        raise FileNotFoundError(f"{path}: no such directory or file list")
    raise ValueError(f"{path}: expected an ImageFolder directory or a .csv file list (path,label)")


def _scan_csv(path: Path, allow_outside_root: bool) -> ImageList:
    base = path.parent.resolve()
    rows: list[tuple[str, str]] = []
    with open(path, newline="") as f:
        for lineno, row in enumerate(csv.reader(f), 1):
            if not row or row[0].startswith("#"):
                continue
            if len(row) < 2:
                raise ValueError(f"{path}:{lineno}: expected 'path,label', got {row!r}")
            if lineno == 1 and row[0].strip().lower() in ("path", "file", "filename"):
                continue  # header
            rows.append((row[0].strip(), row[1].strip()))
    if not rows:
        raise ValueError(f"{path}: the file list is empty")
    numeric = all(label.lstrip("-").isdigit() for _, label in rows)
    if numeric:
        ints = [int(label) for _, label in rows]
        if min(ints) < 0:
            raise ValueError(f"{path}: labels must be >= 0")
        classes = [str(i) for i in range(max(ints) + 1)]
    else:
        classes = sorted({label for _, label in rows})
    class_to_idx = {c: i for i, c in enumerate(classes)}
    samples = []
    for rel, label in rows:
        full = (base / rel).resolve()
        if not allow_outside_root and not full.is_relative_to(base):
            raise ValueError(
                f"{path}: {rel!r} points outside {base}; pass allow_outside_root=True to build_loader if you trust it"
            )
        samples.append((str(full), int(label) if numeric else class_to_idx[label]))
    return ImageList(str(base), samples, classes, class_to_idx)
