"""Facts about the machine that several parts of gpupipe need."""

from __future__ import annotations

import os


def usable_cores() -> int:
    """The cores this process may run on (its CPU affinity), not the machine's count."""
    try:
        return len(os.sched_getaffinity(0))
    except AttributeError:
        return os.cpu_count() or 1


def local_rank() -> int | None:
    """This process's rank on its node under torchrun (``LOCAL_RANK``), or None outside a launcher."""
    value = os.environ.get("LOCAL_RANK", "")
    return int(value) if value.isdigit() else None


def cores_per_rank() -> int:
    """The usable cores shared out among the node's ranks (``LOCAL_WORLD_SIZE`` under torchrun): the default for
    decode workers and DALI threads, so 8 ranks do not start 8 times the node's cores."""
    ranks = os.environ.get("LOCAL_WORLD_SIZE", "")
    return max(1, usable_cores() // (int(ranks) if ranks.isdigit() and int(ranks) > 0 else 1))
