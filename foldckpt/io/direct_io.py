"""Streaming reads and durable appends that bypass the page cache (``O_DIRECT``) where they can.

Why: convert reads every source byte once (to hash it) and writes every fold byte once. Through
the page cache each of those bytes also costs a kernel copy and a cache page that must be
allocated, filled, written back and reclaimed, work that competes with sha256 and the fold for the
cores: a buffered read or write costs several times the CPU of a direct one, and on few cores
that CPU is wall time (the I/O floor measured both ways: ``read_plain_s``/``read_direct_s`` and
``write_plain_s``/``write_direct_s`` in each record of ``docs/bench/convert*.json``). Terabyte
checkpoints do not fit the page cache anyway, so caching what a conversion (or ``verify``)
streams buys nothing. From huge pages (:func:`aligned_buffer`) a direct read also keeps the disk
busier than plain reads with prefetch: see ``hashing.hash_job``'s ``bypass_cache``.

A file whose bytes are already in the page cache is read through it (a memory copy beats the
disk), and a filesystem that refuses ``O_DIRECT`` (at open or at the first transfer: tmpfs on
older kernels, some FUSE mounts) is read and written the plain way: the bytes are the same, only
the cost differs.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import mmap
import os
import queue
import threading
from collections.abc import Callable, Iterator
from contextlib import contextmanager

# Offsets, lengths and buffer addresses of direct transfers are multiples of this: the largest
# logical block size of common devices (4Kn disks; 512-byte devices accept it too).
ALIGN = 4096
# One direct read or write: large enough that the per-transfer latency is amortised, and no larger
# than the largest request common devices take (4 MiB for this project's virtio disks: a larger
# transfer goes as several requests anyway). Each hashing pass holds two such buffers, so their
# size is memory, multiplied by the passes that run at once (``hashing.default_workers``).
DIRECT_CHUNK = 4 * 1024 * 1024
# x86-64's huge page (transparent huge pages back aligned runs of this size); see aligned_buffer.
HUGE_PAGE = 2 * 1024 * 1024
_MADV_HUGEPAGE: int | None = getattr(mmap, "MADV_HUGEPAGE", None)
# Buffers per read: one being read into while the caller works on the other.
_READ_BUFFERS = 2
# Smaller files are not worth a second open and an aligned buffer.
_DIRECT_MIN_BYTES = DIRECT_CHUNK
_UNSUPPORTED = (errno.EINVAL, errno.EOPNOTSUPP, errno.ENOTSUP)

_O_DIRECT = getattr(os, "O_DIRECT", 0)


def buffer_address(view: memoryview) -> int:
    """The address of ``view``'s first byte (a writable view: ctypes takes no read-only buffer)."""
    return ctypes.addressof(ctypes.c_char.from_buffer(view))


def _page_aligned(view: memoryview) -> bool:
    """Whether ``view`` starts at an ``ALIGN``-aligned address (a read-only view counts as not)."""
    if view.readonly:
        return False
    return buffer_address(view) % ALIGN == 0


def aligned_buffer(nbytes: int) -> memoryview:
    """``nbytes`` of anonymous memory at a page-aligned address (what direct transfers need); from
    ``HUGE_PAGE`` bytes on, at a huge-page boundary and backed by huge pages where the kernel has
    transparent ones (``MADV_HUGEPAGE``; elsewhere plain pages, the same bytes).

    Huge pages: a block device takes a bounded number of memory segments per request (254 for this
    project's VM's virtio disk), one per physically contiguous run, so a direct transfer from 4 KiB
    pages is cut into requests of about 1 MiB, and from 2 MiB pages goes in requests of up to the
    device's 4 MiB: fewer, larger requests, so both cold direct reads and direct writes take less
    time. The first fill of a huge page zeroes 2 MiB at once, cheaper than faulting in its 4 KiB
    pages one by one (and paid once: the buffers are reused).

    Private, not shared: Python's default anonymous map is ``MAP_SHARED``, which the kernel backs
    with shmem, whose first touch of each page costs more, and a conversion fills a buffer of
    fold inputs per layer."""
    if not nbytes:
        return memoryview(bytearray())
    flags = mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS
    if nbytes < HUGE_PAGE or _MADV_HUGEPAGE is None:
        return memoryview(mmap.mmap(-1, nbytes, flags=flags))
    region = mmap.mmap(-1, nbytes + HUGE_PAGE, flags=flags)  # room to start at a huge-page boundary
    view = memoryview(region)
    start = -buffer_address(view) % HUGE_PAGE
    with contextlib.suppress(OSError):  # a kernel without transparent huge pages: plain pages
        region.madvise(_MADV_HUGEPAGE, start, nbytes - nbytes % HUGE_PAGE)
    return view[start : start + nbytes]


