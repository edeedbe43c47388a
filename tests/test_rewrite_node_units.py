"""Unit checks of the node-level rule sets (pagedkit/rewriters/node_rules/: __init__.py node_pass, base.py,
to_paged.py, to_gqa.py) on single nodes built with onnx-ir, rewritten node by node.

- node_pass: the direction picks the source operator (GroupQueryAttention for to="paged", PagedAttention for
  to="gqa") and nothing else of the com.microsoft domain; a refused node does not stop the pass.
- every attribute both operators spell alike is carried (with non-default values), causal <-> is_causal,
  defaults are not written, the node is renamed after the target operator.
- quantized caches, GQA -> PagedAttention: the checks (cache dtype / kv_cache_bit_width, missing scales, one side
  quantized) refuse by reason naming the attribute and the cache dtype; the scales reach the PagedAttention node in
  its canonical layouts (PER_TENSOR (1,), PER_CHANNEL (kv_num_heads, 1, head_size)): a canonical scale is passed as
  it is, any other layout is reshaped, and onnxruntime CPU evaluates the helper nodes against numpy.
- quantized caches, PagedAttention -> GQA: one kv_cache_bit_width (k / v cache dtypes of different widths are
  refused), the rule reported only where it applies.
- output_qk: the padded-batch refusal (token_rows or output_shape), its element type restored both ways.
- cast_to (PagedAttention -> GQA): the GQA node runs in float32 in onnxruntime CPU's GroupQueryAttention and the
  output comes back in the source's float16, matching pagedkit's PagedAttention on the original node.
- the created node is validated with every input's type known, also after absent inputs (packed QKV).
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir
import pytest

from pagedkit.rewriters.node_rules import (
    GQA_TO_PAGED, PAGED_TO_GQA, GqaIO, PagedIO, Refused, gqa_node_to_paged, node_pass, paged_node_to_gqa,
)
from pagedkit.rewriters.node_rules.base import SAME_ATTRS, _dims, _dtype
from pagedkit.validators.contract import GROUP_QUERY_ATTENTION as GQA, PAGED_ATTENTION as PA

ort = pytest.importorskip("onnxruntime")

F16, F32, I32, I64 = ir.DataType.FLOAT16, ir.DataType.FLOAT, ir.DataType.INT32, ir.DataType.INT64
I8, U8 = ir.DataType.INT8, ir.DataType.UINT8
H, HKV, D, S = 4, 2, 16, 3


def val(name, dt=F16, shape=None) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(dt) if dt is not None else None,
                    shape=ir.Shape(shape) if shape is not None else None)


def _node(contract, values: dict, attrs: dict, outputs, name: str) -> ir.Node:
    ins = [values.get(n) for n in contract.input_names]
    while ins and ins[-1] is None:
        ins.pop()
    outs = [o if isinstance(o, ir.Value) else ir.Value(name=o or "", type=ir.TensorType(F16) if o else None)
            for o in outputs]
    return ir.Node("com.microsoft", contract.name, ins, ir.convenience.convert_attributes(attrs), outputs=outs,
                   name=name)


def gqa_node(attrs=None, extra=(), packed=False, outputs=("output", "present_key", "present_value"),
             name="layer/GroupQueryAttention", prefix="") -> ir.Node:
    """A B = 1, S = 3 fp16 GQA node with a past of 8 (H 4, kv 2, head_size 16); extra: more input Values."""
    p = prefix
    v = dict(query=val(p + "query", F16, [1, S, (H + 2 * HKV) * D if packed else H * D]),
             past_key=val(p + "past_key", F16, [1, HKV, 8, D]), past_value=val(p + "past_value", F16, [1, HKV, 8, D]),
             seqlens_k=val(p + "seqlens_k", I32, [1]), total_sequence_length=val(p + "total_len", I32, [1]))
    if not packed:
        v.update(key=val(p + "key", F16, [1, S, HKV * D]), value=val(p + "value", F16, [1, S, HKV * D]))
    v.update({e.name.removeprefix(p): e for e in extra})
    outs = [p + o if isinstance(o, str) and o else o for o in outputs]
    return _node(GQA, v, dict(num_heads=H, kv_num_heads=HKV) | (attrs or {}), outs, name)


def paged_node(attrs=None, extra=(), cache=F16, outputs=("output", "key_cache_out", "value_cache_out"),
               name="layer/PagedAttention", prefix="") -> ir.Node:
    """A packed 3-token fp16 PagedAttention node (H 4, kv 2, head_size 16, block 16); extra: more input Values."""
    p = prefix
    dc = D // 2 if cache == U8 else D
    v = dict(query=val(p + "query", F16, [S, H * D]), key=val(p + "key", F16, [S, HKV * D]),
             value=val(p + "value", F16, [S, HKV * D]), key_cache=val(p + "key_cache", cache, ["nb", 16, HKV, dc]),
             value_cache=val(p + "value_cache", cache, ["nb", 16, HKV, dc]),
             cumulative_sequence_length=val(p + "csl", I32, [2]), past_seqlens=val(p + "past", I32, [1]),
             block_table=val(p + "bt", I32, [1, 4]))
    v.update({e.name.removeprefix(p): e for e in extra})
    outs = [p + o if isinstance(o, str) and o else o for o in outputs]
    return _node(PA, v, dict(num_heads=H, kv_num_heads=HKV) | (attrs or {}), outs, name)


def paged_io(cache=F16, block_table=I32, key_cache_shape=("nb", 16, HKV, D), value_cache=None, **kw) -> PagedIO:
    shape = list(key_cache_shape) if key_cache_shape is not None else None
    vdt = cache if value_cache is None else value_cache
    return PagedIO(val("kc", cache, shape), val("vc", vdt, shape), val("csl", I32, [2]), val("past", I32, [1]),
                   val("bt", block_table, [1, 4]), "kco", "vco", **kw)


def gqa_io(past=F16, **kw) -> GqaIO:
    return GqaIO(val("pk", past, [1, HKV, 8, D]), val("pv", past, [1, HKV, 8, D]), "prk", "prv", val("sk", I32, [1]),
                 val("tot", I32, [1]), val("bs", I64, [2]), **kw)


def attention(nodes, op: str) -> ir.Node:
    found = [n for n in nodes if n.op_type == op]
    assert len(found) == 1, [n.op_type for n in nodes]
    return found[0]


def attrs_of(node: ir.Node) -> dict:
    return {k: (a.value.decode() if isinstance(a.value, bytes) else a.value) for k, a in node.attributes.items()}


def inp(node: ir.Node, contract, name: str) -> ir.Value | None:
    i = contract.input_names.index(name)
    return node.inputs[i] if i < len(node.inputs) else None


# ------------------------------------------------------------------------------------------------
# base.py helpers
# ------------------------------------------------------------------------------------------------

def test_dtype_and_dims_of_absent_or_untyped_values():
    """_dtype / _dims take None (an absent optional input) and values without type / shape."""
    assert _dtype(None) is None and _dims(None) is None
    assert _dtype(ir.Value(name="x")) is None and _dims(ir.Value(name="x")) is None
    assert _dtype(val("x", I8, [2])) == I8
    assert _dims(val("x", F16, [2, "n", None, 3])) == (2, None, None, 3)


# ------------------------------------------------------------------------------------------------
# node_pass: direction and source selection
# ------------------------------------------------------------------------------------------------

def _mixed_graph():
    """One GQA node, one PagedAttention node and one other com.microsoft node (SkipSimplifiedLayerNormalization,
    whose name sorts after both attention operators), each with its own inputs and a graph output."""
    g_node = gqa_node(name="gqa", prefix="g_")
    p_node = paged_node(name="paged", prefix="p_")
    x, skip, gamma = val("x", F16, [1, S, 64]), val("skip", F16, [1, S, 64]), val("gamma", F16, [64])
    ln = ir.Node("com.microsoft", "SkipSimplifiedLayerNormalization", [x, skip, gamma],
                 ir.convenience.convert_attributes(dict(epsilon=1e-6)), num_outputs=1, name="ln")
    ln.outputs[0].name = "ln_out"
    inputs = [v for n in (g_node, p_node, ln) for v in n.inputs if v is not None]
    outputs = [g_node.outputs[0], p_node.outputs[0], ln.outputs[0]]
    graph = ir.Graph(inputs, outputs, nodes=[g_node, p_node, ln], opset_imports={"": 21, "com.microsoft": 1})
    return ir.Model(graph, ir_version=10)


@pytest.mark.parametrize("to", ["paged", "gqa"])
def test_node_pass_converts_only_the_source_operator(to):
    m = _mixed_graph()
    extra = [paged_io(), gqa_io()]
    seen = []

    def io_for(node):
        seen.append(node.name)
        return extra[0] if to == "paged" else extra[1]
    report = node_pass(m, to, io_for)
    src, dst, other = ("gqa", "paged", "PagedAttention") if to == "paged" else ("paged", "gqa", "GroupQueryAttention")
    assert seen == [src] and report.changed == [src] and report.skipped == [], (seen, report.skipped)
    ops = sorted(n.op_type for n in m.graph)
    assert ops.count(other) == 2 and "SkipSimplifiedLayerNormalization" in ops
    assert next(n for n in m.graph if n.name == "ln").op_type == "SkipSimplifiedLayerNormalization"
    assert next(n for n in m.graph if n.name == dst).op_type == other  # the other attention node untouched
    # the converted node's output keeps its graph-output name; B = 1 without cast_to: [T, W] back to [1, T, W] by
    # an Unsqueeze (-> paged) / [B, S, W] to [T, W] by a Reshape (-> gqa), no Cast
    out = m.graph.outputs[0 if to == "paged" else 1]
    assert out.name == f"{src[0]}_output" and out.producer().op_type == ("Unsqueeze" if to == "paged" else "Reshape")
    assert out.producer().inputs[0].producer().op_type == other


def test_node_pass_rejects_an_unknown_direction():
    with pytest.raises(ValueError, match="'paged' or 'gqa', got 'Paged'"):
        node_pass(_mixed_graph(), "Paged", lambda n: None)


def test_node_pass_goes_on_after_a_refused_node():
    """The first node is refused (attention_bias with softcap), the second converted: both reported."""
    bias = val("a_attention_bias", F16, [1, H, S, 11])
    refused = gqa_node(dict(softcap=30.0), extra=[bias], name="biased", prefix="a_")
    plain = gqa_node(name="plain", prefix="b_")
    inputs = [v for n in (refused, plain) for v in n.inputs if v is not None]
    g = ir.Graph(inputs, [refused.outputs[0], plain.outputs[0]], nodes=[refused, plain],
                 opset_imports={"": 21, "com.microsoft": 1})
    report = node_pass(ir.Model(g, ir_version=10), "paged", lambda n: paged_io())
    assert [s[0] for s in report.skipped] == ["biased"] and "adds the bias after softcap" in report.skipped[0][1]
    assert report.changed == ["plain"]
    assert [n.op_type for n in g].count("PagedAttention") == 1


# ------------------------------------------------------------------------------------------------
# attributes carried, both directions
# ------------------------------------------------------------------------------------------------

_GIVEN = dict(scale=0.3, softcap=5.0, local_window_size=6, do_rotary=1, rotary_interleaved=1, qk_norm_epsilon=1e-4,
              qk_output=1)


def _rope_norm_inputs(prefix=""):
    return [val(prefix + "cos_cache", F16, [64, D // 2]), val(prefix + "sin_cache", F16, [64, D // 2]),
            val(prefix + "q_norm_weight", F16, [D]), val(prefix + "k_norm_weight", F16, [D])]


def test_gqa_to_paged_carries_every_shared_attribute():
    assert set(_GIVEN) | {"num_heads", "kv_num_heads"} == set(SAME_ATTRS)
    node = gqa_node(dict(_GIVEN, causal=1), extra=_rope_norm_inputs(),
                    outputs=("output", "present_key", "present_value", "output_qk"))
    nodes, _, applied = gqa_node_to_paged(node, paged_io())
    pa = attention(nodes, "PagedAttention")
    assert attrs_of(pa) == dict(_GIVEN, num_heads=H, kv_num_heads=HKV)  # is_causal=1 is the default: not written
    assert pa.name == "layer/PagedAttention"
    for n in ("cos_cache", "sin_cache", "q_norm_weight", "k_norm_weight"):
        assert inp(pa, PA, n) is inp(node, GQA, n), n
    assert "quantized cache" not in applied and "output_qk" in applied


def test_paged_to_gqa_carries_every_shared_attribute():
    node = paged_node(dict(_GIVEN, is_causal=1), extra=_rope_norm_inputs(),
                      outputs=("output", "key_cache_out", "value_cache_out", "", "", "output_qk"))
    nodes, _, applied = paged_node_to_gqa(node, gqa_io())
    g = attention(nodes, "GroupQueryAttention")
    assert attrs_of(g) == dict(_GIVEN, num_heads=H, kv_num_heads=HKV)  # causal=1 is GQA's default: not written
    assert g.name == "layer/GroupQueryAttention"
    assert applied == ["core (heads, Q/K/V, caches, lengths)",
                       "shared attributes (scale, softcap, window, rotary, qk_norm_epsilon, qk_output)",
                       "is_causal=0 with a window", "output_qk"]


def test_defaults_are_not_written_and_causal_maps_both_ways():
    pa = attention(gqa_node_to_paged(gqa_node(dict(causal=0)), paged_io())[0], "PagedAttention")
    assert attrs_of(pa) == dict(num_heads=H, kv_num_heads=HKV, is_causal=0)
    g = attention(paged_node_to_gqa(paged_node(dict(is_causal=0)), gqa_io())[0], "GroupQueryAttention")
    assert attrs_of(g) == dict(num_heads=H, kv_num_heads=HKV, causal=0)
    # written defaults stay unwritten on the target
    pa = attention(gqa_node_to_paged(gqa_node(dict(scale=0.0, local_window_size=-1)), paged_io())[0],
                   "PagedAttention")
    assert attrs_of(pa) == dict(num_heads=H, kv_num_heads=HKV)


@pytest.mark.parametrize("eps", [dict(q_norm_epsilon=2e-5, k_norm_epsilon=2e-5),
                                 dict(q_norm_epsilon=1e-4, qk_norm_epsilon=1e-4)])
def test_gqa_to_paged_one_epsilon(eps):
    pa = attention(gqa_node_to_paged(gqa_node(eps, extra=_rope_norm_inputs()[2:]), paged_io())[0], "PagedAttention")
    want = eps.get("k_norm_epsilon", eps.get("qk_norm_epsilon"))
    assert attrs_of(pa)["qk_norm_epsilon"] == pytest.approx(want)


# ------------------------------------------------------------------------------------------------
# quantized caches, GQA -> PagedAttention
# ------------------------------------------------------------------------------------------------

def _scale(side, shape, dt=F32):
    return val(f"{side}_scale", dt, shape)


@pytest.mark.parametrize("attrs,scales,io,reason", [
    # one side quantized is still checked: an fp16 paged cache has no 8-bit dtype
    (dict(k_quant_type="PER_TENSOR", kv_cache_bit_width=8), ("k",), dict(cache=F16),
     "kv_cache_bit_width 8 with a FLOAT16 paged cache has no PagedAttention cache dtype"),
    (dict(v_quant_type="PER_TENSOR", kv_cache_bit_width=8), ("v",), dict(cache=F16),
     "kv_cache_bit_width 8 with a FLOAT16 paged cache"),
    (dict(k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR", kv_cache_bit_width=4), ("k", "v"), dict(cache=I8),
     "kv_cache_bit_width 4 with a INT8 paged cache"),
    (dict(k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR", kv_cache_bit_width=8), ("k", "v"),
     dict(cache=None), "kv_cache_bit_width 8 with a unknown paged cache"),
    (dict(k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR", kv_cache_bit_width=8), ("v",), dict(cache=I8),
     "k_quant_type without k_scale"),
    (dict(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8), ("k",), dict(cache=I8),
     "v_quant_type without v_scale"),
    (dict(k_quant_type="PER_TENSOR", kv_cache_bit_width=8), (), dict(cache=I8), "k_quant_type without k_scale"),
])
def test_gqa_to_paged_quant_refusals(attrs, scales, io, reason):
    node = gqa_node(attrs, extra=[_scale(s, [1]) for s in scales])
    with pytest.raises(Refused, match=reason) as exc:
        gqa_node_to_paged(node, paged_io(**io))
    assert str(exc.value).startswith("quantized cache: ")


def test_gqa_to_paged_one_side_quantized():
    """k quantized, v not: the rule set asks nothing of v (no scale needed); PagedAttention's two caches share one
    type (T_CACHE), so the created node is refused by the validator, naming that rule - never a crash or a
    made-up v_scale reason."""
    node = gqa_node(dict(k_quant_type="PER_TENSOR", kv_cache_bit_width=8), extra=[_scale("k", [1])])
    with pytest.raises(Refused, match=r"^the created PagedAttention node is invalid: .*\[PA-dtype-same-T_CACHE\]") \
            as exc:
        gqa_node_to_paged(node, paged_io(cache=I8, value_cache=F16))
    assert "v_scale" not in str(exc.value)


def _eval_scale(nodes, node, side, size) -> tuple[np.ndarray, np.ndarray]:
    """Evaluate the helper nodes that make the PagedAttention node's {side}_scale from the GQA node's, in
    onnxruntime CPU: (the GQA scale fed, the PagedAttention scale)."""
    pa = attention(nodes, "PagedAttention")
    src, dst = inp(node, GQA, f"{side}_scale"), inp(pa, PA, f"{side}_scale")
    keep, todo = [], [dst.producer()]
    while todo:
        n = todo.pop()
        if n is not None and n not in keep:
            keep.append(n)
            todo.extend(v.producer() for v in n.inputs if v is not None)
    keep = [n for n in nodes if n in keep]
    assert keep and all(v is src or v.producer() in keep for n in keep for v in n.inputs if v is not None)
    g = ir.Graph([src], [dst], nodes=keep, opset_imports={"": 21})
    proto = ir.serde.serialize_model(ir.Model(g, ir_version=10))
    x = np.random.default_rng(3).uniform(0.01, 0.1, size=size).astype(np.float32)
    if src.shape is None:
        proto.graph.input[0].type.tensor_type.ClearField("shape")
    sess = ort.InferenceSession(onnx.shape_inference.infer_shapes(proto).SerializeToString(),
                                providers=["CPUExecutionProvider"])
    return x, sess.run(None, {src.name: x})[0]


@pytest.mark.parametrize("qt,shape", [("PER_TENSOR", [1]), ("PER_CHANNEL", [HKV, 1, D])])
def test_gqa_to_paged_canonical_scale_passes_as_is(qt, shape):
    """A scale already in PagedAttention's layout is the node's input itself: no helper node."""
    node = gqa_node(dict(k_quant_type=qt, v_quant_type=qt, kv_cache_bit_width=8),
                    extra=[_scale("k", shape), _scale("v", shape)])
    nodes, _, _ = gqa_node_to_paged(node, paged_io(cache=I8))
    pa = attention(nodes, "PagedAttention")
    for side in ("k", "v"):
        assert inp(pa, PA, f"{side}_scale") is inp(node, GQA, f"{side}_scale"), side
    assert not [n.op_type for n in nodes if n is not pa and any(v is inp(node, GQA, s) for s in ("k_scale", "v_scale")
                                                              for v in n.inputs)]
    a = attrs_of(pa)
    assert (a["k_quant_type"], a["v_quant_type"], a["k_cache_dtype"], a["v_cache_dtype"]) == (qt, qt, "int8", "int8")


@pytest.mark.parametrize("qt,shape,want", [
    ("PER_TENSOR", [], (1,)),
    ("PER_TENSOR", [1, 1], (1,)),
    ("PER_TENSOR", None, (1,)),
    ("PER_CHANNEL", [HKV, D], (HKV, 1, D)),
    ("PER_CHANNEL", [HKV * D], (HKV, 1, D)),
    ("PER_CHANNEL", [HKV, D, 1], (HKV, 1, D)),
    ("PER_CHANNEL", [1, HKV, D], (HKV, 1, D)),
    ("PER_CHANNEL", None, (HKV, 1, D)),
])
def test_gqa_to_paged_scale_reshaped_to_canonical(qt, shape, want):
    """Any other layout is reshaped to the canonical one, values in order (onnxruntime evaluates the helpers)."""
    node = gqa_node(dict(k_quant_type=qt, v_quant_type=qt, kv_cache_bit_width=4),
                    extra=[_scale("k", shape), _scale("v", shape)])
    nodes, _, _ = gqa_node_to_paged(node, paged_io(cache=U8, key_cache_shape=("nb", 16, HKV, D // 2)))
    pa = attention(nodes, "PagedAttention")
    assert attrs_of(pa)["k_cache_dtype"] == "int4" and attrs_of(pa)["v_quant_type"] == qt
    assert inp(pa, PA, "k_scale") is not inp(node, GQA, "k_scale")
    x, got = _eval_scale(nodes, node, "k", shape if shape is not None else [int(np.prod(want))])
    assert got.shape == want and np.array_equal(got.ravel(), x.ravel())


# ------------------------------------------------------------------------------------------------
# quantized caches, PagedAttention -> GQA
# ------------------------------------------------------------------------------------------------

def test_paged_to_gqa_refuses_cache_dtypes_of_different_widths():
    node = paged_node(dict(k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR", k_cache_dtype="int8",
                           v_cache_dtype="int4"), extra=[_scale("k", [1]), _scale("v", [1])], cache=I8)
    with pytest.raises(Refused, match="k_cache_dtype 'int8' and v_cache_dtype 'int4' differ: GQA has one "
                                      "kv_cache_bit_width"):
        paged_node_to_gqa(node, gqa_io())


@pytest.mark.parametrize("cache,fmt,bits", [(I8, "int8", 8), (U8, "int4", 4)])
def test_paged_to_gqa_quantized_cache(cache, fmt, bits):
    node = paged_node(dict(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", k_cache_dtype=fmt,
                           v_cache_dtype=fmt), extra=[_scale("k", [HKV, 1, D]), _scale("v", [HKV, 1, D])], cache=cache)
    pk = val("pk", cache, [1, HKV, 8, D // 2 if bits == 4 else D])
    io = GqaIO(pk, val("pv", cache, pk.shape), "prk", "prv", val("sk", I32, [1]), val("tot", I32, [1]),
               val("bs", I64, [2]))
    nodes, _, applied = paged_node_to_gqa(node, io)
    g = attention(nodes, "GroupQueryAttention")
    assert attrs_of(g) == dict(num_heads=H, kv_num_heads=HKV, kv_cache_bit_width=bits, k_quant_type="PER_CHANNEL",
                               v_quant_type="PER_CHANNEL")
    assert inp(g, GQA, "k_scale") is inp(node, PA, "k_scale") and inp(g, GQA, "v_scale") is inp(node, PA, "v_scale")
    assert "quantized cache" in applied


def test_paged_to_gqa_quant_rule_only_where_it_applies():
    """An unquantized node does not report the quantized-cache rule (the report lists the rules applied)."""
    _, _, applied = paged_node_to_gqa(paged_node(), gqa_io())
    assert applied == ["core (heads, Q/K/V, caches, lengths)",
                       "shared attributes (scale, softcap, window, rotary, qk_norm_epsilon, qk_output)",
                       "is_causal=0 with a window"]
    _, _, applied = paged_node_to_gqa(paged_node(dict(k_cache_dtype="", v_quant_type="NONE")), gqa_io())
    assert "quantized cache" not in applied


# ------------------------------------------------------------------------------------------------
# output_qk
# ------------------------------------------------------------------------------------------------

_QK_OUTS = ("output", "present_key", "present_value", "output_qk")


@pytest.mark.parametrize("io", [dict(token_rows=val("rows", I64, [S])), dict(output_shape=val("oshape", I64, [3])),
                                dict(token_rows=val("rows", I64, [S]), output_shape=val("oshape", I64, [3]))])
def test_gqa_to_paged_output_qk_of_a_padded_batch_refused(io):
    with pytest.raises(Refused, match="output_qk: output_qk of a padded batch"):
        gqa_node_to_paged(gqa_node(dict(qk_output=1), outputs=_QK_OUTS), paged_io(**io))
    # without output_qk the same io converts
    gqa_node_to_paged(gqa_node(), paged_io(**io))


@pytest.mark.parametrize("dt,want", [(F16, F16), (F32, F32), (None, F32)])
def test_gqa_to_paged_output_qk_type(dt, want):
    """PagedAttention's output_qk [H, T, capacity] -> GQA's [1, H, T, total] in the source output's type."""
    qk = ir.Value(name="output_qk", type=ir.TensorType(dt) if dt else None)
    node = gqa_node(dict(qk_output=1), outputs=("output", "present_key", "present_value", qk))
    nodes, rep, _ = gqa_node_to_paged(node, paged_io())
    pa = attention(nodes, "PagedAttention")
    assert pa.outputs[5].dtype == want
    y = rep[qk]
    assert y.producer().op_type == "Unsqueeze" and not any(n.op_type == "Cast" and n.inputs[0] is pa.outputs[5]
                                                           for n in nodes)


