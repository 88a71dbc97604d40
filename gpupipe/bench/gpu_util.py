"""GPU utilisation while a measurement runs (the bench's ``gpu_util`` column)."""

from __future__ import annotations

import threading

import torch


class GpuSampler:
    """Samples GPU utilisation every 100 ms while a measurement runs, through ``torch.cuda.utilization`` (NVML, with
    the CUDA index mapped to NVML's, so ``CUDA_VISIBLE_DEVICES`` cannot make it watch another GPU)."""

    def __init__(self, device: torch.device):
        self.samples: list[int] = []
        self._stop = threading.Event()
        self._device = None
        if device.type == "cuda":
            try:
                torch.cuda.utilization(device)
                self._device = device
            except Exception:  # no nvidia-ml-py or no NVML driver: report no figure rather than fail
                self._device = None

    def __enter__(self):
        self._stop = threading.Event()  # entered once per timed window
        if self._device is not None:
            self._thread = threading.Thread(target=self._run, daemon=True)
            self._thread.start()
        return self

    def _run(self):
        while not self._stop.wait(0.1):
            self.samples.append(torch.cuda.utilization(self._device))

    def __exit__(self, *exc):
        self._stop.set()

    @property
    def mean(self) -> float | None:
        return sum(self.samples) / len(self.samples) if self.samples else None
