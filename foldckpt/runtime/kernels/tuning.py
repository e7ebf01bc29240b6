"""Per-GPU tuning tables for the fold GEMM, and the one rule that turns timings into a routing threshold.

One TOML file per GPU kind in ``configs/`` beside this module (``configs/<gpu_key>.toml``, found
through this module's own path so it works from a source tree and from an installed wheel), written
by ``python -m foldckpt.tune`` on the GPU it describes, never by hand. Their schema is
``configs/README.md``; :func:`parse_table` enforces it. Where the threshold of a decode batch comes
from (table, start-up measurement, environment) is :mod:`foldckpt.runtime.kernels.routing`.
"""

from __future__ import annotations

import functools
import math
import tomllib
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Literal

import torch

from foldckpt.errors import FoldckptError

__all__ = [
    "CPU_FOLD_MAX_TOKENS",
    "FP8_UNTUNED_CONFIGS",
    "FP8_WEIGHT_DTYPE",
    "ROUTE_TOLERANCE",
    "SKINNY_MAX_M",
    "TRITON_MAX_M",
    "FOLD_BACKENDS",
    "FP8_BACKENDS",
    "Bucket",
    "GpuTable",
    "KernelConfig",
    "ShapeEntry",
    "bucket_backend",
    "SkinnyConfig",
    "config_dir",
    "decide_fold_max_tokens",
    "is_fp8_weight",
    "kernel_config_for",
    "load_table",
    "parse_table",
    "q_b_proj_bucket",
    "skinny_config",
    "table_fold_max_tokens",
]

# On CPU the fold is one GEMM where the unfolded path runs a GEMM and a batched GEMM, and CPU
# GEMMs are compute-bound early; 256 covers every decode batch a CPU server sees.
CPU_FOLD_MAX_TOKENS = 256
# The routing target: the routed decode step at least this fraction of the faster of the folded and
# the unfolded path's speed at every M (``decide_fold_max_tokens``).
ROUTE_TOLERANCE = 0.97
# Largest token count the Triton kernel is tuned for; above it the fold uses torch.
TRITON_MAX_M = 256
# Largest token tile of the skinny kernel (no MMA: its work grows with M, so it only pays at a few tokens).
SKINNY_MAX_M = 16

# The fp8 fold's weight dtype (OCP e4m3, "fn": no infinities, one NaN pattern): what
# ``foldckpt.fold.quantize_fp8_rows`` writes and the fp8 kernels read.
FP8_WEIGHT_DTYPE = torch.float8_e4m3fn

_KERNEL_KEYS = (
    "block_m",
    "block_n",
    "block_k",
    "split_k",
    "num_warps",
    "num_stages",
    "use_tma",
    "rows_per_program",
    "pdl",
    "rope_epilogue",
)
_BOOL_KEYS = ("use_tma", "pdl", "rope_epilogue", "mma_f16")
# Keys a bucket may leave out (tables written before they existed), with the value that means.
_OPTIONAL_KERNEL_KEYS = {"mma_f16": False}
# The backends a fold bucket may name: [[shape]] (bf16/fp16 weight) and [[fp8_shape]] (e4m3 weight,
# which also has the Hopper CUDA kernel).
FOLD_BACKENDS = ("triton", "torch", "skinny")
FP8_BACKENDS = (*FOLD_BACKENDS, "cuda")
# Roles of a [[skinny]] entry: the weight it was tuned for.
_SKINNY_ROLES = ("q_b_proj", "fold", "fold_fp8")


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
    # fp8 weights only: the MMA runs in fp16 (e4m3 -> fp16 is one exact cvt per two values; x is
    # rounded to fp16 in the kernel) instead of x's dtype (e4m3 -> bf16 goes through fp16 and fp32).
    mma_f16: bool = False

    def rows(self, n: int) -> int:
        """Rows of W per program for an ``n``-row weight."""
        return min(self.rows_per_program or self.block_n, self.block_n, n)

    def fits(self, k: int) -> bool:
        """Whether the kernel can run with this config at reduction length ``k``."""
        return k % (self.split_k * self.block_k) == 0


