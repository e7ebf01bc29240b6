"""The fold's ql_nope rows rounded correctly: each element is its EXACT value rounded once to the fold
dtype (round to nearest, ties to even), so the stored bytes are a function of the source bytes alone,
the same from any GEMM, CPU or GPU, in any summation order.

Why: a fold rounded from fp32 sums depended on which GEMM summed them (fp32 CPU, oneDNN's bf16
kernels, a GPU's), a few elements per layer rounding the other way, so the same sources gave other
sidecar bytes and another manifest sha256 on another machine, and nobody could re-derive a published
fold and compare one digest.

Method, per head: ``e = a·b`` with ``a = W_UK[h]ᵀ`` ``[L, P]`` and ``b = W_qb_nope[h]`` ``[P, Lq]``.

1. ``x``: the fp64 GEMM, in whatever order the BLAS sums. The inputs are bf16, fp16 or fp32 values
   (fp8 sources are dequantized to fp32 first): exact in fp64, and so is every product ``a_p·b_p``
   (at most 24 + 24 significant bits, exponents far inside fp64's range).
2. The bound. Any order of summing ``P`` exact products with ``P - 1`` fp64 additions (fused or not)
   gives ``|x - e| <= γ(P-1)·S``, ``S = Σ_p |a_p·b_p|``, ``γ(n) = n·u / (1 - n·u)``, ``u = 2^-53``
   (Higham, *Accuracy and Stability of Numerical Algorithms*, §3.1; an addition never adds
   underflow error: a subnormal sum is exact). We use ``β = 4·P·u·Ŝ`` with ``Ŝ`` a computed upper
   bound on ``S``: per row, by Cauchy-Schwarz, ``S <= ‖a_l‖·max_k ‖b_k‖``; per element, the sum of
   ``|a_p|·|b_p|`` itself. Computing ``Ŝ`` (sums of squares, square roots, sums) costs a relative
   ``γ(P+2)`` at most, so ``β >= 3.9·P·u·S``: twice ``γ(P-1)·S``, with the rest covering the rounding
   of ``x - β`` and ``x + β`` (at most ``u·(|x| + β)``, and ``|x| <= 1.01·S``).
3. In bulk, bf16 and fp16: ``y = fp32(x)``. Lemma: if ``y`` is no rounding boundary of the dtype (a
   midpoint of two neighbours, or the overflow threshold; each is an fp32 number) and ``β <=
   2^-26·|y|``, no boundary lies between ``x`` and ``e``, nor between ``x`` and ``y``, so ``round(e) =
   round(y)``. Proof: a boundary ``m`` between ``x`` and ``e`` is within ``β`` of ``x``, and ``β <=
   2^-26·|y| < ulp32(m)/2`` (there ``|y| <= (1 + 2^-23)·|m|``, and ``ulp32(m) > 2^-24·|m|``): ``x`` lies
   within half an fp32 ulp of the fp32 number ``m``, so ``y = m``, which it is not; and fp32 rounding
   is monotone, so no fp32 number ``m`` lies strictly between ``x`` and ``y`` unless ``y = m``. A
   boundary is an fp32 number whose bits below the dtype's precision are 1000...0 (bf16: the low 16,
   everywhere, subnormals and overflow included; fp16: the low 13, from its smallest normal number
   up, and smaller values are suspects), so the bulk test looks at those bits, and at ``|y|`` against
   the row's threshold ``T >= 2^26·β`` (an fp32 number, rounded up from ``2^26·β``; at least fp32's
   smallest normal number, where that rounding is relative). fp32 (the fp8 fold's intermediate):
   ``r = fp32(x)``, certified where the sum is exact (below) or ``[x - β, x + β]`` lies strictly between the midpoints
   from ``r`` to its fp32 neighbours (exact in fp64).
4. Suspects, what the bulk test leaves (about 2^-16 of the elements, whose fp32 value happens to be a
   boundary, and those small next to their row's bound): ``x`` is exact where every product is a
   multiple of ``2^q`` and ``Ŝ < 2^(q+53)`` (every partial sum is then such a multiple that fp64 holds;
   bf16 rows typically span far fewer than 53 bits, so exact ties, one element in ten in fp32, are
   settled here), and then ``round(x)`` is the answer; else the per-element ``β`` and the rounding of
   ``x - β`` and of ``x + β``, each rounded correctly from fp64 (to fp32 by rounding to odd, then to
   nearest even: fp32 keeps two more bits than bf16 and fp16 across their range, so that double
   rounding is exact; Boldo and Melquiond, IEEE TC 57(4), 2008). Equal: every value between them,
   ``e`` included, rounds to it (rounding is monotone).
5. Still undecided (``e`` within ``β`` of a boundary: an inexact sum next to a tie, or deep
   cancellation): the exact sum in integers (every input is ``m·2^k``) rounded to nearest even in
   integers.

Why fp64 and not the faster sums: an fp32 sum (a CPU's fp32 GEMM, oneDNN's bf16 kernels on AMX, a
GPU without TF32) is within ``γ(P-1)·S``, 2^-17·S for Kimi-K3's P = 128, of ``e``, which leaves a few
percent of the elements within their bound of a bf16 tie, too many to settle one by one, and spread
over every row, so no row block could go back to fp64 alone; in fp64 almost none are, for the price
of an fp64 GEMM (stage_busy_s.fold in docs/bench/convert*.json). Nor exact sums of sliced inputs
(Ozaki's scheme) on int8 GEMMs, whose int32 sums are exact in any order: an int8 slice holds 7 bits
of a bf16 significand's 8, and the slices must cover each row's range of exponents, so the slice
products outnumber what one fp64 GEMM costs; bf16 slices would need a bf16 GEMM with fp32 output,
which torch's CPU kernels do not offer.

An exact zero is stored as +0 (the sign of an fp64 zero sum depends on the order; adding +0 makes
it +0, and a zero next to nonzero terms is small next to its bound, so it is settled exactly).
Inputs holding NaN or Inf (``--allow-nonfinite``) have no bound: a chunk of heads with one is
rounded from ``x`` as it is, and its bytes are not reproducible.
"""

