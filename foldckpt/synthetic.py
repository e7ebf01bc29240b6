"""Synthetic checkpoints with the exact tensor names, layouts and configs of the real models.

Nothing may be downloaded at run time, so tests, the demo and the benchmarks build their own
checkpoints: DeepSeek-V3 (bf16, and fp8 e4m3 with 128x128 ``weight_scale_inv`` blocks), Kimi-K2.5
(DeepSeek-V3 text model under ``language_model.`` plus a vision tower) and Kimi-K3 (Kimi-Linear
text model: KDA layers, MLA layers, MXFP4-packed experts, an MTP layer). The tiny dimensions keep
``kv_lora_rank`` 512 and ``qk_rope_head_dim`` 64, which vLLM's CPU MLA kernels require, so the
DeepSeek-V3 variant is servable by a real vLLM engine (a byte-level tokenizer is included).
``full_geometry`` gives Kimi-K3's real attention shapes (attention tensors only) for benchmarks.
Shards are split so that the first MLA layer's q_b_proj and kv_b_proj live in different files.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
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


FULL_K3_DIMS = TinyDims(hidden=7168, heads=96, q_lora=1536, kv_lora=512, nope=128, rope=64, v_head=128)


def _byte_to_unicode() -> dict[int, str]:
    """GPT-2's reversible byte -> printable character map used by byte-level BPE."""
    printable = list(range(ord("!"), ord("~") + 1)) + list(range(ord("¡"), ord("¬") + 1)) + list(range(ord("®"), ord("ÿ") + 1))
    chars, extra = list(printable), 0
    for byte in range(256):
        if byte not in printable:
            printable.append(byte)
            chars.append(256 + extra)
            extra += 1
    return dict(zip(printable, map(chr, chars)))


def write_tokenizer(out_dir: Path) -> None:
    """A byte-level BPE tokenizer with no merges (one token per byte) plus BOS/EOS and a chat template."""
    vocab = {char: byte for byte, char in sorted(_byte_to_unicode().items())}
    special = [
        {"id": _BYTE_VOCAB + i, "content": tok, "single_word": False, "lstrip": False,
         "rstrip": False, "normalized": False, "special": True}
        for i, tok in enumerate((_BOS, _EOS))
    ]  # fmt: skip
    byte_level = {"type": "ByteLevel", "add_prefix_space": False, "trim_offsets": True, "use_regex": True}
    tokenizer = {
        "version": "1.0", "truncation": None, "padding": None, "added_tokens": special,
        "normalizer": None, "pre_tokenizer": byte_level, "post_processor": None, "decoder": byte_level,
        "model": {"type": "BPE", "dropout": None, "unk_token": None, "continuing_subword_prefix": None,
                  "end_of_word_suffix": None, "fuse_unk": False, "byte_fallback": False,
                  "ignore_merges": False, "vocab": vocab, "merges": []},
    }  # fmt: skip
    (out_dir / "tokenizer.json").write_text(json.dumps(tokenizer, ensure_ascii=False))
    chat_template = (
        "{% for message in messages %}<|{{ message['role'] }}|>{{ message['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}<|assistant|>{% endif %}"
    )
    (out_dir / "tokenizer_config.json").write_text(json.dumps({
        "tokenizer_class": "PreTrainedTokenizerFast", "bos_token": _BOS, "eos_token": _EOS,
        "model_max_length": 4096, "add_bos_token": False, "chat_template": chat_template,
    }, indent=2))  # fmt: skip
    (out_dir / "generation_config.json").write_text(
        json.dumps({"bos_token_id": _BYTE_VOCAB, "eos_token_id": _BYTE_VOCAB + 1, "do_sample": False}, indent=2)
    )


