"""Hooks and fixtures only; shared helpers are in common_utils.py."""

import functools
import gc
import inspect
import random
import signal

import numpy as np
import pytest
import torch

from .common_utils import INVALID, VALID, S3Server, make_folder, photo

BACKEND_MARKS = ("pillow", "turbojpeg", "dali", "nvjpeg", "synthetic")  # `pytest -m dali`: every test of dali


def pytest_configure(config):
    # A suite started in the background of a non-interactive shell (`make test &`) inherits SIGINT ignored, and so
    # would every process it starts: a Ctrl-C the tests send (gpupipe bench, prepare, train) would go unheard and
    # the test wait out its timeout. Handled here, SIGINT is back to its default in each process the suite execs.
    if signal.getsignal(signal.SIGINT) is signal.SIG_IGN:
        signal.signal(signal.SIGINT, signal.default_int_handler)


def pytest_collection_modifyitems(config, items):
    for item in items:
        for backend in _backends_of(item):
            item.add_marker(backend)
    if torch.cuda.is_available():
        return
    skip = pytest.mark.skip(reason="needs a CUDA device")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


def _backends_of(item) -> set[str]:
    """The backends a test exercises: its module's (``test_dali_files.py``), a parameter's value (``backend="dali"``
    among the cases), a backend named in quotes in the test's own code, or a helper named for one (``_nvjpeg(``)."""
    words = set(item.path.stem.split("_"))
    params = getattr(getattr(item, "callspec", None), "params", {})
    values = {v for v in params.values() if isinstance(v, str)}
    code = _source(getattr(item, "function", None))
    return {
        b
        for b in BACKEND_MARKS
        if b in words
        or b in values
        or f'"{b}"' in code
        or f"'{b}'" in code
        or f'backend="{b}' in code
        or f"_{b}(" in code  # a helper that builds one: test_cpu_stream.py's _nvjpeg(...)
    }


@functools.cache
def _source(function) -> str:
    try:
        return inspect.getsource(function)
    except (OSError, TypeError):
        return ""


def pytest_sessionfinish(session, exitstatus):
    """Free what the tests left (DALI pipelines and their C++ worker threads, loaders) while the interpreter is whole:
    native threads still joinable at interpreter shutdown abort the process after every test passed."""
    gc.collect()


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


@pytest.fixture(scope="session")
def s3(tmp_path_factory):
    """A local S3-compatible server for the session (moto's server mode, a real HTTP server on 127.0.0.1, not a
    mock of the client), found by gpupipe the standard way: ``AWS_ENDPOINT_URL`` and the ``AWS_*`` keys."""
    pytest.importorskip("moto.server", reason="moto[server] is in the dev extra")
    pytest.importorskip("s3fs", reason="s3fs is in the s3 extra")
    server = S3Server()
    with pytest.MonkeyPatch.context() as mp:
        for key, value in {
            "AWS_ENDPOINT_URL": server.endpoint,
            "AWS_ACCESS_KEY_ID": "testing",
            "AWS_SECRET_ACCESS_KEY": "testing-secret",
            "AWS_DEFAULT_REGION": "us-east-1",
            "AWS_CONFIG_FILE": str(tmp_path_factory.mktemp("aws") / "config"),  # none of this machine's own
            "AWS_SHARED_CREDENTIALS_FILE": str(tmp_path_factory.mktemp("aws") / "credentials"),
            "XDG_CACHE_HOME": str(tmp_path_factory.mktemp("xdg-cache")),  # foreign shards' index cache
        }.items():
            mp.setenv(key, value)
        server.client().mkdir(S3Server.BUCKET)
        yield server
    server.stop()