@dataclass(frozen=True)
class SkinnyConfig:
    """Launch parameters of the skinny kernel (``triton_gemm.launch_skinny_gemm``): each program
    owns ``rows`` rows of W and ``block_m`` tokens and reduces K in ``block_k`` chunks (unrolled)."""

    block_m: int
    rows: int
    block_k: int
    num_warps: int
    pdl: bool = False

    def fits(self, k: int) -> bool:
        return k % self.block_k == 0


@dataclass(frozen=True)
class Bucket:
    """Token counts ``(previous m_max, m_max]`` and the GEMM backend that won there.

    ``config`` is the tiled Triton kernel's best config, also where ``backend`` is "torch" or
    "skinny" (the skinny kernel's configs are the table's [[skinny]] role="fold" entries) or
    "cuda" (the fp8 fold's Hopper kernel, ``cuda_fp8``; ``config`` then serves wherever that kernel
    cannot be built or loaded)."""

    m_max: int
    backend: Literal["triton", "torch", "skinny", "cuda"]
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
    # (n, k) -> the fold GEMM with a weight of the activations' dtype (bf16 / fp16): [[shape]].
    shapes: Mapping[tuple[int, int], ShapeEntry]
    # (n, k) of a q_b_proj weight -> its tuned buckets (the unfolded baseline's Triton kernel).
    q_b_proj: Mapping[tuple[int, int], tuple[Bucket, ...]] = field(default_factory=dict)
    # (role, n, k) -> the skinny kernel's configs, ascending block_m (its m_max).
    skinny: Mapping[tuple[str, int, int], tuple[SkinnyConfig, ...]] = field(default_factory=dict)
    # (n, k) -> the fp8 fold GEMM (e4m3 weight + fp32 scale per row): [[fp8_shape]].
    fp8_shapes: Mapping[tuple[int, int], ShapeEntry] = field(default_factory=dict)

    def entries(self, weight_dtype: torch.dtype | None = None) -> Mapping[tuple[int, int], ShapeEntry]:
        """The fold shapes measured for weights of ``weight_dtype`` (fp8: [[fp8_shape]], else [[shape]])."""
        return self.fp8_shapes if is_fp8_weight(weight_dtype) else self.shapes


def is_fp8_weight(weight_dtype: torch.dtype | None) -> bool:
    """Whether a fold weight of this dtype is the fp8 fold (and needs its per-row scale)."""
    return weight_dtype == FP8_WEIGHT_DTYPE


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


def _parse_bucket(raw: Mapping[str, Any], k: int, where: str, backends: tuple[str, ...]) -> Bucket:
    m_max = _require(raw, "m_max", int, where)
    backend = _require(raw, "backend", str, where)
    if backend not in backends:
        raise FoldckptError(f"{where}: backend {backend!r} is not one of {', '.join(map(repr, backends))}")
    values = {key: _require(raw, key, bool if key in _BOOL_KEYS else int, where) for key in _KERNEL_KEYS}
    for key, default in _OPTIONAL_KERNEL_KEYS.items():
        values[key] = _require(raw, key, bool, where) if key in raw else default
    config = KernelConfig(**values)
    if not config.fits(k):
        raise FoldckptError(f"{where}: k={k} is not a multiple of split_k*block_k of {config}")
    if not 0 <= config.rows_per_program <= config.block_n:
        raise FoldckptError(f"{where}: rows_per_program must be 0..block_n, got {config}")
    if not 1 <= m_max <= TRITON_MAX_M:
        raise FoldckptError(f"{where}: m_max={m_max} is outside 1..{TRITON_MAX_M}")
    return Bucket(m_max=m_max, backend=backend, config=config)


def _parse_buckets(
    raw: Mapping[str, Any], k: int, where: str, backends: tuple[str, ...] = ("triton", "torch")
) -> tuple[Bucket, ...]:
    buckets = tuple(
        _parse_bucket(b, k, f"{where} bucket #{j}", backends)
        for j, b in enumerate(_require(raw, "bucket", list, where))
    )
    bounds = [b.m_max for b in buckets]
    if not buckets or bounds != sorted(set(bounds)):
        raise FoldckptError(f"{where}: buckets must be non-empty with strictly ascending m_max, got {bounds}")
    return buckets


