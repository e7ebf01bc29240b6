"""Every default and rule that more than one module needs, written once (no torch, no vLLM).

Convert, verify, inspect and the serving loader all read these; the conversion planner
(:mod:`foldckpt.convert.plan`) re-exports the ones it uses, so that the vLLM plugin never imports it.
"""

from __future__ import annotations

import math
import os
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    import torch

# ``--fold-dtype`` choices and the safetensors dtype each is stored as. "fp8" is OCP e4m3 (e4m3fn)
# with an fp32 scale per output row beside it (``q_fold.weight_scale``; foldckpt.fold).
FOLD_DTYPE_NAMES: dict[str, str] = {"bfloat16": "BF16", "float16": "F16", "float32": "F32", "fp8": "F8_E4M3"}
DEFAULT_FOLD_DTYPE = "bfloat16"
SCALED_FOLD_DTYPES = ("fp8",)
FOLD_SCALE_DTYPE = "F32"
# What the serving log line says after "computed in" for an fp8 fold served as e4m3 (per-row fp32
# scale, the fp8 fold GEMM); one dequantized at load (CPU, older GPUs) says "bfloat16" there.
FP8_KERNEL_LOG = "float8_e4m3fn by the fp8 fold kernel"
_TORCH_DTYPE_NAMES = {"bfloat16": "bfloat16", "float16": "float16", "float32": "float32", "fp8": "float8_e4m3fn"}
# The fold is the exact value of each element rounded once to the fold dtype (foldckpt.rounding).
ACCUMULATION_DTYPE = "exact"
DEFAULT_MAX_SHARD_SIZE = 5 * 1024**3
SIDECAR_PREFIX = "foldckpt-"
# The resume journal of an unfinished conversion (foldckpt.convert.journal): verify and the serving
# loader refuse a directory that holds one.
JOURNAL_NAME = ".foldckpt-journal.json"
# A sidecar's header is padded to a multiple of this (the page size, and direct I/O's alignment),
# so its folds start on page boundaries: a Kimi-K3 fold is a whole number of pages, and convert
# writes each head chunk straight from its page-aligned ring buffer with direct I/O, no staging copy.
SIDECAR_HEADER_ALIGN = 4096
# Tensor-parallel sizes summaries show the per-rank memory of (those that divide H). Any TP size
# that divides H serves and verifies: that is the one TP rule, :meth:`Geometry.splits_heads`.
TP_CANDIDATES: tuple[int, ...] = (1, 2, 4, 8, 16)
# The serving plugin refuses a manifest whose file sha256 is not this (when set).
EXPECT_MANIFEST_ENV = "FOLDCKPT_EXPECT_MANIFEST_SHA256"
# The words the plugin's on/off switches (``FOLDCKPT_DISABLE``, ``FOLDCKPT_AUTOTUNE``) take.
_SWITCH_WORDS = {**dict.fromkeys(("1", "true", "yes", "on"), True), **dict.fromkeys(("0", "false", "no", "off"), False)}


def env_switch(name: str, default: bool, on: str, off: str, environ: Mapping[str, str] = os.environ) -> bool:
    """The on/off switch ``name`` of ``environ`` (``default`` where unset or blank). A value that is
    neither a yes nor a no is refused rather than guessed: either reading would do what its
    operator did not ask for. ``on`` / ``off`` say what each answer does, for that message."""
    from foldckpt.errors import FoldckptError

    raw = environ.get(name, "")
    if not raw.strip():
        return default
    try:
        return _SWITCH_WORDS[raw.strip().lower()]
    except KeyError:
        unset_on, unset_off = (" or unset", "") if default else ("", " or unset")
        raise FoldckptError(
            f"{name}={raw!r}: use 1, true, yes or on{unset_on} to {on}; 0, false, no or off{unset_off} to {off}"
        ) from None


# The serving plugin refuses entries of the served directory its manifest does not list, except
# those these patterns (separated by os.pathsep, as in PATH) match: verify's --allow-extra.
ALLOW_EXTRA_ENV = "FOLDCKPT_ALLOW_EXTRA"


def allow_extra_patterns(value: str | None) -> tuple[str, ...]:
    """The patterns of ``FOLDCKPT_ALLOW_EXTRA`` (none when unset or empty)."""
    return tuple(pattern for pattern in (value or "").split(os.pathsep) if pattern)


def nan_last(error: float) -> float:
    """A sort key under which a NaN error (that of a fold of NaN inputs, ``--allow-nonfinite``)
    is the worst: ``max`` of floats otherwise returns NaN or not depending on the order."""
    return math.inf if math.isnan(error) else error


def fold_torch_dtype(name: str) -> torch.dtype:
    """The torch dtype of a ``--fold-dtype`` name (imports torch)."""
    import torch

    if name not in FOLD_DTYPE_NAMES:
        raise KeyError(name)
    return getattr(torch, _TORCH_DTYPE_NAMES[name])


# ``convert --device``: where the fold is computed. "cpu" is the default: the fold is cheap next to
# the reads a conversion does, and the CPU gives the same bytes on every machine.
FOLD_DEVICES = ("cpu", "cuda", "auto")
DEFAULT_FOLD_DEVICE = "cpu"


# Device files through which torch reaches a GPU: NVIDIA's driver (its control file, there
# whichever GPUs a container was given), AMD's (ROCm, which torch also calls "cuda") and WSL2's.
GPU_DEVICE_FILES: tuple[str, ...] = ("/dev/nvidiactl", "/dev/kfd", "/dev/dxg")


def resolve_fold_device(name: str) -> str:
    """``cpu`` or ``cuda`` for a ``--device`` choice (``auto``: a GPU when torch sees one).

    ``cuda`` on a machine with a GPU device file is taken as it is, and confirmed by
    :func:`require_fold_device` once the fold imports torch. Why: torch's import takes seconds
    (torch_start_s in docs/bench/convert*.json), and convert hashes the sources meanwhile instead of waiting for it. Elsewhere, and for ``auto``
    (whose answer the run needs before it starts), torch is asked here."""
    from foldckpt.errors import FoldckptError

    if name not in FOLD_DEVICES:
        raise FoldckptError(f"--device {name!r}: choose one of {', '.join(FOLD_DEVICES)}")
    if name == "cpu":
        return "cpu"
    if name == "cuda":
        if not any(os.path.exists(path) for path in GPU_DEVICE_FILES):
            require_fold_device("cuda")  # no device file: ask torch now, before the run starts
        return "cuda"
    from foldckpt.console.signals import import_torch

    torch = import_torch()

    return "cuda" if torch.cuda.is_available() else "cpu"


def require_fold_device(device: str, advice: str = "use --device cpu or auto") -> None:
    """Refuse to fold on ``cuda`` where torch sees no GPU (a CPU build of torch, a driver it cannot
    use, no GPU visible to this process); ``advice`` ends the message."""
    from foldckpt.errors import FoldckptError

    if device != "cuda":
        return
    from foldckpt.console.signals import import_torch

    torch = import_torch()

    if not torch.cuda.is_available():
        raise FoldckptError(
            f"--device cuda: torch sees no GPU (torch.cuda.is_available() is False; torch {torch.__version__}, "
            f"CUDA {torch.version.cuda}, ROCm {torch.version.hip}); {advice}"
        )
