"""Parquet files as the :class:`~gpupipe.sources.scan.ImageList` every backend reads: a path, a glob, a folder of
``*.parquet`` or a list of them, on a disk or at a URL (``s3://bucket/train/*.parquet``, a folder, a list), in the
Hugging Face Hub's layout (an image column of ``{bytes, path}`` structs or of encoded bytes, a label column, class
names in the schema's metadata), read with pyarrow one row group at a time.

A row group is what ``build_loader(shuffle_window=K)`` groups by (a tar shard's part): the files in a random order,
each file's groups in a random order, ``K`` groups at a time with their rows shuffled among themselves, so a batch
reads at most ``2K`` groups and an epoch needs each file during one stretch of it
(:func:`~gpupipe.data.sampler.window_order`). Files at a URL are read as shards at a URL are (:mod:`.remote`): each
fetched whole once per node into the node's shard cache (:mod:`.cache`), the next ones read ahead; a file's labels
and row groups indexed once per object version and kept on the local disk; each row group read by range where the
cache is off or the loader's order cannot use it.
"""

from __future__ import annotations

import dataclasses
import glob
import json
import os
from collections import OrderedDict
from collections.abc import Sequence
from pathlib import Path
from typing import Any, TypeGuard

import numpy as np

from .._deps import require
from .._files import read_regular
from .._system import local_ranks
from .._warn import warn_user
from ..errors import DecodeError, MissingFileError, SourceError
from .cache import Pinned
from .cached import ReadAhead, plan
from .compact import SampleList
from .dataset import IMAGE_FIELDS, LABEL_FIELDS
from .objstore import Remote, Store
from .remote import _expand, _listed, _shard_cache, as_remote, is_url, remote_index
from .scan import ImageList, read_each

_KEPT_GROUPS = 4  # row groups a reading process keeps decoded from Parquet (a batch often spans two)
_OPEN_FILES = 8  # local Parquet files a reading process keeps open (mapped), the least recently used dropped first
_INDEX_KEYS = ("label", "group_rows", "columns", "classes")


ParquetSource = str | os.PathLike | Sequence[str | os.PathLike] | Remote


def is_parquet_source(root: object) -> TypeGuard[ParquetSource]:
    """A ``.parquet`` path, glob or URL, a folder holding ``*.parquet`` files, or a list of ``.parquet`` paths or URLs
    (a :class:`Remote` of one of them too). A folder at a URL is known by listing it (:mod:`.remote`)."""
    if isinstance(root, Remote):
        return is_parquet_source(root.url)
    if isinstance(root, (list, tuple)):
        return len(root) > 0 and all(isinstance(p, (str, os.PathLike)) and _is_parquet(p) for p in root)
    if not isinstance(root, (str, os.PathLike)):
        return False
    if _is_parquet(root):
        return True
    if is_url(root):
        return False
    path = Path(root)
    return path.is_dir() and any(path.glob("*.parquet")) and not any(p.is_dir() for p in path.iterdir())


def _is_parquet(path: str | os.PathLike) -> bool:
    return os.fspath(path).lower().endswith(".parquet")


def parquet_files(root: str | os.PathLike | Sequence[str | os.PathLike]) -> list[str]:
    """The files ``root`` names, in order (a glob's and a folder's sorted)."""
    if not isinstance(root, (str, os.PathLike)):
        return [os.fspath(p) for p in root]
    text = os.fspath(root)
    if Path(text).is_dir():
        found = sorted(str(p) for p in Path(text).glob("*.parquet"))
    elif glob.has_magic(text):
        found = sorted(glob.glob(text))
    else:
        found = [text]
    if not found:
        raise MissingFileError(f"{text}: no .parquet files")
    return found


def open_parquet(root: ParquetSource) -> ParquetImageList:
    """The rows of the Parquet files ``root`` names, on this machine's disks or at a URL."""
    if is_url(root):
        remote = as_remote(root)
        return open_parquet_remote(remote, [remote.url] if isinstance(remote.url, str) else list(remote.url))
    assert not isinstance(root, Remote)  # a Remote is a URL
    files = parquet_files(root)
    where = os.fspath(root) if isinstance(root, (str, os.PathLike)) else os.path.dirname(files[0]) or "."
    return ParquetImageList(where, files, [file_index(Path(f), f) for f in files])


