"""validate_model: whole-model rules (cache write-back, genai naming, attention_metadata, external data)
on the bundled example, ORT's single-node test form, and mutations of both."""

from __future__ import annotations

import copy
import json
import os
from pathlib import Path

import numpy as np
import onnx
import pytest
from onnx import TensorProto, helper, numpy_helper

from pagedkit.validators import validate_model
from pagedkit.validators.builders import make_gqa_node, make_paged_attention_node
from pagedkit.validators.model import RULE_DOCS, ModelLoadError, check_model

ROOT = Path(__file__).resolve().parents[1]
EXAMPLE = ROOT / "examples" / "tiny-paged"
FP16 = TensorProto.FLOAT16


# ------------------------------------------------------------------------------------------------
# model factories (also used by test_cli.py)
# ------------------------------------------------------------------------------------------------

def example_model() -> onnx.ModelProto:
    """A fresh copy of the bundled 2-layer paged model (genai layout)."""
    return onnx.load(str(EXAMPLE / "model.onnx"))


def single_node_paged(qk_names=("key_cache", "value_cache"), out_names=("key_cache_out", "value_cache_out"),
                      **attrs) -> onnx.ModelProto:
    """ORT's test form: one PagedAttention node, caches are graph inputs, cache outputs graph outputs."""
    k, v = qk_names
    ko, vo = out_names
    cache = ["num_blocks", 16, 2, 16]  # [NB, BS, Hkv, D]
    inputs = [helper.make_tensor_value_info("query", FP16, ["T", 64]),
              helper.make_tensor_value_info("key", FP16, ["T", 32]),
              helper.make_tensor_value_info("value", FP16, ["T", 32]),
              helper.make_tensor_value_info(k, FP16, cache), helper.make_tensor_value_info(v, FP16, cache),
              helper.make_tensor_value_info("cumulative_sequence_length", TensorProto.INT32, ["B+1"]),
              helper.make_tensor_value_info("past_seqlens", TensorProto.INT32, ["B"]),
              helper.make_tensor_value_info("block_table", TensorProto.INT32, ["B", "M"])]
    node = make_paged_attention_node(
        {"query": "query", "key": "key", "value": "value", "key_cache": k, "value_cache": v,
         "cumulative_sequence_length": "cumulative_sequence_length", "past_seqlens": "past_seqlens",
         "block_table": "block_table"},
        {"output": "output", "key_cache_out": ko, "value_cache_out": vo},
        name="pa", num_heads=4, kv_num_heads=2, **attrs)
    outputs = [helper.make_tensor_value_info("output", FP16, ["T", 64]),
               helper.make_tensor_value_info(ko, FP16, cache), helper.make_tensor_value_info(vo, FP16, cache)]
    graph = helper.make_graph([node], "single", inputs, outputs)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                                   helper.make_opsetid("com.microsoft", 1)])


def single_node_gqa() -> onnx.ModelProto:
    """ORT's GQA test form (fp32, BNSH past/present as graph inputs/outputs)."""
    f = TensorProto.FLOAT
    inputs = [helper.make_tensor_value_info("query", f, ["B", "S", 64]),
              helper.make_tensor_value_info("key", f, ["B", "S", 32]),
              helper.make_tensor_value_info("value", f, ["B", "S", 32]),
              helper.make_tensor_value_info("past_key", f, ["B", 2, "P", 16]),
              helper.make_tensor_value_info("past_value", f, ["B", 2, "P", 16]),
              helper.make_tensor_value_info("seqlens_k", TensorProto.INT32, ["B"]),
              helper.make_tensor_value_info("total_sequence_length", TensorProto.INT32, [1])]
    node = make_gqa_node(
        {"query": "query", "key": "key", "value": "value", "past_key": "past_key", "past_value": "past_value",
         "seqlens_k": "seqlens_k", "total_sequence_length": "total_sequence_length"},
        {"output": "output", "present_key": "present_key", "present_value": "present_value"},
        name="gqa", num_heads=4, kv_num_heads=2)
    outputs = [helper.make_tensor_value_info("output", f, ["B", "S", 64]),
               helper.make_tensor_value_info("present_key", f, ["B", 2, "L", 16]),
               helper.make_tensor_value_info("present_value", f, ["B", 2, "L", 16])]
    graph = helper.make_graph([node], "single_gqa", inputs, outputs)
    return helper.make_model(graph, ir_version=10, opset_imports=[helper.make_opsetid("", 21),
                                                                   helper.make_opsetid("com.microsoft", 1)])


