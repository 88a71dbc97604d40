"""The command line: ``gpupipe info | sample-data | bench | train | check | prepare``."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import warnings

from rich.console import Console
from rich.markup import escape

from ._deps import require
from ._exit import as_command, ending
from ._names import escape as escape_name  # file names on one line, whatever their bytes
from ._options import ALLOW_OUTSIDE_ROOT_HELP, PREPARE_DEFAULTS, at_least, positive_ints
from ._parser import Parser
from ._system import is_main_rank
from ._version import __version__
from .errors import GpupipeError, error_line, interrupt_behind, show_traceback
from .train.cli import add_train_args, run_train
from .train.evaluate import add_eval_args, run_eval

console = Console(stderr=True, soft_wrap=not sys.stderr.isatty())  # whole lines in a log file or pipe


def _stdout() -> Console:
    """The report on stdout: whole lines, never wrapped, in a file or pipe (a terminal wraps at its width)."""
    return Console(soft_wrap=not sys.stdout.isatty())


def _cmd_info(args) -> int:
    from .info import backend_status, machine_info

    info = {"machine": machine_info(), "backends": {k: (v or "available") for k, v in backend_status().items()}}
    if args.json:
        print(json.dumps(info, indent=1))
        return 0
    from .info import describe

    out = _stdout()
    for k, v in info["machine"].items():
        out.print(f"[bold]{k:17}[/] {describe(k, v)}", highlight=False)
    if info["machine"]["gpupipe"]["problem"]:
        console.print(f"[red]warning:[/] {escape(info['machine']['gpupipe']['problem'])}")
    out.print("[bold]backends[/]")
    for name, reason in backend_status().items():
        out.print(
            f"  {name:12} " + ("[green]available[/]" if reason is None else f"[red]unavailable[/]: {escape(reason)}")
        )
    return 0


def _cmd_sample_data(args) -> int:
    from rich.progress import Progress

    from .sample_data import make_sample_data

    per_class = args.per_class or (60 if args.split == "train" else 20)
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task(f"writing the {args.split} split", total=args.classes * per_class)
        root = make_sample_data(
            args.dir, args.classes, per_class, args.seed, args.split, on_image=lambda: progress.advance(task)
        )
    console.print(
        f"sample data ({args.split} split) in {root}: {args.classes} classes x {per_class} JPEGs", markup=False
    )
    return 0


def _cmd_bench(args) -> int:
    from .api import _resolve_device
    from .bench import report, suite
    from .bench.eta import shown_progress
    from .bench.records import Config, bench_pipelines, policy_recipes
    from .sample_data import DEFAULT_DIR, make_sample_data

    if args.plot:  # before the benchmark, not after it
        require("matplotlib", "bench")
    for flag, path in (("--json", args.json), ("--plot", args.plot)):
        _check_writable(flag, path)  # before the benchmark too: a run is minutes to lose
    if args.data is None:  # said, since it writes files: the data the table's title names
        console.print(f"no --data: measuring the sample data in {DEFAULT_DIR} (`gpupipe sample-data` writes it)")
    data = args.data if args.data is not None else str(make_sample_data(DEFAULT_DIR))
    if args.host_budget or args.simulate_step:
        from .bench import host_budget, sim_step

        return (host_budget if args.host_budget else sim_step).from_cli(args, data)
    device = _resolve_device(args.device)
    backends, unavailable = _bench_backends(args.backends, device)
    if not backends:
        return 2
    pipelines = bench_pipelines(args.pipelines, args.model, bool(args.aa or args.color_jitter or args.reprob))
    cfg = Config(
        data,
        backends,
        pipelines,
        suite.default_workers() if args.workers is None else args.workers,
        device,
        batch_size=args.batch_size,
        seconds=args.seconds,
        repeats=args.repeats,
        image_sizes=args.image_size,  # image_size: the first
        model=args.model,
        recipes=policy_recipes(args.image_size[0], args.aa, args.color_jitter, args.reprob),
    )
    if args.model and device.type != "cuda":
        console.print("[yellow]--model measures training on the GPU; on the CPU the figures say little[/]")
    since = report.cpu_times()  # the CPU time other processes take meanwhile: a busy machine is said in the table
    with shown_progress(console) as progress:
        results = suite.run(cfg, progress=progress)
    if not results:
        raise ValueError(
            f"nothing to measure: no backend of {', '.join(backends)} runs a pipeline of {','.join(pipelines)}"
        )
    _bench_outputs(cfg, results, args, unavailable, since)
    return 0


def _bench_backends(asked: str | None, device) -> tuple[list[str], dict[str, str]]:
    """The backends to measure: those asked for (``--backends a,b``) that can run here, or every one that runs on
    ``device`` here; and those asked for that cannot, with the reason (printed; their rows say so)."""
    from .backends import available_backends, check_name, get, names, unavailable_reason

    avail = available_backends()
    if not asked:
        return [b for b in names() if b in avail and device.type in get(b).devices], {}
    backends = list(dict.fromkeys(check_name(b) for b in asked.split(",")))  # each once (pillow,pillow: one row)
    if "auto" in backends:
        raise ValueError(
            "--backends auto: auto is not a backend but a choice among them, made from a bench's "
            f"results; list the backends to measure from: {', '.join(names())}"
        )
    unusable = {b: unavailable_reason(b) for b in backends if b not in avail}
    unusable |= {
        b: f"delivers batches on {' or '.join(get(b).devices)}, not {device.type}"
        for b in backends
        if b in avail and device.type not in get(b).devices
    }
    if len(unusable) == len(backends):  # nothing to measure: one error line, as any other mistake
        raise ValueError("; ".join(f"{b}: {why or 'unavailable'}" for b, why in unusable.items()))
    for b, why in unusable.items():
        console.print(f"[red]{b}[/]: {escape(why or '')}: not measured")
    return [b for b in backends if b not in unusable], {b: why or "unavailable" for b, why in unusable.items()}


def _check_writable(flag: str, path: str | None) -> None:
    """A file ``path`` can be written where it is named (its missing folders made then), or one line naming the
    flag and why not."""
    if path is None:
        return
    if os.path.isdir(path):
        raise ValueError(f"{flag} {path}: a folder; name a file to write")
    above = os.path.dirname(os.path.abspath(path))
    while not os.path.exists(above):  # the nearest that exists: the folders below it are made with the file
        above = os.path.dirname(above)
    if not os.path.isdir(above):
        raise ValueError(f"{flag} {path}: {above} is a file, not a folder")
    if not os.access(above, os.W_OK):
        raise ValueError(f"{flag} {path}: the folder {above} is not writable")


def _bench_outputs(cfg, results: list, args, unavailable: dict, since) -> None:
    """The table, the machine's store (what ``backend="auto"`` reads), and the JSON and chart when asked for
    (``args.json``, ``args.plot``)."""
    import torch

    from . import results as store
    from .bench import report
    from .info import machine_info

    settings = {
        "data": cfg.data,
        "workers": cfg.workers,
        "device": cfg.device.type,
        "batch_size": cfg.batch_size,
        "seconds": cfg.seconds,
        "repeats": cfg.repeats,
        "image_size": cfg.image_sizes if len(cfg.image_sizes) > 1 else cfg.image_size,
        "model": cfg.model,
        "torch_threads": torch.get_num_threads(),
    }
    rep = report.report(results, machine_info(), settings, unavailable, since, accept_busy=args.accept_busy)
    report.print_table(rep, Console(width=None if sys.stdout.isatty() else 160))
    store.save_latest(rep, cfg.data, cfg.device)
    if args.json:
        report.write_json(rep, args.json)
        console.print(f"JSON: {args.json}")
    if args.plot:
        report.plot(rep, args.plot)
        console.print(f"chart: {args.plot}")


def _cmd_check(args) -> int:
    from rich.progress import Progress

    from ._system import usable_cores
    from .check import check_source
    from .sources.open import open_source

    source = open_source(args.dir, allow_outside_root=args.allow_outside_root)
    workers = usable_cores() if args.workers is None else args.workers
    with Progress(console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("checking", total=len(source))
        results = check_source(source, workers, on_result=lambda r: progress.advance(task))
    bad = [r for r in results if not r["ok"]]
    unusual = [r for r in results if r["ok"] and r["notes"]]
    if args.json:
        print(json.dumps({"files": len(results), "unreadable": bad, "unusual": unusual}, indent=1))
    else:
        out = _stdout()
        for r in bad:  # file names are text, not markup: "holiday [copy].jpg" keeps its brackets
            out.print(f"[red]unreadable[/] {escape(escape_name(r['path']))}: {escape(r['reason'])}", highlight=False)
        for r in unusual:
            notes = escape("; ".join(r["notes"]))
            out.print(f"[yellow]unusual[/]    {escape(escape_name(r['path']))}: {notes}", highlight=False)
        out.print(f"{len(results)} files: {len(bad)} unreadable, {len(unusual)} unusual but usable")
    return 1 if bad else 0


def _cmd_prepare(args) -> int:
    from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeRemainingColumn

    from .api import usable_cores
    from .prepare import PrepareOptions, parse_size, prepare

    given = {
        "max_side": args.max_side,
        "quality": args.quality,
        "subsampling": args.subsampling,
        "shard_size": None if args.shard_size is None else parse_size(args.shard_size),
        "order": args.order,
    }
    options = PrepareOptions(**{k: v for k, v in given.items() if v is not None})
    workers = usable_cores() if args.workers is None else args.workers
    columns = (
        TextColumn("preparing"),
        BarColumn(),
        MofNCompleteColumn(),
        TextColumn("time left"),
        TimeRemainingColumn(),
    )
    with Progress(*columns, console=console, transient=True, disable=not console.is_terminal) as progress:
        task = progress.add_task("prepare", total=None)

        def advance(done: int, total: int) -> None:
            if progress.tasks[0].total is None:  # first call: samples an earlier run did must not count as speed
                progress.reset(task, total=total, completed=done)
            else:
                progress.update(task, completed=done)

        summary = prepare(args.src, args.out, options, workers=workers, on_progress=advance)
    out = _stdout()
    for r in summary.left_out:
        out.print(f"[red]unreadable[/] {escape(escape_name(r['path']))}: {escape(r['reason'])}", highlight=False)
    reencoded = summary.samples - summary.copied
    causes = ", ".join(f"{v} {k}" for k, v in summary.reencoded.items())
    causes += " (a file can have several reasons)" if sum(summary.reencoded.values()) > reencoded else ""
    state = (
        "already prepared"
        if summary.up_to_date
        else (f"resumed at sample {summary.resumed_at}" if summary.resumed_at else "prepared")
    )
    out.print(
        f"{summary.out}: {state}: {summary.samples} samples in {summary.shards} shard{'s' * (summary.shards != 1)} "
        f"({summary.copied} copied, {reencoded} re-encoded{': ' + causes if causes else ''}); "
        f"{len(summary.left_out)} left out",
        markup=False,
        highlight=False,
    )
    return 0


_positive_int, _non_negative_int, _positive_float = at_least(1), at_least(0), at_least(0, float, strict=True)


def build_parser() -> argparse.ArgumentParser:
    parser = Parser(prog="gpupipe", description="Feed the GPU: image loading backends, benchmarks and a training core.")
    parser.add_argument("--version", action="version", version=f"gpupipe {__version__}")
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("info", help="versions, cores, CUDA devices, and which backends work here")
    p.add_argument("--json", action="store_true", help="print the raw values as JSON")
    p.set_defaults(func=_cmd_info)

    _add_sample_data_parser(sub)
    _add_bench_args(sub.add_parser("bench", help="which backend is fastest on this machine and data"))

    p = sub.add_parser("train", help="train a timm model fed by any backend (AMP, accumulation, DDP, resume)")
    add_train_args(p)
    p.set_defaults(func=run_train)

    p = sub.add_parser("eval", help="a train checkpoint's accuracy on held-out data, without training")
    add_eval_args(p)
    p.set_defaults(func=run_eval)

    p = sub.add_parser("check", help="find unreadable and unusual files in a data set")
    p.add_argument("dir", help="anything build_loader reads: a folder, a CSV list (path,label), shards, a URL")
    p.add_argument("--workers", type=_non_negative_int, help="checking processes (default: every usable core)")
    p.add_argument("--json", action="store_true", help="print the report as JSON")
    p.add_argument("--allow-outside-root", action="store_true", help=ALLOW_OUTSIDE_ROOT_HELP)
    p.set_defaults(func=_cmd_check)

    _add_prepare_parser(sub)
    return parser


def _add_sample_data_parser(sub) -> None:
    p = sub.add_parser(
        "sample-data",
        help="write the embedded data set (an ImageFolder of JPEGs): a train split, "
        "and a held-out val split that shares no image with it",
    )
    p.add_argument("dir", nargs="?", help="where (default: data/sample for train, data/sample-val for val)")
    p.add_argument(
        "--split",
        choices=["train", "val"],
        default="train",
        help="train, or val: the same classes drawn from other random streams (default train)",
    )
    p.add_argument("--classes", type=at_least(2), default=10, help="number of classes, at least 2 (default 10)")
    p.add_argument("--per-class", type=_positive_int, help="images per class (default 60 for train, 20 for val)")
    p.add_argument("--seed", type=int, default=0, help="the data set's seed (default 0)")
    p.set_defaults(func=_cmd_sample_data)


def _add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument(
        "--data",
        help="anything build_loader reads: a folder, a CSV list, shards, an s3:// URL (default: the sample data)",
    )
    p.add_argument("--backends", help="comma-separated (default: every available backend)")
    p.add_argument(
        "--pipelines",
        help="comma-separated from decode, floor, train, eval (floor: each whole image decoded at the DCT scale its "
        "train crop allows; train rows then say how close they come, or how far past it where only the crop's part "
        "is decoded); default decode,train,eval, train alone with --model or a policy",
    )
    p.add_argument("--workers", type=_non_negative_int, help="decode workers (default: every usable core)")
    p.add_argument("--device", choices=["cpu", "cuda"], help="where batches are delivered (default: cuda if any)")
    p.add_argument("--batch-size", type=_positive_int, default=64, help="(default 64)")
    p.add_argument("--image-size", type=positive_ints, default=[224], help="224, or 160,192,224: rows per size")
    p.add_argument("--seconds", type=_positive_float, default=6.0, help="timed seconds per measurement (default 6)")
    p.add_argument("--repeats", type=_positive_int, default=3, help="timed windows; the median is reported (default 3)")
    p.add_argument("--model", help="end-to-end mode: train this timm model fed by each backend and by synthetic")
    p.add_argument("--aa", action="append", help="add an 'augment' row: train with this policy; repeatable")
    p.add_argument("--color-jitter", type=float, help="augment pipeline: colour jitter strength (e.g. 0.4)")
    p.add_argument("--reprob", type=float, default=0.0, help="augment pipeline: random erasing probability")
    p.add_argument("--host-budget", action="store_true", help="instead: training-thread CPU per batch of GPU paths")
    p.add_argument("--simulate-step", action="store_true", help="instead: the data-wait of a simulated model step")
    p.add_argument("--json", help="write the results as JSON")
    p.add_argument("--plot", help="write a PNG bar chart")
    p.add_argument(
        "--accept-busy",
        action="store_true",
        help='let backend="auto" use this run even if other processes kept the machine busy (a shared node)',
    )
    p.set_defaults(func=_cmd_bench, interrupted="stopped before the end: no table and no result were saved")


def _add_prepare_parser(sub) -> None:
    defaults = PREPARE_DEFAULTS  # PrepareOptions', without importing prepare (and torch) to print --help
    p = sub.add_parser(
        "prepare",
        help="convert a data set to tar shards (WebDataset layout) with an index, for fast "
        "start-up and decode on every backend",
    )
    p.add_argument("src", help="anything build_loader reads: ImageFolder directory, CSV list, shards")
    p.add_argument("out", help="an empty folder (or an interrupted prepare's, which then resumes)")
    p.add_argument("--max-side", type=int, help="shrink images whose longer side is larger (default: keep sizes)")
    p.add_argument("--quality", type=int, help=f"JPEG quality of re-encoded images (default {defaults.quality})")
    p.add_argument("--shard-size", help=f"bytes per shard at most (default {defaults.shard_size // 2**20}MB)")
    p.add_argument("--workers", type=_non_negative_int, help="processes (default: every usable core)")
    p.add_argument(
        "--subsampling",
        choices=["keep", "420"],
        help=f"420: re-encode 4:4:4 and 4:2:2 JPEGs to 4:2:0, which decodes faster (default {defaults.subsampling})",
    )
    mixed = "shuffled: one fixed random order, so each shard holds a random part of the set (--shuffle-window's need)"
    p.add_argument("--order", choices=["source", "shuffled"], help=f"{mixed}; default {defaults.order}")
    p.set_defaults(
        func=_cmd_prepare,
        interrupted="stopped; the shards written whole are kept: run the same command again to resume "
        "(it writes the shards an uninterrupted run writes)",
    )


class _ConsoleHandler(logging.Handler):
    def emit(self, record: logging.LogRecord) -> None:
        console.print(self.format(record), highlight=False, markup=False)


def _show_logs() -> None:
    """Show the ``gpupipe`` logger's lines (``auto``'s choice, warnings); under torchrun rank 0's, others' errors."""
    log = logging.getLogger("gpupipe")
    if not any(isinstance(h, _ConsoleHandler) for h in log.handlers):
        log.addHandler(_ConsoleHandler())
        log.setLevel(logging.INFO if is_main_rank() else logging.ERROR)


def _show_warning(message, category, filename, lineno, file=None, line=None) -> None:
    """A warning as one line, as the command's other messages (Python's own names gpupipe's source file and line, and
    prints that line); under torchrun rank 0's."""
    if is_main_rank():
        console.print(f"warning: {message}", highlight=False, markup=False)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    args.interrupted = getattr(args, "interrupted", None) or "stopped"
    _show_logs()
    try:
        with warnings.catch_warnings():  # (what it sets is undone on the way out: main() may be called in a program)
            warnings.showwarning = _show_warning
            code = args.func(args)
        sys.stdout.flush()  # here, where a reader gone is caught, rather than at the interpreter's exit
        return code
    except KeyboardInterrupt:  # Ctrl-C (train's own stop says what it saved): one line, not a traceback
        return _interrupted(args)
    except BrokenPipeError:  # the reader left (`gpupipe info --json | head`): nothing to say, nowhere to say it
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # so that the exit's flush is quiet too
        return 141  # 128 + SIGPIPE, as a shell reports a command the pipe ended
    except (GpupipeError, ValueError, OSError, ModuleNotFoundError) as e:
        if show_traceback():
            raise
        console.print(f"[red]error:[/] {escape(error_line(e))}", highlight=False)
        return 2
    except Exception as e:  # Ctrl-C that a library wrapped in its own error (DALI, as it builds a pipeline)
        if interrupt_behind(e) is None:
            raise
        return _interrupted(args)


def _interrupted(args) -> int:
    if show_traceback():
        raise  # the exception being handled
    ending()
    console.print(f"interrupted: {args.interrupted}", highlight=False, markup=False)
    return 130  # 128 + SIGINT, as a shell reports a command Ctrl-C stopped


def command() -> int:
    """The ``gpupipe`` command (its console script, ``python -m gpupipe``): :func:`main`, then :func:`.ending`."""
    as_command()
    code = main()
    ending()
    return code


if __name__ == "__main__":
    sys.exit(command())
