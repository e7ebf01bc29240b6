"""``foldckpt.json``: the manifest that describes a converted checkpoint.

It is the single source of truth for verify and for the vLLM plugin, and it is written last and
atomically: its presence means the conversion finished. Its content is deterministic (no
timestamps), so an interrupted-then-resumed conversion produces the same bytes as a clean one.

It is the root of trust, so it vouches for itself: ``manifest_sha256`` is the sha256 of the
canonical encoding of everything else in it (:func:`canonical_bytes`), and the file must be
byte-for-byte the encoding foldckpt writes (:func:`encode_manifest`). Any edit of any byte is
therefore caught by :func:`read_manifest` (a :class:`~foldckpt.errors.ManifestError`), before a
file is judged by it. A consistent forgery (manifest and files rewritten together, digest
recomputed) cannot be told from the real thing by the manifest alone: users pin a conversion by
the sha256 of the ``foldckpt.json`` file (``verify`` and ``inspect`` print it, ``sha256sum`` gives
the same), and ``read_manifest(expect_sha256=...)`` refuses any other.

Format 5 (this one) records folds that are each element's exact value rounded once to the fold
dtype, the same bytes from any CPU or GPU, and so no longer the fold device among its parameters:
the same sources and parameters give the same manifest, and the same sha256, on every machine.
Format 4 had folds rounded from fp32 sums, which depended on the machine, and recorded where they
were made. Since format 4 it records one BLAKE3 digest per head block of each fold and of each
source tensor a fold was computed from (tensor bytes; :mod:`foldckpt.io.hashing` says why), and a
sha256 per file: per source file of the whole file, per sidecar of its header. The header and the head blocks tile a
sidecar, so every sidecar byte is covered by exactly one digest and convert hashes each fold byte
once. Format 3 had sha256 where format 4 has BLAKE3; format 2 also kept a whole-file sha256 of each
sidecar (every fold byte hashed twice); format 1 recorded per-rank hashes for the TP sizes chosen
at convert time. All are refused with the command that rewrites them.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import math
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from foldckpt import __version__
from foldckpt.defaults import SCALED_FOLD_DTYPES
from foldckpt.errors import FoldckptError, ManifestError
from foldckpt.io.files import atomic_output, parse_json
from foldckpt.io.hashing import LEAF_RULE, RANK_RULE, TENSOR_DIGEST_RULE
from foldckpt.io.safetensors_format import tensor_nbytes
from foldckpt.model.geometry import Geometry

MANIFEST_NAME = "foldckpt.json"
FORMAT_NAME = "foldckpt"
FORMAT_VERSION = 5
DIGEST_KEY = "manifest_sha256"
DIGEST_RULE = (
    f"sha256 of the manifest without '{DIGEST_KEY}', encoded as JSON with sorted keys, "
    "separators (',', ':'), ASCII escapes"
)
FORMULA = "W_fold[h] = [W_UK[h]^T @ W_qb_nope[h] ; W_qb_pe[h]]"
SCALE_RULE = (
    "<layer prefix>.self_attn.q_fold.weight_scale, F32 [H*(L+R)]: W_fold ~= weight * weight_scale[:, None], "
    "weight_scale = amax(|row|) / 448, weight = row / weight_scale rounded once to e4m3 (OCP e4m3fn)"
)
ROUNDING_RULE = (
    "each element of W_UK^T @ W_qb_nope is its exact value rounded once to the fold dtype (to nearest, ties to "
    "even; an exact zero is +0), from the source values (fp8 ones: e4m3 value times block scale rounded once to "
    "float32); fp8 folds are quantized from the float32 fold so rounded"
)
SIDECAR_RULE = "header_sha256 covers bytes [0, 8 + header length); the folds' head_blake3 cover the rest"
LAYOUT = "head-major [H*(L+R), Lq]; rank r of tp owns rows [r*H/tp*(L+R), (r+1)*H/tp*(L+R))"
_MAX_MANIFEST_BYTES = 256 * 1024 * 1024
# Older formats this one replaced, refused with the command that rewrites them (format 1 below).
_OLDER_FORMATS = {
    2: "whole-file sidecar hashes",
    3: "sha256 head and source-tensor digests",
    4: "folds rounded from fp32 sums, which differ from machine to machine",
}


@dataclass(frozen=True)
class FileRecord:
    size: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class SidecarRecord:
    """A sidecar file: its size and the sha256 of its safetensors header (bytes ``[0, 8 + header
    length)``); the tensor data after it is covered by the folds' head digests."""

    size: int
    header_sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "header_sha256": self.header_sha256}

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> SidecarRecord:
        return cls(int(data["size"]), str(data["header_sha256"]))