def attention_nodes(model: onnx.ModelProto) -> list[onnx.NodeProto]:
    return [n for n in model.graph.node if n.op_type == "PagedAttention"]


def drop_graph_output(model: onnx.ModelProto, name: str) -> None:
    keep = [o for o in model.graph.output if o.name != name]
    del model.graph.output[:]
    model.graph.output.extend(keep)


def drop_graph_input(model: onnx.ModelProto, name: str) -> None:
    keep = [i for i in model.graph.input if i.name != name]
    del model.graph.input[:]
    model.graph.input.extend(keep)


def only(issues, rule):
    found = [i for i in issues if i.rule == rule]
    assert found, f"no {rule} issue in {[str(i) for i in issues]}"
    return found


# ------------------------------------------------------------------------------------------------
# valid models
# ------------------------------------------------------------------------------------------------

def test_example_is_clean_as_proto_path_and_folder():
    assert validate_model(example_model()) == []
    assert validate_model(EXAMPLE / "model.onnx") == []
    report = check_model(str(EXAMPLE))
    assert report.issues == [] and report.attention_nodes == 2


def test_single_node_ort_form_is_clean():
    assert validate_model(single_node_paged()) == []
    assert validate_model(single_node_gqa()) == []


def test_rule_docs_cover_every_model_rule_id():
    import inspect

    from pagedkit.validators import model as mod

    used = set(__import__("re").findall(r'"(MODEL-[a-z0-9-]+)"', inspect.getsource(mod)))
    assert used <= set(RULE_DOCS), used - set(RULE_DOCS)


# ------------------------------------------------------------------------------------------------
# cache write-back and naming
# ------------------------------------------------------------------------------------------------

def test_cache_output_not_written_back():
    m = example_model()
    drop_graph_output(m, "present.1.key")
    (issue,) = only(validate_model(m), "MODEL-cache-written-back")
    assert issue.node == "layers.1.attn" and issue.where == "output 'key_cache_out'"
    assert "present.1.key" in issue.expected and "past_key_values.1.key" in str(issue)


def test_cache_output_with_mismatched_layer_index():
    m = example_model()
    n0, n1 = attention_nodes(m)
    n0.output[1], n1.output[1] = n1.output[1], n0.output[1]  # layer 0 writes present.1.key and vice versa
    issues = only(validate_model(m), "MODEL-cache-output-name")
    assert {(i.node, i.expected, i.got) for i in issues} == {
        ("layers.0.attn", "'present.0.key'", "'present.1.key'"),
        ("layers.1.attn", "'present.1.key'", "'present.0.key'")}
    assert all("past_key_values." in i.message for i in issues)


def test_cache_fed_by_another_node():
    m = example_model()
    m.graph.node.insert(0, helper.make_node("Identity", ["past_key_values.0.key"], ["k0_copy"], name="copy_k0"))
    attention_nodes(m)[0].input[3] = "k0_copy"
    (issue,) = only(validate_model(m), "MODEL-cache-graph-input")
    assert issue.where == "input 'key_cache'" and "k0_copy" in issue.got and "copy_k0" in issue.got
    assert "past_key_values.{i}.key" in issue.expected


def test_cache_as_initializer():
    m = single_node_paged()
    drop_graph_input(m, "value_cache")
    m.graph.initializer.append(numpy_helper.from_array(np.ones((2, 16, 2, 16), np.float16), "value_cache"))
    (issue,) = only(validate_model(m), "MODEL-cache-graph-input")
    assert issue.where == "input 'value_cache'" and "initializer 'value_cache'" in issue.got


def test_single_node_cache_output_must_be_graph_output():
    m = single_node_paged()
    drop_graph_output(m, "value_cache_out")
    (issue,) = only(validate_model(m), "MODEL-cache-written-back")
    assert issue.where == "output 'value_cache_out'" and "value_cache_out" in issue.got
    assert "'value_cache'" in issue.message


def test_single_node_needs_no_genai_names():
    assert validate_model(single_node_paged(("kc", "vc"), ("kc_new", "vc_new"))) == []


def test_multi_layer_cache_input_name():
    m = example_model()
    for vi in m.graph.input:
        if vi.name == "past_key_values.1.value":
            vi.name = "cache_v1"
    attention_nodes(m)[1].input[4] = "cache_v1"
    (issue,) = only(validate_model(m), "MODEL-cache-name")
    assert issue.where == "input 'value_cache'" and issue.got == "'cache_v1'"
    assert issue.expected == "a graph input named 'past_key_values.{i}.value'"


