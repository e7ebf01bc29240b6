"""GPU tests of the fp8 fold's Hopper kernel (``cuda_fp8``, ``fp8_fold_sm90.cu``).

Run on an sm_90 machine: ``pytest -m gpu tests/gpu``. Fresh random inputs per case; every output
buffer poisoned with NaN first, so an element the kernel never writes fails; the reference is fp64
of the dequantized weight (what the kernel computes before the one bf16 rounding of y). The cache
cases run the real NVRTC build and the real driver load.
"""

from __future__ import annotations

import logging
from pathlib import Path

import pytest
import torch

from foldckpt.runtime.kernels import cuda_fp8, dispatch, fold_gemm, warmup_fold_gemm
from tests.gpu.kernel_cases import MAX_RELERR, SHAPES, K, fp8_relerr, fp8_weight

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")]

# Every plan: 1, 2 and 4 token tiles, partial tiles, a ring of slots (18432 rows: 9 groups, 8 slots),
# ragged and odd row counts, fewer rows than SMs.
NS = (*SHAPES, 18432, 1001, 7)
MS = (1, 2, 3, 8, 9, 15, 16, 17, 31, 32)


@pytest.fixture
def hopper(cuda: torch.device) -> torch.device:
    if not cuda_fp8.runs_on(cuda):
        pytest.skip("the CUDA fp8 kernel needs an sm_90 GPU with NVRTC")
    return cuda


@pytest.mark.parametrize("conversion", sorted(cuda_fp8.CONVERSIONS))
@pytest.mark.parametrize("n", NS)
def test_every_element_matches_fp64(hopper: torch.device, gen: torch.Generator, n: int, conversion: str) -> None:
    w, scale = fp8_weight(n, hopper, gen)
    for m in MS:
        if cuda_fp8.launch_plan(torch.empty(m, K, device=hopper), w) is None:
            continue
        x = torch.randn(m, K, device=hopper, dtype=torch.bfloat16, generator=gen)
        y = torch.full((m, n), float("nan"), device=hopper, dtype=torch.bfloat16)
        cuda_fp8.launch(x, w, scale, y, conversion=conversion)
        err = fp8_relerr(y, x, w, scale)
        assert err < MAX_RELERR, f"N={n} M={m} {conversion}: relerr {err:.2e}"


def test_strided_views_and_a_new_output(hopper: torch.device, gen: torch.Generator) -> None:
    """x a row view of a wider buffer (as vLLM's q_c is), out a column slice of a wider one."""
    n, m = SHAPES[1], 13
    w, scale = fp8_weight(n, hopper, gen)
    wide_x = torch.randn(m, K + 512, device=hopper, dtype=torch.bfloat16, generator=gen)
    x = wide_x[:, 256 : 256 + K]
    wide_y = torch.full((m, n + 64), float("nan"), device=hopper, dtype=torch.bfloat16)
    y = wide_y[:, 32 : 32 + n]
    assert cuda_fp8.supports(x, w, y, scale)
    cuda_fp8.launch(x, w, scale, y)
    assert fp8_relerr(y, x, w, scale) < MAX_RELERR
    assert torch.isnan(wide_y[:, :32]).all() and torch.isnan(wide_y[:, 32 + n :]).all(), "wrote outside out"
    assert fp8_relerr(cuda_fp8.launch(x, w, scale), x, w, scale) < MAX_RELERR


def test_replays_in_a_cuda_graph_with_pdl_after_the_kernel_that_writes_x(
    hopper: torch.device, gen: torch.Generator
) -> None:
    """Captured after a kernel that produces x: PDL must still wait for it on every replay."""
    n, m = SHAPES[1], 4
    w, scale = fp8_weight(n, hopper, gen)
    src = torch.randn(m, K, device=hopper, dtype=torch.bfloat16, generator=gen)
    x = torch.empty_like(src)
    y = torch.empty(m, n, device=hopper, dtype=torch.bfloat16)
    cuda_fp8.launch(torch.mul(src, 2, out=x), w, scale, y)  # loads the kernel outside the capture
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        torch.mul(src, 2, out=x)
        cuda_fp8.launch(x, w, scale, y)
    for _ in range(3):
        src.copy_(torch.randn(m, K, device=hopper, dtype=torch.bfloat16, generator=gen))
        y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert fp8_relerr(y, src * 2, w, scale) < MAX_RELERR