class BufferPool:
    """Page-aligned buffers (:func:`aligned_buffer`) handed out and given back, reused by size.

    Why: the first write to each page of a fresh buffer costs a page fault and the kernel's zeroing
    of the page, far more than refilling a buffer already faulted in, and a conversion fills a
    buffer of fold inputs per layer (82 MB for Kimi-K3) and read buffers per pass. A buffer comes
    back holding what it last held: every user overwrites what it reads. Memory: as many buffers
    as were out at once, until the pool goes.
    """

    def __init__(self) -> None:
        self._free: dict[int, list[memoryview]] = {}
        self._lock = threading.Lock()

    def get(self, nbytes: int) -> memoryview:
        with self._lock:
            free = self._free.get(nbytes)
            if free:
                return free.pop()
        return aligned_buffer(nbytes)

    def put(self, buffer: memoryview) -> None:
        with self._lock:
            self._free.setdefault(buffer.nbytes, []).append(buffer)


def _same_file(direct: int | None, fd: int) -> int | None:
    """``direct`` if it opens the file ``fd`` does, else None (plain writes through ``fd``): it is
    opened by name, and a name can be taken over by another file between two opens."""
    if direct is None:
        return None
    first, second = os.fstat(fd), os.fstat(direct)
    if (first.st_dev, first.st_ino) == (second.st_dev, second.st_ino):
        return direct
    os.close(direct)
    return None


def _align_down(offset: int) -> int:
    return offset - offset % ALIGN


def open_direct(path: os.PathLike[str] | str, flags: int) -> int | None:
    """A descriptor of ``path`` opened with ``flags | O_DIRECT``, or None where the platform or the
    filesystem has no direct I/O (other errors are raised)."""
    if not _O_DIRECT:
        return None
    try:
        return os.open(path, flags | _O_DIRECT)
    except OSError as exc:
        if refused(exc):
            return None
        raise


def direct_reader(path: os.PathLike[str] | str, size: int, cached: Callable[[], bool]) -> int | None:
    """A direct-I/O descriptor to stream ``path`` through, or None to read it the plain way: when
    it is small, its bytes are ``cached()`` already (asked only of files large enough), or its
    filesystem has no direct I/O."""
    if size < _DIRECT_MIN_BYTES or cached():
        return None
    return open_direct(path, os.O_RDONLY)


def refused(exc: OSError) -> bool:
    """Whether ``exc`` is a filesystem refusing a direct transfer (then do it the plain way)."""
    return exc.errno in _UNSUPPORTED


def _transfers(size: int, segments: list[tuple[int, int]]) -> Iterator[tuple[int, int, int]]:
    """``(first byte wanted, end of the bytes wanted, aligned file offset)`` of the ``DIRECT_CHUNK``
    reads covering ``segments`` (clipped to ``size``)."""
    for start, end in segments:
        end = min(end, size)
        base = _align_down(start)
        while base < end:
            yield max(start, base), end, base
            base += DIRECT_CHUNK


