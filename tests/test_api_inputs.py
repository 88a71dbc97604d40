"""``build_loader`` given what a new user gives it: a transform with a bug, a CSV list with absolute paths, an
image size of 0."""

import os

import numpy as np
import pytest
import torch
from torchvision import transforms as T
from torchvision.transforms import v2

import gpupipe

from .common_utils import make_folder

BACKENDS = [b for b in ("pillow", "turbojpeg", "dali") if b in gpupipe.available_backends()]


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_a_bug_in_the_users_transform_is_raised_as_the_transforms_not_skipped_as_data(folder, backend, on_error):
    tf = T.Compose([T.ToTensor(), T.Normalize((0.5,), (0.5,))])  # torchvision's PIL habit: gpupipe gives tensors
    for train in (False, True):
        loader = gpupipe.build_loader(
            folder,
            backend,
            batch_size=4,
            train=train,
            image_size=32,
            device="cpu",
            num_workers=1,
            transforms=tf,
            on_error=on_error,
        )
        with pytest.raises(gpupipe.TransformError) as e:
            next(iter(loader))
        msg = str(e.value)
        assert "ToTensor()" in msg and "TypeError: pic should be PIL Image" in msg  # the member that raised
        assert "cannot decode" not in msg and loader.skipped == []
        if backend != "dali":  # decoded in workers, which know the file
            assert msg.startswith(str(folder)) and msg.split(":")[0].endswith(".jpg")


def test_a_transform_that_works_is_unchanged(folder):
    loader = gpupipe.build_loader(
        folder,
        "pillow",
        batch_size=4,
        image_size=32,
        device="cpu",
        num_workers=0,
        normalize=False,
        transforms=[T.RandomErasing(p=1.0)],
    )
    images, _ = next(iter(loader))
    assert images.dtype == torch.uint8 and images.shape == (4, 3, 32, 32)


_BAD_OUTPUTS = {
    "float": (v2.ToDtype(torch.float32, scale=True), r"returned torch\.float32 images, not uint8.*leave ToDtype"),
    "shape": (lambda x: x[..., :10, :10], r"returned shape \((\d+, )?3, 10, 10\) for \((\d+, )?3, 32, 32\)"),
}


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("mode", ["image", "batch"])
@pytest.mark.parametrize("output", list(_BAD_OUTPUTS))
def test_a_transform_returning_float_or_another_shape_is_a_transform_error(folder, backend, mode, output):
    """On every backend, per image and per batch, whatever on_error says: never garbage pixels, never a skipped file."""
    tf, message = _BAD_OUTPUTS[output]
    loader = gpupipe.build_loader(
        folder, backend, batch_size=4, image_size=32, device="cpu", transforms=tf, transforms_mode=mode, on_error="skip"
    )
    with pytest.raises(gpupipe.TransformError, match=message):
        next(iter(loader))
    assert loader.skipped == []


@pytest.mark.parametrize(
    ("given", "message"),
    [
        ({"device": "gpu"}, r"device must be 'cpu', 'cuda' or 'cuda:N' \(or a torch.device\), got 'gpu'"),
        ({"image_size": "224"}, r"image_size must be a whole number or None, got '224' \(str\)"),
        ({"batch_size": 2.5}, r"batch_size must be a whole number, got 2.5 \(float\)"),
        ({"num_workers": "2"}, r"num_workers must be a whole number or None, got '2' \(str\)"),
        # yes/no arguments given as words were taken as true (a non-empty string): uint8 asked for, float32 given
        ({"normalize": "no"}, r"normalize must be True or False, got 'no' \(str\)"),
        ({"train": "False"}, r"train must be True or False, got 'False' \(str\)"),
        ({"drop_last": 1}, r"drop_last must be True or False \(or None\), got 1 \(int\)"),
        ({"seed": "3"}, r"seed must be a whole number between -2\*\*40 and 2\*\*40, got '3' \(str\)"),
        ({"seed": 2**70}, r"seed must be a whole number between .*, got 1180591620717411303424 \(int\)"),
        ({"backend": None}, r"backend must be a name, one of pillow, .*, auto; got None"),
        ({"recipe": {"size": 64}}, r"recipe must be a gpupipe.Recipe, got dict"),
        (
            {"transforms": 5, "batch_size": 4},
            r"transforms must be a callable, a list or tuple of them or a Compose; got 5",
        ),
        ({"rank": 0, "world_size": 0}, r"world_size must be >= 1, got 0"),
        ({"rank": "1", "world_size": 2}, r"rank must be a whole number or None, got '1' \(str\)"),
    ],
)
def test_an_argument_of_the_wrong_type_or_an_unknown_device_is_one_line(folder, given, message):
    with pytest.raises(ValueError, match=message):
        gpupipe.build_loader(folder, **{"backend": "pillow", **given})


