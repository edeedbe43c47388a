"""Node builders: inputs/outputs by ONNX name at their index, only non-default attributes, validated.

The expected input/output orders below are written out from onnxruntime 1.32.0's schemas (and
contract-decisions.md §1 for PagedAttention 17-20 / outputs 3-5), not read from contract.py.
"""

from __future__ import annotations

import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

from pagedkit.validators import ValidationError, make_gqa_node, make_paged_attention_node
from pagedkit.validators.rules import gqa as rules_gqa, paged as rules_paged
from pagedkit.validators.issues import Issue

F16, F32, I8, I32 = TP.FLOAT16, TP.FLOAT, TP.INT8, TP.INT32

PA_INPUTS = ["query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length", "past_seqlens",
             "block_table", "cos_cache", "sin_cache", "slot_mapping", "head_sink", "q_norm_weight", "k_norm_weight",
             "k_scale", "v_scale", "attention_metadata", "k_scale_cache", "v_scale_cache", "query_positions",
             "attention_bias"]
PA_OUTPUTS = ["output", "key_cache_out", "value_cache_out", "k_scale_cache_out", "v_scale_cache_out", "output_qk"]
GQA_INPUTS = ["query", "key", "value", "past_key", "past_value", "seqlens_k", "total_sequence_length", "cos_cache",
              "sin_cache", "position_ids", "attention_bias", "head_sink", "k_scale", "v_scale", "q_norm_weight",
              "k_norm_weight", "query_seqlens"]


def attrs_of(node):
    out = {}
    for a in node.attribute:
        v = helper.get_attribute_value(a)
        out[a.name] = (a.type, v.decode() if isinstance(v, bytes) else v)
    return out


