"""Every stored fold element is its exact value rounded once, whatever order sums it.

The reference is written here, independently of :mod:`foldckpt.rounding`: the exact sum as a
``fractions.Fraction``, and its rounding picked among the nearest values of the dtype by exact
distance (ties to the even bit pattern), with no integer rounding code shared.
"""

from __future__ import annotations

import math
from dataclasses import replace
from fractions import Fraction

import pytest
import torch

from foldckpt.fold import fold_layer, fold_layer_fp8, quantize_fp8_rows
from foldckpt.model.geometry import Geometry, MLALayer
from foldckpt.rounding import (
    _bound_factor,
    _fp32_suspects,
    _narrow_suspects,
    round_exact_products_into,
    round_to_nearest_even,
)

BITS = {torch.bfloat16: torch.int16, torch.float16: torch.int16, torch.float32: torch.int32}

# W_qb_nope's first column: the terms below are these times each row's values.
COLUMN = (1.0, 1.0, 2.0**-30, 1.0)
BF16_MAX = torch.finfo(torch.bfloat16).max
# Rows of W_UKᵀ (P = 4), each sum crafted against a rounding boundary: exactly on a bf16 tie
# (1 + 2^-8 rounds to even 1, 1 + 3·2^-8 up), or off it by 2^-60, which no fp64 sum of these terms
# keeps (1 + 2^-8 + 2^-60 needs 61 bits), or an fp32 or fp16 tie, a bf16 subnormal tie (3.5·2^-133), the
# overflow threshold, zeros from cancellation and of -0 terms (+0 whatever the order), and 2^-40
# next to ±2^30, which fp64 sums in the usual orders lose.
CRAFTED = (
    (1.0, 2.0**-8, 0.0, 0.0),
    (1.0 + 2.0**-7, 2.0**-8, 0.0, 0.0),
    (1.0, 2.0**-8, 2.0**-30, 0.0),
    (1.0, 2.0**-8, -(2.0**-30), 0.0),
    (-1.0, -(2.0**-8), -(2.0**-30), 0.0),
    (1.0, -1.0, 2.0**-30, 0.0),
    (1.0, 2.0**-24, 0.0, 0.0),
    (1.0, 2.0**-24, 2.0**-30, 0.0),
    (1.0, 2.0**-11, 0.0, -(2.0**-30)),
    (3 * 2.0**-133, 0.0, 2.0**-104, 0.0),
    (BF16_MAX, 2.0**119, 0.0, 0.0),
    (BF16_MAX, 2.0**119, -(2.0**-30), 0.0),
    (1.0, -1.0, 0.0, 0.0),
    (-(2.0**-8), 2.0**-8, -0.0, -0.0),
    (1024.0, 2.0**-15, 2.0**-20, -1024.0),
    (3.0, 2.0**-7, 2.0**-30, 2.0**-6),
    (2.0**30, 2.0**-40, -(2.0**60), 0.0),
    (-0.0, -0.0, -0.0, -0.0),
)

ONE_HEAD = Geometry(
    "deepseek",
    "DeepseekV3ForCausalLM",
    num_heads=1,
    q_lora_rank=2,
    kv_lora_rank=len(CRAFTED),
    qk_nope_head_dim=4,
    qk_rope_head_dim=1,
    v_head_dim=1,
    layers=(MLALayer(0, "model.layers.0"),),
)
# Kimi-K3's per-head dimensions (fewer heads to stay fast).
K3_HEADS = replace(
    ONE_HEAD, num_heads=4, q_lora_rank=1536, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128
)


def significand_bits(dtype: torch.dtype) -> int:
    """``dtype``'s significand bits, the implicit one included (bf16 8, fp16 11, fp32 24)."""
    return 1 - int(math.log2(torch.finfo(dtype).eps))


