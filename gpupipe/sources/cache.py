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
  built), so a re-written object is another name and is fetched again; a fetch whose bytes are not the listed size,
  or not the listed version (their MD5 where the ETag is one; else, or where it is not the bytes', the object's ETag
  asked again), is an error naming the URL. Beside each shard, ``<name>.sha256`` holds the digest of the bytes the
  store served.
- **Trusted**: a cached shard is read only if this user, root or the cache folder's group wrote it (the folder's
  group counts where the folder is group-writable and this user is a member) and its bytes match its digest
  (checked when a process first opens it); any other file at its name (planted, altered, truncated) is fetched
  again over, never read. The default folder is the user's own (mode 0700); a folder every user may write
  (``/tmp``) is refused; a group shares one by choice (:func:`check_folder`).
- **Bounded**: before a fetch, the least recently used shards (modification time, set on each use) are removed
  until the new one fits ``limit`` bytes, counting the fetches in progress at their whole size (so fetches at once
  make room for each other); a shard a process is reading is pinned by its shared lock and never removed (the folder
  may then exceed the limit by the shards in use at once, until they are released: the release that finds the folder
  still over its limit evicts again).
- **Read ahead** (:mod:`.cached`, which also decides when a loader reads through the cache): a thread of the
  process that iterates the loader fetches the shards the coming batches will need while the current ones train.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import hashlib
import mmap
import os
import re
import shutil
import stat
from collections.abc import Callable
from pathlib import Path
from typing import Any, Protocol, TypeVar

from ..errors import StorageError
from .cache_folder import CHOOSE, SHARE_FIX, check_folder, md5_in_etag, md5_of, sha256_of, write_digest

DEFAULT_SHARE = 0.5  # of the folder's free space (with what the cache already holds): the default limit
_PART, _LOCK, _DIGEST = ".part", ".lock", ".sha256"
_OVER = ".over-limit"  # a fetch left the folder over its limit (what it would have evicted was in use)
_FULL = (errno.ENOSPC, errno.EDQUOT, errno.EFBIG)  # a full disk, a quota, a file size limit
_T = TypeVar("_T")


class Store(Protocol):
    """What the cache needs of :class:`~.objstore.Store` (which imports this module for ``Remote``'s check)."""

    @property
    def fs(self) -> Any: ...

    def path(self, url: str) -> str: ...

    def info(self, url: str) -> dict: ...

    def call(self, url: str, what: Callable[[], _T]) -> _T: ...


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
    if size < 1 << 20:  # a small limit, a test's shards: never "0.0 MiB"
        return f"{size} bytes" if size < 1 << 10 else f"{size / (1 << 10):.1f} KiB"
    return f"{size / (1 << 20):.1f} MiB" if size < 1 << 30 else f"{size / (1 << 30):.2f} GiB"


