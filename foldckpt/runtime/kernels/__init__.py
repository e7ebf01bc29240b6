"""Decode fold GEMM kernels, their per-GPU tuning tables and the decode pre-route threshold.

Public API (what the vLLM plugin calls):

- ``fold_gemm(x, weight, out=None)``: ``y = x · weightᵀ`` through the fastest measured backend.
- ``fold_query(x, weight, rope)``: that GEMM and the decode step's query/key RoPE (``QueryRope``),
  in the GEMM's epilogue where measured faster; ``rope_query(y, rope)`` is that RoPE alone.
- ``warmup_fold_gemm(weight, max_m)`` / ``warmup_fold_query(...)``: compile and reserve
  everything before CUDA graph capture.
- ``fold_route_max_tokens(n, k, device)``: decode batches of at most this many tokens take the fold.
- ``gpu_key(device)``: the GPU kind that selects ``configs/<key>.toml``.

Importing this package never imports Triton or aiter; they load on first GPU use.
"""

from foldckpt.runtime.kernels.device import gpu_key
from foldckpt.runtime.kernels.dispatch import fold_gemm, fold_query, rope_query, warmup_fold_gemm, warmup_fold_query
from foldckpt.runtime.kernels.rope import QueryRope
from foldckpt.runtime.kernels.tuning import fold_route_max_tokens

__all__ = [
    "QueryRope",
    "fold_gemm",
    "fold_query",
    "fold_route_max_tokens",
    "gpu_key",
    "rope_query",
    "warmup_fold_gemm",
    "warmup_fold_query",
]
