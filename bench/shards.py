"""Prepared shards, measured: reading from shards vs the same images from the folder, ``build_loader`` start-up
against set size, and ``gpupipe prepare`` throughput. Each part writes JSON with the machine, versions and date.

    python bench/shards.py read DATA [--backends pillow,turbojpeg,dali] [--workers 1] [--seconds 10] [--max-side 512]
                                     [--s3] [--sources folder,shards,s3,s3-ranges,shards-window,s3-window]
                                     [--shard-size MiB] [--memory-cache MiB] [--shuffle-window K] [--skip-extras]
    python bench/shards.py startup [--sizes 1000,10000,100000] [--repeats 3]
    python bench/shards.py prepare DATA [--workers 1,2] [--max-side 512]

``read`` prepares DATA once into ``DATA-shards[-maxN]`` (resumed if interrupted; ``--prepared`` picks the folder),
then times train loaders (uint8 batches, one decode worker by default) on the folder and on the shards in
interleaved windows after a warm-up (one epoch, then a quarter of ``--seconds``), with gpupipe.bench's window
method: median, min-max, shards / folder. With ``--max-side`` the shards hold smaller re-encoded images, so the ratio
then says what the preparation gains, not what the storage layout costs.
With ``--s3`` the same shards are also uploaded to a local S3-compatible server (moto's ``moto_server``, a process
of its own on 127.0.0.1) and read from there (``s3_vs_shards``: what object storage costs over the disk, the HTTP
round trips and the client; a real store adds its network's latency): ``s3`` as ``build_loader`` reads a URL by
default (a set that fits ``Remote.memory_cache`` is read in blocks once per worker, then kept), ``s3-ranges`` with
``memory_cache=0`` (each batch by coalesced range requests, as a set larger than the cache is read; ``--memory-cache``
sets another), ``s3-window`` with ``--memory-cache`` and ``shuffle_window=--shuffle-window`` (blocks of the window's
shards kept), beside ``shards-window``, the same order from the disk (``s3-window_vs_shards-window``). Each S3 row has
the server process's CPU ms per image in its windows (on a shared machine the server's CPU is the loader's CPU).
``--skip-extras`` leaves out the read path alone and the paired batches an ``--s3`` run adds; ``--paired-window``
adds paired batches (one process, disk and S3 in turns, mean per batch) with ``--memory-cache``, in the global shuffle
and in the window's order.
``startup`` times ``build_loader`` on fake prepared sets (one tiny shard, an index of N rows) in fresh processes.
"""

from __future__ import annotations

import argparse
import json
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from datetime import datetime, timezone
from pathlib import Path

import numpy as np
import torch
from s3bench import local_s3, paired, paired_window, read_path, window_cpu  # bench/s3bench.py, beside this script

import gpupipe
from gpupipe.bench.suite import _forever, _warm
from gpupipe.info import machine_info
from gpupipe.prepare import PrepareOptions, prepare


def _report(kind: str, config: dict, results: list[dict], path: str | None) -> None:
    rep = {
        "kind": kind,
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "gpupipe": gpupipe.__version__,
        "config": config,
        "results": results,
    }
    text = json.dumps(rep, indent=1)
    if path:
        Path(path).write_text(text)
    for r in results:
        print("  ".join(f"{k}={v:.3g}" if isinstance(v, float) else f"{k}={v}" for k, v in r.items()))


def _prepared(data: str, out: str | None, options: PrepareOptions, workers: int) -> Path:
    suffix = f"-max{options.max_side}" if options.max_side else ""
    out = Path(out or data.rstrip("/") + f"-shards{suffix}")
    summary = prepare(data, out, options, workers=workers)
    print(
        f"{out}: {summary.samples} samples, {summary.copied} copied, re-encoded {summary.reencoded}, "
        f"{len(summary.left_out)} left out",
        file=sys.stderr,
    )
    return out


def cmd_read(args) -> None:
    options = PrepareOptions(max_side=args.max_side, quality=args.quality, shard_size=args.shard_size << 20)
    shards = _prepared(args.data, args.prepared, options, gpupipe.api.usable_cores())
    server = local_s3({"shards": shards}) if args.s3 else None
    try:  # the server is stopped whatever happens
        results = _read_jobs(args, shards, server)
    finally:
        if server is not None:
            server[0].kill()
            server[0].wait()
    _report("read", {**vars(args), "func": None, "prepared": str(shards)}, results, args.json)


