"""Checkpoints that lose nothing: written atomically (temp file, fsync, rename) with a sha256 digest, the last few
kept, verified and loaded with ``weights_only``.

``save`` and ``restore`` say what a training checkpoint holds: a :class:`TrainState`, the loader's position, the
epoch's running sums, the run's config and the RNG states.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any, cast

import torch
from torch import nn

from .._files import open_regular
from ..errors import GpupipeError
from .precision import Precision
from .stop import interrupt_point


@dataclass
class TrainState:
    """The model and everything that decides its next update: what a resume restores besides the data's position."""

    model: nn.Module
    optimizer: torch.optim.Optimizer
    scheduler: torch.optim.lr_scheduler.LRScheduler
    precision: Precision
    ema: Any = None  # timm's ModelEmaV3 (its ``module`` is saved), or None
    step: int = 0  # optimizer steps taken
    classes: list[str] | None = None  # the training set's class names, by label: what `gpupipe eval` labels with


def save(
    path: str | Path,
    state: TrainState,
    *,
    loader: dict,
    running: dict,
    config: dict,
    keep: int = 2,
    rank_buffers: list[dict] | None = None,
    rank_running: list[dict] | None = None,
) -> None:
    """Write a training checkpoint: ``state``, where the ``loader`` is (``{"epoch", "batch"}``), the epoch's
    ``running`` sums, the run's ``config``, the RNG states and, under DDP, each rank's buffers (``rank_buffers``:
    :func:`restore_rank_buffers`) and running sums (``rank_running``: ``resume.rank_running``); the newest ``keep``
    are kept (:func:`save_atomic`)."""
    save_atomic(
        {
            "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "scaler": state.precision.state_dict(),
            "scheduler": state.scheduler.state_dict(),
            "step": state.step,
            "saved_at": time.time_ns(),  # the save order, which a copy of the run folder keeps (not so mtimes)
            "epoch": loader["epoch"],
            "loader": loader,
            "rng": rng_state(),
            "running": running,
            "config": config,
            **({"classes": state.classes} if state.classes is not None else {}),
            **({"model_ema": state.ema.module.state_dict()} if state.ema is not None else {}),
            **({"rank_buffers": rank_buffers} if rank_buffers is not None else {}),
            **({"rank_running": rank_running} if rank_running is not None else {}),
        },
        path,
        keep,
    )


def restore(saved: dict, state: TrainState) -> None:
    """Load a checkpoint (from :func:`load_for_resume`) into ``state`` and the global RNGs; the loader's position
    (``saved["loader"]``) and the running sums (``saved["running"]``) are the caller's."""
    state.model.load_state_dict(saved["model"])
    load_optimizer(state.optimizer, saved["optimizer"])
    state.precision.load_state_dict(saved["scaler"])
    state.scheduler.load_state_dict(saved["scheduler"])
    set_rng_state(saved["rng"])
    state.step = saved["step"]
    if state.ema is not None:
        state.ema.module.load_state_dict(saved["model_ema"])


def load_optimizer(optimizer: torch.optim.Optimizer, saved: dict) -> None:
    """The saved state and settings, but the implementation this run built (``fused``, ``foreach``): a checkpoint's
    param groups carry those of the run that saved it, and an fp16 run's fused optimizer (GradScaler hands it the inf
    check) turned back into a plain one by a checkpoint saved before fp16 was fused fails its first step."""
    built: list[dict[str, Any]] = [{k: g[k] for k in ("fused", "foreach") if k in g} for g in optimizer.param_groups]
    optimizer.load_state_dict(saved)
    for group, implementation in zip(optimizer.param_groups, built, strict=True):
        group.update(implementation)


def restore_rank_buffers(saved: dict, model: torch.nn.Module, rank: int, world_size: int) -> None:
    """This rank's own buffers (BatchNorm's running statistics), when the checkpoint kept every rank's and the run
    has as many ranks; otherwise the model keeps the saved ones (rank 0's, or the average at an epoch's end)."""
    per_rank = saved.get("rank_buffers")
    if per_rank is None or len(per_rank) != world_size:
        return
    with torch.no_grad():
        for name, b in model.named_buffers():
            if name in per_rank[rank]:
                b.copy_(per_rank[rank][name])


class CheckpointError(GpupipeError, ValueError):
    """A checkpoint that cannot be resumed from; the message names the file, the cause and what to do."""


# A checkpoint file is torch.save's zip followed by this trailer: the sha256 of every byte before it. torch.load
# reads the zip from its end-of-archive record and ignores the trailer; ``verify`` reads it back.
_MAGIC = b"\ngpupipe-checkpoint-sha256 "
_TRAILER_SIZE = len(_MAGIC) + 64 + 1
KEEP = 2  # checkpoints kept by default: the newest (last.pt) and the one before it


