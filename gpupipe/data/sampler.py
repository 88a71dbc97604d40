"""Which samples each rank reads, in which order, epoch by epoch: one sampler for every backend."""

from __future__ import annotations

import math
from collections.abc import Iterator

import torch

from .position import Position

Keys = list[tuple[int, int]]  # one batch as (epoch, index) keys


class ShardSampler:
    """Seeded, epoch-dependent shuffling with DDP sharding and equal step counts on every rank.

    The order is a function of ``(seed, epoch, rank, world_size)`` alone (:meth:`batches`); the sampler remembers no
    epoch of its own. ``position`` is the loader's :class:`~gpupipe.data.position.Position` (the loader takes it):
    ``set_epoch`` (as Lightning calls it on ``loader.sampler``) and iterating the sampler on its own, as a torch batch
    sampler, read and move that one position.

    Like ``DistributedSampler``: with ``drop_last`` the tail that does not divide evenly is dropped, otherwise
    the order wraps around to pad it, so every rank takes exactly ``len(self)`` batches (an unequal count
    hangs DDP). With ``equal_steps=False`` (evaluation) nothing is padded or dropped: each sample is read exactly
    once, by one rank, and ranks may take different numbers of batches. Yields lists of ``(epoch, index)`` keys,
    so persistent workers see the epoch without being told, and a sample's augmentation depends on its key alone.
    """

    def __init__(
        self,
        num_samples: int,
        batch_size: int,
        *,
        shuffle: bool,
        seed: int = 0,
        rank: int = 0,
        world_size: int = 1,
        drop_last: bool = False,
        equal_steps: bool = True,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if num_samples < 1:
            raise ValueError("the data set has no samples")
        self.num_samples, self.batch_size = num_samples, batch_size
        self.shuffle, self.seed, self.drop_last = shuffle, seed, drop_last
        self.rank, self.world_size, self.equal_steps = rank, world_size, equal_steps
        if not equal_steps:
            drop_last = self.drop_last = False
            per_rank = len(range(rank, num_samples, world_size))
        else:
            per_rank = num_samples // world_size if drop_last else math.ceil(num_samples / world_size)
        self.per_rank = per_rank
        self.num_batches = per_rank // batch_size if drop_last else math.ceil(per_rank / batch_size)
        if self.num_batches == 0 and equal_steps:
            raise ValueError(
                f"{num_samples} samples over {world_size} rank(s) make no full batch of {batch_size} with "
                "drop_last=True: use a smaller batch_size or drop_last=False"
            )
        self.position = Position(self.num_batches)

    def __len__(self) -> int:
        return self.num_batches

    @property
    def epoch(self) -> int:
        """The epoch the position is in (the loader's, while it delivers one)."""
        return self.position.epoch

    def set_epoch(self, epoch: int, start_batch: int | None = None) -> None:
        """``DistributedSampler.set_epoch``: the loader's ``set_epoch``, on the position both share. ``start_batch``
        places the position there (skipping batches already consumed), as ``load_state_dict`` does."""
        if start_batch is None:
            self.position.set_epoch(epoch)
            return
        if not 0 <= start_batch <= self.num_batches:
            raise ValueError(f"start_batch must be in [0, {self.num_batches}], got {start_batch}")
        self.position.load_state_dict({"epoch": epoch, "batch": start_batch})

    def rank_indices(self, epoch: int) -> list[int]:
        """This rank's sample indices for ``epoch``, padded or cut to a whole number of equal shares."""
        if self.shuffle:
            g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
            order = torch.randperm(self.num_samples, generator=g).tolist()
        else:
            order = list(range(self.num_samples))
        if not self.equal_steps:
            return order[self.rank :: self.world_size]
        total = self.per_rank * self.world_size
        if total > len(order):  # pad by wrapping around, as DistributedSampler does
            order += (order * math.ceil(total / len(order)))[: total - len(order)]
        mine = order[:total][self.rank :: self.world_size]
        if self.drop_last:
            mine = mine[: self.num_batches * self.batch_size]
        return mine

    def batches(self, epoch: int, start_batch: int = 0) -> list[list[int]]:
        """This rank's batches of sample indices for ``epoch``, from batch ``start_batch`` on."""
        idx = self.rank_indices(epoch)
        b = self.batch_size
        return [idx[i : i + b] for i in range(start_batch * b, len(idx), b)]

    def keys(self, epoch: int, start_batch: int = 0) -> list[Keys]:
        """:meth:`batches` as ``(epoch, index)`` keys: what persistent workers are handed, so they see the epoch."""
        return [[(epoch, i) for i in batch] for batch in self.batches(epoch, start_batch)]

    def __iter__(self) -> Iterator[Keys]:
        """The keys from the position on, as a torch batch sampler: the DataLoader of a worker backend iterates this
        when a pass starts, so it reads the pass's ``(epoch, start_batch)``. It only reads the position."""
        return iter(self.keys(self.position.epoch, self.position.batch))
