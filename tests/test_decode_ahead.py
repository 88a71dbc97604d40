"""plumbing/decode_ahead.py's DecodeAhead: a pass's results made on a thread of its own, and that thread gone once the
pass is, whether it ran to its end or was closed."""

import threading
import time

import torch

from gpupipe.plumbing.decode_ahead import DecodeAhead


class _SlowToDrop:
    """A decode function whose last reference goes slowly (as a DALI pipeline's shutdown does, when the pass's thread
    drops it on its way out)."""

    def __call__(self, work: int) -> int:
        return work * 2

    def __del__(self) -> None:
        time.sleep(0.5)


def _decode_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name == "gpupipe-test-decode"]


def test_a_pass_run_to_its_end_leaves_no_thread_behind():
    for _ in range(2):
        ahead = DecodeAhead(
            iter(range(5)), _SlowToDrop(), torch.device("cpu"), lambda r: [], name="gpupipe-test-decode"
        )
        assert list(ahead) == [0, 2, 4, 6, 8]
        assert _decode_threads() == []
