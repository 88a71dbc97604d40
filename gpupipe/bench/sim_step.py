"""The GPU's wait, measured without a GPU: a simulated model step fed by each backend, and a contention probe.

The GPU waits on the loader whenever the training thread's ``next(loader)`` does not return at once, and that is a
host-side story, measurable on any machine. Here the training thread runs a simulated step: a fixed CPU time (what a
model's kernel launches take; ``--cpu-share`` of the step), then a fixed wait that takes no CPU (the GPU's compute),
sized so that the loader alone is ``--headroom`` (1.5) times as fast as the step. The **data-wait** is the share of
the run spent in ``next()``, over ``--epochs`` epochs, each pass left one batch early (as ``gpupipe train --accum 2``
leaves an odd last batch), epoch starts included; the first ``next()`` of each epoch is reported beside the median
one. The loaders are built as for CUDA: a GPU rank's default workers (``--workers`` to set them), the device side on
the meta device (every op dispatched, none computed: gpupipe.bench.host_budget), one warm-up epoch before.

The **contention probe** is a fixed CPU task on the training thread (pure Python, ``--probe-ms`` alone), timed in
pairs: once with the loader idle (its read-ahead full), once right after a ``next()``, while the loader's processes
and threads make the next batch. The ratio of the medians says how much the loader slows the training thread down;
pairing keeps the machine's drift (other load, clock changes) out of it. It is timed **flat out** too: between
batches taken as fast as they come, the loader never idle, each round's flat-out times over the probe alone timed
just before and after them, with the time the probe waited for a core then (Linux's run-queue delay: a loader's
threads that take the training thread's core, where a shared lock or cache would not show).

    python -m gpupipe.bench.sim_step DATA [--backends pillow,turbojpeg,dali] [--batch 32] [--size 224]
        [--epochs 3] [--steps 30] [--json bench/results/sim-step-NAME-DATE.json]
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import time
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import NamedTuple

import torch

from .._system import default_workers
from ..backends import available_backends
from ..errors import run_script
from ..recipe import Recipe
from .host_budget import meta_loader


@dataclass(frozen=True)
class Settings:
    batch: int = 32
    size: int = 224
    workers: int | None = None  # None: a GPU rank's default
    epochs: int = 3
    steps: int = 30  # at least this many steps an epoch (the data set and the batch decide how many)
    headroom: float = 1.5  # the loader alone is this many times as fast as the step
    cpu_share: float = 0.25  # of the step, spent on the CPU (kernel launches); the rest waits (the GPU's compute)
    probe_ms: float = 7.0
    probe_rounds: int = 15


def spin(seconds: float) -> None:
    """Spend ``seconds`` of this thread's CPU time (the wall time it takes grows when the thread waits for a core)."""
    end = time.thread_time() + seconds
    while time.thread_time() < end:
        sum(range(2000))


def probe_task(n: int) -> None:
    """The probe: a fixed amount of pure-Python work (it holds the GIL, as the training thread's Python does)."""
    x = 0
    for i in range(n):
        x += i * i


def calibrate_probe(ms: float) -> int:
    """The probe's size that takes ``ms`` alone, on this machine (the fastest of a few runs)."""
    n = 20_000
    while True:
        took = min(_timed(n) for _ in range(5))
        if took > 0.002:
            return max(1, round(n * ms / 1e3 / took))
        n *= 4


def _timed(n: int) -> float:
    t0 = time.perf_counter()
    probe_task(n)
    return time.perf_counter() - t0


def time_probe(n: int, rounds: int, take, settle: float) -> tuple[float, float]:
    """Median wall ms of the probe with the loader idle (``settle`` s after the last ``take()``: its read-ahead
    refilled) and right after a ``take()`` (the loader making the next batch), over ``rounds`` pairs."""
    alone, loaded = [], []
    for _ in range(rounds):
        time.sleep(settle)
        alone.append(_timed(n) * 1e3)
        time.sleep(settle)
        take()
        loaded.append(_timed(n) * 1e3)
    return statistics.median(alone), statistics.median(loaded)


