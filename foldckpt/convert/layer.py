"""One layer's fold computed from the source checkpoint, as convert stores it and verify re-derives it.

Gets the layer's inputs with the digest of exactly their bytes (for provenance) from a ``fetch``
(convert's: handed over by the pass that hashes the source file, :mod:`foldckpt.convert.source_reads`;
verify's: read here), dequantizes fp8 blocks, refuses NaN/Inf, folds (on the CPU or a GPU),
measures the error against fp64 head by head (a sample, and every head near underflow), and hashes the result once, head block by head
block (the leaves of :mod:`foldckpt.io.hashing`'s per-head tree).
"""

from __future__ import annotations

import math
import threading
from collections.abc import Callable, Iterator
from concurrent.futures import Executor
from contextlib import AbstractContextManager, nullcontext
from dataclasses import dataclass, replace
from pathlib import Path

import torch

from foldckpt.convert.plan import ConversionPlan, LayerPlan, SourceWeight
from foldckpt.defaults import SCALED_FOLD_DTYPES, fold_torch_dtype
from foldckpt.errors import FoldckptError
from foldckpt.fold import (
    FP8_MAX,
    FoldError,
    FoldErrorMeter,
    abs_max,
    accuracy_problem,
    all_finite,
    dequantize_fp8_blocks,
    dequantize_fp8_rows,
    fold_layer_chunks,
    fold_layer_fp8_chunks,
    sample_heads,
    underflow_suspects,
)
from foldckpt.format.manifest import FoldTensor, ScaleTensor, SourceTensor
from foldckpt.io.direct_io import BufferPool
from foldckpt.io.hashing import head_digests, tensor_digest
from foldckpt.io.safetensors_format import TensorInfo, read_tensor_bytes
from foldckpt.model.geometry import Geometry
from foldckpt.tensors import TORCH_DTYPES, tensor_from_bytes

# Head chunks of a layer's fold that may be out at once (made and not yet written): FoldRing.
_FOLD_RING_SLOTS = 8


@dataclass(frozen=True)
class LayerInputs:
    q_b_proj: torch.Tensor
    kv_b_proj: torch.Tensor
    sources: tuple[SourceTensor, ...]
    # The largest |value| of each (NaN when it holds a NaN), measured once as it is loaded.
    q_b_abs_max: float
    kv_b_abs_max: float

    def to(self, device: str) -> LayerInputs:
        """The same inputs on ``device`` (one copy each; on the CPU, these)."""
        if torch.device(device).type == "cpu":
            return self
        return replace(self, q_b_proj=self.q_b_proj.to(device), kv_b_proj=self.kv_b_proj.to(device))

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


# (file, header info) -> the tensor's bytes and their tensor digest (foldckpt.io.hashing).
Fetch = Callable[[str, TensorInfo], tuple[bytearray | memoryview, str]]


def reader(directory: Path) -> Fetch:
    """The plain ``fetch``: read the tensor from ``directory`` and hash what was read."""

    def fetch(file: str, info: TensorInfo) -> tuple[bytearray, str]:
        data = read_tensor_bytes(directory / file, info)
        return data, tensor_digest(data)

    return fetch


def _load(fetch: Fetch, file: str, info: TensorInfo) -> tuple[torch.Tensor, SourceTensor]:
    data, digest = fetch(file, info)
    tensor = tensor_from_bytes(data, info)
    return tensor, SourceTensor(info.name, file, digest)


def _load_weight(
    plan: ConversionPlan, weight: SourceWeight, allow_nonfinite: bool, fetch: Fetch
) -> tuple[torch.Tensor, list[SourceTensor], float]:
    """One fold input, dequantized to fp32 when it is fp8, the hashes of the bytes read, and its
    largest |value| (NaN when it holds a NaN)."""
    stored, record = _load(fetch, weight.file, weight.info)
    tensor, records, scale = stored, [record], None
    if weight.scale is not None and weight.block is not None:
        scale, scale_record = _load(fetch, *weight.scale)
        records.append(scale_record)
        tensor = dequantize_fp8_blocks(stored, scale, weight.block, weight.name)
    largest = abs_max(tensor)
    if not allow_nonfinite and not math.isfinite(largest):
        file, what = _nonfinite_source(weight, stored, scale)
        raise FoldckptError(
            f"{plan.source.model_dir / file}: {what}; refusing to fold (pass --allow-nonfinite to fold it anyway)"
        )
    return tensor, records, largest


def _nonfinite_source(weight: SourceWeight, stored: torch.Tensor, scale: torch.Tensor | None) -> tuple[str, str]:
    """Which file and tensor put a NaN or Inf into a fold input (only asked once one is found): an
    fp8 weight's block scales may lie in another shard than the weight, and a user must be sent to
    the bytes that hold it, or told that finite values overflowed float32 when multiplied."""
    if scale is None or not all_finite(stored):
        return weight.file, f"tensor '{weight.name}' contains NaN or Inf"
    scale_file, scale_info = weight.scale  # type: ignore[misc]
    if not all_finite(scale):
        return scale_file, f"tensor '{scale_info.name}' (the block scales of '{weight.name}') contains NaN or Inf"
    return weight.file, (
        f"tensor '{weight.name}' times its block scales '{scale_info.name}' (in {scale_file}) overflows float32"
    )


