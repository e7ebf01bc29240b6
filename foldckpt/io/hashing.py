"""The hashing engine: what convert records, what verify recomputes and what a serving rank checks.

Three things live here, and nowhere else:

* **which digest** covers what. Whole files (the sources, the sidecar headers, the manifest) get
  sha256, what ``sha256sum`` prints and the Hugging Face Hub lists for every weight file, so that
  users can check them with tools of their own. Tensor bytes (each head block of a fold, each source
  tensor a fold was computed from) get BLAKE3 (:func:`tensor_digest`), several times cheaper per
  byte on the CPU (it hashes many chunks at once in SIMD lanes, where sha256 is one serial chain;
  the rates are ``sha256_bytes_per_s_per_core`` and ``tensor_digest_bytes_per_s_per_core`` under
  ``projection_full_kimi_k3`` in ``docs/bench/convert*.json``): at Kimi-K3 scale a conversion
  digests some 4 GB of them (the folds, and their inputs beside the sha256 of the files that hold
  them), and every serving rank digests its rows and the inputs beside them at load;
* the **per-head hash tree** of a fold tensor. The fold is head-major (``[H*(L+R), Lq]``, rows head
  by head; ARCHITECTURE.md "Layout"), and a tensor-parallel rank owns a contiguous run of whole
  heads for any TP size that divides H. So the leaves are one digest per head block (the smallest
  unit any rank owns), and a rank's digest is derived from its heads' leaves only
  (:func:`rank_digest`): any rank of any TP size checks exactly what it loads, and convert hashes
  each fold byte once, whatever TP sizes will serve it;
* **bounded reads** for whole-file and range digests (:func:`hash_job`): ``preadv`` into one fixed
  buffer per thread (no memory map, so the address space a check needs does not grow with the
  files), direct I/O for files not in the page cache (:mod:`foldckpt.io.direct_io`), each chunk fed
  to the whole-file digest and to every range (head block) it overlaps while it is in cache; plain
  reads ask the kernel to prefetch, so that the disk stays busy while the thread hashes.
"""

from __future__ import annotations

import ctypes
import hashlib
import mmap
import os
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import Executor
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import BinaryIO, Protocol

from blake3 import blake3

from foldckpt.io.direct_io import BufferPool, direct_reader, read_direct, refused
from foldckpt.io.files import HASH_BUFFER, os_error

# The definitions of the tensor digests, recorded in the manifest (``integrity``) for other readers.
TENSOR_DIGEST_RULE = "BLAKE3 (32-byte output, hex) of exactly the tensor's stored bytes"
LEAF_RULE = "BLAKE3 of each head's rows [h*(L+R), (h+1)*(L+R)) of the stored tensor bytes"
RANK_RULE = "BLAKE3 of the concatenated 32-byte leaf digests of the rank's heads, in head order"

# CPU per byte of a tensor digest against sha256's (the ratio of ``sha256_bytes_per_s_per_core`` to
# ``tensor_digest_bytes_per_s_per_core`` in docs/bench/convert*.json): what orders verify's jobs.
_TENSOR_DIGEST_COST = 0.25

# Asked of the kernel ahead of the hashing (FADV_WILLNEED): the disk stays busy while the thread
# hashes, where plain reads or a memory map leave it idle between the thread's requests.
_PREFETCH = 64 * 1024 * 1024
_RESIDENCY_PROBES = 16


def _libc() -> ctypes.CDLL | None:
    """The C library this process runs on (its own symbols: no library search at start-up)."""
    try:
        return ctypes.CDLL(None, use_errno=True)
    except OSError:
        return None


_LIBC = _libc()


# ---------------------------------------------------------------------------------------------
# tensor digests and the per-head tree


def tensor_digest(data: memoryview | bytes | bytearray) -> str:
    """The digest of tensor bytes (:data:`TENSOR_DIGEST_RULE`)."""
    return blake3(data).hexdigest()


def tensor_hasher() -> blake3:
    """A digest of tensor bytes fed piece by piece (``update``, then ``hexdigest``)."""
    return blake3()