from __future__ import annotations

import math

import torch

# fp64's unit roundoff.
_U = 2.0**-53
# The dtypes an exact product of two of their values is exact in fp64 for (step 1).
_INPUT_DTYPES = (torch.bfloat16, torch.float16, torch.float32)


def _significand_bits(dtype: torch.dtype) -> int:
    return 1 - int(math.log2(torch.finfo(dtype).eps))


def _bound_factor(p: int) -> float:
    """``4·P·u``: the bound on ``|x - e|`` per unit of ``Ŝ`` (the module's step 2)."""
    return 4 * p * _U


def round_exact_products_into(
    out: torch.Tensor, a_t: torch.Tensor, b: torch.Tensor, workspace: dict[str, torch.Tensor]
) -> None:
    """``out [n, L, Lq] = round(a_t [n, P, L]ᵀ @ b [n, P, Lq])``, each element the exact sum rounded
    once to ``out``'s dtype (bf16, fp16 or fp32), computed on ``a_t``'s device (``out`` may be
    elsewhere). ``workspace``: buffers kept by the caller from call to call (:func:`workspace_buffer`).
    Why ``a_t``: W_UK as stored; converted first and transposed after, the GEMM reads it as it is
    (a transposing copy of the strided slice costs as much as the rest of the rounding)."""
    if a_t.dtype not in _INPUT_DTYPES or b.dtype not in _INPUT_DTYPES:
        raise TypeError(f"the exact fold takes bf16, fp16 or fp32 inputs, not {a_t.dtype} and {b.dtype}")
    device, dtype, bits = a_t.device, out.dtype, max(_significand_bits(a_t.dtype), _significand_bits(b.dtype))
    a64, b64 = a_t.to(torch.float64).transpose(1, 2), b.to(torch.float64)
    x = workspace_buffer(workspace, "x", out.shape, torch.float64, device)
    torch.bmm(a64, b64, out=x)
    column = (b64 * b64).sum(1).amax(1).sqrt_()  # max_k ‖b_k‖ per head
    sums = (a64 * a64).sum(2).sqrt_().mul_(column.unsqueeze(1))  # >= Σ_p |a_lp·b_pk| for every k
    beta = sums * _bound_factor(b.shape[1])
    finite = bool(torch.isfinite(beta).all())
    staged = out if out.device == device else workspace_buffer(workspace, "r", out.shape, dtype, device)
    if dtype == torch.float32:
        staged.copy_(x).add_(0.0)  # an fp64 zero sum made +0 (-0 + 0 is +0): its sign was the order's
        suspects = _fp32_suspects(x, staged, beta, _exact_grid(a64, b64, bits, sums)) if finite else None
    else:
        y = workspace_buffer(workspace, "y", out.shape, torch.float32, device)
        staged.copy_(y.copy_(x).add_(0.0))  # an fp64 zero sum made +0 (-0 + 0 is +0)
        suspects = _narrow_suspects(y, beta, dtype, workspace) if finite else None
    if suspects is not None and suspects.numel():
        _settle(staged, x, a64, b64, bits, suspects)
    if staged is not out:
        out.copy_(staged)


