"""Orchestration of ``foldckpt convert``: plan -> place sources -> fold -> sidecars -> manifest.

One direction, one layer at a time: peak memory is a layer's q_b_proj and kv_b_proj in fp32 plus
its fold, whatever the size of the model. Every durable step is journaled (see
:mod:`foldckpt.convert.journal`), so a killed run resumes where it stopped and produces the same bytes as
an uninterrupted one; the manifest is written last and its presence means "finished".
"""

from __future__ import annotations

import errno
import gc
import json
import os

# OpenMP threads that spin after every parallel region take the cycles the hashing threads need:
# on a 16-core H200 host a 16-layer conversion burned 91 core-s and took 14.6 s with spinning
# (the default), 24 core-s and 11.1 s without (docs/bench/convert.json). Only effective before
# torch is first imported (as in the CLI); an explicit setting wins.
os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")
import shutil
import time
from collections import deque
from collections.abc import Callable, Iterable, Iterator
from contextlib import contextmanager
from concurrent.futures import Executor, Future, wait
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from foldckpt.model.checkpoint import INDEX_NAME
from foldckpt.format.consistency import heads_intact, sidecar_intact
from foldckpt.defaults import (
    ACCUMULATION_DTYPE,
    nan_last,
    require_fold_device,
    resolve_fold_device,
)
from foldckpt.io.direct_io import DiskPriority
from foldckpt.errors import FoldckptError
from foldckpt.io.files import (
    atomic_output,
    busy_error,
    check_removable,
    exclusive_lock,
    fingerprint,
    is_locked,
    is_tmp_path,
    os_error,
    place_file,
    remove_placed,
    remove_stale_tmp_files,
    sha256_file,
    tmp_path_for,
    vanished,
    worker_pool,
)
from foldckpt.io.hashing import default_workers
from foldckpt.model.hub import ModelSource
from foldckpt.inspect import FoldedLayer
from foldckpt.convert.journal import JOURNAL_NAME, Journal, ShardProgress, differences, manifest_identity, run_identity, run_key
from foldckpt.format.manifest import (
    MANIFEST_NAME,
    FileRecord,
    FoldTensor,
    Manifest,
    SidecarRecord,
    listed_files,
    read_manifest,
    write_manifest,
)
from foldckpt.convert.plan import (
    DEFAULT_MAX_SHARD_SIZE,
    SIDECAR_METADATA,
    SIDECAR_PREFIX,
    ConversionPlan,
    LayerPlan,
    ShardPlan,
    plan_conversion,
)
from foldckpt.options import ConvertOptions
from foldckpt.progress import progress_bar
from foldckpt.format.sidecar import ShardWriter
from foldckpt.signals import import_torch
from foldckpt.convert.source_reads import IOCounters, SourceReads

if TYPE_CHECKING:
    from foldckpt.convert.layer import Fetch, FoldRing

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "ConvertOptions", "ConvertResult", "LayerOutcome", "convert"]


@dataclass(frozen=True)
class LayerOutcome(FoldedLayer):
    """One MLA layer of the result (what ``inspect`` shows of it) and whether this run folded it
    (``folded``), an earlier interrupted run did (``resumed``), or the output was already complete
    (``up_to_date``)."""

    status: str


@dataclass(frozen=True)
class ConvertResult:
    out_dir: Path
    up_to_date: bool
    layers_total: int
    layers_folded: int
    layers_resumed: int
    sidecars: dict[str, int]
    fold_bytes: int
    placed: dict[str, int] = field(default_factory=dict)
    max_rel_error: float = 0.0
    elapsed_s: float = 0.0
    layers: tuple[LayerOutcome, ...] = ()
    model: str = ""
    source: dict[str, Any] | None = None
    # Files of OUT_DIR found missing or damaged by this run and placed or written again.
    repaired: tuple[str, ...] = ()
    # Source files of an earlier run placed again as --link asks (e.g. copies for hard links).
    replaced: tuple[str, ...] = ()
    fold_device: str = "cpu"
    # What this run read, hashed, wrote and copied, and each stage's busy time (IOCounters).
    io: dict[str, Any] = field(default_factory=dict)

    @property
    def worst_layer(self) -> LayerOutcome | None:
        return max(self.layers, key=lambda layer: nan_last(layer.rel_fro_error), default=None)

    def to_dict(self) -> dict[str, Any]:
        worst = self.worst_layer
        return {
            **self.__dict__,
            "out_dir": str(self.out_dir),
            "layers": [layer.to_dict() for layer in self.layers],
            "folded_layers": [layer.index for layer in self.layers if layer.status == "folded"],
            "resumed_layers": [layer.index for layer in self.layers if layer.status == "resumed"],
            "worst_layer": worst.index if worst else None,
        }


def _worst(errors: Iterable[float]) -> float:
    return max(errors, key=nan_last, default=0.0)


def _output_parameters(plan: ConversionPlan, options: ConvertOptions, device: str) -> dict[str, Any]:
    """The parameters that shape the output bytes (and so key resumption and idempotence): a GPU
    accumulates in another order than the CPU, so a few folded values may round the other way."""
    return {
        "fold_dtype": plan.fold_dtype,
        "accumulation_dtype": ACCUMULATION_DTYPE,
        "max_shard_size": options.max_shard_size,
        "fold_device": device,
    }


