"""What ``train()`` builds before its first step, each from the config: the loaders, the model (timm, or a local
weights file), the optimizer with its warm-up + cosine schedule, the EMA copy, and the loss with MixUp/CutMix."""

from __future__ import annotations

import math
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import torch
from torch import nn

from ..api import build_loader
from ..data.loader import Loader
from ..mix import Mix
from ..recipe import Recipe
from ..sources.objstore import Remote
from ..sources.remote import is_url
from .checkpoint import TrainState
from .config import TrainConfig
from .feedback import CTFeedback
from .precision import Precision


def build_state(cfg: TrainConfig, model: nn.Module, device: torch.device, steps_per_epoch: int) -> TrainState:
    """``model`` on ``device``, its optimizer, warm-up + cosine schedule, ``Precision`` and EMA."""
    memory_format = torch.channels_last if cfg.channels_last else torch.preserve_format
    model.to(device, memory_format=memory_format)  # type: ignore[call-overload]  # torch's stubs lack this overload
    optimizer = build_optimizer(cfg, model)
    warmup_steps = round(cfg.warmup_epochs * steps_per_epoch)
    scheduler = torch.optim.lr_scheduler.LambdaLR(optimizer, warmup_cosine(steps_per_epoch * cfg.epochs, warmup_steps))
    precision = Precision(cfg.precision, device, clip=cfg.clip)
    return TrainState(model, optimizer, scheduler, precision, ema=build_ema(cfg, model))


def check_model_name(name: str) -> None:
    """An unknown timm model is a one-line error with the closest names, before any data is read."""
    import difflib

    import timm

    if not timm.is_model(name):
        close = difflib.get_close_matches(name, timm.list_models(), n=3, cutoff=0.6)
        hint = f"closest: {', '.join(close)}" if close else "see timm.list_models()"
        raise ValueError(f"unknown --model {name!r}; {hint}")


def build_loaders(cfg: TrainConfig, device: torch.device) -> tuple[Loader, Loader | None, CTFeedback | None]:
    """The train loader, with the recipe's per-image policies, the validation loader (None without --val),
    labelled with the training classes whatever its folder holds, and with ``--aa ctaugment...`` its feedback (a
    probe loader over the training data)."""
    recipe = Recipe(
        cfg.train_size(),  # --image-size, or the resolution schedule --res-start .. --res-end
        eval_size=cfg.eval_size or cfg.image_size,
        auto_augment=cfg.aa,
        color_jitter=cfg.color_jitter,
        re_prob=cfg.reprob,
        re_mode=cfg.remode,
        re_count=cfg.recount,
        crop=cfg.crop,
        padding=cfg.padding,
        padding_mode=cfg.padding_mode,
        flip_p=cfg.hflip,
    )  # the policies apply to the train loader only
    loader = partial(
        build_loader,
        backend=cfg.backend,
        batch_size=cfg.batch_size,
        device=device,
        num_workers=cfg.workers,
        seed=cfg.seed,
        channels_last=cfg.channels_last,
        on_error=cfg.on_error,
        recipe=recipe,
        allow_outside_root=cfg.allow_outside_root,
        cache=None if cfg.cache == "none" else cfg.cache,
    )
    train = partial(loader, _source(cfg, cfg.data), train=True, shuffle_window=cfg.shuffle_window)
    train_loader = train()
    feedback = None
    if train_loader.ctaugment is not None:
        feedback = CTFeedback(train_loader, lambda probe_recipe: train(recipe=probe_recipe))
    if not cfg.val:
        return train_loader, None, feedback
    classes = train_loader.dataset.class_to_idx
    val_loader = loader(_source(cfg, cfg.val), train=False, class_to_idx=classes, recipe=recipe.for_eval())
    return train_loader, val_loader, feedback


def _source(cfg: TrainConfig, data: str):
    """``data``, with ``--cache-limit`` when it is at a URL."""
    if cfg.cache_limit is None or not is_url(data):
        return data
    return Remote(data, cache_limit=cfg.cache_limit)


def build_model(cfg: TrainConfig, num_classes: int) -> nn.Module:
    """The timm model: randomly initialised, or from the ``--pretrained`` file (never a download); timm leaves out a
    classifier made for another number of classes."""
    import timm  # defer: only training needs it

    if cfg.pretrained is None:
        return timm.create_model(cfg.model, pretrained=False, num_classes=num_classes)
    if not Path(cfg.pretrained).is_file():
        raise FileNotFoundError(
            f"--pretrained {cfg.pretrained}: no such file (a local weights file; nothing downloads)"
        )
    overlay = {"file": str(cfg.pretrained), "hf_hub_id": None, "url": None}  # the file, and only the file
    try:
        return timm.create_model(cfg.model, pretrained=True, pretrained_cfg_overlay=overlay, num_classes=num_classes)
    except (RuntimeError, KeyError, ValueError) as e:
        cause = str(e).splitlines()[0]
        raise ValueError(f"--pretrained {cfg.pretrained}: not weights of --model {cfg.model} ({cause})") from None


def build_optimizer(cfg: TrainConfig, model: nn.Module) -> torch.optim.Optimizer:
    # no weight decay on norms and biases, as timm and most recipes do
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim > 1]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim <= 1]
    groups = [{"params": decay, "weight_decay": cfg.weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    # fp16: fused, so that GradScaler hands the optimizer its inf check on the device and the step needs no host sync
    # (precision.Precision.step); a device without fused kernels gets the default implementation
    fused = {"fused": True} if cfg.precision == "fp16" else {}
    if cfg.optimizer == "adamw":
        return _optimizer(torch.optim.AdamW, groups, fused, lr=cfg.lr)
    return _optimizer(torch.optim.SGD, groups, fused, lr=cfg.lr, momentum=cfg.momentum, nesterov=cfg.momentum > 0)


def _optimizer(cls: type[torch.optim.Optimizer], groups: list[dict], fused: dict, **kw: Any) -> torch.optim.Optimizer:
    try:
        return cls(groups, **kw, **fused)
    except RuntimeError:  # "`fused=True` requires all the params to be floating point Tensors of supported devices"
        return cls(groups, **kw)


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
