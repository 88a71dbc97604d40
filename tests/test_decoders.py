"""The CPU decoders (backends/pillow.py, backends/turbojpeg.py, gpupipe/image.py) and ``read_image`` on every
backend: one policy for bad and unusual files, EXIF orientation, reduced (DCT-scaled) decoding."""

import io
import os
import subprocess
import sys
import threading

import numpy as np
import pytest
import torch
from PIL import Image

import gpupipe
from gpupipe.image import crop_resize
from gpupipe.recipe import Box

from .common_utils import (
    CPU_LOADER_BACKENDS,
    DECODERS,
    INVALID,
    ORIENTED_FORMATS,
    READERS,
    REPO_ROOT,
    VALID,
    exif_upright,
    float_tiff,
    jpeg_bytes,
    jpeg_with_orientation,
    photo,
    with_orientation,
)


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
    data = jpeg_with_orientation(base, orientation)
    img = gpupipe.read_image(data, backend)
    upright = torch.from_numpy(
        np.asarray(
            __import__("PIL.ImageOps").ImageOps.exif_transpose(Image.open(io.BytesIO(data)).convert("RGB"))
        ).copy()
    ).permute(2, 0, 1)
    assert img.shape == upright.shape
    assert (img.float() - upright.float()).abs().mean() < 3


def _exif_transposed(data: bytes) -> torch.Tensor:
    """PIL's own answer (``ImageOps.exif_transpose``) as a (3, H, W) tensor."""
    return torch.from_numpy(np.asarray(exif_upright(data)).copy()).permute(2, 0, 1)


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("fmt", ORIENTED_FORMATS)
@pytest.mark.parametrize("orientation", [3, 6, 7])
def test_orientation_is_applied_once_in_every_format(base, backend, fmt, orientation):
    """Every format Pillow carries an EXIF orientation in comes out as ``exif_transpose`` turns it: once (Pillow's
    TIFF loader turns a TIFF itself, so turning it again leaves it on its side)."""
    data = with_orientation(base, fmt, orientation)
    img, want = gpupipe.read_image(data, backend), _exif_transposed(data)
    assert img.shape == want.shape
    assert (img.float() - want.float()).abs().mean() < 3


@pytest.mark.parametrize("backend", CPU_LOADER_BACKENDS)
def test_loaders_turn_oriented_files_as_exif_transpose(tmp_path, base, backend):
    """A loader's eval crops of files stored turned (EXIF 6) in each format are those of the upright pictures."""
    stored, upright = tmp_path / "stored" / "c", tmp_path / "upright" / "c"
    stored.mkdir(parents=True)
    upright.mkdir(parents=True)
    ramps = np.asarray(base).copy()  # red grows to the right, green downwards: any wrong turn shows
    ramps[..., 0] = np.linspace(0, 255, ramps.shape[1])[None, :]
    ramps[..., 1] = np.linspace(0, 255, ramps.shape[0])[:, None]
    for i, fmt in enumerate(ORIENTED_FORMATS):
        data = with_orientation(Image.fromarray(ramps), fmt, 6)
        (stored / f"{i}.{fmt.lower()}").write_bytes(data)
        Image.fromarray(_exif_transposed(data).permute(1, 2, 0).numpy()).save(upright / f"{i}.png")

    def batch(root, name):
        kw = {"batch_size": 4, "train": False, "image_size": 32, "num_workers": 0, "normalize": False}
        return next(iter(gpupipe.build_loader(root.parent, name, **kw)))[0].float()

    assert (batch(stored, backend) - batch(upright, "pillow")).abs().mean() < 3


@pytest.mark.parametrize("backend", READERS)
@pytest.mark.parametrize("kind", sorted(INVALID))
def test_invalid_files_raise_decode_error_naming_the_file(tmp_path, base, backend, kind, capfd):
    """Only gpupipe's message: nothing of the library's own on stderr (DALI's decoder writes ``[ERROR] ...`` lines to
    file descriptor 2), and one wording for a truncated file whatever the backend."""
    path = tmp_path / f"{kind}.jpg"
    path.write_bytes(INVALID[kind](base))
    capfd.readouterr()
    with pytest.raises(gpupipe.DecodeError) as e:
        gpupipe.read_image(path, backend)
    assert str(path) in str(e.value) and e.value.backend == backend
    assert capfd.readouterr().err == ""
    if kind.startswith("truncated"):  # cut inside its header: Pillow's "Truncated File Read" before
        assert e.value.reason == "truncated (the data ends before the image does)"
    assert "OSError" not in e.value.reason  # the decoder stopped by the data: "corrupt image data (its words)"
    if kind == "huffman_counts_zeroed":
        assert e.value.reason.startswith("corrupt image data ("), e.value.reason


