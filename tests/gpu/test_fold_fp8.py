"""GPU tests of the fp8 fold GEMM: e4m3 weight + fp32 scale per row, bf16 activations (weight-only).

Run on a CUDA machine: ``pytest -m gpu tests/gpu``. The reference is fp64 of the dequantized weight
(``weight.double() * scale``) against ``x.double()``: what the kernels compute before the one bf16
rounding of y. Every output buffer is poisoned with NaN first.
"""

from __future__ import annotations

import pytest
import torch

from foldckpt.fold import quantize_fp8_rows
from foldckpt.runtime.kernels import (
    dispatch,
    fold_gemm,
    fold_query,
    fold_route,
    gpu_key,
    warmup_fold_gemm,
    warmup_fold_query,
)
from foldckpt.runtime.kernels.reference import MlaDims, decode_rope
from foldckpt.runtime.kernels.rope import rope_gptj
from foldckpt.runtime.kernels.routing import ENV_FOLD_MAX_TOKENS
from foldckpt.runtime.kernels.tuning import (
    FP8_UNTUNED_CONFIGS,
    FP8_WEIGHT_DTYPE,
    TRITON_MAX_M,
    KernelConfig,
    SkinnyConfig,
    load_table,
    skinny_config,
)
from tests.gpu.kernel_cases import MAX_RELERR, SHAPES, K, fp8_relerr, fp8_weight, record_launches

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# A ragged fold shape (no tile divides it), beside the shared ones.
RAGGED_N = 1000
MS = (1, 2, 3, 4, 7, 8, 13, 14, 16, 28, 56, 57, 112, 129, 224, 255)
# Every path of the fp8 kernel: mma.sync and wgmma tiles, fp16 and bf16 MMA, split-K (2, 3, 4),
# TMA, ragged row ownership, the whole K in flight, several M tiles, PDL.
FIXED_CONFIGS = (
    KernelConfig(16, 32, 256, 1, 4, 5),
    KernelConfig(16, 64, 256, 1, 4, 7),
    KernelConfig(16, 64, 256, 1, 4, 7, mma_f16=True),
    KernelConfig(16, 64, 512, 3, 4, 2, rows_per_program=53),
    KernelConfig(16, 128, 128, 4, 4, 4, use_tma=True),
    KernelConfig(16, 64, 256, 2, 4, 4, use_tma=True, pdl=True, mma_f16=True),
    KernelConfig(32, 64, 256, 2, 4, 4, rows_per_program=37, pdl=True),
    KernelConfig(64, 128, 128, 1, 8, 3),
    KernelConfig(64, 64, 128, 2, 4, 3, mma_f16=True),
    KernelConfig(128, 128, 128, 1, 8, 2, use_tma=True),
) + tuple(cfg for _, cfg in FP8_UNTUNED_CONFIGS)
FIXED_SKINNY = (
    SkinnyConfig(1, 1, 512, 1),
    SkinnyConfig(2, 4, 256, 2, pdl=True),
    SkinnyConfig(4, 8, 512, 4),
    SkinnyConfig(16, 2, 256, 1),
)


def table_fp8_configs(device: torch.device, n: int) -> tuple[KernelConfig, ...]:
    table = load_table(gpu_key(device))
    entry = table.fp8_shapes.get((n, K)) if table is not None else None
    return tuple(b.config for b in entry.buckets) if entry is not None else ()


@pytest.mark.parametrize("n", SHAPES + (RAGGED_N,))
def test_fp8_kernel_matches_fp64(cuda: torch.device, gen: torch.Generator, n: int) -> None:
    triton_gemm = pytest.importorskip("foldckpt.runtime.kernels.triton_gemm")
    w, scale = fp8_weight(n, cuda, gen)
    for cfg in FIXED_CONFIGS + table_fp8_configs(cuda, n):
        for m in MS:
            x = torch.randn(m, K, device=cuda, generator=gen).bfloat16()
            y = torch.full((m, n), float("nan"), device=cuda, dtype=torch.bfloat16)
            triton_gemm.reserve_workspace(cuda, *triton_gemm.workspace_needs(m, n, cfg))
            triton_gemm.launch_fold_gemm(x, w, y, cfg, scale=scale)
            err = fp8_relerr(y, x, w, scale)
            assert err < MAX_RELERR, f"N={n} M={m} {cfg}: relerr {err}"