def test_fold_gemm_runs_it_where_the_table_says_cuda(
    hopper: torch.device, gen: torch.Generator, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Each M of a "cuda" bucket launches the kernel (after warm-up, also under capture); with
    FOLDCKPT_CUDA_KERNELS=0 the bucket's Triton config serves instead, with the same result."""
    from foldckpt.runtime.kernels.tuning import bucket_backend

    gpu = dispatch.gpu_key(hopper)
    cuda_ns = [
        n
        for n in SHAPES
        if any(bucket_backend(gpu, n, K, m, torch.float8_e4m3fn) == "cuda" for m in range(1, cuda_fp8.MAX_M + 1))
    ]
    if not cuda_ns:
        pytest.skip(f"no [[fp8_shape]] bucket of {gpu} chose the CUDA kernel")
    n = cuda_ns[0]
    w, scale = fp8_weight(n, hopper, gen)
    launched: list[int] = []
    real = cuda_fp8.launch
    monkeypatch.setattr(cuda_fp8, "launch", lambda x, *a, **kw: launched.append(x.shape[0]) or real(x, *a, **kw))
    warmup_fold_gemm(w, cuda_fp8.MAX_M, scale=scale)
    ms = [m for m in range(1, cuda_fp8.MAX_M + 1) if bucket_backend(gpu, n, K, m, torch.float8_e4m3fn) == "cuda"]
    launched.clear()
    for m in ms:
        x = torch.randn(m, K, device=hopper, dtype=torch.bfloat16, generator=gen)
        assert fp8_relerr(fold_gemm(x, w, scale=scale), x, w, scale) < MAX_RELERR
    assert launched == ms
    monkeypatch.setenv(dispatch.CUDA_KERNELS_ENV, "0")
    dispatch._cuda_fp8_module.cache_clear()
    try:
        launched.clear()
        x = torch.randn(ms[0], K, device=hopper, dtype=torch.bfloat16, generator=gen)
        assert fp8_relerr(fold_gemm(x, w, scale=scale), x, w, scale) < MAX_RELERR
        assert launched == []
    finally:
        monkeypatch.delenv(dispatch.CUDA_KERNELS_ENV)
        dispatch._cuda_fp8_module.cache_clear()


def test_a_corrupt_cache_entry_is_rebuilt_and_never_loaded(
    hopper: torch.device, gen: torch.Generator, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, caplog
) -> None:
    """A cache entry whose cubin bytes changed (same length, a flipped byte) is refused by its
    sha256, rebuilt with NVRTC, rewritten, and the kernel it loads computes the right product."""
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    variant = (1, 3)
    key = cuda_fp8._cache_key(variant, cuda_fp8.CONVERSION, torch.cuda.get_device_capability(hopper))
    path = cuda_fp8.cubin_cache_path(key)
    good = cuda_fp8.cached_cubin(variant, cuda_fp8.CONVERSION, torch.cuda.get_device_capability(hopper))
    raw = bytearray(path.read_bytes())
    raw[-100] ^= 0xFF
    path.write_bytes(bytes(raw))
    with caplog.at_level(logging.WARNING):
        again = cuda_fp8.cached_cubin(variant, cuda_fp8.CONVERSION, torch.cuda.get_device_capability(hopper))
    assert again == good and "does not match its sha256" in caplog.text
    assert path.read_bytes() != bytes(raw), "the corrupt entry was not replaced"
    # The rebuilt kernel, freshly loaded (no process-wide function yet for this plan), is right.
    monkeypatch.setattr(cuda_fp8, "_FUNCTIONS", {})
    n, m = torch.cuda.get_device_properties(hopper).multi_processor_count * 40, 5  # 40 rows per CTA: 3 groups
    w, scale = fp8_weight(n, hopper, gen)
    x = torch.randn(m, K, device=hopper, dtype=torch.bfloat16, generator=gen)
    assert cuda_fp8.launch_plan(x, w).variant == variant
    assert fp8_relerr(cuda_fp8.launch(x, w, scale), x, w, scale) < MAX_RELERR