def _optional_tables(data: Mapping[str, Any], key: str, source: str) -> list[tuple[str, Any]]:
    """The entries of an optional ``[[key]]`` array of tables, each with its name for errors."""
    raw = data.get(key, [])
    if not isinstance(raw, list):
        raise FoldckptError(f"{source}: [[{key}]] must be an array of tables, got {raw!r}")
    return [(f"{source} [[{key}]] #{i}", entry) for i, entry in enumerate(raw)]


def parse_table(data: Mapping[str, Any], source: str) -> GpuTable:
    """Validate a loaded TOML document; ``source`` names it in error messages."""
    meta = _require(data, "meta", dict, source)
    gpu = _require(meta, "gpu", str, f"{source} [meta]")
    shapes, shape_where = _parse_shapes(
        [(f"{source} [[shape]] #{i}", raw) for i, raw in enumerate(_require(data, "shape", list, source))]
    )
    fp8_shapes, fp8_where = _parse_shapes(_optional_tables(data, "fp8_shape", source), FP8_BACKENDS)
    q_b_proj: dict[tuple[int, int], tuple[Bucket, ...]] = {}
    for where, raw in _optional_tables(data, "q_b_proj", source):
        n = _require(raw, "n", int, where)
        k = _require(raw, "k", int, where)
        if (n, k) in q_b_proj:
            raise FoldckptError(f"{where}: shape n={n} k={k} appears twice")
        q_b_proj[(n, k)] = _parse_buckets(raw, k, where)
    skinny: dict[tuple[str, int, int], list[SkinnyConfig]] = {}
    for where, raw in _optional_tables(data, "skinny", source):
        role = _require(raw, "role", str, where)
        if role not in _SKINNY_ROLES:
            raise FoldckptError(f"{where}: role {role!r} is not one of {', '.join(map(repr, _SKINNY_ROLES))}")
        k = _require(raw, "k", int, where)
        cfg = SkinnyConfig(
            block_m=_require(raw, "m_max", int, where),
            rows=_require(raw, "rows", int, where),
            block_k=_require(raw, "block_k", int, where),
            num_warps=_require(raw, "num_warps", int, where),
            pdl=_require(raw, "pdl", bool, where),
        )
        if not cfg.fits(k) or not 1 <= cfg.block_m <= SKINNY_MAX_M:
            raise FoldckptError(f"{where}: {cfg} does not fit k={k} or m_max is outside 1..{SKINNY_MAX_M}")
        if any(v < 1 or v & (v - 1) for v in (cfg.block_m, cfg.rows, cfg.block_k, cfg.num_warps)):
            raise FoldckptError(f"{where}: m_max, rows, block_k and num_warps must be powers of two, got {cfg}")
        key = (role, _require(raw, "n", int, where), k)
        if any(c.block_m == cfg.block_m for c in skinny.get(key, ())):
            raise FoldckptError(f"{where}: role={role} n={key[1]} k={k} m_max={cfg.block_m} appears twice")
        skinny.setdefault(key, []).append(cfg)
    skinny_sorted = {key: tuple(sorted(cfgs, key=lambda c: c.block_m)) for key, cfgs in skinny.items()}
    for role, entries, wheres in (("fold", shapes, shape_where), ("fold_fp8", fp8_shapes, fp8_where)):
        for (n, k), entry in entries.items():
            # A skinny bucket launches the [[skinny]] config of its role for each of its M: one must cover them all.
            covered = max((c.block_m for c in skinny_sorted.get((role, n, k), ())), default=0)
            for j, bucket in enumerate(entry.buckets):
                if bucket.backend == "skinny" and bucket.m_max > covered:
                    raise FoldckptError(
                        f"{wheres[(n, k)]} bucket #{j}: backend 'skinny' up to m_max={bucket.m_max}, but the "
                        f"[[skinny]] role='{role}' configs for n={n} k={k} cover M <= {covered} only"
                    )
    return GpuTable(gpu=gpu, meta=meta, shapes=shapes, q_b_proj=q_b_proj, skinny=skinny_sorted, fp8_shapes=fp8_shapes)