def head_digests(data: memoryview | bytes | bytearray, heads: int, pool: Executor | None = None) -> tuple[str, ...]:
    """The leaves: the tensor digest of each of the ``heads`` equal row blocks of ``data`` (a fold's
    bytes, or a rank's rows of it), in head order; spread over ``pool`` when given (BLAKE3 frees the GIL)."""
    view = memoryview(data).cast("B")
    if heads <= 0 or view.nbytes % heads:
        raise ValueError(f"{view.nbytes} bytes do not split into {heads} equal head blocks")
    size = view.nbytes // heads

    def leaf(head: int) -> str:
        return tensor_digest(view[head * size : (head + 1) * size])

    if pool is None:
        return tuple(leaf(h) for h in range(heads))
    return tuple(pool.map(leaf, range(heads)))


def rank_digest(leaves: Sequence[str]) -> str:
    """A rank's digest, derived from its heads' leaves (see :data:`RANK_RULE`)."""
    return tensor_digest(b"".join(bytes.fromhex(leaf) for leaf in leaves))


def describe_heads(heads: Sequence[int]) -> str:
    """``0, 3-5, 7``: head numbers as ranges."""
    runs: list[list[int]] = []
    for head in sorted(heads):
        if runs and head == runs[-1][1] + 1:
            runs[-1][1] = head
        else:
            runs.append([head, head])
    return ", ".join(f"{a}" if a == b else f"{a}-{b}" for a, b in runs)


# ---------------------------------------------------------------------------------------------
# bounded reads of whole files and ranges


@dataclass(frozen=True)
class RangeCheck:
    """A tensor digest recorded for bytes ``[start, end)`` of a file: one head of a fold (``head``),
    or a whole source tensor (``head`` None; ``expected`` None when it is still to be recorded)."""

    tensor: str
    head: int | None
    expected: str | None


class Capture(Protocol):
    """What a pass over a file does with the ranges it hashes besides digesting them: ``begin``
    returns a buffer of the range's size to copy its bytes into (or None), ``end`` receives the
    range's digest and that buffer once its last byte went by (possibly long before the file's end)."""

    def begin(self, bound: tuple[int, int]) -> memoryview | None: ...

    def end(self, bound: tuple[int, int], digest: str, data: memoryview | None) -> None: ...


@dataclass
class HashJob:
    """One file to read once: its whole-file sha256 (when ``whole``; ``expected`` is the recorded
    one, if any) and the tensor digests of byte ranges in it (alone, only the ranges are read)."""

    name: str
    size: int
    whole: bool
    expected: str | None = None
    ranges: dict[tuple[int, int], list[RangeCheck]] = field(default_factory=dict)

    def add(self, start: int, end: int, check: RangeCheck) -> None:
        self.ranges.setdefault((start, end), []).append(check)

    def segments(self) -> list[tuple[int, int]]:
        if self.whole:
            return [(0, self.size)]
        merged: list[list[int]] = []
        for start, end in sorted(self.ranges):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return [(a, b) for a, b in merged]

    @property
    def read_bytes(self) -> int:
        return sum(b - a for a, b in self.segments())

    @property
    def cost(self) -> int:
        """Hashing work in sha256 bytes: the whole-file digest plus every range's tensor digest."""
        return (self.size if self.whole else 0) + int(sum(b - a for a, b in self.ranges) * _TENSOR_DIGEST_COST)