def test_caches_of_one_node_from_two_layers():
    m = example_model()
    attention_nodes(m)[1].input[4] = "past_key_values.0.value"  # layer 1 reads layer 0's value cache
    issues = validate_model(m)
    (layer,) = only(issues, "MODEL-cache-layer")
    assert "past_key_values.0.value" in layer.got and "past_key_values.1.key" in layer.got
    (name,) = only(issues, "MODEL-cache-output-name")
    assert name.expected == "'present.0.value'" and name.got == "'present.1.value'"


def test_cache_pair_element_type_and_shape():
    m = example_model()
    for vi in m.graph.output:
        if vi.name == "present.0.value":
            vi.type.tensor_type.elem_type = TensorProto.FLOAT
        if vi.name == "present.1.key":
            vi.type.tensor_type.shape.dim[1].dim_value = 32
    issues = only(validate_model(m), "MODEL-cache-pair-type")
    texts = [str(i) for i in issues]
    assert any("element type float16" in t and "present.0.value" in t for t in texts), texts
    assert any("(num_blocks, 16, 2, 16)" in t and "present.1.key" in t for t in texts), texts


def test_gqa_cache_pair_allows_growth_but_not_head_size():
    m = single_node_gqa()
    assert validate_model(m) == []  # P -> L: the sequence length may grow
    m.graph.output[1].type.tensor_type.shape.dim[3].dim_value = 8
    m.graph.input[3].type.tensor_type.shape.dim[3].dim_value = 16
    (issue,) = only(validate_model(m), "MODEL-cache-pair-type")
    assert issue.where == "output 'present_key'" and "past_key" in issue.expected and "8" in issue.got


def test_genai_config_names_are_used(tmp_path):
    m = example_model()
    cfg = json.loads((EXAMPLE / "genai_config.json").read_text())
    cfg["model"]["decoder"]["inputs"]["past_key_names"] = "cache.%d.k"
    onnx.save(m, str(tmp_path / "model.onnx"))
    (tmp_path / "genai_config.json").write_text(json.dumps(cfg))
    issues = only(validate_model(tmp_path), "MODEL-cache-name")
    assert {i.node for i in issues} == {"layers.0.attn", "layers.1.attn"}
    assert all(i.expected == "a graph input named 'cache.{i}.k'" for i in issues)
    # the same names given explicitly, and a model renamed to match: clean
    for i, node in enumerate(attention_nodes(m)):
        node.input[3] = f"cache.{i}.k"
    for vi in m.graph.input:
        if vi.name.endswith(".key"):
            vi.name = "cache.%s.k" % vi.name.split(".")[1]
    assert validate_model(m, genai_config=cfg) == []


def test_unreadable_genai_config(tmp_path):
    onnx.save(example_model(), str(tmp_path / "model.onnx"))
    (tmp_path / "genai_config.json").write_text("{not json")
    (issue,) = only(validate_model(tmp_path / "model.onnx"), "MODEL-genai-config")
    assert "genai_config.json" in issue.where


# ------------------------------------------------------------------------------------------------
# attention_metadata, extension inputs, domain
# ------------------------------------------------------------------------------------------------

def test_attention_metadata_produced_by_a_node():
    m = example_model()
    drop_graph_input(m, "attention_metadata")
    m.graph.node.insert(0, helper.make_node(
        "Constant", [], ["attention_metadata"], name="make_metadata",
        value=numpy_helper.from_array(np.array([4, 64, 0], np.int32))))
    issues = only(validate_model(m), "MODEL-attention-metadata-graph-input")
    assert {i.node for i in issues} == {"layers.0.attn", "layers.1.attn"}
    assert all(i.where == "input 'attention_metadata'" and "make_metadata" in i.got
               and i.expected == "a graph input fed from the host" for i in issues)


def test_attention_metadata_initializer():
    m = example_model()
    drop_graph_input(m, "attention_metadata")
    m.graph.initializer.append(numpy_helper.from_array(np.array([4, 64, 0], np.int32), "attention_metadata"))
    issues = only(validate_model(m), "MODEL-attention-metadata-graph-input")
    assert len(issues) == 2 and all("initializer 'attention_metadata'" in i.got for i in issues)


