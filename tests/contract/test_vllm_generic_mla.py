"""Contract: what the generic plugin (``FoldedMLAWrapper`` and its helpers) relies on in vLLM.

The plugin subclasses ``MultiHeadLatentAttentionWrapper``, swaps it in through
``PluggableLayer.register_oot``, reads the wrapper's and ``MLAAttention``'s attributes, and inside
its own custom op replays parts of ``MLAAttention.forward_impl`` (KV-cache update, MHA prefill, MQA
decode, ``W_UV``). None of that is a vLLM API. Each test here pins one such dependency against each
release (``vllm_tree``: the 0.33.0 wheel's source and the installed vLLM) and, when it breaks, says
which vLLM name moved and which part of foldckpt needs it.

Where the dependency can be read off foldckpt's own source (its ``vllm`` imports, the ``self.X``
the wrapper reads, the ``attn.X`` its op reads) it is derived from it, so a new dependency is
checked without anyone updating a list; the explicit lists below document the rest.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

from tests.contract.vllm_source import SourceTree, bind_problem, params_of

REPO = Path(__file__).resolve().parents[2]

MLA = "vllm.model_executor.layers.mla"
WRAPPER = "MultiHeadLatentAttentionWrapper"
ATTN_MOD = "vllm.model_executor.layers.attention.mla_attention"
ATTN = "MLAAttention"
ATTENTION = "vllm.model_executor.layers.attention.attention"
CUSTOM_OP = "vllm.model_executor.custom_op"
LINEAR = "vllm.model_executor.layers.linear"
ROPE = "vllm.model_executor.layers.rotary_embedding"
FOLD = "foldckpt.runtime.mla_fold"
FOLDED = "FoldedMLAWrapper"

# What FoldedMLAWrapper reads off the stock wrapper (mla_fold.py): set by vLLM's __init__.
WRAPPER_ATTRS = (
    "mla_attn",
    "fused_qkv_a_proj",
    "q_a_layernorm",
    "kv_a_layernorm",
    "q_b_proj",
    "rotary_emb",
    "g_proj",
    "o_proj",
    "is_sparse",
    "indexer",
    "dcp_q_replicate",
    "fuse_qkv_rmsnorm",
    "prefix",
    "num_heads",
    "q_lora_rank",
    "kv_lora_rank",
    "qk_nope_head_dim",
    "qk_rope_head_dim",
    "v_head_dim",
    "qk_head_dim",
)
# What the op reads off ``attn`` (the layer's MLAAttention) and ``attn.impl`` (its backend impl).
MLA_ATTENTION_ATTRS = (
    "impl",
    "use_pcp",
    "q_pad_num_heads",
    "kv_cache_dtype",
    "layer_name",
    "_decode_concat_quant_fp8_op",
    "forward_impl",
    "prepare_kv_cache_update",
    "update_kv_cache",
    "_v_up_proj",
)
IMPL_ATTRS = ("forward_mha", "forward_mqa", "supports_quant_query_input", "dcp_world_size")
# How the op calls them: (method, positional arguments after self, keywords).
MLA_ATTENTION_CALLS = (
    ("forward_impl", 5, ("output",)),  # attn.forward_impl(q, kv_c_normed, k_pe, kv_cache, md, output=)
    ("prepare_kv_cache_update", 1, ()),  # attn.prepare_kv_cache_update(attn_metadata)
    ("update_kv_cache", 7, ()),  # (kv_c_normed, k_pe, kv_cache, slot_mapping, md, dtype, k_scale)
    ("_v_up_proj", 1, ("out",)),  # attn._v_up_proj(attn_out, out=output[:decode])
)
IMPL_CALLS = (
    ("forward_mha", 6, ("output",)),  # (q, kv_c_normed, k_pe, kv_cache, md, attn._k_scale, output=)
    ("forward_mqa", 4, ()),  # (query, kv_cache, attn_metadata, attn)
)
# The ``self.*`` calls of the stock wrapper's forward: the q-LoRA part of it is what
# FoldedMLAWrapper.forward reproduces, so any new step there has to be reproduced too.
STOCK_FORWARD_SELF_CALLS = {
    "self.fused_qkv_a_proj",
    "self.q_a_layernorm",
    "self.kv_a_proj_with_mqa",
    "self.kv_a_layernorm",
    "self.rotary_emb",
    "self.indexer",
    "self.mla_attn",
    "self.mla_attn.impl.record_logical_topk_ready",
    "self.g_proj",
    "self.o_proj",
}
# Where vLLM's models live (what builds MLA layers).
MODEL_PACKAGES = ("vllm.model_executor.models", "vllm.models")
CUSTOM_OP_KEYWORDS = ("op_name", "op_func", "mutates_args", "fake_impl", "target_lib", "dispatch_key")


# --------------------------------------------------------------------------------------------
# What foldckpt's source uses, read at collection time (no vLLM needed for that).
# --------------------------------------------------------------------------------------------
def _vllm_imports() -> list[tuple[str, str, str | None]]:
    """``(where, module, name)`` of every vLLM import in foldckpt (``name`` None: ``import m``)."""
    found = []
    for path in sorted((REPO / "foldckpt").rglob("*.py")):
        tree = ast.parse(path.read_text(encoding="utf-8"))
        where = path.relative_to(REPO).as_posix()
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom) and node.level == 0 and (node.module or "").split(".")[0] == "vllm":
                found += [(f"{where}:{node.lineno}", node.module, alias.name) for alias in node.names]
            elif isinstance(node, ast.Import):
                found += [
                    (f"{where}:{node.lineno}", a.name, None) for a in node.names if a.name.split(".")[0] == "vllm"
                ]
    return found


VLLM_IMPORTS = _vllm_imports()


def _is_getattr_on(node: ast.AST, receiver: str) -> bool:
    return (
        isinstance(node, ast.Call)
        and isinstance(node.func, ast.Name)
        and node.func.id == "getattr"
        and len(node.args) >= 2
        and ast.unparse(node.args[0]) == receiver
        and isinstance(node.args[1], ast.Constant)
    )


def _reads_on(fold: SourceTree, module: str, receiver: str) -> set[str]:
    """``X`` of every ``<receiver>.X`` / ``getattr(<receiver>, "X", ...)`` in the module."""
    found = set()
    for n in ast.walk(fold.module(module)):
        if isinstance(n, ast.Attribute) and ast.unparse(n.value) == receiver:
            found.add(n.attr)
        elif _is_getattr_on(n, receiver):
            found.add(n.args[1].value)
    return found


# --------------------------------------------------------------------------------------------
# Imports
# --------------------------------------------------------------------------------------------
def test_the_import_scan_sees_the_plugin() -> None:
    """The scan below is what checks the imports: it must find the ones we know of."""
    seen = {(module, name) for _, module, name in VLLM_IMPORTS}
    for expected in [
        (MLA, WRAPPER),
        (CUSTOM_OP, "op_registry_oot"),
        (LINEAR, "UnquantizedLinearMethod"),
        (ATTENTION, "get_attention_context"),
        ("vllm.utils.torch_utils", "direct_register_custom_op"),
    ]:
        assert expected in seen, (
            f"the import scan of foldckpt/ no longer finds `from {expected[0]} import {expected[1]}`"
        )


@pytest.mark.parametrize(("where", "module", "name"), VLLM_IMPORTS, ids=[f"{w}:{n or m}" for w, m, n in VLLM_IMPORTS])
def test_every_vllm_import_of_foldckpt_resolves(
    vllm_tree: SourceTree, where: str, module: str, name: str | None
) -> None:
    statement = f"import {module}" if name is None else f"from {module} import {name}"
    assert vllm_tree.has_module(module), f"{vllm_tree.label}: {where} `{statement}` fails: no module {module}"
    if name is not None:
        assert vllm_tree.defines(module, name), (
            f"{vllm_tree.label}: {where} `{statement}` fails: {vllm_tree.where(module)} no longer defines {name}"
        )


def test_vllm_still_has_a_version_attribute(vllm_tree: SourceTree) -> None:
    # plugin.register() gates on vllm.__version__
    vllm_tree.require_global("vllm", "__version__", why="plugin.register (version gate)")


# --------------------------------------------------------------------------------------------
# The wrapper and its replacement
# --------------------------------------------------------------------------------------------
def test_wrapper_is_a_pluggable_layer_replaced_by_its_class_name(vllm_tree: SourceTree) -> None:
    tree = vllm_tree
    why = "plugin.register: MultiHeadLatentAttentionWrapper.register_oot(FoldedMLAWrapper, name=...)"
    tree.require_class(MLA, WRAPPER, bases=["PluggableLayer"], why=why)
    new = tree.method(MLA, WRAPPER, "__new__")
    assert new is tree.method(CUSTOM_OP, "PluggableLayer", "__new__"), (
        f"{tree.label}: {WRAPPER} no longer takes PluggableLayer.__new__, which swaps in the OOT class [foldckpt: {why}]"
    )
    source = tree.source(CUSTOM_OP, "PluggableLayer", "__new__")
    assert "cls.__name__" in source and "op_registry_oot[" in source, (
        f"{tree.label}: PluggableLayer.__new__ ({tree.where(CUSTOM_OP, new)}) no longer looks the class up in "
        f"op_registry_oot by cls.__name__ [foldckpt: {why}]"
    )
    tree.require_method(
        CUSTOM_OP,
        "PluggableLayer",
        "register_oot",
        decorators=["classmethod"],
        positional=1,
        keywords=["name"],
        why=why,
    )
    decorator = tree.method(CUSTOM_OP, "PluggableLayer", "register_oot.decorator")
    stores = [
        n
        for n in ast.walk(decorator)
        if isinstance(n, ast.Assign) and any(ast.unparse(t).startswith("op_registry_oot[") for t in n.targets)
    ]
    assert stores, (
        f"{tree.label}: PluggableLayer.register_oot no longer stores the class in op_registry_oot [foldckpt: {why}]"
    )
    binding = tree.resolve(CUSTOM_OP, "op_registry_oot")
    assert binding is not None and isinstance(getattr(binding[1], "value", None), ast.Dict), (
        f"{tree.label}: {CUSTOM_OP}.op_registry_oot is no module-level dict (plugin.register checks `name in` it)"
    )


def test_wrapper_forward_has_the_signature_folded_forward_overrides(
    vllm_tree: SourceTree, foldckpt_tree: SourceTree
) -> None:
    ours = [p.render() for p in foldckpt_tree.signature(FOLD, FOLDED, "forward")]
    vllm_tree.require_method(
        MLA,
        WRAPPER,
        "forward",
        params=ours,
        inherited=False,
        why=f"FoldedMLAWrapper.forward({', '.join(ours)}) overrides it",
    )


def test_wrapper_init_keeps_prefix_and_per_rank_heads(vllm_tree: SourceTree) -> None:
    set_to = vllm_tree.assignments(MLA, WRAPPER, "__init__")
    for attr, source in [("prefix", "prefix"), ("num_heads", "num_heads")]:
        assert set_to.get(attr) == [source], (
            f"{vllm_tree.label}: {WRAPPER}.__init__ sets self.{attr} = {set_to.get(attr)}, not the `{source}` "
            "argument [the fold looks its layer up by prefix and multiplies num_heads by the TP size]"
        )


def test_wrapper_provides_the_attributes_named_in_the_contract(vllm_tree: SourceTree) -> None:
    vllm_tree.require_attributes(MLA, WRAPPER, WRAPPER_ATTRS, why="FoldedMLAWrapper (mla_fold.py)")


def test_wrapper_provides_every_attribute_the_folded_wrapper_reads(
    vllm_tree: SourceTree, foldckpt_tree: SourceTree
) -> None:
    needed = sorted(foldckpt_tree.undefined_self_reads(FOLD, FOLDED))
    vllm_tree.require_attributes(MLA, WRAPPER, needed, why="FoldedMLAWrapper reads them (derived from mla_fold.py)")


def test_the_attribute_derivation_finds_what_the_folded_wrapper_reads(foldckpt_tree: SourceTree) -> None:
    needed = foldckpt_tree.undefined_self_reads(FOLD, FOLDED)
    core = {"mla_attn", "q_b_proj", "kv_lora_rank", "prefix", "fused_qkv_a_proj"}
    assert core <= needed, f"the derivation lost {sorted(core - needed)} (it found {sorted(needed)})"
    assert not needed & {"q_fold", "attend", "forward"}, f"the derivation counts foldckpt's own names: {sorted(needed)}"


def test_stock_forward_still_does_what_the_folded_forward_reproduces(vllm_tree: SourceTree) -> None:
    tree = vllm_tree
    why = "FoldedMLAWrapper.forward reproduces the q-LoRA path of the stock forward"
    calls = {c for c in tree.calls(MLA, WRAPPER, "forward") if c.startswith("self.") and "(" not in c}
    assert calls == STOCK_FORWARD_SELF_CALLS, (
        f"{tree.label}: {WRAPPER}.forward ({tree.where(MLA, tree.method(MLA, WRAPPER, 'forward'))}) now also calls "
        f"{sorted(calls - STOCK_FORWARD_SELF_CALLS) or 'nothing new'} and no longer calls "
        f"{sorted(STOCK_FORWARD_SELF_CALLS - calls) or 'nothing gone'} [foldckpt: {why}]"
    )
    source = tree.source(MLA, WRAPPER, "forward")
    for step in [
        "qkv_lora.split([self.q_lora_rank, self.kv_lora_rank + self.qk_rope_head_dim], dim=-1)",
        "kv_lora.split([self.kv_lora_rank, self.qk_rope_head_dim], dim=-1)",
        "k_pe = k_pe.unsqueeze(1)",
        "output_shape=(hidden_states.shape[0], self.num_heads * self.v_head_dim)",
        "attn_out * self.g_proj(hidden_states)[0].sigmoid()",
        "return self.o_proj(attn_out)[0]",
    ]:
        assert step in source, f"{tree.label}: {WRAPPER}.forward no longer does `{step}` [foldckpt: {why}]"


def test_every_in_tree_caller_can_call_the_folded_forward(vllm_tree: SourceTree, foldckpt_tree: SourceTree) -> None:
    """The plugin replaces the wrapper for every model that builds one: each ``self.<attr>(...)``
    on an attribute holding a ``MultiHeadLatentAttentionWrapper(...)`` must bind to our forward."""
    tree = vllm_tree
    ours = params_of(foldckpt_tree.method(FOLD, FOLDED, "forward"))[1:]
    checked, problems = 0, []
    for module in tree.modules_containing(f"{WRAPPER}(", MODEL_PACKAGES):
        for node in (s for s in tree.module(module).body if isinstance(s, ast.ClassDef)):
            methods = [s.name for s in node.body if isinstance(s, ast.FunctionDef)]
            holders = {
                attr
                for m in methods
                for attr, values in tree.assignments(module, node.name, m).items()
                if any(v.startswith(f"{WRAPPER}(") for v in values)
            }
            for m in methods:
                for call in tree.call_sites(module, node.name, m):
                    if call.name in {f"self.{h}" for h in holders} | {f"self.{h}.forward" for h in holders}:
                        checked += 1
                        problem = bind_problem(ours, len(call.args), [k for k in call.keywords if k != "**"])
                        if problem:
                            at = f"{tree.where(module)}:{call.lineno} {node.name}.{m}"
                            problems.append(f"{at}: FoldedMLAWrapper.forward {problem}")
    assert checked >= 1, f"{tree.label}: found no caller of a {WRAPPER} (deepseek_v2 has one): the scan is broken"
    assert not problems, f"{tree.label}: " + "; ".join(problems)


def test_deepseek_builds_the_wrapper_per_rank_with_the_attention_prefix(vllm_tree: SourceTree) -> None:
    tree, module = vllm_tree, "vllm.model_executor.models.deepseek_v2"
    why = "DeepSeek-V3 / Kimi-K2 / Kimi-K2.5 layers are folded through the generic wrapper"
    for arch in ("DeepseekV2ForCausalLM", "DeepseekV3ForCausalLM"):
        tree.require_dict_entry(
            "vllm.model_executor.models.registry", "_TEXT_GENERATION_MODELS", arch, ("deepseek_v2", arch), why=why
        )
    tree.require_dict_entry(
        "vllm.model_executor.models.registry",
        "_MULTIMODAL_MODELS",
        "KimiK25ForConditionalGeneration",
        ("kimi_k25", "KimiK25ForConditionalGeneration"),
        why=why,
    )
    call = tree.require_call(module, "DeepseekV2MLAAttention", "__init__", WRAPPER, why=why)
    assert call.args[1:2] == ("self.num_local_heads",), (
        f"{tree.label}: DeepseekV2MLAAttention builds {WRAPPER}({', '.join(call.args[:3])}, ...): num_heads is "
        "no longer the per-rank self.num_local_heads [_init_fold multiplies it by the TP size]"
    )
    prefix = call.keywords.get("prefix", call.args[11] if len(call.args) > 11 else None)
    assert prefix == "prefix", (
        f"{tree.label}: DeepseekV2MLAAttention passes prefix={prefix} to {WRAPPER} [foldckpt: {why}]"
    )
    layer = tree.require_call(module, "DeepseekV2DecoderLayer", "__init__", "attn_cls", keywords=["prefix"], why=why)
    assert layer.keywords["prefix"] == "f'{prefix}.self_attn'", (
        f"{tree.label}: DeepseekV2DecoderLayer names its attention {layer.keywords['prefix']}, the fold manifest "
        "keys layers by '<layer prefix>.self_attn' [loader.FoldSet.layer_for_module]"
    )
    k25 = tree.require_call(
        "vllm.model_executor.models.kimi_k25",
        "KimiK25ForConditionalGeneration",
        "__init__",
        "init_vllm_registered_model",
        keywords=["architectures"],
        why=why,
    )
    assert k25.keywords["architectures"] == "['DeepseekV2ForCausalLM']", (
        f"{tree.label}: Kimi-K2.5's language model is now {k25.keywords['architectures']} [foldckpt: {why}]"
    )


# --------------------------------------------------------------------------------------------
# MLAAttention, as the op drives it
# --------------------------------------------------------------------------------------------
def test_wrapper_builds_the_mla_attention_the_op_drives(vllm_tree: SourceTree) -> None:
    tree = vllm_tree
    values = tree.assignments(MLA, WRAPPER, "__init__").get("mla_attn", [])
    assert any(v.startswith(f"{ATTN}(") for v in values), f"{tree.label}: {WRAPPER}.__init__ sets mla_attn = {values}"
    where = tree.resolve(MLA, ATTN)
    assert where is not None and where[0] == ATTN_MOD, f"{tree.label}: {MLA}.{ATTN} now comes from {where and where[0]}"
    tree.require_call(MLA, WRAPPER, "__init__", ATTN, keywords=["prefix"], why="the op finds the layer by its name")
    assert tree.assignments(ATTN_MOD, ATTN, "__init__").get("layer_name") == ["prefix"], (
        f"{tree.label}: MLAAttention.layer_name is no longer its prefix [the op's get_attention_context key]"
    )
    assert "compilation_config.static_forward_context[prefix] = self" in tree.source(ATTN_MOD, ATTN, "__init__"), (
        f"{tree.label}: MLAAttention no longer registers itself in static_forward_context under its prefix "
        "[get_attention_context(layer_name) finds it there]"
    )


def test_mla_attention_provides_what_the_op_reads(vllm_tree: SourceTree, foldckpt_tree: SourceTree) -> None:
    reads = _reads_on(foldckpt_tree, FOLD, "attn") | _reads_on(foldckpt_tree, FOLD, "self.mla_attn")
    assert {"impl", "forward_impl", "_k_scale"} <= reads, f"the derivation of attn.X reads is broken: {sorted(reads)}"
    # _k_scale / _q_scale are buffers registered by a helper: test_mla_attention_kv_scales.
    needed = sorted((reads | set(MLA_ATTENTION_ATTRS)) - {"_k_scale", "_q_scale"})
    vllm_tree.require_attributes(ATTN_MOD, ATTN, needed, why="the foldckpt::mla_attention op (mla_fold.py attend)")


def test_mla_attention_kv_scales(vllm_tree: SourceTree) -> None:
    tree = vllm_tree
    why = "attend passes attn._k_scale / attn._q_scale to forward_mha / the fp8 query quant"
    tree.require_call(ATTN_MOD, ATTN, "__init__", "_init_kv_cache_quant", why=why)
    helper = tree.resolve(ATTN_MOD, "_init_kv_cache_quant")
    assert helper is not None, f"{tree.label}: {ATTN_MOD} no longer imports _init_kv_cache_quant"
    call = tree.require_call(
        helper[0], None, "_init_kv_cache_quant", "set_default_quant_scales", keywords=["register_buffer"], why=why
    )
    assert call.args[:1] == ("layer",) and call.keywords["register_buffer"] == "True", (
        f"{tree.label}: _init_kv_cache_quant calls set_default_quant_scales({', '.join(call.args)}, ...) [foldckpt: {why}]"
    )
    scales = tree.resolve(helper[0], "set_default_quant_scales")
    assert scales is not None
    registered = tree.assigned_attributes(scales[0], None, "set_default_quant_scales", receiver="layer")
    assert {"_k_scale", "_q_scale"} <= registered, (
        f"{tree.label}: set_default_quant_scales sets only {sorted(registered)} [foldckpt: {why}]"
    )


@pytest.mark.parametrize(
    ("method", "positional", "keywords"), MLA_ATTENTION_CALLS, ids=[c[0] for c in MLA_ATTENTION_CALLS]
)
def test_mla_attention_methods_take_the_ops_calls(
    vllm_tree: SourceTree, method: str, positional: int, keywords: tuple[str, ...]
) -> None:
    vllm_tree.require_method(
        ATTN_MOD,
        ATTN,
        method,
        positional=positional,
        keywords=keywords,
        why="the foldckpt::mla_attention op (mla_fold.py)",
    )


def test_decode_concat_quant_takes_ql_nope_q_pe_scale(vllm_tree: SourceTree) -> None:
    tree, why = (
        vllm_tree,
        "attend quantizes the folded fp8 query with attn._decode_concat_quant_fp8_op(nope, pe, scale)",
    )
    values = tree.assignments(ATTN_MOD, ATTN, "__init__").get("_decode_concat_quant_fp8_op", [])
    assert any(v.startswith("_DecodeConcatQuantFP8(") for v in values), (
        f"{tree.label}: it is now {values} [foldckpt: {why}]"
    )
    tree.require_method(ATTN_MOD, "_DecodeConcatQuantFP8", "_make_forward.forward", positional=3, why=why)
    body = ast.unparse(tree.class_def(ATTN_MOD, "_DecodeConcatQuantFP8"))
    for name in ("forward_native", "forward_cuda", "forward_hip"):
        assert f"{name} = _make_forward(" in body, (
            f"{tree.label}: _DecodeConcatQuantFP8.{name} is no _make_forward [foldckpt: {why}]"
        )


def test_forward_impl_still_does_what_the_op_replays(vllm_tree: SourceTree) -> None:
    """The op's folded path is forward_impl with the query built differently: same cache view,
    same quantized-query rule, same MHA / MQA / W_UV calls, decode rows first. (0.34 moved the
    W_UK bmm, the fp8 concat and the DCP gather into ``_prepare_mqa_query``, which forward_impl
    skips for a ready ``mqa_q_prepared``.)"""
    tree, why = vllm_tree, "mla_fold.py attend replays MLAAttention.forward_impl"
    tree.require_call(
        ATTN_MOD, ATTN, "forward_impl", "self.impl.forward_mha", positional=6, keywords=["output"], why=why
    )
    tree.require_call(ATTN_MOD, ATTN, "forward_impl", "self.impl.forward_mqa", positional=4, why=why)
    tree.require_call(ATTN_MOD, ATTN, "forward_impl", "self._v_up_proj", positional=1, keywords=["out"], why=why)
    tree.require_call(ATTN_MOD, ATTN, "forward_impl", "is_quantized_kv_cache", positional=1, why=why)
    query = "forward_impl" if tree.minor < (0, 34) else "_prepare_mqa_query"
    if query != "forward_impl":
        tree.require_call(
            ATTN_MOD, ATTN, "forward_impl", "self._prepare_mqa_query", positional=1, keywords=["qrep_decode"], why=why
        )
    tree.require_call(ATTN_MOD, ATTN, query, "self._decode_concat_quant_fp8_op", positional=3, why=why)
    tree.require_call(ATTN_MOD, ATTN, query, "is_quantized_kv_cache", positional=1, why=why)
    source, query_source = tree.source(ATTN_MOD, ATTN, "forward_impl"), tree.source(ATTN_MOD, ATTN, query)
    for step, where in [
        ("kv_cache = kv_cache.view(current_platform.fp8_dtype())", source),
        ("fp8_attention and self.impl.supports_quant_query_input", query_source),
        ("self._decode_concat_quant_fp8_op(mqa_ql_nope, mqa_q_pe, self._q_scale)", query_source),
        ("num_mqa_tokens = attn_metadata.num_decode_tokens", source),
        ("self.impl.forward_mqa(mqa_q, kv_cache, ", source),
    ]:
        assert step in where, f"{tree.label}: MLAAttention.{query} no longer does `{step}` [foldckpt: {why}]"


def test_kv_sharing_and_shardq_are_sparse_mla_only(vllm_tree: SourceTree) -> None:
    """0.34's MLA op prepares the cache of KV-sharing layers, and forward_impl shards the query
    under ShardQ: neither is replayed by the op, because neither reaches a dense MLA layer (the
    only kind _init_fold folds): a dense backend refuses KV sharing, and only sparse backends
    turn ShardQ on."""
    tree, why = vllm_tree, "the foldckpt::mla_attention op folds dense MLA only (sparse is refused)"
    if tree.minor < (0, 34):
        assert "kv_sharing_target_layer_name" not in tree.source(ATTN_MOD, None, "unified_mla_attention_with_output")
        return
    source = tree.source(ATTN_MOD, None, "unified_mla_attention_with_output")
    assert "if layer.kv_sharing_target_layer_name is not None:\n        layer.prepare_kv_cache_update(" in source, (
        f"{tree.label}: unified_mla_attention_with_output prepares the cache for more than KV-sharing layers [{why}]"
    )
    assert "KV sharing is only supported by sparse MLA backends" in tree.string_constants(
        ATTN_MOD, "MLACommonImpl", "__init__"
    ), f"{tree.label}: dense MLA backends (MLACommonImpl) no longer refuse KV sharing [foldckpt: {why}]"
    setters = {m for m in tree.modules_containing("self.use_shardq =", ["vllm.v1.attention.backends"])}
    assert setters and all("sparse" in m or m.endswith(".indexer") for m in setters), (
        f"{tree.label}: use_shardq is now set by {sorted(setters)} [foldckpt: {why}]"
    )
    assert "self.use_shardq = shardq_eligible and getattr(impl, 'use_shardq', False)" in tree.source(
        ATTN_MOD, ATTN, "__init__"
    ), f"{tree.label}: MLAAttention turns ShardQ on by another rule [foldckpt: {why}]"


def test_forward_impl_views_every_dense_quantized_cache_as_fp8(vllm_tree: SourceTree) -> None:
    """attend views any quantized cache as fp8; vLLM keeps its opaque per-token byte layouts
    (DeepSeek sparse-MLA formats) as uint8. A new such layout here needs a look at attend."""
    tree = vllm_tree
    source = tree.source(ATTN_MOD, ATTN, "forward_impl")
    assert "if fp8_attention and self.kv_cache_dtype not in ('fp8_ds_mla', 'nvfp4_ds_mla'):" in source, (
        f"{tree.label}: MLAAttention.forward_impl changed which quantized caches it views as fp8; mla_fold.py "
        "attend views every quantized cache as fp8"
    )


def test_the_stock_ops_do_no_more_than_the_folded_op_replays(vllm_tree: SourceTree) -> None:
    """The folded op stands in for vLLM's two MLA ops; a new step in them is a step it misses."""
    tree, why = vllm_tree, "the foldckpt::mla_attention op replaces unified_mla_kv_cache_update + ..._with_output"
    update = tree.calls(ATTN_MOD, None, "unified_mla_kv_cache_update")
    expected = {
        "_resolve_layer_name",
        "get_attention_context",
        "attn_layer.prepare_kv_cache_update",
        "attn_layer.update_kv_cache",
        "torch.empty",
    }
    assert update == expected, (
        f"{tree.label}: unified_mla_kv_cache_update now calls {sorted(update - expected)}, no longer "
        f"{sorted(expected - update)} [{why}: mla_fold.py _update_kv_cache]"
    )
    attend = tree.calls(ATTN_MOD, None, "unified_mla_attention_with_output")
    # hisparse_cache is only set for sparse (index-group) MLA, which _init_fold refuses; so are
    # KV-sharing layers, whose cache 0.34 prepares here (test_kv_sharing_and_shardq_are_sparse_mla_only).
    expected = {
        "_resolve_layer_name",
        "get_attention_context",
        "layer.hisparse_cache.finish_kv_update",
        "layer.forward_impl",
    } | ({"layer.prepare_kv_cache_update"} if tree.minor >= (0, 34) else set())
    assert attend == expected, (
        f"{tree.label}: unified_mla_attention_with_output now calls {sorted(attend - expected)}, no longer "
        f"{sorted(expected - attend)} [foldckpt: {why}]"
    )
    assert "isinstance(index_group, HiSparseMLAIndexGroup)" in tree.source(ATTN_MOD, ATTN, "__init__"), (
        f"{tree.label}: MLAAttention.hisparse_cache is no longer only for HiSparse index groups [foldckpt: {why}]"
    )
    assert tree.decorators(ATTN_MOD, None, "unified_mla_attention_with_output") == [
        "eager_break_during_capture",
        "maybe_transfer_kv_layer",
    ], f"{tree.label}: vLLM's MLA op changed its decorators; mla_fold.mla_attention copies them [foldckpt: {why}]"


