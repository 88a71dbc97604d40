"""gpupipe/backends/nvjpeg.py off the GPU: the workers' records and the batch assembly, with torchvision's CPU
decode standing in for nvJPEG. The real decode runs in the gpu tests (test_api, test_loader, test_shards)."""

import gc
import multiprocessing
import os
import threading
import time
import types
import warnings

import numpy as np
import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode
from torchvision.io import ImageReadMode, decode_jpeg

import gpupipe
from gpupipe._system import WORKER_NICENESS
from gpupipe.backends import gpu_crop
from gpupipe.backends.gpu_crop import crop_resize_flip, stored_rois
from gpupipe.backends.nvjpeg import _LEFT_OVER, NvjpegFeed, NvjpegLoader, _upright_chw
from gpupipe.errors import DecodeError
from gpupipe.image import padded_window
from gpupipe.recipe import Recipe
from gpupipe.sources.open import open_source as scan

from .common_utils import encoded, jpeg_bytes, jpeg_with_orientation, make_folder, photo
from .test_cpu_batch import _Logged


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
    loader._data = NvjpegFeed(dataset, loader.recipe, False, 0, 10**8)
    loader._pad = gpu_crop.PadSize()
    return loader


def test_the_feed_says_what_the_worker_did(files):
    """One GPU row per JPEG nvJPEG takes, named: its box, EXIF orientation and stored size; the PNG decoded and
    cropped by Pillow in the worker; the empty file an error naming it."""
    work = NvjpegFeed(files, Recipe(16), False, 0, 10**8).work(0, [0, 1, 2, 3])
    assert work.gpu == [0, 1] and work.lengths.tolist() == [len(files.read(0)), len(files.read(1))]
    assert work.orientation.tolist() == [1, 6]
    assert work.stored.tolist() == [[40, 60], [40, 60]]  # b.jpg is stored 40 x 60 and upright 60 x 40
    assert work.boxes.shape == (2, 5) and work.encoded.dim() == 1  # one view per file: no padded rows
    assert list(work.cpu) == [2] and work.cpu[2].shape == (3, 16, 16) and work.fallbacks == 1
    assert [p.rsplit("/", 1)[-1] for p, _ in work.errors] == ["d.jpg"] and "empty" in work.errors[0][1]
    assert work.labels.tolist() == [0, 0, 0, 0] and work.index.tolist() == [0, 1, 2, 3]


def test_a_batch_is_decoded_turned_cropped_and_counted(files):
    loader = _loader(files)
    batch = loader._batch(0, loader._data.work(0, [0, 1, 2, 3]), _cpu_decode)
    assert batch.images.shape == (3, 3, 16, 16) and batch.layout == "NCHW"
    assert batch.keys.tolist() == [[0, 0], [0, 1], [0, 2]]
    assert batch.fallbacks == 1
    assert [p.rsplit("/", 1)[-1] for p, _ in batch.errors] == ["d.jpg"]


@pytest.mark.parametrize("refused", [0, 1])
def test_what_nvjpeg_rejects_goes_to_pillow(files, refused):
    """a.jpg (upright) or b.jpg (EXIF 6) refused by nvJPEG: the feed's fallback, Pillow, decodes and crops it."""
    loader = _loader(files)
    rejected = len(files.read(refused))

    def picky(data):  # fails the whole batch, then the refused file alone
        if isinstance(data, list) or data.numel() == rejected:
            raise RuntimeError("nvJPEG says no")
        return _cpu_decode(data)

    batch = loader._batch(0, loader._data.work(0, [0, 1, 2, 3]), picky)
    assert batch.keys.tolist() == [[0, 0], [0, 1], [0, 2]]
    assert batch.fallbacks == 2  # c.jpg in the worker, the refused one after nvJPEG
    reference = loader._batch(0, loader._data.work(0, [0, 1, 2, 3]), _cpu_decode)
    assert (batch.images[refused].float() - reference.images[refused].float()).abs().mean() < 3
    for k in {0, 1, 2} - {refused}:  # the rest keep their own crops: the batch narrowed, each box still its image's
        assert torch.equal(batch.images[k], reference.images[k])


