"""The source checkpoint: its weight files, index, and lazy per-tensor access.

Opening a checkpoint reads ``config.json``, the index and every shard's header (no tensor data)
and checks that they agree, so planning can be done on shapes alone. Paths named by the index are
confined to the model directory: ``../``, absolute paths and symlinks that lead elsewhere are
refused. The one exception is the Hugging Face cache layout, where ``snapshots/<rev>/file`` is a
symlink into the same repository's ``blobs/`` folder.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path, PurePosixPath
from typing import TYPE_CHECKING

from foldckpt.errors import FoldckptError
from foldckpt.io.files import read_json_file, stays_inside
from foldckpt.io.safetensors_format import SafetensorsHeader, TensorInfo, read_header

INDEX_NAME = "model.safetensors.index.json"
SINGLE_FILE_NAME = "model.safetensors"
PICKLE_SUFFIXES = (".bin", ".pt", ".pth", ".ckpt", ".pkl")
_MAX_INDEX_BYTES = 256 * 1024 * 1024

if TYPE_CHECKING:
    import torch


@dataclass(frozen=True)
class SourceCheckpoint:
    """A validated safetensors checkpoint: which file holds which tensor, and every header."""

    model_dir: Path
    index_path: Path | None
    weight_map: dict[str, str]
    headers: dict[str, SafetensorsHeader]

    def locate(self, name: str) -> tuple[str, TensorInfo] | None:
        """The file (relative name) and header entry of tensor ``name``, or None if absent."""
        file = self.weight_map.get(name)
        return None if file is None else (file, self.headers[file].tensors[name])

    def read(self, name: str) -> torch.Tensor:
        located = self.locate(name)
        if located is None:
            raise FoldckptError.at(self.model_dir, f"tensor '{name}' is not in the checkpoint", name)
        file, info = located
        from foldckpt.tensors import read_tensor  # torch: only once a tensor is read

        return read_tensor(self.model_dir / file, info)


def allowed_roots(model_dir: Path) -> tuple[Path, ...]:
    """Where files of ``model_dir`` may really live: the folder itself, and for a Hugging Face
    cache snapshot (``.../snapshots/<rev>``) the same repository's ``blobs`` folder."""
    root = model_dir.resolve()
    roots = [root]
    if root.parent.name == "snapshots":
        roots.append(root.parent.parent / "blobs")
    return tuple(roots)


def resolve_inside(model_dir: Path, name: str, where: str, external_links: bool = False) -> Path:
    """``model_dir / name`` after checking that ``name`` cannot escape the model directory.

    ``external_links`` lets symlinks point anywhere: only for foldckpt's own ``--link symlink``
    outputs, whose files are then checked by content (sha256) against the manifest.
    """
    if not isinstance(name, str) or not name or "\x00" in name:
        raise FoldckptError.at(where, f"invalid file name {name!r}")
    if not stays_inside(name):
        raise FoldckptError.at(where, f"file name {name!r} escapes the model directory; refused")
    path = model_dir / name
    if not path.exists():
        raise FoldckptError.at(where, f"refers to {name!r}, which does not exist in {model_dir}")
    real = path.resolve()
    if not external_links and not any(real.is_relative_to(root) for root in allowed_roots(model_dir)):
        raise FoldckptError.at(where, f"{name!r} is a symlink to {real}, outside the model directory; refused")
    if not real.is_file():
        raise FoldckptError.at(where, f"{name!r} is not a regular file")
    return path


def _read_index(path: Path) -> dict[str, str]:
    index = read_json_file(path, _MAX_INDEX_BYTES, "a safetensors index")
    weight_map = index.get("weight_map") if isinstance(index, dict) else None
    if not isinstance(weight_map, dict) or not all(
        isinstance(k, str) and isinstance(v, str) for k, v in weight_map.items()
    ):
        raise FoldckptError.at(path, "'weight_map' must map tensor names to file names")
    for name, file in weight_map.items():
        if stays_inside(file) and is_hidden(PurePosixPath(file)):
            raise FoldckptError.at(
                path,
                f"maps tensor '{name}' to {file!r}, inside a hidden entry, which a conversion does not carry "
                "over (as .git and .cache); move the file",
                name,
            )
    return weight_map


