"""How each source file appears in OUT_DIR (hard link, copy or symlink), the free space and
writability that needs, and placing them before the first fold.
"""

from __future__ import annotations

import os
import shutil
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from foldckpt.console.progress import progress_bar
from foldckpt.convert.journal import Journal
from foldckpt.convert.plan import (
    ConversionPlan,
)
from foldckpt.convert.source_reads import IOCounters
from foldckpt.errors import FoldckptError
from foldckpt.format.manifest import (
    MANIFEST_NAME,
)
from foldckpt.io.files import (
    atomic_output,
    file_size,
    fingerprint,
    how_placed,
    nearest_existing,
    place_file,
    vanished,
)
from foldckpt.options import ConvertOptions

if TYPE_CHECKING:
    pass


from foldckpt.convert.output_dir import OutDirState


def to_place(plan: ConversionPlan, out_dir: Path, found: OutDirState | Journal, link: str) -> tuple[list[str], int]:
    """The source files a run places (again) and the sidecar bytes it writes, given what OUT_DIR
    holds (``found``, or the journal of the run under way)."""
    journal = found if isinstance(found, Journal) else found.journal
    if journal is not None:
        names = [name for name in plan.files_to_place if name not in journal.placed]
        names += _placed_otherwise(journal.placed, link, journal.placed.__getitem__)
        return names, sum(s.size for s in plan.shards if not journal.shard(s.name).done)
    if isinstance(found, OutDirState) and found.manifest is not None:
        model_dir = plan.source.model_dir
        return _placed_otherwise(plan.files_to_place, link, lambda n: how_placed(out_dir / n, model_dir / n)), 0
    return list(plan.files_to_place), plan.sidecar_bytes


def plan_placement(plan: ConversionPlan, out_dir: Path, names: list[str], link: str) -> dict[str, str]:
    """How each source file of ``names`` will be placed: ``hard``, ``copy`` or ``symlink``. ``auto``
    hard-links a file on OUT_DIR's filesystem (that of the file a Hugging Face snapshot entry
    links to) and copies the others; ``--link hard`` across filesystems is refused here, before
    anything is written, where link(2) would fail after the first files were placed."""
    if link in ("copy", "symlink"):
        return dict.fromkeys(names, link)
    device = os.stat(nearest_existing(out_dir)).st_dev
    placement: dict[str, str] = {}
    for name in names:
        source = plan.source.model_dir / name
        try:
            same = os.stat(source).st_dev == device
        except FileNotFoundError:
            raise vanished(source) from None
        if not same and link == "hard":
            raise FoldckptError.at(
                source,
                f"on another filesystem than {out_dir}: --link hard cannot link across filesystems; "
                "use --link auto (copies such files) or --link copy",
            )
        placement[name] = "hard" if same else "copy"
    return placement


def require_free_space(plan: ConversionPlan, out_dir: Path, sidecar_bytes: int, placement: dict[str, str]) -> int:
    """Refuse before writing when OUT_DIR's filesystem cannot hold ``sidecar_bytes`` plus the
    source files that ``placement`` copies; returns the bytes free."""
    needed = sidecar_bytes + copy_bytes(plan, placement)
    free = shutil.disk_usage(nearest_existing(out_dir)).free
    if needed > free:
        raise FoldckptError(
            f"{out_dir}: needs {needed / 1e9:.3g} GB free but has {free / 1e9:.3g} GB; free space first"
        )
    return free


def copy_bytes(plan: ConversionPlan, placement: dict[str, str]) -> int:
    return sum(file_size(plan.source.model_dir / name) for name, how in placement.items() if how == "copy")


def place_sources(
    plan: ConversionPlan,
    out_dir: Path,
    journal: Journal,
    options: ConvertOptions,
    generated: dict[str, bytes],
    counters: IOCounters,
) -> None:
    """Place every source file (and write the generated ones), journaling each with the
    fingerprints that later runs check it against."""
    otherwise = set(_placed_otherwise(journal.placed, options.link, journal.placed.__getitem__))
    todo = [n for n in plan.files_to_place if not (n in journal.placed and (out_dir / n).exists()) or n in otherwise]
    total = sum(file_size(plan.source.model_dir / n) for n in todo)
    with progress_bar(total, "placing sources", "B", options.progress) as bar:
        for name in todo:
            size = file_size(plan.source.model_dir / name)
            with counters.timed("place"):
                how = place_file(plan.source.model_dir / name, out_dir / name, options.link, root=out_dir)
            bar.update(size)
            if how == "copy":
                counters.add(read=size, written=size, copied=size)
            journal.placed[name] = how
            journal.fingerprints[name] = {
                "out": fingerprint(out_dir / name),
                "src": fingerprint(plan.source.model_dir / name),
            }
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


def replace_placed_otherwise(plan: ConversionPlan, out_dir: Path, link: str) -> list[str]:
    """In a finished output (just rechecked: every file holds the bytes its manifest records),
    place again as ``link`` asks each source file placed otherwise; returns their names. The
    manifest's bytes stay as they are (it records no placement), and its time becomes now, so that
    later runs trust the new entries on their fingerprints instead of hashing them."""
    model_dir = plan.source.model_dir
    names = _placed_otherwise(plan.files_to_place, link, lambda name: how_placed(out_dir / name, model_dir / name))
    if not names:
        return []
    require_free_space(plan, out_dir, 0, plan_placement(plan, out_dir, names, link))
    for name in names:
        place_file(model_dir / name, out_dir / name, link, root=out_dir)
    os.utime(out_dir / MANIFEST_NAME, follow_symlinks=False)
    return names