def open_parquet_remote(remote: Remote, urls: list[str]) -> RemoteParquetImageList:
    """Parquet objects at ``urls`` (globs and braces expanded), each indexed once per object version."""
    store = Store(remote, urls[0])
    urls = _expand(store, urls)
    listed = _listed(store, urls)
    parts = [remote_index(store, u, listed.get(u), file_index, _INDEX_KEYS) for u in urls]
    where = remote.url if isinstance(remote.url, str) else os.path.dirname(urls[0])
    return RemoteParquetImageList(store, where, urls, parts, listed)


def parquet_at(remote: Remote, folder: str) -> RemoteParquetImageList | None:
    """The ``*.parquet`` objects directly in ``folder`` (a URL), or None where it holds none."""
    store = Store(remote, folder)
    found = [u for u in store.glob(f"{folder}/*") if _is_parquet(u)]
    return open_parquet_remote(dataclasses.replace(remote, url=folder), found) if found else None


def file_index(path: Path, name: str) -> dict[str, np.ndarray]:
    """What start-up needs of one Parquet file (``name``: its path or URL, for messages): each row's label, each row
    group's row count, the image and label columns' names and the class names its schema's metadata gives."""
    require("pyarrow", "parquet")
    import pyarrow.parquet as pq  # deferred: an optional dependency

    try:
        f = pq.ParquetFile(path)
    except FileNotFoundError:
        raise MissingFileError(f"{name}: no such Parquet file") from None
    except Exception as e:  # not Parquet, truncated
        raise SourceError(f"{name}: cannot read it as Parquet ({type(e).__name__}: {e})") from None
    with f:
        image, label = _columns(name, f.schema_arrow)
        column = f.read(columns=[label]).column(0)
        rows = [f.metadata.row_group(g).num_rows for g in range(f.num_row_groups)]
        classes = _class_names(f.schema_arrow, label) or []
    return {
        "label": _labels(name, column),
        "group_rows": np.array(rows, np.int64),
        "columns": np.array([image, label]),
        "classes": np.array(classes, dtype=str),
    }


class RowNames(SampleList):
    """``(name, label)`` per row: ``FILE row R``, from each row's file number and row in it."""

    def __init__(self, files: list[str], file_of: np.ndarray, row: np.ndarray, labels: np.ndarray):
        self.files, self.file_of, self.row, self.labels = files, file_of, row, labels

    def name(self, i: int) -> str:
        return f"{self.files[self.file_of[i]]} row {self.row[i]}"


