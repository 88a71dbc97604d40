"""The turbojpeg backend's window decode (gpupipe/_jpeg_window.c, ``TurboJpegDecoder._window``): only the crop's part
of a JPEG decoded, with the pixels of the whole image's decode cut, for every chroma subsampling, progressive,
arithmetic-coded and grey files, every EXIF orientation and DCT reduction; bad input a clear error; a truncated file
judged as the whole decode judges it."""

import io
import shutil
import subprocess
import sysconfig
import warnings
from pathlib import Path

import numpy as np
import pytest

from gpupipe.backends import turbojpeg as tj_backend
from gpupipe.errors import DecodeError
from gpupipe.image import (
    TRUNCATED,
    ends_after,
    ends_whole,
    exif_block_orientation,
    jpeg_exif_orientation,
    pixel_window,
    stored_window,
    upright_array,
)
from gpupipe.recipe import Box, Recipe

from .common_utils import VALID, jpeg_with_orientation, photo

pytest.importorskip("turbojpeg")


def _buildable() -> str | None:
    """Why `pip install` could not build the window decode here (no C compiler, Python's or libjpeg-turbo's headers),
    or None."""
    multiarch = sysconfig.get_config_var("MULTIARCH") or ""
    dirs = [sysconfig.get_config_var("INCLUDEDIR"), "/usr/include", f"/usr/include/{multiarch}", "/usr/local/include"]
    jconfig = next((Path(d, "jconfig.h") for d in dirs if d and Path(d, "jconfig.h").exists()), None)
    if not any(Path(d, "jpeglib.h").exists() for d in dirs if d):
        return "no jpeglib.h (apt-get install libjpeg-dev)"
    if jconfig is None or "LIBJPEG_TURBO_VERSION" not in jconfig.read_text():
        return "the libjpeg headers are not libjpeg-turbo's"
    if not Path(sysconfig.get_paths()["include"], "Python.h").exists():
        return "no Python.h for this Python"
    if shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) is None:
        return "no C compiler"
    return None


def test_the_window_decode_is_built_where_it_can_be():
    if (why := _buildable()) is not None:
        pytest.skip(f"the package was built without its window decode: {why}")
    assert tj_backend._jpeg_window is not None and tj_backend.TurboJpegDecoder.window_decode


@pytest.fixture
def window_module():
    if tj_backend._jpeg_window is None:
        pytest.skip("the window decode is not built (no libjpeg-turbo headers at install time)")
    return tj_backend._jpeg_window


@pytest.fixture
def windows(window_module, monkeypatch) -> list[tuple]:
    """The windows decoded by the window decode, each call's arguments as it was made (the decode itself unchanged)."""
    calls: list[tuple] = []

    class Counted:
        LIBJPEG_TURBO_VERSION_NUMBER = window_module.LIBJPEG_TURBO_VERSION_NUMBER
        header = staticmethod(window_module.header)

        @staticmethod
        def decode_window(*args):
            calls.append(args[1:6])
            return window_module.decode_window(*args)

    monkeypatch.setattr(tj_backend, "_jpeg_window", Counted)
    return calls


def _decoders():
    whole = tj_backend.TurboJpegDecoder()
    whole.window_decode = False
    return whole, tj_backend.TurboJpegDecoder()


def _random_boxes(rng: np.random.Generator, h: int, w: int, count: int) -> list[Box]:
    """Train-recipe-like boxes: any size from a few pixels to the whole image, at the edges too, half mirrored."""
    boxes = [Box(0, 0, h, w), Box(h - 9, w - 7, 9, 7, flip=True), Box(0, w - 40, 33, 40)]
    for _ in range(count):
        bh, bw = int(rng.integers(1, h + 1)), int(rng.integers(1, w + 1))
        boxes.append(
            Box(int(rng.integers(0, h - bh + 1)), int(rng.integers(0, w - bw + 1)), bh, bw, bool(rng.random() < 0.5))
        )
    return boxes


def _cjpeg(*options: str):
    """A JPEG written by libjpeg-turbo's cjpeg (`make test` installs it), for what Pillow cannot write: 4:4:0 and 4:1:1
    chroma, restart markers."""

    def write(img) -> bytes:
        if shutil.which("cjpeg") is None:
            pytest.skip("cjpeg is missing (apt-get install libjpeg-turbo-progs)")
        buf = io.BytesIO()
        img.save(buf, "PPM")
        return subprocess.run(
            ["cjpeg", "-quality", "90", *options], input=buf.getvalue(), capture_output=True, check=True
        ).stdout

    return write


