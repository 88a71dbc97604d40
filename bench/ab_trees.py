"""Two gpupipe trees side by side in one run (issue 24): the floor, then each tree's train loader on the CPU device,
each job in its own process, timed in turns as ``gpupipe bench`` times them (interleaved windows, the prefetched
batches taken untimed first), with the CPU time per image of the job's workers and of its main process (every thread
of each, from ``/proc``).

    git archive <before-commit> gpupipe | tar -x -C /tmp/before
    python bench/ab_trees.py --data data/photos --before /tmp/before --after . --decoders turbojpeg,pillow

The jobs' main processes run as a user's do (torch's default threads); the floor is ``gpupipe bench``'s.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time


def _cpu(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def _children() -> list[int]:
    kids: list[int] = []
    for task in os.listdir("/proc/self/task"):
        with open(f"/proc/self/task/{task}/children") as f:
            kids += [int(p) for p in f.read().split()]
    return kids


def _batches(data: str, decoder: str, kind: str, workers: int, batch: int):
    """Endless batch sizes: the floor (``gpupipe bench``'s ``_DecodeOnly``) or gpupipe's train loader on the CPU."""
    import torch

    if kind == "floor":
        from gpupipe.backends import get
        from gpupipe.bench.suite import _DecodeOnly
        from gpupipe.recipe import Recipe
        from gpupipe.sources.open import open_source

        ds = _DecodeOnly(open_source(data), get(decoder).decoder(None, True), Recipe(224))  # type: ignore[misc]
        dl = torch.utils.data.DataLoader(
            ds, batch_size=batch, num_workers=workers, shuffle=True, collate_fn=sum, persistent_workers=True
        )
        while True:
            yield from dl
    from gpupipe.api import build_loader

    loader = build_loader(
        data, decoder, batch_size=batch, image_size=224, device="cpu", num_workers=workers, drop_last=False,
        on_error="skip",
    )  # fmt: skip
    while True:
        for _, labels in loader:
            yield len(labels)


def job(args: argparse.Namespace) -> None:
    """One job's process: made and warmed, then one timed window per line read (its length in seconds)."""
    batches = _batches(args.data, args.decoders, args.kind, args.workers, args.batch)
    for _ in range(6):
        next(batches)
    kids = _children()
    print("ready", flush=True)
    for line in sys.stdin:
        for _ in range(4 * args.workers + 2):  # made while another job was timed
            next(batches)
        w0, m0, t0, n = sum(map(_cpu, kids)), time.process_time(), time.perf_counter(), 0
        while time.perf_counter() - t0 < float(line):
            n += next(batches)
        wall = time.perf_counter() - t0
        workers, main = sum(map(_cpu, kids)) - w0, time.process_time() - m0
        print(json.dumps([n / wall, workers / n * 1e3, main / n * 1e3]), flush=True)


def _start(args: argparse.Namespace, tree: str, decoder: str, kind: str) -> subprocess.Popen:
    cmd = [sys.executable, os.path.abspath(__file__), "--job", kind, "--data", os.path.abspath(args.data)]
    cmd += ["--decoders", decoder, "--workers", str(args.workers), "--batch", str(args.batch)]
    env = dict(os.environ, PYTHONPATH=os.path.abspath(tree))
    # run from /tmp: the tree is imported from PYTHONPATH, not from the current directory
    p = subprocess.Popen(cmd, stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd="/tmp")
    assert p.stdout is not None and p.stdout.readline().strip() == "ready", f"{tree} {decoder} {kind} did not start"
    return p


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--data", required=True)
    p.add_argument("--before", help="a tree holding the gpupipe package before the change (required)")
    p.add_argument("--after", default=".", help="the tree after it (default: this one)")
    p.add_argument("--decoders", default="turbojpeg,pillow")
    p.add_argument("--workers", type=int, default=1)
    p.add_argument("--batch", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--seconds", type=float, default=4.0)
    p.add_argument("--job", choices=["floor", "train"], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.job:
        args.kind = args.job
        return job(args)
    if not args.before:
        p.error("--before is required")
    jobs = {}
    for decoder in args.decoders.split(","):
        for name, tree, kind in (("floor", args.after, "floor"), ("before", args.before, "train")):
            jobs[(decoder, name)] = _start(args, tree, decoder, kind)
        jobs[(decoder, "after")] = _start(args, args.after, decoder, "train")
    got: dict[tuple[str, str], list[list[float]]] = {k: [] for k in jobs}
    for _ in range(args.rounds):
        for key, proc in jobs.items():
            time.sleep(1.0)  # the previous job's workers refill their queues
            assert proc.stdin is not None and proc.stdout is not None
            proc.stdin.write(f"{args.seconds}\n")
            proc.stdin.flush()
            got[key].append(json.loads(proc.stdout.readline()))
    for proc in jobs.values():
        assert proc.stdin is not None
        proc.stdin.close()
        proc.wait()
    print(f"{args.workers} worker(s), batch {args.batch}, {args.rounds} rounds x {args.seconds:g} s, interleaved")
    print("median img/s (min-max), vs the floor; CPU ms per image (median): the workers', the main process's")
    for (decoder, name), rows in got.items():
        rate, floor = statistics.median(r[0] for r in rows), statistics.median(r[0] for r in got[(decoder, "floor")])
        print(
            f"{decoder:10} {name:7} {rate:7.1f} ({min(r[0] for r in rows):.0f}-{max(r[0] for r in rows):.0f})"
            f"  {rate / floor:6.1%}  workers {statistics.median(r[1] for r in rows):.3f}"
            f"  main {statistics.median(r[2] for r in rows):.3f}"
        )


if __name__ == "__main__":
    main()