@pytest.mark.parametrize("dt,want", [(F16, F16), (F32, F32), (None, F32)])
def test_paged_to_gqa_output_qk_type(dt, want):
    """GQA's output_qk is padded back to [H, T, capacity] and cast to the source output's type (float32 when
    unknown)."""
    qk = ir.Value(name="output_qk", type=ir.TensorType(dt) if dt else None)
    node = paged_node(dict(qk_output=1), outputs=("output", "key_cache_out", "value_cache_out", "", "", qk))
    nodes, rep, _ = paged_node_to_gqa(node, gqa_io())
    y = rep[qk]
    assert y.producer().op_type == "Cast" and y.producer().attributes["to"].value == want
    assert y.producer().inputs[0].producer().op_type == "Pad"


def test_paged_to_gqa_output_qk_of_a_padded_batch_refused():
    node = paged_node(dict(qk_output=1), outputs=("output", "key_cache_out", "value_cache_out", "", "", "output_qk"))
    with pytest.raises(Refused, match="output_qk: output_qk of a padded batch"):
        paged_node_to_gqa(node, gqa_io(token_rows=val("rows", I64, [S])))


# ------------------------------------------------------------------------------------------------
# the created node is validated with all the types known
# ------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("packed", [False, True])
def test_created_node_invalid_is_refused_naming_the_input(packed):
    """A float block_table from the caller: the created node is refused naming the input and the rule, also
    when absent inputs (packed QKV: no key / value) come before it on the node."""
    with pytest.raises(Refused, match=r"the created PagedAttention node is invalid: layer/PagedAttention: input "
                                      r"'block_table'.*\[PA-dtype-allowed\]"):
        gqa_node_to_paged(gqa_node(packed=packed), paged_io(block_table=F32))
    with pytest.raises(Refused, match=r"the created GroupQueryAttention node is invalid: .*'seqlens_k'"):
        paged_node_to_gqa(paged_node(), GqaIO(val("pk", F16, [1, HKV, 8, D]), val("pv", F16, [1, HKV, 8, D]), "prk",
                                              "prv", val("sk", F32, [1]), val("tot", I32, [1]), val("bs", I64, [2])))


