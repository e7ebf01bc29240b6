"""Writing a sidecar shard layer by layer, durably, so that a killed run resumes mid-shard.

The shard is built under its temporary name: the header (known from the plan) first, then each
fold's bytes as the fold makes them (head chunk by head chunk), fsynced after every layer. The
journal records the byte offset reached, so a resumed run truncates the temporary file back to the
last durable layer and appends from there. Only a complete shard is renamed to its final name.
Writes bypass the page cache where the filesystem allows
(:class:`foldckpt.io.direct_io.DurableAppender`). The writer hashes the header only: the fold bytes
are hashed once, head by head, where they are made (:func:`foldckpt.io.hashing.head_digests`), and
those digests with the header's cover the whole file (manifest format 3).
"""

from __future__ import annotations

import contextlib
import hashlib
import os
from pathlib import Path

from foldckpt.defaults import SIDECAR_HEADER_ALIGN
from foldckpt.io.direct_io import DiskPriority, DurableAppender
from foldckpt.io.files import fsync_dir, os_error, tmp_path_for
from foldckpt.format.manifest import SidecarRecord
from foldckpt.io.safetensors_format import TensorInfo, TensorSpec, encode_header


class ShardWriter:
    def __init__(
        self,
        path: Path,
        specs: list[TensorSpec],
        metadata: dict[str, str],
        resume_offset: int = 0,
        priority: DiskPriority | None = None,
    ) -> None:
        """``priority``: the run's, so that its appends go before background reads."""
        self.path = path
        self.tmp = tmp_path_for(path)
        header = encode_header(specs, metadata, SIDECAR_HEADER_ALIGN)
        self.header_sha256 = hashlib.sha256(header).hexdigest()
        self.header_size = len(header)
        self.expected_size = len(header) + sum(spec.nbytes for spec in specs)
        # Where each tensor's bytes go (absolute offsets), as the finished file's header says.
        self.layout: dict[str, TensorInfo] = {}
        cursor = len(header)
        for spec in specs:
            self.layout[spec.name] = TensorInfo(spec.name, spec.dtype, spec.shape, cursor, cursor + spec.nbytes)
            cursor += spec.nbytes
        try:
            resume = (
                resume_offset >= len(header) and self.tmp.is_file() and self.tmp.stat().st_size >= resume_offset
                and _starts_with(self.tmp, header)  # not a damaged header, nor another layout's
            )  # fmt: skip
            kept = resume_offset if resume else 0
            fd = os.open(self.tmp, os.O_RDWR if resume else os.O_RDWR | os.O_CREAT | os.O_TRUNC, 0o666)
            try:
                os.ftruncate(fd, kept)
                self._out = DurableAppender(self.tmp, fd, kept, priority)
            except OSError:
                os.close(fd)
                raise
        except OSError as exc:
            raise os_error(self.tmp, exc, "writing") from None
        self._fd: int | None = fd
        if self.offset == 0:
            self.append(header)

    @property
    def staged(self) -> int:
        """Bytes copied through the direct-I/O staging buffer so far (the header, unaligned tails)."""
        return self._out.staged

    @property
    def offset(self) -> int:
        """The durable size of the temporary file (what the journal records)."""
        return self._out.offset

    def append(self, data: bytes | memoryview | list[memoryview]) -> int:
        """Append (one buffer or several, in order) and make durable; returns the new durable
        offset (for the journal)."""
        self.write(data if isinstance(data, list) else [memoryview(data)])
        return self.sync()

    def write(self, parts: list[memoryview]) -> None:
        """Append ``parts`` in order, durable at the next :meth:`sync` (a layer's fold is written
        head chunk by head chunk and made durable once whole); their memory is free again once
        this returns."""
        try:
            self._out.write(parts)
        except OSError as exc:
            self.close()
            raise os_error(self.path, exc, "writing") from None

    def sync(self) -> int:
        """Make what was written durable; returns the new durable offset (for the journal)."""
        try:
            return self._out.sync()
        except OSError as exc:
            self.close()
            raise os_error(self.path, exc, "writing") from None

    def restart(self) -> int:
        """Drop everything after the header (a resumed prefix that no longer holds its folds)."""
        try:
            self._out.truncate(self.header_size)
        except OSError as exc:
            raise os_error(self.tmp, exc, "writing") from None
        return self.offset

    def finish(self) -> SidecarRecord:
        """Close the complete (already durable) shard; returns its manifest record.

        Separate from :meth:`commit` so the caller can journal the record before the rename.
        """
        if self.offset != self.expected_size:
            raise RuntimeError(f"{self.path}: wrote {self.offset} of {self.expected_size} bytes")
        self.close()
        return SidecarRecord(self.offset, self.header_sha256)

    def commit(self) -> None:
        """Rename the finished shard into place."""
        try:
            os.replace(self.tmp, self.path)
            fsync_dir(self.path.parent)
        except OSError as exc:
            raise os_error(self.path, exc, "renaming into place") from None

    def close(self) -> None:
        """Close the file (idempotent). Nothing is buffered here: every append is durable or failed."""
        if self._fd is not None:
            self._out.close()
            with contextlib.suppress(OSError):
                os.close(self._fd)
            self._fd = None


def _starts_with(path: Path, prefix: bytes) -> bool:
    with open(path, "rb") as handle:
        return handle.read(len(prefix)) == prefix
