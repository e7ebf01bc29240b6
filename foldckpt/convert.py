"""Orchestration of ``foldckpt convert``: plan -> place sources -> fold -> sidecars -> manifest.

One direction, one layer at a time: peak memory is a layer's q_b_proj and kv_b_proj in fp32 plus
its fold, whatever the size of the model. Every durable step is journaled (see
:mod:`foldckpt.journal`), so a killed run resumes where it stopped and produces the same bytes as
an uninterrupted one; the manifest is written last and its presence means "finished".
"""

from __future__ import annotations

import os
import shutil
import time
from collections.abc import Iterable
from concurrent.futures import Executor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from foldckpt.checkpoint import stays_inside
from foldckpt.defaults import ACCUMULATION_DTYPE, DEFAULT_FOLD_DTYPE
from foldckpt.errors import FoldckptError
from foldckpt.files import (
    is_tmp_path,
    os_error,
    place_file,
    remove_stale_tmp_files,
    sha256_file,
    tmp_path_for,
    worker_pool,
)
from foldckpt.hub import ModelSource
from foldckpt.journal import JOURNAL_NAME, Journal, run_key
from foldckpt.manifest import (
    MANIFEST_NAME,
    FileRecord,
    FoldTensor,
    Manifest,
    listed_files,
    read_manifest,
    write_manifest,
)
from foldckpt.plan import (
    DEFAULT_MAX_SHARD_SIZE,
    SIDECAR_METADATA,
    SIDECAR_PREFIX,
    ConversionPlan,
    ShardPlan,
    plan_conversion,
)
from foldckpt.progress import progress_bar
from foldckpt.sidecar import ShardWriter

__all__ = ["DEFAULT_MAX_SHARD_SIZE", "ConvertOptions", "ConvertResult", "LayerOutcome", "convert"]


@dataclass(frozen=True)
class ConvertOptions:
    fold_dtype: str = DEFAULT_FOLD_DTYPE
    max_shard_size: int = DEFAULT_MAX_SHARD_SIZE
    tp_sizes: tuple[int, ...] | None = None
    link: str = "auto"
    allow_nonfinite: bool = False
    restart: bool = False
    overwrite: bool = False
    progress: bool = True
    workers: int | None = None


@dataclass(frozen=True)
class LayerOutcome:
    """One MLA layer of the result: its config index, sidecar, error vs fp64, and whether this run
    folded it (``folded``), an earlier interrupted run did (``resumed``), or the output was already
    complete (``up_to_date``)."""

    index: int
    is_mtp: bool
    tensor: str
    sidecar: str
    rel_fro_error: float
    status: str

    def to_dict(self) -> dict[str, Any]:
        return dict(self.__dict__)


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

    @property
    def worst_layer(self) -> LayerOutcome | None:
        return max(self.layers, key=lambda layer: layer.rel_fro_error, default=None)

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


def _output_parameters(plan: ConversionPlan, options: ConvertOptions) -> dict[str, Any]:
    """The parameters that shape the output bytes (and so key resumption and idempotence)."""
    return {
        "fold_dtype": plan.fold_dtype,
        "accumulation_dtype": ACCUMULATION_DTYPE,
        "max_shard_size": options.max_shard_size,
    }


def _clear_previous_run(out_dir: Path, placed: Iterable[str]) -> None:
    """Remove what an earlier run wrote: manifest, journal, sidecars and the source files it placed
    (``placed``: links or copies inside OUT_DIR, never the originals), so that a restart onto
    another model leaves nothing of the old one behind. Names whose text leaves OUT_DIR are not
    touched; a placed symlink is removed itself, whatever it points to."""
    sources = [out_dir / name for name in placed if stays_inside(name)]
    for path in [
        out_dir / MANIFEST_NAME, out_dir / JOURNAL_NAME, *out_dir.glob(f"{SIDECAR_PREFIX}*.safetensors"), *sources
    ]:  # fmt: skip
        path.unlink(missing_ok=True)
    remove_stale_tmp_files(out_dir)


def _holds_foreign_files(out_dir: Path) -> bool:
    """Whether ``out_dir`` has entries other than temporary files, which are all that a run killed
    before its first journal save leaves behind."""
    try:
        return out_dir.exists() and any(not is_tmp_path(p) for p in out_dir.iterdir())
    except OSError as exc:  # a file, or an unreadable directory
        raise os_error(out_dir, exc, "listing the output directory") from None


