"""gpupipe/_files.py: a file's stamp moves with every change to it, also one that keeps its size and modification
time (a copy with ``cp -p``, ``touch -r``, a ``chmod``, a file renamed over it)."""

import os
import shutil

from gpupipe._files import file_stamp, unchanged


def test_every_change_moves_the_stamp_even_with_the_size_and_time_kept(tmp_path):
    path, other = tmp_path / "a.jpg", tmp_path / "b.jpg"
    path.write_bytes(b"one")
    other.write_bytes(b"two")
    os.utime(other, ns=(0, os.stat(path).st_mtime_ns))
    stamps = [file_stamp(str(path))]
    assert unchanged(stamps)
    shutil.copy2(other, path)  # cp -p: another content, the same size and modification time
    assert os.stat(path).st_mtime_ns == stamps[0].mtime_ns and not unchanged(stamps)
    stamps = [file_stamp(str(path))]
    os.chmod(path, 0)
    assert not unchanged(stamps)
    stamps = [file_stamp(str(path))]
    shutil.copy2(path, tmp_path / "c.jpg")
    os.replace(tmp_path / "c.jpg", path)  # another inode
    assert not unchanged(stamps)
