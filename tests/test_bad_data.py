"""One policy for bad and unusual files, on every backend."""

import io
import shutil
import subprocess

import numpy as np
import pytest
import torch
from PIL import Image

import gpupipe

from .conftest import CPU_LOADER_BACKENDS, DECODERS, make_folder, photo

READERS = [*DECODERS, *(["dali"] if "dali" in gpupipe.available_backends() else [])]


def _jpeg(img, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kw)
    return buf.getvalue()


def _with_orientation(img: Image.Image, orientation: int) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = orientation
    return _jpeg(img, quality=95, exif=exif)


@pytest.fixture(scope="module")
def base():
    return photo(np.random.default_rng(7), 60, 90)


VALID = {
    "cmyk": lambda b: _jpeg(b.convert("CMYK"), quality=95),
    "gray": lambda b: _jpeg(b.convert("L"), quality=95),
    "progressive": lambda b: _jpeg(b, quality=95, progressive=True),
    "arithmetic": lambda b: _arithmetic(_jpeg(b, quality=95)),
    "444": lambda b: _jpeg(b, quality=95, subsampling=0),
    "422": lambda b: _jpeg(b, quality=95, subsampling=1),
    "png_as_jpg": lambda b: _save(b, "PNG"),
    "webp_as_jpg": lambda b: _save(b, "WEBP", lossless=True),
    "bmp_as_jpg": lambda b: _save(b, "BMP"),
    "rgba_png": lambda b: _save(b.convert("RGBA"), "PNG"),
    "png16": lambda b: _save(Image.fromarray(np.asarray(b.convert("L")).astype(np.uint16) * 257), "PNG"),
    "tiny": lambda b: _jpeg(b.resize((3, 2)), quality=95),
    "elongated": lambda b: _jpeg(b.resize((400, 8)), quality=95),
}


def _arithmetic(baseline: bytes) -> bytes:
    """Arithmetic-coded JPEG (Pillow cannot write one): libjpeg-turbo's jpegtran, which `make test` installs."""
    if shutil.which("jpegtran") is None:
        pytest.skip("jpegtran is missing (apt-get install libjpeg-turbo-progs)")
    out = subprocess.run(["jpegtran", "-arithmetic"], input=baseline, capture_output=True, check=True).stdout
    assert out[:2] == b"\xff\xd8" and b"\xff\xc9" in out  # SOF9: arithmetic sequential
    return out


def _save(img, fmt, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, fmt, **kw)
    return buf.getvalue()


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("kind", sorted(VALID))
def test_unusual_valid_files_decode_to_rgb(base, backend, kind):
    data = VALID[kind](base)
    img = gpupipe.read_image(data, backend)
    ref = gpupipe.read_image(data, "pillow")
    assert img.dtype == torch.uint8 and img.shape[0] == 3 and img.shape == ref.shape
    assert (img.float() - ref.float()).abs().mean() < 3


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("orientation", range(1, 9))
def test_exif_orientation_is_applied_everywhere(base, backend, orientation):
    data = _with_orientation(base, orientation)
    img = gpupipe.read_image(data, backend)
    upright = torch.from_numpy(
        np.asarray(
            __import__("PIL.ImageOps").ImageOps.exif_transpose(Image.open(io.BytesIO(data)).convert("RGB"))
        ).copy()
    ).permute(2, 0, 1)
    assert img.shape == upright.shape
    assert (img.float() - upright.float()).abs().mean() < 3


INVALID = {
    "truncated": lambda b: _jpeg(b, quality=95)[:-400],
    "empty": lambda b: b"",
    "not_an_image": lambda b: b"hello, this is text" * 10,
    "corrupt_after_marker": lambda b: _jpeg(b, quality=95)[:200] + bytes(range(256)) * 8,
}


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("kind", sorted(INVALID))
def test_invalid_files_raise_decode_error_naming_the_file(tmp_path, base, backend, kind):
    path = tmp_path / f"{kind}.jpg"
    path.write_bytes(INVALID[kind](base))
    with pytest.raises(gpupipe.DecodeError) as e:
        gpupipe.read_image(path, backend)
    assert str(path) in str(e.value) and e.value.backend == backend