def _previous_run(out_dir: Path, placed: Iterable[str]) -> dict[str, bool]:
    """What clearing an earlier run removes (name: whether it may be a symlink), checked: its
    sidecars, the source files it placed (``placed``: links or copies inside OUT_DIR, never the
    originals), journal and manifest, so that a restart onto another model leaves nothing of the
    old one behind. The names come from a manifest or journal found in OUT_DIR, which anyone who
    can write there can edit: each must be a regular file (or, among the sources, a symlink:
    ``--link symlink``) reached without a symlink on the way, else the run is refused before the
    first removal (:func:`check_removable`). The journal and the manifest go last: a restart
    killed midway leaves OUT_DIR still reading as a foldckpt output, which the same command then
    clears (removed first, the rest read as foreign files)."""
    sidecars = sorted(path.name for path in out_dir.glob(f"{SIDECAR_PREFIX}*.safetensors"))
    entries = {**dict.fromkeys(sidecars, False), **dict.fromkeys(placed, True)}
    entries.update({JOURNAL_NAME: False, MANIFEST_NAME: False})
    return {name: links for name, links in entries.items() if check_removable(out_dir, name, links)}


def _remove(path: Path) -> None:
    try:
        path.unlink()
    except OSError as exc:
        raise os_error(path, exc, "removing") from None


def _size(path: Path) -> int:
    """The size of a file the plan found (a source, or its placed copy or link), or one line naming
    it when it is gone since: another process may remove a file while convert runs."""
    try:
        return path.stat().st_size
    except FileNotFoundError:
        raise vanished(path) from None
    except OSError as exc:
        raise os_error(path, exc, "reading") from None


def _holds_foreign_files(out_dir: Path) -> bool:
    """Whether ``out_dir`` has entries other than temporary files, which are all that a run killed
    before its first journal save leaves behind."""
    try:
        return out_dir.exists() and any(not is_tmp_path(p) for p in out_dir.iterdir())
    except OSError as exc:  # a file, or an unreadable directory
        raise os_error(out_dir, exc, "listing the output directory") from None


def _generated_files(plan: ConversionPlan) -> dict[str, bytes]:
    """Files OUT_DIR gets that MODEL_DIR lacks. A source without a safetensors index (a single
    ``model.safetensors``, or shards without an index) gets one listing its own weights: without
    it vLLM loads every top-level ``*.safetensors``, the sidecars included, and fails on the fold
    names; with it vLLM (and transformers) load only the files the index lists."""
    if plan.source.index_path is not None:
        return {}
    weight_map = dict(sorted(plan.source.weight_map.items()))
    total = sum(plan.source.headers[file].tensors[name].nbytes for name, file in weight_map.items())
    index = {"metadata": {"total_size": total, "generated_by": "foldckpt"}, "weight_map": weight_map}
    return {INDEX_NAME: (json.dumps(index, indent=2) + "\n").encode()}


def _check_overlap(model_dir: Path, out_dir: Path) -> None:
    """Refuse an OUT_DIR that is, contains, or lies inside MODEL_DIR, by path and by identity
    (device and inode): through a bind mount the same directory has a path of its own, and
    convert wrote its sidecars into MODEL_DIR, or carried a whole output along in it."""
    source, target = model_dir.resolve(), out_dir.resolve()
    by_path = target == source or target.is_relative_to(source) or source.is_relative_to(target)
    if by_path or _identity(source) in _identities(target) or _identity(target) in _identities(source):
        raise FoldckptError(
            f"{out_dir}: the output must not be, contain, or lie inside the model directory {model_dir}"
        )


def _identity(path: Path) -> tuple[int, int] | None:
    try:
        status = path.stat()
    except OSError:
        return None
    return status.st_dev, status.st_ino


def _identities(path: Path) -> set[tuple[int, int]]:
    """The identities of ``path`` and of each of its parents that exist."""
    return {identity for identity in map(_identity, [path, *path.parents]) if identity is not None}


def _hard_link_note(out_path: Path, src_path: Path) -> str:
    out_fp, src_fp = fingerprint(out_path), fingerprint(src_path)
    if out_fp is not None and src_fp is not None and out_fp[:2] == src_fp[:2]:
        return f" ({out_path} is a hard link of it: editing either edits both)"
    return ""


def _changed_source(out_dir: Path, src_path: Path, name: str, recorded: str, finished: bool) -> FoldckptError:
    what = "finished conversion" if finished else "unfinished conversion"
    advice = "pass --restart to reconvert" if finished else "refusing to mix results: pass --restart to start over"
    return FoldckptError(
        f"{src_path}: changed since {out_dir} was converted from it (sha256 recorded {recorded[:16]}…)"
        f"{_hard_link_note(out_dir / name, src_path)}; {out_dir} holds a {what} of the earlier bytes; "
        f"restore the file, or {advice}"
    )


def _holds(path: Path, cheap: bool, sha256: str | None) -> bool:
    """Whether ``path`` holds the bytes whose sha256 is recorded: ``cheap`` evidence (an unchanged
    fingerprint) is trusted, else the file is hashed."""
    if not path.is_file():
        return False
    if cheap:
        return True
    return sha256 is not None and sha256_file(path) == sha256


def _recheck_journal(plan: ConversionPlan, out_dir: Path, journal: Journal, generated: dict[str, bytes]) -> list[str]:
    """Check that every file the journal says is placed still holds the recorded bytes, in OUT_DIR
    and in MODEL_DIR (fingerprints first, sha256 where they differ). What is damaged in OUT_DIR
    only is dropped from the journal, to be placed (and hashed) again: returns those names. A
    source that changed after it was hashed (folds may come from it) is refused, naming it."""
    model_dir = plan.source.model_dir
    redo: list[str] = []
    for name in list(journal.placed):
        prints = journal.fingerprints.get(name, {})
        record = journal.source_hashes.get(name)
        sha = record["sha256"] if record else None
        out_path, src_path = out_dir / name, model_dir / name
        out_now = fingerprint(out_path)
        out_ok = _holds(out_path, out_now is not None and out_now == prints.get("out"), sha)
        if name in generated:
            out_ok = out_ok and out_path.read_bytes() == generated[name]
            src_ok = True
        else:
            src_now = fingerprint(src_path)
            if src_now is not None and out_now is not None and src_now[:2] == out_now[:2]:
                src_ok = out_ok  # one inode: the same bytes
            else:
                src_ok = _holds(src_path, src_now is not None and src_now == prints.get("src"), sha)
        if sha is not None and not src_ok:
            raise _changed_source(out_dir, src_path, name, sha, finished=False)
        if not (out_ok and src_ok):
            for table in (journal.placed, journal.source_hashes, journal.fingerprints):
                table.pop(name, None)
            redo.append(name)
        elif sha is not None:  # e.g. touched, same bytes: trust the new fingerprints from now on
            journal.fingerprints[name] = {"out": out_now, "src": None if name in generated else fingerprint(src_path)}
    for shard in plan.shards:  # a finished sidecar edited or replaced since: fold it again
        progress = journal.shards.get(shard.name)
        path = out_dir / shard.name
        if progress is None or progress.done is None or not path.exists():
            continue
        now = fingerprint(path)
        if now != journal.fingerprints.get(shard.name, {}).get("out") and not _sidecar_holds(path, progress, plan):
            journal.shards[shard.name] = ShardProgress()
            journal.fingerprints.pop(shard.name, None)
            remove_placed(out_dir, {shard.name: False})
            redo.append(shard.name)
    return redo


