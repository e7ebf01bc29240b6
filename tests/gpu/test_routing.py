"""The router's promise on the GPU the tests run on: routed >= 0.97x the faster of the fold (as
``fold_gemm`` runs it) and the unfolded path, at every shape of this GPU's table (or of the
start-up measurement where this GPU has none) and every M that its threshold decides; and that
measurement's bound and cache.

A threshold routes a prefix of M to the fold, so it decides the M up to it and the first M past it
(had the fold won there, the threshold would have gone on). A fold that wins only further up, past
a loss (on an H100, Kimi-K3 TP8's fold through cuBLAS at M = 192), is a win no threshold takes; the
unfolded path it keeps there is stock's.

The timings here are taken afresh, independently of those the threshold came from.
"""

from __future__ import annotations

import statistics
import time
from pathlib import Path

import pytest
import torch

from foldckpt.fold import quantize_fp8_rows
from foldckpt.runtime.kernels import fold_gemm, fold_route, fp8_fold_runs_as_fp8, gpu_key, warmup_fold_gemm
from foldckpt.runtime.kernels.reference import MlaDims, unfolded_query
from foldckpt.runtime.kernels.routing import (
    AUTOTUNE_ENV,
    ENV_FOLD_MAX_TOKENS,
    STARTUP_GRID_M,
    cache_path,
    measurement_key,
    read_cached_points,
)
from foldckpt.runtime.kernels.timing import LAYER_COPIES, layer_order, settle_clocks, time_graphs_us
from foldckpt.runtime.kernels.tuning import (
    FP8_WEIGHT_DTYPE,
    ROUTE_TOLERANCE,
    TRITON_MAX_M,
    decide_fold_max_tokens,
    load_table,
    q_b_proj_bucket,
    skinny_config,
)

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

HEADS = (6, 12, 24, 16)  # Kimi-K3 TP16 / TP8 / TP4, DeepSeek-V3 TP8
# The start-up measurement of a model's shapes (one per rank, per dtype) stays within this.
STARTUP_BUDGET_S = 10.0


def _weight_dtypes(cuda: torch.device) -> list[torch.dtype | None]:
    return [None, FP8_WEIGHT_DTYPE] if fp8_fold_runs_as_fp8(cuda) else [None]


def _routed_vs_faster(
    dims: MlaDims, cuda: torch.device, weight_dtype: torch.dtype | None, max_tokens: int, ms: tuple[int, ...]
) -> list[tuple[int, float]]:
    """(M, routed / faster-path speed) at each M: the fold through ``fold_gemm`` and the unfolded
    path on the fastest q_b_proj kernel the table (if any) has at that M, timed interleaved."""
    from foldckpt.tune.search import triton_unfolded_query

    gen = torch.Generator(device=cuda).manual_seed(7)
    k = dims.q_lora
    qb = torch.randn(dims.heads * (dims.nope + dims.rope), k, device=cuda, generator=gen).bfloat16() / k**0.5
    uk = torch.randn(dims.heads, dims.nope, dims.kv_lora, device=cuda, generator=gen).bfloat16() / dims.nope**0.5
    qbs, uks = [qb.clone() for _ in range(LAYER_COPIES)], [uk.clone() for _ in range(LAYER_COPIES)]
    fold = torch.randn(dims.fold_rows, k, device=cuda, generator=gen).bfloat16() / k**0.5
    scale = None
    if weight_dtype == FP8_WEIGHT_DTYPE:
        fold, scale = quantize_fp8_rows(fold)
    folds = [fold.clone() for _ in range(LAYER_COPIES)]
    scales = [None if scale is None else scale.clone() for _ in range(LAYER_COPIES)]
    warmup_fold_gemm(folds[0], max(ms), scale=scales[0])
    table = load_table(gpu_key(cuda))
    ratios = []
    for m in ms:
        settle_clocks(cuda)
        x = torch.randn(m, k, device=cuda, generator=gen).bfloat16()
        q = torch.empty(m, qbs[0].shape[0], device=cuda, dtype=torch.bfloat16)
        variants = {
            "fold": [lambda i=i, x=x: fold_gemm(x, folds[i], scale=scales[i]) for i in layer_order()],
            "cublas": [lambda i=i, x=x: unfolded_query(x, qbs[i], uks[i], dims) for i in layer_order()],
        }
        bucket = q_b_proj_bucket(table, qbs[0].shape[0], k, m) if m <= TRITON_MAX_M else None
        for name, cfg in (
            ("triton", bucket.config if bucket else None),
            ("skinny", skinny_config(table, "q_b_proj", qbs[0].shape[0], k, m)),
        ):
            if cfg is not None:
                if name == "triton":
                    from foldckpt.runtime.kernels import triton_gemm

                    triton_gemm.reserve_workspace(cuda, *triton_gemm.workspace_needs(m, q.shape[1], cfg))
                variants[name] = [
                    lambda i=i, c=cfg, x=x, q=q: triton_unfolded_query(x, qbs[i], uks[i], dims, c, q)
                    for i in layer_order()
                ]
        rounds = [time_graphs_us(variants) for _ in range(3)]
        t = {name: statistics.median(r[name] for r in rounds) for name in variants}
        unfolded = min(v for name, v in t.items() if name != "fold")
        routed = t["fold"] if m <= max_tokens else unfolded
        ratios.append((m, min(t["fold"], unfolded) / routed))
    return ratios


