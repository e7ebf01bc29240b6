"""Triton kernel for the decode fold GEMM ``y = x · Wᵀ`` at small M (1..256 tokens).

Why a kernel of our own: at decode the fold GEMM is a stream over W (21 MB for Kimi-K3 at TP8)
with almost no arithmetic, so its time is set by how fast 132 SMs pull W from HBM, not by FLOPs,
and cuBLAS, shaped for arithmetic, stays well above the copy-bandwidth floor there
(``folded_torch_us`` against ``floor_us`` in docs/bench/decode_nvidia_h200.json's ``records``).
This kernel is shaped for streaming:

- swap-AB: each program computes ``acc[BLOCK_N, BLOCK_M] = W_tile · x_tileᵀ``, so the large N
  dimension feeds the MMA's M side (wgmma wants 64 rows) and the token count is the MMA's
  narrow N side (16..256); W is never padded, only x is.
- split-K with the reduction inside the same launch: the grid is ``row_tiles × split_k`` so the
  SMs can get several waves. Each split stores an fp32 partial into a workspace and bumps a
  per-tile arrival counter; the last arrival sums all partials in split order (so the result is
  bit-reproducible whichever split arrives last), writes the output once and resets the counter
  to zero. One launch, no memset, and a CUDA graph can replay it forever.
- ragged row ownership: a program may own fewer rows than its tile (``rows_per_prog``), which
  spreads W evenly over all SMs without any reduction.
- W is read once (``evict_first``), x is re-read by every program (``evict_last``); W comes in
  either through pointers (16-byte cp.async, pipelined ``num_stages`` deep) or a TMA descriptor.
- optional programmatic dependent launch (``pdl``, sm_90+): the kernel is launched while the
  previous one drains and waits for its writes on the device (``griddepcontrol.wait``) instead
  of behind the launch gap. It never triggers its own dependents early, so a kernel after it
  waits for it as usual.
- optional RoPE epilogue (``fold_query``): the tiles holding a head's last R rows rotate their
  (2i, 2i+1) row pairs by the tokens' cos/sin before the store, and the tile holding head 0's
  first rope row also writes the rotated key. The tuner keeps it where it beats GEMM + RoPE
  kernel (``rope_epilogue`` in the tables of configs/): at the smallest M, where the launch it
  saves is a large share of the step, and not above, where the pair shuffle of a 32/64-token
  accumulator costs more than the launch it saves.

What the H200 search found (``search`` in docs/bench/tune_nvidia_h200.json, and its .log):
split-K always loses, more with more splits: the store/atomic/reload reduction adds latency of
the order of the whole kernel's; ragged rows gain nothing measurable, so HBM, not per-SM
streaming, is the limit. The winners are whole 64-row programs (108 for Kimi-K3 TP8) with 4-6
stages of 16 KB. What they keep above floor + empty-kernel cost (``floor_us`` of the records and
``meta.empty_kernel_us`` in docs/bench/decode_nvidia_h200.json) is first-load latency and the
tail. PDL takes part of that off (paired runs, every shape); an L2 bulk prefetch of W issued
before the wait cost more than it saved.

The fp8 fold (``scale`` given, W float8_e4m3fn + an fp32 scale per row) runs the same two kernels
weight-only: W is streamed as e4m3 (half the bytes), converted in registers (to fp16 with
``mma_f16``: one ``cvt.f16x2.e4m3x2`` per two values, exact; else to x's dtype, which for bf16
goes through fp16 and fp32), the MMA runs against x unquantised (with ``mma_f16`` x is rounded to
fp16 in the kernel: exact for |x| in [2^-14, 65504], where RMS-normalised q_c lies), and the row
scale multiplies the fp32 accumulator once in the epilogue (before RoPE and the split-K store).
On ROCm gfx950 the same kernels serve (e4m3fn is the OCP format there; no PDL/TMA configs).
What the H200 fp8 search found (``fp8_search`` in docs/bench/tune_nvidia_h200.json, Kimi-K3 TP8
N=6912): the fp16 MMA (``mma_f16``) beats the bf16 one, whose path converts through fp32; the
winner at M <= 16 is a 32-row mma.sync tile, BLOCK_K=256, 5 stages, PDL, faster than the bf16
fold though still above its floor (``folded_fp8_us``, ``fp8_floor_us`` and ``folded_triton_us``
of the records in docs/bench/decode_nvidia_h200.json); at M=1 the skinny kernel. Triton lowers
the e4m3 operand through shared memory straight into the MMA register layout (2-byte shared
loads on the wgmma path), and with one 4-warp program per SM the convert latency is exposed:
the search's deeper stages, 8 warps, split-K and ragged rows all lost at M <= 16. Packing the
conversion in inline PTX was slower in the skinny kernel (an extra shared-memory relayout) and
compiled to several times the byte shuffles in the tiled one, so neither uses it.

The workspace and counters live per device and are shared by all calls, so calls on one device
must be stream-ordered with respect to each other (one stream at a time, as in a vLLM worker).
Reserve them before CUDA graph capture (``reserve_workspace``, done by ``warmup_fold_gemm``).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl
from triton.tools.tensor_descriptor import TensorDescriptor

try:
    from triton.language.extra.cuda import gdc_wait
except ImportError:  # a Triton built without the CUDA backend: no config there asks for PDL
    gdc_wait = None

from foldckpt.runtime.kernels.rope import QueryRope
from foldckpt.runtime.kernels.triton_rope import rope_key_rows, rope_query_tile
from foldckpt.runtime.kernels.tuning import KernelConfig, SkinnyConfig

__all__ = [
    "launch_fold_gemm",
    "launch_skinny_gemm",
    "reserve_workspace",
    "rope_fits",
    "workspace_ready",
    "workspace_needs",
]


# Nothing that varies per call is specialised: one compile per config serves every M, split
# and x/out row stride, so warm-up covers all of them and graph capture never compiles.
@triton.jit(
    do_not_specialize=[
        "M",
        "stride_xm",
        "stride_ym",
        "rows_per_prog",
        "k_iters",
        "split_k",
        "stride_cs",
        "stride_kpe",
        "stride_kout",
    ]
)
def _fold_gemm_kernel(
    x_ptr,
    w_src,
    y_ptr,
    ws_ptr,
    cnt_ptr,
    scale_ptr,
    pos_ptr,
    cs_ptr,
    kpe_ptr,
    kout_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_ym,
    stride_cs,
    stride_kpe,
    stride_kout,
    rows_per_prog,
    k_iters,
    split_k,
    BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
    BLOCK_K: tl.constexpr,
    EVEN_N: tl.constexpr,
    USE_TMA: tl.constexpr,
    PDL: tl.constexpr,
    ROPE: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    W_FP8: tl.constexpr,
    MMA_F16: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_m = tl.program_id(1)
    # Splits of one n-tile are adjacent program ids: they run at the same time, so the partials
    # the last one reads back are still in L2.
    pid_n = pid // split_k
    pid_k = pid - pid_n * split_k
    # A program owns rows_per_prog <= BLOCK_N rows: fewer than BLOCK_N spreads W evenly over all
    # SMs (e.g. 53 rows on 131 programs instead of 64 rows on 108) with no split-K reduction.
    offs_r = tl.arange(0, BLOCK_N)
    offs_n = pid_n * rows_per_prog + offs_r
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = (offs_r < rows_per_prog) & (offs_n < N)
    m_mask = offs_m < M
    # k_iters * BLOCK_K rather than a split length: the product keeps BLOCK_K divisibility, so the
    # compiler can prove 16-byte alignment of every W/x row chunk (vector loads, cp.async).
    k_lo = pid_k * k_iters * BLOCK_K

    if W_FP8:
        # The per-row dequantisation scale: read now (the weight's, not the predecessor's), used
        # once in the epilogue, so its latency hides behind the stream of W.
        row_scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
    if PDL:
        # Launched with programmatic dependent launch, this program may start while the previous
        # kernel drains; past this wait all its writes (x among them) are visible.
        gdc_wait()
    if ROPE:
        # Only tiles holding rope rows (1 in 9 at 64-row tiles) do any RoPE work. Their token
        # positions are read now, so that after the loop only the cos/sin gather is in flight.
        row0 = pid_n * rows_per_prog
        has_rope = row0 % HEAD_DIM + rows_per_prog > HEAD_DIM - ROPE_DIM
        pos = tl.load(pos_ptr + offs_m, mask=m_mask & has_rope, other=0).to(tl.int64)
        # The key's RoPE rides along in the tile holding head 0's first rope row (split 0, one
        # per token tile): its loads go out with that tile's cos/sin, with no launch of its own.
        key_tile = (row0 <= HEAD_DIM - ROPE_DIM) & (HEAD_DIM - ROPE_DIM < row0 + rows_per_prog) & (pid_k == 0)

    # The host guarantees 16-byte aligned rows (stride a multiple of 8 elements): tell the
    # compiler so the x loads and y stores stay vectorised although the stride is not specialised.
    x_rows = tl.multiple_of(offs_m * stride_xm, 8)
    x_ptrs = x_ptr + x_rows[:, None] + (k_lo + offs_k)[None, :]
    if not USE_TMA:
        w_ptrs = w_src + offs_n[:, None] * stride_wn + (k_lo + offs_k)[None, :]

    acc = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
    for i in range(0, k_iters):
        if USE_TMA:
            w = w_src.load([pid_n * rows_per_prog, k_lo + i * BLOCK_K])
        elif EVEN_N:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0, eviction_policy="evict_first")
        xk = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0, eviction_policy="evict_last")
        if W_FP8:
            # Weight-only fp8: e4m3 -> fp16 / bf16 in registers (exact either way), MMA against x
            # unquantised; the per-row scale is applied once, in fp32, after the reduction.
            if MMA_F16:
                w = w.to(tl.float16)
                xk = xk.to(tl.float16)
            else:
                w = w.to(xk.dtype)
        acc = tl.dot(w, tl.trans(xk), acc)
        x_ptrs += BLOCK_K
        if not USE_TMA:
            w_ptrs += BLOCK_K

    y_rows = tl.multiple_of(offs_m * stride_ym, 8)
    y_ptrs = y_ptr + y_rows[None, :] + offs_n[:, None]
    y_mask = m_mask[None, :] & n_mask[:, None]
    if ROPE:
        if key_tile:
            rope_key_rows(offs_m, m_mask, pos, cs_ptr, stride_cs, kpe_ptr, stride_kpe, kout_ptr, stride_kout, ROPE_DIM)
    if split_k == 1:
        if W_FP8:
            acc = acc * row_scale[:, None]
        if ROPE:
            if has_rope:
                acc = rope_query_tile(acc, row0, m_mask, pos, cs_ptr, stride_cs, BLOCK_N, BLOCK_M, HEAD_DIM, ROPE_DIM)
        tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=y_mask)
    else:
        tile = pid_m * tl.cdiv(N, rows_per_prog) + pid_n
        tile_elems: tl.constexpr = BLOCK_N * BLOCK_M
        # Partial layout [BLOCK_M, BLOCK_N]: rows of padded tokens (m >= M) are skipped whole.
        part_offs = tl.arange(0, BLOCK_M)[None, :] * BLOCK_N + tl.arange(0, BLOCK_N)[:, None]
        part_base = ws_ptr + tile.to(tl.int64) * split_k * tile_elems
        tl.store(part_base + pid_k * tile_elems + part_offs, acc, mask=m_mask[None, :])
        # Every thread's partial store happens-before the one release below.
        tl.debug_barrier()
        arrived = tl.atomic_add(cnt_ptr + tile, 1, sem="acq_rel", scope="gpu")
        if arrived == split_k - 1:
            # Sum every partial, this program's own too, in split order: the result does not
            # depend on which split arrived last, and acc is dead here (no second accumulator).
            total = tl.zeros((BLOCK_N, BLOCK_M), dtype=tl.float32)
            for s in range(0, split_k):
                # .cg reads L2: other SMs wrote these and L1 is not coherent.
                total += tl.load(
                    part_base + s * tile_elems + part_offs, mask=m_mask[None, :], other=0.0, cache_modifier=".cg"
                )
            if W_FP8:
                total = total * row_scale[:, None]
            if ROPE:
                if has_rope:
                    total = rope_query_tile(
                        total, row0, m_mask, pos, cs_ptr, stride_cs, BLOCK_N, BLOCK_M, HEAD_DIM, ROPE_DIM
                    )
            tl.store(y_ptrs, total.to(y_ptr.dtype.element_ty), mask=y_mask)
            tl.atomic_xchg(cnt_ptr + tile, 0)


@dataclass
class _Workspace:
    """fp32 partials and int32 arrival counters (all zero between launches) of one device."""

    partials: torch.Tensor
    counters: torch.Tensor


_WORKSPACES: dict[int, _Workspace] = {}
# Buffers replaced by a larger reservation stay referenced: a CUDA graph captured earlier still
# holds their addresses, and freeing them would let its replays write into reused memory.
_RETIRED: list[_Workspace] = []


def workspace_needs(m: int, n: int, cfg: KernelConfig) -> tuple[int, int]:
    """(fp32 partial elements, counters) one launch of ``cfg`` at ``m`` x ``n`` uses.

    At least one of each even without split-K: the kernel's split branch is compiled for every
    config (split_k is a run-time argument), so its pointers must always have their real types.
    """
    if cfg.split_k == 1:
        return 1, 1
    tiles = triton.cdiv(m, cfg.block_m) * triton.cdiv(n, cfg.rows(n))
    return tiles * cfg.split_k * cfg.block_n * cfg.block_m, tiles


def _device_index(device: torch.device) -> int:
    return device.index if device.index is not None else torch.cuda.current_device()


def workspace_ready(device: torch.device, partial_elems: int, counter_elems: int) -> bool:
    """Whether the reserved workspace of ``device`` is large enough (no allocation)."""
    ws = _WORKSPACES.get(_device_index(device))
    return ws is not None and ws.partials.numel() >= partial_elems and ws.counters.numel() >= counter_elems


def reserve_workspace(device: torch.device, partial_elems: int, counter_elems: int) -> None:
    """Grow the device's workspace to at least the given sizes (allocates; not during capture)."""
    if workspace_ready(device, partial_elems, counter_elems):
        return
    index = _device_index(device)
    old = _WORKSPACES.get(index)
    if old is not None:
        partial_elems = max(partial_elems, old.partials.numel())
        counter_elems = max(counter_elems, old.counters.numel())
        _RETIRED.append(old)
    dev = torch.device("cuda", index)
    _WORKSPACES[index] = _Workspace(
        partials=torch.empty(partial_elems, dtype=torch.float32, device=dev),
        counters=torch.zeros(counter_elems, dtype=torch.int32, device=dev),
    )


