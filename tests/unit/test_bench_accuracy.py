"""The emulations in scripts/bench_accuracy.py against hand-computed values.

The accuracy numbers are only as good as these: an MXFP4 emulation with a wrong e8m0 exponent (ceil
instead of floor, e2m1's emax taken as 1 or 3, scale = amax/6) or a wrong e2m1 grid or rounding (a
uniform grid, no 1.5, ties away from zero, truncation, no saturation) would make the MXFP4 path look
better or worse than it is, and a block or w8a8 fp8 variant that drops a scale or skips the
activation rounding would do the same for fp8.
"""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType

import pytest
import torch

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "bench_accuracy.py"


@pytest.fixture(scope="module")
def bench() -> ModuleType:
    sys.path.insert(0, str(SCRIPT.parent))  # as `python scripts/bench_accuracy.py` runs it: its sibling modules import
    spec = importlib.util.spec_from_file_location("bench_accuracy", SCRIPT)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_e2m1_grid_ties_to_even_and_saturation(bench: ModuleType) -> None:
    # Exact grid points stay; midpoints go to the even code (0, 1, 2, 4 have mantissa bit 0).
    grid = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]
    assert bench.e2m1_round(torch.tensor(grid)).tolist() == grid
    midpoints = torch.tensor([0.25, 0.75, 1.25, 1.75, 2.5, 3.5, 5.0])
    assert bench.e2m1_round(midpoints).tolist() == [0.0, 1.0, 1.0, 2.0, 2.0, 4.0, 4.0]
    assert bench.e2m1_round(-midpoints).tolist() == [-0.0, -1.0, -1.0, -2.0, -2.0, -4.0, -4.0]
    off_midpoint = torch.tensor([0.26, 0.74, 1.3, 2.49, 2.51, 4.9, 5.1, 6.5, 100.0, -7.0])
    assert bench.e2m1_round(off_midpoint).tolist() == [0.5, 0.5, 1.5, 2.0, 3.0, 4.0, 6.0, 6.0, 6.0, -6.0]


def test_mxfp4_e8m0_exponent_is_floor_log2_amax_minus_2(bench: ModuleType) -> None:
    amaxes = [1.0, 0.99, 6.0, 8.0, 0.01, 0.0]
    # floor(log2 amax) - 2: 1 -> -2, 0.99 -> -3, 6 -> 0, 8 -> 1, 0.01 -> -9; an all-zero block gets 2^0.
    expected_scale = [0.25, 0.125, 1.0, 2.0, 2.0**-9, 1.0]
    blocks = torch.zeros(len(amaxes), bench.MX_BLOCK)
    blocks[:, 0] = torch.tensor(amaxes)
    blocks[:, 1] = torch.tensor(amaxes) / 3  # a non-maximal element per block, rounded on the block's grid
    elements, scale = bench.quantize_mxfp4(blocks.reshape(-1))
    assert scale.tolist() == expected_scale
    elements = elements.reshape(len(amaxes), bench.MX_BLOCK)
    # amax / scale: 4, 7.92 -> 6 (saturates), 6, 4, 5.12 -> 6; a third of it: 1.33 -> 1.5, 2.64 -> 3, 2 -> 2,
    # 1.33 -> 1.5, 1.71 -> 1.5.
    assert elements[:, :2].tolist() == [[4.0, 1.5], [6.0, 3.0], [6.0, 2.0], [4.0, 1.5], [6.0, 1.5], [0.0, 0.0]]
    assert not elements[:, 2:].any()
    restored = bench.dequantize_mxfp4(elements.reshape(-1), scale).reshape(len(amaxes), bench.MX_BLOCK)
    assert restored[:3, :2].tolist() == [[1.0, 0.375], [0.75, 0.375], [6.0, 2.0]]


def test_mxfp4_blocks_run_along_the_last_dim(bench: ModuleType) -> None:
    w = torch.zeros(2, 2 * bench.MX_BLOCK)
    w[0, 0], w[0, bench.MX_BLOCK], w[1, 5] = 4.0, 0.5, 1.0
    _, scale = bench.quantize_mxfp4(w)
    assert scale.tolist() == [[1.0, 0.125], [0.25, 1.0]]


def test_fp8_row_blocks_have_one_scale_per_128_columns(bench: ModuleType) -> None:
    w = torch.zeros(1, 3 * 128)
    w[0, 0], w[0, 1] = 448.0, 17.0  # block 0: scale 1, 17 -> 16 (e4m3 ties to even)
    w[0, 128], w[0, 129] = 896.0, 34.0  # block 1: scale 2, 34 / 2 = 17 -> 16 -> 32
    values, scale = bench.quantize_fp8_row_blocks(w)  # block 2: all zero, scale 1
    assert values.dtype == torch.float8_e4m3fn
    assert scale.tolist() == [[1.0, 2.0, 1.0]]
    restored = bench.dequantize_fp8_row_blocks(values, scale)
    assert restored[0, [0, 1, 128, 129]].tolist() == [448.0, 16.0, 896.0, 32.0]
    assert not restored[0, 256:].any()


def test_w8a8_rounds_activations_per_token_and_applies_both_scales(bench: ModuleType) -> None:
    x = torch.tensor([[448.0, 17.0], [7.0, 3.5]])  # token scales 1 (17 -> 16) and 7/448 = 1/64 (-> 448, 224)
    values = torch.tensor([[1.0, 1.0], [2.0, 0.0]]).to(torch.float8_e4m3fn)
    scale = torch.tensor([2.0, 0.5])
    y = bench.fp8_w8a8_matmul(x, values, scale)
    assert y.tolist() == [[(448 + 16) * 2.0, 448 * 2 * 0.5], [(448 + 224) / 64 * 2.0, 448 * 2 / 64 * 0.5]]


def test_script_self_check_passes(bench: ModuleType) -> None:
    bench._check_emulations()


def test_every_path_is_measured_and_close_to_the_fp64_query(bench: ModuleType) -> None:
    """The whole measurement on two Kimi-K3 heads: each path's query pieces against the fp64 two-step
    query. The fp8 block path built its exact fold from fold_chunks' pieces with the wrong arity
    and raised before any figure was written."""
    from dataclasses import replace

    figures = bench._measure("gaussian", replace(bench.K3, num_heads=2), 8, (0,), 0)
    assert set(figures["paths"]) == {
        "fold_bf16",
        "fold_fp8_row",
        "fold_fp8_block128",
        "fold_fp8_row_w8a8",
        "unfolded_bf16",
        "unfolded_mxfp4_wuk",
    }
    for name, stats in figures["paths"].items():
        worst = max(stats["ql_nope_rel_err"]["worst"], stats["q_pe_rel_err"]["worst"])
        assert worst < (0.25 if "mxfp4" in name else 0.1), (name, stats)
