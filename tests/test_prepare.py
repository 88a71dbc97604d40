"""gpupipe prepare: shards that load as their source does, re-encoding of what is slow or unusual, bad files reported
and left out, and an interrupted run that resumes to the same bytes."""

import io
import json
import os
import signal
import subprocess
import sys
import textwrap
from pathlib import Path

import numpy as np
import pytest
import torch
from PIL import Image
from torchvision.datasets import ImageFolder

import gpupipe
from gpupipe.cli import main
from gpupipe.image import jpeg_sof
from gpupipe.prepare import PrepareOptions, convert, parse_size, prepare
from gpupipe.sources.open import open_source as scan

from .common_utils import (
    ORIENTED_FORMATS,
    REPO_ROOT,
    exif_upright,
    gpupipe_cli,
    make_folder,
    photo,
    with_orientation,
)

LOADERS = [
    pytest.param(b, marks=pytest.mark.skipif(b not in gpupipe.available_backends(), reason=f"no {b}"))
    for b in ("pillow", "turbojpeg", "dali")
]
SMALL = PrepareOptions(shard_size=parse_size("16KB"))  # a few samples per shard


def _files(folder: Path) -> dict[str, bytes]:
    return {p.name: p.read_bytes() for p in sorted(folder.iterdir())}


@pytest.fixture(scope="module")
def prepared(folder, tmp_path_factory):
    out = tmp_path_factory.mktemp("prepared") / "out"
    prepare(folder, out, SMALL)
    return out


@pytest.mark.parametrize("backend", LOADERS)
def test_prepared_set_loads_as_its_source(folder, prepared, backend):
    kw = dict(batch_size=5, train=False, image_size=32, num_workers=1, normalize=False, device="cpu")
    shards, files = gpupipe.build_loader(prepared, backend, **kw), gpupipe.build_loader(folder, backend, **kw)
    tv = ImageFolder(str(folder))
    assert shards.dataset.classes == tv.classes and shards.dataset.class_to_idx == tv.class_to_idx
    assert shards.dataset.targets == tv.targets
    with np.load(prepared / "index.npz") as z:
        assert z["source"].tolist() == [p for p, _ in tv.samples]  # the same samples, in the same order
    a, b = list(shards), list(files)
    assert torch.equal(torch.cat([y for _, y in a]), torch.tensor(tv.targets))
    assert torch.equal(torch.cat([x for x, _ in a]), torch.cat([x for x, _ in b]))  # bytes copied as they were


def test_metadata_and_shards_hold_the_webdataset_layout(folder, prepared):
    import tarfile

    meta = json.loads((prepared / "gpupipe.json").read_text())
    assert meta["format"] == "gpupipe-shards" and meta["version"] == 1 and meta["samples"] == 24
    assert meta["options"]["shard_size"] == 16 * 1024 and meta["left_out"] == [] and meta["copied"] == 24
    assert len(meta["shards"]) > 1
    with tarfile.open(prepared / meta["shards"][0]) as tf:
        names = tf.getnames()
        assert names[:2] == ["00000000.jpg", "00000000.cls"]
        assert tf.extractfile("00000000.cls").read() == b"0"
        assert tf.extractfile("00000000.jpg").read() == (folder / "c00" / "000.jpg").read_bytes()
    data = scan(prepared)
    assert list(data.sizes) == [Image.open(p).size[::-1] for p, _ in ImageFolder(str(folder)).samples]
    assert all(p.stat().st_size <= 16 * 1024 for p in prepared.glob("*.tar"))


def jpeg_bytes(img, **kw) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "JPEG", **kw)
    return buf.getvalue()


def _png(img) -> bytes:
    buf = io.BytesIO()
    img.save(buf, "PNG")
    return buf.getvalue()


def _rotated(img) -> bytes:
    exif = Image.Exif()
    exif[0x0112] = 6
    return jpeg_bytes(img, quality=95, exif=exif)


