"""The fold's decode gain in a real vLLM engine on one GPU, resolved to microseconds per MLA layer.

    python scripts/bench_engine.py --model k3 --out docs/bench/engine_<gpu>.json   # on the GPU machine
    python scripts/bench_engine.py --model ds --out docs/bench/engine_<gpu>.json   # merges into the same file

One model per run (a run is one device call). Each model is ONE tensor-parallel rank of the real
deployment at its FULL depth, so that a decode step is GPU-bound and a few µs per layer add up to
something an engine can show:

* ``k3``, Kimi-K3 TP8: 93 layers in K3's own hybrid layout, 24 MLA (every 4th and the last) and 69
  KDA layers, which run as stock runs them (the fold touches MLA layers only); 12 MLA heads (96/8),
  hidden 7168, q_lora 1536, kv_lora 512, NoPE with the rope slot, output gate; KDA 12 heads of 128.
* ``ds``, DeepSeek-V3 TP8: 61 layers, 3 with a dense MLP (width 2304, 18432/8) and 58 MoE; 16 MLA
  heads (128/8) with RoPE (YaRN).

Reduced, and why the MLA layers are not: the routed experts are 4 (DS) / 2 (K3) bf16 experts of
width 256 (DS) / 512 (K3) with 2 active, beside the shared one, and a 320-token vocabulary; the
weights are random (drawn on the GPU: a K3 rank is 15 GB). The fold changes each MLA layer's query and
nothing else, so the step's non-attention part only sets the denominator; it is reported apart
(saving per MLA layer and step), and the full-model gain is projected from a published full-model
step time, not from this model's step.

Engines, each its own process (vLLM loads plugins once per process), in this order: stock, the
bf16 fold as routed, the fp8 fold as routed, the fp8 fold forced on at every decode batch
(``FOLDCKPT_FOLD_MAX_TOKENS``: the kernel's effect where routing declines it), stock again (the
A/A control: the same GPU work in a second engine; its difference is the noise floor). Every
engine: no torch.compile, decode steps replayed from FULL CUDA graphs (``FULL_DECODE_ONLY``): each
decode step is one graph replay whichever variant runs, and an engine starts in seconds, not
minutes of compilation. At each concurrency c, c requests of fixed lengths start together, for
ROUNDS rounds; per round:

* TPOT: per request (last - first token) / (tokens - 1), from the engine's own timestamps (TTFT
  excluded), the median over the round's requests; the decode rate c * (out - 1) / (last token -
  first first token);
* GPU time per decode step: CUDA events around the model's forward (vLLM's V2 model runner calls its
  KV connector just before and after it) on every step whose batch is the c requests decoding, the
  median over the round's steps. A run is GPU-bound where that is >= 0.8 x TPOT: then the step's
  time is the GPU's, and µs saved on the GPU are µs saved per token.

``--profile`` instead breaks each engine's decode step down by kernel (the torch profiler, which
sees the kernels inside graph replays): stock, the fp8 fold as routed and forced, each kernel's µs
per step beside stock's; where an engine's saving differs from its kernels', this says which
kernels differ (``engine_profile_<gpu>.json``).

Summary per fold variant and concurrency: saving per MLA layer and step = (stock - fold GPU step
time) / MLA layers, the median over the rounds' pairs; beside it the A/A difference and the
per-layer saving of the same kernels in isolation (``scripts/bench_decode.py``'s variants for this
geometry at M = c, timed in the same run); then the projection: saving x the real model's MLA
layers over the published full-model TPOT (``FULL_MODEL_TPOT``).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import statistics
import subprocess
import sys
import time
from dataclasses import asdict, replace
from importlib.metadata import version
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))
sys.path.insert(0, str(REPO / "scripts"))

INPUT_LEN, OUTPUT_LEN = 256, 512
CONCURRENCY = (1, 14, 28)
ROUNDS = 3
# The engine order: interleaved, with the A/A control last so that any drift over the run shows in it.
VARIANTS = ("stock", "bf16", "fp8", "fp8_forced", "stock_aa")
FOLD_VARIANTS = ("bf16", "fp8", "fp8_forced")
GPU_BOUND = 0.8
# --profile: the engines whose decode steps are broken down by kernel, and the steps profiled.
PROFILE_VARIANTS = ("stock", "fp8", "fp8_forced")
PROFILE_STEPS = 64
# The project's own kernels that compute the fold's query (Triton's and the Hopper CUDA kernel).
FOLD_KERNELS = ("_fold_gemm_kernel", "_skinny_gemm_kernel", "_rope_query_kernel", "foldckpt_fp8_fold")

# Per model: layers and MLA layers (the real model's, kept), heads per TP8 rank, RoPE or NoPE, and
# whether its MLA has an output gate (Kimi-K3: vLLM runs its GEMM on a second stream beside the
# query, docs/benchmarks.md).
MODELS: dict[str, dict[str, Any]] = {
    "k3": {"layers": 93, "mla_layers": 24, "heads": 12, "rope": False, "output_gate": True},
    "ds": {"layers": 61, "mla_layers": 61, "heads": 16, "rope": True, "output_gate": False},
}
# The published full-model decode step times the projection divides by, with their sources.
FULL_MODEL_TPOT = REPO / "docs" / "bench" / "full_model_tpot.json"


def dims(model: str) -> Any:
    """The TP8 rank's geometry (``TinyDims``) of ``model``."""
    from foldckpt.model.synthetic import FULL_K3_DIMS

    heads = MODELS[model]["heads"]
    if model == "k3":
        return replace(FULL_K3_DIMS, heads=heads, experts=2, vocab=320, kda_heads=12, kda_head_dim=128)
    return replace(
        FULL_K3_DIMS, heads=heads, experts=4, vocab=320, intermediate=2304, moe_intermediate=256, dense_layers=3
    )


