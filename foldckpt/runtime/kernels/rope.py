"""RoPE of the folded decode query, in torch: the CPU path and the reference of the GPU kernels.

The fold's output ``y [M, heads * (L + R)]`` is the MQA query whose last R columns of every head
still need rotary position embedding, and the key's ``k_pe [M, R]`` needs the same rotation.
Both in one pass, the key written to a buffer of its own: on the GPU inside the fold GEMM's
epilogue where the tuning table measured that faster, else one launch of ``triton_rope``; the
plugin no longer copies ``k_pe`` to rotate it in place.

Only the GPT-J (interleaved) layout that DeepSeek-V2/V3 and Kimi MLA layers use is implemented:
pairs ``(2i, 2i+1)`` turn by angle ``i`` of the token's position, read from vLLM's
``cos_sin_cache [max_position, R]`` (``R/2`` cosines then ``R/2`` sines, YaRN's mscale already in
them). Math is fp32 whatever the storage dtype, rounded once on store.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

__all__ = ["QueryRope", "rope_gptj", "rope_query_torch"]


@dataclass(frozen=True)
class QueryRope:
    """The RoPE to apply to one decode batch's folded query and key.

    ``positions [M]`` (integer), ``cos_sin_cache [max_position, R]``, ``k_pe [M, R]`` the unrotated
    key (unit column stride, any row stride), ``k_out [M, R]`` where the rotated key goes (may be
    ``k_pe`` itself), ``head_dim`` = L + R, the columns of one head in the query.
    """

    positions: torch.Tensor
    cos_sin_cache: torch.Tensor
    k_pe: torch.Tensor
    k_out: torch.Tensor
    head_dim: int

    @property
    def rope_dim(self) -> int:
        return self.cos_sin_cache.shape[-1]

    def check(self, m: int, n: int) -> None:
        """Raise ValueError unless this describes a batch of ``m`` tokens and a query ``[m, n]``."""
        r = self.rope_dim
        problems = []
        if r % 2 or not 0 < r <= self.head_dim or n % self.head_dim:
            problems.append(f"rope dim {r} / head dim {self.head_dim} do not tile a query of width {n}")
        if tuple(self.positions.shape) != (m,):
            problems.append(f"positions {tuple(self.positions.shape)} is not [{m}]")
        for name, t in (("k_pe", self.k_pe), ("k_out", self.k_out)):
            if tuple(t.shape) != (m, r) or t.stride(-1) != 1:
                problems.append(f"{name} {tuple(t.shape)} is not [{m}, {r}] with unit column stride")
        if problems:
            raise ValueError("fold_query: " + "; ".join(problems))


def rope_gptj(t: torch.Tensor, positions: torch.Tensor, cos_sin_cache: torch.Tensor) -> torch.Tensor:
    """``t [M, ..., R]`` with pairs ``(2i, 2i+1)`` of token m turned by angle i of ``positions[m]``.

    Computed in fp32 (fp64 for an fp64 ``t``, as the tests' reference) and returned as a new
    tensor of ``t``'s dtype.
    """
    compute = torch.promote_types(t.dtype, torch.float32)
    half = t.shape[-1] // 2
    cos_sin = cos_sin_cache.index_select(0, positions.long()).to(compute)
    shape = (t.shape[0],) + (1,) * (t.dim() - 2) + (half,)
    cos, sin = cos_sin[:, :half].reshape(shape), cos_sin[:, half:].reshape(shape)
    pairs = t.to(compute).unflatten(-1, (half, 2))
    even, odd = pairs[..., 0], pairs[..., 1]
    return torch.stack((even * cos - odd * sin, odd * cos + even * sin), dim=-1).flatten(-2).to(t.dtype)


def rope_query_torch(y: torch.Tensor, rope: QueryRope) -> None:
    """Rotate the last R columns of every head of ``y [M, n]`` in place and fill ``rope.k_out``."""
    m, n = y.shape
    q_pe = y.view(m, n // rope.head_dim, rope.head_dim)[..., rope.head_dim - rope.rope_dim :]
    q_pe.copy_(rope_gptj(q_pe, rope.positions, rope.cos_sin_cache))
    rope.k_out.copy_(rope_gptj(rope.k_pe, rope.positions, rope.cos_sin_cache))
