"""Mixed precision: autocast on the loader's device type, and a GradScaler that is on only for fp16."""

from __future__ import annotations

import contextlib

import torch

_DTYPES = {"fp32": None, "bf16": torch.bfloat16, "fp16": torch.float16}


class Precision:
    def __init__(self, precision: str, device: torch.device):
        self.dtype = _DTYPES[precision]
        self.device_type = device.type
        # fp16 gradients underflow without loss scaling; bf16 has fp32's range and needs none
        self.scaler = torch.amp.GradScaler(device.type, enabled=precision == "fp16")

    def autocast(self):
        if self.dtype is None:
            return contextlib.nullcontext()
        return torch.autocast(self.device_type, dtype=self.dtype)
