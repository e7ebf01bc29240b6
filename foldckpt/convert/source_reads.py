"""Every placed source file hashed once, in parallel, handing the fold inputs it passes to the fold.

Why: at Kimi-K3 scale a conversion reads about 1.4 TB of sources (hashed for the manifest) and
writes a few GB of folds, so it should take the time that one read of the sources and one write of
the folds take. The fold's inputs (q_b_proj, kv_b_proj and their fp8 scales) lie inside those
files: the pass that hashes a file copies them out as it goes by, and digests each of them (the
manifest's per-tensor provenance, BLAKE3 beside the file's sha256) from the same bytes, so no
source byte is read twice and the fold of a layer starts as soon as the pass has gone past its
inputs, long before the file's end.

Memory stays a few layers' inputs whatever the layout, in buffers reused from layer to layer
(:class:`~foldckpt.io.direct_io.BufferPool`; a CPU fold is done with a layer's inputs once it takes
the next layer's, a GPU fold once it has copied them to the GPU): a pass over a file that feeds
the fold starts only once the fold is within ``LOOKAHEAD_LAYERS`` of the first layer it feeds (it
waits before it has copied anything, and files are started in the order of the layers they feed,
so the file the fold needs next is never queued behind a waiting one); files that feed no layer
are hashed meanwhile by threads of their own, at a lower priority (the fold waits for no byte of
them).
Copies are also bounded by a byte budget, and a pass never waits for the fold once it has started:
where a copy would exceed the budget it is not made, and the fold reads that tensor itself
(``IOCounters.reread`` counts it).

On a resumed run, the folds journaled by the earlier run record the digest of each input they were
made from; the pass checks those digests too, so a source that changed between the two runs is
refused, naming the file and the tensor.
"""

from __future__ import annotations

import contextlib
import os
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import Executor, Future
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from foldckpt.errors import FoldckptError
from foldckpt.format.manifest import FileRecord
from foldckpt.io.direct_io import BufferPool, DiskPriority
from foldckpt.io.hashing import HashJob, RangeCheck, hash_job, tensor_digest
from foldckpt.io.safetensors_format import TensorInfo, read_tensor_bytes

# Niceness of the passes over files that feed no layer (see _yield_to_the_fold); a thread
# cannot raise it back.
_BACKGROUND_NICENESS = 10
# How many layers ahead of the fold a pass over a file that feeds it may start.
LOOKAHEAD_LAYERS = 1


class _Abandoned(Exception):
    """Raised through a pass's progress callback when the run stops (an error or a signal)."""


@dataclass
class _Slot:
    """One fold input in a file being hashed: filled (or given up) once the pass went past it."""

    ready: threading.Event = field(default_factory=threading.Event)
    data: memoryview | None = None
    digest: str | None = None
    error: BaseException | None = None


@dataclass
class IOCounters:
    """Bytes moved by one conversion and the busy time of each stage (summed over threads), for
    the benchmark and ``--json``: ``read`` counts every byte read from a source (``reread`` the
    fold inputs read a second time), ``hashed`` every byte fed to a digest (a fold input's bytes
    twice: its file's sha256 and its own BLAKE3), ``staged`` every byte
    the sidecar writer copied into its direct-I/O staging buffer (page-aligned folds are not)."""

    read: int = 0
    hashed: int = 0
    reread: int = 0
    written: int = 0
    copied: int = 0
    staged: int = 0
    seconds: dict[str, float] = field(default_factory=dict)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False, compare=False)

    def add(
        self, read: int = 0, hashed: int = 0, reread: int = 0, written: int = 0, copied: int = 0, staged: int = 0
    ) -> None:
        with self.lock:
            self.read += read
            self.hashed += hashed
            self.reread += reread
            self.written += written
            self.copied += copied
            self.staged += staged

    @contextmanager
    def timed(self, stage: str) -> Iterator[None]:
        started = time.perf_counter()
        try:
            yield
        finally:
            with self.lock:
                self.seconds[stage] = self.seconds.get(stage, 0.0) + time.perf_counter() - started

    def to_dict(self) -> dict[str, Any]:
        return {
            "bytes_read": self.read,
            "bytes_reread": self.reread,
            "bytes_hashed": self.hashed,
            "bytes_written": self.written,
            "bytes_copied": self.copied,
            "bytes_staged": self.staged,
            "stage_busy_s": {stage: round(s, 3) for stage, s in sorted(self.seconds.items())},
        }


