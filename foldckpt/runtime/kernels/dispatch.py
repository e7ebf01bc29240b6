"""``fold_gemm``: pick the fastest measured implementation of ``y = x · Wᵀ`` for the decode fold;
``fold_query``: that GEMM and the decode step's query/key RoPE (in its epilogue where measured
faster, else one more launch; no copies).

Order: aiter's ``gemm_a16w16`` on ROCm when aiter imports (its skinny kernels are tuned by AMD);
on CUDA the backend this GPU's tuning table chose for (N, K, M bucket): the project's tiled Triton
kernel ("triton"), its skinny GEMV-style Triton kernel ("skinny", a few tokens only) or ``torch``
(cuBLAS); ``torch`` (cuBLAS / the CPU GEMM) for every shape, GPU or dtype the table does not cover.
Which backend wins is decided by the tuner from measurements (``tune.decide``) and read here
through ``tuning.kernel_config_for`` alone. Every decision reads only shapes, strides, dtypes and
pointers, so there is no host sync and the call can be captured in a CUDA graph, once
``warmup_fold_gemm`` has compiled the kernels and reserved the split-K workspace. Triton and
aiter are imported on first GPU use, never at import time (CI has neither).
"""

from __future__ import annotations

import functools
import logging
import warnings
from collections.abc import Callable

import torch
import torch.nn.functional as F

from foldckpt.runtime.kernels.device import gpu_key
from foldckpt.runtime.kernels.rope import QueryRope, rope_query_torch
from foldckpt.runtime.kernels.tuning import (
    TRITON_MAX_M,
    KernelConfig,
    SkinnyConfig,
    kernel_config_for,
    load_table,
    skinny_config,
)

__all__ = ["fold_gemm", "fold_query", "rope_query", "warmup_fold_gemm", "warmup_fold_query"]

logger = logging.getLogger(__name__)

_TRITON_DTYPES = (torch.bfloat16, torch.float16)


@functools.lru_cache(maxsize=1)
def _aiter_gemm() -> Callable[..., torch.Tensor] | None:
    """aiter's ``gemm_a16w16`` when running on ROCm with aiter installed, else None."""
    if torch.version.hip is None:
        return None
    try:
        from aiter.ops.triton.gemm_a16w16 import gemm_a16w16
    except ImportError:
        return None
    return gemm_a16w16


@functools.lru_cache(maxsize=1)
def _triton_module():  # noqa: ANN202 - the module type is only known once triton imports
    """The Triton kernel module, or None when Triton is missing (the torch path then serves)."""
    try:
        from foldckpt.runtime.kernels import triton_gemm
    except ImportError as exc:
        logger.info("foldckpt: Triton unavailable (%s); the fold GEMM uses torch", exc)
        return None
    return triton_gemm


@functools.lru_cache(maxsize=1)
def _triton_rope_module():  # noqa: ANN202 - as _triton_module
    """The Triton RoPE kernel module, or None when Triton is missing."""
    try:
        from foldckpt.runtime.kernels import triton_rope
    except ImportError:
        return None
    return triton_rope


def _rows_aligned(t: torch.Tensor) -> bool:
    """Unit column stride, 16-byte aligned base and rows: what the kernel's vector loads assume."""
    row_ok = t.shape[0] == 1 or (t.stride(0) * t.element_size()) % 16 == 0
    return t.stride(1) == 1 and row_ok and t.data_ptr() % 16 == 0


def _triton_config(x: torch.Tensor, weight: torch.Tensor) -> KernelConfig | SkinnyConfig | None:
    """The table's Triton kernel for this call (tiled: ``KernelConfig``, skinny: ``SkinnyConfig``),
    or None when the table chose torch or no Triton kernel may run here."""
    if torch.version.hip is not None or x.dtype not in _TRITON_DTYPES or weight.dtype != x.dtype:
        return None
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= TRITON_MAX_M or not weight.is_contiguous() or not _rows_aligned(x):
        return None
    return kernel_config_for(gpu_key(x.device), n, k, m)


def _torch_gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> torch.Tensor:
    if out is None:
        return F.linear(x, weight)
    return torch.mm(x, weight.t(), out=out)


