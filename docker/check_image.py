"""Run while the image is built: fails the build, naming what is wrong, unless every backend is in the image.

pillow-simd (built with AVX2) stands in for Pillow; every installed package's ``pillow`` requirement must be met by
its version, and ``pip check`` may report nothing else. TurboJPEG (with gpupipe's window decode) and DALI can be
built; DALI's CUDA is torch's; torchcodec loads against this torch and decodes a JPEG.
"""

import io
import re
import subprocess
import sys
from importlib.metadata import distributions

import PIL
import torch
from packaging.requirements import Requirement
from packaging.version import Version
from PIL import Image

from gpupipe.backends import dali_files, unavailable_reason
from gpupipe.backends.dali import dali_info
from gpupipe.backends.pillow import pil_is_simd

CPU_BACKENDS = ("pillow", "pillow-simd", "turbojpeg", "dali", "synthetic")


def pillow_requirements() -> list[str]:
    """Each installed package's requirement on Pillow that PIL's version does not meet."""
    unmet = []
    for dist in distributions():
        for text in dist.requires or []:
            req = Requirement(text)
            if req.name.lower() == "pillow" and (req.marker is None or req.marker.evaluate({"extra": ""})):
                if Version(PIL.__version__) not in req.specifier:
                    unmet.append(f"{dist.metadata['Name']} requires {req}")
    return unmet


def pip_check() -> list[str]:
    """``pip check``'s complaints other than Pillow's absence (pillow-simd is there, under another name)."""
    out = subprocess.run([sys.executable, "-m", "pip", "check"], capture_output=True, text=True)
    lines = out.stdout.splitlines() if out.returncode else []
    return [line for line in lines if line and "requires pillow, which is not installed" not in line.lower()]


def torchcodec_decodes() -> str | None:
    try:
        from torchcodec.decoders import decode_jpeg
    except (ImportError, OSError, RuntimeError) as e:
        return f"torchcodec does not load with torch {torch.__version__}: {e}"
    buf = io.BytesIO()
    Image.new("RGB", (32, 24), (200, 30, 60)).save(buf, format="JPEG")
    img = decode_jpeg(torch.frombuffer(bytearray(buf.getvalue()), dtype=torch.uint8), mode="RGB")
    return None if tuple(img.shape) == (3, 24, 32) else f"torchcodec decoded a 32x24 JPEG to {tuple(img.shape)}"


def window_decode_loads() -> bool:
    """Whether the turbojpeg backend's window decode was built with gpupipe and loads against the image's libjpeg."""
    from gpupipe.backends.turbojpeg import TurboJpegDecoder

    return TurboJpegDecoder.window_decode


def problems() -> list[str]:
    found = [] if pil_is_simd() else [f"PIL {PIL.__version__} is not pillow-simd"]
    found += pillow_requirements() + [f"pip check: {line}" for line in pip_check()]
    found += [f"backend {b}: {why}" for b in CPU_BACKENDS if (why := unavailable_reason(b)) is not None]
    if not window_decode_loads():
        found.append("turbojpeg's window decode (gpupipe/_jpeg_window.c) was not built or does not load")
    if dali_files._stamps is None:
        found.append("dali's file checks (gpupipe/_stamps.c) were not built")
    dali = dali_info().get("package") or ""
    dali_cuda = re.search(r"cuda(\d+)\d", dali)
    if not dali_cuda or dali_cuda.group(1) != (torch.version.cuda or "").split(".")[0]:
        found.append(f"DALI ({dali or 'not installed'}) is not built for torch's CUDA {torch.version.cuda}")
    why = torchcodec_decodes()
    return [*found, why] if why else found


if __name__ == "__main__":
    wrong = problems()
    for line in wrong:
        print(f"image check: {line}", file=sys.stderr)
    sys.exit(1 if wrong else 0)
