"""What every backend reads (:class:`ImageList`), and the scans of an ImageFolder directory (torchvision's semantics)
and of a CSV file list. :func:`gpupipe.sources.open.open_source` picks the scan for a source."""

from __future__ import annotations

import csv
import logging
import os
import re
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from decimal import Decimal, InvalidOperation
from pathlib import Path
from typing import ClassVar, NamedTuple

import numpy as np

from .._files import read_regular
from .._names import escape
from .._warn import warn_user
from ..errors import DecodeError, SourceError
from .compact import PathList, SampleList
from .walk import walk_folder

MAX_CLASSES = 1_000_000  # numeric labels are class indices: a label beyond this is a typo, not a class list


@dataclass
class ImageList:
    """What a loader reads: ``samples`` as (name, label) in dataset order, and the class names.

    Every backend gets a sample's encoded bytes through :meth:`read` (a file here; a tar member for sharded sets),
    so a new storage layout is a subclass, not a change to each backend. ``sizes`` holds each sample's upright
    (height, width) when the layout records them (a prepared set), so loaders need not read headers at start-up.
    """

    root: str
    samples: Sequence[tuple[str, int]]  # a list, or a view of a shard index
    classes: list[str]
    class_to_idx: dict[str, int] = field(default_factory=dict)
    sizes: Sequence[tuple[int, int]] | None = None
    missing: list[str] = field(default_factory=list)  # a file list's rows that name no file, as "list.csv:LINE: path"
    problems: list[tuple[str, str]] = field(default_factory=list)  # (path, why) the scan left out (sources/walk.py)
    reads_files: ClassVar[bool] = True  # samples[i][0] is a file read whole by read(); False for other layouts

    def __len__(self) -> int:
        return len(self.samples)

    def read(self, index: int) -> bytes:
        """The encoded bytes of sample ``index``; ``OSError`` when they cannot be read, or when the name is no longer
        a regular file (a fifo would block for ever, ``/dev/zero`` never end)."""
        return read_regular(self.samples[index][0])

    def read_many(self, indices: Sequence[int]) -> list[bytes | Exception]:
        """The bytes of several samples (a batch), each or the exception that stopped it; a layout that can fetch
        them concurrently (object storage) overrides this."""
        out: list[bytes | Exception] = []
        for i in indices:
            try:
                out.append(self.read(i))
            except Exception as e:  # the caller reports it with the sample's name
                out.append(e)
        return out

    def read_samples(self, indices: Sequence[int]) -> list[bytes | np.ndarray | Exception]:
        """What a loader makes a batch from: each sample's encoded bytes (:meth:`read_many`), or, for a source that
        holds pixels (a dataset of arrays), its (H, W, 3) uint8 RGB array, which is cropped without a decode."""
        return list(self.read_many(indices))

    def holds_pixels(self) -> bool:
        """Whether :meth:`read_samples` gives pixels rather than encoded bytes (a dataset of arrays): a decoder that
        can take pixels (DALI's pipeline) is then built for them instead of for bytes."""
        return False

    @property
    def shard_of(self) -> np.ndarray | None:
        """Each sample's shard number, what ``build_loader(shuffle_window=)`` groups by; None: files read one at a
        time have none."""
        return None

    @property
    def shard_files(self) -> np.ndarray | None:
        """The file holding each shard where shards are parts of files (Parquet's row groups); None otherwise."""
        return None

    def plan_reads(self, sampler) -> None:
        """Told the loader's order (its sampler) before any worker starts, for a layout that reads in blocks or
        through the node's cache as that order suits; files read one at a time need nothing."""

    @property
    def targets(self) -> list[int]:
        if isinstance(self.samples, SampleList):
            return self.samples.labels.tolist()
        return [label for _, label in self.samples]


Read = Callable[[int], bytes | np.ndarray]


def read_each(read: Read, indices: Sequence[int]) -> list[bytes | np.ndarray | Exception]:
    """``read(i)`` of each index, or the :class:`DecodeError` naming that sample: one bad sample does not end the
    batch (the loader's error policy judges it)."""
    out: list[bytes | np.ndarray | Exception] = []
    for i in indices:
        try:
            out.append(read(i))
        except DecodeError as e:
            out.append(e)
    return out


