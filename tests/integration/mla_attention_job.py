"""One MLA layer of a converted directory through real batches: ``python mla_attention_job.py IN OUT``.

Test fixture (``test_routed_attention.py``). A process of its own: vLLM's distributed state and the
plugin's custom op stay out of pytest, and Kimi-K3's MLA needs the CPU kernel substitutes of
``tests/e2e/k3_cpu_kernels.py`` in ``torch.ops._C`` (installed before the first vllm import), which
neither pytest nor a DeepSeek-V3 layer must get. IN (safetensors) holds every token's ``q_c``,
``kv_c_normed`` and ``k_pe``, and in its metadata the converted ``model`` directory, its ``family``
and the ``steps`` (JSON: per batch, ``[request, new tokens]`` pairs). The job builds the layer on
that directory (weights loaded and post-processed by vLLM's own loader helpers, a KV cache each),
builds each batch's attention metadata with the CPU_MLA backend's own builder, runs the layer inside
a real forward context and writes each output to OUT as ``{name}.{step}``:

- ``kimi_k3``: vLLM's ``MultiHeadLatentAttention`` (``stock``: its ``_attention``) and
  :class:`FoldedKimiK3MLA` (``folded``: its ``_routed_attention``);
- ``deepseek_v3``: vLLM's ``DeepseekV2MLAAttention``, whose generic MLA wrapper the plugin replaced
  with :class:`FoldedMLAWrapper` (``folded``: the routed op, called as the wrapper calls it).

Request r's token at position p is input row r * BLOCK + p and lives in cache block r; decode rows
come first, as vLLM's reorder puts them. A request's first batch is its prefill, also when its
prompt is one token: vLLM sends such a row down the prefill path where short extends are prefills
(``treat_short_extends_as_decodes=False``, the builder's split under prefill context parallelism) or
where decode queries must be uniform and longer (MTP drafts on FlashMLA or Triton MLA, GPU only).
CPU_MLA's decode kernel takes one query token per request, so the builder gets the first split by
its own switch (``use_pcp``, which nothing else in its ``build`` reads). The routing counters land
in ``$FOLDCKPT_STATS_FILE``.
"""

from __future__ import annotations

import json
import sys
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))
import k3_cpu_kernels
import torch
from k3_mla import mla_dims
from safetensors import safe_open
from safetensors.torch import save_file

KIMI_K3 = "kimi_k3"
if __name__ == "__main__":
    with safe_open(sys.argv[1], "pt") as _handle:
        if _handle.metadata()["family"] == KIMI_K3:
            k3_cpu_kernels.install()  # before vLLM's first import

from vllm.config import VllmConfig, set_current_vllm_config
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment
from vllm.engine.arg_utils import EngineArgs
from vllm.forward_context import set_forward_context
from vllm.model_executor.model_loader.utils import process_weights_after_loading
from vllm.v1.attention.backend import CommonAttentionMetadata

from foldckpt.io.safetensors_format import read_header

# The manifest's first MLA layer of each family (it counts the steps), as the checkpoint names it.
LAYERS = {KIMI_K3: "language_model.model.layers.0.self_attn", "deepseek_v3": "model.layers.0.self_attn"}
STOCK = "stock.layers.0.self_attn"
BLOCK = 16
CACHE_BLOCKS = 8

# (positions, q_c, kv_c_normed, k_pe [T, R]) -> the attention output [T, H*V], in a forward context.
Run = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor], torch.Tensor]


@dataclass
class Built:
    """A family's layers: what holds the weights, what runs, and the attention layers by name."""

    modules: torch.nn.Module
    runs: dict[str, Run]
    attention: dict[str, torch.nn.Module]


def _nan_output(rows: int, module: torch.nn.Module) -> torch.Tensor:
    """An output buffer of NaN: a row the path leaves unwritten stays NaN."""
    return torch.full((rows, module.num_local_heads * module.v_head_dim), float("nan"))