def test_a_jpeg_neither_decoder_takes_is_an_error_naming_its_file(files, monkeypatch):
    loader = _loader(files)
    work = loader._data.work(0, [0, 1, 2, 3])  # c.jpg decoded by Pillow in the worker, before the break

    def refuse(data):
        raise RuntimeError("nvJPEG says no")

    def broken(data, path, plan, size):
        raise DecodeError(path, "pillow", "broken")

    monkeypatch.setattr(loader._data.check, "crop", broken)
    batch = loader._batch(0, work, refuse)
    assert batch.keys.tolist() == [[0, 2]] and batch.fallbacks == 1  # only c.jpg, decoded in the worker
    assert sorted(p.rsplit("/", 1)[-1] for p, _ in batch.errors) == ["a.jpg", "b.jpg", "d.jpg"]
    assert all("nvJPEG says no; Pillow: broken" in why for p, why in batch.errors if not p.endswith("d.jpg"))


def _crop(images, boxes, orientation, shapes, size):
    return crop_resize_flip(images, *stored_rois(boxes, orientation, shapes), shapes, size)


@pytest.mark.parametrize("orientation", range(1, 9))
@pytest.mark.parametrize("flip", [False, True])
def test_crops_of_stored_images_match_crops_of_upright_ones(orientation, flip):
    """The boxes are mapped into stored pixels and the outputs turned upright: the same crop as cropping the image
    turned upright first, for every EXIF orientation, with and without the recipe's flip."""
    stored = torch.randint(0, 256, (3, 40, 60), dtype=torch.uint8)
    upright = _upright_chw(stored, orientation).contiguous()
    box = np.array([[5.5, 3.0, 21.0, 17.25, flip]])
    shape = lambda img: np.array([img.shape[1:]], np.int64)
    got = _crop([stored], box, np.array([orientation]), shape(stored), 16)
    want = _crop([upright], box, np.array([1]), shape(upright), 16)
    assert got.shape == (1, 3, 16, 16) and (got.int() - want.int()).abs().max() <= 1


@pytest.mark.parametrize("flips", [0, 2])
def test_a_batch_of_mixed_orientations_and_chunks(monkeypatch, flips):
    """Several chunks (a small padding limit) and orientations in one batch: each image as cropped alone."""
    monkeypatch.setattr(gpu_crop, "_PAD_ELEMENTS", 3 * 50 * 70 * 2)
    rng = np.random.default_rng(1)
    images = [torch.randint(0, 256, (3, 30 + 5 * k, 70 - 5 * k), dtype=torch.uint8) for k in range(5)]
    shapes = np.array([im.shape[1:] for im in images], np.int64)
    orientation = np.array([1, 6, 3, 8, 5])
    upright_hw = [(h, w) if o < 5 else (w, h) for (h, w), o in zip(shapes.tolist(), orientation, strict=True)]
    boxes = np.array(
        [
            (rng.uniform(0, 5), rng.uniform(0, 5), h - 8, w - 9, flips and k % flips)
            for k, (h, w) in enumerate(upright_hw)
        ]
    )
    assert len(list(gpu_crop.chunks(shapes))) > 1
    batch = _crop(images, boxes, orientation, shapes, 12)
    for k, img in enumerate(images):
        alone = _crop([img], boxes[k : k + 1], orientation[k : k + 1], shapes[k : k + 1], 12)
        assert torch.equal(batch[k], alone[0])


@pytest.mark.parametrize("fill", ["zero", "reflect"])
def test_the_pad_crop_of_stored_images_is_the_padded_window_of_upright_ones(fill):
    """The ``"pad"`` crop's gather: windows reaching past every edge, of images in every EXIF orientation, with and
    without the flip, are exactly the upright image padded (zeros or reflected) and cut."""
    rng = np.random.default_rng(5)
    images = [torch.randint(0, 256, (3, 30 + k, 37 - k), dtype=torch.uint8) for k in range(8)]
    shapes = np.array([im.shape[1:] for im in images], np.int64)
    orientation = np.arange(1, 9)
    uprights = [_upright_chw(im, o).permute(1, 2, 0).numpy() for im, o in zip(images, orientation, strict=True)]
    boxes = np.array([(rng.integers(-4, 5), rng.integers(-4, 5), 32, 32, k % 2) for k in range(8)], np.float64)
    boxes[:, 0] = np.where(np.arange(8) % 3 == 0, [u.shape[0] + 4 - 32 for u in uprights], boxes[:, 0])  # bottom edge
    rois, steps = stored_rois(boxes, orientation, shapes)
    got = gpu_crop.pad_crop_flip(images, rois, steps, shapes, 32, fill)
    for k, upright in enumerate(uprights):
        window = padded_window(upright, int(boxes[k, 0]), int(boxes[k, 1]), 32, 32, fill)
        want = torch.from_numpy(np.ascontiguousarray(window[:, ::-1] if boxes[k, 4] else window)).permute(2, 0, 1)
        assert torch.equal(got[k], want), k