def test_mla_impls_take_the_ops_calls(vllm_tree: SourceTree) -> None:
    tree, why = vllm_tree, "attend calls attn.impl.forward_mha / forward_mqa"
    tree.require_attributes(ATTN_MOD, "MLACommonImpl", IMPL_ATTRS, why=why)
    for method, positional, keywords in IMPL_CALLS:
        tree.require_method(ATTN_MOD, "MLACommonImpl", method, positional=positional, keywords=keywords, why=why)


def test_every_dense_mla_backend_takes_the_ops_calls(vllm_tree: SourceTree) -> None:
    tree, problems, checked = vllm_tree, [], 0
    for module in tree.modules_containing("def forward_mqa(", ["vllm.v1.attention.backends.mla"]):
        if "sparse" in module:  # sparse MLA is refused by _init_fold
            continue
        for node in (s for s in tree.module(module).body if isinstance(s, ast.ClassDef)):
            if not any(isinstance(s, ast.FunctionDef) and s.name == "forward_mqa" for s in node.body):
                continue
            checked += 1
            for method, positional, keywords in IMPL_CALLS:
                try:
                    tree.require_method(module, node.name, method, positional=positional, keywords=keywords)
                except AssertionError as exc:
                    problems.append(str(exc))
            if tree.attribute_owner(module, node.name, "supports_quant_query_input") is None:
                problems.append(f"{node.name} ({tree.where(module, node)}) has no supports_quant_query_input")
    assert checked >= 3, f"{tree.label}: found only {checked} MLA backend impls: the scan is broken"
    assert not problems, "; ".join(problems) + " [attend calls attn.impl.forward_mha / forward_mqa]"


