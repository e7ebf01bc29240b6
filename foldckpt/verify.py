"""``foldckpt verify``: prove, offline, that a converted directory is what was converted, and right.

The manifest is the root of trust: before anything else it must prove itself unedited (its own
digest over a canonical encoding of its content, its exact bytes, and, with
``expect_manifest_sha256``, the pinned sha256 of the file; see :mod:`foldckpt.format.manifest`). The report
carries the sha256 of ``foldckpt.json`` (what users pin). Then the levels, cheapest first; each
includes the ones before it, and a failing level stops the run (its problems name the file,
relative to OUT_DIR, and the tensor where there is one):

1. ``manifest``: the manifest is unedited and self-consistent (:func:`foldckpt.format.consistency.manifest_problems`);
   every file it lists exists with its recorded size; nothing else lies in the directory, at any
   depth (:func:`foldckpt.format.consistency.unlisted_entries`), but what ``allow_extra`` names (recorded
   in the report) and never convert's resume journal (a conversion that has not finished).
2. ``structure``: no tensor data read. Every safetensors header parses and tiles its file exactly;
   the sidecar headers hold exactly the manifest's tensors; the index and the source shards'
   headers agree both ways and every indexed shard is vouched for by the manifest; the source
   tensors the manifest records exist; ``config.json`` gives exactly the manifest's geometry.
3. ``content``: one bounded read of every file, in parallel across files, largest first, hashing the
   whole file and, in the same pass, every head block of every fold (the leaves any TP rank checks
   at load). With ``rank``/``tp`` (any TP size dividing the heads) the sidecars are not read whole:
   only that rank's heads of each fold (what a serving node loads), plus the source files.
4. ``deep``: recompute the folds (all, or ``sample`` layers) from the source tensors, whose hashes
   must match the manifest. Every fold is each element's exact value rounded once, so the stored
   bytes must equal the recompute's on any machine (a one-ulp edit fails). Independently of the
   library's fold function, each stored element is also judged against the fp64 fold (within an
   ulp of the fold dtype plus the fp32 accumulation bound), each head's relative error against the
   rounding tolerance (the rule convert refuses a fold by), and ``x·W_foldᵀ`` probed against the
   unfolded two-step query on random x. At most one layer's tensors are in memory.

Cost: ``content`` hashes each byte once: the source files with sha256, the sidecars' head blocks
(and headers) with their BLAKE3 leaves (:mod:`foldckpt.io.hashing`), about a quarter of the CPU per byte.
"""

from __future__ import annotations

import dataclasses
import functools
import os
import time
from pathlib import Path
from typing import Any

from foldckpt.console.progress import progress_bar
from foldckpt.console.signals import import_torch
from foldckpt.errors import FoldckptError, ManifestError
from foldckpt.format.consistency import (
    Problem,
    add_head_ranges,
    changed_fold_inputs,
    config_problems,
    file_problems,
    header_tensors,
    manifest_problems,
    sidecar_headers,
    unlisted_entries,
)
from foldckpt.format.manifest import MANIFEST_NAME, Manifest, SourceTensor, file_sha256, read_manifest
from foldckpt.format.report import LevelResult, VerifyReport
from foldckpt.inspect import conversion_status, describe_conversion
from foldckpt.io.direct_io import BufferPool
from foldckpt.io.files import is_locked, sha256_file, worker_pool
from foldckpt.io.hashing import (
    HashJob,
    all_cached,
    default_workers,
    describe_heads,
    hash_job,
    head_digests,
)
from foldckpt.io.safetensors_format import read_header, read_tensor_bytes
from foldckpt.model.checkpoint import INDEX_NAME, SourceCheckpoint, open_source_checkpoint
from foldckpt.options import LEVELS, VerifyOptions

# torch (and the fold math) is imported by the deep level only: the cheaper levels read headers
# and hash bytes, and start in a fraction of the time torch takes to import.

__all__ = ["LEVELS", "LevelResult", "Problem", "VerifyOptions", "VerifyReport", "default_workers", "verify"]


