"""gpupipe/backends/held.py: ``build_loader(cache="device" | "host")`` decodes the set once and cuts every epoch's
batches from it: the pillow loader's samples, exact resume, DDP shards, bad files, a set too large refused with its
size, on the CPU device and the meta device."""

import dataclasses
import io
import shutil

import numpy as np
import pytest
import torch
from PIL import Image

import gpupipe
from gpupipe.backends import get
from gpupipe.backends.held import HeldLoader, check_fits, held_loader
from gpupipe.data.device import DeviceStage
from gpupipe.recipe import Recipe

from .common_utils import assert_resume_is_exact, jpeg_bytes, photo

PAD = Recipe(32, crop="pad", padding=4, padding_mode="reflect")


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """CIFAR-sized JPEGs in three classes, and one larger image (held at its own size)."""
    root = tmp_path_factory.mktemp("held")
    rng = np.random.default_rng(2)
    for c in range(3):
        (root / f"c{c}").mkdir()
        for i in range(6):
            (root / f"c{c}" / f"{i}.jpg").write_bytes(jpeg_bytes(photo(rng, 32, 32), quality=95))
    (root / "c2" / "large.jpg").write_bytes(jpeg_bytes(photo(rng, 40, 56), quality=95))
    return root


def _kw(**over):
    return {"batch_size": 4, "device": "cpu", "num_workers": 0, "normalize": False, "seed": 3, **over}


def _pairs(loader) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(x.float(), y) for x, y in loader]


@pytest.mark.parametrize("cache", ["device", "host"])
def test_the_held_set_gives_the_pillow_loader_s_samples_without_decoding_again(tiny, tmp_path, cache):
    """The pad crop (exact), two epochs, and rank 1 of 2; the files gone after the build change nothing."""
    data = shutil.copytree(tiny, tmp_path / "d")
    kw = _kw(recipe=PAD, rank=1, world_size=2)
    held = gpupipe.build_loader(data, "turbojpeg", cache=cache, **kw)
    assert held.held_bytes == 3 * (18 * 32 * 32 + 40 * 56)  # said before a pixel was decoded
    reference = gpupipe.build_loader(data, "pillow", **kw)
    expected = []
    for epoch in (0, 1):
        reference.set_epoch(epoch)
        expected.append(_pairs(reference))
    shutil.rmtree(data)  # held: nothing is read again
    for epoch, theirs in enumerate(expected):
        held.set_epoch(epoch)
        ours = _pairs(held)
        assert len(ours) == len(theirs) == 2
        for (x, y), (ref_x, ref_y) in zip(ours, theirs, strict=True):
            assert torch.equal(y, ref_y) and torch.equal(x, ref_x)


def test_the_resized_and_the_random_resized_crops_are_the_pillow_loader_s(tiny):
    """The whole image resized (train, flipped; eval, every sample once, in order), held resized: the pillow
    loader's pixels. The random-resized crop: the same boxes, resampled within a level or two (a batched antialiased
    bilinear)."""
    resized = [(Recipe(64, crop="resize", flip_p=p), True, 0.0) for p in (0.5, 1.0, 0.0)]  # some, all, none mirrored
    cases = (*resized, (PAD, False, 0.0), (Recipe(24), True, 1.5))
    for recipe, train, tolerance in cases:
        ours = _pairs(gpupipe.build_loader(tiny, "pillow", cache="device", train=train, **_kw(recipe=recipe)))
        theirs = _pairs(gpupipe.build_loader(tiny, "pillow", train=train, **_kw(recipe=recipe)))
        assert len(ours) == len(theirs) == (5 if not train else 4)
        for (x, y), (ref_x, ref_y) in zip(ours, theirs, strict=True):
            assert torch.equal(y, ref_y) and (x - ref_x).abs().mean(dim=(1, 2, 3)).max() <= tolerance


@pytest.mark.parametrize("channels_last", [False, True])
def test_normalised_batches_on_the_cpu_are_the_pillow_loader_s_bits(tiny, channels_last):
    """A set held resized on the CPU is normalised straight from the held images on a thread per core, into memory
    reused once dropped: the pillow loader's normalised batches bit for bit (mirrored or not, in either layout), and
    every batch kept by the caller stays as it was made."""
    for p in (0.5, 1.0, 0.0):
        kw = _kw(recipe=Recipe(64, crop="resize", flip_p=p), normalize=True, channels_last=channels_last)
        with gpupipe.build_loader(tiny, "pillow", cache="device", **kw) as loader:
            loader.stage.host_threads = 2  # split, whatever this machine's cores
            kept = [list(loader), list(loader)]  # two passes, every batch held
            assert loader.stage._pool is not None
        assert loader.stage._pool is None  # closed: its threads ended
        reference = gpupipe.build_loader(tiny, "pillow", **kw)
        for ours, theirs in zip(kept, [list(reference), list(reference)], strict=True):
            assert len(ours) == len(theirs) == 4
            for (x, y), (ref_x, ref_y) in zip(ours, theirs, strict=True):
                assert x.dtype == torch.float32 and torch.equal(y, ref_y) and torch.equal(x, ref_x)
                assert x.is_contiguous(memory_format=torch.channels_last if channels_last else torch.contiguous_format)


