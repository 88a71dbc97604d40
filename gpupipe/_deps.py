"""Optional-dependency checks that never import the package they look for, with install hints."""

from __future__ import annotations

import functools
import importlib.util

# backend -> how to install what it lacks
INSTALL_HINTS = {
    "turbojpeg": 'pip install "gpupipe[turbojpeg]"  (and the C library: apt-get install libturbojpeg0)',
    "dali": 'pip install "gpupipe[dali]"  (CUDA 12 driver; "gpupipe[dali-cu13]" for CUDA 13)',
    "pillow-simd": (
        'pip uninstall -y pillow && CC="cc -mavx2" pip install --no-binary :all: pillow-simd '
        "(needs libjpeg-dev zlib1g-dev; see bench/pillow_simd.sh)"
    ),
    "train": 'pip install "gpupipe[train]"',
    "bench": 'pip install "gpupipe[bench]"',
}


@functools.cache
def has_module(name: str) -> bool:
    """Whether ``name`` can be imported, found without importing it."""
    try:
        return importlib.util.find_spec(name) is not None
    except (ImportError, ValueError):
        return False


def require(module: str, extra: str) -> None:
    """Raise ``ModuleNotFoundError`` with the install command when ``module`` is missing."""
    if not has_module(module):
        from .errors import BackendUnavailableError

        raise BackendUnavailableError(f"{module!r} is not installed; {INSTALL_HINTS.get(extra, extra)}")
