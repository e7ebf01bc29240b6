"""``foldckpt`` command line: thin click commands over library functions.

Each command parses its options, calls one library function, and formats the frozen result it
returns (``--json`` prints it for machines). :func:`main` owns every way a command can end:

* usage errors (click's) and input problems (:class:`~foldckpt.errors.FoldckptError`): one line on
  stderr, exit 2;
* SIGINT / SIGTERM: one line, exit 130 / 143 (an interrupted ``convert`` resumes when rerun);
* anything else is a bug: one line naming the file the traceback was written to, exit 3;
* with ``--json``, each of these also prints ``{"error": {...}}`` on stdout.

Start-up stays light: this module imports click and the stdlib-only parts of foldckpt; the
commands import what they need when they run, so ``--help``, ``inspect``, ``convert --dry-run``
and ``verify`` up to its content level never import torch.
"""

from __future__ import annotations

import dataclasses
import errno
import gc
import json
import os
import re
import shlex
import signal
import sys
import tempfile
import time
import traceback
import warnings
from collections.abc import Callable
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import click

from foldckpt import __version__
from foldckpt.console import signals
from foldckpt.console.progress import human_bytes
from foldckpt.defaults import JOURNAL_NAME
from foldckpt.errors import (
    EXIT_BAD_INPUT,
    EXIT_INTERNAL,
    EXIT_OK,
    EXIT_VERIFY_FAILED,
    FoldckptError,
    Interrupted,
)
from foldckpt.io.files import json_safe
from foldckpt.model.geometry import describe_layers
from foldckpt.options import COUNT, INDEX, PATTERNS, SIZE, TP_SIZES, ConvertOptions, VerifyOptions

if TYPE_CHECKING:
    from foldckpt.convert import ConvertResult, Preflight
    from foldckpt.format.report import VerifyReport
    from foldckpt.inspect import Inspection
    from foldckpt.model.hub import ModelSource

__all__ = ["cli", "human_bytes", "main"]

_SIZE_UNITS = {
    "": 1,
    "B": 1,
    "KB": 10**3,
    "MB": 10**6,
    "GB": 10**9,
    "TB": 10**12,
    "KIB": 2**10,
    "MIB": 2**20,
    "GIB": 2**30,
    "TIB": 2**40,
}
_TP_HINT = "give positive integers such as --tp 8 or --tp 1,2,4,8"

# Set by ``convert`` to its OUT_DIR once it starts writing there: an interruption from then on is
# resumable, and what the rerun resumes from is read there (:func:`_kept`).
_resumable: Path | None = None


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
    sizes: list[int] = []
    for item in value:
        for part in item.split(","):
            text = part.strip()
            if not text:
                raise click.BadParameter(f"{item!r} has an empty entry; {_TP_HINT}")
            if not re.fullmatch(r"[+-]?\d+", text):
                raise click.BadParameter(f"{text!r} is not an integer; {_TP_HINT}")
            if int(text) <= 0:
                raise click.BadParameter(f"{text} is not a tensor-parallel size; {_TP_HINT}")
            sizes.append(int(text))
    return tuple(sizes) or None


_Command = TypeVar("_Command", bound=Callable[..., Any])


def _click_option(field: dataclasses.Field[Any]) -> Callable[[_Command], _Command]:
    """The click option of one :func:`foldckpt.options.flag` field."""
    meta = field.metadata
    name = meta["name"] or "--" + field.name.replace("_", "-")
    kwargs: dict[str, Any] = {"help": meta["help"], "metavar": meta["metavar"], "show_default": meta["show_default"]}
    if isinstance(field.default, bool):
        return click.option(name, field.name, is_flag=True, **kwargs)
    if meta["kind"] == TP_SIZES:
        return click.option(name, field.name, multiple=True, callback=_parse_tp, **kwargs)
    if meta["kind"] == PATTERNS:
        return click.option(name, field.name, multiple=True, **kwargs)
    if meta["choices"] is not None:
        kwargs["type"] = click.Choice(list(meta["choices"]))
    elif meta["kind"] is not None:
        kwargs["type"] = {COUNT: click.IntRange(min=1), INDEX: click.IntRange(min=0), SIZE: ByteSize()}[meta["kind"]]
    return click.option(name, field.name, default=field.default, **kwargs)


