"""The tables of bench/README.md, made from the JSON reports in bench/results.

    python bench/tables.py results/cpu-photos-1w-2026-11-22.json [...]   # print the tables of these reports
    python bench/tables.py --write                                        # rewrite bench/README.md's tables
    python bench/tables.py --check                                        # exit 1 if bench/README.md is stale

In bench/README.md a table is a block between `<!-- table: results/NAME.json -->` and `<!-- end table -->`; `--write`
replaces each block's body with the table made from that file, so the README's figures are the committed JSON's.
Each report's kind is recognised from its fields (gpupipe bench, the peers harness, the host budget, bench/shards.py,
bench/decode_paths.py, bench/imagenet_size.py, gpupipe.bench.sim_step).
"""

import argparse
import json
import re
import sys
from collections.abc import Callable
from pathlib import Path

HERE = Path(__file__).resolve().parent
README = HERE / "README.md"
BLOCK = re.compile(r"(<!-- table: (?P<path>\S+) -->\n)(?P<body>.*?)(<!-- end table -->)", re.S)
VERSIONS = ("torch", "torchvision", "pil", "pil_simd", "libjpeg_turbo", "pyturbojpeg", "dali")


def _commit(rep: dict) -> str:
    if rep.get("commit"):
        return f"commit {rep['commit']}"
    return f"recorded in commit {rep['recorded_in']}" if rep.get("recorded_in") else "commit not recorded"


def _machine_line(rep: dict) -> str:
    """CPU, date, commit and versions of a report that carries gpupipe's `machine` block."""
    m = dict(rep["machine"])
    dali = m.get("dali")
    m["dali"] = dali.get("package") if isinstance(dali, dict) else dali
    m.setdefault("libjpeg_turbo", m.get("pil_libjpeg_turbo"))
    versions = ", ".join(f"{k} {m[k]}" for k in VERSIONS if m.get(k) is not None)
    return f"{m['cpu']} ({m.get('cores_usable', '?')} cores), {rep['date'][:10]}, {_commit(rep)}; {versions}"


def _escape(text: str) -> str:
    return text.replace("|", "\\|")


def _f(x: float | None, fmt: str = ",.0f") -> str:
    return "" if x is None else format(x, fmt)


def bench_report(rep: dict) -> list[str]:
    """`gpupipe bench --json`: a row per pipeline and backend."""
    cfg = rep["config"]
    lines = [
        f"{_machine_line(rep)}. {cfg['workers']} worker(s), batch {cfg.get('batch_size')}, {cfg['device']}, "
        f"{cfg['seconds']} s per figure in {cfg['repeats']} interleaved windows.",
        "",
        "| pipeline | backend | img/s | spread | vs baseline | vs floor |",
        "|---|---|---:|---:|---:|---:|",
    ]
    for r in rep["results"]:
        ratio = f"{r['vs_baseline']:.2f}x" if r.get("vs_baseline") else ""
        floor = f"{r['vs_floor']:.0%}" if r.get("vs_floor") else ""
        spread = f"{r['spread'][0]:,.0f}–{r['spread'][1]:,.0f}"
        pipeline = r["pipeline"] + (f" {r['image_size']} px" if r.get("image_size") else "")  # --image-size A,B
        lines.append(f"| {pipeline} | {r['backend']} | {r['images_per_s']:,.0f} | {spread} | {ratio} | {floor} |")
    return lines