@pytest.mark.parametrize("backend", READERS)
def test_pixel_limit_is_checked_from_the_header(tmp_path, backend):
    path = tmp_path / "big.png"
    Image.new("L", (3000, 2000)).save(path)
    with pytest.raises(gpupipe.DecodeError, match="exceeds the limit"):
        gpupipe.read_image(path, backend, max_pixels=1_000_000)


def _float_tiff(path):
    Image.fromarray(np.linspace(0, 1, 64 * 48, dtype=np.float32).reshape(48, 64), "F").save(path, format="TIFF")
    return path


@pytest.mark.parametrize("backend", READERS)
def test_float_images_follow_one_rule_everywhere(tmp_path, backend):
    """A float TIFF (mode F) is refused by every backend, as its value range says nothing about 8-bit colours; 16-bit
    integer TIFFs are scaled (the top 8 bits)."""
    with pytest.raises(gpupipe.DecodeError, match=r"floating-point image \(mode F\)"):
        gpupipe.read_image(_float_tiff(tmp_path / "f.tif"), backend)
    if backend in DECODERS:
        arr = np.full((8, 8), 0xABCD, dtype=np.uint16)
        Image.fromarray(arr).save(tmp_path / "i16.tif")
        assert gpupipe.read_image(tmp_path / "i16.tif", backend).unique().tolist() == [0xAB]


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_loaders_and_check_flag_float_images(tmp_path, backend):
    from gpupipe.cli import main

    root = make_folder(tmp_path / "data", 2, 3)
    _float_tiff(root / "c01" / "zz_float.tif")
    loader = gpupipe.build_loader(
        root, backend, batch_size=2, train=False, image_size=16, num_workers=0, device="cpu", on_error="skip"
    )
    list(loader)
    assert [(p.rsplit("/", 1)[-1], "mode F" in r) for p, r in loader.skipped] == [("zz_float.tif", True)]
    if backend == "pillow":
        assert main(["check", str(root), "--workers", "1"]) == 1


@pytest.mark.parametrize("backend", READERS)
def test_reasons_do_not_name_python_objects(backend):
    with pytest.raises(gpupipe.DecodeError) as e:
        gpupipe.read_image(b"this is not an image at all", backend)
    assert "BytesIO" not in str(e.value) and " at 0x" not in str(e.value)
    assert "not a readable image" in e.value.reason


@pytest.fixture()
def dirty_folder(tmp_path, base):
    root = make_folder(tmp_path / "data", 2, 5)
    (root / "c00" / "zz_truncated.jpg").write_bytes(INVALID["truncated"](base))
    (root / "c01" / "zz_empty.jpg").write_bytes(b"")
    for i, (kind, make) in enumerate(sorted(VALID.items())):  # every valid oddity, beside the broken files
        (root / f"c0{i % 2}" / f"zz_valid_{kind}.jpg").write_bytes(make(base))
    return root


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_loader_raises_in_the_main_process(dirty_folder, backend):
    loader = gpupipe.build_loader(
        dirty_folder, backend, batch_size=4, train=False, image_size=32, num_workers=1, device="cpu"
    )
    with pytest.raises(gpupipe.DecodeError, match=r"zz_truncated\.jpg|zz_empty\.jpg"):
        list(loader)


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_loader_skips_refills_and_reports(dirty_folder, backend):
    loader = gpupipe.build_loader(
        dirty_folder,
        backend,
        batch_size=4,
        train=True,
        image_size=32,
        num_workers=1,
        device="cpu",
        on_error="skip",
        drop_last=False,
    )
    batches = list(loader)
    assert len(batches) == len(loader)
    assert [len(y) for _, y in batches] == [len(b) for b in loader.sampler.batches(0)]  # full batches, equal steps
    assert sorted(p.rsplit("/", 1)[-1] for p, _ in loader.skipped) == ["zz_empty.jpg", "zz_truncated.jpg"]
    assert all(reason for _, reason in loader.skipped)


