"""Progress lines when stderr is not a terminal (``foldckpt.console.progress``)."""

from __future__ import annotations

import io
import re

import pytest

from foldckpt.console.progress import INTERVAL_ENV, progress_bar


def counts(text: str) -> list[str]:
    return [re.sub(r" in \d+\.\d s.*", "", line) for line in text.splitlines()]


def test_no_line_repeats_the_count_of_the_line_before(monkeypatch: pytest.MonkeyPatch) -> None:
    """A stage that moved by less than its count's rounding (hashing that waits for the fold)
    printed ``hashing: 8.7 MB/16.7 MB (52%)`` line after line (issue 46). A line is written when
    the count it shows moves, and the closing line only when it says something new."""
    monkeypatch.setenv(INTERVAL_ENV, "0")
    stream = io.StringIO()
    with progress_bar(16_700_000, "hashing", "B", True, stream) as bar:
        bar.update(8_700_000)
        for _ in range(20):
            bar.update(1_000)  # 8.70 ... 8.72 MB: "8.7 MB", 52%
        bar.update(1_000_000)
    assert counts(stream.getvalue()) == ["hashing: 8.7 MB/16.7 MB (52%)", "hashing: 9.7 MB/16.7 MB (58%)"]
    stream = io.StringIO()
    with progress_bar(3, "folding", "layer", True, stream) as bar:
        for _ in range(3):
            bar.update(1)
    assert counts(stream.getvalue()) == [
        "folding: 1/3 layers (33%)",
        "folding: 2/3 layers (67%)",
        "folding: 3/3 layers (100%)",
    ]
