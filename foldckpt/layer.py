"""One layer's fold computed from the source checkpoint, as convert stores it and verify re-derives it.

Gets the layer's inputs with the digest of exactly their bytes (for provenance) from a ``fetch``
(convert's: handed over by the pass that hashes the source file, :mod:`foldckpt.source_reads`;
verify's: read here), dequantizes fp8 blocks, refuses NaN/Inf, folds (on the CPU or a GPU),
measures the error against fp64 on sampled heads, and hashes the result once, head block by head
block (the leaves of :mod:`foldckpt.hashing`'s per-head tree).
"""

from __future__ import annotations

import math
from collections.abc import Callable
from concurrent.futures import Executor
from dataclasses import dataclass
from pathlib import Path

import torch

from foldckpt.defaults import SCALED_FOLD_DTYPES, fold_torch_dtype
from foldckpt.direct_io import aligned_buffer
from foldckpt.errors import FoldckptError
from foldckpt.fold import (
    FP8_MAX,
    ROUNDING_TOLERANCE,
    FoldError,
    abs_max,
    all_finite,
    dequantize_fp8_blocks,
    dequantize_fp8_rows,
    fold_error,
    fold_layer,
    fold_layer_fp8,
    sample_heads,
    within_one_rounding,
)
from foldckpt.geometry import Geometry
from foldckpt.hashing import head_digests, tensor_digest
from foldckpt.manifest import FoldTensor, ScaleTensor, SourceTensor
from foldckpt.plan import FOLD_DTYPES, ConversionPlan, LayerPlan, SourceWeight
from foldckpt.safetensors_format import TORCH_DTYPES, TensorInfo, read_tensor_bytes, tensor_to_bytes


@dataclass(frozen=True)
class LayerInputs:
    q_b_proj: torch.Tensor
    kv_b_proj: torch.Tensor
    sources: tuple[SourceTensor, ...]
    # The largest |value| of each (NaN when it holds a NaN), measured once as it is loaded.
    q_b_abs_max: float
    kv_b_abs_max: float

    def finite(self) -> bool:
        """Whether both inputs are free of NaN and Inf (only ``--allow-nonfinite`` lets them not be)."""
        return math.isfinite(self.q_b_abs_max) and math.isfinite(self.kv_b_abs_max)

    def fold_cannot_overflow(self, g: Geometry, fold_dtype: str) -> bool:
        """Whether their fold is finite by construction, so that nobody need scan its 170 MB (Kimi-K3,
        bf16) for Inf: an element of W_UKᵀ·W_qb_nope is a sum of P products, so ``|value| <= P ·
        max|q_b_proj| · max|kv_b_proj|`` (fp32 sums, whose rounding the factor 2 of the margin covers),
        and the q_pe rows are q_b_proj's values; the bound must lie within the fold dtype (an fp8
        fold: within its fp32 scales, its values are scaled to e4m3's range)."""
        bound = max(g.qk_nope_head_dim * self.q_b_abs_max * self.kv_b_abs_max, self.q_b_abs_max)
        dtype = torch.float32 if fold_dtype in SCALED_FOLD_DTYPES else fold_torch_dtype(fold_dtype)
        return bound <= torch.finfo(dtype).max / 2  # False for NaN and Inf


# (file, header info) -> the tensor's bytes and their tensor digest (foldckpt.hashing).
Fetch = Callable[[str, TensorInfo], tuple[bytearray | memoryview, str]]


def reader(directory: Path) -> Fetch:
    """The plain ``fetch``: read the tensor from ``directory`` and hash what was read."""

    def fetch(file: str, info: TensorInfo) -> tuple[bytearray, str]:
        data = read_tensor_bytes(directory / file, info)
        return data, tensor_digest(data)

    return fetch


def _load(fetch: Fetch, file: str, info: TensorInfo) -> tuple[torch.Tensor, SourceTensor]:
    data, digest = fetch(file, info)
    tensor = torch.frombuffer(data, dtype=TORCH_DTYPES[info.dtype]).reshape(info.shape)
    return tensor, SourceTensor(info.name, file, digest)


def _load_weight(
    plan: ConversionPlan, weight: SourceWeight, allow_nonfinite: bool, fetch: Fetch
) -> tuple[torch.Tensor, list[SourceTensor], float]:
    """One fold input, dequantized to fp32 when it is fp8, the hashes of the bytes read, and its
    largest |value| (NaN when it holds a NaN)."""
    tensor, record = _load(fetch, weight.file, weight.info)
    records = [record]
    if weight.scale is not None and weight.block is not None:
        scale, scale_record = _load(fetch, *weight.scale)
        records.append(scale_record)
        tensor = dequantize_fp8_blocks(tensor, scale, weight.block, weight.name)
    largest = abs_max(tensor)
    if not allow_nonfinite and not math.isfinite(largest):
        raise FoldckptError(
            f"{plan.source.model_dir / weight.file}: tensor '{weight.name}' contains NaN or Inf; "
            "refusing to fold (pass --allow-nonfinite to fold it anyway)"
        )
    return tensor, records, largest