class DiskPriority:
    """Lets the transfers a conversion waits for go first: while a foreground transfer (a sidecar
    append) runs, background reads (passes over files no fold waits for) hold their next transfer.

    Why: the disk serves requests in turn, and a pass with read-ahead keeps two in flight against
    the append's one, so a few background passes take most of the disk from the sidecar writes
    while they run, and each layer's fold waits for the write before last. Background reads
    have slack until the end of the run: nothing waits for them but the manifest.
    """

    def __init__(self) -> None:
        self._foreground = 0
        self._changed = threading.Condition()

    @contextmanager
    def foreground(self) -> Iterator[None]:
        with self._changed:
            self._foreground += 1
        try:
            yield
        finally:
            with self._changed:
                self._foreground -= 1
                self._changed.notify_all()

    def background_turn(self) -> None:
        """Return once no foreground transfer runs (call before each background transfer)."""
        with self._changed:
            self._changed.wait_for(lambda: self._foreground == 0)


def read_direct(
    fd: int,
    size: int,
    segments: list[tuple[int, int]],
    before_transfer: Callable[[], None] | None = None,
    pool: BufferPool | None = None,
) -> Iterator[tuple[int, memoryview]]:
    """``(offset, bytes)`` of ``segments`` (clipped to ``size``) read through the direct descriptor
    ``fd`` in aligned ``DIRECT_CHUNK`` transfers, each handed out whole (what a transfer holds of
    a segment), valid until the next.

    The next transfer is in flight while the caller works on the current one: a direct read is
    synchronous, and the page cache's read-ahead that keeps the disk busy behind plain reads does
    not apply, so a reader thread (one per call, two buffers) keeps a read outstanding even while
    the caller's thread waits for a core. ``before_transfer`` runs in that thread before each read
    (a background pass's :meth:`DiskPriority.background_turn`). The buffers come from ``pool``
    when given, and go back to it."""
    free: queue.SimpleQueue[memoryview | None] = queue.SimpleQueue()
    done: queue.SimpleQueue[tuple[int, int, int, memoryview, int] | BaseException | None] = queue.SimpleQueue()
    pool = pool if pool is not None else BufferPool()
    buffers = [pool.get(DIRECT_CHUNK) for _ in range(_READ_BUFFERS)]
    for buffer in buffers:
        free.put(buffer)

    def reader() -> None:
        try:
            for first, end, base in _transfers(size, segments):
                buffer = free.get()
                if buffer is None:
                    return  # the caller stopped
                if before_transfer is not None:
                    before_transfer()
                count = os.preadv(fd, [buffer], base)
                done.put((first, end, base, buffer, count))
                if count < buffer.nbytes and base + count < end:
                    break  # the file ends before the segment does
            done.put(None)
        except BaseException as exc:  # raised in the caller's thread
            done.put(exc)

    thread = threading.Thread(target=reader, name="foldckpt-direct-read", daemon=True)
    thread.start()
    try:
        while (item := done.get()) is not None:
            if isinstance(item, BaseException):
                raise item
            first, end, base, buffer, count = item
            stop = min(base + count, end)
            if stop > first:
                yield first, buffer[first - base : stop - base]
            free.put(buffer)
    finally:
        free.put(None)
        thread.join()
        for buffer in buffers:
            pool.put(buffer)