KINDS = {
    "420": lambda img: jpeg_with_orientation(img, 1),
    **{k: VALID[k] for k in ("444", "422", "gray", "progressive", "arithmetic")},
    "440": _cjpeg("-sample", "1x2"),
    "411": _cjpeg("-sample", "4x1"),
    "440-progressive": _cjpeg("-sample", "1x2", "-progressive"),
    "420-restarts": _cjpeg("-sample", "2x2", "-restart", "1"),
}


@pytest.mark.parametrize("kind", KINDS)
def test_window_decode_gives_the_whole_decodes_crop_to_the_bit(windows, kind):
    whole, windowed = _decoders()
    rng = np.random.default_rng(len(kind))
    data = KINDS[kind](photo(rng, 203, 317))
    crops = 0
    for box in _random_boxes(rng, 203, 317, 40):
        for size in (16, 24, 61):  # 16 leaves room for a 1/8 reduction of the larger boxes, 61 for none
            plan = lambda h, w, box=box: box
            want, _ = whole.crop(data, "x.jpg", plan, size)
            got, fell_back = windowed.crop(data, "x.jpg", plan, size)
            assert not fell_back and np.array_equal(got, want), (kind, box, size)
            crops += 1
    assert len(windows) == crops  # every crop by the window decode (the whole decoder's none)
    assert {w[0] for w in windows} == {1, 2, 4, 8}  # at every DCT reduction


@pytest.mark.parametrize("kind", ["420", "444", "gray", "progressive", "440", "420-restarts"])
def test_the_eval_crop_decodes_only_what_its_resize_reads_and_gives_the_whole_decodes_crop(windows, kind):
    """The eval recipe's box is fractional (resize the whole image, then cut the centre): the decoded pixels are those
    the cut's resize reads, in an image whose other pixels are left as they were (here 255s, a stale image's), and
    the crop is the whole decode's to the bit, at every DCT reduction, landscape and portrait."""
    whole, windowed = _decoders()
    rng = np.random.default_rng(len(kind) + 7)
    crops = 0
    for h, w in ((203, 317), (317, 203), (96, 97)):
        data = KINDS[kind](photo(rng, h, w))
        for size in (8, 24, 61, 90):  # 8 and 24: reduced decodes; 61, 90: none
            plan = Recipe(size).eval_box
            tj_backend._CANVAS.buf = np.full(h * w * 3, 255, np.uint8)  # what the window does not decode stays 255
            want, _ = whole.crop(data, "x.jpg", plan, size)
            got, fell_back = windowed.crop(data, "x.jpg", plan, size)
            assert not fell_back and np.array_equal(got, want), (kind, (h, w), size)
            crops += 1
    assert len(windows) == crops
    denom_hw = {1: (203, 317), 2: (102, 159), 4: (51, 80), 8: (26, 40)}
    first = [w for w in windows[:4]]  # the landscape image's: the columns beside the centre are not decoded
    assert all(wh[3] < denom_hw[wh[0]][1] for wh in first), first
    assert {w[0] for w in windows} >= {1, 2}


def test_the_eval_cuts_reads_cover_its_resizes_supports():
    """resized_cut_reads against torch's own resize: the cut is the same when every pixel outside its reads is
    changed."""
    import torch

    from gpupipe.image import crop_resize_into, resized_cut_reads

    rng = np.random.default_rng(3)
    for h, w, size in ((203, 317, 61), (317, 203, 24), (50, 40, 90), (375, 500, 224)):
        box = Recipe(size).eval_box(h, w)
        top, left, rh, rw = resized_cut_reads(box, (h, w), (h, w), size)
        img = rng.integers(0, 256, (h, w, 3), dtype=np.uint8)
        base = torch.empty(size, size, 3, dtype=torch.uint8)
        crop_resize_into(img, box, (h, w), base)
        outside = img.copy()
        outside[:top], outside[top + rh :], outside[:, :left], outside[:, left + rw :] = 0, 0, 0, 0
        again = torch.empty_like(base)
        crop_resize_into(outside, box, (h, w), again)
        assert torch.equal(base, again), (h, w, size)
        assert (top, left, rh, rw) != (0, 0, h, w) or size > min(h, w)  # the reads are less than the image