def options_of(options_class: type) -> Callable[[_Command], _Command]:
    """Every flag of ``options_class`` (:mod:`foldckpt.options`) as click options, in field order."""
    flags = [field for field in dataclasses.fields(options_class) if "help" in field.metadata]

    def decorate(command: _Command) -> _Command:
        for field in reversed(flags):
            command = _click_option(field)(command)
        return command

    return decorate


def options_from(options_class: type, params: dict[str, Any], **extra: Any) -> Any:
    """``options_class`` built from a command's parsed flags (``params``) and ``extra`` fields."""
    names = {field.name for field in dataclasses.fields(options_class)}
    return options_class(**{name: value for name, value in params.items() if name in names}, **extra)


# Shared by every command that prints a result.
json_option = click.option("--json", "as_json", is_flag=True, help="Print the result as JSON.")
quiet_option = click.option("-q", "--quiet", is_flag=True, help="No progress reports.")


def _emit_json(data: Any) -> None:
    click.echo(json.dumps(json_safe(data), indent=2, default=str))


def printable(text: str) -> str:
    """``text`` with each character that a terminal would not print as itself written as Python
    writes it in a string literal: ``\\n``, ``\\t``, ``\\x1b``, ``\\u2028``, and a byte of a file
    name that is not UTF-8 (decoded by surrogate escape) as ``\\xff``. Why: the text output names
    files found on disk, and a name holding a newline printed as it is forged a line of the report
    (``a\\nverified in 0.01 s`` in OUT_DIR printed a "verified" line under a failed verify), an
    escape sequence could rewrite the terminal. Every line of text output goes through here
    (:func:`_say`, :func:`_fail`); ``--json`` needs none, JSON escapes them itself."""
    if text.isprintable():
        return text
    return "".join(char if char.isprintable() else _escaped(char) for char in text)


def _escaped(char: str) -> str:
    code = ord(char)
    if 0xDC80 <= code <= 0xDCFF:  # os.fsdecode's stand-in for the undecodable byte code - 0xDC00
        return f"\\x{code - 0xDC00:02x}"
    return repr(char)[1:-1]


def _say(line: str = "") -> None:
    """One line of a command's text output (:func:`printable`)."""
    click.echo(printable(line))


@click.group(context_settings={"help_option_names": ["-h", "--help"]})
@click.version_option(__version__, prog_name="foldckpt")
def cli() -> None:
    """Fold MLA's q_b_proj and W_UK into one decode weight per head, offline.

    \b
    foldckpt convert MODEL_DIR OUT_DIR   write OUT_DIR = MODEL_DIR + fold sidecars + manifest
    foldckpt verify OUT_DIR              prove OUT_DIR is what was converted (and that it is right)
    foldckpt inspect DIR                 geometry, MLA layers, fold status and overhead

    MODEL_DIR may be a Hugging Face model id (ORG/NAME) in the local Hugging Face cache.

    Exit codes: 0 ok, 1 verification failed, 2 bad input or usage, 3 internal error,
    130/143 interrupted (rerun convert to resume).
    """


revision_option = click.option(
    "--revision",
    default=None,
    metavar="REV",
    help="With a Hugging Face model id: the branch, tag or full commit hash in the local cache (default main).",
)


def _resolve(model: str, revision: str | None) -> ModelSource:
    from foldckpt.model.hub import resolve_model

    return resolve_model(model, revision)


def _model_line(source: ModelSource) -> str:
    if source.repo_id is None:
        return str(source.path)
    return f"{source.repo_id} (revision {source.revision}, commit {source.commit}, {source.path})"