def test_check_command_reports_and_fails(dirty_folder, capsys):
    import json

    from gpupipe.cli import main

    assert main(["check", str(dirty_folder), "--json", "--workers", "2"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert {r["path"].rsplit("/", 1)[-1] for r in report["unreadable"]} == {"zz_empty.jpg", "zz_truncated.jpg"}
    notes = " ".join(n for r in report["unusual"] for n in r["notes"])
    assert "CMYK" in notes and "arithmetic" in notes and "PNG data under a .jpg name" in notes


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_loader_pixel_limit_from_the_header(tmp_path, backend):
    """A picture over the limit is refused from its header by every loader (DALI included: it has no limit of its
    own), raised in the main process or skipped and reported."""
    root = make_folder(tmp_path / "data", 2, 4)
    Image.new("RGB", (1200, 1000)).save(root / "c01" / "zz_big.jpg")
    kw = dict(batch_size=4, image_size=32, num_workers=1, device="cpu", max_pixels=1_000_000)
    with pytest.raises(gpupipe.DecodeError, match=r"zz_big\.jpg.*1200x1000 = 1200000 pixels exceeds the limit"):
        list(gpupipe.build_loader(root, backend, train=False, **kw))
    loader = gpupipe.build_loader(root, backend, train=True, on_error="skip", drop_last=False, **kw)
    batches = list(loader)
    assert [len(y) for _, y in batches] == [4, 4, 1]
    assert [p.rsplit("/", 1)[-1] for p, _ in loader.skipped] == ["zz_big.jpg"]


def _exif_upright(data: bytes) -> Image.Image:
    from PIL import ImageOps

    return ImageOps.exif_transpose(Image.open(io.BytesIO(data)).convert("RGB"))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orientation_on_arrays_and_tensors_matches_pil(base, orientation):
    """The crop path's numpy views and the nvJPEG path's tensor ops turn an image as PIL's exif_transpose does."""
    from gpupipe.backends._image import upright_array
    from gpupipe.backends.nvjpeg import _upright_chw

    data = _with_orientation(base, orientation)
    want = np.asarray(_exif_upright(data))
    arr = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert np.array_equal(upright_array(arr, orientation), want)
    chw = _upright_chw(torch.from_numpy(arr.copy()).permute(2, 0, 1), orientation)
    assert torch.equal(chw.permute(1, 2, 0), torch.from_numpy(want))


@pytest.mark.parametrize("backend", DECODERS)
@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_train_crop_of_a_rotated_file_is_the_upright_crop(base, backend, orientation):
    """The crop is chosen on the upright image and cut from it, whichever way the file is stored."""
    from gpupipe.backends import cpu_decoder
    from gpupipe.recipe import Box

    stored = _with_orientation(base, orientation)
    box = Box(5, 10, 40, 30, flip=True)  # in upright pixels
    got, _ = cpu_decoder(backend).crop(stored, "x.jpg", lambda h, w: box, 32)
    ref, _ = cpu_decoder(backend).crop(_jpeg(_exif_upright(stored), quality=95), "y.jpg", lambda h, w: box, 32)
    assert np.abs(got.astype(np.float32) - ref).mean() < 3


@pytest.mark.skipif("dali" not in gpupipe.available_backends(), reason="DALI is not installed")
def test_worker_forked_beside_a_dead_dali_pipeline_does_not_hang(folder):
    """A DALI pipeline left in a garbage cycle used to be freed inside the next forked DataLoader worker, where its
    shutdown waited for threads that only exist in the parent: the worker hung before its first batch."""
    import gc

    from gpupipe.backends.dali import build_pipeline
    from gpupipe.recipe import Recipe

    files = [str(p) for p in sorted(folder.rglob("*.jpg"))][:2]
    pipe = build_pipeline(Recipe(32), train=False, batch_size=2, device=torch.device("cpu"), num_threads=1)
    pipe.feed_input("enc", [np.fromfile(f, dtype=np.uint8) for f in files])
    pipe.feed_input("meta", [np.array(Recipe(32).eval_offsets(h, w)) for h, w in [(120, 180), (200, 150)]])
    pipe.run()
    pipe.cycle = pipe  # unreachable once deleted, but only the cycle collector frees it
    gc.disable()
    try:
        del pipe
        loader = torch.utils.data.DataLoader(
            range(4), batch_size=2, num_workers=1, timeout=60, worker_init_fn=lambda _: gc.collect()
        )
        assert [b.tolist() for b in loader] == [[0, 1], [2, 3]]
    finally:
        gc.enable()
        gc.collect()