def build(model: str, root: Path) -> dict[str, Path]:
    """The checkpoint and its bf16 and fp8 conversions (the fp8 one serves both fp8 variants)."""
    from foldckpt.convert import ConvertOptions, convert
    from foldckpt.model.synthetic import make_checkpoint

    layers = MODELS[model]["layers"]
    if model == "k3":
        source = make_checkpoint(
            root / "k3", "kimi_k3", layers=layers, mtp_layers=0, bf16_experts=True, dims=dims(model)
        )
    else:
        source = make_checkpoint(root / "ds", "deepseek_v3", layers=layers, mtp_layers=0, dims=dims(model))
    dirs = {"stock": source, "stock_aa": source}
    for variant, fold in (("bf16", "bfloat16"), ("fp8", "fp8")):
        out = source.with_name(f"{source.name}-{variant}")
        dirs[variant] = convert(source, out, ConvertOptions(fold_dtype=fold, progress=False, device="cuda")).out_dir
    dirs["fp8_forced"] = dirs["fp8"]
    return dirs


# ---- inside an engine's process ---------------------------------------------------------------------


class StepTimer:
    """CUDA events around every model forward of the steps measured (``start`` .. ``stop``), with
    the batch each ran: (tokens, requests). Installed on vLLM's V2 model runner's KV connector,
    whose ``pre_forward`` / ``finish_forward`` bracket the forward in eager, piecewise and FULL
    graph steps alike; never during CUDA graph capture."""

    def __init__(self) -> None:
        self.active = False
        self.steps: list[tuple[Any, Any, int, int]] = []
        self._open: tuple[Any, int, int] | None = None

    def install(self) -> None:
        import torch
        from vllm.v1.worker.gpu import kv_connector

        timer, cls = self, kv_connector.KVConnector
        pre, finish = cls.pre_forward, cls.finish_forward

        def pre_forward(self, scheduler_output, input_batch=None, attn_metadata=None):  # noqa: ANN001, ANN202
            if timer.active and input_batch is not None and not torch.cuda.is_current_stream_capturing():
                start = torch.cuda.Event(enable_timing=True)
                start.record()
                timer._open = (start, input_batch.num_tokens, input_batch.num_reqs)
            return pre(self, scheduler_output, input_batch, attn_metadata)

        def finish_forward(self):  # noqa: ANN001, ANN202
            if timer._open is not None:
                end = torch.cuda.Event(enable_timing=True)
                end.record()
                start, tokens, reqs = timer._open
                timer.steps.append((start, end, tokens, reqs))
                timer._open = None
            return finish(self)

        cls.pre_forward, cls.finish_forward = pre_forward, finish_forward

    def start(self) -> None:
        self.steps, self._open, self.active = [], None, True

    def stop(self, requests: int) -> list[float]:
        """µs of each measured step in which all ``requests`` requests decoded one token each."""
        self.active = False
        if self.steps:
            self.steps[-1][1].synchronize()
        return [1e3 * s.elapsed_time(e) for s, e, tokens, reqs in self.steps if reqs == requests == tokens]


