"""Geometry from config.json for every supported family, and the errors for the rest."""

from __future__ import annotations

import copy
import json
from typing import Any

import pytest

from foldckpt.errors import FoldckptError
from foldckpt.format.manifest import Manifest, manifest_bytes
from foldckpt.model.geometry import geometry_from_config

DEEPSEEK_V3: dict[str, Any] = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "num_attention_heads": 128,
    "q_lora_rank": 1536,
    "kv_lora_rank": 512,
    "qk_nope_head_dim": 128,
    "qk_rope_head_dim": 64,
    "v_head_dim": 128,
    "num_hidden_layers": 61,
    "num_nextn_predict_layers": 1,
    "quantization_config": {"quant_method": "fp8", "weight_block_size": [128, 128]},
}
KIMI_K3: dict[str, Any] = {
    "architectures": ["KimiK3ForConditionalGeneration"],
    "text_config": {
        "num_attention_heads": 96,
        "q_lora_rank": 1536,
        "kv_lora_rank": 512,
        "qk_nope_head_dim": 128,
        "qk_rope_head_dim": 64,
        "v_head_dim": 128,
        "num_hidden_layers": 93,
        "mla_use_nope": True,
        "num_nextn_predict_layers": 0,
        "linear_attn_config": {
            "kda_layers": [i for i in range(1, 94) if i % 4 and i != 93],
            "full_attn_layers": [*range(4, 93, 4), 93],
        },
    },
}


def test_deepseek_v3_every_layer_and_the_mtp_layer() -> None:
    g = geometry_from_config(DEEPSEEK_V3)
    assert g.family == "deepseek" and g.num_heads == 128 and g.uses_rope
    assert [layer.index for layer in g.layers] == list(range(62))
    assert g.layers[-1].is_mtp and g.layers[-1].prefix == "model.layers.61"
    assert g.layers[7].q_b_proj == "model.layers.7.self_attn.q_b_proj.weight"
    assert g.layers[7].q_fold == "model.layers.7.self_attn.q_fold.weight"
    assert g.fold_shape == (128 * 576, 1536) and g.weight_block_size == (128, 128)


def test_kimi_k3_mla_layers_are_the_non_kda_layers_one_indexed() -> None:
    g = geometry_from_config(KIMI_K3)
    assert g.family == "kimi_k3" and not g.uses_rope
    # full_attn_layers are 1-based [4, 8, ..., 92, 93] -> 0-based indices 3, 7, ..., 91, 92.
    assert [layer.index for layer in g.layers] == [*range(3, 92, 4), 92]
    assert len(g.layers) == 24
    assert g.layers[0].prefix == "language_model.model.layers.3"
    assert g.fold_shape == (96 * 576, 1536)
    assert g.valid_tp_sizes() == (1, 2, 4, 8, 16)
    assert g.rank_rows(8, 1) == (12 * 576, 24 * 576)


def test_kimi_k25_uses_the_language_model_prefix() -> None:
    config = {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "text_config": {**DEEPSEEK_V3, "num_nextn_predict_layers": 0},
    }
    g = geometry_from_config(config)
    assert g.family == "kimi_k25" and g.layers[0].prefix == "language_model.model.layers.0"


def test_geometry_round_trips_through_the_manifest() -> None:
    g = geometry_from_config(KIMI_K3)
    parameters = {"fold_dtype": "bfloat16", "accumulation_dtype": "exact", "max_shard_size": 1, "run_key": "k"}
    manifest = Manifest(g, "bfloat16", "exact", {}, {}, {}, parameters)
    assert Manifest.from_dict(json.loads(manifest_bytes(manifest))).geometry == g


@pytest.mark.parametrize(
    ("edit", "message"),
    [
        (lambda c: c.update(architectures=["LlamaForCausalLM"]), "unsupported architecture"),
        (lambda c: c.update(q_lora_rank=None), "q_lora_rank is not set"),
        (lambda c: c.update(num_attention_heads=0), "num_attention_heads"),
        (lambda c: c.update(kv_lora_rank="512"), "kv_lora_rank"),
        (lambda c: c.update(num_nextn_predict_layers=-1), "num_nextn_predict_layers"),
        # a damaged count is refused before anything is built per layer (10**30 overflowed range())
        (
            lambda c: c.update(num_hidden_layers=10**30),
            "'num_hidden_layers' is 1000000000000000000000000000000, more than the 10000",
        ),
        (lambda c: c.update(num_nextn_predict_layers=10_001), "'num_nextn_predict_layers' is 10001"),
        # a given fp8 block size must be usable: it was replaced by 128x128 without a word
        *[
            (
                lambda c, block=block: c["quantization_config"].update(weight_block_size=block),
                r"'quantization_config.weight_block_size' must be two positive integers",
            )
            for block in ([0, 128], [-128, -128], [128], "128", [128.0, 128], [True, 128], [128, 128, 128])
        ],
    ],
)
def test_bad_deepseek_configs_are_refused(edit: Any, message: str) -> None:
    config = copy.deepcopy(DEEPSEEK_V3)
    edit(config)
    with pytest.raises(FoldckptError, match=message):
        geometry_from_config(config)


def test_kimi_k3_with_only_kda_layers_has_nothing_to_fold() -> None:
    config = copy.deepcopy(KIMI_K3)
    config["text_config"]["linear_attn_config"]["kda_layers"] = list(range(1, 94))
    with pytest.raises(FoldckptError, match="no MLA layer"):
        geometry_from_config(config)


def test_kimi_k3_kda_layers_out_of_range_are_refused() -> None:
    config = copy.deepcopy(KIMI_K3)
    config["text_config"]["linear_attn_config"]["kda_layers"] = [0, 1]
    with pytest.raises(FoldckptError, match="1-based"):
        geometry_from_config(config)


def test_kimi_k3_block_size_is_checked_where_it_is_given() -> None:
    """Kimi-K3 keeps quantization_config beside text_config: a bad block size there is refused
    without naming text_config, and a good one is read (the fold dequantizes with it)."""
    config = copy.deepcopy(KIMI_K3)
    config["quantization_config"] = {"quant_method": "fp8", "weight_block_size": [64, 64]}
    assert geometry_from_config(config).weight_block_size == (64, 64)
    config["quantization_config"]["weight_block_size"] = [64, 0]
    with pytest.raises(FoldckptError, match=r"config.json: 'quantization_config.weight_block_size' must be") as info:
        geometry_from_config(config)
    assert "text_config" not in str(info.value)


def test_every_divisor_of_the_heads_is_a_tp_size_and_verify_names_each_rank_a_bad_head_hits() -> None:
    """TP 3 and 6 serve a 6-head model as TP 2 does: verify's "rank slices affected" listed only
    1, 2, 4, 8 and 16, so an operator on TP 3 was told nothing about their rank."""
    from types import SimpleNamespace

    from foldckpt.verify import _ranks_affected

    config = copy.deepcopy(DEEPSEEK_V3)
    config["num_attention_heads"] = 6
    geometry = geometry_from_config(config)
    assert geometry.tp_sizes() == (1, 2, 3, 6)
    assert geometry_from_config(KIMI_K3).tp_sizes() == (1, 2, 3, 4, 6, 8, 12, 16, 24, 32, 48, 96)
    assert _ranks_affected(SimpleNamespace(geometry=geometry), [4]) == "0/1, 1/2, 2/3, 4/6"  # type: ignore[arg-type]
