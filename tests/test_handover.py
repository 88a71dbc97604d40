"""How a CPU decode worker's batch reaches the main process (gpupipe/backends/handover.py): written once in the
worker's shared-memory buffer, copied out once, into the memory it ends in (pinned memory on the DataLoader's pin
thread), the buffer then handed back to the worker."""

from __future__ import annotations

import pytest
import torch

from gpupipe.backends import handover
from gpupipe.backends.cpu import _Collate, _SampleDataset
from gpupipe.backends.pillow import PillowDecoder
from gpupipe.data.sources import open_source
from gpupipe.recipe import Recipe

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

    monkeypatch.setattr(handover, "host_tensor", counted("host_tensor", handover.host_tensor), raising=False)
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
