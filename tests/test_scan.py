import pytest
from torchvision.datasets import ImageFolder

import gpupipe
from gpupipe.sources.open import open_source as scan

from .common_utils import photo


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


@pytest.mark.parametrize("header", ["path,label\n", "image,class\n", "\ufefffilename,label\n", "photo,target\n"])
def test_csv_headers_as_users_write_them(tmp_path, folder, header):
    import shutil

    shutil.copytree(folder, tmp_path / "imgs")
    lst = tmp_path / "list.csv"
    lst.write_text(header + "imgs/c00/000.jpg,1\nimgs/c01/000.jpg,0\n", encoding="utf-8")
    data = scan(lst)
    assert [label for _, label in data.samples] == [1, 0] and data.classes == ["0", "1"]


@pytest.mark.parametrize("header", ["path,label\n", "image,class\n", "\ufefffilename,label\n", "photo,target\n"])
def test_a_csv_list_of_a_header_alone_is_empty(tmp_path, header):
    """The probe: ``path,label`` alone was read as a row naming the missing file ``path``."""
    lst = tmp_path / "list.csv"
    lst.write_text(header, encoding="utf-8")
    with pytest.raises(ValueError, match=r"list.csv: the file list is empty \(a header row, no file under it\)"):
        scan(lst)
    lst.write_text("gone.jpg,1\n")  # one row naming a missing file: data
    assert scan(lst).missing == [f"{lst}:1: gone.jpg"]


# \u00b2: ², \u0663: an Arabic-Indic 3; nan: a name, not a number (among indices: a missing one)
@pytest.mark.parametrize("bad", ["dog", "1.5", "--1", "\u00b2", "\u0663"])
def test_csv_mixed_labels_are_an_error_naming_the_line(tmp_path, folder, bad):
    import shutil

    shutil.copytree(folder, tmp_path / "imgs")
    lst = tmp_path / "list.csv"
    lst.write_text(f"imgs/c00/000.jpg,2\nimgs/c01/000.jpg,10\nimgs/c02/000.jpg,{bad}\n")
    with pytest.raises(ValueError, match=r"list.csv:3: label '.*' is not a class index \(a whole number\)"):
        scan(lst)
    lst.write_text(f"imgs/c00/000.jpg,{bad}\nimgs/c01/000.jpg,2\n")  # a real file: data, not a header
    # a number that is no class index is the row named, not the class index after it
    blamed = r"list.csv:1: label '1.5' is a number but not a class index" if bad == "1.5" else r"list.csv:2: label '2'"
    with pytest.raises(ValueError, match=blamed):
        scan(lst)


@pytest.mark.parametrize(
    ("labels", "indices"), [(["0.0", "2.0", "10.0"], [0, 2, 10]), (["1", "2.0", "1e1"], [1, 2, 10])]
)
def test_csv_class_indices_written_as_decimals_are_class_indices(tmp_path, folder, labels, indices):
    """A label column written by pandas once it holds a missing value (``2.0``): read as class names, these were
    sorted as text (``10.0`` before ``2.0``), silently; they are the class indices they say."""
    import shutil

    shutil.copytree(folder, tmp_path / "imgs")
    files = sorted(tmp_path.glob("imgs/*/*.jpg"))[: len(labels)]
    lst = tmp_path / "list.csv"
    lst.write_text("".join(f"{f.relative_to(tmp_path)},{label}\n" for f, label in zip(files, labels, strict=True)))
    data = scan(lst)
    assert [label for _, label in data.samples] == indices and data.classes == [str(i) for i in range(11)]


@pytest.mark.parametrize(("labels", "line"), [(["1.0", "nan", "2.0"], 2), (["NaN", "3"], 1), (["", "3.0"], 1)])
def test_csv_a_missing_label_among_class_indices_is_an_error_naming_its_line(tmp_path, folder, labels, line):
    import shutil

    shutil.copytree(folder, tmp_path / "imgs")
    files = sorted(tmp_path.glob("imgs/*/*.jpg"))[: len(labels)]
    lst = tmp_path / "list.csv"
    lst.write_text("".join(f"{f.relative_to(tmp_path)},{label}\n" for f, label in zip(files, labels, strict=True)))
    with pytest.raises(ValueError, match=rf"list.csv:{line}: label '(nan|NaN|)' is a missing value among class"):
        scan(lst)


