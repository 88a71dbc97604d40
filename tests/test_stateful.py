"""The loader's position, as torchdata's ``StatefulDataLoader`` defines it: ``state_dict()`` is where the loader stands
after the batches delivered to the caller (never the ones prefetched), ``load_state_dict()`` before ``iter()`` resumes
there. ``set_epoch`` (the loader's, or its sampler's as Lightning calls it) agrees with both in any order."""

from __future__ import annotations

import pytest
import torch

import gpupipe

from .common_utils import CPU_LOADER_BACKENDS

stateful_dataloader = pytest.importorskip("torchdata.stateful_dataloader")


def train(make_loader, epochs: int, resume: dict | None = None, stop_after: int | None = None):
    """A training loop written against StatefulDataLoader: each pass over the loader is an epoch, the checkpoint holds
    ``loader.state_dict()``, a resume loads it before the first pass. Returns the (images, labels) it trained on
    and, when stopped after ``stop_after`` batches, the checkpoint it saved."""
    loader = make_loader()
    first = 0
    if resume is not None:
        first = resume["epoch"]
        loader.load_state_dict(resume["loader"])
    seen: list[tuple[torch.Tensor, torch.Tensor]] = []
    for epoch in range(first, epochs):
        for images, labels in loader:
            seen.append((images, labels))
            if len(seen) == stop_after:
                return seen, {"epoch": epoch, "loader": loader.state_dict()}
    return seen, None


def where(state: dict) -> dict:
    """A state's position in batches (it also holds the same in samples, and what the order depends on)."""
    return {"epoch": state["epoch"], "batch": state["batch"]}


def assert_same(a, b):
    assert len(a) == len(b)
    for (x, y), (xb, yb) in zip(a, b, strict=True):
        assert torch.equal(x, xb) and torch.equal(y, yb)


class Pairs(torch.utils.data.Dataset):
    def __len__(self):
        return 26

    def __getitem__(self, i):
        return torch.full((3, 2, 2), i, dtype=torch.uint8), i


@pytest.mark.filterwarnings("ignore:'set_vital' is deprecated")  # torchdata 0.11 on torch 2.14
def test_the_loop_resumes_a_stateful_dataloader_within_the_epoch():
    """The reference: the same loop with torchdata's own loader, workers prefetching, resumes the epoch exactly."""

    def make():
        g = torch.Generator().manual_seed(0)
        return stateful_dataloader.StatefulDataLoader(Pairs(), batch_size=4, shuffle=True, num_workers=2, generator=g)

    straight, _ = train(make, epochs=1)
    first, checkpoint = train(make, epochs=1, stop_after=3)
    rest, _ = train(make, epochs=1, resume=checkpoint)
    assert_same(first + rest, straight)


def _gpupipe(root, backend, **kw):
    kw = dict(batch_size=3, image_size=16, num_workers=0, drop_last=False, normalize=False, device="cpu", seed=4) | kw
    return lambda: gpupipe.build_loader(root, backend, **kw)


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
@pytest.mark.parametrize("stop_after", [3, 5, 9])  # mid-epoch; an epoch's last batch (5 a pass); an epoch's first
def test_the_same_loop_resumes_gpupipe_to_the_straight_runs_batches(unique_folder, backend, stop_after):
    make = _gpupipe(unique_folder, backend)
    straight, _ = train(make, epochs=3)
    first, checkpoint = train(make, epochs=3, stop_after=stop_after)
    assert checkpoint is not None  # taken after the last batch of a pass, before it ended: that epoch's end
    assert where(checkpoint["loader"]) == {"epoch": (stop_after - 1) // 5, "batch": stop_after % 5 or 5}
    rest, _ = train(make, epochs=3, resume=checkpoint)
    assert_same(first + rest, straight)  # the rest of the epoch, then the next epochs, in their own orders


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_state_dict_counts_the_batches_delivered_not_those_prefetched(unique_folder, backend):
    loader = _gpupipe(unique_folder, backend, num_workers=2)()  # workers (or DALI threads) run ahead
    assert where(loader.state_dict()) == {"epoch": 0, "batch": 0}
    batches = iter(loader)
    assert where(loader.state_dict()) == {"epoch": 0, "batch": 0}  # iter() alone delivers nothing
    for k in range(1, 4):
        next(batches)
        assert where(loader.state_dict()) == {"epoch": 0, "batch": k}  # workers and pipelines are further ahead by now
    list(batches)
    assert where(loader.state_dict()) == {"epoch": 1, "batch": 0}  # a whole pass: the start of the next epoch


# The orders in which frameworks call them. Lightning: load_state_dict, iter() (in setup_data), then
# loader.sampler.set_epoch(e) (at the epoch's start), then next(); a hand-written loop: load, set_epoch, iter.
ORDERS = {
    "lightning": ["load", "iter", "sampler.set_epoch", "next"],
    "loop": ["load", "set_epoch", "iter", "next"],
    "set_epoch-first": ["set_epoch", "load", "iter", "next"],
    "sampler-then-load": ["sampler.set_epoch", "load", "iter", "next"],
    "iter-then-set_epoch": ["load", "iter", "set_epoch", "sampler.set_epoch", "next"],
    "no-set_epoch": ["load", "iter", "next"],
}


@pytest.mark.parametrize("order", ORDERS)
def test_load_state_dict_set_epoch_and_iter_agree_in_any_order(unique_folder, order):
    make = _gpupipe(unique_folder, "pillow")
    straight = make()
    straight.set_epoch(2)
    expected = [y.tolist() for _, y in straight]
    loader, batches = make(), None
    for call in ORDERS[order]:
        if call == "load":
            loader.load_state_dict({"epoch": 2, "batch": 3})
        elif call == "set_epoch":
            loader.set_epoch(2)
        elif call == "sampler.set_epoch":
            loader.sampler.set_epoch(2)
        elif call == "iter":
            batches = iter(loader)
    assert batches is not None
    assert [y.tolist() for _, y in batches] == expected[3:]
    assert where(loader.state_dict()) == {"epoch": 3, "batch": 0}


def test_the_sampler_set_epoch_is_the_loader_set_epoch(unique_folder):
    make = _gpupipe(unique_folder, "pillow")
    a, b = make(), make()
    for epoch in (1, 4, 1):
        a.set_epoch(epoch)
        b.sampler.set_epoch(epoch)
        assert a.state_dict() == b.state_dict() and where(a.state_dict()) == {"epoch": epoch, "batch": 0}
        assert [y.tolist() for _, y in a] == [y.tolist() for _, y in b]


def test_an_iterator_made_before_set_epoch_follows_it(unique_folder):
    """Lightning makes the epoch's iterator before it calls set_epoch: resumed at an epoch's end, the iterator it
    made must deliver the next epoch, whole."""
    make = _gpupipe(unique_folder, "pillow")
    straight = make()
    straight.set_epoch(1)
    loader = make()
    loader.load_state_dict({"epoch": 0, "batch": 5})
    batches = iter(loader)
    loader.sampler.set_epoch(1)
    assert [y.tolist() for _, y in batches] == [y.tolist() for _, y in straight]
