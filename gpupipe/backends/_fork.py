"""Fork safety for DALI: a forked child (a DataLoader worker) inherits the parent's DALI pipelines as memory only,
without their threads. If the child's garbage collector then frees one that was waiting in a reference cycle, DALI's
``Pipeline.__del__`` shuts it down and waits for those threads forever: the worker hangs before its first batch.
This happened in gpupipe's own test suite (a DALI loader, then a Pillow loader with workers, in one process).

After every fork, the child detaches the inherited pipelines from their C++ handles and keeps the handles alive for
the rest of its life, so nothing in the child ever shuts a parent's pipeline down, not even the interpreter's teardown
as a child that ends normally exits (a module's list would be freed then: its destructors hung or crashed the child).
The process's exit gives their memory back.
"""

from __future__ import annotations

import ctypes
import os
import sys


def detach_inherited_pipelines() -> None:
    module = sys.modules.get("nvidia.dali.pipeline")
    if module is None:  # DALI was never imported: nothing to detach
        return
    for ref in list(getattr(module.Pipeline, "_pipes", ())):
        pipe = ref()
        handle = getattr(pipe, "_pipe", None)
        if handle is not None:
            ctypes.pythonapi.Py_IncRef(ctypes.py_object(handle))  # a reference never given back: never destroyed here
            pipe._pipe = None  # Pipeline._shutdown is now a no-op in this process


def pipelines_running() -> bool:
    """Whether a DALI pipeline lives in this process, and with it DALI's threads. A process forked then may inherit a
    lock one of them held at that moment, never to be released in the child (about 1 fork in 600 hung in
    ``PyOS_AfterFork_Child``): gpupipe forks its own helpers (dali's header scan) only while none does."""
    module = sys.modules.get("nvidia.dali.pipeline")
    return module is not None and any(ref() is not None for ref in list(getattr(module.Pipeline, "_pipes", ())))


os.register_at_fork(after_in_child=detach_inherited_pipelines)
