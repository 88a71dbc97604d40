"""The hook an adaptive augmentation policy (one that learns while the model trains, as CTAugment does) gives a
loader, so that the loader, its backends and its device stage know no policy by name.

A loader numbers its batches over epochs (``epoch * len(loader) + batch``) and asks its policy for a hook
(:meth:`Adaptive.loader_hook`) at its construction. Then, per pass, the hook tags the batches the loader draws
(:meth:`LoaderHook.tag`: each batch's ``snapshot``, the policy's state its draws use, which the device stage hands to
the policy's draws, and decode workers get with each sample's key), hears each batch handed out
(:meth:`LoaderHook.delivered`: what it returns is the loader's ``records``), and keeps its part of the loader's state
(under :attr:`Adaptive.state_key`). Decode workers run ahead of training, so a batch draws from the state as it was
``lag`` batches earlier (:func:`lag_for`): the same in every run, and in a resumed one.
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any, Protocol

# names an adaptive policy adds to every loader's API, each with its value where the loader has no such policy
# (CTAugment's: ``loader.ctaugment``, None without it)
LOADER_NAMES: dict[str, Any] = {}


def lag_for(workers_ahead: int) -> int:
    """Batches between an update and the first draw that sees it: the batches whose draws are made before they are
    handed out (``workers_ahead``: the DataLoader's queue, ``workers * prefetch_factor``, where decode workers draw;
    0 where the device stage does) plus the device stage's one batch ahead and the one being delivered."""
    return max(workers_ahead, 0) + 2


class Snapshots(Protocol):
    """Which state each batch draws from, by its number over epochs (what decode workers are sent with its keys)."""

    @property
    def lag(self) -> int: ...

    def for_batch(self, g: int) -> Any: ...


class LoaderHook(Protocol):
    """An adaptive policy's side of one loader."""

    @property
    def snapshots(self) -> Snapshots | None:
        """The snapshots the loader's batches draw from; None where they draw none (a probe loader only records)."""

    @property
    def needs_keys(self) -> bool:
        """It reads the sample keys of each batch handed out: the per-sample draws are left to the device stage,
        which keeps the keys (decode workers would use them up)."""

    def tag(self, batches: Iterator, first: int) -> Iterator: ...

    def delivered(self, g: int) -> list | None: ...

    def state_dict(self) -> dict: ...

    def load_state_dict(self, state: dict) -> None: ...


class Adaptive(Protocol):
    """What a policy that learns gives loaders (``Policy.adaptive``)."""

    @property
    def state_key(self) -> str:
        """Its part of a loader's ``state_dict()``."""

    def loader_hook(self, seed: int, lag: int) -> LoaderHook: ...

    def loader_names(self, hook: LoaderHook) -> dict[str, Any]: ...  # what it adds to that loader's API (LOADER_NAMES)