class ShardCache:
    """The shard files in ``folder``, at most ``limit`` bytes of them (see the module's docstring)."""

    def __init__(self, folder: str | os.PathLike, limit: int):
        self.folder, self.limit = Path(folder), limit
        self.group = check_folder(self.folder)
        self.fetches = 0  # whole objects this process fetched (tests and the bench read it)
        self._checked: set[tuple[int, int, int, str]] = set()  # (device, inode, size, digest) read back whole

    @staticmethod
    def default_limit(folder: Path) -> int:
        """:data:`DEFAULT_SHARE` of the space left on ``folder``'s disk plus what the cache already holds."""
        check_folder(folder)
        return int(DEFAULT_SHARE * (shutil.disk_usage(folder).free + _held(folder)))

    @staticmethod
    def name(url: str, size: int, etag: str) -> str:
        """The file name of an object's version: the URL's digest, the size, the ETag's digest, the base name."""
        where = hashlib.sha256(url.encode()).hexdigest()[:16]
        tag = hashlib.sha256(etag.encode()).hexdigest()[:12]
        base = re.sub(r"[^\w.-]", "_", os.path.basename(url))[-80:]
        return f"{where}-{size}-{tag}-{base}"

    def pin(self, store: Store, url: str, size: int, etag: str) -> Pinned:
        """The shard's bytes, fetched first if this node has no copy it can trust, and pinned (never evicted) until
        closed. A permission the cache folder refuses is a :class:`StorageError` naming it."""
        try:
            return self._pin(store, url, size, etag)
        except PermissionError as e:
            raise StorageError(
                f"{self.folder}: the shard cache refuses this user ({e.strerror}: {e.filename}); use a folder of "
                f"your own ({CHOOSE}), {SHARE_FIX}"
            ) from None

    def _pin(self, store: Store, url: str, size: int, etag: str) -> Pinned:
        path = self.folder / self.name(url, size, etag)
        while True:
            fd = _lock(path.with_name(path.name + _LOCK), fcntl.LOCK_SH)
            try:
                found = self._trusted(path, size, etag)
                if found is not None:
                    pinned = Pinned(fd, path, found, on_release=self._trim)
                    fd = -1
                    return pinned
                fcntl.flock(fd, fcntl.LOCK_EX)  # converted: dropped, then taken (no deadlock between two)
                if self._trusted(path, size, etag) is None and _same(fd, path.with_name(path.name + _LOCK)):
                    self._fetch(store, url, size, etag, path)
            finally:
                if fd >= 0:
                    _unlock(fd)

    def _trim(self) -> None:
        """After a shard is released: a folder that a fetch left over its limit is brought back under it, as far as
        the shards still in use allow (the mark stays until it is)."""
        if (self.folder / _OVER).exists():
            self.evict(0, trim=True)

    def ensure(self, store: Store, url: str, size: int, etag: str) -> None:
        """The shard fetched if this node has no copy (read ahead), not pinned."""
        self.pin(store, url, size, etag).close()

    def _trusted(self, path: Path, size: int, etag: str) -> os.stat_result | None:
        """``path``'s status where it is a whole shard this process may read: a regular file of ``size`` bytes,
        written by this user, root or the folder's sharing group, whose bytes match the digest of what the store
        served, kept beside it (read back once per process and file); None otherwise (absent, truncated, planted or
        altered: fetched again over)."""
        digest_path = path.with_name(path.name + _DIGEST)
        try:
            st, digest_st = os.lstat(path), os.lstat(digest_path)
            regular = stat.S_ISREG(st.st_mode) and stat.S_ISREG(digest_st.st_mode) and digest_st.st_size < 256
            if not (regular and st.st_size == size and self._owned(st) and self._owned(digest_st)):
                return None
            expected = digest_path.read_text().strip()
        except (FileNotFoundError, UnicodeDecodeError):
            return None
        key = (st.st_dev, st.st_ino, size, expected)
        if key not in self._checked:
            if sha256_of(path) != expected:
                return None
            self._checked.add(key)
        return st

    def _owned(self, st: os.stat_result) -> bool:
        if stat.S_IMODE(st.st_mode) & 0o002:
            return False  # anyone may have changed it
        return st.st_uid in (os.geteuid(), 0) or (self.group is not None and st.st_gid == self.group)

    def _fetch(self, store: Store, url: str, size: int, etag: str, path: Path) -> None:
        """The whole object into ``<path>.part``, checked, then renamed to ``path`` with its digest beside it (the
        caller holds its lock exclusive)."""
        fits = self.evict(size, keep=path.name)  # makes ``<path>.part``: the next fetch's eviction counts it
        part = path.with_name(path.name + _PART)
        full: list[OSError] = []

        def get() -> None:  # each attempt writes the file anew
            try:
                store.fs.get_file(store.path(url), str(part))
            except OSError as e:
                if e.errno in _FULL:
                    full.append(e)
                raise

        try:
            self._room(url, size)
            store.call(url, get)
            digest = self._checked_download(store, url, size, etag, part)
            write_digest(path.with_name(path.name + _DIGEST), digest)
            os.replace(part, path)
        except OSError as e:
            if e.errno in _FULL:
                full.append(e)
            raise
        finally:
            part.unlink(missing_ok=True)
            if full:
                raise self._full(url, size, full[0]) from None
        st = path.stat()
        self._checked.add((st.st_dev, st.st_ino, size, digest))
        self.fetches += 1
        if not fits:  # marked once the shard is in place, so that a release after this sees it in the total; under
            # the eviction lock, so that a release trimming now cannot take the mark away after its own count
            with contextlib.suppress(PermissionError), self._evicting():  # another user's mark: there already
                (self.folder / _OVER).touch()

    def _checked_download(self, store: Store, url: str, size: int, etag: str, part: Path) -> str:
        """The downloaded bytes' sha256, once they are known to be the object's version the loader listed: its size,
        and its MD5 where the ETag is one (a single-part upload), else the object's ETag asked again."""
        got = part.stat().st_size
        if got != size:
            raise StorageError(
                f"{url}: {got} bytes where the listing said {size} when the loader was built: the object changed "
                "(re-written or truncated?); build the loader again"
            )
        with open(part, "rb") as f:  # to the disk before the rename: a crash leaves no renamed file of zeros
            os.fsync(f.fileno())
        md5 = md5_in_etag(etag)
        if md5 is None or md5_of(part) != md5:  # no MD5, or not the bytes' (encrypted with KMS): ask the store
            store.fs.invalidate_cache(store.path(url))  # the listing's answer is kept: ask the store itself
            now = etag_of(store.info(url))
            if now != etag:
                raise StorageError(
                    f"{url}: the object changed since the loader listed it (ETag {etag}, now {now}): it was re-written "
                    "while this loader runs; build the loader again"
                )
        return sha256_of(part)

    def _room(self, url: str, size: int) -> None:
        """A fetch that cannot fit the disk is refused before it starts (:meth:`_full`)."""
        free = shutil.disk_usage(self.folder).free
        if free < size:
            raise self._full(url, size, None)

    def _full(self, url: str, size: int, e: OSError | None) -> StorageError:
        free, held = shutil.disk_usage(self.folder).free, _held(self.folder)
        cause = f" ({e.strerror})" if e is not None else ""
        return StorageError(
            f"{self.folder}: no room for {url} ({size_text(size)}) on the shard cache's disk{cause}: "
            f"{size_text(free)} free, and cache_limit {size_text(self.limit)} is more than the disk holds; set a "
            f"smaller --cache-limit (cache_limit=), below {size_text(free + held)}, leave it unset (half the free "
            "space), or 0 (no cache folder: range reads)"
        )

    def evict(self, need: int, keep: str = "", trim: bool = False) -> bool:
        """Remove least recently used shards, none pinned, until ``need`` more bytes fit the limit; leftovers of
        killed fetches go first. A fetch in progress counts at the whole size its ``.part``'s name holds, so two
        fetches at once make room for both: ``keep`` names the shard about to be fetched, whose ``.part`` is made here,
        under the lock. With ``trim``, the over-limit mark goes once they fit. Whether they fit (not when the shards in
        the way are in use)."""
        with self._evicting():
            entries = [e for e in _entries(self.folder) if e.name.removesuffix(_PART) != keep]
            total = sum(map(_size, entries))
            for entry in sorted(entries, key=_age):
                if total + need <= self.limit and not entry.name.endswith(_PART):
                    break
                size = _size(entry)
                if _remove(entry):  # else pinned, or being fetched
                    total -= size
            if keep:  # a killed fetch's leftover replaced (another user's: the folder's error, not the store's)
                part = self.folder / (keep + _PART)
                part.unlink(missing_ok=True)
                part.touch()
            fits = total + need <= self.limit
            if trim and fits:
                (self.folder / _OVER).unlink(missing_ok=True)
            return fits

    def _evicting(self) -> contextlib.AbstractContextManager:
        """The folder's eviction lock, held: one process at a time counts and removes."""
        stack = contextlib.ExitStack()
        stack.callback(_unlock, _lock(self.folder / ".evict.lock", fcntl.LOCK_EX))
        return stack


