"""Parquet files as the :class:`~gpupipe.sources.scan.ImageList` every backend reads: a path, a glob, a folder of
``*.parquet`` or a list of them, in the Hugging Face Hub's layout (an image column of ``{bytes, path}`` structs or of
encoded bytes, a label column, class names in the schema's metadata), read with pyarrow one row group at a time."""

from __future__ import annotations

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
from ..errors import DecodeError
from .compact import SampleList
from .dataset import IMAGE_FIELDS, LABEL_FIELDS
from .scan import ImageList

_KEPT_GROUPS = 4  # row groups a reading process keeps decoded from Parquet (a batch often spans two)


ParquetSource = str | os.PathLike | Sequence[str | os.PathLike]


def is_parquet_source(root: object) -> TypeGuard[ParquetSource]:
    """A ``.parquet`` path or glob, a folder holding ``*.parquet`` files, or a list of ``.parquet`` paths."""
    if isinstance(root, (list, tuple)):
        return len(root) > 0 and all(isinstance(p, (str, os.PathLike)) and _is_parquet(p) for p in root)
    if not isinstance(root, (str, os.PathLike)):
        return False
    if _is_parquet(root):
        return True
    path = Path(root)
    return path.is_dir() and any(path.glob("*.parquet")) and not any(p.is_dir() for p in path.iterdir())


def _is_parquet(path: str | os.PathLike) -> bool:
    return os.fspath(path).lower().endswith(".parquet")


def parquet_files(root: ParquetSource) -> list[str]:
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
        raise FileNotFoundError(f"{text}: no .parquet files")
    return found


class RowNames(SampleList):
    """``(name, label)`` per row: ``FILE row R``, from each row's file number and row in it."""

    def __init__(self, files: list[str], file_of: np.ndarray, row: np.ndarray, labels: np.ndarray):
        self.files, self.file_of, self.row, self.labels = files, file_of, row, labels

    def name(self, i: int) -> str:
        return f"{self.files[self.file_of[i]]} row {self.row[i]}"


class ParquetImageList(ImageList):
    """Rows of Parquet files: the label column read once when the list is made, the image column one row group at a
    time in the process that reads (a few kept: a loader's batch of neighbouring rows reads its group once)."""

    reads_files = False

    def __init__(self, root: ParquetSource):
        require("pyarrow", "parquet")
        import pyarrow.parquet as pq  # deferred: an optional dependency

        files = parquet_files(root)
        metas = [_open(pq, f) for f in files]
        self.image_key, self.label_key = _columns(files[0], metas[0].schema_arrow)
        labels, file_of, rows, starts = [], [], [], []
        for k, (f, meta) in enumerate(zip(files, metas, strict=True)):
            column = _read(pq, f, [self.label_key]).column(0)
            labels.append(_labels(f, column))
            file_of.append(np.full(len(column), k, np.int32))
            rows.append(np.arange(len(column), dtype=np.int64))
            starts.append(np.cumsum([0] + [meta.metadata.row_group(g).num_rows for g in range(meta.num_row_groups)]))
        all_labels = np.concatenate(labels)
        if len(all_labels) == 0:
            raise ValueError(f"{files[0]}: the Parquet files hold no rows")
        classes = _class_names(metas[0].schema_arrow, self.label_key) or []
        count = int(all_labels.max()) + 1
        if len(classes) < count:
            classes = [str(i) for i in range(count)]
        names = RowNames(files, np.concatenate(file_of), np.concatenate(rows), all_labels)
        where = os.fspath(root) if isinstance(root, (str, os.PathLike)) else os.path.dirname(files[0]) or "."
        super().__init__(where, names, classes, {c: i for i, c in enumerate(classes)})
        self.files, self.group_starts = files, starts
        self._groups: OrderedDict[tuple[int, int], list[Any]] = OrderedDict()

    def __getstate__(self):  # a spawned worker keeps its own row groups
        return {**self.__dict__, "_groups": OrderedDict()}

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
        out: list[bytes | np.ndarray | Exception] = []
        for i in indices:
            try:
                out.append(self.read(i))
            except DecodeError as e:
                out.append(e)
        return out

    def _group(self, k: int, group: int) -> list[Any]:
        """Row group ``group`` of file ``k``'s image column, as Python values (kept, a few at a time)."""
        key = (k, group)
        if key in self._groups:
            self._groups.move_to_end(key)
            return self._groups[key]
        import pyarrow.parquet as pq  # deferred: an optional dependency

        with pq.ParquetFile(self.files[k]) as f:
            values = f.read_row_group(group, columns=[self.image_key]).column(0).to_pylist()
        self._groups[key] = values
        while len(self._groups) > _KEPT_GROUPS:
            self._groups.popitem(last=False)
        return values


def _open(pq, path: str):
    try:
        return pq.ParquetFile(path)
    except FileNotFoundError:
        raise FileNotFoundError(f"{path}: no such Parquet file") from None
    except Exception as e:  # not Parquet, truncated
        raise ValueError(f"{path}: cannot read it as Parquet ({type(e).__name__}: {e})") from None


def _read(pq, path: str, columns: list[str]):
    return pq.read_table(path, columns=columns)


def _columns(path: str, schema) -> tuple[str, str]:
    """The image and label columns, by the usual names (as a dataset's fields)."""
    names = schema.names
    image = next((n for n in IMAGE_FIELDS if n in names), None)
    label = next((n for n in LABEL_FIELDS if n in names), None)
    if image is None or label is None:
        raise ValueError(
            f"{path}: columns {', '.join(names)}; expected an image column ({', '.join(IMAGE_FIELDS)}) and a label "
            f"column ({', '.join(LABEL_FIELDS)})"
        )
    return image, label


def _labels(path: str, column) -> np.ndarray:
    if column.null_count:
        raise ValueError(f"{path}: {column.null_count} row(s) have no label")
    labels = np.asarray(column.to_numpy(zero_copy_only=False))
    if labels.dtype.kind not in "iu" or (len(labels) and labels.min() < 0):
        raise ValueError(f"{path}: the labels are {labels.dtype} values; expected class indices (whole numbers >= 0)")
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
