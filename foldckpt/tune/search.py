"""The tuner's one search loop and what it measures with, for every weight dtype.

A search space (``space.SearchSpace``: ``bf16.BF16``, ``fp8.FP8``) says which configs exist for a
dtype; everything else is here, once:

1. Search: per fold shape (N, K) and token bucket, time tiled-kernel configs of the space at the
   bucket's largest M (:func:`time_bucket`: CUDA graphs over 16 weight copies, nothing
   L2-resident, every result checked first; the base table's config goes first, so a search cut
   short by the budget never ends worse than the last one). Then each winner's flag variants
   (PDL, and for fp8 the fp16 MMA) and the decode RoPE in its epilogue or after it; the skinny
   kernel per token tile. The bf16 space also searches vLLM's q_b_proj GEMM, so the unfolded
   baseline gets the best q_b_proj kernel we have, not only cuBLAS; the fp8 space reads those
   from the bf16 table.
2. Grid: at every GRID_M, the fold on each backend against the unfolded path on each q_b_proj
   kernel (:func:`grid_point`). :func:`decide`: per bucket the faster fold backend, the M <= 16
   bucket split where the skinny kernel wins, and ``fold_max_tokens`` from
   ``tuning.decide_fold_max_tokens`` (the rule the plugin's start-up measurement applies too).
"""

from __future__ import annotations

import multiprocessing
import random
import statistics
import time
from collections.abc import Callable, Iterator, Mapping
from dataclasses import asdict, replace
from functools import partial

import torch
import torch.nn.functional as F

from foldckpt.fold import quantize_fp8_rows
from foldckpt.runtime.kernels.dispatch import fold_gemm, torch_gemm
from foldckpt.runtime.kernels.reference import MlaDims, decode_rope, unfolded_query
from foldckpt.runtime.kernels.rope import QueryRope
from foldckpt.runtime.kernels.timing import LAYER_COPIES, layer_order, relative_error, time_graph_us, time_graphs_us
from foldckpt.runtime.kernels.tuning import ROUTE_TOLERANCE, KernelConfig, SkinnyConfig, decide_fold_max_tokens
from foldckpt.tune.space import SearchSpace

# Heads per rank of the deployments we serve: Kimi-K3 (96 heads) at TP16/8/4, DeepSeek-V3
# (128 heads) at TP8; N = heads * 576.
HEADS = (12, 6, 16, 24)
K = 1536
BUCKETS = (16, 32, 64, 128, 256)
GRID_M = (1, 2, 4, 8, 14, 16, 28, 32, 56, 64, 96, 112, 128, 160, 192, 224, 256, 320, 384, 512, 768, 1024)
# Each grid point is timed in this many rounds, each with fresh graph captures, and every variant
# keeps its median round: one capture's placement moves a launch-bound point by more than the
# routing tolerance, and the crossover breaks at the first point where the fold loses.
GRID_ROUNDS = 3
# Token tiles of the skinny kernel (the stand-in for vLLM's own skinny q_b_proj kernels at M <= 16).
SKINNY_BLOCK_MS = (1, 2, 4, 8, 16)
# Relative error a correct bf16-output GEMM stays far below (bf16 rounding of y is ~2e-3).
MAX_RELERR = 1e-2
# The weights a search times: the bf16 fold, the fp8 fold (e4m3 + fp32 scale per row) or q_b_proj.
FOLD_ROLES = ("fold", "fold_fp8")


def skinny_block_m(m: int) -> int | None:
    return next((b for b in SKINNY_BLOCK_MS if m <= b), None)


