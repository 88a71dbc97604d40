"""One run per output folder: an exclusive lock held for the run's life.

The lock is a POSIX record lock (``fcntl.lockf``) on ``<folder>/.gpupipe.lock``. The kernel releases it whenever the
holder ends, however it ends (an exception, SIGTERM, SIGKILL, a power cut on a local disk), so a lock left by a dead
process is never in the way (its file stays, free; a run that ends normally removes it). Unlike ``flock``, a record
lock belongs to the process, not to the open file: a child forked while it is held (a DataLoader worker, a pool
worker) does not hold it, so the workers a SIGKILLed run leaves behind for a few seconds do not keep the folder from
the run that resumes it. A process drops its record locks on a file when it closes any descriptor of that file, so
this module never opens the lock file twice in one process (a second lock here is refused from the file's identity).
The holder writes who it is into the file, for the line a second run gets.
"""

from __future__ import annotations

import contextlib
import errno
import fcntl
import json
import os
import socket
import sys
import time
from pathlib import Path
from types import TracebackType

from ._names import escape
from .errors import GpupipeError

LOCK_NAME = ".gpupipe.lock"
_HELD: set[tuple[int, int]] = set()  # (device, inode) of the lock files this process holds


class FolderInUseError(GpupipeError):
    """Another live process holds the folder's lock; the message names it."""


class RunLock:
    """``with RunLock(folder, "--out"):`` the body runs while this process alone holds ``folder``."""

    def __init__(self, folder: str | os.PathLike, option: str = "--out"):
        self.folder, self.option = Path(folder), option
        self.path = self.folder / LOCK_NAME
        self._fd: int | None = None

    def acquire(self) -> None:
        """Take the lock, or raise :class:`FolderInUseError` naming the process that holds it."""
        self.folder.mkdir(parents=True, exist_ok=True)
        self._refuse_if_mine()
        while True:
            fd = self._locked_fd()
            try:  # the file a releasing holder unlinked is not the lock any more: take the new one
                if os.fstat(fd).st_ino == os.stat(self.path, follow_symlinks=False).st_ino:
                    break
            except FileNotFoundError:
                pass
            os.close(fd)
        me = {"pid": os.getpid(), "host": socket.gethostname(), "since": time.time(), "command": _command()}
        os.ftruncate(fd, 0)
        os.pwrite(fd, (json.dumps(me) + "\n").encode(), 0)
        self._fd = fd
        _HELD.add(_identity(os.fstat(fd)))

    def _refuse_if_mine(self) -> None:
        """A second lock on a folder this process holds is refused without opening the file (closing that second
        descriptor would release the first lock)."""
        try:
            st = os.stat(self.path, follow_symlinks=False)
        except OSError:
            return
        if _identity(st) in _HELD:
            raise FolderInUseError(self._in_use(f"pid {os.getpid()}, this process: {_command()}"))

    def _locked_fd(self) -> int:
        try:  # never through a link planted at the name
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise GpupipeError(f"{self.path}: cannot lock the folder for this run ({e.strerror or e})") from None
        try:
            fcntl.lockf(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except OSError as e:
            if e.errno not in (errno.EACCES, errno.EAGAIN):
                os.close(fd)
                raise GpupipeError(f"{self.path}: cannot lock the folder for this run ({e.strerror or e})") from None
            holder = _describe(_read(fd))
            os.close(fd)
            raise FolderInUseError(self._in_use(holder)) from None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def _in_use(self, holder: str) -> str:
        return (
            f"{self.folder}: in use by another run ({holder}); one run per folder: wait for it to end, "
            f"or choose another {self.option}"
        )

    def release(self) -> None:
        """Free the folder: the lock file is removed while still held (a process that opened it meanwhile sees it
        unlinked and takes a new one), so a run that ended leaves nothing behind; one killed leaves a free file."""
        if self._fd is not None:
            _HELD.discard(_identity(os.fstat(self._fd)))
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            os.close(self._fd)  # releases the record lock
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


def _identity(st: os.stat_result) -> tuple[int, int]:
    return st.st_dev, st.st_ino


def _command() -> str:
    return " ".join(["gpupipe" if i == 0 else a for i, a in enumerate(sys.argv)])[:300]


def _read(fd: int) -> dict:
    try:
        data = json.loads(os.pread(fd, 4096, 0) or b"{}")
    except ValueError:
        return {}
    return data if isinstance(data, dict) else {}


def _describe(holder: dict) -> str:
    """``pid 123 on host h since 12:00:01: gpupipe train ...`` from what the holder wrote (it may not have yet)."""
    if "pid" not in holder or not _may_live(holder):  # the file still names the holder before it, who has ended
        return "a process that is just starting"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"pid {holder['pid']} on {holder.get('host', '?')} since {since}: {escape(holder.get('command', '?'))}"


def _may_live(holder: dict) -> bool:
    """False when the process the file names is on this host and has ended; True when it lives or cannot be told."""
    if holder.get("host") != socket.gethostname() or not isinstance(holder["pid"], int):
        return True
    try:
        os.kill(holder["pid"], 0)
    except ProcessLookupError:
        return False
    except OSError:  # another user's process: alive
        pass
    return True
