"""Where each decode routing threshold comes from, and the start-up measurement behind it where no
tuning table covers this GPU.

Decode batches of at most ``Route.max_tokens`` tokens take the fold GEMM, larger ones q_b_proj +
W_UK. The threshold is never guessed; in order of precedence it is (``Route.source``):

- "env": ``FOLDCKPT_FOLD_MAX_TOKENS`` (an int; 0 turns the fold off at decode);
- "cpu": ``CPU_FOLD_MAX_TOKENS`` on the CPU (no GPU timing there);
- "table": this GPU's tuning table (``configs/<gpu>.toml``, see ``tuning.table_fold_max_tokens``);
- "measured" / "cached": no table entry for this GPU and shape, so the fold is timed against the
  unfolded path at start-up (:func:`measure_route_points`: the kernels ``fold_gemm`` and vLLM's
  q_b_proj + W_UK bmm would run, CUDA-graph timed as the tuner times them, on a coarse grid of M)
  and the threshold is ``tuning.decide_fold_max_tokens`` of those timings, the tuner's own rule.
  The timings are cached on disk per (GPU, driver, torch, triton, foldckpt, shape, dtype), so a
  later start reads them ("cached") instead of measuring; a cache file that does not parse or
  disagrees with its key, or that ``foldckpt.runtime.cache`` does not trust (not a regular file of
  this user's, too large, in a folder others can write), is ignored and measured again;
- "off": ``FOLDCKPT_AUTOTUNE=0`` and no table entry: no measurement, so no fold (served unfolded).

:func:`fold_route` may measure, so call it before CUDA graph capture, where vLLM has the GPU
(the plugin calls it while vLLM builds the first layer of each shape); it measures once per
(shape, dtype) per process.
"""

from __future__ import annotations

import json
import logging
import math
import os
import statistics
import time
from collections.abc import Mapping
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, Literal

import torch

import foldckpt
from foldckpt.defaults import env_switch
from foldckpt.errors import FoldckptError
from foldckpt.fold import quantize_fp8_rows
from foldckpt.io.files import parse_json
from foldckpt.runtime.cache import CacheDefect, cache_dir, driver_version, entry_path, read_entry, write_entry
from foldckpt.runtime.kernels.device import gpu_key
from foldckpt.runtime.kernels.dispatch import fold_gemm, warmup_fold_gemm
from foldckpt.runtime.kernels.reference import MlaDims, unfolded_query
from foldckpt.runtime.kernels.timing import LAYER_COPIES, layer_order, settle_clocks, time_graphs_us
from foldckpt.runtime.kernels.tuning import (
    CPU_FOLD_MAX_TOKENS,
    ROUTE_TOLERANCE,
    TRITON_MAX_M,
    decide_fold_max_tokens,
    is_fp8_weight,
    load_table,
    table_fold_max_tokens,
)

__all__ = [
    "AUTOTUNE_ENV",
    "ENV_FOLD_MAX_TOKENS",
    "STARTUP_GRID_M",
    "Route",
    "autotune_enabled",
    "cache_dir",
    "cache_path",
    "fold_route",
    "measure_route_points",
    "read_cached_points",
    "table_route",
    "write_cached_points",
]

logger = logging.getLogger("vllm.foldckpt")

ENV_FOLD_MAX_TOKENS = "FOLDCKPT_FOLD_MAX_TOKENS"
AUTOTUNE_ENV = "FOLDCKPT_AUTOTUNE"
# The start-up grid: powers of two up to the largest M the kernels are tuned for. Coarse, so that
# a model's shapes take seconds; the threshold it finds is a grid point, within one step of the
# tuner's finer grid.
STARTUP_GRID_M = (1, 2, 4, 8, 16, 32, 64, 128, TRITON_MAX_M)
# Each point is the median of this many rounds of fresh captures (one capture's placement moves a
# launch-bound point by more than the routing tolerance; the tuner does the same).
STARTUP_ROUNDS = 3
# Bumped when the cache file's layout changes: older files then miss their key and are re-measured.
CACHE_SCHEMA = 1
# A routing cache file holds a key and a dozen points: anything much larger is not one.
CACHE_MAX_BYTES = 64 * 1024

Source = Literal["env", "cpu", "table", "measured", "cached", "off"]
# (M, fold µs, unfolded µs), ascending M: what ``decide_fold_max_tokens`` reads.
Point = tuple[int, float, float]


@dataclass(frozen=True)
class Route:
    """A routing threshold and where it came from (``source``; ``detail`` says which file or value)."""

    max_tokens: int
    source: Source
    detail: str

    def describe(self) -> str:
        return f"threshold {self.max_tokens} from {self.source}: {self.detail}"


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