def test_created_node_refusal_shows_symbolic_dims():
    """A PER_CHANNEL scale for 3 KV heads on a 2-head node: refused naming the node, the input, the rule, and the
    scale's shape as the graph spells it (symbolic dims by name)."""
    node = gqa_node(dict(k_quant_type="PER_CHANNEL", v_quant_type="PER_CHANNEL", kv_cache_bit_width=8),
                    extra=[_scale("k", [3, 1, "head_size"]), _scale("v", [HKV, 1, D])])
    with pytest.raises(Refused, match=r"^the created PagedAttention node is invalid: layer/PagedAttention: input "
                                      r"'k_scale': .*got \(3, 1, head_size\) \[PA-scale-shape-per-channel\]$"):
        gqa_node_to_paged(node, paged_io(cache=I8))


def test_created_node_refusal_quotes_the_first_six_issues(monkeypatch):
    """A created node with many contract issues: the Refused message quotes the first six, in order, and no more."""
    import pagedkit.rewriters.node_rules.base as base

    monkeypatch.setattr(base, "validate_node", lambda *a, **k: [f"issue-{i}" for i in range(9)])
    with pytest.raises(Refused) as info:
        gqa_node_to_paged(gqa_node({}), paged_io())
    assert str(info.value) == "the created PagedAttention node is invalid: " + "; ".join(f"issue-{i}" for i in range(6))