def core_wait() -> float | None:
    """Seconds the calling thread has waited, runnable, for a core so far (Linux's schedstat: the run queue's delay;
    waiting for a lock, the GIL included, is sleeping and not counted); None where the kernel does not keep it."""
    try:
        with open("/proc/thread-self/schedstat") as f:
            return int(f.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return None


class FlatOut(NamedTuple):
    ms: float  # the probe's median wall ms flat out
    ratio: float  # the median over the rounds of its time over the probe alone in the same round
    core_wait_ms: float | None  # the median ms of it spent waiting for a core (None: not known on this system)


def time_flat_out(n: int, rounds: int, take, settle: float, drain: int, per_round: int = 3) -> FlatOut:
    """The probe between batches taken as fast as they come (``take()`` then the probe, with no pause: the loader's
    processes and threads always at work): its median wall ms, the median over ``rounds`` of its time over the
    probe's time alone in the same round, and the median time it waited for a core (threads of the loader that take
    the training thread's core show here, where a shared lock or cache would not). Each round times the probe alone
    once the loader is idle (``settle`` s after a take: its read-ahead refilled) before and after it, takes ``drain``
    batches flat out (the read-ahead emptied), then times ``per_round`` probes flat out. Set beside the probe alone of
    its own round, not of another moment: a pure-Python task's time alone moves with the machine (bench/README.md,
    the simulated step flat out, timed in rounds)."""
    flat, ratios, waits = [], [], []
    time.sleep(settle)
    alone = _timed(n)
    for _ in range(rounds):
        for _ in range(drain):
            take()
        times = []
        for _ in range(per_round):
            take()
            waited = core_wait()
            times.append(_timed(n))
            waited_after = core_wait()
            if waited is not None and waited_after is not None:
                waits.append(waited_after - waited)
        time.sleep(settle)
        after = _timed(n)
        middle = statistics.median(times)
        flat.append(middle * 1e3)
        ratios.append(middle / ((alone + after) / 2))
        alone = after
    wait_ms = statistics.median(waits) * 1e3 if waits else None
    return FlatOut(statistics.median(flat), statistics.median(ratios), wait_ms)


def forever(loader):
    """The loader's batches across epochs, as a loop that runs whole passes reads them."""
    while True:
        yield from loader


def loader_ms(loader, workers: int, batches: int) -> float:
    """The loader alone: ms per batch once its workers run, after the batches made while it started."""
    it = forever(loader)
    for _ in range(workers + 1):
        next(it)
    t0 = time.perf_counter()
    for _ in range(batches):
        next(it)
    return (time.perf_counter() - t0) * 1e3 / batches


def run_epochs(loader, first: int, epochs: int, step_cpu: float, step_wait: float) -> dict:
    """``epochs`` passes from epoch ``first``, each left one batch early, a simulated step after each batch: the
    time in ``next()`` (each epoch's first apart) and the whole run's."""
    waits: list[float] = []
    starts: list[float] = []
    total = 0.0
    for epoch in range(first, first + epochs):
        loader.set_epoch(epoch)
        t_epoch = time.perf_counter()
        it = iter(loader)
        for k in range(len(loader) - 1):
            t0 = time.perf_counter()
            next(it)
            (starts if k == 0 else waits).append(time.perf_counter() - t0)
            spin(step_cpu)
            time.sleep(step_wait)
        total += time.perf_counter() - t_epoch
    wait = sum(waits) + sum(starts)
    return {
        "data_wait": wait / total,
        "epoch_start_ms": [round(s * 1e3, 2) for s in starts],
        "next_median_ms": round(statistics.median(waits) * 1e3, 3),
        "steps_per_epoch": len(waits) // epochs + 1,
        "run_s": round(total, 2),
    }


def one_backend(data: str, backend: str, s: Settings, probe_n: int) -> dict:
    """The simulated step and the probe, for one backend."""
    gc.collect()
    time.sleep(1.0)  # the last backend's processes gone
    workers = default_workers(torch.device("cuda")) if s.workers is None else s.workers
    loader = meta_loader(data, backend, Recipe(s.size), s.batch, workers)
    if len(loader) - 1 < s.steps:
        raise ValueError(
            f"{data}: {len(loader)} batches of {s.batch} an epoch, fewer than --steps {s.steps} + 1: use a smaller "
            "--batch or more images"
        )
    alone_ms = loader_ms(loader, workers, max(8, 2 * workers))
    step = alone_ms * s.headroom / 1e3
    step_cpu, step_wait = step * s.cpu_share, step * (1 - s.cpu_share)
    run_epochs(loader, 1, 1, step_cpu, step_wait)  # warm-up: the stream as it runs from now on
    row = run_epochs(loader, 2, s.epochs, step_cpu, step_wait)
    batches = forever(loader)
    # a worker remakes the batch taken in ``workers`` batch times (they run side by side): twice that, refilled
    settle = max(0.1, 2 * max(1, workers) * alone_ms / 1e3)
    alone, loaded = time_probe(probe_n, s.probe_rounds, batches.__next__, settle)
    # emptied: a worker's prefetch, the take thread's batch and the one waiting for the training thread, each worker
    flat = time_flat_out(probe_n, s.probe_rounds, batches.__next__, settle, drain=2 + 3 * max(1, workers))
    del batches, loader  # its workers end now
    return {
        "backend": backend,
        "workers": workers,
        "batch": s.batch,
        "size": s.size,
        "loader_alone_ms": round(alone_ms, 2),
        "step_cpu_ms": round(step_cpu * 1e3, 2),
        "step_wait_ms": round(step_wait * 1e3, 2),
        "epochs": s.epochs,
        **row,
        "probe_alone_ms": round(alone, 3),
        "probe_with_loader_ms": round(loaded, 3),
        "probe_ratio": round(loaded / alone, 3),
        "probe_flat_out_ms": round(flat.ms, 3),
        "probe_flat_out_ratio": round(flat.ratio, 3),
        "probe_flat_out_core_wait_ms": None if flat.core_wait_ms is None else round(flat.core_wait_ms, 3),
    }


def _line(r: dict) -> str:
    starts = ", ".join(f"{v:.1f}" for v in r["epoch_start_ms"])
    return (
        f"{r['backend']:>10}: {r['workers']} worker(s), step {r['step_cpu_ms'] + r['step_wait_ms']:.0f} ms "
        f"(loader alone {r['loader_alone_ms']:.0f} ms/batch), data-wait {r['data_wait']:.1%} over {r['epochs']} x "
        f"{r['steps_per_epoch']} steps, epoch starts {starts} ms (median next() {r['next_median_ms']:.1f} ms), "
        f"probe {r['probe_with_loader_ms']:.1f} / {r['probe_alone_ms']:.1f} ms alone = {r['probe_ratio']:.2f}x, "
        f"flat out {r['probe_flat_out_ms']:.1f} ms = {r['probe_flat_out_ratio']:.2f}x"
        + (
            ""
            if r["probe_flat_out_core_wait_ms"] is None
            else f" ({r['probe_flat_out_core_wait_ms']:.2f} ms of it waiting for a core)"
        )
    )


def run(data: str, backends: list[str], s: Settings) -> dict:
    from ..info import machine_info, source_commit  # the machine and the code beside every figure

    probe_n = calibrate_probe(s.probe_ms)
    results = []
    for backend in backends:
        results.append(one_backend(data, backend, s, probe_n))
        print(_line(results[-1]), flush=True)
    return {
        "kind": "sim-step",
        "date": time.strftime("%Y-%m-%d"),
        "commit": source_commit(),
        "machine": machine_info(),
        "data": data,
        "config": asdict(s),
        "probe": "paired",  # idle and right after a next(), in pairs; flat out in rounds between idle ones
        "results": results,
    }


def from_cli(args, data: str) -> int:
    """``gpupipe bench --simulate-step``: at the first ``--image-size``, ``--batch-size``, ``--workers`` (default: a GPU
    rank's), over ``--backends`` (default: pillow, turbojpeg, dali)."""
    argv = [data, "--size", str(args.image_size[0]), "--batch", str(args.batch_size)]
    argv += ["--workers", str(args.workers)] if args.workers is not None else []
    argv += ["--backends", args.backends] if args.backends else []
    argv += ["--json", args.json] if args.json else []
    main(argv)
    return 0


def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("data", help="anything build_loader reads (a folder, a CSV list, shards)")
    p.add_argument("--backends", default="pillow,turbojpeg,dali", help="comma-separated (those available are run)")
    defaults = Settings()
    for name, value in asdict(defaults).items():
        kind = float if isinstance(value, float) else int
        p.add_argument(f"--{name.replace('_', '-')}", type=kind, default=value)
    p.add_argument("--json", type=Path, help="write the report here (bench/results/sim-step-*.json)")
    args = p.parse_args(argv)
    s = Settings(**{k: getattr(args, k) for k in asdict(defaults)})
    backends = [b for b in args.backends.split(",") if b in available_backends()]
    report = run(args.data, backends, s)
    if args.json:
        args.json.write_text(json.dumps(report, indent=1) + "\n")


if __name__ == "__main__":
    run_script(main)
