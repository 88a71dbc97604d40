"""A map-style dataset a user holds (a torchvision or Hugging Face dataset, their own class, ``(images, labels)``
arrays) as the :class:`~gpupipe.sources.scan.ImageList` every backend reads: its items' images as encoded bytes (for
the backend's decoder) or, already pixels, as (H, W, 3) uint8 RGB arrays that no backend decodes or re-encodes."""

from __future__ import annotations

import io
import multiprocessing
import os
import pickle
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch
from PIL import Image

from .._files import read_regular
from ..errors import DecodeError, SourceError
from ..image import orientation_to_apply, to_rgb, upright
from .compact import SampleList
from .scan import ImageList, read_each

IMAGE_FIELDS = ("image", "img", "jpg", "jpeg", "png", "webp")  # Hugging Face and WebDataset names, in that order
LABEL_FIELDS = ("label", "cls", "labels", "target")
_FORMAT = "the items must be (image, label) pairs or mappings with an image and a label field"


@dataclass(frozen=True)
class DatasetSource:
    """A map-style dataset whose items are mappings with fields other than the usual names: ``image`` and ``label``
    name them (``build_loader(DatasetSource(ds, image="pixels", label="fine_label"))``). Either left ``None`` is
    looked up among :data:`IMAGE_FIELDS` / :data:`LABEL_FIELDS`."""

    dataset: Any
    image: str | int | None = None
    label: str | int | None = None


def is_dataset(root: object) -> bool:
    """Whether ``root`` is a dataset object (``__len__`` and ``__getitem__``) or ``(images, labels)`` arrays rather
    than a path, a URL or a list of them."""
    if isinstance(root, DatasetSource) or is_arrays(root):
        return True
    if isinstance(root, (list, tuple)):  # of items, not of paths
        return len(root) > 0 and not isinstance(root[0], (str, os.PathLike))
    if isinstance(root, (str, bytes)) or not hasattr(root, "__getitem__"):
        return False
    return hasattr(root, "__len__")


def is_arrays(root: object) -> bool:
    """``(images, labels)``: an (N, H, W, C) array or tensor (or (N, H, W): grey, as MNIST's) and N labels."""
    if not (isinstance(root, tuple) and len(root) == 2 and isinstance(root[0], (np.ndarray, torch.Tensor))):
        return False
    images, labels = root
    return images.ndim == 4 or (images.ndim == 3 and hasattr(labels, "__len__") and len(labels) == len(images))


class _Arrays:
    """``(images, labels)`` as a dataset of ``(image, label)`` items."""

    def __init__(self, images, labels, name: str = "arrays"):
        shape = tuple(np.shape(labels))
        if len(shape) == 2 and shape[1] == 1:  # a column of labels, as Keras's CIFAR-10 gives them: (N, 1)
            labels = labels[:, 0]
        elif len(shape) != 1:
            raise SourceError(f"{name}: labels of shape {shape}: one class index per image, of shape (N,) or (N, 1)")
        if len(images) != len(labels):
            raise SourceError(f"{name}: {len(images)} images but {len(labels)} labels")
        self.images, self.targets = images, _class_indices(labels, name)

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int):
        return self.images[i], self.targets[i]


def _class_indices(labels, name: str) -> list[int]:
    """The labels as ints; a float one must be a whole number (``1.0``, as a float tensor holds them), never cut
    (``0.5`` was read as 0)."""
    values = np.asarray(labels.cpu() if isinstance(labels, torch.Tensor) else labels)
    if values.dtype.kind in "fc":
        whole = np.isfinite(values) & (values == np.round(values.real))
        if not whole.all():
            i = int(np.flatnonzero(~whole)[0])
            raise SourceError(
                f"{name}: label {values[i].item()!r} (item {i}) is not a class index: labels are whole numbers 0..n-1"
            )
        values = values.real
    return [int(v) for v in values]


class ItemNames(SampleList):
    """``(name, label)`` per item: ``prefix[i]`` with the labels in one array."""

    def __init__(self, labels: Sequence[int], prefix: str = "dataset"):
        self.labels, self.prefix = np.asarray(labels, dtype=np.int64).reshape(-1), prefix

    def name(self, i: int) -> str:
        return f"{self.prefix}[{i}]"


