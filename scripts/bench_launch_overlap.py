#!/usr/bin/env python3
"""Do the microbenchmarks time the decode query as an engine runs it, or a chain of launches that
overlap? Each kernel back to back (as ``bench_decode.py`` and the tuner time it) against each call
after a kernel that writes its input x (as in an engine, where an RMSNorm with no programmatic
launch trigger writes x), minus that kernel alone.

Why: the fold's kernels launch with programmatic dependent launch (PDL), so back to back one call's
weight loads may overlap the previous call's tail, which no engine step has (the engine's fold
kernel follows the RMSNorm). The engine profile (``bench_engine.py --profile``) found the fold
kernel slower inside the engine than alone; this says how much of that a chained measurement
explains. Kimi-K3 TP8 (N = 6912) and DeepSeek-V3 TP8 (N = 9216) ranks, M = 1, 8, 14, 16, 28: the
fp8 fold as the table runs it (on a contiguous x, and on x as the engine hands it over: q_c, a view
of the fused q/kv activation), the Hopper CUDA kernel with and without PDL, stock's unfolded query.

    python scripts/bench_launch_overlap.py --out docs/bench/launch_overlap_<gpu>.json   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

import torch

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

from bench_decode import Layers  # noqa: E402
from bench_machine import gpu_timing_report  # noqa: E402

from foldckpt.runtime.kernels import cuda_fp8, fold_gemm, warmup_fold_gemm  # noqa: E402
from foldckpt.runtime.kernels.reference import MlaDims, unfolded_query  # noqa: E402
from foldckpt.runtime.kernels.timing import (  # noqa: E402
    layer_order,
    time_rounds_us,
)

HEADS = (12, 16)
TOKENS = (1, 8, 14, 16, 28)


def measure(layers: Layers, dims: MlaDims, m: int, device: torch.device) -> dict:
    """µs per call of each kernel at M = m, chained and engine-like, and of the x-writing copy."""
    source = torch.randn(m, dims.q_lora, device=device, dtype=torch.bfloat16)
    x = source.clone()
    # The engine's x: q_c, a view of the q-LoRA + kv-LoRA + k_pe activation (rows 2112 apart).
    wide = torch.zeros(m, dims.q_lora + dims.kv_lora + dims.rope, device=device, dtype=torch.bfloat16)
    x_view = wide[:, : dims.q_lora].copy_(source)
    kernels = {
        "table": lambda i: fold_gemm(x, layers.fp8s[i], scale=layers.scales[i]),
        "table_strided_x": lambda i: fold_gemm(x_view, layers.fp8s[i], scale=layers.scales[i]),
        "cuda": lambda i: cuda_fp8.launch(x, layers.fp8s[i], layers.scales[i]),
        "cuda_nopdl": lambda i: cuda_fp8.launch(x, layers.fp8s[i], layers.scales[i], pdl=False),
        "stock": lambda i: unfolded_query(x, layers.qbs[i], layers.uks[i], dims, None),
    }
    calls = {"copy": [lambda: x.copy_(source) for _ in layer_order()]}
    for name, kernel in kernels.items():
        calls[f"{name}_chain"] = [lambda i=i, k=kernel: k(i) for i in layer_order()]
        calls[f"{name}_after_copy"] = [lambda i=i, k=kernel: (x.copy_(source), k(i)) for i in layer_order()]
    times = time_rounds_us(device, calls)
    record: dict = {"copy_us": times["copy"]}
    for name in kernels:
        record[name] = {
            "chain_us": times[f"{name}_chain"],
            "engine_like_us": times[f"{name}_after_copy"] - times["copy"],
        }
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    report = {**gpu_timing_report(__doc__, device), "records": {}}
    for heads in HEADS:
        dims = MlaDims(heads)
        layers = Layers(dims, device)
        warmup_fold_gemm(layers.fp8, max(TOKENS), scale=layers.scale)
        for m in TOKENS:
            record = measure(layers, dims, m, device)
            report["records"][f"N={layers.fp8.shape[0]} M={m}"] = record
            print(f"N={layers.fp8.shape[0]} M={m}: {record}", flush=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