def test_attention_metadata_fields_the_op_routes_on(vllm_tree: SourceTree) -> None:
    vllm_tree.require_fields(
        ATTN_MOD,
        "MLACommonMetadata",
        ["num_decode_tokens", "num_actual_tokens"],
        why="attend routes decode rows by attn_metadata.num_decode_tokens",
    )


# --------------------------------------------------------------------------------------------
# Custom-op plumbing
# --------------------------------------------------------------------------------------------
def test_get_attention_context_returns_metadata_layer_cache_slots(vllm_tree: SourceTree) -> None:
    tree = vllm_tree
    tree.require_function(ATTENTION, "get_attention_context", params=["layer_name"], why="attend")
    returned = tree.returns(ATTENTION, None, "get_attention_context")
    assert returned == ["(attn_metadata, attn_layer, kv_cache, layer_slot_mapping)"], (
        f"{tree.label}: get_attention_context now returns {returned}; attend unpacks "
        "(attn_metadata, attn, kv_cache, slot_mapping)"
    )


def test_op_decorators_take_the_op(vllm_tree: SourceTree, foldckpt_tree: SourceTree) -> None:
    tree, why = vllm_tree, "mla_fold.mla_attention is decorated with them"
    tree.require_function("vllm.compilation.breakable_cudagraph", "eager_break_during_capture", positional=1, why=why)
    transfer = "vllm.model_executor.layers.attention.kv_transfer_utils"
    tree.require_function(transfer, "maybe_transfer_kv_layer", positional=1, why=why)
    assert "layer_name" in tree.string_constants(transfer, None, "maybe_transfer_kv_layer"), (
        f"{tree.label}: maybe_transfer_kv_layer no longer finds the op's `layer_name` parameter by name [foldckpt: {why}]"
    )
    assert "layer_name" in foldckpt_tree.param_names(FOLD, None, "mla_attention")
    assert foldckpt_tree.decorators(FOLD, None, "mla_attention") == tree.decorators(
        ATTN_MOD, None, "unified_mla_attention_with_output"
    ), "mla_fold.mla_attention's decorators differ from vLLM's own MLA op's (order matters, see breakable_cudagraph)"