def test_a_resumed_held_loader_delivers_the_rest_of_the_epoch_exactly(tiny):
    assert_resume_is_exact(lambda: gpupipe.build_loader(tiny, "pillow", cache="device", **_kw(recipe=PAD)), 1, 2)


def test_on_the_meta_device_everything_is_shaped_and_nothing_decoded(tiny):
    """The meta device (standing in for a GPU): the set sized from its headers, batches of the right shapes."""
    base = gpupipe.build_loader(tiny, "pillow", **_kw(recipe=PAD))
    parts = dataclasses.replace(base.parts, stage=DeviceStage(torch.device("meta"), PAD))
    loader = held_loader(parts, get("pillow"), "device")
    assert loader.held.pixels.device.type == "meta" and loader.held_bytes == 3 * (18 * 32 * 32 + 40 * 56)
    batches = list(loader)
    assert len(batches) == 4 and all(x.shape == (4, 3, 32, 32) and x.device.type == "meta" for x, _ in batches)


def test_batches_for_a_gpu_are_cut_and_finished_off_the_training_thread(tiny, monkeypatch):
    """For a device other than the CPU (the meta device standing in for a GPU) each batch is cut, and normalised by
    the device stage, on the loader's own thread, two ahead: the training thread only takes finished batches. For the
    CPU, where the model's step takes every core, on the caller's thread."""
    import threading

    from gpupipe.data import device as device_module

    where: dict[str, set[str]] = {"cut": set(), "normalised": set()}
    cut, normalize = HeldLoader._crops, device_module.normalize

    def crops(self, *args):
        where["cut"].add(threading.current_thread().name)
        return cut(self, *args)

    def normalised(*args):
        where["normalised"].add(threading.current_thread().name)
        return normalize(*args)

    monkeypatch.setattr(HeldLoader, "_crops", crops)
    monkeypatch.setattr(device_module, "normalize", normalised)
    base = gpupipe.build_loader(tiny, "pillow", **_kw(recipe=PAD, normalize=True))
    parts = dataclasses.replace(base.parts, stage=DeviceStage(torch.device("meta"), PAD))
    batches = list(held_loader(parts, get("pillow"), "device"))
    assert len(batches) == 4 and all(x.dtype == torch.float32 for x, _ in batches)
    assert where == {"cut": {"gpupipe-held"}, "normalised": {"gpupipe-held"}}
    where["cut"].clear()
    list(gpupipe.build_loader(tiny, "pillow", cache="device", **_kw(recipe=PAD)))
    assert where["cut"] == {threading.current_thread().name}


def test_the_loader_s_thread_begins_no_batch_while_the_caller_is_inside_next_with_one_made(tiny, monkeypatch):
    """The caller's pass tells the loader's thread when it is inside ``next()``: a batch made there would take the
    GIL from it (see plumbing/decode_ahead.py's Turn), so with a made batch to take, the next is begun after."""
    import threading
    import time

    base = gpupipe.build_loader(tiny, "pillow", **_kw(recipe=PAD, normalize=True))
    stage = DeviceStage(torch.device("meta"), PAD)
    loader = held_loader(dataclasses.replace(base.parts, stage=stage), get("pillow"), "device")
    begun_inside, batch, upload, inside = [], HeldLoader._batch, stage.upload, threading.Event()

    def made(self, *args):
        ahead = self._ahead
        begun_inside.append(inside.is_set() and ahead is not None and not ahead._queue.empty())
        return batch(self, *args)

    def slow_upload(b):  # the training thread's part of next(), made long
        if threading.current_thread() is threading.main_thread():
            time.sleep(0.02)
        return upload(b)

    monkeypatch.setattr(HeldLoader, "_batch", made)
    monkeypatch.setattr(stage, "upload", slow_upload)
    batches = iter(loader)
    for _ in range(len(loader)):
        inside.set()
        next(batches)
        inside.clear()
        time.sleep(0.03)  # the step
    assert len(begun_inside) == 4 and not any(begun_inside)


