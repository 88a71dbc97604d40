"""gpupipe/data/sampler.py: a seeded order per epoch, disjoint shards, equal steps in train, no padding in eval."""

import pytest

from gpupipe.data.position import LoaderState
from gpupipe.data.sampler import ShardSampler


def _indices(sampler: ShardSampler) -> list[int]:
    return [index for batch in sampler for _, index in batch]


def test_the_order_is_seeded_and_changes_with_the_epoch():
    first = _indices(ShardSampler(20, 4, shuffle=True, seed=3))
    assert _indices(ShardSampler(20, 4, shuffle=True, seed=3)) == first
    assert _indices(ShardSampler(20, 4, shuffle=True, seed=4)) != first
    sampler = ShardSampler(20, 4, shuffle=True, seed=3)
    sampler.set_epoch(1)
    again = _indices(sampler)
    assert sorted(again) == sorted(first) and again != first
    assert all(epoch == 1 for batch in sampler for epoch, _ in batch)
    assert _indices(ShardSampler(20, 4, shuffle=False)) == list(range(20))


def test_train_shards_are_disjoint_and_take_equal_steps():
    ranks = [ShardSampler(12, 2, shuffle=True, seed=0, rank=r, world_size=3) for r in range(3)]
    shards = [set(_indices(s)) for s in ranks]
    assert [len(s) for s in ranks] == [2, 2, 2]
    assert set().union(*shards) == set(range(12)) and sum(map(len, shards)) == 12


def test_an_uneven_train_split_is_padded_or_dropped_to_equal_steps():
    padded = [ShardSampler(10, 2, shuffle=False, rank=r, world_size=3) for r in range(3)]
    assert [len(s) for s in padded] == [2, 2, 2]
    assert set().union(*map(_indices, padded)) == set(range(10))  # 12 slots: two samples read twice
    dropped = [ShardSampler(10, 2, shuffle=False, rank=r, world_size=3, drop_last=True) for r in range(3)]
    kept = [_indices(s) for s in dropped]
    assert [len(k) for k in kept] == [2, 2, 2] and len(set().union(*map(set, kept))) == 6


def test_eval_reads_every_sample_once_without_padding():
    ranks = [ShardSampler(10, 4, shuffle=False, rank=r, world_size=3, equal_steps=False) for r in range(3)]
    indices = [_indices(s) for s in ranks]
    assert sorted(i for shard in indices for i in shard) == list(range(10))
    assert [len(shard) for shard in indices] == [4, 3, 3]


def test_a_start_batch_skips_what_was_consumed():
    sampler = ShardSampler(20, 4, shuffle=True, seed=1)
    full = list(sampler)
    sampler.set_epoch(0, 2)
    assert list(sampler) == full[2:]
    with pytest.raises(ValueError, match="start_batch"):
        sampler.set_epoch(0, 6)


@pytest.mark.parametrize("equal_steps", [True, False])
@pytest.mark.parametrize("drop_last", [False, True])
def test_count_is_how_many_batches_are_dealt_from_a_start(equal_steps, drop_last):
    for rank in range(3):
        s = ShardSampler(23, 4, shuffle=True, rank=rank, world_size=3, drop_last=drop_last, equal_steps=equal_steps)
        assert [s.count(2, b) for b in range(len(s) + 2)] == [len(s.batches(2, b)) for b in range(len(s) + 2)]


def test_bad_arguments_are_errors():
    with pytest.raises(ValueError, match="batch_size"):
        ShardSampler(10, 0, shuffle=False)
    with pytest.raises(ValueError, match="rank"):
        ShardSampler(10, 2, shuffle=False, rank=2, world_size=2)
    with pytest.raises(ValueError, match="no samples"):
        ShardSampler(0, 2, shuffle=False)


@pytest.mark.parametrize("window", [None, 2])
@pytest.mark.parametrize("drop_last", [False, True])
def test_a_position_in_samples_carries_over_to_other_layouts(window, drop_last):
    """At each step of a run of 1, 2 or 4 ranks (batch 12 / ranks, or 3), resumed by 1, 2 or 4 ranks: the steps left
    are this layout's batches to the epoch's end on every rank; with the same global batch the saving run's very
    steps (the last one up to padding), else the rest of its stream in order, cut (drop_last) or padded to equal
    shares."""
    import numpy as np

    shards = np.arange(37) // 5 if window else None

    def ranks(world: int, batch: int) -> list[ShardSampler]:
        kw = dict(shuffle=True, seed=3, world_size=world, drop_last=drop_last, window=window, shards=shards)
        return [ShardSampler(37, batch, rank=r, **kw) for r in range(world)]

    def steps(samplers: list[ShardSampler]) -> list[list[int]]:
        batches = [s.batches(1, s.position.batch) for s in samplers]
        # a re-split epoch's batches counted without dealing it, from its start and from where it stands
        assert all(s.count(1, b) == len(s.batches(1, b)) for s in samplers for b in (0, s.position.batch))
        return [[i for b in step for i in b] for step in zip(*batches, strict=True)]

    layouts = [(1, 12), (2, 6), (4, 3), (2, 3), (1, 3)]
    for world, batch in layouts:
        saving = ranks(world, batch)
        whole, stream = steps(saving), saving[0].stream(1)
        assert [i for s in whole for i in s] == stream
        for k in range(1, len(whole) + 1):
            samples = LoaderState(saving[0], []).samples_at(1, k)
            for new_world, new_batch in layouts:
                resumed = ranks(new_world, new_batch)
                for s in resumed:
                    LoaderState(s, []).resume(1, samples, saving[0].layout)
                rest = steps(resumed)
                assert {s.position.batch for s in resumed} == {resumed[0].num_batches - len(rest)}
                g = new_world * new_batch
                if g == world * batch:
                    assert [sorted(s) for s in rest[:-1]] == [sorted(s) for s in whole[k:-1]]
                    assert len(rest) == len(whole) - k
                left = stream[samples:]
                expected = [left[j : j + g] for j in range(0, len(left), g)]
                if drop_last:
                    expected = [s for s in expected if len(s) == g]
                assert [sorted(s) for s in rest[:-1]] == [sorted(s) for s in expected[:-1]]
                if rest:  # the last step: padded from the rest's start to equal shares
                    assert set(expected[-1]) <= set(rest[-1]) <= set(left) and len(rest[-1]) % new_world == 0
