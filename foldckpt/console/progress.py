"""Progress reports: a tqdm bar on a terminal, plain periodic lines in logs, or nothing.

A bar redrawn with ``\\r`` is unreadable once stderr is a file or a CI log (every frame piles up on
one line), so when the stream is not a TTY progress is written as whole lines instead: one every
``FOLDCKPT_PROGRESS_INTERVAL`` seconds (default 10) while the work runs, and one when it ends, each
only when its count differs from the line before.
tqdm is imported only when a bar is actually drawn.
"""

from __future__ import annotations

import os
import sys
import threading
import time
from typing import Any, TextIO

INTERVAL_ENV = "FOLDCKPT_PROGRESS_INTERVAL"
DEFAULT_INTERVAL_S = 10.0


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


class _Silent:
    def update(self, n: int = 1) -> None:
        pass

    def set_postfix(self, **values: Any) -> None:
        pass

    def close(self) -> None:
        pass

    def __enter__(self) -> _Silent:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


class _Lines(_Silent):
    """Thread-safe (hashing threads report bytes) whole-line progress."""

    def __init__(self, total: int, desc: str, unit: str, stream: TextIO, interval: float) -> None:
        self.total, self.desc, self.unit, self.stream, self.interval = total, desc, unit, stream, interval
        self.done = 0
        self.postfix = ""
        self.started = self.last = time.monotonic()
        self._lock = threading.Lock()
        self._closed = False
        self._shown: str | None = None  # the count of the last line written

    def _amount(self, value: float) -> str:
        return human_bytes(value) if self.unit == "B" else f"{value:.0f}"

    def _count(self) -> str:
        share = f" ({100 * self.done / self.total:.0f}%)" if self.total else ""
        unit = "" if self.unit == "B" else f" {self.unit}s" if self.total != 1 else f" {self.unit}"
        return f"{self._amount(self.done)}/{self._amount(self.total)}{unit}{share}"

    def _write(self, now: float) -> None:
        """Write a line, unless it would show the count the last one showed: a stage that waits
        (hashing while the fold runs) or moves by less than the rounding of the count (``8.7 MB``,
        ``52%``) printed the same count again and again, which reads as a stall. It is written
        once the count moves."""
        count = self._count()
        if count == self._shown:
            return
        self._shown, self.last = count, now
        elapsed = now - self.started
        rate = f", {human_bytes(self.done / elapsed)}/s" if self.unit == "B" and elapsed > 0 else ""
        postfix = f", {self.postfix}" if self.postfix else ""
        self.stream.write(f"{self.desc}: {count} in {elapsed:.1f} s{rate}{postfix}\n")
        self.stream.flush()

    def update(self, n: int = 1) -> None:
        with self._lock:
            self.done += n
            now = time.monotonic()
            if now - self.last >= self.interval and self.done < self.total:
                self._write(now)

    def set_postfix(self, **values: Any) -> None:
        with self._lock:
            self.postfix = " ".join(f"{key}={value}" for key, value in values.items())

    def close(self) -> None:
        with self._lock:
            if not self._closed and self.total:
                self._write(time.monotonic())
            self._closed = True


def _interval() -> float:
    try:
        return max(0.0, float(os.environ.get(INTERVAL_ENV, DEFAULT_INTERVAL_S)))
    except ValueError:
        return DEFAULT_INTERVAL_S


def progress_bar(
    total: int, desc: str, unit: str, enabled: bool, stream: TextIO | None = None, position: int = 0
) -> Any:
    """A progress reporter with tqdm's ``update`` / ``set_postfix`` / ``close`` (and ``with``);
    bars shown at the same time take a ``position`` (line) each."""
    stream = stream or sys.stderr
    if not enabled:
        return _Silent()
    isatty = getattr(stream, "isatty", None)
    if isatty is not None and isatty():
        from tqdm import tqdm

        return tqdm(total=total, desc=desc, unit=unit, unit_scale=unit == "B", file=stream, position=position)
    return _Lines(total, desc, unit, stream, _interval())
