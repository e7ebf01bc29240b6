"""``foldckpt inspect``: what a model or converted directory holds, without reading tensor data."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Any

from foldckpt.checkpoint import open_source_checkpoint
from foldckpt.geometry import Geometry, read_geometry
from foldckpt.manifest import MANIFEST_NAME, read_manifest


@dataclass(frozen=True)
class Inspection:
    directory: Path
    geometry: Geometry
    model_bytes: int
    folded_layers: int | None
    fold_dtype: str | None
    fold_bytes: int
    extra_bytes_per_gpu: dict[int, int]

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory),
            "geometry": self.geometry.to_dict(),
            "model_bytes": self.model_bytes,
            "folded_layers": self.folded_layers,
            "fold_dtype": self.fold_dtype,
            "fold_bytes": self.fold_bytes,
            "extra_bytes_per_gpu": self.extra_bytes_per_gpu,
        }


def inspect_dir(directory: Path) -> Inspection:
    directory = Path(directory)
    geometry = read_geometry(directory)
    source = open_source_checkpoint(directory)
    model_bytes = sum(header.file_size for header in source.headers.values())
    if not (directory / MANIFEST_NAME).exists():
        return Inspection(directory, geometry, model_bytes, None, None, 0, {})
    manifest = read_manifest(directory)
    fold_bytes = manifest.fold_bytes()
    return Inspection(
        directory=directory,
        geometry=geometry,
        model_bytes=model_bytes,
        folded_layers=len(manifest.tensors),
        fold_dtype=manifest.fold_dtype,
        fold_bytes=fold_bytes,
        extra_bytes_per_gpu={tp: fold_bytes // tp for tp in manifest.tp_sizes},
    )
