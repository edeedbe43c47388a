"""Schema registration and §16 type/shape inference through onnx.shape_inference (strict mode).

Oracles: the construction parameters of each model (num_heads, head sizes, cache shapes), onnxruntime's
own GroupQueryAttention shape inference (its C++ inference, read back from an InferenceSession's output
metadata on CPU) and onnxruntime.tools.symbolic_shape_infer's PagedAttention handler (run with our onnx
schemas removed, so it cannot see our inference).
"""

from __future__ import annotations

import random
from contextlib import contextmanager

import numpy as np
import onnx
import pytest
from onnx import TensorProto as TP
from onnx import helper

from pagedkit.validators import GROUP_QUERY_ATTENTION, PAGED_ATTENTION, infer_node_outputs, register_schemas
from pagedkit.validators.nodeview import dtype_from_type_str

F16, BF16, F32, I8, U8, I32, FP8 = TP.FLOAT16, TP.BFLOAT16, TP.FLOAT, TP.INT8, TP.UINT8, TP.INT32, TP.FLOAT8E4M3FN
register_schemas()


# ---------------------------------------------------------------------------------------------- helpers

def make_model(op, inputs, outputs, attrs, *, initializers=(), declared=None, extra_nodes=(), extra_inputs=()):
    """Single-node model: graph inputs named after the contract inputs (name -> (elem, shape)),
    outputs by index ('' = unused), graph outputs declared as given (name -> (elem, shape) or None =
    untyped graph output)."""
    contract = {"PagedAttention": PAGED_ATTENTION, "GroupQueryAttention": GROUP_QUERY_ATTENTION}[op]
    init_names = {t.name for t in initializers}
    names = [p.name if p.name in inputs or p.name in init_names else "" for p in contract.inputs]
    while names and not names[-1]:
        names.pop()
    node = helper.make_node(op, names, list(outputs), domain="com.microsoft", **attrs)
    graph_inputs = [helper.make_tensor_value_info(n, *t) for n, t in {**inputs, **dict(extra_inputs)}.items()]
    graph_outputs = []
    for name, t in (declared or {}).items():
        graph_outputs.append(onnx.ValueInfoProto(name=name) if t is None else helper.make_tensor_value_info(name, *t))
    graph = helper.make_graph([node, *extra_nodes], "g", graph_inputs, graph_outputs, initializer=list(initializers))
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def inferred(model, strict=True):
    """{tensor name: (elem or None, shape tuple with int / str / None dims)} after onnx inference."""
    m = onnx.shape_inference.infer_shapes(model, strict_mode=strict)
    out = {}
    for vi in list(m.graph.value_info) + list(m.graph.output):
        tt = vi.type.tensor_type
        shape = None
        if tt.HasField("shape"):  # onnx names an unknown output dim with a fresh 'unk__N' symbol: None here
            shape = tuple(d.dim_value if d.HasField("dim_value") else
                          (None if d.dim_param.startswith("unk__") else d.dim_param or None) for d in tt.shape.dim)
        out[vi.name] = (tt.elem_type or None, shape)
    return out


def paged_inputs(h, hkv, d, *, t="T", nb="NB", bs=16, b="B", mb="MB", dtype=F16, cache=F16, cache_d=None,
                 packed=False, latent=False):
    cache_d = d if cache_d is None else cache_d
    ins = {"query": (dtype, [t, (h + 2 * hkv) * d if packed else h * d])}
    if latent:
        ins["key"] = (dtype, [t, d])
    elif not packed:
        ins |= {"key": (dtype, [t, hkv * d]), "value": (dtype, [t, hkv * d])}
    ins["key_cache"] = (cache, [nb, bs, hkv, cache_d])
    if not latent:
        ins["value_cache"] = (cache, [nb, bs, hkv, cache_d])
    ins |= {"cumulative_sequence_length": (I32, ["B1"]), "past_seqlens": (I32, [b]), "block_table": (I32, [b, mb])}
    return ins


PA_OUTS = ["output", "key_cache_out", "value_cache_out"]


# ------------------------------------------------------------------------------------------ schemas

def test_register_schemas_is_idempotent():
    assert register_schemas() == []  # registered at import of this module already
    assert register_schemas() == []
    for c in (PAGED_ATTENTION, GROUP_QUERY_ATTENTION):
        assert onnx.defs.has(c.name, "com.microsoft")
        assert onnx.defs.get_schema(c.name, 1, "com.microsoft").has_type_and_shape_inference_function


