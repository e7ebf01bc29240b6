"""The user's cache of what a GPU start-up measured or built: routing timings and compiled kernels.

Anything read back from it decides what runs in the engine (a threshold, a kernel binary), so it
is trusted only as far as the user's own files are, and never trusted to be well formed:

- the folder is ``$XDG_CACHE_HOME/foldckpt`` (``~/.cache/foldckpt``); it is used only if it is a
  real folder (not a symbolic link), owned by this user and not writable by group or others, and
  it is created with mode 0700;
- an entry is read only if it is a regular file (opened without following links and without
  blocking, so a FIFO or a device is refused, never read), owned by this user and at most
  ``max_bytes`` long; a longer file is refused after reading ``max_bytes + 1`` bytes;
- an entry is written to a temporary file in the folder and renamed over the old one, so that
  concurrent ranks of one host never leave half an entry.

Every defect is a ``CacheDefect``: the caller measures or builds again and says so in one warning
line. Whether the bytes of a trusted entry make sense (a digest, a key, a schema) is the caller's
check, not this module's.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import stat
import tempfile
from collections.abc import Mapping
from pathlib import Path
from typing import Any

__all__ = ["CacheDefect", "cache_dir", "driver_version", "entry_path", "read_entry", "write_entry"]


class CacheDefect(Exception):
    """A cache folder or entry that is not to be trusted (or cannot be written); the message says why."""


def cache_dir(environ: Mapping[str, str] = os.environ) -> Path:
    """``$XDG_CACHE_HOME/foldckpt``, or ``~/.cache/foldckpt`` (the XDG spec ignores a relative value)."""
    base = environ.get("XDG_CACHE_HOME", "")
    root = Path(base) if base and Path(base).is_absolute() else Path.home() / ".cache"
    return root / "foldckpt"


def entry_path(kind: str, key: Mapping[str, Any], suffix: str, environ: Mapping[str, str] = os.environ) -> Path:
    """The entry of ``kind`` made under ``key``: a digest of the key names the file (which holds the
    key itself, for the reader to compare)."""
    digest = hashlib.sha256(json.dumps(key, sort_keys=True).encode()).hexdigest()[:24]
    return cache_dir(environ) / f"{kind}-{digest}{suffix}"


def driver_version() -> str:
    """The kernel driver's version (NVIDIA or amdgpu), from the file the driver publishes: part of
    every cache key, since a driver update changes both timings and what a cubin may use."""
    for path in ("/proc/driver/nvidia/version", "/sys/module/amdgpu/version"):
        try:
            return Path(path).read_text(encoding="utf-8").splitlines()[0].strip()
        except (OSError, IndexError):
            continue
    return "unknown"


def _check_owned(status: os.stat_result, what: str) -> None:
    if status.st_uid != os.getuid():
        raise CacheDefect(f"{what} is owned by uid {status.st_uid}, not this user ({os.getuid()})")


def _trusted_dir(folder: Path) -> None:
    """Raise CacheDefect unless ``folder`` is a real folder of this user's that nobody else can write."""
    try:
        status = os.lstat(folder)
    except OSError as exc:
        raise CacheDefect(f"cannot inspect the cache folder: {exc.strerror}") from exc
    if stat.S_ISLNK(status.st_mode):
        raise CacheDefect("the cache folder is a symbolic link")
    if not stat.S_ISDIR(status.st_mode):
        raise CacheDefect("the cache folder is not a folder")
    _check_owned(status, "the cache folder")
    if status.st_mode & (stat.S_IWGRP | stat.S_IWOTH):
        raise CacheDefect(f"the cache folder is writable by others (mode {stat.S_IMODE(status.st_mode):o})")


def read_entry(path: Path, max_bytes: int) -> bytes | None:
    """The bytes of cache entry ``path``; None where there is none; CacheDefect where it, or its
    folder, is not to be trusted (see the module docstring)."""
    if not path.parent.exists():
        return None
    _trusted_dir(path.parent)
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_NONBLOCK | os.O_CLOEXEC)
    except FileNotFoundError:
        return None
    except OSError as exc:
        if exc.errno == errno.ELOOP:
            raise CacheDefect("it is a symbolic link") from exc
        raise CacheDefect(f"cannot open it: {exc.strerror}") from exc
    try:
        status = os.fstat(fd)
        if not stat.S_ISREG(status.st_mode):
            raise CacheDefect("it is not a regular file")
        _check_owned(status, "it")
        if status.st_size > max_bytes:
            raise CacheDefect(f"it holds {status.st_size} bytes, more than the {max_bytes} an entry may")
        chunks, size = [], 0
        while size <= max_bytes:
            chunk = os.read(fd, max_bytes + 1 - size)
            if not chunk:
                break
            chunks.append(chunk)
            size += len(chunk)
        if size > max_bytes:  # it grew after fstat
            raise CacheDefect(f"it holds more than the {max_bytes} bytes an entry may")
        return b"".join(chunks)
    except OSError as exc:
        raise CacheDefect(f"cannot read it: {exc.strerror}") from exc
    finally:
        os.close(fd)


def write_entry(path: Path, data: bytes) -> None:
    """Write ``data`` as cache entry ``path`` atomically (a temporary file in the same folder, then
    renamed over it), creating the folder (mode 0700) if needed; CacheDefect where the folder is
    not to be trusted or cannot be written."""
    try:
        path.parent.mkdir(mode=0o700, parents=True, exist_ok=True)
    except OSError as exc:
        raise CacheDefect(f"cannot create the cache folder: {exc.strerror}") from exc
    _trusted_dir(path.parent)
    tmp = None
    try:
        fd, tmp = tempfile.mkstemp(dir=path.parent, prefix=f".{path.name}.", suffix=".tmp")
        with os.fdopen(fd, "wb") as f:
            f.write(data)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, path)
    except OSError as exc:
        if tmp is not None:
            Path(tmp).unlink(missing_ok=True)
        raise CacheDefect(f"cannot write it: {exc.strerror}") from exc
