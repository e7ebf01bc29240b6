"""Kimi-K3's MLA folded on vLLM's ROCm path (``vllm.models.kimi_k3.amd``).

On ROCm vLLM builds Kimi-K3's MLA layers from ``KimiK3MultiHeadLatentAttentionWrapper``, a
``PluggableLayer`` subclass of the generic wrapper; ``PluggableLayer.__new__`` looks the class up
by name, so :func:`install` registers :class:`FoldedKimiK3Wrapper` under that name and every
Kimi-K3 MLA layer (main model and MTP) is built as it. Its ``forward`` is vLLM's (fused QKV,
output gate split when fused, ``_normalize_q_kv``, gate, ``skip_o_proj``) with the query
projection moved:

- decode-only batches of at most the routing threshold that vLLM would send to ``_fused_decode``
  (AITER MLA, fp8 KV cache): ``y = fold_gemm(q_c)`` (aiter ``gemm_a16w16``) and the views
  ``y[..., :L]`` / ``y[..., L:]`` straight into aiter's ``fused_qk_rope_concat_and_cache_mla``
  (identity RoPE: NoPE), then ``forward_mqa`` and ``_v_up_proj``: one GEMM instead of
  ``q_b_proj`` + the W_UK bmm (bf16 or MXFP4);
- every other batch: the plugin's routed op (:class:`~foldckpt.runtime.mla_fold.FoldedMLAMixin`),
  which splits decode rows to the fold and prefill rows to ``q_b_proj``.

The fused kernel gets all-zero positions: its cos/sin cache is one identity row (cos = 1, sin = 0)
and not every AITER variant clamps a position into it; the head-grouped kernel of AITER v0.1.26
reads cos = sin = 0 past the cache, which zeroes q_pe and the cached k_pe (vLLM 0.34 found this and
passes its ``_zero_positions``). The buffer is vLLM's where it has one (0.34), else the plugin's
own, allocated once per layer at the largest batch and sliced per call, so captured graphs share it.

vLLM 0.34 folds Kimi-K3 itself on this path (``_w_fold``, built in its
``process_weights_after_loading`` when ``_fold_qb_uk``, run by ``_fused_decode`` for decode-only
batches of any size). A layer with a sidecar fold clears ``_fold_qb_uk``, so vLLM builds no second
fold. Why the plugin keeps its own fold rather than handing the sidecar's rows to vLLM's slot: the
same weight, in the manifest's per-head ``[L+R]`` layout, also serves the routed op (mixed batches:
``y.view(m, n, L+R)`` is the MQA query with no concat), fp8 folds (vLLM's slot is bf16
``gemm_a16w16`` only) and vLLM 0.33 (no slot at all); vLLM's layout (all nope rows, then all pe
rows) would need a second copy of the weight or a concat per step, and the handover would rest on
four vLLM internals (``_w_fold``, its row layout, ``_split_fold_output``, ``_fused_decode``'s 2-D
dispatch) where this rests on one flag.

Refused (the engine stops with one line naming it): Kimi-K3's ``decode_backend=latency_specialized``
(vLLM 0.34's "M1" kernel reads ``q_b_proj.weight`` and ``W_K`` itself, past this class's forward),
as on NVIDIA; and a weight reload (:meth:`~foldckpt.runtime.layer_fold.LayerFold.mark_finalized`).

Not run on this project's machines (there is no ROCm GPU here): the vLLM 0.32/0.33/0.34 source it
relies on is contract-tested (tests/contract), and the fused query + cache write runs on the CPU
against a stand-in of the AITER kernel (tests/unit/test_kimi_k3_rocm.py). The release differences
handled: ``_qkv_gate_fused`` and ``_fused_q_heads`` (0.33 on), ``forward(..., skip_o_proj)`` (0.33
on), the fused sigmoid gate (0.33 on), ``_zero_positions`` and ``_fold_qb_uk`` (0.34).
"""

from __future__ import annotations

import importlib.metadata
import inspect
from typing import Any

import torch
from vllm._aiter_ops import rocm_aiter_ops
from vllm.config import get_current_vllm_config
from vllm.model_executor.custom_op import op_registry_oot
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.models.kimi_k3.amd.mla import KimiK3MultiHeadLatentAttentionWrapper
from vllm.platforms import current_platform

from foldckpt.errors import FoldckptError
from foldckpt.runtime.kernels import fold_gemm
from foldckpt.runtime.layer_fold import SPECIALIZED_DECODE, specialized_decode_requested
from foldckpt.runtime.mla_fold import FoldedMLAMixin

