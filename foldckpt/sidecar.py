"""Writing a sidecar shard layer by layer, durably, so that a killed run resumes mid-shard.

The shard is built under its temporary name: the header (known from the plan) first, then each
fold's bytes, fsynced after every layer. The journal records the byte offset reached, so a resumed
run truncates the temporary file back to the last durable layer, re-hashes that prefix, and
appends from there. Only a complete shard is renamed to its final name.
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

from foldckpt.errors import FoldckptError
from foldckpt.files import HASH_CHUNK, fsync_dir, os_error, tmp_path_for
from foldckpt.manifest import FileRecord
from foldckpt.safetensors_format import TensorSpec, encode_header


class ShardWriter:
    def __init__(
        self, path: Path, specs: list[TensorSpec], metadata: dict[str, str], resume_offset: int = 0
    ) -> None:
        self.path = path
        self.tmp = tmp_path_for(path)
        self._digest = hashlib.sha256()
        header = encode_header(specs, metadata)
        self.expected_size = len(header) + sum(spec.nbytes for spec in specs)
        try:
            if resume_offset >= len(header) and self.tmp.is_file() and self.tmp.stat().st_size >= resume_offset:
                self._handle = open(self.tmp, "r+b")
                self._handle.truncate(resume_offset)
                self._rehash_prefix(resume_offset)
                self._handle.seek(resume_offset)
                self.offset = resume_offset
            else:
                self._handle = open(self.tmp, "wb")
                self.offset = 0
                self.append(header)
        except OSError as exc:
            raise os_error(self.tmp, exc, "writing") from None

    def _rehash_prefix(self, length: int) -> None:
        self._handle.seek(0)
        remaining = length
        while remaining:
            chunk = self._handle.read(min(HASH_CHUNK, remaining))
            if not chunk:
                raise FoldckptError(f"{self.tmp}: shorter than its journaled size; pass --restart")
            self._digest.update(chunk)
            remaining -= len(chunk)

    def append(self, data: bytes | memoryview) -> int:
        """Append and make durable; returns the new durable offset (for the journal)."""
        try:
            self._handle.write(data)
            self._handle.flush()
            os.fsync(self._handle.fileno())
        except OSError as exc:
            self.close()
            raise os_error(self.path, exc, "writing") from None
        self._digest.update(data)
        self.offset += len(data)
        return self.offset

    def finish(self) -> FileRecord:
        """Close the complete (already durable) shard; returns the size and sha256 it will have.

        Separate from :meth:`commit` so the caller can journal the record before the rename.
        """
        if self.offset != self.expected_size:
            raise RuntimeError(f"{self.path}: wrote {self.offset} of {self.expected_size} bytes")
        self.close()
        return FileRecord(self.offset, self._digest.hexdigest())

    def commit(self) -> None:
        """Rename the finished shard into place."""
        try:
            os.replace(self.tmp, self.path)
            fsync_dir(self.path.parent)
        except OSError as exc:
            raise os_error(self.path, exc, "renaming into place") from None

    def close(self) -> None:
        """Close the file, ignoring a failed final flush.

        After a failed :meth:`append` (disk full, file too large) the buffer still holds bytes
        that closing retries and fails to write again; they lie past the journaled offset, which
        a resume truncates back to, so nothing is lost and the one-line error stays the one raised.
        """
        if not self._handle.closed:
            with contextlib.suppress(OSError):
                self._handle.close()
