"""What one node asks of object storage per epoch: 2 local ranks x 2 DataLoader workers (turbojpeg, a train loader
with ``shuffle_window``) reading prepared shards from a local S3-compatible server (moto's ``moto_server``) through a
counting proxy, with the node's shard cache (``gpupipe/sources/cache.py``), without it (each process keeps its own
blocks in ``memory_cache``), and from the same shards on the disk.

    python bench/s3cache.py DATA [--prepared DIR] [--shard-size MiB] [--memory-cache MiB] [--shuffle-window K]
                                 [--batch-size 64] [--json PATH]

Per source and epoch (first, second): the bytes the server answered (GET bodies) over the set's shard bytes, the
requests, and the epoch's seconds (the slower rank's; the ranks start each epoch together) with its ratio to the
disk's, run just before it. The first epoch's count includes start-up (listing, index, the first shards read ahead);
what the read ahead fetches for the next epoch as one ends falls in either. Byte and request counts do not depend on
the machine's load; the seconds do (the load average is recorded).
"""

from __future__ import annotations

import argparse
import collections
import http.client
import json
import os
import subprocess
import sys
import tempfile
import threading
from datetime import datetime, timezone
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path
from urllib.parse import urlsplit

from s3bench import local_s3  # bench/s3bench.py, beside this script

import gpupipe
from gpupipe.info import machine_info
from gpupipe.prepare import PrepareOptions, prepare

_RANK = """
import json, sys, time
import gpupipe
source, rank, window, batch, epochs = json.loads(sys.argv[1]), int(sys.argv[2]), int(sys.argv[3]), int(sys.argv[4]), 2
if isinstance(source, dict):
    source = gpupipe.Remote(**source)
loader = gpupipe.build_loader(source, "turbojpeg", train=True, batch_size=batch, image_size=224, num_workers=2,
                              device="cpu", normalize=False, rank=rank, world_size=2, shuffle_window=window)
print("ready", flush=True)
for epoch in range(epochs):
    sys.stdin.readline()
    loader.set_epoch(epoch)
    t0 = time.perf_counter()
    images = sum(len(y) for _, y in loader)
    print(json.dumps({"seconds": time.perf_counter() - t0, "images": images}), flush=True)
"""