def test_numpy_counts_are_taken_as_python_ints(folder):
    """``np.int64(64)`` was refused as "must be a whole number" (a numpy seed was taken)."""
    kw = dict(image_size=np.int64(16), batch_size=np.int64(4), num_workers=np.int64(0), device="cpu")
    loader = gpupipe.build_loader(folder, "pillow", **kw)
    assert next(iter(loader))[0].shape == (4, 3, 16, 16)


def test_drop_last_on_an_eval_loader_warns_that_every_sample_is_delivered(folder):
    """It was ignored without a word: a short last batch where a fixed shape was asked for."""
    kw = dict(batch_size=4, image_size=16, device="cpu", num_workers=0)
    with pytest.warns(UserWarning, match=r"drop_last=True on an eval loader is ignored") as warned:
        loader = gpupipe.build_loader(folder, "pillow", train=False, drop_last=True, **kw)
    assert warned[0].filename == __file__
    assert sum(len(y) for _, y in loader) == len(gpupipe.build_loader(folder, "pillow", train=False, **kw).dataset)


def test_an_empty_list_and_a_read_of_no_path_are_one_line():
    with pytest.raises(ValueError, match=r"root is an empty list: no data"):
        gpupipe.build_loader([], "pillow", device="cpu")
    with pytest.raises(ValueError, match=r"read_image needs a file's path or its bytes, got int"):
        gpupipe.read_image(5)  # type: ignore[arg-type]


@pytest.mark.parametrize("root", [42, None])
def test_a_root_that_is_no_data_is_one_line_naming_the_argument(root):
    """The probe: ``build_loader(42)`` ended in ``TypeError: expected str, bytes or os.PathLike object, not int``."""
    with pytest.raises(ValueError, match=rf"root must be the data: .*; got {root} \({type(root).__name__}\)"):
        gpupipe.build_loader(root, "pillow", device="cpu")


def test_numpy_flags_and_seeds_are_taken_as_python_ones(folder):
    kw = dict(batch_size=4, device="cpu", normalize=np.bool_(False), seed=np.int64(3))
    loader = gpupipe.build_loader(folder, "pillow", **kw)
    assert loader.seed == 3 and type(loader.seed) is int and next(iter(loader))[0].dtype == torch.uint8


def test_read_image_names_an_unknown_device(folder):
    with pytest.raises(ValueError, match="device must be 'cpu', 'cuda'"):
        gpupipe.read_image(next(folder.rglob("*.jpg")), device="gpu")


@pytest.mark.parametrize("size", [0, -1])
def test_image_size_zero_is_an_error_not_224(folder, size):
    with pytest.raises(ValueError, match=f"image_size must be >= 1, got {size}"):
        gpupipe.build_loader(folder, "pillow", image_size=size, device="cpu", num_workers=0)


def test_a_csv_list_with_absolute_paths_loads(tmp_path, folder):
    files = sorted(folder.rglob("*.jpg"))[:4]
    lst = tmp_path / "lists" / "train.csv"  # in another folder than the images
    lst.parent.mkdir()
    lst.write_text("path,label\n" + "".join(f"{f.resolve()},{i % 2}\n" for i, f in enumerate(files)))
    loader = gpupipe.build_loader(lst, "pillow", batch_size=2, train=False, image_size=32, device="cpu", num_workers=0)
    assert [p for p, _ in loader.dataset.samples] == [str(f.resolve()) for f in files]
    assert sum(len(y) for _, y in loader) == 4


