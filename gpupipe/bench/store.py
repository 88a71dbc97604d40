"""Where ``gpupipe bench`` keeps its latest result per machine and data set, so ``backend="auto"`` can use it."""

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
    path = result_path(data_root, device)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(report, indent=1))
    os.replace(tmp, path)
    return path


def best_backend(data_root: str, device: torch.device, train: bool) -> str | None:
    """The fastest real backend for this pipeline in the latest bench result, if there is one and it is usable here."""
    from ..backends import available_backends

    path = result_path(data_root, device)
    if not path.is_file():
        return None
    try:
        results = json.loads(path.read_text())["results"]
    except (ValueError, KeyError):
        return None
    pipeline = "train" if train else "eval"
    usable = set(available_backends()) - {"synthetic"}
    rows = [r for r in results if r.get("pipeline") == pipeline and r.get("backend") in usable
            and r.get("device") == device.type and r.get("images_per_s")]
    return max(rows, key=lambda r: r["images_per_s"])["backend"] if rows else None