class _CpuNvjpegLoader(NvjpegLoader):
    """The nvjpeg loader whole (workers, hand-over, batched crops), its device side on the CPU, decoding with
    torchvision's CPU decoder: the same boxes and pixels as Pillow's loader, checked here without a GPU."""

    decode_devices = ("cpu",)

    def decoder(self):
        return _cpu_decode


@pytest.fixture(scope="module")
def turned(tmp_path_factory):
    """Every EXIF orientation, twice, in two classes, beside a PNG that Pillow decodes in the worker."""
    root = tmp_path_factory.mktemp("turned")
    rng = np.random.default_rng(3)
    for c in range(2):
        (root / f"c{c}").mkdir()
        for o in range(1, 9):
            (root / f"c{c}" / f"{o}.jpg").write_bytes(jpeg_with_orientation(photo(rng, 72 + 8 * c, 100 - o), o))
    (root / "c1" / "png.jpg").write_bytes(encoded(photo(rng, 70, 90), "PNG"))
    return root


@pytest.mark.parametrize("train", [False, True])
def test_the_whole_loader_crops_as_pillow_does(turned, train):
    def run(make):
        kw = dict(batch_size=5, train=train, image_size=32, num_workers=1, normalize=False, device="cpu", seed=4)
        pillow = gpupipe.build_loader(turned, "pillow", **kw)
        loader = make(pillow)
        return [(x.float(), y) for x, y in loader], loader

    ours, loader = run(lambda pillow: _CpuNvjpegLoader(pillow.parts))
    reference, _ = run(lambda pillow: pillow)
    assert len(ours) == len(reference) == (4 if not train else 3)  # train drops the last partial batch
    assert train or loader.fallbacks == 1  # the PNG (train may drop it with the partial batch)
    for (x, y), (ref_x, ref_y) in zip(ours, reference, strict=True):
        assert torch.equal(y, ref_y) and x.shape == ref_x.shape
        # resampling differs (roi_align vs Pillow's filter; the JPEG decoders' upsampling), the boxes do not: a box
        # off by a few pixels, or a wrong turn, costs tens of levels
        assert (x - ref_x).abs().mean(dim=(1, 2, 3)).max() < 4


@pytest.mark.gpu
def test_a_resolution_schedule_gives_each_epoch_its_size_from_the_same_workers(tmp_path):
    """nvjpeg: epoch 1 of [16, 24] is epoch 1 at a fixed 24, from the same worker processes as epoch 0."""
    root = make_folder(tmp_path / "d", 3, 4)
    kw = dict(batch_size=4, num_workers=1, device="cuda", normalize=False, seed=2)
    fixed = gpupipe.build_loader(root, "nvjpeg", recipe=Recipe(24), **kw)
    fixed.set_epoch(1)
    want = list(fixed)
    before = {p.pid for p in multiprocessing.active_children()}
    loader = gpupipe.build_loader(root, "nvjpeg", recipe=Recipe(size=[16, 24]), **kw)
    assert {x.shape[-1] for x, _ in loader} == {16}
    workers = {p.pid for p in multiprocessing.active_children()} - before
    loader.set_epoch(1)
    got = list(loader)
    assert workers and workers == {p.pid for p in multiprocessing.active_children()} - before
    assert all(torch.equal(x, wx) and torch.equal(y, wy) for (x, y), (wx, wy) in zip(got, want, strict=True))