class SourceReads:
    """The hashing passes of one run and the fold inputs they hand over.

    ``files``: name -> size of the source files to hash in this run, in the order to start them;
    ``inputs``: (file, tensor) -> header info of every fold input in those files; ``wanted``: the
    inputs still to be folded in this run -> the position (in fold order) of the layer that takes
    them (copied when the budget allows; default budget: ``LOOKAHEAD_LAYERS + 2`` layers' inputs, room for
    the layer being folded, the ones ahead and a file that interleaves layers);
    ``recorded``: (file, tensor) -> digest an earlier run's fold recorded (checked); ``priority``:
    the run's, whose foreground transfers the passes over files that feed no layer wait for;
    ``fold_releases``: the fold calls :meth:`release` once it is done with a layer's inputs (a GPU
    fold: once it has them on the GPU), instead of taking the next layer's first input saying so.
    ``on_hashed(name, record)`` runs in the pass's thread when a file's digest is known.
    """

    def __init__(
        self,
        out_dir: Path,
        files: dict[str, int],
        inputs: dict[tuple[str, str], TensorInfo],
        wanted: dict[tuple[str, str], int],
        recorded: dict[tuple[str, str], str],
        on_hashed: Callable[[str, FileRecord], None],
        progress: Callable[[int], object],
        counters: IOCounters,
        budget: int | None = None,
        priority: DiskPriority | None = None,
        fold_releases: bool = False,
    ) -> None:
        self.out_dir = out_dir
        self.priority = priority
        self.fold_releases = fold_releases
        self.files = files
        self.inputs = inputs
        self.wanted = wanted
        self.recorded = recorded
        self.on_hashed = on_hashed
        self.progress = progress
        self.counters = counters
        per_layer: dict[int, int] = {}
        self.first_use: dict[str, int] = {}
        for (file, name), position in wanted.items():
            per_layer[position] = per_layer.get(position, 0) + inputs[(file, name)].nbytes
            if file in files:
                self.first_use[file] = min(position, self.first_use.get(file, position))
        self.budget = (LOOKAHEAD_LAYERS + 2) * max(per_layer.values(), default=0) if budget is None else budget
        self._held = 0
        self._lock = threading.Lock()
        self._stop = threading.Event()
        # The layer the fold is at (fold order), as the passes see it: a CPU fold is at its first
        # layer from the start; a fold that releases its inputs is past a layer once it did so.
        self._position = -1 if fold_releases else 0
        self._taking = 0  # the layer whose inputs the fold takes
        self._moved = threading.Condition()
        self._slots = {key: _Slot() for key in inputs if key[0] in files and key in wanted}
        # The passes' read buffers and the copied inputs; the inputs handed over for the fold's layer.
        self.pool = BufferPool()
        self._lent: list[memoryview] = []
        self._futures: list[Future[None]] = []

    def start(self, feeding: Executor, others: Executor) -> None:
        """Start every pass: files that feed the fold in ``feeding``, the others in ``others``."""
        for name in self.files:
            pool = feeding if name in self.first_use else others
            self._futures.append(pool.submit(self._pass, name))

    def stop(self) -> None:
        """Abandon the passes still running (their files stay unhashed in the journal)."""
        self._stop.set()
        with self._moved:
            self._moved.notify_all()

    def wait(self) -> None:
        """Wait for every pass; re-raise the first failure (in start order)."""
        for future in self._futures:
            future.result()

    # -- the fold's side ------------------------------------------------------------------------

    def take(self, file: str, info: TensorInfo) -> tuple[bytearray | memoryview, str]:
        """The bytes of one fold input and their tensor digest: handed over by the pass over ``file`` (once
        it went past them), or read here when that pass did not copy them or ``file`` is not hashed
        in this run. The fold takes its layers in order, one at a time: taking a layer's first input
        tells that the fold is done with the inputs of the layers before it (:meth:`release`),
        unless the fold releases them itself (``fold_releases``). The bytes handed over stay valid
        until they are released."""
        position = self.wanted.get((file, info.name))
        if position is not None and position > self._taking:
            self._taking = position
            if not self.fold_releases:
                self.release()
        slot = self._slots.get((file, info.name))
        if slot is not None:
            with self.counters.timed("fold_waiting_for_inputs"):
                slot.ready.wait()
            del self._slots[(file, info.name)]
            if slot.error is not None:
                raise slot.error
            if slot.data is not None:
                with self._lock:
                    self._held -= slot.data.nbytes
                self._lent.append(slot.data)
                return slot.data, str(slot.digest)
        data = read_tensor_bytes(self.out_dir / file, info)
        self.counters.add(read=len(data), hashed=len(data), reread=len(data) if slot is not None else 0)
        return data, tensor_digest(data)

    def release(self) -> None:
        """The fold is done with the inputs it has taken: their buffers go back to the pool, and the
        passes over the files that feed the layers after it (within ``LOOKAHEAD_LAYERS``) may start.

        Why a GPU fold calls this itself, as soon as its inputs are on the GPU: then the passes that
        this lets start reuse those buffers. When taking the next layer released them, those passes
        had started before and made new ones, and before its first layer the passes read two
        layers ahead, not one: a GPU conversion held two layers' inputs more than it needs (a
        Kimi-K3 shard holds one layer's kv_b_proj and the next one's q_b_proj)."""
        for buffer in self._lent:
            self.pool.put(buffer)
        self._lent.clear()
        with self._moved:
            self._position = self._taking
            self._moved.notify_all()

    # -- the passes ------------------------------------------------------------------------------

    def _pass(self, name: str) -> None:
        due = self.first_use.get(name)
        if due is None:
            _yield_to_the_fold()
        else:
            with self._moved:
                self._moved.wait_for(lambda: self._stop.is_set() or self._position >= due - LOOKAHEAD_LAYERS)
        if self._stop.is_set():
            return
        size = self.files[name]
        job = HashJob(name, size, True)
        in_file = {(info.start, info.end): key for key, info in self.inputs.items() if key[0] == name}
        for (start, end), key in in_file.items():
            job.add(start, end, RangeCheck(key[1], None, self.recorded.get(key)))
        capture = _Capture(self, in_file)

        def progress(count: int) -> None:
            if self._stop.is_set():
                raise _Abandoned
            self.counters.add(read=count, hashed=count)
            self.progress(count)

        try:
            with self.counters.timed("source_passes"):
                background = self.priority.background_turn if self.priority and due is None else None
                whole, ranges = hash_job(
                    self.out_dir / name, job, progress, capture, background, bypass_cache=True, pool=self.pool
                )
        except _Abandoned:
            capture.give_up(None)
            return
        except BaseException as exc:
            capture.give_up(exc)
            raise
        capture.give_up(None)  # a file shorter than its header said: the fold's own read names it
        self.counters.add(hashed=sum(end - start for start, end in in_file))
        for (start, end), checks in job.ranges.items():
            for check in checks:
                if check.expected is not None and ranges[(start, end)] != check.expected:
                    raise FoldckptError.at(
                        self.out_dir / name,
                        f"tensor '{check.tensor}' changed since an earlier run of this "
                        "conversion folded it (its digest differs from the journaled one); refusing to mix "
                        "results: restore the file, or pass --restart to start over",
                        check.tensor,
                    )
        self.on_hashed(name, FileRecord(size, str(whole)))