def test_direct_register_custom_op_takes_the_plugins_keywords(vllm_tree: SourceTree) -> None:
    vllm_tree.require_function(
        "vllm.utils.torch_utils",
        "direct_register_custom_op",
        positional=0,
        keywords=CUSTOM_OP_KEYWORDS,
        why="mla_fold.py registers foldckpt::mla_attention",
    )
    for name in ("_encode_layer_name", "_resolve_layer_name"):
        vllm_tree.require_function("vllm.utils.torch_utils", name, positional=1, why="the op's layer_name argument")


def test_small_helpers_the_plugin_calls(vllm_tree: SourceTree) -> None:
    tree = vllm_tree
    tree.require_function("vllm.v1.kv_cache_interface", "is_quantized_kv_cache", positional=1, why="attend")
    tree.require_function("vllm.config", "get_current_vllm_config", positional=0, why="the fold build")
    for name in ("get_tensor_model_parallel_world_size", "get_tensor_model_parallel_rank"):
        tree.require_function("vllm.distributed", name, positional=0, why="tensor-parallel rows of the fold")
    tree.require_function("vllm.logger", "init_logger", positional=1, why="weights.py logger")


def test_config_fields_the_plugin_reads(vllm_tree: SourceTree) -> None:
    tree = vllm_tree
    tree.require_fields("vllm.config", "VllmConfig", ["model_config", "compilation_config"], why="the fold build")
    tree.require_fields("vllm.config", "ModelConfig", ["model"], why="served_fold_set(model_config.model)")
    tree.require_fields(
        "vllm.config", "CompilationConfig", ["splitting_ops"], why="foldckpt::mla_attention is a splitting op"
    )


