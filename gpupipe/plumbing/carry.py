"""Carry: what a loader made ahead for a pass that has not begun yet, held in order across epochs, and whether the
next pass goes on from it.

A loader's thread runs on past a pass's last batch into the next epoch's first ones (decoded, or scheduled in DALI),
so no epoch starts cold. At the next pass's start those items are in flight behind what the last pass left of its
own (an accumulation's remainder: a few batches short of its epoch's end). :meth:`Carry.begin` decides, the same way
for every backend that carries: the pass goes on from them when it starts at its epoch's first batch, as planned,
and the last pass left at most ``limit`` items (each dropped on the way); else everything in flight is dropped and the
pass starts afresh (a resume, a re-split epoch, a jump elsewhere). The items of the new epoch that go on are checked:
those read before their files changed are named, for the backend to read again.

Items are tagged ``(epoch, batch)`` by the backend. The carry runs on one thread at a time and holds no thread or
loader: the producer (``more``: the next item made, or None once there is none) and the release of a dropped item
(``drop``) are handed to each call, so a loader that holds its carry makes no reference cycle through it.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Callable, Iterator
from typing import Generic, NamedTuple, TypeVar

T = TypeVar("T")
Tag = tuple[int, int]  # (epoch, batch)


def _nothing() -> None:
    return None


def _let_go(item: object) -> None:
    pass


class Start(NamedTuple, Generic[T]):
    """A pass's start, as :meth:`Carry.begin` decided it."""

    goes_on: bool  # the items in flight lead to the pass's first batch (else they were dropped)
    changed: list[T]  # of those carried into the pass's epoch, the ones whose files changed since they were read


class Carry(Generic[T]):
    """Items made ahead, in order, across epochs (``tag(item)``: its ``(epoch, batch)``), and the pass under way,
    which takes them in turn (:meth:`take`). ``limit``: how many items the last pass may leave untaken and the next
    still go on from those behind them; ``fresh(item)``: whether its files are as they were when it was read."""

    def __init__(self, tag: Callable[[T], Tag], limit: int, fresh: Callable[[T], bool] = lambda item: True):
        self._tag, self.limit, self._fresh = tag, limit, fresh
        self._items: deque[T] = deque()
        self._due: Tag | None = None  # the item the pass under way takes next (None: no pass)
        self._end = 0  # the batch its pass ends before

    def __len__(self) -> int:
        return len(self._items)

    def __iter__(self) -> Iterator[T]:
        """The items held, oldest first."""
        return iter(self._items)

    def add(self, item: T) -> None:
        """An item the producer made (the next in order)."""
        self._items.append(item)

    def replace(self, old: T, new: T) -> None:
        """``old`` (held) made again as ``new``, in its place."""
        self._items[next(k for k, item in enumerate(self._items) if item is old)] = new

    def owed(self) -> int:
        """The items of the pass under way that it has not taken (a pass left early: the rest of its epoch)."""
        return 0 if self._due is None else max(self._end - self._due[1], 0)

    def collect(self, more: Callable[[], T | None]) -> None:
        """Before a producer that is to stop stops (its thread ends, what it made is lost): the items it still owes
        the pass under way and the one after them (the next epoch's first) pulled from it and held, when it owes at
        most ``limit``; more could never lead a pass (:meth:`begin`), and nothing is pulled."""
        if self._due is None or self.owed() > self.limit:
            return
        while len(self._items) <= self.owed() and (item := more()) is not None:
            self._items.append(item)

    def begin(
        self,
        at: Tag,
        count: int,
        drop: Callable[[T], None] = _let_go,
        more: Callable[[], T | None] = _nothing,
        replanned: bool = False,
    ) -> Start[T]:
        """A pass of ``count`` items from ``at`` begins. It goes on from the items in flight when it starts at its
        epoch's first batch (not ``replanned``: its batches are those made ahead, not a resumed re-split's), the last
        pass was the epoch before and left at most ``limit`` items (handed to ``drop``, oldest first, pulled from
        ``more`` where not held), and the next item is ``at``'s. Else every item is dropped (to ``drop``, oldest
        first). The pass's items are then taken with :meth:`take`."""
        epoch, start = at
        goes_on = start == 0 and not replanned and self._skip_to(epoch, drop, more)
        if not goes_on:
            self.clear(drop)
        self._due, self._end = at, start + count
        if not goes_on:
            return Start(False, [])
        return Start(True, [item for item in self._items if self._tag(item)[0] == epoch and not self._fresh(item)])

    def _skip_to(self, epoch: int, drop: Callable[[T], None], more: Callable[[], T | None]) -> bool:
        """Drop what the last pass left of the epoch before ``epoch`` (at most ``limit``); whether the next item is
        then ``epoch``'s first."""
        due, left = self._due, self.owed()
        if due is None or due[0] != epoch - 1 or left > self.limit:
            return False
        for k in range(due[1], due[1] + left):
            item = self._head(more)
            if item is None or self._tag(item) != (epoch - 1, k):
                return False
            drop(self._items.popleft())
        head = self._head(more)
        return head is not None and self._tag(head) == (epoch, 0)

    def take(self, more: Callable[[], T | None] = _nothing) -> T | None:
        """The pass's next item (pulled from ``more`` where none is held); None once the pass has all of its items,
        or none comes."""
        if self._due is None or not self.owed():
            return None
        item = self._head(more)
        if item is None:
            return None
        epoch, batch = self._due
        assert self._tag(item) == self._due, f"made ahead out of order: {self._tag(item)} for {self._due}"
        self._due = (epoch, batch + 1)
        return self._items.popleft()

    def drop_from(self, item: T, drop: Callable[[T], None] = _let_go) -> None:
        """``item`` (held) and every item behind it dropped (to ``drop``, oldest first): the producer makes them
        again."""
        items = list(self._items)
        kept = next(k for k, held in enumerate(items) if held is item)
        self._items = deque(items[:kept])
        for dropped in items[kept:]:
            drop(dropped)

    def clear(self, drop: Callable[[T], None] = _let_go) -> None:
        """Every item dropped (to ``drop``, oldest first), and no pass under way: the next one starts afresh."""
        self._due = None
        while self._items:
            drop(self._items.popleft())

    def _head(self, more: Callable[[], T | None]) -> T | None:
        """The oldest item held, pulled from ``more`` when none is."""
        if not self._items:
            item = more()
            if item is None:
                return None
            self._items.append(item)
        return self._items[0]