def _with_extension_input(name: str, pname: str, elem: int, shape) -> onnx.ModelProto:
    m = example_model()
    m.graph.input.append(helper.make_tensor_value_info(name, elem, shape))
    node = attention_nodes(m)[0]
    idx = {"slot_mapping": 10, "query_positions": 19}[pname]
    while len(node.input) <= idx:
        node.input.append("")
    node.input[idx] = name
    return m


def test_extension_inputs_valid_and_invalid():
    assert validate_model(_with_extension_input("slot_mapping", "slot_mapping", TensorProto.INT32,
                                                ["num_tokens"])) == []
    assert validate_model(_with_extension_input("query_positions", "query_positions", TensorProto.INT32,
                                                ["num_tokens"])) == []
    for pname in ("slot_mapping", "query_positions"):
        issues = validate_model(_with_extension_input(pname, pname, TensorProto.INT64, ["num_tokens"]))
        assert any(i.where == f"input '{pname}'" and "int32" in i.expected and "int64" in i.got
                   for i in issues), [str(i) for i in issues]


def test_wrong_domain_and_missing_opset_import():
    m = single_node_paged()
    m.graph.node[0].domain = ""
    (issue,) = only(validate_model(m), "MODEL-domain")
    assert issue.node == "pa" and "com.microsoft" in issue.expected
    m = single_node_paged()
    keep = [o for o in m.opset_import if o.domain != "com.microsoft"]
    del m.opset_import[:]
    m.opset_import.extend(keep)
    (issue,) = only(validate_model(m), "MODEL-domain")
    assert "opset_import" in issue.expected


def test_node_rules_run_on_nodes_inside_subgraphs():
    inner = single_node_paged()
    node = copy.deepcopy(inner.graph.node[0])
    for a in node.attribute:
        if a.name == "kv_num_heads":
            a.i = 3  # 4 query heads are not a multiple of 3
    branch = helper.make_graph([node], "then", [], [helper.make_tensor_value_info("output", FP16, None)])
    other = helper.make_graph([helper.make_node("Identity", ["query"], ["o2"])], "else", [],
                              [helper.make_tensor_value_info("o2", FP16, None)])
    cond = helper.make_tensor_value_info("cond", TensorProto.BOOL, [])
    g = helper.make_graph([helper.make_node("If", ["cond"], ["y"], then_branch=branch, else_branch=other)], "g",
                          [cond, *inner.graph.input], [helper.make_tensor_value_info("y", FP16, None)])
    m = helper.make_model(g, ir_version=10, opset_imports=list(inner.opset_import))
    report = check_model(m)
    assert report.attention_nodes == 1
    assert any(i.node == "pa" and "kv_num_heads=3" in str(i) for i in report.issues), [str(i) for i in report.issues]


def test_shape_inference_failure_never_fails_validation(monkeypatch):
    def boom(*a, **k):
        raise RuntimeError("shape inference exploded")

    monkeypatch.setattr(onnx.shape_inference, "infer_shapes", boom)
    assert validate_model(example_model()) == []


# ------------------------------------------------------------------------------------------------
# loading and external data
# ------------------------------------------------------------------------------------------------

def save_external(model: onnx.ModelProto, folder: Path, location: str = "model.onnx.data") -> Path:
    folder.mkdir(parents=True, exist_ok=True)
    path = folder / "model.onnx"
    onnx.save(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True, location=location,
              size_threshold=0)
    return path


def relocate(path: Path, location: str) -> None:
    """Point every external tensor of the saved model at `location` (graph only, data untouched)."""
    m = onnx.load(str(path), load_external_data=False)
    for t in m.graph.initializer:
        for e in t.external_data:
            if e.key == "location":
                e.value = location
    onnx.save(m, str(path))


def test_external_data_inside_folder_is_clean(tmp_path):
    path = save_external(example_model(), tmp_path / "m")
    assert (tmp_path / "m" / "model.onnx.data").stat().st_size > 10_000
    assert validate_model(path) == []


@pytest.mark.parametrize("location", ["../model.onnx.data", "sub/../../model.onnx.data", "/etc/passwd"])
def test_external_data_outside_folder(tmp_path, location):
    path = save_external(example_model(), tmp_path / "m")
    (tmp_path / "model.onnx.data").write_bytes((tmp_path / "m" / "model.onnx.data").read_bytes())
    relocate(path, location)
    issues = only(validate_model(path), "MODEL-external-data")
    assert all(i.got == f"location {location!r}" and "relative path" in i.expected for i in issues)
    assert any("embed_tokens.weight" in i.where for i in issues)


