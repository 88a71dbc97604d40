"""gpupipe's own exceptions: raised in the main process, naming the file, the backend and the cause."""

from __future__ import annotations

import os
import re
import sys
from collections.abc import Callable


class GpupipeError(Exception):
    """Base class of gpupipe's errors."""


class DecodeError(GpupipeError):
    """A file could not be turned into an image.

    Attributes:
        path: the file (or ``"<bytes>"`` for in-memory input).
        backend: the backend that tried.
        reason: the cause, in words.
        fix: how to go on (a loader's error names ``on_error="skip"`` and ``gpupipe check``), or ``""``.
    """

    def __init__(self, path: str, backend: str, reason: str, fix: str = ""):
        self.path = str(path)
        self.backend = backend
        self.reason = reason
        self.fix = fix
        super().__init__(self.fault + (f"; {fix}" if fix else ""))

    @property
    def fault(self) -> str:
        """The file, the backend and the cause: the message without the fix."""
        return f"{self.path}: cannot decode with backend {self.backend!r}: {self.reason}"

    def __reduce__(self):  # picklable across DataLoader workers
        return (type(self), (self.path, self.backend, self.reason, self.fix))


class TransformError(GpupipeError):
    """The user's ``transforms=`` raised on a sample: a bug in the transform, not in the file, so it is raised
    whatever ``on_error`` says (never skipped as bad data).

    Attributes:
        where: the file, or the sample's ``(epoch, index)`` when the device stage ran the transform.
        transform: the transform that raised (the member of a ``Compose`` when it can be told).
        cause: the exception, in words.
    """

    def __init__(self, where: str, transform: str, cause: str):
        self.where, self.transform, self.cause = str(where), _one_line(transform), cause
        super().__init__(
            f"{self.where}: your transforms= failed in {self.transform}: {cause} (gpupipe hands transforms uint8 "
            "(3, S, S) tensors, after the crop and before normalisation; PIL-only transforms such as ToTensor cannot "
            "take them)"
        )

    def __reduce__(self):  # picklable across DataLoader workers
        return (type(self), (self.where, self.transform, self.cause))


def _one_line(text: str) -> str:
    """A repr on one line: torchvision's ``Compose`` puts each member on a line of its own, ``RandomApply`` its own
    after spaces; the members are joined by commas, the padding inside brackets dropped."""
    out = ""
    for part in filter(None, (line.strip() for line in text.splitlines())):
        out += part if not out or out.endswith("(") or part.startswith(")") else f", {part}"
    return re.sub(r"\(\s+", "(", re.sub(r"\s+", " ", out))


class MissingFileError(FileNotFoundError, GpupipeError):
    """A source, or a file or shard it names, does not exist: the message names it. Also a
    :class:`FileNotFoundError`, so ``except FileNotFoundError`` catches it too."""


class SourceError(ValueError, GpupipeError):
    """A source that cannot be read as one: a file list's row or label, a shard's member or label, classes unlike
    the training set's. The message names the file (and the line or member) and the cause. Also a
    :class:`ValueError`."""


class NoFullBatch(ValueError, GpupipeError):
    """A batch larger than each rank's share of the data, with ``drop_last=True``: ``largest`` is the largest batch
    that makes one (0: fewer samples than ranks). Also a :class:`ValueError`."""

    def __init__(self, samples: int, ranks: int, batch_size: int, largest: int, flag: str = "batch_size="):
        self.samples, self.ranks, self.batch_size, self.largest, self.flag = samples, ranks, batch_size, largest, flag
        way = f"use {flag}{largest} or less" if largest else "use fewer ranks than samples"
        super().__init__(
            f"{samples} samples over {ranks} rank(s) make no full batch of {batch_size} with drop_last=True: {way}"
            + (", or drop_last=False" if flag == "batch_size=" else "")
        )

    def __reduce__(self):
        return (type(self), (self.samples, self.ranks, self.batch_size, self.largest, self.flag))


class LoaderClosedError(GpupipeError):
    """A closed loader (``loader.close()``, or the end of its ``with`` block) was iterated."""


class BackendUnavailableError(ModuleNotFoundError, GpupipeError):
    """A known backend cannot be built on this machine; the message says how to fix it."""


class StorageError(GpupipeError):
    """Object storage could not give the bytes (after retries, for transient causes): the message names the URL and
    the cause. Not a bad sample: a loader raises it whatever ``on_error`` says."""


TRACEBACK_ENV = "GPUPIPE_TRACEBACK"  # set (to anything but 0) for full tracebacks instead of one-line errors


def show_traceback() -> bool:
    """Whether the command line shows the full traceback (for a bug report) instead of the one-line error."""
    return os.environ.get(TRACEBACK_ENV, "0") not in ("", "0")


def interrupt_behind(e: BaseException) -> KeyboardInterrupt | None:
    """The Ctrl-C behind ``e``: ``e`` itself, or the ``KeyboardInterrupt`` in its chain of causes. A Ctrl-C raised
    inside a library can come out as the library's own error: DALI's as it builds a pipeline, or a ``RuntimeError:
    release unlocked lock`` from a thread pool's lock it broke."""
    seen: set[int] = set()
    cause: BaseException | None = e
    while cause is not None and id(cause) not in seen:
        if isinstance(cause, KeyboardInterrupt):
            return cause
        seen.add(id(cause))
        cause = cause.__cause__ or cause.__context__
    return None


def error_line(e: BaseException) -> str:
    """One line naming the file and the cause: ``path: No space left on device`` for a system error, the message
    (on one line) for the others."""
    from ._names import one_line

    if isinstance(e, OSError) and e.errno is not None and e.strerror:
        text = f"{e.filename}: {e.strerror}" if e.filename else e.strerror
    else:
        text = str(e) or type(e).__name__
    return one_line(text)


def run_script(main: Callable[[], object]) -> None:
    """``main()`` of a ``python -m gpupipe...`` script: its mistakes one line, as the gpupipe command says them (the
    whole traceback with GPUPIPE_TRACEBACK set)."""
    try:
        main()
    except (GpupipeError, ValueError, OSError, ModuleNotFoundError) as e:
        if show_traceback():
            raise
        sys.exit(f"error: {error_line(e)}")
