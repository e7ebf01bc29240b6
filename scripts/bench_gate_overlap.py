#!/usr/bin/env python3
"""Kimi-K3's decode query timed where vLLM's decode graph runs it: beside the output gate's GEMM.

vLLM's Kimi-K3 MLA (``vllm/models/kimi_k3/nvidia/mla.py``, ``_forward_q_lora``) runs the output
gate's projection on an auxiliary stream beside the whole query path (the fused_qkv_a GEMM, the q/kv
RMSNorm, q_b_proj, the W_UK bmm) in every batch of fewer than 512 tokens. vLLM turns that second
stream off only under its breakable capture of PIECEWISE steps; FULL decode graphs are captured by
``CUDAGraphWrapper``, which keeps the fork, so every decode step runs the query's kernels beside a
GEMM that reads 22 MB (TP8: 1536 x 7168 bf16). ``bench_decode.py`` times the query with the GPU to
itself. The engine profile (``bench_engine.py --profile``) found the fold's kernel far slower inside
the engine than alone, and stock's query kernels not.

This times one MLA layer's front end (fused_qkv_a, RMSNorm, query) for stock's query and the fp8
fold's, four ways: the query alone (bench_decode's measure), the front end with no gate, the gate
after it on one stream, and the gate beside it on vLLM's auxiliary stream, forked and joined by
vLLM's own ``maybe_execute_in_parallel`` as the engine's FULL graph has it. The fold's saving per
layer in the last is the one a Kimi-K3 engine can show. The kernels are vLLM's: its Kimi-K3
low-latency GEMM plan (``try_low_latency_gemm``, else cuBLAS, as ``_unquantized_gemm`` picks) for
fused_qkv_a, the gate and stock's q_b_proj; its fused q/kv RMSNorm; the fold's kernel as the tables
dispatch it. Needs vLLM (the GPU payload); DeepSeek-V3 has no output gate, so only Kimi-K3 TP8.

    python scripts/bench_gate_overlap.py --out docs/bench/gate_overlap_<gpu>.json   # on a GPU
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

REPO = Path(__file__).resolve().parent.parent
sys.path[:0] = [str(REPO), str(REPO / "scripts")]

from bench_decode import Layers, split_query  # noqa: E402
from bench_machine import gpu_timing_report  # noqa: E402
from vllm.models.common.ops import fused_q_kv_rmsnorm  # noqa: E402
from vllm.models.kimi_k3.nvidia.low_latency_gemm import try_low_latency_gemm  # noqa: E402
from vllm.utils.multi_stream_utils import maybe_execute_in_parallel  # noqa: E402

from foldckpt.runtime.kernels import fold_gemm, warmup_fold_gemm  # noqa: E402
from foldckpt.runtime.kernels.reference import MlaDims  # noqa: E402
from foldckpt.runtime.kernels.timing import (  # noqa: E402
    LAYER_COPIES,
    layer_order,
    time_rounds_us,
)

# One Kimi-K3 TP8 rank: 12 of 96 heads; hidden 7168; the gate has one v_head (128) per head.
DIMS = MlaDims(12)
HIDDEN = 7168
V_HEAD = 128
RMS_EPS = 1e-6
TOKENS = (1, 2, 4, 8, 14, 16, 28)
MODES = ("query", "no_gate", "gate_after", "gate_beside")


def vllm_gemm(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """``x @ weight.T`` as vLLM's Kimi-K3 MLA runs an unquantized projection (``_unquantized_gemm``)."""
    out = try_low_latency_gemm(x, weight)
    return out if out is not None else F.linear(x, weight)


