"""``read_image`` for the backends that decode inside a pipeline (DALI) or on the GPU (nvJPEG)."""

from __future__ import annotations

import numpy as np
import torch

from ..errors import DecodeError
from ._image import chw_tensor, default_max_pixels, probe
from .pillow import PillowDecoder


def read_image(data: bytes, path: str, backend: str, max_pixels: int | None) -> torch.Tensor:
    header = probe(data, path, backend, max_pixels or default_max_pixels())  # the pixel limit, before any decode
    if backend == "nvjpeg":
        from torchvision.io import ImageReadMode, decode_jpeg

        from .nvjpeg import _upright_chw, nvjpeg_can_decode

        if nvjpeg_can_decode(data, header):
            try:
                img = decode_jpeg(torch.frombuffer(bytearray(data), dtype=torch.uint8), mode=ImageReadMode.RGB,
                                  device="cuda")
            except RuntimeError as e:
                raise DecodeError(path, backend, f"nvJPEG: {e}") from None
            return _upright_chw(img, header.orientation).contiguous()
        return chw_tensor(PillowDecoder(max_pixels).decode(data, path)).cuda()
    return _dali_read(data, path)


def _dali_read(data: bytes, path: str) -> torch.Tensor:
    from nvidia.dali import fn, pipeline_def, types  # defer: heavy

    gpu = torch.cuda.is_available()

    @pipeline_def(batch_size=1, num_threads=1, device_id=0 if gpu else None, prefetch_queue_depth=1)
    def pipe():
        enc = fn.external_source(name="enc", dtype=types.UINT8, ndim=1)
        return fn.decoders.image(enc, device="mixed" if gpu else "cpu", output_type=types.RGB)

    p = pipe()
    p.build()
    p.feed_input("enc", [np.frombuffer(data, dtype=np.uint8)])
    try:
        (out,) = p.run()
    except RuntimeError as e:
        first = str(e).strip().splitlines()[0] if str(e).strip() else "DALI decode failed"
        raise DecodeError(path, "dali", first) from None
    arr = (out.as_cpu() if gpu else out).at(0)
    img = chw_tensor(np.array(arr))
    return img.cuda() if gpu else img
