"""``gpupipe train``: one loop that reads top to bottom — data, model, precision, accumulation, DDP, checkpoints.

``train()`` sets the run up and loops over epochs; ``train_one_epoch()`` runs its micro-steps. The helpers below
them follow in the order ``train()`` calls them. Precision (autocast, fp16's scaler, clipping, the optimizer step)
is ``precision.Precision``; what a checkpoint holds is ``checkpoint.TrainState``.
"""

from __future__ import annotations

import contextlib
import math
import os
import time
from collections.abc import Callable
from dataclasses import asdict
from functools import partial
from pathlib import Path
from typing import cast

import torch
from torch import nn

from ..api import build_loader
from ..data.loader import Loader
from ..mix import Mix
from ..recipe import Recipe
from . import checkpoint
from .checkpoint import TrainState
from .config import RESUME_CHANGEABLE, RESUME_FIXED, TrainConfig, to_yaml
from .distributed import Distributed
from .logging import Meter, RunLogger
from .precision import Precision

DATA_WAIT_WARN = 0.20


def train(cfg: TrainConfig, model: nn.Module | None = None) -> dict:
    """Train; returns the last epoch's metrics (``{}`` when the resumed run had already finished). ``model``
    replaces the timm model named in ``cfg``."""
    dist = Distributed(cfg.device, cfg.dist_timeout_s)
    device = dist.device
    out, ckpt_path = Path(cfg.out), checkpoint_path(cfg)
    resume = resuming(cfg, out, ckpt_path)  # refuses to overwrite a run, or to resume none, before reading data
    if model is None:
        check_model_name(cfg.model)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input shapes: pick the fastest conv kernels once

    # Data: every rank reads its own shard, and every rank takes the same number of steps.
    train_loader, val_loader = build_loaders(cfg, device)
    steps_per_epoch = len(train_loader) // cfg.accum
    if steps_per_epoch == 0:
        raise ValueError(f"{len(train_loader)} batches per epoch make no optimizer step with --accum {cfg.accum}")
    num_classes = len(train_loader.dataset.classes)

    # Model, optimizer, schedule, precision, loss.
    model = model if model is not None else build_model(cfg, num_classes)
    memory_format = torch.channels_last if cfg.channels_last else torch.preserve_format
    model.to(device, memory_format=memory_format)  # type: ignore[call-overload]  # torch's stubs lack this overload
    optimizer = build_optimizer(cfg, model)
    warmup_steps = round(cfg.warmup_epochs * steps_per_epoch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps_per_epoch * cfg.epochs, warmup_steps))
    precision = Precision(cfg.precision, device, clip=cfg.clip)
    state = TrainState(model, optimizer, scheduler, precision, ema=build_ema(cfg, model))
    criterion, mix = build_criterion(cfg, num_classes)

    # Resume: everything that decides the rest of the run, the loader's position included.
    meter, changed = Meter(), []
    if resume:
        saved = checkpoint.load_for_resume(ckpt_path)
        changed = check_resumable(saved.get("config", {}), cfg, ckpt_path)
        checkpoint.restore(saved, state)  # model, optimizer, scaler, scheduler, EMA, step count, RNG states
        train_loader.load_state_dict(saved["loader"])
        meter = Meter(**saved["running"])  # the resumed epoch's sums so far
    start = train_loader.state_dict()  # epoch 0, batch 0 on a new run

    # DDP after the resume: it starts every rank from rank 0's weights. Compile last, around what runs.
    run_model = dist.wrap(model)
    run_model = cast(nn.Module, torch.compile(run_model)) if cfg.compile else run_model  # an OptimizedModule

    logger = RunLogger(out, enabled=dist.is_main, total=steps_per_epoch * cfg.accum, world_size=dist.world_size)
    if dist.is_main:
        write_config(out, cfg, resume, changed, state.step, logger)
    if start["epoch"] >= cfg.epochs:
        logger.note(
            f"{ckpt_path}: the run already finished its {cfg.epochs} epochs; nothing to do (to train "
            "longer, raise --epochs with --allow-config-change)"
        )
        logger.close()
        dist.close()
        return {}
    if resume:
        where = f"epoch {start['epoch']}, batch {start['batch']} (optimizer step {state.step})"
        logger.note(f"resumed from {where} of {ckpt_path}")

    metrics: dict = {}
    try:
        for epoch in range(start["epoch"], cfg.epochs):
            train_loader.set_epoch(epoch)  # the resumed epoch keeps the checkpoint's position
            first = train_loader.state_dict()["batch"]
            meter = meter if first > 0 else Meter()  # a resumed epoch goes on with its sums
            if first >= steps_per_epoch * cfg.accum:  # the checkpoint was the epoch's last step
                continue
            train_one_epoch(epoch, first, state, run_model, train_loader, criterion, mix, meter, cfg, dist, logger)
            metrics = epoch_metrics(epoch, meter, dist)
            dist.average_buffers(model)  # BatchNorm statistics agree on every rank before evaluation and saving
            metrics.update(validate(run_model, state.ema, val_loader, precision, dist))
            metrics["lr"] = scheduler.get_last_lr()[0]
            metrics["skipped"] = len(train_loader.skipped)
            metrics["fallbacks"] = train_loader.fallbacks
            skipped = train_loader.skipped + (val_loader.skipped if val_loader is not None else [])
            logger.end_epoch(metrics, hint=data_wait_hint(metrics["data_wait"], cfg), skipped=skipped)
            save_checkpoint(state, {"epoch": epoch + 1, "batch": 0}, meter, cfg, dist)
    finally:
        logger.close()
        dist.close()
    return metrics