def autotune_enabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``FOLDCKPT_AUTOTUNE`` allows the start-up measurement (on unless turned off)."""
    return env_switch(
        AUTOTUNE_ENV,
        True,
        "measure the routing threshold at start-up where no tuning table covers the GPU",
        "serve such GPUs unfolded",
        environ,
    )


def cache_path(key: Mapping[str, Any], environ: Mapping[str, str] = os.environ) -> Path:
    """The cache file of ``key`` (a digest of it names the file; the file holds the key itself)."""
    return entry_path("route", key, ".json", environ)


def _triton_version() -> str:
    try:
        import triton
    except ImportError:
        return "none"
    return triton.__version__


def measurement_key(dims: MlaDims, device: torch.device, weight_dtype: torch.dtype, act_dtype: torch.dtype) -> dict:
    """Everything a start-up measurement depends on: a cache file measured under another key is stale."""
    return {
        "schema": CACHE_SCHEMA,
        "device_name": torch.cuda.get_device_name(device),
        "driver": driver_version(),
        "torch": torch.__version__,
        "triton": _triton_version(),
        "foldckpt": foldckpt.__version__,
        "dims": asdict(dims),
        "weight_dtype": str(weight_dtype).removeprefix("torch."),
        "act_dtype": str(act_dtype).removeprefix("torch."),
        "grid_m": list(STARTUP_GRID_M),
        "rounds": STARTUP_ROUNDS,
        "tolerance": ROUTE_TOLERANCE,
    }


def _valid_points(raw: object) -> list[Point]:
    """The points of a cache file, or ValueError: ascending M of the start-up grid, finite positive times."""
    if not isinstance(raw, list) or not raw:
        raise ValueError("no points")
    points = []
    for item in raw:
        if not (isinstance(item, list) and len(item) == 3 and type(item[0]) is int):
            raise ValueError(f"point {item!r} is not [M, fold_us, unfolded_us]")
        m, fold, unfolded = item
        if not all(isinstance(t, float) and math.isfinite(t) and t > 0 for t in (fold, unfolded)):
            raise ValueError(f"point {item!r} has a time that is not a positive number")
        points.append((m, fold, unfolded))
    ms = [p[0] for p in points]
    if ms != list(STARTUP_GRID_M[: len(ms)]):
        raise ValueError(f"M values {ms} are not a prefix of the start-up grid {list(STARTUP_GRID_M)}")
    return points


def read_cached_points(path: Path, key: Mapping[str, Any]) -> list[Point] | None:
    """The timings cached at ``path`` for ``key``, or None: missing, or not trusted (a file or folder
    ``foldckpt.runtime.cache`` refuses, or one that does not parse, was measured under another key,
    or whose threshold is not the one its timings give), which is logged in one line and then
    measured again."""
    try:
        raw = read_entry(path, CACHE_MAX_BYTES)
        if raw is None:
            return None
        doc = parse_json(raw.decode("utf-8"))
        if not isinstance(doc, dict) or doc.get("key") != dict(key):
            raise ValueError("measured under another key")
        points = _valid_points(doc.get("points"))
        if doc.get("fold_max_tokens") != decide_fold_max_tokens(points):
            raise ValueError(f"fold_max_tokens {doc.get('fold_max_tokens')!r} is not what its timings give")
    # ValueError covers a bad encoding, a document that does not parse or nests too deeply
    except (CacheDefect, ValueError) as exc:
        logger.warning("foldckpt: ignoring the routing cache %s (%s); measuring again", path, exc)
        return None
    return points


def write_cached_points(path: Path, key: Mapping[str, Any], points: list[Point]) -> bool:
    """Write the timings for ``key`` to ``path`` (``foldckpt.runtime.cache.write_entry``: atomic, so
    concurrent ranks of one host measuring the same key never leave half a file). False, and a
    warning, where the cache folder is not trusted or not writable: the threshold still holds."""
    doc = {"key": dict(key), "fold_max_tokens": decide_fold_max_tokens(points), "points": [list(p) for p in points]}
    try:
        write_entry(path, json.dumps(doc, indent=1).encode())
    except CacheDefect as exc:
        logger.warning("foldckpt: cannot write the routing cache %s (%s); the next start measures again", path, exc)
        return False
    return True


def measure_route_points(
    dims: MlaDims, device: torch.device, weight_dtype: torch.dtype, act_dtype: torch.dtype
) -> list[Point]:
    """Time the fold (``fold_gemm`` as the plugin calls it, with a ``weight_dtype`` weight) and the
    unfolded path (``reference.unfolded_query``: q_b_proj through ``F.linear`` + the W_UK bmm, as
    vLLM decodes) at each ``STARTUP_GRID_M``, over LAYER_COPIES copies of random weights of this
    shape, interleaved in CUDA graphs, the median of STARTUP_ROUNDS rounds. Stops after the first M
    where the fold loses (``decide_fold_max_tokens`` reads no further). Needs the GPU and no
    capture in progress; the weights it allocates are released before it returns."""
    with torch.cuda.device(device):
        points = _timed_points(dims, device, weight_dtype, act_dtype)
        torch.cuda.empty_cache()
    return points


def _timed_points(
    dims: MlaDims, device: torch.device, weight_dtype: torch.dtype, act_dtype: torch.dtype
) -> list[Point]:
    gen = torch.Generator(device=device).manual_seed(0)

    def weight(*shape: int) -> torch.Tensor:
        return (torch.randn(*shape, device=device, generator=gen) / shape[-1] ** 0.5).to(act_dtype)

    qb = weight(dims.heads * (dims.nope + dims.rope), dims.q_lora)
    uk = weight(dims.heads, dims.nope, dims.kv_lora)
    fold, scale = weight(dims.fold_rows, dims.q_lora), None
    if is_fp8_weight(weight_dtype):
        fold, scale = quantize_fp8_rows(fold)
    qbs, uks = [qb.clone() for _ in range(LAYER_COPIES)], [uk.clone() for _ in range(LAYER_COPIES)]
    folds = [fold.clone() for _ in range(LAYER_COPIES)]
    scales = [None if scale is None else scale.clone() for _ in range(LAYER_COPIES)]
    warmup_fold_gemm(folds[0], STARTUP_GRID_M[-1], scale=scales[0], x_dtype=act_dtype)
    settle_clocks(device)
    points: list[Point] = []
    for m in STARTUP_GRID_M:
        x = torch.randn(m, dims.q_lora, device=device, generator=gen).to(act_dtype)
        variants = {
            "fold": [lambda i=i, x=x: fold_gemm(x, folds[i], scale=scales[i]) for i in layer_order()],
            "unfolded": [lambda i=i, x=x: unfolded_query(x, qbs[i], uks[i], dims) for i in layer_order()],
        }
        rounds = [time_graphs_us(variants) for _ in range(STARTUP_ROUNDS)]
        point = (m, *(statistics.median(r[name] for r in rounds) for name in ("fold", "unfolded")))
        points.append(point)
        if point[1] * ROUTE_TOLERANCE > point[2]:
            break  # a loss: decide_fold_max_tokens reads no point past it
    return points


# Routes measured or read in this process: (dims, device index, weight dtype, activation dtype) -> Route.
_measured: dict[tuple, Route] = {}


def _startup_route(dims: MlaDims, device: torch.device, weight_dtype: torch.dtype, act_dtype: torch.dtype) -> Route:
    index = device.index if device.index is not None else torch.cuda.current_device()
    memo = (dims, index, weight_dtype, act_dtype)
    if memo in _measured:
        return _measured[memo]
    device = torch.device("cuda", index)
    key = measurement_key(dims, device, weight_dtype, act_dtype)
    path = cache_path(key)
    points = read_cached_points(path, key)
    if points is not None:
        route = Route(decide_fold_max_tokens(points), "cached", str(path))
    else:
        start = time.monotonic()
        points = measure_route_points(dims, device, weight_dtype, act_dtype)
        seconds = time.monotonic() - start
        written = write_cached_points(path, key, points)
        where = f"cached at {path}" if written else "not cached"
        route = Route(decide_fold_max_tokens(points), "measured", f"start-up measurement in {seconds:.1f} s, {where}")
    _measured[memo] = route
    return route


def fold_route(
    dims: MlaDims,
    device: torch.device,
    weight_dtype: torch.dtype | None = None,
    act_dtype: torch.dtype = torch.bfloat16,
) -> Route:
    """The routing threshold of the fold GEMM of ``dims`` (per rank: ``dims.fold_rows`` x
    ``dims.q_lora``) on ``device``, and where it came from (module docstring). ``weight_dtype`` is
    the fold weight's dtype as served (``torch.float8_e4m3fn``: the fp8 fold's own threshold; else,
    or None, the fold in ``act_dtype``, the activations' dtype). May measure: see the module docstring."""
    override = _env_override()
    if override is not None:
        return Route(override, "env", f"{ENV_FOLD_MAX_TOKENS}={override}")
    if device.type != "cuda":
        return Route(CPU_FOLD_MAX_TOKENS, "cpu", "the CPU default (no GPU timing there)")
    route = table_route(gpu_key(device), dims, weight_dtype)
    if route is not None:
        return route
    return _startup_route(dims, device, weight_dtype if weight_dtype is not None else act_dtype, act_dtype)


def table_route(
    gpu: str, dims: MlaDims, weight_dtype: torch.dtype | None = None, environ: Mapping[str, str] = os.environ
) -> Route | None:
    """The route GPU kind ``gpu``'s tuning table gives the fold of ``dims`` ("table"), "off" where no
    table covers it and ``FOLDCKPT_AUTOTUNE=0`` (threshold 0: served unfolded), else None: the
    start-up measurement decides."""
    table = load_table(gpu)
    threshold = table_fold_max_tokens(table, dims.fold_rows, dims.q_lora, weight_dtype) if table is not None else None
    if threshold is not None:
        return Route(threshold, "table", f"configs/{gpu}.toml")
    if not autotune_enabled(environ):
        return Route(0, "off", f"no {gpu} tuning table covers this shape and {AUTOTUNE_ENV}=0: served unfolded")
    return None
