"""The math, and nothing else: dequantize, fold a layer, measure the fold's error.

Per head h (P nope dims, R rope dims, L kv_lora_rank, Lq q_lora_rank)::

    W_fold[h] = [ W_UK[h]ᵀ · W_qb_nope[h] ;  W_qb_pe[h] ]      # [L + R, Lq]

with W_UK[h] = kv_b_proj rows [h*(P+V), h*(P+V)+P) and W_qb = q_b_proj rows [h*(P+R), (h+1)*(P+R)).
Then ``x · W_fold[h]ᵀ = [ (x · W_qb_nope[h]ᵀ) · W_UK[h] | x · W_qb_pe[h]ᵀ ]``, the absorbed MQA
query. Each stored element is the exact value rounded once to the output dtype, whatever computes
it (:mod:`foldckpt.rounding`): the same sources give the same bytes on any CPU or GPU. fp64 is also
the reference the error statistics are measured against.
"""

from __future__ import annotations

import json
import math
import threading
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass, field
from typing import Any

import torch

from foldckpt.defaults import nan_last
from foldckpt.errors import FoldckptError
from foldckpt.io.files import json_safe
from foldckpt.model.geometry import Geometry
from foldckpt.rounding import round_exact_products_into, workspace_buffer

# OCP float8_e4m3fn's largest finite value.
FP8_MAX = 448.0

# Heads folded per matmul: bounds the working set to a few heads' products whatever H is (a
# Kimi-K3 chunk of 4 heads is 4 x 576 x 1536 values); more heads a chunk bought no CPU time, only
# memory at the peak (peak_rss_bytes in docs/bench/convert*.json).
_HEADS_PER_CHUNK = 4

# Acceptance bound on the relative Frobenius error of a stored fold vs the fp64 fold: one rounding
# to the dtype costs at most half an ulp per element, i.e. 2^-9 relative for bf16.
ROUNDING_TOLERANCE: dict[torch.dtype, float] = {
    torch.bfloat16: 2.0**-8,
    torch.float16: 2.0**-10,
    torch.float32: 1e-6,
    # e4m3 keeps 3 mantissa bits: half an ulp is 2^-4 relative; scaled rows use the top binades.
    torch.float8_e4m3fn: 2.0**-4,
}
# Significant digits of the error figures the manifest records (:meth:`FoldError.to_dict`). Why
# not all 17: the fp64 fold they are measured against is a BLAS GEMM whose last bits depend on the
# CPU's code path (MKL's AVX-512 and AVX2 kernels differ by about 1e-15 relative), and the manifest
# must be the same bytes on every machine. Four digits say what the figures are for and lie far
# above that noise.
RECORDED_ERROR_DIGITS = 4

# The share of that tolerance which values below the fold dtype's normal range may cost a head
# before convert measures the head against fp64 (:func:`underflow_suspects`).
_UNDERFLOW_SHARE = 1 / 8