def peers_report(rep: dict) -> list[str]:
    """../shared/peers/run.sh: a row per contender (one decode worker each)."""
    host = rep["host"]
    load = max(host.get("loadavg_before", [0])[0], host.get("loadavg_after", [0])[0])
    lines = [
        f"{host['cpu']} ({host['nproc']} cores), {rep['when'][:10]}, {_commit(rep)}; Python {host['python']}. "
        f"{rep['images']} images of `{rep['dataset']}` x{rep['repeat']}, batch {rep['batch']}, "
        f"{rep['decode_workers']} decode worker, {rep['rounds']} rounds of {rep['seconds']:g} s; "
        f"load average <= {load:.1f}.",
        "",
        "| contender | img/s | min–max | x baseline | cores |",
        "|---|---:|---:|---:|---:|",
    ]
    for r in rep["results"]:
        ratio = f"{r['vs_baseline']:.2f}" if r.get("vs_baseline") else ""
        lines.append(
            f"| {r['contender']} | {r['images_per_s']:,.1f} | {r['min']:,.1f}–{r['max']:,.1f} | {ratio} | "
            f"{r['cores']:.2f} |"
        )
    return lines


def _budget_rows(rows: list[dict], threads: bool = False) -> list[str]:
    return [
        f"| {r['backend']} | {Path(str(r['data'])).name} | {r['batch']} | {r['size']} | {r['ms_per_batch']:.2f} | "
        f"{_f(r.get('one_core_img_s'))} |" + (f" {_thread_ms(r)} |" if threads else "")
        for r in rows
    ]


def _thread_ms(row: dict) -> str:
    return f"{row['loader_thread_ms']:.2f}" if "loader_thread_ms" in row else "-"


def host_budget_report(rep: dict) -> list[str]:
    """`python -m gpupipe.bench.host_budget --json`: the training thread's CPU per batch (and, where the report has
    it, that of the loader's own threads in the training process)."""
    meta = rep["meta"]
    head = "| path | data | batch | px | ms per batch | one-core img/s |"
    rule = "|---|---|---:|---:|---:|---:|"
    machine = meta.get("machine", meta.get("cpu", ""))
    when = "" if meta["date"] in machine else f"{meta['date']}, "
    commit = "" if rep.get("commit") and rep["commit"] in machine else f"{_commit(rep)}; "
    lines = [f"{machine}; {when}{commit}torch {meta['torch']}."]
    if "before" in rep:  # two trees side by side (bench/host_budget_augment.sh)
        for side in ("before", "after"):
            label = f"code of commit {meta['before']}" if side == "before" else "this change"
            lines += ["", f"{side.capitalize()} ({label}):", "", head, rule]
            lines += _budget_rows(rep[side])
        return lines
    threads = any("loader_thread_ms" in r for r in rep["rows"])
    if threads:
        head, rule = head + " loader's own thread, ms per batch |", rule + "---:|"
    return [*lines, "", head, rule, *_budget_rows(rep["rows"], threads)]


def decode_paths_report(rep: dict) -> list[str]:
    """bench/decode_paths.py: ms per image of each way to decode and resize, one thread."""
    meta = rep["meta"]
    lines = [
        f"{meta['cpu']}, {meta['date']}, {_commit(rep)}; torch {meta['torch']}; {meta['photos']}.",
        "",
        "| variant | ms per image |",
        "|---|---:|",
    ]
    lines += [f"| {_escape(r['variant'])} | {r['ms_per_image']:.3f} |" for r in rep["rows"]]
    return lines


def _read_row(r: dict) -> str:
    ratio = next((v for k, v in r.items() if k.endswith("_vs_shards") or k == "shards_vs_folder"), None)
    server = r.get("server_cpu_ms_per_image")
    return (
        f"| {r['backend']} | {r['source']} | {r['images_per_s']:,.0f} | {r['min']:,.0f}–{r['max']:,.0f} | "
        f"{_f(ratio, '.2f')} | {_f(server, '.2f')} |"
    )


def _paired_row(r: dict) -> str:
    order = f"shuffle_window={r['shuffle_window']}" if r["shuffle_window"] else "global shuffle, read by range"
    return (
        f"- paired batches in one process, {r['paired_window']}, {order}: {r['shards_ms_per_batch']:.1f} ms from disk, "
        f"{r['s3_ms_per_batch']:.1f} ms from S3 (S3 / disk {r['s3_vs_shards']:.2f}); "
        f"{r['s3_requests_per_epoch']:g} requests, {r['s3_mb_per_epoch']:.0f} MB per epoch"
    )


