"""Kimi-K3 CPU test fixtures in EVERY Python process of an engine, vLLM's spawned workers included.

A tensor-parallel engine starts its workers as fresh interpreters, which run none of
``engine_job.py``; Python imports ``sitecustomize`` at start-up from ``PYTHONPATH``, so the K3
engine tests put this folder there and set ``FOLDCKPT_K3_CPU_FIXTURES=1``. Test fixture only.
"""

import os
import sys

if os.environ.get("FOLDCKPT_K3_CPU_FIXTURES") == "1":
    sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))  # tests/e2e
    import k3_cpu_kernels

    k3_cpu_kernels.install()
