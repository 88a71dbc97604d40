"""``gpupipe-torchrun``: torchrun, ending as its ranks end when a signal stops the run.

Sent SIGTERM (a scheduler's stop, a preemption) or Ctrl-C, torchrun passes the signal on to its ranks, which save a
checkpoint at the step boundary and exit 143 (130), and then raises the signal as an exception of its own: a
traceback and exit status 1, which a job script reads as a crash. This runs torchrun itself (``torch.distributed.run``,
every argument as torchrun takes it) and ends such a stop in one line with the status the ranks end with, 128 + the
signal. (torchrun waits ``TORCH_ELASTIC_SHUTDOWN_TIMEOUT`` seconds, 30 by default, for its ranks before it kills
them: a rank's save at the step boundary takes far less.)"""

from __future__ import annotations

import signal
import sys


def main(argv: list[str] | None = None) -> None:
    from torch.distributed.elastic.multiprocessing.api import SignalException
    from torch.distributed.run import main as torchrun

    try:
        torchrun(argv)
    except SignalException as e:
        name = signal.Signals(e.sigval).name
        print(f"gpupipe-torchrun: stopped by {name}, which torchrun passed on to its ranks", file=sys.stderr)
        raise SystemExit(128 + int(e.sigval)) from None


if __name__ == "__main__":
    main()
