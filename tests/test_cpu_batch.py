"""Issue 24: the CPU decode worker builds whole batches (``__getitems__``), resizing each image straight into its
slot of a shared buffer it reuses. The same bytes as the per-sample path, whatever the worker count and policy."""

from __future__ import annotations

import dataclasses
import os

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from PIL import Image

import gpupipe
from gpupipe._system import WORKER_NICENESS
from gpupipe.backends import get
from gpupipe.backends.cpu import _Collate, _SampleDataset
from gpupipe.data.device import DeviceStage, host_tensor, normalize, normalize_on_cpu
from gpupipe.image import crop_resize, crop_resize_into, resize_box, resize_box_into
from gpupipe.recipe import Box, Recipe
from gpupipe.sources.open import open_source

from .common_utils import make_folder


def _reference(img: np.ndarray, box: Box, size: int) -> np.ndarray:
    """torchvision's resized_crop on a uint8 tensor (antialiased bilinear), then the mirror: the old path's bytes."""
    region = torch.from_numpy(
        np.ascontiguousarray(img[int(box.top) :, int(box.left) :][: int(box.height), : int(box.width)])
    )
    out = F.interpolate(region.permute(2, 0, 1)[None], size=(size, size), mode="bilinear", antialias=True)[0]
    return (out.flip(-1) if box.flip else out).numpy()


@pytest.mark.parametrize("pil", [False, True])
def test_crop_resize_into_is_resize_then_mirror(pil):
    rng = np.random.default_rng(3)
    for _ in range(60):
        h, w = (int(v) for v in rng.integers(20, 300, 2))
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        bh, bw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
        box = Box(int(rng.integers(0, h - bh + 1)), int(rng.integers(0, w - bw + 1)), bh, bw, bool(rng.random() < 0.5))
        size = int(rng.choice([7, 32, 64]))
        src = Image.fromarray(img) if pil else img
        out = torch.full((size, size, 3), 7, dtype=torch.uint8)
        crop_resize_into(src, box, (h, w), out)
        want = _reference(img, box, size)
        assert np.array_equal(out.permute(2, 0, 1).numpy(), want)
        assert np.array_equal(crop_resize(src, box, (h, w), size), want)


def test_eval_box_into_a_slot_matches_crop_resize():
    img = np.random.default_rng(0).integers(0, 256, (150, 230, 3), dtype=np.uint8)
    recipe = Recipe(64)
    box = recipe.eval_box(150, 230)
    out = torch.empty((64, 64, 3), dtype=torch.uint8)
    crop_resize_into(img, box, (150, 230), out)
    assert np.array_equal(out.permute(2, 0, 1).numpy(), crop_resize(img, box, (150, 230), 64))


@pytest.mark.parametrize("backend", ["pillow", "turbojpeg"])
def test_whole_batch_equals_per_sample_with_a_bad_file_mid_batch(tmp_path, backend):
    root = make_folder(tmp_path, 2, 4)
    (root / "c00" / "001.jpg").write_bytes(b"not a jpeg")
    data = open_source(root)
    ds = _SampleDataset(data, get(backend).decoder(None, True), Recipe(48), True, 5)
    keys = [(2, i) for i in range(len(data))]
    batch = _Collate(48, keys=True)(ds.__getitems__(keys))
    samples = [ds[k] for k in keys]
    good = [s for s in samples if s.image is not None]
    assert batch.layout == "NHWC" and len(good) == len(data) - 1
    assert torch.equal(batch.images.permute(0, 3, 1, 2), torch.from_numpy(np.stack([s.image for s in good])))
    assert batch.labels.tolist() == [s.label for s in good]
    assert batch.keys is not None and batch.keys.tolist() == [list(s.key) for s in good]
    assert [p for p, _ in batch.errors] == [s.path for s in samples if s.image is None]
    assert _Collate(48)(samples).images.tolist() == batch.images.tolist()  # single samples still stack the same


def _epochs(root, workers: int, **kw) -> list[tuple[torch.Tensor, torch.Tensor]]:
    loader = gpupipe.build_loader(
        root, "turbojpeg", batch_size=4, image_size=32, num_workers=workers, device="cpu", seed=3, **kw
    )
    out = []
    for epoch in range(3):  # more batches than a worker's buffers: each buffer is reused, the data never mixed up
        loader.set_epoch(epoch)
        out += [(x.clone(), y.clone()) for x, y in loader]
    return out


@pytest.mark.parametrize("normalize", [False, True])
def test_reused_worker_buffers_give_the_same_batches_as_the_main_process(tmp_path, normalize):
    root = make_folder(tmp_path, 3, 8)
    want = _epochs(root, 0, normalize=normalize)
    got = _epochs(root, 2, normalize=normalize)  # 2 workers: normalised in them when they take every core
    assert len(got) == len(want) == 18
    for (x, y), (wx, wy) in zip(got, want, strict=True):
        assert x.is_contiguous() and x.shape == (4, 3, 32, 32)
        assert torch.equal(y, wy) and torch.equal(x, wx)


def test_pillow_simd_resampler_into_a_slot_is_pils_resize_then_mirror():
    img = Image.fromarray(np.random.default_rng(1).integers(0, 256, (90, 140, 3), dtype=np.uint8))
    for box in (Box(3, 5, 60, 80, False), Box(0, 10, 90, 100, True)):
        out = np.zeros((32, 32, 3), dtype=np.uint8)
        resize_box_into(img, box, (90, 140), out)
        want = img.resize(
            (32, 32), Image.Resampling.BILINEAR, box=(box.left, box.top, box.left + box.width, box.top + box.height)
        )
        want = want.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if box.flip else want
        assert np.array_equal(out, np.asarray(want))
        assert np.array_equal(resize_box(img, box, (90, 140), 32), np.asarray(want).transpose(2, 0, 1))


