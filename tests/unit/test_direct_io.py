"""Direct I/O (foldckpt.io.direct_io) on real files: the bytes read and written are exactly the plain
ones whatever the alignment, and the page cache really is bypassed where the filesystem allows."""

from __future__ import annotations

import hashlib
import os
import threading
import time
from pathlib import Path

import pytest
from blake3 import blake3

from foldckpt.io.direct_io import (
    ALIGN,
    DIRECT_CHUNK,
    HUGE_PAGE,
    BufferPool,
    DiskPriority,
    DurableAppender,
    aligned_buffer,
    buffer_address,
    direct_reader,
    open_direct,
    read_direct,
)
from foldckpt.io.files import HASH_BUFFER
from foldckpt.io.hashing import HashJob, RangeCheck, hash_job, in_page_cache
from tests.conftest import direct_io_supported, evict_from_page_cache


@pytest.fixture
def data_file(tmp_path: Path) -> tuple[Path, bytes]:
    if not direct_io_supported(tmp_path):
        pytest.skip("this filesystem has no O_DIRECT")
    data = os.urandom(3 * DIRECT_CHUNK + 12345)  # a partial last block
    path = tmp_path / "data.bin"
    path.write_bytes(data)
    return path, data


@pytest.mark.parametrize(
    "segments",
    [
        lambda n: [(0, n)],
        lambda n: [(5, 100), (DIRECT_CHUNK - 3, 2 * DIRECT_CHUNK + 7), (n - 10, n + 50)],  # unaligned, past the end
        lambda n: [(ALIGN, ALIGN), (n + 1, n + 10)],  # empty and wholly past the end
    ],
)
def test_direct_reads_yield_exactly_the_segments_bytes(data_file: tuple[Path, bytes], segments) -> None:
    path, data = data_file
    wanted = segments(len(data))
    fd = open_direct(path, os.O_RDONLY)
    assert fd is not None
    try:
        got = [(pos, bytes(chunk)) for pos, chunk in read_direct(fd, len(data), wanted)]
    finally:
        os.close(fd)
    for start, end in wanted:
        assert b"".join(chunk for pos, chunk in got if start <= pos < end) == data[start:end]
    assert all(len(chunk) <= DIRECT_CHUNK for _, chunk in got)
    assert [pos for pos, _ in got] == sorted(pos for pos, _ in got)