class DatasetImageList(ImageList):
    """A dataset's items: labels read once when the list is made (from ``targets`` where the dataset has them, as
    torchvision's do), images on each read, in the process that reads (a DataLoader worker)."""

    reads_files = False

    def __init__(self, source: DatasetSource, name: str = "dataset"):
        data = source.dataset
        if len(data) == 0:
            raise SourceError(f"{name}: the dataset is empty")
        self.image_key, self.label_key = _fields(data, source, name)
        self.data = data = _undecoded(data, self.image_key)
        labels = _labels(data, self.label_key, name)
        classes = _classes(data, labels, self.label_key)
        class_to_idx = getattr(data, "class_to_idx", None) or {c: i for i, c in enumerate(classes)}
        super().__init__(name, ItemNames(labels, name), classes, dict(class_to_idx))
        self._pixels = self._first_is_pixels()

    def holds_pixels(self) -> bool:
        return self._pixels

    def _first_is_pixels(self) -> bool:
        """Whether the first item's image is pixels, which stands for the dataset's (a dataset mixing pixels and
        encoded bytes is rare: each backend still reads every item of either kind)."""
        try:
            return isinstance(self.item_image(0), np.ndarray)
        except DecodeError:
            return False

    def read(self, index: int) -> bytes:
        """The item's image as encoded bytes: as held, or PNG-encoded (lossless) when it is pixels."""
        image = self.item_image(index)
        if isinstance(image, bytes):
            return image
        out = io.BytesIO()
        Image.fromarray(image).save(out, "PNG", compress_level=1)
        return out.getvalue()

    def read_samples(self, indices: Sequence[int]) -> list[bytes | np.ndarray | Exception]:
        return read_each(self.item_image, indices)

    def item_image(self, index: int) -> bytes | np.ndarray:
        """Item ``index``'s image: encoded bytes, or (H, W, 3) uint8 RGB; a :class:`DecodeError` naming the item."""
        name = self.samples.name(index) if isinstance(self.samples, SampleList) else str(index)
        try:
            item = self.data[index]
            return as_image(_field(item, self.image_key))
        except DecodeError as e:
            raise DecodeError(name, "dataset", e.reason) from None
        except Exception as e:  # the user's __getitem__, or an image that is no image
            raise DecodeError(name, "dataset", f"{type(e).__name__}: {e}") from None


def as_image(image: object) -> bytes | np.ndarray:
    """An item's image as a backend takes it: encoded bytes as they are (a Hugging Face ``{bytes, path}`` struct's
    bytes, or its file), else (H, W, 3) uint8 RGB pixels: grey, palette and RGBA made RGB as for files."""
    if isinstance(image, (bytes, bytearray, memoryview)):
        return bytes(image)
    if isinstance(image, Mapping) and "bytes" in image:  # Hugging Face Image(decode=False)
        if image["bytes"] is not None:
            return bytes(image["bytes"])
        if image.get("path"):
            return read_regular(image["path"])
        raise DecodeError("", "dataset", "the image struct holds neither bytes nor a path")
    if isinstance(image, Image.Image):
        image.load()
        return np.asarray(upright(to_rgb(image), orientation_to_apply(image)))
    if isinstance(image, torch.Tensor):
        image = _hwc(image)
    if isinstance(image, np.ndarray):
        return _rgb_array(image)
    raise DecodeError(
        "", "dataset", f"expected encoded bytes, a PIL image or a uint8 array, got {type(image).__name__}"
    )


def _hwc(image: torch.Tensor) -> np.ndarray:
    """A tensor as an (H, W[, C]) array: CHW (torchvision's layout) when its first dimension is 1, 3 or 4 and its
    last is not, else HWC."""
    t = image.detach().cpu()
    if t.ndim == 3 and t.shape[0] in (1, 3, 4) and t.shape[-1] not in (1, 3, 4):
        t = t.permute(1, 2, 0)
    return t.numpy()


def _rgb_array(arr: np.ndarray) -> np.ndarray:
    if arr.dtype != np.uint8:
        raise DecodeError("", "dataset", f"the image is a {arr.dtype} array; expected uint8 (0..255)")
    if arr.ndim == 3 and arr.shape[2] == 1:
        arr = arr[:, :, 0]
    if arr.ndim not in (2, 3) or (arr.ndim == 3 and arr.shape[2] not in (2, 3, 4)) or 0 in arr.shape:
        raise DecodeError("", "dataset", f"the image array's shape {arr.shape} is not (H, W) or (H, W, 1 to 4)")
    if arr.ndim == 3 and arr.shape[2] == 3:
        return np.ascontiguousarray(arr)
    return np.asarray(to_rgb(Image.fromarray(np.ascontiguousarray(arr))))  # L, LA, RGBA: as a file of that mode


def _field(item: object, key: str | int) -> Any:
    if isinstance(item, Mapping):
        return item[key]
    if isinstance(item, (tuple, list)):
        return item[int(key)]
    raise TypeError(f"the item is a {type(item).__name__}; {_FORMAT}")


