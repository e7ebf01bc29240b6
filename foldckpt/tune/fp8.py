"""The fp8 fold's search space (``python -m foldckpt.tune --dtype fp8``): [[fp8_shape]] and the
role="fold_fp8" [[skinny]] entries of a table whose bf16 entries are already tuned.

The fp8 fold is weight-only: W float8_e4m3fn [N, K] and an fp32 scale per row, x bf16 unquantized,
``y = (x · Wᵀ) * scale`` (``triton_gemm``: e4m3 -> fp16/bf16 in registers, the scale in the
epilogue). It streams half the bytes of the bf16 fold, so at decode its time is set by how many of
them are in flight per SM even more than the bf16 kernel's: the space is shaped for that (whole K
in flight per program where shared memory allows, more splits and rows per program than the bf16
space). It is routed against the same unfolded baseline as the bf16 fold (the base table's
q_b_proj kernels).
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace
from itertools import product

from foldckpt.runtime.kernels.tuning import KernelConfig, SkinnyConfig
from foldckpt.tune.search import K, pdl_supported, split_variants
from foldckpt.tune.space import SearchSpace

__all__ = ["FP8", "fp8_candidate_configs", "fp8_launch_variants", "fp8_skinny_candidates"]

# Splits of K across programs (reduced in the same launch): the fp8 fold has half the bytes per
# row of the bf16 one, so a split's partials cost relatively more, but also up to 4x the programs.
FP8_SPLITS = (1, 2, 3, 4)
# Pipeline depths: up to K / block_k + 1, i.e. the whole K of a program in flight at once.
FP8_STAGES = (2, 3, 4, 5, 7)
# Share of the search budget per bucket: decode batches are mostly small.
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
        # search's fp8_search records); ``search.choose_flags`` re-checks the bf16 MMA per winner.
        yield KernelConfig(block_m, block_n, block_k, 1, warps, stages, tma, mma_f16=True)


def fp8_skinny_candidates(block_m: int) -> Iterator[SkinnyConfig]:
    """Skinny-kernel configs for the fp8 weight: at most 128 fp32 products per thread per K chunk
    and at least one 16-byte (16 e4m3 values) load of W per thread and chunk."""
    for rows, block_k, warps in product((1, 2, 4, 8, 16), (256, 512), (1, 2, 4, 8)):
        if rows * block_m * block_k > 128 * 32 * warps or rows * block_k < 512 * warps or K % block_k:
            continue
        yield SkinnyConfig(block_m, rows, block_k, warps)


def fp8_launch_variants(base: KernelConfig, n: int, m: int, role: str = "fold_fp8") -> list[KernelConfig]:
    """Run-time choices of a compiled fp8 config: more than half a tile of rows per program and
    FP8_SPLITS (``search.split_variants``)."""
    return split_variants(base, n, m, base.block_n // 2, FP8_SPLITS)


def flag_variants(cfg: KernelConfig) -> list[KernelConfig]:
    """``cfg`` with each combination of PDL (where supported) and the fp16 MMA, ``cfg``'s own first."""
    pdls = (False, True) if pdl_supported() else (False,)
    variants = [replace(cfg, pdl=p, mma_f16=f) for p, f in product(pdls, (False, True))]
    return [cfg] + [v for v in variants if v != cfg]


def compile_jobs(configs: list[KernelConfig], ns: list[int]) -> list[tuple]:
    """Every candidate as the fp8 kernel, with whole-tile and (no TMA) ragged row ownership (EVEN_N)."""
    jobs: list[tuple] = []
    for c in configs:
        jobs.append((c, ns[0], True, False))
        if not c.use_tma:
            jobs.append((replace(c, rows_per_program=c.block_n // 2 + 1), ns[0], True, False))
    return jobs


FP8 = SearchSpace(
    name="fp8",
    roles=("fold_fp8",),
    section="fp8_shape",
    candidates=fp8_candidate_configs,
    launch_variants=fp8_launch_variants,
    skinny_candidates=fp8_skinny_candidates,
    flag_variants=flag_variants,
    plain=lambda cfg: replace(cfg, pdl=False, rope_epilogue=False, mma_f16=True),
    compile_jobs=compile_jobs,
    bucket_shares=BUCKET_SHARE,
    prefix="fp8_",
)
