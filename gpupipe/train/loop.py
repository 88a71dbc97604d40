"""``gpupipe train``: one loop that reads top to bottom — data, model, precision, accumulation, DDP, checkpoints."""

from __future__ import annotations

import contextlib
import math
import os
import time
from pathlib import Path

import torch
from torch import nn

from ..api import build_loader
from ..mix import Mix
from ..recipe import Recipe
from . import checkpoint
from .config import RESUME_CHANGEABLE, RESUME_FIXED, TrainConfig, to_yaml
from .distributed import Distributed
from .logging import RunLogger
from .precision import Precision

DATA_WAIT_WARN = 0.20


def build_model(cfg: TrainConfig, num_classes: int) -> nn.Module:
    import timm  # defer: only training needs it

    return timm.create_model(cfg.model, pretrained=False, num_classes=num_classes)  # random init: no downloads


def check_model_name(name: str) -> None:
    """An unknown timm model is a one-line error with the closest names, before any data is read."""
    import difflib

    import timm

    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3, cutoff=0.6)
        hint = f"closest: {', '.join(close)}" if close else "see timm.list_models()"
        raise ValueError(f"unknown --model {name!r}; {hint}")


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


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    # no weight decay on norms and biases, as timm and most recipes do
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    if cfg.optimizer == "adamw":
        return torch.optim.AdamW(groups, lr=cfg.lr)
    return torch.optim.SGD(groups, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0)


def warmup_cosine(total_steps: int, warmup_steps: int):
    def factor(step: int) -> float:
        if step < warmup_steps:
            return (step + 1) / warmup_steps
        progress = (step - warmup_steps) / max(1, total_steps - warmup_steps)
        return 0.5 * (1 + math.cos(math.pi * min(1.0, progress)))

    return factor


def evaluate(model: nn.Module, loader, precision: Precision, dist: Distributed) -> dict:
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


