"""Finding, checking and reading the fold sidecars of a converted checkpoint (no vLLM here).

The plugin calls :func:`open_fold_set` once per served directory, while the model is being built
and before any weight is read. It runs the same consistency check as ``foldckpt verify``
(:mod:`foldckpt.format.consistency`): the manifest proves itself unedited (self-digest, exact encoding,
and the sha256 pinned by ``FOLDCKPT_EXPECT_MANIFEST_SHA256`` when set), hangs together, every file
it lists exists with its size, nothing else lies in the directory, every sidecar header holds
exactly its folds, and ``config.json`` gives exactly its geometry. A defect anywhere stops the
engine with a :class:`FoldckptError` naming the file (and tensor), so a model is folded completely
or not at all.

The source files are not hashed here, even when ``FOLDCKPT_EXPECT_MANIFEST_SHA256`` pins the
manifest: of each source file (weight shards, ``config.json``, tokenizer, any other file carried
over from the model) the plugin checks only that it exists with the size the manifest records, and
of ``config.json`` also the geometry. Their sha256 in the manifest is recomputed by ``foldckpt
verify`` (level ``content`` and up) alone. The pin proves which manifest serves, not that the
files it lists still hold their bytes: a source rewritten or replaced at the same size is served as
it is. The one exception is what each fold was made from: a folded layer's ``q_b_proj`` and
``kv_b_proj`` (and their fp8 block scales) are hashed against their BLAKE3 in the manifest before
its fold loads (:meth:`FoldSet.read_rows`). Hashing every source at every engine start would read
the whole model once more on each rank; run ``verify`` where that check matters, before serving.

An entry the manifest does not list stops the engine too, as ``verify`` fails on it, rather than a
warning in a log few read: vLLM and transformers read more of the directory than the weights (a
``chat_template.jinja``, a tokenizer, ``modeling_*.py`` under ``trust_remote_code``), so an added
file changes what is served as surely as an edited one, and a pinned manifest must name all that
serves. Files a deployment adds on purpose are allowed by name: ``FOLDCKPT_ALLOW_EXTRA`` holds
patterns (separated by ``:``) as ``verify --allow-extra`` takes them.

:meth:`FoldSet.read_rows` then reads the rows one tensor-parallel rank owns (its whole heads, a
plain row range for any TP size dividing the heads, see ARCHITECTURE.md "Layout") with ``pread``
and checks each head block against its leaf of the manifest's per-head hash tree before a single
value reaches the model: corrupted bytes never serve. It also hashes the layer's fold inputs
(q_b_proj and kv_b_proj, as served beside the fold) against the manifest: a fold never serves
beside weights it was not made from. That costs a read and a BLAKE3 of those tensors once per
layer and rank (some 80 MB per Kimi-K3 layer in bf16, 2 GB for the model: a fraction of a second
of one core at ``tensor_digest_bytes_per_s_per_core`` of docs/bench/convert*.json), against the
minutes an engine takes to start.
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path

import torch

from foldckpt.defaults import ALLOW_EXTRA_ENV, EXPECT_MANIFEST_ENV, allow_extra_patterns
from foldckpt.errors import FoldckptError
from foldckpt.format.consistency import changed_fold_inputs, check_served
from foldckpt.format.manifest import MANIFEST_NAME, FoldTensor, Manifest, ScaleTensor, read_manifest
from foldckpt.io.hashing import describe_heads, head_digests, rank_digest
from foldckpt.io.safetensors_format import SafetensorsHeader, read_tensor_bytes
from foldckpt.model.geometry import Geometry, MLALayer
from foldckpt.tensors import TORCH_DTYPES

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
        """The fold rows of ``layer`` that tensor-parallel rank ``tp_rank`` of ``tp_size`` owns (any
        size dividing the heads), as a CPU tensor of the stored dtype, after checking each of its
        heads against the manifest's head digests, and that the source tensors it was folded from
        (the q_b_proj and kv_b_proj served beside it) hold the bytes the manifest records."""
        record = self.manifest.tensors[layer.q_fold]
        changed = changed_fold_inputs(self.model_dir, record.sources)
        if changed:
            raise FoldckptError.at(
                self.model_dir / changed[0].file,
                f"tensor '{changed[0].name}' is not the one '{record.name}' was "
                f"folded from (its digest differs from the one in {MANIFEST_NAME}): the fold belongs to other weights; "
                f"{_REMEDY}",
                changed[0].name,
            )
        rows = self._read_checked(record, record.file, tp_size, tp_rank)
        return rows.view(-1, record.shape[1])

    def read_scale_rows(self, layer: MLALayer, tp_size: int, tp_rank: int) -> torch.Tensor | None:
        """An fp8 fold's fp32 scales of the same rows (checked the same way), or None for a fold
        stored without scales."""
        record = self.manifest.tensors[layer.q_fold]
        return None if record.scale is None else self._read_checked(record.scale, record.file, tp_size, tp_rank)

    def _read_checked(self, part: FoldTensor | ScaleTensor, file: str, tp_size: int, tp_rank: int) -> torch.Tensor:
        """One stored tensor's rows of a rank (flat), each head block checked against its leaf."""
        path = self.model_dir / file
        info = self.headers[file].tensors[part.name]
        first, stop = self.geometry.rank_heads(tp_size, tp_rank)
        head_bytes = info.nbytes // self.geometry.num_heads
        data = read_tensor_bytes(path, info, first * head_bytes, stop * head_bytes)
        leaves = head_digests(data, stop - first)
        bad = [first + i for i, leaf in enumerate(leaves) if leaf != part.head_blake3[first + i]]
        if bad:
            start, end = self.geometry.rank_rows(tp_size, tp_rank)
            raise FoldckptError.at(
                path,
                f"tensor '{part.name}' rows [{start}, {end}) (heads {describe_heads(bad)}) do not match their "
                f"head digests in {MANIFEST_NAME}; the sidecar is corrupted: {_REMEDY}",
                part.name,
            )
        return torch.frombuffer(data, dtype=TORCH_DTYPES[info.dtype])

    def rank_digest(self, layer: MLALayer, tp_size: int, tp_rank: int) -> str:
        """The recorded digest of a rank's rows of ``layer``, derived from its heads' leaves."""
        first, stop = self.geometry.rank_heads(tp_size, tp_rank)
        return rank_digest(self.manifest.tensors[layer.q_fold].head_blake3[first:stop])