def _level(name: str, problems: list[Problem], summary: str, bytes_read: int = 0) -> LevelResult:
    failed = f"{len(problems)} problem(s)"
    return LevelResult(name, not problems, summary if not problems else failed, tuple(problems), bytes_read=bytes_read)


def check_manifest(
    out_dir: Path, manifest: Manifest, pinned: bool = False, allow_extra: tuple[str, ...] = ()
) -> tuple[LevelResult, tuple[str, ...]]:
    """The manifest (already proven unedited by :func:`read_manifest`) hangs together, and the file
    set: every listed file, and nothing else but what ``allow_extra`` names. Returns the level and
    the unlisted entries allowed."""
    problems = manifest_problems(manifest)
    if problems:  # file names may be unsafe: judge no file by this manifest
        return _level("manifest", problems, ""), ()
    unlisted = unlisted_entries(out_dir, manifest, allow_extra)
    problems = file_problems(out_dir, manifest) + list(unlisted.problems)
    proof = "pinned sha256 and self-digest match" if pinned else "self-digest matches"
    extra = f" but {len(unlisted.allowed)} allowed" if allow_extra else ""
    summary = f"{proof}; {len(manifest.files)} files present with recorded sizes, nothing unlisted{extra}"
    return _level("manifest", problems, summary), unlisted.allowed


def _check_index(out_dir: Path, source: SourceCheckpoint, manifest: Manifest) -> list[Problem]:
    """The manifest vouches for every shard, and holds the fold inputs it names (that the index and
    the shard headers agree both ways, :func:`open_source_checkpoint` checked)."""
    problems: list[Problem] = []
    index = INDEX_NAME if source.index_path is not None else None
    for file in source.headers:
        if file not in manifest.source_files:
            listed = f" listed by {index}" if index else ""
            problems.append(Problem(file, f"holds weights{listed} but {MANIFEST_NAME} does not vouch for it"))
    for tensor in manifest.tensors.values():
        for item in tensor.sources:
            header = source.headers.get(item.file)
            held = header.tensors if header is not None else header_tensors(out_dir / item.file)
            if held is None or item.name not in held:
                problems.append(
                    Problem(
                        item.file,
                        f"has no tensor '{item.name}', which {MANIFEST_NAME} says fed '{tensor.name}'",
                        item.name,
                    )
                )
    return problems


def check_structure(out_dir: Path, manifest: Manifest) -> LevelResult:
    _, problems = sidecar_headers(out_dir, manifest)
    try:
        source = open_source_checkpoint(out_dir, external_links=True)
    except FoldckptError as exc:
        return _level("structure", [*problems, Problem.of(out_dir, exc, INDEX_NAME)], "")
    problems += _check_index(out_dir, source, manifest)
    problems += config_problems(out_dir, manifest)
    summary = (
        f"{len(manifest.sidecars)} sidecar(s), {len(source.headers)} source shard(s), index and "
        f"{len(manifest.geometry.layers)} MLA layer(s) consistent"
    )
    return _level("structure", problems, summary)


# ---------------------------------------------------------------------------------------------
# content: one pass per file; every fold's head leaves in the same pass


def _plan_hash_jobs(out_dir: Path, manifest: Manifest, tp: int | None, rank: int | None) -> dict[str, HashJob]:
    """Every source file whole; every head block of each fold (or, for one rank, only that rank's
    head blocks), which with the header (checked at the structure level) cover every sidecar byte."""
    rank_mode = tp is not None and rank is not None
    heads = manifest.geometry.num_heads
    first, stop = manifest.geometry.rank_heads(tp, rank) if rank_mode else (0, heads)  # type: ignore[arg-type]
    jobs = {name: HashJob(name, record.size, True, record.sha256) for name, record in manifest.source_files.items()}
    for name, record in manifest.sidecars.items():
        jobs[name] = HashJob(name, record.size, False)
        in_file = [tensor for tensor in manifest.tensors.values() if tensor.file == name]
        add_head_ranges(jobs[name], read_header(out_dir / name).tensors, in_file, heads, first, stop)
    return jobs


