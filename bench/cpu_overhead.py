"""Issue 24: what a CPU decode worker spends after the decode, old path against new, on the same machine and run.

Three jobs per decoder, each a DataLoader over the same files (shuffled, the train recipe at ``--size``):

- ``floor``: only the decode the train pipeline cannot avoid (``decode`` with a plan), as ``gpupipe bench``'s floor;
- ``per-sample``: the path before issue 24, kept here verbatim: one ``__getitem__`` per image (crop, resize into a
  fresh tensor, mirror copy), then a collate that stacks them into a new batch, which the hand-over to the main
  process copies again into shared memory (labels as a second shared tensor);
- ``batch``: gpupipe's CPU loader's worker as it is now (``_SampleDataset.__getitems__``: one call per batch, each
  image resized straight into its slot of one shared-memory buffer).

- ``loader``: gpupipe's loader itself (``build_loader``, device ``cpu``), as ``gpupipe bench`` times train: float32
  normalised batches, so the main process's share (copying the batch out, NHWC to NCHW, normalisation) counts.

``time`` (default) starts all jobs, then times them in turns (``--rounds`` rounds of one ``--seconds`` window each, the
prefetched batches taken untimed before each window), and prints img/s, each job against its decoder's floor, and the
CPU time per image of the worker processes and of the main process (``/proc``, every thread of each: what a profile
inside one process does not see, e.g. the main process's torch threads running on a worker's core). The first three
jobs' main processes only count batches. ``profile`` runs both paths in this process under
cProfile (what one worker does per batch, the hand-over pickling included) and prints the fraction of time per step.

    python bench/cpu_overhead.py time --data /tmp/photos --decoders turbojpeg,pillow --workers 1
    python bench/cpu_overhead.py profile --data /tmp/photos --decoders turbojpeg

On a shared machine read the ratios (new / old, vs floor), not the rates.
"""

from __future__ import annotations

import argparse
import cProfile
import io
import os
import pstats
import statistics
import time
from multiprocessing.reduction import ForkingPickler

import numpy as np
import torch
import torch.nn.functional as F
from PIL import Image
from torch.utils.data._utils import worker

from gpupipe.api import build_loader
from gpupipe.backends import get
from gpupipe.backends.cpu import _Collate, _SampleDataset
from gpupipe.data.loader import Batch
from gpupipe.data.sampler import ShardSampler
from gpupipe.recipe import Recipe
from gpupipe.sources.open import open_source


def _old_resize(region: np.ndarray, hw: tuple[int, int]) -> torch.Tensor:
    x = torch.from_numpy(np.ascontiguousarray(region)).permute(2, 0, 1).unsqueeze(0)
    return x if tuple(x.shape[2:]) == hw else F.interpolate(x, size=hw, mode="bilinear", antialias=True)


def _old_crop(decoder, data: bytes, path: str, plan, size: int) -> np.ndarray:
    """The crop + resize as it was before issue 24 (gpupipe/image.py crop_resize and resize_box, train boxes)."""
    img, box, upright_hw, _ = decoder.decode(data, path, plan, size)
    h, w = (img.height, img.width) if isinstance(img, Image.Image) else img.shape[:2]
    sy, sx = h / upright_hw[0], w / upright_hw[1]
    if getattr(decoder, "pil_resize", False) and isinstance(img, Image.Image):
        b = box.scaled(sy, sx)
        out = img.resize(
            (size, size), Image.Resampling.BILINEAR, box=(b.left, b.top, b.left + b.width, b.top + b.height)
        )
        out = out.transpose(Image.Transpose.FLIP_LEFT_RIGHT) if box.flip else out
        return np.asarray(out).transpose(2, 0, 1)
    bh, bw = min(h, max(1, round(box.height * sy))), min(w, max(1, round(box.width * sx)))
    top, left = min(h - bh, round(box.top * sy)), min(w - bw, round(box.left * sx))
    if isinstance(img, Image.Image):
        region = np.asarray(img.crop((left, top, left + bw, top + bh)))
    else:
        region = img[top : top + bh, left : left + bw]
    res = _old_resize(region, (size, size))[0]
    return (res.flip(-1) if box.flip else res).numpy()


