"""Per-GPU tuning tables for the fold GEMM, and the decode pre-route threshold derived from them.

One TOML file per GPU kind in ``configs/`` beside this module (``configs/<gpu_key>.toml``, found
through this module's own path so it works from a source tree and from an installed wheel). The
files are written by ``python -m foldckpt.runtime.kernels.tune`` on the GPU they describe, from
measurements, never by hand-picked numbers. Layout::

    [meta]                      gpu = "nvidia_h200", device_name, torch, triton, date, ...
    [[shape]]                   one fold GEMM shape: n = W_fold rows on a rank, k = its columns
    n = 6912
    k = 1536
    fold_max_tokens = 192       measured crossover: largest M where the fold beats the unfolded path
    [[shape.bucket]]            token buckets, ascending m_max, covering 1..TRITON_MAX_M
    m_max = 16
    backend = "triton"          which fold GEMM won at this bucket: "triton" or "torch"
    block_m = 16                the best Triton config (kept even when torch won, for tests/bench)
    block_n = 64
    block_k = 128
    split_k = 1
    num_warps = 4
    num_stages = 5
    use_tma = false
    rows_per_program = 0        rows of W per program (<= block_n; 0 = block_n)
    pdl = true                  launch with programmatic dependent launch (sm_90+)
    rope_epilogue = true        fold_query does the decode RoPE inside this kernel
    triton_us = 7.417           the measurements behind the choice (informative)
    torch_us = 8.131
"""

from __future__ import annotations

import functools
import math
import os
import tomllib
from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import torch

from foldckpt.errors import FoldckptError
from foldckpt.runtime.kernels.device import gpu_key

__all__ = [
    "CPU_FOLD_MAX_TOKENS",
    "ENV_FOLD_MAX_TOKENS",
    "TRITON_MAX_M",
    "UNKNOWN_GPU_FOLD_MAX_TOKENS",
    "Bucket",
    "GpuTable",
    "KernelConfig",
    "ShapeEntry",
    "config_dir",
    "fold_route_max_tokens",
    "kernel_config_for",
    "load_table",
    "parse_table",
]

ENV_FOLD_MAX_TOKENS = "FOLDCKPT_FOLD_MAX_TOKENS"
# On CPU the fold is one GEMM where the unfolded path runs a GEMM and a batched GEMM, and CPU
# GEMMs are compute-bound early; 256 covers every decode batch a CPU server sees.
CPU_FOLD_MAX_TOKENS = 256
# An untuned GPU: the fold reads 2.5x the bytes of q_b_proj + W_UK and wins on launch count, so
# keep it to batches where launch overhead dominates (well under the H200's measured crossover).
UNKNOWN_GPU_FOLD_MAX_TOKENS = 64
# Largest token count the Triton kernel is tuned for; above it the fold uses torch.
TRITON_MAX_M = 256

_KERNEL_KEYS = (
    "block_m", "block_n", "block_k", "split_k", "num_warps", "num_stages", "use_tma", "rows_per_program", "pdl",
    "rope_epilogue",
)  # fmt: skip
_BOOL_KEYS = ("use_tma", "pdl", "rope_epilogue")


@dataclass(frozen=True)
class KernelConfig:
    """Launch parameters of the Triton fold GEMM (see ``triton_gemm``)."""

    block_m: int
    block_n: int
    block_k: int
    split_k: int
    num_warps: int
    num_stages: int
    use_tma: bool = False
    # Rows of W each program owns (<= block_n); 0 means block_n. Fewer rows than the tile spread
    # a shape evenly over the SMs, so the tuner picks it per (N, bucket).
    rows_per_program: int = 0
    # Programmatic dependent launch (sm_90+): the kernel starts while the previous one drains and
    # waits for that kernel's writes on the device before reading x.
    pdl: bool = False
    # ``fold_query`` applies the decode RoPE in this kernel's epilogue instead of launching the
    # standalone RoPE kernel after it: the tuner times both per bucket.
    rope_epilogue: bool = False

    def rows(self, n: int) -> int:
        """Rows of W per program for an ``n``-row weight."""
        return min(self.rows_per_program or self.block_n, self.block_n, n)

    def fits(self, k: int) -> bool:
        """Whether the kernel can run with this config at reduction length ``k``."""
        return k % (self.split_k * self.block_k) == 0