def describe_stock_query(model: Any) -> dict[str, Any]:
    """What the served model's q_b_proj runs per decode token count (vLLM's own low-latency plan
    where it installed one), and which MLA query class serves the layers: what stock ran."""
    import torch

    plans, classes = {}, set()
    for name, module in model.named_modules():
        if name.endswith("self_attn") or name.endswith(".attn"):
            classes.add(type(module).__name__)
        if not name.endswith("q_b_proj"):
            continue
        method = module.quant_method
        plan = getattr(method, "_plan", None)
        if plan is None:
            plans[type(method).__name__] = "cuBLAS (F.linear) at every M"
            continue
        try:
            from vllm.model_executor.kernels.linear.cute_dsl.skinny_gemm import shape_dynamic_skinny_gemm

            cute = shape_dynamic_skinny_gemm.is_available()
        except ImportError:
            cute = False
        fused_a = hasattr(torch.ops._C, "dsv3_fused_a_gemm")
        by_m = {}
        for m in range(1, 17):
            backend = plan.get(m, (None, None))[0]
            ran = {"cute": "CuTe DSL" if cute else "cuBLAS (CuTe DSL planned: nvidia-cutlass-dsl missing)"}.get(
                backend, "dsv3_fused_a_gemm" if backend == "dsv3_fused_a" and fused_a else "cuBLAS"
            )
            by_m[m] = ran
        plans[type(method).__name__] = {"M<=16": by_m, "M>16": "cuBLAS"}
    return {"q_b_proj": plans, "attention_modules": sorted(classes)}


def engine_job(spec: dict[str, Any]) -> dict[str, Any]:
    """One engine: every concurrency, ROUNDS rounds each, TPOT and GPU step times."""
    timer = StepTimer()
    timer.install()
    from vllm import LLM, SamplingParams

    started = time.monotonic()
    options = {"language_model_only": True} if spec["model_key"] == "k3" else {}
    capture = sorted({1, 2, 4, 8, 16, 32, *CONCURRENCY})
    llm = LLM(
        model=spec["model"],
        dtype="bfloat16",
        max_model_len=INPUT_LEN + OUTPUT_LEN + 16,
        seed=0,
        max_num_seqs=max(CONCURRENCY),
        gpu_memory_utilization=0.85,
        enable_prefix_caching=False,
        disable_log_stats=False,  # the per-request timestamps (RequestOutput.metrics) need it
        compilation_config={"mode": 0, "cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": capture},
        **options,
    )
    ready = time.monotonic()
    stock_query = llm.apply_model(describe_stock_query)[0]
    params = SamplingParams(temperature=0.0, max_tokens=OUTPUT_LEN, ignore_eos=True)
    warm = SamplingParams(temperature=0.0, max_tokens=32, ignore_eos=True)
    llm.generate([{"prompt_token_ids": [(3 * j) % 251 for j in range(INPUT_LEN)]}] * max(CONCURRENCY), warm)
    if spec.get("profile"):
        profile = [{"concurrency": c, **profile_level(llm, c)} for c in spec["concurrency"]]
        return {"startup_s": ready - started, "profile": profile, "stock_query": stock_query}
    levels = []
    for c in spec["concurrency"]:
        rounds = []
        for r in range(ROUNDS):
            prompts = [
                {"prompt_token_ids": [(7 * i + 13 * j + 31 * r) % 251 for j in range(INPUT_LEN)]} for i in range(c)
            ]
            timer.start()
            outs = llm.generate(prompts, params, use_tqdm=False)
            steps = timer.stop(c)
            metrics = [o.metrics for o in outs]
            tpot = [(m.last_token_ts - m.first_token_ts) / (m.num_generation_tokens - 1) for m in metrics]
            span = max(m.last_token_ts for m in metrics) - min(m.first_token_ts for m in metrics)
            rounds.append(
                {
                    "tpot_ms": 1e3 * statistics.median(tpot),
                    "gpu_step_us": statistics.median(steps) if steps else None,
                    "decode_steps_timed": len(steps),
                    "decode_tok_s": c * (OUTPUT_LEN - 1) / span,
                }
            )
        levels.append({"concurrency": c, "rounds": rounds})
    return {"startup_s": ready - started, "levels": levels, "stock_query": stock_query}