def test_a_csv_row_leaving_its_folder_says_how_to_allow_it(tmp_path, folder):
    lst = tmp_path / "lists" / "train.csv"
    lst.parent.mkdir()
    lst.write_text(f"../{folder.name}/c00/000.jpg,0\n")
    with pytest.raises(ValueError, match=r"relative paths are read from the list's folder.*allow_outside_root=True"):
        gpupipe.build_loader(lst, "pillow", device="cpu", num_workers=0)


def test_a_csv_row_naming_a_folder_says_so(tmp_path, folder):
    """A row naming a folder was reported as a file that does not exist, the folder right there."""
    (tmp_path / "a.jpg").write_bytes((folder / "c00" / "000.jpg").read_bytes())
    (tmp_path / "sub").mkdir()
    lst = tmp_path / "list.csv"
    lst.write_text("a.jpg,0\nsub,1\n")
    with pytest.raises(FileNotFoundError, match=r"list.csv:2: sub \(a folder\)"):
        gpupipe.build_loader(lst, "pillow", device="cpu", num_workers=0)


def test_a_missing_file_in_a_csv_is_named_before_iteration(tmp_path, folder):
    (tmp_path / "a.jpg").write_bytes((folder / "c00" / "000.jpg").read_bytes())
    lst = tmp_path / "list.csv"
    lst.write_text("a.jpg,0\nb.jpg,1\na.jpg,1\n")
    with pytest.raises(FileNotFoundError, match=r"1 file\(s\) in the list do not exist: .*list.csv:2: b.jpg") as e:
        gpupipe.build_loader(lst, "pillow", device="cpu", num_workers=0)  # at build time, not mid-epoch
    assert f"(relative paths are read from the list's folder, {tmp_path})" in str(e.value)
    with pytest.warns(UserWarning, match=r"list.csv:2: b.jpg") as warned:
        loader = gpupipe.build_loader(
            lst, "pillow", batch_size=3, train=False, image_size=32, device="cpu", num_workers=0, on_error="skip"
        )
    assert warned[0].filename == __file__  # the user's line
    assert sum(len(y) for _, y in loader) == 2 and [os.path.basename(p) for p, _ in loader.skipped] == ["b.jpg"]


def test_a_recipe_without_a_size_takes_the_loaders_and_one_with_another_is_refused(folder):
    kw = dict(batch_size=2, device="cpu", num_workers=0, normalize=False)
    loader = gpupipe.build_loader(folder, "pillow", image_size=40, recipe=gpupipe.Recipe(auto_augment="original"), **kw)
    assert next(iter(loader))[0].shape[-2:] == (40, 40) and loader.recipe.auto_augment == "original"
    assert next(iter(gpupipe.build_loader(folder, "pillow", recipe=gpupipe.Recipe(), **kw)))[0].shape[-1] == 224
    with pytest.raises(ValueError, match=r"image_size=40 and recipe\.size=224 disagree"):
        gpupipe.build_loader(folder, "pillow", image_size=40, recipe=gpupipe.Recipe(224), **kw)


def test_the_default_batch_on_a_small_folder_names_the_largest_batch_that_works(tmp_path):
    """The probe: ``build_loader("my_folder", "pillow")`` on any folder under 256 images said "a smaller batch_size"."""
    root = make_folder(tmp_path / "small", 2, 3)
    with pytest.raises(ValueError) as e:
        gpupipe.build_loader(root, "pillow", device="cpu", num_workers=0)
    assert str(e.value) == (
        "6 samples over 1 rank(s) make no full batch of 256 with drop_last=True: use batch_size=6 or less, or "
        "drop_last=False"
    )


def test_read_image_names_the_decoding_backends_and_a_missing_gpu_in_one_line(tmp_path):
    """The probe: `auto` got no list of names; `device="cuda"` without a GPU got torch's driver error."""
    path = next((make_folder(tmp_path / "one", 2, 1) / "c00").iterdir())
    decoders = [n for n in gpupipe.backends.names() if gpupipe.backends.get(n).read is not None]
    for backend in ("auto", "synthetic"):
        with pytest.raises(ValueError) as e:
            gpupipe.read_image(path, backend)
        assert f"read_image needs a decoding backend: one of {', '.join(decoders)}, not {backend!r}" in str(e.value)
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match=r"^device='cuda' was asked for, but torch sees no CUDA device$"):
            gpupipe.read_image(path, "pillow", device="cuda")
    assert gpupipe.read_image(path, "pillow").shape[0] == 3


