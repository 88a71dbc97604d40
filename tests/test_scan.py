import pytest
from torchvision.datasets import ImageFolder

from gpupipe.data.scan import scan

from .conftest import photo


def test_samples_equal_torchvision_imagefolder(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    (tmp_path / "b" / "nested" / "deeper").mkdir(parents=True)
    (tmp_path / "a").mkdir()
    (tmp_path / "C").mkdir()
    photo(rng, 20, 20).save(tmp_path / "b" / "nested" / "deeper" / "x.JPG")
    photo(rng, 20, 20).save(tmp_path / "b" / "z.png")
    photo(rng, 20, 20).save(tmp_path / "a" / "y.JpEg", format="JPEG")
    photo(rng, 20, 20).save(tmp_path / "C" / "w.webp")
    (tmp_path / "a" / "notes.txt").write_text("not an image")
    ours, tv = scan(tmp_path), ImageFolder(str(tmp_path))
    assert ours.samples == tv.samples
    assert ours.classes == tv.classes
    assert ours.class_to_idx == tv.class_to_idx


def test_csv_list_and_root_escape(tmp_path, folder):
    import shutil

    shutil.copytree(folder, tmp_path / "imgs")
    lst = tmp_path / "list.csv"
    lst.write_text("path,label\nimgs/c00/000.jpg,cat\nimgs/c01/000.jpg,dog\n")
    data = scan(lst)
    assert data.classes == ["cat", "dog"]
    assert [label for _, label in data.samples] == [0, 1]
    (tmp_path / "evil.csv").write_text("../../etc/passwd,0\n")
    with pytest.raises(ValueError, match="outside"):
        scan(tmp_path / "evil.csv")
    outside = scan(tmp_path / "evil.csv", allow_outside_root=True).samples[0][0]
    assert not outside.startswith(str(tmp_path.resolve()))


def test_missing_root_is_clear(tmp_path):
    with pytest.raises(FileNotFoundError, match="nope"):
        scan(tmp_path / "nope")
