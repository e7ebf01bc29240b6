"""The unfolded decode q projection (as vLLM runs it) and the fp64 math both paths must match.

Used by the tuner (to find where the fold stops paying), the decode benchmark and the GPU tests,
so all three compare against the same baseline and the same reference.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F

from foldckpt.runtime.kernels.dispatch import rope_query
from foldckpt.runtime.kernels.rope import QueryRope

__all__ = ["MlaDims", "decode_rope", "fold_weight", "reference_query", "unfolded_query"]


@dataclass(frozen=True)
class MlaDims:
    """Per-rank MLA decode dimensions: n heads, P nope, R rope, L kv_lora, Lq q_lora."""

    heads: int
    nope: int = 128
    rope: int = 64
    kv_lora: int = 512
    q_lora: int = 1536

    @property
    def fold_head(self) -> int:
        """Rows of W_fold (columns of the decode query) per head: L + R."""
        return self.kv_lora + self.rope

    @property
    def fold_rows(self) -> int:
        """N of the fold GEMM: heads * (L + R)."""
        return self.heads * self.fold_head


def decode_rope(
    m: int,
    dims: MlaDims,
    device: torch.device,
    generator: torch.Generator | None = None,
    cache_dtype: torch.dtype = torch.bfloat16,
    max_position: int = 4096,
) -> QueryRope:
    """A decode step's RoPE inputs as the plugin passes them to ``fold_query``: a base-10000
    cos/sin cache, random positions, ``k_pe`` a strided slice of the fused [q_c | kv_c | k_pe]
    projection output, ``k_out`` NaN-poisoned."""
    inv_freq = 10000.0 ** (-torch.arange(0, dims.rope, 2, device=device, dtype=torch.float64) / dims.rope)
    angles = torch.arange(max_position, device=device, dtype=torch.float64)[:, None] * inv_freq
    cache = torch.cat([angles.cos(), angles.sin()], dim=-1).to(cache_dtype)
    positions = torch.randint(0, max_position, (m,), device=device, generator=generator)
    width = dims.q_lora + dims.kv_lora + dims.rope
    k_pe = torch.randn(m, width, device=device, generator=generator).bfloat16()[:, width - dims.rope :]
    k_out = torch.full((m, dims.rope), float("nan"), device=device, dtype=torch.bfloat16)
    return QueryRope(positions, cache, k_pe, k_out, dims.fold_head)


def unfolded_query(
    x: torch.Tensor, w_qb: torch.Tensor, w_uk_t: torch.Tensor, dims: MlaDims, rope: QueryRope | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """vLLM's decode path: q = q_b_proj(x), then ql_nope = bmm(q_nope, W_UK_T) per head; with
    ``rope`` (its ``head_dim`` is P + R) also the RoPE launch vLLM makes between the two.

    Returns (ql_nope [M, n, L], q_pe [M, n, R]) as views, exactly the two tensors vLLM hands to
    the MQA kernel (the concat it may do afterwards is not part of the q projection).
    """
    q = F.linear(x, w_qb)
    if rope is not None:
        rope_query(q, rope)
    q = q.view(-1, dims.heads, dims.nope + dims.rope)
    q_nope, q_pe = q.split([dims.nope, dims.rope], dim=-1)
    ql_nope = torch.bmm(q_nope.transpose(0, 1), w_uk_t)
    return ql_nope.transpose(0, 1), q_pe


def fold_weight(w_qb: torch.Tensor, w_uk_t: torch.Tensor, dims: MlaDims, dtype: torch.dtype) -> torch.Tensor:
    """W_fold [n*(L+R), Lq] from q_b_proj [n*(P+R), Lq] and W_UK_T [n, P, L], folded in fp64.

    Head-major: per head L rows of W_UKᵀ·W_qb_nope then R rows of W_qb_pe (ARCHITECTURE.md).
    """
    qb = w_qb.double().view(dims.heads, dims.nope + dims.rope, dims.q_lora)
    nope = torch.bmm(w_uk_t.double().transpose(1, 2), qb[:, : dims.nope])
    return torch.cat([nope, qb[:, dims.nope :]], dim=1).reshape(dims.fold_rows, dims.q_lora).to(dtype)


def reference_query(x: torch.Tensor, w_qb: torch.Tensor, w_uk_t: torch.Tensor, dims: MlaDims) -> torch.Tensor:
    """Exact [M, n, L+R] decode query in fp64 from the unrounded weights: what both paths approximate."""
    q = (x.double() @ w_qb.double().t()).view(-1, dims.heads, dims.nope + dims.rope)
    ql_nope = torch.einsum("mhp,hpl->mhl", q[..., : dims.nope], w_uk_t.double())
    return torch.cat([ql_nope, q[..., dims.nope :]], dim=-1)
