"""Where batches are augmented and normalised is one plan per loader (data/placement.py), and a batch says what it is
(``Batch.normalized``): the device stage trusts it rather than the images' dtype."""

from __future__ import annotations

import pickle

import pytest
import torch

import gpupipe
from gpupipe.augment import Policy, SampleAugment
from gpupipe.backends.handover import WireBatch
from gpupipe.bench.host_budget import meta_loader
from gpupipe.data.device import DeviceStage, normalize
from gpupipe.data.loader import Batch
from gpupipe.data.placement import Placement, place
from gpupipe.recipe import Recipe

from .common_utils import make_folder

RA = Recipe(32, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.5)
CPU, META = torch.device("cpu"), torch.device("meta")


@pytest.fixture(scope="module")
def folder(tmp_path_factory):
    return make_folder(tmp_path_factory.mktemp("placement"), 2, 4)


def _stage(device=CPU, recipe=RA, *, normalize=True, train=True, transforms=None, mode="image"):
    augment = SampleAugment(Policy(recipe) if train else None, 0, transforms, mode)
    return DeviceStage(device, recipe, normalize=normalize, augment=augment)


def _build(folder, **kw):
    args = dict(batch_size=4, image_size=32, num_workers=0, device="cpu", recipe=Recipe(auto_augment="rand-m9"))
    return gpupipe.build_loader(folder, "pillow", **{**args, **kw})


def test_pillow_workers_augment_on_a_cpu_and_the_device_stage_normalises(folder):
    loader = _build(folder)
    assert loader.placement == Placement("worker", "device")
    batch = next(iter(loader._source(0, 0)))
    assert batch.keys is None and not batch.normalized and batch.images.dtype == torch.uint8


def test_pillow_workers_normalise_once_they_take_every_core(folder, monkeypatch):
    monkeypatch.setattr("gpupipe.data.placement.usable_cores", lambda: 1)
    loader = _build(folder, num_workers=1, prefetch_factor=1)
    assert loader.placement == Placement("worker", "worker")
    batch = next(iter(loader._source(0, 0)))
    assert batch.normalized and batch.images.dtype == torch.float32 and batch.layout == "NCHW"
    assert _build(folder, num_workers=1, normalize=False).placement == Placement("worker", None)
    # batch-wise transforms run on the device stage, on uint8: normalised after them, there
    flip = _build(folder, num_workers=1, transforms=lambda x: x.flip(-1), transforms_mode="batch")
    assert flip.placement == Placement("worker", "device")


def test_augment_on_the_device_stage_for_cuda_and_for_a_probe(folder):
    """For CUDA (the meta device stands in) the device stage augments, batched, from keys; so it does for an adaptive
    policy reading the keys of the batches handed out (a probe loader's), even on a CPU."""
    cuda_like = meta_loader(folder, "pillow", RA, batch=4, workers=0)
    assert cuda_like.placement == Placement("device", "device") and cuda_like.placement.keys
    assert next(iter(cuda_like._source(0, 0))).keys is not None
    probe = _build(folder, recipe=Recipe(auto_augment="ctaugment-probe"))
    assert probe.placement == Placement("device", "device")


def test_no_augmentation_eval_and_uint8(folder):
    assert _build(folder, train=False).placement == Placement(None, "device")
    assert _build(folder, train=False, normalize=False).placement == Placement(None, None)


def test_dali_normalises_in_its_graph_unless_the_device_stage_augments():
    assert place(_stage(train=False), "decoder") == Placement(None, "decoder")
    assert place(_stage(META, train=False), "decoder") == Placement(None, "decoder")
    assert place(_stage(train=False, normalize=False), "decoder") == Placement(None, None)
    assert place(_stage(), "decoder") == Placement("device", "device")
    assert place(_stage(META), "decoder", workers=64) == Placement("device", "device")
    batch_only = _stage(train=False, transforms=lambda x: x, mode="batch")
    assert place(batch_only, "decoder") == Placement("device", "device")


def test_backends_that_do_nothing_upstream_leave_all_to_the_device_stage():
    assert place(_stage(), None, workers=64) == Placement("device", "device")
    assert place(_stage(train=False), None) == Placement(None, "device")


def _uint8(n=2, side=8):
    return torch.randint(0, 256, (n, 3, side, side), dtype=torch.uint8, generator=torch.Generator().manual_seed(1))


def test_the_device_stage_normalises_what_the_batch_says_is_not_normalised():
    """A float batch that says it is not normalised is normalised; one that says it is, is left as it is."""
    stage = DeviceStage(CPU, Recipe(8))
    images = _uint8()
    want = normalize(images.float(), stage.mean, stage.inv_std)
    raw_float = Batch(images.float(), torch.arange(2), "NCHW")
    got, _ = stage.upload(raw_float)
    torch.testing.assert_close(got, want, rtol=0, atol=0)
    done = Batch(want.clone(), torch.arange(2), "NCHW", normalized=True)
    got, _ = stage.upload(done)
    assert torch.equal(got, want)
    uint8, _ = stage.upload(Batch(images, torch.arange(2), "NCHW"))
    assert torch.equal(uint8, want)


def test_a_batch_keeps_what_it_says_across_the_hand_over_and_the_rebatching():
    from gpupipe.data.loader import _cat, _split

    wire = WireBatch(_uint8().float(), torch.arange(2), "NCHW", normalized=True)
    arrived = pickle.loads(pickle.dumps(wire))
    assert arrived.normalized
    head, rest = _split(arrived, 1)
    assert head.normalized and rest.normalized and _cat(head, rest).normalized
