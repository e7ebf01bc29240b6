"""``foldckpt verify``: prove, offline, that a converted directory is what was converted, and right.

Levels, cheapest first; each includes the ones before it, and a failing level stops the run (its
problems name the file, relative to OUT_DIR, and the tensor where there is one):

1. ``manifest``: the manifest parses and is self-consistent (file names stay inside OUT_DIR,
   hashes are sha256 hex, every fold lies in a listed sidecar, per-rank hashes cover its TP sizes);
   every file it lists exists with its recorded size; no stray sidecar or safetensors file lies
   beside them.
2. ``structure``: no tensor data read. Every safetensors header parses and tiles its file exactly;
   the sidecar headers hold exactly the manifest's tensors (names, dtypes, shapes); the index and
   the source shards' headers agree both ways and every indexed shard is vouched for by the
   manifest; the source tensors the manifest records exist; ``config.json`` gives the manifest's
   geometry and every MLA layer has its fold.
3. ``content``: one read of every file (memory-mapped), in parallel across files, largest first,
   hashing the whole file and, in the same pass, each fold tensor (a manifest whose tensor hash
   disagrees with intact bytes is caught). When a file differs, the fold tensors or source tensors
   in it that differ are named too. With ``rank``/``tp`` the sidecars are not read whole: only that
   rank's row slice of each fold (what a serving node loads), plus the source files.
4. ``deep``: every fold's per-rank hashes for every recorded TP size (what the serving nodes will
   check; a wrong one would only fail there), then recompute the folds (all, or ``sample`` layers)
   from the source tensors, whose hashes must match the manifest, and compare (bitwise when this
   machine's algorithm reproduces them, else within the rounding tolerance of the fold dtype vs
   fp64), and always probe ``x·W_foldᵀ`` against the unfolded two-step query on random x.

Cost: ``content`` hashes each byte once and the folds a second time (about 2% more sha256 work for
DeepSeek-V3, 0.2% for Kimi-K3). The per-rank hashes would cost one more pass over the folds per TP
size, which is why ``deep`` checks them, with the recomputation that reads the folds anyway.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import mmap
import os
import string
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path, PurePosixPath
from typing import Any, BinaryIO

from foldckpt.checkpoint import INDEX_NAME, SourceCheckpoint, open_source_checkpoint
from foldckpt.errors import FoldckptError
from foldckpt.files import HASH_BUFFER, os_error, sha256_file, worker_pool
from foldckpt.geometry import read_geometry
from foldckpt.manifest import MANIFEST_NAME, Manifest, read_manifest
from foldckpt.plan import SIDECAR_PREFIX
from foldckpt.progress import progress_bar
from foldckpt.safetensors_format import read_header, read_tensor, read_tensor_bytes

# torch (and the fold math) is imported by the deep level only: the cheaper levels read headers
# and hash bytes, and start in a fraction of the time torch takes to import.

LEVELS = ("manifest", "structure", "content", "deep")
_HEX = frozenset(string.hexdigits.lower())


@dataclass(frozen=True)
class VerifyOptions:
    level: str = "content"
    sample: int | None = None
    rank: int | None = None
    tp: int | None = None
    workers: int | None = None
    progress: bool = True


@dataclass(frozen=True)
class Problem:
    """One failed check: the file (relative to OUT_DIR) it is about, the tensor if any, and what differs."""

    file: str
    what: str
    tensor: str | None = None

    def __str__(self) -> str:
        return f"{self.file}: {self.what}"

    def to_dict(self) -> dict[str, Any]:
        return {"file": self.file, "tensor": self.tensor, "what": self.what, "message": str(self)}


@dataclass(frozen=True)
class LevelResult:
    name: str
    ok: bool
    summary: str
    problems: tuple[Problem, ...] = ()
    elapsed_s: float = 0.0
    bytes_read: int = 0

    def to_dict(self) -> dict[str, Any]:
        return {
            "name": self.name,
            "ok": self.ok,
            "summary": self.summary,
            "problems": [problem.to_dict() for problem in self.problems],
            "elapsed_s": round(self.elapsed_s, 6),
            "bytes_read": self.bytes_read,
        }


@dataclass(frozen=True)
class VerifyReport:
    out_dir: Path
    levels: tuple[LevelResult, ...] = field(default_factory=tuple)
    elapsed_s: float = 0.0

    @property
    def ok(self) -> bool:
        return all(level.ok for level in self.levels)

    @property
    def problems(self) -> tuple[Problem, ...]:
        return tuple(problem for level in self.levels for problem in level.problems)

    def to_dict(self) -> dict[str, Any]:
        return {
            "out_dir": str(self.out_dir),
            "ok": self.ok,
            "levels": [lv.to_dict() for lv in self.levels],
            "elapsed_s": round(self.elapsed_s, 6),
        }


def _level(name: str, problems: list[Problem], summary: str, bytes_read: int = 0) -> LevelResult:
    failed = f"{len(problems)} problem(s)"
    return LevelResult(name, not problems, summary if not problems else failed, tuple(problems), bytes_read=bytes_read)


def _from_error(out_dir: Path, exc: FoldckptError, fallback: str) -> Problem:
    """A problem from a library error whose message starts with ``<path>: ``; names the file relative to OUT_DIR."""
    text = str(exc)
    prefix = f"{out_dir}{os.sep}"
    if text.startswith(prefix) and ": " in text:
        file, _, what = text[len(prefix) :].partition(": ")
        return Problem(file, what)
    return Problem(fallback, text)


def _is_sha256(value: str) -> bool:
    return len(value) == 64 and _HEX.issuperset(value)


def _unsafe_name(name: str) -> bool:
    pure = PurePosixPath(name)
    return not name or "\x00" in name or "\\" in name or pure.is_absolute() or ".." in pure.parts or name == "."


def _manifest_consistency(manifest: Manifest) -> list[Problem]:
    """What the manifest says about itself must hang together before any file is judged by it."""
    problems: list[Problem] = []

    def bad(what: str, tensor: str | None = None) -> None:
        problems.append(Problem(MANIFEST_NAME, what, tensor))

    for name in sorted(set(manifest.sidecars) & set(manifest.source_files)):
        bad(f"'{name}' is listed both as a sidecar and as a source file")
    for section, records in (("sidecars", manifest.sidecars), ("source_files", manifest.source_files)):
        for name, record in records.items():
            if _unsafe_name(name):
                bad(f"{section}: file name {name!r} escapes the output directory")
            if record.size < 0:
                bad(f"{section}: '{name}' has a negative size {record.size}")
            if not _is_sha256(record.sha256):
                bad(f"{section}: '{name}' has sha256 {record.sha256!r}, not 64 lowercase hex digits")
    for name in manifest.sidecars:
        if not PurePosixPath(name).name.startswith(SIDECAR_PREFIX) or "/" in name:
            bad(f"sidecar '{name}' is not named {SIDECAR_PREFIX}*.safetensors at the top of the output")
    heads = manifest.geometry.num_heads
    for tp in manifest.tp_sizes:
        if tp <= 0 or heads % tp:
            bad(f"tp_sizes: {tp} does not divide the {heads} attention heads")
    for name, tensor in manifest.tensors.items():
        if tensor.file not in manifest.sidecars:
            bad(f"tensor '{name}' is said to be in '{tensor.file}', which is not a listed sidecar", name)
        if not _is_sha256(tensor.sha256):
            bad(f"tensor '{name}' has sha256 {tensor.sha256!r}, not 64 lowercase hex digits", name)
        if set(tensor.rank_sha256) != set(manifest.tp_sizes):
            bad(
                f"tensor '{name}' has per-rank hashes for TP {sorted(tensor.rank_sha256)}, "
                f"the manifest's tp_sizes are {list(manifest.tp_sizes)}",
                name,
            )
        for tp, hashes in tensor.rank_sha256.items():
            if len(hashes) != tp or not all(map(_is_sha256, hashes)):
                bad(f"tensor '{name}': rank_sha256[{tp}] must be {tp} sha256 hex digests", name)
        for source in tensor.sources:
            if source.file not in manifest.source_files:
                bad(f"tensor '{name}': its source '{source.name}' is in '{source.file}', not a listed source file", name)
            if not _is_sha256(source.sha256):
                bad(f"tensor '{name}': source '{source.name}' has an invalid sha256 {source.sha256!r}", name)
    return problems


def check_manifest(out_dir: Path, manifest: Manifest) -> LevelResult:
    problems = _manifest_consistency(manifest)
    if problems:  # file names may be unsafe: judge no file by this manifest
        return _level("manifest", problems, "")
    for name, record in manifest.files.items():
        path = out_dir / name
        if not path.is_file():
            problems.append(Problem(name, "missing" if not path.exists() else "not a regular file"))
        elif (size := path.stat().st_size) != record.size:
            problems.append(Problem(name, f"size {size} bytes, {MANIFEST_NAME} says {record.size} (truncated or modified?)"))
    for path in sorted(out_dir.glob("*.safetensors")):
        if path.name.startswith(".") or path.name in manifest.files:
            continue
        kind = "sidecar" if path.name.startswith(SIDECAR_PREFIX) else "safetensors file"
        problems.append(Problem(path.name, f"stray {kind} not listed in {MANIFEST_NAME}"))
    return _level("manifest", problems, f"{len(manifest.files)} files present with recorded sizes")


def _check_index(out_dir: Path, source: SourceCheckpoint, manifest: Manifest) -> list[Problem]:
    """The index and the shard headers agree both ways, and the manifest vouches for every shard."""
    problems: list[Problem] = []
    index = INDEX_NAME if source.index_path is not None else None
    for file, header in source.headers.items():
        if file not in manifest.source_files:
            listed = f" listed by {index}" if index else ""
            problems.append(Problem(file, f"holds weights{listed} but {MANIFEST_NAME} does not vouch for it"))
        if index is None:
            continue
        for name in sorted(header.tensors):
            mapped = source.weight_map.get(name)
            if mapped != file:
                where = "does not map" if mapped is None else f"maps to {mapped}"
                problems.append(Problem(index, f"{where} tensor '{name}', which {file}'s header holds", name))
    for tensor in manifest.tensors.values():
        for item in tensor.sources:
            header = source.headers.get(item.file)
            if header is None:
                header_tensors = _try_header(out_dir / item.file)
            else:
                header_tensors = header.tensors
            if header_tensors is None or item.name not in header_tensors:
                problems.append(
                    Problem(item.file, f"has no tensor '{item.name}', which {MANIFEST_NAME} says fed '{tensor.name}'", item.name)
                )
    return problems


def _try_header(path: Path) -> dict[str, Any] | None:
    try:
        return read_header(path).tensors
    except FoldckptError:
        return None


def check_structure(out_dir: Path, manifest: Manifest) -> LevelResult:
    problems: list[Problem] = []
    for name in manifest.sidecars:
        try:
            header = read_header(out_dir / name)
        except FoldckptError as exc:
            problems.append(_from_error(out_dir, exc, name))
            continue
        listed = {t.name: t for t in manifest.tensors.values() if t.file == name}
        for tensor_name in sorted(set(header.tensors) - set(listed)):
            problems.append(Problem(name, f"tensor '{tensor_name}' is not in {MANIFEST_NAME}", tensor_name))
        for tensor_name, tensor in listed.items():
            info = header.tensors.get(tensor_name)
            if info is None:
                problems.append(Problem(name, f"tensor '{tensor_name}' listed by {MANIFEST_NAME} is missing", tensor_name))
            elif (info.dtype, info.shape) != (tensor.dtype, tensor.shape):
                problems.append(Problem(
                    name, f"tensor '{tensor_name}' is {info.dtype}{list(info.shape)}, "
                    f"{MANIFEST_NAME} says {tensor.dtype}{list(tensor.shape)}", tensor_name,
                ))  # fmt: skip
    try:
        source = open_source_checkpoint(out_dir, external_links=True)
    except FoldckptError as exc:
        return _level("structure", [*problems, _from_error(out_dir, exc, INDEX_NAME)], "")
    try:
        geometry = read_geometry(out_dir)
    except FoldckptError as exc:
        return _level("structure", [*problems, _from_error(out_dir, exc, "config.json")], "")
    problems += _check_index(out_dir, source, manifest)
    if geometry != manifest.geometry:
        problems.append(Problem("config.json", f"its MLA geometry differs from the one in {MANIFEST_NAME}"))
    for layer in geometry.layers:
        tensor = manifest.tensors.get(layer.q_fold)
        if tensor is None:
            problems.append(Problem(MANIFEST_NAME, f"MLA layer {layer.index} has no fold '{layer.q_fold}'", layer.q_fold))
        elif tensor.shape != geometry.fold_shape:
            problems.append(Problem(
                tensor.file, f"'{layer.q_fold}' has shape {list(tensor.shape)}, "
                f"the geometry implies {list(geometry.fold_shape)}", layer.q_fold,
            ))  # fmt: skip
    summary = (
        f"{len(manifest.sidecars)} sidecar(s), {len(source.headers)} source shard(s), index and "
        f"{len(geometry.layers)} MLA layer(s) consistent"
    )
    return _level("structure", problems, summary)


# ---------------------------------------------------------------------------------------------
# content: one pass per file; the folds' own hashes in the same pass


@dataclass(frozen=True)
class _RangeCheck:
    """A sha256 the manifest records for bytes ``[start, end)`` of a file."""

    kind: str  # "tensor" (a whole fold) | "rank" (one rank's rows of a fold)
    tensor: str
    expected: str
    label: str


@dataclass
class _HashJob:
    name: str
    size: int
    whole: str | None  # the file's recorded sha256, or None to read only the ranges
    ranges: dict[tuple[int, int], list[_RangeCheck]] = field(default_factory=dict)

    def add(self, start: int, end: int, check: _RangeCheck) -> None:
        self.ranges.setdefault((start, end), []).append(check)

    def segments(self) -> list[tuple[int, int]]:
        if self.whole is not None:
            return [(0, self.size)]
        merged: list[list[int]] = []
        for start, end in sorted(self.ranges):
            if merged and start <= merged[-1][1]:
                merged[-1][1] = max(merged[-1][1], end)
            else:
                merged.append([start, end])
        return [(a, b) for a, b in merged]

    @property
    def read_bytes(self) -> int:
        return sum(b - a for a, b in self.segments())

    @property
    def cost(self) -> int:
        """sha256 work in bytes: the read plus every range digest (a sidecar costs twice its size)."""
        return (self.size if self.whole is not None else 0) + sum(b - a for a, b in self.ranges)


# Asked of the kernel ahead of the hashing when a file is not in the page cache (FADV_WILLNEED):
# the disk stays busy while the thread hashes. Measured cold on this project's 2-core test VM:
# read + prefetch 1.4-1.9 GB/s, the same files read without hashing 1.4-1.9, plain 1-8 MiB reads
# 0.9-1.5, a memory map with or without prefetch 0.8-1.5. (Side effect: a later memory-mapped pass
# over files cached this way measured 15-25% slower than over files cached by plain reads.)
_PREFETCH = 64 * 1024 * 1024
_RESIDENCY_PROBES = 16


def _in_page_cache(fd: int, size: int) -> bool:
    """Whether the file looks fully cached: a few evenly spread bytes read with ``RWF_NOWAIT``,
    which fails instead of waiting for the disk."""
    flag = getattr(os, "RWF_NOWAIT", None)
    if size == 0:
        return True
    if flag is None or not hasattr(os, "preadv"):
        return False
    probe = bytearray(1)
    for i in range(_RESIDENCY_PROBES):
        try:
            if os.preadv(fd, [probe], min(size - 1, size * i // (_RESIDENCY_PROBES - 1)), flag) != 1:
                return False
        except OSError:  # EAGAIN: not cached; EOPNOTSUPP: a filesystem without RWF_NOWAIT
            return False
    return True


def _chunks(
    handle: BinaryIO, size: int, segments: list[tuple[int, int]], cached: bool | None = None
) -> Iterator[tuple[int, memoryview]]:
    """``(offset, bytes)`` of ``segments`` in ``HASH_BUFFER`` steps, valid until the next step.

    A file in the page cache is memory-mapped, so sha256 reads the cached pages without the copy
    ``preadv`` makes (7-10% of a core per byte). Any other file is read with ``preadv`` while the
    kernel is asked for the next ``_PREFETCH`` bytes ahead: a memory map waits on each page fault.
    ``cached`` forces one way (tests).
    """
    fd = handle.fileno()
    if size and (_in_page_cache(fd, size) if cached is None else cached):
        with mmap.mmap(fd, 0, access=mmap.ACCESS_READ) as mapped:
            view = memoryview(mapped)
            try:
                for start, end in segments:
                    for pos in range(start, min(end, size), HASH_BUFFER):
                        chunk = view[pos : min(pos + HASH_BUFFER, end, size)]
                        yield pos, chunk
                        chunk.release()
            finally:
                view.release()
        return
    if hasattr(os, "posix_fadvise"):
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_SEQUENTIAL)
    buffer = memoryview(bytearray(HASH_BUFFER))
    for start, end in segments:
        pos = asked = start
        while pos < end:
            if hasattr(os, "posix_fadvise") and asked < end and asked - pos < _PREFETCH // 2:
                os.posix_fadvise(fd, asked, min(_PREFETCH, end - asked), os.POSIX_FADV_WILLNEED)
                asked += _PREFETCH
            count = os.preadv(fd, [buffer[: min(HASH_BUFFER, end - pos)]], pos)
            if not count:
                return  # shorter than recorded: the digests will not match
            yield pos, buffer[:count]
            pos += count


def _hash_job(
    path: Path, job: _HashJob, progress: Callable[[int], object] | None
) -> tuple[str | None, dict[tuple[int, int], str]]:
    """Read the job's segments once, feeding the whole-file digest and every overlapping range digest
    (a range is fed chunk by chunk, right after the whole-file digest, while the bytes are in cache)."""
    whole = hashlib.sha256() if job.whole is not None else None
    bounds = sorted(job.ranges)
    digests = {bound: hashlib.sha256() for bound in bounds}
    pending, active = 0, []  # bounds sorted by start; active = started and not finished
    try:
        with open(path, "rb", buffering=0) as handle:
            size = os.fstat(handle.fileno()).st_size
            segments = [(0, size)] if whole is not None else job.segments()
            for pos, chunk in _chunks(handle, size, segments):
                chunk_end = pos + len(chunk)
                if whole is not None:
                    whole.update(chunk)
                while pending < len(bounds) and bounds[pending][0] < chunk_end:
                    active.append(bounds[pending])
                    pending += 1
                for start, end in active:
                    lo, hi = max(start, pos), min(end, chunk_end)
                    if hi > lo:
                        digests[(start, end)].update(chunk[lo - pos : hi - pos])
                active = [bound for bound in active if bound[1] > chunk_end]
                if progress:
                    progress(len(chunk))
    except OSError as exc:
        raise os_error(path, exc, "hashing") from None
    return (whole.hexdigest() if whole else None), {bound: d.hexdigest() for bound, d in digests.items()}


def _plan_hash_jobs(out_dir: Path, manifest: Manifest, tp: int | None, rank: int | None) -> dict[str, _HashJob]:
    """Every source file whole; every sidecar whole plus each fold tensor (or, for one rank, only
    that rank's row slice of each fold)."""
    rank_mode = tp is not None and rank is not None
    jobs = {name: _HashJob(name, record.size, record.sha256) for name, record in manifest.source_files.items()}
    for name, record in manifest.sidecars.items():
        jobs[name] = _HashJob(name, record.size, None if rank_mode else record.sha256)
    headers: dict[str, dict[str, Any]] = {}
    for name, tensor in manifest.tensors.items():
        if tensor.file not in headers:
            headers[tensor.file] = read_header(out_dir / tensor.file).tensors
        info = headers[tensor.file].get(name)
        if info is None:  # the structure level reports it
            continue
        if tp is None or rank is None:
            jobs[tensor.file].add(info.start, info.end, _RangeCheck("tensor", name, tensor.sha256, f"tensor '{name}'"))
            continue
        first, stop = manifest.geometry.rank_rows(tp, rank)
        row_bytes = info.nbytes // tensor.shape[0]
        label = f"rank {rank}/{tp} slice (rows {first}-{stop - 1}) of '{name}'"
        check = _RangeCheck("rank", name, tensor.rank_sha256[tp][rank], label)
        jobs[tensor.file].add(info.start + first * row_bytes, info.start + stop * row_bytes, check)
    return jobs


def _changed_sources(out_dir: Path, manifest: Manifest, file: str) -> list[Problem]:
    """Which of the fold inputs held by ``file`` differ from the bytes that were folded (only run
    once the file is known to have changed, to name the tensor and the folds it invalidates)."""
    fed: dict[str, tuple[str, list[str]]] = {}
    for tensor in manifest.tensors.values():
        for source in tensor.sources:
            if source.file == file:
                fed.setdefault(source.name, (source.sha256, []))[1].append(tensor.name)
    if not fed:
        return []
    try:
        infos = read_header(out_dir / file).tensors
    except FoldckptError:
        return []  # a broken header: the file-level problem says enough
    problems = []
    for name, (expected, folds) in fed.items():
        info = infos.get(name)
        try:
            changed = info is None or hashlib.sha256(read_tensor_bytes(out_dir / file, info)).hexdigest() != expected
        except FoldckptError:
            changed = True
        if changed:
            names = ", ".join(f"'{fold}'" for fold in folds)
            problems.append(Problem(
                file, f"source tensor '{name}' is not the one folded into {names} at conversion "
                "(modified after conversion; reconvert or restore it)", name,
            ))  # fmt: skip
    return problems


def _judge(job: _HashJob, whole: str | None, ranges: dict[tuple[int, int], str], out_dir: Path, manifest: Manifest) -> list[Problem]:
    problems: list[Problem] = []
    file_ok = whole is not None and whole == job.whole
    if whole is not None and not file_ok:
        problems.append(Problem(
            job.name, f"sha256 {whole[:16]}… differs from {str(job.whole)[:16]}… recorded in {MANIFEST_NAME} "
            "(the file changed since conversion, or the manifest was edited)",
        ))  # fmt: skip
        if job.name in manifest.source_files:
            problems += _changed_sources(out_dir, manifest, job.name)
    failed = [check for bound, checks in sorted(job.ranges.items()) for check in checks if ranges[bound] != check.expected]
    for check in failed:
        if file_ok:  # the bytes are what was converted, so the manifest's own record is wrong
            problems.append(Problem(
                MANIFEST_NAME, f"the recorded sha256 of the {check.label} does not match its bytes in {job.name}, "
                f"although {job.name} matches its recorded sha256: the manifest was edited or is inconsistent",
                check.tensor,
            ))  # fmt: skip
        elif check.kind == "tensor":
            affected = ", ".join(f"{r}/{tp}" for tp, r in _mismatched_ranks(out_dir, manifest, check.tensor))
            what = f"{check.label} differs from its sha256 in {MANIFEST_NAME} (rank slices affected: {affected or 'none'})"
            problems.append(Problem(job.name, what, check.tensor))
        else:
            problems.append(Problem(job.name, f"{check.label} differs from its sha256 in {MANIFEST_NAME}", check.tensor))
    return problems


def _rank_digests(data: bytes | bytearray, rows: int, manifest: Manifest) -> dict[tuple[int, int], str]:
    """sha256 of every rank's row slice, for every recorded TP size, keyed by (tp, rank)."""
    view = memoryview(data)
    row_bytes = len(data) // rows
    digests = {}
    for tp in manifest.tp_sizes:
        for rank in range(tp):
            first, stop = manifest.geometry.rank_rows(tp, rank)
            digests[(tp, rank)] = hashlib.sha256(view[first * row_bytes : stop * row_bytes]).hexdigest()
    return digests


def _mismatched_ranks(out_dir: Path, manifest: Manifest, name: str) -> list[tuple[int, int]]:
    """(tp, rank) of every rank slice of fold ``name`` whose bytes differ from the manifest's hash."""
    tensor = manifest.tensors[name]
    data = read_tensor_bytes(out_dir / tensor.file, read_header(out_dir / tensor.file).tensors[name])
    digests = _rank_digests(data, tensor.shape[0], manifest)
    return sorted(key for key, digest in digests.items() if tensor.rank_sha256[key[0]][key[1]] != digest)


def default_workers(cached: bool = False) -> int:
    """Hashing threads: one per core when every file is in the page cache (sha256 is the only
    work), else two per core, at most 32, so that a core hashes while another thread waits for
    the disk. Measured on 2 cores: cold, 4 threads beat 2 by 10-25%; warm, 2 beat 4 by ~5%."""
    cores = os.cpu_count() or 1
    return cores if cached else min(32, 2 * cores)


def _all_cached(paths: list[Path]) -> bool:
    for path in paths:
        try:
            with open(path, "rb", buffering=0) as handle:
                if not _in_page_cache(handle.fileno(), os.fstat(handle.fileno()).st_size):
                    return False
        except OSError:
            return False
    return True


def check_content(out_dir: Path, manifest: Manifest, options: VerifyOptions) -> LevelResult:
    rank_mode = options.rank is not None and options.tp is not None
    jobs = _plan_hash_jobs(out_dir, manifest, options.tp, options.rank)
    ordered = sorted(jobs.values(), key=lambda job: job.cost, reverse=True)  # longest first: no lone tail
    total = sum(job.read_bytes for job in ordered)
    workers = options.workers or default_workers(_all_cached([out_dir / job.name for job in ordered]))
    workers = max(1, min(workers, len(ordered)))
    with (
        progress_bar(total, "sha256", "B", options.progress) as bar,
        worker_pool(workers) as pool,
    ):
        futures = {job.name: pool.submit(_hash_job, out_dir / job.name, job, bar.update) for job in ordered}
        digests = {name: future.result() for name, future in futures.items()}
    problems: list[Problem] = []
    for name in manifest.files:  # report in manifest order
        problems += _judge(jobs[name], *digests[name], out_dir, manifest)
    if rank_mode:
        scope = f"rank {options.rank}/{options.tp} slices of {len(manifest.tensors)} folds + {len(manifest.source_files)} source files"
    else:
        scope = f"{len(ordered)} files and {len(manifest.tensors)} fold tensors"
    return _level("content", problems, f"sha256 of {scope} ({total / 1e9:.2f} GB) match", bytes_read=total)


# ---------------------------------------------------------------------------------------------
# deep: the math


def _sample_layers(count: int, sample: int | None) -> list[int]:
    if not sample or sample >= count:
        return list(range(count))
    if sample == 1:
        return [count - 1]
    from foldckpt.fold import sample_heads

    return list(sample_heads(count, sample))


def check_deep(out_dir: Path, manifest: Manifest, options: VerifyOptions) -> LevelResult:
    import torch

    from foldckpt.fold import ROUNDING_TOLERANCE, fold_error, fold_layer, probe_error
    from foldckpt.layer import load_layer_inputs, nonfinite_fold_problem
    from foldckpt.plan import FOLD_DTYPES, plan_conversion

    plan = plan_conversion(
        out_dir, manifest.fold_dtype, int(manifest.parameters.get("max_shard_size", 5 * 1024**3)), manifest.tp_sizes,
        external_links=True,
    )  # fmt: skip
    tolerance = ROUNDING_TOLERANCE[FOLD_DTYPES[manifest.fold_dtype]]
    geometry = plan.geometry
    problems: list[Problem] = []
    for name, tensor in manifest.tensors.items():  # every fold's per-rank hashes, not only the sampled layers
        data = read_tensor_bytes(out_dir / tensor.file, read_header(out_dir / tensor.file).tensors[name])
        if hashlib.sha256(data).hexdigest() != tensor.sha256:  # only when called without the content level
            problems.append(Problem(tensor.file, f"tensor '{name}' differs from its sha256 in {MANIFEST_NAME}", name))
            continue
        for (tp, rank), digest in _rank_digests(data, tensor.shape[0], manifest).items():
            if tensor.rank_sha256[tp][rank] != digest:
                first, stop = geometry.rank_rows(tp, rank)
                problems.append(Problem(
                    MANIFEST_NAME, f"the recorded sha256 of the rank {rank}/{tp} slice (rows {first}-{stop - 1}) of "
                    f"'{name}' does not match its bytes in {tensor.file}: a serving node of TP {tp} would reject it",
                    name,
                ))  # fmt: skip
    rank_hashes = sum(len(hashes) for t in manifest.tensors.values() for hashes in t.rank_sha256.values())

    @functools.cache
    def file_intact(file: str) -> bool:
        record = manifest.source_files.get(file)
        return record is not None and sha256_file(out_dir / file) == record.sha256

    bitwise, worst_error, worst_probe = 0, 0.0, 0.0
    chosen = [plan.layers[i] for i in _sample_layers(len(plan.layers), options.sample)]
    heads = tuple(range(geometry.num_heads))
    bar = progress_bar(len(chosen), "recomputing", "layer", options.progress)
    for layer in chosen:
        bar.update(1)
        record = manifest.tensors.get(layer.output.name)
        if record is None:
            problems.append(Problem(MANIFEST_NAME, f"no fold recorded for MLA layer {layer.layer.index}", layer.output.name))
            continue
        inputs = load_layer_inputs(plan, layer, allow_nonfinite=True)
        recorded = {source.name: source.sha256 for source in record.sources}
        changed = [source for source in inputs.sources if recorded.get(source.name) != source.sha256]
        for source in changed:
            if file_intact(source.file):  # the bytes are those converted: the manifest's record is wrong
                problems.append(Problem(
                    MANIFEST_NAME, f"the recorded sha256 of source tensor '{source.name}' does not match its bytes in "
                    f"{source.file}, although {source.file} matches its recorded sha256: the manifest was edited "
                    "or is inconsistent", source.name,
                ))  # fmt: skip
            else:
                problems.append(Problem(
                    source.file, f"source tensor '{source.name}' changed since conversion: '{record.name}' was folded "
                    "from other bytes (reconvert or restore it)", source.name,
                ))  # fmt: skip
        if changed:
            continue  # the stored fold cannot be expected to match sources it was not made from
        header = read_header(out_dir / record.file)
        stored = read_tensor(out_dir / record.file, header.tensors[record.name])
        recomputed = fold_layer(inputs.q_b_proj, inputs.kv_b_proj, geometry, stored.dtype)
        nonfinite = nonfinite_fold_problem(stored, inputs, manifest.fold_dtype)
        if nonfinite is not None:
            problems.append(Problem(record.file, f"'{record.name}': {nonfinite}", record.name))
            continue
        same = torch.equal(stored, recomputed)
        bitwise += same
        error = 0.0 if same else fold_error(stored, inputs.q_b_proj, inputs.kv_b_proj, geometry, heads).rel_fro_error
        probe = probe_error(stored, inputs.q_b_proj, inputs.kv_b_proj, geometry)
        worst_error, worst_probe = max(worst_error, error), max(worst_probe, probe)
        if not (error <= tolerance and probe <= 2 * tolerance):  # NaN fails too
            problems.append(Problem(
                record.file, f"'{record.name}' is not the fold of its sources (relative error vs fp64 {error:.2e}, "
                f"probe x·W_foldᵀ vs two-step query {probe:.2e}, tolerance {tolerance:.1e})", record.name,
            ))  # fmt: skip
    bar.close()
    summary = (
        f"{rank_hashes} per-rank hashes match; {len(chosen)}/{len(plan.layers)} layer(s) recomputed: {bitwise} bitwise identical, "
        f"{len(chosen) - bitwise} within {tolerance:.1e} of fp64 (worst {worst_error:.1e}); "
        f"probe x·W_foldᵀ vs unfolded query worst relative error {worst_probe:.1e}"
    )
    return _level("deep", problems, summary)


def _check_options(out_dir: Path, manifest: Manifest, options: VerifyOptions) -> None:
    if (options.rank is None) != (options.tp is None):
        raise FoldckptError("--rank and --tp go together")
    if options.tp is None:
        return
    if options.tp not in manifest.tp_sizes:
        raise FoldckptError(
            f"{out_dir / MANIFEST_NAME}: has per-rank hashes for TP {list(manifest.tp_sizes)}, not {options.tp}; "
            "reconvert with --tp to add it"
        )
    if not 0 <= options.rank < options.tp:  # type: ignore[operator]
        raise FoldckptError(f"--rank {options.rank} is outside TP {options.tp} (ranks 0-{options.tp - 1})")


def verify(out_dir: Path, options: VerifyOptions = VerifyOptions()) -> VerifyReport:
    """Run the verification levels up to ``options.level``; raises FoldckptError if unusable."""
    if options.level not in LEVELS:
        raise FoldckptError(f"unknown verification level {options.level!r}; choose one of {', '.join(LEVELS)}")
    begun = time.perf_counter()
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise FoldckptError(f"{out_dir}: not a directory" if out_dir.exists() else f"{out_dir}: no such directory")
    if not os.access(out_dir, os.R_OK | os.X_OK):
        raise FoldckptError(f"{out_dir}: permission denied; cannot read the directory")
    manifest = read_manifest(out_dir)
    _check_options(out_dir, manifest, options)
    checks = {
        "manifest": lambda: check_manifest(out_dir, manifest),
        "structure": lambda: check_structure(out_dir, manifest),
        "content": lambda: check_content(out_dir, manifest, options),
        "deep": lambda: check_deep(out_dir, manifest, options),
    }
    results: list[LevelResult] = []
    for name in LEVELS[: LEVELS.index(options.level) + 1]:
        started = time.perf_counter()
        result = checks[name]()
        results.append(dataclasses.replace(result, elapsed_s=time.perf_counter() - started))
        if not result.ok:
            break
    return VerifyReport(out_dir, tuple(results), time.perf_counter() - begun)