def _parse_shapes(
    raws: list[tuple[str, Any]], backends: tuple[str, ...] = FOLD_BACKENDS
) -> tuple[dict[tuple[int, int], ShapeEntry], dict[tuple[int, int], str]]:
    """[[shape]] or [[fp8_shape]] entries (each with its name for errors): (n, k) -> entry, and -> name."""
    shapes: dict[tuple[int, int], ShapeEntry] = {}
    wheres: dict[tuple[int, int], str] = {}
    for where, raw in raws:
        n = _require(raw, "n", int, where)
        k = _require(raw, "k", int, where)
        max_tokens = _require(raw, "fold_max_tokens", int, where)
        buckets = _parse_buckets(raw, k, where, backends)
        if (n, k) in shapes:
            raise FoldckptError(f"{where}: shape n={n} k={k} appears twice")
        shapes[(n, k)] = ShapeEntry(n=n, k=k, fold_max_tokens=max_tokens, buckets=buckets)
        wheres[(n, k)] = where
    return shapes, wheres


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


# The fp8 fold on a GPU or shape without a measured [[fp8_shape]]: (m_max, tiled config) buckets.
# Unlike the bf16 fold, whose untuned fallback (cuBLAS) streams the same bytes, the fp8 fold's torch
# path must dequantize the whole weight on every call (3x its bytes and a second launch), so the
# tiled kernel with a generic config always serves instead: no PDL and no TMA (NVIDIA sm_90+ only),
# shared memory under 100 KB (fits every GPU Triton targets), the fp16 MMA (``mma_f16``); the tiles
# are the H200 search's winners of those buckets at Kimi-K3 TP8 (docs/bench/tune_nvidia_h200.json).
FP8_UNTUNED_CONFIGS: tuple[tuple[int, KernelConfig], ...] = (
    (16, KernelConfig(16, 32, 256, 1, 4, 5, mma_f16=True)),
    (64, KernelConfig(32, 64, 256, 1, 4, 3, mma_f16=True)),
    (TRITON_MAX_M, KernelConfig(64, 128, 128, 1, 8, 3, mma_f16=True)),
)


def kernel_config_for(
    gpu: str, n: int, k: int, m: int, weight_dtype: torch.dtype | None = None
) -> KernelConfig | SkinnyConfig | None:
    """The fold GEMM kernel the table picks for an ``m`` x ``n`` x ``k`` fold GEMM on GPU kind
    ``gpu``: the bucket holding ``m`` says which, and this returns its launch parameters.
    ``weight_dtype`` ``torch.float8_e4m3fn`` reads the fp8 fold's [[fp8_shape]] entries (and its
    [[skinny]] role="fold_fp8" configs); any other dtype, or None, the [[shape]] entries.

    - backend "triton", or "cuda" (the fp8 Hopper kernel, which ``fold_gemm`` launches first where
      ``bucket_backend`` says so): that bucket's ``KernelConfig`` (the tiled kernel,
      ``launch_fold_gemm``; for "cuda" the fallback);
    - backend "skinny": the [[skinny]] role="fold" ``SkinnyConfig`` for ``m`` (``launch_skinny_gemm``;
      ``parse_table`` guarantees one exists);
    - backend "torch", ``m`` above the last bucket, an (n, k) the table never measured, or a GPU
      without a table: None (torch / cuBLAS).

    Only an exactly measured (n, k) runs Triton: a config tuned for another shape may lose to
    cuBLAS, and the table exists to never lose. The choice of backend is the tuner's alone
    (``foldckpt.tune``); this only reads it. [[q_b_proj]] entries are never returned. The one
    exception is the fp8 fold at an (n, k) or on a GPU the table has not measured: there the
    bucket of ``FP8_UNTUNED_CONFIGS`` holding ``m`` (M <= TRITON_MAX_M), see there why.
    """
    fp8 = is_fp8_weight(weight_dtype)
    table = load_table(gpu)
    entry = table.entries(weight_dtype).get((n, k)) if table is not None else None
    if entry is None:
        return next((cfg for m_max, cfg in FP8_UNTUNED_CONFIGS if m <= m_max), None) if fp8 else None
    bucket = entry.bucket_for(m)
    if bucket is None or bucket.backend == "torch":
        return None
    if bucket.backend == "skinny":
        return skinny_config(table, "fold_fp8" if fp8 else "fold", n, k, m)
    return bucket.config