def scan_folder(path: Path, class_to_idx: dict[str, int] | None = None, allow_outside_root: bool = False) -> ImageList:
    """An ImageFolder directory (``root/<class>/**/<image>``): ``classes``, ``class_to_idx`` and the ``samples``
    order equal ``torchvision.datasets.ImageFolder(root)``'s on a tree without links to folders; links, unreadable
    folders and special files as :mod:`.walk` says (what it leaves out is in ``problems``, and logged)."""
    known = None if class_to_idx is None else (lambda names: _known_classes(path, names, class_to_idx))
    walked = walk_folder(str(path), allow_outside_root=allow_outside_root, label_classes=known)
    classes = walked.classes if class_to_idx is None else sorted(class_to_idx, key=class_to_idx.__getitem__)
    if walked.problems:
        first, why = walked.problems[0]
        more = f" and {len(walked.problems) - 1} more" if len(walked.problems) > 1 else ""
        logging.getLogger("gpupipe").warning(
            f"{path}: left out {escape(first)} ({why}){more}; `gpupipe check {path}` lists them"
        )
    samples = PathList([p for p, _ in walked.samples], [label for _, label in walked.samples])  # no tuple per sample
    found = class_to_idx or walked.class_to_idx
    return ImageList(str(path), samples, classes, found, problems=walked.problems)


def _known_classes(source: Path, names, class_to_idx: dict[str, int]) -> dict[str, int]:
    """``names`` mapped through ``class_to_idx``: unknown names are an error, absent ones a warning."""
    unknown = sorted(set(names) - set(class_to_idx))
    if unknown:
        raise SourceError(
            f"{source}: classes not in the training set: {', '.join(map(str, unknown[:10]))}"
            + (f" and {len(unknown) - 10} more" if len(unknown) > 10 else "")
        )
    absent = sorted(set(class_to_idx) - set(names))
    if absent:
        warn_user(
            f"{source}: no samples of {len(absent)} training class(es): "
            f"{', '.join(map(str, absent[:10]))}{' ...' if len(absent) > 10 else ''}"
        )
    return {n: class_to_idx[n] for n in names}


_HEADER_WORDS = {"path", "file", "filename", "filepath", "file_path", "image", "image_path", "img", "name"}


def _is_int(label: str) -> bool:
    """An integer as a CSV writes one: ASCII digits, maybe a minus (``str.isdigit`` takes ``²`` and ``٣`` too)."""
    return re.fullmatch(r"-?[0-9]+", label) is not None


class _Row(NamedTuple):
    lineno: int
    path: str
    label: str


def scan_csv(path: Path, allow_outside_root: bool, class_to_idx: dict[str, int] | None = None) -> ImageList:
    """Rows ``path,label``; labels are all integers (class indices) or all names. The first row is a header when its
    first column is a usual header word (``path``, ``image``...), or names no file and either has no file extension
    (a column title, not a missing image) or is the only row whose label is not an integer."""
    base = path.parent.resolve()
    read = _csv_rows(path)
    rows = _without_header(read, base)
    if not rows:
        raise SourceError(f"{path}: the file list is empty" + (" (a header row, no file under it)" if read else ""))
    rows = _whole_decimals(path, rows, class_to_idx)
    numeric = _labels_are_indices(path, rows)
    if class_to_idx is not None:  # a held-out set, labelled as the training set
        names = {row.label for row in rows}
        if numeric:
            _check_indices(path, names, len(class_to_idx))
        else:
            _known_classes(path, names, class_to_idx)
        classes = sorted(class_to_idx, key=class_to_idx.__getitem__)
    elif numeric:
        classes = [str(i) for i in range(max(int(row.label) for row in rows) + 1)]
    else:
        classes = sorted({row.label for row in rows})
    class_to_idx = class_to_idx or {c: i for i, c in enumerate(classes)}
    paths = [_resolve(path, base, row.path, allow_outside_root) for row in rows]
    missing = [
        f"{path}:{row.lineno}: {row.path}" + (" (a folder)" if os.path.isdir(full) else "")
        for row, full in zip(rows, paths, strict=True)
        if not os.path.isfile(full)
    ]
    samples = PathList(
        paths, [_label(row.label, numeric, class_to_idx) for row in rows]
    )  # one buffer and an array: no tuple per row for forked workers to copy
    return ImageList(str(base), samples, classes, class_to_idx, missing=missing)


