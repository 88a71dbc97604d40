"""A node's shard cache: each shard at a URL fetched once per node, into a folder every DataLoader worker of every
local rank (and every run on the node) shares, bounded, checked against the object, and read ahead.

The mechanism is a plain folder with a lock file per shard (``flock``), chosen over shared memory or a fetcher
process per node: the kernel releases a lock whenever its holder ends, however it ends (an exception, SIGKILL, an
out-of-memory kill), so no process is trusted to clean up after another; two runs, or processes started by different
launchers, need to agree on nothing but the folder; the page cache serves hot shards from memory anyway; and a
folder on ``/dev/shm`` makes it a memory cache with no other code.

- **One fetch per shard per node**: a reader takes the shard's lock shared; when the shard is not there it takes it
  exclusive, looks again (another process may have fetched it meanwhile) and else fetches the whole object into
  ``<name>.part`` and renames it into place, so a complete file is all a reader ever sees. A process killed
  mid-fetch leaves a ``.part`` and a free lock: the next reader fetches again over it.
- **Checked**: a shard's name holds the object's size and a digest of its ETag (as listed when the loader was
  built), so a re-written object is another name and is fetched again; a cached file of another size (a truncated
  copy) is fetched again, never read; a fetch whose bytes are not the listed size is an error naming the URL.
- **Bounded**: before a fetch, the least recently used shards (modification time, set on each use) are removed
  until the new one fits ``limit`` bytes; a shard a process is reading is pinned by its shared lock and never
  removed (the folder may then exceed the limit by the shards in use at once).
- **Read ahead** (:mod:`.cached`, which also decides when a loader reads through the cache): a thread of the
  process that iterates the loader fetches the shards the coming batches will need while the current ones train.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import mmap
import os
import re
import shutil
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ..errors import StorageError

DEFAULT_SHARE = 0.5  # of the folder's free space (with what the cache already holds): the default limit
_PART, _LOCK = ".part", ".lock"
_T = TypeVar("_T")


class Store(Protocol):
    """What the cache needs of :class:`~.objstore.Store` (which imports this module for ``Remote``'s check)."""

    @property
    def fs(self) -> Any: ...

    def path(self, url: str) -> str: ...

    def call(self, url: str, what: Callable[[], _T]) -> _T: ...


def cache_folder() -> Path:
    """The default shard cache: ``$GPUPIPE_CACHE``, else ``$XDG_CACHE_HOME/gpupipe/shards`` (``~/.cache/...``)."""
    if os.environ.get("GPUPIPE_CACHE"):
        return Path(os.environ["GPUPIPE_CACHE"])
    return Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "gpupipe" / "shards"


def parse_limit(value: int | str | None) -> int | None:
    """``cache_limit``: bytes, or ``"50GB"`` / ``"512MiB"`` / ``"100k"`` (powers of 1024); None: the default."""
    if value is None or (isinstance(value, int) and not isinstance(value, bool)):
        if value is not None and value < 0:
            raise ValueError(f"cache_limit must be >= 0 bytes, got {value}")
        return value
    m = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([kmgt]?)(?:i?b)?\s*", str(value).lower())
    if m is None:
        raise ValueError(f"cache_limit: expected a size such as 50GB or 512MB, got {value!r}")
    return int(float(m[1]) * 1024 ** " kmgt".index(m[2] or " "))


def etag_of(info: dict) -> str:
    """What identifies an object's version: its ETag (S3, GCS), else its modification time."""
    return str(info.get("ETag") or info.get("etag") or info.get("mtime") or info.get("LastModified") or "")


def size_text(size: int) -> str:
    return f"{size / (1 << 20):.1f} MiB" if size < 1 << 30 else f"{size / (1 << 30):.2f} GiB"


class ShardCache:
    """The shard files in ``folder``, at most ``limit`` bytes of them (see the module's docstring)."""

    def __init__(self, folder: str | os.PathLike, limit: int):
        self.folder, self.limit = Path(folder), limit
        self.fetches = 0  # whole objects this process fetched (tests and the bench read it)

    @staticmethod
    def default_limit(folder: Path) -> int:
        """:data:`DEFAULT_SHARE` of the space left on ``folder``'s disk plus what the cache already holds."""
        folder.mkdir(parents=True, exist_ok=True)
        return int(DEFAULT_SHARE * (shutil.disk_usage(folder).free + _held(folder)))

    @staticmethod
    def name(url: str, size: int, etag: str) -> str:
        """The file name of an object's version: the URL's digest, the size, the ETag's digest, the base name."""
        where = hashlib.sha256(url.encode()).hexdigest()[:16]
        tag = hashlib.sha256(etag.encode()).hexdigest()[:12]
        base = re.sub(r"[^\w.-]", "_", os.path.basename(url))[-80:]
        return f"{where}-{size}-{tag}-{base}"

    def pin(self, store: Store, url: str, size: int, etag: str) -> Pinned:
        """The shard's bytes, fetched first if this node has no copy, and pinned (never evicted) until closed."""
        path = self.folder / self.name(url, size, etag)
        while True:
            fd = _lock(path.with_name(path.name + _LOCK), fcntl.LOCK_SH)
            try:
                if _complete(path, size):
                    pinned = Pinned(fd, path)
                    fd = -1
                    return pinned
                fcntl.flock(fd, fcntl.LOCK_EX)  # converted: dropped, then taken (no deadlock between two)
                if not _complete(path, size) and _same(fd, path.with_name(path.name + _LOCK)):
                    self._fetch(store, url, size, path)
            finally:
                if fd >= 0:
                    _unlock(fd)

    def ensure(self, store: Store, url: str, size: int, etag: str) -> None:
        """The shard fetched if this node has no copy (read ahead), not pinned."""
        self.pin(store, url, size, etag).close()

    def _fetch(self, store: Store, url: str, size: int, path: Path) -> None:
        """The whole object into ``<path>.part``, then renamed to ``path`` (the caller holds its lock exclusive)."""
        self.evict(size, keep=path.name)
        part = path.with_name(path.name + _PART)

        def get() -> None:
            part.unlink(missing_ok=True)  # a killed fetch's leftover, or this one's failed attempt
            store.fs.get_file(store.path(url), str(part))

        store.call(url, get)
        got = part.stat().st_size
        if got != size:
            part.unlink(missing_ok=True)
            raise StorageError(
                f"{url}: {got} bytes where the listing said {size} when the loader was built: the object changed "
                "(re-written or truncated?); build the loader again"
            )
        os.replace(part, path)
        self.fetches += 1

    def evict(self, need: int, keep: str = "") -> None:
        """Remove least recently used shards, none pinned, until ``need`` more bytes fit the limit; leftovers of
        killed fetches go first."""
        with contextlib.ExitStack() as stack:
            stack.callback(_unlock, _lock(self.folder / ".evict.lock", fcntl.LOCK_EX))
            entries = _entries(self.folder)
            total = sum(e.stat().st_size for e in entries if not e.name.endswith(_PART))
            for entry in sorted(entries, key=_age):
                if total + need <= self.limit and not entry.name.endswith(_PART):
                    break
                size = 0 if entry.name.endswith(_PART) else entry.stat().st_size  # cached by the listing
                if entry.name.removesuffix(_PART) != keep and _remove(entry):  # else pinned, or being fetched
                    total -= size


class Pinned:
    """A cached shard mapped for reading, held by a shared lock so that no process evicts it meanwhile."""

    def __init__(self, fd: int, path: Path):
        self.fd, self.path = fd, path
        os.utime(path)  # last used: the LRU order
        self.map: mmap.mmap | None = None
        with open(path, "rb") as f:
            if os.fstat(f.fileno()).st_size:  # mmap refuses an empty file
                self.map = mmap.mmap(f.fileno(), 0, access=mmap.ACCESS_READ)

    def read(self, start: int, size: int) -> bytes:
        return b"" if self.map is None else self.map[start : start + size]

    def __enter__(self) -> Pinned:
        return self

    def __exit__(self, *exc) -> None:
        self.close()

    def close(self, unlock: bool = True) -> None:
        """Unpin (``unlock=False`` in a forked child: the lock is its parent's, shared through the descriptor)."""
        if self.map is not None:
            self.map.close()
        if unlock:
            _unlock(self.fd)
        else:
            os.close(self.fd)


def _lock(path: Path, how: int) -> int:
    """An open descriptor of the lock file ``path``, locked ``how``; the file a remover unlinked meanwhile is not
    the lock any more (another took its place): then the new one is taken."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        try:
            fcntl.flock(fd, how)
        except BaseException:
            os.close(fd)
            raise
        if _same(fd, path):
            return fd
        os.close(fd)


def _same(fd: int, path: Path) -> bool:
    try:
        return os.fstat(fd).st_ino == os.stat(path, follow_symlinks=False).st_ino
    except FileNotFoundError:
        return False


def _unlock(fd: int) -> None:
    """Release (for every descriptor a fork copied, too) and close."""
    with contextlib.suppress(OSError):
        fcntl.flock(fd, fcntl.LOCK_UN)
    os.close(fd)


def _complete(path: Path, size: int) -> bool:
    """The file is there, whole (a truncated copy is not: it is fetched again over)."""
    try:
        return path.stat().st_size == size
    except FileNotFoundError:
        return False


def _entries(folder: Path) -> list[os.DirEntry]:
    with os.scandir(folder) as it:
        return [e for e in it if e.is_file(follow_symlinks=False) and not e.name.endswith(_LOCK) and e.name[0] != "."]


def _age(entry: os.DirEntry) -> tuple[bool, float]:
    """Leftovers of killed fetches first, then the least recently used."""
    try:
        return not entry.name.endswith(_PART), entry.stat().st_mtime
    except FileNotFoundError:
        return False, 0.0


def _remove(entry: os.DirEntry) -> bool:
    """Remove a shard (or a fetch's leftover) and its lock file when no process holds the lock; False if one does."""
    lock = Path(entry.path.removesuffix(_PART) + _LOCK)
    try:
        fd = _lock_nb(lock)
    except BlockingIOError:
        return False
    try:
        Path(entry.path).unlink(missing_ok=True)
        if not entry.name.endswith(_PART):
            lock.unlink(missing_ok=True)  # held: a process that opened it meanwhile sees it unlinked, takes a new one
    finally:
        _unlock(fd)
    return True


def _lock_nb(path: Path) -> int:
    fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _held(folder: Path) -> int:
    return sum(e.stat().st_size for e in _entries(folder) if not e.name.endswith(_PART))
