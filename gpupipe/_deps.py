"""Optional-dependency checks that never import the package they look for, with install hints."""

from __future__ import annotations

import functools
import importlib.util

# backend -> how to install what it lacks: the packages themselves, or the extra from the source tree, never
# "gpupipe[...]" from the index (the name there belongs to another project)
INSTALL_HINTS = {
    "turbojpeg": 'pip install "PyTurboJPEG>=1.8,<2"  (and the C library: apt-get install libturbojpeg0)',
    "dali": "pip install nvidia-dali-cuda130  (for torch with CUDA 13, as the package index's; nvidia-dali-cuda120 "
    "beside a CUDA 12 torch)",
    "pillow-simd": (
        'pip uninstall -y pillow && CC="cc -mavx2" pip install --no-binary :all: pillow-simd '
        "(needs libjpeg-dev zlib1g-dev; see bench/pillow_simd.sh)"
    ),
    "train": 'pip install timm tensorboard omegaconf  (or pip install ".[train]" in the gpupipe source tree)',
    "s3": 'pip install s3fs  (or pip install ".[s3]" in the gpupipe source tree)',
    "gs": "pip install gcsfs",
    "parquet": 'pip install pyarrow  (or pip install ".[parquet]" in the gpupipe source tree)',
    "bench": 'pip install matplotlib nvidia-ml-py  (or pip install ".[bench]" in the gpupipe source tree)',
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