def llama_value_info(h=32, hkv=8, d=128, cache=F16):
    """A complete, valid static description of a Llama-like unpacked node (tensor name = input name)."""
    return {
        "query": (F16, ("T", h * d)), "key": (F16, ("T", hkv * d)), "value": (F16, ("T", hkv * d)),
        "key_cache": (cache, ("NB", 16, hkv, d)), "value_cache": (cache, ("NB", 16, hkv, d)),
        "cumulative_sequence_length": (I32, ("B1",)), "past_seqlens": (I32, ("B",)), "block_table": (I32, ("B", "MB")),
        "cos_cache": (F16, ("P", d // 2)), "sin_cache": (F16, ("P", d // 2)),
        "output": (F16, ("T", h * d)), "key_cache_out": (cache, ("NB", 16, hkv, d)),
        "value_cache_out": (cache, ("NB", 16, hkv, d)),
    }


LLAMA_INPUTS = {n: n for n in ["query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length",
                               "past_seqlens", "block_table", "cos_cache", "sin_cache"]}
LLAMA_OUTPUTS = {"output": "output", "key_cache_out": "key_cache_out", "value_cache_out": "value_cache_out"}


def test_paged_inputs_land_at_their_index_with_gaps_and_trailing_gaps_dropped():
    names = {n: f"t_{n}" for n in ["query", "key", "key_cache", "cumulative_sequence_length", "past_seqlens",
                                   "block_table", "cos_cache", "sin_cache"]}
    node = make_paged_attention_node(names, {"output": "o", "key_cache_out": "kco"}, num_heads=16,
                                     kv_num_heads=1, kv_cache_layout="LATENT", v_head_size=512, scale=0.07,
                                     rotary_offset=512, do_rotary=1)
    assert list(node.input) == ["t_query", "t_key", "", "t_key_cache", "", "t_cumulative_sequence_length",
                                "t_past_seqlens", "t_block_table", "t_cos_cache", "t_sin_cache"]
    assert list(node.output) == ["o", "kco"]
    assert (node.op_type, node.domain) == ("PagedAttention", "com.microsoft")


def test_paged_late_optional_inputs_and_outputs_keep_their_index():
    inputs = dict(LLAMA_INPUTS, k_scale_cache="ksc", v_scale_cache="vsc", query_positions="qp")
    inputs.pop("cos_cache"), inputs.pop("sin_cache")
    outputs = dict(LLAMA_OUTPUTS, k_scale_cache_out="ksco", v_scale_cache_out="vsco", output_qk="qk")
    node = make_paged_attention_node(inputs, outputs, num_heads=32, kv_num_heads=8, k_quant_type="PER_TOKEN",
                                     v_quant_type="PER_TOKEN", k_cache_dtype="int8", v_cache_dtype="int8",
                                     qk_output=1)
    assert len(node.input) == PA_INPUTS.index("query_positions") + 1
    assert node.input[PA_INPUTS.index("k_scale_cache")] == "ksc"
    assert node.input[PA_INPUTS.index("v_scale_cache")] == "vsc"
    assert node.input[PA_INPUTS.index("query_positions")] == "qp"
    assert [node.input[i] for i in range(8, 17)] == [""] * 9
    assert list(node.output) == ["output", "key_cache_out", "value_cache_out", "ksco", "vsco", "qk"]


def test_outputs_as_a_sequence_with_gaps_and_trailing_gaps_dropped():
    node = make_paged_attention_node(LLAMA_INPUTS, ["o", "kco", "vco", "", "", ""], num_heads=32, kv_num_heads=8,
                                     do_rotary=1)
    assert list(node.output) == ["o", "kco", "vco"]
    node = make_paged_attention_node(LLAMA_INPUTS, ["o", "kco", "vco", None, "", "qk"], num_heads=32,
                                     kv_num_heads=8, do_rotary=1, qk_output=2)
    assert list(node.output) == ["o", "kco", "vco", "", "", "qk"]


def test_only_non_default_attributes_are_written_with_contract_types():
    node = make_paged_attention_node(
        LLAMA_INPUTS, LLAMA_OUTPUTS, num_heads=32, kv_num_heads=8, do_rotary=1,
        scale=0.0, softcap=0, local_window_size=-1, is_causal=1, rotary_interleaved=0, qk_norm_epsilon=1e-6,
        k_quant_type="NONE", kv_cache_layout="SEPARATE", k_cache_dtype="", v_head_size=0, qk_output=0,
        rotary_offset=None)
    assert attrs_of(node) == {"num_heads": (onnx.AttributeProto.INT, 32), "kv_num_heads": (onnx.AttributeProto.INT, 8),
                              "do_rotary": (onnx.AttributeProto.INT, 1)}
    node = make_paged_attention_node(LLAMA_INPUTS, LLAMA_OUTPUTS, num_heads=32, kv_num_heads=8, do_rotary=1,
                                     scale=1, softcap=30, local_window_size=128, is_causal=0)
    got = attrs_of(node)
    assert got["scale"] == (onnx.AttributeProto.FLOAT, 1.0)  # an int given for a float attribute stays a float
    assert got["softcap"] == (onnx.AttributeProto.FLOAT, 30.0)
    assert got["local_window_size"] == (onnx.AttributeProto.INT, 128)
    assert got["is_causal"] == (onnx.AttributeProto.INT, 0)


def test_string_attributes_stay_strings():
    node = make_paged_attention_node(
        {**LLAMA_INPUTS, "k_scale": "ks", "v_scale": "vs"}, LLAMA_OUTPUTS, num_heads=32, kv_num_heads=8, do_rotary=1,
        k_quant_type="PER_TENSOR", v_quant_type=b"PER_TENSOR", k_cache_dtype="int8", v_cache_dtype="int8")
    got = attrs_of(node)
    for name in ("k_quant_type", "v_quant_type", "k_cache_dtype", "v_cache_dtype"):
        assert got[name][0] == onnx.AttributeProto.STRING, name
    assert got["v_quant_type"][1] == "PER_TENSOR"


@pytest.mark.parametrize("kind,kwargs,needle", [
    ("input", dict(inputs={"query": "q", "keys": "k", "pastkey": "p"}), "'keys', 'pastkey'"),
    ("output", dict(outputs={"output": "o", "present_key": "pk"}), "'present_key'"),
    ("attribute", dict(attrs={"num_head": 32, "causal": 1}), "'num_head', 'causal'"),
])
def test_unknown_names_raise_a_clear_value_error(kind, kwargs, needle):
    inputs = kwargs.get("inputs", LLAMA_INPUTS)
    outputs = kwargs.get("outputs", LLAMA_OUTPUTS)
    attrs = kwargs.get("attrs", {"num_heads": 32, "kv_num_heads": 8, "do_rotary": 1})
    with pytest.raises(ValueError, match=f"unknown {kind} name|unknown {kind}") as exc:
        make_paged_attention_node(inputs, outputs, **attrs)
    assert needle in str(exc.value)
    assert not isinstance(exc.value, ValidationError)


def test_too_many_positional_outputs_and_bad_attribute_types_raise():
    with pytest.raises(ValueError, match="at most 6"):
        make_paged_attention_node(LLAMA_INPUTS, ["o"] * 7, num_heads=32, kv_num_heads=8)
    with pytest.raises(ValueError, match="attribute 'kv_cache_layout' expects type string"):
        make_paged_attention_node(LLAMA_INPUTS, LLAMA_OUTPUTS, num_heads=32, kv_num_heads=8, kv_cache_layout=1)
    with pytest.raises(ValueError, match="attribute 'num_heads' expects type int, got float 2.5"):
        make_paged_attention_node(LLAMA_INPUTS, LLAMA_OUTPUTS, num_heads=2.5, kv_num_heads=8)
    with pytest.raises(ValueError, match="attribute 'scale' expects type float"):
        make_paged_attention_node(LLAMA_INPUTS, LLAMA_OUTPUTS, num_heads=32, kv_num_heads=8, scale="0.1")


def test_builder_runs_validate_node_with_value_info_and_raises_every_issue(monkeypatch):
    """Independent of the real rules: two stub rules see the value_info and both issues are raised."""
    seen = {}

    def rule_a(view):
        seen["query"] = view.t("query").shape
        yield view.issue("input 'query'", "stub-a", "something", "else")

    def rule_b(view):
        yield view.issue("attribute 'num_heads'", "stub-b", "more", "less")

    monkeypatch.setattr(rules_paged, "RULES", [rule_a, rule_b])
    with pytest.raises(ValidationError) as exc:
        make_paged_attention_node(LLAMA_INPUTS, LLAMA_OUTPUTS, name="attn0", value_info=llama_value_info(),
                                  num_heads=32, kv_num_heads=8, do_rotary=1)
    assert [i.rule for i in exc.value.issues] == ["stub-a", "stub-b"]
    assert all(isinstance(i, Issue) and i.node == "attn0" for i in exc.value.issues)
    assert seen["query"] == ("T", 4096)
    assert "input 'query'" in str(exc.value) and "attribute 'num_heads'" in str(exc.value)
    monkeypatch.setattr(rules_paged, "RULES", [])
    assert make_paged_attention_node(LLAMA_INPUTS, LLAMA_OUTPUTS, num_heads=32, kv_num_heads=8).name == ""


def test_built_node_passes_onnx_checker_and_strict_inference():
    node = make_paged_attention_node(LLAMA_INPUTS, LLAMA_OUTPUTS, name="attn0", value_info=llama_value_info(),
                                     num_heads=32, kv_num_heads=8, do_rotary=1, local_window_size=64)
    vi = llama_value_info()
    graph = helper.make_graph(
        [node], "g", [helper.make_tensor_value_info(n, *vi[n]) for n in node.input if n],
        [helper.make_tensor_value_info(n, *vi[n]) for n in node.output])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    onnx.checker.check_model(model, full_check=True)  # uses the registered schemas
    onnx.shape_inference.infer_shapes(model, strict_mode=True)


# ------------------------------------------------------------------ GroupQueryAttention builder

def test_gqa_inputs_at_index_and_defaults_dropped():
    node = make_gqa_node({"query": "qkv", "past_key": "pk", "past_value": "pv", "seqlens_k": "sk",
                          "total_sequence_length": "tsl", "cos_cache": "cos", "sin_cache": "sin"},
                         {"output": "o", "present_key": "prk", "present_value": "prv"},
                         name="gqa0", num_heads=8, kv_num_heads=2, do_rotary=1, causal=1, smooth_softmax=-1,
                         local_window_size=-1, softcap=0.0, k_quant_type="NONE")
    assert list(node.input) == ["qkv", "", "", "pk", "pv", "sk", "tsl", "cos", "sin"]
    assert list(node.output) == ["o", "prk", "prv"]
    assert attrs_of(node) == {"num_heads": (onnx.AttributeProto.INT, 8), "kv_num_heads": (onnx.AttributeProto.INT, 2),
                              "do_rotary": (onnx.AttributeProto.INT, 1)}
    assert node.domain == "com.microsoft" and node.name == "gqa0"


def test_gqa_attributes_without_default_are_written_when_given():
    node = make_gqa_node({"query": "q", "key": "k", "value": "v", "past_key": "pk", "past_value": "pv",
                          "seqlens_k": "sk", "total_sequence_length": "tsl", "k_scale": "ks", "v_scale": "vs"},
                         ["o", "prk", "prv"], num_heads=8, kv_num_heads=2, kv_cache_bit_width=8,
                         k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR")
    assert attrs_of(node)["kv_cache_bit_width"] == (onnx.AttributeProto.INT, 8)
    assert node.input[GQA_INPUTS.index("k_scale")] == "ks"


def test_gqa_unknown_input_name_raises():
    with pytest.raises(ValueError, match=r"unknown input name\(s\) \['block_table'\]"):
        make_gqa_node({"query": "q", "block_table": "bt"}, ["o"], num_heads=8, kv_num_heads=2)


# ---------------------------------------------- rejections by the real rules (validators/rules/paged*.py, gqa.py)

def test_rule_lists_are_populated():
    assert rules_paged.RULES and rules_gqa.RULES


def test_valid_llama_node_builds_clean():
    node = make_paged_attention_node(LLAMA_INPUTS, LLAMA_OUTPUTS, value_info=llama_value_info(), num_heads=32,
                                     kv_num_heads=8, do_rotary=1)
    assert len(node.input) == 10


def _raises_naming(fn, *needles):
    with pytest.raises(ValidationError) as exc:
        fn()
    text = str(exc.value)
    for n in needles:
        assert n in text, text
    return exc.value


def test_builder_rejects_latent_with_value():
    inputs = dict(LLAMA_INPUTS)
    inputs.pop("value_cache"), inputs.pop("cos_cache"), inputs.pop("sin_cache")
    _raises_naming(lambda: make_paged_attention_node(inputs, ["o", "kco"], num_heads=16, kv_num_heads=1,
                                                     kv_cache_layout="LATENT", scale=0.1), "'value'")


def test_builder_rejects_missing_required_attribute():
    _raises_naming(lambda: make_paged_attention_node(LLAMA_INPUTS, LLAMA_OUTPUTS, kv_num_heads=8, do_rotary=1),
                   "num_heads")


def test_builder_rejects_qk_output_without_output_qk():
    _raises_naming(lambda: make_paged_attention_node(LLAMA_INPUTS, LLAMA_OUTPUTS, num_heads=32, kv_num_heads=8,
                                                     do_rotary=1, qk_output=1), "output_qk")


def test_builder_rejects_wrong_cache_head_size_from_value_info():
    vi = llama_value_info()
    vi["key_cache"] = (F16, ("NB", 16, 8, 96))
    _raises_naming(lambda: make_paged_attention_node(LLAMA_INPUTS, LLAMA_OUTPUTS, value_info=vi, num_heads=32,
                                                     kv_num_heads=8, do_rotary=1), "key_cache", "128")


def test_builder_rejects_rotation_with_per_channel():
    inputs = {**LLAMA_INPUTS, "k_scale": "ks", "v_scale": "vs"}
    _raises_naming(lambda: make_paged_attention_node(
        inputs, LLAMA_OUTPUTS, num_heads=32, kv_num_heads=8, do_rotary=1, k_quant_type="PER_CHANNEL",
        v_quant_type="PER_CHANNEL", k_cache_dtype="int8", v_cache_dtype="int8", qk_rotation=1), "qk_rotation")


def test_gqa_builder_rejects_window_without_causal():
    _raises_naming(lambda: make_gqa_node({"query": "q", "key": "k", "value": "v", "seqlens_k": "sk",
                                          "total_sequence_length": "tsl"}, ["o", "pk", "pv"], num_heads=8,
                                         kv_num_heads=2, causal=0, local_window_size=16), "local_window_size")


def test_gqa_builder_rejects_qk_output_without_fourth_output():
    _raises_naming(lambda: make_gqa_node({"query": "q", "key": "k", "value": "v", "seqlens_k": "sk",
                                          "total_sequence_length": "tsl"}, ["o", "pk", "pv"], num_heads=8,
                                         kv_num_heads=2, qk_output=1), "output_qk")


# --------------------------------------------- every design configuration of tests/nodes.py rebuilt

def _config_cases():
    from nodes import GQA_CONFIGS, PAGED_CONFIGS, gqa_case, paged_case

    return [paged_case(n) for n in PAGED_CONFIGS] + [gqa_case(n) for n in GQA_CONFIGS]


@pytest.mark.parametrize("case", _config_cases(), ids=lambda c: f"{c.op_type}-{c.name}")
def test_every_design_configuration_builds_clean_and_identical(case):
    """The builder reproduces the hand-written node of each configuration and finds no issue."""
    ref, value_info = case.node(symbolic="dynamic")
    build = make_paged_attention_node if case.op_type == "PagedAttention" else make_gqa_node
    node = build({n: n for n in case.inputs}, {n: n for n in case.outputs}, name=ref.name, value_info=value_info,
                 **case.attrs)
    assert list(node.input) == list(ref.input)
    assert list(node.output) == list(ref.output)
    assert attrs_of(node) == {k: v for k, v in attrs_of(ref).items() if case.contract.attr(k).default != v[1]}
