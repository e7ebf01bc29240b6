"""Measure the fold GEMM on this GPU and write its tuning table (``configs/<gpu_key>.toml``).

    python -m foldckpt.runtime.kernels.tune --out DIR [--budget-s 330]

1. Search: for every fold shape (N, K) and token bucket, time every Triton config of a pruned
   grid (tile sizes, split-K, pipeline depth, warps, TMA) at the bucket's largest M with CUDA
   graphs over 16 weight copies (nothing L2-resident), after checking each result; then the
   winner with and without programmatic dependent launch (sm_90+), and with the decode RoPE
   in its epilogue or in the standalone RoPE kernel after it.
2. Grid: at M from 1 to 1024, time the unfolded path (q_b_proj GEMM + W_UK bmm), the fold with
   torch and the fold with the bucket's best Triton config; per bucket keep the faster fold
   backend, and take as ``fold_max_tokens`` the largest M up to which the fold never lost.
Writes ``tune_<gpu>.json`` (every measurement) and ``<gpu>.toml`` into DIR; copy the TOML into
``configs/`` to ship it. Needs a CUDA GPU and Triton.
"""

from __future__ import annotations

import argparse
import datetime
import json
import multiprocessing
import platform
import random
import sys
import time
from collections.abc import Callable, Iterator
from dataclasses import asdict, replace
from functools import partial
from pathlib import Path

import torch
import torch.nn.functional as F

from foldckpt.runtime.kernels.device import gpu_key
from foldckpt.runtime.kernels.reference import MlaDims, decode_rope, unfolded_query
from foldckpt.runtime.kernels.timing import (
    measure_copy_bandwidth,
    relative_error,
    settle_clocks,
    time_graph_us,
    time_graphs_us,
)
from foldckpt.runtime.kernels.tuning import TRITON_MAX_M, KernelConfig

# Heads per rank of the deployments we serve: Kimi-K3 (96 heads) at TP16/8/4, DeepSeek-V3
# (128 heads) at TP8; N = heads * 576.
HEADS = (12, 6, 16, 24)
K = 1536
BUCKETS = (16, 32, 64, 128, 256)
GRID_M = (1, 2, 4, 8, 14, 16, 28, 32, 56, 64, 96, 112, 128, 160, 192, 224, 256, 320, 384, 512, 768, 1024)
# Split-K lost everywhere in the first H200 search (2 splits: +2 µs, 12: +8 µs, the latency of the
# in-kernel reduction); 2 stays in the grid so each table re-checks that.
SPLITS = (1, 2)
LAYER_COPIES = 16
# Share of the search budget kept back for each shape still to search.
SHAPE_RESERVE = 0.15
CALLS_PER_GRAPH = 32
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