def kernel_times(llm: Any, prompts: list[dict[str, Any]], tokens: int) -> dict[str, list[float]]:
    """[µs of GPU time, launches] per kernel name (memory copies and sets included) while
    ``prompts`` generate ``tokens`` tokens each, from the torch profiler (which sees the kernels
    inside graph replays)."""
    import torch
    from torch.profiler import ProfilerActivity, profile
    from vllm import SamplingParams

    params = SamplingParams(temperature=0.0, max_tokens=tokens, ignore_eos=True)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        llm.generate(prompts, params, use_tqdm=False)
        torch.cuda.synchronize()
    times: dict[str, list[float]] = {}
    for event in prof.events():
        if event.device_type == torch.autograd.DeviceType.CUDA:
            total = times.setdefault(event.name, [0.0, 0])
            total[0] += event.time_range.elapsed_us()
            total[1] += 1
    return times


def profile_level(llm: Any, c: int) -> dict[str, Any]:
    """GPU µs per decode step per kernel at concurrency ``c``: two generations of the same prompts,
    PROFILE_STEPS tokens apart, and their difference over PROFILE_STEPS, so that the prefill (and
    the first decode steps) cancel and what remains is decode steps of all ``c`` requests."""
    prompts = [{"prompt_token_ids": [(7 * i + 13 * j) % 251 for j in range(INPUT_LEN)]} for i in range(c)]
    short = kernel_times(llm, prompts, 8)
    long = kernel_times(llm, prompts, 8 + PROFILE_STEPS)
    per_step = {
        name: [(total - short.get(name, [0.0, 0])[i]) / PROFILE_STEPS for i, total in enumerate(pair)]
        for name, pair in long.items()
    }
    return {
        "steps": PROFILE_STEPS,
        "gpu_us_per_step": sum(us for us, _ in per_step.values()),
        "kernels_us_per_step": {name: us for name, (us, _) in per_step.items()},
        # the kernel durations overlap where kernels launch early (PDL) or run on a second stream
        # (Kimi-K3's output gate, its MoE's down projection), so their sum can exceed the step; per
        # launch, a kernel's time is set beside the microbenchmark's
        "kernels_launches_per_step": {name: launches for name, (_, launches) in per_step.items()},
    }


# ---- the per-layer microbenchmark, in its own process ---------------------------------------------------


