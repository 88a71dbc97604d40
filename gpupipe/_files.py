"""Files beside user data. What gpupipe writes there (index caches, temp files, metadata) is created exclusively,
never through a link planted at its name, and renamed into place whole; what it reads is a regular file, never a fifo
or a device that would block or never end."""

from __future__ import annotations

import contextlib
import errno
import os
import stat
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import BinaryIO, NamedTuple


def create_exclusive(path: str | os.PathLike) -> BinaryIO:
    """A new file at ``path`` opened for writing: an existing file or link there is an error (``FileExistsError``),
    never overwritten or followed."""
    fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    return os.fdopen(fd, "wb")


@contextlib.contextmanager
def naming(path: str | os.PathLike) -> Iterator[None]:
    """An ``OSError`` from writing ``path`` carries its name (a full disk's ``write()`` error names no file)."""
    try:
        yield
    except OSError as e:
        if e.filename is None:
            raise OSError(e.errno, e.strerror, os.fspath(path)) from None
        raise


def write_atomic(path: str | os.PathLike, data: bytes, *, durable: bool = True) -> None:
    """``path`` holding ``data``, written to a new temp file of unpredictable name (``mkstemp``: ``O_EXCL``, no link
    followed) in its folder and renamed over ``path`` (a link at ``path`` is replaced, not followed). An
    ``OSError`` names ``path``."""
    path = Path(path)
    with naming(path):
        fd, tmp = tempfile.mkstemp(prefix=f".{path.name}.", suffix=".tmp", dir=path.parent)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                if durable:
                    f.flush()
                    os.fsync(f.fileno())
            os.chmod(tmp, 0o644 & ~_umask())  # mkstemp makes it 0600; the file is for every reader the folder has
            os.replace(tmp, path)
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


def is_regular_file(path: str | os.PathLike) -> bool:
    """Whether ``path`` itself (not what a link there points at) is a regular file."""
    try:
        return os.path.isfile(path) and not os.path.islink(path)
    except OSError:
        return False


_KINDS = {
    stat.S_IFIFO: "a fifo",
    stat.S_IFCHR: "a character device",
    stat.S_IFBLK: "a block device",
    stat.S_IFSOCK: "a socket",
    stat.S_IFDIR: "a folder",
}


def special_kind(path: str | os.PathLike) -> str | None:
    """What ``path`` (links followed) is when it is not a regular file (``"a fifo"``, ``"a character device"``...):
    reading one would block for ever (a fifo) or never end (``/dev/zero``); None for a regular or missing file."""
    try:
        mode = os.stat(path).st_mode
    except OSError:
        return None  # the read reports it
    return None if stat.S_ISREG(mode) else _KINDS.get(stat.S_IFMT(mode), "not a regular file")


def open_regular(path: str | os.PathLike) -> BinaryIO:
    """A regular file opened for reading; anything else (a fifo, a device, ...) is an ``OSError`` saying what it is,
    raised without blocking: the file is opened non-blocking (which a regular file's reads ignore) and checked before
    it is read."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC)
    mode = os.fstat(fd).st_mode
    if not stat.S_ISREG(mode):  # checked before a file object is made: Python's refuses a folder naming the fd
        os.close(fd)
        kind = _KINDS.get(stat.S_IFMT(mode), "not a regular file")
        raise OSError(errno.EINVAL, f"not a regular file: {kind}", os.fspath(path))
    return os.fdopen(fd, "rb")


def read_regular(path: str | os.PathLike) -> bytes:
    """A regular file's bytes, opened by :func:`open_regular` (a fifo or a device is an ``OSError``, never read)."""
    with open_regular(path) as f:
        return f.read()


class Stamp(NamedTuple):
    """What says a file changed between two looks (a batch read ahead of its pass, checked when the pass begins): its
    size and modification time, which a copy that keeps them (``cp -p``, ``touch -r``) leaves as they were, and its
    inode (device, number, change time), which every write, replacement or ``chmod`` moves and no user can set back."""

    path: str
    mtime_ns: int | None  # None: the file could not be read then
    size: int | None
    ctime_ns: int | None = None
    inode: tuple[int, int] | None = None  # (device, number)


def file_stamp(path: str) -> Stamp:
    try:
        st = os.stat(path)
    except OSError:
        return Stamp(path, None, None)
    return Stamp(path, st.st_mtime_ns, st.st_size, st.st_ctime_ns, (st.st_dev, st.st_ino))


def unchanged(stamps: list[Stamp]) -> bool:
    """Whether every file is as it was when stamped."""
    return all(file_stamp(s.path) == s for s in stamps)
