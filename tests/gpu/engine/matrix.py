"""The GPU engine matrix: tiny checkpoints, the engine runs the tests compare, and a runner that
starts them side by side.

Every engine is a process of its own (``tests/e2e/engine_job.py``: vLLM loads general plugins once
per process). One engine of these tiny models leaves an H100 idle most of the time and spends most
of its wall time importing vLLM and compiling, so the runs start ``FOLDCKPT_GPU_ENGINES`` at a time,
each with a fixed 256 MiB KV cache (``kv_cache_memory_bytes``: no memory profiling, which other
processes' allocations would confuse) and a compile cache of its own (``VLLM_CACHE_ROOT``: stock and
plugin runs of one model would otherwise share compiled graphs keyed by the same config hash).

Stock runs see vLLM alone: ``PYTHONPATH=$VLLM_STOCK_PATH`` on the GPU machine (``unpack.sh``: the
plugin's entry point is not even installed there) and ``VLLM_PLUGINS=""`` everywhere.

A teacher-forced run (``Job.force_from``) is fed another run's greedy tokens, so it starts once that
run has finished: the runner submits the source first and the forced run then waits for it (the
pool takes jobs in submission order, so the source is running or done by then: no deadlock, at
any ``FOLDCKPT_GPU_ENGINES``).
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import threading
import time
from collections.abc import Callable
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass, field, replace
from pathlib import Path
from typing import Any

import torch

from foldckpt.convert import ConvertOptions, convert
from foldckpt.format.manifest import read_manifest
from foldckpt.model.synthetic import FA3_TINY_DIMS, make_checkpoint
from foldckpt.runtime.kernels.routing import ENV_FOLD_MAX_TOKENS
from tests.e2e.harness import (
    PROMPTS,
    engine_env,
    engine_spec,
    openai_server,
    post_json,
    run_job,
    wait_healthy,
)

PARALLEL = int(os.environ.get("FOLDCKPT_GPU_ENGINES", "10"))
JOB_TIMEOUT_S = float(os.environ.get("FOLDCKPT_GPU_ENGINE_TIMEOUT", "400"))
LOGPROBS = 5
MAX_TOKENS = 24
# 16 short prompts: decode steps of 16 rows, each a CUDA-graph size below.
SHORT_PROMPTS = [[(7 * i + 11 * j + 3) % 251 for j in range(12 + i % 9)] for i in range(16)]
# The harness's 8 prompts of 300 tokens with at most 1024 tokens a step: chunked prefill puts
# prefill chunks next to the decode rows of prompts already done (mixed batches).
LONG_PROMPTS = PROMPTS
MIXED_BATCH_TOKENS = 1024
GRAPH_SIZES = [1, 2, 4, 8, 16, 24, 32]
KV_CACHE_BYTES = 256 << 20
NO_PLUGIN = {"VLLM_PLUGINS": ""}
MODES: dict[str, tuple[bool, dict[str, Any] | None]] = {
    # name -> (enforce_eager, compilation_config)
    "eager": (True, None),
    # vLLM's default: FULL_AND_PIECEWISE CUDA graphs, torch.compile where the model uses it
    # (DeepSeek-V3; Kimi-K3 runs breakable CUDA graphs instead), fewer capture sizes to start fast.
    "default": (False, {"cudagraph_capture_sizes": GRAPH_SIZES}),
    "full_decode_only": (False, {"cudagraph_mode": "FULL_DECODE_ONLY", "cudagraph_capture_sizes": GRAPH_SIZES}),
}


@dataclass(frozen=True)
class Job:
    """One engine run: which model, with or without the plugin, how."""

    model: str
    plugin: bool = True
    mode: str = "eager"
    backend: str | None = None
    prompts: str = "short"
    env: dict[str, str] = field(default_factory=dict)
    spec: dict[str, Any] = field(default_factory=dict)
    options: dict[str, Any] = field(default_factory=dict)
    # The run whose greedy tokens this one is teacher-forced with (engine_job's ``force``): its
    # logprobs are then the model's own at every step of the source's context, ties or not.
    force_from: str | None = None


@dataclass(frozen=True)
class JobResult:
    """A finished run: exit code, log, the job's output (None when it failed) and stats file."""

    name: str
    returncode: int
    log: str
    result: dict[str, Any] | None
    stats: dict[str, int] | None
    wall_s: float

    @property
    def tokens(self) -> list[list[int]]:
        assert self.result is not None, f"{self.name} failed:\n{self.log[-4000:]}"
        return self.result["tokens"]

    @property
    def logprobs(self) -> list[list[dict[str, float]]]:
        assert self.result is not None, f"{self.name} failed:\n{self.log[-4000:]}"
        return self.result["logprobs"]

    def ok(self) -> JobResult:
        """This result, once its engine is known to have generated."""
        assert self.returncode == 0 and self.result is not None, f"engine {self.name} failed:\n{self.log[-6000:]}"
        return self


