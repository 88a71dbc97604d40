"""One run per output folder: an exclusive lock held for the run's life.

The lock is ``flock`` on ``<folder>/.gpupipe.lock``: the kernel releases it whenever the holder ends, however it
ends (an exception, SIGTERM, SIGKILL, a power cut on a local disk), so a lock left by a dead process is never in the
way (its file stays, free; a run that ends normally removes it). The holder writes who it is into the file, for the
line a second run gets.
"""

from __future__ import annotations

import contextlib
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

    def _locked_fd(self) -> int:
        try:  # never through a link planted at the name
            fd = os.open(self.path, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
        except OSError as e:
            raise GpupipeError(f"{self.path}: cannot lock the folder for this run ({e.strerror or e})") from None
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            holder = _describe(_read(fd))
            os.close(fd)
            raise FolderInUseError(
                f"{self.folder}: in use by another run ({holder}); one run per folder: wait for it to end, "
                f"or choose another {self.option}"
            ) from None
        except BaseException:
            os.close(fd)
            raise
        return fd

    def release(self) -> None:
        """Free the folder: the lock file is removed while still held (a process that opened it meanwhile sees it
        unlinked and takes a new one), so a run that ended leaves nothing behind; one killed leaves a free file."""
        if self._fd is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path)
            os.close(self._fd)  # closing the last descriptor releases the flock
            self._fd = None

    def __enter__(self) -> RunLock:
        self.acquire()
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.release()


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
    if "pid" not in holder:
        return "a process that is just starting"
    since = time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(holder.get("since", 0)))
    return f"pid {holder['pid']} on {holder.get('host', '?')} since {since}: {escape(holder.get('command', '?'))}"
