"""Durable file operations: atomic writes, placing source files, hashing.

Every file foldckpt produces goes through :func:`atomic_output`: written under a temporary name in
the destination folder, fsynced, renamed into place, and the folder fsynced. A killed process
therefore leaves either the old state or the complete new file, never a half-written file under
a name that verify or vLLM would read. Disk-full and file-too-large errors become one-line
:class:`FoldckptError` messages naming the file, and the temporary file is removed.

OUT_DIR may hold entries someone else planted (between two runs, after a kill -9): a symlink at a
temporary name, a directory symlink where a sub-folder goes, a journal or a manifest naming such
paths. So every write and every removal in it goes through a descriptor of the folder that holds
the entry, reached from OUT_DIR one component at a time without following a link
(:func:`parent_dir`), creates its file anew (``O_EXCL | O_NOFOLLOW``) and removes only regular
files and links, the link itself (:func:`remove_placed`): nothing outside OUT_DIR is ever written,
truncated or deleted, whatever it holds.
"""

from __future__ import annotations

import errno
import fcntl
import hashlib
import json
import math
import os
import stat
from collections.abc import Callable, Iterable, Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager, suppress
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from foldckpt.errors import FoldckptError

TMP_SUFFIX = ".foldckpt-tmp"
HASH_CHUNK = 8 * 1024 * 1024
# Hashing reads into a buffer that stays in the core's L2 cache (1 MiB on common server cores)
# while sha256 reads it back, where an 8 MiB buffer is fetched from memory a second time;
# readahead keeps the disk busy.
HASH_BUFFER = 1024 * 1024
LINK_MODES = ("auto", "hard", "copy", "symlink")

# A folder on the way to an entry of OUT_DIR: opened as a directory, never through a symlink.
_DIR_FLAGS = os.O_RDONLY | os.O_DIRECTORY | os.O_NOFOLLOW | os.O_CLOEXEC
_NEW_FILE_FLAGS = os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC

_DISK_FULL = {
    errno.ENOSPC: "disk full",
    errno.EFBIG: "file too large for this filesystem or limit",
    errno.EDQUOT: "disk quota exceeded",
}


@contextmanager
def worker_pool(workers: int) -> Iterator[ThreadPoolExecutor]:
    """A thread pool that, when the block raises (an error, Ctrl-C, SIGTERM), drops the tasks not
    yet started instead of running them all first: only the ones in flight finish."""
    pool = ThreadPoolExecutor(max_workers=workers)
    try:
        yield pool
    except BaseException:
        pool.shutdown(wait=True, cancel_futures=True)
        raise
    pool.shutdown(wait=True)


def tmp_path_for(path: Path) -> Path:
    return path.with_name(tmp_name(path.name))


def tmp_name(name: str) -> str:
    return f".{name}{TMP_SUFFIX}"


def check_fits(root: Path, names: Iterable[str]) -> None:
    """Refuse, naming it, a file to be written under ``root`` (``names``, relative to it, each
    written under its temporary name first, :func:`atomic_output`) whose path is longer than the
    system takes (PATH_MAX) or one of whose names is longer than ``root``'s filesystem allows
    (NAME_MAX). Said before anything is written, where the write met ENAMETOOLONG midway, after
    folders had been made; and a source file's name of up to NAME_MAX bytes fits MODEL_DIR but
    not as the longer temporary name in OUT_DIR."""
    folder = nearest_existing(root)
    name_max, path_max = os.pathconf(folder, "PC_NAME_MAX"), os.pathconf(folder, "PC_PATH_MAX")
    for name in names:
        pure = PurePosixPath(name)
        written = pure.with_name(tmp_name(pure.name))
        longest = max(written.parts, key=lambda part: len(os.fsencode(part)))
        if len(os.fsencode(longest)) > name_max:
            raise FoldckptError.at(
                root / name,
                f"the name {longest!r} ({len(os.fsencode(longest))} bytes, with the temporary name it is "
                f"written under) is longer than the {name_max} bytes the filesystem allows; shorten the name",
            )
        size = len(os.fsencode(root / written))
        if size >= path_max:  # the limit counts the terminating NUL
            raise FoldckptError.at(
                root / name,
                f"a path of {size} bytes (with the temporary name it is written under), longer than the "
                f"{path_max - 1} the system takes; choose a shorter output directory",
            )


