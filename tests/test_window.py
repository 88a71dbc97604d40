"""``build_loader(shuffle_window=K)`` (gpupipe/data/sampler.py ``window_order``): each epoch the shards in a seeded
random order, K at a time, the samples of each group shuffled among themselves; each rank a contiguous part with
equal steps; exact resume; refused where there are no shards or no shuffle. The object-storage side (blocks read once
per epoch): tests/test_ranges.py."""

import itertools

import numpy as np
import pytest
import torch

import gpupipe
from gpupipe.data.sampler import ShardSampler
from gpupipe.prepare import PrepareOptions, prepare

from .common_utils import assert_resume_is_exact

KW = dict(batch_size=3, image_size=24, num_workers=0, device="cpu", seed=5, normalize=False, drop_last=False)


def _shards(seed: int = 0, count: int = 20) -> np.ndarray:
    """Each sample's shard number: ``count`` shards of 1 to 9 samples, the samples of a shard not all together."""
    rng = np.random.default_rng(seed)
    shards = np.repeat(np.arange(count), rng.integers(1, 10, count))
    return shards[rng.permutation(len(shards))]


def _groups(sequence: np.ndarray, counts: np.ndarray, window: int) -> list[set[int]]:
    """The order's groups of shards, read off the shard of each sample in turn; fails unless the order is groups of
    ``window`` shards (the last may hold fewer), one after the other, each holding all its shards' samples."""
    groups: list[set[int]] = []
    current: set[int] = set()
    left = 0
    for s in sequence.tolist():
        if s not in current:
            assert len(current) < window, "a group took more shards than the window"
            current.add(s)
            left += counts[s]
        left -= 1
        if left == 0 and len(current) == window:
            groups.append(current)
            current = set()
    assert left == 0, "a shard's samples were not all in its group"
    return groups + ([current] if current else [])


def test_the_window_order_is_groups_of_shards_shuffled_among_themselves():
    shards = _shards()
    counts = np.bincount(shards)
    sampler = ShardSampler(len(shards), 4, shuffle=True, seed=3, shards=shards, window=3)
    order = sampler.order(0)
    assert sorted(order) == list(range(len(shards)))
    groups = _groups(shards[order], counts, 3)
    assert [len(g) for g in groups] == [3] * 6 + [2] and set().union(*groups) == set(range(20))
    runs = 1 + int(np.count_nonzero(np.diff(shards[order])))
    assert runs > 2 * 20  # the samples of a group are mixed, not shard after shard
    assert ShardSampler(len(shards), 4, shuffle=True, seed=3, shards=shards, window=3).order(0) == order
    assert ShardSampler(len(shards), 4, shuffle=True, seed=4, shards=shards, window=3).order(0) != order
    again = sampler.order(1)
    assert again != order and _groups(shards[again], counts, 3) != groups
    for batch in sampler.batches(0):  # a batch lies in one group, or two where it straddles their boundary
        touched = {i for i, g in enumerate(groups) if g & set(shards[batch].tolist())}
        assert max(touched) - min(touched) <= 1 and len(set(shards[batch].tolist())) <= 2 * 3


def test_shards_that_are_parts_of_files_come_file_after_file():
    """Row groups (``shard_files``: each one's file): the files in a random order, each file's groups in a random
    order one after another, then windows of groups as for shards; an epoch needs each file during one stretch."""
    shards = _shards(2, 24)
    files = np.arange(24) // 4  # 6 files of 4 groups
    counts = np.bincount(shards)
    kw = dict(shuffle=True, seed=3, shards=shards, shard_files=files)
    one = ShardSampler(len(shards), 4, window=1, **kw).order(0)
    firsts = list(dict.fromkeys(shards[one].tolist()))
    assert len([f for f, _ in itertools.groupby(files[firsts])]) == 6  # each file once, its groups together
    assert firsts != sorted(firsts)  # the files and their groups shuffled, not in order
    order = ShardSampler(len(shards), 4, window=3, **kw).order(0)
    groups = _groups(shards[order], counts, 3)
    assert all(len({int(files[g]) for g in group}) <= 2 for group in groups)  # a window spans one file or two
    assert ShardSampler(len(shards), 4, window=3, **kw).order(1) != order


def test_a_window_of_every_shard_is_a_global_shuffle_and_one_shard_reads_shard_after_shard():
    shards = _shards(1)
    whole = ShardSampler(len(shards), 4, shuffle=True, shards=shards, window=20).order(0)
    assert len(_groups(shards[whole], np.bincount(shards), 20)) == 1
    one = ShardSampler(len(shards), 4, shuffle=True, shards=shards, window=1).order(0)
    assert 1 + int(np.count_nonzero(np.diff(shards[one]))) == 20  # each shard's samples together