def _read_jobs(args, shards: Path, server: tuple[subprocess.Popen, str] | None) -> list[dict]:
    backends = (
        args.backends.split(",")
        if args.backends
        else [b for b in ("pillow", "pillow-simd", "turbojpeg", "dali") if b in gpupipe.available_backends()]
    )
    jobs = [(b, src, root) for b in backends for src, root in _sources(args, shards, server)]
    device = torch.device(args.device)
    sync = (lambda: torch.cuda.synchronize(device)) if device.type == "cuda" else (lambda: None)
    streams: list = []
    try:
        for backend, src, root in jobs:
            window = args.shuffle_window if src.endswith("-window") else None
            streams.append(_started(args, backend, root, device, window))
            print(f"started {backend} on {src}", file=sys.stderr)
        rates: list[list[float]] = [[] for _ in jobs]
        server_cpu: list[list[float]] = [[] for _ in jobs]  # the S3 server's CPU ms per image, in each window
        drain = 4 * max(args.workers, 1) + 2  # what the prefetch queues made while another job was timed
        pid = server[0].pid if server is not None else None
        for _ in range(args.repeats):  # interleaved: a slow patch of the machine hits folder and shards alike
            for i in range(len(jobs)):
                rate, cpu_ms = window_cpu(streams[i], args.seconds / args.repeats, drain, sync, pid)
                rates[i].append(rate)
                server_cpu[i].append(cpu_ms)
        extra = []
        if server is not None and not args.skip_extras:  # the read path alone, each worker's batch on disk and S3
            extra = read_path(shards, f"{server[1]}/shards", args.batch_size)
            extra += paired(shards, f"{server[1]}/shards", backends, args.batch_size)
        if server is not None and args.paired_window:  # the same, larger than the cache, with the window
            url, cache, window = f"{server[1]}/shards", args.memory_cache << 20, args.shuffle_window
            for backend in backends:
                extra += [paired_window(shards, url, backend, args.batch_size, cache, w) for w in (None, window)]
    finally:
        for st in streams:
            st.close()
    med = {(b, src): statistics.median(r) for (b, src, _), r in zip(jobs, rates, strict=True)}
    return [
        {
            "backend": b,
            "source": src,
            "images_per_s": med[b, src],
            "min": min(r),
            "max": max(r),
            **_ratios(med, b, src),
            **({"server_cpu_ms_per_image": statistics.median(c)} if src.startswith("s3") else {}),
        }
        for (b, src, _), r, c in zip(jobs, rates, server_cpu, strict=True)
    ] + extra


def _sources(args, shards: Path, server: tuple[subprocess.Popen, str] | None) -> list[tuple[str, object]]:
    """The sources ``--sources`` names, as ``(name, root)``; a ``-window`` one is read with ``--shuffle-window``."""
    sources: list[tuple[str, object]] = [("folder", args.data), ("shards", str(shards))]
    sources += [("shards-window", str(shards))]
    if server is not None:  # blocks kept in memory (the set fits), coalesced ranges only, the window's blocks kept
        url, cache = f"{server[1]}/shards", args.memory_cache << 20
        sources += [("s3", url), ("s3-ranges", gpupipe.Remote(url, memory_cache=cache))]
        sources += [("s3-window", gpupipe.Remote(url, memory_cache=cache))]
    default = ("folder", "shards", "s3", "s3-ranges")
    return [s for s in sources if s[0] in (args.sources.split(",") if args.sources else default)]


def _started(args, backend: str, root, device: torch.device, window: int | None = None):
    """A train loader's batch sizes, for ever, warmed up: a whole epoch (caches filled, as in training), then a
    quarter of ``--seconds``."""
    loader = gpupipe.build_loader(
        root,
        backend,
        batch_size=args.batch_size,
        train=True,
        image_size=224,
        device=device,
        num_workers=args.workers,
        drop_last=False,
        normalize=False,
        shuffle_window=window,
    )
    stream = (len(y) for _, y in _forever(lambda: loader))
    for _ in zip(range(len(loader)), stream, strict=False):
        pass
    _warm(stream, max(1.0, args.seconds / 4))
    return stream


def _ratios(med: dict, backend: str, source: str) -> dict[str, float]:
    """This row's figure over the same backend's shards on disk (and the shards' over the folder)."""
    if source == "folder" or (backend, "shards") not in med:
        return {}
    if source == "shards":
        folder = med.get((backend, "folder"))
        return {"shards_vs_folder": med[backend, "shards"] / folder} if folder else {}
    out = {f"{source}_vs_shards": med[backend, source] / med[backend, "shards"]}
    if source == "s3-window" and (backend, "shards-window") in med:  # the same order from the disk
        out["s3-window_vs_shards-window"] = med[backend, source] / med[backend, "shards-window"]
    return out


def fake_prepared(out: Path, n: int) -> Path:
    """A prepared set of ``n`` samples that all point at one tiny image: what start-up reads, at any size."""
    with tempfile.TemporaryDirectory() as tmp:
        src = Path(tmp) / "src" / "c0"
        src.mkdir(parents=True)
        from PIL import Image

        Image.new("RGB", (64, 48), (90, 120, 150)).save(src / "0.jpg")
        prepare(src.parent, out / "one", PrepareOptions())
    meta = json.loads((out / "one" / "gpupipe.json").read_text())
    with np.load(out / "one" / "index.npz") as z:
        index = {k: np.repeat(z[k][:1], n) for k in z.files}
    index["label"] = np.arange(n, dtype=np.int64) % 1000
    index["source"] = np.array([f"/data/train/c{i % 1000:04d}/{i:08d}.JPEG" for i in range(n)])
    big = out / f"n{n}"
    big.mkdir()
    shutil.move(out / "one" / meta["shards"][0], big / meta["shards"][0])
    np.savez(big / "index.npz", **index)
    meta.update(samples=n, classes=[f"c{i:04d}" for i in range(1000)])
    meta["class_to_idx"] = {c: i for i, c in enumerate(meta["classes"])}
    (big / "gpupipe.json").write_text(json.dumps(meta))
    shutil.rmtree(out / "one")
    return big