def test_a_truncated_jpeg_is_judged_by_pillow_not_sent_to_nvjpeg(tmp_path):
    """nvJPEG may decode a truncated baseline JPEG into grey rows without an error: without its end-of-image marker a
    file is judged by Pillow in the worker, which refuses it (the file named): the feed dali shares."""
    d = tmp_path / "c00"
    d.mkdir()
    whole = jpeg_bytes(photo(np.random.default_rng(1), 64, 64), quality=95)
    (d / "whole.jpg").write_bytes(whole)
    (d / "cut.jpg").write_bytes(whole[: len(whole) * 2 // 3])
    (d / "tail.jpg").write_bytes(whole + b"\0" * 100)  # bytes after the marker: still whole
    files = scan(tmp_path)
    work = NvjpegFeed(files, Recipe(16), False, 0, 10**8).work(0, [0, 1, 2])
    names = [p.rsplit("/", 1)[-1] for p, _ in files.samples]
    assert sorted(names[pos] for pos in work.gpu) == ["tail.jpg", "whole.jpg"] and not work.cpu
    assert [p.rsplit("/", 1)[-1] for p, _ in work.errors] == ["cut.jpg"] and work.errors[0][1]


def test_padding_is_one_float_batch_with_each_images_edge_repeated_once():
    """The padded batch roi_align reads is float32 from the start: on CUDA torch's to_padded_tensor has a kernel for
    float types only (uint8 falls to a pad and a copy per image). Past each image's last row and column, that row and
    column once more (what roi_align reads half a pixel past the edge), then zeros."""
    images = [torch.randint(0, 256, (3, h, w), dtype=torch.uint8) for h, w in [(5, 7), (9, 4), (6, 6)]]
    out = gpu_crop.padded(images, np.array([(5, 7), (9, 4), (6, 6)]))
    assert out.dtype == torch.float32 and out.shape == (3, 3, 10, 8)
    for img, pad in zip(images, out, strict=True):
        h, w = img.shape[1:]
        assert torch.equal(pad[:, :h, :w], img.float())
        assert torch.equal(pad[:, h, :w], img[:, -1].float()) and torch.equal(pad[:, :h, w], img[:, :, -1].float())
        assert pad[:, h, w].eq(img[:, -1, -1]).all() and pad[:, h + 1 :].eq(0).all() and pad[:, :, w + 1 :].eq(0).all()


def test_an_enlarged_crop_at_the_edge_of_a_smaller_image_keeps_its_colour():
    """A crop reaching the bottom-right edge of an image smaller than the batch's largest, enlarged: roi_align samples
    up to half a pixel past the edge, which read the zero padding (a uniform 200 came out 131 along the edges, 86 in
    the corner) while the largest image's own edge was clamped."""
    images = [torch.full((3, 40, 40), 200, dtype=torch.uint8), torch.full((3, 20, 20), 200, dtype=torch.uint8)]
    shapes, boxes = np.array([(40, 40), (20, 20)]), np.array([(0, 0, 40, 40, 0), (4, 4, 16, 16, 0)], float)
    for pad in (None, gpu_crop.PadSize()):
        out = crop_resize_flip(images, *stored_rois(boxes, np.array([1, 1]), shapes), shapes, 64, pad)
        assert out.eq(200).all()


def test_the_padded_batch_has_one_size_once_the_largest_images_were_seen():
    """Padded to each batch's own largest image, the float batch (the device side's largest allocation) changed size
    from batch to batch: each new size one the caching allocator had no block for, the pattern that fragments it.
    200 batches of photos in three shapes, four a batch: after the first epoch, no size the first epoch did not ask
    for, and one size for nearly every batch."""
    rng = np.random.default_rng(0)
    pad, sizes = gpu_crop.PadSize(), []
    shapes = np.array([(375, 500), (500, 375), (300, 420), (333, 500), (500, 400)] * 4)
    for _ in range(40):
        order = rng.permutation(len(shapes))
        for b in range(0, len(order), 4):
            sizes.append(pad(shapes[order[b : b + 4]]))
    first, later = set(sizes[:5]), sizes[5:]
    assert len(sizes) == 200 and set(later) <= first and len(set(later)) == 1


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks a machine where torchcodec cannot decode on CUDA")
def test_a_torchcodec_that_cannot_decode_on_the_device_is_passed_over_once(monkeypatch):
    """Decided once per device, with one warning naming torchcodec: not a failure every batch, each then retried
    image by image by Pillow on the training thread (only ``fallbacks`` would have told)."""
    pytest.importorskip("torchcodec")
    from gpupipe.backends import nvjpeg

    monkeypatch.setattr(nvjpeg, "_CHOSEN", {})
    cuda = torch.device("cuda", 0)
    with pytest.warns(UserWarning, match=r"nvjpeg: torchcodec cannot decode on cuda:0 \(.*\); using torchvision's"):
        chosen = nvjpeg._batched_jpeg_decode(cuda)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert nvjpeg._batched_jpeg_decode(cuda) is chosen  # no second try, no second warning
    cpu = nvjpeg._batched_jpeg_decode(torch.device("cpu"))  # where torchcodec works, it is chosen
    assert cpu(nvjpeg._tiny_jpeg(), torch.device("cpu")).shape == (3, 8, 8)


@pytest.mark.gpu
def test_two_hundred_batches_of_varied_photos_reserve_no_more_memory_than_the_first_epochs(tmp_path):
    """The caching allocator's reserved memory, after the first epochs (the largest images seen, the padded size
    settled), does not grow over 200 batches: the decoder's outputs and the padded batch reuse cached blocks. A
    growth per batch is the fragmentation pattern (DALI #278, torchvision #4378); 10 % leaves room for a block the
    allocator splits differently, not for a growth that goes on."""
    rng = np.random.default_rng(3)
    root = tmp_path / "d"
    for c in range(2):
        (root / f"c{c}").mkdir(parents=True)
        for i in range(10):
            h, w = [(375, 500), (500, 375), (300, 420), (480, 640), (256, 300)][i % 5]
            photo(rng, h, w).save(root / f"c{c}" / f"{i}.jpg", quality=90)
    loader = gpupipe.build_loader(root, "nvjpeg", batch_size=4, image_size=64, num_workers=1, device="cuda")
    batches, early = 0, None
    for epoch in range(40):
        loader.set_epoch(epoch)
        batches += sum(1 for _ in loader)
        if epoch == 4:
            torch.cuda.synchronize()
            early = torch.cuda.memory_reserved()
    torch.cuda.synchronize()
    assert batches == 200 and early is not None
    assert torch.cuda.memory_reserved() <= early * 1.1


class _Ops(TorchDispatchMode):
    def __init__(self):
        super().__init__()
        self.names: list[str] = []

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        self.names.append(func.overloadpacket.__name__)
        return func(*args, **(kwargs or {}))


def test_the_padding_runs_on_the_meta_device_what_it_runs_on_a_gpu():
    """tests/test_sync.py counts the nvjpeg loader's device side on the meta device, so the padding must run there
    the ops it runs on CUDA. It ran torch's nested ``to_padded_tensor`` on CPU and CUDA (which copies the nested sizes
    to the device from pageable memory: a host sync each batch, seen on an H100) and plain zeros on the meta device,
    so the count never saw it. Now one path on every device, from the sides and starts the caller sends."""
    shapes = np.array([(5, 7), (9, 4), (6, 6)])
    sides, starts = gpu_crop.pad_arguments(shapes)
    ops = {}
    for device in ("cpu", "meta"):
        images = [torch.zeros(3, h, w, dtype=torch.uint8, device=device) for h, w in shapes]
        args = [torch.from_numpy(a).to(device) for a in (sides, starts)]  # sent by the caller, in its pinned pack
        with _Ops() as seen:
            out = gpu_crop.padded(images, shapes, (10, 8), *args)
        assert out.shape == (3, 3, 10, 8) and out.dtype == torch.float32
        ops[device] = seen.names
    assert ops["cpu"] == ops["meta"] and not any("nested" in op or "padded" in op for op in ops["cpu"])


class _RecordingNvjpegLoader(_CpuNvjpegLoader):
    """The CPU nvjpeg loader with torchvision's real CPU decode, noting the thread of each decode call."""

    def decoder(self):
        self.decoded_on: list[int] = []

        def decode(data):
            self.decoded_on.append(threading.get_ident())
            return _cpu_decode(data)

        return decode


def _recording(folder, **kw) -> _RecordingNvjpegLoader:
    args = dict(batch_size=4, num_workers=1, image_size=24, normalize=False, device="cpu", seed=1, **kw)
    return _RecordingNvjpegLoader(gpupipe.build_loader(folder, "pillow", **args).parts)


def test_the_decode_runs_off_the_training_thread(folder):
    """torchvision's nvJPEG decode runs its Huffman pass on the calling thread (21 ms a 256-batch on an H100's host):
    called from ``next()``, it was the training thread's. The decode runs on the loader's decode thread, the batches
    are what decoding on the training thread gives (the same calls, in turn, ``_batch``), and the thread ends when
    told (it holds the next epoch's first batch, decoded)."""
    loader = _recording(folder)
    got = list(loader)
    assert len(got) == len(loader) and loader.decoded_on
    assert threading.get_ident() not in loader.decoded_on
    loader._ahead.join(timeout=10)
    assert not loader._ahead._thread.is_alive()
    reference = _recording(folder)
    data = reference._data
    for (x, y), keys in zip(got, reference.sampler, strict=True):
        work = data.remake(keys)
        batch = reference._batch(0, work, reference.decoder())
        assert torch.equal(x, batch.images) and torch.equal(y, batch.labels)


class _BatchRecordingNvjpegLoader(_CpuNvjpegLoader):
    """The CPU nvjpeg loader noting the epoch and samples of each batch it decodes, and the thread that did."""

    def _decoded(self, work, decode):
        self.decoded.append((work.epoch, tuple(work.indices)))
        self.decoded_on[self.decoded[-1]] = threading.current_thread()
        return super()._decoded(work, decode)


def _decoded_once(loader, batch: tuple) -> bool:
    """Whether the loader's thread decoded ``batch`` (waiting up to 10 s for it)."""
    deadline = time.monotonic() + 10
    while batch not in loader.decoded and time.monotonic() < deadline:
        time.sleep(0.01)
    return loader.decoded.count(batch) == 1


@pytest.mark.parametrize("left", [0, 1, _LEFT_OVER])
def test_the_next_epochs_first_batch_is_decoded_while_this_pass_ends(folder, left):
    """The decode thread runs on past a pass's last batch into the next epoch's first one (its workers read it ahead),
    also after a pass left ``left`` batches short (an accumulation's remainder): the next pass starts with it decoded,
    no decode of its own, and its batches are a fresh loader's. Left ``_LEFT_OVER`` short, the thread holds two
    batches made (one waiting, one in hand) and makes the next epoch's first once the next pass takes them over: that
    pass still goes on from them, its first batch decoded once."""
    args = dict(batch_size=4, num_workers=1, image_size=24, normalize=False, device="cpu", seed=1)
    loader = _BatchRecordingNvjpegLoader(gpupipe.build_loader(folder, "pillow", **args).parts)
    loader.decoded, loader.decoded_on = [], {}
    count = len(loader)
    first = iter(loader)
    for _ in range(count - left):
        next(first)
    batches = [(1, tuple(b)) for b in loader.sampler.batches(1)]
    if left < _LEFT_OVER:
        assert _decoded_once(loader, batches[0])  # before epoch 1's pass began
    loader.set_epoch(1)
    got = list(loader)
    assert all(loader.decoded.count(b) == 1 for b in batches)  # its first not decoded again
    assert loader.decoded_on[batches[0]] is not loader.decoded_on[batches[1]]  # but by the last pass's thread
    fresh = _recording(folder)
    fresh.set_epoch(1)
    want = list(fresh)
    assert len(got) == len(want) == count
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want, strict=True))


