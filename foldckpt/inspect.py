"""``foldckpt inspect``: what a model or converted directory holds, without reading tensor data."""

from __future__ import annotations

import shlex
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from foldckpt.convert.journal import Journal
from foldckpt.defaults import JOURNAL_NAME
from foldckpt.errors import FoldckptError
from foldckpt.format.manifest import MANIFEST_NAME, FoldedLayer, read_manifest
from foldckpt.io.files import is_locked, lock_holder
from foldckpt.model.checkpoint import open_source_checkpoint
from foldckpt.model.geometry import Geometry, read_geometry
from foldckpt.model.hub import ModelSource


@dataclass(frozen=True)
class Inspection:
    directory: Path
    geometry: Geometry
    model_bytes: int
    folded_layers: int | None
    fold_dtype: str | None
    fold_bytes: int
    extra_bytes_per_gpu: dict[int, int]
    layers: tuple[FoldedLayer, ...] = ()
    sidecars: dict[str, int] = field(default_factory=dict)
    source: dict[str, Any] | None = None
    # sha256 of the foldckpt.json file (as `sha256sum` prints it): what a user pins.
    manifest_sha256: str | None = None
    # A conversion into this directory that is running or was interrupted (conversion_status).
    conversion: dict[str, Any] | None = None

    def to_dict(self) -> dict[str, Any]:
        return {
            "directory": str(self.directory),
            "geometry": self.geometry.to_dict(),
            "model_bytes": self.model_bytes,
            "folded_layers": self.folded_layers,
            "fold_dtype": self.fold_dtype,
            "fold_bytes": self.fold_bytes,
            "extra_bytes_per_gpu": self.extra_bytes_per_gpu,
            "layers": [layer.to_dict() for layer in self.layers],
            "sidecars": self.sidecars,
            "source": self.source,
            "manifest_sha256": self.manifest_sha256,
            "conversion": self.conversion,
        }


def conversion_status(directory: Path) -> dict[str, Any] | None:
    """A conversion into ``directory`` that is running (``{"state": "running", "pid"}``: its lock
    is held) or was interrupted (``{"state": "interrupted", "layers_done", "layers_total",
    "model"}``: a journal and no manifest), else None."""
    if is_locked(directory):
        return {"state": "running", "pid": lock_holder(directory)}
    if (directory / MANIFEST_NAME).exists() or not (directory / JOURNAL_NAME).exists():
        return None
    journal = Journal.load(directory / JOURNAL_NAME)
    model = None if journal.model is None else str(journal.model)
    done, total = journal.layers_done(), journal.layers
    return {"state": "interrupted", "layers_done": done, "layers_total": total, "model": model}


def describe_conversion(directory: Path, status: dict[str, Any]) -> str:
    """One line saying what ``conversion_status`` found and what to do."""
    if status["state"] == "running":
        pid = f" (pid {status['pid']})" if status["pid"] else ""
        return f"a conversion is running{pid}; wait for it to finish"
    total = f" of {status['layers_total']}" if status["layers_total"] is not None else ""
    model = shlex.quote(status["model"]) if status["model"] else "MODEL_DIR"
    return (
        f"interrupted conversion: {status['layers_done']}{total} layers done; resume with: "
        f"foldckpt convert {model} {shlex.quote(str(directory))} (the same options), or pass --restart to start over"
    )


def inspect_dir(directory: Path | ModelSource) -> Inspection:
    origin = directory if isinstance(directory, ModelSource) else ModelSource(Path(directory))
    directory = origin.path
    if not directory.is_dir():  # before config.json: a missing directory is not a missing config
        raise FoldckptError(
            f"{directory}: not a directory" if directory.exists() else f"{directory}: no such directory"
        )
    conversion = conversion_status(directory)
    try:
        geometry = read_geometry(directory)
        source = open_source_checkpoint(directory)
    except FoldckptError:
        if conversion is None:
            raise
        # killed while placing the sources: nothing to show but that
        raise FoldckptError(f"{directory}: {describe_conversion(directory, conversion)}") from None
    model_bytes = sum(header.file_size for header in source.headers.values())
    if not (directory / MANIFEST_NAME).exists():
        return Inspection(
            directory, geometry, model_bytes, None, None, 0, {}, source=origin.to_dict(), conversion=conversion
        )
    manifest = read_manifest(directory)
    fold_bytes = manifest.fold_bytes()
    mtp = {layer.index: layer.is_mtp for layer in manifest.geometry.layers}
    layers = tuple(
        FoldedLayer(t.layer_index, mtp.get(t.layer_index, False), t.name, t.file, t.rel_fro_error)
        for t in manifest.tensors.values()
    )
    return Inspection(
        directory=directory,
        geometry=geometry,
        model_bytes=model_bytes,
        folded_layers=len(manifest.tensors),
        fold_dtype=manifest.fold_dtype,
        fold_bytes=fold_bytes,
        extra_bytes_per_gpu={tp: fold_bytes // tp for tp in manifest.geometry.valid_tp_sizes()},
        layers=layers,
        sidecars={name: record.size for name, record in manifest.sidecars.items()},
        source=manifest.source or origin.to_dict(),
        manifest_sha256=manifest.file_sha256,
        conversion=conversion,
    )