def bucket_backend(gpu: str, n: int, k: int, m: int, weight_dtype: torch.dtype | None = None) -> str | None:
    """The backend the table chose for an ``m``-token fold GEMM of shape (n, k) on ``gpu``, or None
    where no measured bucket holds it."""
    table = load_table(gpu)
    entry = table.entries(weight_dtype).get((n, k)) if table is not None else None
    bucket = entry.bucket_for(m) if entry is not None else None
    return bucket.backend if bucket is not None else None


def q_b_proj_bucket(table: GpuTable | None, n: int, k: int, m: int) -> Bucket | None:
    """The tuned q_b_proj bucket holding ``m`` tokens for an ``n`` x ``k`` q_b_proj weight, or None
    (not tuned, or ``m`` above the last bucket). For the tuner and the benchmark's unfolded baseline."""
    buckets = table.q_b_proj.get((n, k), ()) if table is not None else ()
    return next((b for b in buckets if m <= b.m_max), None)


def skinny_config(table: GpuTable | None, role: str, n: int, k: int, m: int) -> SkinnyConfig | None:
    """The skinny kernel's config for ``m`` tokens on a ``role`` weight ``n`` x ``k``, or None."""
    configs = table.skinny.get((role, n, k), ()) if table is not None else ()
    return next((c for c in configs if m <= c.block_m), None)


def table_fold_max_tokens(table: GpuTable, n: int, k: int, weight_dtype: torch.dtype | None = None) -> int | None:
    """The table's threshold for (n, k), or the smaller of the two measured neighbours in log(n);
    None where the table has no entry of this k.

    The crossover is where the fold's extra bytes stop paying for the launch it saves; both
    scale with n, so neighbours are close, and taking the smaller one never routes a batch to
    a fold that was measured to lose at either neighbour. The fp8 fold reads its own entries;
    where the table has no fp8 entry of this k it takes the bf16 fold's (it streams half the
    bytes of that fold to the same unfolded baseline, so where the bf16 fold won, it does).
    """
    entries = table.entries(weight_dtype)
    if is_fp8_weight(weight_dtype) and not any(e.k == k for e in entries.values()):
        entries = table.shapes
    entry = entries.get((n, k))
    if entry is not None:
        return entry.fold_max_tokens
    same_k = sorted((e.n, e.fold_max_tokens) for e in entries.values() if e.k == k)
    if not same_k:
        return None
    below = [t for measured_n, t in same_k if measured_n < n]
    above = [t for measured_n, t in same_k if measured_n > n]
    if below and above:
        return min(below[-1], above[0])
    nearest = min(same_k, key=lambda item: abs(math.log(item[0] / n)))
    return nearest[1]


def decide_fold_max_tokens(points: Iterable[tuple[int, float, float]], tolerance: float = ROUTE_TOLERANCE) -> int:
    """The routing threshold from timings: the one rule the tuner, the start-up measurement and the
    decode benchmark apply. ``points`` are (M, fold µs, unfolded µs), ascending M, the fold on the
    backend ``fold_gemm`` runs at that M and the unfolded path on the fastest q_b_proj kernel there.

    The threshold is the largest M such that up to it the fold is never slower than
    ``unfolded / tolerance`` and, summed over the points up to it, faster than the unfolded path;
    0 where that holds nowhere. ``tolerance`` 1.0 is "never lost"; the default ROUTE_TOLERANCE is
    the project's routing target (routed >= 0.97x the faster path at every M), so that one point at
    parity within measurement noise does not turn off a fold that wins at the M around it. A fold
    time of inf (a wrong result) or NaN ends the range like a loss.
    """
    threshold, fold_sum, unfolded_sum = 0, 0.0, 0.0
    for m, fold, unfolded in points:
        if not fold * tolerance <= unfolded:
            break
        fold_sum += fold
        unfolded_sum += unfolded
        if fold_sum < unfolded_sum:
            threshold = m
    return threshold
