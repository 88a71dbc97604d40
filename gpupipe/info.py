"""What ``gpupipe info`` reports: versions, cores, CUDA devices, and each backend's availability."""

from __future__ import annotations

import json
import platform
import re
from importlib.metadata import PackageNotFoundError, distribution, version
from pathlib import Path
from typing import Any

import torch


def _version(dist: str) -> str | None:
    try:
        return version(dist)
    except PackageNotFoundError:
        return None


def machine_info() -> dict:
    import PIL
    from PIL import features

    from ._system import usable_cores
    from .backends.dali import dali_info
    from .backends.pillow import pil_is_simd

    cpu = platform.processor() or platform.machine()
    try:
        with open("/proc/cpuinfo") as f:
            cpu = next((line.split(":", 1)[1].strip() for line in f if line.startswith("model name")), cpu)
    except OSError:
        pass
    gpus = (
        [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() else []
    )
    import torchvision

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cores_usable": usable_cores(),
        "decode_workers": decode_workers(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torchvision": torchvision.__version__,
        "pil": PIL.__version__,
        "pil_simd": pil_is_simd(),
        "pil_libjpeg_turbo": features.version("libjpeg_turbo"),  # the copy inside Pillow's wheel
        "turbojpeg_library": turbojpeg_library(),  # the system libturbojpeg the turbojpeg backend loads
        "pyturbojpeg": _version("PyTurboJPEG"),
        "turbojpeg_window_decode": window_decode(),
        "dali_file_checks": file_checks(),
        "dali": dali_info(),
        "cuda_devices": gpus,
        "gpupipe": install_info(),
    }


def window_decode() -> str:
    """The turbojpeg backend's window decode (gpupipe/_jpeg_window.c): the libjpeg-turbo it was built against, or how
    to build it."""
    try:
        from . import _jpeg_window
    except ImportError:
        return "not built (the whole image is decoded): apt-get install gcc libjpeg-dev, then install gpupipe again"
    v = _jpeg_window.LIBJPEG_TURBO_VERSION_NUMBER
    return f"built against libjpeg-turbo {v // 1000000}.{v // 1000 % 1000}.{v % 1000}"


def file_checks() -> str:
    """Where the dali backend checks, once a pass, that each file is the one it judged (gpupipe/_stamps.c)."""
    try:
        from . import _stamps  # noqa: F401
    except ImportError:
        return "in the header scan's processes (_stamps not built): apt-get install gcc, then install gpupipe again"
    return "a batch's files in one call without Python's lock (_stamps built)"


def decode_workers() -> dict:
    """The decode workers a loader starts when none are asked for, on the CPU and with a GPU (the training thread
    keeps a core), and how much nicer than the training process they then run (LOCAL_WORLD_SIZE shares the cores)."""
    from ._system import WORKER_NICENESS, default_workers

    return {
        "cpu": default_workers(torch.device("cpu")),
        "cuda": default_workers(torch.device("cuda")),
        "niceness": WORKER_NICENESS,
    }


def turbojpeg_library() -> str | None:
    """The libturbojpeg the turbojpeg backend has loaded: the libjpeg-turbo version built into it, and its path."""
    from .backends import unavailable_reason

    if unavailable_reason("turbojpeg") is not None:  # else this built a TurboJPEG(): the library is loaded now
        return None
    try:
        with open("/proc/self/maps") as f:
            path = next((line.split(None, 5)[5].strip() for line in f if "libturbojpeg" in line), None)
    except OSError:
        path = None
    if path is None:
        return "loaded (its file is not known on this system)"
    m = re.search(rb"(\d+\.\d+\.\d+) \(build \d+\)", Path(path).read_bytes())
    return f"{m.group(1).decode() if m else 'version unknown'} ({path})"


_SUMMARY = "Keep the GPU busy"  # the start of this project's pyproject description


def install_info() -> dict:
    """Where ``gpupipe`` was imported from and which installed distribution carries the name. The name belongs to
    an unrelated project on the package index: ``problem`` says so when that one is installed."""
    import gpupipe

    info = {"imported_from": str(Path(gpupipe.__file__).parent), "distribution": None, "problem": None}
    try:
        dist = distribution("gpupipe")
    except PackageNotFoundError:
        return info
    origin = "a package index"
    try:
        direct = json.loads(dist.read_text("direct_url.json") or "null")
    except ValueError:
        direct = None
    if direct:
        origin = direct.get("url", "?") + (" (editable)" if direct.get("dir_info", {}).get("editable") else "")
    info["distribution"] = f"gpupipe {dist.version} from {origin}"
    metadata: Any = dist.metadata  # an email Message: .get is there, though the PackageMetadata protocol omits it
    summary = metadata.get("Summary")
    if not (summary or "").startswith(_SUMMARY):
        info["problem"] = (
            f"the installed distribution 'gpupipe' {dist.version} is another project "
            f"({summary!r}); `pip uninstall gpupipe`, then install this one "
            "from its source tree (README: Install)"
        )
    return info


def describe(key: str, value) -> str:
    """One readable line for a ``machine_info`` value (the JSON keeps the raw values)."""
    if key == "dali" and isinstance(value, dict):
        if not value.get("installed"):
            return "not installed"
        line = f"{value.get('package') or 'installed'} ({'GPU and CPU' if value.get('gpu') else 'CPU only: no GPU'})"
        return line + (f"; {value['problem']}" if value.get("problem") else "")
    if key == "decode_workers" and isinstance(value, dict):
        return (
            f"{value['cpu']} on the CPU, {value['cuda']} with a GPU (the training thread keeps a core); "
            f"with a GPU they run at nice +{value['niceness']}, below the training thread (DALI's threads also at "
            "idle priority on Linux)"
        )
    if key == "gpupipe" and isinstance(value, dict):
        where = value["distribution"] or "not installed (run from a source tree)"
        return f"{where}; imported from {value['imported_from']}"
    if value is None:
        return "-"
    if isinstance(value, list):
        return ", ".join(map(str, value)) or "none"
    return str(value)


def backend_status() -> dict[str, str | None]:
    from .backends import names, unavailable_reason

    return {name: unavailable_reason(name) for name in names()}


def source_commit(where: str | None = None) -> str | None:
    """The commit of the source tree this runs from (``git rev-parse --short HEAD`` where it is a git checkout), for
    the figures a benchmark records, with ``-dirty`` after it where the package's files (those under ``where``, the
    package by default) differ from that commit: figures of a tree that was not committed are not that commit's.
    None outside a checkout."""
    import os
    import subprocess

    where = where or os.path.dirname(os.path.abspath(__file__))

    def git(*args: str) -> subprocess.CompletedProcess:
        return subprocess.run(["git", *args], capture_output=True, text=True, timeout=10, cwd=where)

    try:
        commit = git("rev-parse", "--short", "HEAD").stdout.strip()
        if not commit:
            return None
        changed = git("diff", "--quiet", "HEAD", "--", ".").returncode == 1
    except (OSError, subprocess.SubprocessError):
        return None
    return f"{commit}-dirty" if changed else commit
