"""Filling each layer's ``q_fold`` from the sidecars, inside vLLM's weight post-processing.

Why here: vLLM's loaders only stream files listed in the checkpoint index, and the sidecars are
deliberately unlisted (so stock vLLM ignores them). The ``q_fold`` projection therefore gets a
quant method of its own, :class:`SidecarFoldMethod`: vLLM calls ``process_weights_after_loading``
on every linear layer once the checkpoint is in, and ours first copies this rank's rows of the fold
(read and sha256-checked by :mod:`foldckpt.runtime.loader`) into the weight, then hands over to the
stock unquantized post-processing (which repacks the weight on CPU, re-strides it on ROCm). So the
fold is filled exactly when and where a normal checkpoint tensor would be, on every platform.

:class:`FoldBuild` counts the folded layers of one model build in this process and logs the one
line that says what the plugin did once the last of them is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import torch
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import UnquantizedLinearMethod

from foldckpt.errors import FoldckptError
from foldckpt.geometry import MLALayer
from foldckpt.runtime import stats
from foldckpt.runtime.kernels import fold_route_max_tokens, warmup_fold_gemm
from foldckpt.runtime.loader import FoldSet

# Under "vllm." so that vLLM's log handler and VLLM_LOGGING_LEVEL apply.
logger = init_logger("vllm.foldckpt")


@dataclass
class FoldBuild:
    """The folded layers of one model build in this process."""

    fold_set: FoldSet
    vllm_config: object
    built: int = 0
    loaded: int = 0

    def layer_loaded(self, max_tokens: int, dtype: torch.dtype, rope_by_fold_query: bool) -> None:
        self.loaded += 1
        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        recorder = stats.open_worker_stats(tp_rank, tp_size)
        if recorder is not None:
            recorder.set_layers_with_fold(self.loaded)
        if self.loaded == self.built:
            logger.info(
                "foldckpt: folded %d MLA layers of %s (fold %s, computed in %s); decode batches of "
                "at most %d tokens use q_fold (%s), larger ones and all prefill rows use q_b_proj "
                "(tp rank %d of %d)",
                self.loaded, self.fold_set.model_dir, self.fold_set.manifest.fold_dtype,
                str(dtype).removeprefix("torch."), max_tokens,
                "q/k RoPE by fold_query" if rope_by_fold_query else "q/k RoPE by vLLM's rotary module",
                tp_rank, tp_size,
            )  # fmt: skip


class SidecarFoldMethod(UnquantizedLinearMethod):
    """Unquantized linear whose weight comes from the fold sidecar instead of the checkpoint.

    ``on_loaded(max_tokens)`` tells the owning layer its decode routing threshold once the
    weight is in place; it answers whether fold_query does that layer's decode RoPE.
    """

    def __init__(
        self, fold_set: FoldSet, layer: MLALayer, build: FoldBuild, on_loaded: Callable[[int], bool]
    ) -> None:
        super().__init__()
        self.fold_set = fold_set
        self.mla_layer = layer
        self.build = build
        self.on_loaded = on_loaded

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight = layer.weight
        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        rows = self.fold_set.read_rows(self.mla_layer, tp_size, tp_rank)
        if rows.shape != weight.shape:
            raise FoldckptError(
                f"{self.fold_set.model_dir}: the fold of layer '{self.mla_layer.prefix}' has "
                f"{list(rows.shape)} rows for tp rank {tp_rank} of {tp_size}, vLLM's q_fold expects "
                f"{list(weight.shape)}"
            )
        with torch.no_grad():
            weight.copy_(rows)
        (n, k), dtype, device = weight.shape, weight.dtype, weight.device
        max_tokens = fold_route_max_tokens(n, k, device)
        super().process_weights_after_loading(layer)
        if device.type == "cuda":
            warmup_fold_gemm(layer.weight, max_tokens)
        rope_by_fold_query = self.on_loaded(max_tokens)
        self.build.layer_loaded(max_tokens, dtype, rope_by_fold_query)