def _deepseek_text_config(d: TinyDims, layers: int, mtp: int) -> dict[str, Any]:
    return {
        "architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3",
        "vocab_size": d.vocab, "hidden_size": d.hidden, "intermediate_size": d.intermediate,
        "moe_intermediate_size": d.moe_intermediate, "num_hidden_layers": layers,
        "num_nextn_predict_layers": mtp, "num_attention_heads": d.heads, "num_key_value_heads": d.heads,
        "n_shared_experts": 1, "n_routed_experts": d.experts, "routed_scaling_factor": 2.5,
        "kv_lora_rank": d.kv_lora, "q_lora_rank": d.q_lora, "qk_rope_head_dim": d.rope,
        "v_head_dim": d.v_head, "qk_nope_head_dim": d.nope, "topk_method": "noaux_tc", "n_group": 1,
        "topk_group": 1, "num_experts_per_tok": 2, "moe_layer_freq": 1, "first_k_dense_replace": 1,
        "norm_topk_prob": True, "scoring_func": "sigmoid", "hidden_act": "silu",
        "max_position_embeddings": 163840, "rms_norm_eps": 1e-6, "rope_theta": 10000.0,
        # DeepSeek-V3's own YaRN settings: vLLM builds its DeepseekScalingRotaryEmbedding from them.
        "rope_scaling": {
            "type": "yarn", "factor": 40, "original_max_position_embeddings": 4096, "beta_fast": 32,
            "beta_slow": 1, "mscale": 1.0, "mscale_all_dim": 1.0,
        },
        "attention_bias": False, "attention_dropout": 0.0,
        "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True,
        "bos_token_id": _BYTE_VOCAB, "eos_token_id": _BYTE_VOCAB + 1, "initializer_range": 0.02,
    }  # fmt: skip


class _TensorFactory:
    """Seeded random weights scaled by 1/sqrt(fan_in), so activations stay O(1) through the model."""

    def __init__(self, seed: int, dtype: torch.dtype) -> None:
        self.generator = torch.Generator().manual_seed(seed)
        self.dtype = dtype
        self.tensors: dict[str, torch.Tensor] = {}

    def linear(self, name: str, out_features: int, in_features: int) -> None:
        weight = torch.randn(out_features, in_features, generator=self.generator) / math.sqrt(in_features)
        self.tensors[name] = weight.to(self.dtype)

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
        for proj, shape in (("gate_proj", (d.intermediate, d.hidden)), ("up_proj", (d.intermediate, d.hidden)),
                            ("down_proj", (d.hidden, d.intermediate))):  # fmt: skip
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
        _deepseek_mlp(f, p, d, dense=i == 0)
        if i >= layers:  # DeepSeek MTP block extras
            f.norm(f"{p}.enorm.weight", d.hidden)
            f.norm(f"{p}.hnorm.weight", d.hidden)
            f.linear(f"{p}.eh_proj.weight", d.hidden, 2 * d.hidden)
            f.norm(f"{p}.shared_head.norm.weight", d.hidden)
            f.linear(f"{p}.shared_head.head.weight", d.vocab, d.hidden)
    if not full:
        f.norm(f"{prefix}.norm.weight", d.hidden)


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