def microbench_job(spec: dict[str, Any]) -> dict[str, Any]:
    """Per-layer µs of the decode query as stock runs it and as each fold variant runs it, at M = c,
    for this model's geometry: ``bench_decode``'s variants and timing (CUDA graphs over 16 layer
    copies), so that the engine's per-layer saving has a like-for-like reference."""
    import torch
    from bench_decode import Layers, split_query, vllm_accepts, vllm_q_b_proj

    from foldckpt.runtime.kernels import fold_gemm, fold_query, fold_route, warmup_fold_gemm, warmup_fold_query
    from foldckpt.runtime.kernels.reference import MlaDims, decode_rope, unfolded_query
    from foldckpt.runtime.kernels.timing import layer_order, time_rounds_us
    from foldckpt.runtime.kernels.tuning import FP8_WEIGHT_DTYPE

    device = torch.device("cuda")
    info = MODELS[spec["model_key"]]
    dims_ = MlaDims(info["heads"])
    layers = Layers(dims_, device)
    routes = {
        "bf16": fold_route(dims_, device).max_tokens,
        "fp8": fold_route(dims_, device, FP8_WEIGHT_DTYPE).max_tokens,
        "fp8_forced": 1 << 30,
    }
    warmup_fold_gemm(layers.fold, max(CONCURRENCY))
    warmup_fold_gemm(layers.fp8, max(CONCURRENCY), scale=layers.scale)
    rope_cache = decode_rope(1, dims_, device).cos_sin_cache if info["rope"] else None
    if rope_cache is not None:
        warmup_fold_query(layers.fold, max(CONCURRENCY), rope_cache, dims_.fold_head)
        warmup_fold_query(layers.fp8, max(CONCURRENCY), rope_cache, dims_.fold_head, layers.scale)
    out: dict[str, Any] = {"routes": routes, "levels": []}
    for c in spec["concurrency"]:
        x = torch.randn(c, dims_.q_lora, device=device, dtype=torch.bfloat16)
        rope = decode_rope(c, dims_, device) if info["rope"] else None
        unfolded_rope = replace(rope, head_dim=dims_.nope + dims_.rope) if rope is not None else None
        vllm_plan = not info["rope"] and vllm_accepts(x, layers.qb) and 3 <= c <= 8  # vLLM's SM90 K3 plan
        q = torch.empty(c, layers.qb.shape[0], device=device, dtype=torch.bfloat16)

        def stock(i: int, x=x, q=q, vllm_plan=vllm_plan, unfolded_rope=unfolded_rope):  # noqa: ANN001, ANN202
            if vllm_plan:
                vllm_q_b_proj(q, x, layers.qbs[i])
                return split_query(q, layers.uks[i], dims_)
            return unfolded_query(x, layers.qbs[i], layers.uks[i], dims_, unfolded_rope)

        def fold(variant: str, i: int, x=x, rope=rope, c=c):  # noqa: ANN001, ANN202
            if c > routes[variant]:
                return stock(i)
            weight, scale = (layers.folds[i], None) if variant == "bf16" else (layers.fp8s[i], layers.scales[i])
            return fold_query(x, weight, rope, scale) if rope is not None else fold_gemm(x, weight, scale=scale)

        calls = {"stock": [lambda i=i: stock(i) for i in layer_order()]}
        for variant in FOLD_VARIANTS:
            calls[variant] = [lambda i=i, v=variant: fold(v, i) for i in layer_order()]
        times = time_rounds_us(device, calls)
        out["levels"].append(
            {
                "concurrency": c,
                "stock_us": times["stock"],
                "stock_q_b_proj": "dsv3_fused_a_gemm" if vllm_plan else "cuBLAS",
                **{f"{v}_us": times[v] for v in FOLD_VARIANTS},
            }
        )
    return out


# ---- the parent: build, run the engines in order, summarize -------------------------------------------


def run_job(kind: str, spec: dict[str, Any], name: str, workdir: Path, env: dict[str, str]) -> dict[str, Any]:
    """Run ``kind`` ("--job" or "--microbench") in a fresh process; its result, or {"error": last log line}."""
    spec_path, out_path = workdir / f"{name}.spec.json", workdir / f"{name}.out.json"
    spec_path.write_text(json.dumps(spec))
    out_path.unlink(missing_ok=True)
    proc = subprocess.run(
        [sys.executable, __file__, kind, str(spec_path), str(out_path)],
        env=env,
        capture_output=True,
        text=True,
        check=False,
        timeout=900,
    )
    log = proc.stdout + proc.stderr
    (workdir / f"{name}.log").write_text(log)
    if proc.returncode != 0 or not out_path.exists():
        return {"error": log.strip().splitlines()[-1] if log.strip() else f"exit {proc.returncode}"}
    result = json.loads(out_path.read_text())
    result["fold_log"] = next((line.strip() for line in log.splitlines() if "foldckpt: folded" in line), None)
    return result


