"""Decode gain of the fold in a real vLLM engine on one GPU: stock vs bf16 fold vs fp8 fold.

    python scripts/bench_engine.py --out docs/bench/engine_<gpu>.json [--models k3,ds] [--quick]

Models have the attention geometry of ONE tensor-parallel rank of the real ones, so that a GPU
runs what one GPU of a TP8 deployment runs in its MLA layers:

* Kimi-K3 TP8: 12 heads (96/8), hidden 7168, q_lora 1536, kv_lora 512, rope slot 64, NoPE, output
  gate; every layer MLA (``all_mla``);
* DeepSeek-V3 TP8: 16 heads (128/8), hidden 7168, q_lora 1536, kv_lora 512, RoPE (YaRN).

Reduced, and why it leaves the attention side as it is: a few layers instead of 61 / 93 (the fold
changes each MLA layer by itself, so the saving is per layer and scales with the count); the MoE
to 4 bf16 experts of width 512 (K3) / 256 (DeepSeek-V3) with a 320-token vocabulary (the fold
touches neither; they only set the non-attention part of the step, which is reported apart:
saving per layer and step, not only the end-to-end ratio). Hidden 7168 is kept: q_a/kv_a/o_proj
and the KV cache are what the attention reads around the query projection.

Each engine is its own process (vLLM loads plugins once per process): vLLM's default CUDA graphs
(+ torch.compile for DeepSeek-V3; breakable graphs for Kimi-K3), greedy, ``ignore_eos``. At each
concurrency c, c requests of fixed input/output length start together (what a serving benchmark
at concurrency c with fixed lengths runs in steady state), twice; per request the engine's own
timestamps give TTFT and TPOT ((last - first token) / (out - 1)); output tok/s is c * out / wall.
TPOT at c = 1 is the decode step time of a replayed CUDA graph plus the scheduler's overhead.

Saving per MLA layer and step = (stock TPOT - fold TPOT) / layers. Projection to a full model
(24 MLA layers of Kimi-K3, 61 of DeepSeek-V3): saving x layers, set against a full-model step
estimated as this step scaled by layers (an upper bound on the relative gain: a full model's MoE,
embedding and lm_head make its step longer than layers x this step).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import time
from dataclasses import replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

FULL_MLA_LAYERS = {"k3": 24, "ds": 61}
LAYERS = 4
INPUT_LEN, OUTPUT_LEN = 256, 128  # the seed's 1024/1024 scaled down to fit one device call
CONCURRENCY = (1, 4, 14, 28)
ROUNDS = 2
VARIANTS = ("stock", "bf16", "fp8")


def _dims(family: str) -> Any:
    from foldckpt.model.synthetic import FULL_K3_DIMS

    if family == "k3":
        return replace(FULL_K3_DIMS, heads=12, experts=4, vocab=320)
    return replace(FULL_K3_DIMS, heads=16, experts=4, vocab=320, intermediate=2048, moe_intermediate=256)


def build(family: str, root: Path) -> dict[str, Path]:
    """The checkpoint and its bf16 and fp8 conversions."""
    from foldckpt.convert import ConvertOptions, convert
    from foldckpt.model.synthetic import make_checkpoint

    if family == "k3":
        source = make_checkpoint(
            root / "k3", "kimi_k3", layers=LAYERS, mtp_layers=0, all_mla=True, bf16_experts=True, dims=_dims(family)
        )
    else:
        source = make_checkpoint(root / "ds", "deepseek_v3", layers=LAYERS, dims=_dims(family))
    dirs = {"stock": source}
    for variant, fold in (("bf16", "bfloat16"), ("fp8", "fp8")):
        out = source.with_name(f"{source.name}-{variant}")
        dirs[variant] = convert(source, out, ConvertOptions(fold_dtype=fold, progress=False)).out_dir
    return dirs


def job(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine (in this process): every concurrency level, ROUNDS times each."""
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    options = {"language_model_only": True} if spec["family"] == "k3" else {}
    llm = LLM(
        model=spec["model"],
        dtype="bfloat16",
        max_model_len=INPUT_LEN + OUTPUT_LEN + 16,
        seed=0,
        max_num_seqs=max(CONCURRENCY),
        gpu_memory_utilization=0.6,
        disable_log_stats=False,
        enable_prefix_caching=False,
        compilation_config={"cudagraph_capture_sizes": sorted({1, 2, 4, 8, 16, 32, *CONCURRENCY})},
        **options,
    )
    ready = time.monotonic()
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    warm = [{"prompt_token_ids": [(3 * j) % 251 for j in range(INPUT_LEN)]}]
    llm.generate(warm * 4, params, use_tqdm=False)
    levels = []
    for c in CONCURRENCY:
        ttft, tpot, rates = [], [], []
        for r in range(ROUNDS):
            prompts = [{"prompt_token_ids": [(7 * i + 13 * j + r) % 251 for j in range(INPUT_LEN)]} for i in range(c)]
            t0 = time.monotonic()
            outs = llm.generate(prompts, params, use_tqdm=False)
            wall = time.monotonic() - t0
            rates.append(c * OUTPUT_LEN / wall)
            for out in outs:
                m = out.metrics
                ttft.append(m.first_token_latency)
                tpot.append((m.last_token_ts - m.first_token_ts) / (m.num_generation_tokens - 1))
        levels.append(
            {
                "concurrency": c,
                "output_tok_s": statistics.mean(rates),
                "tpot_ms": {
                    "mean": 1e3 * statistics.mean(tpot),
                    "p50": 1e3 * statistics.median(tpot),
                    "p99": 1e3 * sorted(tpot)[round(0.99 * (len(tpot) - 1))],
                },
                "ttft_ms": {"mean": 1e3 * statistics.mean(ttft), "p50": 1e3 * statistics.median(ttft)},
            }
        )
    return {"startup_s": ready - started, "levels": levels}


