"""``foldckpt verify``: prove, offline, that a converted directory is what was converted, and right.

Levels, cheapest first; each includes the ones before it, and a failing level stops the run (its
problems name the file or tensor):

1. ``manifest``: the manifest parses; every file it lists exists with its recorded size; no stray
   sidecar shard lies beside them.
2. ``structure``: no tensor data read. Every safetensors header parses and tiles its file exactly;
   the sidecar headers hold exactly the manifest's tensors (names, dtypes, shapes); the index
   matches the source shards; ``config.json`` gives the manifest's geometry and every MLA layer has
   its fold.
3. ``content``: sha256 of every file against the manifest, in parallel; with ``rank``/``tp`` only
   that rank's row slice of each fold (what a serving node loads) plus the source files.
4. ``deep``: recompute folds from the source tensors and compare (bitwise when this machine's
   algorithm reproduces them, else within the rounding tolerance of the fold dtype vs fp64), and
   probe ``x·W_foldᵀ`` against the unfolded two-step query on random x.
"""

from __future__ import annotations

import hashlib
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from foldckpt.checkpoint import open_source_checkpoint
from foldckpt.errors import FoldckptError
from foldckpt.files import sha256_file
from foldckpt.fold import ROUNDING_TOLERANCE, fold_error, fold_layer, probe_error, sample_heads
from foldckpt.geometry import read_geometry
from foldckpt.layer import load_layer_inputs
from foldckpt.manifest import Manifest, read_manifest
from foldckpt.plan import FOLD_DTYPES, SIDECAR_PREFIX, plan_conversion
from foldckpt.safetensors_format import read_header, read_tensor, read_tensor_bytes

LEVELS = ("manifest", "structure", "content", "deep")


@dataclass(frozen=True)
class VerifyOptions:
    level: str = "content"
    sample: int | None = None
    rank: int | None = None
    tp: int | None = None
    workers: int | None = None
    progress: bool = True


@dataclass(frozen=True)
class LevelResult:
    name: str
    ok: bool
    summary: str
    problems: tuple[str, ...] = ()

    def to_dict(self) -> dict[str, Any]:
        return {"name": self.name, "ok": self.ok, "summary": self.summary, "problems": list(self.problems)}


@dataclass(frozen=True)
class VerifyReport:
    out_dir: Path
    levels: tuple[LevelResult, ...] = field(default_factory=tuple)

    @property
    def ok(self) -> bool:
        return all(level.ok for level in self.levels)

    def to_dict(self) -> dict[str, Any]:
        return {"out_dir": str(self.out_dir), "ok": self.ok, "levels": [lv.to_dict() for lv in self.levels]}


def _level(name: str, problems: list[str], summary: str) -> LevelResult:
    return LevelResult(name, not problems, summary if not problems else f"{len(problems)} problem(s)", tuple(problems))


def check_manifest(out_dir: Path, manifest: Manifest) -> LevelResult:
    problems = []
    for name, record in manifest.files.items():
        path = out_dir / name
        if not path.is_file():
            problems.append(f"{name}: missing")
        elif (size := path.stat().st_size) != record.size:
            problems.append(f"{name}: size {size} bytes, manifest says {record.size}")
    for path in sorted(out_dir.glob(f"{SIDECAR_PREFIX}*.safetensors")):
        if path.name not in manifest.sidecars:
            problems.append(f"{path.name}: stray sidecar not listed in the manifest")
    return _level("manifest", problems, f"{len(manifest.files)} files present with recorded sizes")


def check_structure(out_dir: Path, manifest: Manifest) -> LevelResult:
    problems: list[str] = []
    for name in manifest.sidecars:
        try:
            header = read_header(out_dir / name)
        except FoldckptError as exc:
            problems.append(str(exc))
            continue
        listed = {t.name: t for t in manifest.tensors.values() if t.file == name}
        for tensor_name in sorted(set(header.tensors) - set(listed)):
            problems.append(f"{name}: tensor '{tensor_name}' is not in the manifest")
        for tensor_name, tensor in listed.items():
            info = header.tensors.get(tensor_name)
            if info is None:
                problems.append(f"{name}: tensor '{tensor_name}' listed by the manifest is missing")
            elif (info.dtype, info.shape) != (tensor.dtype, tensor.shape):
                problems.append(
                    f"{name}: tensor '{tensor_name}' is {info.dtype}{list(info.shape)}, "
                    f"manifest says {tensor.dtype}{list(tensor.shape)}"
                )
    try:
        open_source_checkpoint(out_dir, external_links=True)
        geometry = read_geometry(out_dir)
    except FoldckptError as exc:
        return _level("structure", [*problems, str(exc)], "")
    if geometry != manifest.geometry:
        problems.append("config.json: its MLA geometry differs from the manifest's")
    for layer in geometry.layers:
        tensor = manifest.tensors.get(layer.q_fold)
        if tensor is None:
            problems.append(f"layer {layer.index}: no fold '{layer.q_fold}' in the manifest")
        elif tensor.shape != geometry.fold_shape:
            problems.append(f"{tensor.file}: '{layer.q_fold}' has shape {list(tensor.shape)}, geometry implies {list(geometry.fold_shape)}")
    return _level(
        "structure", problems, f"{len(manifest.sidecars)} sidecar(s), index and {len(geometry.layers)} MLA layer(s) consistent"
    )