def engine_env(variant: str, workdir: Path) -> dict[str, str]:
    """Stock runs without the plugin (vLLM alone on the path); fold runs with it, and
    ``fp8_forced`` with the fold at every decode batch size."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("FOLDCKPT_")}
    env.update(VLLM_ENABLE_V1_MULTIPROCESSING="0", VLLM_CACHE_ROOT=str(workdir / "vllm-cache"))
    env["FOLDCKPT_STATS_FILE"] = str(workdir / f"{variant}.stats.json")
    if variant.startswith("stock"):
        env["VLLM_PLUGINS"] = ""
        env["PYTHONPATH"] = os.environ.get("VLLM_STOCK_PATH", env.get("PYTHONPATH", ""))
    if variant == "fp8_forced":
        from foldckpt.runtime.kernels.routing import ENV_FOLD_MAX_TOKENS

        env[ENV_FOLD_MAX_TOKENS] = str(1 << 20)
    return env


def spread(values: list[float]) -> dict[str, float]:
    return {"median": statistics.median(values), "min": min(values), "max": max(values)}


def level_summary(level: dict[str, Any]) -> dict[str, Any]:
    rounds = level["rounds"]
    gpu = [r["gpu_step_us"] for r in rounds if r["gpu_step_us"] is not None]
    tpot = spread([r["tpot_ms"] for r in rounds])
    out = {
        "concurrency": level["concurrency"],
        "tpot_ms": tpot,
        "gpu_step_us": spread(gpu) if gpu else None,
        "decode_tok_s": statistics.median(r["decode_tok_s"] for r in rounds),
    }
    out["gpu_bound"] = bool(gpu) and out["gpu_step_us"]["median"] >= GPU_BOUND * 1e3 * tpot["median"]
    return out


def pct(a: float, b: float) -> float:
    return 100.0 * (a - b) / b


def summarize(model: str, runs: dict[str, Any], micro: dict[str, Any]) -> dict[str, Any]:
    """The A/A control and, per fold variant and concurrency, the saving per MLA layer and step,
    the microbenchmark's, and the projected full-model gain."""
    mla = MODELS[model]["mla_layers"]
    ok = {v: r for v, r in runs.items() if "levels" in r}
    out: dict[str, Any] = {"aa": [], "summary": {}}
    if "stock" in ok and "stock_aa" in ok:
        for a, b in zip(ok["stock"]["levels"], ok["stock_aa"]["levels"], strict=True):
            sa, sb = level_summary(a), level_summary(b)
            out["aa"].append(
                {
                    "concurrency": a["concurrency"],
                    "tpot_diff_pct": pct(sb["tpot_ms"]["median"], sa["tpot_ms"]["median"]),
                    "gpu_step_diff_pct": pct(sb["gpu_step_us"]["median"], sa["gpu_step_us"]["median"])
                    if sa["gpu_step_us"] and sb["gpu_step_us"]
                    else None,
                }
            )
    micro_at = {lv["concurrency"]: lv for lv in micro.get("levels", [])}
    cited = json.loads(FULL_MODEL_TPOT.read_text())[model]
    for variant in FOLD_VARIANTS:
        if "stock" not in ok or variant not in ok:
            continue
        rows = []
        for s, f in zip(ok["stock"]["levels"], ok[variant]["levels"], strict=True):
            c = s["concurrency"]
            # Round r of the fold engine against round r of stock: same prompts, same order.
            savings = [
                (rs["gpu_step_us"] - rf["gpu_step_us"]) / mla
                for rs, rf in zip(s["rounds"], f["rounds"], strict=True)
                if rs["gpu_step_us"] is not None and rf["gpu_step_us"] is not None
            ]
            mb = micro_at.get(c)
            saving = statistics.median(savings) if savings else None
            full_tpot_ms = cited.get("tpot_ms", {}).get(str(c))
            rows.append(
                {
                    "concurrency": c,
                    "saving_per_mla_layer_step_us": spread(savings) if savings else None,
                    "microbench_saving_us": mb["stock_us"] - mb[f"{variant}_us"] if mb else None,
                    "projected_full_model_gain_pct": 100.0 * saving * cited["mla_layers"] / (1e3 * full_tpot_ms)
                    if saving is not None and full_tpot_ms
                    else None,
                }
            )
        out["summary"][variant] = rows
    return out


