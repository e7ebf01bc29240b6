"""Triton GPT-J RoPE for the folded decode query: helpers the fold GEMM's epilogue uses, and a
standalone kernel for the buckets and GEMM backends without that epilogue (aiter, cuBLAS).

Same math as ``rope.rope_gptj`` (the torch reference): pairs ``(2i, 2i+1)`` of a token turned by
angle i of its position, cos/sin from vLLM's ``cos_sin_cache [max_position, R]``, fp32 math.
The standalone kernel is one launch for the query and the key together (one program per token),
so a decode step pays at most one RoPE launch and no ``k_pe`` copy, on every GEMM backend.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from foldckpt.runtime.kernels.rope import QueryRope

__all__ = ["launch_rope_query"]


@triton.jit
def rotate_pairs(src, dst, cos, sin, mask):
    """Rotate the pairs at ``src``/``src + 1`` by (cos, sin) into ``dst``/``dst + 1`` (may alias)."""
    even = tl.load(src, mask=mask, other=0.0).to(tl.float32)
    odd = tl.load(src + 1, mask=mask, other=0.0).to(tl.float32)
    tl.store(dst, (even * cos - odd * sin).to(dst.dtype.element_ty), mask=mask)
    tl.store(dst + 1, (odd * cos + even * sin).to(dst.dtype.element_ty), mask=mask)


@triton.jit
def load_cos_sin(cs_ptr, offs, mask, ROPE_DIM: tl.constexpr):
    """(cos, sin) in fp32 at ``offs`` into the cache rows (``pos * stride + i``); (1, 0) where masked."""
    cos = tl.load(cs_ptr + offs, mask=mask, other=1.0).to(tl.float32)
    sin = tl.load(cs_ptr + offs + ROPE_DIM // 2, mask=mask, other=0.0).to(tl.float32)
    return cos, sin


@triton.jit
def rope_key_rows(
    offs_m, m_mask, pos, cs_ptr, stride_cs, kpe_ptr, stride_kpe, kout_ptr, stride_kout, ROPE_DIM: tl.constexpr
):
    """RoPE of the key rows ``offs_m`` at positions ``pos`` (``k_pe [M, R]`` into ``k_out [M, R]``)."""
    half = tl.arange(0, ROPE_DIM // 2)
    rows = offs_m.to(tl.int64)
    mask = m_mask[:, None]
    cos, sin = load_cos_sin(cs_ptr, pos[:, None] * stride_cs + half[None, :], mask, ROPE_DIM)
    src = kpe_ptr + rows[:, None] * stride_kpe + 2 * half[None, :]
    dst = kout_ptr + rows[:, None] * stride_kout + 2 * half[None, :]
    rotate_pairs(src, dst, cos, sin, mask)


@triton.jit
def rope_query_tile(
    acc,
    row0,
    m_mask,
    pos,
    cs_ptr,
    stride_cs,
    BLOCK_N: tl.constexpr,
    BLOCK_M: tl.constexpr,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
):
    """``acc [BLOCK_N, BLOCK_M]`` (query rows ``row0..``, tokens at positions ``pos``) with its
    rope rows turned, still in fp32. ``row0`` is even, so the tile holds whole pairs; rows that
    are not among the last ROPE_DIM of a head get (cos, sin) = (1, 0)."""
    pairs = tl.permute(tl.reshape(acc, (BLOCK_N // 2, 2, BLOCK_M)), (0, 2, 1))
    even, odd = tl.split(pairs)
    col = (row0 + 2 * tl.arange(0, BLOCK_N // 2)) % HEAD_DIM - (HEAD_DIM - ROPE_DIM)
    is_rope = col >= 0
    freq = tl.where(is_rope, col // 2, 0)
    mask = is_rope[:, None] & m_mask[None, :]
    cos, sin = load_cos_sin(cs_ptr, pos[None, :] * stride_cs + freq[:, None], mask, ROPE_DIM)
    turned = tl.join(even * cos - odd * sin, odd * cos + even * sin)
    return tl.reshape(tl.permute(turned, (0, 2, 1)), (BLOCK_N, BLOCK_M))


@triton.jit
def _rope_query_kernel(
    y_ptr,
    stride_ym,
    pos_ptr,
    cs_ptr,
    stride_cs,
    kpe_ptr,
    stride_kpe,
    kout_ptr,
    stride_kout,
    heads,
    HEAD_DIM: tl.constexpr,
    ROPE_DIM: tl.constexpr,
    BLOCK_H: tl.constexpr,
):
    """One program per token: every head's rope columns of ``y`` in place, and the key."""
    m = tl.program_id(0)
    half = tl.arange(0, ROPE_DIM // 2)
    pos = tl.load(pos_ptr + m).to(tl.int64)
    cos, sin = load_cos_sin(cs_ptr, pos * stride_cs + half, half < ROPE_DIM // 2, ROPE_DIM)
    h = tl.arange(0, BLOCK_H)
    q = y_ptr + m.to(tl.int64) * stride_ym + h[:, None] * HEAD_DIM + (HEAD_DIM - ROPE_DIM) + 2 * half[None, :]
    rotate_pairs(q, q, cos[None, :], sin[None, :], h[:, None] < heads)
    key = kpe_ptr + m.to(tl.int64) * stride_kpe + 2 * half
    rotate_pairs(key, kout_ptr + m.to(tl.int64) * stride_kout + 2 * half, cos, sin, half < ROPE_DIM // 2)


def launch_rope_query(y: torch.Tensor, rope: QueryRope) -> None:
    """RoPE on ``y [M, n]`` (unit column stride) in place and ``rope.k_pe`` into ``rope.k_out``."""
    m, n = y.shape
    heads = n // rope.head_dim
    _rope_query_kernel[(m,)](
        y,
        y.stride(0),
        rope.positions,
        rope.cos_sin_cache,
        rope.cos_sin_cache.stride(0),
        rope.k_pe,
        rope.k_pe.stride(0),
        rope.k_out,
        rope.k_out.stride(0),
        heads,
        HEAD_DIM=rope.head_dim,
        ROPE_DIM=rope.rope_dim,
        BLOCK_H=triton.next_power_of_2(heads),
    )