@pytest.mark.parametrize("n", SHAPES[:3] + (RAGGED_N,))
def test_fp8_skinny_kernel_matches_fp64(cuda: torch.device, gen: torch.Generator, n: int) -> None:
    triton_gemm = pytest.importorskip("foldckpt.runtime.kernels.triton_gemm")
    table = load_table(gpu_key(cuda))
    tabled = list(table.skinny.get(("fold_fp8", n, K), ())) if table is not None else []
    w, scale = fp8_weight(n, cuda, gen)
    for cfg in FIXED_SKINNY + tuple(tabled):
        for m in range(1, 17):
            x = torch.randn(m, K + 576, device=cuda, generator=gen).bfloat16()[:, :K]
            y = torch.full((m, n), float("nan"), device=cuda, dtype=torch.bfloat16)
            triton_gemm.launch_skinny_gemm(x, w, y, cfg, scale=scale)
            err = fp8_relerr(y, x, w, scale)
            assert err < MAX_RELERR, f"N={n} M={m} {cfg}: relerr {err}"


def test_fp8_split_k_is_deterministic_and_resets_counters(cuda: torch.device, gen: torch.Generator) -> None:
    triton_gemm = pytest.importorskip("foldckpt.runtime.kernels.triton_gemm")
    n, m, cfg = SHAPES[1], 57, KernelConfig(64, 64, 128, 4, 4, 3)
    w, scale = fp8_weight(n, cuda, gen)
    x = torch.randn(m, K, device=cuda, generator=gen).bfloat16()
    triton_gemm.reserve_workspace(cuda, *triton_gemm.workspace_needs(m, n, cfg))
    outs = []
    for _ in range(20):
        y = torch.full((m, n), float("nan"), device=cuda, dtype=torch.bfloat16)
        triton_gemm.launch_fold_gemm(x, w, y, cfg, scale=scale)
        outs.append(y)
    assert all(torch.equal(outs[0], o) for o in outs[1:])
    assert fp8_relerr(outs[0], x, w, scale) < MAX_RELERR
    torch.cuda.synchronize()
    assert int(triton_gemm._WORKSPACES[cuda.index or 0].counters.abs().sum()) == 0


@pytest.mark.parametrize("n", SHAPES + (RAGGED_N,))
def test_fp8_fold_gemm_dispatch_every_m(cuda: torch.device, gen: torch.Generator, n: int) -> None:
    """fold_gemm with an fp8 weight on a strided x view into a strided out view, at every M the
    benchmark uses and odd ones (the torch fallback above 256), never writing outside out."""
    w, scale = fp8_weight(n, cuda, gen)
    warmup_fold_gemm(w, TRITON_MAX_M, scale=scale)
    for m in sorted(set(MS + (512, 1024))):
        x = torch.randn(m, K + 576, device=cuda, generator=gen).bfloat16()[:, :K]
        out_buf = torch.full((m, n + 64), float("nan"), device=cuda, dtype=torch.bfloat16)
        out = out_buf[:, 32 : 32 + n]
        got = fold_gemm(x, w, out=out, scale=scale)
        assert got.data_ptr() == out.data_ptr()
        assert fp8_relerr(out, x, w, scale) < MAX_RELERR, f"N={n} M={m}"
        assert torch.isnan(out_buf[:, :32]).all() and torch.isnan(out_buf[:, 32 + n :]).all(), "wrote outside out"
        assert fp8_relerr(fold_gemm(x, w, scale=scale), x, w, scale) < MAX_RELERR


