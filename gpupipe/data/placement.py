"""Where a loader's batches are augmented and normalised: one :class:`Placement`, decided once when the loader is
built, that every stage reads (the decode workers, DALI's graph, the device stage) instead of each deciding.

The choice: the per-sample augmentation (the recipe's policy, per-image transforms) runs in CPU decode workers when
the batches stay on the CPU (each worker augments its own images, in parallel), else batched on the device stage from
the batch's keys. Normalisation runs where it costs least and still comes after every augmentation on uint8: in the
workers when they take every core of a CPU (the main process has none to spare), in DALI's
``crop_mirror_normalize`` when nothing augments after it, else on the device stage. What a stage made, a batch then
says itself (``Batch.normalized``, ``Batch.keys``), so no later stage guesses from its dtype.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import TYPE_CHECKING, Literal

from .._system import usable_cores

if TYPE_CHECKING:
    from .device import DeviceStage

# What of a batch's making a backend can do before the device stage: "workers" (augment and normalise, in its CPU
# decode workers), "decoder" (normalise, in its decode graph: DALI), None (neither: the device stage does both).
Upstream = Literal["workers", "decoder"] | None


@dataclass(frozen=True)
class Placement:
    """Where each step after the crop runs for one loader.

    Attributes:
        augment: the per-sample augmentation: ``"worker"`` (in the decode workers, image by image), ``"device"`` (on
            the device stage, batched, from the batch's keys), ``None`` (none to do). Batch-wise transforms
            (``transforms_mode="batch"``) always run on the device stage.
        normalize: ``"worker"`` (the decode workers' collate), ``"decoder"`` (DALI's ``crop_mirror_normalize``),
            ``"device"`` (the device stage), ``None`` (batches stay uint8).
    """

    augment: Literal["worker", "device"] | None
    normalize: Literal["worker", "decoder", "device"] | None

    @property
    def keys(self) -> bool:
        """Whether batches carry their samples' (epoch, index) keys to the device stage (it augments from them)."""
        return self.augment == "device"

    @property
    def normalized_upstream(self) -> bool:
        """Whether batches reach the device stage normalised already (float32)."""
        return self.normalize in ("worker", "decoder")


def place(stage: DeviceStage, upstream: Upstream, workers: int = 0, keyed: bool = False) -> Placement:
    """The placement for a loader whose backend can do ``upstream`` before ``stage``, with ``workers`` decode
    workers; ``keyed``: an adaptive policy reads the keys of the batches handed out (a probe loader's), so they must
    reach the device stage and it augments."""
    augment = stage.augment
    on_cpu = stage.device.type == "cpu"
    per_sample: Literal["worker", "device"] | None = None
    if augment is not None:
        per_sample = "worker" if upstream == "workers" and on_cpu and not keyed else "device"
    if not stage.normalize:
        return Placement(per_sample, None)
    # the device stage works on uint8 (the per-sample part the workers left, batch-wise transforms): normalised after
    device_augments = per_sample == "device" or (augment is not None and augment.batch_transforms is not None)
    if device_augments:
        return Placement(per_sample, "device")
    if upstream == "workers" and on_cpu and workers >= usable_cores():
        return Placement(per_sample, "worker")
    return Placement(per_sample, "decoder" if upstream == "decoder" else "device")
