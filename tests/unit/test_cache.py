"""The user's cache (``foldckpt.runtime.cache``) and its two readers, the routing timings and the
built kernels: untrusted entries are refused, never read whole and never allowed to stop an
engine's start. Real files, FIFOs, links and devices in a temporary folder."""

from __future__ import annotations

import json
import logging
import os
import stat
import threading
from pathlib import Path

import pytest

from foldckpt.runtime.cache import CacheDefect, read_entry, write_entry
from foldckpt.runtime.kernels.routing import read_cached_points, write_cached_points
from tests.unit.test_routing import WINS_TO_32, _key

ROOT = os.getuid() == 0


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    folder = tmp_path / "foldckpt"
    folder.mkdir(mode=0o700)
    return folder


def test_write_creates_a_private_folder_and_reads_back(tmp_path: Path) -> None:
    path = tmp_path / "cache" / "foldckpt" / "entry.bin"
    write_entry(path, b"abc\n\x00")
    assert stat.S_IMODE(path.parent.stat().st_mode) == 0o700
    assert read_entry(path, 16) == b"abc\n\x00"
    assert [p.name for p in path.parent.iterdir()] == ["entry.bin"], "no temporary file left"
    assert read_entry(path.with_name("missing"), 16) is None
    assert read_entry(tmp_path / "no-folder" / "entry", 16) is None


def test_a_fifo_is_refused_without_blocking(folder: Path) -> None:
    """A reader that opened a FIFO would wait for a writer forever: the open must not block."""
    fifo = folder / "entry"
    os.mkfifo(fifo)
    outcome: list[BaseException | bytes | None] = []

    def read() -> None:
        try:
            outcome.append(read_entry(fifo, 1024))
        except CacheDefect as exc:
            outcome.append(exc)

    reader = threading.Thread(target=read, daemon=True)
    reader.start()
    reader.join(timeout=5)
    assert not reader.is_alive(), "read_entry blocked on a FIFO"
    assert isinstance(outcome[0], CacheDefect) and "not a regular file" in str(outcome[0])


def test_a_link_to_a_device_is_refused_unread(folder: Path) -> None:
    """A symbolic link to /dev/zero would be read until memory runs out: links are never followed."""
    (folder / "entry").symlink_to("/dev/zero")
    with pytest.raises(CacheDefect, match="symbolic link"):
        read_entry(folder / "entry", 1024)


def test_a_link_to_a_regular_file_is_refused_too(folder: Path, tmp_path: Path) -> None:
    target = tmp_path / "elsewhere"
    target.write_bytes(b"{}")
    (folder / "entry").symlink_to(target)
    with pytest.raises(CacheDefect, match="symbolic link"):
        read_entry(folder / "entry", 1024)


def test_an_oversized_entry_is_refused(folder: Path) -> None:
    (folder / "entry").write_bytes(b"x" * 1025)
    with pytest.raises(CacheDefect, match="1025 bytes, more than the 1024"):
        read_entry(folder / "entry", 1024)
    (folder / "entry").write_bytes(b"x" * 1024)
    assert read_entry(folder / "entry", 1024) == b"x" * 1024


@pytest.mark.parametrize("mode", [0o720, 0o702, 0o777])
def test_a_folder_others_can_write_is_not_trusted(folder: Path, mode: int) -> None:
    (folder / "entry").write_bytes(b"{}")
    folder.chmod(mode)
    with pytest.raises(CacheDefect, match="writable by others"):
        read_entry(folder / "entry", 1024)
    with pytest.raises(CacheDefect, match="writable by others"):
        write_entry(folder / "entry", b"{}")


def test_a_linked_folder_is_not_trusted(folder: Path, tmp_path: Path) -> None:
    (folder / "entry").write_bytes(b"{}")
    link = tmp_path / "linked"
    link.symlink_to(folder)
    with pytest.raises(CacheDefect, match="folder is a symbolic link"):
        read_entry(link / "entry", 1024)


@pytest.mark.skipif(not ROOT, reason="giving a file to another user needs root")
def test_entries_and_folders_of_another_user_are_not_trusted(folder: Path) -> None:
    entry = folder / "entry"
    entry.write_bytes(b"{}")
    os.chown(entry, 4242, -1)
    with pytest.raises(CacheDefect, match="owned by uid 4242"):
        read_entry(entry, 1024)
    os.chown(entry, 0, -1)
    os.chown(folder, 4242, -1)
    with pytest.raises(CacheDefect, match="folder is owned by uid 4242"):
        read_entry(entry, 1024)


# The routing cache on top of it: every defect is one warning and a new measurement.
def _bad_entries(folder: Path) -> dict[str, Path]:
    entries = {name: folder / f"{name}.json" for name in ("latin1", "pickle", "nested", "fifo", "zero", "huge")}
    entries["latin1"].write_bytes(b'{"key": "caf\xe9"}')
    entries["pickle"].write_bytes(b"\x80\x04\x95\x0b\x00\x00\x00\x00\x00\x00\x00}\x94.")
    entries["nested"].write_text("[" * 100_000 + "]" * 100_000)
    os.mkfifo(entries["fifo"])
    entries["zero"].symlink_to("/dev/zero")
    entries["huge"].write_text(json.dumps({"key": _key(), "pad": "x" * (1 << 20)}))
    return entries


def test_a_bad_routing_cache_entry_is_one_warning_and_a_new_measurement(
    folder: Path, caplog: pytest.LogCaptureFixture
) -> None:
    for name, path in _bad_entries(folder).items():
        caplog.clear()
        with caplog.at_level(logging.WARNING, logger="vllm.foldckpt"):
            assert read_cached_points(path, _key()) is None, name
        lines = [r for r in caplog.records if r.levelno >= logging.WARNING]
        assert len(lines) == 1 and "ignoring the routing cache" in lines[0].getMessage(), name
        assert "\n" not in lines[0].getMessage(), name


def test_the_routing_cache_still_round_trips(folder: Path) -> None:
    path = folder / "route.json"
    assert write_cached_points(path, _key(), WINS_TO_32)
    assert read_cached_points(path, _key()) == WINS_TO_32
