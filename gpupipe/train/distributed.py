"""torch.distributed as torchrun sets it up (env://): NCCL on CUDA, gloo on the CPU, a bounded timeout."""

from __future__ import annotations

import datetime
from inspect import signature
from typing import Any

import torch
import torch.distributed as dist
from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors

from .._system import env_int, resolve_device

_LAUNCH_VARS = ("WORLD_SIZE", "RANK", "LOCAL_RANK")  # what torchrun (and SLURM wrappers) set together


def ranks_from_env() -> tuple[int, int, int]:
    """(world size, rank, local rank) from torchrun's variables; (1, 0, 0) without them. A value that is not a whole
    number, or a set that cannot come from one launch (a ``RANK`` without ``WORLD_SIZE``, a rank outside the world),
    is a ``ValueError`` naming the variables: a stray ``RANK=1`` would otherwise train as a rank that saves nothing."""
    world, rank, local = (env_int(name) for name in _LAUNCH_VARS)
    problem = _inconsistency(world, rank, local)
    if problem is not None:
        shown = ", ".join(f"{k}={v}" for k, v in zip(_LAUNCH_VARS, (world, rank, local), strict=True) if v is not None)
        raise ValueError(
            f"inconsistent distributed environment ({shown}): {problem}; launch with torchrun, which sets "
            f"{', '.join(_LAUNCH_VARS)} together, or unset them to train as one process"
        )
    return world or 1, rank or 0, local or 0


def _inconsistency(world: int | None, rank: int | None, local: int | None) -> str | None:
    if world is None:
        return f"{'RANK' if rank else 'LOCAL_RANK'} without WORLD_SIZE" if rank or local else None
    if world < 1:
        return "WORLD_SIZE must be at least 1"
    if world > 1 and rank is None:
        return f"WORLD_SIZE {world} without RANK"
    if rank is not None and rank >= world:
        return f"RANK {rank} is not below WORLD_SIZE {world}"
    if local is not None and local > (rank or 0):
        return f"LOCAL_RANK {local} above RANK {rank or 0}"
    return None


class Distributed:
    def __init__(self, device: str | None, timeout_s: int = 600):
        self.world_size, self.rank, self.local_rank = ranks_from_env()
        self._averaged = False  # the buffers were just averaged: the next gather_buffers has nothing to gather
        # the one rule (gpupipe's loaders use it too): --device cuda:N is honoured, and a rank that sees only its own
        # GPU (CUDA_VISIBLE_DEVICES per rank) uses GPU 0, not GPU LOCAL_RANK, which it does not have
        self.device = resolve_device(device)
        want_cuda = self.device.type == "cuda"
        if want_cuda:
            torch.cuda.set_device(self.device)  # what code that asks for the current device finds
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
        all-reduces gradients in backward); the model itself on one process. Each rank keeps its own floating-point
        buffers: DDP's construction broadcasts rank 0's, which would overwrite the BatchNorm statistics a mid-epoch
        resume gave each rank (``checkpoint.restore_rank_buffers``)."""
        if not self.enabled:
            return model
        own = [b.detach().clone() for b in _floating_buffers(model)]
        ddp = self._ddp(model)
        with torch.no_grad():
            for b, mine in zip(_floating_buffers(model), own, strict=True):
                b.copy_(mine)
        return ddp

    def _ddp(self, model: torch.nn.Module) -> torch.nn.Module:
        device_ids = [self.device.index] if self.device.type == "cuda" else None
        # broadcast_buffers=False: DDP would otherwise broadcast rank 0's buffers (BatchNorm's running statistics)
        # before every forward, a collective per step that training does not read (train-mode BatchNorm uses the
        # batch's statistics); the loop averages them over ranks before evaluating and saving (average_buffers).
        ddp = torch.nn.parallel.DistributedDataParallel
        # torch >= 2.14 names it forward_sync_buffers (and warns for broadcast_buffers); either way ``wrap`` puts each
        # rank's own buffers back after the construction
        keyword = "forward_sync_buffers" if "forward_sync_buffers" in signature(ddp).parameters else "broadcast_buffers"
        no_sync: dict[str, Any] = {keyword: False}
        return ddp(model, device_ids=device_ids, **no_sync)

    def all_reduce_sum(self, values: list[float]) -> list[float]:
        """Sum a few scalars over ranks (metrics); a no-op on one process."""
        if not self.enabled:
            return values
        t = torch.tensor(values, dtype=torch.float64, device=self.device)
        dist.all_reduce(t)
        return t.tolist()

    def average_buffers(self, module: torch.nn.Module) -> None:
        """Average floating-point buffers (BatchNorm's running statistics) over ranks, as timm's ``distribute_bn``:
        each rank's last forward updated its own, so without this the ranks (and the checkpoint) disagree. One
        all-reduce of the buffers flattened (one per dtype and device), not one per buffer."""
        if not self.enabled:
            return
        for group in _groups(_floating_buffers(module)):
            flat = _flatten_dense_tensors(group)
            dist.all_reduce(flat)
            flat.div_(self.world_size)  # the sum, then the division: each element as when reduced alone
            with torch.no_grad():
                for b, mean in zip(group, _unflatten_dense_tensors(flat, group), strict=True):
                    b.copy_(mean)
        self._averaged = True  # until the next gather_buffers: the checkpoint saved right after

    def gather_buffers(self, module: torch.nn.Module) -> list[dict[str, torch.Tensor]] | None:
        """Every rank's floating-point buffers, on the CPU (BatchNorm's running statistics are each rank's own between
        two ``average_buffers``): a mid-epoch checkpoint keeps them all, so that each rank resumes with its own, as the
        straight run goes on. A collective; None on one process, and None (no collective) on the first call after
        ``average_buffers``: the checkpoint the loop saves right after averaging, at an epoch's end, when every rank
        holds the average (in the model's own state). Nothing may run the model in between: BatchNorm updates its
        statistics in place without moving their version counters, so the buffers cannot tell it."""
        averaged, self._averaged = self._averaged, False
        if not self.enabled or averaged:
            return None
        out: list[dict[str, torch.Tensor]] = [{} for _ in range(self.world_size)]
        for name, b in module.named_buffers():
            if b.is_floating_point():
                parts = [torch.empty_like(b) for _ in range(self.world_size)]
                dist.all_gather(parts, b.contiguous())
                for rank, part in enumerate(parts):
                    out[rank][name] = part.cpu()
        return out

    def gather_sums(self, values: dict[str, float]) -> list[dict[str, float]]:
        """Every rank's ``values`` (an epoch's running sums), by rank: a collective; ``[values]`` on one process."""
        if not self.enabled:
            return [values]
        mine = torch.tensor(list(values.values()), dtype=torch.float64, device=self.device)
        parts = [torch.empty_like(mine) for _ in range(self.world_size)]
        dist.all_gather(parts, mine)
        return [dict(zip(values, part.tolist(), strict=True)) for part in parts]

    def barrier(self) -> None:
        if self.enabled:
            dist.barrier()

    def close(self) -> None:
        if self.enabled and dist.is_initialized():
            dist.destroy_process_group()


def _floating_buffers(module: torch.nn.Module) -> list[torch.Tensor]:
    return [b for b in module.buffers() if b.is_floating_point()]


def _groups(tensors: list[torch.Tensor]) -> list[list[torch.Tensor]]:
    """``tensors`` by (dtype, device), in order: what one flat tensor can hold."""
    groups: dict[tuple[torch.dtype, torch.device], list[torch.Tensor]] = {}
    for t in tensors:
        groups.setdefault((t.dtype, t.device), []).append(t)
    return list(groups.values())