def _extras(rows: list[dict]) -> list[str]:
    """The read path alone (no DataLoader) and the paired batch times of `shards.py read --s3`."""
    out = []
    for r in rows:
        if "read_path" in r:
            first = f", first epoch {r['first_epoch_s']:.2f} s in {r['requests']} requests" if "requests" in r else ""
            out.append(f"- read path alone, {r['read_path']}: {r['read_us_per_image']:.1f} us per image{first}")
        elif "paired" in r:
            out.append(
                f"- paired batches in one process, {r['paired']}: {r['shards_ms_per_batch']:.1f} ms from disk, "
                f"{r['s3_ms_per_batch']:.1f} ms from S3 (S3 / disk {r['s3_vs_shards']:.2f})"
            )
    return out


def shards_report(rep: dict) -> list[str]:
    """bench/shards.py (read, startup, prepare) and bench/s3_startup.py."""
    skip = ("json", "func", "note", "tmp", "prepared")
    cfg = {k: v for k, v in rep["config"].items() if k not in skip and v not in (None, False)}
    lines = [f"{_machine_line(rep)}.", "", "Settings: " + ", ".join(f"{k} {v}" for k, v in cfg.items()) + ".", ""]
    kind, rows = rep["kind"], rep["results"]
    if kind == "read":
        lines += [
            "| backend | source | img/s | min–max | vs the same shards on disk (or folder) | server ms/img |",
            "|---|---|---:|---:|---:|---:|",
        ]
        lines += [_read_row(r) for r in rows if "backend" in r]
        notes = _extras(rows) + [_paired_row(r) for r in rows if "paired_window" in r]
        lines += ["", *notes] if notes else []
    else:
        cols = [k for k in rows[0] if not isinstance(rows[0][k], (list, dict))]
        lines += ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
        lines += ["| " + " | ".join(_cell(r.get(c)) for c in cols) + " |" for r in rows]
    return lines


def _cell(v: object) -> str:
    return f"{v:,.2f}" if isinstance(v, float) else "" if v is None else str(v)


def imagenet_size_report(rep: dict) -> list[str]:
    """bench/imagenet_size.py: start-up and worker memory on 1.28M files."""
    s = rep["settings"]
    lines = [
        f"{_machine_line(rep)}. {rep['data']}; {s['workers']} workers, batch {s['batch_size']}, {s['image_size']} px; "
        f"{rep.get('note', '')}.",
        "",
        "| loader | run | first batch s | worker growth over the batches, MB |",
        "|---|---:|---:|---:|",
    ]
    for r in rep["results"]:
        growth = ", ".join(f"{g:.1f}" for g in r.get("worker_growth_mb") or [])
        lines.append(f"| {r['loader']} | {r.get('run', 1)} | {r['first_batch_s']:.1f} | {growth} |")
    return lines


def cache_report(rep: dict) -> list[str]:
    """bench/s3cache.py: bytes and requests asked of the store per epoch, one node of several ranks."""
    cfg = rep["config"]
    lines = [
        f"{_machine_line(rep)}. {cfg['ranks']} local ranks x {cfg['workers']} workers, {cfg['backend']}, batch "
        f"{cfg['batch_size']}, shuffle_window {cfg['shuffle_window']}; {cfg['shards']} shards of at most "
        f"{cfg['shard_size']} MiB ({cfg['set_bytes'] / 1e6:.1f} MB).",
        "",
        "| source | epoch | bytes asked / set bytes | requests | disk's time / this | load average |",
        "|---|---:|---:|---:|---:|---:|",
    ]
    for r in rep["results"]:
        if r["source"] != "disk":
            lines.append(
                f"| {r['source']} | {r['epoch']} | {r['bytes_per_set']:.2f} | {r['requests']} | "
                f"{r['disk_vs_this']:.2f} | {r['load_average']:.1f} |"
            )
    return lines