K3_OPTIONS = {"language_model_only": True, "enable_prefix_caching": False}
TRITON_MIXED = {"max_num_batched_tokens": MIXED_BATCH_TOKENS}
# A float32 model: no FlashAttention 3 prefill for float32, so prefill goes to vLLM's SDPA MLA
# prefill and decode to TRITON_MLA (both take float32), in stock and plugin runs alike.
FP32_OPTIONS = {"attention_config": {"mla_prefill_backend": "CPU"}}
BREAKABLE_OFF = {"VLLM_USE_BREAKABLE_CUDAGRAPH": "0"}
# The tiny fp8 fold ([4608, 64]) loses to q_b_proj in an H100's start-up measurement, which then
# serves it unfolded (threshold 0); the fp8 tests are of the fp8 kernel in an engine, so they pin
# the route (test_routing holds the measured routes).
FP8_ROUTE = {ENV_FOLD_MAX_TOKENS: "256"}
# One KDA (Mamba-style) cache block per sequence: with the small KV budget here, vLLM's default
# max_num_seqs (1024) stopped stock's graph capture ("exceeds available Mamba cache blocks (910)").
HYBRID_OPTIONS = {"language_model_only": True, "max_num_seqs": 64}
MTP = {"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}}


def _pair(prefix: str, **kwargs: Any) -> dict[str, Job]:
    return {f"{prefix}-stock": Job(plugin=False, **kwargs), f"{prefix}-fold": Job(**kwargs)}


# In start order: the priorities first, slow (compiled) engines early in each group.
JOBS: dict[str, Job] = {
    **_pair("ds-default", model="ds-bf16", mode="default"),
    **_pair("ds-eager", model="ds-bf16"),
    "ds-eager-disabled": Job(model="ds-bf16", env={"FOLDCKPT_DISABLE": "1"}),
    "ds-default-disabled": Job(model="ds-bf16", mode="default", env={"FOLDCKPT_DISABLE": "1"}),
    **_pair("k3-default", model="k3-bf16", mode="default", options=K3_OPTIONS),
    **_pair("k3-eager", model="k3-bf16", options=K3_OPTIONS),
    **_pair("ds-triton", model="ds-bf16", backend="TRITON_MLA", prompts="long", options=TRITON_MIXED),
    **_pair("ds32-eager", model="ds-fp32", backend="TRITON_MLA", options=FP32_OPTIONS),
    "ds-corrupt": Job(model="ds-corrupt"),
    **_pair("ds-fdo", model="ds-bf16", mode="full_decode_only"),
    **_pair("k3-nobreak", model="k3-bf16", mode="default", env=BREAKABLE_OFF, options=K3_OPTIONS),
    **_pair("k3-triton", model="k3-bf16", backend="TRITON_MLA", prompts="long", options={**K3_OPTIONS, **TRITON_MIXED}),
    # Forced with stock's tokens: a random tiny model's greedy tokens split at near-ties, after
    # which free-running runs share no context; forced, every step is compared (issue 44).
    "ds-fp8fold-default": Job(model="ds-fp8fold", mode="default", env=FP8_ROUTE, force_from="ds-default-stock"),
    "ds-fp8fold-eager": Job(model="ds-fp8fold", env=FP8_ROUTE, force_from="ds-eager-stock"),
    **_pair("dsfp8src-default", model="dsfp8src-bf16", mode="default"),
    **_pair("dsmtp-eager", model="dsmtp-bf16", spec=MTP),
    **_pair("k3mtp-eager", model="k3-bf16", spec=MTP, options=K3_OPTIONS),
    **_pair("hyb-eager", model="hyb-bf16", options=HYBRID_OPTIONS),
    **_pair("hyb-default", model="hyb-bf16", mode="default", options=HYBRID_OPTIONS),
}


def _flip_last_fold_byte(out_dir: Path) -> Path:
    """Flip a byte inside the last fold's data: sizes and headers stay valid, only sha256 can tell."""
    (sidecar,) = read_manifest(out_dir).sidecars
    path = out_dir / sidecar
    with open(path, "r+b") as handle:
        handle.seek(path.stat().st_size - 64)
        byte = handle.read(1)[0]
        handle.seek(path.stat().st_size - 64)
        handle.write(bytes([byte ^ 0xFF]))
    return path


def _converted(source: Path, name: str, **options: Any) -> Path:
    return convert(source, source.with_name(name), ConvertOptions(progress=False, **options)).out_dir


MODEL_BUILDERS: dict[str, Callable[[Path], Path]] = {
    "ds": lambda root: make_checkpoint(root / "ds", "deepseek_v3", dims=FA3_TINY_DIMS),
    "ds-bf16": lambda root: _converted(model(root, "ds"), "ds-bf16"),
    "ds-fp8fold": lambda root: _converted(model(root, "ds"), "ds-fp8fold", fold_dtype="fp8"),
    "ds-corrupt": lambda root: shutil.copytree(model(root, "ds-bf16"), root / "ds-corrupt", symlinks=True),
    "ds32": lambda root: make_checkpoint(root / "ds32", "deepseek_v3", dims=FA3_TINY_DIMS, dtype=torch.float32),
    "ds-fp32": lambda root: _converted(model(root, "ds32"), "ds-fp32", fold_dtype="float32"),
    # q_lora 128: vLLM's W8A8 block GEMM quantizes q_b_proj's input in groups of 128 (with 64,
    # stock stopped: "the last dimension of `x` 64 must be divisible by `group_size` 128").
    "dsfp8src": lambda root: make_checkpoint(
        root / "dsfp8src", "deepseek_v3_fp8", dims=replace(FA3_TINY_DIMS, q_lora=128)
    ),
    "dsfp8src-bf16": lambda root: _converted(model(root, "dsfp8src"), "dsfp8src-bf16"),
    "dsmtp": lambda root: make_checkpoint(root / "dsmtp", "deepseek_v3", mtp_layers=1, dims=FA3_TINY_DIMS),
    "dsmtp-bf16": lambda root: _converted(model(root, "dsmtp"), "dsmtp-bf16"),
    # All-MLA Kimi-K3 (2 layers) with its MTP layer; bf16 experts (MXFP4 MoE is not what is tested).
    "k3": lambda root: make_checkpoint(
        root / "k3", "kimi_k3", layers=2, mtp_layers=1, all_mla=True, bf16_experts=True, dims=FA3_TINY_DIMS
    ),
    "k3-bf16": lambda root: _converted(model(root, "k3"), "k3-bf16"),
    # Hybrid Kimi-K3: 5 layers, kda_layers [1, 2, 3] and MLA layers [4, 5] (1-indexed, as K3's own).
    "hyb": lambda root: make_checkpoint(
        root / "hyb", "kimi_k3", layers=5, mtp_layers=1, bf16_experts=True, dims=FA3_TINY_DIMS
    ),
    "hyb-bf16": lambda root: _converted(model(root, "hyb"), "hyb-bf16"),
}
_models: dict[tuple[Path, str], Path] = {}
_models_lock = threading.RLock()


def model(root: Path, name: str) -> Path:
    """The checkpoint ``name`` under ``root``, built on first use (sources before conversions)."""
    with _models_lock:
        if (root, name) not in _models:
            path = MODEL_BUILDERS[name](root)
            if name == "ds-corrupt":
                _flip_last_fold_byte(path)
            _models[root, name] = path
        return _models[root, name]


def gpu_env(job: Job, workdir: Path, name: str) -> dict[str, str]:
    """The engine's environment: the harness's (offline, no inherited settings) plus what vLLM
    0.32 needs on the GPU machine (``../shared/gpu-vllm/README.md``) and the job's own."""
    env = engine_env(
        VLLM_USE_FLASHINFER_SAMPLER="0",
        VLLM_KIMI_K3_GEMM_AR="0",
        VLLM_NO_USAGE_STATS="1",
        VLLM_CACHE_ROOT=str(workdir / f"{name}.vllm-cache"),
        FOLDCKPT_STATS_FILE=str(stats_path(workdir, name)),
        **job.env,
    )
    if not job.plugin:
        env.update(NO_PLUGIN)
        if os.environ.get("VLLM_STOCK_PATH"):
            env["PYTHONPATH"] = os.environ["VLLM_STOCK_PATH"]
    return env


def stats_path(workdir: Path, name: str) -> Path:
    return workdir / f"{name}.stats.json"


def spec_of(job: Job, model_dir: Path, force: list[list[int]] | None = None) -> dict[str, Any]:
    """``job``'s engine_job spec on ``model_dir``, teacher-forced with ``force`` (per prompt) if given."""
    eager, compilation = MODES[job.mode]
    dtype = "float32" if job.model == "ds-fp32" else "bfloat16"
    options = {"gpu_memory_utilization": 0.08, "kv_cache_memory_bytes": KV_CACHE_BYTES, **job.options}
    extra = {"compilation_config": compilation, "attention_backend": job.backend, "engine_options": options}
    return engine_spec(
        model_dir,
        dtype,
        eager=eager,
        logprobs=LOGPROBS,
        prompts=SHORT_PROMPTS if job.prompts == "short" else LONG_PROMPTS,
        max_tokens=MAX_TOKENS,
        force=force,
        spec_extra={**extra, **job.spec},
    )


def run_one(workdir: Path, root: Path, name: str, force: list[list[int]] | None = None) -> JobResult:
    """Build what ``name`` serves, run its engine (teacher-forced with ``force``), collect what it left."""
    job = JOBS[name]
    started = time.monotonic()
    model_dir = model(root, job.model)
    stats_path(workdir, name).unlink(missing_ok=True)
    spec = spec_of(job, model_dir, force)
    proc = run_job(workdir, name, spec, gpu_env(job, workdir, name), timeout=JOB_TIMEOUT_S)
    log = proc.stdout + proc.stderr
    (workdir / f"{name}.log").write_text(log)
    out = workdir / f"{name}.out.json"
    result = json.loads(out.read_text()) if proc.returncode == 0 and out.exists() else None
    stats = json.loads(stats_path(workdir, name).read_text()) if stats_path(workdir, name).exists() else None
    return JobResult(name, proc.returncode, log, result, stats, time.monotonic() - started)


def _safe(workdir: Path, root: Path, name: str, force: list[list[int]] | None = None) -> JobResult:
    try:
        if name == SERVER:
            return serve_and_query(workdir, model(root, "ds-bf16"))
        return run_one(workdir, root, name, force)
    except (subprocess.TimeoutExpired, OSError, ValueError) as exc:
        return JobResult(name, -1, f"{type(exc).__name__}: {exc}", None, None, 0.0)


class Matrix:
    """Runs of the jobs that the selected tests need, started together (:data:`PARALLEL` at a time)."""

    def __init__(self, workdir: Path, root: Path, names: list[str]) -> None:
        self.workdir, self.root = workdir, root
        self._pool = ThreadPoolExecutor(max_workers=PARALLEL, thread_name_prefix="engine")
        self._futures: dict[str, Future[JobResult]] = {}
        for name in [*JOBS, SERVER]:  # the start order
            if name in names:
                self.submit(name)

    def submit(self, name: str) -> None:
        if name in self._futures:
            return
        source = JOBS[name].force_from if name in JOBS else None
        if source is not None:
            self.submit(source)  # first: see the module docstring
        self._futures[name] = self._pool.submit(self._run, name, source)

    def _run(self, name: str, source: str | None) -> JobResult:
        """``name``'s run; a forced one waits for its source's tokens, and does not start (a failed
        result naming the source) where the source generated none."""
        if source is None:
            return _safe(self.workdir, self.root, name)
        forced_with = self._futures[source].result()
        if forced_with.result is None:
            return JobResult(
                name, -1, f"not started: {source}, whose tokens it is forced with, failed", None, None, 0.0
            )
        return _safe(self.workdir, self.root, name, forced_with.tokens)

    def __getitem__(self, name: str) -> JobResult:
        self.submit(name)
        return self._futures[name].result()

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)
        summary = {
            name: {
                "returncode": f.result().returncode,
                "wall_s": round(f.result().wall_s, 1),
                "stats": f.result().stats,
            }
            for name, f in self._futures.items()
            if f.done() and not f.cancelled()
        }
        (self.workdir / "matrix.json").write_text(json.dumps(summary, indent=1, sort_keys=True))