def nonfinite_count(fold: torch.Tensor, scale: torch.Tensor | None = None) -> int:
    """How many of the fold's values are NaN or Inf (an fp8 fold: once scaled by its row scales,
    ``scale`` shaped as ``fold`` without its last dimension)."""
    if all_finite(fold) and (scale is None or all_finite(scale)):
        return 0
    values = fold if scale is None else dequantize_fp8_rows(fold, scale)
    finite = torch.isfinite(values)
    return int(finite.numel() - finite.sum())


def nonfinite_fold_problem(count: int, numel: int, inputs: LayerInputs, fold_dtype: str) -> str | None:
    """Why a fold with ``count`` NaN/Inf values out of ``numel`` is wrong, or None when it has none
    (or its inputs already had some, which ``--allow-nonfinite`` let through): finite inputs whose
    fold is not finite overflowed the fold dtype (an fp8 fold: its values or its scales)."""
    if not count or not inputs.finite():
        return None
    return (
        f"{count} of its {numel} values are Inf or NaN although q_b_proj and kv_b_proj are finite: "
        f"the fold overflows {fold_dtype}"
    )


def check_fold_finite(count: int, inputs: LayerInputs, layer: LayerPlan, fold_dtype: str) -> None:
    """Refuse a fold with ``count`` NaN/Inf values (:func:`nonfinite_fold_problem`)."""
    problem = nonfinite_fold_problem(count, math.prod(layer.output.shape), inputs, fold_dtype)
    if problem is not None:
        largest = torch.finfo(TORCH_DTYPES[layer.output.dtype]).max
        raise FoldckptError(
            f"{plan_layer_label(layer)}: {problem} (largest value {largest:.6g}); {_wider_fold_dtypes(fold_dtype)}"
        )


def check_fold_scales(small: int, layer: LayerPlan) -> None:
    """Refuse an fp8 fold with ``small`` row scales (``amax / 448``) below float32's normal range
    (:func:`small_scales`): there they lose precision (the rows' values are then more than one
    rounding off, which ``verify --deep`` finds) or become 0 (and the row's values NaN, which would
    read as an overflow)."""
    if small:
        tiny = torch.finfo(torch.float32).tiny
        raise FoldckptError(
            f"{plan_layer_label(layer)}: {small} row scale(s) of the fp8 fold fall below float32's smallest normal "
            f"number {tiny:.2e} (rows whose largest value is below {FP8_MAX * tiny:.2e}), where they lose their "
            f"precision; {_wider_fold_dtypes('fp8', precision=True)}"
        )


def small_scales(scale: torch.Tensor) -> int:
    """How many of an fp8 fold's row scales lie below float32's smallest normal number."""
    return int((scale < torch.finfo(torch.float32).tiny).sum())