@dataclass(frozen=True)
class Bucket:
    """Token counts ``(previous m_max, m_max]`` and the GEMM backend that won there."""

    m_max: int
    backend: Literal["triton", "torch"]
    config: KernelConfig


@dataclass(frozen=True)
class ShapeEntry:
    """One measured fold GEMM shape of one GPU."""

    n: int
    k: int
    fold_max_tokens: int
    buckets: tuple[Bucket, ...]

    def bucket_for(self, m: int) -> Bucket | None:
        """The bucket holding ``m`` tokens, or None above the last bucket."""
        for bucket in self.buckets:
            if m <= bucket.m_max:
                return bucket
        return None


@dataclass(frozen=True)
class GpuTable:
    """A parsed ``configs/<gpu>.toml``."""

    gpu: str
    meta: Mapping[str, Any]
    shapes: Mapping[tuple[int, int], ShapeEntry]


def config_dir() -> Path:
    """Folder of the per-GPU TOML tables (inside the package, so wheels carry it)."""
    return Path(__file__).resolve().parent / "configs"


def _require(table: Mapping[str, Any], key: str, kind: type | tuple[type, ...], where: str) -> Any:
    if key not in table:
        raise FoldckptError(f"{where}: missing key {key!r}; regenerate the table with the tuner")
    value = table[key]
    # bool is an int subclass: reject it where a count is expected.
    if not isinstance(value, kind) or (kind is int and isinstance(value, bool)):
        raise FoldckptError(f"{where}: key {key!r} has {value!r}, expected {kind}")
    return value


def _parse_bucket(raw: Mapping[str, Any], k: int, where: str) -> Bucket:
    m_max = _require(raw, "m_max", int, where)
    backend = _require(raw, "backend", str, where)
    if backend not in ("triton", "torch"):
        raise FoldckptError(f"{where}: backend {backend!r} is not 'triton' or 'torch'")
    values = {key: _require(raw, key, bool if key in _BOOL_KEYS else int, where) for key in _KERNEL_KEYS}
    config = KernelConfig(**values)
    if not config.fits(k):
        raise FoldckptError(f"{where}: k={k} is not a multiple of split_k*block_k of {config}")
    if not 0 <= config.rows_per_program <= config.block_n:
        raise FoldckptError(f"{where}: rows_per_program must be 0..block_n, got {config}")
    if not 1 <= m_max <= TRITON_MAX_M:
        raise FoldckptError(f"{where}: m_max={m_max} is outside 1..{TRITON_MAX_M}")
    return Bucket(m_max=m_max, backend=backend, config=config)


def parse_table(data: Mapping[str, Any], source: str) -> GpuTable:
    """Validate a loaded TOML document; ``source`` names it in error messages."""
    meta = _require(data, "meta", dict, source)
    gpu = _require(meta, "gpu", str, f"{source} [meta]")
    shapes: dict[tuple[int, int], ShapeEntry] = {}
    for i, raw in enumerate(_require(data, "shape", list, source)):
        where = f"{source} [[shape]] #{i}"
        n = _require(raw, "n", int, where)
        k = _require(raw, "k", int, where)
        max_tokens = _require(raw, "fold_max_tokens", int, where)
        buckets = tuple(
            _parse_bucket(b, k, f"{where} bucket #{j}") for j, b in enumerate(_require(raw, "bucket", list, where))
        )
        bounds = [b.m_max for b in buckets]
        if not buckets or bounds != sorted(set(bounds)):
            raise FoldckptError(f"{where}: buckets must be non-empty with strictly ascending m_max, got {bounds}")
        if (n, k) in shapes:
            raise FoldckptError(f"{where}: shape n={n} k={k} appears twice")
        shapes[(n, k)] = ShapeEntry(n=n, k=k, fold_max_tokens=max_tokens, buckets=buckets)
    return GpuTable(gpu=gpu, meta=meta, shapes=shapes)