def stays_inside(name: str) -> bool:
    """Whether the relative file name ``name`` names something inside its directory, by its text
    alone (not absolute, no ``..``, no backslash): what may be joined onto a directory we own."""
    pure = PurePosixPath(name)
    return not (pure.is_absolute() or ".." in pure.parts or "\\" in name)


@contextmanager
def parent_dir(root: Path, name: str, create: bool = False) -> Iterator[tuple[int, str]]:
    """A descriptor of the folder that holds ``root/name`` and the entry's own name in it.

    The folder is reached from ``root`` one component at a time, each opened ``O_NOFOLLOW``: a
    symlink (or anything but a directory) on the way is refused naming it, and what is then
    created, renamed or removed through the descriptor stays inside ``root`` even if a component
    is swapped for a link meanwhile. ``create`` makes missing folders (mkdir never follows a
    link either); otherwise a missing one raises FileNotFoundError."""
    parts = PurePosixPath(name).parts
    if not parts or not stays_inside(name):
        raise FoldckptError.at(root / name, "names a place outside its directory; refused")
    fd = os.open(root, os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    try:
        for depth, part in enumerate(parts[:-1]):
            if create:
                with suppress(FileExistsError):  # a folder, or anything else: checked as it is opened
                    os.mkdir(part, 0o777, dir_fd=fd)
            inner = _open_folder(root, parts[: depth + 1], fd)
            os.close(fd)
            fd = inner
        yield fd, parts[-1]
    finally:
        os.close(fd)


def _open_folder(root: Path, parts: tuple[str, ...], parent_fd: int) -> int:
    try:
        return os.open(parts[-1], _DIR_FLAGS, dir_fd=parent_fd)
    except OSError as exc:
        if exc.errno not in (errno.ELOOP, errno.ENOTDIR):
            raise
        raise _not_a_folder(root, parts) from None


def _not_a_folder(root: Path, parts: tuple[str, ...]) -> FoldckptError:
    return FoldckptError.at(
        root.joinpath(*parts),
        "a symlink or not a directory where convert writes a folder of its own; not followed: remove it "
        "(or choose another output directory) and rerun",
    )


def check_removable(root: Path, name: str, links: bool = True) -> bool:
    """Whether ``root/name`` is there to remove (False: nothing at that name); refuses, naming it,
    an entry convert cannot have made: anything but a regular file or (where ``links``: source
    files placed with ``--link symlink``) a symlink, or one reached through a symlink."""
    try:
        with parent_dir(root, name) as (fd, leaf):
            return _removable(root / name, os.lstat(leaf, dir_fd=fd), links)
    except FileNotFoundError:
        return False
    except OSError as exc:
        raise os_error(root / name, exc, "checking what to remove") from None


def _removable(path: Path, status: os.stat_result, links: bool) -> bool:
    if stat.S_ISREG(status.st_mode) or (links and stat.S_ISLNK(status.st_mode)):
        return True
    if stat.S_ISLNK(status.st_mode):
        kind = "a symlink"
    else:
        kind = "a directory" if stat.S_ISDIR(status.st_mode) else "not a regular file"
    advice = "remove it yourself (or choose another output directory) and rerun"
    raise FoldckptError.at(path, f"{kind}, which convert never writes there; not removed: {advice}")


def remove_placed(root: Path, entries: dict[str, bool]) -> None:
    """Remove the entries of ``root`` that an earlier run made (name: whether it may be a symlink,
    see :func:`check_removable`), in order, each the entry itself (a link, never what it points
    to), through a descriptor of its folder (:func:`parent_dir`). All are checked before the first
    goes: a refusal leaves ``root`` as it was."""
    present = {name: links for name, links in entries.items() if check_removable(root, name, links)}
    for name, links in present.items():
        try:
            with parent_dir(root, name) as (fd, leaf):
                if _removable(root / name, os.lstat(leaf, dir_fd=fd), links):
                    os.unlink(leaf, dir_fd=fd)
        except FileNotFoundError:
            continue
        except OSError as exc:
            raise os_error(root / name, exc, "removing") from None


def is_tmp_path(path: Path) -> bool:
    return path.name.startswith(".") and path.name.endswith(TMP_SUFFIX)


def fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def os_error(path: Path, exc: OSError, action: str) -> FoldckptError:
    """A one-line user error for an OSError met while ``action``-ing ``path``."""
    if exc.errno in _DISK_FULL:
        return FoldckptError.at(path, f"{_DISK_FULL[exc.errno]} while {action}; free space and rerun to resume")
    if exc.errno in (errno.EACCES, errno.EPERM):
        return FoldckptError.at(path, f"permission denied while {action}")
    return FoldckptError.at(path, f"{exc.strerror or exc} while {action}")


@contextmanager
def atomic_output(path: Path, root: Path | None = None) -> Iterator[BinaryIO]:
    """Open ``path`` for writing so that it appears only complete and durable, or not at all.

    ``root``: the directory ``path`` lies in, possibly a few folders down (made where missing);
    the folders between are reached without following a link (:func:`parent_dir`). The temporary
    file is made anew (``O_EXCL | O_NOFOLLOW``, after removing whatever has its name): opened
    plainly, a symlink planted at that name in OUT_DIR had convert write its journal through it,
    onto a file anywhere."""
    path = Path(path)
    root = path.parent if root is None else Path(root)
    try:
        with parent_dir(root, path.relative_to(root).as_posix(), create=True) as (folder, name):
            tmp = tmp_name(name)
            try:
                unlink_at(folder, tmp)  # a leftover of a killed write, or a planted link: not followed
                fd = os.open(tmp, os.O_WRONLY | _NEW_FILE_FLAGS, 0o666, dir_fd=folder)
                with os.fdopen(fd, "wb") as handle:
                    yield handle
                    handle.flush()
                    os.fsync(handle.fileno())
                os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
                os.fsync(folder)
            except BaseException:
                _discard(folder, tmp)
                raise
    except OSError as exc:
        raise os_error(path, exc, "writing") from None


def unlink_at(folder: int, name: str) -> None:
    """Remove the entry ``name`` of the open ``folder`` if there is one (a link itself)."""
    with suppress(FileNotFoundError):
        os.unlink(name, dir_fd=folder)


def _discard(folder: int, tmp: str) -> None:
    """Remove a temporary file after a failed write, where that is possible: on a read-only file
    system even the removal of a file that was never made fails (EROFS), and that must not hide
    the error that stopped the write."""
    with suppress(OSError):
        unlink_at(folder, tmp)


def atomic_write_json(path: Path, data: Any) -> None:
    with atomic_output(path) as handle:
        handle.write((json.dumps(data, indent=2, sort_keys=False) + "\n").encode("utf-8"))


def parse_json(raw: bytes | str) -> Any:
    """``json.loads`` whose every refusal of a malformed document is a ``ValueError`` (as
    ``JSONDecodeError`` and ``UnicodeDecodeError`` are): a hostile file of a few hundred kB
    otherwise escapes as ``RecursionError`` (arrays nested 100,000 deep) or, from an integer of
    more than 4,300 digits, as a ``ValueError`` that names no position."""
    try:
        return json.loads(raw)
    except RecursionError:
        raise ValueError("nested too deeply") from None


def json_safe(value: Any) -> Any:
    """``value`` with every NaN or infinite float replaced by None: JSON has no such numbers
    (``json.dumps`` writes ``NaN``, which strict parsers, JavaScript's among them, refuse). Only
    the errors of folds of NaN inputs (``--allow-nonfinite``) are such numbers."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {key: json_safe(item) for key, item in value.items()}
    if isinstance(value, (list, tuple)):
        return [json_safe(item) for item in value]
    return value


def read_json_file(path: Path, max_bytes: int, what: str, missing_hint: str = "") -> Any:
    """Parse a JSON file of at most ``max_bytes`` (a hostile file cannot exhaust memory)."""
    if path.exists() and not path.is_file():  # a FIFO or device would block or never end
        raise FoldckptError.at(path, f"not a regular file; not {what}")
    try:
        with open(path, "rb") as handle:
            raw = handle.read(max_bytes + 1)
    except FileNotFoundError:
        raise FoldckptError.at(path, f"not found{'; ' + missing_hint if missing_hint else ''}") from None
    except OSError as exc:
        raise FoldckptError.at(path, f"cannot read: {exc.strerror}") from None
    if len(raw) > max_bytes:
        raise FoldckptError.at(path, f"larger than {max_bytes} bytes; not {what}")
    try:
        return parse_json(raw)
    except ValueError as exc:
        raise FoldckptError.at(path, f"invalid JSON ({exc}); not {what}") from None


def sha256_file(path: Path, progress: Callable[[int], object] | None = None) -> str:
    """sha256 of a whole file, read sequentially into a cache-sized buffer (hashlib releases the
    GIL, so threads scale)."""
    digest = hashlib.sha256()
    try:
        with open(path, "rb", buffering=0) as handle:
            if hasattr(os, "posix_fadvise"):
                os.posix_fadvise(handle.fileno(), 0, 0, os.POSIX_FADV_SEQUENTIAL)
            buffer = bytearray(HASH_BUFFER)
            view = memoryview(buffer)
            while count := handle.readinto(buffer):
                digest.update(view[:count])
                if progress:
                    progress(count)
    except OSError as exc:
        raise os_error(path, exc, "hashing") from None
    return digest.hexdigest()


def _copy(src: Path, dst: Path, root: Path, progress: Callable[[int], object] | None) -> None:
    """Copy ``src`` to ``dst`` (under ``root``) with its mode and times, set on the new file
    before it is renamed into place: set by name afterwards, they followed whatever link had
    taken the name meanwhile."""
    with open(src, "rb") as reader, atomic_output(dst, root) as writer:
        while chunk := reader.read(HASH_CHUNK):
            writer.write(chunk)
            if progress:
                progress(len(chunk))
        writer.flush()
        source = os.fstat(reader.fileno())
        os.chmod(writer.fileno(), stat.S_IMODE(source.st_mode))
        os.utime(writer.fileno(), ns=(source.st_atime_ns, source.st_mtime_ns))


def place_file(
    src: Path, dst: Path, mode: str, progress: Callable[[int], object] | None = None, root: Path | None = None
) -> str:
    """Make ``dst`` hold ``src`` unchanged: a hard link, a copy or a symlink; returns how.

    ``auto`` hard-links when source and output share a filesystem and copies otherwise. The new
    entry is created under a temporary name and renamed, so a half-copied file never has the
    final name. ``root``: the output directory ``dst`` lies in (see :func:`atomic_output`).
    """
    if mode not in LINK_MODES:
        raise FoldckptError(f"unknown --link mode {mode!r}; choose one of {', '.join(LINK_MODES)}")
    root = dst.parent if root is None else root
    if mode in ("auto", "hard", "symlink"):
        try:
            with parent_dir(root, dst.relative_to(root).as_posix(), create=True) as (folder, name):
                return _link(src, folder, name, mode)
        except OSError as exc:
            if mode != "auto" or exc.errno not in (errno.EXDEV, errno.EPERM, errno.EMLINK, errno.ENOTSUP):
                if exc.errno == errno.ENOENT and not os.path.lexists(src):
                    raise vanished(src) from None
                raise os_error(dst, exc, f"{'symlinking' if mode == 'symlink' else 'hard-linking'} {src}") from None
    try:
        _copy(src, dst, root, progress)
    except FoldckptError:
        raise
    except FileNotFoundError:
        raise vanished(src) from None
    except OSError as exc:
        raise os_error(src, exc, "copying") from None
    return "copy"


def _link(src: Path, folder: int, name: str, mode: str) -> str:
    """Place ``src`` as ``name`` in the open ``folder``: a hard link (``auto``, ``hard``) or a symlink."""
    tmp = tmp_name(name)
    unlink_at(folder, tmp)
    try:
        if mode == "symlink":
            os.stat(src)  # a source gone since the plan: no dangling link
            os.symlink(src.resolve(), tmp, dir_fd=folder)
        else:
            # link(2) does not follow a symlink: linking a Hugging Face snapshot entry (a relative
            # symlink into blobs/) would give OUT_DIR a dangling link, so link the file it names.
            os.link(os.path.realpath(src), tmp, dst_dir_fd=folder)
        os.replace(tmp, name, src_dir_fd=folder, dst_dir_fd=folder)
        unlink_at(folder, tmp)  # rename(2) is a no-op, leaving tmp, when name already links src
    except OSError:
        _discard(folder, tmp)
        raise
    return "symlink" if mode == "symlink" else "hard"


def vanished(path: Path) -> FoldckptError:
    """A source file that was there when the plan read it and is gone now."""
    return FoldckptError.at(path, "no longer exists (removed or renamed while convert ran); restore it and rerun")


def remove_stale_tmp_files(folder: Path, keep: set[Path] = frozenset()) -> list[Path]:
    """Delete temporary files a killed run left behind (except ``keep``); returns what was removed.

    The walk holds a descriptor of each folder and never enters a symlink (``os.fwalk``); a link
    at a temporary name is removed itself."""
    stale: list[Path] = []
    try:
        for parent, _, names, parent_fd in os.fwalk(folder):
            for name in names:
                path = Path(parent) / name
                if is_tmp_path(path) and path not in keep and _removable_quietly(parent_fd, name):
                    unlink_at(parent_fd, name)
                    stale.append(path)
    except OSError as exc:
        raise os_error(folder, exc, "removing temporary files") from None
    return stale


def _removable_quietly(folder: int, name: str) -> bool:
    try:
        mode = os.lstat(name, dir_fd=folder).st_mode
    except FileNotFoundError:
        return False
    return stat.S_ISREG(mode) or stat.S_ISLNK(mode)


def fingerprint(path: Path) -> list[int] | None:
    """What changes whenever a file's bytes may have changed: device, inode, size, mtime and
    ctime (ns). ctime cannot be set back by a user: an in-place edit with the mtime restored, or
    another file renamed over this name, still shows. None when ``path`` does not exist."""
    try:
        st = os.stat(path)
    except FileNotFoundError:
        return None
    return [st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns, st.st_ctime_ns]


def _lock_fd(directory: Path) -> int:
    return os.open(directory, os.O_RDONLY | getattr(os, "O_DIRECTORY", 0))


@contextmanager
def exclusive_lock(directory: Path) -> Iterator[None]:
    """Hold an exclusive advisory lock (flock) on ``directory`` itself, no lock file: released by
    the kernel when the process ends, however it ends. A second holder gets a one-line error."""
    try:
        fd = _lock_fd(directory)
    except OSError as exc:
        raise os_error(directory, exc, "opening the output directory") from None
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise busy_error(directory) from None
        except OSError:  # a filesystem without flock on directories: convert unlocked
            pass
        yield
    finally:
        os.close(fd)


def is_locked(directory: Path) -> bool:
    """Whether a foldckpt convert holds ``directory``'s lock right now (see :func:`exclusive_lock`)."""
    try:
        fd = _lock_fd(directory)
    except OSError:
        return False
    try:
        fcntl.flock(fd, fcntl.LOCK_SH | fcntl.LOCK_NB)
    except BlockingIOError:
        return True
    except OSError:
        return False
    finally:
        os.close(fd)
    return False


def lock_holder(directory: Path) -> int | None:
    """The process id holding ``directory``'s lock (:func:`exclusive_lock`), from ``/proc/locks``
    (Linux), or None where it cannot be told. Matched by inode: the device number there is the
    filesystem's own, which differs from ``st_dev`` on some (overlayfs, btrfs)."""
    try:
        inode = os.stat(directory).st_ino
        with open("/proc/locks", encoding="ascii", errors="replace") as handle:
            lines = handle.read().splitlines()
    except OSError:
        return None
    for line in lines:
        fields = line.split()  # "1: FLOCK  ADVISORY  WRITE 4242 00:2b:1311 0 EOF"
        if len(fields) >= 6 and fields[1] == "FLOCK" and fields[3] == "WRITE":
            if fields[5].rsplit(":", 1)[-1] == str(inode) and fields[4].isdigit():
                return int(fields[4])
    return None


def busy_error(directory: Path) -> FoldckptError:
    """The refusal of an OUT_DIR that another convert is writing (its lock is held)."""
    pid = lock_holder(directory)
    return FoldckptError(
        f"{directory}: another foldckpt convert is writing this directory{f' (pid {pid})' if pid else ''}; "
        "wait for it to finish (or stop it), then rerun"
    )


def file_size(path: Path) -> int:
    """The size of a file the plan found (a source, or its placed copy or link), or one line naming
    it when it is gone since: another process may remove a file while convert runs."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        raise vanished(path) from None
    except OSError as exc:
        raise os_error(path, exc, "reading") from None


def nearest_existing(path: Path) -> Path:
    """``path`` or, where it does not exist yet, the nearest parent that does (where it will be)."""
    return next(folder for folder in (path, *path.absolute().parents) if folder.exists())


def hard_link_note(out_path: Path, src_path: Path) -> str:
    out_fp, src_fp = fingerprint(out_path), fingerprint(src_path)
    if out_fp is not None and src_fp is not None and out_fp[:2] == src_fp[:2]:
        return f" ({out_path} is a hard link of it: editing either edits both)"
    return ""


def how_placed(out_path: Path, src_path: Path) -> str:
    if out_path.is_symlink():
        return "symlink"
    out_fp, src_fp = fingerprint(out_path), fingerprint(src_path)
    return "hard" if out_fp and src_fp and out_fp[:2] == src_fp[:2] else "copy"
