"""``foldckpt convert``: plan -> place sources -> fold -> sidecars -> manifest.

This module is the operation: :func:`preflight` makes every check a run makes before writing (the
dry run prints it), :func:`convert` takes OUT_DIR's lock and runs the steps, each in its own module:

- :mod:`~foldckpt.convert.plan`: every input validated from headers alone, before any work;
- :mod:`~foldckpt.convert.output_dir`: what OUT_DIR already holds (a run to resume or refuse, a
  finished output to recheck) and undoing what a refused run created;
- :mod:`~foldckpt.convert.placement`: how each source appears in OUT_DIR, and placing them;
- :mod:`~foldckpt.convert.folding`: every source hashed once while the layers are folded from the
  same bytes and streamed to their sidecars (:mod:`~foldckpt.convert.layer`,
  :mod:`~foldckpt.convert.source_reads`);
- :mod:`~foldckpt.convert.journal`: every durable step journaled, so a killed run resumes where it
  stopped and produces the same bytes as an uninterrupted one.

The manifest is written last; its presence means "finished".
"""

from __future__ import annotations

import time
from collections.abc import Iterable
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from foldckpt.console.signals import passive_openmp
from foldckpt.convert.folding import hash_and_fold
from foldckpt.convert.journal import (
    Journal,
    run_identity,
    run_key,
)
from foldckpt.convert.output_dir import (
    Proven,
    assess_out_dir,
    check_overlap,
    check_writable,
    discard_sidecars,
    generated_files,
    make_out_dir,
    prepare_out_dir,
    recheck_journal,
    undo_creation,
)
from foldckpt.convert.placement import (
    copy_bytes,
    place_sources,
    plan_placement,
    replace_placed_otherwise,
    require_free_space,
    to_place,
)
from foldckpt.convert.plan import (
    DEFAULT_MAX_SHARD_SIZE,
    ConversionPlan,
    plan_conversion,
)
from foldckpt.convert.source_reads import IOCounters
from foldckpt.defaults import (
    ACCUMULATION_DTYPE,
    JOURNAL_NAME,
    nan_last,
    resolve_fold_device,
)
from foldckpt.errors import FoldckptError
from foldckpt.format.manifest import (
    MANIFEST_NAME,
    FileRecord,
    FoldedLayer,
    Manifest,
    read_manifest,
    write_manifest,
)
from foldckpt.io.files import (
    busy_error,
    check_fits,
    exclusive_lock,
    is_locked,
    remove_stale_tmp_files,
    tmp_path_for,
)
from foldckpt.model.hub import ModelSource
from foldckpt.options import ConvertOptions

if TYPE_CHECKING:
    pass

# Here too, not only in import_torch: a library caller may import torch itself after this package.
passive_openmp()

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


def _output_parameters(plan: ConversionPlan, options: ConvertOptions) -> dict[str, Any]:
    """The parameters that shape the output bytes (and so key resumption and idempotence). Not the
    fold device: every element is the exact value rounded once (:mod:`foldckpt.rounding`), the same
    bytes on any CPU or GPU, so the manifest, and the sha256 users pin, are the same too."""
    return {
        "fold_dtype": plan.fold_dtype,
        "accumulation_dtype": ACCUMULATION_DTYPE,
        "max_shard_size": options.max_shard_size,
    }


