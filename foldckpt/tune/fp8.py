"""Tune the fp8 fold GEMM (``python -m foldckpt.tune --fp8``): its [[fp8_shape]] table entries.

The fp8 fold is weight-only: W float8_e4m3fn [N, K] and an fp32 scale per row, x bf16 unquantized,
``y = (x · Wᵀ) * scale`` (``triton_gemm``: e4m3 -> fp16/bf16 in registers, the scale in the
epilogue). It streams half the bytes of the bf16 fold, so at decode its time is set by how many of
them are in flight per SM even more than the bf16 kernel's: the search space is shaped for that
(whole K in flight per program where shared memory allows, more splits and rows per program than
the bf16 search). Steps, per deployment (``--heads``; default all of ``tune.HEADS``):

1. Search: the tiled kernel per token bucket (``tune.BUCKETS``), timed at the bucket's largest M
   (CUDA graphs over 16 weight copies, every result checked against fp32), all configs compiled
   up front in parallel (both row-ownership variants); the base table's [[fp8_shape]] config of
   the bucket goes first. Then each winner with and without PDL, with the MMA in fp16 or in
   x's dtype, and with the decode RoPE in its epilogue or not. The skinny kernel per token tile.
2. Grid: at every ``tune.GRID_M``, the fp8 fold on the bucket's tiled config, on the skinny tile
   (M <= 16) and on the torch fallback (dequantize + cuBLAS), against the unfolded path with the
   base table's q_b_proj kernels (cuBLAS, tiled, skinny; the fastest is the baseline) and the
   bf16 fold as ``fold_gemm`` runs it with the base table (informative: what the fp8 fold must
   beat to be worth its rounding). ``tune.decide`` gives the fp8 backends and fold_max_tokens,
   the crossover against the same unfolded baseline as the bf16 fold's.
Writes ``<gpu>.toml`` (``--base`` with [[fp8_shape]] and the role="fold_fp8" [[skinny]] entries of
the tuned deployments replaced) and ``tune_<gpu>.json`` (``--base-json``'s records with
``fp8_search`` and ``fp8_grid`` of the tuned shapes replaced) into ``--out``.
"""

from __future__ import annotations

import argparse
import datetime
import json
import statistics
import time
import tomllib
from collections.abc import Iterator
from dataclasses import asdict, replace
from itertools import product

import torch
import torch.nn.functional as F

from foldckpt.fold import quantize_fp8_rows
from foldckpt.runtime.kernels.device import gpu_key
from foldckpt.runtime.kernels.dispatch import _torch_gemm, fold_gemm, warmup_fold_gemm
from foldckpt.runtime.kernels.reference import unfolded_query
from foldckpt.runtime.kernels.timing import measure_copy_bandwidth, relative_error, settle_clocks, time_graphs_us
from foldckpt.tune.bf16 import (
    BUCKETS,
    GRID_M,
    GRID_ROUNDS,
    MAX_RELERR,
    SKINNY_BLOCK_MS,
    GemmWeights,
    K,
    ShapeBench,
    _layers,
    bucket_block_ms,
    bucket_of,
    choose_rope_epilogue,
    decide,
    pdl_supported,
    precompile,
    random_x,
    search_skinny,
    skinny_block_m,
    table_buckets,
    time_bucket,
    toml_text,
    triton_unfolded_query,
)
from foldckpt.runtime.kernels.tuning import (
    TRITON_MAX_M,
    GpuTable,
    KernelConfig,
    SkinnyConfig,
    config_dir,
    parse_table,
    q_b_proj_bucket,
    skinny_config,
)

__all__ = ["fp8_candidate_configs", "fp8_launch_variants", "fp8_skinny_candidates", "run"]

ROLE = "fold_fp8"
# Splits of K across programs (reduced in the same launch): the fp8 fold has half the bytes per
# row of the bf16 one, so a split's partials cost relatively more, but also up to 4x the programs.
FP8_SPLITS = (1, 2, 3, 4)
# Pipeline depths: up to K / block_k + 1, i.e. the whole K of a program in flight at once.
FP8_STAGES = (2, 3, 4, 5, 7)
# Share of the search budget per bucket: decode batches are mostly small, and the issue's
# targets are at M <= 16.
BUCKET_SHARE = {16: 0.4, 32: 0.2, 64: 0.15, 128: 0.15, 256: 0.1}


