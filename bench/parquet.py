"""Parquet files vs prepared tar shards of the same images, measured: train loaders alone (uint8 batches, no model)
on each, from the disk and, with ``--s3``, from a local S3-compatible server through the node's shard cache.

    python bench/parquet.py DATA [--backends pillow,turbojpeg] [--workers 1] [--seconds 10] [--repeats 3]
                                 [--s3] [--rows-per-group 100] [--shuffle-window 16] [--max-side 512] [--json PATH]

DATA (an ImageFolder) is prepared once into tar shards (``gpupipe prepare``, as ``bench/shards.py read`` does:
``--prepared`` picks the folder); the shards' samples, in their order, are then written as Parquet files in the
Hugging Face Hub's layout (``{bytes, path}`` image structs, class names in the schema's metadata), one file per
shard and row groups of ``--rows-per-group`` rows (the ``datasets`` library's for images), so both hold the very same
encoded bytes. Sources: ``shards`` and ``parquet`` (the global shuffle), ``parquet-window`` (``shuffle_window=K``
row groups: what reads Parquet sequentially), and with ``--s3`` the same three at ``s3://`` URLs
(``s3-shards``, ``s3-parquet``, ``s3-parquet-window``: each object fetched once into a fresh cache folder during the
untimed first epoch). Timing is ``bench/shards.py``'s: a warm-up epoch, then interleaved windows, median and min-max;
each row says its images/s over the same backend's shards from the same place (``vs_shards``).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import tempfile
from pathlib import Path

import torch
from s3bench import local_s3, window_cpu  # bench/s3bench.py, beside this script
from shards import _prepared, _report, _started  # bench/shards.py: the same preparation, warm-up and report

import gpupipe
from gpupipe.prepare import PrepareOptions
from gpupipe.sources.open import open_source


def write_parquet(shards: Path, out: Path, rows_per_group: int) -> Path:
    """The prepared set's samples as Parquet files, one per shard, its samples in the shards' order."""
    import pyarrow as pa  # defer: only this script needs it
    import pyarrow.parquet as pq

    data = open_source(shards)
    if out.is_dir() and len(list(out.glob("*.parquet"))) == len(data.shard_paths):
        return out  # written by an earlier run
    out.mkdir(parents=True, exist_ok=True)
    features = {"image": {"_type": "Image"}, "label": {"names": data.classes, "_type": "ClassLabel"}}
    meta = {b"huggingface": json.dumps({"info": {"features": features}}).encode()}
    struct = pa.struct([("bytes", pa.binary()), ("path", pa.string())])
    for s, path in enumerate(data.shard_paths):
        rows = [int(i) for i in (data.shard_of == s).nonzero()[0]]
        cells = [{"bytes": data.read(i), "path": data.samples[i][0]} for i in rows]
        table = pa.table({"image": pa.array(cells, struct), "label": pa.array([data.targets[i] for i in rows])})
        pq.write_table(table.replace_schema_metadata(meta), out / f"{Path(path).stem}.parquet", rows_per_group)
    print(f"{out}: {len(data)} rows in {len(data.shard_paths)} Parquet files", file=sys.stderr)
    return out


def run(args) -> None:
    options = PrepareOptions(max_side=args.max_side, shard_size=args.shard_size << 20)
    shards = _prepared(args.data, args.prepared, options, gpupipe.api.usable_cores())
    parquet = write_parquet(shards, Path(f"{shards}-parquet{args.rows_per_group}"), args.rows_per_group)
    sources: list[tuple[str, object]] = [("shards", str(shards)), ("parquet", str(parquet))]
    sources += [("parquet-window", str(parquet))]
    server = local_s3({"shards": shards, "parquet": parquet}) if args.s3 else None
    try:  # the server is stopped and the cache folder removed whatever happens
        with tempfile.TemporaryDirectory(prefix="gpupipe-bench-cache-") as cache:
            os.environ["GPUPIPE_CACHE"] = cache  # each object fetched once in this run, none left from another
            os.chmod(cache, 0o700)
            if server is not None:
                url = server[1]
                sources += [("s3-shards", f"{url}/shards"), ("s3-parquet", f"{url}/parquet")]
                sources += [("s3-parquet-window", f"{url}/parquet")]
            results = _timed(args, sources, server[0].pid if server is not None else None)
    finally:
        if server is not None:
            server[0].kill()
            server[0].wait()
    config = {**vars(args), "func": None, "prepared": str(shards), "parquet": str(parquet)}
    _report("parquet-vs-shards", config, results, args.json)


def _timed(args, sources: list[tuple[str, object]], pid: int | None) -> list[dict]:
    """Each backend on each source, started and warmed up, then timed in interleaved windows."""
    jobs = [(b, name, root) for b in args.backends.split(",") for name, root in sources]
    device = torch.device("cpu")
    streams = []
    try:
        for backend, name, root in jobs:
            window = args.shuffle_window if name.endswith("-window") else None
            streams.append(_started(args, backend, root, device, window))
            print(f"started {backend} on {name}", file=sys.stderr)
        rates: list[list[float]] = [[] for _ in jobs]
        drain = 4 * max(args.workers, 1) + 2  # what the prefetch queues made while another job was timed
        for _ in range(args.repeats):  # interleaved: a slow patch of the machine hits every source alike
            for i in range(len(jobs)):
                rates[i].append(window_cpu(streams[i], args.seconds / args.repeats, drain, lambda: None, pid)[0])
    finally:
        for st in streams:
            st.close()
    med = {(b, name): statistics.median(r) for (b, name, _), r in zip(jobs, rates, strict=True)}
    rows = []
    for (b, name, _), r in zip(jobs, rates, strict=True):
        base = (b, "s3-shards" if name.startswith("s3") else "shards")
        row = {"backend": b, "source": name, "images_per_s": med[b, name], "min": min(r), "max": max(r)}
        rows.append(row | ({"vs_shards": med[b, name] / med[base]} if name != base[1] and base in med else {}))
    return rows


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("data", help="an ImageFolder")
    parser.add_argument("--prepared", help="the prepared folder (default DATA-shards[-maxN], made if missing)")
    parser.add_argument("--backends", default="pillow,turbojpeg", help="comma-separated")
    parser.add_argument("--workers", type=int, default=1)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--seconds", type=float, default=10.0, help="timed seconds per figure, split over the repeats")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--max-side", type=int)
    parser.add_argument("--shard-size", type=int, default=512, help="MiB per shard at most (gpupipe prepare's default)")
    parser.add_argument("--rows-per-group", type=int, default=100, help="Parquet rows per row group")
    parser.add_argument("--shuffle-window", type=int, default=16, help="row groups: the -window sources' window")
    parser.add_argument("--s3", action="store_true", help="also read both from a local S3 server (moto_server)")
    parser.add_argument("--json", help="write the report here")
    parser.add_argument("--note", help="kept in the report's config (e.g. what else ran on the machine)")
    run(parser.parse_args())


if __name__ == "__main__":
    main()