class CountingProxy:
    """An HTTP proxy on 127.0.0.1 in front of ``upstream`` that counts requests and answered body bytes."""

    def __init__(self, upstream: str):
        host, port = urlsplit(upstream).hostname, urlsplit(upstream).port
        self.requests, self.bytes = collections.Counter(), collections.Counter()
        proxy = self

        class Handler(BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def forward(self):
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                conn = http.client.HTTPConnection(host, port, timeout=120)
                conn.request(self.command, self.path, body, dict(self.headers.items()))
                answer = conn.getresponse()
                data = answer.read()
                conn.close()
                proxy.requests[self.command] += 1
                proxy.bytes[self.command] += len(data)
                self.send_response(answer.status)
                for k, v in answer.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                length = answer.getheader("Content-Length") if self.command == "HEAD" else None
                self.send_header("Content-Length", length or str(len(data)))
                self.end_headers()
                if self.command != "HEAD":
                    self.wfile.write(data)

            do_GET = do_HEAD = do_PUT = do_POST = forward

        self.server = ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.server.daemon_threads = True
        self.endpoint = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def snapshot(self) -> tuple[int, int]:
        return sum(self.requests.values()), self.bytes["GET"]


def run_node(source, window: int, batch: int, proxy: CountingProxy) -> list[dict]:
    """Two ranks of a node, epoch by epoch, started together: per epoch the slower rank's seconds, the images, and
    what the server was asked meanwhile."""
    spec = json.dumps(source if isinstance(source, dict) else str(source))
    requests, got = proxy.snapshot()  # the first epoch's count includes start-up (index, listing, read ahead)
    ranks = [
        subprocess.Popen(
            [sys.executable, "-c", _RANK, spec, str(r), str(window), str(batch)],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            text=True,
            env={**os.environ, "LOCAL_WORLD_SIZE": "2"},  # as torchrun sets it
        )
        for r in range(2)
    ]
    rows = []
    try:
        for p in ranks:
            assert p.stdout is not None and p.stdout.readline().strip() == "ready"
        for epoch in range(2):
            for p in ranks:
                assert p.stdin is not None
                p.stdin.write("go\n")
                p.stdin.flush()
            done = [json.loads(p.stdout.readline()) for p in ranks if p.stdout is not None]
            after = proxy.snapshot()
            rows.append(
                {
                    "epoch": epoch + 1,
                    "seconds": max(d["seconds"] for d in done),
                    "images": sum(d["images"] for d in done),
                    "requests": after[0] - requests,
                    "bytes": after[1] - got,
                }
            )
            requests, got = after
    finally:
        for p in ranks:
            p.kill()
            p.wait()
    return rows


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("data", help="an image folder (prepared once into --prepared)")
    p.add_argument("--prepared", default=None, help="the prepared shards (default DATA-shards-<MiB>m)")
    p.add_argument("--shard-size", type=int, default=4, help="MiB per shard (default 4)")
    p.add_argument("--memory-cache", type=int, default=16, help="MiB: Remote(memory_cache=) without the cache folder")
    p.add_argument("--shuffle-window", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=64)
    p.add_argument("--json", default=None)
    args = p.parse_args()
    out = Path(args.prepared or f"{args.data.rstrip('/')}-shards-{args.shard_size}m")
    prepare(args.data, out, PrepareOptions(shard_size=args.shard_size << 20, order="shuffled"))
    set_bytes = sum(f.stat().st_size for f in out.glob("*.tar"))
    server, bucket = local_s3({"shards": out})
    proxy = CountingProxy(os.environ["AWS_ENDPOINT_URL"])
    url, options = f"{bucket}/shards", {"endpoint_url": proxy.endpoint}
    memory = args.memory_cache << 20
    results = []
    try:
        with tempfile.TemporaryDirectory() as tmp:
            os.environ["XDG_CACHE_HOME"] = tmp  # the index cache, the default shard cache: none of this machine's
            sources = {
                "disk": str(out),
                "no cache folder (memory_cache per process)": dict(
                    url=url, storage_options=options, cache_limit=0, memory_cache=memory
                ),
                "node cache (fits)": dict(url=url, storage_options=options, cache_dir=f"{tmp}/fits"),
                f"node cache, cache_limit {args.memory_cache} MiB": dict(
                    url=url, storage_options=options, cache_dir=f"{tmp}/bounded", cache_limit=memory
                ),
            }
            for name, source in sources.items():
                if name == "disk":
                    continue
                for which, what in (("disk", sources["disk"]), (name, source)):  # the disk beside each, in turns
                    load = os.getloadavg()[0]
                    for row in run_node(what, args.shuffle_window, args.batch_size, proxy):
                        row.update(source=which, pair=name, bytes_per_set=row["bytes"] / set_bytes, load_average=load)
                        results.append(row)
                        print(json.dumps(row), file=sys.stderr)
    finally:
        proxy.server.shutdown()
        server.kill()
        server.wait()
    disk = {(r["pair"], r["epoch"]): r["seconds"] for r in results if r["source"] == "disk"}
    for r in results:
        r["disk_vs_this"] = disk[r["pair"], r["epoch"]] / r["seconds"]  # >= 1: as fast as the disk beside it
    report = {
        "kind": "s3-cache",
        "date": datetime.now(timezone.utc).isoformat(timespec="seconds"),
        "machine": machine_info(),
        "gpupipe": gpupipe.__version__,
        "config": {
            **vars(args),
            "set_bytes": set_bytes,
            "shards": len(list(out.glob("*.tar"))),
            "ranks": 2,
            "workers": 2,
            "backend": "turbojpeg",
        },
        "results": results,
    }
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
