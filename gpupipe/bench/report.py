"""Bench output: the terminal table, the JSON report and the PNG chart."""

from __future__ import annotations

import datetime
import json
import os
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Literal, NamedTuple

from rich.console import Console
from rich.markup import escape
from rich.table import Table


def report(
    results: list,
    machine: dict,
    config: dict,
    unavailable: dict[str, str] | None = None,
    since: CpuTimes | None = None,
    accept_busy: bool = False,
) -> dict:
    """The run as one record; ``unavailable``: backends asked for that could not run here, with the reason;
    ``since``: :func:`cpu_times` before the measurements, for the share of the CPU other processes took meanwhile;
    ``accept_busy``: the user takes its figures for this machine's even if it was busy (``backend="auto"`` then
    uses them)."""
    from ..info import source_commit  # the code beside the figures, as the other benchmarks record it

    load = list(os.getloadavg()) if hasattr(os, "getloadavg") else None  # 1, 5, 15 min, at the end
    others = others_share(since, cpu_times()) if since is not None else None
    rep = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "commit": source_commit(),
        "machine": machine,
        "config": config,
        "load_average": load,
        "others_cpu_share": others,
        "busy": _busy(others, load),
        "accept_busy": accept_busy,
        "results": [r.as_dict() for r in results],
    }
    if unavailable:
        rep["unavailable"] = dict(unavailable)
    return rep


# Busy: other processes took more than this share of the machine's CPU time while the bench ran (where /proc/stat
# says so; else a 1-minute load average above the core count). Its figures are then not this machine's.
BUSY_SHARE = 0.25


class CpuTimes(NamedTuple):
    machine_busy: float  # seconds of CPU time used on the machine, all cores
    machine_total: float  # seconds of CPU time available, all cores (busy + idle)
    ours: float  # seconds used by this process and its waited-for children (the loaders' workers)


def cpu_times() -> CpuTimes | None:
    """The machine's CPU time and this process's, from ``/proc/stat`` (None where there is none)."""
    try:
        with open("/proc/stat") as f:
            ticks = [int(v) for v in f.readline().split()[1:9]]  # user nice system idle iowait irq softirq steal
    except (OSError, ValueError):
        return None
    hz = os.sysconf("SC_CLK_TCK")
    t = os.times()
    busy = ticks[0] + ticks[1] + ticks[2] + ticks[5] + ticks[6] + ticks[7]
    return CpuTimes(busy / hz, sum(ticks) / hz, t.user + t.system + t.children_user + t.children_system)


def others_share(start: CpuTimes | None, end: CpuTimes | None) -> float | None:
    """The share of the machine's CPU time that processes other than this bench used between ``start`` and ``end``."""
    if start is None or end is None or end.machine_total <= start.machine_total:
        return None
    others = (end.machine_busy - start.machine_busy) - (end.ours - start.ours)
    return round(min(max(others / (end.machine_total - start.machine_total), 0.0), 1.0), 3)


def _busy(others: float | None, load: list[float] | None) -> bool:
    if others is not None:
        return others > BUSY_SHARE
    return load is not None and load[0] > (os.cpu_count() or 1)


def _group(r: dict) -> tuple:
    return r["pipeline"], r.get("policy"), r.get("image_size")


def ties(rows: list[dict]) -> list[tuple[dict, dict]]:
    """Per pipeline (and policy and size), the fastest backend and the runner-up when their spreads overlap: the run
    cannot tell them apart. Rows that are not backends (synthetic, baseline, dali-reference) are left out."""
    groups: dict[tuple, list[dict]] = {}
    for r in rows:
        if r["backend"] not in NOT_BACKENDS and r["backend"] != "synthetic" and r.get("spread"):
            groups.setdefault(_group(r), []).append(r)
    found = []
    for members in groups.values():
        if len(members) > 1:
            first, second = sorted(members, key=lambda r: r["images_per_s"], reverse=True)[:2]
            if second["spread"][1] >= first["spread"][0]:
                found.append((first, second))
    return found