def _check_shapes(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fold_gemm: x {tuple(x.shape)} and weight {tuple(weight.shape)} are not [M, K] x [N, K]")
    if out is not None and tuple(out.shape) != (x.shape[0], weight.shape[0]):
        raise ValueError(f"fold_gemm: out {tuple(out.shape)} is not [M, N] = {(x.shape[0], weight.shape[0])}")


def _run_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None,
    cfg: KernelConfig | SkinnyConfig,
    rope: QueryRope | None = None,
) -> torch.Tensor | None:
    """Launch the tiled (``KernelConfig``, optionally with the RoPE epilogue) or the skinny kernel
    (``SkinnyConfig``, never with RoPE); None when it cannot run here (missing Triton, unreserved
    workspace)."""
    module = _triton_module()
    if module is None:
        return None
    m, n = x.shape[0], weight.shape[0]
    skinny = isinstance(cfg, SkinnyConfig)
    if not skinny:  # the skinny kernel needs no workspace
        partial_elems, counter_elems = module.workspace_needs(m, n, cfg)
        if not module.workspace_ready(x.device, partial_elems, counter_elems):
            if torch.cuda.is_current_stream_capturing():
                warnings.warn(
                    "fold_gemm: captured before warmup_fold_gemm covered this batch size; "
                    "using torch for it. Call warmup_fold_gemm(weight, max_m) before graph capture.",
                    stacklevel=3,
                )
                return None
            module.reserve_workspace(x.device, partial_elems, counter_elems)
    target = out if out is not None and out.dtype == x.dtype and _rows_aligned(out) else None
    if target is None:
        target = torch.empty((m, n), dtype=x.dtype, device=x.device)
    with torch.cuda.device(x.device):
        if skinny:
            module.launch_skinny_gemm(x, weight, target, cfg)
        else:
            module.launch_fold_gemm(x, weight, target, cfg, rope)
    if out is not None and target is not out:
        out.copy_(target)
        return out
    return target


def fold_gemm(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None) -> torch.Tensor:
    """``y = x · weightᵀ`` for the decode fold: x [M, K] (a strided row view is fine), weight [N, K].

    Writes into ``out`` ([M, N], may be a strided view) when given and returns it; otherwise
    returns a new tensor. Same result as ``F.linear(x, weight)`` up to fp32-accumulation rounding.
    Calls on one device must be stream-ordered with each other when a table entry uses split-K
    (it shares one workspace per device); the shipped H200 table uses none.
    """
    _check_shapes(x, weight, out)
    if x.device.type == "cuda" and x.shape[0] > 0:
        aiter_gemm = _aiter_gemm()
        if aiter_gemm is not None:
            return aiter_gemm(x, weight, dtype=x.dtype, y=out)
        cfg = _triton_config(x, weight)
        if cfg is not None:
            y = _run_triton(x, weight, out, cfg)
            if y is not None:
                return y
    return _torch_gemm(x, weight, out)


def rope_query(y: torch.Tensor, rope: QueryRope) -> None:
    """RoPE of a folded decode query ``y [M, n]`` in place (the last R columns of every head) and of
    ``rope.k_pe`` into ``rope.k_out``: one Triton launch on a GPU, torch on the CPU."""
    rope.check(*y.shape)
    if y.is_cuda and y.shape[0] > 0 and y.stride(1) == 1:
        module = _triton_rope_module()
        if module is not None:
            with torch.cuda.device(y.device):
                module.launch_rope_query(y, rope)
            return
    rope_query_torch(y, rope)


def fold_query(x: torch.Tensor, weight: torch.Tensor, rope: QueryRope) -> torch.Tensor:
    """The decode MQA query ``x · weightᵀ`` [M, N] with RoPE on the last R columns of every head,
    and the rotated key in ``rope.k_out`` (never a rotated copy of ``k_pe``).

    One launch where the table's bucket for this batch chose the tiled Triton kernel and measured
    its RoPE epilogue faster (``rope_epilogue``); otherwise ``fold_gemm`` (whichever backend the
    table chose: tiled, skinny or torch) and then ``rope_query``. vLLM's decode query takes three
    (q_b_proj, RoPE, W_UK bmm).
    """
    _check_shapes(x, weight, None)
    rope.check(x.shape[0], weight.shape[0])
    if x.device.type == "cuda" and x.shape[0] > 0 and _aiter_gemm() is None:
        cfg = _triton_config(x, weight)
        # The skinny kernel has no RoPE epilogue: its buckets take fold_gemm + rope_query below.
        fused = isinstance(cfg, KernelConfig) and cfg.rope_epilogue
        module = _triton_module() if fused else None
        if module is not None and module.rope_fits(weight.shape[0], cfg):
            y = _run_triton(x, weight, None, cfg, rope)
            if y is not None:
                return y
    y = fold_gemm(x, weight)
    rope_query(y, rope)
    return y


