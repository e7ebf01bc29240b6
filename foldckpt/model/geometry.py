"""MLA geometry and tensor naming, read from a checkpoint's ``config.json``.

Everything downstream (planning, folding, verification, the vLLM plugin) asks this module which
layers are MLA, what their tensors are called and what shapes they must have. Dimensions always
come from the config; the planner then cross-checks them against the tensor headers before any
data is read, so a config that lies about the checkpoint is caught up front.

Families:

* ``deepseek``: ``DeepseekV2ForCausalLM`` / ``DeepseekV3ForCausalLM`` (DeepSeek-V2/V3, Kimi-K2),
  tensors ``model.layers.{i}``, every layer MLA, MTP layers follow the main layers.
* ``kimi_k25``: ``KimiK25ForConditionalGeneration``, a DeepSeek-V3 text model under
  ``language_model.``.
* ``kimi_k3``: ``KimiK3ForConditionalGeneration``, a Kimi-Linear text model under
  ``language_model.``; MLA layers are those NOT listed in ``linear_attn_config.kda_layers``
  (1-indexed), the others are KDA (linear attention) and have no fold.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass, fields
from pathlib import Path
from typing import Any

from foldckpt.defaults import TP_CANDIDATES
from foldckpt.errors import FoldckptError
from foldckpt.io.files import read_json_file

CONFIG_NAME = "config.json"
_MAX_CONFIG_BYTES = 16 * 1024 * 1024
# More layers than any MLA model has (DeepSeek-V3: 61 + 1 MTP): a larger count in config.json is a
# damaged file, refused before anything is built per layer.
MAX_LAYERS = 10_000


@dataclass(frozen=True)
class MLALayer:
    """One MLA layer of the source checkpoint, named exactly as its tensors are."""

    index: int
    prefix: str
    is_mtp: bool = False

    @property
    def q_b_proj(self) -> str:
        return f"{self.prefix}.self_attn.q_b_proj.weight"

    @property
    def kv_b_proj(self) -> str:
        return f"{self.prefix}.self_attn.kv_b_proj.weight"

    @property
    def q_fold(self) -> str:
        return f"{self.prefix}.self_attn.q_fold.weight"

    @property
    def q_fold_scale(self) -> str:
        """The fp32 per-row scale of an fp8 fold, beside it (vLLM's fp8 linear names it so too)."""
        return f"{self.prefix}.self_attn.q_fold.weight_scale"


def describe_layers(layers: Iterable[MLALayer]) -> str:
    """Config layer indices as users read them in logs and summaries: ``3, 7, 93 (mtp)``."""
    return ", ".join(f"{layer.index}{' (mtp)' if layer.is_mtp else ''}" for layer in layers)


@dataclass(frozen=True)
class Geometry:
    """The MLA dimensions of a model and the list of layers that get a fold.

    Notation used throughout the project: H heads, Lq q_lora_rank, L kv_lora_rank,
    P qk_nope_head_dim, R qk_rope_head_dim, V v_head_dim.
    """

    family: str
    architecture: str
    num_heads: int
    q_lora_rank: int
    kv_lora_rank: int
    qk_nope_head_dim: int
    qk_rope_head_dim: int
    v_head_dim: int
    layers: tuple[MLALayer, ...]
    uses_rope: bool = True
    quant_method: str | None = None
    weight_block_size: tuple[int, int] | None = None

    @property
    def fold_head_dim(self) -> int:
        """Rows per head of the fold: L rows of W_UKᵀ·W_qb_nope, then R rows of W_qb_pe."""
        return self.kv_lora_rank + self.qk_rope_head_dim

    @property
    def fold_shape(self) -> tuple[int, int]:
        return (self.num_heads * self.fold_head_dim, self.q_lora_rank)

    @property
    def q_b_proj_shape(self) -> tuple[int, int]:
        return (self.num_heads * (self.qk_nope_head_dim + self.qk_rope_head_dim), self.q_lora_rank)

    @property
    def kv_b_proj_shape(self) -> tuple[int, int]:
        return (self.num_heads * (self.qk_nope_head_dim + self.v_head_dim), self.kv_lora_rank)

    def splits_heads(self, tp: int) -> bool:
        """The one TP rule: a tensor-parallel size serves (and verifies) when it divides the heads."""
        return not isinstance(tp, bool) and isinstance(tp, int) and tp > 0 and self.num_heads % tp == 0

    def tp_sizes(self) -> tuple[int, ...]:
        """Every tensor-parallel size that serves this model (each divisor of the heads)."""
        return tuple(tp for tp in range(1, self.num_heads + 1) if self.splits_heads(tp))

    def valid_tp_sizes(self, candidates: tuple[int, ...] = TP_CANDIDATES) -> tuple[int, ...]:
        """The candidate tensor-parallel sizes whose head split is exact."""
        return tuple(tp for tp in candidates if self.splits_heads(tp))

    def rank_heads(self, tp: int, rank: int) -> tuple[int, int]:
        """Head range ``[first, stop)`` that vLLM rank ``rank`` of ``tp`` owns."""
        if not self.splits_heads(tp):
            raise FoldckptError(f"tensor-parallel size {tp} does not divide the {self.num_heads} attention heads")
        if not 0 <= rank < tp:
            raise FoldckptError(f"rank {rank} is outside tensor-parallel size {tp}")
        heads = self.num_heads // tp
        return rank * heads, (rank + 1) * heads

    def rank_rows(self, tp: int, rank: int) -> tuple[int, int]:
        """Row range ``[start, stop)`` of the fold that vLLM rank ``rank`` of ``tp`` loads."""
        first, stop = self.rank_heads(tp, rank)
        return first * self.fold_head_dim, stop * self.fold_head_dim

    def differences(self, other: Geometry) -> list[str]:
        """What differs between two geometries, field by field (empty exactly when they are equal:
        the one definition of "same geometry" that verify and the serving loader both use)."""
        diffs = []
        for item in fields(self):
            mine, theirs = getattr(self, item.name), getattr(other, item.name)
            if mine == theirs:
                continue
            if item.name == "layers":
                diffs.append(f"MLA layers: manifest {describe_layers(mine)}, config {describe_layers(theirs)}")
            else:
                diffs.append(f"{item.name}: manifest {mine!r}, config {theirs!r}")
        return diffs

    def to_dict(self) -> dict[str, Any]:
        return {
            "family": self.family,
            "architecture": self.architecture,
            "num_heads": self.num_heads,
            "q_lora_rank": self.q_lora_rank,
            "kv_lora_rank": self.kv_lora_rank,
            "qk_nope_head_dim": self.qk_nope_head_dim,
            "qk_rope_head_dim": self.qk_rope_head_dim,
            "v_head_dim": self.v_head_dim,
            "uses_rope": self.uses_rope,
            "quant_method": self.quant_method,
            "weight_block_size": list(self.weight_block_size) if self.weight_block_size else None,
            "layers": [{"index": layer.index, "prefix": layer.prefix, "is_mtp": layer.is_mtp} for layer in self.layers],
        }


_DEEPSEEK_ARCHITECTURES = ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM")
_KIMI_K25_ARCHITECTURES = ("KimiK25ForConditionalGeneration",)
_KIMI_K3_ARCHITECTURES = ("KimiK3ForConditionalGeneration",)
SUPPORTED_ARCHITECTURES = _DEEPSEEK_ARCHITECTURES + _KIMI_K25_ARCHITECTURES + _KIMI_K3_ARCHITECTURES


def _config_error(where: str, detail: str, section: str | None = None) -> FoldckptError:
    """An error about the config file ``where`` (in its ``section`` object, if any): the message
    reads ``<where> (<section>): <detail>``; ``path`` is the file, and ``detail`` names the section."""
    if section is None:
        return FoldckptError.at(where, detail)
    return FoldckptError(f"{where} ({section}): {detail}", path=where, detail=f"{section}: {detail}")


def _require_int(config: dict[str, Any], key: str, where: str, section: str | None = None) -> int:
    value = config.get(key)
    if not _positive_int(value):
        raise _config_error(where, f"'{key}' must be a positive integer, got {value!r}", section)
    return value


def _quantization(
    config: dict[str, Any], outer: dict[str, Any], where: str, section: str | None
) -> tuple[str | None, tuple[int, int] | None]:
    """The checkpoint-wide quantization method and fp8 block size, if any. A block size that is
    given must be two positive integers: a wrong one would dequantize every fp8 weight wrongly."""
    quant = config.get("quantization_config")
    if not quant and config is not outer:
        quant, section = outer.get("quantization_config"), None
    if not isinstance(quant, dict):
        return None, None
    method = quant.get("quant_method")
    block = quant.get("weight_block_size")
    if block is None:
        return method, None
    if not (isinstance(block, list) and len(block) == 2 and all(_positive_int(b) for b in block)):
        raise _config_error(
            where, f"'quantization_config.weight_block_size' must be two positive integers, got {block!r}", section
        )
    return method, (block[0], block[1])


def _positive_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool) and value > 0


