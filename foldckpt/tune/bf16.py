"""The bf16 fold's search space (``python -m foldckpt.tune --dtype bf16``): [[shape]], [[q_b_proj]]
and the role="fold" / "q_b_proj" [[skinny]] entries of a table.

Besides the fold GEMM W_fold [n*(L+R), K] it searches vLLM's q_b_proj GEMM [n*(P+R), K] (a third of
the fold's rows), so that the unfolded baseline the fold is routed against gets the best q_b_proj
kernel we have, not only cuBLAS.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import replace

from foldckpt.runtime.kernels.tuning import KernelConfig, SkinnyConfig
from foldckpt.tune.search import EQUAL_SHARES, K, pdl_supported, split_variants
from foldckpt.tune.space import SearchSpace

__all__ = ["BF16", "candidate_configs", "launch_variants", "skinny_candidates"]

# Split-K lost everywhere in the first H200 search (the latency of the in-kernel reduction: the
# ``split_k`` > 1 entries of ``search`` in docs/bench/tune_nvidia_h200.json); 2 stays in the grid
# so each table re-checks that. The q_b_proj weights have a third of the fold's rows (36 whole
# 64-row programs at Kimi-K3 TP8 on 132 SMs), so their search also tries 4 splits and programs of
# down to a quarter tile of rows.
SPLITS = (1, 2)
Q_B_PROJ_SPLITS = (1, 2, 4)


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


def launch_variants(base: KernelConfig, n: int, m: int, role: str = "fold") -> list[KernelConfig]:
    """Run-time choices for a compiled config: the fold keeps more than half a tile per program and
    splits K in SPLITS; the q_b_proj GEMM (a third of the rows) may go down to a quarter tile and
    Q_B_PROJ_SPLITS (``search.split_variants``)."""
    if role == "fold":
        return split_variants(base, n, m, base.block_n // 2, SPLITS)
    return split_variants(base, n, m, base.block_n // 4, Q_B_PROJ_SPLITS)


def flag_variants(cfg: KernelConfig) -> list[KernelConfig]:
    """The winner in stream order and, where supported, with programmatic dependent launch."""
    return [cfg, replace(cfg, pdl=True)] if pdl_supported() else [cfg]


def compile_jobs(configs: list[KernelConfig], ns: list[int]) -> list[tuple]:
    """Compile keys differ only by EVEN_N among the shapes (n % block_n): build each key once."""
    jobs: list[tuple] = []
    for c in configs:
        representatives = {n % c.block_n == 0: n for n in ns}
        jobs += [(c, n) for n in representatives.values()]
    return jobs


BF16 = SearchSpace(
    name="bf16",
    roles=("fold", "q_b_proj"),
    section="shape",
    candidates=candidate_configs,
    launch_variants=launch_variants,
    skinny_candidates=skinny_candidates,
    flag_variants=flag_variants,
    plain=lambda cfg: replace(cfg, pdl=False, rope_epilogue=False),
    compile_jobs=compile_jobs,
    bucket_shares=EQUAL_SHARES,
    prefix="",
)
