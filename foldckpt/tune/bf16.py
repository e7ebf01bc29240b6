"""Measure the fold GEMM on this GPU and write its tuning table (``configs/<gpu_key>.toml``).

    python -m foldckpt.tune --out DIR [--budget-s 330] [--heads 12,6,24]

1. Search: for every fold shape (N, K) and token bucket, time Triton configs of a pruned grid
   (tile sizes, split-K, pipeline depth, warps, TMA) at the bucket's largest M with CUDA graphs
   over 16 weight copies (nothing L2-resident), after checking each result; the base table's
   config for the same shape and bucket goes first, so a search cut short by the budget never
   ends worse than the last one. Then the winner with and without programmatic dependent launch
   (sm_90+), and with the decode RoPE in its epilogue or in the standalone RoPE kernel after it.
   The same search runs for the deployment's q_b_proj GEMM ([heads*(P+R), K], 1/3 of the fold's
   rows), so that the unfolded baseline gets the best q_b_proj kernel we have, not only cuBLAS.
   The skinny (GEMV-style) kernel is searched per token tile (M = 1, 2, 4, 8, 16) for both weights.
2. Grid: at M from 1 to 1024, time the unfolded path (q_b_proj GEMM + W_UK bmm, no RoPE) with
   cuBLAS and with the tiled and the skinny Triton q_b_proj kernels, the fold with torch, with the
   bucket's best tiled Triton config and (M <= 16) with the skinny kernel. ``decide``: per bucket
   keep the faster fold backend of tiled Triton and torch (and q_b_proj backend); then split the
   M <= 16 bucket at the skinny tiles where the skinny fold was faster than that backend
   (backend = "skinny" there, which ``fold_gemm`` follows); the unfolded baseline at each M is
   the fastest of its q_b_proj kernels, and ``fold_max_tokens`` is the crossover against it (see
   ``decide``; 0: the fold never wins there).
Writes ``tune_<gpu>.json`` (every measurement) and ``<gpu>.toml`` into DIR; copy the TOML into
``configs/`` to ship it. With ``--heads`` a subset of the shapes is retuned and the others are
kept as they are in ``--base`` (default: the shipped table; ``--base-json`` carries their
measurements over too). Needs a CUDA GPU and Triton.

    python -m foldckpt.tune --fp8 --out DIR [--budget-s 120] [--base-json JSON]

tunes the fp8 fold instead (``tune_fp8``): the same steps for the e4m3 weight + per-row scale,
written as [[fp8_shape]] / [[skinny]] role="fold_fp8" into a copy of ``--base`` whose other
entries stay as they are (and, with ``--base-json``, its measurements plus ``fp8_search`` /
``fp8_grid``); the unfolded baseline it is routed against uses ``--base``'s q_b_proj kernels.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import platform
import random
import statistics
import time
import tomllib
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from foldckpt.runtime.kernels.device import gpu_key
from foldckpt.runtime.kernels.reference import MlaDims, decode_rope, unfolded_query
from foldckpt.runtime.kernels.rope import QueryRope
from foldckpt.runtime.kernels.timing import (
    measure_copy_bandwidth,
    relative_error,
    settle_clocks,
    time_graph_us,
    time_graphs_us,
)
from foldckpt.runtime.kernels.tuning import TRITON_MAX_M, KernelConfig, SkinnyConfig, config_dir

# Heads per rank of the deployments we serve: Kimi-K3 (96 heads) at TP16/8/4, DeepSeek-V3
# (128 heads) at TP8; N = heads * 576.
HEADS = (12, 6, 16, 24)
K = 1536
BUCKETS = (16, 32, 64, 128, 256)
GRID_M = (1, 2, 4, 8, 14, 16, 28, 32, 56, 64, 96, 112, 128, 160, 192, 224, 256, 320, 384, 512, 768, 1024)
# Split-K lost everywhere in the first H200 search (2 splits: +2 µs, 12: +8 µs, the latency of the
# in-kernel reduction); 2 stays in the grid so each table re-checks that. The q_b_proj weights have
# a third of the fold's rows (36 whole 64-row programs at Kimi-K3 TP8 on 132 SMs), so their search
# also tries 4 splits and programs of down to a quarter tile of rows.
SPLITS = (1, 2)
Q_B_PROJ_SPLITS = (1, 2, 4)
LAYER_COPIES = 16
CALLS_PER_GRAPH = 32
# Each grid point is timed in this many rounds, each with fresh graph captures, and every variant
# keeps its median round: one capture's placement moved a launch-bound M=1 point by up to 0.9 µs
# (12%) between two H200 runs, more than the routing tolerance, and the crossover breaks at the
# first point where the fold loses.
GRID_ROUNDS = 3
# What is searched: the fold GEMM W_fold [n*(L+R), K] or vLLM's q_b_proj [n*(P+R), K].
ROLES = ("fold", "q_b_proj")
# The routing target: routed within 0.97x of the faster path at every M (see ``decide``).
ROUTE_TOLERANCE = 0.97
# Token tiles of the skinny kernel (the stand-in for vLLM's own skinny q_b_proj kernels at M <= 16).
SKINNY_BLOCK_MS = (1, 2, 4, 8, 16)
# Relative error a correct bf16-output GEMM stays far below (bf16 rounding of y is ~2e-3).
MAX_RELERR = 1e-2


def candidate_configs(block_m: int) -> Iterator[KernelConfig]:
    """Compile-time configs worth timing at ``block_m`` (split_k is set per launch later).

    Pruned by what a streaming GEMM needs: 16..96 KB of W in flight per program, shared
    memory under 200 KB, at most 64 fp32 accumulators per thread (more spills, as the
    compiler's resource report showed for 128).
    """
    for block_n in (32, 64, 128, 256):
        for block_k in (64, 128, 256):
            for warps in (4, 8):
                for stages in (2, 3, 4, 5, 6):
                    for tma in (False, True):
                        smem = stages * (block_n + block_m) * block_k * 2
                        in_flight = (stages - 1) * block_n * block_k * 2
                        acc_per_thread = block_n * block_m // (32 * warps)
                        if smem > 200 * 1024 or not 16 * 1024 <= in_flight <= 96 * 1024 or acc_per_thread > 64:
                            continue
                        # 32-row tiles run on mma.sync with one warpgroup; wgmma/TMA want >= 64.
                        if block_n == 32 and (warps == 8 or tma):
                            continue
                        if (warps == 8 and block_n * block_m < 128 * 32) or (
                            warps == 4 and block_n * block_m > 128 * 128
                        ):
                            continue
                        yield KernelConfig(block_m, block_n, block_k, 1, warps, stages, tma)


def skinny_candidates(block_m: int) -> Iterator[SkinnyConfig]:
    """Skinny-kernel configs worth timing at ``block_m`` tokens: at most 128 fp32 products per
    thread per K chunk, and at least one 16-byte load of W per thread and chunk."""
    for rows in (1, 2, 4, 8, 16):
        for block_k in (128, 256, 512):
            for warps in (1, 2, 4, 8):
                if rows * block_m * block_k > 128 * 32 * warps or rows * block_k < 256 * warps or K % block_k:
                    continue
                yield SkinnyConfig(block_m, rows, block_k, warps)


def skinny_block_m(m: int) -> int | None:
    return next((b for b in SKINNY_BLOCK_MS if m <= b), None)


def bucket_block_ms(m_max: int) -> tuple[int, ...]:
    """Tile heights tried for a bucket: the bucket itself, or half of it in two M tiles."""
    return (m_max,) if m_max == 16 else (m_max, m_max // 2)


def launch_variants(base: KernelConfig, n: int, m: int, role: str = "fold") -> list[KernelConfig]:
    """Run-time choices for a compiled config: rows per program and split count.

    Rows per program: the full tile, or fewer so that the programs come to a whole number of
    SM waves (1..4); TMA loads whole tiles, so it keeps full tiles. Splits must divide K and,
    with the programs, give 0.5 to ~9 waves. The fold keeps more than half a tile per program;
    the q_b_proj GEMM (a third of the rows) may go down to a quarter tile and 4 splits.
    """
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows_options = {base.block_n}
    if not base.use_tma:
        rows_options |= {-(-n // (waves * sms)) for waves in (1, 2, 3, 4)}
    min_rows = base.block_n // 2 if role == "fold" else base.block_n // 4
    splits = SPLITS if role == "fold" else Q_B_PROJ_SPLITS
    variants = []
    for rows in sorted(r for r in rows_options if min_rows < r <= base.block_n):
        programs = -(-n // rows) * -(-m // base.block_m)
        for split in splits:
            if K % (split * base.block_k) == 0 and sms // 2 <= programs * split <= 9 * sms:
                variants.append(replace(base, split_k=split, rows_per_program=0 if rows == base.block_n else rows))
    return variants


def _compile_worker(jobs: list[tuple]) -> list[tuple[dict, str]]:
    """Compile (by running once) each config in a fresh process; return the ones that failed.
    A job is (config dict, n) or (config dict, n, fp8, rope): an fp8 job builds the fp8 fold's
    variant (e4m3 weight + scale), a rope job the RoPE epilogue. A config dict with ``rows`` is a
    skinny-kernel config."""
    from foldckpt.runtime.kernels import triton_gemm

    failed = []
    for job in jobs:
        cfg_dict, n = job[0], job[1]
        fp8, rope = (job[2], job[3]) if len(job) > 2 else (False, False)
        try:
            w = torch.randn(n, K, device="cuda", dtype=torch.bfloat16)
            scale = torch.rand(n, device="cuda") + 0.5 if fp8 else None
            if fp8:
                w = w.to(torch.float8_e4m3fn)
            if "rows" in cfg_dict:
                sk = SkinnyConfig(**cfg_dict)
                x = torch.randn(sk.block_m, K, device="cuda", dtype=torch.bfloat16)
                y = torch.empty(sk.block_m, n, device="cuda", dtype=torch.bfloat16)
                triton_gemm.launch_skinny_gemm(x, w, y, sk, scale=scale)
                torch.cuda.synchronize()
                continue
            cfg = KernelConfig(**cfg_dict)
            x = torch.randn(cfg.block_m, K, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(cfg.block_m, n, device="cuda", dtype=torch.bfloat16)
            split = replace(cfg, split_k=2) if K % (2 * cfg.block_k) == 0 else cfg
            triton_gemm.reserve_workspace(x.device, *triton_gemm.workspace_needs(cfg.block_m, n, split))
            qrope = decode_rope(cfg.block_m, MlaDims(n // MlaDims(1).fold_head), x.device) if rope else None
            triton_gemm.launch_fold_gemm(x, w, y, split, qrope, scale=scale)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a config that fails to build is data, not a crash
            failed.append((cfg_dict, f"{type(exc).__name__}: {str(exc)[:200]}"))
    return failed


def precompile(configs: list[tuple], workers: int) -> set:
    """Fill Triton's on-disk cache in parallel processes; return configs that do not build.
    Each entry is (config, n) or (config, n, fp8, rope) as ``_compile_worker`` takes it."""
    chunks = [[(asdict(c[0]), *c[1:]) for c in configs[i::workers]] for i in range(workers)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        results = pool.map(_compile_worker, chunks)
    failed = set()
    for part in results:
        for cfg_dict, err in part:
            print(f"  config does not build: {cfg_dict}: {err}", flush=True)
            failed.add(SkinnyConfig(**cfg_dict) if "rows" in cfg_dict else KernelConfig(**cfg_dict))
    return failed


class GemmWeights:
    """LAYER_COPIES copies of one [n, K] weight and the Triton kernel timed over them; with
    ``scale`` the weight is the fp8 fold (e4m3, fp32 scale per row) and every launch passes it."""

    def __init__(self, weight: torch.Tensor, role: str, scale: torch.Tensor | None = None) -> None:
        self.n = weight.shape[0]
        self.role = role
        self.copies = [weight.clone() for _ in range(LAYER_COPIES)]
        self.scales = [scale.clone() for _ in range(LAYER_COPIES)] if scale is not None else [None] * LAYER_COPIES
        # What the kernels approximate, in fp32 (e4m3 * fp32 scale is exact in fp32).
        self.reference = weight.float() if scale is None else weight.float() * scale[:, None]

    def triton_calls(
        self, cfg: KernelConfig, x: torch.Tensor, y: torch.Tensor, rope: QueryRope | None = None
    ) -> list[Callable[[], None]]:
        from foldckpt.runtime.kernels import triton_gemm

        triton_gemm.reserve_workspace(x.device, *triton_gemm.workspace_needs(x.shape[0], self.n, cfg))
        return [
            lambda i=i: triton_gemm.launch_fold_gemm(x, self.copies[i], y, cfg, rope, scale=self.scales[i])
            for i in _layers()
        ]

    def triton_error(self, cfg: KernelConfig, x: torch.Tensor) -> float:
        """Relative error of the kernel vs an fp32 F.linear, on a NaN-poisoned output."""
        y = torch.full((x.shape[0], self.n), float("nan"), device="cuda", dtype=torch.bfloat16)
        self.triton_calls(cfg, x, y)[0]()
        return relative_error(y, F.linear(x.float(), self.reference))

    def time_triton(self, cfg: KernelConfig, m: int) -> tuple[float, float]:
        """(µs per call, relative error) of the kernel at ``m`` tokens; inf for a wrong result."""
        x = random_x(m)
        err = self.triton_error(cfg, x)
        if err > MAX_RELERR:
            return float("inf"), err
        y = torch.empty((m, self.n), device="cuda", dtype=torch.bfloat16)
        return time_graph_us(self.triton_calls(cfg, x, y)), err

    def skinny_calls(self, cfg: SkinnyConfig, x: torch.Tensor, y: torch.Tensor) -> list[Callable[[], None]]:
        from foldckpt.runtime.kernels import triton_gemm

        return [
            lambda i=i: triton_gemm.launch_skinny_gemm(x, self.copies[i], y, cfg, scale=self.scales[i])
            for i in _layers()
        ]

    def skinny_error(self, cfg: SkinnyConfig, x: torch.Tensor) -> float:
        y = torch.full((x.shape[0], self.n), float("nan"), device="cuda", dtype=torch.bfloat16)
        self.skinny_calls(cfg, x, y)[0]()
        return relative_error(y, F.linear(x.float(), self.reference))


def _layers() -> Iterator[int]:
    return (i % LAYER_COPIES for i in range(CALLS_PER_GRAPH))


def random_x(m: int) -> torch.Tensor:
    return torch.randn(m, K, device="cuda", dtype=torch.bfloat16)


def triton_unfolded_query(
    x: torch.Tensor,
    w_qb: torch.Tensor,
    w_uk_t: torch.Tensor,
    dims: MlaDims,
    cfg: KernelConfig | SkinnyConfig,
    q: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """``unfolded_query`` (no RoPE) with q_b_proj through the Triton kernel ``cfg`` (the tiled one
    for a ``KernelConfig``, the skinny one for a ``SkinnyConfig``) into ``q`` [M, n*(P+R)], then
    vLLM's W_UK bmm; for a tiled config the workspace must be reserved."""
    from foldckpt.runtime.kernels import triton_gemm

    if isinstance(cfg, SkinnyConfig):
        triton_gemm.launch_skinny_gemm(x, w_qb, q, cfg)
    else:
        triton_gemm.launch_fold_gemm(x, w_qb, q, cfg)
    q_nope, q_pe = q.view(-1, dims.heads, dims.nope + dims.rope).split([dims.nope, dims.rope], dim=-1)
    ql_nope = torch.bmm(q_nope.transpose(0, 1), w_uk_t)
    return ql_nope.transpose(0, 1), q_pe


class ShapeBench:
    """One deployment's fold and q_b_proj weights and W_UK, LAYER_COPIES deep, and the grid's variants."""

    def __init__(self, heads: int) -> None:
        self.dims = MlaDims(heads)
        self.n = self.dims.fold_rows
        dev = torch.device("cuda")
        fold = torch.randn(self.n, K, device=dev, dtype=torch.bfloat16) / K**0.5
        qb = torch.randn(heads * (self.dims.nope + self.dims.rope), K, device=dev, dtype=torch.bfloat16) / K**0.5
        uk = torch.randn(heads, self.dims.nope, self.dims.kv_lora, device=dev, dtype=torch.bfloat16) / 128**0.5
        self.fold = GemmWeights(fold, "fold")
        self.qb = GemmWeights(qb, "q_b_proj")
        self.uks = [uk.clone() for _ in range(LAYER_COPIES)]

    def weights(self, role: str) -> GemmWeights:
        return self.fold if role == "fold" else self.qb

    def time_grid_point(
        self,
        m: int,
        cfg: KernelConfig | None,
        qb_cfg: KernelConfig | None,
        skinny: dict[str, SkinnyConfig] | None = None,
    ) -> dict[str, float | str | None]:
        """Unfolded (cuBLAS and, given configs, Triton and skinny q_b_proj), torch fold and (given
        configs) Triton and skinny fold at ``m``, timed interleaved, the median of GRID_ROUNDS
        rounds of fresh captures. A config with a wrong result times as inf. ``decide`` picks the fold's skinny sub-buckets from ``skinny_us``."""
        from foldckpt.runtime.kernels import triton_gemm

        x = random_x(m)
        qbs, uks, dims = self.qb.copies, self.uks, self.dims
        variants = {
            "unfolded_cublas_us": [lambda i=i: unfolded_query(x, qbs[i], uks[i], dims) for i in _layers()],
            "torch_us": [lambda i=i: F.linear(x, self.fold.copies[i]) for i in _layers()],
        }
        if cfg is not None and self.fold.triton_error(cfg, x) <= MAX_RELERR:
            y = torch.empty((m, self.n), device="cuda", dtype=torch.bfloat16)
            variants["triton_us"] = self.fold.triton_calls(cfg, x, y)
        if qb_cfg is not None and self.qb.triton_error(qb_cfg, x) <= MAX_RELERR:
            q = torch.empty((m, self.qb.n), device="cuda", dtype=torch.bfloat16)
            triton_gemm.reserve_workspace(x.device, *triton_gemm.workspace_needs(m, self.qb.n, qb_cfg))
            variants["unfolded_triton_us"] = [
                lambda i=i: triton_unfolded_query(x, qbs[i], uks[i], dims, qb_cfg, q) for i in _layers()
            ]
        skinny = skinny or {}
        sk_qb, sk_fold = skinny.get("q_b_proj"), skinny.get("fold")
        if sk_qb is not None and self.qb.skinny_error(sk_qb, x) <= MAX_RELERR:
            q_sk = torch.empty((m, self.qb.n), device="cuda", dtype=torch.bfloat16)
            variants["unfolded_skinny_us"] = [
                lambda i=i: triton_unfolded_query(x, qbs[i], uks[i], dims, sk_qb, q_sk) for i in _layers()
            ]
        if sk_fold is not None and self.fold.skinny_error(sk_fold, x) <= MAX_RELERR:
            y_sk = torch.empty((m, self.n), device="cuda", dtype=torch.bfloat16)
            variants["skinny_us"] = self.fold.skinny_calls(sk_fold, x, y_sk)
        times: dict[str, float | None] = {
            "triton_us": float("inf") if cfg is not None else None,
            "unfolded_triton_us": float("inf") if qb_cfg is not None else None,
            "unfolded_skinny_us": float("inf") if sk_qb is not None else None,
            "skinny_us": float("inf") if sk_fold is not None else None,
        }
        rounds = [time_graphs_us(variants) for _ in range(GRID_ROUNDS)]
        times.update({name: statistics.median(r[name] for r in rounds) for name in variants})
        unfolded = {
            "cublas": times["unfolded_cublas_us"],
            "triton": times["unfolded_triton_us"],
            "skinny": times["unfolded_skinny_us"],
        }
        kernel = min((k for k, v in unfolded.items() if v is not None), key=lambda k: unfolded[k])
        times["unfolded_us"] = unfolded[kernel]
        return {**times, "q_b_proj_kernel": kernel}


# Share of a search budget per bucket where the caller gives none: equal.
EQUAL_SHARES = dict.fromkeys(BUCKETS, 1.0)


def time_bucket(
    weights: GemmWeights,
    role: str,
    m_max: int,
    candidates: list[KernelConfig],
    seed: KernelConfig | None,
    deadline: float,
    log: list[dict],
    shares: dict[int, float] = EQUAL_SHARES,
) -> tuple[KernelConfig, float]:
    """The fastest of ``candidates`` for bucket ``m_max``, timed at M = ``m_max`` (each timing
    appended to ``log``): (config, µs).

    The candidates are tried in a fixed shuffled order, so a search cut short still samples the
    whole grid, with ``seed`` (the base table's winner) first, so it never ends worse than the
    last search; the bucket gets its share (``shares``) of the time left before ``deadline``
    among the buckets from ``m_max`` on, and times at least one config.
    """
    ordered = list(candidates)
    random.Random(m_max).shuffle(ordered)
    if seed is not None:
        ordered = [seed] + [c for c in ordered if c != seed]
    later = [m for m in BUCKETS if m >= m_max]
    bucket_deadline = time.monotonic() + (deadline - time.monotonic()) * shares[m_max] / sum(shares[m] for m in later)
    best: tuple[KernelConfig, float] | None = None
    timed = 0
    for cfg in ordered:
        if best is not None and time.monotonic() > bucket_deadline:
            break
        us, err = weights.time_triton(cfg, m_max)
        timed += 1
        log.append({"role": role, "n": weights.n, "m": m_max, **asdict(cfg), "us": us, "relerr": err})
        if us < (best[1] if best is not None else float("inf")):
            best = (cfg, us)
    if best is None:
        raise RuntimeError(f"{role} N={weights.n} M<={m_max}: none of {timed} configs ran")
    print(f"  {role} N={weights.n} M<={m_max}: best {best[1]:.2f} us of {timed}/{len(ordered)} timed: {best[0]}",
          flush=True)  # fmt: skip
    return best


def search(
    bench: ShapeBench,
    role: str,
    failed: set[KernelConfig],
    deadline: float,
    log: list[dict],
    seeds: dict[int, KernelConfig] | None = None,
) -> dict[int, tuple[KernelConfig, float]]:
    """Best (config, µs) per bucket for one shape's fold (``role`` "fold") or q_b_proj GEMM
    (:func:`time_bucket`), then the winner with and without PDL and (the fold) the RoPE epilogue."""
    weights = bench.weights(role)
    best: dict[int, tuple[KernelConfig, float]] = {}
    for m_max in BUCKETS:
        candidates = [
            cfg
            for block_m in bucket_block_ms(m_max)
            for base in candidate_configs(block_m)
            if base not in failed
            for cfg in launch_variants(base, weights.n, m_max, role)
        ]
        seed = (seeds or {}).get(m_max)
        # PDL and the RoPE epilogue are chosen for the winner below, whichever config wins.
        seed = None if seed is None else replace(seed, pdl=False, rope_epilogue=False)
        cfg, us = time_bucket(weights, role, m_max, candidates, seed, deadline, log)
        if pdl_supported():
            cfg, us = choose_pdl(weights, cfg, m_max, log)
        if role == "fold":
            cfg = choose_rope_epilogue(bench, cfg, m_max, log)
        print(f"  {role} N={weights.n} M<={m_max}: {us:.2f} us with {cfg}", flush=True)
        best[m_max] = (cfg, us)
    return best


def search_skinny(
    bench: ShapeBench,
    role: str,
    failed: set,
    log: list[dict],
    candidates: Callable[[int], Iterator[SkinnyConfig]] = skinny_candidates,
) -> dict[int, tuple[SkinnyConfig, float]]:
    """Best (skinny config, µs) per token tile for one shape's fold or q_b_proj weight, timed at
    the tile's M over every candidate (about 140 in all), then the winner with and without PDL."""
    weights = bench.weights(role)
    best: dict[int, tuple[SkinnyConfig, float]] = {}
    for block_m in SKINNY_BLOCK_MS:
        x = random_x(block_m)
        y = torch.empty((block_m, weights.n), device="cuda", dtype=torch.bfloat16)
        timed = 0
        for cfg in (c for c in candidates(block_m) if c not in failed):
            err = weights.skinny_error(cfg, x)
            us = time_graph_us(weights.skinny_calls(cfg, x, y)) if err <= MAX_RELERR else float("inf")
            timed += 1
            log.append({"role": role, "kernel": "skinny", "n": weights.n, "m": block_m, **asdict(cfg), "us": us,
                        "relerr": err})  # fmt: skip
            if us < best.get(block_m, (None, float("inf")))[1]:
                best[block_m] = (cfg, us)
        if block_m not in best:
            # No candidate for this tile (the fp8 rules leave none at M=16) or none was right.
            print(f"  skinny {role} N={weights.n} M<={block_m}: no candidate", flush=True)
            continue
        cfg, us = best[block_m]
        if pdl_supported():
            choices = {"stream order": cfg, "pdl": replace(cfg, pdl=True)}
            if weights.skinny_error(choices["pdl"], x) > MAX_RELERR:
                raise RuntimeError(f"{choices['pdl']} gives a wrong result where {cfg} is right")
            times = time_graphs_us({name: weights.skinny_calls(c, x, y) for name, c in choices.items()})
            for name, c in choices.items():
                log.append({"role": role, "kernel": "skinny", "n": weights.n, "m": block_m, **asdict(c),
                            "us": times[name]})  # fmt: skip
            name = min(times, key=times.__getitem__)
            cfg, us = choices[name], times[name]
        best[block_m] = (cfg, us)
        print(f"  skinny {role} N={weights.n} M<={block_m}: best {us:.2f} us of {timed} timed: {cfg}", flush=True)
    return best


def choose_rope_epilogue(
    bench: ShapeBench, cfg: KernelConfig, m: int, log: list[dict], weights: GemmWeights | None = None
) -> KernelConfig:
    """``cfg`` with ``rope_epilogue`` set where doing the decode RoPE inside the GEMM beats the GEMM
    followed by the standalone RoPE kernel, timed interleaved as ``fold_query`` runs them
    (``weights``: the bench's bf16 fold, or another fold weight of its shape such as the fp8 one)."""
    from foldckpt.runtime.kernels import triton_gemm, triton_rope

    weights = weights if weights is not None else bench.fold
    if not triton_gemm.rope_fits(bench.n, cfg):
        return cfg
    x, rope = random_x(m), decode_rope(m, bench.dims, torch.device("cuda"))
    y = torch.empty((m, bench.n), device="cuda", dtype=torch.bfloat16)
    triton_gemm.reserve_workspace(x.device, *triton_gemm.workspace_needs(m, bench.n, cfg))

    def fused(i: int) -> None:
        triton_gemm.launch_fold_gemm(x, weights.copies[i], y, cfg, rope, scale=weights.scales[i])

    def split(i: int) -> None:
        triton_gemm.launch_fold_gemm(x, weights.copies[i], y, cfg, scale=weights.scales[i])
        triton_rope.launch_rope_query(y, rope)

    choices = {"fused": fused, "split": split}
    times = time_graphs_us({name: [partial(fn, i) for i in _layers()] for name, fn in choices.items()})
    for name, us in times.items():
        log.append({"role": weights.role, "n": bench.n, "m": m, **asdict(cfg), "rope": name, "us": us})
    return replace(cfg, rope_epilogue=times["fused"] < times["split"])


def pdl_supported() -> bool:
    """Programmatic dependent launch needs an NVIDIA GPU of compute capability 9.0 or newer."""
    return torch.version.hip is None and torch.cuda.get_device_capability() >= (9, 0)


def choose_pdl(weights: GemmWeights, cfg: KernelConfig, m: int, log: list[dict]) -> tuple[KernelConfig, float]:
    """The bucket winner with and without PDL, timed interleaved at ``m``: the faster of the two.

    Only the winner is tried both ways: PDL moves the launch, not the tiling, so it does not
    reorder the configs (a 0.1-0.2 µs shift in the first H200 trial).
    """
    with_pdl = replace(cfg, pdl=True)
    x = random_x(m)
    err = weights.triton_error(with_pdl, x)
    if err > MAX_RELERR:
        raise RuntimeError(f"{with_pdl} gives relative error {err:.1e} where {cfg} is right")
    y = torch.empty((m, weights.n), device="cuda", dtype=torch.bfloat16)
    choices = {"stream order": cfg, "pdl": with_pdl}
    times = time_graphs_us({name: weights.triton_calls(c, x, y) for name, c in choices.items()})
    for name, c in choices.items():
        log.append({"role": weights.role, "n": weights.n, "m": m, **asdict(c), "us": times[name], "relerr": err})
    name = min(times, key=times.__getitem__)
    return choices[name], times[name]


def bucket_of(m: int) -> int | None:
    return next((b for b in BUCKETS if m <= b), None)


def grid(
    bench: ShapeBench,
    best: dict[int, tuple[KernelConfig, float]],
    qb_best: dict[int, tuple[KernelConfig, float]],
    skinny_best: dict[str, dict[int, tuple[SkinnyConfig, float]]] | None = None,
) -> list[dict]:
    """Unfolded (cuBLAS / Triton / skinny q_b_proj) / torch fold / Triton fold (/ skinny fold) at
    every GRID_M."""
    rows = []
    for m in GRID_M:
        bucket = bucket_of(m)
        settle_clocks(torch.device("cuda"))
        cfg = best[bucket][0] if bucket is not None else None
        qb_cfg = qb_best[bucket][0] if bucket is not None else None
        tile = skinny_block_m(m)
        skinny = {role: by_m[tile][0] for role, by_m in (skinny_best or {}).items() if tile is not None}
        row = {"n": bench.n, "q_b_proj_n": bench.qb.n, "m": m, **bench.time_grid_point(m, cfg, qb_cfg, skinny)}
        rows.append(row)
        print(
            f"  N={bench.n} M={m}: "
            + " ".join(f"{k}={v:.2f}" for k, v in row.items() if k.endswith("_us") and v)
            + f" (q_b_proj: {row['q_b_proj_kernel']})",
            flush=True,
        )
    return rows


def fold_us(row: dict, backend: str) -> float:
    """The fold's time at a grid row on ``backend`` ("triton", "torch" or "skinny")."""
    return row[f"{backend}_us"]


def skinny_split(rows: list[dict], backends: dict[int, str]) -> dict[int, str]:
    """``backends`` (per BUCKETS) with the first bucket split at the skinny kernel's token tiles:
    a tile (previous tile, tile] gets backend "skinny" where the skinny fold, summed over the grid
    points inside it, was faster than that bucket's backend; tiles in between keep the bucket's
    backend, adjacent tiles with the same backend merge, and above the last skinny tile the
    bucket stays as it was. Ascending m_max; unchanged where the skinny kernel never wins."""
    first = BUCKETS[0]
    assert SKINNY_BLOCK_MS[-1] <= first, "skinny tiles must lie inside the first bucket"
    base = backends[first]
    wins, lo = {}, 0
    for tile in SKINNY_BLOCK_MS:
        inside = [r for r in rows if lo < r["m"] <= tile]
        lo = tile
        skinny = [r.get("skinny_us") for r in inside]
        wins[tile] = bool(inside) and None not in skinny and sum(skinny) < sum(fold_us(r, base) for r in inside)
    top = max((tile for tile, won in wins.items() if won), default=0)
    split: dict[int, str] = {}
    for tile in (t for t in SKINNY_BLOCK_MS if t <= top):
        backend = "skinny" if wins[tile] else base
        if split and split[next(reversed(split))] == backend:
            del split[next(reversed(split))]
        split[tile] = backend
    # The last split tile is a skinny one, so the bucket's own backend resumes above it.
    split.update((b, backends[b]) for b in BUCKETS if b > top)
    return split


def backend_at(backends: dict[int, str], m: int) -> str:
    """The fold backend of the bucket holding ``m`` (ascending keys); torch above the last."""
    return next((backend for m_max, backend in backends.items() if m <= m_max), "torch")


def decide(rows: list[dict], tolerance: float = ROUTE_TOLERANCE) -> tuple[dict[int, str], dict[int, str], int]:
    """Fold backend per bucket, q_b_proj backend per bucket, and the crossover ``fold_max_tokens``.

    Fold: per BUCKETS bucket the faster of the tiled Triton kernel and torch in sum over the
    bucket's grid points, then ``skinny_split`` (the M <= 16 bucket split where the skinny kernel
    was faster than that): ascending m_max -> "triton" / "torch" / "skinny", the table's
    [[shape.bucket]] list. q_b_proj: per BUCKETS bucket the faster of tiled Triton and cuBLAS.

    The crossover is the largest grid M such that up to it the fold (on its bucket's backend) is
    never slower than ``unfolded / tolerance`` (the unfolded path on the fastest of its q_b_proj
    kernels at that M) and, summed over the grid points up to it, faster than the unfolded path;
    0 where that holds nowhere. ``tolerance`` 1.0 is "never lost"; the default ROUTE_TOLERANCE is
    the project's routing target (routed >= 0.97x the faster path at every M), so that one point
    at parity within measurement noise (Kimi-K3 TP8 at M=1 against the skinny q_b_proj kernel)
    does not turn off a fold that wins at the M around it.
    """
    backends, qb_backends = {}, {}
    for bucket in BUCKETS:
        inside = [r for r in rows if bucket_of(r["m"]) == bucket]
        backends[bucket] = (
            "triton" if sum(r["triton_us"] for r in inside) < sum(r["torch_us"] for r in inside) else "torch"
        )
        qb_triton = [r.get("unfolded_triton_us") for r in inside]
        qb_backends[bucket] = (
            "triton"
            if None not in qb_triton and sum(qb_triton) < sum(r["unfolded_cublas_us"] for r in inside)
            else "torch"
        )
    backends = skinny_split(rows, backends)
    crossover, fold_sum, unfolded_sum = 0, 0.0, 0.0
    for r in rows:
        fold = fold_us(r, backend_at(backends, r["m"]))
        if fold * tolerance > r["unfolded_us"]:
            break
        fold_sum += fold
        unfolded_sum += r["unfolded_us"]
        if fold_sum < unfolded_sum:
            crossover = r["m"]
    return backends, qb_backends, crossover


def table_buckets(backends: dict[int, str], tiled: dict[int, dict], rows: list[dict]) -> list[dict]:
    """The [[shape.bucket]] records for ``decide``'s fold ``backends``: each carries the tiled
    Triton config of the BUCKETS bucket holding it (``tiled``: m_max -> record with the config
    and the search's triton_us), the measurements behind its choice and, where skinny, skinny_us.
    A skinny sub-bucket's triton_us / torch_us are the grid's at its m_max."""
    records = []
    for m_max, backend in backends.items():
        at = next(r for r in rows if r["m"] == m_max)
        src = tiled[bucket_of(m_max)]
        record = {"m_max": m_max, "backend": backend}
        record.update((k, v) for k, v in src.items() if k not in ("m_max", "backend", "skinny_us"))
        if m_max not in BUCKETS:
            record.update(triton_us=at["triton_us"], torch_us=at["torch_us"])
        if backend == "skinny":
            record["skinny_us"] = at["skinny_us"]
        records.append(record)
    return records


def redecide(base_path: Path, json_path: Path, out: Path, tolerance: float) -> int:
    """Recompute ``fold_max_tokens`` and the bucket backends of a table from the grid measurements
    in its tune JSON (no GPU): to apply another ``--tolerance`` to measurements already taken.
    Shapes whose grid rows predate the q_b_proj baseline (no ``unfolded_us`` per kernel) stay."""
    base = tomllib.loads(base_path.read_text(encoding="utf-8"))
    doc = json.loads(json_path.read_text(encoding="utf-8"))
    meta = dict(base["meta"])
    shapes = [dict(sh) for sh in base["shape"]]
    q_b_projs = [dict(q) for q in base.get("q_b_proj", [])]
    for shape in shapes:
        rows = sorted((r for r in doc["grid"] if r["n"] == shape["n"] and "q_b_proj_kernel" in r), key=lambda r: r["m"])
        if not rows:
            continue
        backends, qb_backends, crossover = decide(rows, tolerance)
        print(
            f"N={shape['n']}: fold_max_tokens {shape['fold_max_tokens']} -> {crossover} (tolerance {tolerance}); "
            f"fold backends {backends}"
        )
        shape["fold_max_tokens"] = crossover
        # Sub-buckets of an earlier decision are rebuilt from the BUCKETS buckets they split.
        tiled = {b["m_max"]: b for b in shape["bucket"] if b["m_max"] in BUCKETS}
        shape["bucket"] = table_buckets(backends, tiled, rows)
        for q in q_b_projs:
            if q.get("heads") == shape.get("heads"):
                q["bucket"] = [{**b, "backend": qb_backends[b["m_max"]]} for b in q["bucket"]]
    fp8_shapes = [dict(sh) for sh in base.get("fp8_shape", [])]
    for shape in fp8_shapes:
        rows = sorted((r for r in doc.get("fp8_grid", []) if r["n"] == shape["n"]), key=lambda r: r["m"])
        if rows:
            backends, _, crossover = decide(rows, tolerance)
            print(f"fp8 N={shape['n']}: fold_max_tokens {shape['fold_max_tokens']} -> {crossover}; backends {backends}")
            shape["fold_max_tokens"] = crossover
            tiled = {b["m_max"]: b for b in shape["bucket"] if b["m_max"] in BUCKETS}
            shape["bucket"] = table_buckets(backends, tiled, rows)
    meta["route_tolerance"] = tolerance
    meta["redecided"] = datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ")
    out.mkdir(parents=True, exist_ok=True)
    (out / base_path.name).write_text(
        toml_text(meta, shapes, q_b_projs, base.get("skinny", []), fp8_shapes), encoding="utf-8"
    )
    doc["meta"]["route_tolerance"] = tolerance
    (out / json_path.name).write_text(json.dumps(doc, indent=1), encoding="utf-8")
    return 0


def toml_text(
    meta: dict,
    shapes: list[dict],
    q_b_projs: list[dict],
    skinny: list[dict] | None = None,
    fp8_shapes: list[dict] | None = None,
) -> str:
    """The table in the layout ``tuning.parse_table`` reads (tomllib cannot write)."""

    def value(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, float):
            return f"{v:.3f}"
        return json.dumps(v)

    lines = [
        f"# Written by `python -m foldckpt.tune` on {meta['device_name']}; do not edit by hand.",
        "",
        "[meta]",
    ]
    lines += [f"{k} = {value(v)}" for k, v in meta.items()]
    for section, entries, keys in (
        ("shape", shapes, ("n", "k", "fold_max_tokens", "heads")),
        ("q_b_proj", q_b_projs, ("n", "k", "heads")),
        ("fp8_shape", fp8_shapes or [], ("n", "k", "fold_max_tokens", "heads")),
    ):
        for entry in entries:
            lines += ["", f"[[{section}]]"] + [f"{k} = {value(entry[k])}" for k in keys if k in entry]
            for bucket in entry["bucket"]:
                lines += ["", f"[[{section}.bucket]]"] + [f"{k} = {value(v)}" for k, v in bucket.items()]
    for entry in skinny or []:
        lines += ["", "[[skinny]]"] + [f"{k} = {value(v)}" for k, v in entry.items()]
    return "\n".join(lines) + "\n"


def parse_heads(text: str) -> tuple[int, ...]:
    heads = tuple(int(h) for h in text.split(",") if h.strip())
    if not heads or any(h < 1 for h in heads) or len(set(heads)) != len(heads):
        raise argparse.ArgumentTypeError(f"--heads wants distinct positive counts, e.g. 12,6,24; got {text!r}")
    return heads


def kept_from_base(base: dict | None, tuned: tuple[int, ...]) -> tuple[list[dict], list[dict], list[dict]]:
    """The base table's [[shape]], [[q_b_proj]] and [[skinny]] entries of the deployments not tuned now."""
    if base is None:
        return [], [], []
    tuned_folds = {MlaDims(h).fold_rows for h in tuned}
    tuned_qbs = {h * (MlaDims(h).nope + MlaDims(h).rope) for h in tuned}
    shapes = [s for s in base.get("shape", []) if s["n"] not in tuned_folds and s.get("heads") not in tuned]
    q_b_projs = [s for s in base.get("q_b_proj", []) if s["n"] not in tuned_qbs and s.get("heads") not in tuned]
    # The fp8 fold's tiles belong to [[fp8_shape]], which a bf16 run keeps whole.
    skinny = [
        s
        for s in base.get("skinny", [])
        if s["role"] == "fold_fp8" or s["n"] not in (tuned_folds if s["role"] == "fold" else tuned_qbs)
    ]
    return shapes, q_b_projs, skinny


def base_seeds(base: dict | None, section: str, n: int) -> dict[int, KernelConfig]:
    """The base table's config per bucket for weight rows ``n`` (the search's first candidate)."""
    fields = set(KernelConfig.__dataclass_fields__)
    for entry in (base or {}).get(section, []):
        if entry["n"] == n and entry.get("k") == K:
            return {b["m_max"]: KernelConfig(**{k: v for k, v in b.items() if k in fields}) for b in entry["bucket"]}
    return {}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for tune_<gpu>.json and <gpu>.toml")
    parser.add_argument("--budget-s", type=float, default=330.0, help="time for the config search, all shapes")
    parser.add_argument("--workers", type=int, default=14, help="parallel compile processes")
    parser.add_argument(
        "--heads", type=parse_heads, default=HEADS,
        help="heads per rank of the deployments to tune, comma-separated (default: all); others kept from --base",
    )  # fmt: skip
    parser.add_argument("--base", type=Path, help="table to keep untuned shapes from and seed the search with "
                        "(default: the shipped configs/<gpu>.toml, if any)")  # fmt: skip
    parser.add_argument("--base-json", type=Path, help="tune_<gpu>.json whose records of the kept shapes to carry over")
    parser.add_argument(
        "--tolerance", type=float, default=ROUTE_TOLERANCE,
        help="the fold may be this much slower (unfolded/fold ratio) at a point below the crossover; 1.0: never",
    )  # fmt: skip
    parser.add_argument(
        "--redecide", action="store_true",
        help="no GPU: recompute the thresholds of --base from the grid in --base-json and write both to --out",
    )  # fmt: skip
    parser.add_argument(
        "--fp8", action="store_true",
        help="tune the fp8 fold ([[fp8_shape]], tune_fp8.py) against --base's unfolded baseline; keep the rest of --base",
    )  # fmt: skip
    args = parser.parse_args(argv)
    if args.fp8 and not args.redecide:
        from foldckpt.runtime.kernels import tune_fp8

        return tune_fp8.run(args)
    if not 0 < args.tolerance <= 1:
        parser.error("--tolerance must be in (0, 1]")
    if args.redecide:
        if args.base is None or args.base_json is None:
            parser.error("--redecide needs --base and --base-json")
        return redecide(args.base, args.base_json, args.out, args.tolerance)
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    dev = torch.device("cuda")
    key = gpu_key(dev)
    start = time.monotonic()
    base_path = args.base if args.base is not None else config_dir() / f"{key}.toml"
    base = tomllib.loads(base_path.read_text(encoding="utf-8")) if base_path.is_file() else None
    kept_shapes, kept_qbs, kept_skinny = kept_from_base(base, args.heads)
    bandwidth = measure_copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)} ({key}): copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)
    if base is not None:
        kept = ", ".join(f"N={s['n']}" for s in kept_shapes) or "none"
        print(f"base table {base_path} ({base['meta'].get('date')}): seeds the search; shapes kept: {kept}", flush=True)

    configs = sorted(
        {c for m_max in BUCKETS for bm in bucket_block_ms(m_max) for c in candidate_configs(bm)},
        key=lambda c: (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, c.use_tma),
    )
    # Compile keys differ only by EVEN_N among the shapes (N % block_n); build each key once.
    shape_ns = sorted({n for h in args.heads for n in (MlaDims(h).fold_rows, h * 192)})
    jobs: list[tuple[KernelConfig | SkinnyConfig, int]] = []
    for c in configs:
        representatives = {n % c.block_n == 0: n for n in shape_ns}
        jobs += [(c, n) for n in representatives.values()]
    # Every shape's rows are a multiple of 16: one skinny compile (EVEN_N) per config.
    skinny_configs = [c for b in SKINNY_BLOCK_MS for c in skinny_candidates(b)]
    jobs += [(c, shape_ns[0]) for c in skinny_configs]
    n_configs = len(configs) + len(skinny_configs)
    print(f"compiling {len(jobs)} kernels for {n_configs} configs with {args.workers} processes", flush=True)
    failed = precompile(jobs, args.workers)
    print(f"compiled in {time.monotonic() - start:.0f} s, {len(failed)} failed", flush=True)

    log: list[dict] = []
    rows: list[dict] = []
    shapes, q_b_projs, skinny_entries = [], [], []
    search_deadline = time.monotonic() + args.budget_s
    searches_left = len(ROLES) * len(args.heads)
    for heads in args.heads:
        bench = ShapeBench(heads)
        settle_clocks(torch.device("cuda"))
        best_by_role = {}
        for role in ROLES:
            # Each search may use an equal share of what is left; what one does not use rolls on.
            deadline = time.monotonic() + (search_deadline - time.monotonic()) / searches_left
            searches_left -= 1
            seeds = base_seeds(base, "shape" if role == "fold" else "q_b_proj", bench.weights(role).n)
            best_by_role[role] = search(bench, role, failed, deadline, log, seeds)
        best, qb_best = best_by_role["fold"], best_by_role["q_b_proj"]
        # The skinny searches are small (every candidate) and outside the budget.
        skinny_best = {role: search_skinny(bench, role, failed, log) for role in ("q_b_proj", "fold")}
        shape_rows = grid(bench, best, qb_best, skinny_best)
        rows += shape_rows
        backends, qb_backends, crossover = decide(shape_rows, args.tolerance)
        tiled, qb_buckets = {}, []
        for m_max in BUCKETS:
            at = next(r for r in shape_rows if r["m"] == m_max)
            cfg, us = best[m_max]
            tiled[m_max] = {"m_max": m_max, **asdict(cfg), "triton_us": us, "torch_us": at["torch_us"]}
            cfg, us = qb_best[m_max]
            qb_buckets.append(
                {"m_max": m_max, "backend": qb_backends[m_max], **asdict(cfg), "triton_us": us,
                 "unfolded_triton_us": at["unfolded_triton_us"], "unfolded_cublas_us": at["unfolded_cublas_us"]}
            )  # fmt: skip
        for role, by_m in skinny_best.items():
            for block_m, (cfg, us) in by_m.items():
                skinny_entries.append(
                    {"role": role, "n": bench.weights(role).n, "k": K, "m_max": block_m, "rows": cfg.rows,
                     "block_k": cfg.block_k, "num_warps": cfg.num_warps, "pdl": cfg.pdl, "us": us}
                )  # fmt: skip
        buckets = table_buckets(backends, tiled, shape_rows)
        shapes.append({"n": bench.n, "k": K, "fold_max_tokens": crossover, "heads": heads, "bucket": buckets})
        q_b_projs.append({"n": bench.qb.n, "k": K, "heads": heads, "bucket": qb_buckets})
        print(
            f"  N={bench.n}: fold_max_tokens={crossover} backends={backends} q_b_proj backends={qb_backends}",
            flush=True,
        )
        del bench
        torch.cuda.empty_cache()

    meta = {
        "gpu": key,
        "device_name": torch.cuda.get_device_name(dev),
        "torch": torch.__version__,
        "triton": triton.__version__,
        "python": platform.python_version(),
        "date": datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        "copy_bandwidth_tb_s": round(bandwidth / 1e12, 4),
        "triton_max_m": TRITON_MAX_M,
        "baseline": "unfolded = fastest of cuBLAS, the Triton and the skinny q_b_proj kernel, + W_UK bmm, no RoPE",
        "tuned_heads": ",".join(str(h) for h in args.heads),
        "route_tolerance": args.tolerance,
        "grid_rounds": GRID_ROUNDS,
    }
    if kept_shapes or kept_qbs:
        # Shapes kept over several partial runs keep the date they were measured on.
        kept_date = base["meta"].get("kept_date", base["meta"].get("date"))
        meta["kept_date"] = kept_date
        meta["kept_from"] = f"{base_path.name} of {kept_date}: " + ", ".join(
            [f"shape N={s['n']}" for s in kept_shapes] + [f"q_b_proj N={s['n']}" for s in kept_qbs]
        )
    kept_ns = {s["n"] for s in kept_shapes}
    if args.base_json is not None and kept_ns:
        old = json.loads(args.base_json.read_text(encoding="utf-8"))
        # Records before the q_b_proj search have no role: they are the fold's.
        log = [r for r in old["search"] if r.get("role", "fold") == "fold" and r["n"] in kept_ns] + log
        rows = [r for r in old["grid"] if r["n"] in kept_ns] + rows
        meta["kept_records_from"] = f"{args.base_json.name} of {old['meta'].get('kept_date', old['meta'].get('date'))}"
    all_shapes = sorted(shapes + kept_shapes, key=lambda s: s["n"])
    all_qbs = sorted(q_b_projs + kept_qbs, key=lambda s: s["n"])
    all_skinny = sorted(skinny_entries + kept_skinny, key=lambda s: (s["role"], s["n"], s["m_max"]))
    # The fp8 fold's entries ([[fp8_shape]], tune_fp8.py) are carried over as they are.
    fp8_shapes = (base or {}).get("fp8_shape", [])
    meta.update((k, v) for k, v in ((base or {}).get("meta") or {}).items() if k.startswith("fp8_"))
    (args.out / f"{key}.toml").write_text(
        toml_text(meta, all_shapes, all_qbs, all_skinny, fp8_shapes), encoding="utf-8"
    )
    doc = {"meta": meta, "search": log, "grid": rows}
    if args.base_json is not None:
        old_doc = json.loads(args.base_json.read_text(encoding="utf-8"))
        doc.update((k, v) for k, v in old_doc.items() if k.startswith("fp8_"))
    (args.out / f"tune_{key}.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
    print(f"done in {time.monotonic() - start:.0f} s; {len(log)} configs timed", flush=True)
    return 0

