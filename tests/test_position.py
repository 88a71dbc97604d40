"""gpupipe/data/position.py with the sampler's streams: a loader's state resumes at the same sample of the epoch under
another number of ranks or batch size (the same global batch: the saving run's very steps; another: the epoch's rest
re-split, said in one line), and is refused in one line where the order differs. Flat-colour images name their
sample, so the samples themselves are checked, on every backend, for a folder and for shards with a window."""

from __future__ import annotations

import pickle
import warnings

import numpy as np
import pytest
import torch

import gpupipe
from gpupipe.data.position import ResumeNotice
from gpupipe.sources.open import open_source

from .common_utils import CPU_LOADER_BACKENDS

# -- resuming under another number of ranks or batch size ----------------------------------------------------------

N_COLOURS = 40  # samples; 40 = 1, 2 and 4 ranks without padding


@pytest.fixture(scope="module")
def colours(tmp_path_factory):
    """Flat-colour JPEGs whose red level names their sample (``6 * i``), in 3 classes; the same set as shards of a
    few samples each and as Parquet files of row groups of 4 (for ``shuffle_window``), and as a dataset of images."""
    from PIL import Image

    from gpupipe.prepare import PrepareOptions, prepare

    root = tmp_path_factory.mktemp("colours")
    folder = root / "folder"
    for i in range(N_COLOURS):
        (folder / f"c{i % 3}").mkdir(parents=True, exist_ok=True)
        Image.new("RGB", (20, 20), (6 * i, 255 - 6 * i, 90)).save(folder / f"c{i % 3}" / f"{i:03d}.jpg", quality=95)
    prepare(folder, root / "shards", PrepareOptions(shard_size=3000, order="shuffled"))
    out = {"folder": folder, "shards": root / "shards", "dataset": _as_dataset(folder)}
    pq = pytest.importorskip("pyarrow.parquet")
    import pyarrow as pa

    samples = open_source(folder).samples  # as Parquet files of row groups of 4, the rows in a shuffled order
    order = np.random.default_rng(1).permutation(len(samples))
    table = pa.table(
        {"image": [open(samples[i][0], "rb").read() for i in order], "label": [samples[i][1] for i in order]}
    )
    (root / "parquet").mkdir()
    for k in range(3):
        pq.write_table(table.slice(16 * k, 16), root / "parquet" / f"part-{k}.parquet", row_group_size=4)
    out["parquet"] = root / "parquet"
    return out


def _as_dataset(folder):
    """The folder's images as a map-style dataset of (PIL image, label) items."""
    from PIL import Image

    samples = open_source(folder).samples
    return [(Image.open(path).convert("RGB"), label) for path, label in samples]


def _ids(images: torch.Tensor) -> list[int]:
    """Each flat image's sample, read off its red level."""
    return torch.round(images[:, 0].float().mean((1, 2)) / 6).long().tolist()


class _Ranks:
    """One loader per rank of a run (``world`` ranks, ``batch`` each), stepped together as DDP steps them."""

    def __init__(self, source, backend: str, world: int, batch: int, window: int | None, state: dict | None = None):
        kw = dict(image_size=8, num_workers=0, device="cpu", seed=2, normalize=False, drop_last=False)
        kw |= dict(batch_size=batch, world_size=world, shuffle_window=window)
        self.loaders = [gpupipe.build_loader(source, backend, rank=r, **kw) for r in range(world)]
        if state is not None:
            for loader in self.loaders:
                loader.load_state_dict(state)

    def steps(self, count: int | None = None) -> list[list[int]]:
        """The next ``count`` steps (all: the epoch's rest), each as its samples rank by rank."""
        out = []
        for batches in zip(*self.loaders, strict=True):
            out.append([i for images, _ in batches for i in _ids(images)])
            if len(out) == count:
                break
        return out

    def state(self) -> dict:
        states = [loader.state_dict() for loader in self.loaders]
        assert all(s == states[0] for s in states)
        return pickle.loads(pickle.dumps(states[0]))


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
@pytest.mark.parametrize("source", ["folder", "shards", "parquet", "dataset"])
def test_a_state_resumes_at_the_same_sample_under_another_number_of_ranks(colours, backend, source):
    """A state taken after ``k`` steps at 1, 2 or 4 ranks, loaded at another number: with the same global batch (12,
    per-rank batch 12 / ranks) the next steps take exactly the samples the straight run's would; with the per-rank
    batch kept (so another global batch) the epoch's remaining samples, in the same order, in steps of the new size,
    said in one line."""
    window = 2 if source in ("shards", "parquet") else None
    runs = {(1, 12): [(2, 6), (4, 3)], (2, 6): [(1, 12), (4, 3), (1, 6), (4, 6)], (4, 3): [(2, 6), (1, 3)]}
    for (world, batch), targets in runs.items():
        straight = _Ranks(colours[source], backend, world, batch, window)
        straight.loaders[0].set_epoch(1)  # the others follow the position each holds: the same epoch 1 ...
        for loader in straight.loaders[1:]:
            loader.set_epoch(1)
        steps = straight.steps()
        assert sorted(i for s in steps for i in s) == list(range(N_COLOURS))  # no padding: each sample once
        stopped = _Ranks(colours[source], backend, world, batch, window)
        for loader in stopped.loaders:
            loader.set_epoch(1)
        k = 1 if world == 4 else 2
        assert stopped.steps(k) == steps[:k]
        state = stopped.state()
        assert state["samples"] == 12 * k and state["layout"]["world_size"] == world
        stream = [i for s in steps for i in s][12 * k :]  # what the saving run had not consumed, in its order
        for new_world, new_batch in targets:
            global_batch = new_world * new_batch
            with warnings.catch_warnings(record=True) as notices:
                warnings.simplefilter("always")
                resumed = _Ranks(colours[source], backend, new_world, new_batch, window, state)
            said = [str(w.message) for w in notices if issubclass(w.category, ResumeNotice)]
            rest = resumed.steps()
            if global_batch == 12:
                assert [sorted(s) for s in rest] == [sorted(s) for s in steps[k:]], (world, new_world)
                assert not said
            else:
                assert [sorted(s) for s in rest] == [
                    sorted(stream[j : j + global_batch]) for j in range(0, len(stream), global_batch)
                ], (world, new_world, new_batch)
                assert len(said) == new_world and f"resumed at sample {12 * k} of 40" in said[0]  # one line a rank
            # the next epoch is the new layout's own
            assert resumed.state()["epoch"] == 2 and resumed.state()["samples"] == 0


