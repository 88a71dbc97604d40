"""CTAugment's side of a loader (its :class:`~gpupipe.augment.adaptive.LoaderHook`): which weights each batch draws
from, and the probe records.

Decode workers run ahead of training (DataLoader queues ``workers * prefetch_factor`` batches), so "the current weights"
would depend on timing, and a resumed run (which refills that queue at once) would draw differently. So a loader numbers
its batches over epochs (``epoch * len(loader) + batch``) and batch ``g`` draws from the weights as they were when batch
``g - lag`` was handed out, ``lag`` being at least how far ahead the draws can run
(:func:`~gpupipe.augment.adaptive.lag_for`: 2 where the device stage draws, ``workers * prefetch_factor + 2`` where
decode workers do): an update made after step ``g`` reaches the draws of batch ``g + lag + 1`` and later, the same in
every run. The snapshots (303 floats each) travel with each batch's keys to the workers (pickled once per batch), or
with the batch to the device stage, and the last ``lag + 2`` are part of the loader's state."""

from __future__ import annotations

from collections import deque
from collections.abc import Iterator
from typing import Any

import torch

from ..adaptive import LoaderHook
from .policy import CTAugment, CTRecord, CTWeights


class CTAdaptive:
    """CTAugment as an adaptive policy (:class:`~gpupipe.augment.adaptive.Adaptive`): what loaders get of it."""

    state_key = "ctaugment"

    def __init__(self, policy: CTAugment):
        self.policy = policy

    def loader_hook(self, seed: int, lag: int) -> LoaderFeedback:
        return LoaderFeedback(self.policy, seed, lag)

    def loader_names(self, hook: LoaderHook) -> dict[str, Any]:
        # the weights and their ``update``; which snapshot each batch draws from (None for a probe loader)
        return {"ctaugment": self.policy, "weights_clock": hook.snapshots}


class WeightsClock:
    """Which weights each batch of one loader draws from: those the policy had when the loader handed out the batch
    ``lag`` batches earlier (counted over epochs, ``epoch * len(loader) + batch``). A batch's draws are then fixed
    however far ahead the workers run, and a resumed run (whose state holds the last ``lag`` snapshots) draws as
    the straight one."""

    def __init__(self, policy: CTAugment, lag: int):
        self.policy, self.lag = policy, lag
        self._snaps: dict[int, CTWeights] = {-1: policy.weights()}  # -1: before the first batch

    def delivered(self, g: int) -> None:
        """Batch ``g`` is being handed out: remember the weights as they are now."""
        self._snaps[g] = self.policy.weights()
        for old in [k for k in self._snaps if k < g - self.lag - 1]:
            del self._snaps[old]

    def for_batch(self, g: int) -> CTWeights:
        """The weights batch ``g`` draws from (the latest known when the workers run further ahead than ``lag``,
        which only skipped files can cause)."""
        known = [k for k in self._snaps if k <= g - self.lag]
        return self._snaps[max(known)] if known else self._snaps[min(self._snaps)]

    def state_dict(self) -> dict:
        return {
            "lag": self.lag,
            "snapshots": {k: torch.tensor(w.rates, dtype=torch.float64) for k, w in self._snaps.items()},
        }

    def load_state_dict(self, state: dict) -> None:
        p = self.policy
        self.lag = int(state["lag"])  # the straight run's: its batches drew with it
        self._snaps = {int(k): CTWeights(v.tolist(), p.decay, p.threshold) for k, v in state["snapshots"].items()}


class LoaderFeedback:
    """A loader's side of CTAugment. A drawing loader tags each batch with the snapshot it draws from (its
    :class:`WeightsClock`) and keeps the snapshots in its state; a probe loader recovers each delivered batch's
    records from its (epoch, index) keys."""

    def __init__(self, policy: CTAugment, seed: int, lag: int):
        self.policy, self.seed = policy, seed
        self.clock = None if policy.probe else WeightsClock(policy, lag)
        self.snapshots = self.clock  # what the loader's batches (and its decode workers) draw from
        self.needs_keys = policy.probe  # a probe's records come from the keys of the batches handed out
        self._keys: deque[list[tuple[int, int]]] = deque()

    def tag(self, batches: Iterator, first: int) -> Iterator:
        """The batches (``Batch``) numbered from ``first`` (over epochs), each given its weights snapshot, or its keys
        remembered (probe)."""
        self._keys.clear()
        for g, b in enumerate(batches, first):
            if self.clock is not None:
                b.snapshot = self.clock.for_batch(g)
            else:
                self._keys.append([] if b.keys is None else b.keys.tolist())
            yield b

    def delivered(self, g: int) -> list[CTRecord] | None:
        """Batch ``g`` is handed out: remember the weights; a probe loader returns the batch's records."""
        if self.clock is not None:
            self.clock.delivered(g)
            return None
        return self.policy.records(self.seed, self._keys.popleft())

    def state_dict(self) -> dict:
        if self.clock is None:
            return {}
        return {"policy": self.policy.state_dict(), "clock": self.clock.state_dict()}

    def load_state_dict(self, state: dict) -> None:
        if self.clock is not None and state:
            self.policy.load_state_dict(state["policy"])
            self.clock.load_state_dict(state["clock"])
