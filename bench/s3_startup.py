"""Start-up with many shards, from a local S3-compatible server and from the disk: the time from ``build_loader`` to
the first batch, in a fresh process each time, for a folder written by ``gpupipe prepare`` and for foreign
WebDataset shards (first use: their header index is built; cached: it is read back).

    python bench/s3_startup.py DATA [--backend turbojpeg] [--workers 2] [--repeats 3] [--json OUT]

DATA's images become one shard each (``gpupipe prepare`` with the smallest shard size; and one ``.tar`` per image,
``key.jpg`` + ``key.cls``, for the foreign set): ``data/photos`` gives 1,000 shards. The server is ``moto_server``
(a process on 127.0.0.1, started by :func:`s3bench.local_s3`), reached through the ``AWS_*`` variables.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tarfile
import tempfile
import time
from pathlib import Path

from s3bench import local_s3
from shards import _report  # bench/shards.py and s3bench.py, beside this script

from gpupipe.prepare import PrepareOptions, prepare
from gpupipe.sources.open import open_source

_FIRST_BATCH = """
import json, sys, time
from gpupipe import build_loader  # torch and the backends imported: not start-up's cost
t0 = time.perf_counter()
loader = build_loader(sys.argv[1], sys.argv[2], batch_size=64, device="cpu", num_workers=int(sys.argv[3]),
                              image_size=224, normalize=False)
t1 = time.perf_counter()
next(iter(loader))
t2 = time.perf_counter()
print(json.dumps({"build_loader_s": t1 - t0, "to_first_batch_s": t2 - t0}))
"""


def _foreign(prepared: Path, out: Path) -> int:
    """One WebDataset ``.tar`` per sample of the prepared set (its bytes, ``key.cls`` its label)."""
    data = open_source(prepared)
    out.mkdir()
    for i in range(len(data)):
        with tarfile.open(out / f"part-{i:06d}.tar", "w") as tf:
            for name, payload in ((f"{i:06d}.jpg", data.read(i)), (f"{i:06d}.cls", str(data.targets[i]).encode())):
                info = tarfile.TarInfo(name)
                info.size = len(payload)
                tf.addfile(info, _Bytes(payload))
    return len(data)


class _Bytes:
    def __init__(self, data: bytes):
        self.data, self.at = data, 0

    def read(self, n: int = -1) -> bytes:
        chunk = self.data[self.at :] if n < 0 else self.data[self.at : self.at + n]
        self.at += len(chunk)
        return chunk


def _time(root: str, args, env: dict[str, str], before=None) -> dict[str, float]:
    """The median of ``args.repeats`` fresh processes (``before()`` run ahead of each: a cache emptied)."""
    runs = []
    for _ in range(args.repeats):
        if before is not None:
            before()
        done = subprocess.run(
            [sys.executable, "-c", _FIRST_BATCH, root, args.backend, str(args.workers)],
            capture_output=True,
            text=True,
            env=env,
        )
        if done.returncode:
            raise SystemExit(f"{root}: {done.stderr.strip().splitlines()[-1:]}")
        runs.append(json.loads(done.stdout.strip().splitlines()[-1]))
    return {
        **{k: statistics.median(r[k] for r in runs) for k in runs[0]},
        "to_first_batch_max_s": max(r["to_first_batch_s"] for r in runs),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data")
    parser.add_argument("--backend", default="turbojpeg")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--note", help="kept in the report's config (e.g. what else ran on the machine)")
    args = parser.parse_args()
    with tempfile.TemporaryDirectory() as tmp:
        work = Path(tmp)
        prepare(args.data, work / "prepared", PrepareOptions(shard_size=2048))  # one sample a shard
        samples = _foreign(work / "prepared", work / "wds")
        shards = len(json.loads((work / "prepared" / "gpupipe.json").read_text())["shards"])
        t0 = time.perf_counter()
        server, url = local_s3({"prepared": work / "prepared", "wds": work / "wds"})
        print(f"{2 * shards + 2} objects uploaded in {time.perf_counter() - t0:.1f} s", file=sys.stderr)
        try:
            results = _runs(args, work, url, shards)
        finally:
            server.kill()
            server.wait()
    for r in results:
        r.update(shards=shards, samples=samples)
    _report("s3-startup", {**vars(args)}, results, args.json)


def _runs(args, work: Path, url: str, shards: int) -> list[dict]:
    env = dict(os.environ, XDG_CACHE_HOME=str(work / "xdg"))
    pattern = f"part-{{000000..{shards - 1:06d}}}.tar"

    def forget_disk_index():
        for p in (work / "wds").glob("*.gpupipe-index.npz"):
            p.unlink()

    def forget_remote_index():
        subprocess.run(["rm", "-rf", str(work / "xdg")], check=True)

    cases = [
        ("prepared", "disk", "", str(work / "prepared"), None),
        ("prepared", "s3", "", f"{url}/prepared", None),
        ("webdataset", "disk", "first use", str(work / "wds" / "part-*.tar"), forget_disk_index),
        ("webdataset", "disk", "index cached", str(work / "wds" / "part-*.tar"), None),
        ("webdataset", "s3", "first use", f"{url}/wds/{pattern}", forget_remote_index),
        ("webdataset", "s3", "index cached", f"{url}/wds/{pattern}", None),
    ]
    results = []
    for kind, where, index, root, before in cases:
        r = {"shards_kind": kind, "source": where, "index": index, **_time(root, args, env, before)}
        print(r, file=sys.stderr)
        results.append(r)
    return results


if __name__ == "__main__":
    main()
