"""``gpupipe train``'s command line: one flag per ``TrainConfig`` field, its help text and choices taken from the
field, so that a new setting is one field in train/config.py and nothing here."""

from __future__ import annotations

import argparse
import os
import sys
import types
import typing
from dataclasses import fields
from pathlib import Path

from ..errors import interrupt_behind


def _flag_type(tp) -> tuple[type, tuple | None]:
    """(argparse type, choices) of a resolved field annotation: ``int | None`` -> int; a ``Literal`` -> str and its
    values."""
    args = typing.get_args(tp)
    if typing.get_origin(tp) in (typing.Union, types.UnionType) and type(None) in args:
        tp = next(a for a in args if a is not type(None))
    if typing.get_origin(tp) is typing.Literal:
        return str, typing.get_args(tp)
    return tp, None


def add_train_args(p: argparse.ArgumentParser) -> None:
    """One flag per TrainConfig field, so the defaults live in one place; every default here is None ("not given"),
    so only the flags given override the YAML file. Booleans also have a --no- form, to undo a YAML ``true``. Help
    text and choices come from the fields (their metadata and ``Literal`` types)."""
    from .._options import BUILTIN_BACKENDS  # not the registry: --help answers without importing torch
    from .config import HELP, HINTS, TrainConfig

    aliases = {"label_smoothing": ["--smoothing"]}  # timm's name
    for f in fields(TrainConfig):
        flags = ["--" + f.name.replace("_", "-"), *aliases.get(f.name, [])]
        tp, choices = _flag_type(HINTS[f.name])
        choices = ("auto", *BUILTIN_BACKENDS) if f.name == "backend" else choices
        help = HELP[f.name] if "(default" in HELP[f.name] else f"{HELP[f.name]} (default {f.default})"
        help = help.replace("%", "%%")
        if tp is bool:
            p.add_argument(*flags, action=argparse.BooleanOptionalAction, default=None, help=help)
        else:
            metavar = None if choices else f.name.upper()
            p.add_argument(*flags, type=tp, default=None, choices=choices, help=help, metavar=metavar)
    p.add_argument("--config", help="a YAML file whose keys override the defaults; flags override both")
    p.add_argument("--print-config", action="store_true", help="print the merged config and exit")


def require_train_extra(command: str) -> None:
    """``gpupipe train`` and ``eval`` need the train extra: its install command, rather than the first import that
    fails (``No module named 'yaml'``)."""
    from .._deps import INSTALL_HINTS, has_module

    missing = [m for m in ("timm", "omegaconf", "yaml") if not has_module(m)]
    if missing:
        raise ModuleNotFoundError(
            f"gpupipe {command} needs the train extra ({', '.join(missing)} not installed): {INSTALL_HINTS['train']}"
        )


def run_train(args) -> int:
    require_train_extra("train")
    from .config import TrainConfig, load_config, run_mode_yaml, to_yaml

    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    try:
        cfg = load_config(args.config, overrides)
    except ValueError as e:  # "image_size must be >= 1": the flag given, by its name on the command line
        name, _, rest = str(e).partition(" ")
        if overrides.get(name) is None:
            raise
        raise ValueError(f"--{name.replace('_', '-')} {rest}") from None
    if args.print_config:
        print(to_yaml(cfg) + run_mode_yaml(cfg), end="")
        return 0
    _check_default_data(cfg.data, args)
    made = _folders_to_make(Path(cfg.out))
    try:
        return _train(cfg)
    except Exception:  # a refused run (bad --data, --val, --model, too large a batch) leaves no empty --out behind
        _remove_if_empty(made)
        raise


def _train(cfg) -> int:
    try:  # from the first import on (torch's takes seconds): a Ctrl-C at start-up is the one line of any moment
        return _train_or_stop(cfg)
    except Exception as e:  # a second Ctrl-C inside a library, which broke a lock and raised its own error
        interrupt = interrupt_behind(e)
        if interrupt is None:
            raise
        return _stopped_at_once(cfg, interrupt)
    except KeyboardInterrupt as e:  # a second Ctrl-C, or the first before the run takes signals
        return _stopped_at_once(cfg, e)


def _stopped_at_once(cfg, interrupt: KeyboardInterrupt) -> int:
    from .._exit import ending

    ending()
    if os.environ.get("RANK", "0") == "0":  # rank 0 says it, as _system.is_main_rank (whose import it may be)
        print(f"interrupted: stopped at once; {_kept(cfg, interrupt)}", file=sys.stderr, flush=True)
    return 130


def _train_or_stop(cfg) -> int:
    from .._exit import ending
    from .._system import is_main_rank
    from ..data.sampler import NoFullBatch
    from ..errors import DecodeError, GpupipeError
    from .loop import train
    from .stop import Stopped

    try:
        train(cfg)
    except DecodeError as e:  # the first unreadable file stopped the run: say how to go on
        raise GpupipeError(
            f"{e.fault}; to go on: --on-error skip leaves such files out (listed in {cfg.out}/skipped.txt), "
            f"and `gpupipe check {cfg.data}` lists every unreadable file"
        ) from e
    except NoFullBatch as e:  # build_loader's drop_last is no flag of train's: name the one that is
        raise NoFullBatch(e.samples, e.ranks, e.batch_size, e.largest, flag="--batch-size ") from None
    except Stopped as e:  # a signal: the checkpoint is saved; the line says how to resume (once, under torchrun)
        ending()
        if is_main_rank():
            print(e, file=sys.stderr, flush=True)
        return e.exit_code
    return 0


def _kept(cfg, interrupt: KeyboardInterrupt) -> str:
    """Which checkpoint an interrupted run leaves. Imports nothing: torch's import may be what was interrupted, and
    another import of it would fail on the half-made module."""
    path = Path(cfg.out) / "checkpoints" / "last.pt"
    said = str(interrupt)  # a checkpoint.WriteInterrupted says what the write left; the signal's own says nothing
    if not path.exists():
        return said or f"no checkpoint was saved ({path} does not exist): nothing to resume"
    return f"{said or f'the last checkpoint saved, {path}, is kept'}; --resume goes on from it"


def _check_default_data(data: str, args) -> None:
    """``gpupipe train`` with no --data reads the sample data's folder: where it is missing, say how to make it."""
    from .config import TrainConfig

    if data == TrainConfig.data and args.data is None and not os.path.exists(data):
        raise FileNotFoundError(
            f"{data}: no such folder; it is --data's default, the sample data: `gpupipe sample-data` makes it "
            "(and `gpupipe sample-data --split val` a held-out split for --val), or pass --data"
        )


def _folders_to_make(out: Path) -> list[Path]:
    """The folders a run on ``out`` creates: ``out`` and those above it that do not exist yet, innermost first."""
    made = []
    for folder in (out, *out.absolute().parents):
        if folder.exists():
            break
        made.append(folder)
    return made


def _remove_if_empty(folders: list[Path]) -> None:
    for folder in folders:  # innermost first; a folder with anything in it stays, and so do those above it
        try:
            folder.rmdir()
        except OSError:
            return