def train_one_epoch(
    epoch: int,
    first: int,
    state: TrainState,
    run_model: nn.Module,
    loader: Loader,
    criterion: nn.Module,
    mix: Mix | None,
    meter: Meter,
    cfg: TrainConfig,
    dist: Distributed,
    logger: RunLogger,
) -> None:
    """The epoch's micro-batches from ``first`` on: forward and backward on each, an optimizer step on every
    ``cfg.accum``-th (``need_update``), progress every ``cfg.log_every``, a checkpoint every ``cfg.save_every`` steps.

    ``run_model`` is the model as called (DDP-wrapped, compiled); ``state.model`` the bare one.
    """
    optimizer, scheduler, precision, ema = state.optimizer, state.scheduler, state.precision, state.ema
    n_batches = len(loader) // cfg.accum * cfg.accum  # a tail shorter than --accum is left out
    run_model.train()
    logger.start_epoch(epoch, first)
    ddp = cast(nn.parallel.DistributedDataParallel, run_model)  # its no_sync, under DDP (a compiled one forwards it)
    batches = iter(loader)
    meter.start()
    for batch_idx in range(first, n_batches):
        t_wait = time.perf_counter()
        images, labels = next(batches)
        wait = time.perf_counter() - t_wait
        targets = labels
        if mix is not None:  # its stream keyed by (seed, epoch, batch, rank): a resumed run mixes alike
            mix.rng.seed([cfg.seed, epoch, batch_idx, dist.rank])
            images, targets = mix(images, labels)
        need_update = (batch_idx + 1) % cfg.accum == 0

        # Under DDP, gradients are all-reduced only on the micro-batch that ends an accumulation.
        with ddp.no_sync() if dist.enabled and not need_update else contextlib.nullcontext():
            with precision.autocast():
                loss = criterion(run_model(images), targets)
            precision.backward(loss / cfg.accum)  # the accumulated gradient is the mean over the micro-batches
        if need_update:
            if precision.step(optimizer):  # a step fp16's scaler skipped (inf/NaN gradients) leaves the LR too
                scheduler.step()
            optimizer.zero_grad(set_to_none=True)
            state.step += 1
            if ema is not None:
                ema.update(state.model, step=state.step)

        meter.update(loss, len(labels), wait)
        if (batch_idx + 1) % cfg.log_every == 0 or batch_idx + 1 == n_batches:
            meter.sync()  # one host sync every log_every micro-batches, not every one
            logger.progress(batch_idx + 1, meter, float(scheduler.get_last_lr()[0]), state.step)
        if need_update and cfg.save_every and state.step % cfg.save_every == 0 and batch_idx + 1 < n_batches:
            meter.sync()
            save_checkpoint(state, {"epoch": epoch, "batch": batch_idx + 1}, meter, cfg, dist)