def nonfinite_fold_problem(
    fold: torch.Tensor, inputs: LayerInputs, fold_dtype: str, scale: torch.Tensor | None = None
) -> str | None:
    """Why a fold with NaN/Inf is wrong, or None when it has none (or its inputs already had some,
    which ``--allow-nonfinite`` let through): finite inputs whose fold is not finite overflowed
    the fold dtype (an fp8 fold: its values or its scales)."""
    if (all_finite(fold) and (scale is None or all_finite(scale))) or not inputs.finite():
        return None
    values = fold if scale is None else dequantize_fp8_rows(fold, scale)
    finite = torch.isfinite(values)
    count = int(finite.numel() - finite.sum())
    return (
        f"{count} of its {fold.numel()} values are Inf or NaN although q_b_proj and kv_b_proj are finite: "
        f"the fold overflows {fold_dtype}"
    )


def check_fold_finite(
    fold: torch.Tensor, inputs: LayerInputs, layer: LayerPlan, fold_dtype: str, scale: torch.Tensor | None = None
) -> None:
    problem = nonfinite_fold_problem(fold, inputs, fold_dtype, scale)
    if problem is not None:
        raise FoldckptError(
            f"{plan_layer_label(layer)}: {problem} (largest value {torch.finfo(fold.dtype).max:.6g}); "
            f"{_wider_fold_dtypes(fold_dtype)}"
        )


def check_fold_scales(scale: torch.Tensor | None, layer: LayerPlan, fold_dtype: str) -> None:
    """Refuse an fp8 fold with a row scale (``amax / 448``) below float32's normal range: there it
    loses precision (the rows' values are then more than one rounding off, which ``verify --deep``
    finds) or becomes 0 (and the row's values NaN, which would read as an overflow)."""
    if scale is None:
        return
    tiny = torch.finfo(torch.float32).tiny
    small = int((scale < tiny).sum())
    if small:
        raise FoldckptError(
            f"{plan_layer_label(layer)}: {small} row scale(s) of the fp8 fold fall below float32's smallest normal "
            f"number {tiny:.2e} (rows whose largest value is below {FP8_MAX * tiny:.2e}), where they lose their "
            f"precision; {_wider_fold_dtypes(fold_dtype, precision=True)}"
        )


def check_fold_accuracy(error: FoldError, inputs: LayerInputs, layer: LayerPlan, fold_dtype: str) -> None:
    """Refuse a fold farther from fp64 than one rounding to its dtype allows, the rule ``verify
    --deep`` applies (:func:`~foldckpt.fold.within_one_rounding`), so that convert never writes a
    fold its own verify rejects. With finite inputs and no overflow, what breaks it is underflow:
    fp16's normal range ends at 6.1e-5, and the ql_nope rows of a model with small weights can lie
    below it. Inputs with NaN or Inf (``--allow-nonfinite``) have no such bound."""
    dtype = fold_torch_dtype(fold_dtype)
    if within_one_rounding(error.rel_fro_error, dtype):
        return
    if not inputs.finite():
        return  # NaN/Inf inputs, let through by --allow-nonfinite
    if fold_dtype in SCALED_FOLD_DTYPES:
        why = "values far below the largest of their row keep too few of e4m3's bits"
    else:
        why = f"values below {fold_dtype}'s smallest normal number ({torch.finfo(dtype).tiny:.2e}) keep too few bits"
    raise FoldckptError(
        f"{plan_layer_label(layer)}: relative error vs fp64 {error.rel_fro_error:.2e} in its {error.worst_rows} rows "
        f"is more than one rounding to {fold_dtype} costs ({ROUNDING_TOLERANCE[dtype]:.1e}): {why}; "
        f"{_wider_fold_dtypes(fold_dtype, precision=True)}"
    )


def _wider_fold_dtypes(fold_dtype: str, precision: bool = False) -> str:
    """What to do about a fold its dtype cannot hold: the dtypes with more range (bfloat16 has
    float32's) or, for values that underflow (``precision``), more bits; none for float32."""
    wider = {"fp8": "bfloat16 or float32", "float16": "bfloat16 or float32"}
    wider["bfloat16"] = "float32" if precision else None
    if wider.get(fold_dtype) is None:
        return "no fold dtype holds it: check the source weights"
    return f"choose --fold-dtype {wider[fold_dtype]}"


