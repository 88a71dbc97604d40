"""Where ``gpupipe bench`` keeps its latest result per machine and data set, so ``backend="auto"`` can use it."""

from __future__ import annotations

import hashlib
import json
import logging
import os
import platform
from pathlib import Path

import torch

log = logging.getLogger("gpupipe")


def cache_dir() -> Path:
    base = os.environ.get("GPUPIPE_CACHE") or os.path.join(os.environ.get("XDG_CACHE_HOME", "~/.cache"), "gpupipe")
    return Path(base).expanduser()


def machine_key(device: torch.device) -> str:
    gpu = torch.cuda.get_device_name(device) if device.type == "cuda" else "cpu"
    return f"{platform.node()}|{platform.machine()}|{os.cpu_count()}|{gpu}"


def _key(data_root: str, device: torch.device) -> str:
    raw = f"{os.path.realpath(data_root)}|{machine_key(device)}"
    return hashlib.sha256(raw.encode()).hexdigest()[:16]


def result_path(data_root: str, device: torch.device) -> Path:
    return cache_dir() / f"bench-{_key(data_root, device)}.json"


def save_latest(report: dict, data_root: str, device: torch.device) -> Path:
    """Merge a bench report into the store: one row per (backend, pipeline), each with the date it was measured, so
    a partial run replaces only what it measured."""
    path = result_path(data_root, device)
    rows = _load_rows(path)
    for r in report["results"]:
        rows[f"{r['backend']}|{r['pipeline']}"] = {**r, "date": report["date"]}
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": 2, "rows": rows}, indent=1))
    os.replace(tmp, path)
    return path


def _load_rows(path: Path) -> dict[str, dict]:
    try:
        stored = json.loads(path.read_text())
    except (OSError, ValueError):
        return {}
    if "rows" in stored:
        return stored["rows"]
    # a version-1 file: one whole report
    return {
        f"{r['backend']}|{r['pipeline']}": {**r, "date": stored.get("date")}
        for r in stored.get("results", [])
        if "backend" in r and "pipeline" in r
    }


def best_backend(data_root: str, device: torch.device, train: bool) -> dict | None:
    """The stored row of the fastest real backend for this pipeline that is usable here, if any was measured."""
    from ..backends import available_backends

    pipeline = "train" if train else "eval"
    usable = set(available_backends()) - {"synthetic"}
    rows = [
        r
        for r in _load_rows(result_path(data_root, device)).values()
        if r.get("pipeline") == pipeline
        and r.get("backend") in usable
        and r.get("device") == device.type
        and r.get("images_per_s")
    ]
    return max(rows, key=lambda r: r["images_per_s"]) if rows else None


def choose_auto(data_root: str, device: torch.device, train: bool) -> str:
    """``backend="auto"``: the stored bench's winner, else the rule of thumb; logged (logger ``gpupipe``) either way."""
    from ..backends import rule_of_thumb

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
