"""scripts/bench_engine.py's arithmetic against hand-computed values: the figures the engine
benchmark reports are only as good as its pairing of rounds, its per-layer division, its A/A
percentages and its projection (a saving divided by the wrong layer count, or rounds paired across
concurrencies, would pass unnoticed in a device run)."""

from __future__ import annotations

import importlib.util
import json
import sys
from pathlib import Path
from types import ModuleType

import pytest

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_engine.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    sys.path.insert(0, str(SCRIPT.parent))
    spec = importlib.util.spec_from_file_location("bench_engine", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _run(steps: dict[int, list[float]], tpot_ms: float = 10.0) -> dict:
    """An engine's levels: per concurrency, one round per GPU step time."""
    return {
        "levels": [
            {"concurrency": c, "rounds": [{"tpot_ms": tpot_ms, "gpu_step_us": s, "decode_tok_s": 1.0} for s in gpu]}
            for c, gpu in steps.items()
        ]
    }


def test_saving_per_layer_pairs_rounds_and_divides_by_the_mla_layers(bench: ModuleType) -> None:
    runs = {
        "stock": _run({1: [10_000.0, 10_010.0, 10_020.0], 14: [12_000.0, 12_000.0, 12_000.0]}),
        "stock_aa": _run({1: [10_010.0, 10_010.0, 10_010.0], 14: [12_012.0, 12_012.0, 12_012.0]}),
        "fp8": _run({1: [9_976.0, 9_962.0, 9_972.0], 14: [12_048.0, 12_048.0, 12_048.0]}),
    }
    micro = {
        "levels": [
            {"concurrency": 1, "stock_us": 9.0, "fp8_us": 7.0},
            {"concurrency": 14, "stock_us": 9.0, "fp8_us": 8.5},
        ]
    }
    out = bench.summarize("k3", runs, micro)
    # Kimi-K3: 24 MLA layers. Round pairs at c=1 save 24, 48, 48 µs: 1, 2, 2 µs per layer.
    [c1, c14] = out["summary"]["fp8"]
    assert c1["saving_per_mla_layer_step_us"] == {"median": 2.0, "min": 1.0, "max": 2.0}
    assert c14["saving_per_mla_layer_step_us"]["median"] == pytest.approx(-2.0)
    assert c1["microbench_saving_us"] == 2.0 and c14["microbench_saving_us"] == 0.5
    cited = json.loads(bench.FULL_MODEL_TPOT.read_text())["k3"]
    assert c1["projected_full_model_gain_pct"] == pytest.approx(
        100 * 2.0 * cited["mla_layers"] / (1e3 * cited["tpot_ms"]["1"])
    )
    # A/A: the second stock engine against the first, in percent of the first's medians.
    assert out["aa"][0]["gpu_step_diff_pct"] == pytest.approx(0.0)
    assert out["aa"][1]["gpu_step_diff_pct"] == pytest.approx(0.1)
    assert set(out["summary"]) == {"fp8"}, "variants that did not run have no summary"


def test_a_run_is_gpu_bound_when_its_gpu_step_is_most_of_its_tpot(bench: ModuleType) -> None:
    bound = bench.level_summary(_run({1: [8_100.0]}, tpot_ms=10.0)["levels"][0])
    loose = bench.level_summary(_run({1: [7_900.0]}, tpot_ms=10.0)["levels"][0])
    assert bound["gpu_bound"] and not loose["gpu_bound"]


def test_profile_diff_sets_each_kernel_beside_stock_and_ranks_by_difference(bench: ModuleType) -> None:
    def level(c: int, kernels: dict[str, float]) -> dict:
        launches = {name: 24.0 for name in kernels}  # one launch per MLA layer and step
        return {
            "concurrency": c,
            "gpu_us_per_step": sum(kernels.values()),
            "kernels_us_per_step": kernels,
            "kernels_launches_per_step": launches,
        }

    stock = {"attn": 100.0, "q_b_proj": 240.0, "bmm": 96.0, "norm": 10.0}
    fold = {"attn": 148.0, "fold": 192.0, "norm": 10.0}  # the query saves 144 µs, attention loses 48
    projects = {"attn": 100.0, "_skinny_gemm_kernel": 120.0, "foldckpt_fp8_fold": 72.0}
    profiles = {"stock": {"profile": [level(1, stock)]}, "fp8": {"profile": [level(1, fold)]}, "bf16": {"error": "x"}}
    [row] = bench.profile_diff("k3", profiles, top=3)["fp8"]
    assert row["saving_per_mla_layer_step_us"] == pytest.approx((446.0 - 350.0) / 24)
    assert row["fold_kernels_us_per_mla_layer"] == 0.0, "'fold' is no kernel of the project's"
    assert [k["name"] for k in row["kernels"]] == ["q_b_proj", "fold", "bmm"]
    assert row["kernels"][1] == {
        "name": "fold",
        "stock_us": 0.0,
        "fold_us": 192.0,
        "stock_launches": None,
        "fold_launches": 24.0,
    }
    assert set(bench.profile_diff("k3", profiles)) == {"fp8"}, "an engine that failed has no row"
    profiles["fp8"] = {"profile": [level(1, projects)]}
    [row] = bench.profile_diff("k3", profiles)["fp8"]
    assert row["fold_kernels_us_per_mla_layer"] == pytest.approx(192.0 / 24)


def test_profile_diff_tells_the_output_gate_apart_only_by_its_shape(bench: ModuleType) -> None:
    """Kimi-K3's gate runs vLLM's dsv3_fused_a_gemm compiled for (12 x 128, 7168) at TP8, fused_qkv_a
    the same kernel at (2112, 7168); cuBLAS kernels carry no shape and DeepSeek-V3 has no gate."""
    gate = "void fused_a_gemm_kernel<1, 1536, 7168, 16, 16, 256, 12>(__nv_bfloat16*)"
    qkv_a = "void fused_a_gemm_kernel<1, 2112, 7168, 16, 16, 256, 12>(__nv_bfloat16*)"
    q_b_proj = "void fused_a_gemm_kernel<1, 2304, 1536, 16, 16, 256, 12>(__nv_bfloat16*)"

    def profiles(kernels_stock: dict[str, float], kernels_fold: dict[str, float]) -> dict:
        level = lambda kernels: {"concurrency": 14, "gpu_us_per_step": 1.0, "kernels_us_per_step": kernels}  # noqa: E731
        return {"stock": {"profile": [level(kernels_stock)]}, "fp8": {"profile": [level(kernels_fold)]}}

    both = profiles({gate: 240.0, qkv_a: 336.0, q_b_proj: 200.0}, {gate: 264.0, qkv_a: 336.0})
    [row] = bench.profile_diff("k3", both)["fp8"]
    assert row["gate_kernel_us_per_mla_layer"] == {"stock": pytest.approx(10.0), "fold": pytest.approx(11.0)}
    cublas = profiles(
        {"nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT": 500.0}, {"nvjet_sm90_tst_64x8_64x16_4x1_v_bz_TNT": 9.0}
    )
    [row] = bench.profile_diff("k3", cublas)["fp8"]
    assert row["gate_kernel_us_per_mla_layer"] == {"stock": None, "fold": None}
    [row] = bench.profile_diff("ds", both)["fp8"]
    assert row["gate_kernel_us_per_mla_layer"] == {"stock": None, "fold": None}, "DeepSeek-V3 has no output gate"
