"""The resume journal of an unfinished conversion.

``OUT_DIR/.foldckpt-journal.json`` is rewritten atomically after every durable step: a source
file placed, a layer appended to a sidecar (with the byte offset that is known to be on disk), a
sidecar finished, a source file hashed. It is keyed by a run key derived from the tool version,
the output-shaping parameters and the identity of every source file, so a rerun with other inputs
or parameters refuses to mix its results with this one. The manifest replaces it at the end.
"""

from __future__ import annotations

import hashlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from foldckpt import __version__
from foldckpt.errors import FoldckptError
from foldckpt.format.manifest import FORMAT_VERSION, FoldTensor, Manifest, SchemaError, SidecarRecord
from foldckpt.io.files import atomic_write_json, parse_json


def run_identity(files: tuple[str, ...] | list[str], parameters: dict[str, Any]) -> dict[str, Any]:
    """Identity of a conversion: the tool, the output-shaping parameters and the names of the
    files OUT_DIR holds (what :func:`run_key` digests, and what a refusal compares field by field).

    The files' bytes are not part of it: convert checks, file by file, that every placed file
    still holds the bytes recorded (a fingerprint of device, inode, size, mtime and ctime first,
    sha256 where it differs), so that a change is named, and a mere ``touch`` costs a rehash of
    that file rather than a restart.
    """
    return {
        "tool_version": __version__,
        "format_version": FORMAT_VERSION,
        "parameters": parameters,
        "sources": sorted(files),
    }


def run_key(identity: dict[str, Any]) -> str:
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


def manifest_identity(manifest: Manifest) -> dict[str, Any]:
    """The identity (:func:`run_identity`) of the run that wrote ``manifest``."""
    parameters = {name: value for name, value in manifest.parameters.items() if name != "run_key"}
    if manifest.source is not None:
        parameters["source"] = manifest.source
    identity = run_identity(list(manifest.source_files), parameters)
    return {**identity, "tool_version": manifest.tool_version, "format_version": manifest.format_version}


def differences(old: dict[str, Any] | None, new: dict[str, Any], limit: int = 3) -> str:
    """What differs between the identity of the run found in OUT_DIR (``old``, None where an
    older journal did not record it) and this one's, for a refusal: `` (fold_dtype: bfloat16 in
    OUT_DIR, float32 now)``; empty when nothing can be named."""
    if not old:
        return ""
    found: list[str] = []
    for field_name, label in (("tool_version", "foldckpt version"), ("format_version", "manifest format")):
        if old.get(field_name) != new[field_name]:
            found.append(f"{label}: {old.get(field_name)} in OUT_DIR, {new[field_name]} now")
    before, now = old.get("parameters") or {}, new["parameters"]
    for name in sorted(before.keys() | now.keys()):
        if before.get(name) != now.get(name):
            found.append(f"{name}: {_shown(before.get(name))} in OUT_DIR, {_shown(now.get(name))} now")
    before_files, now_files = set(old.get("sources") or ()), set(new["sources"])
    for names, what in (
        (before_files - now_files, "not in the model now"),
        (now_files - before_files, "new in the model"),
    ):
        if names:
            shown = sorted(names)
            found.append(f"source files {what}: {', '.join(shown[:limit])}{' ...' if len(shown) > limit else ''}")
    return f" ({'; '.join(found)})" if found else ""


def _shown(value: Any) -> str:
    return "none" if value is None else json.dumps(value, sort_keys=True) if isinstance(value, dict) else str(value)


@dataclass
class ShardProgress:
    """What of one sidecar shard is durably on disk."""

    offset: int = 0
    tensors: dict[str, dict[str, Any]] = field(default_factory=dict)
    done: dict[str, Any] | None = None


@dataclass
class Journal:
    path: Path
    run_key: str
    # What run_key digests (run_identity): a refusal names the field that differs. None in
    # journals written before it was recorded.
    identity: dict[str, Any] | None = None
    # For ``inspect`` of an interrupted conversion: the model converted and its MLA layer count.
    model: Path | None = None
    layers: int | None = None
    placed: dict[str, str] = field(default_factory=dict)
    shards: dict[str, ShardProgress] = field(default_factory=dict)
    source_hashes: dict[str, dict[str, Any]] = field(default_factory=dict)
    # name -> {"out": fingerprint of OUT_DIR/name, "src": of MODEL_DIR/name} when it was placed
    # (sidecars: when finished); see foldckpt.io.files.fingerprint.
    fingerprints: dict[str, dict[str, Any]] = field(default_factory=dict)
    # Held by whoever changes and saves the journal while other threads may too (hashing passes,
    # the sidecar writer); reentrant, so a holder can call save().
    lock: threading.RLock = field(default_factory=threading.RLock, repr=False, compare=False)

    def save(self) -> None:
        with self.lock:
            self._save()

    def _save(self) -> None:
        atomic_write_json(
            self.path,
            {
                "run_key": self.run_key,
                "identity": self.identity,
                "model": None if self.model is None else str(self.model),
                "layers": self.layers,
                "placed": self.placed,
                "shards": {
                    name: {"offset": s.offset, "tensors": s.tensors, "done": s.done} for name, s in self.shards.items()
                },
                "source_hashes": self.source_hashes,
                "fingerprints": self.fingerprints,
            },
        )

    def shard(self, name: str) -> ShardProgress:
        return self.shards.setdefault(name, ShardProgress())

    def folds(self, shard: str, num_heads: int) -> list[FoldTensor]:
        """The fold records journaled for sidecar ``shard``, each field checked: a record edited or
        damaged by hand is the journal's defect, refused as an unreadable journal is."""
        try:
            return [FoldTensor.from_dict(name, record, num_heads) for name, record in self.shard(shard).tensors.items()]
        except SchemaError as exc:
            raise _unreadable(self.path, exc) from None

    def sidecar(self, shard: str) -> SidecarRecord:
        """The record of finished sidecar ``shard``, checked as :meth:`folds` checks folds."""
        done = self.shard(shard).done
        assert done is not None
        try:
            return SidecarRecord.from_dict(done)
        except SchemaError as exc:
            raise _unreadable(self.path, exc) from None

    def layers_done(self) -> int:
        """The layers whose folds are durably in a sidecar."""
        return sum(len(progress.tensors) for progress in self.shards.values())

    @classmethod
    def load(cls, path: Path) -> Journal:
        try:
            data = parse_json(path.read_bytes())
            return cls(
                path=path,
                run_key=str(data["run_key"]),
                identity=dict(data["identity"]) if data.get("identity") else None,
                model=Path(data["model"]) if data.get("model") else None,
                layers=int(data["layers"]) if data.get("layers") is not None else None,
                placed=dict(data["placed"]),
                shards={
                    name: ShardProgress(int(s["offset"]), dict(s["tensors"]), s["done"])
                    for name, s in data["shards"].items()
                },
                source_hashes=dict(data["source_hashes"]),
                fingerprints=dict(data.get("fingerprints", {})),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # any shape but the right one
            raise _unreadable(path, exc) from None


def _unreadable(path: Path, why: Exception) -> FoldckptError:
    return FoldckptError(f"{path}: unreadable resume journal ({why}); pass --restart to start over")
