"""How a CPU decode worker's batch reaches the main process (gpupipe/backends/handover.py): written once in the
worker's shared-memory buffer, copied out once, into the memory it ends in (pinned memory on the DataLoader's pin
thread), the buffer then handed back to the worker."""

from __future__ import annotations

import collections
import os

import numpy as np
import pytest
import torch
from PIL import Image

from gpupipe.backends import handover
from gpupipe.backends.cpu import _Collate, _SampleDataset
from gpupipe.backends.pillow import PillowDecoder
from gpupipe.data.device import HostBlocks
from gpupipe.recipe import Recipe
from gpupipe.sources.open import open_source

from .common_utils import make_folder

SIZE = 32


@pytest.fixture(scope="module")
def dataset(tmp_path_factory):
    root = make_folder(tmp_path_factory.mktemp("handover"), 2, 4)
    return _SampleDataset(open_source(root), PillowDecoder(None), Recipe(SIZE), False, 0)


def _one_batch(dataset, workers: int):
    keys = [[(0, i) for i in range(8)]]
    dl = torch.utils.data.DataLoader(dataset, batch_sampler=keys, collate_fn=_Collate(SIZE), num_workers=workers)
    return next(iter(dl))


def test_a_workers_batch_reaches_pinned_memory_in_one_copy(dataset, monkeypatch):
    """The pin thread's part: the batch as it arrives from a worker, then ``pin_memory()``. One batch-sized buffer is
    written on the way (the pinned one), where there were two (a copy out of shared memory, then torch's pinning copy
    of that). No accelerator here: page-locked memory is stood in for by ordinary memory, counted."""
    made: list[tuple[str, tuple[int, ...]]] = []
    shape = (8, SIZE, SIZE, 3)

    def counted(name, make):
        def call(*args, **kwargs):
            out = make(*args, **kwargs)
            if tuple(out.shape) == shape:
                made.append((name, tuple(out.shape)))
            return out

        return call

    monkeypatch.setattr(handover._host_blocks, "take", counted("host", handover._host_blocks.take))
    stand_in = counted("pinned", lambda size, dtype: torch.empty(size, dtype=dtype))
    monkeypatch.setattr(handover, "pinned_tensor", stand_in, raising=False)
    monkeypatch.setattr(torch.Tensor, "pin_memory", counted("Tensor.pin_memory", lambda self: self.clone()))
    batch = _one_batch(dataset, workers=1)
    pinned = batch.pin_memory()
    assert made == [("pinned", shape)]
    assert pinned.lease is None  # the worker's buffer went back
    expected = _one_batch(dataset, workers=0)  # made in this process: no shared memory, no copy
    assert torch.equal(pinned.images, expected.images) and torch.equal(pinned.labels, expected.labels)


def test_an_unpinned_batch_is_copied_out_once_and_its_buffer_handed_back(dataset):
    batch = _one_batch(dataset, workers=1)
    lent = batch.images
    batch.own()
    assert batch.lease is None and batch.images.data_ptr() != lent.data_ptr()
    assert torch.equal(batch.images, _one_batch(dataset, workers=0).images)


def test_a_batch_copied_out_for_the_cpu_lands_in_memory_written_before_never_in_one_still_held(dataset):
    """Without pinning (a CPU or meta device) the batch is copied out on the training thread: into a block of an
    earlier batch once nothing holds that one (no page faults on the copy), never into one a tensor, a view of it or
    an array still holds."""
    first = _one_batch(dataset, workers=1).own()
    kept = first.images.permute(0, 3, 1, 2)  # a view: holds the memory
    expected = first.images.clone()
    del first
    second = _one_batch(dataset, workers=1).own()
    assert second.images.data_ptr() != kept.data_ptr()
    assert torch.equal(kept.permute(0, 2, 3, 1), expected)
    address = second.images.data_ptr()
    del second
    again = _one_batch(dataset, workers=1).own()
    assert again.images.data_ptr() == address  # the second batch's block, free again
    held = again.images.numpy()  # an array holds it too
    del again
    last = _one_batch(dataset, workers=1).own()
    assert last.images.data_ptr() != held.ctypes.data
    del kept
    assert torch.equal(last.images, expected)  # the same samples, whatever block they landed in


def test_host_blocks_reuse_only_what_no_one_holds():
    blocks = HostBlocks(keep=2)
    a = blocks.take((4, 8), torch.float32)
    pa = a.data_ptr()
    del a
    b = blocks.take((4, 8), torch.float32)
    assert b.data_ptr() == pa  # reused: nothing held it
    c = blocks.take((4, 8), torch.float32)
    assert c.data_ptr() != pa  # b holds that block
    d = blocks.take((2, 2), torch.uint8)  # another size, no room, every block held: a new block, not kept
    assert {d.data_ptr()} & {b.data_ptr(), c.data_ptr()} == set()