@pytest.mark.parametrize("where", ["left beyond the limit", "resumed mid-epoch"])
def test_a_pass_that_does_not_go_on_drops_what_was_decoded_ahead(folder, where):
    """A pass left more than ``_LEFT_OVER`` batches short: the next one does not wait for the decode thread to make
    them (it is stopped: the epoch's last batch is never decoded) and decodes its own first batch. A pass resumed at
    batch 2 drops the first batch decoded ahead for its epoch. Either way its batches are a fresh loader's: a batch
    decoded ahead (its bytes given back) is never handed to a pass it does not lead."""
    args = dict(batch_size=4, num_workers=1, image_size=24, normalize=False, device="cpu", seed=1)
    loader = _BatchRecordingNvjpegLoader(gpupipe.build_loader(folder, "pillow", **args).parts)
    loader.decoded, loader.decoded_on = [], {}
    count, start = len(loader), 0 if where == "left beyond the limit" else 2
    last, upcoming = (0, tuple(loader.sampler.batches(0)[-1])), (1, tuple(loader.sampler.batches(1)[0]))
    first = iter(loader)
    for _ in range(count - (_LEFT_OVER + 1 if start == 0 else 0)):
        next(first)
    if start:
        assert _decoded_once(loader, upcoming)  # decoded ahead of its pass
    loader.load_state_dict(loader.position_at(1, start))
    got = list(loader)
    if not start:
        assert last not in loader.decoded and loader.decoded.count(upcoming) == 1
    fresh = _recording(folder)
    fresh.load_state_dict(fresh.position_at(1, start))
    want = list(fresh)
    assert len(got) == len(want) == count - start
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want, strict=True))