class Pinned:
    """A cached shard mapped for reading, held by a shared lock so that no process evicts it meanwhile."""

    def __init__(
        self, fd: int, path: Path, checked: os.stat_result | None = None, on_release: Callable[[], None] | None = None
    ):
        self.fd, self.path, self._on_release = fd, path, on_release
        with contextlib.suppress(PermissionError):  # another user's file (a shared folder): its last use is theirs
            os.utime(path)  # last used: the LRU order
        self.map: mmap.mmap | None = None
        with open(os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC), "rb") as f:
            st = os.fstat(f.fileno())
            if checked is not None and (st.st_dev, st.st_ino) != (checked.st_dev, checked.st_ino):
                raise StorageError(f"{path}: replaced while it was being opened; another process writes this cache")
            if st.st_size:  # mmap refuses an empty file
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
            if self._on_release is not None:
                self._on_release()
        else:
            os.close(self.fd)


def _lock(path: Path, how: int) -> int:
    """An open descriptor of the lock file ``path``, locked ``how``; the file a remover unlinked meanwhile is not
    the lock any more (another took its place): then the new one is taken."""
    path.parent.mkdir(parents=True, exist_ok=True)
    while True:
        fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)  # another user's too
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


def _entries(folder: Path) -> list[os.DirEntry]:
    with os.scandir(folder) as it:
        return [
            e
            for e in it
            if e.is_file(follow_symlinks=False) and not e.name.endswith((_LOCK, _DIGEST)) and e.name[0] != "."
        ]


def _size(entry: os.DirEntry) -> int:
    """A shard's bytes; a fetch's ``.part`` counts at the whole size its name holds (:meth:`ShardCache.name`)."""
    if entry.name.endswith(_PART):
        named = re.match(r"[0-9a-f]{16}-(\d+)-", entry.name)
        return int(named[1]) if named else 0
    try:
        return entry.stat().st_size
    except FileNotFoundError:
        return 0


def _age(entry: os.DirEntry) -> tuple[bool, float]:
    """Leftovers of killed fetches first, then the least recently used."""
    try:
        return not entry.name.endswith(_PART), entry.stat().st_mtime
    except FileNotFoundError:
        return False, 0.0


def _remove(entry: os.DirEntry) -> bool:
    """Remove a shard (or a fetch's leftover), its digest and its lock file when no process holds the lock; False if
    one does, or when this user may not (another user's file in a folder with the sticky bit)."""
    lock = Path(entry.path.removesuffix(_PART) + _LOCK)
    try:
        fd = _lock_nb(lock)
    except (BlockingIOError, PermissionError):
        return False
    try:
        Path(entry.path).unlink(missing_ok=True)
        if not entry.name.endswith(_PART):
            Path(entry.path + _DIGEST).unlink(missing_ok=True)
            lock.unlink(missing_ok=True)  # held: a process that opened it meanwhile sees it unlinked, takes a new one
    except PermissionError:
        return False
    finally:
        _unlock(fd)
    return True


def _lock_nb(path: Path) -> int:
    fd = os.open(path, os.O_RDONLY | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
    except BaseException:
        os.close(fd)
        raise
    return fd


def _held(folder: Path) -> int:
    return sum(e.stat().st_size for e in _entries(folder) if not e.name.endswith(_PART))
