"""``fold_gemm``: pick the fastest measured implementation of ``y = x · Wᵀ`` for the decode fold;
``fold_query``: that GEMM and the decode step's query/key RoPE (in its epilogue where measured
faster, else one more launch; no copies).

Order: aiter's ``gemm_a16w16`` on ROCm when aiter imports (its skinny kernels are tuned by AMD);
on CUDA the backend this GPU's tuning table chose for (N, K, M bucket): the project's tiled Triton
kernel ("triton"), its skinny GEMV-style Triton kernel ("skinny", a few tokens only) or ``torch``
(cuBLAS); ``torch`` (cuBLAS / the CPU GEMM) for every shape, GPU or dtype the table does not cover.

The fp8 fold (``weight`` float8_e4m3fn [N, K] with ``scale`` fp32 [N], ``foldckpt.fold.quantize_fp8_rows``)
is weight-only: the same Triton kernels load e4m3, convert it to fp16/bf16 in registers and scale
each output row in the epilogue, so ``y = (x · weightᵀ) * scale`` is one launch with fp32
accumulation and x is never quantized. Its buckets are the table's [[fp8_shape]] entries; an fp8
shape the table has not measured takes the tiled kernel with ``tuning.FP8_UNTUNED_CONFIGS`` (the
torch path would dequantize the whole weight per call). aiter has no fp8 weight-only GEMM we rely
on, so on ROCm the fp8 fold also runs the Triton kernels, on gfx950 (MI350/MI355) only: there
``torch.float8_e4m3fn`` is the OCP e4m3 "fn" format the hardware converts natively (gfx942's fp8 is
the fnuz variant, so MI300 takes the torch path). On NVIDIA it needs sm_89+ (the e4m3 -> fp16 cvt).
The torch path (CPU, no Triton, other GPUs): ``(x.float() · weight.float()ᵀ) * scale`` in fp32,
rounded once to x's dtype.
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

from foldckpt.defaults import env_switch
from foldckpt.runtime.kernels.device import gpu_key
from foldckpt.runtime.kernels.rope import QueryRope, rope_query_torch
from foldckpt.runtime.kernels.tuning import (
    FP8_UNTUNED_CONFIGS,
    TRITON_MAX_M,
    KernelConfig,
    SkinnyConfig,
    bucket_backend,
    is_fp8_weight,
    kernel_config_for,
    load_table,
    skinny_config,
)

__all__ = ["fold_gemm", "fold_query", "rope_query", "torch_gemm", "warmup_fold_gemm", "warmup_fold_query"]

logger = logging.getLogger(__name__)

_TRITON_DTYPES = (torch.bfloat16, torch.float16)
# On/off switch of the CUDA kernels the tables choose (on by default; off: their buckets run Triton).
CUDA_KERNELS_ENV = "FOLDCKPT_CUDA_KERNELS"


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
def _cuda_fp8_module():  # noqa: ANN202 - as _triton_module
    """The Hopper fp8 kernel's module (ctypes only: it imports anywhere), or None where
    ``FOLDCKPT_CUDA_KERNELS=0`` turns it off."""
    if not env_switch(CUDA_KERNELS_ENV, True, "use the CUDA kernels the tables chose", "use Triton instead"):
        return None
    from foldckpt.runtime.kernels import cuda_fp8

    return cuda_fp8


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


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


@functools.cache
def _fp8_triton_device(index: int) -> bool:
    """Whether the Triton kernels can convert e4m3fn on this GPU: NVIDIA sm_89+, or ROCm gfx950
    (whose fp8 is the OCP "fn" format; gfx942's is fnuz)."""
    if torch.version.hip is not None:
        return getattr(torch.cuda.get_device_properties(index), "gcnArchName", "").startswith("gfx95")
    return torch.cuda.get_device_capability(index) >= (8, 9)


def fp8_fold_runs_as_fp8(device: torch.device) -> bool:
    """Whether an fp8 fold is served as e4m3 on ``device``: a GPU whose Triton kernels convert
    e4m3fn (NVIDIA sm_89+, ROCm gfx950). Elsewhere (CPU, older GPUs, no Triton) the plugin
    dequantizes it at load, since the torch fallback would dequantize on every step."""
    return device.type == "cuda" and _triton_module() is not None and _fp8_triton_device(_device_index(device))


def _cuda_fp8_ready(x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None, scale: torch.Tensor):  # noqa: ANN202
    """The fp8 Hopper kernel's module where the table chose it for this call and it takes these
    operands and can run on this GPU, else None (the bucket's Triton config then serves)."""
    m, k = x.shape
    if bucket_backend(gpu_key(x.device), weight.shape[0], k, m, weight.dtype) != "cuda":
        return None
    module = _cuda_fp8_module()
    if module is None or not module.supports(x, weight, out, scale) or not module.runs_on(x.device):
        return None
    if torch.cuda.is_current_stream_capturing() and not module.is_loaded(x, weight):
        warnings.warn(
            "fold_gemm: captured before warmup_fold_gemm loaded the CUDA fp8 kernel for this batch size; "
            "using Triton for it. Call warmup_fold_gemm(weight, max_m, scale) before graph capture.",
            stacklevel=4,
        )
        return None
    return module


def _run_cuda_fp8(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None, scale: torch.Tensor
) -> torch.Tensor | None:
    """The fp8 fold through the Hopper kernel where ``_cuda_fp8_ready``; None where it cannot run
    (then, once, a warning), so that the caller's Triton path serves."""
    module = _cuda_fp8_ready(x, weight, out, scale)
    if module is None:
        return None
    try:
        with torch.cuda.device(x.device):
            return module.launch(x, weight, scale, out)
    except module.KernelUnavailable as exc:
        _warn_cuda_unavailable(str(exc))
        return None


@functools.cache
def _warn_cuda_unavailable(reason: str) -> None:
    logger.warning("foldckpt: the CUDA fp8 fold kernel cannot run (%s); using Triton", reason)


def _triton_config(x: torch.Tensor, weight: torch.Tensor) -> KernelConfig | SkinnyConfig | None:
    """The table's Triton kernel for this call (tiled: ``KernelConfig``, skinny: ``SkinnyConfig``),
    or None when the table chose torch or no Triton kernel may run here. An e4m3 ``weight`` is the
    fp8 fold (its scale is checked by the caller): its own table entries, and ROCm gfx950 too."""
    fp8 = is_fp8_weight(weight.dtype)
    if x.dtype not in _TRITON_DTYPES or (weight.dtype != x.dtype and not fp8):
        return None
    if torch.version.hip is not None and not fp8:
        return None
    m, k = x.shape
    n = weight.shape[0]
    if not 1 <= m <= TRITON_MAX_M or not weight.is_contiguous() or not _rows_aligned(x):
        return None
    if fp8 and (x.device.type != "cuda" or not _fp8_triton_device(_device_index(x.device))):
        return None
    if fp8 and n % 8:
        return None  # y's rows would not be 16-byte aligned (a tuned shape always is; an untuned may not)
    cfg = kernel_config_for(gpu_key(x.device), n, k, m, weight.dtype)
    if cfg is None or not cfg.fits(k):
        return None  # the untuned fp8 configs' block_k need not divide an arbitrary k
    if torch.version.hip is not None and isinstance(cfg, KernelConfig) and (cfg.pdl or cfg.use_tma):
        return None  # an NVIDIA-only launch option in a ROCm table: never launched there
    return cfg


def torch_gemm(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The torch path of ``fold_gemm`` (cuBLAS / the CPU GEMM), unchecked: what serves where no
    Triton kernel does, and what the tuner times as the "torch" backend."""
    if scale is not None:
        # The fp8 fold: what the kernels compute, in fp32 (e4m3 -> fp32 is exact), rounded once.
        y = torch.mm(x.float(), weight.float().t()).mul_(scale.float())
        if out is None:
            return y.to(x.dtype)
        out.copy_(y)
        return out
    if out is None:
        return F.linear(x, weight)
    return torch.mm(x, weight.t(), out=out)


def _check_shapes(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None, scale: torch.Tensor | None = None
) -> None:
    if x.dim() != 2 or weight.dim() != 2 or x.shape[1] != weight.shape[1]:
        raise ValueError(f"fold_gemm: x {tuple(x.shape)} and weight {tuple(weight.shape)} are not [M, K] x [N, K]")
    if out is not None and tuple(out.shape) != (x.shape[0], weight.shape[0]):
        raise ValueError(f"fold_gemm: out {tuple(out.shape)} is not [M, N] = {(x.shape[0], weight.shape[0])}")
    fp8 = is_fp8_weight(weight.dtype)
    if fp8 != (scale is not None):
        raise ValueError(
            f"fold_gemm: a {weight.dtype} weight "
            + ("needs its fp32 scale per row (scale=)" if fp8 else "takes no scale (only float8_e4m3fn weights do)")
        )
    if scale is not None and (
        tuple(scale.shape) != (weight.shape[0],) or scale.dtype != torch.float32 or scale.device != weight.device
    ):
        raise ValueError(
            f"fold_gemm: scale {tuple(scale.shape)} {scale.dtype} on {scale.device} is not fp32 "
            f"[N] = [{weight.shape[0]}] on {weight.device}"
        )


def _run_triton(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor | None,
    cfg: KernelConfig | SkinnyConfig,
    rope: QueryRope | None = None,
    scale: torch.Tensor | None = None,
) -> torch.Tensor | None:
    """Launch the tiled (``KernelConfig``, optionally with the RoPE epilogue) or the skinny kernel
    (``SkinnyConfig``, never with RoPE), for the fp8 fold with ``scale``; None when it cannot run
    here (missing Triton, unreserved workspace)."""
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
    if scale is not None and not scale.is_contiguous():
        scale = scale.contiguous()
    with torch.cuda.device(x.device):
        if skinny:
            module.launch_skinny_gemm(x, weight, target, cfg, scale=scale)
        else:
            module.launch_fold_gemm(x, weight, target, cfg, rope, scale=scale)
    if out is not None and target is not out:
        out.copy_(target)
        return out
    return target


def fold_gemm(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor | None = None, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """``y = x · weightᵀ`` for the decode fold: x [M, K] (a strided row view is fine), weight [N, K].

    Writes into ``out`` ([M, N], may be a strided view) when given and returns it; otherwise
    returns a new tensor. Same result as ``F.linear(x, weight)`` up to fp32-accumulation rounding.
    The fp8 fold: ``weight`` float8_e4m3fn [N, K] and ``scale`` its fp32 scale per row [N]
    (required then, refused otherwise); ``y = (x · weightᵀ) * scale`` in x's dtype, the same as
    ``x @ (weight.float() * scale[:, None]).t()`` in fp32 rounded once (see the module docstring).
    Calls on one device must be stream-ordered with each other when a table entry uses split-K
    (it shares one workspace per device).
    """
    _check_shapes(x, weight, out, scale)
    if x.device.type == "cuda" and x.shape[0] > 0:
        aiter_gemm = _aiter_gemm() if scale is None else None
        if aiter_gemm is not None:
            return aiter_gemm(x, weight, dtype=x.dtype, y=out)
        if scale is not None:
            y = _run_cuda_fp8(x, weight, out, scale)
            if y is not None:
                return y
        cfg = _triton_config(x, weight)
        if cfg is not None:
            y = _run_triton(x, weight, out, cfg, scale=scale)
            if y is not None:
                return y
    return torch_gemm(x, weight, out, scale)


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


def fold_query(
    x: torch.Tensor, weight: torch.Tensor, rope: QueryRope, scale: torch.Tensor | None = None
) -> torch.Tensor:
    """The decode MQA query ``x · weightᵀ`` [M, N] with RoPE on the last R columns of every head,
    and the rotated key in ``rope.k_out`` (never a rotated copy of ``k_pe``); for the fp8 fold
    ``scale`` as ``fold_gemm`` (the rows are scaled before they are rotated).

    One launch where the table's bucket for this batch chose the tiled Triton kernel and measured
    its RoPE epilogue faster (``rope_epilogue``); otherwise ``fold_gemm`` (whichever backend the
    table chose: tiled, skinny, the fp8 Hopper kernel or torch) and then ``rope_query``. vLLM's decode query takes three
    (q_b_proj, RoPE, W_UK bmm).
    """
    _check_shapes(x, weight, None, scale)
    rope.check(x.shape[0], weight.shape[0])
    on_gpu = x.device.type == "cuda" and x.shape[0] > 0
    # A bucket of the fp8 Hopper kernel runs it and then the RoPE kernel (it has no RoPE epilogue).
    y = _run_cuda_fp8(x, weight, None, scale) if on_gpu and scale is not None else None
    if y is not None:
        rope_query(y, rope)
        return y
    if on_gpu and (_aiter_gemm() is None or scale is not None):
        cfg = _triton_config(x, weight)
        # The skinny kernel has no RoPE epilogue: its buckets take fold_gemm + rope_query below.
        fused = isinstance(cfg, KernelConfig) and cfg.rope_epilogue
        module = _triton_module() if fused else None
        if module is not None and module.rope_fits(weight.shape[0], cfg):
            y = _run_triton(x, weight, None, cfg, rope, scale)
            if y is not None:
                return y
    y = fold_gemm(x, weight, scale=scale)
    rope_query(y, rope)
    return y


def _warm_ms(weight: torch.Tensor, max_m: int) -> list[int]:
    """One token count per tuned bucket up to ``max_m`` (each compiles one kernel), plus max_m;
    in a skinny bucket one per skinny token tile inside it (each tile is its own compile)."""
    ms = {max_m}
    fp8 = is_fp8_weight(weight.dtype)
    table = load_table(gpu_key(weight.device)) if torch.version.hip is None or fp8 else None
    entry = table.entries(weight.dtype).get(tuple(weight.shape)) if table is not None else None
    if entry is not None:
        ms.update(min(b.m_max, max_m) for b in entry.buckets)
        lo = 0
        for bucket in entry.buckets:
            if bucket.backend == "cuda":
                # One build per token-tile count inside the bucket (cuda_fp8.plan's variants).
                ms.update(min(m, max_m) for m in cuda_tile_starts(lo + 1, bucket.m_max))
            if bucket.backend == "skinny":
                first_m: dict[SkinnyConfig | None, int] = {}
                for m in range(lo + 1, bucket.m_max + 1):
                    first_m.setdefault(skinny_config(table, "fold_fp8" if fp8 else "fold", entry.n, entry.k, m), m)
                ms.update(min(m, max_m) for m in first_m.values())
            lo = bucket.m_max
    elif fp8:
        ms.update(min(m_max, max_m) for m_max, _ in FP8_UNTUNED_CONFIGS)
    elif torch.version.hip is not None:
        # aiter buckets its configs by M at these bounds (see VLLM_NOTES.md).
        ms.update(min(b, max_m) for b in (8, 16, 32, 64, 128, 256, 512, 2048))
    return sorted(ms)


def cuda_tile_starts(lo: int, hi: int) -> list[int]:
    """The token counts in [lo, hi] at which the fp8 Hopper kernel needs another build (its token
    tile count changes: 1-8, 9-16, 17-32 tokens)."""
    starts = {lo} | {m for m in (9, 17) if lo < m <= hi}
    return sorted(m for m in starts if m <= hi)


def _act_dtype(weight: torch.Tensor, x_dtype: torch.dtype) -> torch.dtype:
    """The activations' dtype a warm-up compiles for: the weight's own, or ``x_dtype`` for fp8."""
    return x_dtype if is_fp8_weight(weight.dtype) else weight.dtype


def warmup_fold_gemm(
    weight: torch.Tensor,
    max_m: int,
    scale: torch.Tensor | None = None,
    x_dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Compile every kernel and reserve every buffer ``fold_gemm(x, weight, scale=scale)`` needs
    for M <= max_m.

    Call once per distinct weight shape (and dtype) before CUDA graph capture; Triton compiles on
    first use and the split-K workspace must exist before a graph records its address. A no-op on
    CPU. Runs GEMMs on the current stream and does not synchronise. For the fp8 fold pass its
    ``scale``; ``x_dtype`` is then the activations' dtype the kernels are compiled for (a bf16 or
    fp16 weight's activations have its dtype).
    """
    if weight.device.type != "cuda" or max_m < 1:
        return
    _check_shapes(weight[:1], weight, None, scale)
    module = _triton_module() if torch.version.hip is None or scale is not None else None
    dtype = _act_dtype(weight, x_dtype)
    for m in _warm_ms(weight, max_m):
        x = torch.randn((m, weight.shape[1]), dtype=dtype, device=weight.device)
        cfg = _triton_config(x, weight)
        if isinstance(cfg, KernelConfig) and module is not None:
            module.reserve_workspace(weight.device, *module.workspace_needs(m, weight.shape[0], cfg))
        fold_gemm(x, weight, scale=scale)
        # The torch path serves buckets the table gave to cuBLAS and any fallback: warm it too.
        torch_gemm(x, weight, None, scale)


def warmup_fold_query(
    weight: torch.Tensor,
    max_m: int,
    cos_sin_cache: torch.Tensor,
    head_dim: int,
    scale: torch.Tensor | None = None,
    x_dtype: torch.dtype = torch.bfloat16,
) -> None:
    """Compile the kernels ``fold_query`` runs with this weight and cache up to ``max_m`` tokens
    (the cache dtype is part of what they are compiled for): the GEMM with the RoPE epilogue per
    bucket that chose it, and the standalone RoPE kernel (one compile serves every M). Call after
    ``warmup_fold_gemm`` (with the same ``scale`` and ``x_dtype``). A no-op on CPU."""
    if weight.device.type != "cuda" or max_m < 1:
        return
    r = cos_sin_cache.shape[-1]
    dtype = _act_dtype(weight, x_dtype)

    def inputs(m: int) -> tuple[torch.Tensor, QueryRope]:
        x = torch.randn((m, weight.shape[1]), dtype=dtype, device=weight.device)
        k_pe = torch.zeros((m, r), dtype=dtype, device=weight.device)
        positions = torch.zeros(m, dtype=torch.long, device=weight.device)
        return x, QueryRope(positions, cos_sin_cache, k_pe, k_pe, head_dim)

    for m in _warm_ms(weight, max_m):
        x, rope = inputs(m)
        fold_query(x, weight, rope, scale)
    # Buckets with the RoPE epilogue never launch the standalone kernel; one compile serves any M.
    x, rope = inputs(1)
    rope_query(fold_gemm(x, weight, scale=scale), rope)
