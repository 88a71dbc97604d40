"""A loader dropped in the middle of a pass ends its DataLoader workers at once, by reference counting.

A loader that sat in a reference cycle with its DataLoader's iterator was left to the garbage collector, which
finalises the iterator's queues before the iterator itself: the "stop" it then sends its workers never leaves the
process, and torch waits 5 s per worker before it terminates them (a test suite, a notebook re-running a cell, a
sweep building loaders in a loop). With gc off, the workers must be gone soon after the last reference is.
"""

from __future__ import annotations

import gc
import os
import time

import pytest

import gpupipe
from gpupipe import Recipe

from .test_pool import _children

CASES = {
    "pillow": ("pillow", {"image_size": 32}),
    "turbojpeg": ("turbojpeg", {"image_size": 32}),
    "dali": ("dali", {"image_size": 32}),
    "ctaugment": ("pillow", {"recipe": Recipe(32, auto_augment="ctaugment")}),
}


@pytest.fixture(scope="module")
def shards(folder, tmp_path_factory):
    from gpupipe.prepare import PrepareOptions, prepare

    out = tmp_path_factory.mktemp("teardown-shards") / "out"
    prepare(folder, out, PrepareOptions(), workers=1)
    return out


@pytest.mark.parametrize("case", CASES)
def test_a_dropped_loader_ends_its_workers_without_the_garbage_collector(folder, shards, case):
    backend, kw = CASES[case]
    if backend not in gpupipe.available_backends():
        pytest.skip(f"no {backend}")
    data = shards if backend == "dali" else folder  # dali's feed processes read shards (a folder: DALI's threads)
    _ends_with_its_last_reference(
        lambda: gpupipe.build_loader(data, backend, batch_size=4, num_workers=1, device="cpu", **kw)
    )


def test_a_dropped_nvjpeg_loader_ends_its_workers_without_the_garbage_collector(folder):
    """nvjpeg's stream too, its decode thread left in the middle of a pass (the loader's device side on the CPU)."""
    from .test_nvjpeg import _CpuNvjpegLoader

    parts = gpupipe.build_loader(folder, "pillow", batch_size=4, num_workers=1, device="cpu", image_size=32).parts
    _ends_with_its_last_reference(lambda: _CpuNvjpegLoader(parts))


def _ends_with_its_last_reference(make) -> None:
    """The loader ``make()`` builds, two batches of a pass taken, then it and its pass dropped with gc off: its
    workers end."""
    before = set(_children(os.getpid()))
    loader = make()
    it = iter(loader)
    next(it)
    next(it)
    workers = set(_children(os.getpid())) - before
    assert workers, "the loader started no worker process"
    gc.disable()
    try:
        del it, loader
        deadline = time.monotonic() + 3  # torch's own wait for a worker that missed the stop is 5 s
        while workers & set(_children(os.getpid())) and time.monotonic() < deadline:
            time.sleep(0.05)
        left = workers & set(_children(os.getpid()))
    finally:
        gc.enable()
        gc.collect()
    assert not left, f"workers {sorted(left)} outlived their loader (a reference cycle keeps it for the collector)"
