"""Where a loader stands: the one owner of its position.

A loader's position is ``(epoch, batch)``: the epoch whose order it follows and how many of that epoch's batches were
delivered to the caller. It lives here, in one :class:`Position` per loader, shared by the loader and its sampler
(``loader.position is loader.sampler.position``), and nowhere else: the sampler computes orders from
``(seed, epoch, rank, world_size)`` and remembers nothing, and the backends are told which batches to make.

Only :class:`Pass` moves the position: ``iter(loader)`` makes one; its first ``next()`` reads where to start, each
batch it hands to the caller adds one, and its end moves on to the next epoch. Batches a backend has prefetched
(workers, a DALI pipeline, the device stage) were not delivered and are never counted.

The calls frameworks make, in whatever order they make them:

- ``state_dict()``: ``{"epoch", "batch"}``, the position after the batches delivered (torchdata's
  ``StatefulDataLoader`` semantics). After a whole pass: ``{"epoch": e + 1, "batch": 0}``. The loader adds the same
  position in samples of the epoch and what the order depends on (``Loader.state_dict``), so that another number of
  ranks or another batch size resumes at the same sample: then the epoch's remaining samples are re-split into this
  loader's batches (a :class:`Resplit`), numbered so that the epoch still ends at batch ``num_batches``.
- ``load_state_dict(state)``: the next pass starts there, including an iterator made but not yet started.
- ``set_epoch(e)``, the loader's or its sampler's (Lightning calls ``loader.sampler.set_epoch``): when no pass is under
  way and the position is already in epoch ``e`` (just loaded, or where the loader moved on to) it is kept; otherwise
  the next pass is epoch ``e`` from its start.
- ``iter()`` while an earlier pass is under way (a ``break``, a step cap) gives up that pass and moves on to the next
  epoch, as a DataLoader does; the earlier iterator raises if used again.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Generic, TypeVar

from ..errors import GpupipeError

T = TypeVar("T")


class ResumeNotice(UserWarning):
    """A loader state was loaded under another global batch: the epoch goes on from the first sample not yet
    consumed, in batches of another size (said in one line)."""


@dataclass(frozen=True)
class Resplit:
    """The rest of an epoch resumed from a state of another layout (ranks, batch size): the samples the saving layout
    had not consumed (``start`` of its ``total``, in the order its steps take them), re-split into this rank's
    ``batches``, which are the epoch's batches ``first`` to the last; ``sizes`` holds each step's samples over all
    ranks. Made by the sampler, kept by the position for that ``epoch`` only."""

    epoch: int
    layout: tuple[int, int, bool]  # (world_size, batch_size, drop_last) of the run whose order this epoch follows
    start: int
    total: int
    first: int
    batches: tuple[tuple[int, ...], ...]
    sizes: tuple[int, ...]


class Position:
    """``(epoch, batch)`` of one loader, and which :class:`Pass` is moving it (see the module's docstring)."""

    def __init__(self, num_batches: int):
        self.num_batches = num_batches  # batches in an epoch (of this rank)
        self.epoch = 0
        self.batch = 0  # batches of ``epoch`` delivered to the caller
        self._newest: object | None = None  # the latest iterator made: only it may start
        self._running: object | None = None  # the iterator delivering this epoch's batches now, if any
        self.resplit: Resplit | None = None  # how this epoch's rest is dealt, when resumed from another layout

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "batch": self.batch}

    def load_state_dict(self, state: dict) -> None:
        epoch, batch = _epoch(state["epoch"], "the state's epoch"), int(state["batch"])
        if not 0 <= batch <= self.num_batches:
            raise ValueError(
                f"cannot resume at epoch {epoch}, batch {batch}: this loader has {self.num_batches} batches an epoch"
                " (was the state saved with another batch size, data set or number of ranks?)"
            )
        self.epoch, self.batch, self._running, self.resplit = epoch, batch, None, None

    def place(self, resplit: Resplit) -> None:
        """Resume ``resplit.epoch`` at its first re-split batch."""
        self.load_state_dict({"epoch": resplit.epoch, "batch": resplit.first})
        self.resplit = resplit

    def set_epoch(self, epoch: int) -> None:
        epoch = _epoch(epoch, "set_epoch")
        if self._running is None and epoch == self.epoch:
            return  # already there: a loaded position is kept
        self.epoch, self.batch, self._running, self.resplit = epoch, 0, None, None

    # -- what a Pass does -------------------------------------------------------------------------------------------

    def begin(self, token: object) -> None:
        """``iter()``: ``token`` is the newest iterator. A pass still under way is given up: on to the next epoch."""
        if self._running is not None:
            self.epoch, self.batch, self._running, self.resplit = self.epoch + 1, 0, None, None
        self._newest = token

    def start(self, token: object) -> tuple[int, int]:
        """The iterator's first ``next()``: where its batches start."""
        if token is not self._newest:
            raise GpupipeError(
                "this loader was iterated again before this iterator started; only the newest iterator of a loader "
                "delivers batches"
            )
        self._running = token
        return self.epoch, self.batch

    def advance(self, token: object) -> None:
        """One more batch delivered by ``token``."""
        self.check(token)
        self.batch += 1

    def check(self, token: object) -> None:
        if token is not self._running:
            raise GpupipeError(
                "this loader was iterated again, or moved by set_epoch/load_state_dict, while this iterator was "
                "unfinished; only the newest iterator of a loader delivers batches"
            )

    def finish(self, token: object) -> None:
        """``token`` delivered its epoch's last batch: the next pass is the next epoch, from its start."""
        if token is self._running:
            self.epoch, self.batch, self._running, self.resplit = self.epoch + 1, 0, None, None


def _epoch(value, what: str) -> int:
    """An epoch number: a whole number >= 0 (a negative one would be saved in ``state_dict`` and refused on resume)."""
    if isinstance(value, bool) or int(value) != value or value < 0:
        raise ValueError(f"{what}: an epoch is a whole number >= 0 (epochs count from 0), got {value!r}")
    return int(value)


class Pass(Generic[T]):
    """One pass over a loader: the iterator ``iter(loader)`` returns, and the only thing that moves its position.

    ``make(epoch, start_batch)`` gives the pass's batches; it is called at the first ``next()``, so a
    ``load_state_dict`` or ``set_epoch`` made between ``iter()`` and then still decides where the pass starts (Lightning
    makes the iterator first)."""

    def __init__(self, position: Position, make: Callable[[int, int], Iterator[T]]):
        self._position, self._make = position, make
        self._batches: Iterator[T] | None = None
        self._done = False
        # the position knows this pass by a token of its own, not by the pass: a pass holds the loader (``make``),
        # which holds the position, and a cycle through a DataLoader's iterator would leave its workers to the
        # garbage collector, which closes their queues before the iterator can tell them to stop (5 s a worker)
        self._token = object()
        position.begin(self._token)

    def __iter__(self) -> Pass[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        if self._batches is None:
            self._batches = self._make(*self._position.start(self._token))
        else:
            self._position.check(self._token)
        try:
            batch = next(self._batches)
        except StopIteration:
            self._done = True
            self._position.finish(self._token)
            raise
        self._position.advance(self._token)
        return batch