# ------------------------------------------------------------------------------------------------
# cast_to, PagedAttention -> GQA: onnxruntime CPU's GroupQueryAttention as the oracle
# ------------------------------------------------------------------------------------------------

def test_paged_to_gqa_cast_to_float32_runs_in_onnxruntime():
    """PagedAttention fp16 -> GQA run in float32 (cast_to=FLOAT): Q/K/V and the RoPE caches cast up, the output cast
    back to float16; onnxruntime CPU on the rewrite matches pagedkit's PagedAttention on the original."""
    import pagedkit
    from paged_gqa import gqa_from_paged
    from test_paged_vs_gqa import make_paged
    from test_rewrite_nodes import _layout_rows, _np, _rel, convert, gqa_io_of, one_node_model

    x, a = make_paged(rotary="half", seed=31)
    px = {n: x[n] for n in PA.input_names if n in x}
    proto = one_node_model(PA, px, a, ["output", "key_cache_out", "value_cache_out"])
    ref = pagedkit.InferenceSession(proto).run(["output"], {k: _np(v.clone()) for k, v in px.items()})[0]
    gx, _, layout = gqa_from_paged(x, a)
    rows = _layout_rows(layout)
    extra = {"past_key": _np(gx["past_key"]).astype(np.float32), "past_value": _np(gx["past_value"]).astype(np.float32),
             "seqlens_k": _np(gx["seqlens_k"]), "total_sequence_length": _np(gx["total_sequence_length"]),
             "query_seqlens": _np(gx["query_seqlens"]),
             "batch_seq": np.array([len(layout.sequences), layout.seq], np.int64), "token_rows": rows}

    conv = convert(proto, paged_node_to_gqa, lambda v: gqa_io_of(v, cast_to=F32), PAGED_TO_GQA, extra)
    gqa = next(n for n in conv.graph.node if n.op_type == "GroupQueryAttention")
    assert {i.name: i.type.tensor_type.elem_type for i in conv.graph.input}["past_key"] == 1
    feeds = {k: _np(v) for k, v in px.items()} | extra
    names = {i.name for i in conv.graph.input}
    sess = ort.InferenceSession(conv.SerializeToString(), providers=["CPUExecutionProvider"])
    got = sess.run(["output"], {k: v for k, v in feeds.items() if k in names})[0]
    assert gqa.input[0] and got.dtype == np.float16 and got.shape == ref.shape
    assert _rel(got, ref) <= 5e-3


