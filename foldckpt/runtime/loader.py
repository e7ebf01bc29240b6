"""Finding, checking and reading the fold sidecars of a converted checkpoint (no vLLM here).

The plugin calls :func:`open_fold_set` once per served directory, while the model is being built
and before any weight is read: it checks everything that can be checked without tensor data (the
manifest parses, its geometry is the one ``config.json`` implies, every MLA layer has a fold of the
right shape and dtype, every sidecar exists with its recorded size and a valid header that holds
the fold). A defect anywhere stops the engine with a :class:`FoldckptError` naming the file or layer,
so a model is folded completely or not at all.

:meth:`FoldSet.read_rows` then reads the rows one tensor-parallel rank owns (a plain row range,
see ARCHITECTURE.md "Layout") with ``pread`` and checks their sha256 against the manifest before a
single value reaches the model: corrupted bytes never serve.
"""

from __future__ import annotations

import functools
import hashlib
from dataclasses import dataclass
from pathlib import Path

import torch

from foldckpt.checkpoint import resolve_inside
from foldckpt.errors import FoldckptError
from foldckpt.geometry import CONFIG_NAME, Geometry, MLALayer, geometry_from_config, read_config
from foldckpt.manifest import MANIFEST_NAME, FoldTensor, Manifest, read_manifest
from foldckpt.plan import FOLD_DTYPES
from foldckpt.safetensors_format import (
    SAFETENSORS_DTYPES,
    TORCH_DTYPES,
    SafetensorsHeader,
    read_header,
    read_tensor_bytes,
)

_REMEDY = "re-run `foldckpt convert`, or set FOLDCKPT_DISABLE=1 to serve without the fold"

# vLLM module prefixes that differ from checkpoint tensor prefixes: the MTP loaders remap
# ``model.layers.61.self_attn`` to ``model.layers.61.mtp_block.self_attn``, and Kimi-K3's MTP
# model is built without the ``language_model.`` its checkpoint tensors carry.
_MODULE_ALIASES = (".mtp_block.",)
_OUTER_PREFIXES = ("", "language_model.")


@dataclass(frozen=True)
class FoldSet:
    """A checked converted directory: its manifest and the validated header of every sidecar."""

    model_dir: Path
    manifest: Manifest
    headers: dict[str, SafetensorsHeader]

    @property
    def geometry(self) -> Geometry:
        return self.manifest.geometry

    def layer_for_module(self, attn_prefix: str) -> MLALayer:
        """The MLA layer whose attention module vLLM built under ``attn_prefix``
        (e.g. ``model.layers.3.self_attn``); error when the manifest has no fold for it."""
        name = attn_prefix
        for alias in _MODULE_ALIASES:
            name = name.replace(alias, ".")
        candidates = {outer + name for outer in _OUTER_PREFIXES}
        for layer in self.geometry.layers:
            if f"{layer.prefix}.self_attn" in candidates:
                return layer
        raise FoldckptError(
            f"{self.model_dir / MANIFEST_NAME}: vLLM built the MLA layer '{attn_prefix}' but the "
            f"manifest has no fold for it; {_REMEDY}"
        )

    def read_rows(self, layer: MLALayer, tp_size: int, tp_rank: int) -> torch.Tensor:
        """The fold rows of ``layer`` that tensor-parallel rank ``tp_rank`` of ``tp_size`` owns,
        as a CPU tensor of the stored dtype, after checking their sha256."""
        record = self.manifest.tensors[layer.q_fold]
        path = self.model_dir / record.file
        info = self.headers[record.file].tensors[record.name]
        start, stop = self.geometry.rank_rows(tp_size, tp_rank)
        row_bytes = info.nbytes // record.shape[0]
        hashes = record.rank_sha256.get(tp_size)
        if hashes is not None:
            data = read_tensor_bytes(path, info, start * row_bytes, stop * row_bytes)
            _check_digest(data, hashes[tp_rank], path, record, f"rows [{start}, {stop})")
        else:
            # tp size not hashed at convert time: verify the whole tensor, keep our rows.
            data = read_tensor_bytes(path, info)
            _check_digest(data, record.sha256, path, record, "data")
            data = data[start * row_bytes : stop * row_bytes]
        rows = torch.frombuffer(data, dtype=TORCH_DTYPES[info.dtype])
        return rows.view(stop - start, record.shape[1])


