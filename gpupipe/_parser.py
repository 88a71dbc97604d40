"""The command line's argparse: no prefix matching, unknown flags answered with the closest known ones, and every
argument mistake one line (not the usage block before it)."""

from __future__ import annotations

import argparse
import difflib
from typing import NoReturn


class Parser(argparse.ArgumentParser):
    """argparse without prefix matching (``--epoch 2`` is no ``--epochs``), whose unknown flags are named by the
    command's own parser with the closest flags it has (``--batchsize``: did you mean ``--batch-size``?)."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("allow_abbrev", False)
        super().__init__(*args, **kwargs)

    def parse_args(self, args=None, namespace=None):  # the same call, unknown flags named by the command's parser
        parsed, extras = self.parse_known_args(args, namespace)
        if extras:
            parser = self._command_parser(parsed)
            parser.error(_unrecognized(extras, parser))
        return parsed

    def error(self, message: str) -> NoReturn:
        """One line, as every other mistake is (argparse prints the whole usage block first), with where help is."""
        what = (
            "commands"
            if message.startswith(("argument command:", "the following arguments are required: command"))
            else "flags"
        )
        self.exit(2, f"error: {message} (`{self.prog} --help` lists the {what})\n")

    def _command_parser(self, parsed: argparse.Namespace) -> argparse.ArgumentParser:
        for action in self._actions:
            if isinstance(action, argparse._SubParsersAction):
                return action.choices.get(str(getattr(parsed, action.dest, None)), self)
        return self


def _unrecognized(extras: list[str], parser: argparse.ArgumentParser) -> str:
    """argparse's "unrecognized arguments" line, with the closest known flag to each unknown one."""
    known = [s for a in parser._actions for s in a.option_strings if s.startswith("--")]
    hints = []
    for flag in (e.split("=")[0] for e in extras if e.startswith("--")):
        close = difflib.get_close_matches(flag, known, n=2, cutoff=0.7)
        if close:
            hints.append(f"{flag}: did you mean {' or '.join(close)}?")
    return f"unrecognized arguments: {' '.join(extras)}" + (f" ({'; '.join(hints)})" if hints else "")
