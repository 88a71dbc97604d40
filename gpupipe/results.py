"""Where ``gpupipe bench`` keeps its latest result per machine and data set, so ``backend="auto"``
(:mod:`gpupipe.backends.auto`) can use it. Storage only: it knows no backend."""

from __future__ import annotations

import hashlib
import json
import os
import platform
from pathlib import Path

import torch


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
    rows = load_rows(path)
    for r in report["results"]:
        key = f"{r['backend']}|{r['pipeline']}" + (f"|{r['policy']}" if r.get("policy") else "")
        key += f"|{r['image_size']}px" if r.get("image_size") else ""
        # auto trusts no busy run unless the user accepted it (``gpupipe bench --accept-busy``)
        rows[key] = {**r, "date": report["date"], "busy": bool(report.get("busy"))}
        rows[key]["accept_busy"] = bool(report.get("accept_busy"))
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({"version": 2, "rows": rows}, indent=1))
    os.replace(tmp, path)
    return path


def load_rows(path: Path) -> dict[str, dict]:
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