_STATES = {
    "new": "a new directory",
    "empty": "empty (or --overwrite): a fresh conversion",
    "resume": "an interrupted conversion of these inputs and parameters: resumed",
    "finished": "already converted with these inputs and parameters: nothing to fold",
    "replace": "an earlier conversion, cleared first (--restart/--overwrite)",
}


def _print_plan(pre: Preflight, source: ModelSource) -> None:
    plan = pre.plan
    g = plan.geometry
    layers = describe_layers(layer.layer for layer in plan.layers)
    _say(f"model      {_model_line(source)} ({g.architecture}, family {g.family})")
    _say(
        f"geometry   H={g.num_heads} Lq={g.q_lora_rank} L={g.kv_lora_rank} P={g.qk_nope_head_dim} "
        f"R={g.qk_rope_head_dim} V={g.v_head_dim} rope={'yes' if g.uses_rope else 'no (NoPE)'}"
    )
    inputs = sorted(
        {layer.q_b_proj.info.dtype for layer in plan.layers} | {layer.kv_b_proj.info.dtype for layer in plan.layers}
    )
    _say(f"inputs     q_b_proj/kv_b_proj {'/'.join(inputs)} in {len(plan.source.headers)} shard(s)")
    _say(f"MLA layers {len(plan.layers)}: {layers}")
    _say(
        f"fold       [{g.fold_shape[0]}, {g.fold_shape[1]}] {plan.fold_dtype} per layer, {human_bytes(plan.fold_bytes)} in all"
    )
    for shard in plan.shards:
        _say(f"sidecar    {shard.name}  {len(shard.layers)} layer(s)  {human_bytes(shard.size)}")
    state = _STATES[pre.state]
    if pre.state == "finished" and pre.repair:
        state = "already converted with these inputs and parameters, but damaged: repaired"
    if pre.state == "resume" or pre.repair:
        state += f" ({pre.layers_done} of {len(plan.layers)} layers done)"
    _say(f"out        {pre.out_dir}: {state}")
    if pre.repair:
        _say(f"repair     {', '.join(pre.repair)}: missing or damaged in OUT_DIR, placed or folded again")
    ways = {"hard": ("hard link", "hard links"), "copy": ("copy", "copies"), "symlink": ("symlink", "symlinks")}
    counts = [f"{n} {ways[how][n != 1]}" for how in ways if (n := list(pre.placement.values()).count(how))]
    copied = f" ({human_bytes(pre.copy_bytes)} copied)" if pre.copy_bytes else ""
    _say(
        f"write      {human_bytes(pre.sidecar_bytes)} of sidecars; {len(pre.placement)} source file(s) to place"
        + (f": {', '.join(counts)}{copied}" if counts else "")
    )
    per_gpu = ", ".join(f"TP{tp} {human_bytes(b)}" for tp, b in plan.extra_bytes_per_gpu().items())
    _say(f"GPU memory extra per rank: {per_gpu}")


def _layer_list(result: ConvertResult, status: str) -> str:
    return ", ".join(
        f"{layer.index}{' (mtp)' if layer.is_mtp else ''}" for layer in result.layers if layer.status == status
    )


