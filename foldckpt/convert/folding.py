"""Hash every placed source once, fold each layer from the bytes the hashing passes hand over, and
write the folds to their sidecar shards, journaling each finished layer.

One direction, one layer at a time: peak memory is a few layers' inputs and the fold ring, whatever
the size of the model.
"""

from __future__ import annotations

import gc
import os
from collections import deque
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future, wait
from contextlib import contextmanager
from pathlib import Path
from typing import TYPE_CHECKING, Any

from foldckpt.console.progress import progress_bar
from foldckpt.console.signals import import_torch
from foldckpt.convert.journal import Journal, ShardProgress
from foldckpt.convert.plan import (
    SIDECAR_METADATA,
    ConversionPlan,
    LayerPlan,
    ShardPlan,
)
from foldckpt.convert.source_reads import IOCounters, SourceReads
from foldckpt.defaults import (
    require_fold_device,
)
from foldckpt.format.consistency import heads_intact
from foldckpt.format.manifest import (
    FileRecord,
    FoldTensor,
)
from foldckpt.format.sidecar import ShardWriter
from foldckpt.io.direct_io import DiskPriority
from foldckpt.io.files import (
    file_size,
    fingerprint,
    worker_pool,
)
from foldckpt.io.hashing import default_workers
from foldckpt.options import ConvertOptions

if TYPE_CHECKING:
    from foldckpt.convert.layer import Fetch, FoldRing


def _fold_order(plan: ConversionPlan, journal: Journal) -> list[LayerPlan]:
    """The layers still to fold, in sidecar order."""
    return [
        layer
        for shard in plan.shards
        if not (journal.shard(shard.name).done)
        for layer in shard.layers
        if layer.output.name not in journal.shard(shard.name).tensors
    ]


def _source_reads(
    plan: ConversionPlan,
    out_dir: Path,
    journal: Journal,
    todo: list[LayerPlan],
    counters: IOCounters,
    bar: Any,
    priority: DiskPriority,
    device: str,
) -> SourceReads:
    """The hashing passes of this run: every placed file not hashed yet, those feeding the first
    layers to fold first (then the largest), so that the fold waits as little as possible; a fold
    on ``device`` other than the CPU releases its inputs itself, once they are there."""
    inputs = {(file, info.name): info for layer in plan.layers for file, info in layer.input_tensors()}
    wanted = {
        (file, info.name): position for position, layer in enumerate(todo) for file, info in layer.input_tensors()
    }
    recorded = {
        (source["file"], source["name"]): source["blake3"]
        for progress in journal.shards.values()
        for record in progress.tensors.values()
        for source in record["sources"]
    }
    first_use: dict[str, int] = {}
    for position, layer in enumerate(todo):
        for file, _ in layer.input_tensors():
            first_use.setdefault(file, position)
    sizes = {n: file_size(out_dir / n) for n in journal.placed if n not in journal.source_hashes}
    order = sorted(sizes, key=lambda n: (first_use.get(n, len(todo)), -sizes[n]))

    def on_hashed(name: str, record: FileRecord) -> None:
        with journal.lock:
            journal.source_hashes[name] = record.to_dict()
            journal.save()

    return SourceReads(
        out_dir,
        {n: sizes[n] for n in order},
        inputs,
        wanted,
        recorded,
        on_hashed,
        bar.update,
        counters,
        priority=priority,
        fold_releases=device != "cpu",
    )


