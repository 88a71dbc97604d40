"""The folder walk (sources/walk.py) on ordinary and hostile trees, built as the probe built them: real symlinks,
fifos, a folder a non-root reader cannot open, a tree 1,500 folders deep."""

from __future__ import annotations

import os
import shutil
import tempfile
import time
from pathlib import Path

import pytest
from torchvision.datasets import ImageFolder

from gpupipe.sources.walk import walk_folder

from .common_utils import make_folder


@pytest.fixture()
def tree(tmp_path):
    """4 classes x 4 images, with sub-folders as ImageFolder allows, and a non-image file."""
    root = make_folder(tmp_path / "data", 4, 3)
    (root / "c01" / "sub" / "deeper").mkdir(parents=True)
    (root / "c01" / "sub" / "deeper" / "x.png").write_bytes((root / "c01" / "000.jpg").read_bytes())
    (root / "c02" / "a").mkdir()
    (root / "c02" / "a" / "y.jpg").write_bytes((root / "c02" / "000.jpg").read_bytes())
    (root / "c03" / "notes.txt").write_text("not an image")
    return root


def test_an_ordinary_tree_walks_as_torchvision_does(tree):
    walked = walk_folder(str(tree))
    reference = ImageFolder(str(tree))
    assert walked.classes == reference.classes and walked.class_to_idx == reference.class_to_idx
    assert walked.samples == reference.samples and len(walked.samples) == 14
    assert walked.problems == []


def test_a_link_to_the_parent_is_not_followed(tree):
    """The probe: ``ln -s .. data/class_00/up`` made 656 samples of 16, 320 of them wrongly labelled."""
    (tree / "c00" / "up").symlink_to("..")
    walked = walk_folder(str(tree))
    assert len(walked.samples) == 14
    assert walked.problems == [
        (str(tree / "c00" / "up"), "a link to a folder: not followed (allow_outside_root=True follows them)")
    ]
    trusted = walk_folder(str(tree), allow_outside_root=True)  # followed, but never into a folder twice
    assert len(trusted.samples) == 14
    assert "a loop" in trusted.problems[0][1]


def test_two_links_to_dot_end_at_once(tree):
    """The probe: two links to ``.`` scanned for over a minute at 2 GB."""
    (tree / "c00" / "a").symlink_to(".")
    (tree / "c00" / "b").symlink_to(".")
    for trusted in (False, True):
        start = time.perf_counter()
        walked = walk_folder(str(tree), allow_outside_root=trusted)
        assert len(walked.samples) == 14 and time.perf_counter() - start < 2


def test_links_out_of_the_root_are_not_followed(tree, tmp_path):
    """A class folder linked to a folder outside, a file linked outside, and one linked to /dev/zero."""
    outside = make_folder(tmp_path / "private", 1, 2)
    (tree / "c04").symlink_to(outside / "c00")
    (tree / "c00" / "secret.jpg").symlink_to(outside / "c00" / "000.jpg")
    (tree / "c00" / "z.jpg").symlink_to("/dev/zero")
    (tree / "c01" / "inside.jpg").symlink_to(tree / "c02" / "000.jpg")  # inside the root: a sample
    walked = walk_folder(str(tree))
    assert walked.classes == ["c00", "c01", "c02", "c03"]
    assert (str(tree / "c01" / "inside.jpg"), 1) in walked.samples and len(walked.samples) == 15
    reasons = dict(walked.problems)
    assert reasons[str(tree / "c04")].startswith("a link to a folder: not followed")
    assert reasons[str(tree / "c00" / "secret.jpg")].startswith(f"a link out of {tree} (to {outside}")
    assert reasons[str(tree / "c00" / "z.jpg")].startswith(f"a link out of {tree} (to /dev/zero)")


def test_fifos_and_broken_links_are_left_out_and_listed(tree):
    os.mkfifo(tree / "c00" / "p.jpg")
    (tree / "c01" / "gone.jpg").symlink_to(tree / "nowhere.jpg")
    walked = walk_folder(str(tree))
    assert len(walked.samples) == 14
    assert dict(walked.problems) == {
        str(tree / "c00" / "p.jpg"): "not a regular file: a fifo",
        str(tree / "c01" / "gone.jpg"): f"a broken link (to {tree / 'nowhere.jpg'})",
    }