def test_csv_decimal_labels_that_are_not_all_whole_stay_class_names_and_a_bad_index_is_quoted_as_written(
    tmp_path, folder
):
    """Ratings (``0.5``, ``1.0``, ``1.5``) are names, as before; the held-out set of a model trained on names such as
    ``1.0`` is read by those names; an index written ``-1.0`` or ``2e6`` is refused in the words the file used."""
    import shutil

    shutil.copytree(folder, tmp_path / "imgs")
    files = sorted(tmp_path.glob("imgs/*/*.jpg"))[:3]
    lst = tmp_path / "list.csv"

    def write(*labels):
        lst.write_text("".join(f"{f.relative_to(tmp_path)},{label}\n" for f, label in zip(files, labels, strict=True)))

    write("0.5", "1.0", "1.5")
    assert scan(lst).classes == ["0.5", "1.0", "1.5"]
    write("2.0", "1.0", "3.0")
    trained = {"1.0": 0, "2.0": 1, "3.0": 2}  # a model trained on these as names
    held = scan(lst, class_to_idx=trained)
    assert [label for _, label in held.samples] == [1, 0, 2] and held.classes == ["1.0", "2.0", "3.0"]
    assert [label for _, label in scan(lst).samples] == [2, 1, 3]  # a training set: class indices
    write("1.0", "-1.0", "0e8")
    with pytest.raises(ValueError, match=r"list.csv:2: label -1.0 must be >= 0"):
        scan(lst)
    write("1.0", "0e8", "2e6")
    with pytest.raises(ValueError, match=r"list.csv:3: label 2e6 would make more than 1,000,000 classes"):
        scan(lst)


def test_csv_written_by_pandas_with_its_index_column_is_read_by_its_path_and_label(tmp_path, folder):
    """``df.to_csv("list.csv")`` writes the index first, under an empty header cell: it was read as the paths ("0",
    "1", ... do not exist); that column is left out."""
    import shutil

    shutil.copytree(folder, tmp_path / "imgs")
    lst = tmp_path / "list.csv"
    lst.write_text(",path,label\n0,imgs/c00/000.jpg,1.0\n1,imgs/c01/000.jpg,0.0\n")
    data = scan(lst)
    assert [label for _, label in data.samples] == [1, 0] and data.classes == ["0", "1"] and not data.missing


@pytest.mark.parametrize("first", ["imgs/gone.jpeg2000", "gone.tif"])
def test_csv_first_row_naming_a_missing_file_is_data_not_a_header(tmp_path, folder, first):
    import shutil

    shutil.copytree(folder, tmp_path / "imgs")
    lst = tmp_path / "list.csv"
    lst.write_text(f"{first},1\nimgs/c00/000.jpg,0\n")
    data = scan(lst)
    assert len(data.samples) == 2 and data.missing == [f"{lst}:1: {first}"]


def test_held_out_set_uses_the_training_classes(tmp_path):
    import numpy as np

    rng = np.random.default_rng(0)
    for split, names in (("train", "abc"), ("val", "bc"), ("odd", "bz")):
        for n in names:
            (tmp_path / split / n).mkdir(parents=True)
            photo(rng, 20, 20).save(tmp_path / split / n / "x.jpg")
    train = scan(tmp_path / "train")
    with pytest.warns(UserWarning, match="no samples of 1 training class.*a") as said:
        val = scan(tmp_path / "val", class_to_idx=train.class_to_idx)
    assert said[0].filename == __file__  # the caller's line, not the folder walk's (walk.py)
    assert val.classes == ["a", "b", "c"] and [label for _, label in val.samples] == [1, 2]
    with pytest.raises(ValueError, match="classes not in the training set: z"):
        scan(tmp_path / "odd", class_to_idx=train.class_to_idx)
    lst = tmp_path / "val.csv"
    lst.write_text("val/c/x.jpg,c\nval/b/x.jpg,b\n")
    with pytest.warns(UserWarning) as said:
        assert [label for _, label in scan(lst, class_to_idx=train.class_to_idx).samples] == [2, 1]
    assert said[0].filename == __file__
    with pytest.warns(UserWarning, match="no samples of 1 training class") as said:
        gpupipe.build_loader(tmp_path / "val", "pillow", batch_size=1, class_to_idx=train.class_to_idx, device="cpu")
    assert said[0].filename == __file__


def test_csv_a_nul_byte_and_a_label_of_thousands_of_digits_name_the_line(tmp_path, folder):
    """Python's own errors ("embedded null byte", the 4,300-digit limit of int()) named neither the list nor the
    line; each is the list's one-line error like every other CSV mistake."""
    import shutil

    shutil.copytree(folder, tmp_path / "imgs")
    lst = tmp_path / "list.csv"
    lst.write_text("path,label\nimgs/c00/000.jpg,1\nimgs/c01/\x00000.jpg,0\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"list.csv:3: the path 'imgs/c01/\\x00000.jpg' holds a NUL byte") as e:
        scan(lst)
    assert "\n" not in str(e.value)
    lst.write_text("path,label\nimgs/c00/000.jpg,1\nimgs/c01/000.jpg," + "9" * 5000 + "\n", encoding="utf-8")
    with pytest.raises(ValueError, match=r"list.csv:3: label 999999999999...\(5000 characters\) would make more") as e:
        scan(lst)
    assert len(str(e.value)) < 300
    lst.write_text("imgs/c00/000.jpg,-0\nimgs/c01/000.jpg,000001\n", encoding="utf-8")  # zeros as written: kept
    assert [label for _, label in scan(lst).samples] == [0, 1]