def test_a_pass_left_early_then_the_next_epoch_whole(folder):
    """A pass left after one batch stops its decode thread; the next pass (the same persistent workers) starts where
    the position says, as a fresh loader's."""
    loader = _recording(folder, persistent_workers=True)
    next(iter(loader))
    loader.set_epoch(1)
    got = list(loader)
    fresh = _recording(folder)
    fresh.set_epoch(1)
    want = list(fresh)
    assert len(got) == len(want)
    assert all(torch.equal(a[0], b[0]) and torch.equal(a[1], b[1]) for a, b in zip(got, want, strict=True))


@pytest.mark.slow
def test_a_pass_left_early_and_closed_late_leaves_the_next_pass_alone(folder):
    """The first pass's iterator is closed (garbage) only after the next pass began: closing it ends its own decode
    thread, not the next pass's, which would then wait for ever."""
    loader = _recording(folder)
    first = iter(loader)
    next(first)
    loader.set_epoch(1)
    second = iter(loader)
    got = [next(second)]
    del first  # garbage: its generators closed, its decode thread told to stop
    gc.collect()
    got += list(second)
    assert len(got) == len(loader)


def test_an_error_in_the_decode_thread_reaches_the_caller(folder):
    loader = _recording(folder)

    def broken(data):
        raise MemoryError("the decode thread's own error")

    loader._decode = broken
    with pytest.raises(MemoryError, match="the decode thread's own error"):
        next(iter(loader))