def _prepare_out_dir(model_dir: Path, out_dir: Path, key: str, options: ConvertOptions) -> Journal | None:
    """Decide between a fresh run, a resume, or "already done" (returns None); refuse the rest."""
    source, target = model_dir.resolve(), out_dir.resolve()
    if target == source or target.is_relative_to(source) or source.is_relative_to(target):
        raise FoldckptError(
            f"{out_dir}: the output must not be, contain, or lie inside the model directory {model_dir}"
        )
    journal_path = out_dir / JOURNAL_NAME
    discard = options.restart or options.overwrite
    if (out_dir / MANIFEST_NAME).exists():
        if discard:  # whatever the manifest is (another format, edited): it only names what to remove
            _clear_previous_run(out_dir, listed_files(out_dir))
        else:
            manifest = read_manifest(out_dir)
            if manifest.parameters.get("run_key") == key:
                journal_path.unlink(missing_ok=True)
                return None
            raise FoldckptError(
                f"{out_dir}: holds a finished conversion of other inputs or parameters; "
                "pass --restart to replace it"
            )
    elif journal_path.exists():
        journal = Journal.load(journal_path)
        if journal.run_key == key and not discard:
            return journal
        if not discard:
            raise FoldckptError(
                f"{out_dir}: holds an unfinished conversion of other inputs or parameters; "
                "refusing to mix results: pass --restart to start over"
            )
        _clear_previous_run(out_dir, journal.placed)
    elif not options.overwrite and _holds_foreign_files(out_dir):
        raise FoldckptError(
            f"{out_dir}: not empty and not a foldckpt output; choose an empty directory or pass --overwrite"
        )
    try:
        out_dir.mkdir(parents=True, exist_ok=True)
    except OSError as exc:
        raise os_error(out_dir, exc, "creating the output directory") from None
    journal = Journal(journal_path, key)
    journal.save()  # before any other file: a killed run must leave an OUT_DIR that reads as ours
    return journal


def _check_free_space(plan: ConversionPlan, out_dir: Path, journal: Journal, link: str) -> None:
    needed = sum(s.size for s in plan.shards if not journal.shard(s.name).done)
    same_device = os.stat(plan.source.model_dir).st_dev == os.stat(out_dir).st_dev
    if link == "copy" or (link == "auto" and not same_device):
        needed += sum(
            (plan.source.model_dir / name).stat().st_size
            for name in plan.files_to_place
            if name not in journal.placed
        )
    free = shutil.disk_usage(out_dir).free
    if needed > free:
        raise FoldckptError(
            f"{out_dir}: needs {needed / 1e9:.3g} GB free but has {free / 1e9:.3g} GB; free space first"
        )


def _place_sources(plan: ConversionPlan, out_dir: Path, journal: Journal, options: ConvertOptions) -> None:
    todo = [n for n in plan.files_to_place if not (n in journal.placed and (out_dir / n).exists())]
    total = sum((plan.source.model_dir / n).stat().st_size for n in todo)
    with progress_bar(total, "placing sources", "B", options.progress) as bar:
        for name in todo:
            size = (plan.source.model_dir / name).stat().st_size
            how = place_file(plan.source.model_dir / name, out_dir / name, options.link, progress=None)
            bar.update(size)
            journal.placed[name] = how
            journal.save()


def _write_shard(
    plan: ConversionPlan,
    shard: ShardPlan,
    out_dir: Path,
    journal: Journal,
    options: ConvertOptions,
    pool: Executor,
    bar: Any,
) -> list[str]:
    """Write (or finish) one sidecar shard; returns the folds (tensor names) made in this run."""
    from foldckpt.layer import fold_from_source  # torch: only once there is something to fold

    progress = journal.shard(shard.name)
    writer = ShardWriter(out_dir / shard.name, shard.specs, SIDECAR_METADATA, progress.offset)
    if writer.offset != progress.offset:  # nothing usable on disk: start the shard over
        progress.tensors.clear()
    folded: list[str] = []
    try:
        for layer in shard.layers:
            if layer.output.name in progress.tensors:
                bar.update(1)
                continue
            data, record = fold_from_source(plan, layer, shard.name, pool, options.allow_nonfinite)
            progress.offset = writer.append(data)
            progress.tensors[record.name] = record.to_dict()
            journal.save()
            folded.append(record.name)
            bar.set_postfix(layer=layer.layer.index, relerr=f"{record.error['rel_fro_error']:.1e}")
            bar.update(1)
        # Journal the finished shard before renaming it: a kill in between then costs a rehash
        # and a rename on resume, where the reverse order would redo the whole shard.
        progress.done = writer.finish().to_dict()
        journal.save()
        writer.commit()
    finally:
        writer.close()
    return folded