def workspace_buffer(
    workspace: dict[str, torch.Tensor], name: str, shape: torch.Size, dtype: torch.dtype, device: torch.device
) -> torch.Tensor:
    """``workspace[name]``, made anew only when its shape, dtype or device changes. Why: a fresh
    fp64 buffer per chunk of heads is a new mapping to fault in on the CPU, 24 times a Kimi-K3 layer."""
    held = workspace.get(name)
    if held is None or held.shape != shape or held.dtype != dtype or held.device != device:
        held = workspace[name] = torch.empty(shape, dtype=dtype, device=device)
    return held


def _narrow_suspects(
    y: torch.Tensor, beta: torch.Tensor, dtype: torch.dtype, workspace: dict[str, torch.Tensor]
) -> torch.Tensor:
    """``[m, 3]`` (head, row, column) of the elements the lemma (the module's step 3) does not certify
    for ``y`` rounded to ``dtype`` (bf16 or fp16): ``y`` a boundary (its bits below ``dtype``'s
    precision are 1000...0, which holds for every bf16 boundary and for fp16's from its smallest
    normal number up, its overflow threshold included), or ``|y| < T``, ``T >= 2^26·β`` (and at
    least fp32's smallest normal number, so that ``T``'s own rounding to fp32 is relative, and
    fp16's, below which its boundaries are not bit patterns). Rows are screened first with row
    reductions that make no temporary of their own (:func:`_rows_with_boundaries`, the least
    ``|y|``), and only the rows they flag are tested element by element: on the CPU, each pass
    over every element is a sizeable share of the fold, after the GEMM."""
    floor = max(torch.finfo(torch.float32).smallest_normal, torch.finfo(dtype).smallest_normal)
    # 2^26·β·(1 + 2^-20) rounded to fp32 is still >= 2^26·β: that rounding costs 2^-24 relative at most
    limit = (beta * (2.0**26 * (1 + 2.0**-20))).clamp_(min=floor)
    threshold = torch.where(beta > 0, limit, 0.0).to(torch.float32)
    bits = _significand_bits(dtype)
    magnitude = torch.abs(y, out=workspace_buffer(workspace, "magnitude", *_like(y)))
    screened = _rows_with_boundaries(y, bits).logical_or_(magnitude.amin(2) < threshold)
    heads, rows = torch.nonzero(screened).unbind(1)
    uncertified = _boundaries(y[heads, rows], bits).logical_or_(magnitude[heads, rows] < threshold[heads, rows, None])
    which, cols = torch.nonzero(uncertified).unbind(1)
    return torch.stack((heads[which], rows[which], cols), dim=1)


def _boundaries(y: torch.Tensor, bits: int) -> torch.Tensor:
    """Whether each fp32 ``y`` is a boundary of the ``bits``-bit dtype: its bits below that precision,
    moved to the top of an int32, are 1000...0, the least int32."""
    return torch.bitwise_left_shift(y.view(torch.int32), 32 - 24 + bits) == -(2**31)


def _rows_with_boundaries(y: torch.Tensor, bits: int) -> torch.Tensor:
    """``[n, L]``: whether a row of ``y`` may hold a boundary (:func:`_boundaries`); rows flagged
    wrongly only cost their test. bf16: the low 16 bits of an fp32 value are an int16 of their own,
    and 0x8000 is the least int16, so one reduction over the int16 view finds the rows (it also
    flags a row with a high half of 0x8000, an fp32 value of at most 2^-133 in magnitude, small
    next to any bound)."""
    if bits == _significand_bits(torch.bfloat16):
        return y.view(torch.int16).amin(2) == -(2**15)
    return _boundaries(y, bits).any(2)