class FrontEnd:
    """LAYER_COPIES copies of the MLA front end's weights beside the query's (``Layers``): the
    fused q/kv/k_pe down-projection, the output gate and the two RMSNorm weights; and the one
    auxiliary stream every layer forks its gate to, as vLLM's Kimi-K3 decoder hands one to all."""

    def __init__(self, dims: MlaDims, device: torch.device) -> None:
        gen = torch.Generator(device=device).manual_seed(HIDDEN)
        rows = dims.q_lora + dims.kv_lora + dims.rope

        def weight(n: int) -> torch.Tensor:
            return (torch.randn(n, HIDDEN, device=device, generator=gen) / HIDDEN**0.5).bfloat16()

        self.dims = dims
        self.qkv_a = [weight(rows) for _ in range(LAYER_COPIES)]
        self.gate = [weight(dims.heads * V_HEAD) for _ in range(LAYER_COPIES)]
        self.q_norm = torch.ones(dims.q_lora, device=device, dtype=torch.bfloat16)
        self.kv_norm = torch.ones(dims.kv_lora, device=device, dtype=torch.bfloat16)
        self.aux = torch.cuda.Stream(device)

    def q_c(self, hidden: torch.Tensor, i: int) -> torch.Tensor:
        """The normed q-LoRA activation of layer copy ``i``, as ``_apply_q_lora_attention`` makes it."""
        dims = self.dims
        q_c, kv_c, _k_pe = vllm_gemm(hidden, self.qkv_a[i]).split([dims.q_lora, dims.kv_lora, dims.rope], dim=-1)
        return fused_q_kv_rmsnorm(q_c, kv_c, self.q_norm, self.kv_norm, RMS_EPS)[0]


def mode_calls(
    front: FrontEnd, hidden: torch.Tensor, x: torch.Tensor, query: Callable[[torch.Tensor, int], object], mode: str
) -> list[Callable[[], object]]:
    """One timed graph's calls of ``query`` in ``mode`` (see the module docstring)."""

    def call(i: int) -> Callable[[], object]:
        if mode == "query":
            return lambda: query(x, i)
        main = lambda: query(front.q_c(hidden, i), i)  # noqa: E731
        if mode == "no_gate":
            return main
        gate = lambda: vllm_gemm(hidden, front.gate[i])  # noqa: E731
        if mode == "gate_after":
            return lambda: (main(), gate())
        events = (torch.cuda.Event(), torch.cuda.Event())
        return lambda: maybe_execute_in_parallel(main, gate, *events, front.aux)

    return [call(i) for i in layer_order()]


def measure(front: FrontEnd, layers: Layers, m: int, device: torch.device) -> dict:
    """µs per layer of stock's and the fold's query in each mode at M = m, the gate GEMM alone,
    and the fold's saving per mode."""
    dims = layers.dims
    hidden = torch.randn(m, HIDDEN, device=device, dtype=torch.bfloat16)
    x = front.q_c(hidden, 0)
    queries = {
        "stock": lambda q_c, i: split_query(vllm_gemm(q_c, layers.qbs[i]), layers.uks[i], dims),
        "fold": lambda q_c, i: fold_gemm(q_c, layers.fp8s[i], scale=layers.scales[i]),
    }
    calls = {
        f"{name}_{mode}": mode_calls(front, hidden, x, query, mode) for name, query in queries.items() for mode in MODES
    }
    calls["gate"] = [lambda i=i: vllm_gemm(hidden, front.gate[i]) for i in layer_order()]
    times = time_rounds_us(device, calls)
    record: dict = {"gate_us": times["gate"]}
    for name in queries:
        record[name] = {f"{mode}_us": times[f"{name}_{mode}"] for mode in MODES}
    record["fold_saving_us"] = {mode: times[f"stock_{mode}"] - times[f"fold_{mode}"] for mode in MODES}
    return record


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    args = parser.parse_args()
    device = torch.device("cuda")
    layers = Layers(DIMS, device)
    front = FrontEnd(DIMS, device)
    warmup_fold_gemm(layers.fp8, max(TOKENS), scale=layers.scale)
    report = {**gpu_timing_report(__doc__, device), "records": {}}
    for m in TOKENS:
        record = measure(front, layers, m, device)
        report["records"][f"M={m}"] = record
        print(f"M={m}: {json.dumps(record)}", flush=True)
    args.out.write_text(json.dumps(report, indent=1))


if __name__ == "__main__":
    main()
