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
import stat
from pathlib import Path

from foldckpt.defaults import SIDECAR_HEADER_ALIGN
from foldckpt.format.manifest import SidecarRecord
from foldckpt.io.direct_io import DiskPriority, DurableAppender
from foldckpt.io.files import fsync_dir, os_error, tmp_path_for
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
            fd, kept = _open_tmp(self.tmp, header, resume_offset)
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


def _open_tmp(tmp: Path, header: bytes, resume_offset: int) -> tuple[int, int]:
    """A descriptor of the temporary shard and the bytes of it to keep: the one a killed run left,
    where it is this conversion's (a regular file of ours, with no other name, that begins with
    ``header`` and holds ``resume_offset`` bytes), else a new one.

    Never through a link: a symlink planted at the temporary name after a kill had the resume
    truncate and append to the file it points to, anywhere, and a hard link to another file
    shares that file's bytes. Such an entry, or anything else not ours, is removed (the entry
    itself) and the shard starts over."""
    flags = os.O_RDWR | os.O_NOFOLLOW | os.O_NOCTTY | os.O_CLOEXEC
    if resume_offset >= len(header):
        try:
            fd = os.open(tmp, flags)
        except OSError:  # missing, a link (ELOOP), a directory...: start over
            fd = -1
        if fd >= 0:
            if _ours(fd, header, resume_offset):
                return fd, resume_offset
            os.close(fd)
    with contextlib.suppress(FileNotFoundError):
        os.unlink(tmp)
    return os.open(tmp, flags | os.O_CREAT | os.O_EXCL, 0o666), 0


def _ours(fd: int, header: bytes, resume_offset: int) -> bool:
    try:
        status = os.fstat(fd)
        alone = stat.S_ISREG(status.st_mode) and status.st_nlink == 1 and status.st_uid == os.geteuid()
        return alone and status.st_size >= resume_offset and os.pread(fd, len(header), 0) == header
    except OSError:
        return False