def gate_kernel(model: str) -> re.Pattern[str] | None:
    """The output gate's kernel where its name tells it apart: vLLM's dsv3_fused_a_gemm, compiled per
    (N, K), at the gate's (heads x v_head, hidden), which no other GEMM of the bench's model has (at
    other token counts the gate runs a cuBLAS kernel that other GEMMs share). None without a gate."""
    if not MODELS[model]["output_gate"]:
        return None
    d = dims(model)
    return re.compile(rf"fused_a_gemm_kernel<\d+, {d.heads * d.v_head}, {d.hidden},")


def profile_diff(model: str, profiles: dict[str, Any], top: int = 12) -> dict[str, Any]:
    """Per fold variant and concurrency: the decode step's GPU time against stock's (total and per
    MLA layer), the fold's kernels and the output gate's per MLA layer, and the kernels whose time
    per step differs most, each with both sides."""
    mla = MODELS[model]["mla_layers"]
    gate = gate_kernel(model)

    def gate_us(kernels: dict[str, float]) -> float | None:
        if gate is None:
            return None
        times = [us for name, us in kernels.items() if gate.search(name)]
        return sum(times) / mla if times else None

    stock = profiles.get("stock", {}).get("profile")
    out: dict[str, Any] = {}
    for variant, result in profiles.items():
        if variant == "stock" or stock is None or "profile" not in result:
            continue
        rows = []
        for s, f in zip(stock, result["profile"], strict=True):
            a, b = s["kernels_us_per_step"], f["kernels_us_per_step"]
            diffs = sorted(set(a) | set(b), key=lambda name: -abs(a.get(name, 0.0) - b.get(name, 0.0)))
            rows.append(
                {
                    "concurrency": s["concurrency"],
                    "stock_gpu_us_per_step": s["gpu_us_per_step"],
                    "fold_gpu_us_per_step": f["gpu_us_per_step"],
                    "saving_per_mla_layer_step_us": (s["gpu_us_per_step"] - f["gpu_us_per_step"]) / mla,
                    "fold_kernels_us_per_mla_layer": sum(b.get(name, 0.0) for name in FOLD_KERNELS) / mla,
                    "gate_kernel_us_per_mla_layer": {"stock": gate_us(a), "fold": gate_us(b)},
                    "kernels": [
                        {
                            "name": name[:200],
                            "stock_us": a.get(name, 0.0),
                            "fold_us": b.get(name, 0.0),
                            "stock_launches": s.get("kernels_launches_per_step", {}).get(name),
                            "fold_launches": f.get("kernels_launches_per_step", {}).get(name),
                        }
                        for name in diffs[:top]
                    ],
                }
            )
        out[variant] = rows
    return out


