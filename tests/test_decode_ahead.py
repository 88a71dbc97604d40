"""plumbing/decode_ahead.py's DecodeAhead: a pass's results made on a thread of its own, and that thread gone once the
pass is, whether it ran to its end or was closed."""

import threading
import time

import torch

from gpupipe.plumbing.decode_ahead import DecodeAhead, Turn


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


def test_no_item_is_begun_while_the_caller_is_inside_next_with_one_to_take():
    """The thread's work runs Python in the caller's interpreter: begun while the caller is inside ``next()`` with a
    made item waiting, it would take the GIL from it there. With a :class:`Turn` it waits for the caller to leave
    (and begins at once when the caller waits for an item none has made: the first, here)."""
    turn = Turn()
    begun_inside = []
    ahead: DecodeAhead | None = None

    def decode(work: int) -> int:  # (the first may begin before ``ahead`` is assigned: nothing made yet)
        begun_inside.append(turn._inside and ahead is not None and not ahead._queue.empty())
        return work

    ahead = DecodeAhead(iter(range(8)), decode, torch.device("cpu"), lambda r: [], depth=2, turn=turn)
    it, got = iter(ahead), []
    for _ in range(8):
        turn.enter()
        try:
            got.append(next(it))
            time.sleep(0.02)  # the rest of next(): the made items are there, the thread has room for one more
        finally:
            turn.leave()
        time.sleep(0.05)  # the step
    assert got == list(range(8))
    assert not any(begun_inside)


def test_a_thread_waiting_for_its_turn_ends_when_closed(monkeypatch):
    """Closed while it waits for the caller to leave ``next()`` (a pass left early, its next begun), the thread is
    told at once, not at its next look."""
    monkeypatch.setattr(Turn, "LOOK", 60.0)
    turn = Turn()
    ahead = DecodeAhead(iter(range(8)), lambda w: w, torch.device("cpu"), lambda r: [], depth=2, turn=turn)
    it = iter(ahead)
    turn.enter()
    next(it)  # inside next(), a made item waiting: the thread waits for its turn
    deadline = time.monotonic() + 10
    while ahead._queue.qsize() < 2 and time.monotonic() < deadline:
        time.sleep(0.01)
    assert ahead.join(timeout=10)
    turn.leave()
