from .cli import command

raise SystemExit(command())