def main() -> None:
    if sys.argv[1:2] in (["--job"], ["--microbench"]):
        spec = json.loads(Path(sys.argv[2]).read_text())
        result = engine_job(spec) if sys.argv[1] == "--job" else microbench_job(spec)
        Path(sys.argv[3]).write_text(json.dumps(result))
        return
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--model", choices=sorted(MODELS), required=True)
    parser.add_argument("--out", type=Path, required=True, help="engine_<gpu>.json (a model already in it is kept)")
    parser.add_argument("--workdir", type=Path, default=Path("/tmp/bench_engine"))
    parser.add_argument(
        "--variants",
        default=None,
        help="engines to run, in order (default: all, or with --profile "
        f"{','.join(PROFILE_VARIANTS)}); the model's other runs in --out are kept",
    )
    parser.add_argument(
        "--concurrency",
        default=",".join(map(str, CONCURRENCY)),
        help="the concurrencies measured, a subset of the default (a shorter device call)",
    )
    parser.add_argument(
        "--profile",
        action="store_true",
        help="instead of timing rounds, break each engine's decode step down by kernel (torch profiler) "
        "and set each fold variant's kernels beside stock's: where an engine's saving differs from the "
        "kernels' (--out: engine_profile_<gpu>.json)",
    )
    parser.add_argument(
        "--resummarize",
        action="store_true",
        help="no GPU: recompute --model's summary (or profile comparison) in --out from its runs",
    )
    args = parser.parse_args()
    concurrency = [int(c) for c in args.concurrency.split(",")]
    if not set(concurrency) <= set(CONCURRENCY):
        parser.error(f"--concurrency: a subset of {CONCURRENCY} (the engines are built for those)")
    if args.resummarize:
        report = json.loads(args.out.read_text())
        entry = report["models"][args.model]
        if "profile" in entry:
            entry["profile_diff"] = profile_diff(args.model, entry["profile"])
        if "microbench" in entry:
            entry.update(summarize(args.model, entry["runs"], entry["microbench"]))
        report["full_model_tpot"] = json.loads(FULL_MODEL_TPOT.read_text())
        args.out.write_text(json.dumps(report, indent=1))
        return
    import torch
    from bench_machine import commit

    from foldckpt.runtime.kernels import gpu_key

    workdir = args.workdir / args.model
    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.monotonic()
    models_dir = args.workdir / "models"
    if all((models_dir / f"{args.model}{suffix}" / "foldckpt.json").exists() for suffix in ("-bf16", "-fp8")):
        dirs = {
            v: models_dir / f"{args.model}{'' if v.startswith('stock') else '-' + v.split('_')[0]}" for v in VARIANTS
        }
    else:
        dirs = build(args.model, models_dir)
    print(f"bench {args.model}: checkpoints built and converted in {time.monotonic() - t0:.0f} s", flush=True)
    report = json.loads(args.out.read_text()) if args.out.exists() else {}
    report.update(
        gpu=torch.cuda.get_device_name(0),
        gpu_key=gpu_key(torch.device("cuda")),
        commit=commit(),
        torch=torch.__version__,
        vllm=version("vllm"),
        method=__doc__,
        input_len=INPUT_LEN,
        output_len=OUTPUT_LEN,
        rounds=ROUNDS,
        full_model_tpot=json.loads(FULL_MODEL_TPOT.read_text()),
    )
    models = report.setdefault("models", {})
    entry = models.setdefault(args.model, {"runs": {}})
    entry.update(
        layers=MODELS[args.model]["layers"],
        mla_layers=MODELS[args.model]["mla_layers"],
        geometry=asdict(dims(args.model)),
    )
    spec = {"model_key": args.model, "profile": args.profile, "concurrency": concurrency}
    variants = args.variants.split(",") if args.variants else PROFILE_VARIANTS if args.profile else VARIANTS
    for variant in variants:  # written after each engine: a timeout keeps what finished
        result = run_job("--job", {**spec, "model": str(dirs[variant])}, variant, workdir, engine_env(variant, workdir))
        if args.profile:
            entry.setdefault("profile", {})[variant] = result
            entry["profile_diff"] = profile_diff(args.model, entry["profile"])
            args.out.write_text(json.dumps(report, indent=1))
            print(f"bench {args.model} {variant} profiled at {time.monotonic() - t0:.0f} s", flush=True)
            continue
        stats = workdir / f"{variant}.stats.json"
        if stats.exists():
            result["routing_stats"] = json.loads(stats.read_text())
        if "levels" in result:
            result["levels"] = [{**level_summary(lv), "rounds": lv["rounds"]} for lv in result["levels"]]
        entry["runs"][variant] = result
        args.out.write_text(json.dumps(report, indent=1))
        brief = [(lv["concurrency"], lv["tpot_ms"]["median"], lv["gpu_step_us"]) for lv in result.get("levels", [])]
        print(
            f"bench {args.model} {variant} at {time.monotonic() - t0:.0f} s: {result.get('error') or brief}", flush=True
        )
    if args.profile:
        print(json.dumps(entry["profile_diff"], indent=1), flush=True)
        return
    micro = run_job("--microbench", spec, "microbench", workdir, {**os.environ})
    entry["microbench"] = micro
    entry.update(summarize(args.model, entry["runs"], micro))
    args.out.write_text(json.dumps(report, indent=1))
    print(json.dumps({k: entry[k] for k in ("aa", "summary")}, indent=1), flush=True)


if __name__ == "__main__":
    main()
