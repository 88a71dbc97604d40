"""Where a loader stands, and how it is saved and resumed: the one owner of a loader's state.

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

:class:`LoaderState` owns what a loader's ``state_dict`` holds besides the position (the position in samples, the
layout its epoch's stream follows, what the order depends on, an adaptive policy's part) and what loading one does
(the order checked, an epoch resumed from another layout re-split); the loader hands both calls to it, and the
sampler only orders and deals.
- ``set_epoch(e)``, the loader's or its sampler's (Lightning calls ``loader.sampler.set_epoch``): when no pass is under
  way and the position is already in epoch ``e`` (just loaded, or where the loader moved on to) it is kept; otherwise
  the next pass is epoch ``e`` from its start.
- ``iter()`` while an earlier pass is under way (a ``break``, a step cap) gives up that pass and moves on to the next
  epoch, as a DataLoader does; the earlier iterator raises if used again.
"""

from __future__ import annotations

import atexit
import contextlib
import hashlib
import weakref
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from functools import cached_property
from typing import Any, ClassVar, Generic, TypeVar

import numpy as np

from ..errors import GpupipeError
from ..plumbing.decode_ahead import Turn

T = TypeVar("T")


class ResumeNotice(UserWarning):
    """A loader state was loaded under another global batch: the epoch goes on from the first sample not yet
    consumed, in batches of another size (said in one line)."""


@dataclass(frozen=True)
class Resplit:
    """The rest of an epoch resumed from a state of another layout (ranks, batch size): the samples the saving layout
    had not consumed (``start`` of its ``total``, in the order its steps take them), re-split into this rank's
    ``batches``, which are the epoch's batches ``first`` to the last; ``sizes`` holds each step's samples over all
    ranks. Made by :class:`LoaderState`, kept by the position for that ``epoch`` only; the sampler deals by it."""

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
        if not isinstance(state, dict) or not {"epoch", "batch"} <= state.keys():
            raise ValueError(
                f"not a loader's state: {state!r:.80} has no 'epoch' and 'batch' (what Loader.state_dict() returns)"
            )
        epoch, batch = (
            _epoch(state["epoch"], "the state's epoch"),
            _epoch(state["batch"], "the state's batch", "a batch", ""),
        )
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


