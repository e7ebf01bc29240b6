"""``foldckpt`` command line: thin click commands over library functions.

Each command parses its options, calls one library function, and formats the frozen result it
returns (``--json`` prints it for machines). Input problems surface as
:class:`~foldckpt.errors.FoldckptError` and are printed on one line, exit code 2.
"""

from __future__ import annotations

import json
import re
import signal
import sys
from pathlib import Path
from typing import Any

import click

from foldckpt import __version__
from foldckpt.convert import DEFAULT_MAX_SHARD_SIZE, ConvertOptions, ConvertResult, convert
from foldckpt.errors import EXIT_BAD_INPUT, EXIT_OK, EXIT_VERIFY_FAILED, FoldckptError
from foldckpt.files import LINK_MODES
from foldckpt.geometry import describe_layers
from foldckpt.inspect import Inspection, inspect_dir
from foldckpt.plan import FOLD_DTYPES, ConversionPlan, plan_conversion
from foldckpt.verify import VerifyOptions, VerifyReport, verify

_SIZE_UNITS = {"": 1, "B": 1, "KB": 10**3, "MB": 10**6, "GB": 10**9, "TB": 10**12,
               "KIB": 2**10, "MIB": 2**20, "GIB": 2**30, "TIB": 2**40}  # fmt: skip


def human_bytes(count: float) -> str:
    for unit in ("B", "KB", "MB", "GB", "TB"):
        if abs(count) < 1000 or unit == "TB":
            return f"{count:.0f} {unit}" if unit == "B" else f"{count:.1f} {unit}"
        count /= 1000
    raise AssertionError("unreachable")


class ByteSize(click.ParamType):
    """Sizes such as ``5GB``, ``512MiB`` or plain bytes."""

    name = "size"

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> int:
        if isinstance(value, int):
            return value
        match = re.fullmatch(r"\s*(\d+(?:\.\d+)?)\s*([A-Za-z]*)\s*", str(value))
        if not match or match.group(2).upper() not in _SIZE_UNITS:
            self.fail(f"{value!r} is not a size like 5GB, 512MiB or 1000000", param, ctx)
        return int(float(match.group(1)) * _SIZE_UNITS[match.group(2).upper()])


def _parse_tp(ctx: click.Context, param: click.Parameter, value: tuple[str, ...]) -> tuple[int, ...] | None:
    try:
        sizes = tuple(int(part) for item in value for part in item.split(",") if part.strip())
    except ValueError:
        raise click.BadParameter("expected integers such as --tp 8 or --tp 1,2,4,8") from None
    return sizes or None


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(data, indent=2, default=str))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="foldckpt")
def cli() -> None:
    """Fold MLA's q_b_proj and W_UK into one decode weight per head, offline.

    \b
    foldckpt convert MODEL_DIR OUT_DIR   write OUT_DIR = MODEL_DIR + fold sidecars + manifest
    foldckpt verify OUT_DIR              prove OUT_DIR is what was converted (and that it is right)
    foldckpt inspect DIR                 geometry, MLA layers, fold status and overhead

    Exit codes: 0 ok, 1 verification failed, 2 bad input or usage.
    """


def _print_plan(plan: ConversionPlan) -> None:
    g = plan.geometry
    layers = describe_layers(layer.layer for layer in plan.layers)
    click.echo(f"model      {plan.source.model_dir} ({g.architecture}, family {g.family})")
    click.echo(
        f"geometry   H={g.num_heads} Lq={g.q_lora_rank} L={g.kv_lora_rank} P={g.qk_nope_head_dim} "
        f"R={g.qk_rope_head_dim} V={g.v_head_dim} rope={'yes' if g.uses_rope else 'no (NoPE)'}"
    )
    inputs = sorted({layer.q_b_proj.info.dtype for layer in plan.layers} | {layer.kv_b_proj.info.dtype for layer in plan.layers})
    click.echo(f"inputs     q_b_proj/kv_b_proj {'/'.join(inputs)} in {len(plan.source.headers)} shard(s)")
    click.echo(f"MLA layers {len(plan.layers)}: {layers}")
    click.echo(f"fold       [{g.fold_shape[0]}, {g.fold_shape[1]}] {plan.fold_dtype} per layer, {human_bytes(plan.fold_bytes)} in all")
    for shard in plan.shards:
        click.echo(f"sidecar    {shard.name}  {len(shard.layers)} layer(s)  {human_bytes(shard.size)}")
    click.echo(f"write      {human_bytes(plan.sidecar_bytes)} of sidecars; {len(plan.files_to_place)} source files "
               f"({human_bytes(plan.source_bytes())}) placed unchanged")  # fmt: skip
    per_gpu = ", ".join(f"TP{tp} {human_bytes(b)}" for tp, b in plan.extra_bytes_per_gpu().items())
    click.echo(f"GPU memory extra per rank: {per_gpu}")