class DurableAppender:
    """Appends to a file at a known offset, through direct writes where the filesystem has them,
    and makes what it appended durable on :meth:`sync` (fsync).

    A direct write covers whole aligned blocks, so the bytes of the last, partial block of what the
    file holds (``_tail``, under ``ALIGN`` bytes) are kept here and rewritten in front of the next
    write; the file is cut back to its exact size after each. ``offset`` is always the durable size
    of the file, ``end`` the size written. Bytes go through an aligned staging buffer, except the
    whole blocks of a page-aligned part that starts on a block boundary of the file: those are
    written straight from the caller's memory (a fold buffer, :func:`aligned_buffer`), which saves
    the copy of every fold byte into the staging buffer.
    ``staged`` counts the bytes copied.
    """

    def __init__(
        self, path: os.PathLike[str] | str, fd: int, offset: int, priority: DiskPriority | None = None
    ) -> None:
        """``fd``: the file open for reading and writing (plain); its first ``offset`` bytes are
        kept. With ``priority``, every write is a foreground transfer."""
        self.fd = fd
        self.priority = priority
        self.offset = self.end = offset
        self._direct = _same_file(open_direct(path, os.O_WRONLY | os.O_NOFOLLOW), fd)
        self._stage = aligned_buffer(DIRECT_CHUNK) if self._direct is not None else None
        self._tail = os.pread(fd, offset % ALIGN, _align_down(offset)) if self._direct is not None else b""
        self.staged = 0

    def truncate(self, offset: int) -> None:
        """Drop everything after ``offset`` (durably, at the next sync or now if nothing follows)."""
        os.ftruncate(self.fd, offset)
        self.offset = self.end = offset
        if self._direct is not None:
            self._tail = os.pread(self.fd, offset % ALIGN, _align_down(offset))

    def append(self, parts: list[memoryview]) -> int:
        """Write ``parts`` in order after ``end``, fsync, and return the new durable offset."""
        self.write(parts)
        return self.sync()

    def write(self, parts: list[memoryview]) -> None:
        """Write ``parts`` in order after ``end`` (durable at the next :meth:`sync`); the caller may
        reuse their memory once this returns."""
        if self.priority is None:
            self._write(parts)
            return
        with self.priority.foreground():
            self._write(parts)

    def sync(self) -> int:
        """Make everything written durable; returns the durable offset."""
        os.fsync(self.fd)
        self.offset = self.end
        return self.offset

    def _write(self, parts: list[memoryview]) -> None:
        if self._direct is not None:
            try:
                self._write_direct(parts)
            except OSError as exc:
                if not refused(exc):
                    raise
                self._fall_back()
                self._write_plain(parts)
        else:
            self._write_plain(parts)
        self.end += sum(part.nbytes for part in parts)

    def close(self) -> None:
        if self._direct is not None:
            os.close(self._direct)
            self._direct = None

    def _write_plain(self, parts: list[memoryview]) -> None:
        position = self.end
        for part in parts:
            view = part.cast("B")
            while view.nbytes:
                written = os.pwrite(self.fd, view, position)
                view, position = view[written:], position + written

    def _write_direct(self, parts: list[memoryview]) -> None:
        assert self._direct is not None and self._stage is not None
        stage, direct = self._stage, self._direct
        block = _align_down(self.end)  # the file offset stage[0] goes to
        filled = len(self._tail)
        stage[:filled] = self._tail
        for part in parts:
            view = part.cast("B")
            while view.nbytes:
                if filled == 0 and view.nbytes >= ALIGN and _page_aligned(view):  # block: where it goes
                    whole_blocks = _align_down(view.nbytes)
                    self._write_block(direct, view[:whole_blocks], block)
                    view, block = view[whole_blocks:], block + whole_blocks
                    continue
                take = min(view.nbytes, stage.nbytes - filled)
                self.staged += take
                stage[filled : filled + take] = view[:take]
                view, filled = view[take:], filled + take
                if filled == stage.nbytes:
                    self._write_block(direct, stage, block)
                    block, filled = block + stage.nbytes, 0
        end = block + filled
        whole = filled + (-filled % ALIGN)
        if whole:
            stage[filled:whole] = bytes(whole - filled)  # padding, cut off below
            self._write_block(direct, stage[:whole], block)
        os.ftruncate(self.fd, end)
        self._tail = bytes(stage[_align_down(filled) : filled])

    @staticmethod
    def _write_block(direct: int, data: memoryview, offset: int) -> None:
        while data.nbytes:
            written = os.pwrite(direct, data, offset)
            data, offset = data[written:], offset + written

    def _fall_back(self) -> None:
        """Forget direct I/O for this file: the filesystem took the flag but refuses the transfers."""
        self.close()
        os.ftruncate(self.fd, self.end)  # whatever a failed direct write may have left
        self._stage = None
        self._tail = b""
