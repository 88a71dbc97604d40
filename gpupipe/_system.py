"""Facts about the machine that several parts of gpupipe need."""

from __future__ import annotations

import os
import re


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def env_int(name: str) -> int | None:
    """The environment variable ``name`` as a whole number >= 0 (ASCII digits), None when unset or empty; anything
    else is a ``ValueError`` naming the variable (``LOCAL_RANK=abc`` is a launcher's mistake, not rank 0)."""
    value = os.environ.get(name, "").strip()
    if not value:
        return None
    if not re.fullmatch(r"[0-9]+", value):
        raise ValueError(f"environment variable {name}={value!r}: expected a whole number >= 0")
    return int(value)


def local_rank() -> int | None:
    """This process's rank on its node under torchrun (``LOCAL_RANK``), or None outside a launcher."""
    return env_int("LOCAL_RANK")


def cores_per_rank() -> int:
    """The usable cores shared out among the node's ranks (``LOCAL_WORLD_SIZE`` under torchrun): the default for
    decode workers and DALI threads, so 8 ranks do not start 8 times the node's cores."""
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "")
    return max(1, usable_cores() // (int(ranks) if ranks.isdigit() and int(ranks) > 0 else 1))