def correctly_rounded(exact: Fraction, dtype: torch.dtype) -> torch.Tensor:
    """``exact`` rounded to nearest ``dtype`` value, ties to the even bit pattern, +inf/-inf past the
    largest value by half an ulp or more: the candidates are the value torch gives for the nearest
    double and its two neighbours, judged by exact distance."""
    if exact == 0:
        return torch.zeros((), dtype=dtype)
    top = torch.tensor(torch.finfo(dtype).max, dtype=dtype)
    below = torch.nextafter(top, torch.zeros_like(top))
    threshold = Fraction(top.item()) + (Fraction(top.item()) - Fraction(below.item())) / 2
    if abs(exact) >= threshold:
        return torch.tensor(float("inf") if exact > 0 else float("-inf"), dtype=dtype)
    guess = torch.tensor(float(exact), dtype=torch.float64).to(dtype)
    candidates = [
        guess,
        torch.nextafter(guess, guess.new_tensor(float("inf"))),
        torch.nextafter(guess, guess.new_tensor(float("-inf"))),
    ]
    candidates = [c for c in candidates if c.isfinite()]

    def key(candidate: torch.Tensor) -> tuple[Fraction, int]:
        return abs(Fraction(candidate.item()) - exact), int(candidate.view(BITS[dtype]).item()) & 1

    return min(candidates, key=key)


def exact_fold(q_b: torch.Tensor, kv_b: torch.Tensor, g: Geometry, head: int, row: int, col: int) -> Fraction:
    """W_UK[h]ᵀ·W_qb_nope[h] at (row, col), exactly, straight from the row ranges of the formula."""
    p, r, v = g.qk_nope_head_dim, g.qk_rope_head_dim, g.v_head_dim
    w_qb_nope = q_b[head * (p + r) : head * (p + r) + p, col].tolist()
    w_uk = kv_b[head * (p + v) : head * (p + v) + p, row].tolist()
    return sum((Fraction(a) * Fraction(b) for a, b in zip(w_uk, w_qb_nope, strict=True)), Fraction(0))


