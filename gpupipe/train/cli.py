"""``gpupipe train``'s command line: one flag per ``TrainConfig`` field, its help text and choices taken from the
field, so that a new setting is one field in train/config.py and nothing here."""

from __future__ import annotations

import argparse
import sys
import types
import typing
from dataclasses import fields


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


def run_train(args) -> int:
    from .config import TrainConfig, load_config, to_yaml

    overrides = {f.name: getattr(args, f.name) for f in fields(TrainConfig)}
    cfg = load_config(args.config, overrides)
    if args.print_config:
        print(to_yaml(cfg), end="")
        return 0
    from ..errors import DecodeError, GpupipeError
    from .loop import train
    from .stop import Stopped

    try:
        train(cfg)
    except DecodeError as e:  # the first unreadable file stopped the run: say how to go on
        raise GpupipeError(
            f"{e}; to go on: --on-error skip leaves such files out (listed in {cfg.out}/skipped.txt), "
            f"and `gpupipe check {cfg.data}` lists every unreadable file"
        ) from e
    except Stopped as e:  # a signal: the checkpoint is saved; the line says how to resume
        print(e, file=sys.stderr, flush=True)
        return e.exit_code
    except KeyboardInterrupt:  # a second Ctrl-C
        print("interrupted: stopped at once (the last checkpoint saved before it is kept)", file=sys.stderr)
        return 130
    return 0