def test_a_tree_1500_folders_deep_is_walked(tmp_path):
    root = make_folder(tmp_path / "data", 2, 1)
    deep = str(root / "c00")
    for _ in range(1500):  # os.makedirs recurses: build it one level at a time
        deep = os.path.join(deep, "d")
        os.mkdir(deep)
    os.link(root / "c00" / "000.jpg", os.path.join(deep, "bottom.jpg"))
    try:
        walked = walk_folder(str(root))
        assert len(walked.samples) == 3 and walked.samples[1][0].endswith("/d/bottom.jpg")
    finally:  # one level at a time too: pytest's recursive clean-up of old temp folders hits the recursion limit
        os.unlink(os.path.join(deep, "bottom.jpg"))
        while deep != str(root / "c00"):
            os.rmdir(deep)
            deep = os.path.dirname(deep)


def _walk_as_nobody(root) -> str:
    """Walk ``root`` in a forked child that gave up root's right to read anything (uid/gid 65534)."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: no return into pytest from here
        try:
            os.close(read)
            os.setgroups([])
            os.setgid(65534)
            os.setuid(65534)
            w = walk_folder(str(root))
            os.write(write, f"{len(w.samples)} {w.problems}".encode())
        finally:
            os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        out = f.read()
    os.waitpid(pid, 0)
    return out


def test_a_folder_the_reader_cannot_open_is_listed():
    """The probe: a sub-folder a non-root reader cannot open silently dropped its files."""
    base = tempfile.mkdtemp()  # not under pytest's 0700 folder: the reader below must reach it
    try:
        os.chmod(base, 0o755)
        tree = make_folder(Path(base) / "data", 2, 3)
        locked = tree / "c01" / "sub"
        locked.mkdir()
        (locked / "x.jpg").write_bytes((tree / "c01" / "000.jpg").read_bytes())
        locked.chmod(0o000)
        if os.geteuid() == 0:  # root reads anything: read as nobody, as the probe did
            out = _walk_as_nobody(tree)
        else:
            w = walk_folder(str(tree))
            out = f"{len(w.samples)} {w.problems}"
        assert out.startswith("6 ") and f"('{locked}', 'cannot read the folder (Permission denied)')" in out, out
    finally:
        os.chmod(Path(base) / "data" / "c01" / "sub", 0o755)
        shutil.rmtree(base)


def test_empty_classes_are_one_short_line_however_many(tmp_path):
    """The probe: 100k empty class folders gave a 1.4 MB error line."""
    root = make_folder(tmp_path / "data", 1, 1)
    for i in range(2000):
        (root / f"empty{i:05d}").mkdir()
    with pytest.raises(FileNotFoundError) as e:
        walk_folder(str(root))
    msg = str(e.value)
    assert len(msg) < 400 and "no image file in 2000 class folder(s): empty00000," in msg and "and 1995 more" in msg


class _CountedName(str):
    """A class name that counts the comparisons made with it (``in`` a list compares with every element)."""

    compared = 0

    def __eq__(self, other):
        type(self).compared += 1
        return str.__eq__(self, other)

    __hash__ = str.__hash__


def test_the_scan_is_linear_in_the_number_of_classes(tmp_path):
    """An operation count, not a time: 1,500 classes made 1.1 million name comparisons when each class was looked up
    in the list of all of them (100k empty folders took 89 s to give their error)."""
    n = 1500
    for i in range(n):
        (tmp_path / f"c{i:05d}").mkdir()
        (tmp_path / f"c{i:05d}" / "a.jpg").write_bytes(b"x")
    _CountedName.compared = 0
    walked = walk_folder(str(tmp_path), label_classes=lambda names: {_CountedName(c): i for i, c in enumerate(names)})
    assert len(walked.samples) == n
    assert _CountedName.compared <= 4 * n