def _sidecar_holds(path: Path, progress: ShardProgress, plan: ConversionPlan) -> bool:
    """Whether a finished sidecar the journal records still holds its bytes (hashed: its
    fingerprint changed)."""
    assert progress.done is not None
    folds = [FoldTensor.from_dict(name, record) for name, record in progress.tensors.items()]
    return sidecar_intact(path, SidecarRecord.from_dict(progress.done), folds, plan.geometry.num_heads)


def _how_placed(out_path: Path, src_path: Path) -> str:
    if out_path.is_symlink():
        return "symlink"
    out_fp, src_fp = fingerprint(out_path), fingerprint(src_path)
    return "hard" if out_fp and src_fp and out_fp[:2] == src_fp[:2] else "copy"


def _recheck_manifest(
    plan: ConversionPlan, out_dir: Path, manifest: Manifest, key: str, generated: dict[str, bytes]
) -> tuple[Journal | None, list[str]]:
    """A finished output of this very run key: check that every file it vouches for still holds
    the recorded bytes. A file whose inode changed (ctime) after the manifest was written is
    hashed; the others are trusted on their size. Returns (None, []) when all is intact; else a
    journal that redoes only what is damaged in OUT_DIR, and the damaged names. A source changed
    in MODEL_DIR is refused, naming it."""
    model_dir = plan.source.model_dir
    stat = (out_dir / MANIFEST_NAME).stat()
    since = min(stat.st_mtime_ns, stat.st_ctime_ns)

    def quiet(path: Path, size: int) -> bool:  # unchanged since the manifest was written
        now = fingerprint(path)
        return now is not None and now[2] == size and now[4] < since

    journal = Journal(out_dir / JOURNAL_NAME, key)
    damaged: list[str] = []
    for name, record in manifest.source_files.items():
        out_path, src_path = out_dir / name, model_dir / name
        out_ok = _holds(out_path, quiet(out_path, record.size), record.sha256)
        if name in generated:
            out_ok = out_ok and out_path.read_bytes() == generated[name]
        else:
            out_fp, src_fp = fingerprint(out_path), fingerprint(src_path)
            same_inode = out_fp is not None and src_fp is not None and out_fp[:2] == src_fp[:2]
            src_ok = out_ok if same_inode else _holds(src_path, quiet(src_path, record.size), record.sha256)
            if not src_ok:
                raise _changed_source(out_dir, src_path, name, record.sha256, finished=True)
        if not out_ok:
            damaged.append(name)
            continue
        journal.placed[name] = "generated" if name in generated else _how_placed(out_path, src_path)
        journal.source_hashes[name] = record.to_dict()
        journal.fingerprints[name] = {"out": fingerprint(out_path), "src": fingerprint(src_path)}
    for name, record in manifest.sidecars.items():
        path = out_dir / name
        folds = [tensor for tensor in manifest.tensors.values() if tensor.file == name]
        if not (quiet(path, record.size) or sidecar_intact(path, record, folds, plan.geometry.num_heads)):
            damaged.append(name)
            continue
        progress = journal.shard(name)
        progress.offset, progress.done = record.size, record.to_dict()
        progress.tensors = {t.name: t.to_dict() for t in manifest.tensors.values() if t.file == name}
        journal.fingerprints[name] = {"out": fingerprint(path)}
    if not damaged:
        return None, []
    journal.save()  # before the manifest goes: OUT_DIR must always read as ours
    (out_dir / MANIFEST_NAME).unlink()
    remove_placed(out_dir, {name: False for name in damaged if name in manifest.sidecars})
    return journal, damaged


@dataclass(frozen=True)
class _Found:
    """What OUT_DIR holds for a run of one run key, read without changing anything: ``new`` (no
    OUT_DIR yet), ``empty`` (nothing of ours, nothing foreign, or ``--overwrite``), ``resume`` (an
    unfinished run of this key: ``journal``), ``finished`` (a finished run of this key:
    ``manifest``) or ``replace`` (an earlier run that ``--restart`` or ``--overwrite`` clears:
    ``clear``, the entries to remove). Every other case is refused."""

    state: str
    journal: Journal | None = None
    manifest: Manifest | None = None
    clear: dict[str, bool] = field(default_factory=dict)