def _print_convert(result: ConvertResult) -> None:
    if result.up_to_date:
        click.echo(f"{result.out_dir}: already converted with these inputs and parameters; nothing to do")
        return
    placed = ", ".join(f"{count} {how}" for how, count in sorted(result.placed.items())) or "none"
    click.echo(f"folded     {result.layers_folded} layer(s), resumed {result.layers_resumed}, total {result.layers_total}")
    for name, size in result.sidecars.items():
        click.echo(f"sidecar    {name}  {human_bytes(size)}")
    click.echo(f"sources    placed: {placed}")
    click.echo(f"accuracy   max relative error vs fp64 fold {result.max_rel_error:.2e}")
    click.echo(f"done       {result.out_dir} in {result.elapsed_s:.1f} s; check it with: foldckpt verify {result.out_dir}")


@cli.command(name="convert")
@click.argument("model_dir", type=click.Path(path_type=Path))
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--fold-dtype", type=click.Choice(list(FOLD_DTYPES)), default="bfloat16", show_default=True,
              help="Dtype of the stored fold (accumulation is always fp32, rounded once).")  # fmt: skip
@click.option("--max-shard-size", type=ByteSize(), default=DEFAULT_MAX_SHARD_SIZE, show_default="5GiB",
              help="Cap on each sidecar shard's size.")  # fmt: skip
@click.option("--tp", "tp_sizes", multiple=True, callback=_parse_tp, metavar="N[,N...]",
              help="Tensor-parallel sizes to record per-rank slice hashes for (default: 1,2,4,8,16 that divide H).")  # fmt: skip
@click.option("--link", type=click.Choice(LINK_MODES), default="auto", show_default=True,
              help="How source files appear in OUT_DIR: hard link (auto: when on the same filesystem), copy, symlink.")  # fmt: skip