def _hash_sources(plan: ConversionPlan, out_dir: Path, journal: Journal, options: ConvertOptions) -> None:
    """Hash every placed source file in parallel, largest first so that no big shard starts last
    and runs alone; each digest is journaled as it lands."""
    sizes = {n: (out_dir / n).stat().st_size for n in plan.files_to_place if n not in journal.source_hashes}
    workers = options.workers or os.cpu_count() or 1
    with (
        progress_bar(sum(sizes.values()), "hashing sources", "B", options.progress) as bar,
        worker_pool(workers) as pool,
    ):
        largest_first = sorted(sizes, key=sizes.__getitem__, reverse=True)
        futures = {n: pool.submit(sha256_file, out_dir / n, bar.update) for n in largest_first}
        for name, future in futures.items():
            journal.source_hashes[name] = FileRecord(sizes[name], future.result()).to_dict()
            journal.save()


def _manifest(
    plan: ConversionPlan, journal: Journal, parameters: dict[str, Any], source: dict[str, Any] | None
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
        sidecars={s.name: FileRecord(**journal.shard(s.name).done) for s in plan.shards},
        source_files={n: FileRecord(**journal.source_hashes[n]) for n in plan.files_to_place},
        parameters=parameters,
        source=source,
    )


def _outcomes(plan: ConversionPlan, manifest: Manifest, status: dict[str, str]) -> tuple[LayerOutcome, ...]:
    return tuple(
        LayerOutcome(
            index=layer.layer.index,
            is_mtp=layer.layer.is_mtp,
            tensor=layer.output.name,
            sidecar=manifest.tensors[layer.output.name].file,
            rel_fro_error=float(manifest.tensors[layer.output.name].error["rel_fro_error"]),
            status=status.get(layer.output.name, "resumed"),
        )
        for layer in plan.layers
    )


def convert(
    model_dir: Path | ModelSource, out_dir: Path, options: ConvertOptions = ConvertOptions()
) -> ConvertResult:
    """Fold every MLA layer of ``model_dir`` into sidecars in ``out_dir`` (resumable, idempotent).

    ``model_dir`` is a directory, or a :class:`~foldckpt.hub.ModelSource` (a Hugging Face cache
    snapshot, whose id and commit the manifest then records).
    """
    started = time.monotonic()
    origin = model_dir if isinstance(model_dir, ModelSource) else ModelSource(Path(model_dir))
    model_dir, out_dir = origin.path, Path(out_dir)
    source = origin.to_dict()
    plan = plan_conversion(model_dir, options.fold_dtype, options.max_shard_size, options.tp_sizes)
    parameters = _output_parameters(plan, options)
    # The manifest records where a Hub model came from, so that identity is part of the run too.
    key = run_key(model_dir, plan.files_to_place, parameters if source is None else {**parameters, "source": source})
    sidecars = {shard.name: shard.size for shard in plan.shards}
    journal = _prepare_out_dir(model_dir, out_dir, key, options)
    if journal is None:
        manifest = read_manifest(out_dir)
        layers = _outcomes(plan, manifest, {layer.output.name: "up_to_date" for layer in plan.layers})
        return ConvertResult(
            out_dir, True, len(plan.layers), 0, 0, sidecars, plan.fold_bytes,
            max_rel_error=max(layer.rel_fro_error for layer in layers),
            elapsed_s=time.monotonic() - started, layers=layers, model=origin.label, source=source,
        )  # fmt: skip
    remove_stale_tmp_files(out_dir, keep={tmp_path_for(out_dir / name) for name in journal.shards})
    _check_free_space(plan, out_dir, journal, options.link)

    _place_sources(plan, out_dir, journal, options)
    folded: list[str] = []
    with (
        worker_pool(options.workers or os.cpu_count() or 1) as pool,
        progress_bar(len(plan.layers), "folding", "layer", options.progress) as bar,
    ):
        for shard in plan.shards:
            if journal.shard(shard.name).done and (out_dir / shard.name).exists():
                bar.update(len(shard.layers))
                continue
            folded += _write_shard(plan, shard, out_dir, journal, options, pool, bar)
    _hash_sources(plan, out_dir, journal, options)

    parameters["run_key"] = key
    manifest = _manifest(plan, journal, parameters, source)
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
        max_rel_error=max(layer.rel_fro_error for layer in layers),
        elapsed_s=time.monotonic() - started,
        layers=layers,
        model=origin.label,
        source=source,
    )