def resuming(cfg: TrainConfig, out: Path, ckpt_path: Path) -> bool:
    """Whether this run resumes the one in ``out``. Refuses, before any data is read, to overwrite a run, to resume
    one that saved no checkpoint, or to overwrite another run's config."""
    resume = ckpt_path.exists() and (cfg.resume or cfg.resume_or_start)
    if ckpt_path.exists() and not resume:
        raise FileExistsError(f"{ckpt_path} exists: pass --resume to continue that run, or choose another --out")
    if cfg.resume and not resume and not cfg.resume_or_start:
        raise FileNotFoundError(
            f"--resume: no checkpoint at {ckpt_path}: check --out, or drop --resume to start a "
            "new run (--resume-or-start starts one when there is nothing to resume)"
        )
    config_file = out / "config.yaml"
    if not resume and config_file.exists() and config_file.read_text() != to_yaml(cfg):
        raise FileExistsError(
            f"{config_file} holds another run's config (it saved no checkpoint): choose another "
            "--out, or delete that folder"
        )
    return resume


def check_model_name(name: str) -> None:
    """An unknown timm model is a one-line error with the closest names, before any data is read."""
    import difflib

    import timm

    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3, cutoff=0.6)
        hint = f"closest: {', '.join(close)}" if close else "see timm.list_models()"
        raise ValueError(f"unknown --model {name!r}; {hint}")


def build_loaders(cfg: TrainConfig, device: torch.device) -> tuple[Loader, Loader | None]:
    """The train loader, with the recipe's per-image policies, and the validation loader (None without --val),
    labelled with the training classes whatever its folder holds."""
    recipe = Recipe(
        cfg.image_size,
        auto_augment=cfg.aa,
        color_jitter=cfg.color_jitter,
        re_prob=cfg.reprob,
        re_mode=cfg.remode,
        re_count=cfg.recount,
    )  # the policies apply to the train loader only
    loader = partial(
        build_loader,
        backend=cfg.backend,
        batch_size=cfg.batch_size,
        image_size=cfg.image_size,
        device=device,
        num_workers=cfg.workers,
        seed=cfg.seed,
        channels_last=cfg.channels_last,
        on_error=cfg.on_error,  # type: ignore[arg-type]  # TrainConfig checked it is one of ON_ERROR
        recipe=recipe,
    )
    train_loader = loader(cfg.data, train=True)
    if not cfg.val:
        return train_loader, None
    return train_loader, loader(cfg.val, train=False, class_to_idx=train_loader.dataset.class_to_idx)


def build_model(cfg: TrainConfig, num_classes: int) -> nn.Module:
    import timm  # defer: only training needs it

    return timm.create_model(cfg.model, pretrained=False, num_classes=num_classes)  # random init: no downloads


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    # no weight decay on norms and biases, as timm and most recipes do
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0)


def warmup_cosine(total_steps: int, warmup_steps: int) -> Callable[[int], float]:
    """The LR factor at each optimizer step: linear warm-up, then cosine decay to 0 at ``total_steps``."""

    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def build_ema(cfg: TrainConfig, model: nn.Module):
    """timm's ModelEmaV3 of ``model`` with --model-ema, else None."""
    if not cfg.model_ema:
        return None
    from timm.utils import ModelEmaV3  # defer: only training needs timm

    return ModelEmaV3(model, decay=cfg.model_ema_decay)


def build_criterion(cfg: TrainConfig, num_classes: int) -> tuple[nn.Module, Mix | None]:
    """Cross-entropy, and MixUp/CutMix when asked for. Mixing makes soft targets with the smoothing already in
    them, so the criterion then takes probabilities and smooths nothing itself."""
    if cfg.mixup <= 0 and cfg.cutmix <= 0:
        return nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing), None
    mix = Mix(
        cfg.mixup,
        cfg.cutmix,
        cfg.mixup_prob,
        cfg.mixup_switch_prob,
        label_smoothing=cfg.label_smoothing,
        num_classes=num_classes,
    )
    return nn.CrossEntropyLoss(), mix


def _same(key: str, a, b) -> bool:
    if key == "data" and isinstance(a, str) and isinstance(b, str):
        return os.path.realpath(a) == os.path.realpath(b)
    return a == b


