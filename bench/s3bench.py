"""What ``bench/shards.py read --s3`` and ``bench/s3_startup.py`` share: a local S3-compatible server (moto's
``moto_server``, a process of its own) with folders uploaded, the server's CPU time, a timing window that reports it,
and the read path alone (no decode, one process): bytes per image from the disk and from S3, and the worker's whole
batch (read + decode + crop) on each, in turns."""

from __future__ import annotations

import os
import socket
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

import gpupipe
from gpupipe.backends import cpu_decoders
from gpupipe.sources.open import open_source


def read_path(shards: Path, url: str, batch_size: int) -> list[dict]:
    """The read path alone (no decode), in this process: the bytes of shuffled batches by ``read_many``, from the
    disk and from S3 (``build_loader``'s default: the first epoch fetches the blocks, the next ones reuse them), in
    microseconds per image over 3 epochs after the first; and the first epoch's seconds from S3."""
    disk, remote = open_source(shards), open_source(url)
    order = np.random.default_rng(0).permutation(len(disk)).tolist()
    batches = [order[i : i + batch_size] for i in range(0, len(order), batch_size)]
    t0 = time.perf_counter()
    for b in batches:
        remote.read_many(b)
    first = time.perf_counter() - t0
    rows = []
    for name, data in (("shards", disk), ("s3", remote)):
        t0 = time.perf_counter()
        for _ in range(3):
            for b in batches:
                data.read_many(b)
        us = 1e6 * (time.perf_counter() - t0) / (3 * len(order))
        rows.append({"read_path": name, "read_us_per_image": us})
    rows[1].update(first_epoch_s=first, requests=remote.reader.requests)
    return rows


def cpu_seconds(pid: int | None) -> float:
    """The CPU time (user + system) process ``pid`` has used; 0 without one."""
    if pid is None:
        return 0.0
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def window_cpu(batches, seconds: float, drain: int, sync, pid: int | None) -> tuple[float, float]:
    """gpupipe.bench's window (images/s after ``drain`` untimed batches), with the CPU ms per image the server
    process ``pid`` spent in it."""
    for _, _ in zip(range(drain), batches, strict=False):
        pass
    sync()
    cpu0, t0, count = cpu_seconds(pid), time.perf_counter(), 0
    for n in batches:
        count += n
        if time.perf_counter() - t0 >= seconds:
            break
    sync()
    elapsed, cpu = time.perf_counter() - t0, cpu_seconds(pid) - cpu0
    return count / elapsed, 1000 * cpu / max(count, 1)


def local_s3(folders: dict[str, Path]) -> tuple[subprocess.Popen, str]:
    """A ``moto_server`` process on a free port, the AWS_* variables pointing at it, and each folder's files
    uploaded under ``s3://bench/<name>/``; returns the process and ``s3://bench``."""
    import s3fs  # defer: only an --s3 run needs it

    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", str(port)],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    endpoint = f"http://127.0.0.1:{port}"
    os.environ.update(
        AWS_ENDPOINT_URL=endpoint,
        AWS_ACCESS_KEY_ID="bench",
        AWS_SECRET_ACCESS_KEY="bench",
        AWS_DEFAULT_REGION="us-east-1",
    )
    try:  # the server is killed if it never answers or an upload fails
        fs = s3fs.S3FileSystem(skip_instance_cache=True)
        for attempt in range(600):  # up to a minute for the server to answer
            try:
                fs.mkdir("bench")
                break
            except OSError:
                if attempt == 599:
                    raise
                time.sleep(0.1)
        for name, folder in folders.items():
            files = sorted(p for p in folder.rglob("*") if p.is_file())
            fs.put([str(p) for p in files], [f"bench/{name}/{p.relative_to(folder).as_posix()}" for p in files])
            print(f"uploaded {folder} to s3://bench/{name} at {endpoint}", file=sys.stderr)
    except BaseException:
        proc.kill()
        proc.wait()
        raise
    return proc, "s3://bench"


def paired(shards: Path, url: str, backends: list[str], batch_size: int, epochs: int = 5) -> list[dict]:
    """A decode worker's whole batch (read, decode, crop: ``num_workers=0``; the CPU decoders) from the disk and
    from S3, in turns, batch by batch, so the machine's noise hits both alike: the median ms per batch over the
    epochs after the first (whose S3 reads fetch the blocks)."""
    rows = []
    for backend in [b for b in backends if b in cpu_decoders()]:  # DALI has no worker-less mode
        kw = dict(batch_size=batch_size, train=True, image_size=224, device="cpu", num_workers=0, normalize=False)
        loaders = {
            "shards": gpupipe.build_loader(shards, backend, **kw),
            "s3": gpupipe.build_loader(url, backend, **kw),
        }
        times = _in_turns(loaders, epochs)
        ms = {k: 1000 * statistics.median(v) for k, v in times.items()}
        rows.append(
            {
                "paired": backend,
                "shards_ms_per_batch": ms["shards"],
                "s3_ms_per_batch": ms["s3"],
                "s3_vs_shards": ms["shards"] / ms["s3"],
            }
        )
    return rows


def _in_turns(loaders: dict, epochs: int, after_first=lambda: None) -> dict[str, list[float]]:
    """Seconds per batch of each loader (``"shards"``, ``"s3"``), taken batch by batch in turns (which goes first
    alternates), over ``epochs`` epochs; the first epoch warms up, untimed (``after_first`` is called after it)."""
    times: dict[str, list[float]] = {"shards": [], "s3": []}
    for epoch in range(epochs):
        its = {k: iter(v) for k, v in loaders.items()}
        if epoch == 1:
            after_first()
        for b in range(len(loaders["shards"])):
            for k in ("shards", "s3") if b % 2 else ("s3", "shards"):
                t0 = time.perf_counter()
                next(its[k])
                if epoch:
                    times[k].append(time.perf_counter() - t0)
    return times


def paired_window(shards: Path, url: str, backend: str, batch_size: int, memory_cache: int, window: int | None) -> dict:
    """:func:`paired` for a set larger than ``memory_cache`` bytes: a train loader with ``shuffle_window=window``
    (None: the global shuffle) from the disk and from S3 (``Remote(url, memory_cache=)``), batch by batch in turns in
    one process, over 4 epochs after the first; the mean ms per batch (a group's first batch waits for its blocks:
    the median would hide it), and the S3 reader's requests and MB per epoch."""
    kw = dict(batch_size=batch_size, train=True, image_size=224, device="cpu", num_workers=0, normalize=False)
    remote = gpupipe.Remote(url, memory_cache=memory_cache)
    loaders = {
        "shards": gpupipe.build_loader(shards, backend, shuffle_window=window, **kw),
        "s3": gpupipe.build_loader(remote, backend, shuffle_window=window, **kw),
    }
    reader = loaders["s3"].dataset.reader
    at_epoch_1: list[int] = []
    times = _in_turns(loaders, 5, lambda: at_epoch_1.extend((reader.requests, reader.bytes_read)))
    requests, read = at_epoch_1
    ms = {k: 1000 * statistics.mean(v) for k, v in times.items()}
    return {
        "paired_window": backend,
        "shuffle_window": window,
        "memory_cache_mib": memory_cache >> 20,
        "shards_ms_per_batch": ms["shards"],
        "s3_ms_per_batch": ms["s3"],
        "s3_vs_shards": ms["shards"] / ms["s3"],
        "s3_requests_per_epoch": (reader.requests - requests) / 4,
        "s3_mb_per_epoch": (reader.bytes_read - read) / 4e6,
    }
