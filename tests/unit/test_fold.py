"""The fold math against fp64 references: per head, on random inputs, and per TP rank."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest
import torch

from foldckpt.errors import FoldckptError
from foldckpt.fold import (
    ROUNDING_TOLERANCE,
    FoldError,
    dequantize_fp8_blocks,
    fold_error,
    fold_layer,
    probe_error,
    quantize_fp8_rows,
    sample_heads,
    underflow_suspects,
)
from foldckpt.model.geometry import Geometry, MLALayer

TINY = Geometry(
    "deepseek",
    "DeepseekV3ForCausalLM",
    num_heads=8,
    q_lora_rank=64,
    kv_lora_rank=512,
    qk_nope_head_dim=32,
    qk_rope_head_dim=64,
    v_head_dim=32,
    layers=(MLALayer(0, "model.layers.0"),),
)
# Kimi-K3's per-head dimensions (fewer heads to stay fast).
K3_HEADS = replace(TINY, num_heads=4, q_lora_rank=1536, qk_nope_head_dim=128, v_head_dim=128)


def random_weights(
    g: Geometry, seed: int = 0, dtype: torch.dtype = torch.bfloat16
) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q_b = torch.randn(g.q_b_proj_shape, generator=generator) / g.q_lora_rank**0.5
    kv_b = torch.randn(g.kv_b_proj_shape, generator=generator) / g.kv_lora_rank**0.5
    return q_b.to(dtype), kv_b.to(dtype)


def fp64_fold_of_head(q_b: torch.Tensor, kv_b: torch.Tensor, g: Geometry, h: int) -> torch.Tensor:
    """Straight from the formula, one head at a time, with explicit row ranges."""
    p, r, v = g.qk_nope_head_dim, g.qk_rope_head_dim, g.v_head_dim
    q_b, kv_b = q_b.double(), kv_b.double()
    w_qb_nope = q_b[h * (p + r) : h * (p + r) + p]  # [P, Lq]
    w_qb_pe = q_b[h * (p + r) + p : (h + 1) * (p + r)]  # [R, Lq]
    w_uk = kv_b[h * (p + v) : h * (p + v) + p]  # [P, L]
    return torch.cat([w_uk.T @ w_qb_nope, w_qb_pe])  # [L+R, Lq]


@pytest.mark.parametrize("geometry", [TINY, K3_HEADS], ids=["tiny", "k3-heads"])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_fold_matches_fp64_reference_per_head(geometry: Geometry, out_dtype: torch.dtype) -> None:
    q_b, kv_b = random_weights(geometry)
    fold = fold_layer(q_b, kv_b, geometry, out_dtype).reshape(geometry.num_heads, geometry.fold_head_dim, -1)
    assert fold.dtype == out_dtype
    for h in range(geometry.num_heads):
        reference = fp64_fold_of_head(q_b, kv_b, geometry, h)
        error = (fold[h].double() - reference).norm() / reference.norm()
        assert error < ROUNDING_TOLERANCE[out_dtype], f"head {h}: {error}"
        # The rope rows are copied, not computed: exact.
        assert torch.equal(
            fold[h, geometry.kv_lora_rank :],
            q_b.reshape(geometry.num_heads, -1, geometry.q_lora_rank)[h, geometry.qk_nope_head_dim :].to(out_dtype),
        )


def test_fold_reproduces_the_two_step_query_on_random_inputs() -> None:
    g = K3_HEADS
    q_b, kv_b = random_weights(g, seed=1, dtype=torch.float32)
    fold = fold_layer(q_b, kv_b, g, torch.float32)
    x = torch.randn(5, g.q_lora_rank, dtype=torch.float64)
    p, r, v = g.qk_nope_head_dim, g.qk_rope_head_dim, g.v_head_dim
    q = (x @ q_b.double().T).reshape(5, g.num_heads, p + r)
    w_uk = kv_b.double().reshape(g.num_heads, p + v, g.kv_lora_rank)[:, :p]
    expected = torch.cat([torch.einsum("thp,hpl->thl", q[..., :p], w_uk), q[..., p:]], dim=-1)
    got = (x @ fold.double().T).reshape(5, g.num_heads, g.fold_head_dim)
    assert ((got - expected).norm() / expected.norm()).item() < 1e-6
    assert probe_error(fold, q_b, kv_b, g) < 1e-6


def test_fold_error_reports_a_corrupted_head() -> None:
    q_b, kv_b = random_weights(TINY)
    fold = fold_layer(q_b, kv_b, TINY, torch.float32)
    assert fold_error(fold, q_b, kv_b, TINY, (0, 7)).rel_fro_error < 1e-6
    fold[7 * TINY.fold_head_dim + 3, 5] += 1.0
    assert fold_error(fold, q_b, kv_b, TINY, (7,)).max_abs_error == pytest.approx(1.0, rel=1e-3)
    assert probe_error(fold, q_b, kv_b, TINY) > 1e-4


def _expected_error(
    stored: torch.Tensor,
    q_b: torch.Tensor,
    kv_b: torch.Tensor,
    g: Geometry,
    heads: tuple[int, ...],
    scale: torch.Tensor | None,
) -> tuple[dict[str, float], float]:
    """Per row group the worst head's relative Frobenius error, and max |difference|, straight from
    the definitions."""
    values = stored.double().reshape(g.num_heads, g.fold_head_dim, -1)
    if scale is not None:
        values = values * scale.double().reshape(g.num_heads, g.fold_head_dim, 1)
    diffs = torch.stack([values[h] - fp64_fold_of_head(q_b, kv_b, g, h) for h in heads])
    refs = torch.stack([fp64_fold_of_head(q_b, kv_b, g, h) for h in heads])
    lora = g.kv_lora_rank
    rows = {
        "ql_nope": (diffs[:, :lora].norm(dim=(1, 2)) / refs[:, :lora].norm(dim=(1, 2))).max().item(),
        "q_pe": (diffs[:, lora:].norm(dim=(1, 2)) / refs[:, lora:].norm(dim=(1, 2))).max().item(),
    }
    return rows, diffs.abs().max().item()


def test_fold_error_is_its_definition_from_call_to_call_and_geometry_to_geometry() -> None:
    """fold_error keeps its fp64 buffers between calls (per thread): calls on two geometries in
    turn, with and without per-row scales, must each give what the definition gives (a buffer
    sized for the other geometry, or rows left from the head before, would not)."""
    for round_ in range(2):
        for g in (K3_HEADS, TINY):
            q_b, kv_b = random_weights(g, seed=round_)
            fold = fold_layer(q_b, kv_b, g, torch.float32)
            fold += torch.randn(fold.shape, generator=torch.Generator().manual_seed(5)) * 1e-3
            scale = torch.rand(g.fold_shape[0], generator=torch.Generator().manual_seed(6)) + 0.5
            heads = (0, g.num_heads - 1)
            for stored, row_scale in ((fold, None), (fold / scale[:, None], scale)):
                error = fold_error(stored, q_b, kv_b, g, heads, row_scale)
                rows, max_abs = _expected_error(stored, q_b, kv_b, g, heads, row_scale)
                assert error.rows == pytest.approx(rows, rel=1e-9) and error.max_abs_error == pytest.approx(
                    max_abs, rel=1e-9
                )
                assert rows["ql_nope"] > 1e-4 and rows["q_pe"] > 1e-4  # the noise is seen in both groups


def test_the_recorded_error_figures_do_not_move_with_the_last_bits_of_the_fp64_fold() -> None:
    """What the manifest records of a fold's error, to 4 significant digits: the figures one fp8
    fold gave on one Intel CPU through MKL's AVX-512 and its AVX2 path (fp64 folds a few ulps
    apart) must record the same, or the manifest's sha256 depends on the machine; NaN is null."""
    avx512 = FoldError((0, 2), 0.02707483563067706, 0.0146484375, {"ql_nope": 0.025223274586101217}, 2)
    avx2 = FoldError((0, 2), 0.027074835630677058, 0.014648437500000002, {"ql_nope": 0.025223274586101237}, 2)
    recorded = {
        "heads": [0, 2],
        "rel_fro_error": 0.02707,
        "rel_fro_error_rows": {"ql_nope": 0.02522},
        "worst_head": 2,
        "max_abs_error": 0.01465,
    }
    assert avx512.to_dict() == avx2.to_dict() == recorded
    nan = FoldError((0,), math.nan, math.nan, {"ql_nope": math.nan, "q_pe": 2.5278295125998895e-08}, 0).to_dict()
    assert nan["rel_fro_error"] is None and nan["rel_fro_error_rows"] == {"ql_nope": None, "q_pe": 2.528e-08}