def check_fold_accuracy(error: FoldError, inputs: LayerInputs, layer: LayerPlan, fold_dtype: str) -> None:
    """Refuse a fold farther from fp64 than one rounding to its dtype allows, in any head measured,
    by the rule ``verify --deep`` applies (:func:`~foldckpt.fold.accuracy_problem`), so that convert
    never writes a fold its own verify rejects. With finite inputs and no overflow, what breaks it
    is underflow: fp16's normal range ends at 6.1e-5, and the ql_nope rows of a model with small
    weights (or of one head with small weights) can lie below it. Inputs with NaN or Inf
    (``--allow-nonfinite``) have no such bound."""
    dtype = fold_torch_dtype(fold_dtype)
    problem = accuracy_problem(error, dtype)
    if problem is None or not inputs.finite():
        return  # within one rounding, or NaN/Inf inputs let through by --allow-nonfinite
    if fold_dtype in SCALED_FOLD_DTYPES:
        why = "values far below the largest of their row keep too few of e4m3's bits"
    else:
        why = f"values below {fold_dtype}'s smallest normal number ({torch.finfo(dtype).tiny:.2e}) keep too few bits"
    raise FoldckptError(
        f"{plan_layer_label(layer)}: {problem}: {why}; {_wider_fold_dtypes(fold_dtype, precision=True)}"
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


class FoldRing:
    """The page-aligned buffers a layer's fold goes into, head chunk by head chunk
    (:func:`~foldckpt.fold.fold_layer_chunks`), and the sidecar writer writes from: :meth:`take`
    waits until fewer than ``slots`` are out, the writer gives each back once it is written.

    Why: a Kimi-K3 layer's fold is 170 MB in bf16. Held whole, and twice so that one layer was
    folded while the other was written, it was 340 MB of a conversion's peak RSS; 8 chunks of 4
    heads are 57 MB, and the fold still runs up to 7 chunks ahead of the
    writer. Buffers are reused by size (:class:`~foldckpt.io.direct_io.BufferPool`: a fresh one costs
    its page faults) and page-aligned, so the writer's direct I/O takes their bytes as they are."""

    def __init__(
        self, slots: int = _FOLD_RING_SLOTS, waiting: Callable[[], AbstractContextManager[object]] = nullcontext
    ) -> None:
        """``waiting``: a context around each wait for a free buffer (convert times them)."""
        self._free_slots = threading.Semaphore(slots)
        self._waiting = waiting
        self._pool = BufferPool()

    def take(self, shape: tuple[int, ...], dtype: torch.dtype) -> tuple[memoryview, torch.Tensor]:
        """A buffer (once one is free) and a tensor of ``shape`` over it."""
        nbytes = math.prod(shape) * dtype.itemsize
        if not self._free_slots.acquire(blocking=False):
            with self._waiting():
                self._free_slots.acquire()
        buffer = self._pool.get(nbytes)
        tensor = torch.frombuffer(buffer, dtype=dtype).view(shape) if nbytes else torch.empty(shape, dtype=dtype)
        return buffer, tensor

    def give_back(self, buffer: memoryview) -> None:
        self._pool.put(buffer)
        self._free_slots.release()


# Where each part of a layer's fold goes once it is made (in sidecar order): a buffer of the
# ring, which the consumer gives back once it is done with it.
Emit = Callable[[memoryview], None]


def fold_from_source(
    plan: ConversionPlan,
    layer: LayerPlan,
    shard: str,
    pool: Executor,
    ring: FoldRing,
    emit: Emit,
    allow_nonfinite: bool = False,
    fetch: Fetch | None = None,
    device: str = "cpu",
    release: Callable[[], None] | None = None,
) -> FoldTensor:
    """Fold one layer head chunk by head chunk into ``ring``'s buffers and ``emit`` each chunk's
    stored bytes once hashed (each fold byte once, head by head: the leaves of
    :mod:`foldckpt.io.hashing`'s per-head tree) and measured, then the fp8 row scales if any. Returns
    the layer's manifest record once every check has passed; a check that fails raises after
    chunks were emitted, so the caller must count no emitted bytes as the layer's before it has
    the record (convert journals a layer after it). A GPU fold copies the inputs to the GPU first
    and calls ``release`` then: it reads the bytes ``fetch`` handed over no more."""
    g = plan.geometry
    inputs = load_layer_inputs(plan, layer, allow_nonfinite, fetch).to(device)
    if release is not None and torch.device(device).type != "cpu":
        release()
    scan = not inputs.fold_cannot_overflow(g, plan.fold_dtype)
    # measured against fp64: a sample of heads, and every head whose values the fold dtype's
    # normal range may not hold (underflow_suspects screens them all)
    sample = sample_heads(g.num_heads)
    meter = FoldErrorMeter(inputs.q_b_proj, inputs.kv_b_proj, g)
    dtype = TORCH_DTYPES[layer.output.dtype]
    taken: dict[int, memoryview] = {}  # buffers out and not yet emitted, by the chunk's first head

    def take(heads: slice) -> torch.Tensor:
        taken[heads.start], values = ring.take((heads.stop - heads.start, g.fold_head_dim, g.q_lora_rank), dtype)
        return values

    chunks: Iterator[tuple[slice, torch.Tensor, torch.Tensor | None]]
    if layer.scale_output is not None:
        taken[-1], scale = ring.take((g.num_heads, g.fold_head_dim), torch.float32)  # the row scales: -1
        chunks = fold_layer_fp8_chunks(
            inputs.q_b_proj, inputs.kv_b_proj, g, device, lambda heads: (take(heads), scale[heads])
        )
    else:
        chunks = (
            (heads, values, None)
            for heads, values in fold_layer_chunks(inputs.q_b_proj, inputs.kv_b_proj, g, dtype, device, take)
        )
    leaves: list[str] = []
    nonfinite = small = 0
    try:
        for heads, values, chunk_scale in chunks:
            if chunk_scale is not None:
                small += small_scales(chunk_scale)
            if scan:
                nonfinite += nonfinite_count(values, chunk_scale)
            measured = {head - heads.start for head in sample if heads.start <= head < heads.stop}
            for row in sorted(measured.union(underflow_suspects(values, g))):
                meter.add(heads.start + row, values[row], None if chunk_scale is None else chunk_scale[row])
            leaves += head_digests(taken[heads.start], heads.stop - heads.start, pool)
            emit(taken.pop(heads.start))  # emit owns it now, also if it raises
        scale_record = None
        if layer.scale_output is not None:
            spec = layer.scale_output
            scale_record = ScaleTensor(spec.name, spec.dtype, spec.shape, head_digests(taken[-1], g.num_heads, pool))
            emit(taken.pop(-1))
    finally:
        for buffer in taken.values():  # where the fold failed
            ring.give_back(buffer)
    check_fold_scales(small, layer)
    check_fold_finite(nonfinite, inputs, layer, plan.fold_dtype)
    error = meter.result()
    check_fold_accuracy(error, inputs, layer, plan.fold_dtype)
    return FoldTensor(
        name=layer.output.name,
        layer_index=layer.layer.index,
        layer_prefix=layer.layer.prefix,
        file=shard,
        dtype=layer.output.dtype,
        shape=g.fold_shape,
        head_blake3=tuple(leaves),
        sources=inputs.sources,
        error=error.to_dict(),
        scale=scale_record,
    )
