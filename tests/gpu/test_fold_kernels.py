"""GPU tests of the fold GEMM kernels, the dispatcher and the pre-route threshold.

Run on a CUDA machine: ``pytest -m gpu tests/gpu``. Every output buffer is poisoned with NaN
first, so an element the kernel forgot to write fails the error check.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from foldckpt.runtime.kernels import (
    QueryRope,
    dispatch,
    fold_gemm,
    fold_query,
    fold_route,
    gpu_key,
    rope_query,
    tuning,
    warmup_fold_gemm,
    warmup_fold_query,
)
from foldckpt.runtime.kernels.reference import MlaDims, decode_rope, reference_query
from foldckpt.runtime.kernels.rope import rope_gptj
from foldckpt.runtime.kernels.routing import AUTOTUNE_ENV, ENV_FOLD_MAX_TOKENS
from foldckpt.runtime.kernels.tuning import (
    TRITON_MAX_M,
    KernelConfig,
    SkinnyConfig,
    load_table,
    parse_table,
    q_b_proj_bucket,
    skinny_config,
)
from tests.gpu.kernel_cases import MAX_RELERR, SHAPES, K, record_launches

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Their q_b_proj weights [heads * (P + R), K]: the unfolded baseline's Triton kernel runs at these.
Q_B_PROJ_SHAPES = tuple(h * 192 for h in (6, 12, 24, 16))
BENCH_MS = (1, 2, 4, 8, 14, 28, 56, 112, 224)
ODD_MS = (1, 3, 7, 13, 57, 129, 255)
# Fixed configs covering every kernel path (mma.sync / wgmma, split or not, TMA or pointers,
# ragged row ownership, several M tiles, programmatic dependent launch) independent of what the
# tuner picked.
FIXED_CONFIGS = (
    KernelConfig(16, 32, 128, 1, 4, 4),
    KernelConfig(16, 64, 128, 4, 4, 4),
    KernelConfig(16, 128, 64, 3, 4, 4, use_tma=True),
    KernelConfig(64, 128, 128, 2, 8, 3),
    KernelConfig(128, 128, 64, 6, 8, 3, use_tma=True),
    KernelConfig(16, 64, 128, 1, 4, 5, rows_per_program=53),
    KernelConfig(64, 64, 64, 2, 4, 4, rows_per_program=37),
    KernelConfig(16, 64, 128, 1, 4, 5, pdl=True),
    KernelConfig(64, 64, 128, 2, 4, 4, use_tma=True, pdl=True),
)


def relerr(out: torch.Tensor, x: torch.Tensor, w: torch.Tensor) -> float:
    ref = x.double() @ w.double().t()
    diff = out.double() - ref
    if not torch.isfinite(diff).all():
        return float("inf")
    return (diff.norm() / ref.norm()).item()


def table_configs(device: torch.device, n: int) -> tuple[KernelConfig, ...]:
    table = load_table(gpu_key(device))
    entry = table.shapes.get((n, K)) if table is not None else None
    return tuple(b.config for b in entry.buckets) if entry is not None else ()


@pytest.mark.parametrize("n", SHAPES)
def test_kernel_matches_fp64(cuda: torch.device, gen: torch.Generator, n: int) -> None:
    triton_gemm = pytest.importorskip("foldckpt.runtime.kernels.triton_gemm")
    w = torch.randn(n, K, device=cuda, generator=gen).bfloat16()
    for cfg in FIXED_CONFIGS + table_configs(cuda, n):
        for m in sorted(set(BENCH_MS + ODD_MS)):
            x = torch.randn(m, K, device=cuda, generator=gen).bfloat16()
            y = torch.full((m, n), float("nan"), device=cuda, dtype=torch.bfloat16)
            triton_gemm.reserve_workspace(cuda, *triton_gemm.workspace_needs(m, n, cfg))
            triton_gemm.launch_fold_gemm(x, w, y, cfg)
            err = relerr(y, x, w)
            assert err < MAX_RELERR, f"N={n} M={m} {cfg}: relerr {err}"


def q_b_proj_configs(device: torch.device, n: int) -> tuple[KernelConfig, ...]:
    table = load_table(gpu_key(device))
    return tuple(b.config for b in table.q_b_proj.get((n, K), ())) if table is not None else ()


@pytest.mark.parametrize("n", Q_B_PROJ_SHAPES)
def test_kernel_at_q_b_proj_shapes_matches_fp64(cuda: torch.device, gen: torch.Generator, n: int) -> None:
    """The tuned q_b_proj configs (quarter-tile row programs, 4 splits) and the fixed ones at the
    q_b_proj shapes, a third of the fold's rows."""
    triton_gemm = pytest.importorskip("foldckpt.runtime.kernels.triton_gemm")
    w = torch.randn(n, K, device=cuda, generator=gen).bfloat16()
    extra = (
        KernelConfig(16, 32, 128, 4, 4, 4, rows_per_program=9),
        KernelConfig(32, 64, 128, 2, 4, 5, rows_per_program=18),
    )
    for cfg in FIXED_CONFIGS + extra + q_b_proj_configs(cuda, n):
        for m in sorted(set(BENCH_MS + ODD_MS)):
            x = torch.randn(m, K, device=cuda, generator=gen).bfloat16()
            y = torch.full((m, n), float("nan"), device=cuda, dtype=torch.bfloat16)
            triton_gemm.reserve_workspace(cuda, *triton_gemm.workspace_needs(m, n, cfg))
            triton_gemm.launch_fold_gemm(x, w, y, cfg)
            err = relerr(y, x, w)
            assert err < MAX_RELERR, f"N={n} M={m} {cfg}: relerr {err}"