def train(cfg: TrainConfig, model: nn.Module | None = None) -> dict:
    """Train; returns the last epoch's metrics. ``model`` replaces the timm model named in ``cfg``."""
    dist = Distributed(cfg.device, cfg.dist_timeout_s)
    device = dist.device
    out = Path(cfg.out)
    ckpt_path = out / "checkpoints" / "last.pt"
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
    if model is None:
        check_model_name(cfg.model)
    torch.manual_seed(cfg.seed)
    if device.type == "cuda":
        torch.backends.cudnn.benchmark = True  # fixed input shapes: pick the fastest conv kernels once

    # Data: every rank reads its own shard, and every rank takes the same number of steps.
    recipe = Recipe(
        cfg.image_size,
        auto_augment=cfg.aa,
        color_jitter=cfg.color_jitter,
        re_prob=cfg.reprob,
        re_mode=cfg.remode,
        re_count=cfg.recount,
    )  # the policies apply to the train loader only
    loader_kw = dict(
        image_size=cfg.image_size,
        device=device,
        num_workers=cfg.workers,
        seed=cfg.seed,
        channels_last=cfg.channels_last,
        on_error=cfg.on_error,
        recipe=recipe,
    )
    train_loader = build_loader(cfg.data, cfg.backend, batch_size=cfg.batch_size, train=True, **loader_kw)
    # validation labels follow the training classes, whatever the val folder holds
    val_loader = (
        build_loader(
            cfg.val,
            cfg.backend,
            batch_size=cfg.batch_size,
            train=False,
            class_to_idx=train_loader.dataset.class_to_idx,
            **loader_kw,
        )
        if cfg.val
        else None
    )
    steps_per_epoch = len(train_loader) // cfg.accum
    if steps_per_epoch == 0:
        raise ValueError(f"{len(train_loader)} batches per epoch make no optimizer step with --accum {cfg.accum}")

    # Model, optimizer, schedule, precision.
    model = model if model is not None else build_model(cfg, len(train_loader.dataset.classes))
    model.to(device, memory_format=torch.channels_last if cfg.channels_last else torch.preserve_format)
    optimizer = build_optimizer(cfg, model)
    total_steps = steps_per_epoch * cfg.epochs
    scheduler = torch.optim.lr_scheduler.LambdaLR(
        optimizer, warmup_cosine(total_steps, round(cfg.warmup_epochs * steps_per_epoch))
    )
    precision = Precision(cfg.precision, device)
    scaler = precision.scaler
    criterion = nn.CrossEntropyLoss(label_smoothing=cfg.label_smoothing)
    mix = None
    if cfg.mixup > 0 or cfg.cutmix > 0:  # soft targets, smoothing included: cross-entropy with probabilities
        mix = Mix(
            cfg.mixup,
            cfg.cutmix,
            cfg.mixup_prob,
            cfg.mixup_switch_prob,
            label_smoothing=cfg.label_smoothing,
            num_classes=len(train_loader.dataset.classes),
        )
        criterion = nn.CrossEntropyLoss()
    ema = None
    if cfg.model_ema:
        from timm.utils import ModelEmaV3  # defer: only training needs timm

        ema = ModelEmaV3(model, decay=cfg.model_ema_decay)

    # Resume: everything that decides the rest of the run, the loader's position included.
    start_epoch, step, running = 0, 0, {"loss": 0.0, "images": 0, "wait": 0.0, "time": 0.0}
    changed: list[str] = []
    if resume:
        state = checkpoint.load_for_resume(ckpt_path)
        changed = check_resumable(state.get("config", {}), cfg, ckpt_path)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        scaler.load_state_dict(state["scaler"])
        scheduler.load_state_dict(state["scheduler"])
        checkpoint.set_rng_state(state["rng"])
        step, running = state["step"], state["running"]
        train_loader.load_state_dict(state["loader"])
        if ema is not None:
            ema.module.load_state_dict(state["model_ema"])
        start_epoch = state["loader"]["epoch"]

    ddp_model = model
    if dist.enabled:
        ddp_model = nn.parallel.DistributedDataParallel(
            model, device_ids=[device.index] if device.type == "cuda" else None
        )
    run_model = torch.compile(ddp_model) if cfg.compile else ddp_model

    logger = RunLogger(out, enabled=dist.is_main, total=steps_per_epoch * cfg.accum, world_size=dist.world_size)
    if dist.is_main:
        out.mkdir(parents=True, exist_ok=True)
        if changed and config_file.exists():  # keep the settings the run was started with
            kept = config_file.rename(out / f"config.before-step-{step}.yaml")
            logger.note(f"settings changed: {'; '.join(changed)} (the previous config is kept in {kept})")
        if not resume or changed or not config_file.exists():
            config_file.write_text(to_yaml(cfg))
    if resume:
        where = train_loader.state_dict()
        if start_epoch >= cfg.epochs:
            logger.note(
                f"{ckpt_path}: the run already finished its {cfg.epochs} epochs; nothing to do (to train "
                "longer, raise --epochs with --allow-config-change)"
            )
            logger.close()
            dist.close()
            return {}
        logger.note(
            f"resumed from epoch {where['epoch']}, batch {where['batch']} (optimizer step {step}) of {ckpt_path}"
        )

    def save(epoch_metrics_running: dict, loader_state: dict) -> None:
        if dist.is_main:
            checkpoint.save_atomic(
                {
                    "model": model.state_dict(),
                    "optimizer": optimizer.state_dict(),
                    "scaler": scaler.state_dict(),
                    "scheduler": scheduler.state_dict(),
                    "step": step,
                    "epoch": loader_state["epoch"],
                    "loader": loader_state,
                    "rng": checkpoint.rng_state(),
                    "running": epoch_metrics_running,
                    "config": {k: v for k, v in cfg.__dict__.items()},
                    **({"model_ema": ema.module.state_dict()} if ema is not None else {}),
                },
                ckpt_path,
            )
        dist.barrier()

    metrics: dict = {}
    try:
        for epoch in range(start_epoch, cfg.epochs):
            first = train_loader.state_dict()["batch"] if epoch == start_epoch and resume else 0
            if first == 0:
                train_loader.set_epoch(epoch)
                running = {"loss": 0.0, "images": 0, "wait": 0.0, "time": 0.0}
            if first >= steps_per_epoch * cfg.accum:  # the checkpoint was the epoch's last step
                continue
            ddp_model.train()
            logger.start_epoch(epoch, first)
            n_batches = steps_per_epoch * cfg.accum  # a tail shorter than --accum is left out
            loss_acc = torch.zeros((), device=device)
            batches = iter(train_loader)
            tick = time.perf_counter()
            for i in range(first, n_batches):
                t_wait = time.perf_counter()
                images, labels = next(batches)
                wait = time.perf_counter() - t_wait
                targets = labels
                if mix is not None:  # its stream keyed by (seed, epoch, batch, rank): a resumed run mixes alike
                    mix.rng.seed([cfg.seed, epoch, i, dist.rank])
                    images, targets = mix(images, labels)
                last_micro = (i + 1) % cfg.accum == 0
                # under DDP, gradients are all-reduced only on the micro-batch that ends an accumulation
                sync = contextlib.nullcontext() if last_micro or not dist.enabled else ddp_model.no_sync()
                with sync:
                    with precision.autocast():
                        loss = criterion(run_model(images), targets)
                    scaler.scale(loss / cfg.accum).backward()
                if last_micro:
                    if cfg.clip:
                        scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
                        nn.utils.clip_grad_norm_(model.parameters(), cfg.clip)
                    scale_before = scaler.get_scale()
                    scaler.step(optimizer)
                    scaler.update()
                    if scaler.get_scale() >= scale_before:  # a step the scaler skipped leaves the LR where it was
                        scheduler.step()
                    optimizer.zero_grad(set_to_none=True)
                    step += 1
                    if ema is not None:
                        ema.update(model, step=step)
                loss_acc += loss.detach() * len(labels)
                running["images"] += len(labels)
                running["wait"] += wait
                if (i + 1) % cfg.log_every == 0 or i + 1 == n_batches:
                    running["loss"] += loss_acc.item()  # one sync every log_every steps, not every step
                    loss_acc.zero_()
                    now = time.perf_counter()
                    running["time"] += now - tick
                    tick = now
                    logger.progress(i + 1, running, scheduler.get_last_lr()[0], step)
                if last_micro and cfg.save_every and step % cfg.save_every == 0 and i + 1 < n_batches:
                    running["loss"] += loss_acc.item()
                    loss_acc.zero_()
                    save(running, {"epoch": epoch, "batch": i + 1})
            metrics = epoch_metrics(epoch, running, dist)
            dist.average_buffers(model)
            if val_loader is not None:
                metrics.update(evaluate(run_model, val_loader, precision, dist))
                if ema is not None:
                    ema_metrics = evaluate(ema.module, val_loader, precision, dist)
                    metrics.update({f"ema_{k}": v for k, v in ema_metrics.items()})
            metrics["lr"] = scheduler.get_last_lr()[0]
            metrics["skipped"] = len(train_loader.skipped)
            metrics["fallbacks"] = train_loader.fallbacks
            skipped = train_loader.skipped + (val_loader.skipped if val_loader is not None else [])
            logger.end_epoch(metrics, hint=data_wait_hint(metrics["data_wait"], cfg), skipped=skipped)
            save(running, {"epoch": epoch + 1, "batch": 0})
    finally:
        logger.close()
        dist.close()
    return metrics


def epoch_metrics(epoch: int, running: dict, dist: Distributed) -> dict:
    loss, images, wait, elapsed = dist.all_reduce_sum(
        [running["loss"], running["images"], running["wait"], running["time"]]
    )
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
