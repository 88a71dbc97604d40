"""What ``gpupipe info`` reports: versions, cores, CUDA devices, and each backend's availability."""

from __future__ import annotations

import platform
from importlib.metadata import PackageNotFoundError, version

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
    gpus = [torch.cuda.get_device_name(i) for i in range(torch.cuda.device_count())] if torch.cuda.is_available() \
        else []
    import torchvision

    return {
        "python": platform.python_version(),
        "platform": platform.platform(),
        "cpu": cpu,
        "cores_usable": usable_cores(),
        "torch": torch.__version__,
        "torch_cuda": torch.version.cuda,
        "torchvision": torchvision.__version__,
        "pil": PIL.__version__,
        "pil_simd": pil_is_simd(),
        "libjpeg_turbo": features.version("libjpeg_turbo"),
        "pyturbojpeg": _version("PyTurboJPEG"),
        "dali": dali_info(),
        "cuda_devices": gpus,
    }


def backend_status() -> dict[str, str | None]:
    from .backends import names, unavailable_reason

    return {name: unavailable_reason(name) for name in names()}