# --------------------------------------------------------------------------------------------
# q_fold: a ColumnParallelLinear whose quant method fills it from the sidecar
# --------------------------------------------------------------------------------------------
def test_column_parallel_linear_as_the_fold_builds_it(vllm_tree: SourceTree) -> None:
    tree, why = vllm_tree, "layer_fold builds q_fold = ColumnParallelLinear(in, out, bias=, quant_config=, prefix=)"
    tree.require_method(
        LINEAR, "ColumnParallelLinear", "__init__", positional=2, keywords=["bias", "quant_config", "prefix"], why=why
    )
    tree.require_method(LINEAR, "ColumnParallelLinear", "forward", calls=["self.quant_method.apply"], why=why)
    tree.require_attributes(LINEAR, "ColumnParallelLinear", ["quant_method"], why=why)
    # An fp8 fold served as e4m3 replaces q_fold.weight; the activations' dtype comes from params_dtype.
    tree.require_attributes(
        LINEAR, "ColumnParallelLinear", ["params_dtype"], why="mla_fold warms the fp8 fold GEMM for q_fold.params_dtype"
    )


def test_unquantized_linear_method_as_the_sidecar_method_extends_it(vllm_tree: SourceTree) -> None:
    tree, why = vllm_tree, "weights.SidecarFoldMethod(UnquantizedLinearMethod)"
    tree.require_method(LINEAR, "UnquantizedLinearMethod", "__init__", positional=0, why=why)
    tree.require_method(
        LINEAR,
        "UnquantizedLinearMethod",
        "process_weights_after_loading",
        params=["self", "layer"],
        inherited=False,
        why=why,
    )
    registered = tree.assigned_attributes(LINEAR, "UnquantizedLinearMethod", "create_weights", receiver="layer")
    assert "weight" in registered, (
        f"{tree.label}: UnquantizedLinearMethod.create_weights no longer registers layer.weight [foldckpt: {why}]"
    )


