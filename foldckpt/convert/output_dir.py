"""What OUT_DIR holds before a run: an earlier run to resume or refuse, a finished output to
recheck, foreign files, and the folders a refused run created (removed again).

Every removal here goes through :mod:`foldckpt.io.files`, which never follows a link out of
OUT_DIR; every refusal names the file and what differs.
"""

from __future__ import annotations

import dataclasses
import errno
import json
import os
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from foldckpt.convert.journal import (
    Journal,
    ShardProgress,
    differences,
    manifest_identity,
)
from foldckpt.convert.plan import (
    SIDECAR_PREFIX,
    ConversionPlan,
)
from foldckpt.defaults import JOURNAL_NAME
from foldckpt.errors import FoldckptError
from foldckpt.format.consistency import sidecar_intact
from foldckpt.format.manifest import (
    MANIFEST_NAME,
    FoldTensor,
    Manifest,
    SidecarRecord,
    listed_files,
    read_manifest,
)
from foldckpt.io.files import (
    check_removable,
    fingerprint,
    hard_link_note,
    how_placed,
    is_tmp_path,
    nearest_existing,
    os_error,
    remove_placed,
    remove_stale_tmp_files,
    sha256_file,
)
from foldckpt.model.checkpoint import INDEX_NAME
from foldckpt.options import ConvertOptions

if TYPE_CHECKING:
    pass


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


def _holds_foreign_files(out_dir: Path) -> bool:
    """Whether ``out_dir`` has entries other than temporary files, which are all that a run killed
    before its first journal save leaves behind."""
    try:
        return out_dir.exists() and any(not is_tmp_path(p) for p in out_dir.iterdir())
    except OSError as exc:  # a file, or an unreadable directory
        raise os_error(out_dir, exc, "listing the output directory") from None


def generated_files(plan: ConversionPlan) -> dict[str, bytes]:
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


def check_overlap(model_dir: Path, out_dir: Path) -> None:
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


def _changed_source(out_dir: Path, src_path: Path, name: str, recorded: str, finished: bool) -> FoldckptError:
    what = "finished conversion" if finished else "unfinished conversion"
    advice = "pass --restart to reconvert" if finished else "refusing to mix results: pass --restart to start over"
    return FoldckptError(
        f"{src_path}: changed since {out_dir} was converted from it (sha256 recorded {recorded[:16]}…)"
        f"{hard_link_note(out_dir / name, src_path)}; {out_dir} holds a {what} of the earlier bytes; "
        f"restore the file, or {advice}"
    )


class Proven:
    """Files found by hashing to hold the bytes recorded, each with its fingerprint then
    (:func:`~foldckpt.io.files.fingerprint`). What OUT_DIR holds is judged twice by a run: by its
    preflight (the checks ``--dry-run`` makes too) and again under OUT_DIR's lock; a file unchanged
    since the first judgement is not hashed a second time (a copied model: every file)."""

    def __init__(self) -> None:
        self._found: dict[Path, tuple[list[int], object]] = {}

    def holds(self, path: Path, expected: object, check: Callable[[], bool]) -> bool:
        """Whether ``path`` holds what ``expected`` records: proven before with the fingerprint it
        has now, else ``check()`` (which hashes it)."""
        before = fingerprint(path)
        if before is not None and self._found.get(path) == (before, expected):
            return True
        if not check():
            return False
        if before is not None:
            self._found[path] = (before, expected)
        return True


def _holds(path: Path, cheap: bool, sha256: str | None, proven: Proven) -> bool:
    """Whether ``path`` holds the bytes whose sha256 is recorded: ``cheap`` evidence (an unchanged
    fingerprint) is trusted, else the file is hashed (once: ``proven``)."""
    if not path.is_file():
        return False
    if cheap:
        return True
    return sha256 is not None and proven.holds(path, sha256, lambda: sha256_file(path) == sha256)


