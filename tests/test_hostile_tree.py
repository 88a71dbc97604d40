"""Hostile data sets through the commands, as the probe made them: folder links, loops, a class linked outside the
root, labels that would allocate billions of classes."""

from __future__ import annotations

import io
import json

import pytest

from gpupipe.cli import main
from gpupipe.errors import GpupipeError
from gpupipe.prepare import PrepareOptions, prepare
from gpupipe.sources.open import open_source

from .common_utils import make_folder
from .test_shards import _tar


def test_check_lists_what_the_scan_left_out(tmp_path, capsys):
    """The probe: ``check`` said '0 unreadable' for a link to the parent, two links to '.', and more."""
    root = make_folder(tmp_path / "data", 2, 3)
    (root / "c00" / "up").symlink_to("..")
    (root / "c01" / "a").symlink_to(".")
    (root / "c01" / "b").symlink_to(".")
    assert main(["check", str(root), "--json", "--workers", "1"]) == 1
    report = json.loads(capsys.readouterr().out)
    assert report["files"] == 9
    assert {r["path"] for r in report["unreadable"]} == {str(root / p) for p in ("c00/up", "c01/a", "c01/b")}


def test_prepare_does_not_copy_a_class_linked_outside_the_root(tmp_path):
    private = make_folder(tmp_path / "private", 1, 2)
    root = make_folder(tmp_path / "data", 2, 2)
    (root / "c02").symlink_to(private / "c00")
    summary = prepare(root, tmp_path / "prep", PrepareOptions(), workers=1)
    assert summary.samples == 4
    assert summary.left_out[0]["path"] == str(root / "c02")
    assert json.loads((tmp_path / "prep" / "gpupipe.json").read_text())["classes"] == ["c00", "c01"]


def test_a_huge_csv_label_is_one_line_not_a_memory_error(tmp_path):
    make_folder(tmp_path / "data", 1, 2)
    csv = tmp_path / "data" / "list.csv"
    csv.write_text("c00/000.jpg,0\nc00/001.jpg,99999999999\n")
    with pytest.raises(ValueError) as e:
        open_source(csv)
    assert str(e.value) == (
        f"{csv}:2: label 99999999999 would make more than 1,000,000 classes (labels are class indices 0..n-1; "
        "at most 1,000,000 classes)"
    )


def test_a_huge_cls_label_is_one_line_naming_the_shard(tmp_path, base):
    buf = io.BytesIO()
    base.save(buf, "JPEG")
    ok, bad = tmp_path / "a.tar", tmp_path / "b.tar"
    _tar(ok, {"k.jpg": buf.getvalue(), "k.cls": b"1"})
    _tar(bad, {"k.jpg": buf.getvalue(), "k.cls": b"99999999999"})
    with pytest.raises(GpupipeError, match=f"^{bad}: k.cls: label 99999999999 would make more than 1,000,000 classes"):
        open_source([ok, bad])


@pytest.mark.parametrize("train", [True, False])
def test_a_jpeg_cut_to_100_bytes_is_a_decode_error_under_turbojpeg(tmp_path, base, train):
    """The probe: ``ZeroDivisionError`` (libjpeg-turbo reads a 0 x 0 header from it)."""
    pytest.importorskip("turbojpeg")
    import gpupipe
    from gpupipe.errors import DecodeError

    root = make_folder(tmp_path / "data", 1, 1)
    buf = io.BytesIO()
    base.save(buf, "JPEG")
    (root / "c00" / "cut.jpg").write_bytes(buf.getvalue()[:100])
    loader = gpupipe.build_loader(root, "turbojpeg", batch_size=2, train=train, image_size=16, device="cpu")
    with pytest.raises(DecodeError, match=r"cut\.jpg: cannot decode with backend 'turbojpeg': truncated \("):
        list(loader)