@pytest.mark.parametrize("n", Q_B_PROJ_SHAPES + SHAPES[:3])
def test_skinny_kernel_matches_fp64(cuda: torch.device, gen: torch.Generator, n: int) -> None:
    """The skinny kernel (the unfolded baseline's stand-in for vLLM's skinny q_b_proj kernels) at
    every M up to 16, with the table's configs and fixed ones (single rows, PDL, every block_k)."""
    triton_gemm = pytest.importorskip("foldckpt.runtime.kernels.triton_gemm")
    table = load_table(gpu_key(cuda))
    tabled = [c for key, cfgs in (table.skinny.items() if table is not None else ()) if key[1] == n for c in cfgs]
    fixed = [
        SkinnyConfig(1, 1, 512, 2),
        SkinnyConfig(2, 4, 256, 4, pdl=True),
        SkinnyConfig(8, 8, 128, 4),
        SkinnyConfig(16, 2, 256, 8),
    ]
    w = torch.randn(n, K, device=cuda, generator=gen).bfloat16()
    for cfg in fixed + tabled:
        for m in range(1, 17):
            x = torch.randn(m, K + 576, device=cuda, generator=gen).bfloat16()[:, :K]
            y = torch.full((m, n), float("nan"), device=cuda, dtype=torch.bfloat16)
            triton_gemm.launch_skinny_gemm(x, w, y, cfg)
            err = relerr(y, x, w)
            assert err < MAX_RELERR, f"N={n} M={m} {cfg}: relerr {err}"


def test_triton_unfolded_query_matches_fp64(cuda: torch.device, gen: torch.Generator) -> None:
    """The benchmark's and tuner's unfolded baseline with the Triton q_b_proj kernel: vLLM's math."""
    tune = pytest.importorskip("foldckpt.tune.search")
    triton_gemm = pytest.importorskip("foldckpt.runtime.kernels.triton_gemm")
    dims = MlaDims(12)
    qn = dims.heads * (dims.nope + dims.rope)
    w_qb = (torch.randn(qn, K, device=cuda, generator=gen) / K**0.5).bfloat16()
    w_uk = (torch.randn(dims.heads, dims.nope, dims.kv_lora, device=cuda, generator=gen) / dims.nope**0.5).bfloat16()
    table = load_table(gpu_key(cuda))
    for m in (1, 8, 14, 57, 224):
        bucket = q_b_proj_bucket(table, qn, K, m)
        tiled = bucket.config if bucket is not None else KernelConfig(16, 32, 128, 1, 4, 4, rows_per_program=18)
        for cfg in (tiled, SkinnyConfig(16, 4, 256, 4)) if m <= 16 else (tiled,):
            x = torch.randn(m, K, device=cuda, generator=gen).bfloat16()
            q = torch.full((m, qn), float("nan"), device=cuda, dtype=torch.bfloat16)
            if isinstance(cfg, KernelConfig):
                triton_gemm.reserve_workspace(cuda, *triton_gemm.workspace_needs(m, qn, cfg))
            ql_nope, q_pe = tune.triton_unfolded_query(x, w_qb, w_uk, dims, cfg, q)
            ref = reference_query(x, w_qb, w_uk, dims)
            got = torch.cat([ql_nope, q_pe], dim=-1).double()
            err = ((got - ref).norm() / ref.norm()).item()
            assert torch.isfinite(got).all() and err < MAX_RELERR, f"M={m} {cfg}: {err}"