def crafted_weights(dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
    """ONE_HEAD's q_b_proj and kv_b_proj holding CRAFTED (column 0) and random values (column 1)."""
    g = ONE_HEAD
    q_b = torch.zeros(g.q_b_proj_shape, dtype=torch.float64)
    q_b[: g.qk_nope_head_dim, 0] = torch.tensor(COLUMN)
    q_b[: g.qk_nope_head_dim, 1] = torch.randn(g.qk_nope_head_dim, generator=torch.Generator().manual_seed(0)).to(dtype)
    q_b[g.qk_nope_head_dim :] = 0.5
    kv_b = torch.zeros(g.kv_b_proj_shape, dtype=torch.float64)
    kv_b[: g.qk_nope_head_dim] = torch.tensor(CRAFTED).T
    assert bool((q_b.to(dtype).double() == q_b).all() and (kv_b.to(dtype).double() == kv_b).all()), "inexact inputs"
    return q_b.to(dtype), kv_b.to(dtype)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_sums_on_and_next_to_a_rounding_tie_are_the_exact_sum_rounded_once(out_dtype: torch.dtype) -> None:
    """Ties, sums 2^-60 off a tie (which fp64 loses), cancellation, subnormals and overflow: each
    element equals the Fraction sum rounded once. Kills: an fp64 or fp32 sum rounded as it is (the
    2^-60 cases), rounding through fp32 (double rounding), ties away from zero, a zero's sign taken
    from the sum's order, and skipping the exact settlement of the undecided elements."""
    q_b, kv_b = crafted_weights(torch.bfloat16)
    fold = fold_layer(q_b, kv_b, ONE_HEAD, out_dtype)
    for row in range(ONE_HEAD.kv_lora_rank):
        for col in range(ONE_HEAD.q_lora_rank):
            exact = exact_fold(q_b, kv_b, ONE_HEAD, 0, row, col)
            expected = correctly_rounded(exact, out_dtype)
            got = fold[row, col]
            assert got.view(BITS[out_dtype]) == expected.view(BITS[out_dtype]), (
                row,
                col,
                float(exact),
                got.item(),
                expected.item(),
            )


def test_fp32_inputs_are_summed_exactly_too() -> None:
    """fp8 sources are dequantized to fp32: the fold of fp32 inputs is their exact sum rounded once."""
    q_b, kv_b = crafted_weights(torch.bfloat16)
    q_b, kv_b = q_b.float(), kv_b.float()
    q_b[: ONE_HEAD.qk_nope_head_dim, 1] = torch.tensor([1 + 2.0**-23, 3 - 2.0**-22, 2.0**-30, 1.0 / 3])
    fold = fold_layer(q_b, kv_b, ONE_HEAD, torch.bfloat16)
    for row in range(ONE_HEAD.kv_lora_rank):
        for col in range(ONE_HEAD.q_lora_rank):
            expected = correctly_rounded(exact_fold(q_b, kv_b, ONE_HEAD, 0, row, col), torch.bfloat16)
            assert fold[row, col].view(torch.int16) == expected.view(torch.int16), (row, col)


def _random_weights(g: Geometry, seed: int, dtype: torch.dtype = torch.bfloat16) -> tuple[torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(seed)
    q_b = torch.randn(g.q_b_proj_shape, generator=generator) / g.q_lora_rank**0.5
    kv_b = torch.randn(g.kv_b_proj_shape, generator=generator) / g.kv_lora_rank**0.5
    return q_b.to(dtype), kv_b.to(dtype)


def _near_ties_and_a_sample(
    q_b: torch.Tensor, kv_b: torch.Tensor, g: Geometry, dtype: torch.dtype
) -> list[tuple[int, int, int]]:
    """(head, row, col) of elements whose fp64 value lies within 2^-22 of an ulp from a tie of ``dtype``
    (where a wrong rounding would hide; 400 of them at most, chosen at random: an fp32 tie is exact
    in a tenth of the elements), and of a random sample of the others."""
    p = g.qk_nope_head_dim
    q_heads, kv_heads = (
        q_b.double().reshape(g.num_heads, -1, g.q_lora_rank),
        kv_b.double().reshape(g.num_heads, -1, g.kv_lora_rank),
    )
    fp64 = torch.bmm(kv_heads[:, :p].transpose(1, 2), q_heads[:, :p])
    _, exponent = torch.frexp(fp64)
    ulp = torch.ldexp(torch.ones_like(fp64), exponent - (1 - int(torch.finfo(dtype).eps.hex().split("p")[1])))
    offset = torch.remainder(fp64, ulp) / ulp  # where in its ulp, 0.5 a tie
    near = torch.nonzero((offset - 0.5).abs() < 2.0**-22)
    generator = torch.Generator().manual_seed(1)
    near = near[torch.randperm(len(near), generator=generator)[:400]].tolist()
    sample = torch.randint(0, fp64.numel(), (300,), generator=generator)
    return near + [list(divmod_all(i, fp64.shape)) for i in sample.tolist()]


def divmod_all(index: int, shape: torch.Size) -> tuple[int, ...]:
    coordinates = []
    for size in reversed(shape):
        index, coordinate = divmod(index, size)
        coordinates.append(coordinate)
    return tuple(reversed(coordinates))


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float32])
def test_every_element_of_a_kimi_k3_head_fold_is_its_exact_value_rounded_once(out_dtype: torch.dtype) -> None:
    """On Kimi-K3's head shapes with random bf16 weights: the elements next to a tie (where a
    rounding from an fp32 sum or through fp32 goes wrong) and a sample of the rest."""
    g = K3_HEADS
    q_b, kv_b = _random_weights(g, seed=3)
    fold = fold_layer(q_b, kv_b, g, out_dtype).reshape(g.num_heads, g.fold_head_dim, g.q_lora_rank)
    checked = _near_ties_and_a_sample(q_b, kv_b, g, out_dtype)
    assert len(checked) > 320  # some near ties, or the test shows little
    for head, row, col in checked:
        expected = correctly_rounded(exact_fold(q_b, kv_b, g, head, row, col), out_dtype)
        assert fold[head, row, col].view(BITS[out_dtype]) == expected.view(BITS[out_dtype]), (head, row, col)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32, "fp8"])