def _check_digest(data: bytearray, expected: str, path: Path, record: FoldTensor, what: str) -> None:
    if hashlib.sha256(data).hexdigest() != expected:
        raise FoldckptError(
            f"{path}: tensor '{record.name}' {what} do not match the sha256 in {MANIFEST_NAME}; "
            f"the sidecar is corrupted: {_REMEDY}"
        )


def _geometry_mismatch(manifest: Geometry, config: Geometry) -> list[str]:
    fields = ("architecture", "num_heads", "q_lora_rank", "kv_lora_rank", "qk_nope_head_dim",
              "qk_rope_head_dim", "v_head_dim", "uses_rope")  # fmt: skip
    diffs = [
        f"{name}: manifest {getattr(manifest, name)!r}, config {getattr(config, name)!r}"
        for name in fields
        if getattr(manifest, name) != getattr(config, name)
    ]
    if [layer.prefix for layer in manifest.layers] != [layer.prefix for layer in config.layers]:
        diffs.append("the list of MLA layers differs")
    return diffs


def _check_tensor(record: FoldTensor | None, layer: MLALayer, manifest: Manifest, where: Path) -> None:
    if record is None:
        raise FoldckptError(f"{where}: no fold for MLA layer '{layer.prefix}' ({layer.q_fold}); {_REMEDY}")
    want_dtype = SAFETENSORS_DTYPES[FOLD_DTYPES[manifest.fold_dtype]]
    if record.shape != manifest.geometry.fold_shape or record.dtype != want_dtype:
        raise FoldckptError(
            f"{where}: fold '{record.name}' is {record.dtype}{list(record.shape)}, the geometry "
            f"implies {want_dtype}{list(manifest.geometry.fold_shape)}; {_REMEDY}"
        )


def _check_header(header: SafetensorsHeader, record: FoldTensor) -> None:
    info = header.tensors.get(record.name)
    if info is None:
        raise FoldckptError(f"{header.path}: holds no tensor '{record.name}' (the manifest says it does); {_REMEDY}")
    if info.dtype != record.dtype or info.shape != record.shape:
        raise FoldckptError(
            f"{header.path}: tensor '{record.name}' is {info.dtype}{list(info.shape)}, the manifest "
            f"says {record.dtype}{list(record.shape)}; {_REMEDY}"
        )


def open_fold_set(model_dir: Path) -> FoldSet:
    """Check a converted directory as far as possible without reading tensor data."""
    model_dir = Path(model_dir)
    where = model_dir / MANIFEST_NAME
    manifest = read_manifest(model_dir)
    if manifest.fold_dtype not in FOLD_DTYPES:
        raise FoldckptError(f"{where}: fold dtype {manifest.fold_dtype!r} is not one of {', '.join(FOLD_DTYPES)}")
    config = geometry_from_config(read_config(model_dir), str(model_dir / CONFIG_NAME))
    diffs = _geometry_mismatch(manifest.geometry, config)
    if diffs:
        raise FoldckptError(
            f"{where}: made for another model than {model_dir / CONFIG_NAME} describes "
            f"({'; '.join(diffs)}); {_REMEDY}"
        )
    for layer in manifest.geometry.layers:
        _check_tensor(manifest.tensors.get(layer.q_fold), layer, manifest, where)

    headers: dict[str, SafetensorsHeader] = {}
    for name, file_record in manifest.sidecars.items():
        if not (model_dir / name).exists():
            raise FoldckptError(f"{model_dir / name}: the fold sidecar listed in {MANIFEST_NAME} is missing; {_REMEDY}")
        path = resolve_inside(model_dir, name, str(where))  # no escape from the directory
        size = path.stat().st_size
        if size != file_record.size:
            raise FoldckptError(
                f"{path}: {size} bytes, the manifest records {file_record.size} (truncated or "
                f"replaced?); {_REMEDY}"
            )
        headers[name] = read_header(path)
    for layer in manifest.geometry.layers:
        record = manifest.tensors[layer.q_fold]
        if record.file not in headers:
            raise FoldckptError(
                f"{where}: fold '{record.name}' lives in '{record.file}', which is not a listed sidecar"
            )
        _check_header(headers[record.file], record)
    return FoldSet(model_dir, manifest, headers)


def is_converted(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` is a local directory that carries a foldckpt manifest."""
    return (Path(model_dir) / MANIFEST_NAME).is_file()


@functools.lru_cache(maxsize=4)
def cached_fold_set(model_dir: str) -> FoldSet:
    """:func:`open_fold_set` once per directory and process (every MLA layer asks for it)."""
    return open_fold_set(Path(model_dir))