def _print_convert(result: ConvertResult) -> None:
    worst = result.worst_layer
    accuracy = f"accuracy   max relative error vs fp64 fold {result.max_rel_error:.2e}" + (
        f" (layer {worst.index})" if worst is not None else ""
    )
    if result.up_to_date:
        if result.replaced:
            _say(f"{result.out_dir}: already converted with these inputs and parameters; nothing to fold")
            _say(
                f"re-placed  {len(result.replaced)} source file(s) placed otherwise by the earlier run, as "
                f"--link asks: {', '.join(result.replaced)}"
            )
        else:
            _say(f"{result.out_dir}: already converted with these inputs and parameters; nothing to do")
        _say(f"layers     {result.layers_total} MLA layer(s) folded: {_layer_list(result, 'up_to_date')}")
        _say(accuracy)
        return
    placed = ", ".join(f"{count} {how}" for how, count in sorted(result.placed.items())) or "none"
    folded = _layer_list(result, "folded")
    _say(f"folded     {result.layers_folded} of {result.layers_total} MLA layer(s)" + (f": {folded}" if folded else ""))
    if result.repaired:
        _say(f"repaired   {', '.join(result.repaired)}: missing or damaged in OUT_DIR, placed or folded again")
    if result.layers_resumed:
        _say(f"resumed    {result.layers_resumed} layer(s) folded by an earlier run: {_layer_list(result, 'resumed')}")
    for name, size in result.sidecars.items():
        _say(f"sidecar    {name}  {human_bytes(size)}")
    _say(f"sources    {sum(result.placed.values())} file(s) in OUT_DIR, placed: {placed}")
    if result.io:
        io = result.io
        _say(
            f"io         read {human_bytes(io['bytes_read'])} (re-read {human_bytes(io['bytes_reread'])}), "
            f"wrote {human_bytes(io['bytes_written'])}, copied {human_bytes(io['bytes_copied'])}; "
            f"folded on {result.fold_device}"
        )
    _say(accuracy)
    _say(f"done       {result.out_dir} in {result.elapsed_s:.1f} s; check it with: foldckpt verify {result.out_dir}")


@cli.command(name="convert")
@click.argument("model_dir", metavar="MODEL_DIR")
@click.argument("out_dir", type=click.Path(path_type=Path))
@revision_option
@options_of(ConvertOptions)
@click.option(
    "--dry-run",
    is_flag=True,
    help="Make every check the run makes (from headers; an earlier run's files as the run rechecks them) and print the plan; write nothing.",
)
@quiet_option
@json_option
def convert_command(
    model_dir: str, out_dir: Path, revision: str | None, dry_run: bool, quiet: bool, as_json: bool, **flags: Any
) -> None:
    """Fold every MLA layer of MODEL_DIR into OUT_DIR (resumable; rerun to continue a killed run).

    MODEL_DIR is a model directory, or a Hugging Face model id (ORG/NAME, with --revision)
    already in the local Hugging Face cache; foldckpt never downloads.
    """
    global _resumable
    source = _resolve(model_dir, revision)
    from foldckpt.convert import convert, preflight

    options = options_from(ConvertOptions, flags, progress=not quiet and not as_json)
    if dry_run:
        pre = preflight(source, out_dir, options)
        plan = pre.plan
        if as_json:
            _emit_json(
                {
                    "model": str(source.path),
                    "source": source.to_dict(),
                    "out_dir": str(out_dir),
                    "state": pre.state,
                    "repair": list(pre.repair),
                    "layers": [layer.layer.index for layer in plan.layers],
                    "layers_done": pre.layers_done,
                    "sidecars": {shard.name: shard.size for shard in plan.shards},
                    "fold_bytes": plan.fold_bytes,
                    "extra_bytes_per_gpu": plan.extra_bytes_per_gpu(),
                    "placement": pre.placement,
                    "sidecar_bytes_to_write": pre.sidecar_bytes,
                    "bytes_to_copy": pre.copy_bytes,
                    "free_bytes": pre.free_bytes,
                }
            )
        else:
            _print_plan(pre, source)
        return
    _resumable = out_dir
    result = convert(source, out_dir, options)
    _resumable = None
    _emit_json(result.to_dict()) if as_json else _print_convert(result)