def test_a_state_of_another_order_is_refused_in_one_line(colours):
    """Another seed, data set or shuffle window: the epoch's order differs, and the position is refused, named."""
    kw = dict(batch_size=4, image_size=8, num_workers=0, device="cpu", normalize=False)
    saved = gpupipe.build_loader(colours["shards"], "pillow", seed=2, shuffle_window=2, **kw)
    next(iter(saved))
    state = saved.state_dict()
    cases = {
        "seed 2 -> 3": dict(source=colours["shards"], seed=3, shuffle_window=2),
        "shuffle_window 2 -> 3": dict(source=colours["shards"], seed=2, shuffle_window=3),
        "data (digest": dict(source=colours["folder"], seed=2, shuffle_window=None),
    }
    for said, options in cases.items():
        loader = gpupipe.build_loader(options.pop("source"), "pillow", **options, **kw)
        with pytest.raises(ValueError, match=r"cannot resume from this loader state: .*") as e:
            loader.load_state_dict(state)
        assert said in str(e.value) and "\n" not in str(e.value)


def test_a_state_of_an_earlier_version_counts_this_loaders_batches(colours):
    """``{"epoch", "batch"}`` alone (states saved before the position in samples): the same loader resumes there, and
    a batch this loader does not have is refused in one line."""
    make = lambda: gpupipe.build_loader(
        colours["folder"], "pillow", batch_size=4, image_size=8, num_workers=0, device="cpu", normalize=False
    )
    straight = make()
    straight.set_epoch(1)
    whole = [_ids(x) for x, _ in straight]
    resumed = make()
    resumed.load_state_dict({"epoch": 1, "batch": 3})
    assert [_ids(x) for x, _ in resumed] == whole[3:]
    with pytest.raises(ValueError, match="cannot resume at epoch 1, batch 11: this loader has 10 batches an epoch"):
        make().load_state_dict({"epoch": 1, "batch": 11})


def test_an_evaluation_loader_resumes_mid_epoch_only_with_its_own_ranks(colours):
    """Evaluation reads each sample once, in unequal shares per rank: its position carries over only unchanged."""
    kw = dict(batch_size=4, image_size=8, num_workers=0, device="cpu", normalize=False, train=False)
    saved = gpupipe.build_loader(colours["folder"], "pillow", rank=0, world_size=2, **kw)
    next(iter(saved))
    again = gpupipe.build_loader(colours["folder"], "pillow", rank=0, world_size=2, **kw)
    again.load_state_dict(saved.state_dict())
    assert again.state_dict()["batch"] == 1
    with pytest.raises(ValueError, match=r"cannot resume this evaluation loader mid-epoch: .* 2 rank"):
        gpupipe.build_loader(colours["folder"], "pillow", **kw).load_state_dict(saved.state_dict())


def test_a_negative_epoch_is_refused_where_it_is_set_never_saved(colours):
    """``set_epoch(-1)`` (the loader's or its sampler's) is refused at once, in one line: accepted, it would be saved
    in ``state_dict`` and refused only on resume, blaming the batch size, the data or the ranks."""
    loader = gpupipe.build_loader(
        colours["folder"], "pillow", batch_size=4, image_size=8, num_workers=0, device="cpu", normalize=False
    )
    for set_epoch in (loader.set_epoch, loader.sampler.set_epoch):
        with pytest.raises(ValueError, match=r"set_epoch: an epoch is a whole number >= 0 .* got -1$"):
            set_epoch(-1)
    with pytest.raises(ValueError, match=r"set_epoch: .* got 1.5$"):
        loader.set_epoch(1.5)
    assert loader.state_dict()["epoch"] == 0
    with pytest.raises(ValueError, match=r"the state's epoch: an epoch is a whole number >= 0 .* got -2$"):
        loader.load_state_dict({**loader.state_dict(), "epoch": -2})
    loader.set_epoch(2)
    assert loader.state_dict()["epoch"] == 2
