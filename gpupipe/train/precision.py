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

    def autocast(self) -> contextlib.AbstractContextManager[Any]:
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)

    def backward(self, loss: torch.Tensor) -> None:
        self.scaler.scale(loss).backward()  # scale() is the identity when the scaler is off

    def step(self, optimizer: torch.optim.Optimizer) -> bool:
        """Unscale and clip the gradients, step the optimizer, update the scale; whether the step was taken.

        Only fp16's scaler skips steps: when the gradients hold inf or NaN it lowers its scale and leaves the
        weights alone. Telling that costs one host sync, the scaler's own (it reads its inf check to decide), in fp16
        only: whether it called the optimizer is seen by a step hook, not by reading the scale back. fp32 and bf16
        always step and never sync here.
        """
        if self.clip is not None:
            self.scaler.unscale_(optimizer)  # clip the true gradients, not the scaled ones
            nn.utils.clip_grad_norm_(_parameters(optimizer), self.clip)
        if not self.scaler.is_enabled():
            self.scaler.step(optimizer)
            return True
        stepped: list[bool] = []
        hook = optimizer.register_step_post_hook(lambda *_: stepped.append(True))
        try:
            self.scaler.step(optimizer)
        finally:
            hook.remove()
        self.scaler.update()
        return bool(stepped)

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
