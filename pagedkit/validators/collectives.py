"""com.microsoft AllReduce / AllGather as data (onnxruntime's schemas, core/graph/contrib_ops/collective_defs.cc):
their types and attributes, their onnx schemas (so that shape inference carries types and shapes through them),
and the whole-model rules of a tensor-parallel rank's graph (`paged-export --tp N`).

    AllReduce  inputs: variadic T; outputs: variadic T, output i = sum over the ranks of input i (same shape)
               T: float16, float, double
    AllGather  inputs: variadic T; outputs: variadic T, output i = the ranks' input i concatenated along `axis`
               attributes: axis (int, default 1), group_size (int, default 1: the ranks gathered)
               T: float16, float, double, int64, bool

The runtime's implementations are pagedkit/runtime/ops/collectives.py (torch.distributed).
"""

from __future__ import annotations

import threading
from dataclasses import dataclass
from typing import Iterator, Mapping

from .contract import DOMAIN
from .issues import Issue

F16, F32, F64, I64, BOOL = 10, 1, 11, 7, 9  # onnx.TensorProto values (no onnx import at module load)
_NAMES = {F16: "float16", F32: "float", F64: "double", I64: "int64", BOOL: "bool"}


@dataclass(frozen=True)
class Collective:
    name: str
    types: tuple[int, ...]  # element types of T
    attributes: tuple[tuple[str, int], ...]  # (name, default), all INT
    summary: str


COLLECTIVES: dict[str, Collective] = {c.name: c for c in (
    Collective("AllReduce", (F16, F32, F64), (), "each input summed over the ranks of the set"),
    Collective("AllGather", (F16, F32, F64, I64, BOOL), (("axis", 1), ("group_size", 1)),
               "each input of every rank concatenated along `axis`, rank order (group_size ranks)"),
)}

RULE_DOCS = {
    "MODEL-collective-type": "AllReduce inputs are float16 / float / double, AllGather inputs float16 / float / "
                             "double / int64 / bool (onnxruntime's schemas): a bfloat16 model reduces in float32 "
                             "between Casts.",
    "MODEL-collective-arity": "An AllReduce / AllGather node has as many outputs as inputs (variadic pairs).",
    "MODEL-collective-group": "AllGather's group_size equals the world size genai_config.json's "
                              "pagedkit.tensor_parallel names, and a graph with collectives has that section.",
    "MODEL-collective-axis": "AllGather's axis lies within its input's rank.",
}

_LOCK = threading.Lock()


def _infer(op: Collective):
    def infer(ctx) -> None:
        import onnx

        attrs = {a: d for a, d in op.attributes}
        for a in attrs:
            proto = ctx.get_attribute(a)
            if proto is not None:
                attrs[a] = onnx.helper.get_attribute_value(proto)
        for i in range(min(ctx.get_num_inputs(), ctx.get_num_outputs())):
            tp = ctx.get_input_type(i)
            if tp is None or not tp.HasField("tensor_type") or not tp.tensor_type.elem_type:
                continue
            out = onnx.TypeProto()
            out.CopyFrom(tp)
            dims = out.tensor_type.shape.dim
            if op.name == "AllGather" and out.tensor_type.HasField("shape"):
                axis = attrs["axis"] + (len(dims) if attrs["axis"] < 0 else 0)
                if 0 <= axis < len(dims):
                    d = dims[axis]
                    if d.HasField("dim_value"):
                        d.dim_value *= max(1, attrs["group_size"])
                    else:
                        d.Clear()
            ctx.set_output_type(i, out)

    return infer


def register_collective_schemas() -> list[str]:
    """Register AllReduce / AllGather (com.microsoft) with onnx where it lacks them (idempotent)."""
    from onnx import defs, helper

    S = defs.OpSchema
    added = []
    with _LOCK:
        for op in COLLECTIVES.values():
            if defs.has(op.name, DOMAIN):
                continue
            variadic = S.FormalParameterOption.Variadic
            schema = S(op.name, DOMAIN, 1, op.summary,
                       inputs=[S.FormalParameter("input", "T", "tensors", param_option=variadic)],
                       outputs=[S.FormalParameter("output", "T", "tensors", param_option=variadic)],
                       type_constraints=[("T", [f"tensor({_NAMES[t]})" for t in op.types], "")],
                       attributes=[S.Attribute(a, helper.make_attribute(a, d), "") for a, d in op.attributes])
            schema.set_type_and_shape_inference_function(_infer(op))
            defs.register_schema(schema)
            added.append(op.name)
    return added


def world_size(genai_config: Mapping | None) -> int | None:
    """The tensor_parallel world size a genai_config names (None: none, or no config)."""
    if genai_config is None:
        return None
    from ..interface.genai_config import read_pagedkit_section

    try:
        tp = read_pagedkit_section(genai_config).get("tensor_parallel")
    except ValueError:  # a malformed pagedkit section: the config checks report it (genai_schema)
        return None
    return tp.get("world_size") if isinstance(tp, Mapping) else None


def collective_issues(graph_nodes, value_info: Mapping, genai_config: Mapping | None) -> Iterator[Issue]:
    """The MODEL-collective-* issues of a graph's nodes (value_info: name -> (elem, shape) after inference)."""
    world = world_size(genai_config)
    seen_any = False
    for node in graph_nodes:
        op = COLLECTIVES.get(node.op_type)
        if op is None or node.domain != DOMAIN:
            continue
        seen_any = True
        nn = node.name or node.op_type
        if len(node.output) != len(node.input):
            yield Issue(nn, "node", "MODEL-collective-arity", f"{len(node.input)} output(s), one per input",
                        f"{len(node.output)}")
        attrs = {a: d for a, d in op.attributes}
        attrs.update({a.name: a.i for a in node.attribute if a.name in attrs})
        for x in node.input:
            elem, shape = value_info.get(x, (None, None))
            if elem is not None and elem not in op.types:
                yield Issue(nn, f"input '{x}'", "MODEL-collective-type",
                            " / ".join(_NAMES[t] for t in op.types), f"element type {elem}")
            if op.name == "AllGather" and shape is not None and not -len(shape) <= attrs["axis"] < len(shape):
                yield Issue(nn, "attribute 'axis'", "MODEL-collective-axis", f"an axis of a rank-{len(shape)} input",
                            str(attrs["axis"]))
        if op.name == "AllGather" and world is not None and attrs["group_size"] != world:
            yield Issue(nn, "attribute 'group_size'", "MODEL-collective-group",
                        f"{world} (pagedkit.tensor_parallel.world_size)", str(attrs["group_size"]))
    if seen_any and genai_config is not None and world is None:
        yield Issue("model", "model", "MODEL-collective-group",
                    "a pagedkit.tensor_parallel section in genai_config.json naming the set",
                    "collective nodes in a model whose genai_config.json names no tensor-parallel set")
