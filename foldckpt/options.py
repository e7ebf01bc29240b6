"""The options of ``convert`` and ``verify``, each defined once.

The library takes these frozen dataclasses (``convert(source, out_dir, ConvertOptions(...))``).
A field that is also a command-line flag carries the flag's help, choices and value kind in its
metadata (:func:`flag`), and :mod:`foldckpt.cli` generates the click options from the fields: a
default, a choice or a help text lives here and nowhere else. Standard library only, because the
CLI imports this module at start-up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from foldckpt.defaults import (
    DEFAULT_FOLD_DEVICE,
    DEFAULT_FOLD_DTYPE,
    DEFAULT_MAX_SHARD_SIZE,
    FOLD_DEVICES,
    FOLD_DTYPE_NAMES,
)
from foldckpt.io.files import LINK_MODES

if TYPE_CHECKING:  # at start-up the CLI imports this module and no more than it needs
    from foldckpt.format.report import VerifyReport

# verify's levels, cheapest first; each level includes the ones before it.
LEVELS = ("manifest", "structure", "content", "deep")

# How a flag's value is parsed (cli.py maps each kind to a click type).
COUNT = "count"  # an integer >= 1
INDEX = "index"  # an integer >= 0
SIZE = "size"  # a byte size such as 5GB or 512MiB
TP_SIZES = "tp_sizes"  # comma-separated tensor-parallel sizes, repeatable
PATTERNS = "patterns"  # a repeatable flag, one pattern each


def flag(
    help: str,
    default: Any = None,
    *,
    choices: tuple[str, ...] | None = None,
    kind: str | None = None,
    name: str | None = None,
    metavar: str | None = None,
    show_default: bool | str = False,
) -> Any:
    """A dataclass field that is also the command-line flag ``name`` (default ``--field-name``).

    A bool field is an on/off switch; other fields take a value of ``kind`` or one of ``choices``.
    """
    metadata = {
        "help": help,
        "choices": choices,
        "kind": kind,
        "name": name,
        "metavar": metavar,
        "show_default": show_default,
    }
    return field(default=default, metadata=metadata)


@dataclass(frozen=True)
class ConvertOptions:
    fold_dtype: str = flag(
        "Dtype of the stored fold, each element its exact value rounded once (the same bytes on any "
        "device); fp8: OCP e4m3 from the fp32 fold with an fp32 scale per row, half the bytes of bfloat16.",
        DEFAULT_FOLD_DTYPE,
        choices=tuple(FOLD_DTYPE_NAMES),
        show_default=True,
    )
    max_shard_size: int = flag(
        "Cap on each sidecar shard's size (a layer's fold is never split: a shard holds at least one).",
        DEFAULT_MAX_SHARD_SIZE,
        kind=SIZE,
        show_default="5GiB",
    )
    tp_sizes: tuple[int, ...] | None = flag(
        "Tensor-parallel sizes to show the per-rank GPU memory of (default: 1,2,4,8,16 that divide H). "
        "Does not shape the output: every TP size dividing H serves and verifies (per-head hashes).",
        kind=TP_SIZES,
        name="--tp",
        metavar="N[,N...]",
    )
    link: str = flag(
        "How source files appear in OUT_DIR: hard link (auto: when on the same filesystem), copy, symlink.",
        "auto",
        choices=LINK_MODES,
        show_default=True,
    )
    allow_nonfinite: bool = flag("Fold even if q_b_proj/kv_b_proj contain NaN or Inf.", False)
    restart: bool = flag("Discard an unfinished (or different) previous run in OUT_DIR.", False)
    overwrite: bool = flag("Allow a non-empty OUT_DIR that is not a foldckpt output.", False)
    device: str = flag(
        "Where the fold is computed (auto: a GPU when torch sees one); the same bytes either way.",
        DEFAULT_FOLD_DEVICE,
        choices=FOLD_DEVICES,
        show_default=True,
    )
    workers: int | None = flag("Threads hashing the sources (default: two per core, at most 32).", kind=COUNT)
    # Progress reports on stderr (the CLI turns them off with --quiet and --json).
    progress: bool = True


@dataclass(frozen=True)
class VerifyOptions:
    level: str = flag(
        "Stop after this level (each level includes the cheaper ones).", "content", choices=LEVELS, show_default=True
    )
    sample: int | None = flag("With --deep: recompute only K layers.", kind=COUNT)
    rank: int | None = flag("Hash only this rank's slice of each fold.", kind=INDEX)
    tp: int | None = flag("Tensor-parallel size for --rank: any size that divides the attention heads.", kind=COUNT)
    # Refuse the directory unless foldckpt.json has exactly this sha256 (what `sha256sum` prints).
    expect_manifest_sha256: str | None = flag(
        "Fail unless foldckpt.json has this sha256 (as verify, inspect and sha256sum print it).", metavar="HEX"
    )
    # Patterns of entries the manifest does not list that may lie in the directory all the same
    # (shell-style, on the path relative to it: foldckpt.format.consistency.unlisted_entries).
    allow_extra: tuple[str, ...] = flag(
        "Let entries foldckpt.json does not list through when their path relative to OUT_DIR matches this "
        "shell-style pattern ('*' matches '/' too; a folder's match covers all it holds). Repeatable; "
        "recorded in the report. Without it, any unlisted file, folder or symlink fails.",
        (),
        kind=PATTERNS,
        metavar="PATTERN",
    )
    workers: int | None = flag(
        "Hashing threads (default: one per core when the files are cached, else two per core).", kind=COUNT
    )
    progress: bool = True
    # Called with the report so far as each level ends, so that a caller shows each result when
    # it is known: a `verify --deep` stopped by Ctrl-C still shows the levels that passed.
    on_level: Callable[[VerifyReport], None] | None = field(default=None, compare=False)
