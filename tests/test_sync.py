"""No synchronising copy on any backend's per-batch path (issue 21, item 4).

On the CPU the device is the meta device: the device stage runs every op it would run on CUDA, without data, and a
dispatch mode counts what reaches the dispatcher: host-to-device copies (at most 2 per batch: the images when they
were decoded on the host, and one pack of labels and augmentation arguments) and the ops that make CUDA wait for the
GPU (``.item()``, ``nonzero``, boolean-mask indexing, blocking copies). ``torch.tensor(..., device=)`` builds its
tensor below the dispatcher, so it is counted by a wrapper. On a GPU (``gpu`` tests) ten batches of every GPU backend
run under ``torch.cuda.set_sync_debug_mode("error")``.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

import gpupipe
from gpupipe.augment import Policy, SampleAugment
from gpupipe.bench.host_budget import meta_loader
from gpupipe.data.device import DeviceStage
from gpupipe.data.loader import Batch
from gpupipe.recipe import Recipe

META = torch.device("meta")
_SYNC_OPS = {"_local_scalar_dense", "nonzero", "masked_select", "masked_scatter", "unique", "_unique2", "item"}
POLICIES = {
    "rand-m9 + erasing": dict(auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25),
    "rand-m9-n3 + pixel erasing x3": dict(auto_augment="rand-m9-n3-mstd0.5-inc1", re_prob=1.0, re_count=3),
    "original + jitter": dict(auto_augment="original", color_jitter=0.4),
    "trivialaugment + const erasing": dict(auto_augment="trivialaugment", re_prob=0.5, re_mode="const"),
    "ctaugment-n4 (every op in 32 images)": dict(auto_augment="ctaugment-n4-t0.5"),
}


class CopyAndSyncCounter(TorchDispatchMode):
    """Counts host-to-``device`` copies and the ops that would make the host wait for ``device``."""

    def __init__(self, device: torch.device = META):
        super().__init__()
        self.device, self.copies, self.syncs = device, 0, []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        on_device = any(t.device == self.device for t in tensors)  # on the CPU, .item() and masks wait for nothing
        if name in _SYNC_OPS and on_device:
            self.syncs.append(name)
        elif name in ("index", "index_put", "index_put_") and on_device and _has_bool_index(args):
            self.syncs.append(f"{name} with a boolean mask")
        elif name == "_to_copy" and tensors[0].device.type == "cpu" and _on_device(kwargs.get("device"), self.device):
            self._copy(kwargs.get("non_blocking", False), name)
        elif name == "copy_" and tensors[0].device == self.device and tensors[1].device.type == "cpu":
            self._copy(bool(args[2]) if len(args) > 2 else kwargs.get("non_blocking", False), name)
        return func(*args, **kwargs)

    def _copy(self, non_blocking: bool, name: str) -> None:
        self.copies += 1
        if not non_blocking:
            self.syncs.append(f"blocking {name}")

    @contextlib.contextmanager
    def counting(self) -> Iterator[CopyAndSyncCounter]:
        """The mode, plus ``torch.tensor``/``torch.as_tensor`` onto the device counted as a blocking copy each."""
        originals = torch.tensor, torch.as_tensor

        def wrap(fn):
            def made_on_device(*a, **k):
                if _on_device(k.get("device"), self.device):
                    self._copy(False, fn.__name__)
                return fn(*a, **k)

            return made_on_device

        torch.tensor, torch.as_tensor = wrap(torch.tensor), wrap(torch.as_tensor)
        try:
            with self:
                yield self
        finally:
            torch.tensor, torch.as_tensor = originals


def _on_device(device, target: torch.device) -> bool:
    return device is not None and torch.device(device).type == target.type


def _has_bool_index(args) -> bool:
    indices = args[1] if len(args) > 1 else []
    return any(isinstance(i, torch.Tensor) and i.dtype == torch.bool for i in indices or [])


def per_batch(stage: DeviceStage, batches: list[Batch]) -> list[tuple[int, list[str]]]:
    """(copies, syncs) of each batch through ``stage.iterate``."""
    out, it = [], stage.iterate(batches)
    counter = CopyAndSyncCounter(stage.device)
    for _ in batches:
        counter.copies, counter.syncs = 0, []
        with counter.counting():
            next(it)
        out.append((counter.copies, counter.syncs))
    return out


def _batches(n: int, size: int, keys: bool, layout: str = "NCHW") -> list[Batch]:
    shape = (8, 3, size, size) if layout == "NCHW" else (8, size, size, 3)
    out = []
    for b in range(n):
        images = torch.randint(0, 256, shape, dtype=torch.uint8)
        k = torch.tensor([(0, b * 8 + i) for i in range(8)]) if keys else None
        out.append(Batch(images, torch.arange(8) + b, layout, keys=k))
    return out


def test_the_counter_sees_copies_and_syncs():
    counter = CopyAndSyncCounter()
    x = torch.zeros(4, device=META)
    with counter.counting():
        torch.tensor([1.0, 2.0], device=META)  # below the dispatcher: the wrapper counts it
        torch.ones(3).to(META)
        torch.ones(3).to(META, non_blocking=True)
        x[torch.ones(4, dtype=torch.bool)] = 0.0
        with contextlib.suppress(RuntimeError):
            x.sum().item()  # meta tensors have no value; the call is still seen
    assert counter.copies == 3
    assert counter.syncs == ["blocking tensor", "blocking _to_copy", "index_put_ with a boolean mask"] + (
        ["_local_scalar_dense"] if len(counter.syncs) == 4 else []
    )


@pytest.mark.parametrize("layout", ["NCHW", "NHWC"])
def test_a_plain_batch_costs_the_images_and_one_pack(layout):
    stage = DeviceStage(META, Recipe(32))
    for copies, syncs in per_batch(stage, _batches(3, 32, keys=False, layout=layout)):
        assert (copies, syncs) == (2, [])


def test_a_batch_made_on_the_device_costs_one_pack():
    stage = DeviceStage(META, Recipe(32))
    batch = Batch(torch.empty(8, 3, 32, 32, dtype=torch.uint8, device=META), torch.arange(8), "NCHW")
    assert per_batch(stage, [batch]) == [(1, [])]


@pytest.mark.parametrize("policy", list(POLICIES))
def test_the_policies_send_their_arguments_in_the_same_pack(policy):
    recipe = Recipe(32, **POLICIES[policy])
    stage = DeviceStage(META, recipe, augment=SampleAugment(Policy(recipe), seed=3))
    for copies, syncs in per_batch(stage, _batches(4, 32, keys=True)):
        assert syncs == [] and copies <= 2


@pytest.mark.parametrize("backend", ["pillow", "dali", "nvjpeg", "synthetic"])
def test_a_backend_batch_costs_at_most_two_copies_and_no_sync(folder, backend):
    """Each backend's loader as built for CUDA, its device side on the meta device (nvjpeg's decode: the host-budget
    benchmark's stand-in, empty tensors of the decoded shapes)."""
    if backend == "dali" and backend not in gpupipe.available_backends():
        pytest.skip("DALI is not installed")
    recipe = Recipe(32, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.5)
    it, counter = iter(meta_loader(str(folder), backend, recipe, batch=6, workers=0)), CopyAndSyncCounter()
    for _ in range(3):
        counter.copies, counter.syncs = 0, []
        with counter.counting():
            images, labels = next(it)
        assert images.device == META and labels.device == META and images.shape == (6, 3, 32, 32)
        assert counter.syncs == [] and counter.copies <= 2


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["pillow", "turbojpeg", "dali", "nvjpeg", "synthetic"])
@pytest.mark.parametrize("augment", [False, True])
def test_ten_cuda_batches_without_a_sync(folder, backend, augment):
    if backend not in gpupipe.available_backends():
        pytest.skip(f"{backend} is not installed")
    recipe = Recipe(64, **(POLICIES["rand-m9 + erasing"] if augment else {}))
    loader = gpupipe.build_loader(folder, backend, batch_size=2, num_workers=2, device="cuda", recipe=recipe)
    it = iter(loader)
    next(it)  # the first batch builds the pipeline, the streams and the tables
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        for _ in range(10):
            images, _labels = next(it)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert images.is_cuda