@click.option("--dry-run", is_flag=True, help="Validate everything from headers and print the plan; write nothing.")
@click.option("--allow-nonfinite", is_flag=True, help="Fold even if q_b_proj/kv_b_proj contain NaN or Inf.")
@click.option("--restart", is_flag=True, help="Discard an unfinished (or different) previous run in OUT_DIR.")
@click.option("--overwrite", is_flag=True, help="Allow a non-empty OUT_DIR that is not a foldckpt output.")
@click.option("--workers", type=click.IntRange(min=1), default=None, help="Hashing threads (default: one per core).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
@click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
def convert_command(model_dir: Path, out_dir: Path, fold_dtype: str, max_shard_size: int,
                    tp_sizes: tuple[int, ...] | None, link: str, dry_run: bool, allow_nonfinite: bool,
                    restart: bool, overwrite: bool, workers: int | None, quiet: bool, as_json: bool) -> None:  # fmt: skip
    """Fold every MLA layer of MODEL_DIR into OUT_DIR (resumable; rerun to continue a killed run)."""
    if dry_run:
        plan = plan_conversion(model_dir, fold_dtype, max_shard_size, tp_sizes)
        if as_json:
            _emit_json({
                "layers": [layer.layer.index for layer in plan.layers],
                "sidecars": {shard.name: shard.size for shard in plan.shards},
                "fold_bytes": plan.fold_bytes,
                "extra_bytes_per_gpu": plan.extra_bytes_per_gpu(),
            })  # fmt: skip
        else:
            _print_plan(plan)
        return
    options = ConvertOptions(
        fold_dtype=fold_dtype, max_shard_size=max_shard_size, tp_sizes=tp_sizes, link=link,
        allow_nonfinite=allow_nonfinite, restart=restart, overwrite=overwrite,
        progress=not quiet and not as_json, workers=workers,
    )  # fmt: skip
    result = convert(model_dir, out_dir, options)
    _emit_json(result.to_dict()) if as_json else _print_convert(result)


def _print_verify(report: VerifyReport) -> None:
    for level in report.levels:
        click.echo(f"{'ok  ' if level.ok else 'FAIL'} {level.name:<10} {level.summary}")
        for problem in level.problems:
            click.echo(f"     - {problem}")
    click.echo("verified" if report.ok else "verification FAILED")


@cli.command(name="verify")
@click.argument("out_dir", type=click.Path(path_type=Path))
@click.option("--level", type=click.Choice(["manifest", "structure", "content", "deep"]), default="content",
              show_default=True, help="Stop after this level (each level includes the cheaper ones).")  # fmt: skip
@click.option("--deep", is_flag=True, help="Same as --level deep: recompute folds from the source tensors.")
@click.option("--sample", type=click.IntRange(min=1), default=None, help="With --deep: recompute only K layers.")
@click.option("--rank", type=click.IntRange(min=0), default=None, help="Hash only this rank's slice of each fold.")
@click.option("--tp", type=click.IntRange(min=1), default=None, help="Tensor-parallel size for --rank.")
@click.option("--workers", type=click.IntRange(min=1), default=None,
              help="Hashing threads (default: one per core when the files are cached, else two per core).")
@click.option("-q", "--quiet", is_flag=True, help="No progress bars.")
@click.option("--json", "as_json", is_flag=True, help="Print the report as JSON.")
def verify_command(out_dir: Path, level: str, deep: bool, sample: int | None, rank: int | None,
                   tp: int | None, workers: int | None, quiet: bool, as_json: bool) -> None:  # fmt: skip
    """Check OUT_DIR against its manifest: files, structure, sha256, and (--deep) the math."""
    if (rank is None) != (tp is None):
        raise click.UsageError("--rank and --tp go together")
    if sample is not None and not (deep or level == "deep"):
        raise click.UsageError("--sample applies to --deep")
    options = VerifyOptions(
        level="deep" if deep else level, sample=sample, rank=rank, tp=tp, workers=workers,
        progress=not quiet and not as_json,
    )  # fmt: skip
    report = verify(out_dir, options)
    _emit_json(report.to_dict()) if as_json else _print_verify(report)
    sys.exit(EXIT_OK if report.ok else EXIT_VERIFY_FAILED)


def _print_inspection(info: Inspection) -> None:
    g = info.geometry
    click.echo(f"directory  {info.directory}")
    click.echo(f"model      {g.architecture} (family {g.family})")
    click.echo(
        f"geometry   H={g.num_heads} Lq={g.q_lora_rank} L={g.kv_lora_rank} P={g.qk_nope_head_dim} "
        f"R={g.qk_rope_head_dim} V={g.v_head_dim} rope={'yes' if g.uses_rope else 'no (NoPE)'}"
    )
    layers = describe_layers(g.layers)
    click.echo(f"MLA layers {len(g.layers)}: {layers}")
    click.echo(f"weights    {human_bytes(info.model_bytes)}")
    if info.folded_layers is None:
        click.echo("fold       not converted (no foldckpt.json)")
        return
    click.echo(f"fold       {info.folded_layers}/{len(g.layers)} layers, {info.fold_dtype}, "
               f"{human_bytes(info.fold_bytes)} ({100 * info.fold_bytes / max(info.model_bytes, 1):.2f}% of the weights)")  # fmt: skip
    per_gpu = ", ".join(f"TP{tp} {human_bytes(b)}" for tp, b in info.extra_bytes_per_gpu.items())
    click.echo(f"GPU memory extra per rank: {per_gpu}")


@cli.command(name="inspect")
@click.argument("directory", type=click.Path(path_type=Path))
@click.option("--json", "as_json", is_flag=True, help="Print the inspection as JSON.")
def inspect_command(directory: Path, as_json: bool) -> None:
    """Show the MLA geometry of a model or converted directory, its fold status and overhead."""
    info = inspect_dir(directory)
    _emit_json(info.to_dict()) if as_json else _print_inspection(info)


def main() -> None:
    """Console entry point: one-line errors and exit code 2 for bad input."""
    # A file-size limit (RLIMIT_FSIZE) must surface as EFBIG, not kill the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    try:
        cli(prog_name="foldckpt")
    except FoldckptError as exc:
        click.echo(f"foldckpt: error: {exc}", err=True)
        sys.exit(EXIT_BAD_INPUT)
    except KeyboardInterrupt:
        click.echo("foldckpt: interrupted; rerun the same command to resume", err=True)
        sys.exit(130)
