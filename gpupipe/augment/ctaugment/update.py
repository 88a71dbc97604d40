"""CTAugment's feedback on its way in: the probe images' scores (:func:`proximity`), packed with their records' codes
into rows (:func:`score_rows`), gathered from every rank in one collective (:func:`gather_rows`) and copied to the
host without the host waiting for them (:class:`PendingUpdate`). :meth:`.CTAugment.update` applies the rows."""

from __future__ import annotations

import torch


def score_rows(codes: torch.Tensor, scores: torch.Tensor) -> torch.Tensor:
    """(N, depth * 2 + 1) int64 on the scores' device: each record's codes, then its score as its float64 bits (one
    tensor for one copy or one collective). No host wait: on CUDA the codes go over pinned and non-blocking."""
    device = scores.device
    if device.type == "cuda":
        codes = codes.pin_memory().to(device, non_blocking=True)
    else:
        codes = codes.to(device)
    return torch.cat([codes, scores.to(torch.float64).view(torch.int64).view(-1, 1)], dim=1)


def gather_rows(rows: torch.Tensor, capacity: int | None) -> torch.Tensor:
    """Every rank's rows, in rank order, each rank's padded with rows of -1 to ``capacity`` (or, without one, to the
    most any rank holds: their counts gathered first, which waits for them)."""
    dist = torch.distributed
    dev = collective_device()
    world = dist.get_world_size()
    if capacity is None:
        n = torch.tensor([len(rows)], device=dev)
        sizes = [torch.zeros_like(n) for _ in range(world)]
        dist.all_gather(sizes, n)
        capacity = int(max(int(s) for s in sizes))
    elif len(rows) > capacity:
        raise ValueError(f"update got {len(rows)} records, more than its capacity of {capacity}")
    padded = torch.full((capacity, rows.shape[1]), -1, dtype=torch.int64, device=dev)
    padded[: len(rows)] = rows.to(dev)
    parts = [torch.empty_like(padded) for _ in range(world)]
    dist.all_gather(parts, padded)
    return torch.cat(parts)


class PendingUpdate:
    """An update's rows on their way to the host: a non-blocking copy into pinned memory and an event after it (on
    CUDA); :meth:`rows` waits for that event only, by then long passed."""

    def __init__(self, rows: torch.Tensor):
        self._event: torch.cuda.Event | None = None
        if rows.device.type == "cuda":
            self._host = torch.empty(rows.shape, dtype=rows.dtype, pin_memory=True)
            self._host.copy_(rows, non_blocking=True)
            self._event = torch.cuda.Event()
            self._event.record()
        else:
            self._host = rows

    def rows(self) -> torch.Tensor:
        if self._event is not None:
            self._event.synchronize()
            self._event = None
        return self._host


def collective_device() -> torch.device:
    """Where this rank's tensors for a collective go: the CPU under gloo; under NCCL the GPU its process group is bound
    to (``init_process_group(device_id=...)``, as ``gpupipe train`` does), else the current one. Never a fixed
    ``cuda:0``: in library use without ``set_device`` every rank would gather on the same GPU."""
    dist = torch.distributed
    if dist.get_backend() != "nccl":
        return torch.device("cpu")
    bound = getattr(dist.group.WORLD, "bound_device_id", None)
    return bound if bound is not None else torch.device("cuda", torch.cuda.current_device())


def proximity(probs: torch.Tensor, labels: torch.Tensor) -> torch.Tensor:
    """FixMatch's score of a probe image: ``1 - 0.5 * |probs - onehot(label)|_1`` (1: right and certain, 0: wrong
    and certain); ``probs`` (N, C) are softmax outputs."""
    err = probs.detach().double().clone()
    err[torch.arange(len(labels), device=err.device), labels.to(err.device)] -= 1
    return 1 - 0.5 * err.abs().sum(dim=1)  # where ``probs`` are: read on the host by ``update``