def test_the_loader_post_processes_q_fold_and_does_not_demand_it_from_the_checkpoint(vllm_tree: SourceTree) -> None:
    """q_fold.weight is in no checkpoint file: it is filled by the quant method's post-processing,
    which vLLM runs for every module with a quant_method, and the loaded-weights check exempts it."""
    tree, why = vllm_tree, "SidecarFoldMethod.process_weights_after_loading fills q_fold"
    utils = "vllm.model_executor.model_loader.utils"
    tree.require_call(
        utils,
        None,
        "process_weights_after_loading",
        "quant_method.process_weights_after_loading",
        positional=1,
        why=why,
    )
    assert "quant_method" in tree.string_constants(utils, None, "process_weights_after_loading")
    loader = "vllm.model_executor.model_loader.default_loader"
    assert "process_weights_after_loading" in tree.string_constants(
        loader, "DefaultModelLoader", "track_weights_loading"
    ), (
        f"{tree.label}: track_weights_loading no longer exempts modules whose quant method post-processes weights "
        "[q_fold.weight would be reported 'not initialized from checkpoint']"
    )
    assert "model_config.quantization is None" in tree.source(loader, "DefaultModelLoader", "load_weights"), (
        f"{tree.label}: DefaultModelLoader.load_weights now tracks loaded weights of quantized models too "
        "[track_weights_loading only exempts q_fold for unquantized ones]"
    )


