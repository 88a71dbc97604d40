"""gpupipe/_stamps.c: a batch's files stamped in one call without the GIL, each stamp the number
``dali_files.stamp_key`` gives the same file (the scan processes judge with one, the dali loader checks with the
other: a stamp that differed would judge every file again every pass)."""

import os
import shutil
import sys
import sysconfig
from pathlib import Path

import numpy as np
import pytest

from gpupipe.backends import dali_files
from gpupipe.backends.dali_files import stamp_key


def test_the_stamps_are_built_where_a_c_compiler_is():
    if not sys.platform.startswith("linux"):
        pytest.skip("gpupipe/_stamps.c reads Linux's struct stat (st_mtim, st_ctim)")
    if not Path(sysconfig.get_paths()["include"], "Python.h").exists():
        pytest.skip("no Python.h for this Python")
    if shutil.which((sysconfig.get_config_var("CC") or "cc").split()[0]) is None:
        pytest.skip("no C compiler")
    assert dali_files._stamps is not None
    from gpupipe.info import machine_info

    assert "(_stamps built)" in machine_info()["dali_file_checks"]  # what ``gpupipe info`` says


@pytest.fixture
def stamps():
    if dali_files._stamps is None:
        pytest.skip("gpupipe._stamps is not built (no C compiler at install time)")
    return dali_files._stamps.stamps


def _table(paths: list[str]) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    names = [os.fsencode(p) + b"\0" for p in paths]  # as a folder's path list holds them: each with a NUL after
    lengths = np.array([len(n) - 1 for n in names], np.int64)
    starts = np.concatenate([[0], np.cumsum([len(n) for n in names])[:-1]]).astype(np.int64)
    return np.frombuffer(b"".join(names), np.uint8), starts, lengths


def test_each_stamp_is_stamp_keys_number_and_moves_when_its_file_changes(tmp_path, stamps):
    files = []
    for i, size in enumerate([0, 10, 5000]):
        path = tmp_path / f"f{i}.jpg"
        path.write_bytes(b"x" * size)
        files.append(str(path))
    (tmp_path / "é ü.jpg").write_bytes(b"y")  # a name that is not ASCII
    files.append(str(tmp_path / "é ü.jpg"))
    paths = [*files, str(tmp_path / "gone.jpg"), str(tmp_path), "relative-and-missing.jpg"]
    buf, starts, lengths = _table(paths)
    index = np.array([6, 0, 1, 2, 3, 4, 5, 2], np.int64)  # any order, one twice
    out = np.full(len(index), 7, np.int64)
    stamps(buf, starts, lengths, index, out)
    assert out.tolist() == [stamp_key(paths[i]) for i in index.tolist()]
    assert out[0] == out[5] == 0 and out[6] != 0 and len(set(out[1:5].tolist())) == 4  # gone: 0; a folder has one

    before = out.copy()
    Path(files[1]).write_bytes(b"z" * 11)  # rewritten: its size moves
    os.utime(files[2], ns=(0, 10**18))  # its modification time moves
    stamps(buf, starts, lengths, index, out)
    assert out[2] != before[2] and out[3] != before[3] and out[1] == before[1]
    assert out.tolist() == [stamp_key(paths[i]) for i in index.tolist()]


def test_an_index_outside_the_table_or_an_array_of_another_type_is_an_error(tmp_path, stamps):
    buf, starts, lengths = _table([str(tmp_path)])
    out = np.empty(1, np.int64)
    with pytest.raises(IndexError, match="index 1 is not a path of the table"):
        stamps(buf, starts, lengths, np.array([1], np.int64), out)
    with pytest.raises(IndexError, match="index -1"):
        stamps(buf, starts, lengths, np.array([-1], np.int64), out)
    huge = np.array([2**63 - 5], np.int64)  # start + length overflows: it was read from far outside the buffer
    with pytest.raises(IndexError, match="index 0 is not a path of the table"):
        stamps(buf, huge, lengths, np.array([0], np.int64), out)
    with pytest.raises(TypeError, match="index: a contiguous array of int64"):
        stamps(buf, starts, lengths, np.array([0], np.int32), out)
    with pytest.raises(ValueError, match="one stamp per index"):
        stamps(buf, starts, lengths, np.array([0, 0], np.int64), out)
    with pytest.raises(ValueError, match="read-only"):  # nowhere to write
        stamps(buf, starts, lengths, np.array([0], np.int64), np.frombuffer(bytes(8), np.int64))


def test_no_stamp_is_that_of_a_sample_not_judged_yet_or_of_a_gone_file(monkeypatch):
    """stamp_key maps the two numbers that mean something else (0: gone, -1: not judged) to 1, as the C side does
    (which no real file reaches there: that side is read, not tested)."""
    assert dali_files._mix(0, 0) == 0  # the finaliser's fixed point: a mix can give 0

    class Stat:
        st_dev = st_ino = st_size = st_mtime_ns = st_ctime_ns = 0

    monkeypatch.setattr(dali_files, "_mix", lambda h, v: 0)
    monkeypatch.setattr(os, "stat", lambda path: Stat)
    assert stamp_key("x") == 1
    monkeypatch.setattr(dali_files, "_mix", lambda h, v: (1 << 64) - 1)
    assert stamp_key("x") == 1