@pytest.mark.parametrize("backend", READERS)
def test_pixel_limit_is_checked_from_the_header(tmp_path, backend):
    path = tmp_path / "big.png"
    Image.new("L", (3000, 2000)).save(path)
    with pytest.raises(gpupipe.DecodeError, match="exceeds the limit"):
        gpupipe.read_image(path, backend, max_pixels=1_000_000)


@pytest.mark.parametrize("backend", READERS)
def test_float_images_follow_one_rule_everywhere(tmp_path, backend):
    """A float TIFF (mode F) is refused by every backend, as its value range says nothing about 8-bit colours; 16-bit
    integer TIFFs are scaled (the top 8 bits)."""
    with pytest.raises(gpupipe.DecodeError, match=r"floating-point image \(mode F\)"):
        gpupipe.read_image(float_tiff(tmp_path / "f.tif"), backend)
    if backend in DECODERS:
        arr = np.full((8, 8), 0xABCD, dtype=np.uint16)
        Image.fromarray(arr).save(tmp_path / "i16.tif")
        assert gpupipe.read_image(tmp_path / "i16.tif", backend).unique().tolist() == [0xAB]


@pytest.mark.parametrize("backend", READERS)
def test_reasons_do_not_name_python_objects(backend):
    with pytest.raises(gpupipe.DecodeError) as e:
        gpupipe.read_image(b"this is not an image at all", backend)
    assert "BytesIO" not in str(e.value) and " at 0x" not in str(e.value)
    assert "not a readable image" in e.value.reason


@pytest.mark.parametrize("orientation", range(1, 9))
def test_orientation_on_arrays_and_tensors_matches_pil(base, orientation):
    """The crop path's numpy views and the nvJPEG path's tensor ops turn an image as PIL's exif_transpose does."""
    from gpupipe.backends.nvjpeg import _upright_chw
    from gpupipe.image import upright_array

    data = jpeg_with_orientation(base, orientation)
    want = np.asarray(exif_upright(data))
    arr = np.asarray(Image.open(io.BytesIO(data)).convert("RGB"))
    assert np.array_equal(upright_array(arr, orientation), want)
    chw = _upright_chw(torch.from_numpy(arr.copy()).permute(2, 0, 1), orientation)
    assert torch.equal(chw.permute(1, 2, 0), torch.from_numpy(want))


@pytest.mark.parametrize("orientation", range(1, 9))
def test_a_turned_view_reaches_the_resampler_as_its_pixels_channels_last(orientation):
    """``_as_tensor`` makes the resampler's (1, 3, H, W) channels-last input of any view ``upright_array`` gives
    (mirrored, flipped, transposed; cut; read-only, as Pillow's arrays), with torch's copies instead of numpy's
    element-by-element ones: the same pixels as numpy's copy."""
    from gpupipe.image import _as_tensor, upright_array

    rng = np.random.default_rng(orientation)
    for shape in ((7, 11, 3), (1, 5, 3), (5, 1, 3), (64, 48, 3)):
        stored = rng.integers(0, 256, shape, dtype=np.uint8)
        for writeable in (True, False):
            stored.flags.writeable = writeable
            turned = upright_array(stored, orientation)
            for view in (turned, turned[1:, :-1], turned[:, 1:2]):
                if view.size == 0:
                    continue
                got = _as_tensor(view)
                assert torch.equal(got[0].permute(1, 2, 0), torch.from_numpy(view.copy())), (shape, view.strides)
                assert got.is_contiguous(memory_format=torch.channels_last)


@pytest.mark.parametrize("backend", DECODERS)
@pytest.mark.parametrize("orientation", [3, 6, 8])
def test_train_crop_of_a_rotated_file_is_the_upright_crop(base, backend, orientation):
    """The crop is chosen on the upright image and cut from it, whichever way the file is stored."""
    from gpupipe.backends import cpu_decoder
    from gpupipe.recipe import Box

    stored = jpeg_with_orientation(base, orientation)
    box = Box(5, 10, 40, 30, flip=True)  # in upright pixels
    got, _ = cpu_decoder(backend).crop(stored, "x.jpg", lambda h, w: box, 32)
    ref, _ = cpu_decoder(backend).crop(jpeg_bytes(exif_upright(stored), quality=95), "y.jpg", lambda h, w: box, 32)
    assert np.abs(got.astype(np.float32) - ref).mean() < 3


