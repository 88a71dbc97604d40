"""``gpupipe bench --device cuda --model NAME``: train the model fed by each backend and by ``synthetic``.

Each backend's throughput is reported as a fraction of ``synthetic`` (1.0: the GPU never waits for data),
with its data-wait fraction: the time the training step spent blocked on the next batch.
"""

from __future__ import annotations

import time
from collections.abc import Callable

import torch
from torch import nn

from ..api import build_loader
from .eta import Eta
from .records import Config, Result


def _train_rate(cfg: Config, backend: str, model: nn.Module) -> tuple[float, float]:
    loader = build_loader(
        cfg.data,
        backend,
        batch_size=cfg.batch_size,
        train=True,
        image_size=cfg.image_size,
        device=cfg.device,
        num_workers=cfg.workers,
        channels_last=True,
        drop_last=True,
    )
    opt = torch.optim.SGD(model.parameters(), lr=0.01, momentum=0.9)
    criterion = nn.CrossEntropyLoss()
    dtype = torch.bfloat16 if cfg.device.type == "cuda" else torch.float32

    def batches():
        while True:
            yield from loader

    it = batches()

    def step():
        t0 = time.perf_counter()
        images, labels = next(it)
        wait = time.perf_counter() - t0
        with torch.autocast(cfg.device.type, dtype=dtype, enabled=cfg.device.type == "cuda"):
            loss = criterion(model(images), labels)
        loss.backward()
        opt.step()
        opt.zero_grad(set_to_none=True)
        return len(labels), wait

    warm_until = time.perf_counter() + max(2.0, cfg.seconds / 4)
    while time.perf_counter() < warm_until:
        step()
    if cfg.device.type == "cuda":
        torch.cuda.synchronize()
    t0, images, waited = time.perf_counter(), 0, 0.0
    while time.perf_counter() - t0 < cfg.seconds:
        n, w = step()
        images += n
        waited += w
    if cfg.device.type == "cuda":
        torch.cuda.synchronize()
    elapsed = time.perf_counter() - t0
    return images / elapsed, waited / elapsed


def trained_backends(cfg: Config) -> list[str]:
    """The backends trained end to end, in order: ``synthetic`` (the reference) first."""
    return ["synthetic"] + [b for b in cfg.backends if b != "synthetic"]


def run_end_to_end(
    cfg: Config, progress: Callable[..., None], megapixels: float, eta: Eta | None = None
) -> list[Result]:
    import timm

    from ..sources.open import open_source

    name = cfg.model
    assert name is not None  # suite.run calls this only with a model
    num_classes = len(open_source(cfg.data).classes)
    if cfg.device.type == "cuda":
        torch.backends.cudnn.benchmark = True
    rows = []
    for b in trained_backends(cfg):
        if eta is None:
            progress(f"end-to-end {name} with {b}")
        else:
            progress(f"end-to-end {name} with {b}", eta.fraction(), left=eta.left())
        t0 = time.monotonic()
        torch.manual_seed(0)
        model = timm.create_model(name, pretrained=False, num_classes=num_classes)
        model.to(cfg.device, memory_format=torch.channels_last).train()  # type: ignore[call-overload]  # (stubs)
        rate, wait = _train_rate(cfg, b, model)
        rows.append(
            Result(
                b,
                f"train:{name}",
                cfg.device.type,
                cfg.workers,
                rate,
                (rate, rate),
                rate * megapixels,
                rate / max(cfg.workers, 1),
                extra={"data_wait": wait},
            )
        )
        if eta is not None:
            eta.modelled(time.monotonic() - t0)
    synthetic = rows[0].images_per_s
    for r in rows:
        r.extra["vs_synthetic"] = r.images_per_s / synthetic
    return rows