def _changed_sources(out_dir: Path, manifest: Manifest, file: str) -> list[Problem]:
    """Which of the fold inputs held by ``file`` differ from the bytes that were folded (only run
    once the file is known to have changed, to name the tensor and the folds it invalidates)."""
    fed: dict[SourceTensor, list[str]] = {}
    for tensor in manifest.tensors.values():
        for source in tensor.sources:
            if source.file == file:
                fed.setdefault(source, []).append(tensor.name)
    if not fed or header_tensors(out_dir / file) is None:
        return []  # a broken header: the file-level problem says enough
    problems = []
    for source in changed_fold_inputs(out_dir, fed):
        names = ", ".join(f"'{fold}'" for fold in fed[source])
        problems.append(
            Problem(
                file,
                f"source tensor '{source.name}' is not the one folded into {names} at conversion "
                "(modified after conversion; reconvert or restore it)",
                source.name,
            )
        )
    return problems


def _ranks_affected(manifest: Manifest, heads: list[int]) -> str:
    """Which rank of every TP size that splits the heads owns one of ``heads``: ``0/1, 1/2, 2/4``
    (all of them: an operator serving TP 3 or 6 must see their rank named too)."""
    g = manifest.geometry
    owners = [f"{r}/{tp}" for tp in g.tp_sizes() for r in sorted({h // (g.num_heads // tp) for h in heads})]
    return ", ".join(owners)


def _judge(
    job: HashJob, whole: str | None, ranges: dict[tuple[int, int], str], out_dir: Path, manifest: Manifest, rank: str
) -> list[Problem]:
    problems: list[Problem] = []
    file_ok = whole is not None and whole == job.expected
    if whole is not None and not file_ok:
        problems.append(
            Problem(
                job.name,
                f"sha256 {whole[:16]}… differs from {str(job.expected)[:16]}… recorded in {MANIFEST_NAME} "
                "(the file changed since conversion)",
            )
        )
        if job.name in manifest.source_files:
            problems += _changed_sources(out_dir, manifest, job.name)
    failed: dict[str, list[int]] = {}
    for bound, checks in sorted(job.ranges.items()):
        for check in checks:
            if ranges[bound] != check.expected:
                failed.setdefault(check.tensor, []).append(check.head)
    for tensor, heads in failed.items():
        where = f"head(s) {describe_heads(heads)}"
        if rank:
            problems.append(
                Problem(
                    job.name,
                    f"rank {rank} rows of '{tensor}' differ from their head digests in {MANIFEST_NAME} ({where})",
                    tensor,
                )
            )
        else:
            what = f"tensor '{tensor}' differs from its head digests in {MANIFEST_NAME} in {where} (rank slices affected: {_ranks_affected(manifest, heads)})"
            problems.append(Problem(job.name, what, tensor))
    return problems


def check_content(out_dir: Path, manifest: Manifest, options: VerifyOptions) -> LevelResult:
    rank_mode = options.rank is not None and options.tp is not None
    jobs = _plan_hash_jobs(out_dir, manifest, options.tp, options.rank)
    ordered = sorted(jobs.values(), key=lambda job: job.cost, reverse=True)  # longest first: no lone tail
    total = sum(job.read_bytes for job in ordered)
    workers = options.workers or default_workers(all_cached([out_dir / job.name for job in ordered]))
    workers = max(1, min(workers, len(ordered)))
    buffers = BufferPool()  # the direct reads' buffers, shared by the jobs: none made per file
    with (
        progress_bar(total, "hashing", "B", options.progress) as bar,
        worker_pool(workers) as pool,
    ):
        futures = {
            job.name: pool.submit(hash_job, out_dir / job.name, job, bar.update, bypass_cache=True, pool=buffers)
            for job in ordered
        }
        digests = {name: future.result() for name, future in futures.items()}
    problems: list[Problem] = []
    rank = f"{options.rank}/{options.tp}" if rank_mode else ""
    for name in manifest.files:  # report in manifest order
        problems += _judge(jobs[name], *digests[name], out_dir, manifest, rank)
    if rank_mode:
        first, stop = manifest.geometry.rank_heads(options.tp, options.rank)  # type: ignore[arg-type]
        scope = (
            f"rank {rank} (heads {describe_heads(range(first, stop))}) of {len(manifest.tensors)} folds "
            f"+ {len(manifest.source_files)} source files"
        )
    else:
        heads = manifest.geometry.num_heads * len(manifest.tensors)
        scope = f"{len(manifest.source_files)} source files and {heads} head blocks of {len(manifest.tensors)} folds"
    return _level("content", problems, f"digests of {scope} ({total / 1e9:.2f} GB) match", bytes_read=total)


# ---------------------------------------------------------------------------------------------
# deep: the math, judged against fp64 (not against the function that made the fold)


def _sample_layers(count: int, sample: int | None) -> list[int]:
    if not sample or sample >= count:
        return list(range(count))
    if sample == 1:
        return [count - 1]
    from foldckpt.fold import sample_heads

    return list(sample_heads(count, sample))


def one_rounding_violations(
    stored: Any, q_b: Any, kv_b: Any, geometry: Any, meter: Any = None, heads_per_chunk: int = 8
) -> tuple[int, float]:
    """Elements of a bf16/fp16/fp32 fold farther from the fp64 fold than one rounding allows: one
    ulp of the fold dtype at the fp64 value, plus twice the fp32 accumulation bound
    ``P·2⁻²⁴·(|W_UK|ᵀ|W_qb|)``. A fold accumulated in bf16, rounded twice, or (fp32) edited by a
    few hundred ulps exceeds it. Each head's fp64 fold also goes to ``meter``
    (:class:`~foldckpt.fold.FoldErrorMeter`) when given. Returns (count, worst excess in ulps)."""
    import torch

    from foldckpt.fold import head_chunks

    g = geometry
    p, lora = g.qk_nope_head_dim, g.kv_lora_rank
    q_heads = q_b.reshape(g.num_heads, p + g.qk_rope_head_dim, g.q_lora_rank)
    kv_heads = kv_b.reshape(g.num_heads, p + g.v_head_dim, g.kv_lora_rank)
    folds = stored.reshape(g.num_heads, g.fold_head_dim, g.q_lora_rank)
    eps = torch.finfo(stored.dtype).eps  # one ulp at 1.0
    count, worst = 0, 0.0
    for chunk in head_chunks(g.num_heads, heads_per_chunk):
        exact = _measured_reference(q_b, kv_b, g, chunk, folds, meter)[:, :lora]
        w_uk = kv_heads[chunk, :p].to(torch.float64)
        w_qb = q_heads[chunk, :p].to(torch.float64)
        bound = torch.matmul(w_uk.abs().transpose(1, 2), w_qb.abs()) * (2 * p * 2.0**-24)
        got = folds[chunk, :lora].to(torch.float64)
        magnitude = exact.abs().clamp(min=torch.finfo(stored.dtype).tiny)
        ulp = torch.exp2(torch.floor(torch.log2(magnitude))) * eps
        excess = ((got - exact).abs() - bound) / ulp
        rope = folds[chunk, lora:].to(torch.float64) != q_heads[chunk, p:].to(stored.dtype).to(torch.float64)
        count += int((excess > 1).sum().item()) + int(rope.sum().item())
        worst = max(worst, float(excess.max().item()) if excess.numel() else 0.0)
    return count, worst


def _measured_reference(q_b: Any, kv_b: Any, g: Any, chunk: slice, folds: Any, meter: Any, scales: Any = None) -> Any:
    """The fp64 fold of the heads of ``chunk`` (``[n, L+R, Lq]``), each head also measured by ``meter``
    when given (the stored ``folds [H, L+R, Lq]``, with fp8 row ``scales [H, L+R]``)."""
    from foldckpt.fold import reference_fold_heads

    heads = tuple(range(chunk.start, chunk.stop))
    reference = reference_fold_heads(q_b, kv_b, g, heads)
    if meter is not None:
        for row, head in enumerate(heads):
            meter.add(head, folds[head], None if scales is None else scales[head], reference[row])
    return reference


def fp8_rounding_violations(
    values: Any, scale: Any, q_b: Any, kv_b: Any, geometry: Any, meter: Any = None, heads_per_chunk: int = 8
) -> tuple[int, float]:
    """Rows and elements of an fp8 fold farther from the fp64 fold than one rounding allows: each
    row's scale within 2⁻¹⁶ (relative) of ``amax(|fp64 row|) / 448``, and each value within one e4m3
    ulp of ``fp64 / scale`` (half an ulp for the rounding, as much again for the fp32 accumulation
    near a tie). Each head's fp64 fold also goes to ``meter`` when given. Returns (count, worst
    distance in ulps)."""
    import torch

    from foldckpt.fold import FP8_MAX, head_chunks

    g = geometry
    folds = values.reshape(g.num_heads, g.fold_head_dim, g.q_lora_rank)
    stored_scales = scale.reshape(g.num_heads, g.fold_head_dim)
    scales = stored_scales.to(torch.float64)
    count, worst = 0, 0.0
    for chunk in head_chunks(g.num_heads, heads_per_chunk):
        exact = _measured_reference(q_b, kv_b, g, chunk, folds, meter, stored_scales)  # [n, L+R, Lq] fp64
        amax = exact.abs().amax(dim=-1)
        expected = torch.where(amax > 0, amax / FP8_MAX, torch.ones_like(amax))
        row_scale = scales[chunk]
        count += int(((row_scale - expected).abs() > 2.0**-16 * expected).sum().item())
        target = exact / row_scale.unsqueeze(-1)
        # e4m3: 3 mantissa bits; normals from 2^-6, subnormal spacing 2^-9
        ulp = torch.exp2(torch.floor(torch.log2(target.abs().clamp(min=2.0**-6))) - 3)
        distance = (folds[chunk].to(torch.float64) - target).abs() / ulp
        count += int((distance > 1).sum().item())
        worst = max(worst, float(distance.max().item()) if distance.numel() else 0.0)
    return count, worst


def _differing_elements(a: Any, b: Any) -> int:
    """Elements whose bytes differ (NaN equal to the same NaN, which ``==`` is not; -0.0 and 0.0 not)."""
    import torch

    as_int = {1: torch.uint8, 2: torch.int16, 4: torch.int32}[a.element_size()]
    return int((a.view(as_int) != b.view(as_int)).sum().item())


def check_deep(out_dir: Path, manifest: Manifest, options: VerifyOptions) -> LevelResult:
    import_torch()  # before any module below imports it: signals wait, OpenMP threads passive

    from foldckpt.convert.layer import load_layer_inputs, nonfinite_count, nonfinite_fold_problem
    from foldckpt.convert.plan import plan_conversion
    from foldckpt.defaults import fold_torch_dtype
    from foldckpt.fold import (
        ROUNDING_TOLERANCE,
        FoldErrorMeter,
        accuracy_problem,
        fold_layer,
        fold_layer_fp8,
        probe_error,
        recorded_error_mismatch,
    )
    from foldckpt.tensors import tensor_from_bytes

    plan = plan_conversion(
        out_dir,
        fold_dtype=manifest.fold_dtype,
        max_shard_size=manifest.parameters["max_shard_size"],  # an integer >= 1: read_manifest checked it
        external_links=True,
    )
    dtype = fold_torch_dtype(manifest.fold_dtype)
    tolerance = ROUNDING_TOLERANCE[dtype]
    geometry = plan.geometry
    problems: list[Problem] = []

    @functools.cache
    def file_intact(file: str) -> bool:
        record = manifest.source_files.get(file)
        return record is not None and sha256_file(out_dir / file) == record.sha256

    bitwise, worst_error, worst_probe, worst_ulps, nonfinite_inputs = 0, 0.0, 0.0, 0.0, 0
    chosen = [plan.layers[i] for i in _sample_layers(len(plan.layers), options.sample)]
    bar = progress_bar(len(chosen), "recomputing", "layer", options.progress)
    for layer in chosen:  # one layer's tensors in memory at a time
        bar.update(1)
        record = manifest.tensors.get(layer.output.name)
        if record is None:
            problems.append(
                Problem(MANIFEST_NAME, f"no fold recorded for MLA layer {layer.layer.index}", layer.output.name)
            )
            continue
        inputs = load_layer_inputs(plan, layer, allow_nonfinite=True)
        recorded = {source.name: source.blake3 for source in record.sources}
        changed = [source for source in inputs.sources if recorded.get(source.name) != source.blake3]
        for source in changed:
            if file_intact(source.file):  # the bytes are those converted: the manifest's record is wrong
                problems.append(
                    Problem(
                        MANIFEST_NAME,
                        f"the recorded digest of source tensor '{source.name}' does not match its bytes in "
                        f"{source.file}, although {source.file} matches its recorded sha256: the manifest is inconsistent",
                        source.name,
                    )
                )
            else:
                problems.append(
                    Problem(
                        source.file,
                        f"source tensor '{source.name}' changed since conversion: '{record.name}' was folded "
                        "from other bytes (reconvert or restore it)",
                        source.name,
                    )
                )
        if changed:
            continue  # the stored fold cannot be expected to match sources it was not made from
        header = read_header(out_dir / record.file).tensors
        stored_parts = []
        for part in record.parts():
            info = header[part.name]
            data = read_tensor_bytes(out_dir / record.file, info)
            if head_digests(data, geometry.num_heads) != part.head_blake3:  # only when called without content
                problems.append(
                    Problem(
                        record.file, f"tensor '{part.name}' differs from its head digests in {MANIFEST_NAME}", part.name
                    )
                )
                break
            stored_parts.append(tensor_from_bytes(data, info))
        else:
            stored, scale = stored_parts[0], (stored_parts[1] if len(stored_parts) > 1 else None)
            nonfinite = nonfinite_fold_problem(
                nonfinite_count(stored, scale), stored.numel(), inputs, manifest.fold_dtype
            )
            if nonfinite is not None:
                problems.append(Problem(record.file, f"'{record.name}': {nonfinite}", record.name))
                continue
            # Every fold of this format is each element's exact value rounded once (rounding.py),
            # so a correct fold is bitwise identical to the recompute, on any machine.
            if scale is None:
                differing = _differing_elements(stored, fold_layer(inputs.q_b_proj, inputs.kv_b_proj, geometry, dtype))
            else:
                values, scales = fold_layer_fp8(inputs.q_b_proj, inputs.kv_b_proj, geometry)
                differing = _differing_elements(stored, values) + _differing_elements(scale, scales)
                del values, scales
            same = differing == 0
            bitwise += same
            if not inputs.finite():
                # NaN/Inf inputs, folded under --allow-nonfinite: no fp64 bound applies, only the recompute
                nonfinite_inputs += 1
                if not same:
                    problems.append(
                        Problem(
                            record.file,
                            f"'{record.name}' differs from the fold of its sources recomputed here (they hold "
                            "NaN or Inf, folded with --allow-nonfinite: only a bitwise comparison applies)",
                            record.name,
                        )
                    )
                continue
            # every head against fp64: one fp64 fold per head for the error and the element-wise checks
            meter = FoldErrorMeter(inputs.q_b_proj, inputs.kv_b_proj, geometry)
            if scale is not None:
                off, ulps = fp8_rounding_violations(stored, scale, inputs.q_b_proj, inputs.kv_b_proj, geometry, meter)
            else:
                off, ulps = one_rounding_violations(stored, inputs.q_b_proj, inputs.kv_b_proj, geometry, meter)
            worst_ulps = max(worst_ulps, ulps)
            measured = meter.result()
            error = measured.rel_fro_error
            probe = probe_error(stored, inputs.q_b_proj, inputs.kv_b_proj, geometry, scale=scale)
            worst_error, worst_probe = max(worst_error, error), max(worst_probe, probe)
            inaccurate = accuracy_problem(measured, dtype)  # the rule convert refuses a fold by
            if not same or inaccurate is not None or not probe <= 2 * tolerance or off:  # NaN fails too
                accuracy = inaccurate or f"relative error vs fp64 {error:.2e} in head {measured.worst_head}"
                problems.append(
                    Problem(
                        record.file,
                        f"'{record.name}' is not the fold of its sources rounded once ({differing} element(s) "
                        f"differ from the exact fold recomputed here; {accuracy}; probe x·W_foldᵀ vs two-step "
                        f"query {probe:.2e}, tolerance {tolerance:.1e}; {off} element(s) beyond one rounding "
                        "of the fp64 fold)",
                        record.name,
                    )
                )
            elif (mismatch := recorded_error_mismatch(record.error, meter)) is not None:
                # the figures inspect and convert show, judged on a right fold only (a wrong one's differ)
                problems.append(
                    Problem(
                        MANIFEST_NAME,
                        f"the error vs fp64 it records for '{record.name}' is not the fold's ({mismatch})",
                        record.name,
                    )
                )
    bar.close()
    summary = (
        f"{len(chosen)}/{len(plan.layers)} layer(s) recomputed: {bitwise} bitwise identical to the exact fold, "
        f"within {tolerance:.1e} of fp64 (worst {worst_error:.1e}), every element within one rounding of fp64; "
        f"probe x·W_foldᵀ vs unfolded query worst relative error {worst_probe:.1e}"
        + (f"; {nonfinite_inputs} layer(s) with NaN/Inf inputs compared bitwise only" if nonfinite_inputs else "")
    )
    return _level("deep", problems, summary)


def _check_options(out_dir: Path, manifest: Manifest, options: VerifyOptions) -> None:
    if (options.rank is None) != (options.tp is None):
        raise FoldckptError("--rank and --tp go together")
    if options.tp is None:
        return
    if not manifest.geometry.splits_heads(options.tp):
        raise FoldckptError(
            f"--tp {options.tp}: does not divide the model's {manifest.geometry.num_heads} attention heads "
            f"(sizes that serve it: {', '.join(map(str, manifest.geometry.tp_sizes()))})"
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
    if is_locked(out_dir):
        raise FoldckptError(
            f"{out_dir}: a foldckpt convert is writing this directory right now; verify it once that has finished"
        )
    conversion = conversion_status(out_dir)
    if conversion is not None:  # as inspect says it, with the command that finishes it
        raise FoldckptError(f"{out_dir}: {describe_conversion(out_dir, conversion)}")
    allowed: list[str] = []

    def report(levels: tuple[LevelResult, ...], sha256: str | None) -> VerifyReport:
        return VerifyReport(out_dir, levels, time.perf_counter() - begun, sha256, options.allow_extra, tuple(allowed))

    try:
        manifest = read_manifest(out_dir, options.expect_manifest_sha256)
    except ManifestError as exc:  # an edited, damaged or unpinned manifest: verification fails
        level = LevelResult(
            "manifest", False, "1 problem(s)", (Problem(MANIFEST_NAME, exc.detail),), time.perf_counter() - begun
        )
        return report((level,), file_sha256(out_dir))
    _check_options(out_dir, manifest, options)

    def manifest_level() -> LevelResult:
        level, entries = check_manifest(
            out_dir, manifest, options.expect_manifest_sha256 is not None, options.allow_extra
        )
        allowed.extend(entries)
        return level

    checks = {
        "manifest": manifest_level,
        "structure": lambda: check_structure(out_dir, manifest),
        "content": lambda: check_content(out_dir, manifest, options),
        "deep": lambda: check_deep(out_dir, manifest, options),
    }
    results: list[LevelResult] = []
    for name in LEVELS[: LEVELS.index(options.level) + 1]:
        started = time.perf_counter()
        result = checks[name]()
        results.append(dataclasses.replace(result, elapsed_s=time.perf_counter() - started))
        if options.on_level is not None:
            options.on_level(report(tuple(results), manifest.file_sha256))
        if not result.ok:
            break
    return report(tuple(results), manifest.file_sha256)