def rope_fits(n: int, cfg: KernelConfig) -> bool:
    """Whether ``cfg`` can apply RoPE in its epilogue for an ``n``-row weight: every program must
    start on an even row so that it holds whole (2i, 2i+1) pairs."""
    return cfg.rows(n) % 2 == 0


def launch_fold_gemm(
    x: torch.Tensor,
    weight: torch.Tensor,
    out: torch.Tensor,
    cfg: KernelConfig,
    rope: QueryRope | None = None,
    scale: torch.Tensor | None = None,
) -> None:
    """Write ``x · weightᵀ`` into ``out`` with the Triton kernel (no host sync); with ``rope``,
    the query RoPE is applied before the store and the rotated key written to ``rope.k_out``.
    With ``scale`` (fp32 [N]) the weight is the fp8 fold (float8_e4m3fn [N, K]) and ``out`` gets
    ``(x · weightᵀ) * scale`` per output column, accumulated in fp32 and rounded once.

    Preconditions (checked by the dispatcher, not here, to keep the hot path short): bf16/fp16
    ``x`` [M, K] and ``out`` [M, N] with unit column stride and 16-byte aligned rows, ``weight``
    [N, K] contiguous (x's dtype, or e4m3 with a contiguous fp32 ``scale``),
    ``K % (split_k * block_k) == 0``, the workspace reserved (``reserve_workspace`` with
    ``workspace_needs``), and with ``rope`` a checked ``QueryRope`` and ``rope_fits(N, cfg)``.
    """
    m, k = x.shape
    n = weight.shape[0]
    # A single row's stride is never used; any multiple of 8 satisfies the in-kernel hint.
    stride_xm = x.stride(0) if m > 1 else 0
    stride_ym = out.stride(0) if m > 1 else 0
    ws = _WORKSPACES[_device_index(x.device)]
    if cfg.use_tma:
        # Built per call (a few µs of host time, nothing on the device): a cache would pin weights.
        w_src = TensorDescriptor.from_tensor(weight, [cfg.block_n, cfg.block_k])
    else:
        w_src = weight
    rows = cfg.rows(n)
    grid = (triton.cdiv(n, rows) * cfg.split_k, triton.cdiv(m, cfg.block_m))
    # Without RoPE its pointers are never read; x stands in so that the argument types are real.
    pos, cache, k_pe, k_out = (rope.positions, rope.cos_sin_cache, rope.k_pe, rope.k_out) if rope else (x,) * 4
    _fold_gemm_kernel[grid](
        x,
        w_src,
        out,
        ws.partials,
        ws.counters,
        scale if scale is not None else ws.partials,
        pos,
        cache,
        k_pe,
        k_out,
        m,
        n,
        stride_xm,
        weight.stride(0),
        stride_ym,
        cache.stride(0),
        k_pe.stride(0),
        k_out.stride(0),
        rows,
        k // (cfg.split_k * cfg.block_k),
        cfg.split_k,
        BLOCK_M=cfg.block_m,
        BLOCK_N=cfg.block_n,
        BLOCK_K=cfg.block_k,
        EVEN_N=rows == cfg.block_n and n % rows == 0,
        USE_TMA=cfg.use_tma,
        PDL=cfg.pdl,
        ROPE=rope is not None,
        HEAD_DIM=rope.head_dim if rope else 0,
        ROPE_DIM=rope.rope_dim if rope else 0,
        W_FP8=scale is not None,
        MMA_F16=scale is not None and cfg.mma_f16,
        num_warps=cfg.num_warps,
        num_stages=cfg.num_stages,
        # Only asked for where wanted: a backend without PDL (ROCm) need not know the option.
        **({"launch_pdl": True} if cfg.pdl else {}),
    )