class LoaderState:
    """A loader's state, saved and loaded: its position (in its own batches and in samples of the epoch's stream, the
    layout that stream follows), what its order depends on, and an adaptive policy's part. ``sampler``: the loader's
    :class:`~gpupipe.data.sampler.ShardSampler` (its ``position`` is the one this reads and moves); ``targets``: the
    data set's labels (part of the order's digest); ``adaptive``: an adaptive policy's hook
    (:class:`~gpupipe.augment.adaptive.LoaderHook`), whose state is kept under ``key``, or None."""

    def __init__(self, sampler: Any, targets, adaptive: Any = None, key: str = ""):
        self.sampler, self.position, self._targets = sampler, sampler.position, targets
        self._adaptive, self._key = adaptive, key

    def state_dict(self) -> dict:
        """The position after the batches delivered (:meth:`at`), with the adaptive policy's state when it keeps one."""
        state = self.at(self.position.epoch, self.position.batch)
        kept = self._adaptive.state_dict() if self._adaptive is not None else {}
        if kept:
            state[self._key] = kept
        return state

    def at(self, epoch: int, batch: int) -> dict:
        """The state after ``batch`` batches of ``epoch``: ``epoch`` and ``batch`` (this loader's count), ``samples``
        (of the epoch's stream, :mod:`.sampler`), the ``layout`` that stream is dealt by, and what the ``order``
        depends on (seed, the data's sample count and label digest, shuffle window)."""
        world, batch_size, drop_last = self.stream_layout(epoch)
        return {
            "epoch": epoch,
            "batch": batch,
            "samples": self.samples_at(epoch, batch),
            "layout": {"world_size": world, "batch_size": batch_size, "drop_last": drop_last},
            "order": dict(self.order),
        }

    def load_state_dict(self, state: dict) -> str | None:
        """Resume at ``state`` (see ``Loader.load_state_dict``); a one-line notice when the global batch differs."""
        if not isinstance(state, dict):
            self.position.load_state_dict(state)  # its one-line "not a loader's state"
        if self._adaptive is not None and self._key in state:
            self._adaptive.load_state_dict(state[self._key])
        if "samples" not in state:
            self.position.load_state_dict(state)
            return None
        self.check_order(state.get("order", {}))
        layout = state["layout"]
        saved = (int(layout["world_size"]), int(layout["batch_size"]), bool(layout["drop_last"]))
        sampler = self.sampler
        if not sampler.equal_steps:  # evaluation: ranks take unequal shares, counted in their own batches
            if saved != sampler.layout and int(state["batch"]) > 0:
                raise ValueError(
                    f"cannot resume this evaluation loader mid-epoch: its state was saved with {saved[0]} rank(s) x "
                    f"batch {saved[1]}, this loader has {sampler.world_size} x {sampler.batch_size}"
                )
            self.position.load_state_dict(state)
            return None
        return self.resume(int(state["epoch"]), int(state["samples"]), saved)

    @cached_property
    def order(self) -> dict:
        """What the epochs' order depends on besides the epoch: compared by :meth:`load_state_dict`."""
        sampler = self.sampler
        digest = hashlib.sha256(np.asarray(self._targets, np.int64).tobytes())
        if sampler.window is not None and sampler.shards is not None:
            digest.update(np.asarray(sampler.shards, np.int64).tobytes())
            if sampler.shard_files is not None:
                digest.update(np.asarray(sampler.shard_files, np.int64).tobytes())
        return {
            "seed": sampler.seed,
            "num_samples": sampler.num_samples,
            "shuffle": sampler.shuffle,
            "window": sampler.window,
            "digest": digest.hexdigest()[:16],
        }

    def check_order(self, saved: dict) -> None:
        """A one-line ``ValueError`` naming what differs, where the state's order is not this loader's."""
        names = {"seed": "seed", "num_samples": "samples", "shuffle": "shuffle", "window": "shuffle_window"}
        names["digest"] = "data (digest of the labels and shards)"
        diff = [f"{names[k]} {saved[k]!r} -> {v!r}" for k, v in self.order.items() if k in saved and saved[k] != v]
        if diff:
            raise ValueError(
                f"cannot resume from this loader state: {'; '.join(diff)}: the epoch's order differs, so its position "
                "does not carry over (build the loader as it was, or start the epoch anew)"
            )

    # -- the position in samples, across layouts ---------------------------------------------------------------------

    def stream_layout(self, epoch: int) -> tuple[int, int, bool]:
        """The layout whose stream ``epoch`` follows: the one it was resumed from, else the sampler's."""
        plan = self.sampler.resplit(epoch)
        return plan.layout if plan is not None else self.sampler.layout

    def samples_at(self, epoch: int, batch: int) -> int:
        """Samples of ``epoch``'s stream consumed by every rank's first ``batch`` batches."""
        plan, s = self.sampler.resplit(epoch), self.sampler
        if plan is not None:
            return min(plan.start + sum(plan.sizes[: max(batch - plan.first, 0)]), plan.total)
        share = s.num_batches * s.batch_size if s.drop_last else s.per_rank
        return min(batch * s.batch_size, share) * s.world_size

    def resume(self, epoch: int, samples: int, layout: tuple[int, int, bool]) -> str | None:
        """Place the position at sample ``samples`` of ``epoch``'s stream under ``layout`` (a train sampler's). The
        same layout at a step boundary resumes at that batch; another goes on with the rest of that stream re-split
        into this layout's batches (:class:`Resplit`). Returns a one-line notice when the global batch differs, else
        None."""
        s = self.sampler
        world, batch_size, _ = layout
        g = s.batch_size * s.world_size
        # an epoch's start is the same steps under any layout of a global order (not of a windowed one's parts)
        if (layout == s.layout and samples % g == 0) or (samples == 0 and s.window is None):
            self.position.load_state_dict({"epoch": epoch, "batch": min(samples // g, s.num_batches)})
            return None
        stream = s.stream(epoch, layout)  # the saving run's layout of this order
        plan = self._resplit(epoch, layout, stream, samples)
        self.position.place(plan)
        if batch_size * world == g:
            return None
        return (
            f"epoch {epoch} resumed at sample {min(samples, len(stream))} of {len(stream)}: saved with {world} rank(s) "
            f"x batch {batch_size} (global batch {batch_size * world}), now {s.world_size} x {s.batch_size} "
            f"(global batch {g}): its remaining samples go on in {len(plan.sizes)} step(s) of up to {g}"
        )

    def _resplit(self, epoch: int, layout: tuple[int, int, bool], stream: list[int], start: int) -> Resplit:
        """The rest of ``stream`` from ``start``, in steps of this layout's global batch (the last one cut with
        ``drop_last``, else padded by wrapping around to a multiple of the ranks), each split in equal parts over
        the ranks in rank order. They are at most this layout's batches an epoch: the rest of a stream resumed past
        its start holds fewer samples than the data set."""
        s = self.sampler
        g, world = s.batch_size * s.world_size, s.world_size
        rest = stream[start:][: s.num_batches * g]  # past that, only another layout's padding (from a start)
        if s.drop_last:
            rest = rest[: len(rest) // g * g]
        elif rest and len(rest) % world:
            pad = world - len(rest) % world
            rest = rest + (rest * pad)[:pad]
        steps = [rest[i : i + g] for i in range(0, len(rest), g)]
        mine = tuple(tuple(step[s.rank * len(step) // world : (s.rank + 1) * len(step) // world]) for step in steps)
        sizes = tuple(len(step) for step in steps)
        first = s.num_batches - len(steps)
        return Resplit(epoch, layout, min(start, len(stream)), len(stream), first, mine, sizes)


def _epoch(value, what: str, kind: str = "an epoch", note: str = " (epochs count from 0)") -> int:
    """An epoch number: a whole number >= 0 (a negative one would be saved in ``state_dict`` and refused on resume);
    a batch count with ``kind="a batch"``. ``"3"`` is neither: it would be saved as it came."""
    try:
        whole = not isinstance(value, (bool, str, bytes)) and int(value) == value and value >= 0
    except (TypeError, ValueError):
        whole = False
    if not whole:
        raise ValueError(f"{what}: {kind} is a whole number >= 0{note}, got {value!r}")
    return int(value)


class Pass(Generic[T]):
    """One pass over a loader: the iterator ``iter(loader)`` returns, and the only thing that moves its position.

    ``make(epoch, start_batch)`` gives the pass's batches; it is called at the first ``next()``, so a
    ``load_state_dict`` or ``set_epoch`` made between ``iter()`` and then still decides where the pass starts (Lightning
    makes the iterator first). ``abandon()`` is called when an error ends the pass, before it is raised."""

    def __init__(
        self,
        position: Position,
        make: Callable[[int, int], Iterator[T]],
        abandon: Callable[[], None] = lambda: None,
        turn: Turn | None = None,
    ):
        self._position, self._make, self._abandon = position, make, abandon
        self._turn = turn  # told when the caller is inside next(): the loader's threads make their items outside it
        self._batches: Iterator[T] | None = None
        self._done = False
        # the position knows this pass by a token of its own, not by the pass: a pass holds the loader (``make``),
        # which holds the position, and a cycle through a DataLoader's iterator would leave its workers to the
        # garbage collector, which closes their queues before the iterator can tell them to stop (5 s a worker)
        self._token = object()
        position.begin(self._token)
        Pass._open.add(self)

    _open: ClassVar[weakref.WeakSet[Pass]] = weakref.WeakSet()  # for :meth:`_close_open_at_exit`

    @classmethod
    def _close_open_at_exit(cls) -> None:
        """At interpreter exit (a script that ends in the middle of a pass, its iterator still held), each pass's
        batches are closed while the modules their clean-up uses are whole: left to the interpreter's teardown, it ran
        with their names cleared ("Exception ignored in: <generator ...> ... 'NoneType' object has no attribute")."""
        for p in list(cls._open):
            batches, p._batches, p._done = p._batches, None, True
            close = getattr(batches, "close", None)
            if close is not None:
                with contextlib.suppress(Exception):
                    close()

    def __iter__(self) -> Pass[T]:
        return self

    def __next__(self) -> T:
        if self._done:
            raise StopIteration
        if self._turn is None:
            return self._next()
        self._turn.enter()
        try:
            return self._next()
        finally:
            self._turn.leave()

    def _next(self) -> T:
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
        except BaseException:
            self._done = True  # the batches' generators ended with the error: so did the pass
            self._abandon()
            raise
        self._position.advance(self._token)
        return batch


atexit.register(Pass._close_open_at_exit)  # registered before any backend's: runs after theirs