def in_page_cache(fd: int, size: int) -> bool:
    """Whether the file looks fully cached: the pages of a few evenly spread offsets asked of
    ``mincore`` (False where it cannot tell). Why not a read with ``RWF_NOWAIT``: on a miss it
    starts read-ahead, and on a fast disk that read can land before the flag's check, so the probe
    itself caches what it asks about (a freshly evicted file then looked cached now and then)."""
    if size == 0:
        return True
    mincore = getattr(_LIBC, "mincore", None) if _LIBC is not None else None
    if mincore is None:
        return False
    page = mmap.PAGESIZE
    resident = (ctypes.c_ubyte * 1)()
    for i in range(_RESIDENCY_PROBES):
        offset = min(size - 1, size * i // (_RESIDENCY_PROBES - 1))
        base = offset - offset % mmap.ALLOCATIONGRANULARITY
        length = offset - base + 1
        try:
            with mmap.mmap(fd, length, access=mmap.ACCESS_COPY, offset=base) as mapping:
                view = (ctypes.c_char * length).from_buffer(mapping)
                try:
                    start = ctypes.addressof(view) + (offset - base) // page * page
                    if mincore(ctypes.c_void_p(start), ctypes.c_size_t(1), resident) != 0:
                        return False
                finally:
                    del view
        except (OSError, ValueError):  # a file that cannot be mapped: cannot tell
            return False
        if not resident[0] & 1:
            return False
    return True


def all_cached(paths: list[Path]) -> bool:
    for path in paths:
        try:
            with open(path, "rb", buffering=0) as handle:
                if not in_page_cache(handle.fileno(), os.fstat(handle.fileno()).st_size):
                    return False
        except OSError:
            return False
    return True


def default_workers(cached: bool = False) -> int:
    """Hashing threads: one per core when every file is in the page cache (sha256 is the only
    work), else two per core, at most 32, so that a core hashes while another thread waits for
    the disk; with every file cached, threads beyond the cores only contend for them."""
    cores = os.cpu_count() or 1
    return cores if cached else min(32, 2 * cores)


def chunks(
    handle: BinaryIO,
    size: int,
    segments: list[tuple[int, int]],
    direct: int | None = None,
    before_transfer: Callable[[], None] | None = None,
    pool: BufferPool | None = None,
) -> Iterator[tuple[int, memoryview]]:
    """``(offset, bytes)`` of ``segments`` (clipped to ``size``), each valid until the next: read
    through ``direct`` (a direct-I/O descriptor of the same file, see :mod:`foldckpt.io.direct_io`)
    when given and the filesystem takes its transfers, whole transfers of ``DIRECT_CHUNK`` bytes;
    else from ``handle`` in ``HASH_BUFFER`` steps into one fixed buffer (which stays in the core's
    cache while sha256 reads it back) with ``preadv``, the next ``_PREFETCH`` bytes asked ahead;
    ``before_transfer`` runs before each read (a background pass waiting for its turn); ``pool``
    lends the direct reads their buffers."""
    if direct is not None:
        started = False
        try:
            for item in read_direct(direct, size, segments, before_transfer, pool):
                started = True
                yield item
            return
        except OSError as exc:
            if started or not refused(exc):
                raise
    fd = handle.fileno()
    advise = hasattr(os, "posix_fadvise")
    if advise:
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    buffer = memoryview(bytearray(HASH_BUFFER))
    for start, end in segments:
        end = min(end, size)
        pos = asked = start
        while pos < end:
            if advise and asked < end and asked - pos < _PREFETCH // 2:
                os.posix_fadvise(fd, asked, min(_PREFETCH, end - asked), os.POSIX_FADV_WILLNEED)
                asked += _PREFETCH
            if before_transfer is not None:
                before_transfer()
            count = os.preadv(fd, [buffer[: min(HASH_BUFFER, end - pos)]], pos)
            if not count:
                return  # shorter than recorded: the digests will not match
            yield pos, buffer[:count]
            pos += count


def _pieces(
    transfers: Iterator[tuple[int, memoryview]], bounds: list[tuple[int, int]]
) -> Iterator[tuple[int, memoryview]]:
    """The ``transfers`` as :func:`hash_job` feeds them to its digests: cut into ``HASH_BUFFER``
    pieces where they overlap one of the ``bounds`` (byte ranges: several digests, and a copy, read
    those bytes, each piece while it is in the core's cache), whole elsewhere. Why whole: each
    piece costs the pass a trip through Python (this loop, its progress callback) and so a take of
    the GIL, which the fold's thread and torch's import (convert's first seconds) hold most of the
    time. A whole direct transfer (``direct_io.DIRECT_CHUNK``) is one trip where ``HASH_BUFFER`` pieces are
    several; only the bytes of the fold inputs stay cut."""
    for start, transfer in transfers:
        end = start + len(transfer)
        if not any(lo < end and hi > start for lo, hi in bounds):
            yield start, transfer
            continue
        for offset in range(0, len(transfer), HASH_BUFFER):
            yield start + offset, transfer[offset : offset + HASH_BUFFER]


@contextmanager
def _direct_reads(path: Path, handle: BinaryIO, bypass_cache: bool) -> Iterator[tuple[int, int | None]]:
    """The size of ``handle``'s file and the direct-I/O descriptor to read it through (None: read
    it plainly)."""
    fd = handle.fileno()
    size = os.fstat(fd).st_size
    direct = direct_reader(path, size, lambda: in_page_cache(fd, size)) if bypass_cache else None
    try:
        yield size, direct
    finally:
        if direct is not None:
            os.close(direct)


def hash_job(
    path: Path,
    job: HashJob,
    progress: Callable[[int], object] | None = None,
    capture: Capture | None = None,
    before_transfer: Callable[[], None] | None = None,
    bypass_cache: bool = False,
    pool: BufferPool | None = None,
) -> tuple[str | None, dict[tuple[int, int], str]]:
    """Read the job's segments once, feeding the whole-file digest and every overlapping range digest
    (a range is fed chunk by chunk, right after the whole-file digest, while the bytes are in cache),
    and, with ``capture``, copying the ranges it asks for; ``before_transfer`` as in :func:`chunks`.
    Returns (whole-file digest or None, range digests). ``progress`` may raise to abandon the pass.

    ``bypass_cache``: stream a large file that is not in the page cache with direct I/O (convert's
    passes and ``verify --level content``): direct reads skip the page cache's copy of every byte,
    and from huge pages (:func:`~foldckpt.io.direct_io.aligned_buffer`) they keep the disk busier
    than plain reads with prefetch (``results.cold`` in ``docs/bench/verify.json``:
    ``foldckpt_verify_content`` against ``sequential_read``).
    Without it, plain reads (:func:`~foldckpt.format.consistency.heads_intact`: a few head blocks of a
    sidecar, for the serving loader and convert's resume checks). ``pool`` lends the direct reads
    their buffers (one pool for a run's reads: no fresh buffer per file)."""
    whole = hashlib.sha256() if job.whole else None
    bounds = sorted(job.ranges)
    digests = {bound: tensor_hasher() for bound in bounds}
    buffers: dict[tuple[int, int], memoryview | None] = {}
    pending, active = 0, []  # bounds sorted by start; active = started and not finished
    try:
        with open(path, "rb", buffering=0) as handle, _direct_reads(path, handle, bypass_cache) as (size, direct):
            segments = [(0, size)] if whole is not None else job.segments()
            for pos, chunk in _pieces(chunks(handle, size, segments, direct, before_transfer, pool), bounds):
                chunk_end = pos + len(chunk)
                if whole is not None:
                    whole.update(chunk)
                while pending < len(bounds) and bounds[pending][0] < chunk_end:
                    active.append(bounds[pending])
                    if capture is not None:
                        buffers[bounds[pending]] = capture.begin(bounds[pending])
                    pending += 1
                for start, end in active:
                    lo, hi = max(start, pos), min(end, chunk_end)
                    if hi > lo:
                        digests[(start, end)].update(chunk[lo - pos : hi - pos])
                        if (buffer := buffers.get((start, end))) is not None:
                            buffer[lo - start : hi - start] = chunk[lo - pos : hi - pos]
                if capture is not None:
                    for bound in active:
                        if bound[1] <= chunk_end:
                            capture.end(bound, digests[bound].hexdigest(), buffers.pop(bound))
                active = [bound for bound in active if bound[1] > chunk_end]
                if progress:
                    progress(len(chunk))
    except OSError as exc:
        raise os_error(path, exc, "hashing") from None
    return (whole.hexdigest() if whole else None), {bound: d.hexdigest() for bound, d in digests.items()}