def dequantize_fp8_blocks(
    weight: torch.Tensor, scale_inv: torch.Tensor, block: tuple[int, int], name: str
) -> torch.Tensor:
    """fp8 e4m3 weight x per-block ``weight_scale_inv`` -> fp32 (DeepSeek-V3 / Kimi-K2 format): each
    value is its e4m3 value (exact in fp32) times its block's fp32 scale, rounded once to fp32 (one
    IEEE multiplication, done on the CPU). That defines the fold's inputs exactly, so its bytes are
    reproducible from fp8 sources too."""
    rows, cols = weight.shape
    expected = (-(-rows // block[0]), -(-cols // block[1]))
    if tuple(scale_inv.shape) != expected:
        raise FoldckptError(
            f"tensor '{name}_scale_inv' has shape {list(scale_inv.shape)}, expected {list(expected)} "
            f"for {block[0]}x{block[1]} blocks of a {rows}x{cols} weight"
        )
    scale = scale_inv.to(torch.float32)
    scale = scale.repeat_interleave(block[0], dim=0)[:rows].repeat_interleave(block[1], dim=1)[:, :cols]
    return weight.to(torch.float32) * scale


def _per_head(q_b: torch.Tensor, kv_b: torch.Tensor, g: Geometry) -> tuple[torch.Tensor, torch.Tensor]:
    """View q_b_proj as [H, P+R, Lq] and kv_b_proj as [H, P+V, L]."""
    p, r, v = g.qk_nope_head_dim, g.qk_rope_head_dim, g.v_head_dim
    return (
        q_b.reshape(g.num_heads, p + r, g.q_lora_rank),
        kv_b.reshape(g.num_heads, p + v, g.kv_lora_rank),
    )


def head_chunks(num_heads: int, size: int = _HEADS_PER_CHUNK) -> Iterator[slice]:
    """The heads in runs of ``size`` (the last may be shorter)."""
    return (slice(start, min(start + size, num_heads)) for start in range(0, num_heads, size))


def _exact_nope_rows(
    q_b: torch.Tensor, kv_b: torch.Tensor, g: Geometry, device: torch.device | str
) -> Iterator[tuple[slice, Callable[[torch.Tensor], None]]]:
    """The heads of one layer, ``_HEADS_PER_CHUNK`` at a time, each with ``write(rows)``, which writes
    the chunk's ql_nope rows ``[n, L, Lq]`` (W_UKᵀ·W_qb_nope per head) into ``rows``: every element
    the exact value rounded once to ``rows``' dtype (:mod:`foldckpt.rounding`), computed on ``device``. A
    GPU gets each input in one copy (82 MB for a Kimi-K3 layer), not one per chunk: 24 small
    synchronous copies a layer were most of a GPU fold's time. And it folds all the layer's heads
    in one call, at the first write (about 1.7 GB of GPU memory at the peak for Kimi-K3), each
    chunk then copied from there: a call costs a hundred-odd kernel launches and several
    synchronizations whatever its size, which, 24 times a layer, made the exact fold on an H100
    slower than the fp32 fold before it (docs/bench/convert_vs_baseline_nvidia_h100.json, measured
    since with one call)."""
    device = torch.device(device)
    q_heads, kv_heads = _per_head(q_b.to(device), kv_b.to(device), g)
    p = g.qk_nope_head_dim
    workspace = _workspace(device)
    whole: list[torch.Tensor] = []  # a GPU's fold of every head, made at the first write

    def into(chunk: slice) -> Callable[[torch.Tensor], None]:
        def write(rows: torch.Tensor) -> None:
            if device.type == "cpu":
                round_exact_products_into(rows, kv_heads[chunk, :p], q_heads[chunk, :p], workspace)
                return
            if not whole:
                whole.append(torch.empty((g.num_heads, *rows.shape[1:]), dtype=rows.dtype, device=device))
                round_exact_products_into(whole[0], kv_heads[:, :p], q_heads[:, :p], workspace)
            rows.copy_(whole[0][chunk])

        return write

    for chunk in head_chunks(g.num_heads):
        yield chunk, into(chunk)


def _workspace(device: torch.device) -> dict[str, torch.Tensor]:
    """The exact fold's per-head buffers (:func:`~foldckpt.rounding.round_exact_products_into`),
    kept by each thread from layer to layer on the CPU. Why: fresh ones per layer are new mappings
    to fault in, and once they are freed glibc serves the next from its heap, which keeps the pages
    (a higher peak_rss_bytes in docs/bench/convert*.json). On a GPU, torch's caching allocator reuses
    the memory anyway."""
    if device.type != "cpu":
        return {}
    if not hasattr(_workspaces, "exact"):
        _workspaces.exact = {}
    return _workspaces.exact


# The fold's output for a run of heads: ``take(heads)`` is where the chunk's stored values go.
ChunkOutput = Callable[[slice], torch.Tensor]


def fold_layer_chunks(
    q_b: torch.Tensor,
    kv_b: torch.Tensor,
    g: Geometry,
    out_dtype: torch.dtype,
    device: torch.device | str,
    take: ChunkOutput,
) -> Iterator[tuple[slice, torch.Tensor]]:
    """The fold of one layer, ``_HEADS_PER_CHUNK`` heads at a time: each element the exact value
    rounded once to ``out_dtype`` (computed on ``device``), written into ``take(heads)`` (``[n, L+R,
    Lq]``), which is yielded with its heads. Why by chunk: a consumer can hash, check and write each
    chunk while the next is folded, so that no layer's fold (170 MB for Kimi-K3 in bf16) is ever held
    whole."""
    lora, p = g.kv_lora_rank, g.qk_nope_head_dim
    q_heads = _per_head(q_b, kv_b, g)[0]
    for chunk, write_nope in _exact_nope_rows(q_b, kv_b, g, device):
        out = take(chunk)
        write_nope(out[:, :lora])
        out[:, lora:].copy_(q_heads[chunk, p:])
        yield chunk, out


def fold_layer(
    q_b: torch.Tensor,
    kv_b: torch.Tensor,
    g: Geometry,
    out_dtype: torch.dtype = torch.bfloat16,
    device: torch.device | str = "cpu",
    out: torch.Tensor | None = None,
) -> torch.Tensor:
    """The head-major fold ``[H*(L+R), Lq]`` of one layer (:func:`fold_layer_chunks`), whole, in
    ``out`` (a fresh tensor when None)."""
    shape = (g.num_heads, g.fold_head_dim, g.q_lora_rank)
    whole = torch.empty(shape, dtype=out_dtype) if out is None else out.view(shape)
    for _ in fold_layer_chunks(q_b, kv_b, g, out_dtype, device, whole.__getitem__):
        pass
    return whole.reshape(g.fold_shape)


def quantize_fp8_rows(exact: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """OCP e4m3 values and an fp32 scale per row (last dim) with ``values * scale ≈ exact``.

    ``scale = amax(|row|) / 448`` (448 is e4m3's largest finite value; an all-zero row gets 1), and
    each value is ``exact / scale`` rounded once to e4m3 (round to nearest even). The one
    definition of the fp8 fold, used by convert, ``verify --deep`` and the benchmarks.
    """
    exact = exact.to(torch.float32)
    amax = exact.abs().amax(dim=-1)
    # divided by a tensor of 448s: torch's CUDA kernels multiply by the reciprocal of a Python
    # number instead, which rounds half of all quotients differently from the CPU's division
    scale = torch.where(amax > 0, amax / torch.full_like(amax, FP8_MAX), torch.ones_like(amax))
    scaled = (exact / scale.unsqueeze(-1)).clamp(-FP8_MAX, FP8_MAX)
    return scaled.to(torch.float8_e4m3fn), scale


def dequantize_fp8_rows(values: torch.Tensor, scale: torch.Tensor, dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """``values * scale`` per row (the inverse of :func:`quantize_fp8_rows`), computed in fp32."""
    return (values.to(torch.float32) * scale.to(torch.float32).unsqueeze(-1)).to(dtype)


# Where an fp8 chunk goes: ``take(heads)`` is ``(values [n, L+R, Lq] e4m3, scale [n, L+R] fp32)``.
Fp8ChunkOutput = Callable[[slice], tuple[torch.Tensor, torch.Tensor]]


def fold_layer_fp8_chunks(
    q_b: torch.Tensor, kv_b: torch.Tensor, g: Geometry, device: torch.device | str, take: Fp8ChunkOutput
) -> Iterator[tuple[slice, torch.Tensor, torch.Tensor]]:
    """The fp8 fold of one layer, ``_HEADS_PER_CHUNK`` heads at a time (as :func:`fold_layer_chunks`):
    quantized (:func:`quantize_fp8_rows`, IEEE fp32 operations, each correctly rounded: the same
    bits on any device) from the fp32 fold, itself the exact value rounded once; rows are
    independent, so the ql_nope and q_pe rows are quantized apart. Written into ``take(heads)`` and
    yielded with its heads."""
    lora, p = g.kv_lora_rank, g.qk_nope_head_dim
    q_heads = _per_head(q_b, kv_b, g)[0]
    shape, on = torch.Size((min(_HEADS_PER_CHUNK, g.num_heads), lora, g.q_lora_rank)), torch.device(device)
    workspace = _workspace(on)
    for chunk, write_nope in _exact_nope_rows(q_b, kv_b, g, device):
        values, scale = take(chunk)
        nope = workspace_buffer(workspace, "fp8_nope", shape, torch.float32, on)[: chunk.stop - chunk.start]
        write_nope(nope)
        for rows, exact in ((slice(None, lora), nope), (slice(lora, None), q_heads[chunk, p:].to(device))):
            chunk_values, chunk_scale = quantize_fp8_rows(exact)
            values[:, rows].copy_(chunk_values)
            scale[:, rows].copy_(chunk_scale)
        yield chunk, values, scale


def fold_layer_fp8(
    q_b: torch.Tensor,
    kv_b: torch.Tensor,
    g: Geometry,
    device: torch.device | str = "cpu",
    out: tuple[torch.Tensor, torch.Tensor] | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The fp8 fold of one layer (:func:`fold_layer_fp8_chunks`), whole: e4m3 ``[H*(L+R), Lq]`` and
    its fp32 scale per row ``[H*(L+R)]``, written into ``out`` when given."""
    shape = (g.num_heads, g.fold_head_dim, g.q_lora_rank)
    if out is None:
        values, scale = torch.empty(shape, dtype=torch.float8_e4m3fn), torch.empty(shape[:2], dtype=torch.float32)
    else:
        values, scale = out[0].view(shape), out[1].view(shape[:2])
    for _ in fold_layer_fp8_chunks(q_b, kv_b, g, device, lambda heads: (values[heads], scale[heads])):
        pass
    return values.reshape(g.fold_shape), scale.reshape(g.fold_shape[0])


def all_finite(tensor: torch.Tensor) -> bool:
    """Whether ``tensor`` holds no NaN or Inf (e4m3fn has no Inf; its NaN is 0x7f)."""
    if tensor.dtype == torch.float8_e4m3fn:
        return not bool(((tensor.view(torch.uint8) & 0x7F) == 0x7F).any())
    return math.isfinite(abs_max(tensor))


def abs_max(tensor: torch.Tensor) -> float:
    """The largest ``|value|`` of ``tensor``, NaN when it holds a NaN (and Inf an Inf): one min/max
    pass (both propagate NaN), with no boolean temporary the size of the tensor as
    ``isfinite().all()`` makes."""
    if tensor.numel() == 0:
        return 0.0
    low, high = (value.item() for value in torch.aminmax(tensor))
    return math.nan if math.isnan(low) or math.isnan(high) else max(-low, high)


def _reference_head_into(
    out: torch.Tensor,
    q_heads: torch.Tensor,
    kv_heads: torch.Tensor,
    head: int,
    q_nope: torch.Tensor,
    w_uk: torch.Tensor,
) -> None:
    """The fp64 fold of one head (views from :func:`_per_head`) into ``out [L+R, Lq]``: W_UKᵀ·W_qb_nope,
    then W_qb_pe; ``q_nope [P, Lq]`` and ``w_uk [P, L]`` are fp64 staging buffers the head is copied into."""
    p, lora = w_uk.shape
    q_nope.copy_(q_heads[head, :p])
    w_uk.copy_(kv_heads[head, :p])
    torch.matmul(w_uk.T, q_nope, out=out[:lora])
    out[lora:].copy_(q_heads[head, p:])


def reference_fold_heads(q_b: torch.Tensor, kv_b: torch.Tensor, g: Geometry, heads: tuple[int, ...]) -> torch.Tensor:
    """fp64 fold of the selected heads, ``[len(heads), L+R, Lq]``."""
    q_heads, kv_heads = _per_head(q_b, kv_b, g)
    f64, p = torch.float64, g.qk_nope_head_dim
    out = torch.empty(len(heads), g.fold_head_dim, g.q_lora_rank, dtype=f64)
    q_nope, w_uk = torch.empty(p, g.q_lora_rank, dtype=f64), torch.empty(p, g.kv_lora_rank, dtype=f64)
    for row, head in enumerate(heads):
        _reference_head_into(out[row], q_heads, kv_heads, head, q_nope, w_uk)
    return out


def sample_heads(num_heads: int, count: int = 4) -> tuple[int, ...]:
    """Deterministic, evenly spread head sample that always includes the first and last head."""
    if count >= num_heads:
        return tuple(range(num_heads))
    if count <= 1:
        return (0,)
    step = (num_heads - 1) / (count - 1)
    return tuple(sorted({round(i * step) for i in range(count)}))


@dataclass(frozen=True)
class FoldError:
    """How far a stored fold is from the fp64 fold, head by head, on the heads measured.

    Each head's two row groups are measured apart: ``ql_nope`` (W_UKᵀ·W_qb_nope) and ``q_pe``
    (W_qb_pe), each against its own fp64 norm, and the fold's error is the worst of them
    (``rel_fro_error``, in head ``worst_head``); ``rows`` holds each group's worst over the heads.
    Why per group: the two can differ in magnitude by orders, and one norm over the head let an
    fp16 fold whose small ql_nope rows had underflowed (27% off, 38% zeros) pass at 3.6e-4 behind
    exact q_pe rows. Why per head: one norm over several heads let a head whose rows underflowed
    (weights orders smaller than its neighbours') pass behind the others, in convert's sample and
    in ``verify --deep``'s every head alike."""

    heads: tuple[int, ...]
    rel_fro_error: float
    max_abs_error: float
    rows: dict[str, float] = field(default_factory=dict)
    worst_head: int | None = None

    @property
    def worst_rows(self) -> str:
        return max(self.rows, key=lambda part: nan_last(self.rows[part]))

    def to_dict(self) -> dict[str, object]:
        """As the manifest records it: each figure to :data:`RECORDED_ERROR_DIGITS` significant
        digits, NaN (the error of a fold of NaN inputs) as null."""
        return json_safe(
            {
                "heads": list(self.heads),
                "rel_fro_error": _recorded(self.rel_fro_error),
                "rel_fro_error_rows": {part: _recorded(error) for part, error in self.rows.items()},
                "worst_head": self.worst_head,
                "max_abs_error": _recorded(self.max_abs_error),
            }
        )


def _recorded(figure: float) -> float:
    """``figure`` to :data:`RECORDED_ERROR_DIGITS` significant digits (NaN and infinities kept)."""
    return float(f"{figure:.{RECORDED_ERROR_DIGITS}g}")


def _agrees(recorded: float | None, measured: float) -> bool:
    """Whether a figure recorded to :data:`RECORDED_ERROR_DIGITS` significant digits (null: NaN or
    infinite) is ``measured``. Rounding to that precision moves a figure by up to half a unit of
    its last digit; the tolerance is one unit, so that fp64 sums added in another order (another
    BLAS, a GPU) do not fail a true record that lay near a tie."""
    if recorded is None or not math.isfinite(recorded) or not math.isfinite(measured):
        return (recorded is None or not math.isfinite(recorded)) and not math.isfinite(measured)
    if recorded == 0:  # only an exact zero is recorded as 0
        return measured == 0
    unit = 10.0 ** (math.floor(math.log10(abs(recorded))) - RECORDED_ERROR_DIGITS + 1)
    return abs(recorded - measured) <= unit


def recorded_error_mismatch(recorded: dict[str, Any], meter: FoldErrorMeter) -> str | None:
    """What a fold's recorded error vs fp64 (``error_vs_fp64``, :meth:`FoldError.to_dict`, on the
    heads convert measured) says that ``meter``, which has measured those heads again, does not;
    None when each figure agrees at the precision recorded (:func:`_agrees`) and the recorded worst
    head is as bad as the worst of them. Why: ``inspect`` and convert's summary show these figures,
    and ``verify --deep`` passed a manifest whose figures had been rewritten (digest recomputed)."""
    measured = meter.result(recorded["heads"])
    figures = [
        ("rel_fro_error", recorded["rel_fro_error"], measured.rel_fro_error),
        ("max_abs_error", recorded["max_abs_error"], measured.max_abs_error),
        *(
            (f"rel_fro_error_rows.{part}", recorded["rel_fro_error_rows"][part], error)
            for part, error in measured.rows.items()
        ),
    ]
    digits = RECORDED_ERROR_DIGITS
    for name, given, value in figures:
        if not _agrees(given, value):
            return f"{name} recorded {json.dumps(given)}, measured {value:.{digits}g} on the same heads"
    worst = recorded["worst_head"]
    if worst is not None and not _agrees(error := meter.result((worst,)).rel_fro_error, measured.rel_fro_error):
        return (
            f"worst_head recorded {worst} (measured {error:.{digits}g}), measured {measured.worst_head} "
            f"({measured.rel_fro_error:.{digits}g})"
        )
    return None


def within_one_rounding(rel_error: float, dtype: torch.dtype) -> bool:
    """Whether a fold's relative error vs fp64 is what one rounding to ``dtype`` can cost
    (:data:`ROUNDING_TOLERANCE`; NaN is not): the acceptance rule of convert and ``verify --deep``."""
    return rel_error <= ROUNDING_TOLERANCE[dtype]


def accuracy_problem(error: FoldError, dtype: torch.dtype) -> str | None:
    """What is wrong with a fold whose error (:class:`FoldError`) is beyond one rounding to
    ``dtype``, or None: the one wording of the one rule convert refuses a fold by and ``verify
    --deep`` fails it by."""
    if within_one_rounding(error.rel_fro_error, dtype):
        return None
    return (
        f"relative error vs fp64 {error.rel_fro_error:.2e} in head {error.worst_head}'s {error.worst_rows} rows is more "
        f"than one rounding to {str(dtype).removeprefix('torch.')} costs ({ROUNDING_TOLERANCE[dtype]:.1e})"
    )


def underflow_floor(dtype: torch.dtype, nope_dim: int) -> float:
    """The RMS value below which a row group of one head of a fold stored in ``dtype`` (bf16, fp16
    or fp32) can be more than one rounding off through underflow, as far as its stored values tell.

    A value in the normal range of ``dtype`` is off by at most half an ulp, relative. One below it
    is off by up to half the subnormal spacing, ``tiny·eps/2``, however small it is, plus what the
    fp32 sum of ``nope_dim`` products lost in fp32's own subnormal range (half its spacing,
    2⁻¹⁵⁰, per addition). Over a group of n values with RMS r, that absolute error adds at most
    ``(tiny·eps/2 + P·2⁻¹⁵⁰) / r`` to its relative error, whichever of the values are subnormal:
    a group whose RMS is above the floor keeps that within ``_UNDERFLOW_SHARE`` of the tolerance."""
    info = torch.finfo(dtype)
    absolute = info.tiny * info.eps / 2 + nope_dim * 2.0**-150
    return absolute / (_UNDERFLOW_SHARE * ROUNDING_TOLERANCE[dtype])


def underflow_suspects(values: torch.Tensor, g: Geometry) -> list[int]:
    """The heads of a chunk of a stored fold (``values [n, L+R, Lq]``) with a row group whose RMS is
    below :func:`underflow_floor`: those whose error the stored values cannot vouch for, which
    convert measures against fp64 on top of its sample. Every head is screened (a norm per row
    group, a few percent of the fold's time): a sample of heads misses one head whose weights are
    orders smaller than its neighbours'. An fp8 fold is not screened: each row is scaled to
    e4m3's range by its own largest value, and a scale below fp32's normal range is refused
    (:func:`foldckpt.convert.layer.check_fold_scales`)."""
    if values.dtype not in (torch.bfloat16, torch.float16, torch.float32):
        return []
    floor = underflow_floor(values.dtype, g.qk_nope_head_dim)
    suspects: set[int] = set()
    for rows in (slice(None, g.kv_lora_rank), slice(g.kv_lora_rank, None)):
        group = values[:, rows]
        if not group[0].numel():
            continue
        least = floor * math.sqrt(group[0].numel())
        # squares below fp32's range read as 0 (bf16 and fp32 values under 1e-19): each head the
        # fp32 norm flags is confirmed in fp64, so that only heads truly near underflow cost a check
        below = (torch.linalg.vector_norm(group, dim=(1, 2), dtype=torch.float32) < least).nonzero().flatten().tolist()
        suspects.update(h for h in below if torch.linalg.vector_norm(group[h], dtype=torch.float64) < least)
    return sorted(suspects)


_workspaces = threading.local()


def _fp64_workspace(p: int, lora: int, rows: int, cols: int) -> tuple[torch.Tensor, ...]:
    """This thread's fp64 buffers for :func:`fold_error` (``q_nope [P, Lq]``, ``w_uk [P, L]``, the
    reference and the difference ``[L+R, Lq]``), kept from call to call: fresh ones are new mappings
    whose first touch costs more than the check itself (a conversion checks 4 heads per layer)."""
    key = (p, lora, rows, cols)
    if getattr(_workspaces, "key", None) != key:
        f64 = torch.float64
        _workspaces.key = key
        _workspaces.buffers = (
            torch.empty(p, cols, dtype=f64),
            torch.empty(p, lora, dtype=f64),
            torch.empty(rows, cols, dtype=f64),
            torch.empty(rows, cols, dtype=f64),
        )
    return _workspaces.buffers


class FoldErrorMeter:
    """How far a stored fold is from the fp64 fold, measured one head at a time as the heads come
    (:meth:`add`), so that a fold made and written chunk by chunk is measured without being held
    whole, and checking every head, as ``verify --deep`` does, needs one head's fp64 working set.
    Each head is judged on its own (:class:`FoldError`).

    The head's fp64 fold and its difference to the stored values go into two buffers reused from
    head to head (this thread's), and the sums and the largest difference are reductions over
    them: a dozen fresh fp64 temporaries the size of a Kimi-K3 head's fold, each a new mapping to
    fault in, made this check a large share of a conversion's fold time and most of ``verify
    --deep``'s compute."""

    def __init__(self, q_b: torch.Tensor, kv_b: torch.Tensor, g: Geometry) -> None:
        self._q_heads, self._kv_heads = _per_head(q_b, kv_b, g)
        self._rows = {"ql_nope": slice(None, g.kv_lora_rank), "q_pe": slice(g.kv_lora_rank, None)}
        self._workspace = _fp64_workspace(g.qk_nope_head_dim, g.kv_lora_rank, g.fold_head_dim, g.q_lora_rank)
        self._errors: dict[int, dict[str, float]] = {}  # head -> row group -> relative error
        self._max_abs: dict[int, float] = {}  # head -> largest absolute difference

    def add(
        self, head: int, stored: torch.Tensor, scale: torch.Tensor | None = None, reference: torch.Tensor | None = None
    ) -> None:
        """Measure one head: its stored values ``[L+R, Lq]`` (and fp8 row scales ``[L+R]``) against
        ``reference``, the head's fp64 fold, when the caller has it (``verify --deep`` makes it once
        for this and for its element-wise checks), else against one made here."""
        q_nope, w_uk, own, diff = self._workspace
        if reference is None:
            reference = own
            _reference_head_into(reference, self._q_heads, self._kv_heads, head, q_nope, w_uk)
        diff.copy_(stored)
        if scale is not None:
            diff.mul_(scale.reshape(-1, 1))
        diff.sub_(reference)
        errors = self._errors.setdefault(head, {})
        for part, rows in self._rows.items():
            d, r = diff[rows].reshape(-1), reference[rows].reshape(-1)
            diff_sq, ref_sq = float(torch.dot(d, d)), float(torch.dot(r, r))
            errors[part] = math.sqrt(diff_sq / ref_sq if ref_sq else diff_sq)  # all-zero rows: the absolute error
        low, high = torch.aminmax(diff)
        self._max_abs[head] = float(torch.maximum(-low, high))

    def result(self, heads: Iterable[int] | None = None) -> FoldError:
        """The error over ``heads`` (all those added so far by default, each of them added): the
        worst head's. ``verify --deep`` measures every head, and compares what convert recorded
        of its sample with the same heads (:func:`recorded_error_mismatch`)."""
        heads = tuple(sorted(self._errors if heads is None else set(heads)))
        rows = {part: max((self._errors[h][part] for h in heads), key=nan_last, default=0.0) for part in self._rows}
        worst = max(heads, key=lambda h: nan_last(max(self._errors[h].values(), key=nan_last)), default=None)
        error = 0.0 if worst is None else max(self._errors[worst].values(), key=nan_last)
        max_abs = max((self._max_abs[h] for h in heads if not math.isnan(self._max_abs[h])), default=0.0)
        return FoldError(heads, error, max_abs, rows, worst)


def fold_error(
    fold: torch.Tensor,
    q_b: torch.Tensor,
    kv_b: torch.Tensor,
    g: Geometry,
    heads: tuple[int, ...],
    scale: torch.Tensor | None = None,
) -> FoldError:
    """How far the stored fold ``[H*(L+R), Lq]`` (with its fp8 row scales) is from the fp64 fold on
    ``heads`` (:class:`FoldErrorMeter`)."""
    stored = fold.reshape(g.num_heads, g.fold_head_dim, g.q_lora_rank)
    scales = None if scale is None else scale.reshape(g.num_heads, g.fold_head_dim)
    meter = FoldErrorMeter(q_b, kv_b, g)
    for head in heads:
        meter.add(head, stored[head], None if scales is None else scales[head])
    return meter.result()


def probe_error(
    fold: torch.Tensor,
    q_b: torch.Tensor,
    kv_b: torch.Tensor,
    g: Geometry,
    tokens: int = 8,
    seed: int = 0,
    scale: torch.Tensor | None = None,
) -> float:
    """Relative error of ``x·W_foldᵀ`` against the unfolded two-step query on random x (fp64).

    This is the property decode relies on, checked end to end on the stored tensor:
    ``x·W_foldᵀ ≈ [ (x·W_qb_nopeᵀ)·W_UK | x·W_qb_peᵀ ]`` per head.
    """
    generator = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, g.q_lora_rank, generator=generator, dtype=torch.float64)
    p = g.qk_nope_head_dim
    q_heads, kv_heads = _per_head(q_b.to(torch.float64), kv_b.to(torch.float64), g)
    q = torch.einsum("tk,hdk->htd", x, q_heads)  # [H, T, P+R]
    ql_nope = torch.bmm(q[:, :, :p], kv_heads[:, :p, :])  # [H, T, L]
    expected = torch.cat([ql_nope, q[:, :, p:]], dim=2).transpose(0, 1)  # [T, H, L+R]
    got = x @ fold.to(torch.float64).T
    if scale is not None:
        got = got * scale.to(torch.float64)
    got = got.reshape(tokens, g.num_heads, g.fold_head_dim)
    norm = expected.norm().item()
    error = (got - expected).norm().item()
    return error / norm if norm else error  # an all-zero layer: the absolute error (0 when exact)
