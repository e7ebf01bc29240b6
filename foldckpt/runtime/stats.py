"""Per-worker routing counters, mirrored into a JSON file named by ``FOLDCKPT_STATS_FILE``.

Why a file kept up to date rather than written at exit: under the OpenAI server the worker
process is force-killed at shutdown, so anything written "at the end" never lands. Why not a
write per step: the attention op runs on the hot path. So recording only bumps counters under a
lock and wakes a daemon thread; that thread writes the file (tmp + rename, so readers never see a
partial file) and then sleeps ``FLUSH_INTERVAL_S``. Writes are therefore at most one per interval,
and the last counts land at most one interval after the last step.

With several workers (tensor parallel) each writes its own file: rank r > 0 of a world larger
than one inserts ``.rank<r>`` before the suffix (``stats.json`` -> ``stats.rank1.json``); rank 0
writes the path as given. A normal exit flushes pending counts at once (``atexit``).
"""

from __future__ import annotations

import atexit
import json
import os
import threading
import time
from pathlib import Path

STATS_ENV = "FOLDCKPT_STATS_FILE"
FLUSH_INTERVAL_S = 0.05


class StatsFile:
    """Counters of one worker and the thread that mirrors them to ``path``."""

    def __init__(self, path: Path) -> None:
        self.path = path
        self._tmp = path.with_name(f".{path.name}.{os.getpid()}.tmp")
        self._counts = {
            "folded_decode_tokens": 0,
            "unfolded_decode_tokens": 0,
            "prefill_tokens": 0,
            "mixed_batches": 0,
            "layers_with_fold": 0,
            "graph_captures_folded": 0,
            "graph_captures_unfolded": 0,
        }
        self._layers: set[str] = set()
        self._lock = threading.Lock()
        self._write_lock = threading.Lock()
        self._dirty = threading.Event()
        self._dirty.set()
        threading.Thread(target=self._flush_forever, name="foldckpt-stats", daemon=True).start()
        atexit.register(self._flush_pending)

    def record_step(self, folded: int, unfolded: int, prefill: int) -> None:
        """Count one forward step: decode rows that took the fold, decode rows that did not,
        and prefill rows (always q_b_proj). A step with folded and prefill rows is a mixed batch
        that the pre-route split."""
        with self._lock:
            self._counts["folded_decode_tokens"] += folded
            self._counts["unfolded_decode_tokens"] += unfolded
            self._counts["prefill_tokens"] += prefill
            self._counts["mixed_batches"] += int(folded > 0 and prefill > 0)
        self._dirty.set()

    def record_capture(self, folded: bool) -> None:
        """Count a CUDA-graph capture by the path it froze (its replays never reach Python)."""
        with self._lock:
            self._counts["graph_captures_folded" if folded else "graph_captures_unfolded"] += 1
        self._dirty.set()

    def add_layer_with_fold(self, layer: str) -> None:
        """Count a layer whose fold is loaded, once whichever model build of this worker loads it
        (the target model and, under MTP speculative decoding, the draft: each counted its own
        layers, and the draft's count replaced the target's)."""
        with self._lock:
            self._layers.add(layer)
            self._counts["layers_with_fold"] = len(self._layers)
        self._dirty.set()

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)

    def _flush_forever(self) -> None:
        while True:
            self._dirty.wait()
            self._dirty.clear()
            self._write()
            time.sleep(FLUSH_INTERVAL_S)

    def _flush_pending(self) -> None:
        if self._dirty.is_set():
            self._dirty.clear()
            self._write()

    def _write(self) -> None:
        # Snapshot under the write lock: whichever writer goes last writes the latest counts.
        with self._write_lock:
            try:
                self._tmp.write_text(json.dumps(self.snapshot(), sort_keys=True) + "\n")
                os.replace(self._tmp, self.path)
            except OSError:
                # Observability must never take the engine down; the next change retries.
                pass


def worker_stats_path(base: str, rank: int, world_size: int) -> Path:
    """The file this worker writes: ``base`` itself on rank 0 or in a world of one."""
    path = Path(base)
    if world_size <= 1 or rank == 0:
        return path
    return path.with_name(f"{path.stem}.rank{rank}{path.suffix}")


_stats: StatsFile | None = None
_stats_lock = threading.Lock()


def open_worker_stats(rank: int, world_size: int) -> StatsFile | None:
    """This process's :class:`StatsFile`, created on first call; None when the env var is unset."""
    global _stats
    base = os.environ.get(STATS_ENV)
    if not base:
        return None
    with _stats_lock:
        if _stats is None:
            _stats = StatsFile(worker_stats_path(base, rank, world_size))
        return _stats


def current() -> StatsFile | None:
    """The stats file opened by :func:`open_worker_stats`, if any (cheap: called per step)."""
    return _stats