class ParquetImageList(ImageList):
    """Rows of Parquet files: the labels read when the list is made (:func:`file_index`), the image column one row
    group at a time in the process that reads (a few kept: a loader's batch of neighbouring rows reads its group
    once; with a ``shuffle_window`` of ``K`` groups, the ``2K`` a batch may span)."""

    reads_files = False

    def __init__(self, where: str, files: list[str], parts: list[dict[str, np.ndarray]]):
        self.image_key, self.label_key = (str(c) for c in parts[0]["columns"])
        all_labels = np.concatenate([p["label"] for p in parts])
        if len(all_labels) == 0:
            raise SourceError(f"{files[0]}: the Parquet files hold no rows")
        classes = [str(c) for c in parts[0]["classes"]]
        count = int(all_labels.max()) + 1
        if len(classes) < count:
            classes = [str(i) for i in range(count)]
        file_of = np.concatenate([np.full(len(p["label"]), k, np.int32) for k, p in enumerate(parts)])
        rows = np.concatenate([np.arange(len(p["label"]), dtype=np.int64) for p in parts])
        names = RowNames(files, file_of, rows, all_labels)
        super().__init__(where, names, classes, {c: i for i, c in enumerate(classes)})
        self.files, self.file_of = files, file_of
        self.group_starts = [np.concatenate([[0], np.cumsum(p["group_rows"])]) for p in parts]
        # each row group's number over all files (what a shuffle window groups by), and the file that holds it
        first = np.cumsum([0] + [len(p["group_rows"]) for p in parts])
        self._group_of = np.concatenate(
            [first[k] + np.searchsorted(s, np.arange(s[-1]), side="right") - 1 for k, s in enumerate(self.group_starts)]
        ).astype(np.int64)
        self._group_file = np.concatenate([np.full(len(p["group_rows"]), k, np.int64) for k, p in enumerate(parts)])
        self.kept_groups = _KEPT_GROUPS
        self._groups: OrderedDict[tuple[int, int], list[Any]] = OrderedDict()
        # file number -> (what it was opened from: its path, or the pin of its cached copy; its pyarrow ParquetFile)
        self._opened: OrderedDict[int, tuple[object, Any]] = OrderedDict()
        self._pid = os.getpid()

    def __getstate__(self):  # a spawned worker keeps its own row groups and opens its own files
        return {**self.__dict__, "_groups": OrderedDict(), "_opened": OrderedDict()}

    @property
    def shard_of(self) -> np.ndarray:
        """Each row's row group, numbered over all the files."""
        return self._group_of

    @property
    def shard_files(self) -> np.ndarray:
        return self._group_file

    def plan_reads(self, sampler) -> None:
        """Keep the row groups a batch of the loader's order may span decoded. A global shuffle over more groups than
        that is worth a warning, once, with the fix: Parquet has no access to one row, so nearly every sample then
        costs a whole group's read and decompression."""
        self.kept_groups = max(_KEPT_GROUPS, 2 * (sampler.window or 0))
        groups = len(self._group_file)
        if sampler.shuffle and sampler.window is None and groups > self.kept_groups:
            rows = len(self._group_of) / groups
            warn_user(
                f"{self.root}: a global shuffle over {groups} Parquet row groups (about {rows:.0f} rows each) reads "
                "and decompresses a whole group for nearly every sample; shuffle_window=K (16, say) reads each group "
                "once an epoch, K groups' rows shuffled together (or prepare the set into tar shards: gpupipe "
                "prepare)"
            )

    def read(self, index: int) -> bytes:
        """Row ``index``'s encoded image; a :class:`DecodeError` naming the file and row when it holds none."""
        assert isinstance(self.samples, RowNames)
        k, row = int(self.samples.file_of[index]), int(self.samples.row[index])
        group = int(np.searchsorted(self.group_starts[k], row, side="right")) - 1
        value = self._group(k, group)[row - int(self.group_starts[k][group])]
        try:
            return _image_bytes(value, os.path.dirname(self.files[k]))
        except (DecodeError, OSError) as e:
            why = e.reason if isinstance(e, DecodeError) else f"cannot read the file ({e})"
            raise DecodeError(self.samples.name(index), "parquet", why) from None

    def read_samples(self, indices: Sequence[int]) -> list[bytes | np.ndarray | Exception]:
        return read_each(self.read, indices)

    def _group(self, k: int, group: int) -> list[Any]:
        """Row group ``group`` of file ``k``'s image column, as Python values (kept, a few at a time)."""
        key = (k, group)
        if key in self._groups:
            self._groups.move_to_end(key)
            return self._groups[key]
        values = self._read_group(k, group)
        self._groups[key] = values
        while len(self._groups) > self.kept_groups:
            self._groups.popitem(last=False)
        return values

    def _read_group(self, k: int, group: int) -> list[Any]:
        return _group_values(self._open(k, self.files[k]), group, self.image_key)

    def _open(self, k: int, source: object) -> Any:
        """File ``k`` opened once in this process from ``source`` (its path, or the pin of its cached copy: opened
        again once that pin was let go), memory-mapped, as a tar shard is (an open per row group read its footer again,
        and a read through a buffer copied every column chunk first: ~2.5x the time of a group)."""
        if self._pid != os.getpid():  # a forked worker: its parent's files are not its own to share
            self._opened, self._pid = OrderedDict(), os.getpid()
        opened = self._opened.pop(k, None)
        if opened is None or opened[0] is not source:
            while len(self._opened) >= _OPEN_FILES:  # dropped, not closed: a thread may still be reading it
                self._opened.popitem(last=False)
            path = source.path if isinstance(source, Pinned) else source
            opened = (source, _parquet_file(path, memory_map=True))
        self._opened[k] = opened  # last: kept in order of use
        return opened[1]


