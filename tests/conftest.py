"""Shared fixtures: real synthetic checkpoints on disk and a real ``foldckpt`` subprocess."""

from __future__ import annotations

import os
import subprocess
import sys
import tempfile
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest

from foldckpt.convert import ConvertOptions, convert
from foldckpt.io.direct_io import open_direct
from foldckpt.model.synthetic import make_checkpoint

REPO = Path(__file__).resolve().parent.parent


@pytest.fixture(scope="session", autouse=True)
def temporary_files_under_basetemp(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """``TMPDIR`` (for this process and every command it starts) under pytest's own basetemp for the
    whole session. Why: the tests that end a command in an internal error on purpose (a broken
    torch, a file removed mid-run) had it write its traceback file (``foldckpt-traceback-*.txt``)
    into the machine's /tmp, where each run of the suite left more; under the basetemp they are
    pruned with it (pytest keeps the last three) and can still be read after a failure."""
    folder = tmp_path_factory.mktemp("tmpdir")
    with pytest.MonkeyPatch.context() as patch:
        patch.setenv("TMPDIR", str(folder))
        patch.setattr(tempfile, "tempdir", None)  # gettempdir() reads TMPDIR again
        yield folder


def evict_from_page_cache(*paths: Path) -> None:
    """Write back and drop the files' pages from the page cache, so that the next read is cold."""
    for path in paths:
        fd = os.open(path, os.O_RDONLY)
        try:
            os.fsync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def run_foldckpt(*args: str | Path, timeout: float = 300, **kwargs: object) -> subprocess.CompletedProcess[str]:
    """Run the real command line in a subprocess (exit codes and stderr as a user sees them)."""
    return subprocess.run(
        [sys.executable, "-m", "foldckpt", *map(str, args)],
        capture_output=True,
        text=True,
        timeout=timeout,
        check=False,
        **kwargs,
    )


def direct_io_supported(folder: Path) -> bool:
    """Whether the filesystem of ``folder`` takes O_DIRECT (tmpfs, for one, does not)."""
    probe = folder / "direct-io-probe"
    probe.write_bytes(b"")
    try:
        fd = open_direct(probe, os.O_RDONLY)
        if fd is None:
            return False
        os.close(fd)
        return True
    finally:
        probe.unlink()


@pytest.fixture
def make_model(tmp_path: Path) -> Callable[..., Path]:
    """Factory: ``make_model("kimi_k3", layers=...)`` writes a synthetic checkpoint under tmp_path."""
    counter = iter(range(1000))

    def factory(family: str = "deepseek_v3", **kwargs: object) -> Path:
        return make_checkpoint(tmp_path / f"model-{family}-{next(counter)}", family, **kwargs)  # type: ignore[arg-type]

    return factory


@pytest.fixture
def converted(tmp_path: Path, make_model: Callable[..., Path]) -> Callable[..., tuple[Path, Path]]:
    """Factory: a synthetic checkpoint and its conversion; returns (model_dir, out_dir)."""

    def factory(
        family: str = "deepseek_v3", options: ConvertOptions | None = None, **kwargs: object
    ) -> tuple[Path, Path]:
        model_dir = make_model(family, **kwargs)
        out_dir = tmp_path / f"{model_dir.name}-folded"
        convert(model_dir, out_dir, options or ConvertOptions(progress=False))
        return model_dir, out_dir

    return factory


@pytest.fixture
def small_filesystem(tmp_path: Path) -> Iterator[Path]:
    """A real 8 MB tmpfs (root with CAP_SYS_ADMIN only; CI runs as root)."""
    mount_point = tmp_path / "small"
    mount_point.mkdir()
    mounted = subprocess.run(
        ["mount", "-t", "tmpfs", "-o", "size=8m", "tmpfs", str(mount_point)], capture_output=True, text=True
    )
    if mounted.returncode != 0:
        pytest.skip(
            f"cannot mount a small tmpfs for a real ENOSPC ({mounted.stderr.strip()}); "
            "the EFBIG test covers the same error path"
        )
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)


@pytest.fixture()
def read_only_dir(tmp_path: Path) -> Iterator[Path]:
    """A real read-only mount (a bind mount of an empty directory remounted read-only; root with
    CAP_SYS_ADMIN only, as the tmpfs above), on which every write and every unlink fails with EROFS."""
    mount_point = tmp_path / "read-only"
    mount_point.mkdir()
    for command in (["mount", "--bind", mount_point, mount_point], ["mount", "-o", "remount,bind,ro", mount_point]):
        mounted = subprocess.run(command, capture_output=True, text=True)
        if mounted.returncode != 0:
            subprocess.run(["umount", "-l", str(mount_point)], check=False, capture_output=True)
            pytest.skip(f"cannot make a read-only mount ({mounted.stderr.strip()})")
    try:
        yield mount_point
    finally:
        subprocess.run(["umount", "-l", str(mount_point)], check=False)
