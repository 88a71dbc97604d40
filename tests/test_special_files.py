"""Files that are not files: a fifo named ``p.jpg`` and a link ``z.jpg -> /dev/zero`` are reported by ``check`` and
left out by ``prepare``, at once (no hang, no read until memory runs out); ``check`` reads prepared folders and tars
as the loaders do."""

from __future__ import annotations

import os
import signal

import pytest

import gpupipe
from gpupipe.check import check
from gpupipe.prepare import PrepareOptions, prepare
from gpupipe.sources.open import open_source as scan

from .common_utils import make_folder


@pytest.fixture()
def no_hang():
    """A hang is a failure, not a stuck test run."""

    def stop(signum, frame):
        raise TimeoutError("still running after 60 s: something blocked")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(60)
    yield
    signal.alarm(0)
    signal.signal(signal.SIGALRM, old)


@pytest.fixture()
def special(tmp_path):
    root = make_folder(tmp_path / "data", 2, 3)
    os.mkfifo(root / "c00" / "p.jpg")
    (root / "c01" / "z.jpg").symlink_to("/dev/zero")
    return root


def test_check_reports_fifos_and_devices_without_reading_them(special, no_hang):
    results = {os.path.relpath(r["path"], special): r for r in check(scan(special), workers=1)}
    assert len(results) == 8
    assert results["c00/p.jpg"] == {
        "path": str(special / "c00" / "p.jpg"),
        "ok": False,
        "reason": "not a regular file: a fifo",
        "notes": [],
    }
    assert (
        results["c01/z.jpg"]["reason"]
        == f"a link out of {special} (to /dev/zero): not followed (allow_outside_root=True follows it)"
    )
    assert sum(r["ok"] for r in results.values()) == 6


def test_prepare_leaves_them_out_and_names_them(special, tmp_path, no_hang):
    summary = prepare(special, tmp_path / "prep", PrepareOptions(), workers=1)
    assert summary.samples == 6
    reasons = {os.path.basename(r["path"]): r["reason"] for r in summary.left_out}
    assert reasons["p.jpg"] == "not a regular file: a fifo" and reasons["z.jpg"].startswith("a link out of")


def test_a_fifo_that_appears_after_the_scan_is_an_error_naming_it_not_a_hang(tmp_path, no_hang):
    """Between the scan and the read, a file became a fifo, another a link to /dev/zero."""
    root = make_folder(tmp_path / "data", 2, 3)
    data = scan(root)
    loader = gpupipe.build_loader(
        root, "pillow", batch_size=3, train=False, image_size=16, device="cpu", on_error="skip"
    )
    (root / "c00" / "000.jpg").unlink()
    os.mkfifo(root / "c00" / "000.jpg")
    (root / "c00" / "001.jpg").unlink()
    (root / "c00" / "001.jpg").symlink_to("/dev/zero")
    for i, kind in ((0, "a fifo"), (1, "a character device")):
        with pytest.raises(OSError, match=f"not a regular file: {kind}"):
            data.read(i)
    assert sum(len(y) for _, y in loader) == 4
    assert sorted(reason for _, reason in loader.skipped) == [
        "cannot read the file (not a regular file: a character device)",
        "cannot read the file (not a regular file: a fifo)",
    ]


def _prepared_with_a_fifo_shard(tmp_path):
    root = make_folder(tmp_path / "data", 2, 4)
    out = tmp_path / "prep"
    prepare(root, out, PrepareOptions(shard_size=3000), workers=1)
    shard = sorted(out.glob("*.tar"))[1]
    shard.unlink()
    os.mkfifo(shard)
    return out, shard


@pytest.mark.parametrize("backend", ["pillow", "dali"])
def test_a_prepared_shard_that_is_a_fifo_is_an_error_naming_it_not_a_hang(tmp_path, backend, no_hang):
    if backend not in gpupipe.available_backends():
        pytest.skip(f"{backend} is not installed")
    out, shard = _prepared_with_a_fifo_shard(tmp_path)
    loader = gpupipe.build_loader(out, backend, batch_size=4, train=False, image_size=16, device="cpu")
    with pytest.raises(gpupipe.DecodeError, match="not a regular file: a fifo") as e:
        list(loader)
    assert "\n" not in str(e.value) and shard.name in str(e.value)


def test_resuming_from_a_checkpoint_that_is_a_fifo_is_one_line_not_a_hang(tmp_path, no_hang):
    from gpupipe.train.checkpoint import CheckpointError, load_for_resume

    os.mkfifo(tmp_path / "last.pt")
    with pytest.raises(CheckpointError, match=r"last\.pt: cannot resume from it \(not a regular file: a fifo\)"):
        load_for_resume(tmp_path / "last.pt")


def test_resuming_a_run_whose_last_checkpoint_is_a_fifo_reads_no_settings_from_it(tmp_path, no_hang):
    """Before the checkpoint is verified (which refuses it, above), the resume reads its settings (the number of ranks
    it was saved with): a fifo is left to the verify, never opened."""
    from gpupipe.train.config import TrainConfig
    from gpupipe.train.elastic import fit_world_size

    os.mkfifo(tmp_path / "last.pt")
    cfg = TrainConfig()
    blocked = []

    def stop(signum, frame):
        blocked.append(True)
        raise TimeoutError("blocked")

    old = signal.signal(signal.SIGALRM, stop)
    signal.alarm(30)
    try:
        assert fit_world_size(cfg, tmp_path / "last.pt", 1) == (cfg, None)
    finally:
        signal.alarm(0)
        signal.signal(signal.SIGALRM, old)
    assert not blocked


def test_a_reader_waiting_on_a_fifo_in_flight_is_let_go_once_a_wait_is_long(tmp_path, no_hang, monkeypatch):
    """dali's pipelines read their paths in their own threads, where a file that became a fifo holds ``open`` until a
    writer comes. While a wait on the pipeline lasts over a second, each fifo among the paths in flight is opened for
    writing and closed: the reader goes on and reads the end. A wait shorter than that, or one that has ended, opens
    nothing."""
    import threading
    import time

    import numpy as np

    from gpupipe.backends import dali_fifos

    fifo, image = tmp_path / "a.jpg", tmp_path / "b.jpg"
    os.mkfifo(fifo)
    image.write_bytes(b"not read")
    rows = np.zeros((2, 256), np.uint8)
    for row, path in zip(rows, (image, fifo), strict=True):
        row[: len(bytes(path))] = np.frombuffer(bytes(path), np.uint8)
    read: list[bytes] = []
    reader = threading.Thread(target=lambda: read.append(fifo.read_bytes()), daemon=True)
    reader.start()
    monkeypatch.setattr(dali_fifos, "AFTER", 3.0)  # seconds of margin for the first check on a busy machine
    flight = dali_fifos.InFlight()
    flight.add(None)  # a batch fed bytes: nothing to look at
    flight.add(rows)
    flight.wait()
    reader.join(1.0)
    assert reader.is_alive()  # not yet: a batch may take a while
    reader.join(10)
    flight.done()
    assert read == [b""] and not reader.is_alive()
    assert len(flight.batches) == 1 and flight.since == 0

    late = threading.Thread(target=lambda: read.append(fifo.read_bytes()), daemon=True)
    late.start()
    time.sleep(dali_fifos.AFTER + 2 * dali_fifos._EVERY)
    assert late.is_alive()  # no wait under way: the fifo is left to its reader
    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
    late.join(10)