class _PerSample(torch.utils.data.Dataset):
    """The pre-issue-24 worker: one sample per call, then a stacking collate (errors left out: good data here)."""

    def __init__(self, data, decoder, recipe: Recipe):
        self.data, self.decoder, self.recipe = data, decoder, recipe

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, key: tuple[int, int]) -> tuple[np.ndarray, int]:
        epoch, index = key
        path, label = self.data.samples[index]
        plan = self.recipe.plan(True, 0, epoch, index)
        return _old_crop(self.decoder, self.data.read(index), path, plan, self.recipe.size), label


def _stack(items: list[tuple[np.ndarray, int]]) -> Batch:
    images = torch.empty((len(items), *items[0][0].shape), dtype=torch.uint8)
    np.stack([im for im, _ in items], out=images.numpy())
    return Batch(images, torch.tensor([label for _, label in items], dtype=torch.int64), "NCHW")


class _Floor(_PerSample):
    def __getitem__(self, key: tuple[int, int]) -> tuple[np.ndarray, int]:  # type: ignore[override]
        epoch, index = key
        path, label = self.data.samples[index]
        plan = self.recipe.plan(True, 0, epoch, index)
        self.decoder.decode(self.data.read(index), path, plan, self.recipe.size)
        return np.empty(0), label


def _datasets(args: argparse.Namespace, name: str) -> dict[str, tuple[torch.utils.data.Dataset, object]]:
    data, recipe = open_source(args.data), Recipe(args.size)
    decoder = get(name).decoder(None, True)  # type: ignore[misc]
    return {
        "floor": (_Floor(data, decoder, recipe), len),
        "per-sample": (_PerSample(data, decoder, recipe), _stack),
        "batch": (_SampleDataset(data, decoder, recipe, True, 0), _Collate(args.size)),
    }


class _Stream:
    """An endless stream of batch sizes from one job, with the CPU seconds its worker processes have used
    (``/proc``: each process's user + system time, every thread)."""

    def __init__(self, epochs, count):
        self.epochs, self.count, self.pids = epochs, count, []
        self._it = self._batches()

    def _batches(self):
        epoch = 0
        while True:
            for b in self.epochs(epoch):
                self.pids = self.pids or _worker_pids()
                yield self.count(b)
            epoch += 1

    def __next__(self) -> int:
        return next(self._it)

    def worker_cpu(self) -> float:
        return sum(_proc_cpu(pid) for pid in self.pids)


_SEEN: set[int] = set()


def _worker_pids() -> list[int]:
    """This process's child processes not yet claimed by another stream (each job starts its workers in turn)."""
    kids = {int(p) for t in os.listdir("/proc/self/task") for p in _read(f"/proc/self/task/{t}/children").split()}
    new = sorted(kids - _SEEN)
    _SEEN.update(new)
    return new


def _read(path: str) -> str:
    try:
        with open(path) as f:
            return f.read()
    except OSError:
        return ""