@functools.cache
def load_table(gpu: str) -> GpuTable | None:
    """The table of GPU kind ``gpu``, or None when this GPU was never tuned."""
    path = config_dir() / f"{gpu}.toml"
    if not path.is_file():
        return None
    try:
        data = tomllib.loads(path.read_text(encoding="utf-8"))
    except tomllib.TOMLDecodeError as exc:
        raise FoldckptError(f"{path}: not valid TOML ({exc}); restore it from the package") from exc
    table = parse_table(data, str(path))
    if table.gpu != gpu:
        raise FoldckptError(f"{path}: [meta] gpu is {table.gpu!r}, expected {gpu!r} from the file name")
    return table


def kernel_config_for(gpu: str, n: int, k: int, m: int) -> KernelConfig | None:
    """The Triton config to use for an ``m`` x ``n`` x ``k`` fold GEMM, or None for torch.

    Only an exactly measured (n, k) runs Triton: a config tuned for another shape may lose to
    cuBLAS, and the table exists to never lose.
    """
    table = load_table(gpu)
    if table is None:
        return None
    entry = table.shapes.get((n, k))
    if entry is None:
        return None
    bucket = entry.bucket_for(m)
    if bucket is None or bucket.backend != "triton":
        return None
    return bucket.config


def _env_override() -> int | None:
    raw = os.environ.get(ENV_FOLD_MAX_TOKENS)
    if raw is None or raw.strip() == "":
        return None
    try:
        value = int(raw)
    except ValueError:
        raise FoldckptError(
            f"{ENV_FOLD_MAX_TOKENS}={raw!r} is not an integer; unset it or give a token count"
        ) from None
    if value < 0:
        raise FoldckptError(f"{ENV_FOLD_MAX_TOKENS}={value} is negative; use 0 to turn the fold off at decode")
    return value


def _crossover(table: GpuTable, n: int, k: int) -> int | None:
    """Measured crossover for (n, k), or the smaller of the two measured neighbours in log(n).

    The crossover is where the fold's extra bytes stop paying for the launch it saves; both
    scale with n, so neighbours are close, and taking the smaller one never routes a batch to
    a fold that was measured to lose at either neighbour.
    """
    entry = table.shapes.get((n, k))
    if entry is not None:
        return entry.fold_max_tokens
    same_k = sorted((e.n, e.fold_max_tokens) for e in table.shapes.values() if e.k == k)
    if not same_k:
        return None
    below = [t for measured_n, t in same_k if measured_n < n]
    above = [t for measured_n, t in same_k if measured_n > n]
    if below and above:
        return min(below[-1], above[0])
    nearest = min(same_k, key=lambda item: abs(math.log(item[0] / n)))
    return nearest[1]


def fold_route_max_tokens(n: int, k: int, device: torch.device) -> int:
    """Largest decode batch (tokens) that should take the fold GEMM instead of q_b_proj + W_UK.

    ``n`` and ``k`` are the fold GEMM's weight shape on this rank (``W_fold.shape``: heads per
    rank times (kv_lora_rank + qk_rope_head_dim), and q_lora_rank). Order of precedence:
    the environment variable ``FOLDCKPT_FOLD_MAX_TOKENS`` (an int; 0 disables the fold at
    decode), then on CPU ``CPU_FOLD_MAX_TOKENS``, then the GPU's tuning table (the measured
    crossover of that shape, or of the nearest measured shapes with the same k), then
    ``UNKNOWN_GPU_FOLD_MAX_TOKENS``. Host-side only: safe to call at any time.
    """
    override = _env_override()
    if override is not None:
        return override
    if device.type != "cuda":
        return CPU_FOLD_MAX_TOKENS
    table = load_table(gpu_key(device))
    if table is None:
        return UNKNOWN_GPU_FOLD_MAX_TOKENS
    crossover = _crossover(table, n, k)
    return UNKNOWN_GPU_FOLD_MAX_TOKENS if crossover is None else crossover