def fp8_candidate_configs(block_m: int) -> Iterator[KernelConfig]:
    """Compile-time configs of the fp8 tiled kernel worth timing at ``block_m``.

    W tiles are 1 byte per value: 32..160 KB of W in flight per program (the bf16 search: 16..96),
    shared memory (W + x stages) under 200 KB, at most 64 fp32 accumulators per thread, no
    deeper pipeline than the K loop. 32-row tiles run on mma.sync with one warpgroup.
    """
    for block_n, block_k, warps, stages, tma in product(
        (32, 64, 128), (128, 256, 512), (4, 8), FP8_STAGES, (False, True)
    ):
        if stages > K // block_k + 1:
            continue
        smem = stages * (block_n + block_m * 2) * block_k
        in_flight = (stages - 1) * block_n * block_k
        if smem > 200 * 1024 or not 32 * 1024 <= in_flight <= 160 * 1024 or block_n * block_m // (32 * warps) > 64:
            continue
        if block_n == 32 and (warps == 8 or tma):
            continue
        # 8 warps also at few tokens: one 4-warp program per SM leaves each scheduler a single warp
        # to hide the smem -> register -> convert latency of every W tile (first H200 search).
        if (warps == 8 and block_n < 64) or (warps == 4 and block_n * block_m > 128 * 128):
            continue
        # The fp16 MMA: e4m3 -> fp16 is one cvt per two values, e4m3 -> bf16 three (the first H200
        # search: 8.8 vs 12.2 us at Kimi-K3 TP8); ``choose_flags`` re-checks the bf16 MMA per winner.
        yield KernelConfig(block_m, block_n, block_k, 1, warps, stages, tma, mma_f16=True)


def fp8_skinny_candidates(block_m: int) -> Iterator[SkinnyConfig]:
    """Skinny-kernel configs for the fp8 weight: at most 128 fp32 products per thread per K chunk
    and at least one 16-byte (16 e4m3 values) load of W per thread and chunk."""
    for rows, block_k, warps in product((1, 2, 4, 8, 16), (256, 512), (1, 2, 4, 8)):
        if rows * block_m * block_k > 128 * 32 * warps or rows * block_k < 512 * warps or K % block_k:
            continue
        yield SkinnyConfig(block_m, rows, block_k, warps)


