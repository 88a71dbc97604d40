"""Run from tests/test_train.py in subprocesses: the training core with probes and injected faults.

Under ``torchrun``, every mode records per rank the train samples seen, the gradient all-reduces DDP made and the
final parameters (``OUT/probe-rank{R}.pt``).

    torchrun --nproc_per_node 2 tests/probe.py cli -- <gpupipe train arguments>
    torchrun --nproc_per_node 2 tests/probe.py tiny64 OUT INIT.pt DATA BATCH ACCUM
    python tests/probe.py plain -- <gpupipe train arguments>   # gpupipe train as it is (with GPUPIPE_PROBE_STEP_S)
    python tests/probe.py kill-in-save N -- <gpupipe train arguments>   # SIGKILL inside the Nth checkpoint write
    python tests/probe.py int-in-save N -- <gpupipe train arguments>   # SIGINT inside the Nth checkpoint write
    python tests/probe.py int-at-import MODULE -- <gpupipe train arguments>   # SIGINT as MODULE is imported
    python tests/probe.py rank-exits RANK K -- <gpupipe train arguments>  # that rank exits after K train batches
    python tests/probe.py worker-dies RANK K -- <gpupipe train arguments>  # that rank's loader worker is SIGKILLed
    torchrun ... tests/probe.py all-exit K -- <gpupipe train arguments>  # every rank exits after K train batches
    torchrun ... tests/probe.py seen TAG K -- <gpupipe train arguments>  # OUT/seen-TAG-rankR.pt: the train batches
    torchrun ... tests/probe.py count -- <gpupipe train arguments>  # host syncs and collectives per micro-batch

In every mode, ``GPUPIPE_PROBE_STEP_S=S`` makes each training step S seconds longer: a signal a test sends on a
progress line then lands seconds, not milliseconds, before the point the test means it to come before, however busy
the machine.
"""

from __future__ import annotations

import os
import signal
import sys
import time

import torch
from torch import nn
from torch.distributed.algorithms.ddp_comm_hooks.default_hooks import allreduce_hook

from gpupipe.backends.cpu_stream import Plan
from gpupipe.data.sampler import ShardSampler
from gpupipe.train.stop import _children

try:
    from .common_utils import train_config
except ImportError:  # run as a script (torchrun tests/probe.py ...): tests/ itself is on sys.path
    from common_utils import train_config  # type: ignore[no-redef]


class Tiny(nn.Module):
    """No BatchNorm: micro-batches and one big batch must give the same gradients."""

    def __init__(self, classes=4):
        super().__init__()
        self.conv = nn.Conv2d(3, 8, 3, stride=2)
        self.head = nn.Linear(8, classes)

    def forward(self, x):
        return self.head(self.conv(x).relu().mean((2, 3)))


seen: list[tuple[int, int]] = []
allreduces = [0]
models: list[nn.Module] = []

_sampler_iter = ShardSampler.__iter__
_plan_task = Plan._task


def _on_dispatch(hook) -> None:
    """``hook(sampler, i, keys)`` each time a loader's sampler is asked for a batch (``i``: its number in the pass,
    ``keys``: its ``(epoch, index)`` pairs): when a DataLoader iterates the sampler (``ShardSampler.__iter__``), and
    when the CPU backends' stream dispatches a batch to its workers (``cpu_stream.Plan``, ``i`` the batch's number in
    its epoch)."""

    def iterating(self):
        for i, keys in enumerate(_sampler_iter(self)):
            hook(self, i, keys)
            yield keys

    def dispatching(self, indices):
        task = _plan_task(self, indices)
        hook(self.sampler, task.batch, [(e, i) for e, i, *_ in task])
        return task

    ShardSampler.__iter__ = iterating
    Plan._task = dispatching


def _record(sampler, i, keys) -> None:
    if sampler.shuffle:  # the train loader's sampler
        seen.extend(keys)


class _ProbeDDP(nn.parallel.DistributedDataParallel):
    def __init__(self, module, *args, **kwargs):
        super().__init__(module, *args, **kwargs)
        models.append(module)

        def counting_hook(state, bucket):
            allreduces[0] += 1
            return allreduce_hook(state, bucket)

        self.register_comm_hook(None, counting_hook)