def _find(out_dir: Path, key: str, identity: dict[str, Any], options: ConvertOptions) -> _Found:
    """Decide between a fresh run, a resume (or repair), "already done", or clearing an earlier
    run; refuse the rest, saying which input or parameter differs from the earlier run's."""
    if not out_dir.exists():
        return _Found("new")
    journal_path = out_dir / JOURNAL_NAME
    discard = options.restart or options.overwrite
    if (out_dir / MANIFEST_NAME).exists():
        if discard:  # whatever the manifest is (another format, edited): it only names what to remove
            return _Found("replace", clear=_previous_run(out_dir, listed_files(out_dir)))
        manifest = read_manifest(out_dir)
        if manifest.parameters.get("run_key") == key:
            return _Found("finished", manifest=manifest)
        raise FoldckptError(
            f"{out_dir}: holds a finished conversion of other inputs or parameters"
            f"{differences(manifest_identity(manifest), identity)}; pass --restart to replace it"
        )
    if journal_path.exists():
        journal = Journal.load(journal_path)
        if journal.run_key == key and not discard:
            return _Found("resume", journal=journal)
        if not discard:
            raise FoldckptError(
                f"{out_dir}: holds an unfinished conversion of other inputs or parameters"
                f"{differences(journal.identity, identity)}; refusing to mix results: pass --restart to start over"
            )
        return _Found("replace", clear=_previous_run(out_dir, journal.placed))
    if not options.overwrite and _holds_foreign_files(out_dir):
        raise FoldckptError(
            f"{out_dir}: not empty and not a foldckpt output; choose an empty directory or pass --overwrite"
        )
    return _Found("empty")


def _prepare_out_dir(
    plan: ConversionPlan, out_dir: Path, key: str, identity: dict[str, Any], generated: dict[str, bytes],
    options: ConvertOptions,
) -> tuple[Journal | None, list[str]]:  # fmt: skip
    """Act on what OUT_DIR holds (:func:`_find`, again under the lock). Returns the journal of the
    run (None: already done) and the names found damaged (to be redone)."""
    found = _find(out_dir, key, identity, options)
    journal_path = out_dir / JOURNAL_NAME
    if found.manifest is not None:
        if journal_path.exists():  # only then: removing nothing fails too on a read-only filesystem
            _remove(journal_path)
        return _recheck_manifest(plan, out_dir, found.manifest, key, generated)
    if found.journal is not None:
        redo = _recheck_journal(plan, out_dir, found.journal, generated)
        found.journal.save()
        return found.journal, redo
    if found.clear:
        remove_placed(out_dir, found.clear)
        remove_stale_tmp_files(out_dir)
    journal = Journal(journal_path, key, identity=identity, model=plan.source.model_dir, layers=len(plan.layers))
    journal.save()  # before any other file: a killed run must leave an OUT_DIR that reads as ours
    return journal, []


def _to_place(plan: ConversionPlan, out_dir: Path, found: _Found | Journal, link: str) -> tuple[list[str], int]:
    """The source files a run places (again) and the sidecar bytes it writes, given what OUT_DIR
    holds (``found``, or the journal of the run under way)."""
    journal = found if isinstance(found, Journal) else found.journal
    if journal is not None:
        names = [name for name in plan.files_to_place if name not in journal.placed]
        names += _placed_otherwise(journal.placed, link, journal.placed.__getitem__)
        return names, sum(s.size for s in plan.shards if not journal.shard(s.name).done)
    if isinstance(found, _Found) and found.manifest is not None:
        model_dir = plan.source.model_dir
        return _placed_otherwise(plan.files_to_place, link, lambda n: _how_placed(out_dir / n, model_dir / n)), 0
    return list(plan.files_to_place), plan.sidecar_bytes


def _placement(plan: ConversionPlan, out_dir: Path, names: list[str], link: str) -> dict[str, str]:
    """How each source file of ``names`` will be placed: ``hard``, ``copy`` or ``symlink``. ``auto``
    hard-links a file on OUT_DIR's filesystem (that of the file a Hugging Face snapshot entry
    links to) and copies the others; ``--link hard`` across filesystems is refused here, before
    anything is written, where link(2) would fail after the first files were placed."""
    if link in ("copy", "symlink"):
        return dict.fromkeys(names, link)
    device = os.stat(_nearest_existing(out_dir)).st_dev
    placement: dict[str, str] = {}
    for name in names:
        source = plan.source.model_dir / name
        try:
            same = os.stat(source).st_dev == device
        except FileNotFoundError:
            raise vanished(source) from None
        if not same and link == "hard":
            raise FoldckptError.at(
                source, f"on another filesystem than {out_dir}: --link hard cannot link across filesystems; "
                "use --link auto (copies such files) or --link copy"
            )  # fmt: skip
        placement[name] = "hard" if same else "copy"
    return placement


def _require_free_space(plan: ConversionPlan, out_dir: Path, sidecar_bytes: int, placement: dict[str, str]) -> int:
    """Refuse before writing when OUT_DIR's filesystem cannot hold ``sidecar_bytes`` plus the
    source files that ``placement`` copies; returns the bytes free."""
    needed = sidecar_bytes + _copy_bytes(plan, placement)
    free = shutil.disk_usage(_nearest_existing(out_dir)).free
    if needed > free:
        raise FoldckptError(
            f"{out_dir}: needs {needed / 1e9:.3g} GB free but has {free / 1e9:.3g} GB; free space first"
        )
    return free


def _copy_bytes(plan: ConversionPlan, placement: dict[str, str]) -> int:
    return sum(_size(plan.source.model_dir / name) for name, how in placement.items() if how == "copy")


def _nearest_existing(path: Path) -> Path:
    """``path`` or, where it does not exist yet, the nearest parent that does (where it will be)."""
    return next(folder for folder in (path, *path.absolute().parents) if folder.exists())


def _check_writable(out_dir: Path) -> None:
    """Refuse an OUT_DIR that cannot be written (or, not there yet, made): a read-only filesystem
    or no write permission, said before anything is written (the journal's first save failed)."""
    folder = _nearest_existing(out_dir)
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        problem = errno.EROFS
    elif not os.access(folder, os.W_OK | os.X_OK):
        problem = errno.EACCES
    else:
        return
    action = "writing" if folder == out_dir else f"creating {out_dir}"
    raise os_error(folder, OSError(problem, os.strerror(problem)), action)


