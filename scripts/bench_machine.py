"""What a benchmark ran on, recorded in each ``docs/bench/*.json``: the same figures mean different
things on different machines (this project's test VMs have been an AMD EPYC with AVX2, an Intel
Xeon with AVX-512 and AMX, and an AMD EPYC with AVX-512), so every report names its CPU, the
instruction sets its hot paths depend on (sha256 extensions for hashing; AVX-512, which the CPU
fold's oneDNN bf16 GEMM needs; AMX), and the library versions."""

from __future__ import annotations

import os
import platform
import ssl
from pathlib import Path
from typing import Any

import torch

_FLAGS = ("sha_ni", "avx2", "avx512f", "avx512_bf16", "amx_tile")


def machine() -> dict[str, Any]:
    cpuinfo = Path("/proc/cpuinfo").read_text() if Path("/proc/cpuinfo").exists() else ""
    lines = cpuinfo.splitlines()
    model = next(
        (line.split(":", 1)[1].strip() for line in lines if line.startswith("model name")), platform.processor()
    )
    flags = set(next((line.split(":", 1)[1].split() for line in lines if line.startswith("flags")), []))
    return {
        "cpu": model,
        "cores": os.cpu_count(),
        "cpu_flags": {flag: flag in flags for flag in _FLAGS},
        "aten_cpu_capability": torch.backends.cpu.get_cpu_capability(),
        "memory_gb": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 1e9, 1),
        "platform": platform.platform(),
        "python": platform.python_version(),
        "openssl": ssl.OPENSSL_VERSION,
        "torch": torch.__version__,
        "gpu": torch.cuda.get_device_name() if torch.cuda.is_available() else None,
    }


def commit() -> str:
    """The commit this checkout (or device copy) is at: ``foldckpt.tune.cli.source_commit``."""
    from foldckpt.tune.cli import source_commit

    return source_commit(Path(__file__).resolve().parent.parent)


def gpu_timing_report(method: str, device: torch.device) -> dict[str, Any]:
    """The head of a GPU kernel timing report: the GPU, the commit, the method, and what an empty
    launch costs in the same process (every µs-scale kernel pays it; figures are read against it)."""
    from foldckpt.runtime.kernels.timing import measure_kernel_overhead_us

    return {
        "gpu": torch.cuda.get_device_name(device),
        "commit": commit(),
        "method": method,
        "empty_launch_us": measure_kernel_overhead_us(device),
    }
