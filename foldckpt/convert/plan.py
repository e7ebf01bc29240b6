"""Plan a conversion from headers alone, and reject every bad input before any work is done.

The plan says, per MLA layer, which source tensors feed its fold (and in which files, possibly
different shards), how to dequantize them, and which sidecar shard the fold goes to. Building it
reads ``config.json``, the index and the shard headers only; ``--dry-run`` prints it.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foldckpt import __version__
from foldckpt.defaults import (
    DEFAULT_FOLD_DTYPE,
    DEFAULT_MAX_SHARD_SIZE,
    FOLD_DTYPE_NAMES,
    FOLD_SCALE_DTYPE,
    SCALED_FOLD_DTYPES,
    SIDECAR_HEADER_ALIGN,
    SIDECAR_PREFIX,
)
from foldckpt.errors import FoldckptError
from foldckpt.io.safetensors_format import TensorInfo, TensorSpec, file_size_for
from foldckpt.model.checkpoint import (
    SourceCheckpoint,
    list_files_to_place,
    open_source_checkpoint,
)
from foldckpt.model.geometry import Geometry, MLALayer, read_geometry

# ``--fold-dtype`` choices (and the safetensors dtype each is stored as), the sidecar prefix and the
# shard cap are written once, in foldckpt.defaults. Planning needs no torch; ``FOLD_DTYPES``
# (name -> torch dtype) is built on first access.
SIDECAR_METADATA = {"format": "pt", "producer": f"foldckpt {__version__}"}
_DIRECT_DTYPES = ("BF16", "F16", "F32")
_FP8_DTYPE = "F8_E4M3"
_SCALE_DTYPES = ("F32", "BF16", "F16")
_DEFAULT_FP8_BLOCK = (128, 128)


@dataclass(frozen=True)
class SourceWeight:
    """One input of a fold: a weight tensor, plus its block scales when it is fp8."""

    name: str
    file: str
    info: TensorInfo
    scale: tuple[str, TensorInfo] | None = None
    block: tuple[int, int] | None = None


@dataclass(frozen=True)
class LayerPlan:
    layer: MLALayer
    q_b_proj: SourceWeight
    kv_b_proj: SourceWeight
    output: TensorSpec
    # An fp8 fold's fp32 scale per row, stored right after it.
    scale_output: TensorSpec | None = None

    @property
    def outputs(self) -> list[TensorSpec]:
        return [self.output] if self.scale_output is None else [self.output, self.scale_output]

    def input_tensors(self) -> list[tuple[str, TensorInfo]]:
        """(file, header info) of every source tensor the fold reads: the weights and fp8 scales."""
        found: list[tuple[str, TensorInfo]] = []
        for weight in (self.q_b_proj, self.kv_b_proj):
            found.append((weight.file, weight.info))
            if weight.scale is not None:
                found.append(weight.scale)
        return found


@dataclass(frozen=True)
class ShardPlan:
    name: str
    layers: tuple[LayerPlan, ...]

    @property
    def specs(self) -> list[TensorSpec]:
        return [spec for layer in self.layers for spec in layer.outputs]

    @property
    def size(self) -> int:
        return sidecar_size(self.specs)


@dataclass(frozen=True)
class ConversionPlan:
    source: SourceCheckpoint
    geometry: Geometry
    fold_dtype: str
    tp_sizes: tuple[int, ...]
    shards: tuple[ShardPlan, ...]
    files_to_place: tuple[str, ...]

    @property
    def layers(self) -> tuple[LayerPlan, ...]:
        return tuple(layer for shard in self.shards for layer in shard.layers)

    @property
    def fold_bytes(self) -> int:
        return sum(spec.nbytes for layer in self.layers for spec in layer.outputs)

    @property
    def sidecar_bytes(self) -> int:
        return sum(shard.size for shard in self.shards)

    def source_bytes(self) -> int:
        return sum((self.source.model_dir / name).stat().st_size for name in self.files_to_place)

    def extra_bytes_per_gpu(self) -> dict[int, int]:
        """Fold weight each GPU holds on top of the original model, per tensor-parallel size."""
        return {tp: self.fold_bytes // tp for tp in self.tp_sizes}


def __getattr__(name: str) -> Any:
    """``FOLD_DTYPES``: ``--fold-dtype`` name -> torch dtype, without importing torch up front."""
    if name == "FOLD_DTYPES":
        from foldckpt.defaults import fold_torch_dtype

        return {dtype: fold_torch_dtype(dtype) for dtype in FOLD_DTYPE_NAMES}
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def sidecar_name(number: int, total: int) -> str:
    return f"{SIDECAR_PREFIX}{number:05d}-of-{total:05d}.safetensors"


def _source_weight(
    source: SourceCheckpoint, geometry: Geometry, layer: MLALayer, name: str, shape: tuple[int, int]
) -> SourceWeight:
    located = source.locate(name)
    if located is None:
        raise FoldckptError.at(source.model_dir, f"MLA layer {layer.index} has no tensor '{name}'", name)
    file, info = located
    path, where = source.model_dir / file, f"tensor '{name}'"
    if info.shape != shape:
        raise FoldckptError.at(
            path,
            f"{where} has shape {list(info.shape)} but config.json implies {list(shape)} "
            f"(heads={geometry.num_heads}, q_lora_rank={geometry.q_lora_rank}, "
            f"kv_lora_rank={geometry.kv_lora_rank}, qk_nope={geometry.qk_nope_head_dim}, "
            f"qk_rope={geometry.qk_rope_head_dim}, v_head={geometry.v_head_dim}); config and weights disagree",
            name,
        )
    if info.dtype in _DIRECT_DTYPES:
        return SourceWeight(name, file, info)
    if info.dtype != _FP8_DTYPE:
        raise FoldckptError.at(
            path,
            f"{where} has dtype {info.dtype}; foldckpt folds bf16/fp16/fp32 and fp8 e4m3 with "
            "128x128 weight_scale_inv blocks only",
            name,
        )
    scale_name = f"{name}_scale_inv"
    scale = source.locate(scale_name)
    if scale is None:
        raise FoldckptError.at(path, f"{where} is fp8 but '{scale_name}' is missing; cannot dequantize", name)
    if scale[1].dtype not in _SCALE_DTYPES:
        raise FoldckptError.at(
            source.model_dir / scale[0], f"tensor '{scale_name}' has dtype {scale[1].dtype}, expected F32", scale_name
        )
    block = geometry.weight_block_size or _DEFAULT_FP8_BLOCK
    expected = (-(-shape[0] // block[0]), -(-shape[1] // block[1]))
    if scale[1].shape != expected:
        raise FoldckptError.at(
            source.model_dir / scale[0],
            f"tensor '{scale_name}' has shape {list(scale[1].shape)}, "
            f"expected {list(expected)} for {block[0]}x{block[1]} blocks",
            scale_name,
        )
    return SourceWeight(name, file, info, scale=(scale[0], scale[1]), block=block)


def sidecar_size(specs: list[TensorSpec]) -> int:
    """The size of a sidecar shard holding ``specs`` (its header as :class:`~foldckpt.format.sidecar.ShardWriter` writes it)."""
    return file_size_for(specs, SIDECAR_METADATA, SIDECAR_HEADER_ALIGN)


def _pack_shards(layers: list[LayerPlan], max_shard_size: int) -> tuple[ShardPlan, ...]:
    """Greedy, order-preserving packing; a fold larger than the cap gets a shard of its own."""
    groups: list[list[LayerPlan]] = [[]]
    for layer in layers:
        candidate = groups[-1] + [layer]
        if groups[-1] and sidecar_size([spec for lp in candidate for spec in lp.outputs]) > max_shard_size:
            groups.append([layer])
        else:
            groups[-1] = candidate
    return tuple(ShardPlan(sidecar_name(i + 1, len(groups)), tuple(group)) for i, group in enumerate(groups))


def resolve_tp_sizes(geometry: Geometry, tp_sizes: tuple[int, ...] | None) -> tuple[int, ...]:
    if not tp_sizes:
        return geometry.valid_tp_sizes()
    for tp in tp_sizes:
        if isinstance(tp, bool) or not isinstance(tp, int) or tp <= 0:
            raise FoldckptError(f"--tp {tp}: not a tensor-parallel size; give positive integers such as --tp 1,2,4,8")
        if geometry.num_heads % tp:
            raise FoldckptError(f"--tp {tp}: does not divide the model's {geometry.num_heads} attention heads")
    return tuple(sorted(set(tp_sizes)))


def _refuse_foldckpt_output(model_dir: Path) -> None:
    """A foldckpt output (finished or not) is not a model to convert: its manifest, journal and
    sidecars would be carried over as source files of the new output, which then fails verify."""
    from foldckpt.defaults import JOURNAL_NAME
    from foldckpt.format.manifest import MANIFEST_NAME

    marks = [MANIFEST_NAME, JOURNAL_NAME, *sorted(p.name for p in model_dir.glob(f"{SIDECAR_PREFIX}*.safetensors"))]
    found = [name for name in marks if (model_dir / name).exists()]
    if found:
        raise FoldckptError.at(
            model_dir,
            f"is a foldckpt output (holds {found[0]}), not a model to convert; "
            "convert the original model it was made from (it already serves folded and unfolded)",
        )


def plan_conversion(
    model_dir: Path,
    fold_dtype: str = DEFAULT_FOLD_DTYPE,
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE,
    tp_sizes: tuple[int, ...] | None = None,
    external_links: bool = False,
) -> ConversionPlan:
    """Validate ``model_dir`` on headers alone and lay out the conversion.

    ``external_links`` is for re-planning a ``--link symlink`` output in ``verify --deep``.
    """
    model_dir = Path(model_dir)
    if fold_dtype not in FOLD_DTYPE_NAMES:
        raise FoldckptError(f"--fold-dtype {fold_dtype!r}: choose one of {', '.join(FOLD_DTYPE_NAMES)}")
    if max_shard_size <= 0:
        raise FoldckptError("--max-shard-size must be positive")
    if not model_dir.is_dir():  # before config.json: a missing directory is not a missing config
        raise FoldckptError.at(model_dir, "not a directory" if model_dir.exists() else "no such directory")
    if not external_links:
        _refuse_foldckpt_output(model_dir)
    geometry = read_geometry(model_dir)
    source = open_source_checkpoint(model_dir, external_links)
    if any(name.startswith(SIDECAR_PREFIX) for name in source.headers):
        raise FoldckptError.at(model_dir, "already holds foldckpt sidecars; convert the original model")
    out_dtype = FOLD_DTYPE_NAMES[fold_dtype]
    layers = [
        LayerPlan(
            layer=layer,
            q_b_proj=_source_weight(source, geometry, layer, layer.q_b_proj, geometry.q_b_proj_shape),
            kv_b_proj=_source_weight(source, geometry, layer, layer.kv_b_proj, geometry.kv_b_proj_shape),
            output=TensorSpec(layer.q_fold, out_dtype, geometry.fold_shape),
            scale_output=TensorSpec(layer.q_fold_scale, FOLD_SCALE_DTYPE, (geometry.fold_shape[0],))
            if fold_dtype in SCALED_FOLD_DTYPES
            else None,
        )
        for layer in geometry.layers
    ]
    return ConversionPlan(
        source=source,
        geometry=geometry,
        fold_dtype=fold_dtype,
        tp_sizes=resolve_tp_sizes(geometry, tp_sizes),
        shards=_pack_shards(layers, max_shard_size),
        files_to_place=tuple(list_files_to_place(model_dir, external_links)),
    )