def _place_sources(
    plan: ConversionPlan, out_dir: Path, journal: Journal, options: ConvertOptions, generated: dict[str, bytes],
    counters: IOCounters,
) -> None:  # fmt: skip
    """Place every source file (and write the generated ones), journaling each with the
    fingerprints that later runs check it against."""
    otherwise = set(_placed_otherwise(journal.placed, options.link, journal.placed.__getitem__))
    todo = [n for n in plan.files_to_place if not (n in journal.placed and (out_dir / n).exists()) or n in otherwise]
    total = sum(_size(plan.source.model_dir / n) for n in todo)
    with progress_bar(total, "placing sources", "B", options.progress) as bar:
        for name in todo:
            size = _size(plan.source.model_dir / name)
            with counters.timed("place"):
                how = place_file(plan.source.model_dir / name, out_dir / name, options.link, root=out_dir)
            bar.update(size)
            if how == "copy":
                counters.add(read=size, written=size, copied=size)
            journal.placed[name] = how
            journal.fingerprints[name] = {"out": fingerprint(out_dir / name), "src": fingerprint(plan.source.model_dir / name)}
            journal.save()
    for name, data in generated.items():
        if name in journal.placed and (out_dir / name).exists():
            continue
        with atomic_output(out_dir / name, out_dir) as handle:
            handle.write(data)
        counters.add(written=len(data))
        journal.placed[name] = "generated"
        journal.fingerprints[name] = {"out": fingerprint(out_dir / name), "src": None}
        journal.save()


def _placed_otherwise(names: Iterable[str], link: str, how: Callable[[str], str]) -> list[str]:
    """The placed files (of ``names``; ``how(name)``: hard, copy, symlink or generated) that an
    explicit ``--link`` wants placed another way (``auto`` takes any). Why: a rerun with ``--link
    copy``, which README advises before editing OUT_DIR's files, must leave copies, not the hard
    links of an earlier run, through which the edits would change MODEL_DIR."""
    if link == "auto":
        return []
    return [name for name in names if how(name) not in (link, "generated")]


def _replace_placed_otherwise(plan: ConversionPlan, out_dir: Path, link: str) -> list[str]:
    """In a finished output (just rechecked: every file holds the bytes its manifest records),
    place again as ``link`` asks each source file placed otherwise; returns their names. The
    manifest's bytes stay as they are (it records no placement), and its time becomes now, so that
    later runs trust the new entries on their fingerprints instead of hashing them."""
    model_dir = plan.source.model_dir
    names = _placed_otherwise(plan.files_to_place, link, lambda name: _how_placed(out_dir / name, model_dir / name))
    if not names:
        return []
    _require_free_space(plan, out_dir, 0, _placement(plan, out_dir, names, link))
    for name in names:
        place_file(model_dir / name, out_dir / name, link, root=out_dir)
    os.utime(out_dir / MANIFEST_NAME, follow_symlinks=False)
    return names


def _fold_order(plan: ConversionPlan, journal: Journal) -> list[LayerPlan]:
    """The layers still to fold, in sidecar order."""
    return [
        layer
        for shard in plan.shards
        if not (journal.shard(shard.name).done)
        for layer in shard.layers
        if layer.output.name not in journal.shard(shard.name).tensors
    ]


def _source_reads(
    plan: ConversionPlan, out_dir: Path, journal: Journal, todo: list[LayerPlan], counters: IOCounters, bar: Any,
    priority: DiskPriority, device: str,
) -> SourceReads:  # fmt: skip
    """The hashing passes of this run: every placed file not hashed yet, those feeding the first
    layers to fold first (then the largest), so that the fold waits as little as possible; a fold
    on ``device`` other than the CPU releases its inputs itself, once they are there."""
    inputs = {(file, info.name): info for layer in plan.layers for file, info in layer.input_tensors()}
    wanted = {(file, info.name): position for position, layer in enumerate(todo) for file, info in layer.input_tensors()}
    recorded = {
        (source["file"], source["name"]): source["blake3"]
        for progress in journal.shards.values()
        for record in progress.tensors.values()
        for source in record["sources"]
    }
    first_use: dict[str, int] = {}
    for position, layer in enumerate(todo):
        for file, _ in layer.input_tensors():
            first_use.setdefault(file, position)
    sizes = {n: _size(out_dir / n) for n in journal.placed if n not in journal.source_hashes}
    order = sorted(sizes, key=lambda n: (first_use.get(n, len(todo)), -sizes[n]))

    def on_hashed(name: str, record: FileRecord) -> None:
        with journal.lock:
            journal.source_hashes[name] = record.to_dict()
            journal.save()

    return SourceReads(
        out_dir, {n: sizes[n] for n in order}, inputs, wanted, recorded, on_hashed, bar.update, counters,
        priority=priority, fold_releases=device != "cpu",
    )  # fmt: skip