def test_fold_error_measures_the_ql_nope_and_q_pe_rows_apart() -> None:
    """A fold whose ql_nope rows are 30% off behind exact, 100x larger q_pe rows: one norm over
    the head (the old measure) saw about 3e-4; each group's own norm sees the 30%."""
    q_b, kv_b = random_weights(TINY, dtype=torch.float32)
    q_b = q_b.reshape(TINY.num_heads, -1, TINY.q_lora_rank)
    q_b[:, TINY.qk_nope_head_dim :] *= 100  # large q_pe rows; ql_nope is unchanged
    q_b = q_b.reshape(TINY.q_b_proj_shape)
    fold = fold_layer(q_b, kv_b, TINY, torch.float32).reshape(TINY.num_heads, TINY.fold_head_dim, -1)
    fold[:, : TINY.kv_lora_rank] *= 0.7
    error = fold_error(fold.reshape(TINY.fold_shape), q_b, kv_b, TINY, (0, 7))
    assert error.rows["ql_nope"] == pytest.approx(0.3, rel=1e-4) and error.rows["q_pe"] < 1e-7
    assert error.rel_fro_error == error.rows["ql_nope"] and error.worst_rows == "ql_nope"
    # independently: the relative error of the whole heads, which the old measure reported
    whole = torch.stack([fold[h].double() - fp64_fold_of_head(q_b, kv_b, TINY, h) for h in (0, 7)]).norm()
    assert whole / torch.stack([fp64_fold_of_head(q_b, kv_b, TINY, h) for h in (0, 7)]).norm() < 0.01