class _Hashing:
    """A file wrapper that hashes what is written through it (torch.save writes its zip sequentially)."""

    def __init__(self, f):
        self.f, self.sha = f, hashlib.sha256()
        self.error: OSError | None = None  # torch reports a failed write as "unexpected pos": keep the real cause

    def write(self, data) -> int:
        interrupt_point()  # a second Ctrl-C abandons the write here
        self.sha.update(data)
        try:
            return self.f.write(data)
        except OSError as e:
            self.error = e
            raise

    def flush(self) -> None:
        self.f.flush()


class WriteInterrupted(KeyboardInterrupt):
    """A ``KeyboardInterrupt`` (a second Ctrl-C) during :func:`save_atomic`; the message says which checkpoint
    ``path`` holds now: the previous one (the write was abandoned), the new one (it was in place), or none."""


def save_atomic(state: dict, path: str | Path, keep: int = KEEP) -> None:
    """Write ``state`` to ``path`` with its digest. A crash at any moment leaves either the previous file or the new
    one, never a torn one; the newest ``keep`` checkpoints stay beside it as ``step-<step>.pt`` (hard links: no
    extra space for the newest), so a damaged ``path`` leaves an earlier good one to resume from. An interrupt
    (``KeyboardInterrupt``) during the write is :class:`WriteInterrupted`, saying which checkpoint is kept."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    tmp.unlink(missing_ok=True)  # one of this pid's, left by a killed process before it: stale (or a planted link)
    hashing, written = None, None
    try:
        fd = os.open(tmp, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW, 0o644)
        written = os.fstat(fd).st_ino  # the new file: ``path`` holds it once it is renamed
        with os.fdopen(fd, "wb") as f:
            hashing = _Hashing(f)
            torch.save(state, hashing)  # type: ignore[arg-type]  # torch only calls write() and flush()
            f.write(_MAGIC + hashing.sha.hexdigest().encode() + b"\n")
            f.flush()
            os.fsync(f.fileno())
        if keep > 1 and "step" in state:
            _keep_copy(tmp, path.with_name(f"step-{int(state['step']):08d}.pt"))
        os.replace(tmp, path)
    except KeyboardInterrupt:
        raise _interrupted(path, written) from None
    except (OSError, RuntimeError) as e:  # a full disk, a quota, a read-only folder; torch wraps some as RuntimeError
        if isinstance(e.__context__, KeyboardInterrupt):  # raised in a write() torch called: "unexpected pos ..."
            raise _interrupted(path, written) from None
        cause = _cause(hashing.error if hashing is not None and hashing.error is not None else e)
        raise CheckpointError(
            f"{path}: cannot write the checkpoint ({cause}); the previous checkpoint, if any, is intact"
        ) from e
    finally:
        tmp.unlink(missing_ok=True)
    _fsync_dir(path.parent)  # make the rename itself durable
    _remove_torn(path)
    _prune(path.parent, keep)


def _interrupted(path: Path, written: int | None) -> WriteInterrupted:
    """What an interrupted :func:`save_atomic` left at ``path``, ``written`` being the new file's inode."""
    try:
        now = os.stat(path).st_ino
    except FileNotFoundError:
        return WriteInterrupted(f"the write of {path} was interrupted, and no checkpoint was saved before it")
    if now == written:
        return WriteInterrupted(f"{path} is the checkpoint just written: the interrupt came once it was in place")
    problem = verify(path)
    kept = "it verifies" if problem is None else f"but it does not verify: {problem}"
    return WriteInterrupted(f"the write of {path} was interrupted: it still holds the previous checkpoint, and {kept}")


def _keep_copy(tmp: Path, kept: Path) -> None:
    """``kept`` holding ``tmp``'s bytes: a hard link, or a copy where the file system has none."""
    partial = kept.with_name(f".{kept.name}.tmp-{os.getpid()}")
    partial.unlink(missing_ok=True)
    try:
        os.link(tmp, partial)
    except OSError:
        shutil.copyfile(tmp, partial)
    os.replace(partial, kept)


def _fsync_dir(folder: Path) -> None:
    dir_fd = os.open(folder, os.O_RDONLY)
    try:
        os.fsync(dir_fd)
    finally:
        os.close(dir_fd)


def kept(folder: str | Path) -> list[Path]:
    """The kept ``step-*.pt`` checkpoints in ``folder``, newest first (by modification time, then name)."""
    files = []
    for p in Path(folder).glob("step-*.pt"):
        with contextlib.suppress(FileNotFoundError):
            files.append((p.stat().st_mtime_ns, p.name, p))
    return [p for *_, p in sorted(files, reverse=True)]


def _prune(folder: Path, keep: int) -> None:
    for old in kept(folder)[max(keep, 1) :]:
        old.unlink(missing_ok=True)


