"""Which samples each rank reads, in which order, epoch by epoch: one sampler for every backend.

A train epoch is a global random permutation of the samples, dealt round-robin over the ranks (``order[rank::world]``),
or, with a shuffle window of ``K`` shards (:func:`window_order`), the shards permuted and taken ``K`` at a time, the
samples of each group permuted among themselves, each rank a contiguous part of that order: a batch then touches at
most the ``K`` shards of its group (``2K`` where it straddles two), so shards at a URL can be read in large blocks and
kept (:mod:`.ranges`), as Mosaic streaming and litdata order their samples.

An epoch's *stream* is its samples in the order a layout (ranks, batch size, ``drop_last``) consumes them: step by
step and, within a step, rank by rank. A position in samples of that stream carries over to another layout
(:class:`~gpupipe.data.position.LoaderState`): with the same global batch each step takes what the saving run's step
would have, with another the rest of the stream is re-split into this layout's steps.
"""

from __future__ import annotations

import math
from collections.abc import Iterator

import numpy as np
import torch

from ..errors import NoFullBatch
from .position import Position, Resplit

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

    ``window`` (with ``shuffle``; ``shards[i]``: sample ``i``'s shard number): the epoch's order is
    :func:`window_order` over groups of ``window`` shards, and each rank takes a contiguous part of it (the same
    counts, padding and dropping as above), so ranks read mostly disjoint shards. The order is then a function of
    ``(seed, epoch, rank, world_size, window, shards)`` (and ``shard_files``: see :func:`window_order`).
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
        shards: np.ndarray | None = None,
        window: int | None = None,
        shard_files: np.ndarray | None = None,
    ):
        if batch_size < 1:
            raise ValueError(f"batch_size must be >= 1, got {batch_size}")
        if not 0 <= rank < world_size:
            raise ValueError(f"rank must be in [0, {world_size}), got {rank}")
        if num_samples < 1:
            raise ValueError("the data set has no samples")
        _check_window(window, shards, num_samples, shuffle)
        self.shards, self.window, self.shard_files = shards, window, shard_files
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
            raise NoFullBatch(num_samples, world_size, batch_size, per_rank)
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

    def order(self, epoch: int) -> list[int]:
        """Every sample index in ``epoch``'s order, before it is dealt to the ranks."""
        if not self.shuffle:
            return list(range(self.num_samples))
        g = torch.Generator().manual_seed(self.seed * 1_000_003 + epoch)
        if self.window is None or self.shards is None:
            return torch.randperm(self.num_samples, generator=g).tolist()
        return window_order(self.shards, self.window, g, self.shard_files).tolist()

    def rank_indices(self, epoch: int) -> list[int]:
        """This rank's sample indices for ``epoch``, padded or cut to a whole number of equal shares: every
        ``world_size``-th of the order from ``rank`` on, or with a window its ``rank``-th contiguous part."""
        order = self.order(epoch)
        n, world, rank = self.num_samples, self.world_size, self.rank
        if not self.equal_steps:
            if self.window is None:
                return order[rank::world]
            start = rank * (n // world) + min(rank, n % world)
            return order[start : start + self.per_rank]
        return self._share(order, rank)

    def _share(self, order: list[int], rank: int) -> list[int]:
        """``rank``'s equal share of an epoch's ``order`` (train)."""
        world = self.world_size
        total = self.per_rank * world
        if total > len(order):  # pad by wrapping around, as DistributedSampler does
            order = order + (order * math.ceil(total / len(order)))[: total - len(order)]
        order = order[:total]
        mine = order[rank::world] if self.window is None else order[rank * self.per_rank : (rank + 1) * self.per_rank]
        if self.drop_last:
            mine = mine[: self.num_batches * self.batch_size]
        return mine

    def batches(self, epoch: int, start_batch: int = 0) -> list[list[int]]:
        """This rank's batches of sample indices for ``epoch``, from batch ``start_batch`` on."""
        plan = self.resplit(epoch)
        if plan is not None:
            return [list(b) for b in plan.batches[max(start_batch - plan.first, 0) :]]
        idx = self.rank_indices(epoch)
        b = self.batch_size
        return [idx[i : i + b] for i in range(start_batch * b, len(idx), b)]

    def count(self, epoch: int, start_batch: int = 0) -> int:
        """How many batches :meth:`batches` gives, without dealing the epoch."""
        plan = self.resplit(epoch)
        if plan is not None:
            return max(len(plan.batches) - max(start_batch - plan.first, 0), 0)
        return max(self.num_batches - start_batch, 0)

    # -- the layout, and an epoch resumed from another (the loader's state, data/position.py, re-splits it) -----------

    @property
    def layout(self) -> tuple[int, int, bool]:
        """``(world_size, batch_size, drop_last)``: what, besides the order, decides which samples a step takes."""
        return (self.world_size, self.batch_size, self.drop_last)

    def resplit(self, epoch: int) -> Resplit | None:
        """How ``epoch`` is dealt when it was resumed from another layout (None: this sampler's own way)."""
        plan = self.position.resplit
        return plan if plan is not None and plan.epoch == epoch else None

    def stream(self, epoch: int, layout: tuple[int, int, bool] | None = None) -> list[int]:
        """``epoch``'s samples as the steps of this sampler's layout (or of ``layout``: ``(world_size, batch_size,
        drop_last)``) take them: step by step, rank by rank within a step."""
        if layout is not None and layout != self.layout:
            world, batch_size, drop_last = layout
            other = ShardSampler(
                self.num_samples,
                batch_size,
                shuffle=self.shuffle,
                seed=self.seed,
                world_size=world,
                drop_last=drop_last,
                shards=self.shards,
                window=self.window,
                shard_files=self.shard_files,
            )
            return other.stream(epoch)
        order, b = self.order(epoch), self.batch_size
        shares = [self._share(list(order), r) for r in range(self.world_size)]
        return [i for j in range(0, len(shares[0]), b) for share in shares for i in share[j : j + b]]

    def keys(self, epoch: int, start_batch: int = 0) -> list[Keys]:
        """:meth:`batches` as ``(epoch, index)`` keys: what persistent workers are handed, so they see the epoch."""
        return [[(epoch, i) for i in batch] for batch in self.batches(epoch, start_batch)]

    def __iter__(self) -> Iterator[Keys]:
        """The keys from the position on, as a torch batch sampler: the DataLoader of a worker backend iterates this
        when a pass starts, so it reads the pass's ``(epoch, start_batch)``. It only reads the position."""
        return iter(self.keys(self.position.epoch, self.position.batch))


def window_order(
    shards: np.ndarray, window: int, generator: torch.Generator, shard_files: np.ndarray | None = None
) -> np.ndarray:
    """Every sample index (``shards[i]``: sample ``i``'s shard number) in a windowed shuffle: the shards in a random
    order, taken ``window`` at a time, and the samples of each group of shards in a random order among themselves;
    the groups one after the other. Drawn from ``generator`` alone.

    ``shard_files[s]``: the file that holds shard ``s``, where shards are parts of files (Parquet's row groups): the
    files in a random order and each file's shards in a random order, one file after another, so that an epoch
    needs each file during one stretch of it (fetched once per node where the files do not all fit its cache)."""
    count = int(shards.max()) + 1
    place = torch.randperm(count, generator=generator).numpy()
    if shard_files is not None:
        file_place = torch.randperm(int(shard_files.max()) + 1, generator=generator).numpy()
        place = place[np.argsort(file_place[shard_files[place]], kind="stable")]
    # each shard's group: its place in that order, // window (in the narrowest integer type, which numpy's stable sort
    # sorts by radix: linear in the samples)
    group = np.empty(count, np.min_scalar_type(max(count // window, 1)))
    group[place] = np.arange(count) // window
    shuffled = torch.randperm(len(shards), generator=generator).numpy()
    return shuffled[np.argsort(group[shards[shuffled]], kind="stable")]  # a group's samples keep the random order


def _check_window(window: int | None, shards: np.ndarray | None, num_samples: int, shuffle: bool) -> None:
    if window is None:
        return
    if isinstance(window, bool) or not isinstance(window, (int, np.integer)) or window < 1:
        raise ValueError(f"shuffle_window must be a number of shards >= 1, got {window!r}")
    if not shuffle:
        raise ValueError("shuffle_window orders a shuffled (train) epoch; an eval loader reads in order: leave it None")
    if shards is None or len(shards) != num_samples:
        raise ValueError("shuffle_window needs each sample's shard number (a shard source)")


def window_mixing(shards: np.ndarray, labels: np.ndarray, window: int, batch_size: int) -> str | None:
    """Why a ``window`` of shards would mix too few classes into a batch, or None. Shards written class by class (an
    ImageFolder prepared in its own order) hold one or two classes each, so a group of ``window`` of them holds at most
    ``window`` times that many, where a globally shuffled batch of ``batch_size`` holds about
    ``C * (1 - (1 - 1/C) ** batch_size)`` of the ``C`` classes. Said when the group holds fewer than half that."""
    classes = int(labels.max()) + 1 if len(labels) else 0
    if classes < 2:
        return None
    per_shard = len(np.unique(shards.astype(np.int64) * classes + labels)) / (int(shards.max()) + 1)
    in_group = min(classes, window * per_shard)
    in_batch = classes * (1 - (1 - 1 / classes) ** batch_size)
    if in_group >= in_batch / 2:
        return None
    return (
        f"shuffle_window={window}: a group of {window} shards holds about {in_group:.0f} of the {classes} classes "
        f"(its shards {per_shard:.1f} each), where a shuffled batch of {batch_size} holds about {in_batch:.0f}: the "
        "shards look written class by class, so every batch would see few classes. Write them in a random order "
        "(gpupipe prepare --order shuffled) or raise shuffle_window"
    )