@pytest.mark.parametrize("orientation", range(1, 9))
def test_window_decode_of_a_turned_file_is_the_upright_crop_to_the_bit(windows, orientation):
    whole, windowed = _decoders()
    rng = np.random.default_rng(orientation)
    data = jpeg_with_orientation(photo(rng, 150, 238), orientation)
    upright = (238, 150) if orientation > 4 else (150, 238)
    for box in _random_boxes(rng, *upright, 25):
        for size in (16, 40):
            want, _ = whole.crop(data, "x.jpg", lambda h, w, box=box: box, size)
            got, _ = windowed.crop(data, "x.jpg", lambda h, w, box=box: box, size)
            assert np.array_equal(got, want), (orientation, box, size)
    assert len(windows) == 2 * 28


@pytest.mark.parametrize("orientation", range(1, 9))
def test_the_stored_window_turned_upright_is_the_upright_window(orientation):
    stored = np.arange(7 * 11 * 3).reshape(7, 11, 3)
    upright = upright_array(stored, orientation)
    for window in [(0, 0, 1, 1), (1, 2, 3, 4), (0, 0, *upright.shape[:2]), (2, 1, 1, upright.shape[1] - 1)]:
        top, left, h, w = stored_window(window, orientation, upright.shape[:2])
        t, le, wh, ww = window
        assert np.array_equal(
            upright_array(stored[top : top + h, left : left + w], orientation), upright[t : t + wh, le : le + ww]
        )


def test_a_box_that_is_not_a_cut_of_the_image_has_no_window():
    assert pixel_window(Box(-4, 0, 20, 20, fill="reflect"), (50, 50), (50, 50)) is None  # past the edge
    assert pixel_window(Box(2.5, 3.5, 40.0, 40.0), (50, 50), (50, 50)) is None  # the eval recipe's fractions
    assert pixel_window(Box(8, 4, 24, 40), (50, 50), (25, 25)) == (4, 2, 12, 20)  # on a 1/2 reduction's grid