def hash_and_fold(
    plan: ConversionPlan, out_dir: Path, journal: Journal, options: ConvertOptions, counters: IOCounters, device: str
) -> list[str]:
    """Hash every placed source not hashed yet and fold every layer not folded yet, overlapped:
    hashing passes (threads; hashlib frees the GIL) hand the fold its inputs as they go by, the fold
    runs on the cores torch has (or a GPU), the previous layer's write and fsync run in a thread of
    their own. Returns the folds (tensor names) made in this run."""
    todo = _fold_order(plan, journal)
    cores = os.cpu_count() or 1
    hashers = options.workers or default_workers()
    source_bytes = sum(file_size(out_dir / n) for n in journal.placed if n not in journal.source_hashes)
    folded: list[str] = []
    with (
        progress_bar(len(plan.layers), "folding", "layer", options.progress, position=1) as fold_bar,
        progress_bar(source_bytes, "hashing sources", "B", options.progress, position=0) as hash_bar,  # closes first
        worker_pool(max(1, hashers // 2)) as feeding_pool,
        worker_pool(max(1, hashers - hashers // 2)) as other_pool,
        worker_pool(cores) as leaf_pool,
        worker_pool(1) as write_pool,
    ):
        # the sidecar appends go before the passes over files that feed no layer (DiskPriority)
        priority = DiskPriority()
        reads = _source_reads(plan, out_dir, journal, todo, counters, hash_bar, priority, device)
        reads.start(feeding_pool, other_pool)
        try:
            with _collector_paused():
                import_torch()  # only once there is something to fold
                from foldckpt.convert.layer import FoldRing

                require_fold_device(device, "nothing was folded: rerun with --device cpu or auto, and --restart")
                ring = FoldRing(waiting=lambda: counters.timed("fold_waiting_for_writes"))
                for shard in plan.shards:
                    if journal.shard(shard.name).done and (out_dir / shard.name).exists():
                        fold_bar.update(len(shard.layers))
                        continue
                    folded += _write_shard(
                        plan,
                        shard,
                        out_dir,
                        journal,
                        options,
                        (reads.take, reads.release, device, ring),
                        counters,
                        leaf_pool,
                        write_pool,
                        fold_bar,
                        priority,
                    )
                reads.wait()
        except BaseException:
            reads.stop()
            raise
    return folded


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off (if it was on) while torch is imported and the layers
    are folded, the critical path of a conversion. The import makes hundreds of thousands of
    objects and no garbage, so its own collections are pure cost, and afterwards every collection
    that reaches an older generation walks them all, in the fold's thread, holding the GIL that the
    hashing threads need between chunks. The folds leave little cyclic garbage, collected once the
    collector is back on, after the last pass: the first collection then walks torch's objects
    once, with no other thread left to stall."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _write_shard(
    plan: ConversionPlan,
    shard: ShardPlan,
    out_dir: Path,
    journal: Journal,
    options: ConvertOptions,
    source: tuple[Fetch, Callable[[], None], str, FoldRing],
    counters: IOCounters,
    leaf_pool: Executor,
    write_pool: Executor,
    bar: Any,
    priority: DiskPriority,
) -> list[str]:
    """Write (or finish) one sidecar shard; returns the folds (tensor names) made in this run. Each
    head chunk of a layer's fold is written while the next is folded, and each layer is fsynced and
    journaled once whole and checked, while the next layer is folded."""
    from foldckpt.convert.layer import (
        fold_from_source,  # torch: only once there is something to fold
    )

    fetch, release, device, ring = source
    progress = journal.shard(shard.name)
    writer = ShardWriter(out_dir / shard.name, shard.specs, SIDECAR_METADATA, progress.offset, priority)
    if progress.offset == 0:
        counters.add(written=writer.offset)
    if (
        writer.offset != progress.offset
        or not _journal_matches_layout(writer, progress, shard)
        or not _prefix_intact(writer, journal.folds(shard.name, plan.geometry.num_heads), plan.geometry.num_heads)
    ):
        with journal.lock:  # nothing usable on disk: start the shard over
            progress.tensors.clear()
            progress.offset = writer.restart()
    folded: list[str] = []

    def write(buffer: memoryview) -> None:
        with counters.timed("write"):
            writer.write([buffer])
        counters.add(written=buffer.nbytes)

    writes = _SidecarWrites(write_pool, ring, write)

    def emit(buffer: memoryview) -> None:
        counters.add(hashed=buffer.nbytes)  # the head leaves: each fold byte once
        writes.chunk(buffer)

    def journal_layer(record: FoldTensor, layer_index: int) -> None:
        with counters.timed("write"):
            offset = writer.sync()
        with journal.lock:
            progress.offset = offset
            progress.tensors[record.name] = record.to_dict()
            journal.save()
        bar.set_postfix(layer=layer_index, relerr=f"{record.rel_fro_error:.1e}")
        bar.update(1)

    try:
        for layer in shard.layers:
            if layer.output.name in progress.tensors:
                bar.update(1)
                continue
            with counters.timed("fold"):
                record = fold_from_source(
                    plan, layer, shard.name, leaf_pool, ring, emit, options.allow_nonfinite, fetch, device, release
                )
            writes.then(journal_layer, record, layer.layer.index)
            folded.append(record.name)
        writes.wait()
        # Journal the finished shard before renaming it: a kill in between then costs a recheck
        # and a rename on resume, where the reverse order would redo the whole shard.
        with journal.lock:
            progress.done = writer.finish().to_dict()
            journal.save()
        writer.commit()
        with journal.lock:
            journal.fingerprints[shard.name] = {"out": fingerprint(out_dir / shard.name)}
            journal.save()
    finally:
        writes.stop()
        writer.close()
        counters.add(staged=writer.staged)
    return folded


class _SidecarWrites:
    """The write thread's work for one shard, in order: each fold chunk written as the fold hands it
    over (its ring buffer given back once written), then each layer made durable and journaled.
    The first failure skips the rest (their buffers still go back) and is raised in the fold's
    thread at its next hand-over."""

    def __init__(self, pool: Executor, ring: FoldRing, write: Callable[[memoryview], None]) -> None:
        """``write``: writes one chunk to the shard (in the write thread)."""
        self._pool = pool
        self._ring = ring
        self._write = write
        self._pending: deque[Future[None]] = deque()
        self._failure: BaseException | None = None
        self._stopped = False

    def chunk(self, buffer: memoryview) -> None:
        """Write ``buffer`` (a chunk from the ring) after what was handed over before."""

        def run() -> None:
            try:
                self._run(self._write, buffer)
            finally:
                self._ring.give_back(buffer)

        try:
            self._submit(run)
        except BaseException:
            self._ring.give_back(buffer)
            raise

    def then(self, work: Callable[..., None], *args: Any) -> None:
        """Run ``work(*args)`` once everything handed over before is written."""
        self._submit(lambda: self._run(work, *args))

    def wait(self) -> None:
        """Wait for everything handed over; raise the first failure."""
        while self._pending:
            self._pending.popleft().result()
        self._raise_failure()

    def stop(self) -> None:
        """Skip what was not started yet and wait for what was (the writer closes next)."""
        self._stopped = True
        wait(self._pending)
        self._pending.clear()

    def _submit(self, run: Callable[[], None]) -> None:
        self._raise_failure()
        while self._pending and self._pending[0].done():
            self._pending.popleft()
        self._pending.append(self._pool.submit(run))

    def _run(self, work: Callable[..., None], *args: Any) -> None:
        if self._failure is not None or self._stopped:
            return
        try:
            work(*args)
        except BaseException as exc:
            self._failure = exc

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure


def _journal_matches_layout(writer: ShardWriter, progress: ShardProgress, shard: ShardPlan) -> bool:
    """Whether the journal's folds of a resumed shard are its first layers and its offset is where
    they end. An edited journal said otherwise (one fold dropped, the offset kept): the resumed run
    appended after the offset and every rerun ended in "wrote N of M bytes", an internal error."""
    kept = len(progress.tensors)
    if set(progress.tensors) != {layer.output.name for layer in shard.layers[:kept]}:
        return False
    end = writer.layout[shard.layers[kept - 1].outputs[-1].name].end if kept else writer.header_size
    return progress.offset == end


def _prefix_intact(writer: ShardWriter, kept: list[FoldTensor], heads: int) -> bool:
    """Whether the folds a resumed shard keeps still hold their journaled head digests (the
    temporary file is ours, but a crash or a hand can damage it between two runs)."""
    return not kept or heads_intact(writer.tmp, writer.layout, kept, heads)