BASE = photo(np.random.default_rng(3), 60, 90)
CASES = {  # name: (bytes, options, expected change, upright (h, w) of the result)
    "baseline": (jpeg_bytes(BASE, quality=90), PrepareOptions(), (), (60, 90)),
    "progressive": (jpeg_bytes(BASE, progressive=True), PrepareOptions(), ("progressive",), (60, 90)),
    "cmyk": (jpeg_bytes(BASE.convert("CMYK")), PrepareOptions(), ("CMYK JPEG",), (60, 90)),
    "png": (_png(BASE), PrepareOptions(), ("PNG (not JPEG)",), (60, 90)),
    "rotated": (_rotated(BASE), PrepareOptions(), ("EXIF orientation",), (90, 60)),
    "444_keep": (jpeg_bytes(BASE, subsampling=0), PrepareOptions(), (), (60, 90)),
    "444_to_420": (jpeg_bytes(BASE, subsampling=0), PrepareOptions(subsampling="420"), ("4:4:4",), (60, 90)),
    "large": (jpeg_bytes(BASE), PrepareOptions(max_side=45), ("larger than max-side",), (30, 45)),
    "large_rotated": (
        _rotated(BASE),
        PrepareOptions(max_side=45),
        ("EXIF orientation", "larger than max-side"),
        (45, 30),
    ),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_slow_or_unusual_files_become_baseline_rgb_jpegs(case):
    data, options, changes, size = CASES[case]
    out = convert(data, "x.img", options)
    assert out.reason is None and out.changes == changes and (out.height, out.width) == size
    if not changes:
        assert out.data == data  # copied byte for byte
        return
    img = Image.open(io.BytesIO(out.data))
    assert jpeg_sof(out.data) == 0xC0 and img.mode == "RGB" and not img.getexif()  # baseline, RGB, no orientation
    assert img.size == (size[1], size[0])
    ref = gpupipe.read_image(data, "pillow").float()[None]
    ref = torch.nn.functional.interpolate(ref, size=size, mode="bilinear", antialias=True)[0]
    assert (gpupipe.read_image(out.data, "pillow").float() - ref).abs().mean() < 8  # the same picture, upright


@pytest.mark.parametrize("fmt", ORIENTED_FORMATS)
def test_files_with_an_orientation_are_stored_upright_in_every_format(fmt):
    """A file turned by its EXIF tag is stored as ``exif_transpose`` turns it, whatever its format (Pillow's TIFF
    loader turns a TIFF itself: it must not be turned twice)."""
    data = with_orientation(BASE, fmt, 6)
    out = convert(data, "x.img", PrepareOptions())
    assert out.reason is None and out.changes  # stored anew: baseline JPEG, no tag
    want = np.asarray(exif_upright(data), dtype=np.float32)
    got = np.asarray(Image.open(io.BytesIO(out.data)), dtype=np.float32)
    assert (out.height, out.width) == want.shape[:2] == got.shape[:2] == (90, 60)
    assert np.abs(got - want).mean() < 4


def test_bad_files_are_reported_and_left_out(tmp_path, capsys):
    src = make_folder(tmp_path / "src", 2, 3)
    good = (src / "c00" / "000.jpg").read_bytes()
    (src / "c00" / "truncated.jpg").write_bytes(good[: len(good) // 2])
    (src / "c01" / "empty.jpg").write_bytes(b"")
    (src / "c01" / "text.png").write_bytes(b"not an image")
    assert main(["prepare", str(src), str(tmp_path / "out"), "--workers", "2"]) == 0
    printed = "".join(capsys.readouterr().out.split())  # rich wraps long lines
    meta = json.loads((tmp_path / "out" / "gpupipe.json").read_text())
    bad = {Path(r["path"]).name: r["reason"] for r in meta["left_out"]}
    assert sorted(bad) == ["empty.jpg", "text.png", "truncated.jpg"]
    assert bad["empty.jpg"] == "empty file" and "truncated" in bad["truncated.jpg"]
    for r in meta["left_out"]:  # reported as `gpupipe check` reports them
        assert "".join(f"unreadable {r['path']}: {r['reason']}".split()) in printed
    assert "3leftout" in printed
    assert scan(tmp_path / "out").targets == [0, 0, 0, 1, 1, 1]


def test_workers_give_the_same_bytes(folder, tmp_path):
    prepare(folder, tmp_path / "one", SMALL, workers=1)
    prepare(folder, tmp_path / "two", SMALL, workers=2)
    assert _files(tmp_path / "one") == _files(tmp_path / "two")


_KILLED_RUN = """
import os, signal, sys
import gpupipe.prepare as p

add, written = p.ShardWriter.add, []
def add_then_die(self, *args):
    add(self, *args)
    written.append(1)
    if len(written) == {kill_at}:  # mid-shard: SIGKILL, no clean-up of any kind
        os.kill(os.getpid(), signal.SIGKILL)
p.ShardWriter.add = add_then_die
p.prepare(sys.argv[1], sys.argv[2], p.PrepareOptions(shard_size={shard_size}, order="{order}"))
"""


@pytest.mark.slow  # `gpupipe prepare` processes, one killed
def test_an_interrupted_prepare_resumes_to_the_same_result(folder, tmp_path, prepared):
    out = tmp_path / "out"
    script = textwrap.dedent(_KILLED_RUN).format(kill_at=11, shard_size=SMALL.shard_size, order="source")
    run = subprocess.run([sys.executable, "-c", script, str(folder), str(out)], capture_output=True, text=True)
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert not (out / "gpupipe.json").exists() and (out / ".prepare-plan.json").exists()
    complete = sorted(p.name for p in out.glob("shard-*.tar"))
    assert complete and list(out.glob(".shard-*.tar.tmp"))  # some shards done, one cut short
    # a shard that looks complete but is not (a torn write) must be written again, not kept
    last = out / complete[-1]
    last.write_bytes(last.read_bytes()[:-512])
    with pytest.raises(FileExistsError, match=rf"other settings \(--shard-size {SMALL.shard_size} -> "):
        prepare(folder, out, PrepareOptions(shard_size=SMALL.shard_size * 2))
    summary = prepare(folder, out, SMALL)
    assert 0 < summary.resumed_at < 24
    assert _files(out) == _files(prepared)  # byte for byte what an uninterrupted run writes
    assert prepare(folder, out, SMALL).up_to_date


_PAUSED_RUN = """
import sys, time
import gpupipe.prepare as p

add = p.ShardWriter.add
def add_then_wait(self, *args):
    add(self, *args)
    print("writing", flush=True)
    time.sleep(120)
p.ShardWriter.add = add_then_wait
p.prepare(sys.argv[1], sys.argv[2], p.PrepareOptions(shard_size={shard_size}))
"""


@pytest.mark.slow  # two processes
def test_a_second_prepare_into_the_same_folder_is_refused_naming_the_first(folder, tmp_path, prepared):
    """Two ``gpupipe prepare`` into one folder: the second is one line naming the first (it used to delete the first's
    temp shard from under it); once the first is gone, the folder resumes to the same bytes."""
    out = tmp_path / "out"
    script = textwrap.dedent(_PAUSED_RUN).format(shard_size=SMALL.shard_size)
    first = subprocess.Popen(
        [sys.executable, "-c", script, str(folder), str(out)], stdout=subprocess.PIPE, text=True, env=_env()
    )
    try:
        assert first.stdout is not None and first.stdout.readline() == "writing\n"
        temp = list(out.glob(".shard-*.tar.tmp"))
        second = gpupipe_cli("prepare", folder, out, "--shard-size", "16KB", "--workers", "1")
        lines = second.stderr.strip().splitlines()
        assert second.returncode == 2 and len(lines) == 1, second.stderr
        assert lines[0].startswith(f"error: {out}: in use by another run (pid {first.pid} on "), lines
        assert temp and all(t.exists() for t in temp)  # the first's work is untouched
    finally:
        first.kill()
        first.wait()
    prepare(folder, out, SMALL)  # the first shard was cut short: written again
    assert _files(out) == _files(prepared)


_PAUSED_CLI = """
import sys, time
import gpupipe.prepare as p
from gpupipe.cli import main

add = p.ShardWriter.add
def add_then_wait(self, *args):
    add(self, *args)
    print("writing", flush=True)
    time.sleep(120)
p.ShardWriter.add = add_then_wait
sys.exit(main(["prepare", *sys.argv[1:], "--shard-size", "16KB", "--workers", "2"]))
"""


@pytest.mark.slow  # a process and its workers
def test_ctrl_c_on_prepare_is_one_line_saying_how_to_resume(folder, tmp_path, prepared):
    """Ctrl-C reaches the process group, the workers too: one line (no traceback from the main process or a worker)
    and exit 130; the same command then resumes to the bytes of an uninterrupted run."""
    out = tmp_path / "out"
    run = subprocess.Popen(
        [sys.executable, "-c", _PAUSED_CLI, str(folder), str(out)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        env=_env(),
        start_new_session=True,  # its own process group, as a terminal's foreground job
    )
    try:
        assert run.stdout is not None and run.stdout.readline() == "writing\n"
        os.killpg(run.pid, signal.SIGINT)  # what Ctrl-C in a terminal sends
        _, err = run.communicate(timeout=120)
    finally:
        run.kill()
    assert run.returncode == 130 and err.splitlines() == [
        "interrupted: stopped; the shards written whole are kept: run the same command again to resume (it writes "
        "the shards an uninterrupted run writes)"
    ], err
    assert main(["prepare", str(folder), str(out), "--shard-size", "16KB"]) == 0
    assert _files(out) == _files(prepared)


def _env() -> dict:
    return {**os.environ, "PYTHONPATH": str(REPO_ROOT)}


@pytest.mark.slow
def test_shuffled_order_spreads_the_classes_over_the_shards_and_resumes(folder, tmp_path):
    """``order="shuffled"``: the shards hold the samples in one fixed random order (each sample once, its label kept),
    so a shard holds more classes than in the source's class-by-class order; an interrupted run resumes to the same
    bytes; a set prepared in the source's order keeps its plan (no ``order`` in it), as sets prepared before."""
    shuffled = PrepareOptions(shard_size=SMALL.shard_size, order="shuffled")
    prepare(folder, tmp_path / "straight", shuffled)
    tv = ImageFolder(str(folder))
    perm = shuffled.sample_order(len(tv.samples))
    assert sorted(perm.tolist()) == list(range(len(tv.samples))) and perm.tolist() != sorted(perm.tolist())
    loaded = gpupipe.build_loader(tmp_path / "straight", "pillow", batch_size=24, train=False, image_size=16)
    assert loaded.dataset.targets == [tv.targets[i] for i in perm]  # the set's sample numbers follow the order
    with np.load(tmp_path / "straight" / "index.npz") as z:
        assert z["source"].tolist() == [tv.samples[i][0] for i in perm]
        classes_per_shard = {k: len(set(z["label"][z["shard"] == k].tolist())) for k in set(z["shard"].tolist())}
    with np.load(tmp_path / "straight" / "index.npz") as z, np.load(_prepared_in_order(folder, tmp_path)) as y:
        in_order = {k: len(set(y["label"][y["shard"] == k].tolist())) for k in set(y["shard"].tolist())}
    assert np.mean(list(classes_per_shard.values())) > np.mean(list(in_order.values()))
    out = tmp_path / "resumed"
    script = textwrap.dedent(_KILLED_RUN).format(kill_at=11, shard_size=SMALL.shard_size, order="shuffled")
    run = subprocess.run([sys.executable, "-c", script, str(folder), str(out)], capture_output=True, text=True)
    assert run.returncode == -signal.SIGKILL, run.stderr
    assert 0 < prepare(folder, out, shuffled).resumed_at < 24
    assert _files(out) == _files(tmp_path / "straight")
    meta = json.loads((out / "gpupipe.json").read_text())
    assert meta["options"]["order"] == "shuffled"
    with pytest.raises(FileExistsError, match=r"other settings \(--order shuffled -> source\)"):
        prepare(folder, out, SMALL)  # the same folder in the source's order: another set


def _prepared_in_order(folder, tmp_path) -> Path:
    prepare(folder, tmp_path / "in-order", SMALL)
    assert "order" not in json.loads((tmp_path / "in-order" / "gpupipe.json").read_text())["options"]
    return tmp_path / "in-order" / "index.npz"


def test_prepare_refuses_a_folder_it_did_not_write(folder, tmp_path):
    (tmp_path / "notes.txt").write_text("mine")
    with pytest.raises(FileExistsError, match="not empty"):
        prepare(folder, tmp_path, SMALL)
    with pytest.raises(ValueError, match="inside the source"):
        prepare(folder, folder / "shards", SMALL)
    assert not (folder / "shards").exists()


def test_parse_size_and_options():
    assert parse_size("512MB") == 512 * 2**20 and parse_size("2GiB") == 2 * 2**30 and parse_size("100") == 100
    assert parse_size("1.5k") == 1536
    with pytest.raises(ValueError, match="512MB"):
        parse_size("lots")
    with pytest.raises(ValueError, match="'keep' or '420'"):
        PrepareOptions(subsampling="444")
    with pytest.raises(ValueError, match="'source' or 'shuffled'"):
        PrepareOptions(order="random")


def test_cli_flags_reach_the_options(tmp_path):
    src = make_folder(tmp_path / "src", 2, 2)
    args = ["--max-side", "64", "--quality", "80", "--shard-size", "20KB", "--subsampling", "420", "--workers", "1"]
    assert main(["prepare", str(src), str(tmp_path / "out"), *args, "--order", "shuffled"]) == 0
    meta = json.loads((tmp_path / "out" / "gpupipe.json").read_text())
    expected = {"max_side": 64, "quality": 80, "shard_size": 20 * 1024, "subsampling": "420", "order": "shuffled"}
    assert meta["options"] == expected
    assert max(max(hw) for hw in scan(tmp_path / "out").sizes) == 64