def _kimi_k3(config: VllmConfig) -> Built:
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

    from foldckpt.runtime.kimi_k3.nvidia import FoldedKimiK3MLA

    text = config.model_config.hf_text_config
    kwargs = dict(**mla_dims(text), use_output_gate=bool(text.mla_use_output_gate), cache_config=config.cache_config)
    stock = MultiHeadLatentAttention(**kwargs, prefix=STOCK)
    folded = FoldedKimiK3MLA(**kwargs, prefix=LAYERS[KIMI_K3])
    assert folded.fold is not None, "the layer was not folded"

    def run_stock(positions: torch.Tensor, q_c: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        out = _nan_output(len(q_c), stock)
        q = stock.q_b_proj(q_c)[0].view(-1, stock.num_local_heads, stock.qk_head_dim)
        stock._attention(positions, q, kv_c, k_pe.unsqueeze(1), out)
        return out

    def run_folded(positions: torch.Tensor, q_c: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        out = _nan_output(len(q_c), folded)
        folded._routed_attention(positions, q_c, kv_c, k_pe.unsqueeze(1), out)
        return out

    modules = torch.nn.ModuleDict({"stock": stock, "folded": folded})
    return Built(modules, {"stock": run_stock, "folded": run_folded}, {STOCK: stock, LAYERS[KIMI_K3]: folded})


def _deepseek_v3(config: VllmConfig) -> Built:
    from vllm.model_executor.models.deepseek_v2 import DeepseekV2MLAAttention

    from foldckpt.runtime.mla_fold import FoldedMLAWrapper

    text = config.model_config.hf_text_config
    layer = DeepseekV2MLAAttention(
        vllm_config=config,
        **mla_dims(text),
        max_position_embeddings=text.max_position_embeddings,
        cache_config=config.cache_config,
        prefix=LAYERS["deepseek_v3"],
    )
    wrapper = layer.mla_attn
    assert isinstance(wrapper, FoldedMLAWrapper) and wrapper.fold is not None, "the layer was not folded"

    def run_folded(positions: torch.Tensor, q_c: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor) -> torch.Tensor:
        return wrapper._call_op(q_c, positions, kv_c, k_pe.unsqueeze(1), len(q_c), None)  # as its forward does

    return Built(layer, {"folded": run_folded}, {wrapper.mla_attn.layer_name: wrapper.mla_attn})


FAMILIES: dict[str, Callable[[VllmConfig], Built]] = {KIMI_K3: _kimi_k3, "deepseek_v3": _deepseek_v3}


def _load(module: torch.nn.Module, model: Path, layer: str) -> None:
    """The checkpoint's q_b_proj and kv_b_proj of ``layer`` into every such projection of ``module``,
    through each parameter's weight_loader."""
    tensors = {}
    for shard in sorted(model.glob("model-*.safetensors")):
        names = read_header(shard).tensors
        with safe_open(shard, "pt") as handle:
            tensors |= {n: handle.get_tensor(n) for n in names if n.startswith(layer) and "_b_proj" in n}
    for name, param in module.named_parameters():
        proj = name.split(".")[-2]
        if proj in ("q_b_proj", "kv_b_proj"):
            param.weight_loader(param, tensors[f"{layer}.{proj}.weight"])


def _metadata(builder: Any, batch: list[list[int]], done: list[int]) -> tuple[Any, torch.Tensor, torch.Tensor]:
    """The attention metadata of one batch, with its positions and input rows (= cache slots)."""
    new = [(request, p) for request, count in batch for p in range(done[request], done[request] + count)]
    positions = torch.tensor([p for _, p in new])
    rows = torch.tensor([request * BLOCK + p for request, p in new])
    query_lens = [count for _, count in batch]
    seq_lens = [done[request] + count for request, count in batch]
    start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
    common = CommonAttentionMetadata(
        query_start_loc=start,
        query_start_loc_cpu=start,
        seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
        num_reqs=len(batch),
        num_actual_tokens=len(rows),
        max_query_len=max(query_lens),
        max_seq_len=max(seq_lens),
        block_table_tensor=torch.tensor([[request] for request, _ in batch], dtype=torch.int32),
        slot_mapping=rows.to(torch.int64),
        seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
        is_prefilling=torch.tensor([done[request] == 0 for request, _ in batch]),
    )
    return builder.build(common_prefix_len=0, common_attn_metadata=common), positions, rows


def main(inputs_path: Path, out_path: Path) -> None:
    with safe_open(inputs_path, "pt") as handle:
        meta = handle.metadata()
        inputs = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    model, family, steps = Path(meta["model"]), meta["family"], json.loads(meta["steps"])
    args = EngineArgs(
        model=str(model),
        dtype="float32",
        enforce_eager=True,
        max_model_len=256,
        enable_prefix_caching=False,
        language_model_only=True,
        skip_tokenizer_init=True,
        attention_backend="CPU_MLA",
    )
    config = args.create_engine_config()
    init_distributed_environment(
        world_size=1, rank=0, local_rank=0, backend="gloo", distributed_init_method=f"file://{out_path}.dist"
    )
    torch.set_default_dtype(torch.float32)
    with set_current_vllm_config(config):
        ensure_model_parallel_initialized(1, 1)
        built = FAMILIES[family](config)
        _load(built.modules, model, LAYERS[family])
        process_weights_after_loading(built.modules, config.model_config, torch.device("cpu"))
        for layer in built.attention.values():
            layer.kv_cache = torch.zeros(CACHE_BLOCKS, BLOCK, layer.head_size)
        first = next(iter(built.attention.values()))
        builder_cls = first.attn_backend.get_builder_cls()
        builder = builder_cls(first.get_kv_cache_spec(config), list(built.attention), config, torch.device("cpu"))
        builder.use_pcp = True  # a one-token prompt is a prefill (the module docstring says why)

        outputs, done = {}, [0] * CACHE_BLOCKS
        for step, batch in enumerate(steps):
            metadata, positions, rows = _metadata(builder, batch, done)
            q_c, kv_c, k_pe = (inputs[name][rows] for name in ("q_c", "kv_c_normed", "k_pe"))
            slots = rows.to(torch.int64)
            with set_forward_context(
                dict.fromkeys(built.attention, metadata),
                config,
                num_tokens=len(rows),
                slot_mapping=dict.fromkeys(built.attention, slots),
            ):
                for name, run in built.runs.items():
                    outputs[f"{name}.{step}"] = run(positions, q_c, kv_c, k_pe)
            for request, count in batch:
                done[request] += count
    save_file(outputs, str(out_path))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