def _range(r: dict) -> str:
    return f"{r['backend']} {r['images_per_s']:,.0f} ({r['spread'][0]:,.0f}–{r['spread'][1]:,.0f})"


def doubts(rep: dict) -> list[str]:
    """What makes the run's order of backends unsure, in words: a busy machine, rows that overlap."""
    said = []
    if rep.get("busy"):
        load = rep.get("load_average")
        others = rep.get("others_cpu_share")
        why = f"other processes took {others:.0%} of the CPU time" if others is not None else ""
        why += (", " if why else "") + (f"load average {load[0]:.1f}" if load else "")
        if rep.get("accept_busy"):
            said.append(f'busy machine ({why}, {os.cpu_count()} cores): kept for backend="auto" (--accept-busy)')
        else:
            said.append(
                f"busy machine ({why}, {os.cpu_count()} cores): these figures are not this machine's, and "
                f'backend="auto" keeps to its rule; measure again on a quiet one, or, on a shared node, with the '
                "workers your jobs get (--workers), longer windows (--seconds 30) and more of them (--repeats 5), "
                "and --accept-busy if the spreads come out apart"
            )
    for first, second in ties(rep["results"]):
        pipeline = first["pipeline"] + (f": {first['policy']}" if first.get("policy") else "")
        said.append(f"{pipeline}: {_range(first)} and {_range(second)} overlap: this run cannot tell them apart")
    return said


# Rows that are not backends, each explained under the table and in the chart's legend.
NOT_BACKENDS = {
    "baseline": "torchvision's Pillow loader + transforms on the same samples (its ImageFolder for a folder; shards, "
    "URLs and CSV lists read by gpupipe's reader), the same workers",
    "dali-reference": "DALI's own pipeline as its documentation writes it (files read by DALI): a yardstick for the "
    "dali backend, not a backend",
}


def _cell(v, spec: str, suffix: str = "") -> str:
    return "" if v is None else format(v, spec) + suffix


# (column, justify, the cell of a result row); a column empty in every row (GPU figures on a CPU run) is left out
_COLUMNS: list[tuple[str, Literal["left", "right"], Callable[[dict], str]]] = [
    ("pipeline", "left", lambda r: r["pipeline"] + (f": {r['policy']}" if r.get("policy") else "")),
    ("backend", "left", lambda r: r["backend"]),
    ("size", "right", lambda r: _cell(r.get("image_size"), "d", " px")),  # with several --image-size
    ("img/s", "right", lambda r: _cell(r["images_per_s"], ",.0f")),
    ("spread", "right", lambda r: f"{r['spread'][0]:,.0f}–{r['spread'][1]:,.0f}"),
    ("MP/s", "right", lambda r: _cell(r["megapixels_per_s"], ",.1f")),
    ("img/s/worker", "right", lambda r: _cell(r["images_per_s_per_worker"], ",.0f")),
    ("vs baseline", "right", lambda r: _cell(r.get("vs_baseline"), ".2f", "x")),
    ("vs floor", "right", lambda r: _cell(r.get("vs_floor"), ".0%")),
    ("GPU util", "right", lambda r: _cell(r.get("gpu_util"), ".0f")),
    ("vs synthetic", "right", lambda r: _cell(r.get("vs_synthetic"), ".2f")),
    ("data-wait", "right", lambda r: _cell(r.get("data_wait"), ".0%")),
    ("ms/img vs train", "right", lambda r: _cell(r.get("cost_ms_per_image"), "+.2f")),
]


