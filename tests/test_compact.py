"""sources/compact.py: folder and CSV sample lists held in one buffer and two arrays, equal to torchvision's lists."""

import gc

import pytest
from torchvision.datasets import ImageFolder
from torchvision.datasets.folder import IMG_EXTENSIONS, make_dataset

from gpupipe.sources.compact import PathList
from gpupipe.sources.walk import walk_folder

from .common_utils import jpeg_bytes, photo


def test_walk_folder_is_make_dataset(tmp_path):
    """The order of ``sorted(os.walk())``, where a depth-first walk would differ ("b c" sorts before "b/x")."""
    import numpy as np

    img = jpeg_bytes(photo(np.random.default_rng(0), 8, 8))
    for rel in ["a/1.jpg", "a/b/x/2.JPG", "a/b c/3.png", "a/b/4.jpeg", "a/é ü.jpg", "a/skip.txt", "z/5.jpg"]:
        (tmp_path / rel).parent.mkdir(parents=True, exist_ok=True)
        (tmp_path / rel).write_bytes(img)
    classes = {"a": 0, "z": 1}
    ours = PathList(*zip(*walk_folder(str(tmp_path)).samples, strict=True))
    assert ours == make_dataset(str(tmp_path), classes, IMG_EXTENSIONS) == ImageFolder(str(tmp_path)).samples
    assert ours[1:3] == list(ImageFolder(str(tmp_path)).samples[1:3]) and ours[-1] == (str(tmp_path / "z/5.jpg"), 1)
    (tmp_path / "y").mkdir()
    with pytest.raises(FileNotFoundError, match="no image file in 1 class folder"):
        walk_folder(str(tmp_path))


def test_a_path_list_holds_no_object_per_sample():
    paths = [f"/data/train/n{i % 1000:08d}/img_{i:07d}.JPEG" for i in range(100_000)]
    gc.collect()
    before = len(gc.get_objects())
    samples = PathList(paths, [i % 1000 for i in range(100_000)])
    del paths
    gc.collect()
    assert len(gc.get_objects()) - before < 50
    assert samples[12345] == ("/data/train/n00000345/img_0012345.JPEG", 345) and len(samples) == 100_000
    with pytest.raises(IndexError):
        samples[100_000]
    assert PathList([], []) == [] and list(PathList(["\udcff-raw"], [0])) == [("\udcff-raw", 0)]