@dataclass(frozen=True)
class SourceTensor:
    """Where a fold's input came from, with the tensor digest (BLAKE3) of exactly the bytes read."""

    name: str
    file: str
    blake3: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "file": self.file, "blake3": self.blake3}


@dataclass(frozen=True)
class ScaleTensor:
    """The fp32 scale per row of an fp8 fold (``...q_fold.weight_scale``, ``[H*(L+R)]``), stored
    right after the fold in its sidecar, with its own per-head leaves (head h: rows
    ``[h*(L+R), (h+1)*(L+R))``, the rows its rank owns)."""

    name: str
    dtype: str
    shape: tuple[int, ...]
    head_blake3: tuple[str, ...]

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "head_blake3": list(self.head_blake3),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> ScaleTensor:
        return cls(
            str(data["name"]),
            str(data["dtype"]),
            tuple(int(d) for d in data["shape"]),
            tuple(str(h) for h in data["head_blake3"]),
        )


@dataclass(frozen=True)
class FoldTensor:
    """One stored fold tensor and everything needed to check it: the leaves of its per-head hash
    tree (``head_blake3[h]``: BLAKE3 of head h's rows of the stored bytes), its sources, its error."""

    name: str
    layer_index: int
    layer_prefix: str
    file: str
    dtype: str
    shape: tuple[int, int]
    head_blake3: tuple[str, ...]
    sources: tuple[SourceTensor, ...]
    error: dict[str, Any]
    scale: ScaleTensor | None = None

    @property
    def rel_fro_error(self) -> float:
        """The recorded relative error vs fp64; NaN where it is null (a fold of NaN inputs)."""
        value = self.error.get("rel_fro_error")
        return math.nan if value is None else float(value)

    def parts(self) -> list[FoldTensor | ScaleTensor]:
        """The tensors stored for this fold, in sidecar order: the fold, and an fp8 fold's scale."""
        return [self] if self.scale is None else [self, self.scale]

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer_index": self.layer_index,
            "layer_prefix": self.layer_prefix,
            "file": self.file,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "head_blake3": list(self.head_blake3),
            **({"weight_scale": self.scale.to_dict()} if self.scale is not None else {}),
            "sources": [source.to_dict() for source in self.sources],
            "error_vs_fp64": self.error,
        }

    @classmethod
    def from_dict(cls, name: str, data: dict[str, Any]) -> FoldTensor:
        return cls(
            name=name,
            layer_index=int(data["layer_index"]),
            layer_prefix=str(data["layer_prefix"]),
            file=str(data["file"]),
            dtype=str(data["dtype"]),
            shape=(int(data["shape"][0]), int(data["shape"][1])),
            head_blake3=tuple(str(h) for h in data["head_blake3"]),
            sources=tuple(SourceTensor(s["name"], s["file"], s["blake3"]) for s in data["sources"]),
            error=dict(data["error_vs_fp64"]),
            scale=ScaleTensor.from_dict(data["weight_scale"]) if "weight_scale" in data else None,
        )


