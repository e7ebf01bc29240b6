"""Kimi-K3 CPU test fixtures in every Python process of an engine, vLLM's spawned workers included.

A tensor-parallel engine starts its workers as fresh interpreters, which run none of
``engine_job.py``; Python imports ``sitecustomize`` at start-up from ``PYTHONPATH``, so the K3
engine tests put this folder there and set ``FOLDCKPT_K3_CPU_FIXTURES=1``. Test fixture only.

Only the engine's own processes install them: the engine job and the workers multiprocessing
spawns (``--multiprocessing-fork``). Every other Python child inherits the environment too, and
installing means importing vLLM (about 12 s on a 2-core machine): torch inductor probes each
vector ISA by dlopening a test library in a ``python -c`` child, and those probes alone took about
60 s of every Kimi-K3 engine run (the first call of vLLM's compiled output gate).
"""

import os
import sys


def _engine_process() -> bool:
    argv = sys.orig_argv
    return "--multiprocessing-fork" in argv or any(os.path.basename(arg) == "engine_job.py" for arg in argv)


if os.environ.get("FOLDCKPT_K3_CPU_FIXTURES") == "1" and _engine_process():
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/e2e
    import k3_cpu_kernels

    k3_cpu_kernels.install()
