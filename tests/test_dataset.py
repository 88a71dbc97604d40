"""gpupipe/sources/dataset.py: a dataset object and ``(images, labels)`` arrays read by every backend as the same
images written as an ImageFolder: the same samples, labels, crops and order, resumed mid-epoch and on a rank; a bad
item named; grey, palette and RGBA images made RGB as files are."""

import hashlib
import io
import pickle
import types

import numpy as np
import pytest
import torch
import torchvision
from PIL import Image

import gpupipe
from gpupipe.errors import DecodeError, SourceError
from gpupipe.sources.dataset import DatasetSource, check_sendable, open_dataset
from gpupipe.sources.open import open_source

from .common_utils import encoded, on_two_gloo_ranks, photo
from .test_nvjpeg import _CpuNvjpegLoader

BACKENDS = [
    "pillow",
    pytest.param("pillow-simd", marks=pytest.mark.skipif("pillow-simd" not in gpupipe.available_backends(), reason="")),
    pytest.param("turbojpeg", marks=pytest.mark.skipif("turbojpeg" not in gpupipe.available_backends(), reason="")),
    pytest.param("dali", marks=pytest.mark.skipif("dali" not in gpupipe.available_backends(), reason="needs DALI")),
    "nvjpeg",
]
MODES = ("RGB", "L", "P", "RGBA", "RGB", "LA", "RGB", "RGB", "L")  # as the images are held, and as files


@pytest.fixture(scope="module")
def images():
    """Nine images of several sizes and colour modes, three classes."""
    rng = np.random.default_rng(5)
    out = []
    for i, mode in enumerate(MODES):
        img = photo(rng, 30 + 7 * i, 48 - 3 * i)
        if mode == "P":
            img = img.quantize(64)
        elif mode != "RGB":
            img = img.convert(mode)
        out.append((img, i % 3))
    return out


@pytest.fixture(scope="module")
def folder(tmp_path_factory, images):
    """The images as PNG files in an ImageFolder, named so that its order is the list's."""
    root = tmp_path_factory.mktemp("folder")
    for i, (img, label) in enumerate(images):
        (root / f"c{label}").mkdir(exist_ok=True)
        img.save(root / f"c{label}" / f"{i}.png")
    return root


def _in_folder_order(folder, items):
    """``items`` (one per image, in the list's order) in the folder's sample order, which the loaders compare."""
    names = [int(p.rsplit("/", 1)[1].split(".")[0]) for p, _ in open_source(folder).samples]
    return [items[i] for i in names]


def _as_held(images, kind):
    """The images as a dataset holds them: PIL images, encoded bytes, HWC arrays, CHW tensors, in mappings."""
    if kind == "pil":
        return list(images)
    if kind == "bytes":
        return [(encoded(img, "PNG"), label) for img, label in images]
    if kind == "hwc":  # grey as (H, W), palette as what Pillow makes of it, alpha kept: made RGB by the loader
        return [{"img": np.asarray(img if img.mode != "P" else img.convert("RGB")), "label": lb} for img, lb in images]
    # CHW tensors: RGB and grey (1, H, W) only (a CHW alpha channel is not a layout datasets use)
    return [
        {
            "image": torch.from_numpy(np.asarray(img.convert("RGB" if img.mode != "L" else "L")))
            .reshape(img.height, img.width, -1)
            .permute(2, 0, 1),
            "label": lb,
        }
        for img, lb in images
    ]


def _batches(source, backend, **kw):
    args = dict(batch_size=4, image_size=24, device="cpu", num_workers=0, normalize=False, seed=7) | kw
    if backend == "nvjpeg":  # its device side on the CPU (tests/test_nvjpeg.py)
        return _CpuNvjpegLoader(gpupipe.build_loader(source, "pillow", **args).parts)
    return gpupipe.build_loader(source, backend, **args)