def bucket_block_ms(m_max: int) -> tuple[int, ...]:
    """Tile heights tried for a bucket: the bucket itself, or half of it in two M tiles."""
    return (m_max,) if m_max == 16 else (m_max, m_max // 2)


def bucket_of(m: int) -> int | None:
    return next((b for b in BUCKETS if m <= b), None)


def pdl_supported() -> bool:
    """Programmatic dependent launch needs an NVIDIA GPU of compute capability 9.0 or newer."""
    return torch.version.hip is None and torch.cuda.get_device_capability() >= (9, 0)


def sm_count() -> int:
    return torch.cuda.get_device_properties(0).multi_processor_count


def rows_options(base: KernelConfig, n: int) -> list[int]:
    """Rows per program worth a launch of ``base``: the full tile, or fewer so that the programs come
    to a whole number of SM waves (1..4); TMA loads whole tiles, so it keeps full tiles."""
    options = {base.block_n}
    if not base.use_tma:
        options |= {-(-n // (waves * sm_count())) for waves in (1, 2, 3, 4)}
    return sorted(options)


def split_variants(base: KernelConfig, n: int, m: int, min_rows: int, splits: tuple[int, ...]) -> list[KernelConfig]:
    """``base`` with each rows-per-program option above ``min_rows`` and each split of K in whole
    blocks that gives 0.5 to ~9 waves of programs."""
    sms = sm_count()
    variants = []
    for rows in (r for r in rows_options(base, n) if min_rows < r <= base.block_n):
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

    def torch_calls(self, x: torch.Tensor) -> list[Callable[[], object]]:
        """The fold's torch path over the copies, as ``fold_gemm`` runs it there (the fp8 fold
        dequantizes in fp32 per call)."""
        return [lambda i=i: torch_gemm(x, self.copies[i], None, self.scales[i]) for i in layer_order()]

    def triton_calls(
        self, cfg: KernelConfig, x: torch.Tensor, y: torch.Tensor, rope: QueryRope | None = None
    ) -> list[Callable[[], None]]:
        from foldckpt.runtime.kernels import triton_gemm

        triton_gemm.reserve_workspace(x.device, *triton_gemm.workspace_needs(x.shape[0], self.n, cfg))
        return [
            lambda i=i: triton_gemm.launch_fold_gemm(x, self.copies[i], y, cfg, rope, scale=self.scales[i])
            for i in layer_order()
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

    def cuda_calls(self, x: torch.Tensor, y: torch.Tensor) -> list[Callable[[], object]] | None:
        """The fp8 fold through the Hopper CUDA kernel (``cuda_fp8``) over the copies, or None where
        it cannot run (not an fp8 weight, not an sm_90 GPU, no NVRTC, M above its plans)."""
        from foldckpt.runtime.kernels import cuda_fp8

        if self.scales[0] is None or not cuda_fp8.runs_on(x.device):
            return None
        if not cuda_fp8.supports(x, self.copies[0], y, self.scales[0]):
            return None
        try:
            cuda_fp8.launch(x, self.copies[0], self.scales[0], y)
        except cuda_fp8.KernelUnavailable as exc:
            print(f"  CUDA fp8 kernel unavailable at N={self.n} M={x.shape[0]}: {exc}", flush=True)
            return None
        return [lambda i=i: cuda_fp8.launch(x, self.copies[i], self.scales[i], y) for i in layer_order()]

    def skinny_calls(self, cfg: SkinnyConfig, x: torch.Tensor, y: torch.Tensor) -> list[Callable[[], None]]:
        from foldckpt.runtime.kernels import triton_gemm

        return [
            lambda i=i: triton_gemm.launch_skinny_gemm(x, self.copies[i], y, cfg, scale=self.scales[i])
            for i in layer_order()
        ]

    def skinny_error(self, cfg: SkinnyConfig, x: torch.Tensor) -> float:
        y = torch.full((x.shape[0], self.n), float("nan"), device="cuda", dtype=torch.bfloat16)
        self.skinny_calls(cfg, x, y)[0]()
        return relative_error(y, F.linear(x.float(), self.reference))


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
    """One deployment's weights, LAYER_COPIES deep: the bf16 fold, q_b_proj and W_UK, and with
    ``fp8`` the fp8 fold (the bf16 fold quantized per row, as convert writes it)."""

    def __init__(self, heads: int, fp8: bool = False) -> None:
        self.dims = MlaDims(heads)
        self.n = self.dims.fold_rows
        dev = torch.device("cuda")
        fold = torch.randn(self.n, K, device=dev, dtype=torch.bfloat16) / K**0.5
        qb = torch.randn(heads * (self.dims.nope + self.dims.rope), K, device=dev, dtype=torch.bfloat16) / K**0.5
        uk = torch.randn(heads, self.dims.nope, self.dims.kv_lora, device=dev, dtype=torch.bfloat16) / 128**0.5
        self.fold = GemmWeights(fold, "fold")
        self.qb = GemmWeights(qb, "q_b_proj")
        self.uks = [uk.clone() for _ in range(LAYER_COPIES)]
        self.fp8 = GemmWeights(*_fp8_args(fold)) if fp8 else None

    def weights(self, role: str) -> GemmWeights:
        return {"fold": self.fold, "q_b_proj": self.qb, "fold_fp8": self.fp8}[role]


def _fp8_args(fold: torch.Tensor) -> tuple[torch.Tensor, str, torch.Tensor]:
    values, scale = quantize_fp8_rows(fold.float())
    return values, "fold_fp8", scale


def grid_point(
    bench: ShapeBench,
    role: str,
    m: int,
    cfg: KernelConfig | None,
    sk: SkinnyConfig | None,
    qb_cfg: KernelConfig | None,
    sk_qb: SkinnyConfig | None,
) -> dict:
    """The fold of ``role`` (tiled ``cfg``, skinny ``sk``, torch) and the unfolded path (q_b_proj
    through cuBLAS, the tiled ``qb_cfg`` and the skinny ``sk_qb`` + W_UK bmm, no RoPE) at ``m``,
    timed interleaved, the median of GRID_ROUNDS rounds of fresh captures; for the fp8 fold also
    the bf16 fold as ``fold_gemm`` runs it (informative: what the fp8 fold must beat to be worth
    its rounding). A kernel with a wrong result times as inf; ``unfolded_us`` is the fastest
    q_b_proj kernel's (named by ``q_b_proj_kernel``)."""
    from foldckpt.runtime.kernels import triton_gemm

    x = random_x(m)
    fold, qb, uks, dims = bench.weights(role), bench.qb, bench.uks, bench.dims
    variants = {
        "unfolded_cublas_us": [lambda i=i: unfolded_query(x, qb.copies[i], uks[i], dims) for i in layer_order()],
        "torch_us": fold.torch_calls(x),
    }
    checked = {"torch_us": fold}
    if role == "fold_fp8":
        variants["bf16_fold_us"] = [lambda i=i: fold_gemm(x, bench.fold.copies[i]) for i in layer_order()]
        checked["bf16_fold_us"] = bench.fold
    # The fallback and the bf16 fold are checked too: a wrong baseline is a wrong decision.
    for name, weights in checked.items():
        err = relative_error(variants[name][0](), F.linear(x.float(), weights.reference))
        if err > MAX_RELERR:
            raise RuntimeError(f"N={bench.n} M={m}: {name} relative error {err:.1e}")
    times: dict = {
        "triton_us": None,
        "skinny_us": None,
        "cuda_us": None,
        "unfolded_triton_us": None,
        "unfolded_skinny_us": None,
    }
    y_cuda = torch.full((m, bench.n), float("nan"), device="cuda", dtype=torch.bfloat16)
    cuda = fold.cuda_calls(x, y_cuda)
    if cuda is not None:
        times["cuda_us"] = float("inf")
        if relative_error(y_cuda, F.linear(x.float(), fold.reference)) <= MAX_RELERR:
            variants["cuda_us"] = cuda
    if cfg is not None:
        times["triton_us"] = float("inf")
        if fold.triton_error(cfg, x) <= MAX_RELERR:
            y = torch.empty((m, bench.n), device="cuda", dtype=torch.bfloat16)
            variants["triton_us"] = fold.triton_calls(cfg, x, y)
    if sk is not None:
        times["skinny_us"] = float("inf")
        if fold.skinny_error(sk, x) <= MAX_RELERR:
            y_sk = torch.empty((m, bench.n), device="cuda", dtype=torch.bfloat16)
            variants["skinny_us"] = fold.skinny_calls(sk, x, y_sk)
    for name, qcfg in (("unfolded_triton_us", qb_cfg), ("unfolded_skinny_us", sk_qb)):
        if qcfg is None:
            continue
        times[name] = float("inf")
        ok = (qb.skinny_error if isinstance(qcfg, SkinnyConfig) else qb.triton_error)(qcfg, x) <= MAX_RELERR
        if ok:
            q = torch.empty((m, qb.n), device="cuda", dtype=torch.bfloat16)
            if isinstance(qcfg, KernelConfig):
                triton_gemm.reserve_workspace(x.device, *triton_gemm.workspace_needs(m, qb.n, qcfg))
            variants[name] = [
                lambda i=i, c=qcfg, q=q: triton_unfolded_query(x, qb.copies[i], uks[i], dims, c, q)
                for i in layer_order()
            ]
    rounds = [time_graphs_us(variants) for _ in range(GRID_ROUNDS)]
    times.update({name: statistics.median(r[name] for r in rounds) for name in variants})
    unfolded = {kn: times[f"unfolded_{kn}_us"] for kn in ("cublas", "triton", "skinny")}
    kernel = min((kn for kn, v in unfolded.items() if v is not None), key=lambda kn: unfolded[kn])
    return {
        "n": bench.n,
        "q_b_proj_n": qb.n,
        "m": m,
        **times,
        "unfolded_us": unfolded[kernel],
        "q_b_proj_kernel": kernel,
    }


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
    print(
        f"  {role} N={weights.n} M<={m_max}: best {best[1]:.2f} us of {timed}/{len(ordered)} timed: {best[0]}",
        flush=True,
    )
    return best


def search(
    space: SearchSpace,
    bench: ShapeBench,
    role: str,
    failed: set,
    deadline: float,
    log: list[dict],
    seeds: Mapping[int, KernelConfig],
) -> dict[int, tuple[KernelConfig, float]]:
    """Best (tiled config, µs) per bucket for one shape's ``role`` weight (:func:`time_bucket`, each
    bucket with its share of the time left); flags and RoPE are chosen for the winners later
    (:func:`finish_winners`)."""
    weights = bench.weights(role)
    best: dict[int, tuple[KernelConfig, float]] = {}
    for m_max in BUCKETS:
        candidates = [
            cfg
            for block_m in bucket_block_ms(m_max)
            for base in space.candidates(block_m)
            if base not in failed
            for cfg in space.launch_variants(base, weights.n, m_max, role)
        ]
        seed = seeds.get(m_max)
        seed = None if seed is None else space.plain(seed)
        best[m_max] = time_bucket(weights, role, m_max, candidates, seed, deadline, log, space.bucket_shares)
    return best


def finish_winners(
    space: SearchSpace, bench: ShapeBench, role: str, best: dict[int, tuple[KernelConfig, float]], log: list[dict]
) -> dict[int, tuple[KernelConfig, float]]:
    """Each bucket winner with its fastest flag variant (:func:`choose_flags`) and, for a fold, the
    decode RoPE in its epilogue where that is faster (:func:`choose_rope_epilogue`)."""
    weights = bench.weights(role)
    finished = {}
    for m_max, (cfg, _us) in best.items():
        cfg, us = choose_flags(weights, space.flag_variants(cfg), m_max, log)
        if role in FOLD_ROLES:
            cfg = choose_rope_epilogue(bench, cfg, m_max, log, weights)
        print(f"  {role} N={weights.n} M<={m_max}: {us:.2f} us with {cfg}", flush=True)
        finished[m_max] = (cfg, us)
    return finished


def search_skinny(
    bench: ShapeBench,
    role: str,
    failed: set,
    log: list[dict],
    candidates: Callable[[int], Iterator[SkinnyConfig]],
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
            log.append(
                {"role": role, "kernel": "skinny", "n": weights.n, "m": block_m, **asdict(cfg), "us": us, "relerr": err}
            )
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
                log.append(
                    {"role": role, "kernel": "skinny", "n": weights.n, "m": block_m, **asdict(c), "us": times[name]}
                )
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
    times = time_graphs_us({name: [partial(fn, i) for i in layer_order()] for name, fn in choices.items()})
    for name, us in times.items():
        log.append({"role": weights.role, "n": bench.n, "m": m, **asdict(cfg), "rope": name, "us": us})
    return replace(cfg, rope_epilogue=times["fused"] < times["split"])


def choose_flags(
    weights: GemmWeights, variants: list[KernelConfig], m: int, log: list[dict]
) -> tuple[KernelConfig, float]:
    """The fastest of a winner's flag ``variants`` at ``m``, timed interleaved (each checked first).

    Only the winner is tried with each flag: PDL moves the launch and the MMA dtype the convert,
    not the tiling, so they do not reorder the configs."""
    x = random_x(m)
    y = torch.empty((m, weights.n), device="cuda", dtype=torch.bfloat16)
    choices = {}
    for variant in variants:
        err = weights.triton_error(variant, x)
        if err > MAX_RELERR:
            raise RuntimeError(f"{variant} gives relative error {err:.1e} where {variants[0]} is right")
        choices[f"pdl={variant.pdl} mma_f16={variant.mma_f16}"] = variant
    times = time_graphs_us({name: weights.triton_calls(c, x, y) for name, c in choices.items()})
    for name, c in choices.items():
        log.append({"role": weights.role, "n": weights.n, "m": m, **asdict(c), "us": times[name]})
    name = min(times, key=times.__getitem__)
    return choices[name], times[name]


def fold_us(row: dict, backend: str) -> float:
    """The fold's time at a grid row on ``backend`` ("triton", "torch", "skinny" or "cuda")."""
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

    Fold: per BUCKETS bucket the fastest of the tiled Triton kernel, torch and (the fp8 fold on
    Hopper, where it ran at every grid point of the bucket) the CUDA kernel in sum over the
    bucket's grid points, then ``skinny_split`` (the M <= 16 bucket split where the skinny kernel
    was faster than that): ascending m_max -> "triton" / "torch" / "skinny", the table's
    [[shape.bucket]] list ("cuda" too for the fp8 fold). q_b_proj: per BUCKETS bucket the faster of tiled Triton and cuBLAS.

    The crossover is ``tuning.decide_fold_max_tokens`` of the fold on its bucket's backend against
    the unfolded path on the fastest of its q_b_proj kernels at each grid M.
    """
    backends, qb_backends = {}, {}
    for bucket in BUCKETS:
        inside = [r for r in rows if bucket_of(r["m"]) == bucket]
        sums = {backend: sum(r[f"{backend}_us"] for r in inside) for backend in ("triton", "torch")}
        if inside and all(r.get("cuda_us") is not None for r in inside):
            sums["cuda"] = sum(r["cuda_us"] for r in inside)
        # Ties keep the earlier backend (the Triton kernel, then torch).
        backends[bucket] = min(sums, key=sums.__getitem__)
        qb_triton = [r.get("unfolded_triton_us") for r in inside]
        qb_backends[bucket] = (
            "triton"
            if None not in qb_triton and sum(qb_triton) < sum(r["unfolded_cublas_us"] for r in inside)
            else "torch"
        )
    backends = skinny_split(rows, backends)
    points = [(r["m"], fold_us(r, backend_at(backends, r["m"])), r["unfolded_us"]) for r in rows]
    crossover = decide_fold_max_tokens(points, tolerance)
    return backends, qb_backends, crossover


def table_buckets(backends: dict[int, str], tiled: dict[int, dict], rows: list[dict]) -> list[dict]:
    """The [[shape.bucket]] records for ``decide``'s fold ``backends``: each carries the tiled
    Triton config of the BUCKETS bucket holding it (``tiled``: m_max -> record with the config
    and the search's triton_us), the measurements behind its choice and, where skinny or cuda, that
    backend's time at its m_max.
    A skinny sub-bucket's triton_us / torch_us are the grid's at its m_max."""
    records = []
    for m_max, backend in backends.items():
        at = next(r for r in rows if r["m"] == m_max)
        src = tiled[bucket_of(m_max)]
        record = {"m_max": m_max, "backend": backend}
        record.update((k, v) for k, v in src.items() if k not in ("m_max", "backend", "skinny_us"))
        if m_max not in BUCKETS:
            record.update(triton_us=at["triton_us"], torch_us=at["torch_us"])
        if backend in ("skinny", "cuda"):
            record[f"{backend}_us"] = at[f"{backend}_us"]
        records.append(record)
    return records