def recheck_journal(
    plan: ConversionPlan, out_dir: Path, journal: Journal, generated: dict[str, bytes], proven: Proven
) -> list[str]:
    """Check that every file the journal says is placed still holds the recorded bytes, in OUT_DIR
    and in MODEL_DIR (fingerprints first, sha256 where they differ). What is damaged in OUT_DIR
    only is dropped from the (in-memory) journal, to be placed, hashed or folded again: returns
    those names (:func:`discard_sidecars` removes the sidecars among them). A source that changed
    after it was hashed (folds may come from it) is refused, naming it. Writes nothing."""
    model_dir = plan.source.model_dir
    redo: list[str] = []
    for name in list(journal.placed):
        prints = journal.fingerprints.get(name, {})
        record = journal.source_hashes.get(name)
        sha = record["sha256"] if record else None
        out_path, src_path = out_dir / name, model_dir / name
        out_now = fingerprint(out_path)
        out_ok = _holds(out_path, out_now is not None and out_now == prints.get("out"), sha, proven)
        if name in generated:
            out_ok = out_ok and out_path.read_bytes() == generated[name]
            src_ok = True
        else:
            src_now = fingerprint(src_path)
            if src_now is not None and out_now is not None and src_now[:2] == out_now[:2]:
                src_ok = out_ok  # one inode: the same bytes
            else:
                src_ok = _holds(src_path, src_now is not None and src_now == prints.get("src"), sha, proven)
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
        if now != journal.fingerprints.get(shard.name, {}).get("out") and not _sidecar_holds(
            path, journal, shard.name, plan, proven
        ):
            journal.shards[shard.name] = ShardProgress()
            journal.fingerprints.pop(shard.name, None)
            redo.append(shard.name)
    return redo


def discard_sidecars(plan: ConversionPlan, out_dir: Path, names: Iterable[str]) -> None:
    """Remove the sidecars among ``names`` (found damaged: to be folded again) from OUT_DIR."""
    sidecars = {shard.name for shard in plan.shards}
    remove_placed(out_dir, {name: False for name in names if name in sidecars})


def _sidecar_holds(path: Path, journal: Journal, shard: str, plan: ConversionPlan, proven: Proven) -> bool:
    """Whether a finished sidecar the journal records still holds its bytes (hashed: its
    fingerprint changed)."""
    return _sidecar_intact(path, journal.sidecar(shard), journal.folds(shard, plan.geometry.num_heads), plan, proven)


def _sidecar_intact(
    path: Path, record: SidecarRecord, folds: list[FoldTensor], plan: ConversionPlan, proven: Proven
) -> bool:
    expected = (record, tuple(folds))
    return proven.holds(path, expected, lambda: sidecar_intact(path, record, folds, plan.geometry.num_heads))


def _recheck_manifest(
    plan: ConversionPlan, out_dir: Path, manifest: Manifest, key: str, generated: dict[str, bytes], proven: Proven
) -> tuple[Journal | None, list[str]]:
    """A finished output of this very run key: check that every file it vouches for still holds
    the recorded bytes. A file whose inode changed (ctime) after the manifest was written is
    hashed; the others are trusted on their size. Returns (None, []) when all is intact; else a
    journal (in memory) that redoes only what is damaged in OUT_DIR, and the damaged names. A
    source changed in MODEL_DIR is refused, naming it. Writes nothing."""
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
        out_ok = _holds(out_path, quiet(out_path, record.size), record.sha256, proven)
        if name in generated:
            out_ok = out_ok and out_path.read_bytes() == generated[name]
        else:
            out_fp, src_fp = fingerprint(out_path), fingerprint(src_path)
            same_inode = out_fp is not None and src_fp is not None and out_fp[:2] == src_fp[:2]
            src_ok = out_ok if same_inode else _holds(src_path, quiet(src_path, record.size), record.sha256, proven)
            if not src_ok:
                raise _changed_source(out_dir, src_path, name, record.sha256, finished=True)
        if not out_ok:
            damaged.append(name)
            continue
        journal.placed[name] = "generated" if name in generated else how_placed(out_path, src_path)
        journal.source_hashes[name] = record.to_dict()
        journal.fingerprints[name] = {"out": fingerprint(out_path), "src": fingerprint(src_path)}
    for name, record in manifest.sidecars.items():
        path = out_dir / name
        folds = [tensor for tensor in manifest.tensors.values() if tensor.file == name]
        if not (quiet(path, record.size) or _sidecar_intact(path, record, folds, plan, proven)):
            damaged.append(name)
            continue
        progress = journal.shard(name)
        progress.offset, progress.done = record.size, record.to_dict()
        progress.tensors = {t.name: t.to_dict() for t in manifest.tensors.values() if t.file == name}
        journal.fingerprints[name] = {"out": fingerprint(path)}
    return (journal, damaged) if damaged else (None, [])