def _same(ours, reference, exact: bool):
    ours, reference = list(ours), list(reference)
    assert len(ours) == len(reference) > 0
    for (x, y), (rx, ry) in zip(ours, reference, strict=True):
        assert torch.equal(y, ry) and x.shape == rx.shape
        diff = (x.float() - rx.float()).abs()
        assert diff.max() == 0 if exact else diff.mean() < 1.0, float(diff.mean())


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("kind", ["pil", "bytes", "hwc", "chw"])
def test_a_dataset_reads_as_the_same_images_in_a_folder(images, folder, backend, kind):
    """Every kind of item on every backend: the folder's labels, order and crops (train and eval); on Pillow the
    pixels exactly, else within resampling's usual difference. Items that are pixels are cropped as they are, never
    encoded for a decoder (which would count PNGs that turbojpeg and nvJPEG leave to Pillow as fallbacks)."""
    data = _in_folder_order(folder, _as_held(images, kind))
    exact = backend == "pillow"  # nvjpeg: the folder's PNGs cropped by Pillow, the pixels by its batched crop
    for train in (True, False):
        loader = _batches(data, backend, train=train)
        _same(loader, _batches(folder, backend, train=train), exact)
        assert loader.fallbacks == 0 or (kind == "bytes" and backend in ("turbojpeg", "nvjpeg"))


def test_arrays_read_as_the_folder_of_the_same_images(tmp_path):
    rng = np.random.default_rng(1)
    arrays = rng.integers(0, 256, (6, 20, 28, 3), dtype=np.uint8), np.array([0, 1, 0, 1, 1, 0])
    for i, (a, label) in enumerate(zip(*arrays, strict=True)):
        (tmp_path / f"c{label}").mkdir(exist_ok=True)
        Image.fromarray(a).save(tmp_path / f"c{label}" / f"{i}.png")
    order = [int(p.rsplit("/", 1)[1][:-4]) for p, _ in open_source(tmp_path).samples]
    held = (torch.from_numpy(arrays[0][order]), arrays[1][order])  # a tensor of images, labels as an array
    for train in (True, False):
        _same(_batches(held, "pillow", train=train), _batches(tmp_path, "pillow", train=train), exact=True)
    assert open_dataset(held).samples[2] == ("arrays[2]", int(arrays[1][order][2]))


def test_grey_arrays_read_as_the_folder_of_the_same_images(tmp_path):
    """(N, H, W) images, as MNIST's: taken for a two-item dataset ("dataset[0] is a ndarray; the items must be
    (image, label) pairs")."""
    rng = np.random.default_rng(2)
    images, labels = rng.integers(0, 256, (6, 20, 28), dtype=np.uint8), np.array([0, 1, 0, 1, 1, 0])
    for i, (a, label) in enumerate(zip(images, labels, strict=True)):
        (tmp_path / f"c{label}").mkdir(exist_ok=True)
        Image.fromarray(a).save(tmp_path / f"c{label}" / f"{i}.png")
    order = [int(p.rsplit("/", 1)[1][:-4]) for p, _ in open_source(tmp_path).samples]
    for held in ((images[order], labels[order]), (torch.from_numpy(images[order]), torch.from_numpy(labels[order]))):
        for train in (True, False):
            _same(_batches(held, "pillow", train=train), _batches(tmp_path, "pillow", train=train), exact=True)


def test_labels_in_a_column_read_as_a_vector_and_other_shapes_are_named():
    """Keras's CIFAR-10 labels are (N, 1): they were a raw ``TypeError: only 0-dimensional arrays can be converted to
    Python scalars``."""
    images = np.zeros((4, 8, 8, 3), np.uint8)
    for labels in (np.array([[0], [1], [0], [1]]), torch.tensor([[0], [1], [0], [1]])):
        assert [label for _, label in open_dataset((images, labels)).samples] == [0, 1, 0, 1]
    with pytest.raises(SourceError, match=r"arrays: labels of shape \(4, 2\): one class index per image"):
        open_dataset((images, np.zeros((4, 2), np.int64)))


def test_float_labels_are_class_indices_when_whole_and_an_error_naming_the_item_when_not():
    """``(images, np.arange(10) * 0.5)`` was read as labels 0, 0, 1, 1, ...: each float cut to an int."""
    images = np.zeros((4, 8, 8, 3), np.uint8)
    for labels in (np.array([0.0, 1.0, 2.0, 1.0]), torch.tensor([0.0, 1.0, 2.0, 1.0])):
        assert [label for _, label in open_dataset((images, labels)).samples] == [0, 1, 2, 1]
    for bad, shown in ((0.5, "0.5"), (float("nan"), "nan")):
        with pytest.raises(SourceError, match=rf"arrays: label {shown} \(item 2\) is not a class index"):
            open_dataset((images, np.array([0.0, 1.0, bad, 1.0])))