def test_fold_gemm_never_runs_q_b_proj_configs(
    cuda: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """[[q_b_proj]] is the baseline's, not the dispatcher's: a q_b_proj-shaped weight that is no
    measured fold shape goes to torch."""
    table = load_table(gpu_key(cuda))
    if table is None or not table.q_b_proj:
        pytest.skip(f"no q_b_proj entries in the {gpu_key(cuda)} table")
    triton_gemm = pytest.importorskip("foldckpt.runtime.kernels.triton_gemm")
    launches: list[KernelConfig] = []
    real = triton_gemm.launch_fold_gemm
    monkeypatch.setattr(
        triton_gemm,
        "launch_fold_gemm",
        lambda x, w, y, cfg, rope=None, scale=None: (launches.append(cfg), real(x, w, y, cfg, rope, scale=scale)),
    )
    for n, k in table.q_b_proj:
        if (n, k) in table.shapes:
            continue
        w = torch.randn(n, k, device=cuda, generator=gen).bfloat16()
        for m in (1, 16, 100):
            x = torch.randn(m, k, device=cuda, generator=gen).bfloat16()
            assert torch.equal(fold_gemm(x, w), F.linear(x, w))
    assert launches == []


@pytest.mark.parametrize("cfg", [c for c in FIXED_CONFIGS if c.pdl], ids=str)
@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph"])
def test_pdl_reads_the_x_its_predecessor_writes(
    cuda: torch.device, gen: torch.Generator, cfg: KernelConfig, graphed: bool
) -> None:
    """With PDL the kernel is resident before the kernel writing x has finished; the device-side
    wait must still hand it that kernel's x. Each step overwrites the one x buffer with a long
    GEMM right before the fold reads it, so a missing or misplaced wait reads the previous x."""
    triton_gemm = pytest.importorskip("foldckpt.runtime.kernels.triton_gemm")
    n, m, steps = SHAPES[1], cfg.block_m - 3, 12
    w = torch.randn(n, K, device=cuda, generator=gen).bfloat16()
    a = torch.randn(steps, m, 16384, device=cuda, generator=gen).bfloat16() / 128
    b = torch.randn(16384, K, device=cuda, generator=gen).bfloat16()
    x = torch.empty(m, K, device=cuda, dtype=torch.bfloat16)
    ys = torch.full((steps, m, n), float("nan"), device=cuda, dtype=torch.bfloat16)
    triton_gemm.reserve_workspace(cuda, *triton_gemm.workspace_needs(m, n, cfg))

    def run() -> None:
        for i in range(steps):
            torch.matmul(a[i], b, out=x)
            triton_gemm.launch_fold_gemm(x, w, ys[i], cfg)

    run()
    if graphed:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        ys.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    for i in range(steps):
        xi = torch.matmul(a[i], b)
        assert relerr(ys[i], xi, w) < MAX_RELERR, f"step {i}: read another step's x"


def test_split_k_is_deterministic_and_resets_counters(cuda: torch.device, gen: torch.Generator) -> None:
    triton_gemm = pytest.importorskip("foldckpt.runtime.kernels.triton_gemm")
    n, m, cfg = SHAPES[1], 57, KernelConfig(64, 64, 128, 6, 4, 4)
    w = torch.randn(n, K, device=cuda, generator=gen).bfloat16()
    x = torch.randn(m, K, device=cuda, generator=gen).bfloat16()
    triton_gemm.reserve_workspace(cuda, *triton_gemm.workspace_needs(m, n, cfg))
    outs = []
    for _ in range(20):
        y = torch.full((m, n), float("nan"), device=cuda, dtype=torch.bfloat16)
        triton_gemm.launch_fold_gemm(x, w, y, cfg)
        outs.append(y)
    assert all(torch.equal(outs[0], o) for o in outs[1:]), "split-K sum order must not depend on arrival order"
    assert relerr(outs[0], x, w) < MAX_RELERR
    torch.cuda.synchronize()
    assert int(triton_gemm._WORKSPACES[cuda.index or 0].counters.abs().sum()) == 0


@pytest.mark.parametrize("n", SHAPES)
def test_fold_gemm_dispatch_strided_views(cuda: torch.device, gen: torch.Generator, n: int) -> None:
    """fold_gemm on a strided x row view into a strided out view, at every M the benchmark uses."""
    w = torch.randn(n, K, device=cuda, generator=gen).bfloat16()
    warmup_fold_gemm(w, TRITON_MAX_M)
    for m in sorted(set(BENCH_MS + ODD_MS + (512, 2048))):
        # x as vLLM slices q_c out of the fused [q_c | kv_c | k_pe] projection.
        fused = torch.randn(m, K + 576, device=cuda, generator=gen).bfloat16()
        x = fused[:, :K]
        out_buf = torch.full((m, n + 64), float("nan"), device=cuda, dtype=torch.bfloat16)
        out = out_buf[:, 32 : 32 + n]
        got = fold_gemm(x, w, out=out)
        assert got.data_ptr() == out.data_ptr()
        assert relerr(out, x, w) < MAX_RELERR, f"N={n} M={m}"
        assert torch.isnan(out_buf[:, :32]).all() and torch.isnan(out_buf[:, 32 + n :]).all(), "wrote outside out"
        assert relerr(fold_gemm(x, w), x, w) < MAX_RELERR


def test_dispatch_uses_triton_where_the_table_says(
    cuda: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The shipped table's backend per bucket, at both ends of every bucket: the tiled kernel with
    the bucket's config, the skinny kernel with the [[skinny]] fold config of that M, or none."""
    table = load_table(gpu_key(cuda))
    if table is None:
        pytest.skip(f"no tuning table for {gpu_key(cuda)}")
    launches = record_launches(monkeypatch)
    skinny_buckets = 0
    for entry in table.shapes.values():
        w = torch.randn(entry.n, entry.k, device=cuda, generator=gen).bfloat16()
        lo = 0
        for bucket in entry.buckets:
            skinny_buckets += bucket.backend == "skinny"
            for m in sorted({lo + 1, bucket.m_max}):
                launches.clear()
                x = torch.randn(m, entry.k, device=cuda, generator=gen).bfloat16()
                y = fold_gemm(x, w)
                expected = {
                    "triton": [("tiled", bucket.config, False)],
                    "skinny": [("skinny", skinny_config(table, "fold", entry.n, entry.k, m), False)],
                    "torch": [],
                }[bucket.backend]
                assert launches == expected, (entry.n, m, bucket)
                assert relerr(y, x, w) < MAX_RELERR, (entry.n, m, bucket.backend)
            lo = bucket.m_max
    if gpu_key(cuda) == "nvidia_h200":
        assert skinny_buckets > 0, "the H200 table chose the skinny fold somewhere (Kimi-K3 at M=1)"


# Skinny configs for every token tile (single and several rows, every block_k, PDL on and off),
# routed by a synthetic table in the tests below, independent of what the tuner picked.
SKINNY_TILES = (
    SkinnyConfig(1, 4, 512, 1, pdl=True),
    SkinnyConfig(2, 2, 256, 2),
    SkinnyConfig(4, 4, 256, 4, pdl=True),
    SkinnyConfig(8, 2, 128, 2),
    SkinnyConfig(16, 1, 256, 1, pdl=True),
)


@pytest.fixture
def skinny_table(cuda: torch.device, monkeypatch: pytest.MonkeyPatch) -> tuning.GpuTable:
    """This GPU's table replaced by one whose Kimi-K3 fold shapes take the skinny kernel at every
    M <= 16 (SKINNY_TILES) and torch above."""
    tiled = {
        "block_m": 16,
        "block_n": 64,
        "block_k": 128,
        "split_k": 1,
        "num_warps": 4,
        "num_stages": 4,
        "use_tma": False,
        "rows_per_program": 0,
        "pdl": True,
        "rope_epilogue": False,
    }
    doc = {
        "meta": {"gpu": gpu_key(cuda)},
        "shape": [
            {
                "n": n,
                "k": K,
                "fold_max_tokens": 16,
                "bucket": [
                    {"m_max": 16, "backend": "skinny", **tiled},
                    {"m_max": TRITON_MAX_M, "backend": "torch", **tiled},
                ],
            }
            for n in SHAPES[:3]
        ],
        "skinny": [
            {
                "role": "fold",
                "n": n,
                "k": K,
                "m_max": c.block_m,
                "rows": c.rows,
                "block_k": c.block_k,
                "num_warps": c.num_warps,
                "pdl": c.pdl,
            }
            for n in SHAPES[:3]
            for c in SKINNY_TILES
        ],
    }
    table = parse_table(doc, "skinny test table")
    real = tuning.load_table

    def fake(gpu: str) -> tuning.GpuTable | None:
        return table if gpu == gpu_key(cuda) else real(gpu)

    monkeypatch.setattr(tuning, "load_table", fake)
    monkeypatch.setattr(dispatch, "load_table", fake)
    return table


@pytest.mark.parametrize("n", SHAPES[:3])
def test_skinny_fold_gemm_matches_fp64(
    cuda: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, skinny_table: tuning.GpuTable, n: int
) -> None:
    """fold_gemm through the skinny kernel at every M of 1..16 (odd M included), on a strided x row
    view into a strided out view and into a fresh tensor, each launch with its tile's config."""
    launches = record_launches(monkeypatch)
    w = torch.randn(n, K, device=cuda, generator=gen).bfloat16()
    for m in range(1, 17):
        tile = next(c for c in SKINNY_TILES if m <= c.block_m)
        fused = torch.randn(m, K + 576, device=cuda, generator=gen).bfloat16()
        x = fused[:, :K]
        out_buf = torch.full((m, n + 64), float("nan"), device=cuda, dtype=torch.bfloat16)
        out = out_buf[:, 32 : 32 + n]
        launches.clear()
        assert fold_gemm(x, w, out=out).data_ptr() == out.data_ptr()
        y = fold_gemm(x, w)
        assert launches == [("skinny", tile, False)] * 2, (m, launches)
        assert relerr(out, x, w) < MAX_RELERR, f"N={n} M={m} {tile}"
        assert torch.equal(out, y), f"N={n} M={m}: out view and fresh output differ"
        assert torch.isnan(out_buf[:, :32]).all() and torch.isnan(out_buf[:, 32 + n :]).all(), "wrote outside out"
    launches.clear()
    x = torch.randn(17, K, device=cuda, generator=gen).bfloat16()
    assert torch.equal(fold_gemm(x, w), F.linear(x, w)) and launches == [], "M=17 is the torch bucket's"


def test_skinny_fold_gemm_graph_capture_and_replay(
    cuda: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, skinny_table: tuning.GpuTable
) -> None:
    """warmup_fold_gemm compiles every skinny tile; a captured graph replays the skinny launches
    (no torch fallback inside) on new inputs, equal to eager and to fp64."""
    n = SHAPES[1]
    w = torch.randn(n, K, device=cuda, generator=gen).bfloat16()
    ms = (1, 2, 3, 5, 8, 11, 16)
    warmup_fold_gemm(w, 16)
    launches = record_launches(monkeypatch)
    xs = [torch.randn(m, K, device=cuda, generator=gen).bfloat16() for m in ms]
    ys = [torch.empty(m, n, device=cuda, dtype=torch.bfloat16) for m in ms]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, y in zip(xs, ys, strict=True):
            fold_gemm(x, w, out=y)
    assert [kind for kind, *_ in launches] == ["skinny"] * len(ms), launches
    for _ in range(2):
        for x in xs:
            x.copy_(torch.randn(x.shape, device=cuda, generator=gen).bfloat16())
        for y in ys:
            y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for x, y in zip(xs, ys, strict=True):
            assert torch.equal(y, fold_gemm(x, w)), f"replay differs from eager at M={x.shape[0]}"
            assert relerr(y, x, w) < MAX_RELERR


@pytest.mark.parametrize("graphed", [False, True], ids=["eager", "graph"])
def test_skinny_pdl_reads_the_x_its_predecessor_writes(cuda: torch.device, gen: torch.Generator, graphed: bool) -> None:
    """As the tiled kernel's PDL test, for the skinny kernel launched with PDL."""
    triton_gemm = pytest.importorskip("foldckpt.runtime.kernels.triton_gemm")
    cfg = SkinnyConfig(4, 4, 256, 4, pdl=True)
    n, m, steps = SHAPES[1], 3, 12
    w = torch.randn(n, K, device=cuda, generator=gen).bfloat16()
    a = torch.randn(steps, m, 16384, device=cuda, generator=gen).bfloat16() / 128
    b = torch.randn(16384, K, device=cuda, generator=gen).bfloat16()
    x = torch.empty(m, K, device=cuda, dtype=torch.bfloat16)
    ys = torch.full((steps, m, n), float("nan"), device=cuda, dtype=torch.bfloat16)

    def run() -> None:
        for i in range(steps):
            torch.matmul(a[i], b, out=x)
            triton_gemm.launch_skinny_gemm(x, w, ys[i], cfg)

    run()
    if graphed:
        torch.cuda.synchronize()
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph):
            run()
        ys.fill_(float("nan"))
        graph.replay()
    torch.cuda.synchronize()
    for i in range(steps):
        assert relerr(ys[i], torch.matmul(a[i], b), w) < MAX_RELERR, f"step {i}: read another step's x"


def test_fold_query_in_a_skinny_bucket(
    cuda: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch, skinny_table: tuning.GpuTable
) -> None:
    """fold_query where the bucket is skinny: the skinny GEMM, then the standalone RoPE kernel."""
    launches = record_launches(monkeypatch)
    n = SHAPES[1]
    w = torch.randn(n, K, device=cuda, generator=gen).bfloat16()
    for m in (1, 3, 16):
        x = torch.randn(m, K, device=cuda, generator=gen).bfloat16()
        rope, k_ref = rope_case(cuda, gen, m)
        launches.clear()
        y = fold_query(x, w, rope)
        assert [kind for kind, *_ in launches] == ["skinny"], launches
        check_query(y, x, w, rope, k_ref, f"skinny bucket M={m}")


def test_cuda_graph_capture_and_replay(cuda: torch.device, gen: torch.Generator) -> None:
    n = SHAPES[1]
    w = torch.randn(n, K, device=cuda, generator=gen).bfloat16()
    ms = (1, 13, 56, 255, 512)
    warmup_fold_gemm(w, max(ms))
    xs = [torch.randn(m, K, device=cuda, generator=gen).bfloat16() for m in ms]
    ys = [torch.empty(m, n, device=cuda, dtype=torch.bfloat16) for m in ms]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, y in zip(xs, ys, strict=True):
            fold_gemm(x, w, out=y)
    for _ in range(2):
        for x in xs:
            x.copy_(torch.randn(x.shape, device=cuda, generator=gen).bfloat16())
        for y in ys:
            y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for x, y in zip(xs, ys, strict=True):
            assert torch.equal(y, fold_gemm(x, w)), f"replay differs from eager at M={x.shape[0]}"
            assert relerr(y, x, w) < MAX_RELERR


def _dims(n: int, k: int = K) -> MlaDims:
    return MlaDims(n // MlaDims(1).fold_head, q_lora=k)


def test_route_reads_table(cuda: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_FOLD_MAX_TOKENS, raising=False)
    monkeypatch.setenv(AUTOTUNE_ENV, "0")
    table = load_table(gpu_key(cuda))
    # A shape no table measured (another k) is never guessed: with the start-up measurement off, no fold.
    assert fold_route(_dims(SHAPES[1], K + 64), cuda).max_tokens == 0
    if table is None:
        assert fold_route(_dims(SHAPES[1]), cuda).source == "off"
        return
    for (n, k), entry in table.shapes.items():
        route = fold_route(_dims(n, k), cuda)
        assert (route.max_tokens, route.source) == (entry.fold_max_tokens, "table")
    measured = sorted(n for n, k in table.shapes if k == K)
    if len(measured) >= 2:
        lo, hi = measured[0], measured[1]
        between = (lo + hi) // 2 // 576 * 576
        expected = min(table.shapes[(lo, K)].fold_max_tokens, table.shapes[(hi, K)].fold_max_tokens)
        assert fold_route(_dims(between), cuda).max_tokens == expected


def test_route_env_override(cuda: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv(ENV_FOLD_MAX_TOKENS, "37")
    assert fold_route(_dims(SHAPES[1]), cuda).max_tokens == 37
    monkeypatch.setenv(ENV_FOLD_MAX_TOKENS, "0")
    assert fold_route(_dims(SHAPES[1]), cuda).max_tokens == 0


def test_torch_fallback_for_untuned_shape(cuda: torch.device, gen: torch.Generator) -> None:
    """An (N, K) the table never measured runs through torch and is still right."""
    w = torch.randn(1000, 1000, device=cuda, generator=gen).bfloat16()
    x = torch.randn(7, 1000, device=cuda, generator=gen).bfloat16()
    assert torch.equal(fold_gemm(x, w), F.linear(x, w))


# --------------------------------------------------------------------------------------------
# fold_query: the fold GEMM with the decode step's query/key RoPE.
# --------------------------------------------------------------------------------------------
L = MlaDims(1).kv_lora
HEAD = MlaDims(1).fold_head


def rope_case(
    cuda: torch.device, gen: torch.Generator, m: int, cache_dtype: torch.dtype = torch.bfloat16
) -> tuple[QueryRope, torch.Tensor]:
    """A QueryRope as the plugin builds it, and its fp64 key reference."""
    rope = decode_rope(m, MlaDims(1), cuda, gen, cache_dtype)
    return rope, rope_gptj(rope.k_pe.double(), rope.positions, rope.cos_sin_cache)


def check_query(
    y: torch.Tensor, x: torch.Tensor, w: torch.Tensor, rope: QueryRope, k_ref: torch.Tensor, what: str
) -> None:
    """y and rope.k_out against fp64; the rope columns on their own (a few % of y's norm)."""
    m = x.shape[0]
    ref = (x.double() @ w.double().t()).view(m, -1, HEAD)
    ref[..., L:] = rope_gptj(ref[..., L:], rope.positions, rope.cos_sin_cache)
    got = y.view(m, -1, HEAD)
    for part, (a, b) in {"query": (got, ref), "q_pe": (got[..., L:], ref[..., L:]), "k": (rope.k_out, k_ref)}.items():
        err = (a.double() - b).norm() / b.norm()
        assert torch.isfinite(a).all() and err < MAX_RELERR, f"{what}: {part} relerr {err}"


@pytest.mark.parametrize("n", SHAPES)
def test_fused_rope_matches_fp64(cuda: torch.device, gen: torch.Generator, n: int) -> None:
    triton_gemm = pytest.importorskip("foldckpt.runtime.kernels.triton_gemm")
    w = torch.randn(n, K, device=cuda, generator=gen).bfloat16()
    configs = [c for c in FIXED_CONFIGS + table_configs(cuda, n) if triton_gemm.rope_fits(n, c)]
    assert len(configs) >= 6
    for cfg in configs:
        for m in sorted(set(BENCH_MS + ODD_MS)):
            x = torch.randn(m, K, device=cuda, generator=gen).bfloat16()
            rope, k_ref = rope_case(cuda, gen, m)
            y = torch.full((m, n), float("nan"), device=cuda, dtype=torch.bfloat16)
            triton_gemm.reserve_workspace(cuda, *triton_gemm.workspace_needs(m, n, cfg))
            triton_gemm.launch_fold_gemm(x, w, y, cfg, rope)
            check_query(y, x, w, rope, k_ref, f"N={n} M={m} {cfg}")


@pytest.mark.parametrize("cache_dtype", [torch.bfloat16, torch.float32])
def test_fold_query_dispatch_every_m(cuda: torch.device, gen: torch.Generator, cache_dtype: torch.dtype) -> None:
    """The RoPE epilogue where the table chose it, fold_gemm + the standalone RoPE kernel elsewhere."""
    for n in SHAPES:
        w = torch.randn(n, K, device=cuda, generator=gen).bfloat16()
        warmup_fold_gemm(w, 512)
        for m in sorted(set(BENCH_MS + ODD_MS + (512,))):
            x = torch.randn(m, K + 576, device=cuda, generator=gen).bfloat16()[:, :K]
            rope, k_ref = rope_case(cuda, gen, m, cache_dtype)
            y = fold_query(x, w, rope)
            check_query(y, x, w, rope, k_ref, f"N={n} M={m} cache {cache_dtype}")
            # Both implementations agree to bf16 rounding (the epilogue rotates before rounding).
            y2 = fold_gemm(x, w)
            rope_query(y2, QueryRope(rope.positions, rope.cos_sin_cache, rope.k_pe, rope.k_pe.clone(), HEAD))
            assert (y2.double() - y.double()).norm() / y.double().norm() < 4e-3


@pytest.mark.parametrize("m", [1, 2, 8, 28, 56, 160])
def test_fold_query_launches_what_the_table_says(cuda: torch.device, gen: torch.Generator, m: int) -> None:
    """No k_pe copy, no extra kernels: one kernel where the bucket chose the RoPE epilogue, the
    GEMM (whichever backend: tiled, skinny, cuBLAS) and the RoPE kernel elsewhere."""
    table = load_table(gpu_key(cuda))
    if table is None:
        pytest.skip(f"no tuning table for {gpu_key(cuda)}")
    n = SHAPES[1]
    bucket = table.shapes[(n, K)].bucket_for(m)
    fused = bucket.backend == "triton" and bucket.config.rope_epilogue
    w = torch.randn(n, K, device=cuda, generator=gen).bfloat16()
    x = torch.randn(m, K, device=cuda, generator=gen).bfloat16()
    rope, _ = rope_case(cuda, gen, m)
    fold_query(x, w, rope)
    torch.cuda.synchronize()
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CUDA], acc_events=True) as prof:
        fold_query(x, w, rope)
        torch.cuda.synchronize()
    kernels = [e.name for e in prof.events() if e.device_type == torch.autograd.DeviceType.CUDA]
    assert len(kernels) == (1 if fused else 2), kernels
    assert ("fold_gemm" in kernels[0]) == (bucket.backend == "triton"), kernels
    assert ("skinny_gemm" in kernels[0]) == (bucket.backend == "skinny"), kernels
    if not fused:
        assert "rope_query" in kernels[1], kernels


def test_fold_query_graph_capture_and_replay(cuda: torch.device, gen: torch.Generator) -> None:
    n = SHAPES[1]
    w = torch.randn(n, K, device=cuda, generator=gen).bfloat16()
    ms = (1, 13, 56, 160)
    cases = [(torch.randn(m, K, device=cuda, generator=gen).bfloat16(), *rope_case(cuda, gen, m)) for m in ms]
    warmup_fold_gemm(w, max(ms))
    warmup_fold_query(w, max(ms), cases[0][1].cos_sin_cache, HEAD)
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        ys = [fold_query(x, w, rope) for x, rope, _ in cases]
    for y, (_, rope, _) in zip(ys, cases, strict=True):
        y.fill_(float("nan"))
        rope.k_out.fill_(float("nan"))
    graph.replay()
    torch.cuda.synchronize()
    for y, (x, rope, k_ref) in zip(ys, cases, strict=True):
        check_query(y, x, w, rope, k_ref, f"replay M={x.shape[0]}")