def _kimi_k3_mla_indices(text: dict[str, Any], num_layers: int, where: str, section: str | None) -> list[int]:
    linear = text.get("linear_attn_config")
    if not isinstance(linear, dict) or not isinstance(linear.get("kda_layers"), list):
        raise _config_error(where, "Kimi-K3 text_config needs linear_attn_config.kda_layers", section)
    kda = linear["kda_layers"]
    if not all(isinstance(i, int) and 1 <= i <= num_layers for i in kda):
        raise _config_error(
            where, f"linear_attn_config.kda_layers must hold 1-based layer numbers in 1..{num_layers}", section
        )
    kda_set = set(kda)
    return [i for i in range(num_layers) if (i + 1) not in kda_set]


def geometry_from_config(config: dict[str, Any], where: str = CONFIG_NAME) -> Geometry:
    """Build the geometry of a supported MLA model from its parsed ``config.json``.

    ``where`` names the file in error messages, and is the ``path`` of every error raised.
    """
    if not isinstance(config, dict):
        raise _config_error(where, "expected a JSON object")
    architectures = config.get("architectures") or []
    architecture = next((a for a in architectures if a in SUPPORTED_ARCHITECTURES), None)
    if architecture is None:
        raise _config_error(
            where,
            f"unsupported architecture {architectures!r}; foldckpt folds {', '.join(SUPPORTED_ARCHITECTURES)}",
        )
    section: str | None = None  # the object of config.json that holds the text model's fields
    if architecture in _DEEPSEEK_ARCHITECTURES:
        family, text, prefix = "deepseek", config, "model.layers"
    else:
        text = config.get("text_config")
        if not isinstance(text, dict):
            raise _config_error(where, f"{architecture} needs a 'text_config' object")
        family = "kimi_k25" if architecture in _KIMI_K25_ARCHITECTURES else "kimi_k3"
        prefix = "language_model.model.layers"
        section = "text_config"

    if text.get("q_lora_rank") in (None, 0):
        raise _config_error(
            where,
            "q_lora_rank is not set: this model projects queries with q_proj directly "
            "(no q_b_proj), so there is nothing to fold",
            section,
        )
    dims = {
        key: _require_int(text, key, where, section)
        for key in (
            "num_attention_heads",
            "q_lora_rank",
            "kv_lora_rank",
            "qk_nope_head_dim",
            "qk_rope_head_dim",
            "v_head_dim",
            "num_hidden_layers",
        )
    }
    num_layers = dims["num_hidden_layers"]
    mtp = text.get("num_nextn_predict_layers") or 0
    if isinstance(mtp, bool) or not isinstance(mtp, int) or mtp < 0:
        raise _config_error(where, "'num_nextn_predict_layers' must be a non-negative integer", section)
    for key, count in (("num_hidden_layers", num_layers), ("num_nextn_predict_layers", mtp)):
        if count > MAX_LAYERS:
            raise _config_error(
                where, f"'{key}' is {count}, more than the {MAX_LAYERS} layers foldckpt accepts", section
            )

    if family == "kimi_k3":
        main = _kimi_k3_mla_indices(text, num_layers, where, section)
        uses_rope = not bool(text.get("mla_use_nope", False))
    else:
        main = list(range(num_layers))
        uses_rope = True
    layers = tuple(MLALayer(i, f"{prefix}.{i}") for i in main) + tuple(
        MLALayer(num_layers + j, f"{prefix}.{num_layers + j}", is_mtp=True) for j in range(mtp)
    )
    if not layers:
        raise _config_error(where, "the model has no MLA layer (every layer is linear attention)", section)

    quant_method, block = _quantization(text, config, where, section)
    return Geometry(
        family=family,
        architecture=architecture,
        num_heads=dims["num_attention_heads"],
        q_lora_rank=dims["q_lora_rank"],
        kv_lora_rank=dims["kv_lora_rank"],
        qk_nope_head_dim=dims["qk_nope_head_dim"],
        qk_rope_head_dim=dims["qk_rope_head_dim"],
        v_head_dim=dims["v_head_dim"],
        layers=layers,
        uses_rope=uses_rope,
        quant_method=quant_method,
        weight_block_size=block,
    )


def read_config(model_dir: Path) -> dict[str, Any]:
    """Parse ``config.json`` with a size limit and one-line errors."""
    return read_json_file(
        Path(model_dir) / CONFIG_NAME, _MAX_CONFIG_BYTES, "a model config", "is this a Hugging Face model directory?"
    )


def read_geometry(model_dir: Path) -> Geometry:
    """The geometry of the model stored in ``model_dir``."""
    return geometry_from_config(read_config(model_dir), str(Path(model_dir) / CONFIG_NAME))
