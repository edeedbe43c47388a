"""`lower`: every com.microsoft::PagedAttention node the CPU attention library serves -> one pagedkit.cpu node
(paged_attention.c), the form runtime/delegate.py runs in onnxruntime's CPU execution provider: one node a
layer where the op-by-op decomposition (kernels/onnx_ops, decompose(in_place=True)) takes about 25.

Served: SEPARATE layout, packed or separate QKV, float16 / bfloat16 T and caches (both caches of one type), RoPE
(half or interleaved, any rotary_offset), QK-norm, causal or not, local window, softcap, head_sink, slot_mapping,
query_positions. Not served (the node is left as it is, with the reason; the decomposition takes it): quantized
caches (int8 / fp8 / int4), LATENT, attention_bias, output_qk, the Hadamard rotations, PER_TOKEN scale caches.

The lowered node writes the caches in the input buffers and has no cache outputs in onnxruntime: it keeps the
PagedAttention node's output names (output, key_cache_out, value_cache_out) in the model, and `LowerReport.in_place`
maps each cache output to the cache input it is (the delegate returns that input's tensor for it).
Casts around the node from / to float32 (what `paged-export --dtype fp32` writes: T is float16 inside) are folded
into it (the `f32` io variants round to T on entry and on exit exactly as the Casts did).
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
from onnx import TensorProto, helper

from ...validators import validate_node
from ...validators.contract import PAGED_ATTENTION
from ..onnx_facts import facts as _facts

DOMAIN = "pagedkit.cpu"
PARALLEL_MIN = 8192  # a step's keys x heads from which a node's attention spreads over pool.h's threads (~10 ns each)
# ... over onnxruntime's intra-op pool (onnxruntime >= 1.17; -1: never): its workers spin between nodes, so even a
# batch-8 decode step gains (SmolLM2 int4, 2 threads: the attention 4.1 -> 3.1 ms a step, decode +8%)
ORT_PARALLEL_MIN = 512
SOURCE_DOMAINS = ("com.microsoft",)
_KIND = {TensorProto.FLOAT16: "f16", TensorProto.BFLOAT16: "bf16"}
_INPUTS = ("query", "key", "value", "key_cache", "value_cache", "cumulative_sequence_length", "past_seqlens",
           "block_table", "cos_cache", "sin_cache", "head_sink", "q_norm_weight", "k_norm_weight", "slot_mapping",
           "query_positions")  # the lowered op's inputs, in order (paged_attention.c)
_IGNORED = ("attention_metadata",)  # launch bounds only: never part of the result
_ATTRS = {"num_heads": "i", "kv_num_heads": "i", "scale": "f", "softcap": "f", "local_window_size": "i",
          "do_rotary": "i", "rotary_interleaved": "i", "is_causal": "i", "rotary_offset": "i", "qk_norm_epsilon": "f"}
_UNSERVED_ATTRS = {"kv_cache_layout": "SEPARATE", "k_quant_type": "NONE", "v_quant_type": "NONE", "qk_output": 0,
                   "qk_rotation": 0, "v_rotation": 0}


@dataclass
class LowerReport:
    lowered: list[str] = field(default_factory=list)  # PagedAttention nodes now one pagedkit.cpu node
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (node, why it was left as it is)
    in_place: dict[str, str] = field(default_factory=dict)  # cache output -> the cache input it is
    folded_casts: int = 0


def _refusal(node: onnx.NodeProto, attrs: dict, named: dict, outs: dict, info: dict) -> str | None:
    for a, want in _UNSERVED_ATTRS.items():
        if attrs.get(a, want) not in (want, want.encode() if isinstance(want, str) else want):
            return f"{a}={attrs[a]!r} is not served by the CPU kernel"
    for kind in ("k_cache_dtype", "v_cache_dtype"):
        v = attrs.get(kind, "")
        v = v.decode() if isinstance(v, bytes) else v
        if v not in ("", "float16", "bfloat16"):
            return f"{kind}={v!r}: quantized caches are not served by the CPU kernel"
    extra = [n for n in named if n not in _INPUTS and n not in _IGNORED]
    if extra:
        return f"input(s) {extra} not served by the CPU kernel"
    if set(outs) - {"output", "key_cache_out", "value_cache_out"}:
        return f"output(s) {sorted(set(outs) - {'output', 'key_cache_out', 'value_cache_out'})} not served"
    if "value_cache" not in named:
        return "no value_cache (LATENT layout)"
    if ("key" in named) != ("value" in named):
        return "key without value"
    t = info.get(named["query"], (None,))[0]
    kc, vc = (info.get(named[n], (None,))[0] for n in ("key_cache", "value_cache"))
    if t not in _KIND:
        return f"query element type {t} is not float16 / bfloat16 (or unknown)"
    if kc not in _KIND or kc != vc:
        return f"cache element types {kc} / {vc}: the CPU kernel serves float16 / bfloat16 caches of one type"
    for n in ("key", "value", "cos_cache", "sin_cache", "head_sink", "q_norm_weight", "k_norm_weight"):
        if n in named and info.get(named[n], (None,))[0] != t:
            return f"input '{n}' is not of query's element type"
    return None


def lower(model: onnx.ModelProto, threads: int = 1) -> tuple[onnx.ModelProto, LowerReport]:
    """(a new model with the served PagedAttention nodes lowered, the report). `model` is not changed. threads: the
    most threads a node's attention may use (prefill and batches; a decode step's runs on one)."""
    report = LowerReport()
    info, consts = _facts(model)
    g = model.graph
    consumers: dict[str, list[int]] = {}
    for i, n in enumerate(g.node):
        for x in n.input:
            if x:
                consumers.setdefault(x, []).append(i)
    producer = {o: i for i, n in enumerate(g.node) for o in n.output if o}
    graph_outputs = {o.name for o in g.output}
    drop: set[int] = set()
    replace: dict[int, onnx.NodeProto] = {}
    for i, node in enumerate(g.node):
        if node.op_type != "PagedAttention" or node.domain not in SOURCE_DOMAINS:
            continue
        name = node.name or f"PagedAttention_{i}"
        named = {p: x for p, x in zip(PAGED_ATTENTION.input_names, node.input) if x}
        outs = {p: x for p, x in zip(PAGED_ATTENTION.output_names, node.output) if x}
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        issues = validate_node(node, info, consts)
        why = ("invalid node: " + "; ".join(map(str, issues[:3]))) if issues else _refusal(node, attrs, named, outs,
                                                                                             info)
        if why is None and any(consumers.get(outs[c]) for c in ("key_cache_out", "value_cache_out") if c in outs):
            why = "a cache output is read by another node"
        if why is not None:
            report.skipped.append((name, why))
            continue
        t = _KIND[info[named["query"]][0]]
        c = _KIND[info[named["key_cache"]][0]]
        io, ins, out_name = t, [named.get(n, "") for n in _INPUTS], outs["output"]
        # fold Casts float32 -> T before (query, key, value) and T -> float32 after (output), when all fold
        feeds = [named[n] for n in ("query", "key", "value") if n in named]
        casts_in = [producer.get(x) for x in feeds]
        users = consumers.get(out_name, [])
        def types(x):
            return _elem_of(x, info, producer, g.node)

        if (all(j is not None and _is_cast(g.node[j], TensorProto.FLOAT, None, types) for j in casts_in)
                and len(users) == 1 and out_name not in graph_outputs
                and _is_cast(g.node[users[0]], None, TensorProto.FLOAT, types)):
            io = "f32"
            for p, j in zip(("query", "key", "value"), casts_in):
                ins[_INPUTS.index(p)] = g.node[j].input[0]
                if all(k in (i,) for k in consumers.get(g.node[j].output[0], [])) and \
                        g.node[j].output[0] not in graph_outputs:
                    drop.add(j)
            drop.add(users[0])
            out_name = g.node[users[0]].output[0]
            report.folded_casts += 1
        kwargs = {}
        for a, kind in _ATTRS.items():
            v = attrs.get(a, PAGED_ATTENTION.attr(a).default)
            kwargs[a] = float(v) if kind == "f" else int(v)
        kwargs["threads"] = max(1, int(threads))
        kwargs["parallel_min"] = PARALLEL_MIN
        kwargs["ort_parallel_min"] = ORT_PARALLEL_MIN
        while ins and not ins[-1]:
            ins.pop()
        new = helper.make_node(f"PagedAttention_{io}_{t}_{c}", ins,
                               [out_name, outs.get("key_cache_out", ""), outs.get("value_cache_out", "")],
                               name=f"{name}/cpu", domain=DOMAIN, **kwargs)
        replace[i] = new
        for c_out, c_in in (("key_cache_out", "key_cache"), ("value_cache_out", "value_cache")):
            if c_out in outs:
                report.in_place[outs[c_out]] = named[c_in]
        report.lowered.append(name)
    if not replace:
        return model, report
    out = onnx.ModelProto()
    out.CopyFrom(model)  # weights in external data (the session's lazy load) are references, not bytes
    del out.graph.node[:]
    out.graph.node.extend(replace.get(i, n) for i, n in enumerate(g.node) if i not in drop)
    if not any(o.domain == DOMAIN for o in out.opset_import):
        out.opset_import.append(helper.make_opsetid(DOMAIN, 1))
    return out, report


# ops whose output 0 has the element type of their input 0 (what ONNX shape inference cannot tell past the
# contrib ops, e.g. SkipSimplifiedLayerNormalization; used to recognize the Casts from float32 to fold)
_SAME_TYPE = {"MatMul", "Gemm", "Add", "Sub", "Mul", "Div", "Neg", "Relu", "Sigmoid", "Tanh", "Reshape", "Transpose",
              "Squeeze", "Unsqueeze", "Slice", "Concat", "Identity", "Softmax", "LayerNormalization",
              "RMSNormalization", "SimplifiedLayerNormalization", "SkipLayerNormalization",
              "SkipSimplifiedLayerNormalization", "FastGelu", "QuickGelu", "Gelu", "MatMulNBits", "BiasGelu"}


_TYPE_FROM = {"Gather": 0, "GatherBlockQuantized": 2, "DequantizeLinear": 1}  # output 0 typed as this input


def _elem_of(name: str, info: dict, producer: dict, nodes, depth: int = 64) -> int | None:
    """name's element type: shape inference's, else through the ops of _SAME_TYPE (input 0), _TYPE_FROM and Cast."""
    elem = info.get(name, (None,))[0]
    while elem is None and depth > 0 and name in producer:
        node = nodes[producer[name]]
        if node.op_type == "Cast":
            return next((a.i for a in node.attribute if a.name == "to"), None)
        k = 0 if node.op_type in _SAME_TYPE else _TYPE_FROM.get(node.op_type)
        if k is None or len(node.input) <= k or node.output[0] != name:
            return None
        name, depth = node.input[k], depth - 1
        elem = info.get(name, (None,))[0]
    return elem


def _is_cast(node: onnx.NodeProto, src: int | None, to: int | None, types) -> bool:
    """node is a Cast (to `to`, from an input of type `src`; None: any); types(name) -> element type."""
    if node.op_type != "Cast" or node.domain not in ("", "ai.onnx"):
        return False
    target = next((a.i for a in node.attribute if a.name == "to"), None)
    if to is not None and target != to:
        return False
    return src is None or types(node.input[0]) == src


__all__ = ["DOMAIN", "LowerReport", "lower"]