def test_host_blocks_reuse_a_batch_over_32_mib():
    """A batch over 32 MiB (a float32 batch of 64 at 227 px, a uint8 batch of 256 at 224) gets a mapping of its own,
    whose view holds its base: reused once dropped all the same, and not while it is held."""
    blocks = HostBlocks(keep=2)
    shape = (64, 3, 227, 227)
    a = blocks.take(shape, torch.float32)
    assert a.numel() * 4 > 32 << 20
    pa = a.data_ptr()
    del a
    b = blocks.take(shape, torch.float32)
    assert b.data_ptr() == pa
    assert blocks.take(shape, torch.float32).data_ptr() != pa


def test_a_gpu_feeds_worker_reuses_its_buffers_for_batches_of_changing_size(tmp_path):
    """A GPU feed's batch of encoded files (its byte count changes with every batch) is written into one of its
    worker's shared-memory buffers with room for it, which the worker writes again once the main process has dropped
    the batch: a few buffers for many batches (a new one each made the worker fault in every page, and the training
    process map and unmap it), and the bytes are those read in this process."""
    from gpupipe.backends.dali_feed import DaliFeed, Request
    from gpupipe.backends.dali_stream import _as_is
    from gpupipe.plumbing.workers import worker_init  # batches sent by name, as the feed's workers send them

    rng = np.random.default_rng(0)
    for i in range(24):  # noisy photos, one in six many times the others' bytes
        (tmp_path / "d" / f"c{i % 2}").mkdir(parents=True, exist_ok=True)
        side = 160 if i % 6 == 0 else 24 + i
        Image.fromarray(rng.integers(0, 256, (side, side, 3), dtype=np.uint8)).save(
            tmp_path / "d" / f"c{i % 2}" / f"{i}.jpg"
        )
    feed = DaliFeed(open_source(tmp_path / "d"), Recipe(SIZE), True, 0, 10**8)
    large = [k for k, (path, _) in enumerate(feed.dataset.samples) if os.path.getsize(path) > 10_000]
    small = [k for k in range(24) if k not in large]
    # batches of 5 small ones (padded: the bytes as rows) and of a large one among 5 small (not padded: one after the
    # other), in turn
    requests = [Request(e, small[:5] if e % 2 else [large[e % 4], *small[5:10]], 0) for e in range(16)]
    dl = torch.utils.data.DataLoader(
        feed, batch_size=None, sampler=requests, collate_fn=_as_is, num_workers=1, worker_init_fn=worker_init
    )
    names, padded = set(), set()
    for request, work in zip(requests, dl, strict=True):
        assert work.lease is not None  # in a worker's buffer
        names.add(work.encoded.untyped_storage()._share_filename_cpu_()[1])
        padded.add(work.encoded.dim())
        alone = feed[request]  # made here: ordinary memory
        assert all(bytes(a) == bytes(b) for a, b in zip(work.samples(), alone.samples(), strict=True))
        del work  # handed back
    assert padded == {1, 2} and len(names) <= 4 < len(requests)


@pytest.mark.parametrize("workers", [1, 2])
def test_a_gpu_feeds_buffers_held_in_the_main_process_are_not_written_while_held(tmp_path, workers):
    """The dali loader holds up to four works at once (scheduled ahead in DALI), from one feed worker or several: a
    buffer a work still holds is never written by its worker for a later batch, whichever worker's it is."""
    from gpupipe.backends.dali_feed import DaliFeed, Request
    from gpupipe.backends.dali_stream import _as_is
    from gpupipe.plumbing.workers import worker_init

    root = make_folder(tmp_path / "d", 2, 12)
    feed = DaliFeed(open_source(root), Recipe(SIZE), True, 0, 10**8)
    order = np.random.default_rng(1).permutation(24).tolist()
    requests = [Request(e, order[k : k + 3], k) for e in range(4) for k in range(0, 24, 3)]
    dl = torch.utils.data.DataLoader(
        feed, batch_size=None, sampler=requests, collate_fn=_as_is, num_workers=workers, worker_init_fn=worker_init
    )
    held: collections.deque = collections.deque()
    for request, work in zip(requests, dl, strict=True):
        assert work.lease is not None
        held.append((request, work))
        if len(held) > 4:  # the oldest, dropped once four later ones arrived: its bytes still as read
            old, made = held.popleft()
            assert all(bytes(a) == bytes(b) for a, b in zip(made.samples(), feed[old].samples(), strict=True))