def _csv_rows(path: Path) -> list[_Row]:
    """The rows with a path and a label; blank rows and ``#`` comments are left out. A first row whose first cell is
    empty, with two more after it, is the header pandas writes with its index (``df.to_csv()``): that column is left
    out of every row (it was read as the paths: "0", "1", ... "do not exist")."""
    rows: list[_Row] = []
    skip = 0
    with open(path, newline="", encoding="utf-8-sig") as f:  # utf-8-sig: Excel's byte-order mark
        for lineno, row in enumerate(csv.reader(f), 1):
            if not row or row[0].startswith("#"):
                continue
            if not rows and not skip and len(row) >= 3 and not row[0].strip():
                skip = 1  # (pandas' index column: its header cell is empty)
            row = row[skip:]
            if len(row) < 2:
                raise SourceError(f"{path}:{lineno}: expected 'path,label', got {row!r}")
            if "\0" in row[0]:  # the OS refuses it ("embedded null byte"): said here, with the line
                raise SourceError(f"{path}:{lineno}: the path {row[0]!r} holds a NUL byte, which no file name can")
            rows.append(_Row(lineno, row[0].strip(), row[1].strip()))
    return rows


def _without_header(rows: list[_Row], base: Path) -> list[_Row]:
    if len(rows) == 1:  # a header with no data under it: column titles naming no file
        only, name = rows[0], rows[0].path.lower()
        titles = name in _HEADER_WORDS or (not os.path.splitext(name)[1] and not _is_index(only.label))
        return [] if titles and not (base / only.path).is_file() else rows
    if len(rows) < 2:  # a header is followed by data
        return rows
    first = rows[0]
    others_int = all(_is_index(row.label) for row in rows[1:])
    a_file = (base / first.path).is_file()
    name = first.path.lower()
    if name in _HEADER_WORDS or (
        not a_file and (not os.path.splitext(name)[1] or (others_int and not _is_index(first.label)))
    ):
        return rows[1:]
    return rows


def _labels_are_indices(path: Path, rows: list[_Row]) -> bool:
    """Whether the labels are class indices (else class names); a mix of both, or a negative index, is an error."""
    numeric = _is_int(rows[0].label)
    for lineno, _, label in rows:
        if _is_int(label) != numeric:
            first = rows[0]
            if not numeric and _is_number(first.label):  # (1.5, then 1): the first one is the odd one out
                raise SourceError(
                    f"{path}:{first.lineno}: label {first.label!r} is a number but not a class index, and the label "
                    f"on line {lineno} ({label!r}) is one: class indices are whole numbers 0..n-1; use class indices "
                    "or class names, not both"
                )
            kind = "a class index (a whole number)" if numeric else "a class name"
            raise SourceError(
                f"{path}:{lineno}: label {label!r} is not {kind} like the label on line {rows[0].lineno} "
                f"({rows[0].label!r}); use class indices or class names, not both"
            )
        if numeric and (problem := index_problem(label)) is not None:
            raise SourceError(f"{path}:{lineno}: {problem}")
    return numeric