def with_one_head_scaled(q_b: torch.Tensor, g: Geometry, head: int, factor: float) -> torch.Tensor:
    """``q_b`` with head ``head``'s W_qb_nope rows times ``factor`` (in fp64, rounded once)."""
    heads = q_b.double().reshape(g.num_heads, -1, g.q_lora_rank).clone()
    heads[head, : g.qk_nope_head_dim] *= factor
    return heads.reshape(g.q_b_proj_shape).to(q_b.dtype)


def test_fold_error_judges_each_head_on_its_own() -> None:
    """One head's ql_nope rows 1% off, its weights 1e-4 times its neighbours': in one norm over the
    heads (the old measure) its error weighs 1e-8 of theirs; on its own it is the 1%."""
    q_b, kv_b = random_weights(TINY, dtype=torch.float32)
    q_b = with_one_head_scaled(q_b, TINY, 3, 1e-4)
    fold = fold_layer(q_b, kv_b, TINY, torch.float32).reshape(TINY.num_heads, TINY.fold_head_dim, -1)
    fold[3, : TINY.kv_lora_rank] *= 1.01
    error = fold_error(fold.reshape(TINY.fold_shape), q_b, kv_b, TINY, tuple(range(TINY.num_heads)))
    assert (
        error.rel_fro_error == pytest.approx(0.01, rel=1e-3) and error.worst_head == 3 and error.worst_rows == "ql_nope"
    )
    assert error.heads == tuple(range(TINY.num_heads))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16])
def test_every_head_beyond_one_rounding_is_an_underflow_suspect(out_dtype: torch.dtype) -> None:
    """The screen convert runs on every head (the fp64 error is measured on a sample only): one
    head's weights scaled down through the fold dtype's normal range into its subnormals, each head
    whose fp64 error (measured here, independently) exceeds the tolerance must be flagged, and a
    head of ordinary weights must not be (it would cost an fp64 check of every head)."""
    q_b, kv_b = random_weights(TINY, dtype=torch.float32)
    rms = fp64_fold_of_head(q_b, kv_b, TINY, 3)[: TINY.kv_lora_rank].pow(2).mean().sqrt().item()
    beyond = flagged = 0
    for exponent in range(48):  # the head's ql_nope RMS from 256 times the dtype's smallest normal down
        factor = torch.finfo(out_dtype).tiny / rms * 2.0 ** (8 - exponent / 2)
        scaled = with_one_head_scaled(q_b, TINY, 3, factor)
        fold = fold_layer(scaled, kv_b, TINY, out_dtype).reshape(TINY.num_heads, TINY.fold_head_dim, -1)
        suspects = underflow_suspects(fold, TINY)
        assert not set(suspects) - {3}, (factor, suspects)
        reference = fp64_fold_of_head(scaled, kv_b, TINY, 3)[: TINY.kv_lora_rank]
        error = ((fold[3, : TINY.kv_lora_rank].double() - reference).norm() / reference.norm()).item()
        if error > ROUNDING_TOLERANCE[out_dtype]:
            beyond += 1
            assert suspects == [3], (factor, error)
        flagged += suspects == [3]
    assert beyond >= 5 and flagged < beyond + 12  # the sweep crosses the boundary; the screen is not all-flagging


def test_an_all_zero_layer_folds_exactly_with_zero_errors() -> None:
    """Zero weights give a zero fold, whose relative errors are defined as 0 (the probe divided by
    the reference's norm, 0, and called the exact fold NaN)."""
    q_b, kv_b = torch.zeros(TINY.q_b_proj_shape), torch.zeros(TINY.kv_b_proj_shape)
    fold = fold_layer(q_b, kv_b, TINY, torch.bfloat16)
    assert not fold.any()
    assert fold_error(fold, q_b, kv_b, TINY, (0, 7)).rel_fro_error == 0.0
    assert probe_error(fold, q_b, kv_b, TINY) == 0.0