def _remove_torn(path: Path) -> None:
    """Delete temp files that a killed writer left beside ``path`` (their process is gone; the file is useless)."""
    for tmp in path.parent.glob(".*.pt.tmp-*"):
        try:
            pid = int(tmp.name.rsplit("-", 1)[1])
            os.kill(pid, 0)  # raises when no such process: the writer is dead
        except ProcessLookupError:
            tmp.unlink(missing_ok=True)
        except (ValueError, PermissionError):  # not our naming, or a live process of another user: leave it
            pass


REQUIRED = ("model", "optimizer", "scaler", "scheduler", "step", "loader", "rng", "running")


def load(path: str | Path, map_location="cpu") -> dict:
    return torch.load(path, map_location=map_location, weights_only=True)


def verify(path: str | Path) -> str | None:
    """Why ``path`` is damaged (its digest does not match, or it has none), or None when it is whole; a fifo or a
    device is an ``OSError`` saying what it is, never read (a fifo would block)."""
    with open_regular(path) as f:
        size = os.fstat(f.fileno()).st_size
        if size < _TRAILER_SIZE:
            return "empty" if size == 0 else f"not a gpupipe train checkpoint: {size} bytes, no digest"
        f.seek(size - _TRAILER_SIZE)
        trailer = f.read(_TRAILER_SIZE)
        if not trailer.startswith(_MAGIC) or not trailer.endswith(b"\n"):
            return "no gpupipe digest at its end: truncated, damaged, or not written by gpupipe train"
        f.seek(0)
        sha, left = hashlib.sha256(), size - _TRAILER_SIZE
        while left:
            chunk = f.read(min(left, 1 << 20))
            if not chunk:
                return "shorter than when it was read"
            sha.update(chunk)
            left -= len(chunk)
    if sha.hexdigest().encode() != trailer[len(_MAGIC) : -1]:
        return "damaged: its contents do not match their sha256 digest"
    return None


def load_for_resume(path: str | Path) -> dict:
    """A checkpoint to resume from, its digest checked; an empty, truncated, damaged or foreign file is a one-line
    :class:`CheckpointError` naming it and the newest earlier good checkpoint kept beside it, if any."""
    state = None
    try:
        problem = verify(path)
        state = load(path) if problem is None else None
    except Exception as e:  # OSError, EOFError, RuntimeError (a torn zip), UnpicklingError, ...
        problem = _cause(e)
        if problem.startswith("Weights only load failed"):
            problem = "not a checkpoint of tensors and plain values"
    missing = [k for k in REQUIRED if not isinstance(state, dict) or k not in state]
    if problem is None and missing:
        problem = f"not a gpupipe train checkpoint: no {', '.join(missing)}"
    if problem is not None:
        raise CheckpointError(f"{path}: cannot resume from it ({problem}); {_offer(Path(path))}") from None
    return cast(dict, state)


def _offer(path: Path) -> str:
    """What to do about a bad ``path``: resume from the newest good checkpoint kept beside it, else start again."""
    good = newest_good(path)
    if good is None:
        return "no earlier good checkpoint is kept: restore a good copy, or delete it to start the run again"
    other, saved = good
    where = f"epoch {saved['loader']['epoch']}, batch {saved['loader']['batch']}, step {saved['step']}"
    return f"the previous good checkpoint is {other} ({where}): resume from it with --resume-from {other}"


def newest_good(path: Path) -> tuple[Path, dict] | None:
    """The newest good checkpoint kept beside a bad ``path`` and what it holds (its tensors mapped, not read), by
    the order they were saved in: the time each records, or the file's modification time for one saved before
    checkpoints recorded it. A copy of the run folder (``cp -r``) gives every file the copy's time; the recorded
    one still tells the step file of ``path``'s own save from the one before it."""
    found = []
    for other in kept(path.parent):
        if other.exists() and path.exists() and os.path.samefile(other, path):
            continue  # the same file under its kept name
        with contextlib.suppress(Exception):
            if verify(other) is None:
                saved = torch.load(other, map_location="cpu", weights_only=True, mmap=True)
                found.append((saved.get("saved_at", other.stat().st_mtime_ns), other, saved))
    if not found:
        return None
    _, other, saved = max(found, key=lambda f: f[0])
    return other, saved


def _cause(e: BaseException) -> str:
    """An exception's first line: its message, or its type's name when it has none."""
    if isinstance(e, OSError) and e.strerror:
        return e.strerror
    text = str(e).strip()
    return text.splitlines()[0] if text else type(e).__name__


def rng_state() -> dict:
    import random

    state = {"torch": torch.get_rng_state(), "python": random.getstate()}
    if torch.cuda.is_available():
        state["cuda"] = torch.cuda.get_rng_state_all()
    return state


def set_rng_state(state: dict) -> None:
    import random

    torch.set_rng_state(state["torch"])
    random.setstate(state["python"])
    if "cuda" in state and torch.cuda.is_available():
        torch.cuda.set_rng_state_all(state["cuda"])
