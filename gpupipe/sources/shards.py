"""Tar shards in the WebDataset layout as an :class:`ImageList`: a folder written by ``gpupipe prepare`` (metadata,
index, shards), or ``.tar`` shards written by other tools (webdataset, img2dataset), indexed once from their tar
headers and cached. A sample is read by random access through the index (an mmap of its shard), so every backend
keeps the global per-epoch shuffle, the sharding over ranks and mid-epoch resume.
"""

from __future__ import annotations

import errno
import glob
import hashlib
import io
import json
import mmap
import os
import re
import resource
import tarfile
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import BinaryIO, NamedTuple, cast

import numpy as np

from .._files import is_regular_file, open_regular, write_atomic
from .._system import usable_cores
from ..errors import MissingFileError, SourceError
from .compact import SampleList
from .scan import MAX_CLASSES, ImageList, index_problem

META = "gpupipe.json"  # a prepared folder's metadata: its presence marks a complete prepared set
INDEX = "index.npz"  # per-sample columns of a prepared folder
FORMAT = "gpupipe-shards"
VERSION = 1
IMAGE_EXTS = ("jpg", "jpeg", "png", "webp")
LABEL_FIELDS = ("label", "cls")  # where a ``key.json`` holds the label
_INDEX_SUFFIX = ".gpupipe-index.npz"  # the header index of a foreign shard, cached next to it
_INDEX_VERSION = 1
_MAX_OPEN = 256  # shard maps kept open per process at most: each holds a file descriptor (see _open_limit)


class _Samples(SampleList):
    """A shard index's ``(name, label)`` per sample; a name is ``shard.tar:member``."""

    def __init__(self, shard_names: list[str], shard: np.ndarray, members: np.ndarray | None, labels: np.ndarray):
        self._shards, self._shard, self._members, self.labels = shard_names, shard, members, labels

    def name(self, i: int) -> str:
        member = f"{i:08d}.jpg" if self._members is None else str(self._members[i])
        return f"{self._shards[self._shard[i]]}:{member}"


class _Sizes(Sequence):
    """Upright ``(height, width)`` per sample, from the index arrays."""

    def __init__(self, heights: np.ndarray, widths: np.ndarray):
        self.heights, self.widths = heights, widths

    def __len__(self) -> int:
        return len(self.heights)

    def __getitem__(self, i):
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        return int(self.heights[i]), int(self.widths[i])

    def __array__(self, dtype=None, copy=None) -> np.ndarray:
        """``np.asarray(sizes)``: an (N, 2) array, without a Python object per sample."""
        return np.stack([self.heights, self.widths], axis=1).astype(dtype or np.int64)