@pytest.mark.parametrize("contract", [PAGED_ATTENTION, GROUP_QUERY_ATTENTION], ids=lambda c: c.name)
def test_schema_is_built_from_the_contract(contract):
    s = onnx.defs.get_schema(contract.name, contract.since_version, contract.domain)
    opt = onnx.defs.OpSchema.FormalParameterOption
    assert [(p.name, p.type_str, p.option == opt.Optional) for p in s.inputs] == \
        [(p.name, p.type_param, p.optional) for p in contract.inputs]
    assert [(p.name, p.type_str, p.option == opt.Optional) for p in s.outputs] == \
        [(p.name, p.type_param, p.optional) for p in contract.outputs]
    assert {tc.type_param_str: sorted(tc.allowed_type_strs) for tc in s.type_constraints} == \
        {k: sorted(v) for k, v in contract.type_constraints.items()}
    assert sorted(s.attributes) == sorted(a.name for a in contract.attributes)
    for a in contract.attributes:
        sa = s.attributes[a.name]
        assert sa.required == a.required, a.name
        if a.default is None:
            assert not sa.default_value.name, a.name  # no default
        else:
            got = helper.get_attribute_value(sa.default_value)
            got = got.decode() if isinstance(got, bytes) else got
            assert got == pytest.approx(a.default) if a.type == "float" else got == a.default, a.name


# ------------------------------------------------------------------------------- PagedAttention, onnx

@pytest.mark.parametrize("dtype", [F16, BF16])
def test_llama_like_unpacked_and_downstream_matmul(dtype):
    h, hkv, d = 32, 8, 128
    w = helper.make_node("MatMul", ["output", "w_o"], ["y"])
    m = make_model("PagedAttention", paged_inputs(h, hkv, d, dtype=dtype, cache=dtype), PA_OUTS,
                   dict(num_heads=h, kv_num_heads=hkv), extra_nodes=[w], extra_inputs=[("w_o", (dtype, [h * d, 4096]))],
                   declared={"y": None, "key_cache_out": None, "value_cache_out": None})
    got = inferred(m)
    assert got["output"] == (dtype, ("T", h * d))
    assert got["y"] == (dtype, ("T", 4096))
    assert got["key_cache_out"] == got["value_cache_out"] == (dtype, ("NB", 16, hkv, d))


def test_unpacked_symbolic_hidden_dim_stays_symbolic():
    ins = paged_inputs(32, 8, 128)
    ins["query"] = (F16, ["T", "HQ"])
    got = inferred(make_model("PagedAttention", ins, PA_OUTS, dict(num_heads=32, kv_num_heads=8)))
    assert got["output"] == (F16, ("T", "HQ"))


def test_packed_qkv_width():
    h, hkv, d = 32, 8, 128
    m = make_model("PagedAttention", paged_inputs(h, hkv, d, packed=True), PA_OUTS,
                   dict(num_heads=h, kv_num_heads=hkv, do_rotary=0))
    got = inferred(m)
    assert got["output"] == (F16, ("T", h * d))
    assert got["key_cache_out"] == (F16, ("NB", 16, hkv, d))


def test_packed_qkv_symbolic_width_never_fails():
    ins = paged_inputs(32, 8, 128, packed=True)
    ins["query"] = (F16, ["T", "QKV"])
    got = inferred(make_model("PagedAttention", ins, PA_OUTS, dict(num_heads=32, kv_num_heads=8)))
    assert got["output"] == (F16, ("T", None))  # width unknown, token dim kept


def _mla_model(query_width=16 * 576, declared_out=None, cache=F16):
    h, d = 16, 576
    ins = paged_inputs(h, 1, d, bs=64, latent=True, cache=cache)
    ins["query"] = (F16, ["T", query_width])
    ins |= {"cos_cache": (F16, ["N", 32]), "sin_cache": (F16, ["N", 32])}
    attrs = dict(num_heads=h, kv_num_heads=1, kv_cache_layout="LATENT", v_head_size=512, scale=0.0416,
                 rotary_offset=512, do_rotary=1)
    w = helper.make_node("MatMul", ["output", "w_o"], ["y"])
    return make_model("PagedAttention", ins, ["output", "key_cache_out"], attrs, extra_nodes=[w],
                      extra_inputs=[("w_o", (F16, [h * 512, 7168]))],
                      declared={"y": None, "key_cache_out": None, **({"output": declared_out} if declared_out else {})})


