"""The device stage: per-sample augmentation from Batch.keys, and stream order on CUDA (gpu tests)."""

import pytest
import torch

import gpupipe
from gpupipe.augment import Policy, SampleAugment
from gpupipe.data.device import DeviceStage, normalize
from gpupipe.data.loader import Batch
from gpupipe.recipe import Recipe

from .common_utils import cpu_and_cuda


def _stage(device, recipe):
    return DeviceStage(torch.device(device), recipe, augment=SampleAugment(Policy(recipe), seed=7))


@pytest.mark.parametrize("device", cpu_and_cuda())
def test_keys_select_the_per_sample_augmentation(device):
    recipe = Recipe(32, auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.5)
    stage = _stage(device, recipe)
    x = torch.randint(0, 256, (6, 3, 32, 32), dtype=torch.uint8)
    keys = torch.tensor([(1, i) for i in range(6)])
    ((done, _),) = list(stage.iterate([Batch(x, torch.arange(6), "NCHW", keys=keys)]))
    policy = Policy(recipe)
    expected = policy.apply(x, [policy.draw(7, 1, i) for i in range(6)]).to(device)
    assert torch.allclose(done, normalize(expected, stage.mean, stage.inv_std), atol=1e-5 if device == "cpu" else 0.1)
    ((plain, _),) = list(stage.iterate([Batch(x, torch.arange(6), "NCHW")]))  # no keys: already augmented
    assert torch.allclose(plain, normalize(x.to(device), stage.mean, stage.inv_std))


def test_a_batch_made_on_the_device_is_yielded_before_the_next_is_made():
    """A batch made on the device (DALI, nvjpeg on CUDA; here the meta device) has no copy to overlap: the stage hands
    it out before asking for the next one, so the backend's latency for that next batch is not added to the wait."""
    stage = DeviceStage(torch.device("meta"), Recipe(16), normalize=False)
    made: list[int] = []

    def batches():
        for k in range(4):
            made.append(k)
            n = k + 1  # batch k has k + 1 images: its place, read from a shape (a meta tensor holds no values)
            yield Batch(torch.zeros(n, 3, 16, 16, dtype=torch.uint8, device="meta"), torch.zeros(n).long(), "NCHW")

    seen = [(len(made), len(x) - 1) for x, _ in stage.iterate(batches())]
    assert seen == [(1, 0), (2, 1), (3, 2), (4, 3)]  # batch k handed out when k + 1 batches were made


@pytest.mark.gpu
def test_batches_made_on_the_gpu_are_read_after_they_are_written():
    """A batch written on the current stream behind a long kernel must not be read early by the stage."""
    stage = DeviceStage(torch.device("cuda", torch.cuda.current_device()), Recipe(64))
    expected = []

    def batches():
        for k in range(4):
            torch.cuda._sleep(50_000_000)  # keep the current stream busy
            images = torch.full((8, 3, 64, 64), k * 10, dtype=torch.uint8, device="cuda")
            expected.append(images.clone())
            yield Batch(images, torch.arange(8, device="cuda"), "NCHW")

    for (x, _), e in zip(stage.iterate(batches()), expected, strict=True):
        torch.testing.assert_close(x, normalize(e, stage.mean, stage.inv_std))


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["nvjpeg", "synthetic", "pillow"])
def test_one_cuda_device_object_and_the_policy_on_the_gpu(folder, backend):
    recipe = Recipe(auto_augment="rand-m9-mstd0.5-inc1", re_prob=0.25)
    loader = gpupipe.build_loader(
        folder, backend, batch_size=8, image_size=48, num_workers=1, device="cuda", recipe=recipe
    )
    assert loader.device == torch.device("cuda", torch.cuda.current_device())
    for x, _ in loader:
        assert x.device == loader.device and x.shape[1:] == (3, 48, 48) and torch.isfinite(x).all()


def test_a_cpu_batch_is_normalised_over_the_stage_s_threads_into_memory_it_reuses():
    """On the CPU, a stage of several threads normalises as one thread does, bit for bit, in either layout; once a
    batch is dropped its memory makes the next, and a batch still held is never written over."""
    import numpy as np

    from gpupipe.data.device import DeviceStage
    from gpupipe.recipe import Recipe

    rng = np.random.default_rng(0)
    for channels_last in (False, True):
        one = DeviceStage(torch.device("cpu"), Recipe(32), channels_last=channels_last)
        two = DeviceStage(torch.device("cpu"), Recipe(32), channels_last=channels_last, host_threads=2)
        batches = [torch.from_numpy(rng.integers(0, 256, (5, 32, 32, 3), dtype=np.uint8)) for _ in range(3)]
        expected = [one.finish(b, "NHWC").clone() for b in batches]
        held = two.finish(batches[0], "NHWC")
        dropped = two.finish(batches[1], "NHWC")
        where = dropped.data_ptr()
        assert torch.equal(dropped, expected[1])
        del dropped
        again = two.finish(batches[2], "NHWC")
        assert again.data_ptr() == where and torch.equal(again, expected[2])
        assert torch.equal(held, expected[0])  # held meanwhile: not written over
        assert held.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)
        two.close()
        assert two._pool is None
