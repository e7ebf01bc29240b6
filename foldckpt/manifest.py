"""``foldckpt.json``: the manifest that describes a converted checkpoint.

It is the single source of truth for verify and for the vLLM plugin, and it is written last and
atomically: its presence means the conversion finished. Its content is deterministic (no
timestamps), so an interrupted-then-resumed conversion produces the same bytes as a clean one.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from foldckpt import __version__
from foldckpt.errors import FoldckptError
from foldckpt.files import atomic_write_json, read_json_file
from foldckpt.geometry import Geometry
from foldckpt.safetensors_format import tensor_nbytes

MANIFEST_NAME = "foldckpt.json"
FORMAT_NAME = "foldckpt"
FORMAT_VERSION = 1
FORMULA = "W_fold[h] = [W_UK[h]^T @ W_qb_nope[h] ; W_qb_pe[h]]"
LAYOUT = "head-major [H*(L+R), Lq]; rank r of tp owns rows [r*H/tp*(L+R), (r+1)*H/tp*(L+R))"
_MAX_MANIFEST_BYTES = 256 * 1024 * 1024


@dataclass(frozen=True)
class FileRecord:
    size: int
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"size": self.size, "sha256": self.sha256}


@dataclass(frozen=True)
class SourceTensor:
    """Where a fold's input came from, with the sha256 of exactly the bytes that were read."""

    name: str
    file: str
    sha256: str

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "file": self.file, "sha256": self.sha256}


@dataclass(frozen=True)
class FoldTensor:
    """One stored fold tensor and everything needed to check it."""

    name: str
    layer_index: int
    layer_prefix: str
    file: str
    dtype: str
    shape: tuple[int, int]
    sha256: str
    rank_sha256: dict[int, tuple[str, ...]]
    sources: tuple[SourceTensor, ...]
    error: dict[str, Any]

    def to_dict(self) -> dict[str, Any]:
        return {
            "layer_index": self.layer_index,
            "layer_prefix": self.layer_prefix,
            "file": self.file,
            "dtype": self.dtype,
            "shape": list(self.shape),
            "sha256": self.sha256,
            "rank_sha256": {str(tp): list(hashes) for tp, hashes in sorted(self.rank_sha256.items())},
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
            sha256=str(data["sha256"]),
            rank_sha256={int(tp): tuple(map(str, h)) for tp, h in data["rank_sha256"].items()},
            sources=tuple(SourceTensor(s["name"], s["file"], s["sha256"]) for s in data["sources"]),
            error=dict(data["error_vs_fp64"]),
        )


@dataclass(frozen=True)
class Manifest:
    geometry: Geometry
    fold_dtype: str
    accumulation_dtype: str
    tp_sizes: tuple[int, ...]
    tensors: dict[str, FoldTensor]
    sidecars: dict[str, FileRecord]
    source_files: dict[str, FileRecord]
    parameters: dict[str, Any] = field(default_factory=dict)
    # For a model converted by Hugging Face id: {"repo_id", "revision" (as asked), "commit"}.
    source: dict[str, Any] | None = None
    tool_version: str = __version__
    format_version: int = FORMAT_VERSION

    @property
    def files(self) -> dict[str, FileRecord]:
        """Every file of the output directory the manifest vouches for (except itself)."""
        return {**self.source_files, **self.sidecars}

    def fold_bytes(self) -> int:
        """Bytes of fold tensor data (what GPUs hold), as ``Plan.fold_bytes`` counts them."""
        return sum(tensor_nbytes(t.dtype, t.shape) for t in self.tensors.values())

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
                "tensor_name": "<layer prefix>.self_attn.q_fold.weight",
            },
            "tp_sizes": list(self.tp_sizes),
            "parameters": self.parameters,
            "tensors": {name: t.to_dict() for name, t in self.tensors.items()},
            "sidecars": {name: r.to_dict() for name, r in self.sidecars.items()},
            "source_files": {name: r.to_dict() for name, r in self.source_files.items()},
        }

    @classmethod
    def from_dict(cls, data: dict[str, Any]) -> Manifest:
        fold = data["fold"]
        return cls(
            geometry=Geometry.from_dict(data["geometry"]),
            fold_dtype=str(fold["dtype"]),
            accumulation_dtype=str(fold["accumulation_dtype"]),
            tp_sizes=tuple(int(tp) for tp in data["tp_sizes"]),
            tensors={name: FoldTensor.from_dict(name, t) for name, t in data["tensors"].items()},
            sidecars={n: FileRecord(int(r["size"]), str(r["sha256"])) for n, r in data["sidecars"].items()},
            source_files={
                n: FileRecord(int(r["size"]), str(r["sha256"])) for n, r in data["source_files"].items()
            },
            parameters=dict(data.get("parameters", {})),
            source=dict(data["source"]) if data.get("source") is not None else None,
            tool_version=str(data["tool_version"]),
            format_version=int(data["format_version"]),
        )


def write_manifest(out_dir: Path, manifest: Manifest) -> None:
    atomic_write_json(Path(out_dir) / MANIFEST_NAME, manifest.to_dict())


def read_manifest(out_dir: Path) -> Manifest:
    """Load and validate ``foldckpt.json`` of a converted directory."""
    path = Path(out_dir) / MANIFEST_NAME
    data = read_json_file(
        path, _MAX_MANIFEST_BYTES, "a foldckpt manifest", f"{out_dir} is not a finished foldckpt conversion"
    )
    if not isinstance(data, dict) or data.get("format") != FORMAT_NAME:
        raise FoldckptError(f"{path}: not a foldckpt manifest")
    if data.get("format_version") != FORMAT_VERSION:
        raise FoldckptError(
            f"{path}: format_version {data.get('format_version')!r} is not supported "
            f"by foldckpt {__version__} (expects {FORMAT_VERSION})"
        )
    try:
        return Manifest.from_dict(data)
    except (KeyError, TypeError, ValueError, IndexError, AttributeError) as exc:
        raise FoldckptError(f"{path}: malformed manifest ({type(exc).__name__}: {exc})") from None