# aiter reads a strided q_nope correctly from this version on (older ones misread it when the KV
# block size is not 1): below it, ql_nope is made contiguous as vLLM does.
_AITER_STRIDED_Q_NOPE = (0, 1, 17)
_HAS_SKIP_O_PROJ = "skip_o_proj" in inspect.signature(KimiK3MultiHeadLatentAttentionWrapper.forward).parameters
# vLLM 0.33 brought skip_o_proj and aiter's fused sigmoid gate together; 0.32 gates in torch.
_FUSED_SIGMOID_GATE = _HAS_SKIP_O_PROJ


def _aiter_reads_strided_q_nope() -> bool:
    try:
        version = importlib.metadata.version("aiter")
    except importlib.metadata.PackageNotFoundError:
        return False
    parts = tuple(int(p) for p in version.split("+")[0].split(".")[:3] if p.isdigit())
    return parts >= _AITER_STRIDED_Q_NOPE


def _max_batch_tokens() -> int:
    """The most rows one forward can have: vLLM 0.34 sizes its ``_zero_positions`` the same way."""
    config = get_current_vllm_config()
    scheduler, compilation = config.scheduler_config, config.compilation_config
    return max(scheduler.max_num_batched_tokens, compilation.max_cudagraph_capture_size or 0)


class FoldedKimiK3Wrapper(FoldedMLAMixin, KimiK3MultiHeadLatentAttentionWrapper):
    """Kimi-K3's ROCm MLA wrapper with the query projection folded for decode rows."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        if self.q_lora_rank is None:  # Kimi-Linear's full-rank q_proj: nothing to fold.
            self.fold = self.q_fold = None
            return
        self._init_fold(
            {
                "sparse MLA (indexer)": self.is_sparse or self.indexer is not None,
                "DCP query replication": self.dcp_q_replicate,
                "MLA with RoPE": self.rotary_emb is not None,
                SPECIALIZED_DECODE: specialized_decode_requested(),
            }
        )
        self._strided_q_nope = _aiter_reads_strided_q_nope()
        if self.fold is None:
            return
        self._fold_qb_uk = False  # vLLM 0.34: no _w_fold of its own beside the sidecar's (module docstring)
        if getattr(self, "_zero_positions", None) is None:  # vLLM 0.33 has none (0.34: when it fuses no decode)
            zeros = torch.zeros(_max_batch_tokens(), dtype=torch.int64)
            self.register_buffer("_zero_positions", zeros, persistent=False)

    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: Any,
        llama_4_scaling: torch.Tensor | None = None,
        skip_o_proj: bool = False,
    ) -> torch.Tensor:
        if self.fold is None:
            extra = {"skip_o_proj": skip_o_proj} if _HAS_SKIP_O_PROJ else {}
            return super().forward(positions, hidden_states, llama_4_scaling, **extra)
        num_tokens = hidden_states.orig_shape[0] if hasattr(hidden_states, "orig_shape") else hidden_states.shape[0]
        qkv_lora = self.fused_qkv_a_proj(hidden_states)[0]
        gate = None
        if getattr(self, "_qkv_gate_fused", False):
            qkv_lora, gate = qkv_lora.split(
                [self.q_lora_rank + self.kv_lora_rank + self.qk_rope_head_dim, self.num_heads * self.v_head_dim],
                dim=-1,
            )
        q_c, kv_c, k_pe = qkv_lora.split([self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_c, kv_c_normed = self._normalize_q_kv(q_c, kv_c)
        k_pe = k_pe.unsqueeze(1)

        attn_out = None
        if self._fused_qk_prep and llama_4_scaling is None:
            attn_metadata, layer, kv_cache, slot_mapping = get_attention_context(self.mla_attn.layer_name)
            if (
                attn_metadata is not None
                and slot_mapping is not None
                and kv_cache.numel() > 0
                and attn_metadata.num_actual_tokens == attn_metadata.num_decode_tokens
                and self.fold.takes(attn_metadata.num_decode_tokens)
            ):
                attn_out = self._fused_fold_decode(
                    q_c, kv_c_normed, k_pe, num_tokens, attn_metadata, layer, kv_cache, slot_mapping
                )
                self.fold.count(q_c, attn_metadata.num_decode_tokens, 0, 0)
        if attn_out is None:
            attn_out = self._call_op(q_c, positions, kv_c_normed, k_pe, num_tokens, llama_4_scaling)

        # vLLM's tail: the output gate, then o_proj unless the specialized decode runs it.
        if self.g_proj is not None:
            gate = self.g_proj(hidden_states)[0]
        if gate is not None:
            if rocm_aiter_ops.is_enabled() and _FUSED_SIGMOID_GATE:
                from aiter.ops.triton.fusions.fused_sigmoid_mul import fused_sigmoid_mul

                attn_out = fused_sigmoid_mul(attn_out, gate)
            else:
                attn_out = attn_out * gate.sigmoid()
        if skip_o_proj:
            return attn_out
        return self.o_proj(attn_out)[0]

    def _fused_fold_decode(
        self,
        q_c: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        num_tokens: int,
        attn_metadata: Any,
        layer: Any,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """vLLM's ``_fused_decode`` with the fold GEMM in place of q_b_proj + the W_UK bmm."""
        fp8_dtype = current_platform.fp8_dtype()
        if kv_cache.dtype != fp8_dtype:
            kv_cache = kv_cache.view(fp8_dtype)
        q_out = self._fold_into_cache(q_c, kv_c_normed, k_pe, layer, kv_cache, slot_mapping)
        attn = self.mla_attn
        attn_out, _ = attn.impl.forward_mqa(q_out, kv_cache, attn_metadata, attn)
        output = q_c.new_empty((num_tokens, self.num_heads * self.v_head_dim))
        attn._v_up_proj(attn_out, out=output)
        return output

    def _fold_into_cache(
        self,
        q_c: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        layer: Any,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor,
    ) -> torch.Tensor:
        """The fp8 MQA query ``[m, n, L+R]`` of decode rows (the fold GEMM, then aiter's fused
        concat + quant) and their latent cache rows written into ``kv_cache`` (viewed as fp8)."""
        from aiter.ops.cache import fused_qk_rope_concat_and_cache_mla

        assert self.q_fold is not None
        head_size = self.kv_lora_rank + self.qk_rope_head_dim
        y = fold_gemm(q_c, self.q_fold.weight, scale=self.fold.weight_scale)
        y = y.view(q_c.shape[0], self.num_heads, head_size)
        ql_nope, q_pe = y[..., : self.kv_lora_rank], y[..., self.kv_lora_rank :]
        if not self._strided_q_nope:
            ql_nope = ql_nope.contiguous()
        # From here on exactly vLLM's _fused_decode (identity RoPE: Kimi-K3 is NoPE).
        if self._identity_rope is None:
            half = self.qk_rope_head_dim // 2
            opts = {"dtype": kv_c_normed.dtype, "device": kv_c_normed.device}
            self._identity_rope = (torch.ones(1, half, **opts), torch.zeros(1, half, **opts))
        cos_cache, sin_cache = self._identity_rope
        fused_heads = getattr(self, "_fused_q_heads", self.num_heads)
        q_out = torch.empty((q_c.shape[0], fused_heads, head_size), dtype=kv_cache.dtype, device=q_c.device)
        q_out = q_out[:, : self.num_heads]
        # Position 0 for every row: the one-row identity cache is exact there (module docstring).
        slot_mapping = slot_mapping.flatten()
        positions = self._zero_positions[: slot_mapping.shape[0]]
        fused_qk_rope_concat_and_cache_mla(
            ql_nope,
            q_pe,
            kv_c_normed,
            k_pe.squeeze(1),
            kv_cache.view(kv_cache.shape[0], -1, head_size),
            q_out,
            slot_mapping,
            layer._k_scale,
            layer._q_scale,
            positions,
            cos_cache,
            sin_cache,
            is_neox=True,
            is_nope_first=True,
        )
        return q_out


def install() -> None:
    """Build every Kimi-K3 MLA layer as :class:`FoldedKimiK3Wrapper` (once per process)."""
    name = KimiK3MultiHeadLatentAttentionWrapper.__name__
    current = op_registry_oot.get(name)
    if current is FoldedKimiK3Wrapper:
        return
    if current is not None:
        raise FoldckptError(
            f"{name} is already replaced by {current.__qualname__} (another plugin); foldckpt cannot "
            "fold Kimi-K3 next to it: set FOLDCKPT_DISABLE=1 or remove the other plugin"
        )
    KimiK3MultiHeadLatentAttentionWrapper.register_oot(FoldedKimiK3Wrapper, name=name)