def check_resumable(saved: dict, cfg: TrainConfig, path: Path) -> list[str]:
    """The changeable keys that differ from the checkpoint's run (allowed with ``allow_config_change``); a change
    to a fixed key, or an unallowed one, is a ``ValueError`` listing each ``key old -> new``."""

    def diff(keys):
        return [
            f"{k} {saved[k]!r} -> {getattr(cfg, k)!r}"
            for k in keys
            if k in saved and not _same(k, saved[k], getattr(cfg, k))
        ]

    fixed, changeable = diff(RESUME_FIXED), diff(RESUME_CHANGEABLE)
    if fixed:
        raise ValueError(
            f"{path}: cannot resume with {'; '.join(fixed)}: they decide the checkpoint's shapes or the "
            "data order; restore them, or start a new run in another --out"
        )
    if changeable and not cfg.allow_config_change:
        raise ValueError(
            f"{path}: the run was made with other settings: {'; '.join(changeable)}; restore them, or "
            "pass --allow-config-change to resume with the new ones"
        )
    return changeable


def write_config(out: Path, cfg: TrainConfig, resume: bool, changed: list[str], step: int, logger: RunLogger) -> None:
    """``out/config.yaml``: the run's settings. A resume with changed settings keeps the old file beside it."""
    config_file = out / "config.yaml"
    out.mkdir(parents=True, exist_ok=True)
    if changed and config_file.exists():  # keep the settings the run was started with
        kept = config_file.rename(out / f"config.before-step-{step}.yaml")
        logger.note(f"settings changed: {'; '.join(changed)} (the previous config is kept in {kept})")
    if not resume or changed or not config_file.exists():
        config_file.write_text(to_yaml(cfg))


def save_checkpoint(state: TrainState, position: dict, meter: Meter, cfg: TrainConfig, dist: Distributed) -> None:
    """``checkpoints/last.pt`` with the loader's ``position`` (``{"epoch", "batch"}``) to resume from. Every rank
    holds the same weights: rank 0 writes, the others wait for it."""
    if dist.is_main:
        config = asdict(cfg)
        checkpoint.save(checkpoint_path(cfg), state, loader=position, running=meter.state_dict(), config=config)
    dist.barrier()


def checkpoint_path(cfg: TrainConfig) -> Path:
    return Path(cfg.out) / "checkpoints" / "last.pt"


def validate(run_model: nn.Module, ema, loader: Loader | None, precision: Precision, dist: Distributed) -> dict:
    """``val_loss`` and ``val_acc`` of the model, and of its EMA (``ema_val_...``); {} without validation data."""
    if loader is None:
        return {}
    metrics = evaluate(run_model, loader, precision, dist)
    if ema is not None:
        metrics.update({f"ema_{k}": v for k, v in evaluate(ema.module, loader, precision, dist).items()})
    return metrics


def evaluate(model: nn.Module, loader: Loader, precision: Precision, dist: Distributed) -> dict:
    model.eval()
    loss_sum = correct = count = 0.0
    criterion = nn.CrossEntropyLoss(reduction="sum")
    with torch.inference_mode():
        for images, labels in loader:
            with precision.autocast():
                logits = model(images)
            loss_sum += criterion(logits.float(), labels).item()
            correct += (logits.argmax(1) == labels).sum().item()
            count += len(labels)
    loss_sum, correct, count = dist.all_reduce_sum([loss_sum, correct, count])
    return {"val_loss": loss_sum / count, "val_acc": correct / count}


def epoch_metrics(epoch: int, meter: Meter, dist: Distributed) -> dict:
    """The epoch's metrics over all ranks: mean loss, images per second (all ranks') and the share of time spent
    waiting for data."""
    loss, images, wait, elapsed = dist.all_reduce_sum([meter.loss, meter.images, meter.wait, meter.time])
    elapsed_mean = elapsed / dist.world_size
    return {
        "epoch": epoch,
        "train_loss": loss / max(images, 1),
        "images_per_s": images / max(elapsed_mean, 1e-9),
        "data_wait": wait / max(elapsed, 1e-9),
    }


def data_wait_hint(data_wait: float, cfg: TrainConfig) -> str | None:
    if data_wait <= DATA_WAIT_WARN:
        return None
    return (
        f"the model waited for data {data_wait:.0%} of the time: the loader is the bottleneck. Try "
        "`gpupipe bench --data ...` to find the fastest backend here (--backend dali on a GPU, turbojpeg or "
        f"pillow-simd on the CPU), or more --workers (now {cfg.workers or 'all cores'})."
    )
