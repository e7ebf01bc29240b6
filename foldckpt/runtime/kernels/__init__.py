"""Decode fold GEMM kernels, their per-GPU tuning tables and the decode pre-route threshold.

Public API (what the vLLM plugin calls):

- ``fold_gemm(x, weight, out=None, scale=None)``: ``y = x · weightᵀ`` through the fastest measured
  backend. The fp8 fold: ``weight`` float8_e4m3fn [N, K] with ``scale`` its fp32 scale per row [N]
  (``foldckpt.fold.quantize_fp8_rows``): ``y = (x · weightᵀ) * scale``, weight-only (x stays
  bf16/fp16), one launch, fp32 accumulation; the scale is required for e4m3 and refused otherwise.
- ``fold_query(x, weight, rope, scale=None)``: that GEMM and the decode step's query/key RoPE
  (``QueryRope``), in the GEMM's epilogue where measured faster; ``rope_query(y, rope)`` is that
  RoPE alone.
- ``warmup_fold_gemm(weight, max_m, scale=None, x_dtype=torch.bfloat16)`` /
  ``warmup_fold_query(weight, max_m, cos_sin_cache, head_dim, scale=None, x_dtype=...)``: compile
  and reserve everything before CUDA graph capture (``x_dtype``: the activations of an fp8 weight).
- ``fold_route(dims, device, weight_dtype=None, act_dtype=torch.bfloat16)``: a ``Route``; decode
  batches of at most ``.max_tokens`` tokens take the fold, ``.source`` says where that came from
  (environment, CPU default, tuning table, start-up measurement or its cache, or off);
  ``weight_dtype=torch.float8_e4m3fn`` gives the fp8 fold's own threshold. May time the fold on a
  GPU without a table: call it before CUDA graph capture.
- ``fp8_fold_runs_as_fp8(device)``: whether an fp8 fold is served as e4m3 there (else the plugin
  dequantizes it at load).
- ``gpu_key(device)``: the GPU kind that selects ``configs/<key>.toml``.

Importing this package never imports Triton or aiter; they load on first GPU use.
"""

from foldckpt.runtime.kernels.device import gpu_key
from foldckpt.runtime.kernels.dispatch import (
    fold_gemm,
    fold_query,
    fp8_fold_runs_as_fp8,
    rope_query,
    warmup_fold_gemm,
    warmup_fold_query,
)
from foldckpt.runtime.kernels.rope import QueryRope
from foldckpt.runtime.kernels.routing import Route, fold_route

__all__ = [
    "QueryRope",
    "Route",
    "fold_gemm",
    "fold_query",
    "fold_route",
    "fp8_fold_runs_as_fp8",
    "gpu_key",
    "rope_query",
    "warmup_fold_gemm",
    "warmup_fold_query",
]
