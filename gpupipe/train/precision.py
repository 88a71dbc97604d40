"""Mixed precision: autocast on the loader's device type, and a GradScaler that is on only for fp16.

Lightning Fabric's ``plugins/precision/amp.py`` is the model: the plugin owns backward's loss scaling and the
optimizer step (unscale, clip, step, update), so the training loop says ``precision.step(optimizer)`` and no more.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn

from .._options import PrecisionName

_DTYPES: dict[str, torch.dtype | None] = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    """Autocast, loss scaling and the optimizer step for one precision.

    Args:
        precision: ``fp32``; or autocast to ``bf16`` or ``fp16`` (fp16 adds a GradScaler).
        device: where the model runs (autocast's device type).
        clip: clip the gradients' total norm to this before each step; ``None``: no clipping.
    """

    def __init__(self, precision: PrecisionName | str, device: torch.device, clip: float | None = None):
        if precision not in _DTYPES:
            raise ValueError(f"precision must be one of {', '.join(_DTYPES)}, got {precision!r}")
        self.dtype = _DTYPES[precision]
        self.device_type = device.type
        self.clip = clip
        # fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")
        self._skipped: torch.Tensor | None = None  # steps the scaler skipped, counted on the device (fused optimizers)
        self._skipped_on_host = 0  # and on the host (an optimizer that left the decision to the scaler)
        self._buffered = -1  # parameters that had a momentum buffer at the last check (see ``_zero_momentum``)

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()  # scale() is the identity when the scaler is off

    def step(self, optimizer: torch.optim.Optimizer) -> None:
        """Unscale and clip the gradients, step the optimizer, update the scale.

        Only fp16's scaler skips steps: when the gradients hold inf or NaN it lowers its scale and leaves the weights
        alone. With an optimizer that takes the scaler's inf check on the device (torch's fused SGD, Adam and AdamW:
        ``_step_supports_amp_scaling``; ``build_optimizer`` makes them fused in fp16) the step, the skip and the scale's
        update all happen on the device and the host waits for nothing; the skips are counted there too, read by
        :meth:`skipped_steps`. Another optimizer makes the scaler read its inf check on the host (one sync a step).
        fp32 and bf16 always step and never sync here.
        """
        if self.clip is not None:
            self.scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            nn.utils.clip_grad_norm_(_parameters(optimizer), self.clip)
        if not self.scaler.is_enabled():
            self.scaler.step(optimizer)
            return
        if getattr(optimizer, "_step_supports_amp_scaling", False) and self._buffered != _count(optimizer):
            self._buffered = _zero_momentum(optimizer)  # until every parameter has one: a loop over them all
        stepped: list[bool] = []
        hooks = (
            optimizer.register_step_pre_hook(self._count_found_inf),
            optimizer.register_step_post_hook(lambda *_: stepped.append(True)),
        )
        try:
            self.scaler.step(optimizer)
        finally:
            for hook in hooks:
                hook.remove()
        self.scaler.update()
        self._skipped_on_host += not stepped  # a scaler that decided on the host did not call the optimizer

    def _count_found_inf(self, optimizer: torch.optim.Optimizer, *_: Any) -> None:
        """Before a step that takes the scaler's inf check itself (``optimizer.found_inf``, set by GradScaler for
        the step): add it to the device's count of skipped steps."""
        found_inf = getattr(optimizer, "found_inf", None)
        if found_inf is None:
            return
        if self._skipped is None:
            self._skipped = torch.zeros((), dtype=torch.float32, device=found_inf.device)
        self._skipped.add_(found_inf.to(self._skipped.device, non_blocking=True))

    def skipped_steps(self) -> int:
        """The steps fp16's scaler skipped since the last call (inf/NaN gradients), and reset the count: one host sync
        when a fused optimizer counted them on the device (read it where the host syncs anyway, at a log step)."""
        skipped, self._skipped_on_host = self._skipped_on_host, 0
        if self._skipped is not None:
            skipped += int(self._skipped.item())
            self._skipped.zero_()
        return skipped

    def state_dict(self) -> dict[str, Any]:
        """The scaler's state (empty without fp16)."""
        return self.scaler.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        # a checkpoint of an fp32 or bf16 run has no scale to restore: an fp16 resume starts a fresh scaler
        if state or not self.scaler.is_enabled():
            self.scaler.load_state_dict(state)


def _parameters(optimizer: torch.optim.Optimizer) -> Iterator[torch.Tensor]:
    for group in optimizer.param_groups:
        yield from group["params"]


def _count(optimizer: torch.optim.Optimizer) -> int:
    return sum(len(group["params"]) for group in optimizer.param_groups)


def _zero_momentum(optimizer: torch.optim.Optimizer) -> int:
    """Zero momentum buffers for parameters that have none yet, before a fused SGD step: torch's fused SGD makes them
    with ``empty_like`` on its first step and fills them in the kernel, which a skipped step never runs, so after a
    skipped first step (common in fp16: the first scale is often too high) the momentum would be uninitialised
    memory. With dampening 0 a zero buffer gives the first step's update exactly (momentum x 0 + gradient). Returns
    how many parameters need no more of this (all of them once each trainable one had a gradient; the caller then
    stops calling until a parameter is added)."""
    if not isinstance(optimizer, torch.optim.SGD):
        return _count(optimizer)
    done = 0
    for group in optimizer.param_groups:
        if group["momentum"] == 0 or group["dampening"] != 0:
            done += len(group["params"])
            continue
        for p in group["params"]:
            state = optimizer.state[p]
            if p.grad is not None and state.get("momentum_buffer") is None:
                state["momentum_buffer"] = torch.zeros_like(p, memory_format=torch.preserve_format)
            done += state.get("momentum_buffer") is not None or not p.requires_grad  # a frozen one never steps
    return done