def _hash_and_fold(
    plan: ConversionPlan, out_dir: Path, journal: Journal, options: ConvertOptions, counters: IOCounters, device: str
) -> list[str]:
    """Hash every placed source not hashed yet and fold every layer not folded yet, overlapped:
    hashing passes (threads; hashlib frees the GIL) hand the fold its inputs as they go by, the fold
    runs on the cores torch has (or a GPU), the previous layer's write and fsync run in a thread of
    their own. Returns the folds (tensor names) made in this run."""
    todo = _fold_order(plan, journal)
    cores = os.cpu_count() or 1
    hashers = options.workers or default_workers()
    source_bytes = sum(_size(out_dir / n) for n in journal.placed if n not in journal.source_hashes)
    folded: list[str] = []
    with (
        progress_bar(len(plan.layers), "folding", "layer", options.progress, position=1) as fold_bar,
        progress_bar(source_bytes, "hashing sources", "B", options.progress, position=0) as hash_bar,  # closes first
        worker_pool(max(1, hashers // 2)) as feeding_pool,
        worker_pool(max(1, hashers - hashers // 2)) as other_pool,
        worker_pool(cores) as leaf_pool,
        worker_pool(1) as write_pool,
    ):
        # the sidecar appends go before the passes over files that feed no layer (DiskPriority)
        priority = DiskPriority()
        reads = _source_reads(plan, out_dir, journal, todo, counters, hash_bar, priority, device)
        reads.start(feeding_pool, other_pool)
        try:
            with _collector_paused():
                import_torch()  # only once there is something to fold
                from foldckpt.convert.layer import FoldRing

                require_fold_device(device, "nothing was folded: rerun with --device cpu or auto, and --restart")
                ring = FoldRing(waiting=lambda: counters.timed("fold_waiting_for_writes"))
                for shard in plan.shards:
                    if journal.shard(shard.name).done and (out_dir / shard.name).exists():
                        fold_bar.update(len(shard.layers))
                        continue
                    folded += _write_shard(
                        plan, shard, out_dir, journal, options, (reads.take, reads.release, device, ring), counters,
                        leaf_pool, write_pool, fold_bar, priority,
                    )  # fmt: skip
                reads.wait()
        except BaseException:
            reads.stop()
            raise
    return folded


@contextmanager
def _collector_paused() -> Iterator[None]:
    """Python's cyclic garbage collector off (if it was on) while torch is imported and the layers
    are folded, the critical path of a conversion. The import makes some 250k objects and no
    garbage: its own collections cost 8% of it (1.69-1.79 s against 1.54-1.71 s on this project's
    2-core VM), and afterwards every collection that reaches an older generation walks them all (a
    16-layer conversion collected 20 times for 0.24 s, in the fold's thread, holding the GIL that
    the hashing threads need between chunks). The folds leave little cyclic garbage (some 10k
    objects in 16 layers), collected once the collector is back on, after the last pass: the
    first collection then walks torch's objects once (0.12 s), with no other thread left to stall."""
    enabled = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if enabled:
            gc.enable()


def _write_shard(
    plan: ConversionPlan,
    shard: ShardPlan,
    out_dir: Path,
    journal: Journal,
    options: ConvertOptions,
    source: tuple[Fetch, Callable[[], None], str, FoldRing],
    counters: IOCounters,
    leaf_pool: Executor,
    write_pool: Executor,
    bar: Any,
    priority: DiskPriority,
) -> list[str]:
    """Write (or finish) one sidecar shard; returns the folds (tensor names) made in this run. Each
    head chunk of a layer's fold is written while the next is folded, and each layer is fsynced and
    journaled once whole and checked, while the next layer is folded."""
    from foldckpt.convert.layer import fold_from_source  # torch: only once there is something to fold

    fetch, release, device, ring = source
    progress = journal.shard(shard.name)
    writer = ShardWriter(out_dir / shard.name, shard.specs, SIDECAR_METADATA, progress.offset, priority)
    if progress.offset == 0:
        counters.add(written=writer.offset)
    if (
        writer.offset != progress.offset or not _journal_matches_layout(writer, progress, shard)
        or not _prefix_intact(writer, progress, plan.geometry.num_heads)
    ):  # fmt: skip
        with journal.lock:  # nothing usable on disk: start the shard over
            progress.tensors.clear()
            progress.offset = writer.restart()
    folded: list[str] = []

    def write(buffer: memoryview) -> None:
        with counters.timed("write"):
            writer.write([buffer])
        counters.add(written=buffer.nbytes)

    writes = _SidecarWrites(write_pool, ring, write)

    def emit(buffer: memoryview) -> None:
        counters.add(hashed=buffer.nbytes)  # the head leaves: each fold byte once
        writes.chunk(buffer)

    def journal_layer(record: FoldTensor, layer_index: int) -> None:
        with counters.timed("write"):
            offset = writer.sync()
        with journal.lock:
            progress.offset = offset
            progress.tensors[record.name] = record.to_dict()
            journal.save()
        bar.set_postfix(layer=layer_index, relerr=f"{record.rel_fro_error:.1e}")
        bar.update(1)

    try:
        for layer in shard.layers:
            if layer.output.name in progress.tensors:
                bar.update(1)
                continue
            with counters.timed("fold"):
                record = fold_from_source(
                    plan, layer, shard.name, leaf_pool, ring, emit, options.allow_nonfinite, fetch, device, release
                )
            writes.then(journal_layer, record, layer.layer.index)
            folded.append(record.name)
        writes.wait()
        # Journal the finished shard before renaming it: a kill in between then costs a recheck
        # and a rename on resume, where the reverse order would redo the whole shard.
        with journal.lock:
            progress.done = writer.finish().to_dict()
            journal.save()
        writer.commit()
        with journal.lock:
            journal.fingerprints[shard.name] = {"out": fingerprint(out_dir / shard.name)}
            journal.save()
    finally:
        writes.stop()
        writer.close()
        counters.add(staged=writer.staged)
    return folded


class _SidecarWrites:
    """The write thread's work for one shard, in order: each fold chunk written as the fold hands it
    over (its ring buffer given back once written), then each layer made durable and journaled.
    The first failure skips the rest (their buffers still go back) and is raised in the fold's
    thread at its next hand-over."""

    def __init__(self, pool: Executor, ring: FoldRing, write: Callable[[memoryview], None]) -> None:
        """``write``: writes one chunk to the shard (in the write thread)."""
        self._pool = pool
        self._ring = ring
        self._write = write
        self._pending: deque[Future[None]] = deque()
        self._failure: BaseException | None = None
        self._stopped = False

    def chunk(self, buffer: memoryview) -> None:
        """Write ``buffer`` (a chunk from the ring) after what was handed over before."""

        def run() -> None:
            try:
                self._run(self._write, buffer)
            finally:
                self._ring.give_back(buffer)

        try:
            self._submit(run)
        except BaseException:
            self._ring.give_back(buffer)
            raise

    def then(self, work: Callable[..., None], *args: Any) -> None:
        """Run ``work(*args)`` once everything handed over before is written."""
        self._submit(lambda: self._run(work, *args))

    def wait(self) -> None:
        """Wait for everything handed over; raise the first failure."""
        while self._pending:
            self._pending.popleft().result()
        self._raise_failure()

    def stop(self) -> None:
        """Skip what was not started yet and wait for what was (the writer closes next)."""
        self._stopped = True
        wait(self._pending)
        self._pending.clear()

    def _submit(self, run: Callable[[], None]) -> None:
        self._raise_failure()
        while self._pending and self._pending[0].done():
            self._pending.popleft()
        self._pending.append(self._pool.submit(run))

    def _run(self, work: Callable[..., None], *args: Any) -> None:
        if self._failure is not None or self._stopped:
            return
        try:
            work(*args)
        except BaseException as exc:
            self._failure = exc

    def _raise_failure(self) -> None:
        if self._failure is not None:
            raise self._failure


def _journal_matches_layout(writer: ShardWriter, progress: ShardProgress, shard: ShardPlan) -> bool:
    """Whether the journal's folds of a resumed shard are its first layers and its offset is where
    they end. An edited journal said otherwise (one fold dropped, the offset kept): the resumed run
    appended after the offset and every rerun ended in "wrote N of M bytes", an internal error."""
    kept = len(progress.tensors)
    if set(progress.tensors) != {layer.output.name for layer in shard.layers[:kept]}:
        return False
    end = writer.layout[shard.layers[kept - 1].outputs[-1].name].end if kept else writer.header_size
    return progress.offset == end


def _prefix_intact(writer: ShardWriter, progress: ShardProgress, heads: int) -> bool:
    """Whether the folds a resumed shard keeps still hold their journaled head digests (the
    temporary file is ours, but a crash or a hand can damage it between two runs)."""
    kept = [FoldTensor.from_dict(name, record) for name, record in progress.tensors.items()]
    return not kept or heads_intact(writer.tmp, writer.layout, kept, heads)


def _manifest(
    plan: ConversionPlan, journal: Journal, parameters: dict[str, Any], source: dict[str, Any] | None,
    generated: tuple[str, ...] = (),
) -> Manifest:
    tensors = {
        name: FoldTensor.from_dict(name, record)
        for shard in plan.shards
        for name, record in journal.shard(shard.name).tensors.items()
    }
    ordered = {layer.output.name: tensors[layer.output.name] for layer in plan.layers}
    return Manifest(
        geometry=plan.geometry,
        fold_dtype=plan.fold_dtype,
        accumulation_dtype=ACCUMULATION_DTYPE,
        tensors=ordered,
        sidecars={s.name: SidecarRecord.from_dict(journal.shard(s.name).done) for s in plan.shards},
        source_files={n: FileRecord(**journal.source_hashes[n]) for n in (*plan.files_to_place, *generated)},
        parameters=parameters,
        source=source,
        generated_files=generated,
    )


def _outcomes(plan: ConversionPlan, manifest: Manifest, status: dict[str, str]) -> tuple[LayerOutcome, ...]:
    return tuple(
        LayerOutcome(
            index=layer.layer.index,
            is_mtp=layer.layer.is_mtp,
            tensor=layer.output.name,
            sidecar=manifest.tensors[layer.output.name].file,
            rel_fro_error=manifest.tensors[layer.output.name].rel_fro_error,
            status=status.get(layer.output.name, "resumed"),
        )
        for layer in plan.layers
    )


@dataclass(frozen=True)
class Preflight:
    """What ``convert`` would do to OUT_DIR with these options, found by every check the run makes
    before it writes, and nothing written: ``--dry-run`` shows it, and the run starts with it, so
    that the two refuse alike. ``state``: new, empty, resume, finished or replace (see
    :class:`_Found`); ``placement``: how each source file this run places will be placed (hard,
    copy or symlink); ``layers_done``: folded by an earlier run."""

    plan: ConversionPlan
    origin: ModelSource
    out_dir: Path
    state: str
    placement: dict[str, str]
    sidecar_bytes: int
    copy_bytes: int
    free_bytes: int
    layers_done: int
    key: str
    identity: dict[str, Any]
    parameters: dict[str, Any]
    generated: dict[str, bytes]
    device: str


def preflight(model_dir: Path | ModelSource, out_dir: Path, options: ConvertOptions = ConvertOptions()) -> Preflight:
    """Plan the conversion and make every check that ``convert`` makes before it writes: OUT_DIR
    not overlapping MODEL_DIR, a directory, not being written by another convert, its contents
    (an earlier run of other inputs or parameters, foreign files, entries a clearing may not
    remove), ``--link hard`` across filesystems, writable, and room for what will be written."""
    origin = model_dir if isinstance(model_dir, ModelSource) else ModelSource(Path(model_dir))
    out_dir = Path(out_dir)
    source = origin.to_dict()
    plan = plan_conversion(origin.path, options.fold_dtype, options.max_shard_size, options.tp_sizes)
    device = resolve_fold_device(options.device)
    parameters = _output_parameters(plan, options, device)
    # The manifest records where a Hub model came from, so that identity is part of the run too.
    generated = _generated_files(plan)
    identity = run_identity(
        [*plan.files_to_place, *generated], parameters if source is None else {**parameters, "source": source}
    )
    _check_overlap(origin.path, out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FoldckptError(f"{out_dir}: exists and is not a directory; choose a directory for the output")
    if out_dir.is_dir() and is_locked(out_dir):
        raise busy_error(out_dir)
    key = run_key(identity)
    found = _find(out_dir, key, identity, options)
    names, sidecar_bytes = _to_place(plan, out_dir, found, options.link)
    if found.state != "finished" or names:  # a finished output with nothing to place may be read-only
        _check_writable(out_dir)
    placement = _placement(plan, out_dir, names, options.link)
    free = _require_free_space(plan, out_dir, sidecar_bytes, placement)
    copied = _copy_bytes(plan, placement)
    layers_done = len(plan.layers) if found.manifest else found.journal.layers_done() if found.journal else 0
    return Preflight(
        plan, origin, out_dir, found.state, placement, sidecar_bytes, copied, free, layers_done, key, identity,
        parameters, generated, device,
    )  # fmt: skip


def convert(
    model_dir: Path | ModelSource, out_dir: Path, options: ConvertOptions = ConvertOptions()
) -> ConvertResult:
    """Fold every MLA layer of ``model_dir`` into sidecars in ``out_dir`` (resumable, idempotent).

    ``model_dir`` is a directory, or a :class:`~foldckpt.model.hub.ModelSource` (a Hugging Face cache
    snapshot, whose id and commit the manifest then records). A run refused before its first
    durable step leaves OUT_DIR as it found it: what it created for it is removed again.
    """
    started = time.monotonic()
    pre = preflight(model_dir, out_dir, options)
    created = _make_out_dir(pre.out_dir)
    try:
        with exclusive_lock(pre.out_dir):  # for the whole run: a second convert into OUT_DIR is refused
            return _convert_locked(pre, options, started)
    except FoldckptError:
        _undo_creation(pre.out_dir, created)
        raise


def _make_out_dir(out_dir: Path) -> list[tuple[Path, tuple[int, int] | None]]:
    """Create OUT_DIR (and missing parents); returns the folders created, deepest first, each with
    its identity (device, inode) so that only these very folders are ever removed again."""
    missing = []
    folder = out_dir.absolute()
    while not folder.exists() and not folder.is_symlink():
        missing.append(folder)
        folder = folder.parent
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise os_error(out_dir, exc, "creating the output directory") from None
    return [(folder, _identity(folder)) for folder in missing]


def _undo_creation(out_dir: Path, created: list[tuple[Path, tuple[int, int] | None]]) -> None:
    """After a refusal, remove the OUT_DIR this run created while it holds nothing durable (a
    journal that records no placed file and no fold, temporary files); a refused run then leaves
    no directory behind that reads as an unfinished conversion. Work a rerun resumes is kept."""
    if not created:
        return
    try:
        journal = Journal.load(out_dir / JOURNAL_NAME) if (out_dir / JOURNAL_NAME).exists() else None
    except FoldckptError:
        return
    if journal is not None and (journal.placed or journal.shards):
        return
    try:
        remove_placed(out_dir, {JOURNAL_NAME: False})
        remove_stale_tmp_files(out_dir)
    except FoldckptError:
        return
    for folder, identity in created:  # deepest first; rmdir removes only an empty directory
        if folder.is_symlink() or _identity(folder) != identity:
            return
        try:
            folder.rmdir()
        except OSError:
            return


def _convert_locked(pre: Preflight, options: ConvertOptions, started: float) -> ConvertResult:
    plan, origin, out_dir, key = pre.plan, pre.origin, pre.out_dir, pre.key
    generated, device = pre.generated, pre.device
    parameters = dict(pre.parameters)
    sidecars = {shard.name: shard.size for shard in plan.shards}
    source = origin.to_dict()
    journal, repaired = _prepare_out_dir(plan, out_dir, key, pre.identity, generated, options)
    if journal is None:
        replaced = _replace_placed_otherwise(plan, out_dir, options.link)
        manifest = read_manifest(out_dir)
        layers = _outcomes(plan, manifest, {layer.output.name: "up_to_date" for layer in plan.layers})
        return ConvertResult(
            out_dir, True, len(plan.layers), 0, 0, sidecars, plan.fold_bytes,
            max_rel_error=_worst(layer.rel_fro_error for layer in layers),
            elapsed_s=time.monotonic() - started, layers=layers, model=origin.label, source=source,
            fold_device=str(manifest.parameters.get("fold_device", device)), replaced=tuple(replaced),
        )  # fmt: skip
    remove_stale_tmp_files(out_dir, keep={tmp_path_for(out_dir / name) for name in journal.shards})
    if repaired:  # more to write than the preflight counted (which, made again now, would count the journal too)
        names, sidecar_bytes = _to_place(plan, out_dir, journal, options.link)
        _require_free_space(plan, out_dir, sidecar_bytes, _placement(plan, out_dir, names, options.link))

    counters = IOCounters()
    _place_sources(plan, out_dir, journal, options, generated, counters)
    folded = _hash_and_fold(plan, out_dir, journal, options, counters, device)
    changed = _recheck_journal(plan, out_dir, journal, generated)  # a change while this run folded
    if changed:
        journal.save()
        raise FoldckptError(
            f"{out_dir / changed[0]}: changed while this conversion ran; rerun the same command to redo it"
        )

    parameters["run_key"] = key
    manifest = _manifest(plan, journal, parameters, source, tuple(generated))
    write_manifest(out_dir, manifest)
    journal.path.unlink(missing_ok=True)
    placed: dict[str, int] = {}
    for how in journal.placed.values():
        placed[how] = placed.get(how, 0) + 1
    layers = _outcomes(plan, manifest, dict.fromkeys(folded, "folded"))
    return ConvertResult(
        out_dir=out_dir,
        up_to_date=False,
        layers_total=len(plan.layers),
        layers_folded=len(folded),
        layers_resumed=len(plan.layers) - len(folded),
        sidecars=sidecars,
        fold_bytes=plan.fold_bytes,
        placed=placed,
        max_rel_error=_worst(layer.rel_fro_error for layer in layers),
        elapsed_s=time.monotonic() - started,
        layers=layers,
        model=origin.label,
        source=source,
        repaired=tuple(repaired),
        fold_device=device,
        io=counters.to_dict(),
    )