class _VerifyPrinter:
    """Prints a verify report level by level as the levels end (``VerifyOptions.on_level``), so
    that an interrupted run has shown what it proved, then the verdict."""

    def __init__(self) -> None:
        self._shown = 0  # levels printed (every report has at least one)

    def __call__(self, report: VerifyReport) -> None:
        if self._shown == 0 and report.manifest_sha256 is not None:  # `sha256sum foldckpt.json` prints the same
            _say(f"sha256     {report.manifest_sha256}  foldckpt.json")
        for level in report.levels[self._shown :]:
            _say(f"{'ok  ' if level.ok else 'FAIL'} {level.name:<10} {level.summary} ({level.elapsed_s:.2f} s)")
            for problem in level.problems:
                _say(f"     - {problem}")
            if level.name == "manifest" and report.allow_extra:  # what the verdict took on trust, said each time
                patterns = " ".join(f"--allow-extra {shlex.quote(pattern)}" for pattern in report.allow_extra)
                _say(f"     allowed by {patterns}: {', '.join(report.allowed_extra) or 'nothing found'}")
        self._shown = len(report.levels)

    def finish(self, report: VerifyReport) -> None:
        self(report)
        _say(f"{'verified' if report.ok else 'verification FAILED'} in {report.elapsed_s:.2f} s")


@cli.command(name="verify")
@click.argument("out_dir", type=click.Path(path_type=Path))
@options_of(VerifyOptions)
@click.option("--deep", is_flag=True, help="Same as --level deep: recompute folds from the source tensors.")
@quiet_option
@json_option
@click.pass_context
def verify_command(ctx: click.Context, out_dir: Path, deep: bool, quiet: bool, as_json: bool, **flags: Any) -> None:
    """Check OUT_DIR against its manifest: files, structure, digests, and (--deep) the math.

    First the manifest proves itself unedited (its own digest); its file sha256 is printed: pin
    it with --expect-manifest-sha256 (or FOLDCKPT_EXPECT_MANIFEST_SHA256 when serving).
    """
    expect_sha256, level = flags["expect_manifest_sha256"], flags["level"]
    if expect_sha256 is not None and not re.fullmatch(r"[0-9a-fA-F]{64}", expect_sha256.strip()):
        raise click.BadParameter(
            f"{expect_sha256!r} is not a sha256 (64 hex digits)", param_hint="'--expect-manifest-sha256'"
        )
    if (flags["rank"] is None) != (flags["tp"] is None):
        raise click.UsageError("--rank and --tp go together (--rank R --tp N)")
    if flags["sample"] is not None and not (deep or level == "deep"):
        raise click.UsageError("--sample applies to --deep")
    if deep and level != "deep" and ctx.get_parameter_source("level") is click.core.ParameterSource.COMMANDLINE:
        raise click.UsageError(f"--deep is --level deep: it contradicts --level {level}")
    from foldckpt.verify import verify

    printer = None if as_json else _VerifyPrinter()
    flags["level"] = "deep" if deep else level
    options = options_from(VerifyOptions, flags, progress=not quiet and not as_json, on_level=printer)
    report = verify(out_dir, options)
    _emit_json(report.to_dict()) if printer is None else printer.finish(report)
    ctx.exit(EXIT_OK if report.ok else EXIT_VERIFY_FAILED)


