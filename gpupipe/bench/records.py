"""The bench's records: what a run is asked to measure (:class:`Config`) and each figure it gives (:class:`Result`).

Kept apart from ``suite`` and ``end_to_end`` so that both use them without importing each other.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..recipe import Recipe


@dataclass
class Config:
    """One ``gpupipe bench`` run: the data, the backends and pipelines to time, and how long."""

    data: str
    backends: list[str]
    pipelines: list[str]
    workers: int
    device: torch.device
    batch_size: int = 64
    seconds: float = 6.0
    repeats: int = 3
    image_size: int = 224
    image_sizes: list[int] = field(default_factory=list)  # several: train, eval, floor and augment at each (a row each)
    model: str | None = None
    dali_reference: bool = True  # time DALI's own pipeline beside the dali backend (train, eval)
    recipes: dict[str, Recipe] = field(default_factory=dict)  # the augment pipeline's policies: one job per label
    skipped: set[str] = field(default_factory=set)  # filled by the run: unreadable files the loaders left out

    def __post_init__(self) -> None:
        if self.image_sizes:  # the first is the one size of what times a single size (decode jobs, end to end)
            self.image_size = self.image_sizes[0]


def bench_pipelines(asked: str | None, model: str | None, augmenting: bool) -> list[str]:
    """The pipelines a ``gpupipe bench`` times: those asked for (``--pipelines``), else decode, train and eval; with
    ``--model`` or an augmentation policy, train alone (the rows those modes are read against: a GPU's check of every
    backend then fits one 10-minute call), and augment beside it for a policy."""
    if asked is not None:
        pipelines = asked.split(",")
    else:
        pipelines = ["train"] if model or augmenting else ["decode", "train", "eval"]
    return [*pipelines, "augment"] if augmenting and "augment" not in pipelines else pipelines


@dataclass
class Result:
    """One figure: a backend's images per second in one pipeline (median over the timed windows, with their
    range), and its ratios to the run's references (``extra``: ``vs_floor``, ``vs_synthetic``, ``data_wait``)."""

    backend: str
    pipeline: str
    device: str
    workers: int
    images_per_s: float
    spread: tuple[float, float]
    megapixels_per_s: float
    images_per_s_per_worker: float
    vs_baseline: float | None = None
    gpu_util: float | None = None
    extra: dict = field(default_factory=dict)

    def as_dict(self) -> dict:
        d = {k: v for k, v in self.__dict__.items() if k != "extra"}
        d["spread"] = list(self.spread)
        return {**d, **self.extra}


def policy_recipes(
    image_size: int, auto_augments: list[str] | None, color_jitter: float | None = None, re_prob: float = 0.0
) -> dict[str, Recipe]:
    """The augment pipeline's policies by label: one per auto-augment policy (``--aa``, repeatable), each with the
    colour jitter and erasing asked for; one without auto-augment when none is named."""
    extras = []
    if color_jitter:
        extras.append(f"color-jitter {color_jitter}")
    if re_prob:
        extras.append(f"reprob {re_prob}")
    recipes = {}
    names: list[str | None] = [*auto_augments] if auto_augments else [None]
    for aa in dict.fromkeys(names):
        label = " + ".join(([aa] if aa else []) + extras) or "none"
        recipes[label] = Recipe(image_size, auto_augment=aa, color_jitter=color_jitter, re_prob=re_prob)
    return recipes
