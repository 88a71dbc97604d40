"""Bytes-safe file names (_names) wherever gpupipe writes them: names that are not UTF-8, or hold a newline."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from gpupipe._names import escape, unescape

from .common_utils import make_folder


@pytest.mark.parametrize(
    "name, written",
    [
        ("plain/name [1].jpg", "plain/name [1].jpg"),
        ("caf\u00e9/\u732b.jpg", "caf\u00e9/\u732b.jpg"),  # valid UTF-8 stays as it is
        (os.fsdecode(b"bad\xff.jpg"), "bad\\xff.jpg"),
        ("new\nline\ttab\rcr.jpg", "new\\nline\\ttab\\rcr.jpg"),
        ("back\\slash\\xff.jpg", "back\\\\slash\\\\xff.jpg"),  # a literal backslash cannot pass for an escape
        ("esc\x1b[31m.jpg", "esc\\x1b[31m.jpg"),
        ("c1\x85 sep\u2028.jpg", "c1\\u0085 sep\\u2028.jpg"),
    ],
)
def test_escape_writes_one_utf8_line_and_unescape_gives_the_name_back(name, written):
    assert escape(name) == written
    assert escape(os.fsencode(name)) == written
    assert unescape(written) == name
    written.encode("utf-8")  # never a surrogate


def test_every_byte_round_trips():
    name = os.fsdecode(bytes(b for b in range(1, 256) if b != ord("/")))
    text = escape(name)
    assert "\n" not in text and "\r" not in text and "\t" not in text
    text.encode("utf-8")
    assert os.fsencode(unescape(text)) == os.fsencode(name)


@pytest.fixture()
def odd_names(tmp_path):
    """An ImageFolder with two undecodable files: one named in Latin-1 (not UTF-8), one with a newline in its name;
    and a good image under a name with brackets and an accent."""
    root = make_folder(tmp_path / "data", 2, 4)
    bad = os.path.join(os.fsencode(root), b"c00", b"bad\xff.jpg")
    with open(bad, "wb") as f:
        f.write(b"not a jpeg")
    (root / "c01" / "new\nline.jpg").write_bytes(b"not a jpeg")
    (root / "c01" / "good\u00e9 [x].jpg").write_bytes((root / "c01" / "000.jpg").read_bytes())
    return root


def _cli(*args):
    return subprocess.run([sys.executable, "-m", "gpupipe", *map(str, args)], capture_output=True, timeout=300)


@pytest.mark.slow
def test_train_with_on_error_skip_writes_one_record_per_skipped_file_and_resumes(odd_names, tmp_path):
    args = ["train", "--data", odd_names, "--out", tmp_path / "run", "--model", "test_resnet", "--epochs", "1"]
    args += ["--batch-size", "4", "--image-size", "32", "--workers", "0", "--device", "cpu", "--on-error", "skip"]
    r = _cli(*args)
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    lines = (tmp_path / "run" / "skipped.txt").read_text(encoding="utf-8").splitlines()
    assert len(lines) == 2
    names = sorted(unescape(line.split("\t")[1]) for line in lines)
    assert [os.fsencode(n) for n in names] == sorted(
        [os.path.join(os.fsencode(odd_names), b"c00", b"bad\xff.jpg"), os.fsencode(odd_names / "c01" / "new\nline.jpg")]
    )
    assert b"bad\\xff.jpg" in r.stderr and b"new\\nline.jpg" in r.stderr  # the log names them escaped, too
    r = _cli(*args, "--resume", "--epochs", "2", "--allow-config-change")
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    assert len((tmp_path / "run" / "skipped.txt").read_text(encoding="utf-8").splitlines()) == 4


@pytest.mark.slow
def test_prepare_and_check_take_any_name(odd_names, tmp_path):
    r = _cli("prepare", odd_names, tmp_path / "prep", "--workers", "1")
    assert r.returncode == 0, r.stderr.decode(errors="replace")
    meta = json.loads((tmp_path / "prep" / "gpupipe.json").read_bytes().decode("utf-8"))
    left_out = sorted(os.fsencode(r["path"]) for r in meta["left_out"])
    assert left_out[0].endswith(b"c00/bad\xff.jpg") and left_out[1].endswith(b"c01/new\nline.jpg")
    assert meta["samples"] == 9
    r = _cli("check", "--json", odd_names)
    report = json.loads(r.stdout.decode("utf-8"))
    assert sorted(os.fsencode(x["path"]) for x in report["unreadable"])[0].endswith(b"bad\xff.jpg")
    assert report["files"] == 11


def test_check_lines_name_each_file_on_one_line(odd_names, capsys):
    from gpupipe.cli import main

    assert main(["check", str(odd_names), "--workers", "1"]) == 1
    out = capsys.readouterr().out.replace("\n", "")  # (rich wraps at 80 columns off a terminal: issue 25's)
    assert "c00/bad\\xff.jpg: not a readable image" in out and "c01/new\\nline.jpg: not a readable image" in out