def _print_inspection(info: Inspection) -> None:
    g = info.geometry
    _say(f"directory  {info.directory}")
    if info.source is not None:
        _say(
            f"source     {info.source['repo_id']} (revision {info.source['revision']}, commit {info.source['commit']})"
        )
    _say(f"model      {g.architecture} (family {g.family})")
    _say(
        f"geometry   H={g.num_heads} Lq={g.q_lora_rank} L={g.kv_lora_rank} P={g.qk_nope_head_dim} "
        f"R={g.qk_rope_head_dim} V={g.v_head_dim} rope={'yes' if g.uses_rope else 'no (NoPE)'}"
    )
    layers = describe_layers(g.layers)
    _say(f"MLA layers {len(g.layers)}: {layers}")
    _say(f"weights    {human_bytes(info.model_bytes)}")
    if info.conversion is not None:
        from foldckpt.inspect import describe_conversion

        _say(f"conversion {describe_conversion(info.directory, info.conversion)}")
    if info.folded_layers is None:
        if info.conversion is None:
            _say("fold       not converted (no foldckpt.json)")
        return
    if info.manifest_sha256 is not None:
        _say(f"sha256     {info.manifest_sha256}  foldckpt.json")
    _say(
        f"fold       {info.folded_layers}/{len(g.layers)} layers, {info.fold_dtype}, "
        f"{human_bytes(info.fold_bytes)} ({100 * info.fold_bytes / max(info.model_bytes, 1):.2f}% of the weights)"
    )
    for name, size in info.sidecars.items():
        count = sum(layer.sidecar == name for layer in info.layers)
        _say(f"sidecar    {name}  {count} layer(s)  {human_bytes(size)}")
    width = max((len(f"{layer.index}{' (mtp)' if layer.is_mtp else ''}") for layer in info.layers), default=0)
    for layer in info.layers:
        label = f"{layer.index}{' (mtp)' if layer.is_mtp else ''}"
        _say(f"layer      {label:<{width}}  {layer.sidecar}  relative error vs fp64 {layer.rel_fro_error:.2e}")
    per_gpu = ", ".join(f"TP{tp} {human_bytes(b)}" for tp, b in info.extra_bytes_per_gpu.items())
    _say(f"GPU memory extra per rank: {per_gpu}")


@cli.command(name="inspect")
@click.argument("directory", metavar="DIR")
@revision_option
@json_option
def inspect_command(directory: str, revision: str | None, as_json: bool) -> None:
    """Show the MLA geometry of a model or converted directory, its fold status and overhead.

    DIR may also be a Hugging Face model id (ORG/NAME) in the local Hugging Face cache.
    """
    from foldckpt.inspect import inspect_dir

    info = inspect_dir(_resolve(directory, revision))
    _emit_json(info.to_dict()) if as_json else _print_inspection(info)


# ---------------------------------------------------------------------------------------------
# How a command ends


def _wants_json(args: list[str]) -> bool:
    options = args[: args.index("--")] if "--" in args else args
    return "--json" in options


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _fail(code: int, kind: str, message: str, as_json: bool, **extra: Any) -> None:
    """Report how the command ended (one line on stderr, and JSON on stdout with --json); exit."""
    if as_json:
        click.echo(json.dumps({"error": {"code": code, "kind": kind, "message": message, **extra}}, indent=2))
    click.echo(printable(f"foldckpt: {'error: ' if kind in ('usage', 'input') else ''}{message}"), err=True)
    sys.exit(code)


def _usage_message(exc: click.UsageError) -> str:
    no_args = getattr(click.exceptions, "NoArgsIsHelpError", None)
    command = exc.ctx.command_path if exc.ctx is not None else "foldckpt"
    if no_args is not None and isinstance(exc, no_args):
        return f"no command given; choose one of convert, verify, inspect; see '{command} --help'"
    return f"{_one_line(exc.format_message()).rstrip('.')}; see '{command} --help'"


def _name_too_long(exc: OSError) -> str:
    """The refusal of a path the system cannot take (ENAMETOOLONG). Bad input wherever it is met: the
    path is one given on the command line, or one of those joined onto it (a source file, a sidecar),
    and every file operation may be the first to meet it, so it is told apart here, where the
    command ends, rather than at each of them."""
    where = "a path" if exc.filename is None else os.fsdecode(exc.filename)
    return (
        f"{where}: file name too long (a name longer than the filesystem allows, 255 bytes on most, or "
        f"a path longer than {os.pathconf('/', 'PC_PATH_MAX')} bytes); choose a shorter one"
    )