def test_the_fold_is_the_same_bytes_whatever_order_sums_it(out_dtype: torch.dtype | str) -> None:
    """The nope dimensions of a head permuted alike in W_UK and W_qb_nope: the same exact fold,
    summed by the GEMM in another order (fp64 sums that differ in their last bits). Kills a fold
    rounded from its fp32 or fp64 sum as it is: another order then rounds some elements apart."""
    g = K3_HEADS
    q_b, kv_b = _random_weights(g, seed=4)
    p, r, v = g.qk_nope_head_dim, g.qk_rope_head_dim, g.v_head_dim
    order = torch.randperm(p, generator=torch.Generator().manual_seed(5))
    q_heads, kv_heads = q_b.reshape(g.num_heads, p + r, -1).clone(), kv_b.reshape(g.num_heads, p + v, -1).clone()
    q_heads[:, :p], kv_heads[:, :p] = q_heads[:, order], kv_heads[:, order]
    permuted = q_heads.reshape(q_b.shape), kv_heads.reshape(kv_b.shape)
    if out_dtype == "fp8":
        for one, other in zip(fold_layer_fp8(q_b, kv_b, g), fold_layer_fp8(*permuted, g), strict=True):
            assert torch.equal(one.view(torch.uint8), other.view(torch.uint8))
        return
    one, other = fold_layer(q_b, kv_b, g, out_dtype), fold_layer(*permuted, g, out_dtype)
    assert torch.equal(one.view(BITS[out_dtype]), other.view(BITS[out_dtype]))


def test_the_fp8_fold_is_quantized_from_the_exactly_rounded_fp32_fold() -> None:
    """The fp8 definition: per row, quantize_fp8_rows of the fp32 fold (each element its exact value
    rounded once to fp32), the ql_nope and q_pe rows apart. Kills an fp8 fold quantized from an fp32
    or fp64 sum as it is."""
    g = K3_HEADS
    q_b, kv_b = _random_weights(g, seed=6)
    fp32 = fold_layer(q_b, kv_b, g, torch.float32)
    values, scale = fold_layer_fp8(q_b, kv_b, g)
    expected_values, expected_scale = quantize_fp8_rows(fp32)
    assert torch.equal(values.view(torch.uint8), expected_values.view(torch.uint8))
    assert torch.equal(scale, expected_scale)


def _adversarial_head(kind: str, p: int, lora: int, cols: int, generator: torch.Generator) -> tuple[torch.Tensor, ...]:
    """One head's ``a_t [P, L]`` and ``b [P, Lq]`` (fp64 holding bf16 values) of one kind: small
    integers (their sums land on bf16, fp16 and fp32 ties, exactly), those plus ±2^-50 terms (off
    the ties by less than fp64 keeps next to them), values over 80 binades (sums that fp64
    rounds), subnormal products, ±2^60 products cancelling over small ones (fp64 loses the small
    ones in some orders), and zero rows and columns."""

    def ints(rows: int, width: int, bound: int) -> torch.Tensor:
        return torch.randint(-bound, bound + 1, (rows, width), generator=generator).double()

    a, b = ints(p, lora, 15), ints(p, cols, 31)
    if kind == "off_ties":
        a[-1], b[-1] = 2.0**-25, 2.0**-25 * torch.sign(ints(1, cols, 1)[0])
    elif kind == "wide":
        a, b = a * 2.0 ** (ints(p, lora, 40) - 20), b * 2.0 ** (ints(p, cols, 40) - 10)
    elif kind == "subnormal":
        a, b = a * 2.0**-70, b * 2.0**-66
    elif kind == "cancel":
        a[0], a[-1], b[0], b[-1] = 2.0**30, 2.0**30, 2.0**30, -(2.0**30)  # apart: no order adds them first
    elif kind == "zeros":
        a[:, ::3], b[:, ::4] = 0.0, 0.0
    return a, b