def print_table(rep: dict, console: Console | None = None) -> None:
    # piped or redirected, rich would wrap at 80 columns: a file gets the table's own width
    console = console or Console(width=None if sys.stdout.isatty() else 200)
    m = rep["machine"]
    cfg = rep["config"]
    data = f"{cfg['data']}, " if cfg.get("data") else ""
    title = (
        f"gpupipe bench — {data}{m['cpu']}, {cfg['workers']} worker(s), device {cfg['device']}, "
        f"batch {cfg['batch_size']}, {m['cores_usable']} usable cores"
    )
    cells = [[cell(r) for _, _, cell in _COLUMNS] for r in rep["results"]]
    shown = [i for i in range(len(_COLUMNS)) if i < 2 or any(row[i] for row in cells)]
    present = {r["backend"] for r in rep["results"]}
    notes = [f"{name}: {what}" for name, what in NOT_BACKENDS.items() if name in present]
    table = Table()  # title and notes are lines of their own: never wrapped at the table's width
    for i in shown:
        table.add_column(_COLUMNS[i][0], justify=_COLUMNS[i][1])
    for row in cells:
        table.add_row(*(row[i] for i in shown))
    for backend, why in rep.get("unavailable", {}).items():  # asked for, not measured: the row says why
        table.add_row("-", backend, f"unavailable: {why}", *[""] * (len(shown) - 3))
    console.print(title, soft_wrap=True, markup=False, highlight=False)
    console.print(table)
    for line in notes:
        console.print(line, soft_wrap=True, markup=False, highlight=False)
    for line in doubts(rep):
        console.print(f"[yellow]note:[/] {escape(line)}", soft_wrap=True, highlight=False)


def write_json(rep: dict, path: str | Path) -> None:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(rep, indent=1) + "\n")


def plot(rep: dict, path: str | Path) -> None:
    """A grouped bar chart of the real backends' images/s, one group per pipeline, the spread over the timed windows
    as error bars. ``synthetic`` (random batches: the compute ceiling, often several times higher) would squeeze
    the others into the bottom of the scale, so it is a note under the title instead of a bar."""
    try:
        import matplotlib
    except ImportError as e:
        raise ModuleNotFoundError("--plot needs matplotlib: pip install matplotlib") from e
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    rows = [r for r in rep["results"] if r["backend"] != "synthetic"]
    ceiling = [r for r in rep["results"] if r["backend"] == "synthetic"]
    pipelines = list(dict.fromkeys(r["pipeline"] for r in rows))
    backends = list(dict.fromkeys(r["backend"] for r in rows))
    width = 0.8 / max(len(backends), 1)
    fig, ax = plt.subplots(figsize=(max(6, 1.6 * len(pipelines) * max(1, len(backends) / 3)), 4), dpi=120)
    for i, b in enumerate(backends):
        xs, ys, err = [], [], [[], []]  # type: list[float], list[float], list[list[float]]
        for j, p in enumerate(pipelines):
            hit = [r for r in rows if r["backend"] == b and r["pipeline"] == p]
            if hit:
                xs.append(j + (i - (len(backends) - 1) / 2) * width)
                ys.append(hit[0]["images_per_s"])
                lo, hi = hit[0].get("spread") or (ys[-1], ys[-1])
                err[0].append(max(0.0, ys[-1] - lo))
                err[1].append(max(0.0, hi - ys[-1]))
        label = "dali-reference (DALI's own pipeline)" if b == "dali-reference" else b
        bars = ax.bar(xs, ys, width, yerr=err, capsize=2, error_kw={"elinewidth": 0.8}, label=label)
        ax.bar_label(bars, fmt="%.0f", fontsize=7, rotation=90, label_type="center", color="white")
    ax.set_xticks(range(len(pipelines)), pipelines)
    ax.set_ylabel("images / s (median; error bars: min-max of the timed windows)", fontsize=8)
    m, cfg = rep["machine"], rep["config"]
    title = f"gpupipe bench: {cfg['workers']} worker(s), {cfg['device']}, {m['cpu'][:40]}"
    if ceiling:
        title += (
            "\nsynthetic (the compute ceiling, not drawn): "
            + ", ".join(f"{r['pipeline']} {r['images_per_s']:,.0f}" for r in ceiling)
            + " img/s"
        )
    ax.set_title(title, fontsize=9)
    ax.legend(fontsize=8, ncol=min(len(backends), 4))
    ax.margins(y=0.2)
    fig.tight_layout()
    Path(path).parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path)
    plt.close(fig)
