"""``backend="auto"``: the fastest backend in the latest ``gpupipe bench`` result for this machine and data set
(:mod:`gpupipe.bench.store`), else a stated rule of thumb."""

from __future__ import annotations

import logging

import torch

from ..bench.store import load_rows, result_path
from . import available_backends

log = logging.getLogger("gpupipe")


def rule_of_thumb(device: torch.device) -> str:
    """The stated rule for ``backend="auto"`` when no benchmark result applies."""
    avail = available_backends()
    if device.type == "cuda" and "dali" in avail:
        return "dali"
    for name in ("turbojpeg", "pillow-simd"):
        if name in avail:
            return name
    return "pillow"


def best_backend(data_root: str, device: torch.device, train: bool) -> dict | None:
    """The stored row of the fastest real backend for this pipeline that is usable here, if any was measured."""
    pipeline = "train" if train else "eval"
    usable = set(available_backends()) - {"synthetic"}
    rows = [
        r
        for r in load_rows(result_path(data_root, device)).values()
        if r.get("pipeline") == pipeline
        and r.get("backend") in usable
        and r.get("device") == device.type
        and r.get("images_per_s")
    ]
    return max(rows, key=lambda r: r["images_per_s"]) if rows else None


def choose_auto(data_root: str, device: torch.device, train: bool) -> str:
    """``backend="auto"``: the stored bench's winner, else the rule of thumb; logged (logger ``gpupipe``) either way."""
    best = best_backend(data_root, device, train)
    pipeline = "train" if train else "eval"
    if best is not None:
        name = best["backend"]
        log.info(
            f"backend auto chose {name}: {best['images_per_s']:,.0f} img/s ({pipeline}) in the bench of "
            f"{best.get('date') or 'an unknown date'}"
        )
    else:
        name = rule_of_thumb(device)
        log.info(
            f"backend auto chose {name}: no bench result for this data and machine, so the rule: dali on a "
            f"GPU, then turbojpeg, pillow-simd, pillow (`gpupipe bench --data {data_root}` measures them)"
        )
    return name