@dataclass(frozen=True)
class Manifest:
    geometry: Geometry
    fold_dtype: str
    accumulation_dtype: str
    tensors: dict[str, FoldTensor]
    sidecars: dict[str, SidecarRecord]
    source_files: dict[str, FileRecord]
    parameters: dict[str, Any] = field(default_factory=dict)
    # For a model converted by Hugging Face id: {"repo_id", "revision" (as asked), "commit"}.
    source: dict[str, Any] | None = None
    # Names among source_files that foldckpt wrote rather than placed: the safetensors index of a
    # source without one, so that weight loaders read the listed weights and never the sidecars.
    generated_files: tuple[str, ...] = ()
    tool_version: str = __version__
    format_version: int = FORMAT_VERSION
    # The sha256 of the foldckpt.json file this was read from (what users pin); None when built.
    file_sha256: str | None = field(default=None, compare=False)

    @property
    def files(self) -> dict[str, FileRecord | SidecarRecord]:
        """Every file of the output directory the manifest vouches for (except itself)."""
        return {**self.source_files, **self.sidecars}

    def fold_bytes(self) -> int:
        """Bytes of fold tensor data, scales included (what GPUs hold), as ``Plan.fold_bytes`` counts them."""
        return sum(tensor_nbytes(part.dtype, part.shape) for t in self.tensors.values() for part in t.parts())

    def sidecar_bytes(self) -> int:
        """Bytes of the sidecar files on disk (tensor data plus safetensors headers)."""
        return sum(record.size for record in self.sidecars.values())

    def to_dict(self) -> dict[str, Any]:
        source = {"source": self.source} if self.source is not None else {}
        return {
            "format": FORMAT_NAME,
            "format_version": self.format_version,
            "tool_version": self.tool_version,
            **source,
            "geometry": self.geometry.to_dict(),
            "fold": {
                "formula": FORMULA,
                "layout": LAYOUT,
                "dtype": self.fold_dtype,
                "accumulation_dtype": self.accumulation_dtype,
                "rounding": ROUNDING_RULE,
                "tensor_name": "<layer prefix>.self_attn.q_fold.weight",
                **({"scale": SCALE_RULE} if self.fold_dtype in SCALED_FOLD_DTYPES else {}),
            },
            "integrity": {
                "head_blake3": LEAF_RULE,
                "rank_digest": RANK_RULE,
                "sources": TENSOR_DIGEST_RULE,
                "sidecar": SIDECAR_RULE,
                DIGEST_KEY: DIGEST_RULE,
            },
            "parameters": self.parameters,
            "tensors": {name: t.to_dict() for name, t in self.tensors.items()},
            "sidecars": {name: r.to_dict() for name, r in self.sidecars.items()},
            "source_files": {name: r.to_dict() for name, r in self.source_files.items()},
            **({"generated_files": list(self.generated_files)} if self.generated_files else {}),
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        fold = data["fold"]
        return cls(
            geometry=Geometry.from_dict(data["geometry"]),
            fold_dtype=str(fold["dtype"]),
            accumulation_dtype=str(fold["accumulation_dtype"]),
            tensors={name: FoldTensor.from_dict(name, t) for name, t in data["tensors"].items()},
            sidecars={n: SidecarRecord.from_dict(r) for n, r in data["sidecars"].items()},
            source_files={n: FileRecord(int(r["size"]), str(r["sha256"])) for n, r in data["source_files"].items()},
            parameters=dict(data.get("parameters", {})),
            source=dict(data["source"]) if data.get("source") is not None else None,
            generated_files=tuple(str(n) for n in data.get("generated_files", ())),
            tool_version=str(data["tool_version"]),
            format_version=int(data["format_version"]),
        )


def canonical_bytes(data: dict[str, Any]) -> bytes:
    """The canonical encoding of a manifest's content, without its own digest (what it signs)."""
    body = {key: value for key, value in data.items() if key != DIGEST_KEY}
    return json.dumps(body, sort_keys=True, separators=(",", ":"), ensure_ascii=True).encode("ascii")


def manifest_digest(data: dict[str, Any]) -> str:
    return hashlib.sha256(canonical_bytes(data)).hexdigest()


def encode_manifest(data: dict[str, Any]) -> bytes:
    """The exact bytes of ``foldckpt.json`` for ``data`` (which carries its digest last)."""
    return (json.dumps(data, indent=2, ensure_ascii=True) + "\n").encode("ascii")


def manifest_bytes(manifest: Manifest) -> bytes:
    data = manifest.to_dict()
    data[DIGEST_KEY] = manifest_digest(data)
    return encode_manifest(data)


def write_manifest(out_dir: Path, manifest: Manifest) -> str:
    """Write ``foldckpt.json`` atomically; returns the file's sha256 (what users pin)."""
    raw = manifest_bytes(manifest)
    with atomic_output(Path(out_dir) / MANIFEST_NAME) as handle:
        handle.write(raw)
    return hashlib.sha256(raw).hexdigest()


def _read_raw(path: Path, out_dir: Path) -> bytes:
    """The manifest's bytes; a missing or unreadable manifest is unusable input, not a failed check."""
    if path.exists() and not path.is_file():  # a FIFO or device would block or never end
        raise FoldckptError.at(path, "not a regular file; not a foldckpt manifest")
    try:
        with open(path, "rb") as handle:
            raw = handle.read(_MAX_MANIFEST_BYTES + 1)
    except FileNotFoundError:
        raise FoldckptError.at(path, f"not found; {out_dir} is not a finished foldckpt conversion") from None
    except OSError as exc:
        raise FoldckptError.at(path, f"cannot read: {exc.strerror}") from None
    return raw


def file_sha256(out_dir: Path) -> str:
    """sha256 of the ``foldckpt.json`` file, as ``sha256sum`` prints it."""
    return hashlib.sha256(_read_raw(Path(out_dir) / MANIFEST_NAME, Path(out_dir))).hexdigest()


def listed_files(out_dir: Path) -> list[str]:
    """The file names any foldckpt manifest in ``out_dir`` lists (format 1 included; nothing when it
    cannot be parsed): what ``convert --restart`` removes. Trusts nothing else in it."""
    try:
        data = parse_json(_read_raw(Path(out_dir) / MANIFEST_NAME, Path(out_dir))[:_MAX_MANIFEST_BYTES])
        return [name for name in data.get("source_files", {}) if isinstance(name, str)]
    except (FoldckptError, ValueError, AttributeError, TypeError):
        return []


def read_manifest(out_dir: Path, expect_sha256: str | None = None) -> Manifest:
    """Load ``foldckpt.json`` and prove it is unedited: its own digest, its exact encoding, and (when
    ``expect_sha256`` is given) the pinned file sha256. Raises :class:`ManifestError` for any defect
    of an existing manifest, :class:`FoldckptError` when there is none to read or it is format 1."""
    out_dir = Path(out_dir)
    path = out_dir / MANIFEST_NAME
    raw = _read_raw(path, out_dir)

    def bad(detail: str) -> ManifestError:
        return ManifestError(f"{path}: {detail}", path=path, detail=detail)

    digest = hashlib.sha256(raw).hexdigest()
    if expect_sha256 is not None and digest != expect_sha256.strip().lower():
        raise bad(f"sha256 {digest} is not the pinned {expect_sha256.strip().lower()}: not the conversion you pinned")
    if len(raw) > _MAX_MANIFEST_BYTES:
        raise bad(f"larger than {_MAX_MANIFEST_BYTES} bytes; not a foldckpt manifest")
    try:
        data = parse_json(raw)
    except ValueError as exc:
        raise bad(f"invalid JSON ({exc}); damaged or edited after conversion") from None
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise bad('not a foldckpt manifest (no "format": "foldckpt")')
    version, recorded = data.get("format_version"), data.get(DIGEST_KEY)
    # The self-digest first (every format since 2 has it, by the same rule), then the format:
    # the format_version of a current manifest edited to an older one is an edit (a failed check,
    # exit 1), not an old output to reconvert (unusable input, exit 2).
    if version == 1 and recorded is None and "tp_sizes" in data:
        raise FoldckptError.at(
            path,
            f"written in manifest format 1 (per-TP rank hashes, no self-digest) by foldckpt "
            f"{data.get('tool_version')}; foldckpt {__version__} reads format {FORMAT_VERSION} only: "
            "reconvert (foldckpt convert MODEL_DIR OUT_DIR --restart)",
        )
    if not isinstance(recorded, str) or recorded != manifest_digest(data):
        raise bad(f"its self-digest ({DIGEST_KEY}) does not match its content: edited or damaged after conversion")
    if isinstance(version, int) and version in _OLDER_FORMATS:
        raise FoldckptError.at(
            path,
            f"written in manifest format {version} ({_OLDER_FORMATS[version]}) by foldckpt "
            f"{data.get('tool_version')}; foldckpt {__version__} reads format {FORMAT_VERSION} only: reconvert "
            "(foldckpt convert MODEL_DIR OUT_DIR --restart)",
        )
    if version != FORMAT_VERSION:
        raise bad(
            f"format_version {version!r} is not one foldckpt {__version__} reads ({FORMAT_VERSION}): edited, or written by another foldckpt"
        )
    try:
        canonical = encode_manifest(data) == raw
    except (TypeError, ValueError):
        canonical = False
    if not canonical:
        raise bad("not byte-for-byte the encoding foldckpt writes (its content is intact): edited after conversion")
    try:
        manifest = Manifest.from_dict(data)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise bad(f"malformed manifest ({type(exc).__name__}: {exc})") from None
    return dataclasses.replace(manifest, file_sha256=digest)


@dataclass(frozen=True)
class FoldedLayer:
    """One fold recorded in the manifest: config layer index, sidecar and error vs fp64."""

    index: int
    is_mtp: bool
    tensor: str
    sidecar: str
    rel_fro_error: float

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)