def open_fold_set(model_dir: Path, expect_sha256: str | None = None) -> FoldSet:
    """Check a converted directory as far as possible without reading tensor data.

    ``expect_sha256`` (default: ``$FOLDCKPT_EXPECT_MANIFEST_SHA256``) pins the manifest file;
    ``$FOLDCKPT_ALLOW_EXTRA`` allows entries the manifest does not list."""
    model_dir = Path(model_dir)
    if expect_sha256 is None:
        expect_sha256 = os.environ.get(EXPECT_MANIFEST_ENV) or None
    try:
        manifest = read_manifest(model_dir, expect_sha256)
    except FoldckptError as exc:
        raise type(exc)(
            f"{exc}; {_REMEDY}", path=exc.path, tensor=exc.tensor, detail=f"{exc.detail}; {_REMEDY}"
        ) from None
    headers = check_served(model_dir, manifest, _REMEDY, allow_extra_patterns(os.environ.get(ALLOW_EXTRA_ENV)))
    return FoldSet(model_dir, manifest, headers)


def is_converted(model_dir: str | Path) -> bool:
    """Whether ``model_dir`` is a local directory that carries a foldckpt manifest."""
    return (Path(model_dir) / MANIFEST_NAME).is_file()


def served_fold_set(model_dir: str | Path) -> FoldSet | None:
    """The checked fold set of the directory vLLM serves, or None where it is no conversion (then
    the plugin leaves the model as it is). With ``FOLDCKPT_EXPECT_MANIFEST_SHA256`` set, a
    directory without a manifest is refused: the pin names the conversion that must be served, and
    the unconverted model (or a conversion whose manifest went missing) would otherwise be served
    unfolded and unchecked without a word."""
    if is_converted(model_dir):
        return cached_fold_set(str(model_dir))
    if os.environ.get(EXPECT_MANIFEST_ENV):
        raise FoldckptError.at(
            Path(model_dir) / MANIFEST_NAME,
            f"missing, but {EXPECT_MANIFEST_ENV} pins the conversion to serve: serve "
            "the converted directory, or unset the variable to serve this one unfolded",
        )
    return None


@functools.lru_cache(maxsize=4)
def cached_fold_set(model_dir: str) -> FoldSet:
    """:func:`open_fold_set` once per directory and process (every MLA layer asks for it)."""
    return open_fold_set(Path(model_dir))
