"""Hooks and fixtures only; shared helpers are in common_utils.py."""

import random

import numpy as np
import pytest
import torch

from .common_utils import INVALID, VALID, make_folder, photo


def pytest_collection_modifyitems(config, items):
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture(autouse=True)
def prevent_leaking_rng():
    """torchvision's habit: a test may use the global RNGs, but must not change them for the next test."""
    torch_state, py_state, np_state = torch.get_rng_state(), random.getstate(), np.random.get_state()
    cuda_states = torch.cuda.get_rng_state_all() if torch.cuda.is_available() else None
    yield
    torch.set_rng_state(torch_state)
    random.setstate(py_state)
    np.random.set_state(np_state)
    if cuda_states is not None:
        torch.cuda.set_rng_state_all(cuda_states)


@pytest.fixture(scope="session")
def folder(tmp_path_factory):
    """4 classes x 6 JPEGs of mixed sizes."""
    return make_folder(tmp_path_factory.mktemp("folder"), 4, 6)


@pytest.fixture(scope="session")
def unique_folder(tmp_path_factory):
    """13 classes of one image each: a label identifies its sample."""
    return make_folder(tmp_path_factory.mktemp("unique"), 13, 1, seed=1)


@pytest.fixture(scope="module")
def base():
    """A small photo: the source of the unusual and the broken files (common_utils.VALID, INVALID)."""
    return photo(np.random.default_rng(7), 60, 90)


@pytest.fixture()
def dirty_folder(tmp_path, base):
    """An ImageFolder with a truncated and an empty file beside one file of every unusual valid kind."""
    root = make_folder(tmp_path / "data", 2, 5)
    (root / "c00" / "zz_truncated.jpg").write_bytes(INVALID["truncated"](base))
    (root / "c01" / "zz_empty.jpg").write_bytes(b"")
    for i, (kind, make) in enumerate(sorted(VALID.items())):  # every valid oddity, beside the broken files
        (root / f"c0{i % 2}" / f"zz_valid_{kind}.jpg").write_bytes(make(base))
    return root