def test_deepseek_v3_mla_latent_output_width():
    got = inferred(_mla_model())
    assert got["output"] == (F16, ("T", 16 * 512))
    assert got["y"] == (F16, ("T", 7168))
    assert got["key_cache_out"] == (F16, ("NB", 64, 1, 576))


def test_mla_with_symbolic_query_width_still_knows_output_width():
    assert inferred(_mla_model(query_width="QW"))["output"] == (F16, ("T", 16 * 512))


def test_latent_without_v_head_size_propagates_query_shape():
    ins = paged_inputs(16, 1, 576, bs=64, latent=True)
    got = inferred(make_model("PagedAttention", ins, ["output", "key_cache_out"],
                              dict(num_heads=16, kv_num_heads=1, kv_cache_layout="LATENT")))
    assert got["output"] == (F16, ("T", 16 * 576))


def test_latent_value_cache_out_without_value_cache_is_skipped():
    """value_cache (input 4) is optional: a named output 2 without it must not crash inference."""
    ins = paged_inputs(16, 1, 576, bs=64, latent=True)
    m = make_model("PagedAttention", ins, PA_OUTS, dict(num_heads=16, kv_num_heads=1, kv_cache_layout="LATENT",
                                                       v_head_size=512, scale=0.05))
    got = inferred(m)
    assert got["output"] == (F16, ("T", 8192))
    assert "value_cache_out" not in got


@pytest.mark.parametrize("cache,cache_dtype,cache_d", [(I8, "int8", 128), (FP8, "float8e4m3fn", 128), (U8, "int4", 64)])
def test_quantized_caches_type_cache_outputs_from_cache_inputs(cache, cache_dtype, cache_d):
    h, hkv, d = 32, 8, 128
    ins = paged_inputs(h, hkv, d, cache=cache, cache_d=cache_d) | {"k_scale": (F32, [1]), "v_scale": (F32, [1])}
    attrs = dict(num_heads=h, kv_num_heads=hkv, k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR",
                 k_cache_dtype=cache_dtype, v_cache_dtype=cache_dtype)
    got = inferred(make_model("PagedAttention", ins, PA_OUTS, attrs,
                              declared={"output": None, "key_cache_out": None, "value_cache_out": None}))
    assert got["output"] == (F16, ("T", h * d))
    assert got["key_cache_out"] == got["value_cache_out"] == (cache, ("NB", 16, hkv, cache_d))


@pytest.mark.parametrize("scale_dtype", [F16, F32])
def test_per_token_scale_cache_outputs(scale_dtype):
    h, hkv, d = 8, 2, 64
    ins = paged_inputs(h, hkv, d, cache=I8, nb=40) | {
        "k_scale_cache": (scale_dtype, [40, 16, hkv]), "v_scale_cache": (scale_dtype, [40, 16, hkv])}
    attrs = dict(num_heads=h, kv_num_heads=hkv, k_quant_type="PER_TOKEN", v_quant_type="PER_TOKEN",
                 k_cache_dtype="int8", v_cache_dtype="int8", qk_rotation=1)
    outs = PA_OUTS + ["k_scale_cache_out", "v_scale_cache_out"]
    got = inferred(make_model("PagedAttention", ins, outs, attrs, declared={o: None for o in outs}))
    assert got["key_cache_out"] == (I8, (40, 16, hkv, d))
    assert got["k_scale_cache_out"] == got["v_scale_cache_out"] == (scale_dtype, (40, 16, hkv))
    assert got["output"] == (F16, ("T", h * d))


@pytest.mark.parametrize("declared_qk", [F32, F16, BF16])
def test_output_qk_with_empty_names_at_unused_positions(declared_qk):
    h, hkv, d = 32, 8, 128
    ins = paged_inputs(h, hkv, d, mb=8)
    m = make_model("PagedAttention", ins, ["output", "", "", "", "", "output_qk"],
                   dict(num_heads=h, kv_num_heads=hkv, qk_output=1),
                   declared={"output": None, "output_qk": (declared_qk, None)})
    got = inferred(m)
    assert got["output_qk"] == (declared_qk, (h, "T", 8 * 16))
    assert got["output"] == (F16, ("T", h * d))


