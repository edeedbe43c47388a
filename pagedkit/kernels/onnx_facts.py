"""Static facts of an ONNX model for the rewrites (kernels/onnx_ops decompose, kernels/cpu lower): value types and
shapes from ONNX shape inference with pagedkit's schemas, and small integer constants. Imports neither onnx-ir
nor torch."""

from __future__ import annotations

import math

import onnx

from ..validators.inference import register_schemas, type_of_proto


def facts(proto: onnx.ModelProto) -> tuple[dict, dict]:
    """(value_info name -> (elem, shape), small integer constants name -> array) of the main graph."""
    register_schemas()
    try:
        inferred = onnx.shape_inference.infer_shapes(_without_weights(proto), check_type=False, strict_mode=False,
                                                     data_prop=True)
    except Exception:  # inference is a help only
        inferred = proto
    g = inferred.graph
    info = {}
    for vi in list(g.input) + list(g.output) + list(g.value_info):
        info.setdefault(vi.name, type_of_proto(vi.type))
    consts = {}
    for t in proto.graph.initializer:
        info[t.name] = (t.data_type or None, tuple(int(d) for d in t.dims))
        if t.data_type in (onnx.TensorProto.INT32, onnx.TensorProto.INT64) and math.prod(t.dims) <= 4096 \
                and not t.external_data:
            consts[t.name] = onnx.numpy_helper.to_array(t)
    return info, consts


def _without_weights(proto: onnx.ModelProto) -> onnx.ModelProto:
    """A copy for shape inference without the weights' bytes: large or non-integer initializers become graph
    inputs of the same type and shape (inference needs no values from them; small integer initializers,
    e.g. Reshape shapes, stay for data propagation). Avoids copying a large model, and the 2 GB limit."""
    m = onnx.ModelProto()
    m.ir_version = proto.ir_version
    m.opset_import.extend(proto.opset_import)
    m.functions.extend(proto.functions)
    g = m.graph
    g.node.extend(proto.graph.node)
    g.input.extend(proto.graph.input)
    g.output.extend(proto.graph.output)
    g.value_info.extend(proto.graph.value_info)
    names = {i.name for i in proto.graph.input}
    for t in proto.graph.initializer:
        small_int = t.data_type in (onnx.TensorProto.INT32, onnx.TensorProto.INT64) and math.prod(t.dims) <= 4096
        if small_int and not t.external_data:
            g.initializer.append(t)
        elif t.name not in names:
            g.input.append(onnx.helper.make_tensor_value_info(t.name, t.data_type, list(t.dims)))
    return m