@dataclass(frozen=True)
class OutDirState:
    """What OUT_DIR holds for a run of one run key, read without changing anything: ``new`` (no
    OUT_DIR yet), ``empty`` (nothing of ours, nothing foreign, or ``--overwrite``), ``resume`` (an
    unfinished run of this key: ``journal``), ``finished`` (a finished run of this key:
    ``manifest``; and where something of it is damaged, the ``journal`` that redoes it) or
    ``replace`` (an earlier run that ``--restart`` or ``--overwrite`` clears: ``clear``, the
    entries to remove). ``repair``: the files of a resumed or finished run found missing or
    damaged in OUT_DIR, to be placed or folded again. Every other case is refused."""

    state: str
    journal: Journal | None = None
    manifest: Manifest | None = None
    clear: dict[str, bool] = field(default_factory=dict)
    repair: tuple[str, ...] = ()


def find_previous_run(out_dir: Path, key: str, identity: dict[str, Any], options: ConvertOptions) -> OutDirState:
    """Decide between a fresh run, a resume (or repair), "already done", or clearing an earlier
    run; refuse the rest, saying which input or parameter differs from the earlier run's."""
    if not out_dir.exists():
        return OutDirState("new")
    journal_path = out_dir / JOURNAL_NAME
    discard = options.restart or options.overwrite
    if (out_dir / MANIFEST_NAME).exists():
        if discard:  # whatever the manifest is (another format, edited): it only names what to remove
            return OutDirState("replace", clear=_previous_run(out_dir, listed_files(out_dir)))
        manifest = read_manifest(out_dir)
        if manifest.parameters.get("run_key") == key:
            return OutDirState("finished", manifest=manifest)
        raise FoldckptError(
            f"{out_dir}: holds a finished conversion of other inputs or parameters"
            f"{differences(manifest_identity(manifest), identity)}; pass --restart to replace it"
        )
    if journal_path.exists():
        journal = Journal.load(journal_path)
        if journal.run_key == key and not discard:
            return OutDirState("resume", journal=journal)
        if not discard:
            raise FoldckptError(
                f"{out_dir}: holds an unfinished conversion of other inputs or parameters"
                f"{differences(journal.identity, identity)}; refusing to mix results: pass --restart to start over"
            )
        return OutDirState("replace", clear=_previous_run(out_dir, journal.placed))
    if not options.overwrite and _holds_foreign_files(out_dir):
        raise FoldckptError(
            f"{out_dir}: not empty and not a foldckpt output; choose an empty directory or pass --overwrite"
        )
    return OutDirState("empty")


