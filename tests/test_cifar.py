"""gpupipe/bench/cifar.py: CIFAR-10-format data made from photo-like images, read back by torchvision's CIFAR10."""

import pickle

import numpy as np
import pytest
from PIL import Image
from torchvision.datasets import CIFAR10

from gpupipe.bench.cifar import BASE, CLASSES, CIFAR10Files, cifar10, make_cifar10


@pytest.fixture(scope="module")
def root(tmp_path_factory):
    """50 train images (five files of 10) and 10 test images."""
    return make_cifar10(tmp_path_factory.mktemp("cifar"), 50, seed=3)


def test_torchvision_reads_every_file_in_cifar10s_layout(root):
    train, test = CIFAR10Files(root, train=True), CIFAR10Files(root, train=False)
    assert len(train) == 50 and len(test) == 10
    assert train.classes == CLASSES and train.class_to_idx["truck"] == 9
    assert np.bincount(train.targets).tolist() == [5] * 10  # balanced over the classes
    image, label = train[7]
    assert isinstance(image, Image.Image) and image.mode == "RGB" and image.size == (32, 32)
    assert label == train.targets[7]
    with open(root / BASE / "data_batch_1", "rb") as f:  # as torchvision reads it: planes of R, G, B per row
        entry = pickle.load(f, encoding="latin1")
    assert entry["data"].shape == (10, 3072) and entry["data"].dtype == np.uint8
    assert np.array_equal(np.asarray(image), entry["data"][7].reshape(3, 32, 32).transpose(1, 2, 0))


def test_the_images_are_photo_like_not_flat(root):
    data = CIFAR10Files(root, train=True).data.astype(np.float32)
    assert data.std(axis=(1, 2)).min() > 5  # each image varies within itself
    assert np.abs(np.diff(data, axis=1)).mean() > 1  # neighbouring pixels differ (edges, stripes, noise)


def test_the_made_set_is_told_from_the_downloaded_one(root, tmp_path):
    with pytest.raises(RuntimeError, match="corrupted"):  # torchvision's class checks the downloaded files' digests
        CIFAR10(root)
    assert type(cifar10(root, train=False)) is CIFAR10Files
    with pytest.raises(RuntimeError, match="not found"):  # elsewhere, torchvision's own class and message
        cifar10(tmp_path)


def test_the_same_seed_makes_the_same_set(root, tmp_path):
    again = make_cifar10(tmp_path, 50, seed=3)
    for name in ("data_batch_3", "test_batch", "batches.meta"):
        assert (again / BASE / name).read_bytes() == (root / BASE / name).read_bytes()
    with pytest.raises(ValueError, match="at least 5"):
        make_cifar10(tmp_path, 4)