def bucket_block_ms(m_max: int) -> tuple[int, ...]:
    """Tile heights tried for a bucket: the bucket itself, or half of it in two M tiles."""
    return (m_max,) if m_max == 16 else (m_max, m_max // 2)


def launch_variants(base: KernelConfig, n: int, m: int) -> list[KernelConfig]:
    """Run-time choices for a compiled config: rows per program and split count.

    Rows per program: the full tile, or fewer so that the programs come to a whole number of
    SM waves (1..4); TMA loads whole tiles, so it keeps full tiles. Splits must divide K and,
    with the programs, give 0.5 to ~9 waves.
    """
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows_options = {base.block_n}
    if not base.use_tma:
        rows_options |= {-(-n // (waves * sms)) for waves in (1, 2, 3, 4)}
    variants = []
    for rows in sorted(r for r in rows_options if base.block_n // 2 < r <= base.block_n):
        programs = -(-n // rows) * -(-m // base.block_m)
        for split in SPLITS:
            if K % (split * base.block_k) == 0 and sms // 2 <= programs * split <= 9 * sms:
                variants.append(replace(base, split_k=split, rows_per_program=0 if rows == base.block_n else rows))
    return variants


def _compile_worker(jobs: list[tuple[dict, int]]) -> list[tuple[dict, str]]:
    """Compile (by running once) each config in a fresh process; return the ones that failed."""
    from foldckpt.runtime.kernels import triton_gemm

    failed = []
    for cfg_dict, n in jobs:
        cfg = KernelConfig(**cfg_dict)
        try:
            w = torch.randn(n, K, device="cuda", dtype=torch.bfloat16)
            x = torch.randn(cfg.block_m, K, device="cuda", dtype=torch.bfloat16)
            y = torch.empty(cfg.block_m, n, device="cuda", dtype=torch.bfloat16)
            split = replace(cfg, split_k=2)
            triton_gemm.reserve_workspace(x.device, *triton_gemm.workspace_needs(cfg.block_m, n, split))
            triton_gemm.launch_fold_gemm(x, w, y, split)
            torch.cuda.synchronize()
        except Exception as exc:  # noqa: BLE001 - a config that fails to build is data, not a crash
            failed.append((cfg_dict, f"{type(exc).__name__}: {str(exc)[:200]}"))
    return failed


def precompile(configs: list[tuple[KernelConfig, int]], workers: int) -> set[KernelConfig]:
    """Fill Triton's on-disk cache in parallel processes; return configs that do not build."""
    chunks = [[(asdict(c), n) for c, n in configs[i::workers]] for i in range(workers)]
    with multiprocessing.get_context("spawn").Pool(workers) as pool:
        results = pool.map(_compile_worker, chunks)
    failed = set()
    for part in results:
        for cfg_dict, err in part:
            print(f"  config does not build: {cfg_dict}: {err}", flush=True)
            failed.add(KernelConfig(**cfg_dict))
    return failed


class ShapeBench:
    """Weights of one fold shape, LAYER_COPIES deep, and the timed variants over them."""

    def __init__(self, heads: int) -> None:
        self.dims = MlaDims(heads)
        self.n = self.dims.fold_rows
        dev = torch.device("cuda")
        fold = torch.randn(self.n, K, device=dev, dtype=torch.bfloat16) / K**0.5
        qb = torch.randn(heads * 192, K, device=dev, dtype=torch.bfloat16) / K**0.5
        uk = torch.randn(heads, 128, 512, device=dev, dtype=torch.bfloat16) / 128**0.5
        self.folds = [fold.clone() for _ in range(LAYER_COPIES)]
        self.qbs = [qb.clone() for _ in range(LAYER_COPIES)]
        self.uks = [uk.clone() for _ in range(LAYER_COPIES)]

    def _layers(self) -> Iterator[int]:
        return (i % LAYER_COPIES for i in range(CALLS_PER_GRAPH))

    def x(self, m: int) -> torch.Tensor:
        return torch.randn(m, K, device="cuda", dtype=torch.bfloat16)

    def triton_calls(self, cfg: KernelConfig, x: torch.Tensor, y: torch.Tensor) -> list[Callable[[], None]]:
        from foldckpt.runtime.kernels import triton_gemm

        triton_gemm.reserve_workspace(x.device, *triton_gemm.workspace_needs(x.shape[0], self.n, cfg))
        return [lambda i=i: triton_gemm.launch_fold_gemm(x, self.folds[i], y, cfg) for i in self._layers()]

    def triton_error(self, cfg: KernelConfig, x: torch.Tensor) -> float:
        """Relative error of the kernel vs an fp32 F.linear, on a NaN-poisoned output."""
        y = torch.full((x.shape[0], self.n), float("nan"), device="cuda", dtype=torch.bfloat16)
        self.triton_calls(cfg, x, y)[0]()
        return relative_error(y, F.linear(x.float(), self.folds[0].float()))

    def time_triton(self, cfg: KernelConfig, m: int) -> tuple[float, float]:
        """(µs per call, relative error) of the kernel at ``m`` tokens; inf for a wrong result."""
        x = self.x(m)
        err = self.triton_error(cfg, x)
        if err > MAX_RELERR:
            return float("inf"), err
        y = torch.empty((m, self.n), device="cuda", dtype=torch.bfloat16)
        return time_graph_us(self.triton_calls(cfg, x, y)), err

    def time_grid_point(self, m: int, cfg: KernelConfig | None) -> dict[str, float | None]:
        """Unfolded, torch fold and (given a config) Triton fold at ``m``, timed interleaved."""
        x = self.x(m)
        variants = {
            "unfolded_us": [lambda i=i: unfolded_query(x, self.qbs[i], self.uks[i], self.dims) for i in self._layers()],
            "torch_us": [lambda i=i: F.linear(x, self.folds[i]) for i in self._layers()],
        }
        if cfg is not None and self.triton_error(cfg, x) <= MAX_RELERR:
            y = torch.empty((m, self.n), device="cuda", dtype=torch.bfloat16)
            variants["triton_us"] = self.triton_calls(cfg, x, y)
        times: dict[str, float | None] = {"triton_us": float("inf") if cfg is not None else None}
        times.update(time_graphs_us(variants))
        return times


def search(
    bench: ShapeBench, failed: set[KernelConfig], deadline: float, log: list[dict]
) -> dict[int, tuple[KernelConfig, float]]:
    """Best (config, µs) per bucket for one shape, timed at the bucket's largest M.

    Each bucket gets an equal share of the time left before ``deadline`` and tries its
    candidates in a fixed shuffled order, so a search cut short still samples the whole grid.
    """
    best: dict[int, tuple[KernelConfig, float]] = {}
    for b, m_max in enumerate(BUCKETS):
        candidates = [
            cfg
            for block_m in bucket_block_ms(m_max)
            for base in candidate_configs(block_m)
            if base not in failed
            for cfg in launch_variants(base, bench.n, m_max)
        ]
        random.Random(m_max).shuffle(candidates)
        bucket_deadline = time.monotonic() + (deadline - time.monotonic()) / (len(BUCKETS) - b)
        timed = 0
        for cfg in candidates:
            if time.monotonic() > bucket_deadline and m_max in best:
                break
            us, err = bench.time_triton(cfg, m_max)
            timed += 1
            log.append({"n": bench.n, "m": m_max, **asdict(cfg), "us": us, "relerr": err})
            if us < best.get(m_max, (None, float("inf")))[1]:
                best[m_max] = (cfg, us)
        cfg, us = best[m_max]
        if pdl_supported():
            cfg, us = best[m_max] = choose_pdl(bench, cfg, m_max, log)
        cfg = choose_rope_epilogue(bench, cfg, m_max, log)
        best[m_max] = (cfg, us)
        print(f"  N={bench.n} M<={m_max}: best {us:.2f} us of {timed}/{len(candidates)} timed: {cfg}", flush=True)
    return best


def choose_rope_epilogue(bench: ShapeBench, cfg: KernelConfig, m: int, log: list[dict]) -> KernelConfig:
    """``cfg`` with ``rope_epilogue`` set where doing the decode RoPE inside the GEMM beats the GEMM
    followed by the standalone RoPE kernel, timed interleaved as ``fold_query`` runs them."""
    from foldckpt.runtime.kernels import triton_gemm, triton_rope

    if not triton_gemm.rope_fits(bench.n, cfg):
        return cfg
    x, rope = bench.x(m), decode_rope(m, bench.dims, torch.device("cuda"))
    y = torch.empty((m, bench.n), device="cuda", dtype=torch.bfloat16)
    triton_gemm.reserve_workspace(x.device, *triton_gemm.workspace_needs(m, bench.n, cfg))

    def fused(i: int) -> None:
        triton_gemm.launch_fold_gemm(x, bench.folds[i], y, cfg, rope)

    def split(i: int) -> None:
        triton_gemm.launch_fold_gemm(x, bench.folds[i], y, cfg)
        triton_rope.launch_rope_query(y, rope)

    choices = {"fused": fused, "split": split}
    times = time_graphs_us({name: [partial(fn, i) for i in bench._layers()] for name, fn in choices.items()})
    for name, us in times.items():
        log.append({"n": bench.n, "m": m, **asdict(cfg), "rope": name, "us": us})
    return replace(cfg, rope_epilogue=times["fused"] < times["split"])


def pdl_supported() -> bool:
    """Programmatic dependent launch needs an NVIDIA GPU of compute capability 9.0 or newer."""
    return torch.version.hip is None and torch.cuda.get_device_capability() >= (9, 0)


def choose_pdl(bench: ShapeBench, cfg: KernelConfig, m: int, log: list[dict]) -> tuple[KernelConfig, float]:
    """The bucket winner with and without PDL, timed interleaved at ``m``: the faster of the two.

    Only the winner is tried both ways: PDL moves the launch, not the tiling, so it does not
    reorder the configs (a 0.1-0.2 µs shift in the first H200 trial).
    """
    with_pdl = replace(cfg, pdl=True)
    x = bench.x(m)
    err = bench.triton_error(with_pdl, x)
    if err > MAX_RELERR:
        raise RuntimeError(f"{with_pdl} gives relative error {err:.1e} where {cfg} is right")
    y = torch.empty((m, bench.n), device="cuda", dtype=torch.bfloat16)
    choices = {"stream order": cfg, "pdl": with_pdl}
    times = time_graphs_us({name: bench.triton_calls(c, x, y) for name, c in choices.items()})
    for name, c in choices.items():
        log.append({"n": bench.n, "m": m, **asdict(c), "us": times[name], "relerr": err})
    name = min(times, key=times.__getitem__)
    return choices[name], times[name]


def bucket_of(m: int) -> int | None:
    return next((b for b in BUCKETS if m <= b), None)


def grid(bench: ShapeBench, best: dict[int, tuple[KernelConfig, float]]) -> list[dict]:
    """Unfolded / torch fold / Triton fold at every GRID_M."""
    rows = []
    for m in GRID_M:
        bucket = bucket_of(m)
        settle_clocks(torch.device("cuda"))
        row = {"n": bench.n, "m": m, **bench.time_grid_point(m, best[bucket][0] if bucket is not None else None)}
        rows.append(row)
        print(
            f"  N={bench.n} M={m}: " + " ".join(f"{k}={v:.2f}" for k, v in row.items() if k.endswith("_us") and v),
            flush=True,
        )
    return rows


def decide(rows: list[dict]) -> tuple[dict[int, str], int]:
    """Per-bucket fold backend (faster in sum over the bucket's grid points) and the crossover."""
    backends = {}
    for bucket in BUCKETS:
        inside = [r for r in rows if bucket_of(r["m"]) == bucket]
        backends[bucket] = (
            "triton" if sum(r["triton_us"] for r in inside) < sum(r["torch_us"] for r in inside) else "torch"
        )
    crossover = 0
    for r in rows:
        bucket = bucket_of(r["m"])
        fold = r["triton_us"] if bucket is not None and backends[bucket] == "triton" else r["torch_us"]
        if fold > r["unfolded_us"]:
            break
        crossover = r["m"]
    return backends, crossover


def toml_text(meta: dict, shapes: list[dict]) -> str:
    """The table in the layout ``tuning.parse_table`` reads (tomllib cannot write)."""

    def value(v: object) -> str:
        if isinstance(v, bool):
            return "true" if v else "false"
        if isinstance(v, float):
            return f"{v:.3f}"
        return json.dumps(v)

    lines = [
        f"# Written by `python -m foldckpt.runtime.kernels.tune` on {meta['device_name']}; do not edit by hand.",
        "",
        "[meta]",
    ]
    lines += [f"{k} = {value(v)}" for k, v in meta.items()]
    for shape in shapes:
        lines += ["", "[[shape]]"] + [f"{k} = {value(shape[k])}" for k in ("n", "k", "fold_max_tokens", "heads")]
        for bucket in shape["bucket"]:
            lines += ["", "[[shape.bucket]]"] + [f"{k} = {value(v)}" for k, v in bucket.items()]
    return "\n".join(lines) + "\n"


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--out", type=Path, required=True, help="folder for tune_<gpu>.json and <gpu>.toml")
    parser.add_argument("--budget-s", type=float, default=330.0, help="time for the config search, all shapes")
    parser.add_argument("--workers", type=int, default=14, help="parallel compile processes")
    args = parser.parse_args(argv)
    args.out.mkdir(parents=True, exist_ok=True)
    import triton

    dev = torch.device("cuda")
    key = gpu_key(dev)
    start = time.monotonic()
    bandwidth = measure_copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)} ({key}): copy bandwidth {bandwidth / 1e12:.3f} TB/s", flush=True)

    configs = sorted(
        {c for m_max in BUCKETS for bm in bucket_block_ms(m_max) for c in candidate_configs(bm)},
        key=lambda c: (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, c.use_tma),
    )
    # Compile keys differ only by EVEN_N among the shapes (N % block_n); build each key once.
    shape_ns = sorted({MlaDims(h).fold_rows for h in HEADS})
    jobs = []
    for c in configs:
        representatives = {n % c.block_n == 0: n for n in shape_ns}
        jobs += [(c, n) for n in representatives.values()]
    print(f"compiling {len(jobs)} kernels for {len(configs)} configs with {args.workers} processes", flush=True)
    failed = precompile(jobs, args.workers)
    print(f"compiled in {time.monotonic() - start:.0f} s, {len(failed)} failed", flush=True)

    log: list[dict] = []
    rows: list[dict] = []
    shapes = []
    search_deadline = time.monotonic() + args.budget_s
    for i, heads in enumerate(HEADS):
        bench = ShapeBench(heads)
        settle_clocks(torch.device("cuda"))
        # The first shape also pays each kernel's first load; later shapes reuse them and need
        # less. Each shape may use what is left, less a reserve for every shape still to come.
        deadline = search_deadline - (len(HEADS) - 1 - i) * SHAPE_RESERVE * args.budget_s
        best = search(bench, failed, deadline, log)
        shape_rows = grid(bench, best)
        rows += shape_rows
        backends, crossover = decide(shape_rows)
        buckets = []
        for m_max in BUCKETS:
            cfg, us = best[m_max]
            torch_us = next(r["torch_us"] for r in shape_rows if r["m"] == m_max)
            buckets.append(
                {"m_max": m_max, "backend": backends[m_max], **asdict(cfg), "triton_us": us, "torch_us": torch_us}
            )
        shapes.append({"n": bench.n, "k": K, "fold_max_tokens": crossover, "heads": heads, "bucket": buckets})
        print(f"  N={bench.n}: fold_max_tokens={crossover} backends={backends}", flush=True)
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
    }
    (args.out / f"{key}.toml").write_text(toml_text(meta, sorted(shapes, key=lambda s: s["n"])), encoding="utf-8")
    (args.out / f"tune_{key}.json").write_text(
        json.dumps({"meta": meta, "search": log, "grid": rows}, indent=1), encoding="utf-8"
    )
    print(f"done in {time.monotonic() - start:.0f} s; {len(log)} configs timed", flush=True)
    return 0


if __name__ == "__main__":
    sys.exit(main())