def test_external_data_symlink_out_and_missing(tmp_path):
    path = save_external(example_model(), tmp_path / "m")
    outside = tmp_path / "outside.data"
    (tmp_path / "m" / "model.onnx.data").rename(outside)
    os.symlink(outside, tmp_path / "m" / "model.onnx.data")
    issues = only(validate_model(path), "MODEL-external-data")
    assert all("resolving to" in i.got for i in issues)
    (tmp_path / "m" / "model.onnx.data").unlink()
    issues = only(validate_model(path), "MODEL-external-data")
    assert all(i.got == "missing file 'model.onnx.data'" for i in issues)


def test_load_errors(tmp_path):
    with pytest.raises(ModelLoadError, match="no such file"):
        validate_model(tmp_path / "missing.onnx")
    (tmp_path / "junk.onnx").write_bytes(b"\x00\xffnot a model at all" * 10)
    with pytest.raises(ModelLoadError, match="not an ONNX model"):
        validate_model(tmp_path / "junk.onnx")


# ------------------------------------------------------------------------------------------------
# the design configurations (tests/nodes.py) as whole models; PER_TOKEN scale-cache pairs
# ------------------------------------------------------------------------------------------------

def _configs():
    from nodes import GQA_CONFIGS, PAGED_CONFIGS

    return [("paged", n) for n in PAGED_CONFIGS] + [("gqa", n) for n in GQA_CONFIGS]


@pytest.mark.parametrize("op,config", _configs())
def test_design_configurations_as_single_node_models_are_clean(op, config):
    from nodes import gqa_case, paged_case

    case = paged_case(config) if op == "paged" else gqa_case(config)
    issues = validate_model(case.model())
    assert issues == [], [str(i) for i in issues]


_LAYER_NAMES = {"key_cache": "past_key_values.{i}.key", "value_cache": "past_key_values.{i}.value",
                "k_scale_cache": "past_key_values.{i}.key_scale", "v_scale_cache": "past_key_values.{i}.value_scale",
                "key_cache_out": "present.{i}.key", "value_cache_out": "present.{i}.value",
                "k_scale_cache_out": "present.{i}.key_scale", "v_scale_cache_out": "present.{i}.value_scale",
                "output": "output.{i}"}


def two_layer_model(single: onnx.ModelProto) -> onnx.ModelProto:
    """Two copies of a single-node model's node (layers 0 and 1) with genai-named caches; the other inputs
    are shared."""
    (node,) = single.graph.node
    types = {v.name: v for v in list(single.graph.input) + list(single.graph.output)}
    nodes, inputs, outputs = [], [v for v in single.graph.input if v.name not in _LAYER_NAMES], []
    for i in range(2):
        n = copy.deepcopy(node)
        n.name = f"layer{i}"
        for names, vis in ((n.input, inputs), (n.output, outputs)):
            for k, t in enumerate(names):
                if t in _LAYER_NAMES:
                    names[k] = _LAYER_NAMES[t].format(i=i)
                    vi = copy.deepcopy(types[t])
                    vi.name = names[k]
                    vis.append(vi)
        nodes.append(n)
    g = helper.make_graph(nodes, "two_layers", inputs, outputs)
    return helper.make_model(g, ir_version=single.ir_version, opset_imports=list(single.opset_import))


def test_per_token_scale_caches_follow_the_genai_names():
    from nodes import paged_case

    m = two_layer_model(paged_case("int8_per_token_f32_scales").model())
    assert {o.name for o in m.graph.output} >= {"present.0.key_scale", "present.1.value_scale"}
    assert validate_model(m) == []
    n0, n1 = m.graph.node
    n0.output[3], n1.output[3] = n1.output[3], n0.output[3]
    issues = only(validate_model(m), "MODEL-cache-output-name")
    assert {(i.node, i.where, i.expected) for i in issues} == {
        ("layer0", "output 'k_scale_cache_out'", "'present.0.key_scale'"),
        ("layer1", "output 'k_scale_cache_out'", "'present.1.key_scale'")}
    # names from genai_config (as pagedkit's config writer spells them)
    cfg = {"model": {"decoder": {"inputs": {"past_key_scale_names": "ks.%d"},
                                 "outputs": {"present_key_scale_names": "ks_out.%d"}}}}
    issues = only(validate_model(two_layer_model(paged_case("int8_per_token_f32_scales").model()),
                                 genai_config=cfg), "MODEL-cache-name")
    assert {i.expected for i in issues} == {"a graph input named 'ks.{i}'"}
