"""torch.distributed as torchrun sets it up (env://): NCCL on CUDA, gloo on the CPU, a bounded timeout."""

from __future__ import annotations

import datetime
import os

import torch
import torch.distributed as dist

from ..api import as_device


class Distributed:
    def __init__(self, device: str | None, timeout_s: int = 600):
        self.world_size = int(os.environ.get("WORLD_SIZE", "1"))
        self.rank = int(os.environ.get("RANK", "0"))
        self.local_rank = int(os.environ.get("LOCAL_RANK", "0"))
        want_cuda = torch.cuda.is_available() if device is None else as_device(device).type == "cuda"
        if want_cuda:
            if not torch.cuda.is_available():
                raise ValueError("device='cuda' was asked for, but torch sees no CUDA device")
            torch.cuda.set_device(self.local_rank)
            self.device = torch.device("cuda", self.local_rank)
        else:
            self.device = torch.device("cpu")
        if self.enabled and not dist.is_initialized():
            dist.init_process_group(
                "nccl" if want_cuda else "gloo",
                timeout=datetime.timedelta(seconds=timeout_s),
                device_id=self.device if want_cuda else None,
            )

    @property
    def enabled(self) -> bool:
        return self.world_size > 1

    @property
    def is_main(self) -> bool:
        return self.rank == 0

    def wrap(self, model: torch.nn.Module) -> torch.nn.Module:
        """``model`` in DistributedDataParallel when there are several ranks (it broadcasts rank 0's weights, then
        all-reduces gradients in backward); the model itself on one process."""
        if not self.enabled:
            return model
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        return torch.nn.parallel.DistributedDataParallel(model, device_ids=device_ids)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum a few scalars over ranks (metrics); a no-op on one process."""
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def average_buffers(self, module: torch.nn.Module) -> None:
        """Average floating-point buffers (BatchNorm running statistics) over ranks, as timm's ``distribute_bn``:
        each rank's last forward updated its own, so without this the ranks (and the checkpoint) disagree."""
        if not self.enabled:
            return
        for b in module.buffers():
            if b.is_floating_point():
                dist.all_reduce(b)
                b.div_(self.world_size)

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()