def assess_out_dir(
    plan: ConversionPlan,
    out_dir: Path,
    key: str,
    identity: dict[str, Any],
    generated: dict[str, bytes],
    options: ConvertOptions,
    proven: Proven,
) -> OutDirState:
    """What OUT_DIR holds (:func:`find_previous_run`) and, for a run of this key, finished or not,
    whether every file it placed or wrote still holds its bytes: a source changed in MODEL_DIR is
    refused, naming it; what is damaged in OUT_DIR is to be redone (``repair``). Writes nothing:
    ``convert --dry-run`` makes these very checks, so that it refuses what the run refuses."""
    found = find_previous_run(out_dir, key, identity, options)
    if found.manifest is not None:
        journal, damaged = _recheck_manifest(plan, out_dir, found.manifest, key, generated, proven)
        return dataclasses.replace(found, journal=journal, repair=tuple(damaged))
    if found.journal is not None:
        return dataclasses.replace(
            found, repair=tuple(recheck_journal(plan, out_dir, found.journal, generated, proven))
        )
    return found


def prepare_out_dir(
    plan: ConversionPlan,
    out_dir: Path,
    key: str,
    identity: dict[str, Any],
    generated: dict[str, bytes],
    options: ConvertOptions,
    proven: Proven,
) -> tuple[Journal | None, list[str]]:
    """Act on what OUT_DIR holds (:func:`assess_out_dir`, made again under the lock: the files the
    preflight proved intact and that have not changed since are not hashed again). Returns the
    journal of the run (None: already done) and the names found damaged (to be redone)."""
    found = assess_out_dir(plan, out_dir, key, identity, generated, options, proven)
    journal_path = out_dir / JOURNAL_NAME
    if found.manifest is not None:
        if journal_path.exists():  # only then: removing nothing fails too on a read-only filesystem
            _remove(journal_path)
        if found.journal is None:
            return None, []
        found.journal.save()  # before the manifest goes: OUT_DIR must always read as ours
        (out_dir / MANIFEST_NAME).unlink()
        discard_sidecars(plan, out_dir, found.repair)
        return found.journal, list(found.repair)
    if found.journal is not None:
        found.journal.save()  # before the damaged sidecars go: it no longer counts them done
        discard_sidecars(plan, out_dir, found.repair)
        return found.journal, list(found.repair)
    if found.clear:
        remove_placed(out_dir, found.clear)
        remove_stale_tmp_files(out_dir)
    journal = Journal(journal_path, key, identity=identity, model=plan.source.model_dir, layers=len(plan.layers))
    journal.save()  # before any other file: a killed run must leave an OUT_DIR that reads as ours
    return journal, []


def check_writable(out_dir: Path) -> None:
    """Refuse an OUT_DIR that cannot be written (or, not there yet, made): a read-only filesystem
    or no write permission, said before anything is written (the journal's first save failed)."""
    folder = nearest_existing(out_dir)
    if os.statvfs(folder).f_flag & os.ST_RDONLY:
        problem = errno.EROFS
    elif not os.access(folder, os.W_OK | os.X_OK):
        problem = errno.EACCES
    else:
        return
    action = "writing" if folder == out_dir else f"creating {out_dir}"
    raise os_error(folder, OSError(problem, os.strerror(problem)), action)


def make_out_dir(out_dir: Path) -> list[tuple[Path, tuple[int, int] | None]]:
    """Create OUT_DIR (and missing parents); returns the folders created, deepest first, each with
    its identity (device, inode) so that only these very folders are ever removed again."""
    missing = []
    folder = out_dir.absolute()
    while not folder.exists() and not folder.is_symlink():
        missing.append(folder)
        folder = folder.parent
    try:
        # one level at a time, outermost first: mkdir(parents=True) recurses once per missing
        # folder, and an OUT_DIR a thousand folders deep (short names, a legal path) overflowed
        # Python's stack
        for folder in reversed(missing):
            folder.mkdir(exist_ok=True)
    except OSError as exc:
        raise os_error(out_dir, exc, "creating the output directory") from None
    return [(folder, _identity(folder)) for folder in missing]


def undo_creation(out_dir: Path, created: list[tuple[Path, tuple[int, int] | None]]) -> None:
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
