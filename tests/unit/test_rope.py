"""The torch RoPE of the folded decode query (CPU path and reference of the GPU kernels)."""

from __future__ import annotations

import math

import pytest
import torch

from foldckpt.runtime.kernels import QueryRope, rope_query
from foldckpt.runtime.kernels.rope import rope_gptj

R, L, HEADS = 64, 512, 3


def _cache(max_pos: int, rope_dim: int = R, base: float = 10000.0) -> torch.Tensor:
    inv_freq = base ** (-torch.arange(0, rope_dim, 2, dtype=torch.float64) / rope_dim)
    angles = torch.arange(max_pos, dtype=torch.float64)[:, None] * inv_freq[None, :]
    return torch.cat([angles.cos(), angles.sin()], dim=-1)


def test_rope_gptj_is_a_complex_rotation_of_interleaved_pairs() -> None:
    gen = torch.Generator().manual_seed(0)
    cache = _cache(100)
    t = torch.randn(5, 2, R, dtype=torch.float64, generator=gen)
    positions = torch.tensor([0, 1, 7, 42, 99])
    got = rope_gptj(t, positions, cache)
    inv_freq = 10000.0 ** (-torch.arange(0, R, 2, dtype=torch.float64) / R)
    turn = torch.polar(torch.ones(5, 1, R // 2, dtype=torch.float64), positions[:, None, None] * inv_freq)
    expected = torch.view_as_real(torch.view_as_complex(t.unflatten(-1, (R // 2, 2)).contiguous()) * turn)
    torch.testing.assert_close(got, expected.flatten(-2), rtol=1e-12, atol=1e-12)
    torch.testing.assert_close(got[0], t[0])  # position 0 turns nothing
    assert got.norm(dim=-1).sub(t.norm(dim=-1)).abs().max() < 1e-12  # rotations keep the norm


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_query_turns_only_the_rope_columns_and_fills_k_out(dtype: torch.dtype) -> None:
    gen = torch.Generator().manual_seed(1)
    m, head = 4, L + R
    cache = _cache(64).to(dtype)
    y = torch.randn(m, HEADS * head, generator=gen).to(dtype)
    fused = torch.randn(m, 100 + R, generator=gen).to(dtype)  # k_pe as a strided slice, as in vLLM
    k_pe, k_out = fused[:, 100:], torch.full((m, R), math.nan, dtype=dtype)
    positions = torch.tensor([3, 0, 63, 17])
    before = y.clone()
    rope_query(y, QueryRope(positions, cache, k_pe, k_out, head))
    y3, b3 = y.view(m, HEADS, head), before.view(m, HEADS, head)
    assert torch.equal(y3[..., :L], b3[..., :L])
    torch.testing.assert_close(y3[..., L:], rope_gptj(b3[..., L:], positions, cache))
    torch.testing.assert_close(k_out, rope_gptj(k_pe, positions, cache))
    assert not torch.equal(y3[1:, :, L:], b3[1:, :, L:])  # positions > 0 did turn


def test_query_rope_check_names_what_is_wrong() -> None:
    cache, head = _cache(8), L + R
    k = torch.zeros(2, R, dtype=torch.float64)
    QueryRope(torch.zeros(2, dtype=torch.long), cache, k, k, head).check(2, 3 * head)
    with pytest.raises(ValueError, match="positions"):
        QueryRope(torch.zeros(3, dtype=torch.long), cache, k, k, head).check(2, 3 * head)
    with pytest.raises(ValueError, match="k_out"):
        QueryRope(torch.zeros(2, dtype=torch.long), cache, k, k.t(), head).check(2, 3 * head)
    with pytest.raises(ValueError, match="do not tile"):
        QueryRope(torch.zeros(2, dtype=torch.long), cache, k, k, head).check(2, 3 * head + 1)