def test_the_workers_run_nicer_than_the_training_process_and_send_batches_by_name(folder, tmp_path):
    """nvjpeg's batches always go to a GPU, which the training thread only launches work on: its workers begin as the
    CPU backends' do for a GPU (``worker_init``), below the training thread, sending batches by name."""
    log = tmp_path / "nice.log"
    args = dict(batch_size=4, image_size=24, num_workers=2, device="cpu")
    loader = _CpuNvjpegLoader(gpupipe.build_loader(folder, "pillow", **args).parts)  # its device side on the CPU
    loader._data.dataset = _Logged(loader._data.dataset, log)
    list(loader)
    seen = {tuple(line.split()) for line in log.read_text().splitlines()}
    assert str(os.getpid()) not in {pid for pid, _, _ in seen}  # read in the workers
    nice = min(19, os.getpriority(os.PRIO_PROCESS, 0) + WORKER_NICENESS)
    assert {(int(n), strategy) for _, n, strategy in seen} == {(nice, "file_system")}


def test_pixels_are_uploaded_and_cropped_by_the_batched_crop(monkeypatch):
    """A dataset of HWC arrays (one shape, and several) on nvjpeg: the feed crops none on the CPU; the device side
    takes them as they are, with the recipe's boxes: Pillow's samples and labels, train and eval, every crop."""
    from gpupipe.backends import gpu_feed

    def refused(*args, **kw):
        raise AssertionError("the feed cropped pixels on the CPU")

    monkeypatch.setattr(gpu_feed, "crop_resize", refused)
    rng = np.random.default_rng(6)
    same = (torch.from_numpy(np.stack([np.asarray(photo(rng, 32, 32)) for _ in range(8)])), np.arange(8) % 3)
    mixed = [(np.asarray(photo(rng, 32 + 4 * (i % 3), 40 - 4 * (i % 2))), i % 3) for i in range(8)]
    recipes = [dict(image_size=24), dict(recipe=Recipe(32, crop="pad", padding=4, padding_mode="reflect"))]
    for source, extra, workers in ((same, recipes[0], 1), (mixed, recipes[0], 0), (mixed, recipes[1], 1)):
        for train in (True, False):
            kw = dict(batch_size=4, train=train, device="cpu", num_workers=workers, normalize=False, seed=5, **extra)
            ours = _CpuNvjpegLoader(gpupipe.build_loader(source, "pillow", **kw).parts)
            got, want = list(ours), list(gpupipe.build_loader(source, "pillow", **kw))
            assert len(got) == len(want) > 0 and ours.fallbacks == 0
            for (x, y), (rx, ry) in zip(got, want, strict=True):
                assert torch.equal(y, ry) and (x.float() - rx.float()).abs().mean(dim=(1, 2, 3)).max() < 1.5