def _parts(n: int, world: int, batch: int, **kw) -> list[list[int]]:
    """Each rank's samples of epoch 0, in order, over ``n`` samples in shards of 4."""
    shards = np.arange(n) // 4
    samplers = [
        ShardSampler(n, batch, shuffle=True, seed=1, rank=r, world_size=world, shards=shards, **kw)
        for r in range(world)
    ]
    return [[i for b in s.batches(0) for i in b] for s in samplers]


def test_windowed_ranks_take_contiguous_parts_with_equal_steps():
    shards = np.arange(24) // 4
    order = ShardSampler(24, 2, shuffle=True, seed=1, shards=shards, window=2).order(0)
    parts = _parts(24, 3, 2, window=2)
    assert parts[0] + parts[1] + parts[2] == order  # every sample once, each rank a contiguous part
    padded = _parts(22, 3, 2, window=2)  # 24 slots: two samples twice, from the start of the order
    assert [len(p) for p in padded] == [8, 8, 8] and set().union(*map(set, padded)) == set(range(22))
    dropped = _parts(22, 3, 2, window=2, drop_last=True)
    assert [len(p) for p in dropped] == [6, 6, 6] and len(set().union(*map(set, dropped))) == 18
    kw = dict(shuffle=True, shards=np.arange(10) // 4, window=2, world_size=3, equal_steps=False)
    uneven = [ShardSampler(10, 4, rank=r, **kw).rank_indices(0) for r in range(3)]
    assert [len(u) for u in uneven] == [4, 3, 3]
    assert uneven[0] + uneven[1] + uneven[2] == ShardSampler(10, 4, **kw).order(0)


def test_bad_windows_are_errors():
    shards = np.zeros(10, np.int64)
    for window in (0, -1, 1.5, True):
        with pytest.raises(ValueError, match="shuffle_window must be a number of shards >= 1"):
            ShardSampler(10, 2, shuffle=True, shards=shards, window=window)
    with pytest.raises(ValueError, match="eval loader reads in order"):
        ShardSampler(10, 2, shuffle=False, shards=shards, window=2)
    with pytest.raises(ValueError, match="each sample's shard number"):
        ShardSampler(10, 2, shuffle=True, shards=shards[:5], window=2)


@pytest.fixture(scope="module")
def prepared(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("window") / "prepared"
    prepare(folder, out, PrepareOptions(shard_size=16 * 1024))
    return out


def test_the_loader_delivers_the_window_order(prepared, folder):
    loader = gpupipe.build_loader(prepared, "pillow", train=True, shuffle_window=2, **KW)
    data = loader.dataset
    assert len(data.shard_paths) >= 5 and loader.sampler.window == 2
    for epoch in (0, 1):
        loader.set_epoch(epoch)
        labels = torch.cat([y for _, y in loader]).tolist()
        assert labels == [data.labels[i] for i in loader.sampler.rank_indices(epoch)]
    with pytest.raises(ValueError, match=r"shuffle_window=2 shuffles groups of shards and .* has none"):
        gpupipe.build_loader(folder, "pillow", train=True, shuffle_window=2, **KW)
    with pytest.raises(ValueError, match="eval loader reads in order"):
        gpupipe.build_loader(prepared, "pillow", train=False, shuffle_window=2, **KW)


def test_resume_mid_epoch_under_the_window(prepared):
    make = lambda: gpupipe.build_loader(prepared, "pillow", train=True, shuffle_window=3, **KW)
    assert_resume_is_exact(make, epoch=1, batch=3)


def test_train_passes_the_window_to_the_train_loader_only(prepared):
    from gpupipe.train.build import build_loaders
    from gpupipe.train.config import load_config

    cfg = load_config(
        None, {"data": str(prepared), "val": str(prepared), "shuffle_window": 2, "workers": 0, "batch_size": 4}
    )
    train, val, _ = build_loaders(cfg, torch.device("cpu"))
    assert train.sampler.window == 2 and val is not None and val.sampler.window is None


def test_shards_written_class_by_class_are_named_and_shuffled_ones_are_not(tmp_path):
    """A window over shards that each hold one or two classes would feed every batch few classes: said in one
    warning with the fix (``gpupipe prepare --order shuffled``), which then mixes them."""
    import warnings

    from .common_utils import make_folder

    src = make_folder(tmp_path / "src", 8, 4, sizes=((64, 64),))
    for order in ("source", "shuffled"):
        prepare(src, tmp_path / order, PrepareOptions(shard_size=8 * 1024, order=order))  # ~2 samples a shard
    kw = {**KW, "batch_size": 8, "shuffle_window": 2}
    with pytest.warns(UserWarning, match="look written class by class") as said:
        gpupipe.build_loader(tmp_path / "source", "pillow", **kw)
    assert "gpupipe prepare --order shuffled" in str(said[0].message) and str(tmp_path / "source") in str(
        said[0].message
    )
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        gpupipe.build_loader(tmp_path / "shuffled", "pillow", **kw)