def test_direct_reads_stop_at_the_real_end_of_a_shorter_file(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    claimed = len(data) + 5 * DIRECT_CHUNK  # a header that promises more than the file holds
    fd = open_direct(path, os.O_RDONLY)
    assert fd is not None
    try:
        got = b"".join(bytes(chunk) for _, chunk in read_direct(fd, claimed, [(0, claimed)]))
    finally:
        os.close(fd)
    assert got == data


def test_abandoning_a_direct_read_ends_its_reader_thread(data_file: tuple[Path, bytes]) -> None:
    path, data = data_file
    fd = open_direct(path, os.O_RDONLY)
    assert fd is not None
    before = {t.ident for t in threading.enumerate()}
    reads = read_direct(fd, len(data), [(0, len(data))])
    next(reads)
    assert any(t.name == "foldckpt-direct-read" for t in threading.enumerate() if t.ident not in before)
    reads.close()
    os.close(fd)
    assert not any(t.name == "foldckpt-direct-read" for t in threading.enumerate() if t.ident not in before)


def test_direct_reads_take_their_buffers_from_the_pool_and_give_them_back(data_file: tuple[Path, bytes]) -> None:
    """One pool serves a run's passes: a second read reuses the first one's buffers, and a buffer
    that comes back holding other bytes is refilled, never read from."""
    path, data = data_file
    pool = BufferPool()
    fd = open_direct(path, os.O_RDONLY)
    assert fd is not None
    try:
        first = b"".join(bytes(chunk) for _, chunk in read_direct(fd, len(data), [(0, len(data))], pool=pool))
        kept = [pool.get(DIRECT_CHUNK), pool.get(DIRECT_CHUNK)]
        for buffer in kept:
            buffer[:] = b"\xff" * buffer.nbytes  # what a reused buffer may hold
            pool.put(buffer)
        again = [(pos, bytes(chunk)) for pos, chunk in read_direct(fd, len(data), [(7, len(data) - 3)], pool=pool)]
    finally:
        os.close(fd)
    assert first == data and b"".join(chunk for _, chunk in again) == data[7:-3]
    back = {id(pool.get(DIRECT_CHUNK)), id(pool.get(DIRECT_CHUNK))}
    assert back == {id(buffer) for buffer in kept}  # the same two buffers, given back again


def test_a_pool_reuses_a_buffer_only_for_its_own_size() -> None:
    pool = BufferPool()
    small, large = pool.get(ALIGN), pool.get(3 * ALIGN)
    assert (small.nbytes, large.nbytes) == (ALIGN, 3 * ALIGN)
    pool.put(large)
    assert pool.get(ALIGN) is not large and pool.get(3 * ALIGN) is large
    assert pool.get(0).nbytes == 0  # an empty tensor's buffer


def test_hashing_an_uncached_file_bypasses_the_page_cache_only_when_asked(data_file: tuple[Path, bytes]) -> None:
    """convert's passes and verify (``bypass_cache``) read an uncached file directly and leave it
    uncached; without it (the serving loader's head reads) it is read through the page cache, with
    prefetch; a cached file is always read plainly."""
    path, data = data_file
    job = HashJob(path.name, len(data), True)
    job.add(100, 200, RangeCheck("t", None, None))
    fd = os.open(path, os.O_RDONLY)
    try:
        for bypass_cache in (True, False):
            evict_from_page_cache(path)
            assert not in_page_cache(fd, len(data))
            whole, ranges = hash_job(path, job, bypass_cache=bypass_cache)
            assert in_page_cache(fd, len(data)) != bypass_cache
            assert whole == hashlib.sha256(data).hexdigest()
            assert ranges[(100, 200)] == blake3(data[100:200]).hexdigest()  # a tensor digest
        assert direct_reader(path, len(data), cached=lambda: True) is None  # cached files are read plainly
    finally:
        os.close(fd)


class _Copy:
    """A capture that copies every range it is offered."""

    def __init__(self) -> None:
        self.copies: dict[tuple[int, int], bytes] = {}

    def begin(self, bound: tuple[int, int]) -> memoryview:
        return memoryview(bytearray(bound[1] - bound[0]))

    def end(self, bound: tuple[int, int], digest: str, data: memoryview | None) -> None:
        assert data is not None
        self.copies[bound] = bytes(data)


@pytest.mark.parametrize("with_range", [False, True])
def test_a_direct_pass_feeds_whole_transfers_except_where_a_tensor_is_read(
    data_file: tuple[Path, bytes], with_range: bool
) -> None:
    """Each piece a pass feeds its digests costs a take of the GIL, which torch's import (convert's
    first seconds) holds: a direct pass feeds whole transfers, and cuts into ``HASH_BUFFER`` pieces
    only a transfer that overlaps a tensor's range, whose bytes several digests and a copy read
    while they are in the core's cache."""
    path, data = data_file
    bound = (DIRECT_CHUNK + 100, DIRECT_CHUNK + 200)  # inside the second transfer
    job = HashJob(path.name, len(data), True)
    if with_range:
        job.add(*bound, RangeCheck("t", None, None))
    fed: list[int] = []
    capture = _Copy()
    evict_from_page_cache(path)
    whole, ranges = hash_job(path, job, fed.append, capture, bypass_cache=True)
    second = [HASH_BUFFER] * (DIRECT_CHUNK // HASH_BUFFER) if with_range else [DIRECT_CHUNK]
    assert fed == [DIRECT_CHUNK, *second, DIRECT_CHUNK, len(data) - 3 * DIRECT_CHUNK]
    assert whole == hashlib.sha256(data).hexdigest()
    if with_range:
        assert ranges[bound] == blake3(data[bound[0] : bound[1]]).hexdigest()
        assert capture.copies == {bound: data[bound[0] : bound[1]]}


def _appended(path: Path, start: bytes, parts: list[bytes]) -> DurableAppender:
    path.write_bytes(start)
    fd = os.open(path, os.O_RDWR)
    appender = DurableAppender(path, fd, len(start))
    for part in parts:
        size = appender.append([memoryview(part)])
        assert size == path.stat().st_size  # exact after every append: no padding left behind
    return appender


@pytest.mark.parametrize("start", [0, 1, ALIGN - 1, ALIGN, 3 * ALIGN + 5])
def test_durable_appends_write_exactly_the_bytes_at_any_alignment(tmp_path: Path, start: int) -> None:
    path = tmp_path / "out.bin"
    head = os.urandom(start)
    parts = [os.urandom(n) for n in (1, ALIGN - 1, 7, DIRECT_CHUNK + 3, 2 * DIRECT_CHUNK, 0, 12345)]
    appender = _appended(path, head, parts)
    appender.close()
    os.close(appender.fd)
    assert path.read_bytes() == head + b"".join(parts)


def test_a_truncated_appender_resumes_over_the_cut_with_the_kept_tail(tmp_path: Path) -> None:
    path = tmp_path / "out.bin"
    first, second = os.urandom(ALIGN + 100), os.urandom(3 * ALIGN)
    appender = _appended(path, b"", [first, second])
    appender.truncate(ALIGN + 50)  # inside a block: the next append must keep bytes [ALIGN, ALIGN + 50)
    appender.append([memoryview(b"x" * 10)])
    appender.close()
    os.close(appender.fd)
    assert path.read_bytes() == first[: ALIGN + 50] + b"x" * 10
    # a fresh appender at an unaligned offset (a resumed run) reads its tail back from the file
    fd = os.open(path, os.O_RDWR)
    resumed = DurableAppender(path, fd, ALIGN + 55)
    os.ftruncate(fd, ALIGN + 55)
    resumed.append([memoryview(b"yz")])
    resumed.close()
    os.close(fd)
    assert path.read_bytes() == first[: ALIGN + 50] + b"x" * 5 + b"yz"


def test_durable_appends_bypass_the_page_cache_where_supported(tmp_path: Path) -> None:
    if not direct_io_supported(tmp_path):
        pytest.skip("this filesystem has no O_DIRECT")
    path = tmp_path / "out.bin"
    appender = _appended(path, b"", [os.urandom(4 * DIRECT_CHUNK)])
    assert not in_page_cache(appender.fd, path.stat().st_size)
    appender.close()
    os.close(appender.fd)


@pytest.mark.parametrize(
    ("start", "size", "staged"),
    [
        (0, 3 * ALIGN, 0),  # whole blocks from page-aligned memory at a block boundary: written as they are
        (2 * ALIGN, 3 * ALIGN + 100, 100),  # the partial last block is staged
        (5, 3 * ALIGN, 3 * ALIGN),  # behind a partial block of the file: every byte goes through the stage
    ],
)
def test_page_aligned_parts_are_written_without_a_staging_copy(
    tmp_path: Path, start: int, size: int, staged: int
) -> None:
    if not direct_io_supported(tmp_path):
        pytest.skip("this filesystem has no O_DIRECT")
    path = tmp_path / "out.bin"
    head = os.urandom(start)
    path.write_bytes(head)
    fd = os.open(path, os.O_RDWR)
    appender = DurableAppender(path, fd, start)
    part = aligned_buffer(size)
    part[:] = os.urandom(size)
    before = appender.staged
    appender.append([part])
    assert appender.staged - before == staged
    appender.append([memoryview(b"xyz")])  # plain memory: staged
    assert appender.staged - before == staged + 3
    appender.close()
    os.close(fd)
    assert path.read_bytes() == head + bytes(part) + b"xyz"


def test_appends_with_a_priority_are_foreground_transfers(tmp_path: Path) -> None:
    """A background read waiting for its turn during an append goes only once the append is durable."""
    priority = DiskPriority()
    path = tmp_path / "out.bin"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDWR)
    appender = DurableAppender(path, fd, 0, priority)
    data = memoryview(os.urandom(1 << 20) * 256)
    ended: list[int] = []
    size_at_turn: list[int] = []
    writer = threading.Thread(target=lambda: ended.append(appender.append([data])))
    with priority.foreground():  # holds the waiter until the append has begun
        writer.start()
        waiter = threading.Thread(target=lambda: (priority.background_turn(), size_at_turn.append(path.stat().st_size)))
        waiter.start()
        deadline = time.monotonic() + 10
        while priority._foreground < 2 and not ended and time.monotonic() < deadline:
            time.sleep(0.001)
        assert priority._foreground == 2, "the append did not run as a foreground transfer"
    writer.join()
    waiter.join()
    appender.close()
    os.close(fd)
    assert size_at_turn == ended == [data.nbytes]  # the waiter's turn came after the whole append


def _rss_shmem_kib() -> int:
    with open("/proc/self/status") as status:
        return next(int(line.split()[1]) for line in status if line.startswith("RssShmem:"))


def test_aligned_buffers_are_page_aligned_private_memory() -> None:
    """Touching a fresh buffer adds no shmem pages: it is private anonymous memory, whose first
    touch costs about 40% less than the shared kind Python's mmap makes by default."""
    before = _rss_shmem_kib()
    buffer = aligned_buffer(64 << 20)
    buffer[::4096] = b"\x01" * len(range(0, 64 << 20, 4096))  # one byte per page: every page is touched
    assert _rss_shmem_kib() - before < 4096  # 64 MiB shared would add 65536 KiB
    assert buffer_address(buffer) % ALIGN == 0


def _vm_flags(address: int) -> set[str]:
    """The VmFlags of this process's mapping that holds ``address`` (``hg``: advised huge pages)."""
    region = None
    with open("/proc/self/smaps") as smaps:
        for line in smaps:
            head = line.split()[0]
            if "-" in head and all(c in "0123456789abcdef-" for c in head):
                start, end = (int(part, 16) for part in head.split("-"))
                region = start <= address < end
            elif region and line.startswith("VmFlags:"):
                return set(line.split()[1:])
    raise AssertionError(f"no mapping holds {address:#x}")


@pytest.mark.skipif(not Path("/sys/kernel/mm/transparent_hugepage").exists(), reason="no transparent huge pages")
def test_buffers_of_a_huge_page_or_more_start_on_one_and_ask_for_huge_pages() -> None:
    """A direct transfer from 4 KiB pages is cut into requests of at most the device's segment count
    of pages (254 on this project's VM: about 1 MiB), from 2 MiB pages it is not (reads 2.5x as
    fast there); a small buffer stays on plain pages."""
    large, small = aligned_buffer(3 * HUGE_PAGE + ALIGN), aligned_buffer(HUGE_PAGE - ALIGN)
    address = buffer_address(large)
    assert address % HUGE_PAGE == 0 and large.nbytes == 3 * HUGE_PAGE + ALIGN
    assert "hg" in _vm_flags(address)
    assert "hg" not in _vm_flags(buffer_address(small))


def test_writes_are_durable_only_once_synced_and_keep_their_tails_between_writes(tmp_path: Path) -> None:
    """A layer's fold is written chunk by chunk and fsynced once whole: ``offset`` (what the journal
    records) must stay at the last sync while ``end`` follows the writes, and unaligned writes in a
    row must carry the partial block from one to the next."""
    path = tmp_path / "out.bin"
    path.write_bytes(b"")
    fd = os.open(path, os.O_RDWR)
    appender = DurableAppender(path, fd, 0)
    parts = [os.urandom(n) for n in (ALIGN + 7, 3, 2 * ALIGN - 10, DIRECT_CHUNK + 1)]
    for number, part in enumerate(parts):
        appender.write([memoryview(part)])
        assert appender.offset == 0 and appender.end == sum(map(len, parts[: number + 1]))
    assert appender.sync() == appender.end == path.stat().st_size
    appender.close()
    os.close(fd)
    assert path.read_bytes() == b"".join(parts)