def test_read_image_of_a_missing_file_or_a_folder_and_a_foreign_loader_state_are_named(tmp_path, folder):
    """The probe: a missing file was a plain FileNotFoundError (docs/loader.md: gpupipe.MissingFileError), a folder
    ``IsADirectoryError: [Errno 21] Is a directory: 3`` (a file descriptor for a name), and load_state_dict of a dict
    that is no loader's state a bare ``KeyError: 'epoch'``."""
    with pytest.raises(gpupipe.MissingFileError, match=rf"^{tmp_path}/nope.jpg: no such file$"):
        gpupipe.read_image(tmp_path / "nope.jpg", "pillow")
    with pytest.raises(OSError, match="not a regular file: a folder") as e:
        gpupipe.read_image(tmp_path, "pillow")
    assert e.value.filename == str(tmp_path)
    loader = gpupipe.build_loader(folder, "pillow", batch_size=2, image_size=16, device="cpu", num_workers=0)
    with pytest.raises(ValueError, match=r"^not a loader's state: \{'foo': 1\} has no 'epoch' and 'batch'"):
        loader.load_state_dict({"foo": 1})
    with pytest.raises(ValueError, match=r"^not a loader's state: None has no 'epoch' and 'batch'"):
        loader.load_state_dict(None)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match=r"^the state's batch: a batch is a whole number >= 0, got '3'$"):
        loader.load_state_dict({"epoch": 0, "batch": "3"})  # it was taken, and saved again as the string


def test_a_missing_absolute_row_gets_no_relative_path_hint_and_every_data_error_is_gpupipes(tmp_path, folder):
    """The hint about relative paths only where a missing row is relative; the missing-file, malformed-source and
    batch-size errors are gpupipe's own, each keeping its builtin class as a base (docs/loader.md)."""
    lst = tmp_path / "list.csv"
    lst.write_text(f"{folder.resolve()}/c00/000.jpg,0\n{tmp_path}/gone.jpg,1\n")
    with pytest.raises(gpupipe.MissingFileError, match=r"list.csv:2: .*gone.jpg") as e:
        gpupipe.build_loader(lst, "pillow", device="cpu", num_workers=0)
    assert isinstance(e.value, FileNotFoundError) and "relative paths" not in str(e.value)
    with pytest.raises(gpupipe.MissingFileError, match="no such directory or file list"):
        gpupipe.build_loader(tmp_path / "nowhere", "pillow", device="cpu", num_workers=0)
    lst.write_text(f"{folder.resolve()}/c00/000.jpg,-1\n")
    with pytest.raises(gpupipe.SourceError, match=r"list.csv:1: label -1 must be >= 0") as e:
        gpupipe.build_loader(lst, "pillow", device="cpu", num_workers=0)
    assert isinstance(e.value, ValueError)
    with pytest.raises(gpupipe.NoFullBatch, match="make no full batch of 4096") as e:
        gpupipe.build_loader(folder, "pillow", batch_size=4096, device="cpu", num_workers=0)
    assert isinstance(e.value, ValueError) and isinstance(e.value, gpupipe.GpupipeError)


def test_an_image_file_given_as_the_data_is_refused_naming_every_kind_of_source(tmp_path):
    """A file that is no source (an image): the error names it and every kind a source may be; it named folders and
    file lists alone, though shards and Parquet files are sources too."""
    root = make_folder(tmp_path / "data", 1, 1)
    image = next(root.glob("*/*.jpg"))
    with pytest.raises(gpupipe.SourceError, match=rf"^{image}: not a data source: ") as e:
        gpupipe.build_loader(image, "pillow", batch_size=1)
    assert all(kind in str(e.value) for kind in ("ImageFolder directory", ".csv file list", "tar shards", "Parquet"))