@pytest.mark.parametrize("device", ["cpu", pytest.param("cuda", marks=pytest.mark.gpu)])
@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
@pytest.mark.parametrize("in_dtype", [torch.bfloat16, torch.float32])
def test_every_element_of_adversarial_heads_is_its_exact_value_rounded_once(
    out_dtype: torch.dtype, in_dtype: torch.dtype, device: str
) -> None:
    """Heads of every kind of :func:`_adversarial_head` in one call, each element against its
    Fraction sum rounded once, computed on the CPU and on a GPU (its GEMMs and reductions, its
    int16 views). Kills: no boundary test in the bulk certificate (the ±2^-50 terms), no
    small-value test (the cancelling ±2^60 products), and any rounding of an fp64 or fp32 sum as
    it is."""
    if device == "cuda" and not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    kinds = ("ties", "off_ties", "wide", "subnormal", "cancel", "zeros")
    generator = torch.Generator().manual_seed(7)
    heads = [_adversarial_head(kind, 16, 24, 40, generator) for kind in kinds]
    a_t = torch.stack([a for a, _ in heads]).to(in_dtype)
    b = torch.stack([b for _, b in heads]).to(in_dtype)
    out = torch.empty(len(kinds), 24, 40, dtype=out_dtype)
    round_exact_products_into(out, a_t.to(device), b.to(device), {})
    a_exact, b_exact = a_t.double().tolist(), b.double().tolist()
    for head, kind in enumerate(kinds):
        for row in range(24):
            for col in range(40):
                terms = zip((line[row] for line in a_exact[head]), (line[col] for line in b_exact[head]), strict=True)
                exact = sum((Fraction(left) * Fraction(right) for left, right in terms), Fraction(0))
                expected = correctly_rounded(exact, out_dtype).view(BITS[out_dtype])
                assert out[head, row, col].view(BITS[out_dtype]) == expected, (kind, row, col, float(exact))


def _needs_settling(y: float, beta: float, dtype: torch.dtype) -> bool:
    """What the bulk lemma (rounding.py's step 3) leaves to the suspects, decided in exact arithmetic:
    ``|y| < 2^26·β``, ``y`` below fp32's smallest normal number (or fp16's, for fp16), or ``y`` a
    rounding boundary of ``dtype``, a value halfway between two neighbours on its grid (the
    overflow threshold included: it is the midpoint past the largest value)."""
    info = torch.finfo(dtype)
    floor = max(torch.finfo(torch.float32).smallest_normal, info.smallest_normal)
    if Fraction(abs(y)) < Fraction(2) ** 26 * Fraction(beta) or abs(y) < floor:
        return True
    exponent = math.frexp(abs(y))[1] - 1  # |y| in [2^exponent, 2^(exponent+1))
    quantum = Fraction(2) ** (exponent - significand_bits(dtype) + 1)
    return (Fraction(abs(y)) / quantum) % 1 == Fraction(1, 2) and abs(y) <= info.max + quantum / 2


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_the_bulk_certificate_leaves_every_element_the_lemma_does_not_cover(dtype: torch.dtype) -> None:
    """Rows of fp32 values against their row's bound, around each edge of the lemma: ``|y|`` one fp32
    step either side of ``2^26·β``, where ``2^26·β`` rounds down to fp32, boundaries, values below
    the floors, and plain values well inside; every element :func:`_needs_settling` says the lemma
    does not cover is a suspect, and a row of plain values gives none. Kills: a threshold of 2^25·β,
    ``2^26·β`` rounded to fp32 to nearest (below it, by up to half an fp32 ulp), the floor at bf16's
    least subnormal or at fp32's for fp16 too, the boundary bits shifted by one, and no boundary
    test."""
    tie = 1 + 2.0 ** (int(math.log2(torch.finfo(dtype).eps)) - 1)  # halfway from 1 to its neighbour
    edge = 2.0**-40 * 2**26
    down = 1.0 + 2.0**-30  # 2^26·β for β = down·2^-26 rounds down to fp32's 1.0
    beta = torch.tensor([[2.0**-40, down * 2.0**-26, 2.0**-200, 2.0**-60, 2.0**-60]], dtype=torch.float64)
    rows = [
        [edge, math.nextafter(edge, 0), -math.nextafter(edge, 0), math.nextafter(edge, 1), 3.0, -0.75],
        [1.0, -1.0, 1.0 + 2.0**-23, 2.0, 0.5, 3.0],
        [2.0**-127, 2.0**-126, 2.0**-15, 2.0**-14, 2.0**-149, 0.0],
        [tie, -tie, 2 * tie, tie / 1024, tie + 2.0**-23, 1.5],
        [1.0 + 2.0**-23 * k for k in range(1, 7)],
    ]
    y = torch.tensor([rows], dtype=torch.float32)
    flagged = {(row, col) for _, row, col in _narrow_suspects(y, beta, dtype, {}).tolist()}
    for row, values in enumerate(y[0].tolist()):
        for col, value in enumerate(values):
            if _needs_settling(value, beta[0, row].item(), dtype):
                assert (row, col) in flagged, (row, col, value)
    assert not any(row == 4 for row, _ in flagged)  # plain values: no work for the settlement