def _kill_in_save(n: int) -> None:
    """The Nth ``torch.save`` writes part of its data, then the process is SIGKILLed: a kill during the write."""
    real_save, calls = torch.save, [0]

    def save(obj, f, *args, **kwargs):
        calls[0] += 1
        if calls[0] == n:
            f.write(b"PK\x03\x04 half a checkpoint")
            f.flush()
            os.kill(os.getpid(), signal.SIGKILL)
        return real_save(obj, f, *args, **kwargs)

    torch.save = save


def _int_in_save(n: int) -> None:
    """The Nth ``torch.save`` writes its first bytes, then the process gets a SIGINT (a Ctrl-C) in the middle of the
    write: raised in a ``write()`` that torch's C++ writer called."""
    real_save, calls = torch.save, [0]

    class Interrupting:
        def __init__(self, f):
            self.f, self.writes = f, 0

        def write(self, data):
            self.writes += 1
            if self.writes == 2:
                os.kill(os.getpid(), signal.SIGINT)
            return self.f.write(data)

        def flush(self):
            self.f.flush()

    def save(obj, f, *args, **kwargs):
        calls[0] += 1
        return real_save(obj, Interrupting(f) if calls[0] == n else f, *args, **kwargs)

    torch.save = save


class _IntAtImport:
    """A finder that sends this process a SIGINT (a Ctrl-C) as ``module`` starts to be imported, and finds nothing."""

    def __init__(self, module: str):
        self.module = module

    def find_spec(self, name, path=None, target=None):
        if name == self.module:
            os.kill(os.getpid(), signal.SIGINT)
        return None


def _rank_exits(rank: int, after: int) -> None:
    def exit_at(sampler, i, keys):
        if sampler.shuffle and sampler.rank == rank and i == after:
            os._exit(3)  # no clean-up, no goodbye to the other ranks: as a crash

    _on_dispatch(exit_at)


def _worker_dies(rank: int, after: int) -> None:
    """On ``rank``, the DataLoader workers (this process's children) are SIGKILLed when its train sampler is asked
    for batch ``after + 1``: a worker lost to the out-of-memory killer in the middle of a DDP run."""

    def kill_at(sampler, i, keys):
        if sampler.shuffle and sampler.rank == rank and i == after:
            for pid in _children(os.getpid()):
                os.kill(pid, signal.SIGKILL)

    _on_dispatch(kill_at)


def _all_exit(after: int) -> None:
    """Every rank exits (status 3, no clean-up) when its train sampler is asked for batch ``after + 1`` of the run:
    the same point on all ranks, as a job that a scheduler stops."""
    fetched = [0]

    def exit_at(sampler, i, keys):
        if sampler.shuffle:
            if fetched[0] == after:
                os._exit(3)
            fetched[0] += 1
        _record(sampler, i, keys)

    _on_dispatch(exit_at)


def _seen(tag: str, after: int, out: str):
    """This rank's train batches as ``(epoch, index)`` keys, saved to ``OUT/seen-TAG-rankR.pt`` by the function
    returned; with ``after`` > 0, every rank saves them and exits (status 3, no clean-up) when its train sampler is
    asked for batch ``after + 1`` of the run, as a job that a scheduler stops."""
    batches: list = []
    path = f"{out}/seen-{tag}-rank{os.environ.get('RANK', '0')}.pt"

    def recording(sampler, i, keys):
        if sampler.shuffle:
            if after and len(batches) == after:
                torch.save(batches, path)
                os._exit(3)
            batches.append(keys)

    _on_dispatch(recording)
    return lambda: torch.save(batches, path)