def test_output_qk_symbolic_capacity_is_unknown_not_wrong():
    ins = paged_inputs(4, 2, 64, mb="MB")
    m = make_model("PagedAttention", ins, ["output", "", "", "", "", "output_qk"],
                   dict(num_heads=4, kv_num_heads=2, qk_output=2), declared={"output_qk": (F32, None)})
    assert inferred(m)["output_qk"] == (F32, (4, "T", None))


def test_declared_cache_output_type_mismatch_raises_in_strict_mode():
    ins = paged_inputs(32, 8, 128, cache=I8) | {"k_scale": (F32, [1]), "v_scale": (F32, [1])}
    attrs = dict(num_heads=32, kv_num_heads=8, k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR")
    m = make_model("PagedAttention", ins, PA_OUTS, attrs, declared={"key_cache_out": (F16, None)})
    with pytest.raises(onnx.shape_inference.InferenceError, match="elem type"):
        inferred(m)
    ok = make_model("PagedAttention", ins, PA_OUTS, attrs, declared={"key_cache_out": (I8, None)})
    assert inferred(ok)["key_cache_out"][0] == I8


def test_declared_output_width_mismatch_raises_in_strict_mode():
    with pytest.raises(onnx.shape_inference.InferenceError):
        inferred(_mla_model(declared_out=(F16, ["T", 16 * 576])))
    assert inferred(_mla_model(declared_out=(F16, ["T", 16 * 512])))["output"] == (F16, ("T", 8192))


def test_random_paged_configs_match_construction():
    """Seeded random head layouts, through onnx strict inference, against the widths they were built with."""
    rng = random.Random(1234)
    for _ in range(40):
        hkv = rng.choice([1, 2, 4, 8])
        h = hkv * rng.choice([1, 2, 4])
        d = rng.choice([64, 80, 128])
        mode = rng.choice(["unpacked", "packed", "latent"])
        t = rng.choice(["T", rng.randint(1, 64)])
        if mode == "latent":
            h, hkv, v = rng.choice([4, 16]), 1, rng.choice([0, d // 2])
            ins = paged_inputs(h, 1, d, t=t, latent=True)
            attrs = dict(num_heads=h, kv_num_heads=1, kv_cache_layout="LATENT", scale=0.1)
            if v:
                attrs["v_head_size"] = v
            outs, want = ["output", "key_cache_out"], h * (v or d)
        else:
            ins = paged_inputs(h, hkv, d, t=t, packed=mode == "packed")
            attrs, outs, want = dict(num_heads=h, kv_num_heads=hkv), PA_OUTS, h * d
        got = inferred(make_model("PagedAttention", ins, outs, attrs))
        assert got["output"] == (F16, (t, want)), (mode, h, hkv, d)
        assert got["key_cache_out"] == (F16, ("NB", 16, hkv, d))


# --------------------------------------------------------------------------------- GQA, onnx

def gqa_inputs(h, hkv, d, *, b="B", s="S", past=64, dtype=F16, cache=None, cache_d=None, packed=False, with_past=True):
    cache = dtype if cache is None else cache
    cache_d = d if cache_d is None else cache_d
    ins = {"query": (dtype, [b, s, (h + 2 * hkv) * d if packed else h * d])}
    if not packed:
        ins |= {"key": (dtype, [b, s, hkv * d]), "value": (dtype, [b, s, hkv * d])}
    if with_past:
        ins |= {"past_key": (cache, [b, hkv, past, cache_d]), "past_value": (cache, [b, hkv, past, cache_d])}
    ins["seqlens_k"] = (I32, [b])
    return ins


def total_init(n):
    return helper.make_tensor("total_sequence_length", I32, [], [n])


GQA_OUTS = ["output", "present_key", "present_value"]


@pytest.mark.parametrize("total,want", [(40, 64), (100, 100)])
def test_gqa_present_length_is_max_of_past_and_total(total, want):
    m = make_model("GroupQueryAttention", gqa_inputs(32, 8, 128), GQA_OUTS, dict(num_heads=32, kv_num_heads=8),
                   initializers=[total_init(total)], declared={o: None for o in GQA_OUTS})
    got = inferred(m)
    assert got["output"] == (F16, ("B", "S", 4096))
    assert got["present_key"] == got["present_value"] == (F16, ("B", 8, want, 128))


def test_gqa_packed_and_unknown_total():
    ins = gqa_inputs(16, 4, 64, packed=True, past="P") | {"total_sequence_length": (I32, [1])}
    got = inferred(make_model("GroupQueryAttention", ins, GQA_OUTS, dict(num_heads=16, kv_num_heads=4)))
    assert got["output"] == (F16, ("B", "S", 16 * 64))
    assert got["present_key"] == (F16, ("B", 4, None, 64))  # past + new or shared capacity: unknown


def test_gqa_int4_cache_types_from_past():
    ins = gqa_inputs(8, 2, 64, cache=U8, cache_d=32) | {"k_scale": (F32, [1]), "v_scale": (F32, [1])}
    attrs = dict(num_heads=8, kv_num_heads=2, kv_cache_bit_width=4, k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR")
    got = inferred(make_model("GroupQueryAttention", ins, GQA_OUTS, attrs, initializers=[total_init(10)],
                              declared={o: None for o in GQA_OUTS}))
    assert got["present_key"] == got["present_value"] == (U8, ("B", 2, 64, 32))
    assert got["output"] == (F16, ("B", "S", 8 * 64))


def test_gqa_sliding_window_cache_keeps_past_capacity():
    attrs = dict(num_heads=8, kv_num_heads=2, local_window_size=32, sliding_window_cache=1)
    got = inferred(make_model("GroupQueryAttention", gqa_inputs(8, 2, 64, past=32), GQA_OUTS, attrs,
                              initializers=[total_init(500)]))
    assert got["present_key"] == (F16, ("B", 2, 32, 64))


def test_gqa_no_past_and_output_qk():
    ins = gqa_inputs(8, 2, 64, with_past=False)
    outs = GQA_OUTS + ["output_qk"]
    got = inferred(make_model("GroupQueryAttention", ins, outs, dict(num_heads=8, kv_num_heads=2, qk_output=1),
                              initializers=[total_init(12)], declared={o: None for o in outs}))
    assert got["present_key"] == (F16, ("B", 2, 12, 64))
    assert got["output_qk"] == (F16, ("B", 8, "S", 12))


# ------------------------------------------------------------------------- against onnxruntime

GQA_ORACLE_CASES = {
    "unpacked_past_total": (gqa_inputs(4, 2, 16, dtype=F32, past=8), dict(num_heads=4, kv_num_heads=2), 11, GQA_OUTS),
    "packed_past_total": (gqa_inputs(4, 2, 16, dtype=F32, past=32, packed=True), dict(num_heads=4, kv_num_heads=2), 20,
                          GQA_OUTS),
    "no_past": (gqa_inputs(4, 1, 16, dtype=F32, with_past=False), dict(num_heads=4, kv_num_heads=1), 7, GQA_OUTS),
    "window_cache": (gqa_inputs(4, 2, 16, dtype=F32, past=16), dict(num_heads=4, kv_num_heads=2, local_window_size=16,
                     sliding_window_cache=1), 40, GQA_OUTS),
}


@pytest.mark.parametrize("case", sorted(GQA_ORACLE_CASES))
def test_gqa_matches_onnxruntime_cpp_inference(case):
    """onnxruntime's C++ GQA inference (read from a CPU session's output metadata) agrees exactly."""
    ort = pytest.importorskip("onnxruntime")
    ins, attrs, total, outs = GQA_ORACLE_CASES[case]
    m = make_model("GroupQueryAttention", ins, outs, attrs, initializers=[total_init(total)],
                   declared={o: (F32, None) for o in outs})
    ours = inferred(m)
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    for o in sess.get_outputs():
        assert o.type == "tensor(float)"
        assert ours[o.name] == (F32, tuple(o.shape)), o.name


@contextmanager
def _our_schemas_removed():
    for c in (PAGED_ATTENTION, GROUP_QUERY_ATTENTION):
        onnx.defs.deregister_schema(c.name, c.since_version, c.domain)
    try:
        yield
    finally:
        assert register_schemas() == ["PagedAttention", "GroupQueryAttention"]


PA_ORACLE_CASES = {
    "unpacked": (paged_inputs(32, 8, 128), dict(num_heads=32, kv_num_heads=8), PA_OUTS),
    "packed": (paged_inputs(8, 2, 64, packed=True), dict(num_heads=8, kv_num_heads=2), PA_OUTS),
    "int8": (paged_inputs(8, 2, 64, cache=I8) | {"k_scale": (F32, [1]), "v_scale": (F32, [1])},
             dict(num_heads=8, kv_num_heads=2, k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR"), PA_OUTS),
    "latent": (paged_inputs(16, 1, 576, bs=64, latent=True, cache=FP8),
               dict(num_heads=16, kv_num_heads=1, kv_cache_layout="LATENT", v_head_size=512, scale=0.04),
               ["output", "key_cache_out"]),
}


@pytest.mark.parametrize("case", sorted(PA_ORACLE_CASES))
def test_paged_matches_onnxruntime_symbolic_shape_infer(case):
    ssi = pytest.importorskip("onnxruntime.tools.symbolic_shape_infer")
    ins, attrs, outs = PA_ORACLE_CASES[case]
    m = make_model("PagedAttention", ins, outs, attrs, declared={o: None for o in outs})
    ours = inferred(m)
    with _our_schemas_removed():
        theirs_model = ssi.SymbolicShapeInference.infer_shapes(m, auto_merge=False, guess_output_rank=False)
    theirs = {vi.name: (vi.type.tensor_type.elem_type, tuple(d.dim_value if d.HasField("dim_value") else d.dim_param
                                                           for d in vi.type.tensor_type.shape.dim))
              for vi in list(theirs_model.graph.value_info) + list(theirs_model.graph.output)}
    for name in outs:
        assert ours[name] == theirs[name], name


# ----------------------------------------------------------------------- pure infer_node_outputs

def test_infer_node_outputs_without_onnx_by_name_and_index():
    h, hkv, d = 32, 8, 128
    types = {k: (e, tuple(s)) for k, (e, s) in paged_inputs(h, hkv, d, cache=I8, mb=4).items()}
    res = infer_node_outputs("PagedAttention", {"num_heads": h, "kv_num_heads": hkv}, types)
    assert res[0] == (F16, ("T", h * d))
    assert res[1] == res[2] == (I8, ("NB", 16, hkv, d))
    assert res[3] == res[4] == (None, None)  # no scale caches
    assert res[5] == (F32, (h, "T", 64))  # float by default
    by_index = [types.get(p.name) for p in PAGED_ATTENTION.inputs]
    res2 = infer_node_outputs("PagedAttention", {"num_heads": h, "kv_num_heads": hkv}, by_index,
                              outputs=["output", 5], declared_output_types={"output_qk": BF16})
    assert res2 == {0: res[0], 5: (BF16, (h, "T", 64))}
    # a declared type outside QK does not override the default
    res3 = infer_node_outputs("PagedAttention", {"num_heads": h, "kv_num_heads": hkv}, types, outputs=[5],
                              declared_output_types={5: I8})
    assert res3[5][0] == dtype_from_type_str("tensor(float)")


def test_infer_node_outputs_gqa_uses_total_sequence_length_value():
    types = {k: (e, tuple(s)) for k, (e, s) in gqa_inputs(8, 2, 64, past=16, b=2, s=3).items()}
    types["total_sequence_length"] = (I32, ())
    res = infer_node_outputs("GroupQueryAttention", {"num_heads": 8, "kv_num_heads": 2}, types,
                             input_values={"total_sequence_length": np.array(19, np.int32)})
    assert res[0] == (F16, (2, 3, 512))
    assert res[1] == res[2] == (F16, (2, 2, 19, 64))
    assert res[3] == (F16, (2, 8, 3, 19))
    res = infer_node_outputs("GroupQueryAttention", {"num_heads": 8, "kv_num_heads": 2}, types)
    assert res[1] == (F16, (2, 2, None, 64))


def test_infer_node_outputs_rejects_unknown_names():
    with pytest.raises(ValueError, match="no input named 'keys'"):
        infer_node_outputs("PagedAttention", {"num_heads": 1, "kv_num_heads": 1}, {"keys": (F16, (1, 8))})
    with pytest.raises(ValueError, match="no output named 'qk'"):
        infer_node_outputs("PagedAttention", {"num_heads": 1, "kv_num_heads": 1}, {}, outputs=["qk"])
    with pytest.raises(KeyError, match="no contract"):
        infer_node_outputs("Attention", {}, {})


def test_infer_node_outputs_never_raises_on_bad_attributes_or_ranks():
    types = {"query": (F16, ("T", 100, 3)), "key_cache": (F16, None)}
    res = infer_node_outputs("PagedAttention", {"num_heads": 0, "kv_cache_layout": b"LATENT", "v_head_size": "x"},
                             types)
    assert res[0] == (F16, None)
    res = infer_node_outputs("PagedAttention", {"num_heads": 3, "kv_num_heads": 1},
                             {"query": (F16, ("T", 100))})  # packed, 100 % (3 + 2) == 0 -> head 20
    assert res[0] == (F16, ("T", 60))
    res = infer_node_outputs("PagedAttention", {"num_heads": 3, "kv_num_heads": 2},
                             {"query": (F16, ("T", 100))})  # 100 % 7 != 0 -> unknown width
    assert res[0] == (F16, ("T", None))


# ------------------------------- every design configuration of tests/nodes.py (expected shapes written there)

def _config_cases():
    from nodes import GQA_CONFIGS, PAGED_CONFIGS, gqa_case, paged_case

    return [paged_case(n) for n in PAGED_CONFIGS] + [gqa_case(n) for n in GQA_CONFIGS]


@pytest.mark.parametrize("case", _config_cases(), ids=lambda c: f"{c.op_type}-{c.name}")
def test_every_design_configuration_infers_its_expected_outputs(case):
    """Integer inputs as initializers (so total_sequence_length is a constant); outputs declared untyped
    except PagedAttention's output_qk, whose type the graph must declare."""
    node, info = case.node()
    consts = case.constants()
    inits = [onnx.numpy_helper.from_array(consts[n], n) for n in node.input if n in consts]
    ins = [helper.make_tensor_value_info(n, *info[n]) for n in node.input if n and n not in consts]
    outs = [helper.make_tensor_value_info(n, TP.FLOAT, None) if (n == "output_qk" and case.op_type == "PagedAttention")
            else onnx.ValueInfoProto(name=n) for n in node.output if n]
    graph = helper.make_graph([node], "g", ins, outs, initializer=inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    got = inferred(model)
    for name in case.outputs:
        assert got[name] == case.out_info[name], name
    # the pure function agrees, given the same types and constants
    res = infer_node_outputs(case.op_type, case.attrs, {n: info[n] for n in case.inputs}, outputs=case.outputs,
                             input_values=consts)
    assert {case.contract.outputs[i].name: t for i, t in res.items()} == {n: case.out_info[n] for n in case.outputs}


# ------------------------------------------------ whole models written by onnxruntime-genai's builder

@pytest.fixture(scope="module")
def genai_root(tmp_path_factory):
    return tmp_path_factory.mktemp("genai-infer")


@pytest.mark.slow
@pytest.mark.parametrize("layout", ["paged", "gqa"])
@pytest.mark.parametrize("family", ["llama", "qwen3", "gemma2", "gpt_oss"])
def test_genai_builder_models_infer_through_every_layer(genai_root, family, layout):
    """Paged models pass strict inference end to end (attention outputs, caches, logits). GQA models are
    run non-strict: onnx's strict mode rejects one of the builder's own Constant nodes (declared rank 0,
    inferred rank 1), with or without our schemas."""
    pytest.importorskip("onnxruntime_genai")
    from genai_models import BuilderFailed, build_genai_model

    try:
        folder = build_genai_model(family, layout, genai_root)
    except BuilderFailed as exc:
        pytest.skip(f"onnxruntime-genai builder could not build {family}/{layout}: {exc}")
    model = onnx.load(str(folder / "model.onnx"))
    got = inferred(model, strict=layout == "paged")
    op = "PagedAttention" if layout == "paged" else "GroupQueryAttention"
    nodes = [n for n in model.graph.node if n.op_type == op]
    assert len(nodes) == 2
    tokens = ("num_tokens",) if layout == "paged" else ("batch_size", "sequence_length")
    for n in nodes:
        h = helper.get_attribute_value(next(a for a in n.attribute if a.name == "num_heads"))
        assert got[n.output[0]] == (F16 if layout == "paged" else F32, (*tokens, h * 16))
        assert got[n.output[1]][0] == got[n.output[2]][0] == (F16 if layout == "paged" else F32)
    assert got["logits"] == (F16 if layout == "paged" else F32, (*tokens, 128))