class ShardImageList(ImageList):
    """Samples stored as members of uncompressed tar shards; :meth:`read` slices them out of a per-process mmap."""

    reads_files = False

    def __init__(
        self,
        root: str,
        shard_paths: list[str],
        shard: np.ndarray,
        offset: np.ndarray,
        size: np.ndarray,
        labels: np.ndarray,
        classes: list[str],
        *,
        members: np.ndarray | None = None,
        heights: np.ndarray | None = None,
        widths: np.ndarray | None = None,
    ):
        names = [os.path.basename(p) for p in shard_paths]
        sizes = _Sizes(heights, widths) if heights is not None and widths is not None else None
        super().__init__(
            root, _Samples(names, shard, members, labels), classes, {c: i for i, c in enumerate(classes)}, sizes
        )
        self.shard_paths, self.labels = shard_paths, labels
        self._shard, self._offset, self._size = shard, offset, size
        self._maps: dict[int, mmap.mmap | BinaryIO] = {}
        self._pid = os.getpid()

    @property
    def targets(self) -> list[int]:
        return self.labels.tolist()

    @property
    def shard_of(self) -> np.ndarray:
        """Each sample's shard number (what ``build_loader(shuffle_window=)`` groups by)."""
        return self._shard

    def read(self, index: int) -> bytes:
        if self._pid != os.getpid():  # a forked worker: its parent's maps are not its own to share
            self._close()
            self._pid = os.getpid()
        s = int(self._shard[index])
        mm = self._maps.pop(s, None)
        if mm is None:
            mm = self._open(s)
        self._maps[s] = mm  # last: the maps are kept in order of use, the least recently used first to go
        start = int(self._offset[index])
        size = int(self._size[index])
        data = (
            os.pread(mm.fileno(), size, start)
            if isinstance(mm, io.IOBase)
            else cast(mmap.mmap, mm)[start : start + size]
        )
        if len(data) != size:
            raise OSError(f"{self.shard_paths[s]} ends before its member at byte {start} of {size} bytes: truncated?")
        return data

    def _open(self, s: int) -> mmap.mmap | BinaryIO:
        """The shard's map; its open file (read with ``pread``) where the file system refuses ``mmap``, as some
        FUSE mounts of object storage do."""
        while self._maps and len(self._maps) >= _open_limit():  # dropped, not closed: a thread may still be slicing
            self._maps.pop(next(iter(self._maps)))  # it (then freed with it)
        try:
            f = open_regular(self.shard_paths[s])  # kept open if mmap is refused; closed in _close (never a fifo)
        except OSError as e:
            if e.errno in (errno.EMFILE, errno.ENFILE):
                raise OSError(e.errno, f"{e.strerror} ({_open_files()})", self.shard_paths[s]) from None
            raise
        try:
            mm: mmap.mmap | BinaryIO = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)
            f.close()
        except (OSError, ValueError):
            mm = f
        return mm

    def _close(self) -> None:
        for mm in self._maps.values():
            mm.close()
        self._maps = {}

    def __getstate__(self):  # spawned workers open their own maps
        return {**self.__dict__, "_maps": {}, "_pid": None}