def test_fp8_dispatch_follows_the_table(
    cuda: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each [[fp8_shape]] bucket's backend at both of its ends; an fp8 shape the table never
    measured takes FP8_UNTUNED_CONFIGS; every launch gets the scale."""
    launches = record_launches(monkeypatch)
    table = load_table(gpu_key(cuda))
    entries = list(table.fp8_shapes.values()) if table is not None else []
    for entry in entries:
        w, scale = fp8_weight(entry.n, cuda, gen)
        lo = 0
        for bucket in entry.buckets:
            for m in sorted({lo + 1, bucket.m_max}):
                launches.clear()
                x = torch.randn(m, entry.k, device=cuda, generator=gen).bfloat16()
                y = fold_gemm(x, w, scale=scale)
                expected = {
                    "triton": [("tiled", bucket.config, True)],
                    "skinny": [("skinny", skinny_config(table, "fold_fp8", entry.n, entry.k, m), True)],
                    "torch": [],
                }[bucket.backend]
                assert launches == expected, f"N={entry.n} M={m}"
                assert fp8_relerr(y, x, w, scale) < MAX_RELERR
            lo = bucket.m_max
    w, scale = fp8_weight(RAGGED_N, cuda, gen)
    lo = 0
    for m_max, cfg in FP8_UNTUNED_CONFIGS:
        for m in sorted({lo + 1, m_max}):
            launches.clear()
            x = torch.randn(m, K, device=cuda, generator=gen).bfloat16()
            assert fp8_relerr(fold_gemm(x, w, scale=scale), x, w, scale) < MAX_RELERR
            assert launches == [("tiled", cfg, True)], f"untuned N={RAGGED_N} M={m}"
        lo = m_max


def test_fp8_torch_fallback(cuda: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch) -> None:
    """Without Triton, above TRITON_MAX_M, or at a shape no kernel takes (n % 8 != 0, k no block
    divides): the fp32 formula ``(x·Wᵀ)·scale`` rounded once, bit for bit."""

    def formula(x: torch.Tensor, w: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
        return (x.float() @ w.float().t() * scale).to(x.dtype)

    w, scale = fp8_weight(SHAPES[1], cuda, gen)
    x = torch.randn(TRITON_MAX_M + 1, K, device=cuda, generator=gen).bfloat16()
    assert torch.equal(fold_gemm(x, w, scale=scale), formula(x, w, scale))
    odd_w, odd_scale = quantize_fp8_rows(torch.randn(1001, 1000, device=cuda, generator=gen))
    x_odd = torch.randn(5, 1000, device=cuda, generator=gen).bfloat16()
    assert torch.equal(fold_gemm(x_odd, odd_w, scale=odd_scale), formula(x_odd, odd_w, odd_scale))
    monkeypatch.setattr(dispatch, "_triton_module", lambda: None)
    x = torch.randn(7, K, device=cuda, generator=gen).bfloat16()
    assert torch.equal(fold_gemm(x, w, scale=scale), formula(x, w, scale))
    out = torch.full((7, SHAPES[1]), float("nan"), device=cuda, dtype=torch.bfloat16)
    fold_gemm(x, w, out=out, scale=scale)
    assert torch.equal(out, formula(x, w, scale))


def test_fp8_scale_is_required_and_checked(cuda: torch.device, gen: torch.Generator) -> None:
    w, scale = fp8_weight(SHAPES[0], cuda, gen)
    x = torch.randn(3, K, device=cuda, generator=gen).bfloat16()
    with pytest.raises(ValueError, match="needs its fp32 scale"):
        fold_gemm(x, w)
    with pytest.raises(ValueError, match="takes no scale"):
        fold_gemm(x, w.bfloat16(), scale=scale)
    for bad in (scale.double(), scale[:-1], scale.cpu()):
        with pytest.raises(ValueError, match="is not fp32"):
            fold_gemm(x, w, scale=bad)


def test_fp8_cuda_graph_capture_and_replay(cuda: torch.device, gen: torch.Generator) -> None:
    n = SHAPES[1]
    w, scale = fp8_weight(n, cuda, gen)
    ms = (1, 2, 13, 56, 255)
    warmup_fold_gemm(w, max(ms), scale=scale)
    xs = [torch.randn(m, K, device=cuda, generator=gen).bfloat16() for m in ms]
    ys = [torch.empty(m, n, device=cuda, dtype=torch.bfloat16) for m in ms]
    torch.cuda.synchronize()
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        for x, y in zip(xs, ys, strict=True):
            fold_gemm(x, w, out=y, scale=scale)
    for _ in range(2):
        for x in xs:
            x.copy_(torch.randn(x.shape, device=cuda, generator=gen).bfloat16())
        for y in ys:
            y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        for x, y in zip(xs, ys, strict=True):
            assert torch.equal(y, fold_gemm(x, w, scale=scale)), f"replay differs from eager at M={x.shape[0]}"
            assert fp8_relerr(y, x, w, scale) < MAX_RELERR


@pytest.mark.parametrize("n", SHAPES)
def test_fp8_fold_query_matches_fp64(cuda: torch.device, gen: torch.Generator, n: int) -> None:
    """fold_query with the fp8 weight: rows scaled, then the rope rows rotated; the key too."""
    dims = MlaDims(1)
    head = dims.fold_head
    w, scale = fp8_weight(n, cuda, gen)
    warmup_fold_gemm(w, 256, scale=scale)
    for m in (1, 2, 8, 13, 56, 160):
        x = torch.randn(m, K, device=cuda, generator=gen).bfloat16()
        rope = decode_rope(m, dims, cuda, gen)
        if m == 1:
            warmup_fold_query(w, 256, rope.cos_sin_cache, head, scale=scale)
        y = fold_query(x, w, rope, scale)
        ref = (x.double() @ (w.double() * scale.double()[:, None]).t()).view(m, -1, head)
        ref[..., dims.kv_lora :] = rope_gptj(ref[..., dims.kv_lora :], rope.positions, rope.cos_sin_cache)
        k_ref = rope_gptj(rope.k_pe.double(), rope.positions, rope.cos_sin_cache)
        got = y.view(m, -1, head)
        parts = {
            "query": (got, ref),
            "q_pe": (got[..., dims.kv_lora :], ref[..., dims.kv_lora :]),
            "k": (rope.k_out, k_ref),
        }
        for part, (a, b) in parts.items():
            err = (a.double() - b).norm() / b.norm()
            assert torch.isfinite(a).all() and err < MAX_RELERR, f"N={n} M={m}: {part} relerr {err}"


def test_fp8_pdl_reads_the_x_its_predecessor_writes(cuda: torch.device, gen: torch.Generator) -> None:
    """As the bf16 PDL test: a long GEMM writes x right before each fp8 fold reads it."""
    triton_gemm = pytest.importorskip("foldckpt.runtime.kernels.triton_gemm")
    if torch.cuda.get_device_capability(cuda) < (9, 0):
        pytest.skip("PDL needs sm_90+")
    n, steps = SHAPES[1], 8
    w, scale = fp8_weight(n, cuda, gen)
    for cfg in (KernelConfig(16, 64, 256, 1, 4, 7, pdl=True), KernelConfig(16, 64, 256, 2, 4, 4, pdl=True)):
        m = 13
        a = torch.randn(steps, m, 16384, device=cuda, generator=gen).bfloat16() / 128
        b = torch.randn(16384, K, device=cuda, generator=gen).bfloat16()
        x = torch.empty(m, K, device=cuda, dtype=torch.bfloat16)
        ys = torch.full((steps, m, n), float("nan"), device=cuda, dtype=torch.bfloat16)
        triton_gemm.reserve_workspace(cuda, *triton_gemm.workspace_needs(m, n, cfg))
        for i in range(steps):
            torch.matmul(a[i], b, out=x)
            triton_gemm.launch_fold_gemm(x, w, ys[i], cfg, scale=scale)
        torch.cuda.synchronize()
        for i in range(steps):
            assert fp8_relerr(ys[i], torch.matmul(a[i], b), w, scale) < MAX_RELERR, f"{cfg} step {i}"


def test_fp8_route_max_tokens_reads_its_own_entries(cuda: torch.device, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_FOLD_MAX_TOKENS, raising=False)
    table = load_table(gpu_key(cuda))
    if table is None or not table.fp8_shapes:
        pytest.skip(f"no [[fp8_shape]] entries in the {gpu_key(cuda)} table")

    def dims(n: int, k: int) -> MlaDims:
        return MlaDims(n // MlaDims(1).fold_head, q_lora=k)

    for (n, k), entry in table.fp8_shapes.items():
        assert fold_route(dims(n, k), cuda, FP8_WEIGHT_DTYPE).max_tokens == entry.fold_max_tokens
    for (n, k), entry in table.shapes.items():
        assert fold_route(dims(n, k), cuda).max_tokens == entry.fold_max_tokens
        assert fold_route(dims(n, k), cuda, torch.bfloat16).max_tokens == entry.fold_max_tokens