def run_variant(family: str, variant: str, model: Path, workdir: Path, log_dir: Path) -> dict[str, Any]:
    """One engine in a subprocess; stock runs without the plugin (vLLM alone on the path)."""
    spec_path, out_path = workdir / f"{family}-{variant}.spec.json", workdir / f"{family}-{variant}.out.json"
    spec_path.write_text(json.dumps({"family": family, "model": str(model)}))
    env = {k: v for k, v in os.environ.items() if not k.startswith("FOLDCKPT_")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CACHE_ROOT=str(workdir / f"{family}-{variant}.cache"))
    if variant == "stock":
        env["VLLM_PLUGINS"] = ""
        env["PYTHONPATH"] = os.environ.get("VLLM_STOCK_PATH", env.get("PYTHONPATH", ""))
    proc = subprocess.run(
        [sys.executable, __file__, "--job", str(spec_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=600,
    )
    log = proc.stdout + proc.stderr
    (log_dir / f"bench-{family}-{variant}.log").write_text(log)
    if proc.returncode != 0:
        return {"error": log.strip().splitlines()[-1] if log.strip() else f"exit {proc.returncode}"}
    result = json.loads(out_path.read_text())
    result["fold_log"] = next((line for line in log.splitlines() if "foldckpt: folded" in line), None)
    return result


def summarize(family: str, runs: dict[str, dict[str, Any]]) -> dict[str, Any]:
    """Per fold variant and concurrency: the gain, the saving per MLA layer and step, the projection."""
    stock = runs.get("stock", {})
    out: dict[str, Any] = {}
    for variant in VARIANTS[1:]:
        fold = runs.get(variant, {})
        if "levels" not in stock or "levels" not in fold:
            continue
        rows = []
        for s, f in zip(stock["levels"], fold["levels"], strict=True):
            saving_ms = s["tpot_ms"]["mean"] - f["tpot_ms"]["mean"]
            per_layer_us = 1e3 * saving_ms / LAYERS
            full = FULL_MLA_LAYERS[family]
            rows.append(
                {
                    "concurrency": s["concurrency"],
                    "throughput_gain_pct": 100 * (f["output_tok_s"] / s["output_tok_s"] - 1),
                    "tpot_saving_ms": saving_ms,
                    "saving_per_mla_layer_step_us": per_layer_us,
                    "projected_full_model_saving_per_step_us": per_layer_us * full,
                    "projected_full_model_gain_pct_upper": 100 * saving_ms / s["tpot_ms"]["mean"],
                }
            )
        out[variant] = rows
    return out


def main() -> None:
    if sys.argv[1:2] == ["--job"]:
        result = job(json.loads(Path(sys.argv[2]).read_text()))
        Path(sys.argv[3]).write_text(json.dumps(result))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--out", type=Path, required=True)
    parser.add_argument("--models", default="k3,ds")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench_engine"))
    parser.add_argument("--log-dir", type=Path, default=None)
    args = parser.parse_args()
    import torch

    args.workdir.mkdir(parents=True, exist_ok=True)
    log_dir = args.log_dir or args.workdir
    log_dir.mkdir(parents=True, exist_ok=True)
    report: dict[str, Any] = {
        "gpu": torch.cuda.get_device_name(0),
        "torch": torch.__version__,
        "vllm": version("vllm"),
        "method": __doc__,
        "layers": LAYERS,
        "input_len": INPUT_LEN,
        "output_len": OUTPUT_LEN,
        "concurrency": list(CONCURRENCY),
        "rounds": ROUNDS,
        "models": {},
    }
    for family in args.models.split(","):
        dirs = build(family, args.workdir / "models")
        runs: dict[str, Any] = {}
        for variant in VARIANTS:  # written after each engine: a timeout keeps what finished
            runs[variant] = run_variant(family, variant, dirs[variant], args.workdir, log_dir)
            report["models"][family] = {
                "geometry": {k: v for k, v in vars(_dims(family)).items()},
                "runs": runs,
                "summary": summarize(family, runs),
            }
            args.out.write_text(json.dumps(report, indent=1))
            print(
                f"bench {family} {variant}: {json.dumps(runs[variant].get('levels', runs[variant]))[:400]}", flush=True
            )


if __name__ == "__main__":
    main()