def _kept(out_dir: Path) -> str:
    """What an interrupted convert leaves in ``out_dir`` for the rerun, as its journal (or manifest)
    records it. Why read: the message said "the finished layers are kept" also when none had
    finished (a ^C while the sources were placed or torch imported)."""
    from foldckpt.convert.journal import Journal
    from foldckpt.format.manifest import MANIFEST_NAME

    if (out_dir / MANIFEST_NAME).is_file():  # interrupted while a finished output was rechecked
        return "the finished conversion is kept"
    try:
        journal = Journal.load(out_dir / JOURNAL_NAME) if (out_dir / JOURNAL_NAME).is_file() else None
    except FoldckptError:
        journal = None
    done = 0 if journal is None else journal.layers_done()
    if not done:
        return "no MLA layer had finished yet"
    total = "" if journal is None or journal.layers is None else f" of {journal.layers}"
    return f"{done}{total} MLA layer(s) finished and kept"


def _write_traceback() -> str:
    fd, path = tempfile.mkstemp(prefix="foldckpt-traceback-", suffix=".txt")
    with os.fdopen(fd, "w") as handle:
        handle.write(f"foldckpt {__version__}, python {sys.version.split()[0]}, {time.strftime('%Y-%m-%d %H:%M:%S')}\n")
        handle.write(f"argv: {sys.argv!r}\n\n")
        handle.write(traceback.format_exc())
    return path


def _run(args: list[str]) -> Any:
    """The command, then the garbage collector frozen: all that follows is output and exit, and the
    interpreter's teardown would otherwise collect every object torch's import made, hundreds of
    thousands once a command has imported torch, which makes exiting a large share of a short
    command's time."""
    try:
        return cli.main(args=args, prog_name="foldckpt", standalone_mode=False)
    finally:
        gc.freeze()


def main(args: list[str] | None = None) -> None:
    """Console entry point: run one command and end it with the documented exit code."""
    args = sys.argv[1:] if args is None else list(args)
    as_json = _wants_json(args)
    # torch warns on import when numpy is absent; foldckpt does not use numpy (nor depend on it).
    warnings.filterwarnings("ignore", message="Failed to initialize NumPy", category=UserWarning)
    # A file-size limit (RLIMIT_FSIZE) must surface as EFBIG, not kill the process.
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    # A reader that leaves (`foldckpt inspect DIR | head`) ends the command as it ends any Unix
    # tool: killed by SIGPIPE (exit status 141), nothing printed. Python ignores SIGPIPE, and click
    # turned the EPIPE into exit 1, "verification failed"; a cut-short verify must not read as a
    # result, and every step of convert is durable (the rerun resumes).
    signal.signal(signal.SIGPIPE, signal.SIG_DFL)
    signals.install()
    try:
        code = _run(args)
    except click.UsageError as exc:
        _fail(EXIT_BAD_INPUT, "usage", _usage_message(exc), as_json)
    except click.ClickException as exc:
        _fail(EXIT_BAD_INPUT, "usage", _one_line(exc.format_message()), as_json)
    except FoldckptError as exc:
        _fail(EXIT_BAD_INPUT, "input", str(exc), as_json)
    except (Interrupted, KeyboardInterrupt, click.exceptions.Abort) as exc:
        signum, name = (exc.signum, exc.name) if isinstance(exc, Interrupted) else (signal.SIGINT, "SIGINT")
        message = f"interrupted by {name}"
        if _resumable is not None:
            message += f"; {_kept(_resumable)}: rerun the same command to resume"
        _fail(128 + signum, "interrupted", message, as_json, signal=name, resumable=_resumable is not None)
    except Exception as exc:
        if isinstance(exc, OSError) and exc.errno == errno.ENAMETOOLONG:
            _fail(EXIT_BAD_INPUT, "input", _name_too_long(exc), as_json)
        # a bug: one line, the traceback in a file
        path = _write_traceback()
        first = _one_line(str(exc).splitlines()[0] if str(exc) else "")
        _fail(
            EXIT_INTERNAL,
            "internal",
            f"internal error: {type(exc).__name__}{': ' + first if first else ''}; "
            f"traceback written to {path} (please report it)",
            as_json,
            traceback=path,
        )
    sys.exit(code if isinstance(code, int) else EXIT_OK)