@pytest.mark.parametrize("tp", [1, 2, 4, 8])
def test_tp_row_slices_are_exactly_each_ranks_heads(tp: int) -> None:
    g = TINY
    q_b, kv_b = random_weights(g, seed=2)
    fold = fold_layer(q_b, kv_b, g)
    local = replace(g, num_heads=g.num_heads // tp)
    q_rows, kv_rows = q_b.shape[0] // tp, kv_b.shape[0] // tp
    for rank in range(tp):
        start, stop = g.rank_rows(tp, rank)
        # What rank r computes from ITS q_b_proj / kv_b_proj shards (vLLM's ColumnParallelLinear split).
        expected = fold_layer(
            q_b[rank * q_rows : (rank + 1) * q_rows], kv_b[rank * kv_rows : (rank + 1) * kv_rows], local
        )
        assert torch.equal(fold[start:stop], expected)


def test_rank_rows_rejects_sizes_that_do_not_divide_the_heads() -> None:
    with pytest.raises(FoldckptError, match="does not divide"):
        TINY.rank_rows(3, 0)


def test_fp8_block_dequantization_applies_each_blocks_scale() -> None:
    weight = torch.ones(200, 300).to(torch.float8_e4m3fn)
    scale = torch.arange(1, 7, dtype=torch.float32).reshape(2, 3)
    out = dequantize_fp8_blocks(weight, scale, (128, 128), "w")
    assert out.dtype == torch.float32
    assert out[0, 0] == 1 and out[127, 127] == 1 and out[128, 0] == 4 and out[199, 299] == 6 and out[5, 256] == 3
    with pytest.raises(FoldckptError, match="w_scale_inv"):
        dequantize_fp8_blocks(weight, scale[:1], (128, 128), "w")


def test_sample_heads_spreads_and_includes_both_ends() -> None:
    assert sample_heads(96) == (0, 32, 63, 95)
    assert sample_heads(3) == (0, 1, 2)


@pytest.mark.parametrize(
    ("fold_dtype", "value", "overflows"),
    [
        ("float16", 2000.0, False),  # P·a·b = 2000: far inside fp16
        ("float16", 70000.0, True),  # every product 70000/P fits fp16, their sum does not
        ("bfloat16", 1e38, False),  # bf16 has fp32's range
        ("fp8", 1e38, False),  # e4m3 values are scaled into range; the fp32 scales hold it
        ("bfloat16", 1e39, True),  # the fp32 sums themselves overflow
    ],
)
def test_a_fold_is_proved_finite_only_where_no_sum_can_overflow(fold_dtype: str, value: float, overflows: bool) -> None:
    """convert skips scanning a fold for Inf only where its inputs prove it finite. Constant inputs
    make every W_UKᵀ·W_qb_nope element exactly P·a·b = ``value``; a bound that forgot the sum over
    P (or the dtype's range) would call the 70000 fold safe."""
    from foldckpt.convert.layer import LayerInputs

    g = TINY
    factor = (value / g.qk_nope_head_dim) ** 0.5
    q_b = torch.full(g.q_b_proj_shape, factor)
    kv_b = torch.full(g.kv_b_proj_shape, factor)
    inputs = LayerInputs(q_b, kv_b, (), factor, factor)
    fold = fold_layer(q_b, kv_b, g, torch.float16 if fold_dtype == "float16" else torch.float32)
    assert bool(torch.isfinite(fold).all()) is not overflows  # what the skipped scan would have found
    assert inputs.fold_cannot_overflow(g, fold_dtype) is not overflows
    assert not replace(inputs, q_b_abs_max=float("nan")).fold_cannot_overflow(g, fold_dtype)


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
def test_fp8_row_scales_are_the_row_maximum_divided_by_448_rounded_once(device: str) -> None:
    """Each row's scale is ``amax / 448`` correctly rounded to fp32 on any device (an fp64 quotient
    of fp32 values rounded to fp32 is: 53 >= 2·24 + 2 bits), and each value ``exact / scale``
    rounded once to e4m3. Kills a multiplication by the reciprocal of 448, which rounds about half
    of the quotients the other way, and which torch's CUDA kernels substitute for a division by a
    Python number: a GPU-folded fp8 checkpoint then differed from the CPU's."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    exact = torch.randn(64, 96, generator=torch.Generator().manual_seed(3)) * 7
    values, scale = quantize_fp8_rows(exact.to(device))
    expected_scale = (exact.double().abs().amax(-1) / 448).float()
    assert torch.equal(scale.cpu().view(torch.int32), expected_scale.view(torch.int32))
    expected = (exact.double() / expected_scale.double().unsqueeze(-1)).float().clamp(-448, 448)
    assert torch.equal(values.cpu().view(torch.uint8), expected.to(torch.float8_e4m3fn).view(torch.uint8))
