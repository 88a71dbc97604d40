"""gpupipe/backends/nvjpeg.py off the GPU: the workers' records and the batch assembly, with torchvision's CPU
decode standing in for nvJPEG. The real decode runs in the gpu tests (test_api, test_loader, test_shards)."""

import types

import numpy as np
import pytest
import torch
from torchvision.io import ImageReadMode, decode_jpeg

from gpupipe.backends.nvjpeg import NvjpegLoader, _BytesDataset
from gpupipe.data.sources import open_source as scan
from gpupipe.recipe import Recipe

from .common_utils import encoded, jpeg_bytes, jpeg_with_orientation, photo


def _cpu_decode(data):
    """nvJPEG's call (one tensor of bytes or a list of them), decoded on the CPU."""
    return decode_jpeg(data, mode=ImageReadMode.RGB)


@pytest.fixture()
def files(tmp_path):
    base = photo(np.random.default_rng(0), 40, 60)
    d = tmp_path / "c00"
    d.mkdir()
    (d / "a.jpg").write_bytes(jpeg_bytes(base, quality=95))
    (d / "b.jpg").write_bytes(jpeg_with_orientation(base, 6))
    (d / "c.jpg").write_bytes(encoded(base, "PNG"))  # not a JPEG: Pillow decodes it in the worker
    (d / "d.jpg").write_bytes(b"")  # unreadable
    return scan(tmp_path)


def _loader(dataset) -> NvjpegLoader:
    loader = NvjpegLoader.__new__(NvjpegLoader)  # its constructor insists on CUDA; _batch needs only these
    loader.stage = types.SimpleNamespace(device=torch.device("cpu"))
    loader.recipe = Recipe(16)
    loader._data = _BytesDataset(dataset, loader.recipe, False, 0, 10**8)
    return loader


def test_items_say_what_the_worker_did(files):
    data = _BytesDataset(files, Recipe(16), False, 0, 10**8)
    a, b, c, d = (data[(0, i)] for i in range(4))
    assert (a.decoded_on_cpu, a.orientation, a.error) == (False, 1, None)
    assert (b.decoded_on_cpu, b.orientation) == (False, 6)
    assert c.decoded_on_cpu and c.data.shape == (40, 60, 3)
    assert d.data is None and "empty" in d.error
    assert [it.sample for it in (a, b, c, d)] == [0, 1, 2, 3]


def test_a_batch_is_decoded_turned_cropped_and_counted(files):
    loader = _loader(files)
    items = [loader._data[(0, i)] for i in range(4)]
    batch = loader._batch(0, items, _cpu_decode)
    assert batch.images.shape == (3, 3, 16, 16) and batch.layout == "NCHW"
    assert batch.keys.tolist() == [[0, 0], [0, 1], [0, 2]]
    assert batch.fallbacks == 1
    assert [p.rsplit("/", 1)[-1] for p, _ in batch.errors] == ["d.jpg"]


def test_what_nvjpeg_rejects_goes_to_pillow(files):
    loader = _loader(files)
    items = [loader._data[(0, i)] for i in range(4)]
    rejected = len(files.read(0))

    def picky(data):  # fails the whole batch, then a.jpg alone
        if isinstance(data, list) or data.numel() == rejected:
            raise RuntimeError("nvJPEG says no")
        return _cpu_decode(data)

    batch = loader._batch(0, items, picky)
    assert batch.keys.tolist() == [[0, 0], [0, 1], [0, 2]]
    assert batch.fallbacks == 2  # c.jpg in the worker, a.jpg after nvJPEG refused it
    reference = loader._batch(0, items, _cpu_decode)
    assert (batch.images[0].float() - reference.images[0].float()).abs().mean() < 3