@pytest.mark.parametrize("backend", DECODERS)
def test_reduced_decode_keeps_what_the_crop_needs(backend):
    """The DCT-reduced decode is as small as the crop allows (1/4 here) yet still at least the output size, and the
    train crop it gives matches the full-resolution decode's within resampling noise."""
    from gpupipe.backends import cpu_decoder

    buf = io.BytesIO()
    photo(np.random.default_rng(3), 1200, 1600).save(buf, "JPEG", quality=90)
    data = buf.getvalue()
    box = Box(100, 200, 960, 1000, flip=True)
    img, got_box, hw, fell_back = cpu_decoder(backend).decode(data, "x.jpg", lambda h, w: box, 224)
    assert got_box == box and hw == (1200, 1600) and not fell_back
    assert np.asarray(img).shape[:2] == (300, 400)  # 1/4: the crop stays 240x250 >= 224
    reduced, _ = cpu_decoder(backend).crop(data, "x.jpg", lambda h, w: box, 224)
    full, _ = cpu_decoder(backend, reduced_decode=False).crop(data, "x.jpg", lambda h, w: box, 224)
    assert reduced.shape == full.shape == (3, 224, 224)
    assert np.abs(reduced.astype(np.float32) - full).mean() <= 2.0


@pytest.mark.parametrize("backend", DECODERS)
@pytest.mark.parametrize("orientation", [1, 6])
def test_two_methods_serve_every_caller(base, backend, orientation):
    """``decode`` without a plan is the whole image at full scale (its box the whole upright image), as
    ``read_image`` gives it; ``crop`` into a batch's slot (a tensor or an array) is ``crop`` into its own array, to the
    bit, and hands back the slot's (3, S, S) view."""
    from gpupipe.backends import cpu_decoder

    decoder = cpu_decoder(backend)
    data = jpeg_with_orientation(base, orientation)
    img, box, hw, fell_back = decoder.decode(data, "x.jpg")
    assert not fell_back and np.asarray(img).shape[:2] == hw
    assert (box.top, box.left, box.height, box.width) == (0, 0, *hw)
    assert torch.equal(torch.from_numpy(np.array(img)).permute(2, 0, 1), gpupipe.read_image(data, backend))
    plan = lambda h, w: Box(3, 5, h - 9, w - 12, flip=True)
    alone, _ = decoder.crop(data, "x.jpg", plan, 24)
    slot = torch.zeros(2, 24, 24, 3, dtype=torch.uint8)
    view, _ = decoder.crop(data, "x.jpg", plan, 24, slot[1])
    assert torch.equal(slot[1], torch.from_numpy(np.ascontiguousarray(alone)).permute(1, 2, 0))
    assert view.shape == (3, 24, 24) and view.data_ptr() == slot[1].data_ptr() and not slot[0].any()
    array = np.zeros((24, 24, 3), dtype=np.uint8)
    view, _ = decoder.crop(data, "x.jpg", plan, 24, array)
    assert np.shares_memory(view, array) and np.array_equal(view, alone)


@pytest.mark.slow  # a fresh interpreter
def test_read_image_of_a_one_pixel_image_is_a_writable_copy_without_a_warning(tmp_path):
    """A 1x1 image's (3, 1, 1) transpose is already contiguous: the tensor is still a copy, not a view over PIL's
    read-only buffer (torch warns of those once per process, so a fresh interpreter asks; the CPU decoders share
    ``chw_tensor`` with every backend's ``read_image`` of a Pillow-only file)."""
    for fmt in ("jpg", "png"):
        Image.new("RGB", (1, 1), (10, 20, 30)).save(tmp_path / f"one.{fmt}")
    script = (
        "import gpupipe, sys\n"
        f"for backend in {DECODERS!r}:\n"
        "    for name in ('one.jpg', 'one.png'):\n"
        "        img = gpupipe.read_image(name, backend)\n"
        "        img += 1\n"
        "        assert img.flatten().tolist() == [11, 21, 31], (backend, name, img.flatten().tolist())\n"
    )
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    run = subprocess.run(
        [sys.executable, "-W", "error", "-c", script],
        cwd=tmp_path,
        capture_output=True,
        text=True,
        env=env,
        timeout=120,
    )
    assert run.returncode == 0 and not run.stderr, run.stderr


def test_crops_mirrored_on_several_threads_at_once_are_each_their_own():
    """A mirrored crop goes through a scratch image: each thread has its own (a dali or nvjpeg loader's thread, the
    held set's decode threads and the caller may crop at once), so no image gets another's pixels."""
    failures = []

    def run(level):
        img = np.full((40, 40, 3), level, np.uint8)
        for _ in range(1000):
            out = crop_resize(img, Box(0, 0, 40, 40, True), (40, 40), 24)
            if not (out == level).all():
                failures.append(level)
                return

    threads = [threading.Thread(target=run, args=(v,)) for v in (10, 200, 90)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not failures