def test_gqa_to_paged_rule_set_order_is_checks_first():
    """A node with two refusals lists both reasons (every check runs before any rewrite)."""
    node = gqa_node(dict(softcap=30.0, sliding_window_cache=1, local_window_size=4),
                    extra=[val("attention_bias", F16, [1, H, S, 11])])
    with pytest.raises(Refused) as exc:
        gqa_node_to_paged(node, paged_io())
    msg = str(exc.value)
    assert msg.startswith("attention_bias: attention_bias with softcap > 0") and "; sliding_window_cache: " in msg
    assert GQA_TO_PAGED[0].name == "activation dtype"


def _untyped_output_case(to):
    """A float32 source node whose attention output carries no declared type, rewritten with cast_to=FLOAT16."""
    out = ir.Value(name="output", type=None)
    if to == "paged":
        v = dict(query=val("query", F32, [1, S, H * D]), key=val("key", F32, [1, S, HKV * D]),
                 value=val("value", F32, [1, S, HKV * D]), past_key=val("past_key", F16, [1, HKV, 8, D]),
                 past_value=val("past_value", F16, [1, HKV, 8, D]), seqlens_k=val("seqlens_k", I32, [1]),
                 total_sequence_length=val("total_len", I32, [1]))
        node = _node(GQA, v, dict(num_heads=H, kv_num_heads=HKV), [out, "present_key", "present_value"], "l/GQA")
        return gqa_node_to_paged(node, paged_io(cast_to=F16)), "PagedAttention"
    v = dict(query=val("query", F32, [S, H * D]), key=val("key", F32, [S, HKV * D]), value=val("value", F32, [S, HKV * D]),
             key_cache=val("key_cache", F16, ["nb", 16, HKV, D]), value_cache=val("value_cache", F16, ["nb", 16, HKV, D]),
             cumulative_sequence_length=val("csl", I32, [2]), past_seqlens=val("past", I32, [1]),
             block_table=val("bt", I32, [1, 4]))
    node = _node(PA, v, dict(num_heads=H, kv_num_heads=HKV), [out, "key_cache_out", "value_cache_out"], "l/PA")
    return paged_node_to_gqa(node, gqa_io(cast_to=F16)), "GroupQueryAttention"