def fp8_launch_variants(base: KernelConfig, n: int, m: int) -> list[KernelConfig]:
    """Run-time choices of a compiled fp8 config: rows per program (the full tile, or fewer so the
    programs come to 1..4 whole SM waves; more than half a tile; TMA keeps whole tiles) and splits
    (FP8_SPLITS dividing K in whole blocks, 0.5 to 9 waves of programs)."""
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    rows_options = {base.block_n}
    if not base.use_tma:
        rows_options |= {-(-n // (waves * sms)) for waves in (1, 2, 3, 4)}
    variants = []
    for rows in sorted(r for r in rows_options if base.block_n // 2 < r <= base.block_n):
        programs = -(-n // rows) * -(-m // base.block_m)
        for split in FP8_SPLITS:
            if K % (split * base.block_k) == 0 and sms // 2 <= programs * split <= 9 * sms:
                variants.append(replace(base, split_k=split, rows_per_program=0 if rows == base.block_n else rows))
    return variants


class Fp8Bench(ShapeBench):
    """A deployment's ShapeBench (bf16 fold, q_b_proj, W_UK) plus its fp8 fold: the bf16 fold
    quantized per row (``foldckpt.fold.quantize_fp8_rows``, as convert writes it)."""

    def __init__(self, heads: int) -> None:
        super().__init__(heads)
        values, scale = quantize_fp8_rows(self.fold.copies[0].float())
        self.fp8 = GemmWeights(values, ROLE, scale)

    def weights(self, role: str) -> GemmWeights:
        return self.fp8 if role == ROLE else super().weights(role)


def _base_seed(base: dict | None, n: int) -> dict[int, KernelConfig]:
    fields = set(KernelConfig.__dataclass_fields__)
    for entry in (base or {}).get("fp8_shape", []):
        if entry["n"] == n and entry.get("k") == K:
            return {b["m_max"]: KernelConfig(**{k: v for k, v in b.items() if k in fields}) for b in entry["bucket"]}
    return {}


def search(
    bench: Fp8Bench, failed: set, deadline: float, log: list[dict], seeds: dict[int, KernelConfig]
) -> dict[int, tuple[KernelConfig, float]]:
    """Best (tiled config, µs) per bucket of the fp8 fold (:func:`tune.time_bucket`), each bucket
    with its BUCKET_SHARE of the time left; flags and RoPE are chosen for the winners later."""
    best: dict[int, tuple[KernelConfig, float]] = {}
    for m_max in BUCKETS:
        candidates = [
            cfg
            for block_m in bucket_block_ms(m_max)
            for base in fp8_candidate_configs(block_m)
            if base not in failed
            for cfg in fp8_launch_variants(base, bench.n, m_max)
        ]
        seed = seeds.get(m_max)
        seed = None if seed is None else replace(seed, pdl=False, rope_epilogue=False, mma_f16=True)
        best[m_max] = time_bucket(bench.fp8, ROLE, m_max, candidates, seed, deadline, log, BUCKET_SHARE)
    return best


def flag_variants(cfg: KernelConfig) -> list[KernelConfig]:
    """``cfg`` with each combination of PDL (where supported) and the fp16 MMA."""
    pdls = (False, True) if pdl_supported() else (False,)
    return [replace(cfg, pdl=p, mma_f16=f) for p, f in product(pdls, (False, True))]


def choose_flags(weights: GemmWeights, cfg: KernelConfig, m: int, log: list[dict]) -> tuple[KernelConfig, float]:
    """The fastest of ``flag_variants(cfg)`` at ``m``, timed interleaved (each checked first)."""
    x = random_x(m)
    y = torch.empty((m, weights.n), device="cuda", dtype=torch.bfloat16)
    choices = {}
    for variant in flag_variants(cfg):
        err = weights.triton_error(variant, x)
        if err > MAX_RELERR:
            raise RuntimeError(f"{variant} gives relative error {err:.1e} where {cfg} is right")
        choices[f"pdl={variant.pdl} mma_f16={variant.mma_f16}"] = variant
    times = time_graphs_us({name: weights.triton_calls(c, x, y) for name, c in choices.items()})
    for name, c in choices.items():
        log.append({"role": ROLE, "n": weights.n, "m": m, **asdict(c), "us": times[name]})
    name = min(times, key=times.__getitem__)
    return choices[name], times[name]


def grid_point(
    bench: Fp8Bench,
    table: GpuTable,
    m: int,
    cfg: KernelConfig | None,
    sk: SkinnyConfig | None,
) -> dict:
    """The fp8 fold (tiled, skinny, torch), the bf16 fold (``fold_gemm``) and the unfolded path
    (cuBLAS / tiled / skinny q_b_proj + W_UK bmm) at ``m``, timed interleaved, GRID_ROUNDS rounds."""
    from foldckpt.runtime.kernels import triton_gemm

    x = random_x(m)
    dims, qbs, uks, fp8 = bench.dims, bench.qb.copies, bench.uks, bench.fp8
    qn = bench.qb.n
    qb_bucket = q_b_proj_bucket(table, qn, K, m) if m <= TRITON_MAX_M else None
    qb_cfg = qb_bucket.config if qb_bucket is not None else None
    sk_qb = skinny_config(table, "q_b_proj", qn, K, m)
    variants = {
        "unfolded_cublas_us": [lambda i=i: unfolded_query(x, qbs[i], uks[i], dims) for i in _layers()],
        "bf16_fold_us": [lambda i=i: fold_gemm(x, bench.fold.copies[i]) for i in _layers()],
        "torch_us": [lambda i=i: _torch_gemm(x, fp8.copies[i], None, fp8.scales[i]) for i in _layers()],
    }
    times: dict = {"triton_us": None, "skinny_us": None, "unfolded_triton_us": None, "unfolded_skinny_us": None}
    if cfg is not None:
        times["triton_us"] = float("inf")
        if fp8.triton_error(cfg, x) <= MAX_RELERR:
            y = torch.empty((m, bench.n), device="cuda", dtype=torch.bfloat16)
            variants["triton_us"] = fp8.triton_calls(cfg, x, y)
    if sk is not None:
        times["skinny_us"] = float("inf")
        if fp8.skinny_error(sk, x) <= MAX_RELERR:
            y_sk = torch.empty((m, bench.n), device="cuda", dtype=torch.bfloat16)
            variants["skinny_us"] = fp8.skinny_calls(sk, x, y_sk)
    if qb_cfg is not None:
        times["unfolded_triton_us"] = float("inf")
        q = torch.empty((m, qn), device="cuda", dtype=torch.bfloat16)
        triton_gemm.reserve_workspace(x.device, *triton_gemm.workspace_needs(m, qn, qb_cfg))
        if bench.qb.triton_error(qb_cfg, x) <= MAX_RELERR:
            variants["unfolded_triton_us"] = [
                lambda i=i: triton_unfolded_query(x, qbs[i], uks[i], dims, qb_cfg, q) for i in _layers()
            ]
    if sk_qb is not None:
        times["unfolded_skinny_us"] = float("inf")
        if bench.qb.skinny_error(sk_qb, x) <= MAX_RELERR:
            q_sk = torch.empty((m, qn), device="cuda", dtype=torch.bfloat16)
            variants["unfolded_skinny_us"] = [
                lambda i=i: triton_unfolded_query(x, qbs[i], uks[i], dims, sk_qb, q_sk) for i in _layers()
            ]
    # The fallback and the bf16 fold are checked too: a wrong baseline is a wrong decision.
    for name, fn in (("torch_us", variants["torch_us"][0]), ("bf16_fold_us", variants["bf16_fold_us"][0])):
        ref = fp8.reference if name == "torch_us" else bench.fold.reference
        err = relative_error(fn(), F.linear(x.float(), ref))
        if err > MAX_RELERR:
            raise RuntimeError(f"N={bench.n} M={m}: {name} relative error {err:.1e}")
    rounds = [time_graphs_us(variants) for _ in range(GRID_ROUNDS)]
    times.update({name: statistics.median(r[name] for r in rounds) for name in variants})
    unfolded = {kn: times[f"unfolded_{kn}_us"] for kn in ("cublas", "triton", "skinny")}
    kernel = min((kn for kn, v in unfolded.items() if v is not None), key=lambda kn: unfolded[kn])
    return {"n": bench.n, "q_b_proj_n": qn, "m": m, **times, "unfolded_us": unfolded[kernel], "q_b_proj_kernel": kernel}


def run(args: argparse.Namespace) -> int:
    """``tune --fp8``: see the module docstring."""
    import triton

    args.out.mkdir(parents=True, exist_ok=True)
    dev = torch.device("cuda")
    key = gpu_key(dev)
    start = time.monotonic()
    base_path = args.base if args.base is not None else config_dir() / f"{key}.toml"
    if not base_path.is_file():
        raise SystemExit(f"tune --fp8: no base table {base_path}: tune the bf16 fold first")
    base = tomllib.loads(base_path.read_text(encoding="utf-8"))
    table = parse_table(base, str(base_path))
    heads_list = args.heads
    bandwidth = measure_copy_bandwidth(dev)
    print(f"{torch.cuda.get_device_name(dev)} ({key}): copy bandwidth {bandwidth / 1e12:.3f} TB/s; fp8 fold of "
          f"heads {heads_list}; base {base_path}", flush=True)  # fmt: skip
    benches = {h: Fp8Bench(h) for h in heads_list}
    ns = sorted({b.n for b in benches.values()})

    # 1. Compile every candidate in parallel: whole-tile and ragged-row ownership (EVEN_N), fp8.
    configs = sorted(
        {c for m_max in BUCKETS for bm in bucket_block_ms(m_max) for c in fp8_candidate_configs(bm)},
        key=lambda c: (c.block_m, c.block_n, c.block_k, c.num_warps, c.num_stages, c.use_tma),
    )
    jobs: list[tuple] = []
    for c in configs:
        jobs.append((c, ns[0], True, False))
        if not c.use_tma:
            jobs.append((replace(c, rows_per_program=c.block_n // 2 + 1), ns[0], True, False))
    skinny_configs = [replace(c, pdl=p) for b in SKINNY_BLOCK_MS for c in fp8_skinny_candidates(b)
                      for p in ((False, True) if pdl_supported() else (False,))]  # fmt: skip
    jobs += [(c, ns[0], True, False) for c in skinny_configs]
    print(f"compiling {len(jobs)} fp8 kernels ({len(configs)} tiled, {len(skinny_configs)} skinny configs)", flush=True)
    failed = precompile(jobs, args.workers)
    print(f"compiled in {time.monotonic() - start:.0f} s, {len(failed)} failed", flush=True)

    # 2. Search the tiled kernel for every shape, then compile the winners' flag and RoPE variants.
    log: list[dict] = []
    best_by_heads: dict[int, dict[int, tuple[KernelConfig, float]]] = {}
    search_deadline = time.monotonic() + args.budget_s
    for i, heads in enumerate(heads_list):
        bench = benches[heads]
        settle_clocks(dev)
        deadline = time.monotonic() + (search_deadline - time.monotonic()) / (len(heads_list) - i)
        best_by_heads[heads] = search(bench, failed, deadline, log, _base_seed(base, bench.n))
    winner_jobs = []
    for heads, best in best_by_heads.items():
        for cfg, _us in best.values():
            for variant in flag_variants(cfg):
                winner_jobs += [(variant, benches[heads].n, True, False), (variant, benches[heads].n, True, True)]
    precompile(winner_jobs, args.workers)
    print(f"winners' variants compiled at {time.monotonic() - start:.0f} s", flush=True)

    # 3. Per shape: flags and RoPE per bucket, the skinny tiles, the grid, the decision.
    grid_rows: list[dict] = []
    fp8_shapes, skinny_entries = [], []
    for heads in heads_list:
        bench = benches[heads]
        warmup_fold_gemm(bench.fold.copies[0], GRID_M[-1])
        settle_clocks(dev)
        best = {}
        for m_max, (cfg, _us) in best_by_heads[heads].items():
            cfg, us = choose_flags(bench.fp8, cfg, m_max, log)
            cfg = choose_rope_epilogue(bench, cfg, m_max, log, bench.fp8)
            best[m_max] = (cfg, us)
            print(f"  fp8 N={bench.n} M<={m_max}: {us:.2f} us with {cfg}", flush=True)
        skinny_best = search_skinny(bench, ROLE, failed, log, fp8_skinny_candidates)
        rows = []
        for m in GRID_M:
            settle_clocks(dev)
            bucket = bucket_of(m)
            tile = skinny_block_m(m)
            sk = skinny_best.get(tile, (None, 0.0))[0] if tile else None
            row = grid_point(bench, table, m, best[bucket][0] if bucket else None, sk)
            rows.append(row)
            print(f"  fp8 N={bench.n} M={m}: " + " ".join(f"{k}={v:.2f}" for k, v in row.items()
                  if k.endswith("_us") and v) + f" (q_b_proj: {row['q_b_proj_kernel']})", flush=True)  # fmt: skip
        grid_rows += rows
        backends, _, crossover = decide(rows, args.tolerance)
        tiled = {}
        for m_max in BUCKETS:
            at = next(r for r in rows if r["m"] == m_max)
            cfg, us = best[m_max]
            tiled[m_max] = {"m_max": m_max, **asdict(cfg), "triton_us": us, "torch_us": at["torch_us"]}
        fp8_shapes.append({"n": bench.n, "k": K, "fold_max_tokens": crossover, "heads": heads,
                           "bucket": table_buckets(backends, tiled, rows)})  # fmt: skip
        for block_m, (cfg, us) in skinny_best.items():
            skinny_entries.append({"role": ROLE, "n": bench.n, "k": K, "m_max": block_m, "rows": cfg.rows,
                                   "block_k": cfg.block_k, "num_warps": cfg.num_warps, "pdl": cfg.pdl, "us": us})  # fmt: skip
        print(f"  fp8 N={bench.n}: fold_max_tokens={crossover} backends={backends}", flush=True)

    # 4. The base table with the tuned deployments' fp8 entries replaced.
    tuned_ns = {b.n for b in benches.values()}
    meta = dict(base["meta"])
    meta.update(
        fp8_date=datetime.datetime.now(datetime.UTC).strftime("%Y-%m-%dT%H:%M:%SZ"),
        fp8_torch=torch.__version__,
        fp8_triton=triton.__version__,
        fp8_copy_bandwidth_tb_s=round(bandwidth / 1e12, 4),
        fp8_tuned_heads=",".join(str(h) for h in heads_list),
        fp8_baseline="unfolded = fastest of cuBLAS and the base table's tiled and skinny q_b_proj kernels, + W_UK bmm",
    )
    kept = [s for s in base.get("fp8_shape", []) if s["n"] not in tuned_ns]
    all_fp8 = sorted(kept + fp8_shapes, key=lambda s: s["n"])
    skinny = [s for s in base.get("skinny", []) if not (s["role"] == ROLE and s["n"] in tuned_ns)] + skinny_entries
    skinny.sort(key=lambda s: (s["role"], s["n"], s["m_max"]))
    text = toml_text(meta, base["shape"], base.get("q_b_proj", []), skinny, all_fp8)
    parse_table(tomllib.loads(text), "the written table")  # never write a table the dispatcher rejects
    (args.out / f"{key}.toml").write_text(text, encoding="utf-8")
    doc = json.loads(args.base_json.read_text(encoding="utf-8")) if args.base_json is not None else {"meta": {}}
    doc["meta"].update((k, v) for k, v in meta.items() if k.startswith("fp8_"))
    doc["fp8_search"] = [r for r in doc.get("fp8_search", []) if r["n"] not in tuned_ns] + log
    doc["fp8_grid"] = [r for r in doc.get("fp8_grid", []) if r["n"] not in tuned_ns] + grid_rows
    (args.out / f"tune_{key}.json").write_text(json.dumps(doc, indent=1), encoding="utf-8")
    print(f"done in {time.monotonic() - start:.0f} s; {len(log)} fp8 configs timed", flush=True)
    return 0