def plan_layer_label(layer: LayerPlan) -> str:
    return f"MLA layer {layer.layer.index}{' (mtp)' if layer.layer.is_mtp else ''} ('{layer.output.name}')"


def load_layer_inputs(
    plan: ConversionPlan, layer: LayerPlan, allow_nonfinite: bool = False, fetch: Fetch | None = None
) -> LayerInputs:
    fetch = fetch or reader(plan.source.model_dir)
    q_b, q_sources, q_b_abs_max = _load_weight(plan, layer.q_b_proj, allow_nonfinite, fetch)
    kv_b, kv_sources, kv_b_abs_max = _load_weight(plan, layer.kv_b_proj, allow_nonfinite, fetch)
    return LayerInputs(q_b, kv_b, tuple(q_sources + kv_sources), q_b_abs_max, kv_b_abs_max)


class FoldBuffers:
    """Two sets of fold output tensors, used in turn: the fold of layer i + 1 is written into one
    while the other still holds layer i on its way to disk. Why: a fresh 170 MB tensor per layer
    costs its page faults (measured 70 ms to fill one against 11 ms reused). Each tensor is
    page-aligned, so that the sidecar writer's direct I/O takes its bytes without a staging copy.
    The caller must have finished with the bytes of a layer before the fold after next (convert
    waits for each write before it starts the next one)."""

    def __init__(self) -> None:
        self._sets: list[list[torch.Tensor] | None] = [None, None]
        self._turn = 0

    def take(self, layer: LayerPlan) -> list[torch.Tensor]:
        turn, self._turn = self._turn, self._turn ^ 1
        wanted = [(spec.shape, TORCH_DTYPES[spec.dtype]) for spec in layer.outputs]
        held = self._sets[turn]
        if held is None or [(tuple(t.shape), t.dtype) for t in held] != wanted:
            held = self._sets[turn] = [_page_aligned_tensor(shape, dtype) for shape, dtype in wanted]
        return held


def _page_aligned_tensor(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    nbytes = math.prod(shape) * dtype.itemsize
    if not nbytes:
        return torch.empty(shape, dtype=dtype)
    return torch.frombuffer(aligned_buffer(nbytes), dtype=dtype).view(shape)


def fold_from_source(
    plan: ConversionPlan,
    layer: LayerPlan,
    shard: str,
    pool: Executor,
    allow_nonfinite: bool = False,
    fetch: Fetch | None = None,
    device: str = "cpu",
    buffers: FoldBuffers | None = None,
) -> tuple[list[memoryview], FoldTensor]:
    """The stored bytes of one layer's fold (the tensors in sidecar order) and its manifest record;
    the bytes live in ``buffers`` when given (valid until the fold after next)."""
    geometry = plan.geometry
    inputs = load_layer_inputs(plan, layer, allow_nonfinite, fetch)
    out = buffers.take(layer) if buffers is not None else None
    scale: torch.Tensor | None = None
    if layer.scale_output is not None:
        fold, scale = fold_layer_fp8(inputs.q_b_proj, inputs.kv_b_proj, geometry, device, None if out is None else (out[0], out[1]))
    else:
        dtype = FOLD_DTYPES[plan.fold_dtype]
        fold = fold_layer(inputs.q_b_proj, inputs.kv_b_proj, geometry, dtype, device, None if out is None else out[0])
    check_fold_scales(scale, layer, plan.fold_dtype)
    if not inputs.fold_cannot_overflow(geometry, plan.fold_dtype):
        check_fold_finite(fold, inputs, layer, plan.fold_dtype, scale)
    error = fold_error(fold, inputs.q_b_proj, inputs.kv_b_proj, geometry, sample_heads(geometry.num_heads), scale)
    check_fold_accuracy(error, inputs, layer, plan.fold_dtype)
    data = [tensor_to_bytes(fold)] + ([] if scale is None else [tensor_to_bytes(scale)])
    # each fold byte hashed once, head block by head block: any rank of any TP size checks its own
    leaves = [head_digests(part, geometry.num_heads, pool) for part in data]
    scale_record = None
    if layer.scale_output is not None:
        spec = layer.scale_output
        scale_record = ScaleTensor(spec.name, spec.dtype, spec.shape, leaves[1])
    record = FoldTensor(
        name=layer.output.name,
        layer_index=layer.layer.index,
        layer_prefix=layer.layer.prefix,
        file=shard,
        dtype=layer.output.dtype,
        shape=geometry.fold_shape,
        head_blake3=leaves[0],
        sources=inputs.sources,
        error=error.to_dict(),
        scale=scale_record,
    )
    return data, record