def _like(tensor: torch.Tensor) -> tuple[torch.Size, torch.dtype, torch.device]:
    return tensor.shape, tensor.dtype, tensor.device


def _fp32_suspects(x: torch.Tensor, r: torch.Tensor, beta: torch.Tensor, exact: torch.Tensor) -> torch.Tensor:
    """``[m, 3]`` (head, row, column) of the elements whose fp32 rounding ``r = fp32(x)`` neither
    ``exact`` (``x`` is the exact sum) nor the cell test (the module's step 3) certifies:
    ``[x - β, x + β]`` strictly inside the interval of values that round to ``r``, whose ends are the
    midpoints to ``r``'s fp32 neighbours (exact in fp64; past the largest finite value, the overflow
    threshold). Why both: bf16 products summed exactly often need 25 bits, an exact fp32 tie, in a
    tenth of the elements, which no bound can settle."""
    rd = r.to(torch.float64)
    beta = beta.unsqueeze(2)
    inside = (x + beta < _midpoint(r, rd, math.inf)).logical_and_(x - beta > _midpoint(r, rd, -math.inf))
    return torch.nonzero(inside.logical_or_(exact).logical_not_())


def _midpoint(r: torch.Tensor, rd: torch.Tensor, direction: float) -> torch.Tensor:
    """The midpoints (fp64, exact) between fp32 ``r`` and its neighbours towards ``direction``;
    past the largest finite value, the overflow threshold."""
    neighbour = torch.nextafter(r, torch.full_like(r, direction)).to(torch.float64)
    edge = math.copysign(2.0**128, direction)  # one ulp past fp32's largest value
    return torch.where(neighbour.isinf() & rd.isfinite(), edge, neighbour).add_(rd).mul_(0.5)


def _exact_grid(a: torch.Tensor, b: torch.Tensor, bits: int, sums: torch.Tensor) -> torch.Tensor:
    """``[n, L, Lq]``: whether the fp64 sum of each element is exact (:func:`_exact_in_fp64`, with the
    row's bound ``sums >= Σ|a_p·b_p|``): every product of row l and column k is a multiple of
    ``2^(qa_l + qb_k)``, so the test is one comparison of small integers per element."""
    _, exponent = torch.frexp(sums * (1 + 2.0**-39))  # sums·(1 + 2^-39) < 2^exponent
    limit = exponent - _lowest_bit(a, bits) - 53
    return _lowest_bit(b.transpose(1, 2), bits).unsqueeze(1) >= limit.unsqueeze(2)


def _settle(
    r: torch.Tensor, x: torch.Tensor, a: torch.Tensor, b: torch.Tensor, bits: int, suspects: torch.Tensor
) -> None:
    """Store the correct rounding of each suspect ``(h, l, k)`` into ``r``: that of ``x`` where the
    fp64 sum was exact (:func:`_exact_in_fp64`), else that of ``x ± β`` with its own ``β`` where both
    agree (the module's step 4), else that of the exact sum (step 5). ``bits``: the inputs'
    significand bits."""
    heads, rows, cols = suspects.unbind(1)
    a_rows, b_cols = a[heads, rows], b[heads, :, cols]  # [m, P] each
    sums = (a_rows * b_cols).abs_().sum(1)  # Σ|a_p·b_p| (each product exact)
    beta = sums * _bound_factor(a.shape[2])
    approx = x[heads, rows, cols] + 0.0
    exact = _exact_in_fp64(_lowest_bit(a_rows, bits) + _lowest_bit(b_cols, bits), sums)
    low, high = round_from_fp64(approx - beta, r.dtype), round_from_fp64(approx + beta, r.dtype)
    low = torch.where(exact, round_from_fp64(approx, r.dtype), low)
    view = torch.int16 if r.dtype.itemsize == 2 else torch.int32
    sure = exact | (low.view(view) == high.view(view))
    r[heads[sure], rows[sure], cols[sure]] = low[sure]
    unsure = torch.nonzero(~sure).squeeze(1)
    if unsure.numel():
        settled = [
            round_to_nearest_even(*exact_dot(a_row, b_col), r.dtype)
            for a_row, b_col in zip(a_rows[unsure].tolist(), b_cols[unsure].tolist(), strict=True)
        ]
        where = heads[unsure], rows[unsure], cols[unsure]
        r[where] = torch.tensor(settled, dtype=torch.float64, device=r.device).to(r.dtype)