def _open_limit() -> int:
    """Shard maps one process keeps open: a quarter of its open-file limit (``ulimit -n``), the rest left to its
    DataLoader pipes, shared-memory batches and the files of other sources, and at most ``_MAX_OPEN``."""
    soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
    return _MAX_OPEN if soft == resource.RLIM_INFINITY else max(1, min(_MAX_OPEN, soft // 4))


def _open_files() -> str:
    """This process's open files beside its limit, in words."""
    limit = f"ulimit -n is {resource.getrlimit(resource.RLIMIT_NOFILE)[0]}"
    try:
        return f"this process has {len(os.listdir('/proc/self/fd')) - 1} files open, {limit}"
    except OSError:  # out of them: not even the listing opens
        return limit


def is_shard_source(root) -> bool:
    """A list of shards, a glob or brace pattern, a ``.tar`` file, or a folder written by ``gpupipe prepare``."""
    if isinstance(root, (list, tuple)):
        return True
    path = os.fspath(root)
    if (glob.has_magic(path) or _BRACES.search(path)) and not os.path.exists(path):
        return True
    if path.lower().endswith(COMPRESSED_TAR):  # read as a shard, which names it as compressed
        return True
    return path.endswith(".tar") or os.path.isfile(os.path.join(path, META)) or is_tar_folder(path)


COMPRESSED_TAR = (".tar.gz", ".tgz", ".tar.bz2", ".tbz2", ".tar.xz", ".txz", ".tar.zst")


def is_tar_folder(path: str) -> bool:
    """A local folder of WebDataset shards that ``gpupipe prepare`` did not write: ``.tar`` files and no class
    folder (an ImageFolder's, read as one)."""
    try:
        entries = list(os.scandir(path))
    except OSError:
        return False
    return any(e.name.endswith(".tar") and e.is_file() for e in entries) and not any(e.is_dir() for e in entries)


_BRACES = re.compile(r"\{[^{}]*\}")


def expand_braces(pattern: str) -> list[str]:
    """WebDataset's brace notation: ``a-{000..012}.tar`` (zero-padded as written) and ``{train,val}``, nested."""
    m = _BRACES.search(pattern)
    if m is None:
        return [pattern]
    head, body, tail = pattern[: m.start()], m[0][1:-1], pattern[m.end() :]
    rng = re.fullmatch(r"(\d+)\.\.(\d+)", body)
    if rng:
        lo, hi, width = int(rng[1]), int(rng[2]), len(rng[1])
        if hi < lo:
            raise ValueError(f"{pattern}: range {{{body}}} runs backwards")
        choices = [f"{i:0{width}d}" for i in range(lo, hi + 1)]
    else:
        choices = body.split(",")
    return [p for c in choices for p in expand_braces(head + c + tail)]


def shard_paths(root) -> list[str]:
    """The shard files ``root`` names: a path, a glob, WebDataset's braces (``train-{000000..000009}.tar``, as for
    shards at a URL), or a list of them; a name that exists as written is taken as it is."""
    entries = [os.fspath(p) for p in root] if isinstance(root, (list, tuple)) else [os.fspath(root)]
    if not entries:
        raise SourceError("the list of shards is empty")
    paths = []
    for entry in entries:
        for pattern in [entry] if os.path.exists(entry) else expand_braces(entry):
            if glob.has_magic(pattern) and not os.path.exists(pattern):
                found = sorted(glob.glob(os.path.expanduser(pattern)))
                if not found:
                    raise MissingFileError(f"{pattern}: no file matches this pattern")
                paths.extend(found)
            else:
                paths.append(pattern)
    for p in paths:
        if not os.path.isfile(p):
            raise MissingFileError(f"{p}: no such shard")
    return paths


def scan_shards(root, allow_outside_root: bool = False) -> ShardImageList:
    """The :class:`ShardImageList` for ``root`` (see :func:`is_shard_source`)."""
    if not isinstance(root, (list, tuple)) and os.path.isdir(root):
        if not os.path.isfile(os.path.join(root, META)):  # a folder of WebDataset shards: its .tar files
            return load_tars(sorted(str(p) for p in Path(root).glob("*.tar") if p.is_file()))
        return load_prepared(root, allow_outside_root)
    return load_tars(shard_paths(root))


def load_prepared(folder: str | os.PathLike, allow_outside_root: bool = False) -> ShardImageList:
    """A folder written by ``gpupipe prepare``: reads its metadata and index only (no shard is opened). Its shards
    must lie inside it (links resolved) unless ``allow_outside_root``."""
    folder = Path(folder)
    meta = json.loads((folder / META).read_text())
    if meta.get("format") != FORMAT or meta.get("version") != VERSION:
        raise SourceError(
            f"{folder / META}: format {meta.get('format')!r} version {meta.get('version')!r}; this "
            f"gpupipe reads {FORMAT!r} version {VERSION}: prepare the data again"
        )
    if not allow_outside_root:
        _shards_inside(folder, meta.get("shards", []))
    with np.load(folder / INDEX) as z:  # ``source`` (one path per sample) is left unread: start-up needs none
        cols = {k: z[k] for k in ("shard", "offset", "size", "label", "height", "width")}
    return ShardImageList(
        str(folder),
        [str(folder / n) for n in meta["shards"]],
        cols["shard"],
        cols["offset"],
        cols["size"],
        cols["label"],
        meta["classes"],
        heights=cols["height"],
        widths=cols["width"],
    )


def _shards_inside(folder: Path, names: list) -> None:
    """A prepared folder names only shards inside itself: a ``gpupipe.json`` that names any other file (an absolute
    path, ``../``) is refused, as a CSV list naming files outside its folder is. A link placed in the folder is its
    owner's doing (shards kept on another disk) and is followed."""
    root = Path(os.path.abspath(folder))
    for name in names:
        if not isinstance(name, str) or not Path(os.path.normpath(root / name)).is_relative_to(root):
            raise SourceError(
                f"{folder / META}: shard {name!r} lies outside {root}; pass allow_outside_root=True to build_loader "
                "if you trust it"
            )


def load_tars(paths: list[str]) -> ShardImageList:
    """Shards in the WebDataset layout (``key.jpg|jpeg|png|webp`` + ``key.cls`` or ``key.json``) in the given order;
    each is indexed from its tar headers on first use, several at once. Numeric labels give classes ``"0"`` ..
    ``str(max)``; string labels give their sorted names, as a CSV list does."""
    parts = index_all(paths, shard_index)
    labels, classes, shard = combine_indexes(parts, paths)
    root = os.path.commonpath([os.path.dirname(os.path.abspath(p)) for p in paths])
    return ShardImageList(
        root,
        [os.path.abspath(p) for p in paths],
        shard,
        np.concatenate([p["offset"] for p in parts]),
        np.concatenate([p["size"] for p in parts]),
        labels,
        classes,
        members=np.concatenate([p["member"] for p in parts]),
    )


def index_all(paths: list[str], index: Callable[[str], dict[str, np.ndarray]]) -> list[dict[str, np.ndarray]]:
    """``index(p)`` of every shard, in order; in a pool of processes when there are several (walking tar headers is
    Python work, slow in one process at ImageNet's size: bench/README.md), so a first use of 1.28M samples is spread
    over the cores."""
    parts = [_cached_index(p) for p in paths]
    missing = [i for i, part in enumerate(parts) if part is None]
    if len(missing) < 2:
        return [part if part is not None else index(p) for p, part in zip(paths, parts, strict=True)]
    from concurrent.futures import ProcessPoolExecutor
    from concurrent.futures.process import BrokenProcessPool

    try:
        with ProcessPoolExecutor(min(len(missing), usable_cores())) as pool:
            for i, part in zip(missing, pool.map(index, [paths[i] for i in missing]), strict=True):
                parts[i] = part
    except BrokenProcessPool:  # a worker died (killed, out of memory): what is left is walked here
        parts = [part if part is not None else index(p) for p, part in zip(paths, parts, strict=True)]
    return cast(list[dict[str, np.ndarray]], parts)


def combine_indexes(parts: list[dict[str, np.ndarray]], paths: list[str]) -> tuple[np.ndarray, list[str], np.ndarray]:
    """The shards' labels as class indices, the class names, and each sample's shard number."""
    numeric = [p["label"].dtype.kind in "iu" for p in parts]
    if any(numeric) and not all(numeric):
        raise SourceError(
            f"{paths[numeric.index(True)]} has numeric labels but {paths[numeric.index(False)]} has "
            "class names: one data set needs one kind"
        )
    labels = np.concatenate([p["label"] for p in parts])
    if all(numeric):
        if labels.size and labels.min() < 0:
            raise SourceError(f"{paths[0]}...: labels must be >= 0, found {labels.min()}")
        if labels.size and labels.max() >= MAX_CLASSES:
            ends = np.cumsum([len(p["label"]) for p in parts])
            where = paths[int(np.searchsorted(ends, int(np.argmax(labels)), side="right"))]
            raise SourceError(
                f"{where}: label {labels.max()} would make {int(labels.max()) + 1} classes (labels are class "
                f"indices 0..n-1; at most {MAX_CLASSES:,} classes)"
            )
        classes = [str(i) for i in range(int(labels.max()) + 1)]
    else:
        names, labels = np.unique(labels, return_inverse=True)
        classes = names.tolist()
    shard = np.concatenate([np.full(len(p["label"]), i, np.uint32) for i, p in enumerate(parts)])
    return labels.astype(np.int64), classes, shard


def shard_index(path: str) -> dict[str, np.ndarray]:
    """The header index of one foreign shard: ``member``, ``offset``, ``size`` of each image and its ``label``
    (integers, or class names). Cached next to the shard, or in the user cache folder when that is not writable;
    rebuilt when the shard changes (its size, modification time, or inode: see :class:`.._files.Stamp`)."""
    found = _cached_index(path)
    if found is not None:
        return found
    stamp = _stamp(path)  # before the walk: a shard rewritten meanwhile is indexed again next time
    index = index_tar(path)
    for target in _index_locations(path):
        try:
            target.parent.mkdir(parents=True, exist_ok=True)
            _save_npz(target, stamp=stamp, **index)
            break
        except OSError:
            continue
    return index


def _stamp(path: str) -> np.ndarray:
    st = os.stat(path)  # the inode's change time and number too: a copy keeping the size and time (cp -p) is caught
    return np.array([_INDEX_VERSION, st.st_size, st.st_mtime_ns, st.st_ctime_ns, st.st_dev, st.st_ino], np.int64)


def _cached_index(path: str) -> dict[str, np.ndarray] | None:
    """The cached header index of ``path`` when it is there and its stamp is the shard's as it is now."""
    stamp = _stamp(path)
    for cached in _index_locations(path):
        if not is_regular_file(cached):
            continue  # absent, or a link someone put there: not ours to read
        try:
            with np.load(cached) as z:
                if np.array_equal(z["stamp"], stamp):
                    return {k: z[k] for k in ("member", "offset", "size", "label")}
        except (OSError, KeyError, ValueError):
            continue  # absent, unreadable or from another version: build it again
    return None


def _index_locations(path: str) -> list[Path]:
    """Next to the shard when its folder is writable, else in ``$XDG_CACHE_HOME/gpupipe/shard-index``."""
    here = Path(path + _INDEX_SUFFIX)
    cache = Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpupipe" / "shard-index"
    digest = hashlib.sha256(os.path.abspath(path).encode()).hexdigest()[:16]
    elsewhere = cache / f"{digest}-{os.path.basename(path)}{_INDEX_SUFFIX}"
    return [here, elsewhere] if os.access(os.path.dirname(os.path.abspath(path)), os.W_OK) else [elsewhere]


def _save_npz(target: Path, **arrays) -> None:
    buf = io.BytesIO()
    np.savez(buf, **arrays)
    write_atomic(target, buf.getvalue(), durable=False)  # a temp file no one can predict or plant a link at


class _TarMembers(NamedTuple):
    images: dict[str, tuple[str, int, int]]  # key -> (member name, data offset, size)
    labels: dict[str, dict[str, tuple[str, bytes]]]  # "cls" or "json" -> key -> (member name, its bytes)
    order: list[str]  # the keys in the order the tar first names them


def index_tar(path: str) -> dict[str, np.ndarray]:
    """Walk a tar's headers (image data is skipped; only the small label members are read) and pair each key's
    image with its label, WebDataset's way: the key is the member name up to the first dot of its last part."""
    members = _walk_tar(path)
    images = members.images
    keys, values = _paired(path, members)
    kinds = {type(v) for v in values}
    if len(kinds) > 1:
        raise SourceError(f"{path}: labels mix numbers and class names")
    return {
        "member": np.array([images[k][0] for k in keys]),
        "offset": np.array([images[k][1] for k in keys], np.uint64),
        "size": np.array([images[k][2] for k in keys], np.uint64),
        "label": np.array(values, np.int64 if kinds == {int} else None),
    }


def _walk_tar(path: str) -> _TarMembers:
    """The image and label members of each key, reading only the label members' bytes."""
    members = _TarMembers({}, {"cls": {}, "json": {}}, [])
    images, labels = members.images, members.labels
    try:
        # "r:": uncompressed only, so offsets are offsets into the file; never a fifo (it would block)
        with open_regular(path) as raw, tarfile.open(path, "r:", fileobj=raw) as tf:
            for m in tf:
                key, ext = _split(m.name)
                if not m.isfile() or (ext not in IMAGE_EXTS and ext not in labels):
                    continue
                if m.size < 0:  # tarfile reads a base-256 size field as it is: a damaged or hostile header
                    raise SourceError(f"{path}: {m.name}: the tar header gives a negative size ({m.size})")
                if key not in images and all(key not in d for d in labels.values()):
                    members.order.append(key)
                if ext in IMAGE_EXTS:
                    if key in images:
                        raise SourceError(
                            f"{path}: key {key!r} has two images ({images[key][0]} and {m.name}): "
                            "mixed extensions, which one is the sample?"
                        )
                    images[key] = (m.name, m.offset_data, m.size)
                else:
                    if key in labels[ext]:
                        raise SourceError(
                            f"{path}: key {key!r} has two .{ext} members ({labels[ext][key][0]} and {m.name}): "
                            "which one is its label?"
                        )
                    member = tf.extractfile(m)  # a regular file (isfile above): never None
                    assert member is not None
                    labels[ext][key] = (m.name, member.read())
    except tarfile.TarError as e:
        raise SourceError(f"{path}: {_tar_problem(path, e)} ({e})") from None
    return members


def _tar_problem(path: str, e: tarfile.TarError) -> str:
    if "unexpected end of data" in str(e):
        return "a tar file cut short (truncated, or still being written)"
    if path.lower().endswith(COMPRESSED_TAR):
        return "a compressed tar file: shards are read uncompressed (decompress it, or `gpupipe prepare` the images)"
    return "not an uncompressed tar file"


def _paired(path: str, members: _TarMembers) -> tuple[list[str], list[int | str]]:
    """The keys in tar order and their labels (a .cls member's, else a .json's); a key without its image or its
    label is an error, and so is a shard without samples."""
    keys, values = [], []
    for key in members.order:
        if key not in members.images:
            raise SourceError(f"{path}: key {key!r} has a label but no image (.{', .'.join(IMAGE_EXTS)})")
        found = members.labels["cls"].get(key) or members.labels["json"].get(key)
        if found is None:
            raise SourceError(
                f"{path}: key {key!r} has no label (a .cls member, or a .json with a "
                f"{' or '.join(repr(f) for f in LABEL_FIELDS)} field)"
            )
        keys.append(key)
        values.append(_label(path, *found))
    if not keys:
        raise SourceError(f"{path}: no samples (key.jpg|jpeg|png|webp with key.cls or key.json) in this shard")
    return keys, values


def _split(name: str) -> tuple[str, str]:
    folder, _, base = name.rpartition("/")
    stem, _, ext = base.partition(".")
    return (f"{folder}/{stem}" if folder else stem), ext.lower()


def _label(path: str, member: str, data: bytes) -> int | str:
    where = f"{path}: {member}"
    if member.lower().endswith(".cls"):
        text = data.strip()
        if re.fullmatch(rb"-?[0-9]+", text) is None:  # ASCII digits only: int() would read b"1_0" as 10
            raise SourceError(f"{where}: a .cls member must hold an integer label, got {data[:40]!r}")
        return _class_index(where, text.decode())
    try:
        obj = json.loads(data)
    except ValueError as e:
        raise SourceError(f"{where}: not valid JSON ({e})") from None
    for f in LABEL_FIELDS:
        if isinstance(obj, dict) and f in obj:
            value = obj[f]
            if isinstance(value, bool) or not isinstance(value, (int, str)):
                raise SourceError(f"{where}: field {f!r} must be an integer or a class name, got {value!r}")
            return _class_index(where, str(value)) if isinstance(value, int) else value
    raise SourceError(f"{where}: no label field ({' or '.join(repr(f) for f in LABEL_FIELDS)})")


def _class_index(where: str, label: str) -> int:
    """A numeric label as a class index, checked before it meets an int64 column (a 30-digit label overflows it)."""
    if (problem := index_problem(label)) is not None:
        raise SourceError(f"{where}: {problem}")
    return int(label)