def _whole_decimals(path: Path, rows: list[_Row], class_to_idx: dict[str, int] | None) -> list[_Row]:
    """A label column of whole numbers with decimals among them (``2.0``: pandas writes a label column so once it
    holds a gap) as the class indices it holds: read as names, they were sorted as text (``10.0`` before ``2.0``),
    silently. A gap among them (``nan``, or nothing) is an error naming its line. Left as they are: a column with any
    other label (``0.5``, ``cat``: names), and one whose every label is a class of the training set (the held-out set
    of a model trained on such names)."""
    labels = {row.label for row in rows}
    if all(_is_int(label) for label in labels) or (class_to_idx is not None and labels <= class_to_idx.keys()):
        return rows
    present = [row for row in rows if not _is_gap(row.label)]
    values = [_whole(row.label) for row in present]
    if not present or any(value is None for value in values):
        return rows
    if len(present) < len(rows):
        gap = next(row for row in rows if _is_gap(row.label))
        raise SourceError(
            f"{path}:{gap.lineno}: label {gap.label!r} is a missing value among class indices (a column with a gap, "
            "as pandas writes one): give every image its class"
        )
    out = []
    for row, value in zip(rows, values, strict=True):
        assert value is not None  # (checked above)
        if value < 0 or value >= MAX_CLASSES:  # the integer's own words, the label as written
            problem = index_problem("-1" if value < 0 else str(MAX_CLASSES), written=row.label)
            raise SourceError(f"{path}:{row.lineno}: {problem}")
        out.append(row._replace(label=str(int(value))))
    return out


def _is_gap(label: str) -> bool:
    return label == "" or label.lower() == "nan"


def _whole(label: str) -> Decimal | None:
    """The value of a label that writes a whole number (``2``, ``2.0``, ``1e3``), else None."""
    if not _is_number(label):
        return None
    try:
        value = Decimal(label)
    except InvalidOperation:  # (an exponent past what Decimal holds)
        return None
    return value if value == value.to_integral_value() else None


def _is_index(label: str) -> bool:
    """A class index, as an integer or a whole decimal (the header's test: a column title is neither)."""
    return _is_int(label) or _whole(label) is not None


_NUMBER = re.compile(r"[-+]?(\d+\.?\d*|\.\d+)([eE][-+]?\d+)?", re.ASCII)


def _is_number(label: str) -> bool:
    """Whether a label is a decimal number (``1.5``, ``2.0``, ``1e3``; not ``nan`` or ``inf``, which may be names)."""
    return _NUMBER.fullmatch(label) is not None


def index_problem(label: str, written: str | None = None) -> str | None:
    """Why a numeric label (ASCII digits after an optional minus) is no class index, or ``None`` when it is one;
    ``written``: the label as the file wrote it, when that was another form (``-1.0``)."""
    shown = _short(written or label)
    if label.startswith("-") and label.lstrip("-0"):
        return f"label {shown} must be >= 0"
    if _too_large(label):
        return (
            f"label {shown} would make more than {MAX_CLASSES:,} classes (labels are class indices 0..n-1; "
            f"at most {MAX_CLASSES:,} classes)"
        )
    return None


def _too_large(label: str) -> bool:
    """An index at or past MAX_CLASSES, told without int() for a label of thousands of digits (which Python refuses
    to convert past 4,300 digits)."""
    digits = label.lstrip("0") or "0"
    return len(digits) > len(str(MAX_CLASSES)) or int(digits) >= MAX_CLASSES


def _short(label: str) -> str:
    return label if len(label) <= 24 else f"{label[:12]}...({len(label)} characters)"


def _check_indices(path: Path, labels: set[str], num_classes: int) -> None:
    beyond = {n for n in labels if int(n) >= num_classes}
    if beyond:
        raise SourceError(
            f"{path}: labels {', '.join(sorted(beyond, key=int))} are beyond the training set's {num_classes} classes"
        )


def _resolve(path: Path, base: Path, rel: str, allow_outside_root: bool) -> str:
    """A row's path: absolute as written, relative to the list's folder, which ``..`` may not leave unless
    ``allow_outside_root``."""
    full = (base / rel).resolve()
    if not allow_outside_root and not Path(rel).is_absolute() and not full.is_relative_to(base):
        raise SourceError(
            f"{path}: {rel!r} points outside {base} (relative paths are read from the list's folder); write it as "
            "an absolute path, or pass allow_outside_root=True to build_loader (--allow-outside-root to gpupipe train, "
            "check, eval) if you trust it"
        )
    return str(full)


def _label(label: str, numeric: bool, class_to_idx: dict[str, int]) -> int:
    return int(label) if numeric else class_to_idx[label]