def _manifest(
    plan: ConversionPlan,
    journal: Journal,
    parameters: dict[str, Any],
    source: dict[str, Any] | None,
    generated: tuple[str, ...] = (),
) -> Manifest:
    tensors = {fold.name: fold for shard in plan.shards for fold in journal.folds(shard.name, plan.geometry.num_heads)}
    ordered = {layer.output.name: tensors[layer.output.name] for layer in plan.layers}
    return Manifest(
        geometry=plan.geometry,
        fold_dtype=plan.fold_dtype,
        accumulation_dtype=ACCUMULATION_DTYPE,
        tensors=ordered,
        sidecars={s.name: journal.sidecar(s.name) for s in plan.shards},
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
    :class:`OutDirState`); ``repair``: files of that earlier run missing or damaged in OUT_DIR, to be
    placed or folded again; ``placement``: how each source file this run places will be placed
    (hard, copy or symlink); ``layers_done``: folded by an earlier run (and intact); ``proven``: the
    files hashed to judge OUT_DIR, which the run, judging it again under its lock, does not hash
    again."""

    plan: ConversionPlan
    origin: ModelSource
    out_dir: Path
    state: str
    repair: tuple[str, ...]
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
    proven: Proven


def preflight(model_dir: Path | ModelSource, out_dir: Path, options: ConvertOptions = ConvertOptions()) -> Preflight:
    """Plan the conversion and make every check that ``convert`` makes before it writes: OUT_DIR
    not overlapping MODEL_DIR, a directory, not being written by another convert, its contents
    (an earlier run of other inputs or parameters, foreign files, entries a clearing may not
    remove), that every file it placed or folded is intact (a source changed in MODEL_DIR is
    refused; what is damaged in OUT_DIR is to be repaired), ``--link hard`` across filesystems,
    writable, and room for what will be written."""
    origin = model_dir if isinstance(model_dir, ModelSource) else ModelSource(Path(model_dir))
    out_dir = Path(out_dir)
    source = origin.to_dict()
    plan = plan_conversion(origin.path, options.fold_dtype, options.max_shard_size, options.tp_sizes)
    device = resolve_fold_device(options.device)
    parameters = _output_parameters(plan, options)
    # The manifest records where a Hub model came from, so that identity is part of the run too.
    generated = generated_files(plan)
    identity = run_identity(
        [*plan.files_to_place, *generated], parameters if source is None else {**parameters, "source": source}
    )
    check_overlap(origin.path, out_dir)
    if out_dir.exists() and not out_dir.is_dir():
        raise FoldckptError(f"{out_dir}: exists and is not a directory; choose a directory for the output")
    check_fits(out_dir, [*plan.files_to_place, *generated, *(s.name for s in plan.shards), JOURNAL_NAME, MANIFEST_NAME])
    if out_dir.is_dir() and is_locked(out_dir):
        raise busy_error(out_dir)
    key = run_key(identity)
    proven = Proven()
    found = assess_out_dir(plan, out_dir, key, identity, generated, options, proven)
    names, sidecar_bytes = to_place(plan, out_dir, found, options.link)
    if found.state != "finished" or found.repair or names:  # an intact output with nothing to place may be read-only
        check_writable(out_dir)
    placement = plan_placement(plan, out_dir, names, options.link)
    free = require_free_space(plan, out_dir, sidecar_bytes, placement)
    copied = copy_bytes(plan, placement)
    layers_done = found.journal.layers_done() if found.journal else len(plan.layers) if found.manifest else 0
    return Preflight(
        plan,
        origin,
        out_dir,
        found.state,
        found.repair,
        placement,
        sidecar_bytes,
        copied,
        free,
        layers_done,
        key,
        identity,
        parameters,
        generated,
        device,
        proven,
    )


def convert(model_dir: Path | ModelSource, out_dir: Path, options: ConvertOptions = ConvertOptions()) -> ConvertResult:
    """Fold every MLA layer of ``model_dir`` into sidecars in ``out_dir`` (resumable, idempotent).

    ``model_dir`` is a directory, or a :class:`~foldckpt.model.hub.ModelSource` (a Hugging Face cache
    snapshot, whose id and commit the manifest then records). A run refused before its first
    durable step leaves OUT_DIR as it found it: what it created for it is removed again.
    """
    started = time.monotonic()
    pre = preflight(model_dir, out_dir, options)
    created = make_out_dir(pre.out_dir)
    try:
        with exclusive_lock(pre.out_dir):  # for the whole run: a second convert into OUT_DIR is refused
            return _convert_locked(pre, options, started)
    except FoldckptError:
        undo_creation(pre.out_dir, created)
        raise


def _convert_locked(pre: Preflight, options: ConvertOptions, started: float) -> ConvertResult:
    plan, origin, out_dir, key = pre.plan, pre.origin, pre.out_dir, pre.key
    generated, device = pre.generated, pre.device
    parameters = dict(pre.parameters)
    sidecars = {shard.name: shard.size for shard in plan.shards}
    source = origin.to_dict()
    journal, repaired = prepare_out_dir(plan, out_dir, key, pre.identity, generated, options, pre.proven)
    if journal is None:
        replaced = replace_placed_otherwise(plan, out_dir, options.link)
        manifest = read_manifest(out_dir)
        layers = _outcomes(plan, manifest, {layer.output.name: "up_to_date" for layer in plan.layers})
        return ConvertResult(
            out_dir,
            True,
            len(plan.layers),
            0,
            0,
            sidecars,
            plan.fold_bytes,
            max_rel_error=_worst(layer.rel_fro_error for layer in layers),
            elapsed_s=time.monotonic() - started,
            layers=layers,
            model=origin.label,
            source=source,
            fold_device=device,
            replaced=tuple(replaced),
        )
    remove_stale_tmp_files(out_dir, keep={tmp_path_for(out_dir / name) for name in journal.shards})
    if repaired != list(pre.repair):  # found under the lock: what changed since the preflight counted
        names, sidecar_bytes = to_place(plan, out_dir, journal, options.link)
        require_free_space(plan, out_dir, sidecar_bytes, plan_placement(plan, out_dir, names, options.link))

    counters = IOCounters()
    place_sources(plan, out_dir, journal, options, generated, counters)
    folded = hash_and_fold(plan, out_dir, journal, options, counters, device)
    changed = recheck_journal(plan, out_dir, journal, generated, pre.proven)  # a change while this run folded
    if changed:
        journal.save()
        discard_sidecars(plan, out_dir, changed)
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
