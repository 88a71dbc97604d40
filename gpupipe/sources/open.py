"""The one place a source is opened: whatever ``root`` names (an ImageFolder directory, a CSV file list, tar shards:
a folder written by ``gpupipe prepare``, a ``.tar``, a glob or a list of them, on a disk or at a URL; Parquet files;
a dataset object),
:func:`open_source` returns the :class:`~gpupipe.sources.scan.ImageList` every backend reads. A new kind of source is
one more branch here and a module that builds its ``ImageList`` (a subclass when its bytes are not plain files)."""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from ..errors import MissingFileError, SourceError
from .dataset import DatasetSource, is_dataset, open_dataset
from .named import is_named_dataset, open_named
from .objstore import Remote
from .parquet import is_parquet_source, open_parquet, parquet_at
from .remote import NotPrepared, as_remote, is_url, scan_remote
from .scan import ImageList, scan_csv, scan_folder
from .shards import is_shard_source, scan_shards

Source = str | os.PathLike | Sequence[str | os.PathLike] | Remote | DatasetSource | Any  # Any: a dataset object


def open_source(
    root: Source,
    *,
    allow_outside_root: bool = False,
    class_to_idx: dict[str, int] | None = None,
) -> ImageList:
    """The samples of ``root``: an ImageFolder directory (``root/<class>/**/<image>``, exactly as torchvision's
    ``ImageFolder``), a CSV file list (``path,label``), or tar shards (a folder written by ``gpupipe prepare``, a
    ``.tar``, a glob or a list of them), on a disk or at a URL (``s3://``, ``gs://``..., or a :class:`Remote`).

    Or Parquet files: a ``.parquet`` path, glob or list, or a folder of them, on a disk or at a URL
    (:mod:`.parquet`). Or a map-style dataset object, a :class:`DatasetSource` or ``(images, labels)`` arrays
    (:mod:`.dataset`), or a dataset named ``module:callable`` or ``module.Class:ROOT`` (:mod:`.named`).

    CSV paths are relative to the CSV's folder and may not leave it unless ``allow_outside_root``.

    ``class_to_idx`` (a training set's) labels a held-out set the same way: a class it lacks is an error, a class
    missing here a warning.
    """
    if isinstance(root, str) and is_named_dataset(root):
        root = open_named(root)  # module:callable, module.Class:ROOT (the command line's way to pass a dataset)
    if is_dataset(root):
        return open_dataset(root)
    if is_parquet_source(root):
        return open_parquet(root)
    if is_url(root) or is_shard_source(root):
        shards = _at_url(root) if is_url(root) else scan_shards(root, allow_outside_root)
        if class_to_idx is not None and shards.class_to_idx != class_to_idx:
            raise SourceError(
                f"{root}: the shards' classes differ from the training set's; prepare both from "
                "folders with the same classes"
            )
        return shards
    if not isinstance(root, (str, os.PathLike)):
        raise SourceError(f"{root}: a list of sources must name tar shards")
    path = Path(root)
    if path.is_dir():
        return scan_folder(path, class_to_idx, allow_outside_root)
    if path.is_file() and path.suffix.lower() in (".csv", ".txt"):
        return scan_csv(path, allow_outside_root, class_to_idx)
    if not path.exists():
        raise MissingFileError(f"{path}: no such directory or file list")
    raise SourceError(
        f"{path}: not a data source: expected an ImageFolder directory, a .csv file list (path,label), tar shards "
        "(a folder written by `gpupipe prepare`, or .tar files) or Parquet files (.parquet)"
    )


def _at_url(root) -> ImageList:
    """Shards at a URL; a folder there that holds no prepared set but ``*.parquet`` objects is read as Parquet."""
    try:
        return scan_remote(root)
    except NotPrepared:
        remote = as_remote(root)
        found = parquet_at(remote, str(remote.url).rstrip("/"))
        if found is None:
            raise
        return found