# The skinny kernel: ``y = x · Wᵀ`` for a handful of tokens without MMA, GEMV-style. Each program
# owns ROWS rows of W (as few as 1) and BLOCK_M tokens and reduces K in K_ITERS unrolled chunks of
# plain vector loads, so that many small programs keep many loads in flight per SM (no shared
# memory, no pipeline prologue). What vLLM's own H200 skinny kernels for q_b_proj do at M <= 16
# (CuTe DSL at M=1-2, dsv3_fused_a at M=3-8), which need vLLM; the tuner and the decode benchmark
# use it for the unfolded baseline. On the fold, ``fold_gemm`` launches it in the M buckets where
# the tuner measured it faster than the bucket's tiled/torch backend (backend = "skinny" in the
# tables of configs/). Without MMA its arithmetic on the CUDA
# cores grows with M, so it loses to the tiled kernel from a few tokens on.
@triton.jit(do_not_specialize=["M", "stride_xm", "stride_ym"])
def _skinny_gemm_kernel(
    x_ptr,
    w_ptr,
    y_ptr,
    scale_ptr,
    M,
    N,
    stride_xm,
    stride_wn,
    stride_ym,
    ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr,
    BLOCK_K: tl.constexpr,
    K_ITERS: tl.constexpr,
    EVEN_N: tl.constexpr,
    PDL: tl.constexpr,
    W_FP8: tl.constexpr,
):
    pid_n = tl.program_id(0)
    pid_m = tl.program_id(1)
    offs_n = pid_n * ROWS + tl.arange(0, ROWS)
    offs_m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    offs_k = tl.arange(0, BLOCK_K)
    n_mask = offs_n < N
    m_mask = offs_m < M
    if W_FP8:
        row_scale = tl.load(scale_ptr + offs_n, mask=n_mask, other=0.0)
    if PDL:
        gdc_wait()
    x_rows = tl.multiple_of(offs_m * stride_xm, 8)
    acc = tl.zeros((ROWS, BLOCK_M), dtype=tl.float32)
    for kk in tl.static_range(K_ITERS):
        k0 = kk * BLOCK_K
        w_ptrs = w_ptr + offs_n[:, None] * stride_wn + (k0 + offs_k)[None, :]
        if EVEN_N:
            w = tl.load(w_ptrs, eviction_policy="evict_first")
        else:
            w = tl.load(w_ptrs, mask=n_mask[:, None], other=0.0, eviction_policy="evict_first")
        x_ptrs = x_ptr + x_rows[:, None] + (k0 + offs_k)[None, :]
        xk = tl.load(x_ptrs, mask=m_mask[:, None], other=0.0, eviction_policy="evict_last")
        acc += tl.sum(w.to(tl.float32)[:, None, :] * xk.to(tl.float32)[None, :, :], axis=2)
    if W_FP8:
        acc = acc * row_scale[:, None]
    y_ptrs = y_ptr + tl.multiple_of(offs_m * stride_ym, 8)[None, :] + offs_n[:, None]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=m_mask[None, :] & n_mask[:, None])