def test_a_set_too_large_is_refused_up_front_with_its_size(tmp_path):
    """A list naming an 8000 x 8000 JPEG 5,000 times: 894 GiB decoded, refused from the headers alone (the file
    ends after its scan header: no pixel is decoded)."""
    buf = io.BytesIO()
    Image.new("L", (8000, 8000)).save(buf, "JPEG", quality=10)
    (tmp_path / "big.jpg").write_bytes(buf.getvalue()[: buf.getvalue().index(b"\xff\xda") + 20])
    (tmp_path / "list.csv").write_text("".join(f"big.jpg,{i % 2}\n" for i in range(5000)))
    with pytest.raises(ValueError, match=r'cache="device": the 5000 decoded images need 894\.07 GiB, more than'):
        gpupipe.build_loader(tmp_path / "list.csv", "pillow", cache="device", **_kw())
    with pytest.raises(ValueError, match=r"need 512\.0 MiB, more than the memory given allows \(512\.0 MiB"):
        check_fits(1 << 29, 10, torch.device("cuda"), "device", memory=1 << 29)


@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_bad_file_is_named_at_the_build_or_skipped_every_pass(tiny, tmp_path, on_error):
    data = shutil.copytree(tiny, tmp_path / "d")
    (data / "c1" / "3.jpg").write_bytes(b"not an image")
    if on_error == "raise":
        with pytest.raises(gpupipe.DecodeError, match=r"c1/3\.jpg"):
            gpupipe.build_loader(data, "pillow", cache="device", **_kw(recipe=PAD))
        return
    loader = gpupipe.build_loader(data, "pillow", cache="device", on_error="skip", **_kw(recipe=PAD))
    for _ in range(2):
        batches = list(loader)
        assert len(batches) == 4 and all(len(y) == 4 for _, y in batches)  # refilled from the next samples
        assert [p.rsplit("/", 2)[-2:] for p, _ in loader.skipped] == [["c1", "3.jpg"]]


def test_an_image_the_pad_crop_cannot_be_cut_from_is_named_at_the_build(tiny, tmp_path):
    data = shutil.copytree(tiny, tmp_path / "d")
    (data / "c0" / "small.jpg").write_bytes(jpeg_bytes(photo(np.random.default_rng(0), 20, 30)))
    with pytest.raises(gpupipe.DecodeError, match=r"c0/small\.jpg.*a 20-pixel side padded by 4 is smaller than"):
        gpupipe.build_loader(data, "pillow", cache="device", **_kw(recipe=PAD))
    loader = gpupipe.build_loader(data, "pillow", cache="device", on_error="skip", **_kw(recipe=PAD))
    assert len(list(loader)) == 5 and [p.rsplit("/", 1)[-1] for p, _ in loader.skipped] == ["small.jpg"]


def test_a_backend_without_images_or_an_unknown_cache_is_one_line(tiny):
    with pytest.raises(ValueError, match="backend 'synthetic' decodes no images"):
        gpupipe.build_loader(tiny, "synthetic", cache="device", batch_size=4, device="cpu")
    with pytest.raises(ValueError, match="cache must be None, 'device' or 'host', got 'gpu'"):
        gpupipe.build_loader(tiny, "pillow", cache="gpu", **_kw())  # type: ignore[arg-type]


def test_repr_says_the_set_is_held_not_read_by_workers(tiny):
    held = gpupipe.build_loader(tiny, "pillow", cache="device", **_kw(recipe=PAD, num_workers=2))
    text = repr(held)
    assert "worker" not in text.replace("no workers", "") and "held on cpu ('device')" in text, text
    assert f"no workers, {held.held_bytes / 1024:.1f} KiB held" in text  # a small set read "0.00 GiB"


def test_a_set_of_pixels_is_held_without_encoding_an_image(monkeypatch):
    """Arrays (and datasets of pixels) are held as they are: no image is PNG-encoded to be decoded again, and the
    batches equal the pillow loader's on the same arrays."""
    rng = np.random.default_rng(5)
    images = np.stack([photo(rng, 32, 32) for _ in range(8)]).astype(np.uint8)
    labels = np.arange(8) % 2
    kw = _kw(recipe=Recipe(48, crop="resize", flip_p=0.0))
    reference = _pairs(gpupipe.build_loader((images, labels), "pillow", **kw))
    saved = []
    real = Image.Image.save
    monkeypatch.setattr(Image.Image, "save", lambda self, *a, **k: saved.append(1) or real(self, *a, **k))
    held = gpupipe.build_loader((images, labels), "pillow", cache="device", **kw)
    assert not saved
    for (x, y), (rx, ry) in zip(_pairs(held), reference, strict=True):
        assert torch.equal(y, ry) and torch.equal(x, rx)


def test_each_sample_is_read_once_to_be_held(tiny, monkeypatch):
    """The headers' pass keeps what it read for the decode: each file is read once (a set on object storage is
    fetched once)."""
    from gpupipe.sources.scan import ImageList

    reads: list[int] = []
    real = ImageList.read_samples
    monkeypatch.setattr(ImageList, "read_samples", lambda self, idx: reads.extend(idx) or real(self, idx))
    held = gpupipe.build_loader(tiny, "pillow", cache="device", **_kw(recipe=PAD))
    assert sorted(reads) == list(range(len(held.dataset)))