def sim_step_report(rep: dict) -> list[str]:
    """`python -m gpupipe.bench.sim_step --json`: the data-wait of a simulated model step, and the contention probe."""
    cfg = rep["config"]
    lines = [
        f"{_machine_line(rep)}. `{Path(str(rep['data'])).name}`, batch {cfg['batch']}, {cfg['size']} px, the step "
        f"{cfg['headroom']:g}x the loader's time alone ({cfg['cpu_share']:.0%} of it on the CPU), {cfg['epochs']} "
        f"epochs each left one batch early; probe {cfg['probe_ms']:g} ms alone, median of {cfg['probe_rounds']}"
        f"{' pairs (the loader idle, then right after a next())' if rep.get('probe') == 'paired' else ''}.",
        "",
        "| backend | workers | step ms | data-wait | epoch starts, ms | median next(), ms | probe vs alone |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    flat = all("probe_flat_out_ratio" in r for r in rep["results"])  # timed flat out too (reports since 2026-11-29)
    if flat:
        lines[-2:] = [lines[-2] + " flat out |", lines[-1] + "---:|"]
    # and how long the probe waited for a core flat out (reports since 2026-11-30, where the kernel keeps it)
    waited = flat and any(r.get("probe_flat_out_core_wait_ms") is not None for r in rep["results"])
    if waited:
        lines[-2:] = [lines[-2] + " of it waiting for a core, ms |", lines[-1] + "---:|"]
    for r in rep["results"]:
        starts = ", ".join(f"{v:.1f}" for v in r["epoch_start_ms"])
        wait = r.get("probe_flat_out_core_wait_ms")
        lines.append(
            f"| {r['backend']} | {r['workers']} | {r['step_cpu_ms'] + r['step_wait_ms']:.0f} | {r['data_wait']:.1%} | "
            f"{starts} | {r['next_median_ms']:.1f} | {r['probe_ratio']:.2f}x |"
            + (f" {r['probe_flat_out_ratio']:.2f}x |" if flat else "")
            + ((" - |" if wait is None else f" {wait:.2f} |") if waited else "")
        )
    return lines


def kind_of(rep: dict) -> Callable[[dict], list[str]]:
    if rep.get("kind") == "s3-cache":
        return cache_report
    if rep.get("kind") == "sim-step":
        return sim_step_report
    if "contender" in str(rep.get("results", [{}])[:1]):
        return peers_report
    if "settings" in rep and "loader" in str(rep.get("results", [])[:1]):
        return imagenet_size_report
    if rep.get("kind"):
        return shards_report
    if "meta" in rep and ("variant" in str(rep.get("rows", [])[:1])):
        return decode_paths_report
    if "meta" in rep:
        return host_budget_report
    return bench_report


def table(path: str | Path) -> str:
    with open(path) as f:
        rep = json.load(f)
    return "\n".join(kind_of(rep)(rep))


def render(readme: str) -> str:
    """`readme` with each table block's body made anew from its JSON (paths relative to bench/)."""

    def body(m: re.Match) -> str:
        return f"{m.group(1)}\n{table(HERE / m.group('path'))}\n\n{m.group(4)}"

    return BLOCK.sub(body, readme)


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("reports", nargs="*", help="JSON reports to print as tables")
    g = p.add_mutually_exclusive_group()
    g.add_argument("--write", action="store_true", help="rewrite the tables in bench/README.md")
    g.add_argument("--check", action="store_true", help="exit 1 if bench/README.md's tables differ from the JSON")
    args = p.parse_args()
    if args.write or args.check:
        old = README.read_text()
        new = render(old)
        if args.check:
            if new != old:
                print("bench/README.md's tables differ from bench/results: run python bench/tables.py --write")
                return 1
            return 0
        README.write_text(new)
        return 0
    print("\n\n".join(table(r) for r in args.reports))
    return 0


if __name__ == "__main__":
    sys.exit(main())
