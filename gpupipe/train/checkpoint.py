"""Checkpoints that lose nothing: written atomically (temp file, fsync, rename), loaded with ``weights_only``.

``save`` and ``restore`` say what a training checkpoint holds: a :class:`TrainState`, the loader's position, the
epoch's running sums, the run's config and the RNG states.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from torch import nn

from .precision import Precision


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


def save(path: str | Path, state: TrainState, *, loader: dict, running: dict, config: dict) -> None:
    """Write a training checkpoint: ``state``, where the ``loader`` is (``{"epoch", "batch"}``), the epoch's
    ``running`` sums, the run's ``config`` and the RNG states."""
    save_atomic(
        {
            "model": state.model.state_dict(),
            "optimizer": state.optimizer.state_dict(),
            "scaler": state.precision.state_dict(),
            "scheduler": state.scheduler.state_dict(),
            "step": state.step,
            "epoch": loader["epoch"],
            "loader": loader,
            "rng": rng_state(),
            "running": running,
            "config": config,
            **({"classes": state.classes} if state.classes is not None else {}),
            **({"model_ema": state.ema.module.state_dict()} if state.ema is not None else {}),
        },
        path,
    )


def restore(saved: dict, state: TrainState) -> None:
    """Load a checkpoint (from :func:`load_for_resume`) into ``state`` and the global RNGs; the loader's position
    (``saved["loader"]``) and the running sums (``saved["running"]``) are the caller's."""
    state.model.load_state_dict(saved["model"])
    state.optimizer.load_state_dict(saved["optimizer"])
    state.precision.load_state_dict(saved["scaler"])
    state.scheduler.load_state_dict(saved["scheduler"])
    set_rng_state(saved["rng"])
    state.step = saved["step"]
    if state.ema is not None:
        state.ema.module.load_state_dict(saved["model_ema"])


def save_atomic(state: dict, path: str | Path) -> None:
    """A crash at any moment leaves either the previous file or the new one, never a torn one."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp-{os.getpid()}")
    try:
        with open(tmp, "wb") as f:
            torch.save(state, f)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    finally:
        tmp.unlink(missing_ok=True)
    dir_fd = os.open(path.parent, os.O_RDONLY)
    try:
        os.fsync(dir_fd)  # make the rename itself durable
    finally:
        os.close(dir_fd)
    _remove_torn(path)


def _remove_torn(path: Path) -> None:
    """Delete temp files that a killed writer left beside ``path`` (their process is gone; the file is useless)."""
    for tmp in path.parent.glob(f".{path.name}.tmp-*"):
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


def load_for_resume(path: str | Path) -> dict:
    """A checkpoint to resume from; an empty, truncated or foreign file is a one-line ``ValueError`` naming it."""
    try:
        state = load(path)
    except Exception as e:  # EOFError, RuntimeError (a torn zip), UnpicklingError, ...
        cause = str(e).splitlines()[0] if str(e) else type(e).__name__
        if cause.startswith("Weights only load failed"):
            cause = "not a checkpoint of tensors and plain values"
        raise ValueError(
            f"{path}: cannot resume from it ({cause}); restore a good copy, or delete it to start the run again"
        ) from None
    missing = [k for k in REQUIRED if not isinstance(state, dict) or k not in state]
    if missing:
        raise ValueError(
            f"{path}: cannot resume from it (not a gpupipe train checkpoint: no {', '.join(missing)}); "
            "restore a good copy, or delete it to start the run again"
        )
    return state


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