def _yield_to_the_fold() -> None:
    """Lower the scheduling priority of this thread, a pass over a file that feeds no layer (Linux:
    per thread; the direct-read thread it starts inherits it): such a pass has slack until the end
    of the run, and the fold is the critical path, so on a machine with few cores it should take
    the cycles the fold leaves, not slow every layer down. A pass that feeds the fold keeps its
    priority: the fold waits for what it reads, and niced, such a pass is slowed by the fold's own
    GEMM until the fold waits for it (what ``stage_busy_s.fold_waiting_for_inputs`` of each record
    in ``docs/bench/convert*.json`` counts). (``SCHED_IDLE`` for these passes would leave them to
    the end of the run, after the last fold, and yield to every other process of a shared
    machine.)"""
    if hasattr(os, "setpriority") and hasattr(threading, "get_native_id"):
        with contextlib.suppress(OSError):
            os.setpriority(os.PRIO_PROCESS, threading.get_native_id(), _BACKGROUND_NICENESS)


class _Capture:
    """The :class:`~foldckpt.io.hashing.Capture` of one pass: copies the wanted inputs within budget."""

    def __init__(self, reads: SourceReads, by_bound: dict[tuple[int, int], tuple[str, str]]) -> None:
        self.reads = reads
        self.by_bound = by_bound
        self.reserved: dict[tuple[int, int], int] = {}

    def begin(self, bound: tuple[int, int]) -> memoryview | None:
        reads, key = self.reads, self.by_bound[bound]
        if key not in reads._slots:
            return None
        with reads._lock:
            if reads._held + (bound[1] - bound[0]) > reads.budget:
                return None
            reads._held += bound[1] - bound[0]
        self.reserved[bound] = bound[1] - bound[0]
        return self.reads.pool.get(bound[1] - bound[0])

    def end(self, bound: tuple[int, int], digest: str, data: memoryview | None) -> None:
        slot = self.reads._slots.get(self.by_bound[bound])
        if slot is None or slot.ready.is_set():
            return
        self.reserved.pop(bound, None)  # from now on the fold's to release (take)
        slot.data, slot.digest = data, digest
        slot.ready.set()

    def give_up(self, error: BaseException | None) -> None:
        """Release every slot of this file not handed over yet (the fold then reads it, or raises)."""
        with self.reads._lock:
            self.reads._held -= sum(self.reserved.values())
        self.reserved.clear()
        for key in self.by_bound.values():
            slot = self.reads._slots.get(key)
            if slot is not None and not slot.ready.is_set():
                slot.error = error
                slot.ready.set()
