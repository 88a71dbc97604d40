"""gpupipe/data/sampler.py: a seeded order per epoch, disjoint shards, equal steps in train, no padding in eval."""

import pytest

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


def test_bad_arguments_are_errors():
    with pytest.raises(ValueError, match="batch_size"):
        ShardSampler(10, 0, shuffle=False)
    with pytest.raises(ValueError, match="rank"):
        ShardSampler(10, 2, shuffle=False, rank=2, world_size=2)
    with pytest.raises(ValueError, match="no samples"):
        ShardSampler(0, 2, shuffle=False)
