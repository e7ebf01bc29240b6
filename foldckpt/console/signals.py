"""SIGINT and SIGTERM: raised as :class:`~foldckpt.errors.Interrupted` in the main thread, except
while torch is being imported, when they wait until the import is complete.

Why the exception: every step of a conversion is durable, so unwinding from wherever the signal
lands loses nothing and the command can say so (exit 130 / 143, "rerun to resume"). Why not during
torch's import: it runs C++ static initialisers and Python code with bare ``except:`` clauses, and
an exception raised by a signal handler in the middle of it was swallowed (convert then ran to the
end, exit 0, the signal lost) or left torch half-imported (exit 3: "module 'numpy' has no
attribute 'ndarray'", "CPU dispatcher tracer already initialized"): about one signal in eight
sent at start-up. :func:`import_torch` is how foldckpt's commands import torch.
"""

from __future__ import annotations

import os
import signal
import sys
from types import FrameType, ModuleType

from foldckpt.errors import Interrupted

_deferring = 0
_pending: list[int] = []


def install() -> None:
    """Route SIGINT and SIGTERM to :func:`_on_signal` (the command line does, at start)."""
    signal.signal(signal.SIGINT, _on_signal)
    signal.signal(signal.SIGTERM, _on_signal)


def _on_signal(signum: int, frame: FrameType | None) -> None:
    # A second signal while this one unwinds (or waits) kills at once: every step is durable.
    signal.signal(signal.SIGINT, signal.SIG_DFL)
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    if _deferring:
        _pending.append(signum)
        return
    raise Interrupted(signum, signal.Signals(signum).name)


def passive_openmp() -> None:
    """Have torch's OpenMP threads sleep, not spin, once a parallel region ends (unless
    ``OMP_WAIT_POLICY`` says otherwise; only effective before torch is first imported). Why:
    spinning threads take the cycles that foldckpt's other threads (convert's hashing, verify's
    Python between a layer's many small GEMMs) and every other process need, for no work: on a
    many-core host a conversion burns several times the CPU it needs, and on a loaded machine with
    fewer cores than threads a spinning thread holds the core the thread it waits for needs."""
    os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")


def import_torch() -> ModuleType:
    """``import torch`` (OpenMP threads passive: :func:`passive_openmp`), with a SIGINT or SIGTERM
    that arrives meanwhile raised once it is done."""
    global _deferring
    if "torch" in sys.modules and not getattr(sys.modules["torch"].__spec__, "_initializing", False):
        return sys.modules["torch"]
    passive_openmp()
    _deferring += 1
    try:
        import torch
    finally:
        _deferring -= 1
    if _pending and not _deferring:
        signum = _pending.pop(0)
        _pending.clear()
        raise Interrupted(signum, signal.Signals(signum).name)
    return torch
