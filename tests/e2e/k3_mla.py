"""The dimensions vLLM's Kimi-K3 MLA classes are built with, from a checkpoint's text config: the
NVIDIA ``MultiHeadLatentAttention`` and the AMD ``KimiMLAAttention`` take the same ones, and the
tests that build either one by hand (outside a model) take them from here."""

from __future__ import annotations

from typing import Any


def mla_dims(text: Any) -> dict[str, Any]:
    return dict(
        config=text,
        hidden_size=text.hidden_size,
        num_heads=text.num_attention_heads,
        qk_nope_head_dim=text.qk_nope_head_dim,
        qk_rope_head_dim=text.qk_rope_head_dim,
        v_head_dim=text.v_head_dim,
        q_lora_rank=text.q_lora_rank,
        kv_lora_rank=text.kv_lora_rank,
    )