def _scaled(m: int, k: int) -> Fraction:
    """``m·2^k`` exactly."""
    return Fraction(m) * Fraction(2) ** k


def _integer_rounding_cases(dtype: torch.dtype, generator: torch.Generator) -> list[tuple[int, int]]:
    """``(m, k)`` pairs for ``m·2^k`` at the edges of ``dtype``'s grid: quarter steps of the local
    spacing around its least subnormal, its smallest normal number (where the spacing stops
    shrinking) and its largest value (the overflow threshold is 2 quarters past it); at random
    exponents from the least subnormal to past the largest value, values on the grid (``m`` as
    wide as the grid, or with zeros below; the integer rounding's shifts of 0, 1 and 3), ties
    (the only bit dropped is the half), ties off by 2^-60 of an ulp, and wide integers (also below
    the least subnormal), of either sign."""
    info, bits = torch.finfo(dtype), significand_bits(dtype)
    emin, emax = int(math.log2(info.smallest_normal)), int(math.log2(info.max))
    least = emin - bits + 1  # the exponent of the least subnormal, and the spacing below 2^(emin+1)
    anchors = ((1, least), (1 << (bits - 1), least), ((1 << bits) - 1, emax - bits + 1))
    cases = [(4 * m + step, k - 2) for m, k in anchors for step in range(-6, 7)]

    def draw(high: int) -> int:
        return int(torch.randint(0, high, (), generator=generator))

    for _ in range(60):
        exponent = least + draw(emax - least + 2)  # of the leading bit
        spacing = max(exponent, emin) - bits + 1
        kept = (1 << (exponent - spacing)) | draw(1 << (exponent - spacing))  # the leading bit set
        sign = 1 - 2 * draw(2)
        for off in (-1, 0, 1):
            cases.append((sign * (((2 * kept + 1) << 60) + off), spacing - 61))
        cases += [(sign * kept, spacing), (sign * (2 * kept + 1), spacing - 1), (sign * kept << 3, spacing - 3)]
        wide = (1 << 70) | draw(1 << 62) << 8 | draw(256)
        cases.append((sign * wide, exponent - 70 - draw(4)))
    return cases + [(0, 0), (-3, 0)]


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_integer_rounding_is_the_exact_value_rounded_once(dtype: torch.dtype) -> None:
    """:func:`round_to_nearest_even` settles the elements no bound can (the module's step 5): each
    ``m·2^k`` against the Fraction reference, bit for bit. Kills: the spacing taken from the
    leading bit alone below the smallest normal number (fp16 3·2^-26 then comes out 4.47e-8, not
    5.96e-8), that number's exponent off by one either way, ties away from zero and overflow at
    the largest value instead of half an ulp past it."""
    generator = torch.Generator().manual_seed(11)
    for m, k in _integer_rounding_cases(dtype, generator):
        got = torch.tensor(round_to_nearest_even(m, k, dtype), dtype=torch.float64).to(dtype)
        expected = correctly_rounded(_scaled(m, k), dtype)
        assert got.view(BITS[dtype]) == expected.view(BITS[dtype]), (m, k, got.item(), expected.item())
    assert round_to_nearest_even(3, -26, torch.float16) == 2.0**-24  # up to the least subnormal, not 3·2^-26