def launch_skinny_gemm(
    x: torch.Tensor, weight: torch.Tensor, out: torch.Tensor, cfg: SkinnyConfig, scale: torch.Tensor | None = None
) -> None:
    """Write ``x · weightᵀ`` into ``out`` with the skinny kernel (no host sync, no workspace);
    with ``scale`` (fp32 [N]) for an e4m3 ``weight``, ``(x · weightᵀ) * scale`` as ``launch_fold_gemm``.

    Preconditions as ``launch_fold_gemm`` (bf16/fp16, unit column stride, 16-byte aligned rows,
    contiguous ``weight``) and ``K % cfg.block_k == 0``.
    """
    m, k = x.shape
    n = weight.shape[0]
    _skinny_gemm_kernel[(triton.cdiv(n, cfg.rows), triton.cdiv(m, cfg.block_m))](
        x,
        weight,
        out,
        scale if scale is not None else out,
        m,
        n,
        x.stride(0) if m > 1 else 0,
        weight.stride(0),
        out.stride(0) if m > 1 else 0,
        ROWS=cfg.rows,
        BLOCK_M=cfg.block_m,
        BLOCK_K=cfg.block_k,
        K_ITERS=k // cfg.block_k,
        EVEN_N=n % cfg.rows == 0,
        PDL=cfg.pdl,
        W_FP8=scale is not None,
        num_warps=cfg.num_warps,
        **({"launch_pdl": True} if cfg.pdl else {}),
    )
