"""``backend="auto"``: the fastest backend in the latest ``gpupipe bench`` result for this machine and data set
(:mod:`gpupipe.results`), else a stated rule of thumb."""

from __future__ import annotations

import logging

import torch

from ..results import load_rows, result_path
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


def _rows(data_root: str, device: torch.device, train: bool) -> list[dict]:
    """The stored rows of the real backends for this pipeline that are usable here, fastest first."""
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
    return sorted(rows, key=lambda r: r["images_per_s"], reverse=True)


def best_backend(data_root: str, device: torch.device, train: bool) -> dict | None:
    """The stored row of the fastest real backend for this pipeline that is usable here, if any was measured."""
    rows = _rows(data_root, device, train)
    return rows[0] if rows else None


def doubt(rows: list[dict]) -> str | None:
    """Why the fastest stored row is no sure winner, or None: measured on a busy machine (unless the run was
    accepted as it is: ``gpupipe bench --accept-busy``), or its timed windows' range overlaps the runner-up's."""
    best = rows[0]
    if best.get("busy") and not best.get("accept_busy"):
        return (
            f"the bench of {best.get('date') or 'an unknown date'} ran on a busy machine; `gpupipe bench "
            "--accept-busy` stores a run that auto uses anyway (docs/performance.md: a usable run on a shared node)"
        )
    second = rows[1] if len(rows) > 1 else None
    if second is not None and best.get("spread") and second.get("spread") and second["spread"][1] >= best["spread"][0]:
        ranges = [
            f"{r['backend']} {r['images_per_s']:,.0f} ({r['spread'][0]:,.0f}-{r['spread'][1]:,.0f})" for r in rows[:2]
        ]
        return f"its {' and '.join(ranges)} img/s overlap: the bench cannot tell them apart"
    return None


def choose_auto(data_root: str, device: torch.device, train: bool) -> str:
    """``backend="auto"``: the stored bench's winner when it is a sure one, else the rule of thumb; logged (logger
    ``gpupipe``) either way."""
    rows = _rows(data_root, device, train)
    pipeline = "train" if train else "eval"
    rule = (
        "the rule: dali on a GPU, then turbojpeg, pillow-simd, pillow (`gpupipe bench --data "
        f"{data_root}` on a quiet machine measures them)"
    )
    unsure = doubt(rows) if rows else None
    if rows and unsure is None:
        name, best = rows[0]["backend"], rows[0]
        log.info(
            f"backend auto chose {name}: {best['images_per_s']:,.0f} img/s ({pipeline}) in the bench of "
            f"{best.get('date') or 'an unknown date'}"
        )
    elif rows:
        name = rule_of_thumb(device)
        log.info(f"backend auto chose {name}: the stored bench is no sure guide ({unsure}), so {rule}")
    else:
        name = rule_of_thumb(device)
        log.info(f"backend auto chose {name}: no bench result for this data and machine, so {rule}")
    return name