SERVER = "server"


# ----------------------------------------------------------------------------------------------
# The OpenAI server (``vllm serve``): API server and engine core in processes of their own.
# ----------------------------------------------------------------------------------------------
SERVER_REQUESTS = 4
SERVER_MAX_TOKENS = 16


def serve_and_query(workdir: Path, model_dir: Path, startup_s: float = 300) -> JobResult:
    """Start ``python -m vllm.entrypoints.openai.api_server`` (what ``vllm serve`` runs) with the
    plugin on ``model_dir``, send :data:`SERVER_REQUESTS` completions at once, stop it; returns the
    completions as the result, the log and the stats file (written by the engine core's worker while
    it serves: the worker is killed, not asked to exit, when the server stops)."""
    name, started = SERVER, time.monotonic()
    env = gpu_env(Job(model="ds-bf16"), workdir, name)
    stats_path(workdir, name).unlink(missing_ok=True)
    log_path = workdir / f"{name}.log"
    args = ("--gpu-memory-utilization", "0.08", "--kv-cache-memory-bytes", str(KV_CACHE_BYTES))
    args += ("--compilation-config", json.dumps({"cudagraph_capture_sizes": GRAPH_SIZES}))
    with openai_server(model_dir, log_path, env, *args) as (url, process):
        if not wait_healthy(url, process, startup_s):
            return JobResult(name, process.poll() or -1, log_path.read_text(), None, None, time.monotonic() - started)
        bodies = [
            {
                "model": str(model_dir),
                "prompt": f"request {i}: the fold",
                "max_tokens": SERVER_MAX_TOKENS,
                "temperature": 0.0,
                "ignore_eos": True,
            }
            for i in range(SERVER_REQUESTS)
        ]
        with ThreadPoolExecutor(max_workers=SERVER_REQUESTS) as pool:
            completions = list(pool.map(lambda body: post_json(f"{url}/v1/completions", body), bodies))
        time.sleep(0.5)  # the stats thread writes at most one flush interval after the last step
        stats = json.loads(stats_path(workdir, name).read_text()) if stats_path(workdir, name).exists() else None
        result = {"completions": completions}
        return JobResult(name, 0, log_path.read_text(), result, stats, time.monotonic() - started)