FP32_MAX = torch.finfo(torch.float32).max
FP32_OVERFLOW = 2.0**128 - 2.0**103  # half an ulp past the largest value: from there on, +inf
ODD = 1 + 2.0**-23  # an fp32 value with an odd significand: a tie next to it rounds to its even neighbour
# (x, β) against the fp32 cell test, r = fp32(x), each x exact in fp64: [x - β, x + β] touching the
# midpoint above or below an odd r, or the overflow threshold, from inside (the cell test must
# leave each to the settlement: a sum on that end rounds to r's neighbour or to ±inf), then the same
# intervals one fp64 step inside (the cell certifies them) and intervals well inside.
CELL_EDGES = (
    (ODD + 2.0**-24 - 2.0**-30, 2.0**-30),
    (ODD - 2.0**-24 + 2.0**-30, 2.0**-30),
    (-(ODD + 2.0**-24 - 2.0**-30), 2.0**-30),
    (FP32_OVERFLOW - 2.0**90, 2.0**90),
    (-(FP32_OVERFLOW - 2.0**90), 2.0**90),
    (math.nextafter(ODD + 2.0**-24 - 2.0**-30, 0), 2.0**-30),
    (math.nextafter(ODD - 2.0**-24 + 2.0**-30, 2), 2.0**-30),
    (math.nextafter(FP32_OVERFLOW - 2.0**90, 0), 2.0**90),
    (ODD, 2.0**-40),
    (FP32_MAX, 2.0**90),
    (1.0, 0.0),
)


def test_the_fp32_cell_test_certifies_only_intervals_strictly_inside_the_cell() -> None:
    """``_fp32_suspects`` (the fp8 fold's fp32 rounding, the module's step 3) on intervals that
    touch a rounding boundary of fp32: every element it certifies has both ends of ``[x - β,
    x + β]`` rounding to ``r`` in the Fraction reference (so does everything between them), and the
    intervals one fp64 step inside are certified (the test is no blanket refusal). Kills: ``x + β <=``
    or ``x - β >=`` the midpoint (an interval ending on the tie next to an odd ``r``, where ``e``
    rounds to the neighbour), and the overflow threshold placed one binade too high (2^129)."""
    x = torch.tensor([[[value] for value, _ in CELL_EDGES]], dtype=torch.float64)
    beta = torch.tensor([[bound for _, bound in CELL_EDGES]], dtype=torch.float64)
    r = x.to(torch.float32)
    flagged = {row for _, row, _ in _fp32_suspects(x, r, beta, torch.zeros_like(x, dtype=torch.bool)).tolist()}
    unsound = set()  # where some value of [x - β, x + β] does not round to r
    for row, (value, bound) in enumerate(CELL_EDGES):
        ends = (correctly_rounded(Fraction(value) + sign * Fraction(bound), torch.float32) for sign in (-1, 1))
        if any(end.view(torch.int32) != r[0, row, 0].view(torch.int32) for end in ends):
            unsound.add(row)
    assert unsound == {0, 1, 2, 3, 4}  # the premise: the first five are the edges
    assert flagged == unsound


