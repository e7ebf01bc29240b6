"""``kernels.rope_query`` against vLLM's own RoPE modules, for the rotary kinds MLA models use.

The plugin replaces vLLM's RoPE call on the decode query and key with ``fold_query`` /
``rope_query`` wherever ``FoldedMLAWrapper._rope_cache`` accepts the module; these are the
numbers that substitution has to reproduce (vLLM's native implementation is the reference its
CUDA/CPU kernels are tested against).
"""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import pytest
import torch

from foldckpt.runtime.kernels import QueryRope, rope_query

vllm_config = pytest.importorskip("vllm.config")
rotary = pytest.importorskip("vllm.model_executor.layers.rotary_embedding")

R, L, HEADS = 64, 512, 4
DEEPSEEK_YARN = {
    "rope_type": "deepseek_yarn",
    "factor": 40,
    "original_max_position_embeddings": 4096,
    "beta_fast": 32,
    "beta_slow": 1,
    "mscale": 1.0,
    "mscale_all_dim": 0.0,
    "rope_theta": 10000.0,
}
ROPES = {"default": {"rope_type": "default", "rope_theta": 10000.0}, "deepseek_yarn": DEEPSEEK_YARN}


@pytest.fixture(scope="module", autouse=True)
def _vllm_config() -> Iterator[None]:
    with vllm_config.set_current_vllm_config(vllm_config.VllmConfig()):
        yield


def _rope(kind: str, dtype: torch.dtype) -> Any:
    return rotary.get_rope(R, max_position=4096, is_neox_style=False, rope_parameters=ROPES[kind], dtype=dtype)


@pytest.mark.parametrize("kind", sorted(ROPES))
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_rope_query_matches_vllm_native(kind: str, dtype: torch.dtype) -> None:
    module = _rope(kind, dtype)
    gen = torch.Generator().manual_seed(3)
    m = 6
    positions = torch.tensor([0, 1, 5, 1000, 4095, 100000 if kind == "deepseek_yarn" else 77])
    y = torch.randn(m, HEADS * (L + R), generator=gen).to(dtype)
    k_pe = torch.randn(m, 1, R, generator=gen).to(dtype)
    q_ref, k_ref = module.forward_native(positions, y.view(m, HEADS, L + R)[..., L:].clone(), k_pe.clone())

    k_out = torch.empty(m, R, dtype=dtype)
    rope_query(y, QueryRope(positions, module.cos_sin_cache, k_pe[:, 0], k_out, L + R))
    # vLLM rounds the product of bf16 factors on the way; we round once after fp32 math.
    tol = {"rtol": 1e-5, "atol": 1e-5} if dtype == torch.float32 else {"rtol": 2e-2, "atol": 2e-2}
    torch.testing.assert_close(y.view(m, HEADS, L + R)[..., L:], q_ref.view(m, HEADS, R), **tol)
    torch.testing.assert_close(k_out, k_ref.view(m, R), **tol)


def test_yarn_cache_carries_its_mscale() -> None:
    """The YaRN magnitude factor lives in the cache, so a cache lookup reproduces it."""
    module = _rope("deepseek_yarn", torch.float32)
    assert module.mscale != 1.0
    cos, sin = module.cos_sin_cache[:, : R // 2], module.cos_sin_cache[:, R // 2 :]
    torch.testing.assert_close(cos**2 + sin**2, torch.full_like(cos, module.mscale**2))