class RemoteParquetImageList(ParquetImageList):
    """Parquet objects at URLs, read through the node's shard cache as shards at a URL are (each object fetched whole
    once per node, the coming ones read ahead), or a row group at a time by range where the cache is off or a
    shuffled epoch cannot use it."""

    def __init__(
        self, store: Store, where: str, urls: list[str], parts: list[dict[str, np.ndarray]], listed: dict[str, dict]
    ):
        super().__init__(where, urls, parts)
        self.store = store
        self.cache = _shard_cache(store, urls, listed)  # None: no cache folder
        self.cached = self.cache is not None and plan(self.cache.sizes, self.cache.cache.limit, True, None).cached
        self.read_ahead: ReadAhead | None = None

    def __getstate__(self):  # a spawned worker reads; the read ahead is its parent's
        return {**super().__getstate__(), "read_ahead": None}

    def plan_reads(self, sampler) -> None:
        """As shards at a URL (:meth:`~.remote.RemoteShardImageList.plan_reads`), a file standing for a shard: a
        window of ``K`` row groups spans at most ``K`` files."""
        super().plan_reads(sampler)
        if self.cache is None:
            return
        how = plan(self.cache.sizes, self.cache.cache.limit, sampler.shuffle, sampler.window, local_ranks())
        self.cached, self.cache.keep = how.cached, how.keep
        if how.cached and how.ahead:
            self.read_ahead = ReadAhead(self.cache, sampler, self.file_of, how.ahead)
        elif how.why:
            warn_user(f"{self.root}: {how.why}")

    def _read_group(self, k: int, group: int) -> list[Any]:
        url = self.files[k]
        if self.cached:
            assert self.cache is not None  # cached: there is one
            with self.cache.using(k) as pinned:  # kept pinned, as a cached shard is, and kept open while it is
                return _group_values(self._open(k, pinned), group, self.image_key)

        def by_range() -> list[Any]:
            with self.store.fs.open(self.store.path(url), "rb", block_size=1 << 20) as f, _parquet_file(f) as pf:
                return _group_values(pf, group, self.image_key)

        return self.store.call(url, by_range)


def _group_values(f: Any, group: int, column: str) -> list[Any]:
    """Row group ``group`` of ``column`` of a pyarrow ``ParquetFile`` as Python values, read and decompressed on this
    thread (pyarrow's pool of threads would take the other decode workers' cores)."""
    return f.read_row_group(group, columns=[column], use_threads=False).column(0).to_pylist()


def _parquet_file(source: Any, memory_map: bool = False) -> Any:
    """A pyarrow ``ParquetFile`` of a path (``memory_map``: a local file mapped, read without a copy of each column
    chunk first) or of an open file."""
    import pyarrow.parquet as pq  # deferred: an optional dependency

    return pq.ParquetFile(source, memory_map=memory_map)


def _columns(path: str, schema) -> tuple[str, str]:
    """The image and label columns, by the usual names (as a dataset's fields)."""
    names = schema.names
    image = next((n for n in IMAGE_FIELDS if n in names), None)
    label = next((n for n in LABEL_FIELDS if n in names), None)
    if image is None or label is None:
        raise SourceError(
            f"{path}: columns {', '.join(names)}; expected an image column ({', '.join(IMAGE_FIELDS)}) and a label "
            f"column ({', '.join(LABEL_FIELDS)})"
        )
    return image, label


def _labels(path: str, column) -> np.ndarray:
    if column.null_count:
        raise SourceError(f"{path}: {column.null_count} row(s) have no label")
    labels = np.asarray(column.to_numpy(zero_copy_only=False))
    if labels.dtype.kind not in "iu" or (len(labels) and labels.min() < 0):
        raise SourceError(f"{path}: the labels are {labels.dtype} values; expected class indices (whole numbers >= 0)")
    return labels.astype(np.int64)


def _class_names(schema, label: str) -> list[str] | None:
    """The label column's class names from the schema's metadata, as the ``datasets`` library writes it
    (``huggingface``: ``info.features[label].names`` of a ``ClassLabel``)."""
    raw = (schema.metadata or {}).get(b"huggingface")
    if raw is None:
        return None
    try:
        feature = json.loads(raw)["info"]["features"][label]
    except (ValueError, KeyError, TypeError):
        return None
    names = feature.get("names") if isinstance(feature, dict) else None
    return [str(n) for n in names] if isinstance(names, list) else None


def _image_bytes(value: object, folder: str) -> bytes:
    """A cell of the image column: a ``{bytes, path}`` struct (its bytes, else its file) or encoded bytes."""
    if isinstance(value, dict):
        if value.get("bytes") is not None:
            return bytes(value["bytes"])
        if value.get("path"):
            return read_regular(os.path.join(folder, value["path"]))
        raise DecodeError("", "parquet", "the image cell holds neither bytes nor a path")
    if isinstance(value, (bytes, bytearray)):
        return bytes(value)
    raise DecodeError("", "parquet", f"the image cell is {type(value).__name__}, not encoded bytes")