def test_a_dataset_resumes_mid_epoch_and_reads_its_rank_as_the_folder(images, folder):
    data = _in_folder_order(folder, _as_held(images, "pil"))
    kw = dict(batch_size=2, train=True, drop_last=False)
    loader = _batches(data, "pillow", **kw)
    loader.set_epoch(1)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    rest = list(it)
    resumed = _batches(data, "pillow", **kw)
    resumed.load_state_dict(state)
    _same(resumed, rest, exact=True)
    for rank in (0, 1):
        _same(
            _batches(data, "pillow", rank=rank, world_size=2), _batches(folder, "pillow", rank=rank, world_size=2), True
        )


class _Broken:
    """A dataset whose item 3 is no image and item 5's ``__getitem__`` raises; its labels held apart, as
    torchvision's ``targets``."""

    def __init__(self, items):
        self.items = items
        self.targets = [label for _, label in items]

    def __len__(self):
        return len(self.items)

    def __getitem__(self, i):
        if i == 5:
            raise KeyError("no such record")
        return (b"not an image", 1) if i == 3 else self.items[i]


@pytest.mark.parametrize("backend", ["pillow", "nvjpeg"])
def test_a_bad_item_is_named_and_skipped(images, backend):
    data = _Broken(_as_held(images, "bytes"))
    with pytest.raises(DecodeError, match=r"^dataset\[3\]: cannot decode"):
        list(_batches(data, backend, train=False))
    loader = _batches(data, backend, train=False, on_error="skip")
    assert sum(len(y) for _, y in loader) == len(images) - 2
    assert [name for name, _ in loader.skipped] == ["dataset[3]", "dataset[5]"]
    assert "KeyError" in loader.skipped[1][1]
    del data.targets  # the labels read from the items: the one that raises is named up front
    with pytest.raises(ValueError, match=r"^dataset\[5\]: cannot read its label \(KeyError"):
        open_dataset(data)


def _cifar(root, images):
    """torchvision's CIFAR10 reading files written in CIFAR's own format (its checksums those of these files)."""
    base = root / "cifar-10-batches-py"
    base.mkdir(parents=True)
    data = np.stack([np.asarray(img.convert("RGB").resize((32, 32))) for img, _ in images])
    batch = {"data": data.transpose(0, 3, 1, 2).reshape(len(images), -1), "labels": [lb for _, lb in images]}
    files = {"data_batch_1": batch, "test_batch": batch, "batches.meta": {"label_names": ["cat", "dog", "owl"]}}
    md5 = {}
    for name, content in files.items():
        (base / name).write_bytes(pickle.dumps(content))
        md5[name] = hashlib.md5((base / name).read_bytes()).hexdigest()
    attrs = dict(
        train_list=[["data_batch_1", md5["data_batch_1"]]],
        test_list=[["test_batch", md5["test_batch"]]],
        meta={"filename": "batches.meta", "key": "label_names", "md5": md5["batches.meta"]},
    )
    cifar = types.new_class("Cifar", (torchvision.datasets.CIFAR10,), exec_body=lambda ns: ns.update(attrs))
    return cifar(str(root), train=True), data


def test_torchvisions_cifar10_as_it_comes(tmp_path, images):
    cifar, data = _cifar(tmp_path / "cifar", images)
    folder = tmp_path / "folder"  # the same pixels as PNG files, in the dataset's order
    for i, (pixels, (_, label)) in enumerate(zip(data, images, strict=True)):
        (folder / f"c{label}").mkdir(parents=True, exist_ok=True)
        Image.fromarray(pixels).save(folder / f"c{label}" / f"{i}.png")
    order = [int(p.rsplit("/", 1)[1][:-4]) for p, _ in open_source(folder).samples]
    ordered = torch.utils.data.Subset(cifar, order)  # a dataset without targets: labels read from its items
    for train in (True, False):
        _same(_batches(ordered, "pillow", train=train), _batches(folder, "pillow", train=train), exact=True)
    loader = _batches(cifar, "pillow", train=False)
    assert [y for _, y in loader.dataset.samples] == [lb for _, lb in images]
    assert loader.dataset.classes == ["cat", "dog", "owl"]