_STARTUP = """
import json, sys, time
import gpupipe
t0 = time.perf_counter()
loader = gpupipe.build_loader(sys.argv[1], "pillow", batch_size=256, device="cpu", num_workers=0)
t1 = time.perf_counter()
next(iter(loader))
t2 = time.perf_counter()
print(json.dumps({"build_loader_s": t1 - t0, "first_batch_s": t2 - t1}))
"""


def cmd_startup(args) -> None:
    results = []
    with tempfile.TemporaryDirectory() as tmp:
        for n in map(int, args.sizes.split(",")):
            folder = fake_prepared(Path(tmp), n)
            runs = [
                json.loads(
                    subprocess.run(
                        [sys.executable, "-c", _STARTUP, str(folder)], check=True, capture_output=True, text=True
                    ).stdout
                )
                for _ in range(args.repeats)
            ]
            results.append(
                {
                    "samples": n,
                    **{k: statistics.median(r[k] for r in runs) for k in runs[0]},
                    "build_loader_max_s": max(r["build_loader_s"] for r in runs),
                }
            )
    _report("startup", {**vars(args), "func": None}, results, args.json)


def cmd_prepare(args) -> None:
    options = PrepareOptions(max_side=args.max_side, quality=args.quality, subsampling=args.subsampling)
    results = []
    for w in map(int, args.workers.split(",")):
        with tempfile.TemporaryDirectory(dir=args.tmp) as tmp:
            t0 = time.perf_counter()
            s = prepare(args.data, Path(tmp) / "out", options, workers=w)
            dt = time.perf_counter() - t0
        n = s.samples + len(s.left_out)
        results.append(
            {
                "workers": w,
                "images": n,
                "seconds": dt,
                "images_per_s": n / dt,
                "images_per_s_per_worker": n / dt / w,
                "reencoded": s.samples - s.copied,
            }
        )
    _report("prepare", {**vars(args), "func": None}, results, args.json)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(required=True)
    p = sub.add_parser("read", help="shards vs folder, per backend")
    p.add_argument("data")
    p.add_argument("--prepared", help="the prepared folder (default DATA-shards[-maxN], made if missing)")
    p.add_argument("--backends", help="comma-separated (default: every available CPU-capable one)")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--seconds", type=float, default=10.0, help="timed seconds per figure, split over the repeats")
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--device", default="cpu")
    p.add_argument("--max-side", type=int)
    p.add_argument("--quality", type=int, default=90)
    p.add_argument("--s3", action="store_true", help="also read the shards from a local S3 server (moto_server)")
    p.add_argument("--shard-size", type=int, default=512, help="MiB per shard at most (gpupipe prepare's default)")
    p.add_argument(
        "--sources",
        help="comma-separated, of folder,shards,s3,s3-ranges,shards-window,s3-window (default: the first four)",
    )
    p.add_argument("--memory-cache", type=int, default=0, help="MiB: Remote(memory_cache=) of s3-ranges and s3-window")
    p.add_argument("--shuffle-window", type=int, default=4, help="shards: the shuffle_window of the -window sources")
    p.add_argument("--skip-extras", action="store_true", help="no read path alone nor paired batches after --s3")
    p.add_argument(
        "--paired-window", action="store_true", help="after --s3: paired batches with --memory-cache, --shuffle-window"
    )
    p.set_defaults(func=cmd_read)
    p = sub.add_parser("startup", help="build_loader start-up against set size")
    p.add_argument("--sizes", default="1000,10000,100000")
    p.add_argument("--repeats", type=int, default=3)
    p.set_defaults(func=cmd_startup)
    p = sub.add_parser("prepare", help="gpupipe prepare throughput per worker count")
    p.add_argument("data")
    p.add_argument("--workers", default="1,2", help="comma-separated worker counts")
    p.add_argument("--max-side", type=int)
    p.add_argument("--quality", type=int, default=90)
    p.add_argument("--subsampling", choices=["keep", "420"], default="keep")
    p.add_argument("--tmp", help="where outputs go (deleted after each run; default the system temp folder)")
    p.set_defaults(func=cmd_prepare)
    for p in sub.choices.values():
        p.add_argument("--json", help="write the report here")
        p.add_argument("--note", help="kept in the report's config (e.g. what else ran on the machine)")
    args = parser.parse_args()
    args.func(args)


if __name__ == "__main__":
    main()
