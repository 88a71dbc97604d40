"""gpupipe/augment/adaptive.py: an adaptive policy plugged into loaders through the hook alone (nothing of
gpupipe/data or gpupipe/backends knows it): a toy policy whose state is the count of batches handed out."""

from __future__ import annotations

import pytest

import gpupipe
from gpupipe.backends import get
from gpupipe.recipe import Recipe

from .common_utils import make_folder


class _Clock:
    """Batch ``g`` draws from the state as it was ``lag`` batches earlier: here, that batch's number."""

    def __init__(self, lag: int):
        self.lag = lag

    def for_batch(self, g: int) -> int:
        return g - self.lag


class _Hook:
    def __init__(self, policy: _Toy, seed: int, lag: int):
        self.policy, self.seed = policy, seed
        self.snapshots = _Clock(lag)
        self.needs_keys = False

    def tag(self, batches, first: int):
        for g, batch in enumerate(batches, first):
            batch.snapshot = self.snapshots.for_batch(g)
            self.policy.tagged.append(g)
            yield batch

    def delivered(self, g: int) -> list:
        self.policy.handed_out += 1
        return [("handed out", g)]

    def state_dict(self) -> dict:
        return {"handed_out": self.policy.handed_out}

    def load_state_dict(self, state: dict) -> None:
        self.policy.handed_out = state["handed_out"]


class _Toy:
    """A policy that learns nothing but counts: what an adaptive policy gives a loader."""

    state_key = "toy"

    def __init__(self):
        self.tagged: list[int] = []
        self.handed_out = 0

    def loader_hook(self, seed: int, lag: int) -> _Hook:
        return _Hook(self, seed, lag)

    def loader_names(self, hook: _Hook) -> dict:
        return {"toy": self}


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("adaptive"), 2, 6)


def _loader(folder, toy: _Toy, device: str = "cpu"):
    """A RandAugment loader whose policy is also ``toy``'s adaptive one, built as ``build_loader`` builds any."""
    kw = dict(batch_size=4, image_size=24, num_workers=0, device="cpu", seed=3, train=True)
    base = gpupipe.build_loader(folder, "pillow", recipe=Recipe(24, auto_augment="rand-m9-mstd0.5"), **kw)
    base.parts.stage.augment.policy.adaptive = toy
    return get("pillow").make_loader(base.parts)


def test_a_toy_policy_tags_each_batch_hears_it_handed_out_and_draws_from_its_snapshot(folder, monkeypatch):
    toy = _Toy()
    loader = _loader(folder, toy)
    policy = loader.parts.stage.augment.policy
    drawn: list = []
    plan = policy.plan

    def recording(seed, epochs, indices, snapshot=None, size=None):
        drawn.append(snapshot)
        return plan(seed, epochs, indices, snapshot, size)

    monkeypatch.setattr(policy, "plan", recording)
    n = len(loader)
    for epoch in range(2):
        loader.set_epoch(epoch)
        for k, _ in enumerate(loader):
            assert loader.records == [("handed out", epoch * n + k)]  # what the hook returned for this batch
    lag = loader.snapshots.lag
    assert toy.tagged == list(range(2 * n)) and toy.handed_out == 2 * n  # numbered over epochs, each handed out
    # the workers' draws (here in this process: no workers) use each batch's snapshot, one per sample
    assert drawn == [g - lag for g in range(2 * n) for _ in range(4)]
    assert loader.toy is toy  # what the policy adds to the loader's API


def test_a_toy_policys_state_is_saved_and_loaded_with_the_loaders(folder):
    toy = _Toy()
    loader = _loader(folder, toy)
    it = iter(loader)
    next(it), next(it)
    state = loader.state_dict()
    assert state["toy"] == {"handed_out": 2} and state["batch"] == 2
    other = _Toy()
    _loader(folder, other).load_state_dict(state)
    assert other.handed_out == 2


def test_a_loader_without_the_policy_has_none_of_its_names(folder):
    plain = gpupipe.build_loader(folder, "pillow", batch_size=4, image_size=24, num_workers=0, device="cpu")
    assert plain.adaptive is None and plain.snapshots is None and "toy" not in plain.state_dict()
    assert plain.ctaugment is None and plain.weights_clock is None  # CTAugment's names, their values without it
    with pytest.raises(AttributeError, match="'toy'"):
        plain.toy  # noqa: B018