def test_torchvisions_fake_data_and_mapping_fields_named_by_the_user():
    fake = torchvision.datasets.FakeData(size=5, image_size=(3, 20, 30), num_classes=4)
    x, y = next(iter(_batches(fake, "pillow", train=False, batch_size=5)))
    assert x.shape == (5, 3, 24, 24) and y.tolist() == [fake[i][1] for i in range(5)]
    rows = [{"pixels": np.zeros((8, 8, 3), np.uint8), "fine": i} for i in range(3)]
    with pytest.raises(ValueError, match=r"^dataset\[0\] has fields pixels, fine and no image field; name it"):
        open_dataset(rows)
    assert open_dataset(DatasetSource(rows, image="pixels", label="fine")).targets == [0, 1, 2]


def test_a_dataset_workers_cannot_receive_is_refused_up_front(monkeypatch):
    class Unpicklable(list):
        def __reduce__(self):
            raise TypeError("cannot pickle '_io.BufferedReader' object")

    listed = open_dataset(Unpicklable([(np.zeros((4, 4, 3), np.uint8), 0)]))
    check_sendable(listed, 2)  # forked workers inherit it
    monkeypatch.setattr("multiprocessing.get_context", lambda: types.SimpleNamespace(get_start_method=lambda: "spawn"))
    check_sendable(listed, 0)  # read in the main process
    with pytest.raises(ValueError, match=r"cannot be sent to worker processes .*num_workers=0"):
        check_sendable(listed, 2)


def test_pixels_read_as_bytes_are_lossless_png(images):
    listed = open_dataset(_as_held(images, "hwc"))
    assert np.array_equal(np.asarray(Image.open(io.BytesIO(listed.read(1)))), np.asarray(images[1][0].convert("RGB")))


def test_a_hugging_face_dataset_gives_its_encoded_images_to_the_decoder_and_its_class_names(images, folder):
    datasets = pytest.importorskip("datasets")
    held = _in_folder_order(folder, _as_held(images, "bytes"))
    features = datasets.Features({"image": datasets.Image(), "label": datasets.ClassLabel(names=["a", "b", "c"])})
    cells = [{"bytes": data, "path": None} for data, _ in held]
    hub = datasets.Dataset.from_dict({"image": cells, "label": [lb for _, lb in held]}, features=features)
    listed = open_dataset(hub)
    assert isinstance(listed.read_samples([0])[0], bytes)  # not decoded by `datasets` into a PIL image
    assert listed.classes == ["a", "b", "c"]
    for backend in ("pillow", "nvjpeg"):
        for train in (True, False):
            _same(_batches(hub, backend, train=train), _batches(folder, backend, train=train), exact=True)


def test_two_gloo_ranks_read_a_dataset_as_each_reads_the_folder(images, folder):
    results = on_two_ranks(_in_folder_order(folder, _as_held(images, "pil")))
    for rank, got in results.items():
        _same(got, _batches(folder, "pillow", train=True, rank=rank, world_size=2), exact=True)
    labels = sorted(int(v) for got in results.values() for _, y in got for v in y)
    assert len(labels) == 8  # 9 samples, batches of 4 on 2 ranks: one full batch each (train drops the rest)


def on_two_ranks(data) -> dict:
    """Each of two gloo ranks' train batches of ``data``, the rank and world size taken from torch.distributed:
    rank -> [(images, labels)]."""

    def batches() -> list:  # arrays, pickled whole: a tensor would be sent as a handle its rank may close
        return [(x.numpy(), y.numpy()) for x, y in _batches(data, "pillow", train=True)]

    results = on_two_gloo_ranks(batches)
    return {rank: [(torch.from_numpy(x), torch.from_numpy(y)) for x, y in got] for rank, got in results.items()}


@pytest.mark.parametrize("backend", ["pillow", "turbojpeg", "dali"])
@pytest.mark.parametrize("kind", ["pil", "hwc"])
def test_a_dataset_reads_as_the_folder_with_the_default_two_workers(images, folder, backend, kind):
    """The dataset sent to (forked) DataLoader or feed workers, as a user's default ``num_workers=2`` runs it: the
    folder's samples, labels and order, train and eval."""
    data = _in_folder_order(folder, _as_held(images, kind))
    for train in (True, False):
        loader = _batches(data, backend, train=train, num_workers=2)
        _same(loader, _batches(folder, backend, train=train, num_workers=2), exact=backend == "pillow")
