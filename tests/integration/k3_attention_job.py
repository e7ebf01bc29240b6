"""One Kimi-K3 MLA layer, stock and folded, through three real batches: ``python k3_attention_job.py IN OUT``.

Test fixture (``test_k3_routed_attention.py``). A process of its own: Kimi-K3's MLA needs the CPU
kernel substitutes of ``tests/e2e/k3_cpu_kernels.py`` in ``torch.ops._C`` (installed before the first
vllm import), which the pytest process must not get. IN (safetensors) holds every token's
``q_c``, ``kv_c_normed`` and ``k_pe`` and a ``model`` path in its metadata; the job builds vLLM's
``MultiHeadLatentAttention`` and :class:`FoldedKimiK3MLA` on that converted directory (weights
loaded and post-processed by vLLM's own loader helpers, a KV cache each), builds each batch's
attention metadata with the CPU_MLA backend's own builder, calls ``_attention`` (stock) and
``_routed_attention`` (folded) inside a real forward context, and writes both outputs to OUT.
The routing counters land in ``$FOLDCKPT_STATS_FILE``.
"""

from __future__ import annotations

import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "e2e"))
import k3_cpu_kernels  # noqa: E402
from k3_mla import mla_dims  # noqa: E402

k3_cpu_kernels.install()

import torch  # noqa: E402
from safetensors import safe_open  # noqa: E402
from safetensors.torch import save_file  # noqa: E402
from vllm.config import set_current_vllm_config  # noqa: E402
from vllm.distributed import ensure_model_parallel_initialized, init_distributed_environment  # noqa: E402
from vllm.engine.arg_utils import EngineArgs  # noqa: E402
from vllm.forward_context import set_forward_context  # noqa: E402
from vllm.model_executor.model_loader.utils import process_weights_after_loading  # noqa: E402
from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention  # noqa: E402
from vllm.v1.attention.backend import CommonAttentionMetadata  # noqa: E402

from foldckpt.io.safetensors_format import read_header  # noqa: E402
from foldckpt.runtime.kimi_k3.nvidia import FoldedKimiK3MLA  # noqa: E402

LAYER = "language_model.model.layers.0.self_attn"  # the manifest's first MLA layer: it counts the steps
STOCK = "stock.layers.0.self_attn"
BLOCK = 16
# (request, new tokens) per step: two prefills; two decodes beside a third request's prefill (the
# pre-route splits it); three decodes. Decode rows come first, as vLLM's reorder puts them.
STEPS = [[(0, 5), (1, 7)], [(0, 1), (1, 1), (2, 6)], [(0, 1), (1, 1), (2, 1)]]


def _load(modules: torch.nn.ModuleDict, model: Path) -> None:
    """q_b_proj and kv_b_proj of layer 0 into both modules, through each parameter's weight_loader."""
    tensors = {}
    for shard in sorted(model.glob("model-*.safetensors")):
        names = read_header(shard).tensors
        with safe_open(shard, "pt") as handle:
            tensors |= {n: handle.get_tensor(n) for n in names if n.startswith(LAYER) and "_b_proj" in n}
    for module in modules.values():
        for proj in ("q_b_proj", "kv_b_proj"):
            param = getattr(module, proj).weight
            param.weight_loader(param, tensors[f"{LAYER}.{proj}.weight"])


def main(inputs_path: Path, out_path: Path) -> None:
    with safe_open(inputs_path, "pt") as handle:
        model = Path(handle.metadata()["model"])
        inputs = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
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
    text = config.model_config.hf_text_config
    with set_current_vllm_config(config):
        ensure_model_parallel_initialized(1, 1)
        kwargs = dict(
            **mla_dims(text), use_output_gate=bool(text.mla_use_output_gate), cache_config=config.cache_config
        )
        modules = torch.nn.ModuleDict(
            {
                "stock": MultiHeadLatentAttention(**kwargs, prefix=STOCK),
                "folded": FoldedKimiK3MLA(**kwargs, prefix=LAYER),
            }
        )
        assert modules["folded"].fold is not None, "the layer was not folded"
        _load(modules, model)
        process_weights_after_loading(modules, config.model_config, torch.device("cpu"))
        for module in modules.values():
            module.kv_cache = torch.zeros(8, BLOCK, module.head_size)
        spec = modules["stock"].get_kv_cache_spec(config)
        builder = modules["stock"].attn_backend.get_builder_cls()(spec, [STOCK, LAYER], config, torch.device("cpu"))

        outputs, done = {}, [0, 0, 0]
        for step, batch in enumerate(STEPS):
            # Request r's token at position p is input row r * BLOCK + p and lives in cache block r.
            new = [(request, p) for request, count in batch for p in range(done[request], done[request] + count)]
            positions = torch.tensor([p for _, p in new])
            rows = torch.tensor([request * BLOCK + p for request, p in new])
            query_lens = [count for _, count in batch]
            seq_lens = [done[request] + count for request, count in batch]
            start = torch.tensor([0, *torch.tensor(query_lens).cumsum(0).tolist()], dtype=torch.int32)
            block_table = torch.tensor([[request] for request, _ in batch], dtype=torch.int32)
            slots = rows.to(torch.int64)
            common = CommonAttentionMetadata(
                query_start_loc=start,
                query_start_loc_cpu=start,
                seq_lens=torch.tensor(seq_lens, dtype=torch.int32),
                num_reqs=len(batch),
                num_actual_tokens=len(rows),
                max_query_len=max(query_lens),
                max_seq_len=max(seq_lens),
                block_table_tensor=block_table,
                slot_mapping=slots,
                seq_lens_cpu_upper_bound=torch.tensor(seq_lens, dtype=torch.int32),
            )
            metadata = builder.build(common_prefix_len=0, common_attn_metadata=common)
            q_c, kv_c, k_pe = (inputs[name][rows] for name in ("q_c", "kv_c_normed", "k_pe"))
            with set_forward_context(
                {STOCK: metadata, LAYER: metadata},
                config,
                num_tokens=len(rows),
                slot_mapping={STOCK: slots, LAYER: slots},
            ):
                for name, module in modules.items():
                    out = torch.full((len(rows), module.num_local_heads * module.v_head_dim), float("nan"))
                    if name == "stock":
                        q = module.q_b_proj(q_c)[0].view(-1, module.num_local_heads, module.qk_head_dim)
                        module._attention(positions, q, kv_c, k_pe.unsqueeze(1), out)
                    else:
                        module._routed_attention(positions, q_c, kv_c, k_pe.unsqueeze(1), out)
                    outputs[f"{name}.{step}"] = out
            for request, count in batch:
                done[request] += count
    save_file(outputs, str(out_path))


if __name__ == "__main__":
    main(Path(sys.argv[1]), Path(sys.argv[2]))