def _kimi_k3(f: _TensorFactory, layers: int, mtp: int, d: TinyDims, full: bool) -> dict[str, Any]:
    """Kimi-Linear text model: KDA layers except every 4th (and the last), which are MLA."""
    mla = sorted({i for i in range(4, layers + 1, 4)} | {layers})
    kda = [i for i in range(1, layers + 1) if i not in mla]
    prefix = "language_model.model"
    if not full:
        f.linear(f"{prefix}.embed_tokens.weight", d.vocab, d.hidden)
    for i in range(layers + mtp):
        p = f"{prefix}.layers.{i}"
        if (i + 1) in kda:
            if full:
                continue
            for proj in ("q_proj", "k_proj", "v_proj", "g_a_proj", "f_a_proj"):
                f.linear(f"{p}.self_attn.{proj}.weight", d.heads * d.v_head if proj[0] in "qkv" else d.v_head, d.hidden)
            f.linear(f"{p}.self_attn.b_proj.weight", d.heads, d.hidden)
            f.linear(f"{p}.self_attn.o_proj.weight", d.hidden, d.heads * d.v_head)
            f.raw(f"{p}.self_attn.A_log", torch.zeros(1, 1, d.heads, 1, dtype=torch.float32))
            f.raw(f"{p}.self_attn.dt_bias", torch.zeros(d.heads * d.v_head, dtype=torch.float32))
        else:
            _mla_attention(f, p, d, full, output_gate=True)
        if full:
            continue
        f.norm(f"{p}.input_layernorm.weight", d.hidden)
        f.norm(f"{p}.post_attention_layernorm.weight", d.hidden)
        f.linear(f"{p}.block_sparse_moe.gate.weight", d.experts, d.hidden)
        for e in range(d.experts):  # MXFP4: two fp4 values per byte, one e8m0 scale per 32 values
            for w, (rows, cols) in (("w1", (d.moe_intermediate, d.hidden)), ("w3", (d.moe_intermediate, d.hidden)),
                                    ("w2", (d.hidden, d.moe_intermediate))):  # fmt: skip
                base = f"{p}.block_sparse_moe.experts.{e}.{w}"
                f.raw(f"{base}.weight_packed", torch.randint(0, 256, (rows, cols // 2), generator=f.generator, dtype=torch.uint8))
                f.raw(f"{base}.weight_scale", torch.full((rows, cols // 32), 127, dtype=torch.uint8))
    if not full:
        f.norm(f"{prefix}.norm.weight", d.hidden)
        f.linear("language_model.lm_head.weight", d.vocab, d.hidden)
    return {
        "architectures": ["KimiK3ForConditionalGeneration"], "model_type": "kimi_k3",
        "text_config": {
            "architectures": ["KimiLinearForCausalLM"], "model_type": "kimi_linear",
            "vocab_size": d.vocab, "hidden_size": d.hidden, "num_hidden_layers": layers,
            "num_nextn_predict_layers": mtp, "num_attention_heads": d.heads,
            "q_lora_rank": d.q_lora, "kv_lora_rank": d.kv_lora, "qk_nope_head_dim": d.nope,
            "qk_rope_head_dim": d.rope, "v_head_dim": d.v_head, "mla_use_nope": True,
            "mla_use_output_gate": True, "num_experts": d.experts, "moe_intermediate_size": d.moe_intermediate,
            "linear_attn_config": {"kda_layers": kda, "full_attn_layers": mla, "head_dim": d.v_head, "num_heads": d.heads},
            "torch_dtype": "bfloat16",
        },
        "quantization_config": {
            "quant_method": "compressed-tensors", "format": "mxfp4-pack-quantized",
            "ignore": ["re:.*self_attn.*", "re:.*lm_head", "re:.*block_sparse_moe.gate$"],
        },
    }  # fmt: skip


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
) -> Path:
    """Write a synthetic checkpoint of ``family`` to ``out_dir`` and return it."""
    if family not in FAMILIES:
        raise ValueError(f"unknown family {family!r}; choose one of {', '.join(FAMILIES)}")
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    dims = FULL_K3_DIMS if full_geometry else TinyDims()
    factory = _TensorFactory(seed, dtype)
    if family == "kimi_k3":
        layers = 6 if layers is None else layers
        mtp_layers = 1 if mtp_layers is None else mtp_layers
        config = _kimi_k3(factory, layers, mtp_layers, dims, full_geometry)
        first_mla = next(n for n in factory.tensors if n.endswith("q_b_proj.weight"))
    else:
        layers = 2 if layers is None else layers
        mtp_layers = 0 if mtp_layers is None else mtp_layers
        text = _deepseek_text_config(dims, layers, mtp_layers)
        text["torch_dtype"] = str(dtype).removeprefix("torch.")
        prefix = "model" if family.startswith("deepseek") else "language_model.model"
        _deepseek_decoder(factory, prefix, layers, mtp_layers, dims, full_geometry)
        if not full_geometry:
            factory.linear("lm_head.weight" if prefix == "model" else "language_model.lm_head.weight", dims.vocab, dims.hidden)
        first_mla = f"{prefix}.layers.0.self_attn.q_b_proj.weight"
        if family == "deepseek_v3_fp8":
            _quantize_fp8(factory)
            text["quantization_config"] = {"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                                           "weight_block_size": [_FP8_BLOCK, _FP8_BLOCK]}  # fmt: skip
        if family == "kimi_k25":
            factory.linear("vision_tower.patch_embed.proj.weight", 64, 3 * 14 * 14)
            factory.linear("mm_projector.proj.0.weight", dims.hidden, 64)
            config = {"architectures": ["KimiK25ForConditionalGeneration"], "model_type": "kimi_k25",
                      "text_config": text, "vision_config": {"hidden_size": 64, "patch_size": 14}}  # fmt: skip
        else:
            config = text
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    _write_shards(out_dir, factory.tensors, shards, first_mla)
    if family.startswith("deepseek") and not full_geometry:
        write_tokenizer(out_dir)
    return out_dir
