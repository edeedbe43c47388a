"""`widen`: a float16 PagedAttention model -> the same model computing in float32 outside its attention, the form
onnxruntime's CPU execution provider runs fast (it has no float16 MatMul on x86) and `paged-export --dtype fp32`
writes: every float16 weight is widened by a Cast onnxruntime folds at session creation (exact: every float16 is
a float32), Casts to float16 in front of each PagedAttention node's activations and back to float32 after its
output (kernels/cpu/lower.py folds them into the node), the caches, the attention's own constants (cos / sin, sinks,
norm gains) and the graph's float16 outputs (the logits: a Cast at the end) as the model declares them.

Lossless for the weights; the activations are computed in float32 instead of float16 (closer to the float32
reference the model was exported from). Applied by runtime/delegate.py to models the rule of runtime/session.py
(`_auto_backend`) sends to onnxruntime; `why_not` says why a model is left as it is.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import onnx
from onnx import TensorProto, helper, numpy_helper

from ...validators.contract import PAGED_ATTENTION

HALF, FLOAT = TensorProto.FLOAT16, TensorProto.FLOAT
_ATTENTION = {("com.microsoft", "PagedAttention")}
_OTHER_ATTENTION = {"GroupQueryAttention", "MultiHeadAttention", "Attention", "SparseAttention"}
_T_INPUTS = {p.index for p in PAGED_ATTENTION.inputs if p.type_param == "T"}  # query, key, value, cos, sin, ...
_ACTIVATIONS = {PAGED_ATTENTION.input_index(n) for n in ("query", "key", "value")}


@dataclass
class WidenReport:
    widened_weights: int = 0  # float16 initializers now widened by a Cast
    boundary_casts: int = 0  # Casts added around attention nodes and at the float16 outputs
    kept_half: list[str] = field(default_factory=list)  # float16 initializers only the attention nodes read


def why_not(model: onnx.ModelProto) -> str | None:
    """Why `widen` leaves this model as it is (None: it widens it)."""
    g = model.graph
    pa = [n for n in g.node if (n.domain, n.op_type) in _ATTENTION]
    if not pa:
        return "no PagedAttention node"
    half = {t.name for t in g.initializer if t.data_type == HALF}
    if not any(x in half for n in g.node if (n.domain, n.op_type) not in _ATTENTION for x in n.input):
        return "no float16 weights outside attention (a float32 model: its attention constants are float16)"
    for n in g.node:
        if n.op_type in _OTHER_ATTENTION:
            return f"a {n.op_type} node (its caches bind its activations' type)"
        for a in n.attribute:
            if a.type in (onnx.AttributeProto.GRAPH, onnx.AttributeProto.GRAPHS):
                return f"node '{n.name}' holds a subgraph"
            if a.name in ("dtype",) or (a.name == "to" and n.op_type != "Cast"):
                return f"node '{n.name}' ({n.op_type}) has a type attribute '{a.name}'"
    for vi in g.input:
        if vi.type.tensor_type.elem_type == HALF and not any(vi.name in n.input for n in pa):
            return f"float16 graph input '{vi.name}' other than an attention cache"
    return None


def widen(model: onnx.ModelProto) -> tuple[onnx.ModelProto, WidenReport]:
    """(the widened model, a new proto; the report). `model` is not changed. Call why_not first."""
    out = onnx.ModelProto()
    out.CopyFrom(model)  # weights in external data (the session's lazy load) are references, not bytes
    g, rep = out.graph, WidenReport()
    pa_inputs = {x for n in g.node if (n.domain, n.op_type) in _ATTENTION for i, x in enumerate(n.input)
                 if i in _T_INPUTS - _ACTIVATIONS and x}
    readers: dict[str, list] = {}
    for n in g.node:
        if (n.domain, n.op_type) not in _ATTENTION:
            for x in n.input:
                readers.setdefault(x, []).append(n)
    new_nodes = []
    for t in g.initializer:  # weights: widened by a Cast (folded by onnxruntime), attention-only constants kept
        if t.data_type != HALF:
            continue
        if t.name not in readers:
            rep.kept_half.append(t.name)
            continue
        wide = f"{t.name}/float32"
        new_nodes.append(helper.make_node("Cast", [t.name], [wide], name=f"{t.name}/widen", to=FLOAT))
        for n in readers[t.name]:
            n.input[:] = [wide if x == t.name else x for x in n.input]
        rep.widened_weights += 1
    nodes = []
    for n in g.node:
        if (n.domain, n.op_type) in _ATTENTION:
            for i, x in enumerate(n.input):
                if i in _ACTIVATIONS and x:
                    half = f"{x}/float16/{n.name}"
                    nodes.append(helper.make_node("Cast", [x], [half], name=f"{n.name}/{i}/Cast", to=HALF))
                    n.input[i] = half
                    rep.boundary_casts += 1
            nodes.append(n)
            if n.output and n.output[0]:
                y = n.output[0]
                n.output[0] = f"{y}/float16"
                nodes.append(helper.make_node("Cast", [n.output[0]], [y], name=f"{n.name}/output/Cast", to=FLOAT))
                rep.boundary_casts += 1
            continue
        for a in n.attribute:
            if n.op_type == "Cast" and a.name == "to" and a.i == HALF:
                a.i = FLOAT
            elif a.type == onnx.AttributeProto.TENSOR and a.t.data_type == HALF:
                a.t.CopyFrom(numpy_helper.from_array(numpy_helper.to_array(a.t).astype("float32"), a.t.name))
        nodes.append(n)
    outputs_half = {o.name for o in g.output if o.type.tensor_type.elem_type == HALF}
    produced = {o for n in nodes if (n.domain, n.op_type) not in _ATTENTION for o in n.output}
    for y in outputs_half & produced:  # the logits: computed in float32, declared float16
        wide = f"{y}/float32"
        for n in nodes:
            n.output[:] = [wide if o == y else o for o in n.output]
            n.input[:] = [wide if x == y else x for x in n.input]
        nodes.append(helper.make_node("Cast", [wide], [y], name=f"{y}/Cast", to=HALF))
        rep.boundary_casts += 1
    del g.node[:]
    g.node.extend(new_nodes + nodes)
    keep = {vi.name for vi in g.input} | {vi.name for vi in g.output}
    vis = [vi for vi in g.value_info if vi.name in keep or vi.type.tensor_type.elem_type != HALF]
    del g.value_info[:]
    g.value_info.extend(vis)  # float16 intermediates are float32 now: shape inference retypes them
    del pa_inputs
    return out, rep


__all__ = ["WidenReport", "why_not", "widen"]