def _lowest_bit(values: torch.Tensor, bits: int) -> torch.Tensor:
    """Per row (last dimension) of ``values`` (``bits``-bit significands, in fp64), an exponent ``q``
    with every value of the row a multiple of ``2^q``: the lowest over its nonzero values of (its
    leading bit - bits + 1); a large number for an all-zero row."""
    _, exponent = torch.frexp(values)  # |v| in [2^(e-1), 2^e): its lowest bit is 2^(e-bits) or above
    return torch.where(values != 0, exponent - bits, 1 << 20).amin(dim=-1)


def _exact_in_fp64(lowest: torch.Tensor, sums: torch.Tensor) -> torch.Tensor:
    """Whether an fp64 sum of products that are all multiples of ``2^lowest``, with ``Σ|products| <=
    sums·(1 + 2^-40)``, is exact in any order: every partial sum is then such a multiple below
    ``2^(lowest+53)``, which fp64 holds exactly."""
    _, exponent = torch.frexp(sums * (1 + 2.0**-39))  # sums·(1 + 2^-39) < 2^exponent
    return exponent <= lowest + 53


def round_from_fp64(values: torch.Tensor, dtype: torch.dtype) -> torch.Tensor:
    """fp64 ``values`` rounded once to ``dtype`` (bf16, fp16, fp32), to nearest even. Why not
    ``.to(dtype)``: torch goes through fp32 for bf16 and fp16, and rounding twice to nearest is
    wrong where the first lands on a tie of the second. Rounding to odd first is not (fp32 keeps at
    least two more bits than bf16 and fp16, across their whole range: Boldo and Melquiond, 2008)."""
    nearest = values.to(torch.float32)
    if dtype == torch.float32:
        return nearest
    back = nearest.to(torch.float64)
    toward_zero = torch.where(back.abs() > values.abs(), torch.nextafter(nearest, torch.zeros_like(nearest)), nearest)
    odd = (toward_zero.view(torch.int32) | 1).view(torch.float32)
    return torch.where(back == values, nearest, odd).to(dtype)


def exact_dot(a: list[float], b: list[float]) -> tuple[int, int]:
    """``Σ a_i·b_i`` exactly, as ``(m, k)`` with the sum ``m·2^k`` (every finite float is an integer
    times a power of two, so the products and their sum are too)."""
    terms = []
    for left, right in zip(a, b, strict=True):
        if left and right:
            (n1, d1), (n2, d2) = left.as_integer_ratio(), right.as_integer_ratio()
            terms.append((n1 * n2, (d1 * d2).bit_length() - 1))  # n / 2^shift
    if not terms:
        return 0, 0
    shift = max(t[1] for t in terms)
    return sum(n << (shift - s) for n, s in terms), -shift


def round_to_nearest_even(m: int, k: int, dtype: torch.dtype) -> float:
    """``m·2^k`` rounded to ``dtype`` (bf16, fp16, fp32), to nearest, ties to even, subnormals and
    overflow (to ±inf) included, in integers; as a Python float (exact: ``dtype`` fits in fp64).
    An exact zero is +0."""
    if m == 0:
        return 0.0
    info = torch.finfo(dtype)
    p, emin = _significand_bits(dtype), int(math.log2(info.smallest_normal))
    magnitude = abs(m)
    leading = magnitude.bit_length() - 1 + k  # the exponent of the leading bit
    quantum = max(leading, emin) - (p - 1)  # the spacing of dtype's values there
    shift = quantum - k
    if shift > 0:
        kept, rest = divmod(magnitude, 1 << shift)
        half = 1 << (shift - 1)
        kept += rest > half or (rest == half and kept & 1)
    else:
        kept = magnitude << -shift
    value = math.ldexp(kept, quantum)
    value = math.inf if value > info.max else value
    return -value if m < 0 else value