@pytest.mark.parametrize("heads", HEADS)
def test_routed_keeps_the_routing_target(
    cuda: torch.device, heads: int, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.delenv(ENV_FOLD_MAX_TOKENS, raising=False)
    monkeypatch.delenv(AUTOTUNE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    from foldckpt.tune.search import GRID_M

    dims = MlaDims(heads)
    for weight_dtype in _weight_dtypes(cuda):
        route = fold_route(dims, cuda, weight_dtype)
        ms = GRID_M if route.source == "table" else STARTUP_GRID_M
        ratios = _routed_vs_faster(dims, cuda, weight_dtype, route.max_tokens, ms)
        print(f"heads={heads} {weight_dtype}: {route.describe()}; routed/faster by M: {ratios}")
        past = [(m, ratio) for m, ratio in ratios if m > route.max_tokens][:1]
        worst = min([(m, ratio) for m, ratio in ratios if m <= route.max_tokens] + past, key=lambda mr: mr[1])
        assert worst[1] >= ROUTE_TOLERANCE, f"heads={heads} {weight_dtype} {route.describe()}: worst {worst}"


def test_startup_measurement_is_bounded_and_cached(
    cuda: torch.device, monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    """Where this GPU has no table entry (a shape with another k here, so it runs on any GPU): the
    measurement takes at most STARTUP_BUDGET_S for a shape's dtypes, writes its cache file, and
    the file gives the threshold the measurement did."""
    monkeypatch.delenv(ENV_FOLD_MAX_TOKENS, raising=False)
    monkeypatch.delenv(AUTOTUNE_ENV, raising=False)
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    dims = MlaDims(12, q_lora=2048)
    start = time.monotonic()
    routes = {dtype: fold_route(dims, cuda, dtype) for dtype in _weight_dtypes(cuda)}
    took = time.monotonic() - start
    print(
        f"start-up measurement of {len(routes)} dtypes: {took:.1f} s; "
        + "; ".join(r.describe() for r in routes.values())
    )
    assert took <= STARTUP_BUDGET_S
    for dtype, route in routes.items():
        assert route.source == "measured", route
        key = measurement_key(dims, cuda, dtype if dtype is not None else torch.bfloat16, torch.bfloat16)
        points = read_cached_points(cache_path(key), key)
        assert points is not None and decide_fold_max_tokens(points) == route.max_tokens
        assert fold_route(dims, cuda, dtype) == route, "once per (shape, dtype) per process"