def _count(args: list[str]) -> None:
    """``gpupipe train`` under the sync counter of tests/test_sync.py (on the CPU, the training device): what each
    micro-batch made the host wait for, and the collectives it called beyond DDP's gradient all-reduce, from one
    training forward to the next (an epoch's end falls to its last micro-batch), in ``OUT/count-rank{R}.pt``."""
    try:
        from .test_sync import CopyAndSyncCounter
    except ImportError:
        from test_sync import CopyAndSyncCounter  # type: ignore[no-redef]
    from gpupipe.cli import main as cli_main

    counter, steps = CopyAndSyncCounter(torch.device("cpu")), []

    def boundary(module, inputs):
        if module.training:
            steps.append((counter.syncs, counter.collectives))
            counter.syncs, counter.collectives = [], []

    class CountingDDP(nn.parallel.DistributedDataParallel):
        def __init__(self, module, *a, **k):
            super().__init__(module, *a, **k)
            self.register_forward_pre_hook(boundary)

    nn.parallel.DistributedDataParallel = CountingDDP
    with counter.counting():
        cli_main(args)
    steps.append((counter.syncs, counter.collectives))
    out = args[args.index("--out") + 1]
    torch.save({"steps": steps[1:]}, f"{out}/count-rank{os.environ['RANK']}.pt")


def _slow_steps(seconds: float) -> None:
    """A sleep before each outermost forward in training mode (the model's, not its layers'); none for 0."""
    if seconds <= 0:
        return
    depth = [0]

    def before(module, inputs):
        if depth[0] == 0 and module.training:
            time.sleep(seconds)
        depth[0] += 1

    def after(module, inputs, output):
        depth[0] -= 1

    nn.modules.module.register_module_forward_pre_hook(before)
    nn.modules.module.register_module_forward_hook(after)


def main() -> None:
    mode = sys.argv[1]
    _slow_steps(float(os.environ.get("GPUPIPE_PROBE_STEP_S", 0)))
    if mode == "seen":
        from gpupipe.cli import main as cli_main

        args = sys.argv[sys.argv.index("--") + 1 :]
        save = _seen(sys.argv[2], int(sys.argv[3]), args[args.index("--out") + 1])
        code = cli_main(args)
        save()
        sys.exit(code)
    if mode == "count":
        _count(sys.argv[sys.argv.index("--") + 1 :])
        return
    if mode == "all-exit":
        _all_exit(int(sys.argv[2]))
        from gpupipe.cli import main as cli_main

        sys.exit(cli_main(sys.argv[sys.argv.index("--") + 1 :]))
    faults = {
        "plain": lambda: None,
        "kill-in-save": lambda: _kill_in_save(int(sys.argv[2])),
        "int-in-save": lambda: _int_in_save(int(sys.argv[2])),
        "int-at-import": lambda: sys.meta_path.insert(0, _IntAtImport(sys.argv[2])),
        "rank-exits": lambda: _rank_exits(int(sys.argv[2]), int(sys.argv[3])),
        "worker-dies": lambda: _worker_dies(int(sys.argv[2]), int(sys.argv[3])),
    }
    if mode in faults:
        faults[mode]()
        from gpupipe.cli import main as cli_main

        args = sys.argv[sys.argv.index("--") + 1 :]
        if mode == "plain":  # the command line a user typed, as the resume command reads it: gpupipe train ...
            sys.argv = ["gpupipe", *args]
        sys.exit(cli_main(args))
    _on_dispatch(_record)
    nn.parallel.DistributedDataParallel = _ProbeDDP
    if mode == "cli":
        from gpupipe.cli import main as cli_main

        args = sys.argv[sys.argv.index("--") + 1 :]
        out = args[args.index("--out") + 1]
        cli_main(args)
    else:
        from gpupipe.train.loop import train

        out, init, data, batch, accum = sys.argv[2:7]
        model = Tiny().double()
        model.load_state_dict(torch.load(init, weights_only=True))
        model.register_forward_pre_hook(lambda m, args: (args[0].double(),))
        sgd = {"optimizer": "sgd", "momentum": 0.0, "clip": None}  # as tests/test_train.py's one-process run
        cfg = train_config(data, out, model="tiny", epochs=1, batch_size=int(batch), accum=int(accum), **sgd)
        train(cfg, model=model)
    rank = int(os.environ["RANK"])
    state = {k: v.detach().clone() for k, v in models[0].state_dict().items()}
    torch.save({"params": state, "seen": seen, "allreduces": allreduces[0]}, f"{out}/probe-rank{rank}.pt")


if __name__ == "__main__":
    main()
