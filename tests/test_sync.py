"""No synchronising copy on any backend's per-batch path (issue 21, item 4).

On the CPU the device is the meta device: the device stage runs every op it would run on CUDA, without data, and a
dispatch mode counts what reaches the dispatcher: host-to-device copies (at most 2 per batch: the images when they
were decoded on the host, and one pack of labels and augmentation arguments) and the ops that make CUDA wait for the
GPU (``.item()``, ``nonzero``, boolean-mask indexing, blocking copies). ``torch.tensor(..., device=)`` builds its
tensor below the dispatcher, so it is counted by a wrapper. On a GPU (``gpu`` tests) ten batches of every GPU backend
run under ``torch.cuda.set_sync_debug_mode("error")``.

The counter also sees what makes the host wait without a dispatched op (``Tensor.tolist``) and the collectives called
through ``torch.distributed`` (DDP's own gradient all-reduce runs in its C++ reducer, unseen): with it two gloo ranks
count a whole DDP training step (``tests/probe.py count``).
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
_CPU = torch.device("cpu")
_COLLECTIVES = (
    "all_reduce",
    "all_gather",
    "all_gather_into_tensor",
    "all_gather_object",
    "broadcast",
    "broadcast_object_list",
    "_broadcast_coalesced",
    "reduce",
    "reduce_scatter_tensor",
    "all_to_all_single",
    "barrier",
)
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
        self.device, self.copies, self.syncs, self.collectives = device, 0, [], []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = func.overloadpacket.__name__
        tensors = [a for a in args if isinstance(a, torch.Tensor)]
        on_device = any(t.device == self.device for t in tensors)  # on the CPU, .item() and masks wait for nothing
        host = self.device.type == "cpu"  # the CPU standing in for the device (gloo DDP): no copy is told apart
        if name in _SYNC_OPS and on_device:
            self.syncs.append(name)
        elif name in ("index", "index_put", "index_put_") and on_device and _has_bool_index(args):
            self.syncs.append(f"{name} with a boolean mask")
        elif host:
            pass
        elif name == "_to_copy" and tensors[0].device.type == "cpu" and _on_device(kwargs.get("device"), self.device):
            self._copy(kwargs.get("non_blocking", False), name)
        elif name == "_to_copy" and tensors[0].device == self.device and _on_device(kwargs.get("device"), _CPU):
            self.syncs.append(f"{name} to the host")  # the host reads what the device computed: it waits for it
        elif name == "copy_" and tensors[0].device == self.device and tensors[1].device.type == "cpu":
            self._copy(bool(args[2]) if len(args) > 2 else kwargs.get("non_blocking", False), name)
        return func(*args, **kwargs)

    def _copy(self, non_blocking: bool, name: str) -> None:
        self.copies += 1
        if not non_blocking:
            self.syncs.append(f"blocking {name}")

    @contextlib.contextmanager
    def counting(self) -> Iterator[CopyAndSyncCounter]:
        """The mode, plus ``torch.tensor``/``torch.as_tensor`` onto the device counted as a blocking copy each,
        ``Tensor.tolist`` of a device tensor as a sync and each ``torch.distributed`` collective in ``collectives``."""
        with contextlib.ExitStack() as undo:
            for module, name, wrapper in self._wrappers():
                original = getattr(module, name)
                setattr(module, name, wrapper(original))
                undo.callback(setattr, module, name, original)
            with self:
                yield self

    def _wrappers(self):
        def made_on_device(fn):
            def wrapped(*a, **k):
                if _on_device(k.get("device"), self.device):
                    self._copy(False, fn.__name__)
                return fn(*a, **k)

            return wrapped

        def read_back(fn):
            def wrapped(t, *a, **k):
                if t.device == self.device and t.device.type == "cpu":  # elsewhere it dispatches a copy to the host
                    self.syncs.append("tolist")
                return fn(t, *a, **k)

            return wrapped

        def collective(fn):
            def wrapped(*a, **k):
                self.collectives.append(fn.__name__)
                return fn(*a, **k)

            return wrapped

        yield from ((torch, name, made_on_device) for name in ("tensor", "as_tensor"))
        yield torch.Tensor, "tolist", read_back
        yield from ((torch.distributed, name, collective) for name in _COLLECTIVES)


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
        for read in (x.cpu, x.tolist, x.sum().item):  # meta tensors have no value; the calls are still seen
            with contextlib.suppress(RuntimeError, NotImplementedError):
                read()
    assert counter.copies == 3
    assert counter.syncs[:5] == [
        "blocking tensor",
        "blocking _to_copy",
        "index_put_ with a boolean mask",
        "_to_copy to the host",
        "_to_copy to the host",  # tolist
    ]
    assert counter.syncs[5:] in ([], ["_local_scalar_dense"])
    assert counter.collectives == []


def test_the_counter_sees_collectives():
    import torch.distributed as dist

    dist.init_process_group("gloo", store=dist.HashStore(), rank=0, world_size=1)
    try:
        counter = CopyAndSyncCounter(_CPU)
        with counter.counting():
            dist.all_reduce(torch.ones(2))
            dist.barrier()
            torch.ones(2).tolist()
    finally:
        dist.destroy_process_group()
    assert counter.collectives == ["all_reduce", "barrier"] and counter.syncs == ["tolist"]
    assert dist.all_reduce.__name__ == "all_reduce"  # put back


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


@pytest.mark.parametrize("mode", ["batch", "elem"])
@pytest.mark.parametrize("alphas", [(1.0, 0.0), (1.0, 1.0)])
def test_mix_costs_at_most_one_nonblocking_copy(mode, alphas):
    from gpupipe.mix import Mix

    mix = Mix(*alphas, mode=mode, num_classes=10, seed=0)
    images, labels = torch.empty(8, 3, 32, 32, device=META), torch.empty(8, dtype=torch.int64, device=META)
    with CopyAndSyncCounter().counting() as counter:
        mix(images, labels)
    assert counter.syncs == [] and counter.copies == (mode == "elem")  # elem: its lambdas, one pack


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