# --------------------------------------------------------------------------------------------
# RoPE: what fold_query reproduces
# --------------------------------------------------------------------------------------------
@pytest.mark.parametrize("cls", ["RotaryEmbedding", "DeepseekScalingRotaryEmbedding"])
def test_rope_is_the_cache_lookup_fold_query_reproduces(vllm_tree: SourceTree, cls: str) -> None:
    tree, why = vllm_tree, "mla_fold._CACHE_LOOKUP_ROPES / _rope_cache (kernels.fold_query reimplements the rotation)"
    tree.require_method(ROPE, cls, "forward_native", positional=3, why=why)
    tree.require_attributes(ROPE, cls, ["is_neox_style", "rotary_dim", "head_size", "cos_sin_cache"], why=why)
    assert "torch.cat((cos, sin), dim=-1)" in tree.source(ROPE, cls, "_compute_cos_sin_cache"), (
        f"{tree.label}: {cls}'s cos_sin_cache is no longer [cos | sin] per position [foldckpt: {why}]"
    )
    tree.require_method(ROPE, cls, "forward_native", calls=["self.forward_static"], why=why)
    assert "cos, sin = cos_sin.chunk(2, dim=-1)" in tree.source(ROPE, cls, "forward_static"), (
        f"{tree.label}: {cls}.forward_static no longer splits the cache row into (cos, sin) halves [foldckpt: {why}]"
    )