def _one_bit_too_wide(dtype: torch.dtype, scale: int = -40) -> tuple[torch.Tensor, torch.Tensor]:
    """One head's ``a_t [1, 4, 1]`` and ``b [1, 4, 1]`` (bf16) whose products are multiples of
    ``2^scale`` and sum to ``2^(53+scale) + h + 2^scale``, ``h`` half a ``dtype`` ulp of the first
    term: ``Σ|a_p·b_p| < 2^(54+scale)``, one bit more than fp64 holds on that grid. The row's and
    the column's smallest factors (±254, 255: all 8 bits used) put the lowest bit the fold assumes
    on that grid exactly. Every order of fp64 additions drops the ``2^scale`` (a tie, to even) and
    lands on the ``dtype`` tie ``2^(53+scale) + h``, which rounds down to even; the exact sum is
    past it and rounds up."""
    half = 53 - significand_bits(dtype)  # log2 of h, before scaling
    a = [2.0 ** (26 + scale), 2.0 ** (half - 15 + scale), -254 * 2.0**scale, 255 * 2.0**scale]
    b = [2.0**27, 2.0**15, 256.0, 255.0]  # products 2^(53+s), h, -65024·2^s, 65025·2^s
    return torch.tensor(a).view(1, 4, 1).to(torch.bfloat16), torch.tensor(b).view(1, 4, 1).to(torch.bfloat16)


@pytest.mark.parametrize("out_dtype", [torch.bfloat16, torch.float16, torch.float32])
def test_a_sum_one_bit_too_wide_for_fp64_is_not_taken_as_exact(out_dtype: torch.dtype) -> None:
    """The exactness test (the module's step 4; ``_exact_grid`` in the fp32 bulk test,
    ``_exact_in_fp64`` among the suspects) at its edge: products on a grid ``2^q`` whose sum needs
    54 bits. Taken as exact, the fold would be the fp64 sum rounded, which is wrong here; the
    element must be the Fraction sum rounded once. Kills: ``+ 54`` in ``_exact_in_fp64``, ``- 54``
    in ``_exact_grid``, and a lowest bit one above the inputs' (``exponent - bits + 1``)."""
    a_t, b = _one_bit_too_wide(out_dtype)
    terms = zip(a_t.flatten().tolist(), b.flatten().tolist(), strict=True)
    exact = sum((Fraction(left) * Fraction(right) for left, right in terms), Fraction(0))
    expected = correctly_rounded(exact, out_dtype).view(BITS[out_dtype])
    fp64 = torch.bmm(a_t.double().transpose(1, 2), b.double()).item()
    assert correctly_rounded(Fraction(fp64), out_dtype).view(BITS[out_dtype]) != expected  # the premise
    out = torch.empty(1, 1, 1, dtype=out_dtype)
    round_exact_products_into(out, a_t, b, {})
    assert out[0, 0, 0].view(BITS[out_dtype]) == expected, (out.item(), float(exact))


@pytest.mark.parametrize("p", [3, 16, 128, 1024])
def test_the_bound_covers_twice_the_error_of_the_worst_summation_order(p: int) -> None:
    """``β = _bound_factor(P)·S`` against the error of a summation order that reaches Higham's
    worst case: 1, then ``P - 1`` products of ``2^-53·(1 + 2^-7)``, added one by one in fp64, each
    addition rounding up by almost half an ulp, ``(P-1)·u·S`` in all. The module's step 2 budgets β
    for twice that error plus the rounding of ``x ± β`` (``u·(|x| + β)``); the error is measured
    against the Fraction sum. Kills ``1·P·u``: it still exceeds ``γ(P-1)``, so no wrong fold
    follows from it alone, but it leaves none of the margin the module's proof budgets for."""
    terms = [1.0] + [2.0**-53 * (1 + 2.0**-7)] * (p - 1)  # bf16 products: each is itself times 1.0
    x = 0.0
    for term in terms:
        x += term
    exact = sum(map(Fraction, terms), Fraction(0))  # = S: every term is positive
    error = abs(Fraction(x) - exact)
    u = Fraction(2) ** -53
    assert error > Fraction(99, 100) * (p - 1) * u * exact  # the premise: the worst order, nearly
    assert error <= (p - 1) * u / (1 - (p - 1) * u) * exact  # Higham's γ(P-1)·S
    beta = Fraction(_bound_factor(p)) * exact
    assert 2 * error + u * (abs(Fraction(x)) + beta) <= beta