def _proc_cpu(pid: int) -> float:
    """A process's CPU seconds (user + system, every thread) from /proc; 0 when it is gone or not Linux."""
    fields = _read(f"/proc/{pid}/stat").rsplit(")", 1)[-1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK") if len(fields) > 12 else 0.0


def _stream(args: argparse.Namespace, ds, collate) -> _Stream:
    sampler = ShardSampler(len(ds), args.batch, shuffle=True)
    dl = torch.utils.data.DataLoader(
        ds, batch_sampler=sampler, collate_fn=collate, num_workers=args.workers, persistent_workers=True
    )

    def epoch(e: int):
        sampler.set_epoch(e)
        return dl

    return _Stream(epoch, lambda b: b if isinstance(b, int) else len(b.labels))


def _loader_stream(args: argparse.Namespace, name: str) -> _Stream:
    """gpupipe's loader as ``gpupipe bench`` times train: float32 normalised NCHW batches on the CPU device, so the
    main process's share (the batch copied out of the worker's buffer, NHWC to NCHW, normalisation) is counted."""
    loader = build_loader(
        args.data, name, batch_size=args.batch, train=True, image_size=args.size, device="cpu",
        num_workers=args.workers, on_error="skip",
    )  # fmt: skip
    return _Stream(lambda e: loader, lambda b: len(b[1]))


def time_jobs(args: argparse.Namespace) -> None:
    jobs: dict[tuple[str, str], _Stream] = {}
    for name in args.decoders.split(","):
        for kind, (ds, collate) in _datasets(args, name).items():
            jobs[(name, kind)] = _stream(args, ds, collate)
            for _ in range(3):
                next(jobs[(name, kind)])  # workers started, warm
        jobs[(name, "loader")] = _loader_stream(args, name)
        for _ in range(3):
            next(jobs[(name, "loader")])
    rates: dict[tuple[str, str], list[float]] = {k: [] for k in jobs}
    cpu = {k: [0.0, 0.0, 0.0] for k in jobs}  # worker s, main s, images
    for _ in range(args.rounds):
        for key, stream in jobs.items():
            for _ in range(2 * args.workers):
                next(stream)  # what was prefetched while another job was timed
            n, w0, m0, t0 = 0, stream.worker_cpu(), time.process_time(), time.perf_counter()
            while time.perf_counter() - t0 < args.seconds:
                n += next(stream)
            rates[key].append(n / (time.perf_counter() - t0))
            used = cpu[key]
            used[0] += stream.worker_cpu() - w0
            used[1] += time.process_time() - m0
            used[2] += n
    print(f"{args.workers} worker(s), batch {args.batch}, {args.rounds} x {args.seconds} s windows, median (min-max);")
    print("CPU ms per image while timed: the workers' and the main process's (every thread of each)")
    for (name, kind), r in rates.items():
        med, floor = statistics.median(r), statistics.median(rates[(name, "floor")])
        w, m, n = cpu[(name, kind)]
        fw, _, fn = cpu[(name, "floor")]
        print(
            f"{name:10} {kind:10} {med:7.1f} img/s ({min(r):.0f}-{max(r):.0f})  vs floor {med / floor:6.1%}"
            f"  CPU ms/img: workers {w / n * 1e3:6.3f} (after the decode {(w / n - fw / fn) * 1e3:6.3f})"
            f"  main {m / n * 1e3:6.3f}"
        )


STEPS = (  # (step, substrings of cProfile's "file:function" label), first match wins; the rest is Python overhead
    ("hand-over", ("_share_fd_cpu_", "_new_shared", "dump", "loads", "rebuild_storage", "arrive", "clone")),
    ("decode", ("turbojpeg.py:decode", "'decode' of 'ImagingDecoder'")),
    ("resize", ("_upsample_bilinear2d_aa", "aten.", "'resize' of 'ImagingCore'")),
    ("copies", ("stack", "ascontiguousarray", "flip", "copy_", "'transpose' of", "'crop' of", "copyto")),
    ("header", ("decode_header", "_jpeg_segments", "probe", "getexif", "draft", "PIL/Image.py:open")),
    ("read", ("'read' of '_io", "io.open")),
    ("crop plan", ("recipe.py",)),
)


def _step(func: tuple[str, int, str]) -> str:
    label = f"{func[0]}:{func[2]}"
    return next((step for step, keys in STEPS if any(k in label for k in keys)), "python overhead")


def profile(args: argparse.Namespace) -> None:
    for name in args.decoders.split(","):
        for kind, (ds, collate) in _datasets(args, name).items():
            n = len(ds) // args.batch * args.batch
            batches = [[(0, i) for i in range(s, s + args.batch)] for s in range(0, n, args.batch)]
            getitems = getattr(ds, "__getitems__", None)

            def run(batches=batches, ds=ds, collate=collate, getitems=getitems) -> None:
                for keys in batches:
                    b = collate(getitems(keys) if getitems else [ds[k] for k in keys])
                    if not isinstance(b, int):  # the hand-over, both ends (the main process's copy included)
                        msg = io.BytesIO()
                        ForkingPickler(msg).dump(b)
                        ForkingPickler.loads(msg.getvalue())

            # as in a DataLoader worker (the batch buffer is then allocated in shared memory)
            worker._worker_info = worker.WorkerInfo(id=0, num_workers=1, seed=0, dataset=ds)
            run()  # warm: page cache, allocator
            prof = cProfile.Profile()
            prof.runcall(run)
            worker._worker_info = None
            stats = pstats.Stats(prof).stats  # type: ignore[attr-defined]
            total = sum(v[2] for v in stats.values())
            parts: dict[str, float] = {}
            for func, v in stats.items():
                parts[_step(func)] = parts.get(_step(func), 0.0) + v[2]
            shares = ", ".join(f"{k} {v / total:.0%}" for k, v in sorted(parts.items(), key=lambda kv: -kv[1]))
            print(f"{name:12} {kind:10} {total / n * 1e3:6.3f} ms/img (profiled)  {shares}")


def paired(args: argparse.Namespace) -> None:
    """The three jobs in this process, as a worker runs them, on the same batches in turns (the order rotating):
    per batch, each job's time; the medians over batches of per-image time after the decode (job - floor) hold on a
    busy machine better than throughput does."""
    for name in args.decoders.split(","):
        jobs = _datasets(args, name)
        n = len(next(iter(jobs.values()))[0]) // args.batch * args.batch
        times: dict[str, list[float]] = {k: [] for k in jobs}
        worker._worker_info = worker.WorkerInfo(id=0, num_workers=1, seed=0, dataset=None)
        for r in range(args.rounds):
            for s in range(0, n, args.batch):
                keys = [(r, i) for i in range(s, s + args.batch)]
                order = list(jobs)[s // args.batch % 3 :] + list(jobs)[: s // args.batch % 3]
                for kind in order:
                    ds, collate = jobs[kind]
                    getitems = getattr(ds, "__getitems__", None)
                    t0 = time.perf_counter()
                    b = collate(getitems(keys) if getitems else [ds[k] for k in keys])
                    if not isinstance(b, int):  # the hand-over, both ends (the main process's copy included)
                        msg = io.BytesIO()
                        ForkingPickler(msg).dump(b)
                        del b
                        ForkingPickler.loads(msg.getvalue())
                    times[kind].append((time.perf_counter() - t0) / args.batch * 1e3)
        worker._worker_info = None
        after = {k: statistics.median(a - f for a, f in zip(times[k], times["floor"], strict=True)) for k in times}
        for kind, t in times.items():
            print(
                f"{name:12} {kind:10} median {statistics.median(t):6.3f} ms/img  after the decode {after[kind]:6.3f}"
                f" ms/img ({after[kind] / max(after['per-sample'], 1e-9):.0%} of per-sample's)"
            )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("mode", choices=["time", "profile", "paired"], nargs="?", default="time")
    p.add_argument("--data", required=True)
    p.add_argument("--decoders", default="turbojpeg,pillow")
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--size", type=int, default=224)
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=3.0)
    args = p.parse_args()
    if args.mode != "time":  # one thread, as in a DataLoader worker; `time`'s main process is left as a user's is
        torch.set_num_threads(1)
    {"time": time_jobs, "profile": profile, "paired": paired}[args.mode](args)


if __name__ == "__main__":
    main()