def is_hidden(relative: PurePosixPath | Path) -> bool:
    """Whether a path inside the model directory lies in a hidden entry (``.git``, ``.cache``...):
    such entries are not part of the model, and are never placed in OUT_DIR."""
    return any(part.startswith(".") for part in relative.parts)


def _refuse_pickles(model_dir: Path) -> None:
    pickles = sorted(p.name for p in model_dir.iterdir() if p.suffix in PICKLE_SUFFIXES)
    if pickles:
        raise FoldckptError.at(
            model_dir,
            f"only pickle weights found ({', '.join(pickles[:3])}); foldckpt never "
            "unpickles files: convert the checkpoint to safetensors first",
        )
    raise FoldckptError.at(model_dir, f"no {INDEX_NAME} or *.safetensors weights found")


def open_source_checkpoint(model_dir: Path, external_links: bool = False) -> SourceCheckpoint:
    """Validate the index and every shard header of ``model_dir``; read no tensor data."""
    model_dir = Path(model_dir)
    if not model_dir.is_dir():
        raise FoldckptError.at(model_dir, "not a directory")
    index_path = model_dir / INDEX_NAME
    if index_path.is_file():
        weight_map = _read_index(index_path)
        files = sorted(set(weight_map.values()))
        where = str(index_path)
    else:
        index_path = None
        files = sorted(p.name for p in model_dir.glob("*.safetensors") if not p.name.startswith("foldckpt-"))
        if not files:
            _refuse_pickles(model_dir)
        weight_map = {}
        where = str(model_dir)

    headers: dict[str, SafetensorsHeader] = {}
    for file in files:
        headers[file] = read_header(resolve_inside(model_dir, file, where, external_links))

    if index_path is None:
        for file, header in headers.items():
            for name in header.tensors:
                if name in weight_map:
                    raise FoldckptError.at(
                        model_dir / file, f"tensor '{name}' also appears in {weight_map[name]}", name
                    )
                weight_map[name] = file
    else:
        _check_index_matches_headers(index_path, weight_map, headers)
    return SourceCheckpoint(model_dir, index_path, weight_map, headers)


def _check_index_matches_headers(
    index_path: Path, weight_map: dict[str, str], headers: dict[str, SafetensorsHeader]
) -> None:
    """The index and the shard headers agree both ways: every tensor the index maps is in its file,
    and every tensor a shard holds is mapped to that shard. Why both: loaders read the shards the
    index lists, whole, so a tensor it does not map (or maps elsewhere, a second copy) is served
    all the same, unaccounted for; convert refuses it up front, and verify finds it the same way
    in an index edited after conversion."""
    for name, file in weight_map.items():
        if name not in headers[file].tensors:
            raise FoldckptError.at(
                index_path, f"says '{name}' is in {file}, but that file's header has no such tensor", name
            )
    for file, header in headers.items():
        for name in sorted(header.tensors):
            mapped = weight_map.get(name)
            if mapped != file:
                where = "does not map" if mapped is None else f"maps to {mapped}"
                raise FoldckptError.at(index_path, f"{where} tensor '{name}', which {file}'s header holds", name)


def list_files_to_place(model_dir: Path, external_links: bool = False) -> list[str]:
    """Every file of the model directory that the output must carry unchanged (relative POSIX
    names), skipping hidden entries such as ``.cache`` and ``.git``."""
    names: list[str] = []
    for path in sorted(model_dir.rglob("*")):
        relative = path.relative_to(model_dir)
        if is_hidden(relative) or path.is_dir():
            continue
        resolve_inside(model_dir, relative.as_posix(), str(model_dir), external_links)
        names.append(relative.as_posix())
    return names
