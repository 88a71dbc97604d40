"""``gpupipe train`` resumed under another number of ranks (a preempted job relaunched on what is free).

A checkpoint records the run's ranks, per-rank batch and accumulation (its config's ``world_size``, ``batch_size``,
``accum``), and its loader state the position in samples of the epoch (``Loader.state_dict``). Resumed over another
number of ranks with the same flags, the run keeps the global batch (ranks x batch x accum) where whole numbers allow:
the largest per-rank batch not above the saved one, the rest as accumulation (``fit``), said in one line. Where they do
not, the global batch changes: the loader re-splits the epoch's remaining samples, and the LR schedule goes on by
samples seen (``continue_schedule``), not by a step count whose meaning changed.
"""

from __future__ import annotations

import contextlib
import dataclasses
import warnings
from collections.abc import Iterator
from pathlib import Path

import torch

from .._files import special_kind
from ..data.position import ResumeNotice
from .checkpoint import TrainState
from .config import TrainConfig


def saved_layout(config: dict) -> tuple[int, int, int] | None:
    """``(world_size, batch_size, accum)`` of the run that saved ``config``; None where it records no number of ranks
    (saved by an earlier version)."""
    if "world_size" not in config:
        return None
    return int(config["world_size"]), int(config.get("batch_size", 1)), int(config.get("accum", 1))


def fit(batch_size: int, accum: int, saved_world: int, world: int) -> tuple[int, int]:
    """The per-rank batch and accumulation that keep ``saved_world x batch_size x accum`` samples an optimizer step over
    ``world`` ranks: the largest per-rank batch not above ``batch_size`` that divides a rank's share; unchanged where no
    whole share exists."""
    total = saved_world * batch_size * accum
    if total % world:
        return batch_size, accum
    share = total // world
    batch = max(d for d in range(1, min(batch_size, share) + 1) if share % d == 0)
    return batch, share // batch


def as_saved_at(config: dict, world: int) -> dict:
    """The saved ``config`` with the per-rank batch and accumulation it takes over ``world`` ranks: what a resume over
    ``world`` ranks compares its settings with."""
    saved = saved_layout(config)
    if saved is None or saved[0] == world:
        return config
    batch, accum = fit(saved[1], saved[2], saved[0], world)
    return {**config, "batch_size": batch, "accum": accum}


def fit_world_size(cfg: TrainConfig, ckpt_path: Path, world: int) -> tuple[TrainConfig, str | None]:
    """``cfg`` for resuming ``ckpt_path`` over ``world`` ranks, and the line that says what changed with the number of
    ranks (None: nothing did). The per-rank batch and accumulation are fitted only where ``cfg`` has the saved ones
    (the same flags); other values are the user's, and the resume's comparison of settings judges them."""
    if special_kind(ckpt_path) is not None:  # a fifo would block the load: the resume reports it
        return cfg, None
    try:  # the settings alone: tensors mapped, not read; a damaged file is the resume's to report
        saved = torch.load(ckpt_path, map_location="cpu", weights_only=True, mmap=True)
        config, loader = dict(saved["config"]), dict(saved["loader"])
    except Exception:
        return cfg, None
    layout = saved_layout(config)
    if layout is None:
        if int(loader.get("batch", 0)) == 0:
            return cfg, None
        return cfg, (
            f"{ckpt_path}: this checkpoint records no number of ranks (an earlier gpupipe): its position, epoch "
            f"{loader.get('epoch')} batch {loader.get('batch')}, is read as this run's own batches over {world} "
            "rank(s); it is right only with as many ranks as it was saved with"
        )
    saved_world, batch, accum = layout
    if saved_world == world:
        return cfg, None
    fitted = fit(batch, accum, saved_world, world)
    if (cfg.batch_size, cfg.accum) == (batch, accum):
        cfg = dataclasses.replace(cfg, batch_size=fitted[0], accum=fitted[1])
    elif (cfg.batch_size, cfg.accum) != fitted:
        raise ValueError(_refusal(ckpt_path, layout, world, cfg, fitted))
    before, now = saved_world * batch * accum, world * cfg.batch_size * cfg.accum
    said = (
        f"{ckpt_path}: saved with {saved_world} rank(s) x batch {batch} x accum {accum} (global batch {before}); "
        f"over {world} rank(s) now: batch {cfg.batch_size} x accum {cfg.accum}"
    )
    if before == now:
        return cfg, f"{said} keep the global batch"
    return cfg, (
        f"{said}, global batch {now}: the epoch's remaining samples are re-split into steps of {now} and the LR "
        "schedule goes on by samples seen"
    )


def _refusal(path: Path, saved: tuple[int, int, int], world: int, cfg: TrainConfig, fitted: tuple[int, int]) -> str:
    """Another per-rank batch or accumulation than the saved one or its fit, under another number of ranks: both are
    fixed on resume (they decide the data order), so the line says both layouts and the flags that resume."""
    saved_world, batch, accum = saved
    return (
        f"{path}: saved with {saved_world} rank(s) x batch {batch} x accum {accum} (global batch "
        f"{saved_world * batch * accum}); asked: {world} rank(s) x batch {cfg.batch_size} x accum {cfg.accum} (global "
        f"batch {world * cfg.batch_size * cfg.accum}): the number of ranks changed, and the per-rank batch and accum "
        f"resume as saved; pass --batch-size {batch} --accum {accum} (over {world} rank(s): batch {fitted[0]} x accum "
        f"{fitted[1]}), or start a new run in another --out"
    )


def continue_schedule(state: TrainState, config: dict, cfg: TrainConfig, world: int) -> None:
    """After ``state`` was restored from a checkpoint saved with ``config``: where the samples an optimizer step takes
    changed, the schedule's step count becomes the samples seen over the new step's samples, and the LR follows."""
    saved = saved_layout(config)
    scheduler = state.scheduler
    if saved is None or not isinstance(scheduler, torch.optim.lr_scheduler.LambdaLR):
        return
    before, now = saved[0] * saved[1] * saved[2], world * cfg.batch_size * cfg.accum
    if before == now:
        return
    scheduler.last_epoch = round(scheduler.last_epoch * before / now)
    lrs = [base * f(scheduler.last_epoch) for f, base in zip(scheduler.lr_lambdas, scheduler.base_lrs, strict=True)]
    for group, lr in zip(state.optimizer.param_groups, lrs, strict=True):
        group["lr"] = lr
    scheduler._last_lr = lrs  # what get_last_lr() reports (the logs' LR)


@contextlib.contextmanager
def quiet_resume_notices() -> Iterator[None]:
    """The loader's one-line notice of a re-split epoch, left out: ``fit_world_size``'s line says it for the run."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", ResumeNotice)
        yield