def _warm_ms(weight: torch.Tensor, max_m: int) -> list[int]:
    """One token count per tuned bucket up to ``max_m`` (each compiles one kernel), plus max_m;
    in a skinny bucket one per skinny token tile inside it (each tile is its own compile)."""
    ms = {max_m}
    table = load_table(gpu_key(weight.device)) if torch.version.hip is None else None
    entry = table.shapes.get(tuple(weight.shape)) if table is not None else None
    if entry is not None:
        ms.update(min(b.m_max, max_m) for b in entry.buckets)
        lo = 0
        for bucket in entry.buckets:
            if bucket.backend == "skinny":
                first_m: dict[SkinnyConfig | None, int] = {}
                for m in range(lo + 1, bucket.m_max + 1):
                    first_m.setdefault(skinny_config(table, "fold", entry.n, entry.k, m), m)
                ms.update(min(m, max_m) for m in first_m.values())
            lo = bucket.m_max
    elif torch.version.hip is not None:
        # aiter buckets its configs by M at these bounds (see VLLM_NOTES.md).
        ms.update(min(b, max_m) for b in (8, 16, 32, 64, 128, 256, 512, 2048))
    return sorted(ms)


def warmup_fold_gemm(weight: torch.Tensor, max_m: int) -> None:
    """Compile every kernel and reserve every buffer ``fold_gemm(x, weight)`` needs for M <= max_m.

    Call once per distinct weight shape before CUDA graph capture; Triton compiles on first use
    and the split-K workspace must exist before a graph records its address. A no-op on CPU.
    Runs GEMMs on the current stream and does not synchronise.
    """
    if weight.device.type != "cuda" or max_m < 1:
        return
    module = _triton_module() if torch.version.hip is None else None
    for m in _warm_ms(weight, max_m):
        x = torch.randn((m, weight.shape[1]), dtype=weight.dtype, device=weight.device)
        cfg = _triton_config(x, weight)
        if isinstance(cfg, KernelConfig) and module is not None:
            module.reserve_workspace(weight.device, *module.workspace_needs(m, weight.shape[0], cfg))
        fold_gemm(x, weight)
        # The torch path serves buckets the table gave to cuBLAS and any fallback: warm it too.
        _torch_gemm(x, weight, None)


def warmup_fold_query(weight: torch.Tensor, max_m: int, cos_sin_cache: torch.Tensor, head_dim: int) -> None:
    """Compile the kernels ``fold_query`` runs with this weight and cache up to ``max_m`` tokens
    (the cache dtype is part of what they are compiled for): the GEMM with the RoPE epilogue per
    bucket that chose it, and the standalone RoPE kernel (one compile serves every M). Call after
    ``warmup_fold_gemm``. A no-op on CPU."""
    if weight.device.type != "cuda" or max_m < 1:
        return
    r = cos_sin_cache.shape[-1]

    def inputs(m: int) -> tuple[torch.Tensor, QueryRope]:
        x = torch.randn((m, weight.shape[1]), dtype=weight.dtype, device=weight.device)
        k_pe = torch.zeros((m, r), dtype=weight.dtype, device=weight.device)
        positions = torch.zeros(m, dtype=torch.long, device=weight.device)
        return x, QueryRope(positions, cos_sin_cache, k_pe, k_pe, head_dim)

    for m in _warm_ms(weight, max_m):
        x, rope = inputs(m)
        fold_query(x, weight, rope)
    # Buckets with the RoPE epilogue never launch the standalone kernel; one compile serves any M.
    x, rope = inputs(1)
    rope_query(fold_gemm(x, weight), rope)
