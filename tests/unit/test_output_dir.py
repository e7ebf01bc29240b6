"""What convert's preflight proves about OUT_DIR is not proven again under the lock while it holds
(``foldckpt.convert.output_dir.Proven``), on real files."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path

from foldckpt.convert.output_dir import Proven


def counted(calls: list[bool], verdict: bool) -> Callable[[], bool]:
    """A check (hashing, in convert) that records that it ran and gives ``verdict``."""

    def check() -> bool:
        calls.append(verdict)
        return verdict

    return check


def test_a_file_proven_intact_is_not_hashed_again_until_it_changes(tmp_path: Path) -> None:
    """The dry run's checks, which the run now shares (issue 46), hash every file whose fingerprint
    changed; the run, judging OUT_DIR again under its lock, must not hash such a file twice (a
    copied model: every file, hours), yet must see a change made in between."""
    path = tmp_path / "model-00001-of-00001.safetensors"
    path.write_bytes(b"weights")
    proven, calls = Proven(), []
    assert proven.holds(path, "sha", counted(calls, True))
    assert proven.holds(path, "sha", counted(calls, False))  # unchanged: trusted, not checked
    assert calls == [True]
    assert not proven.holds(path, "another sha", counted(calls, False))  # another record: checked
    os.utime(path, ns=(0, 0))  # touched (its ctime moves): checked again
    assert proven.holds(path, "sha", counted(calls, True))
    path.write_bytes(b"other weights")
    assert not proven.holds(path, "sha", counted(calls, False))
    assert calls == [True, False, True, False]


def test_a_file_that_fails_its_check_is_not_remembered(tmp_path: Path) -> None:
    path = tmp_path / "config.json"
    path.write_text("{}")
    proven, calls = Proven(), []
    assert not proven.holds(path, "sha", counted(calls, False))
    assert not proven.holds(path, "sha", counted(calls, False))
    assert calls == [False, False]
    assert not Proven().holds(tmp_path / "missing", "sha", counted(calls, False))