def _fields(data, source: DatasetSource, name: str) -> tuple[str | int, str | int]:
    """The image and label fields: named by ``source``, else positions 0 and 1 of a pair, else the usual names."""
    first = data[0]
    if isinstance(first, (tuple, list)) and len(first) >= 2 and source.image is None and source.label is None:
        return 0, 1
    if not isinstance(first, Mapping):
        raise SourceError(f"{name}[0] is a {type(first).__name__}; {_FORMAT}")
    image = source.image if source.image is not None else _usual(first, IMAGE_FIELDS)
    label = source.label if source.label is not None else _usual(first, LABEL_FIELDS)
    for kind, key in (("image", image), ("label", label)):
        if key is None or key not in first:
            raise SourceError(
                f"{name}[0] has fields {', '.join(map(str, first))} and no {kind} field"
                + (f" named {key!r}" if key is not None else "")
                + "; name it: gpupipe.DatasetSource(dataset, image=..., label=...)"
            )
    assert image is not None and label is not None  # by the loop
    return image, label


def _usual(item: Mapping, names: tuple[str, ...]) -> str | None:
    return next((n for n in names if n in item), None)


def _labels(data, key: str | int, name: str) -> list[int]:
    """Every item's label: the dataset's ``targets`` (torchvision's), a Hugging Face column, else each item's."""
    targets = getattr(data, "targets", None)
    if targets is None and isinstance(key, str) and hasattr(data, "column_names") and key in data.column_names:
        targets = data[key]  # a Hugging Face dataset: the column alone, no image decoded
    if targets is None or len(targets) != len(data):
        targets = [_item_label(data, i, key, name) for i in range(len(data))]
    labels = []
    for i, t in enumerate(targets):
        value = t.item() if isinstance(t, (torch.Tensor, np.generic, np.ndarray)) else t
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 0:
            raise SourceError(f"{name}[{i}]: label {value!r} is not a class index (a whole number >= 0)")
        labels.append(int(value))
    return labels


def _item_label(data, i: int, key: str | int, name: str) -> Any:
    """Item ``i``'s label, read from the item (a dataset without ``targets``)."""
    try:
        return _field(data[i], key)
    except Exception as e:
        raise SourceError(f"{name}[{i}]: cannot read its label ({type(e).__name__}: {e})") from None


def _undecoded(data, image_key: str | int):
    """A Hugging Face dataset whose image column ``datasets`` decodes (to PIL images, in Python) as one whose items
    hold the encoded ``{bytes, path}``, for the backend's decoder; any other dataset as it is."""
    feature = _feature(data, image_key)
    if type(feature).__name__ != "Image" or not getattr(feature, "decode", False) or not hasattr(data, "cast_column"):
        return data
    import datasets  # deferred: only a Hugging Face dataset gets here

    return data.cast_column(image_key, datasets.Image(decode=False))


def _feature(data, key: str | int) -> Any:
    """A Hugging Face dataset's feature ``key`` (``Image``, ``ClassLabel``...), else None."""
    features = getattr(data, "features", None)
    return features.get(key) if isinstance(features, Mapping) else None


def _classes(data, labels: list[int], label_key: str | int) -> list[str]:
    """The dataset's class names (``classes``, torchvision's; a Hugging Face ``ClassLabel``'s names) when they cover
    its labels, else ``"0"``..``"n-1"``."""
    count = max(labels) + 1
    names = getattr(data, "classes", None) or getattr(_feature(data, label_key), "names", None)
    if isinstance(names, Sequence) and not isinstance(names, str) and len(names) >= count:
        return [str(c) for c in names]
    return [str(i) for i in range(count)]


def open_dataset(root: object) -> DatasetImageList:
    """``root`` (a dataset, a :class:`DatasetSource` or ``(images, labels)`` arrays) as the list a loader reads."""
    if is_arrays(root):
        assert isinstance(root, tuple)  # by is_arrays
        return DatasetImageList(DatasetSource(_Arrays(*root)), "arrays")
    source = root if isinstance(root, DatasetSource) else DatasetSource(root)
    return DatasetImageList(source)


def check_sendable(dataset: ImageList, workers: int) -> None:
    """A dataset object that worker processes would receive pickled (a start method other than fork) and that
    cannot be pickled (an open handle, a lambda): refused up front, in one line with the fix."""
    if not isinstance(dataset, DatasetImageList) or workers == 0:
        return
    if multiprocessing.get_context().get_start_method() == "fork":
        return  # forked workers inherit it
    try:
        pickle.dumps(dataset.data)
    except Exception as e:
        raise SourceError(
            f"{dataset.root}: the dataset cannot be sent to worker processes ({type(e).__name__}: {e}); make it "
            "picklable, or pass num_workers=0 to read it in the main process"
        ) from None