def test_two_workers_skip_and_raise_a_bad_file_mid_batch_as_the_main_process(tmp_path):
    root = make_folder(tmp_path, 2, 6)
    (root / "c01" / "002.jpg").write_bytes(b"\xff\xd8\xff broken")
    kw = dict(batch_size=4, image_size=32, device="cpu", train=False, normalize=False)
    runs = []
    for workers in (0, 2):
        loader = gpupipe.build_loader(root, "turbojpeg", num_workers=workers, on_error="skip", **kw)
        batches = [(x.clone(), y.tolist()) for x, y in loader]
        runs.append(([y for _, y in batches], [x for x, _ in batches], loader.skipped))
    assert runs[0][0] == runs[1][0] and all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1], strict=True))
    assert [p for p, _ in runs[1][2]] == [str(root / "c01" / "002.jpg")]
    with pytest.raises(gpupipe.DecodeError, match=r"002\.jpg"):
        list(gpupipe.build_loader(root, "turbojpeg", num_workers=2, on_error="raise", **kw))


@pytest.mark.parametrize("channels_last", [False, True])
@pytest.mark.parametrize("size", [40, 1050])  # 1050: a 66 MB float batch, in its own mapping (host_tensor)
def test_normalising_on_the_cpu_image_by_image_gives_torchs_bits(channels_last, size):
    recipe = Recipe(size)
    nhwc = torch.from_numpy(np.random.default_rng(2).integers(0, 256, (5, size, size, 3), dtype=np.uint8))
    stage = DeviceStage(torch.device("cpu"), recipe, channels_last=channels_last)
    want = normalize(nhwc.permute(0, 3, 1, 2).contiguous(), stage.mean, stage.inv_std)
    got = stage.finish(nhwc, "NHWC")
    assert got.dtype == torch.float32 and torch.equal(got, want)
    fmt = torch.channels_last if channels_last else torch.contiguous_format
    assert got.is_contiguous(memory_format=fmt)
    assert torch.equal(stage.finish(nhwc.permute(0, 3, 1, 2).contiguous(), "NCHW"), want)
    as_uint8 = DeviceStage(torch.device("cpu"), recipe, channels_last=channels_last, normalize=False)
    as_uint8 = as_uint8.finish(nhwc, "NHWC")
    assert as_uint8.is_contiguous(memory_format=fmt) and torch.equal(as_uint8, nhwc.permute(0, 3, 1, 2))
    out = torch.full((5, 3, size, size), 7.0)
    assert normalize_on_cpu(nhwc.permute(0, 3, 1, 2), stage.mean, stage.inv_std, out=out) is out
    assert torch.equal(out, want)


def test_a_batch_in_its_own_mapping_is_an_ordinary_tensor():
    x = host_tensor((2, 3, 1600, 1600), torch.float32)  # 61 MB: its own mapping
    x.copy_(torch.arange(x.numel(), dtype=torch.float32).view_as(x))
    assert x.is_contiguous() and x[1, 2, 1599, 1599].item() == x.numel() - 1
    y = x[0].clone()
    x.share_memory_()  # as a tensor sent to another process is
    assert x.is_shared() and torch.equal(x[0], y)
    assert host_tensor((3, 4), torch.uint8).shape == (3, 4)


class _Logged:
    """A loader's data set, read through this in its workers: each read logs the process, its niceness and how it
    shares memory."""

    def __init__(self, dataset, log):
        self.dataset, self.log = dataset, str(log)

    def __getattr__(self, name):
        if name == "dataset":  # not set yet (unpickling)
            raise AttributeError(name)
        return getattr(self.dataset, name)

    def read_many(self, indices):  # the GPU decoders' feed reads a batch at a time: a line a file still
        for _ in indices:
            self._note()
        return self.dataset.read_many(indices)

    def read_samples(self, indices):  # what the loaders read a batch through
        for _ in indices:
            self._note()
        return self.dataset.read_samples(indices)

    def read(self, index):
        self._note()
        return self.dataset.read(index)

    def _note(self) -> None:
        strategy = torch.multiprocessing.get_sharing_strategy()
        with open(self.log, "a") as f:
            f.write(f"{os.getpid()} {os.getpriority(os.PRIO_PROCESS, 0)} {strategy}\n")


@pytest.mark.parametrize("device", ["cpu", "meta"])
def test_decode_workers_for_a_gpu_run_nicer_than_the_training_process(tmp_path, device):
    """Where batches go to a device (the meta device stands in for CUDA), workers take a core only when the training
    thread leaves it: a step never waits behind a decode. On the CPU the training thread computes beside them, as an
    equal. Either way they send batches by name, so receiving one needs no answer from a worker's thread."""
    root = make_folder(tmp_path / "data", 2, 4)
    log = tmp_path / "nice.log"
    loader = gpupipe.build_loader(root, "pillow", batch_size=4, image_size=32, num_workers=2, device="cpu")
    if device != "cpu":
        stage = DeviceStage(torch.device(device), loader.recipe)
        loader = get("pillow").make_loader(dataclasses.replace(loader.parts, stage=stage))
    loader._data.dataset = _Logged(loader._data.dataset, log)
    list(loader)
    seen = {tuple(line.split()) for line in log.read_text().splitlines()}
    assert str(os.getpid()) not in {pid for pid, _, _ in seen}  # read in the workers
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    nice = min(19, mine + WORKER_NICENESS) if device != "cpu" else mine
    assert {(int(n), strategy) for _, n, strategy in seen} == {(nice, "file_system")}
