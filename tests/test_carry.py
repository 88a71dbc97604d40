"""plumbing/carry.py's Carry: what was made ahead across a pass boundary, and whether the next pass goes on from it."""

from dataclasses import dataclass

import pytest

from gpupipe.plumbing.carry import Carry


@dataclass(eq=False)
class Item:
    epoch: int
    batch: int
    fresh: bool = True


def _carry(limit: int = 2) -> Carry[Item]:
    return Carry(lambda item: (item.epoch, item.batch), limit, lambda item: item.fresh)


def _producer(*tags: tuple[int, int]):
    """``more`` for a carry: these items in turn, then None; ``pulled`` lists what it gave."""
    items = iter([Item(*tag) for tag in tags])
    pulled: list[Item] = []

    def more():
        item = next(items, None)
        if item is not None:
            pulled.append(item)
        return item

    return more, pulled


def _never():
    raise AssertionError("pulled where nothing was to be pulled")


def _passed(carry: Carry[Item], epoch: int, count: int, taken: int, more=_never) -> list[Item]:
    """A pass of ``epoch`` begun at its start and left after ``taken`` of its ``count`` items."""
    carry.begin((epoch, 0), count)
    return [carry.take(more) for _ in range(taken)]


def test_a_whole_pass_goes_on_into_the_next_epochs_items_made_ahead():
    carry = _carry()
    more, _ = _producer(*[(0, k) for k in range(4)], (1, 0), (1, 1), (1, 2))
    got = _passed(carry, 0, 4, 4, more)
    assert [(i.epoch, i.batch) for i in got] == [(0, k) for k in range(4)]
    assert carry.take(_never) is None  # the pass has its items: the next epoch's are not pulled
    carry.add(more())  # the producer runs on: (1, 0), (1, 1) made ahead
    carry.add(more())
    start = carry.begin((1, 0), 3, drop=_never)
    assert start.goes_on and start.changed == []
    taken = [carry.take(more) for _ in range(3)]
    assert [(i.epoch, i.batch) for i in taken] == [(1, 0), (1, 1), (1, 2)]


@pytest.mark.parametrize("left", [1, 2])
def test_a_pass_left_up_to_the_limit_short_goes_on_past_what_it_left(left):
    """The items the last pass left are dropped (the producer's, pulled where not held), oldest first, and the next
    pass takes the next epoch's first item without a pull."""
    carry = _carry(limit=2)
    more, pulled = _producer(*[(0, k) for k in range(5)], (1, 0))
    _passed(carry, 0, 5, 5 - left, more)
    dropped: list[Item] = []
    start = carry.begin((1, 0), 5, drop=dropped.append, more=more)
    assert start.goes_on
    assert [(i.epoch, i.batch) for i in dropped] == [(0, k) for k in range(5 - left, 5)]
    first = carry.take(_never)
    assert (first.epoch, first.batch) == (1, 0) and first is pulled[-1]


def test_a_pass_left_more_than_the_limit_short_drops_everything_unpulled():
    carry = _carry(limit=2)
    more, _ = _producer(*[(0, k) for k in range(5)])
    _passed(carry, 0, 5, 2, more)
    held = Item(0, 2)
    carry.add(held)  # made ahead already
    dropped: list[Item] = []
    start = carry.begin((1, 0), 5, drop=dropped.append, more=_never)
    assert not start.goes_on and dropped == [held] and len(carry) == 0


@pytest.mark.parametrize(
    ("at", "replanned"),
    [((1, 1), False), ((1, 0), True), ((2, 0), False), ((0, 0), False)],
    ids=["resumed mid-epoch", "re-split", "a jump ahead", "the same epoch again"],
)
def test_a_pass_that_starts_elsewhere_drops_what_is_in_flight(at, replanned):
    carry = _carry()
    _passed(carry, 0, 2, 2, _producer((0, 0), (0, 1))[0])
    made = [Item(1, 0), Item(1, 1)]
    for item in made:
        carry.add(item)
    dropped: list[Item] = []
    start = carry.begin(at, 2, drop=dropped.append, more=_never, replanned=replanned)
    assert not start.goes_on and dropped == made
    more, _ = _producer((at[0], at[1]))
    first = carry.take(more)
    assert (first.epoch, first.batch) == at  # the pass's own, from the producer


def test_the_first_pass_and_one_after_a_clear_start_afresh():
    carry = _carry()
    assert not carry.begin((0, 0), 2, more=_never).goes_on
    carry.take(_producer((0, 0))[0])
    carry.add(Item(0, 1))
    carry.add(Item(1, 0))
    carry.clear()  # an error ended the pass
    assert len(carry) == 0 and not carry.begin((1, 0), 2, more=_never).goes_on


def test_items_carried_into_the_epoch_whose_files_changed_are_named():
    carry = _carry()
    _passed(carry, 0, 1, 1, _producer((0, 0))[0])
    stale, later = Item(1, 1, fresh=False), Item(2, 0, fresh=False)
    for item in (Item(1, 0), stale, later):
        carry.add(item)
    start = carry.begin((1, 0), 2)
    assert start.goes_on and start.changed == [stale]  # the next epoch's are checked when its pass begins


def test_collect_pulls_what_is_owed_and_the_next_item_before_the_producer_stops():
    carry = _carry(limit=2)
    more, pulled = _producer(*[(0, k) for k in range(4)], (1, 0), (1, 1))
    _passed(carry, 0, 4, 2, more)
    carry.collect(more)
    assert [(i.epoch, i.batch) for i in carry] == [(0, 2), (0, 3), (1, 0)]
    carry.collect(more)  # again: nothing more
    assert len(pulled) == 5


def test_collect_pulls_nothing_when_what_is_owed_could_not_lead_a_pass():
    carry = _carry(limit=2)
    more, _ = _producer(*[(0, k) for k in range(4)])
    _passed(carry, 0, 4, 1, more)
    carry.collect(_never)
    assert len(carry) == 0
    carry.clear()
    carry.collect(_never)  # no pass under way


def test_items_out_of_order_are_an_error():
    carry = _carry()
    carry.begin((0, 0), 2)
    carry.add(Item(0, 1))
    with pytest.raises(AssertionError, match="out of order"):
        carry.take()


def test_drop_from_drops_an_item_and_those_behind_it():
    carry = _carry()
    items = [Item(1, 0), Item(1, 1), Item(1, 2)]
    for item in items:
        carry.add(item)
    dropped: list[Item] = []
    carry.drop_from(items[1], dropped.append)
    assert list(carry) == items[:1] and dropped == items[1:]
    carry.replace(items[0], items[2])
    assert list(carry) == [items[2]]