def test_a_truncated_file_is_refused_whatever_the_crop(window_module, tmp_path):
    """A file cut short keeps its top rows: a crop there alone could be decoded. It is refused as the whole decode
    refuses it, so a file is good or bad whatever an epoch's crop."""
    data = jpeg_with_orientation(photo(np.random.default_rng(1), 160, 160), 1)
    cut = data[: len(data) * 2 // 3]
    for decoder in _decoders():
        with pytest.raises(DecodeError) as e:
            decoder.crop(cut, "cut.jpg", lambda h, w: Box(0, 0, 20, 20), 16)
        assert e.value.reason == TRUNCATED and "cut.jpg" in str(e.value)


def test_a_truncated_file_whose_header_holds_an_end_marker_is_refused(windows):
    """An EXIF thumbnail is a JPEG inside the header, with its own end marker: in the last bytes of a small file cut
    short, it is no sign that the file is whole."""
    rng = np.random.default_rng(4)
    thumbnail = jpeg_with_orientation(photo(rng, 24, 24), 1)
    comment = b"\xff\xfe" + (len(thumbnail) + 2).to_bytes(2, "big") + thumbnail  # a segment holding it
    data = jpeg_with_orientation(photo(rng, 96, 96), 1)
    cut = (data[:2] + comment + data[2:])[: len(comment) + 1200]
    assert len(cut) - cut.rfind(b"\xff\xd9") < 4096  # the thumbnail's marker is among the last bytes
    with pytest.raises(DecodeError) as e:
        tj_backend.TurboJpegDecoder().crop(cut, "cut.jpg", lambda h, w: Box(0, 0, 8, 8), 8)
    assert e.value.reason == TRUNCATED and not windows


def test_corrupt_data_inside_the_window_is_the_whole_decodes_error(window_module):
    data = bytearray(jpeg_with_orientation(photo(np.random.default_rng(2), 160, 160), 1))
    scan = data.index(b"\xff\xda")  # start of scan: the entropy-coded data follows its header
    data[scan + 60 : scan + 62] = b"\xff\xd3"  # a restart marker where none belongs, in the top rows
    errors = []
    for decoder in _decoders():
        with pytest.raises(DecodeError) as e:
            decoder.crop(bytes(data), "bad.jpg", lambda h, w: Box(0, 0, 40, 40), 16)
        errors.append(str(e.value))
    assert errors[0] == errors[1] and "bad.jpg" in errors[0] and "Corrupt JPEG data" in errors[0]


def _header_files() -> dict[str, bytes]:
    """Every kind of file the window decode's header reader must read as TurboJPEG and the header walk do."""
    rng = np.random.default_rng(5)
    img = photo(rng, 64, 96)
    files = {kind: write(img) for kind, write in KINDS.items() if not kind.startswith(("440", "411", "420-"))}
    files.update({f"orientation-{o}": jpeg_with_orientation(img, o) for o in range(2, 9)})
    files["cmyk"] = VALID["cmyk"](img)
    xmp = b"http://ns.adobe.com/xap/1.0/\x00<x/>"
    files["xmp-before-exif"] = (lambda d: d[:2] + b"\xff\xe1" + (len(xmp) + 2).to_bytes(2, "big") + xmp + d[2:])(
        jpeg_with_orientation(img, 6)
    )
    whole = files["420"]
    files["truncated"] = whole[: len(whole) // 2]
    files["cut-in-header"] = whole[:40]
    files["not-a-jpeg"] = b"GIF89a" + bytes(100)
    return files


def test_the_window_modules_header_reads_what_turbojpeg_and_the_header_walk_read(window_module):
    """One C call reads the header for the window decode: the size, CMYK, the EXIF orientation and where the header
    ends, as TurboJPEG's header reader, the EXIF walk and ends_whole read them; a broken header is an error."""
    from turbojpeg import TJCS_CMYK, TJCS_YCCK, TurboJPEG

    tj = TurboJPEG()
    for kind, data in _header_files().items():
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("error")  # as the backend reads it: a warning is a header TurboJPEG rejects
                width, height, _, colorspace = tj.decode_header(data)
        except (OSError, Warning):
            width = height = 0
        if not width:  # TurboJPEG rejects it, or reads 0 x 0 (cut before its frame header)
            with pytest.raises((OSError, RuntimeWarning)):
                window_module.header(data)
            continue
        got_h, got_w, cmyk, end, exif = window_module.header(data)
        assert (got_h, got_w, cmyk) == (height, width, colorspace in (TJCS_CMYK, TJCS_YCCK)), kind
        assert (1 if exif is None else exif_block_orientation(exif)) == jpeg_exif_orientation(data), kind
        assert ends_after(data, end) == ends_whole(data), kind
        assert data.rfind(b"\xff\xda", 0, end) > 0 and len(data) > end, kind  # read up to the first scan's data


def test_a_file_whose_first_app1_block_is_not_exif_is_turned_by_its_exif_block(windows):
    data = _header_files()["xmp-before-exif"]
    whole, windowed = _decoders()
    plan = lambda h, w: Box(0, 0, h, w)
    got, _ = windowed.crop(data, "x.jpg", plan, 32)
    want, _ = whole.crop(data, "x.jpg", plan, 32)
    assert np.array_equal(got, want) and len(windows) == 1
    assert got.shape == (3, 32, 32) and windowed._window_header(data, "x.jpg").upright == (96, 64)


def test_decode_window_refuses_what_it_cannot_do(window_module):
    data = jpeg_with_orientation(photo(np.random.default_rng(3), 40, 60), 1)
    out = np.empty((10, 10, 3), np.uint8)
    with pytest.raises(ValueError, match="denom must be 1, 2, 4 or 8, not 3"):
        window_module.decode_window(data, 3, 0, 0, 10, 10, out)
    with pytest.raises(ValueError, match="not inside the image reduced 1/2"):
        window_module.decode_window(data, 2, 15, 0, 10, 10, out)  # rows 15-24 of a 20-row image
    with pytest.raises(ValueError, match="contiguous buffer of 10 x 12 x 3"):
        window_module.decode_window(data, 1, 0, 0, 10, 12, out)
    with pytest.raises(ValueError, match="not a window"):
        window_module.decode_window(data, 1, -1, 0, 10, 10, out)
    with pytest.raises(OSError, match="Not a JPEG file"):
        window_module.decode_window(b"GIF89a" + bytes(100), 1, 0, 0, 10, 10, out)
    with pytest.raises(TypeError):
        window_module.decode_window(data, 1, 0, 0, 10, 10, bytes(300))  # read-only out