@pytest.mark.parametrize("to", ["paged", "gqa"])
def test_an_untyped_output_is_cast_back_to_the_querys_type(to):
    """The attention output has the query's type (both operators): with cast_to=FLOAT16 on a float32 node whose
    output is not typed, the rewrite still casts the result back to float32 (a float16 output would feed the
    float32 graph after it: a type error in onnxruntime)."""
    (nodes, replaces, _), op = _untyped_output_case(to)
    attn = attention(nodes, op)
    after = nodes[nodes.index(attn) + 1:]
    casts = [n for n in after if n.op_type == "Cast"]
    assert [n.attributes["to"].value for n in casts] == [F32], [n.op_type for n in after]
    (y,) = [v for k, v in replaces.items() if k.name == "output"]
    seen, frontier = set(), [y]
    while frontier:  # the replacement value is reached from the Cast
        v = frontier.pop()
        if v.producer() is not None and v.producer() not in seen:
            seen.add(v.producer())
            frontier.extend(i for i in v.producer().inputs if i is not None)
    assert casts[0] in seen


def test_gqa_to_paged_output_goes_back_through_the_given_output_shape():
    """A padded batch without token rows: the [T, W] output is reshaped to io.output_shape ([B, S, W]), not
    unsqueezed to [1, T, W]."""
    shape = val("out_shape", I64, [3])
    nodes, replaces, _ = gqa_node_to_paged(gqa_node(), paged_io(output_shape=shape))
    (y,) = [v for k, v in replaces.items() if k.name == "output"]
    assert y.producer().op_type == "Reshape" and y.producer().inputs[1] is shape
    nodes, replaces, _ = gqa_node_to_paged(gqa_node(), paged_io())
    (y,) = [v for k, v in replaces.items() if k.name == "output"]
    assert y.producer().op_type == "Unsqueeze"
