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
from foldckpt.io.files import atomic_write_json, parse_json
from foldckpt.format.manifest import FORMAT_VERSION

JOURNAL_NAME = ".foldckpt-journal.json"


def run_key(files: tuple[str, ...] | list[str], parameters: dict[str, Any]) -> str:
    """Identity of a conversion: the tool, the output-shaping parameters and the names of the
    files OUT_DIR holds.

    The files' bytes are not part of the key: convert checks, file by file, that every placed
    file still holds the bytes recorded (a fingerprint of device, inode, size, mtime and ctime
    first, sha256 where it differs), so that a change is named, and a mere ``touch`` costs a
    rehash of that file rather than a restart.
    """
    identity = {
        "tool_version": __version__,
        "format_version": FORMAT_VERSION,
        "parameters": parameters,
        "sources": sorted(files),
    }
    return hashlib.sha256(json.dumps(identity, sort_keys=True).encode()).hexdigest()


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
                "placed": self.placed,
                "shards": {
                    name: {"offset": s.offset, "tensors": s.tensors, "done": s.done}
                    for name, s in self.shards.items()
                },
                "source_hashes": self.source_hashes,
                "fingerprints": self.fingerprints,
            },
        )

    def shard(self, name: str) -> ShardProgress:
        return self.shards.setdefault(name, ShardProgress())

    @classmethod
    def load(cls, path: Path) -> Journal:
        try:
            data = parse_json(path.read_bytes())
            return cls(
                path=path,
                run_key=str(data["run_key"]),
                placed=dict(data["placed"]),
                shards={
                    name: ShardProgress(int(s["offset"]), dict(s["tensors"]), s["done"])
                    for name, s in data["shards"].items()
                },
                source_hashes=dict(data["source_hashes"]),
                fingerprints=dict(data.get("fingerprints", {})),
            )
        except (OSError, ValueError, KeyError, TypeError, AttributeError) as exc:  # any shape but the right one
            raise FoldckptError(
                f"{path}: unreadable resume journal ({exc}); pass --restart to start over"
            ) from None