def _rank_slice_digest(out_dir: Path, manifest: Manifest, name: str, tp: int, rank: int) -> str:
    tensor = manifest.tensors[name]
    info = read_header(out_dir / tensor.file).tensors[name]
    start, stop = manifest.geometry.rank_rows(tp, rank)
    row_bytes = info.nbytes // tensor.shape[0]
    return hashlib.sha256(read_tensor_bytes(out_dir / tensor.file, info, start * row_bytes, stop * row_bytes)).hexdigest()


def check_content(out_dir: Path, manifest: Manifest, options: VerifyOptions) -> LevelResult:
    problems: list[str] = []
    rank_mode = options.rank is not None and options.tp is not None
    if rank_mode and options.tp not in manifest.tp_sizes:
        raise FoldckptError(
            f"{out_dir}: the manifest has per-rank hashes for TP {list(manifest.tp_sizes)}, not {options.tp}; "
            "reconvert with --tp to add it"
        )
    if rank_mode and not 0 <= options.rank < options.tp:  # type: ignore[operator]
        raise FoldckptError(f"--rank {options.rank} is outside TP {options.tp}")
    files = dict(manifest.source_files) if rank_mode else manifest.files
    total = sum(record.size for record in files.values())
    workers = options.workers or os.cpu_count() or 1
    with (
        tqdm(total=total, unit="B", unit_scale=True, desc="sha256", disable=not options.progress) as bar,
        ThreadPoolExecutor(max_workers=workers) as pool,
    ):
        futures = {name: pool.submit(sha256_file, out_dir / name, bar.update) for name in files}
        slices = {
            name: pool.submit(_rank_slice_digest, out_dir, manifest, name, options.tp, options.rank)
            for name in manifest.tensors
        } if rank_mode else {}  # fmt: skip
        for name, future in futures.items():
            if future.result() != files[name].sha256:
                problems.append(f"{name}: sha256 differs from the manifest (file modified or corrupted)")
        for name, future in slices.items():
            expected = manifest.tensors[name].rank_sha256[options.tp][options.rank]  # type: ignore[index]
            if future.result() != expected:
                problems.append(
                    f"{manifest.tensors[name].file}: rank {options.rank}/{options.tp} slice of '{name}' differs from the manifest"
                )
    scope = f"rank {options.rank} of TP {options.tp} slices + {len(files)} source files" if rank_mode else f"{len(files)} files"
    return _level("content", problems, f"sha256 of {scope} ({total / 1e9:.2f} GB) match")


def _sample_layers(count: int, sample: int | None) -> list[int]:
    return list(sample_heads(count, sample)) if sample else list(range(count))


def check_deep(out_dir: Path, manifest: Manifest, options: VerifyOptions) -> LevelResult:
    plan = plan_conversion(
        out_dir, manifest.fold_dtype, int(manifest.parameters.get("max_shard_size", 5 * 1024**3)), manifest.tp_sizes,
        external_links=True,
    )
    tolerance = ROUNDING_TOLERANCE[FOLD_DTYPES[manifest.fold_dtype]]
    geometry = plan.geometry
    problems: list[str] = []
    bitwise = 0
    chosen = [plan.layers[i] for i in _sample_layers(len(plan.layers), options.sample)]
    for layer in tqdm(chosen, unit="layer", desc="recomputing", disable=not options.progress):
        record = manifest.tensors[layer.output.name]
        inputs = load_layer_inputs(plan, layer, allow_nonfinite=True)
        recorded = {source.name: source.sha256 for source in record.sources}
        for source in inputs.sources:
            if recorded.get(source.name) != source.sha256:
                problems.append(f"{source.file}: source tensor '{source.name}' changed since conversion")
        header = read_header(out_dir / record.file)
        stored = read_tensor(out_dir / record.file, header.tensors[record.name])
        recomputed = fold_layer(inputs.q_b_proj, inputs.kv_b_proj, geometry, stored.dtype)
        if torch.equal(stored, recomputed):
            bitwise += 1
            continue
        heads = tuple(range(geometry.num_heads))
        error = fold_error(stored, inputs.q_b_proj, inputs.kv_b_proj, geometry, heads).rel_fro_error
        probe = probe_error(stored, inputs.q_b_proj, inputs.kv_b_proj, geometry)
        if error > tolerance or probe > 2 * tolerance:
            problems.append(
                f"{record.file}: '{record.name}' is not the fold of its sources "
                f"(relative error {error:.2e}, probe {probe:.2e}, tolerance {tolerance:.1e})"
            )
    summary = (
        f"{len(chosen)}/{len(plan.layers)} layer(s) recomputed: {bitwise} bitwise identical, "
        f"{len(chosen) - bitwise} within {tolerance:.1e} of fp64"
    )
    return _level("deep", problems, summary)


def verify(out_dir: Path, options: VerifyOptions = VerifyOptions()) -> VerifyReport:
    """Run the verification levels up to ``options.level``; raises FoldckptError if unusable."""
    if options.level not in LEVELS:
        raise FoldckptError(f"unknown verification level {options.level!r}; choose one of {', '.join(LEVELS)}")
    out_dir = Path(out_dir)
    if not out_dir.is_dir():
        raise FoldckptError(f"{out_dir}: not a directory")
    manifest = read_manifest(out_dir)
    checks = {
        "manifest": lambda: check_manifest(out_dir, manifest),
        "structure": lambda: check_structure(out_dir, manifest),
        "content": lambda: check_content(out_dir, manifest, options),
        "deep": lambda: check_deep(out_dir, manifest, options),
    }
    results: list[LevelResult] = []
    for name in LEVELS[: LEVELS.index(options.level) + 1]:
        results.append(checks[name]())
        if not results[-1].ok:
            break
    return VerifyReport(out_dir, tuple(results))
