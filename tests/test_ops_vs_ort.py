"""pagedkit.runtime.ops vs onnxruntime CPU, part 1: elementwise, activations, shape, indexing,
reductions, matmuls. Part 2 (LLM ops, lookup, doc) is test_ops_vs_ort_llm.py.

Each case is one node on fresh seeded random inputs (no zeros), run by onnxruntime 1.32 CPU and by
our table; integers exact, fp32 max|diff| <= 1e-5 * max|ref|, fp16 1e-3 * max|ref|.
"""

from __future__ import annotations

import numpy as np
import pytest
from onnx import TensorProto, helper

from ops_single_node import case, check_case, i64, ints, randn, uniform

F16 = dict(tol=1e-3)

ELEMENTWISE = [
    *(case(op, randn(3, 4), randn(4), id=op) for op in ("Add", "Sub", "Mul", "Div")),
    case("Add", randn(2, 3, 4, dtype=np.float16), randn(3, 1, dtype=np.float16), id="Add-f16", **F16),
    case("Div", ints(-50, 50, 3, 4, dtype=np.int32), np.array([3, -4, 7, -2], np.int32), id="Div-int-trunc"),
    case("Pow", uniform(0.5, 2, 3, 4), randn(3, 4)),
    case("Pow", uniform(0.5, 2, 3, 4), np.array(3, dtype=np.int64), id="Pow-int-exp"),
    case("Mod", ints(-50, 50, 3, 4), i64(3, -4, 7, -2), id="Mod-int"),
    case("Mod", randn(3, 4) * 5, uniform(0.5, 2, 3, 4), attrs=dict(fmod=1), id="Mod-fmod"),
    case("Max", randn(3, 4), randn(4), randn(1, 4), id="Max-3in"),
    case("Min", randn(3, 4), randn(3, 1), id="Min"),
    case("Sum", randn(3, 4), randn(4), randn(3, 4), id="Sum"),
    case("Mean", randn(3, 4), randn(3, 4), id="Mean"),
    *(case(op, ints(0, 3, 3, 4), ints(0, 3, 4), id=op)
      for op in ("Equal", "Less", "LessOrEqual", "Greater", "GreaterOrEqual")),
    case("Equal", randn(3, 4), randn(3, 4), id="Equal-float"),
    *(case(op, ints(0, 2, 3, 4).astype(bool), ints(0, 2, 4).astype(bool), id=op) for op in ("And", "Or", "Xor")),
    case("Not", ints(0, 2, 3, 4).astype(bool)),
    *(case(op, randn(3, 5), id=op) for op in (
        "Exp", "Neg", "Abs", "Floor", "Ceil", "Sin", "Cos", "Tan", "Atan", "Sinh", "Cosh", "Tanh", "Erf", "Sigmoid",
        "Relu", "Softplus", "Sign")),
    *(case(op, uniform(0.1, 4, 3, 5), id=op) for op in ("Sqrt", "Log", "Reciprocal")),
    *(case(op, uniform(-0.9, 0.9, 3, 5), id=op) for op in ("Asin", "Acos")),
    case("Round", np.concatenate([randn(8) * 3, np.array([0.5, 1.5, 2.5, -0.5, -2.5], np.float32)]),
         id="Round-half-even"),
    case("Abs", ints(-9, 9, 3, 4, dtype=np.int32, nonzero=True), id="Abs-int"),
    case("Relu", randn(3, 5, dtype=np.float16), id="Relu-f16", **F16),
    case("IsNaN", np.array([1.0, np.nan, -np.inf, 2.0], np.float32)),
    case("IsInf", np.array([1.0, np.nan, -np.inf, np.inf], np.float32), id="IsInf"),
    case("IsInf", np.array([1.0, np.nan, -np.inf, np.inf], np.float32), attrs=dict(detect_negative=0), id="IsInf-pos"),
    case("Where", ints(0, 2, 3, 4).astype(bool), randn(3, 4), randn(4)),
    case("Clip", randn(3, 4), np.array(-0.5, np.float32), np.array(0.7, np.float32), opset=13, id="Clip-13"),
    case("Clip", randn(3, 4), np.array(-0.5, np.float32), None, opset=13, id="Clip-13-min-only"),
    case("Clip", randn(3, 4), attrs=dict(min=-0.3, max=0.4), opset=6, id="Clip-6"),
    case("Clip", ints(-9, 9, 3, 4), i64(-2).reshape(()), i64(5).reshape(()), opset=13, id="Clip-int"),
    case("Cast", randn(3, 4) * 10, attrs=dict(to=TensorProto.INT32), id="Cast-f2i-trunc"),
    case("Cast", randn(3, 4), attrs=dict(to=TensorProto.FLOAT16), id="Cast-f2h"),
    case("Cast", ints(-9, 9, 3, 4), attrs=dict(to=TensorProto.FLOAT), id="Cast-i2f"),
    case("Cast", randn(3, 4), attrs=dict(to=TensorProto.BOOL), id="Cast-f2b"),
    case("Cast", ints(0, 2, 3, 4).astype(bool), attrs=dict(to=TensorProto.FLOAT), id="Cast-b2f"),
    case("CastLike", randn(3, 4), np.zeros(1, np.float16) + 1, id="CastLike"),
]

ACTIVATIONS = [
    case("Gelu", randn(3, 8), opset=20, id="Gelu-none"),
    case("Gelu", randn(3, 8), attrs=dict(approximate="tanh"), opset=20, id="Gelu-tanh"),
    case("Gelu", randn(3, 8), domain="com.microsoft", id="ms-Gelu"),
    case("FastGelu", randn(2, 3, 8), domain="com.microsoft", id="FastGelu"),
    case("FastGelu", randn(2, 3, 8), randn(8), domain="com.microsoft", id="FastGelu-bias"),
    case("QuickGelu", randn(2, 8), domain="com.microsoft", id="QuickGelu"),
    case("QuickGelu", randn(2, 8), attrs=dict(alpha=1.3), domain="com.microsoft", id="QuickGelu-alpha"),
    case("BiasGelu", randn(2, 3, 8), randn(8), domain="com.microsoft", id="BiasGelu"),
    case("Swish", randn(3, 8), attrs=dict(alpha=0.8), opset=24, id="Swish-24"),
    case("HardSigmoid", randn(3, 8) * 4, attrs=dict(alpha=0.3, beta=0.4)),
    case("HardSwish", randn(3, 8) * 4),
    case("LeakyRelu", randn(3, 8), attrs=dict(alpha=0.1)),
    case("Elu", randn(3, 8), attrs=dict(alpha=0.7)),
    case("Softmax", randn(2, 3, 8) * 3, id="Softmax"),
    case("Softmax", randn(2, 3, 8) * 3, attrs=dict(axis=1), id="Softmax-axis1"),
    case("Softmax", randn(2, 3, 8) * 3, attrs=dict(axis=1), opset=11, id="Softmax-11-flatten"),
    case("Softmax", randn(2, 3, 8, dtype=np.float16), id="Softmax-f16", **F16),
    case("LogSoftmax", randn(2, 3, 8) * 3, id="LogSoftmax"),
    case("LogSoftmax", randn(4, 6), attrs=dict(axis=0), id="LogSoftmax-axis0"),
]

X = randn(2, 3, 4, 5)
SHAPE = [
    case("Reshape", X, i64(0, -1, 5), id="Reshape-0-neg1"),
    case("Reshape", randn(0, 4), i64(0, 2, 2), attrs=dict(allowzero=1), id="Reshape-allowzero"),
    case("Transpose", X, attrs=dict(perm=[0, 2, 3, 1]), id="Transpose"),
    case("Transpose", randn(2, 3, 4), id="Transpose-default"),
    case("Squeeze", randn(2, 1, 3, 1), i64(-1, 1), id="Squeeze-13"),
    case("Squeeze", randn(2, 1, 3, 1), attrs=dict(axes=[1]), opset=11, id="Squeeze-11"),
    case("Squeeze", randn(1, 3, 1), id="Squeeze-all"),
    case("Unsqueeze", randn(2, 3), i64(-1, 0), id="Unsqueeze-13"),
    case("Unsqueeze", randn(2, 3), attrs=dict(axes=[1, 3]), opset=11, id="Unsqueeze-11"),
    case("Concat", randn(2, 3), randn(2, 1), randn(2, 4), attrs=dict(axis=-1)),
    case("Split", randn(2, 7), attrs=dict(axis=1, num_outputs=3), outputs=3, id="Split-18-num_outputs"),
    case("Split", randn(6, 3), i64(1, 3, 2), outputs=3, id="Split-sizes"),
    case("Split", randn(6, 3), outputs=2, opset=13, id="Split-equal"),
    case("Split", randn(2, 5), attrs=dict(axis=1, split=[2, 3]), outputs=2, opset=11, id="Split-11"),
    case("Slice", X, i64(1, -3), i64(1000, -1), i64(1, 3), i64(1, 2), id="Slice-steps"),
    case("Slice", X, i64(-1, 3), i64(-1000, 0), i64(2, 0), i64(-2, -1), id="Slice-neg-steps"),
    case("Slice", X, i64(0), i64(-1), id="Slice-default-axes"),
    case("Slice", randn(5, 4), attrs=dict(starts=[1], ends=[4], axes=[0]), opset=9, id="Slice-1"),
    case("Expand", randn(3, 1), i64(2, 1, 4), id="Expand"),
    case("Tile", randn(2, 3), i64(2, 3)),
    case("Shape", X, id="Shape"),
    case("Shape", X, attrs=dict(start=1, end=-1), id="Shape-start-end"),
    case("Size", X),
    case("ConstantOfShape", i64(2, 3), attrs=dict(value=helper.make_tensor("v", TensorProto.INT64, [1], [7])),
         id="ConstantOfShape-int"),
    case("ConstantOfShape", i64(4), id="ConstantOfShape-default"),
    case("Range", np.array(2, np.int64), np.array(17, np.int64), np.array(3, np.int64), id="Range-int"),
    case("Range", np.array(0.5, np.float32), np.array(-3.2, np.float32), np.array(-0.7, np.float32), id="Range-float"),
    case("Flatten", X, attrs=dict(axis=2), id="Flatten"),
    case("Flatten", X, attrs=dict(axis=0), id="Flatten-0"),
    case("Flatten", X, attrs=dict(axis=-1), id="Flatten-neg"),
    case("Identity", X),
    case("Constant", attrs=dict(value=helper.make_tensor("v", TensorProto.FLOAT, [2, 2], [1.5, -2, 3, 4])),
         id="Constant-tensor"),
    case("Constant", attrs=dict(value_floats=[1.5, -2.0]), id="Constant-floats"),
    case("Constant", attrs=dict(value_int=7), id="Constant-int"),
    case("Constant", attrs=dict(value_ints=[3, -1, 4]), id="Constant-ints"),
    case("Pad", randn(2, 3), i64(1, 2, 0, 1), np.array(1.5, np.float32), id="Pad-constant"),
    case("Pad", randn(3, 4), i64(-1, 2, 1, -2), id="Pad-negative"),
    case("Pad", randn(2, 3, 4), i64(2, 1), None, i64(-1), id="Pad-axes"),
    case("Pad", randn(3, 4), i64(2, 1, 1, 2), attrs=dict(mode="edge"), id="Pad-edge"),
    case("Pad", randn(3, 4), i64(2, 1, 1, 2), attrs=dict(mode="reflect"), id="Pad-reflect"),
    case("Pad", randn(3, 4), i64(2, 1, 1, 2), attrs=dict(mode="wrap"), opset=19, id="Pad-wrap"),
    case("Trilu", randn(2, 4, 5), np.array(1, np.int64), id="Trilu-upper-k1"),
    case("Trilu", randn(4, 5), np.array(-1, np.int64), attrs=dict(upper=0), id="Trilu-lower-k-1"),
]

D = randn(5, 4, 3)
INDEXING = [
    case("Gather", D, i64(0, -1, 2, 2), id="Gather-neg"),
    case("Gather", D, ints(-4, 4, 2, 3), attrs=dict(axis=1), id="Gather-axis1-2d"),
    case("Gather", D, np.array(-2, np.int64), attrs=dict(axis=2), id="Gather-scalar"),
    case("Gather", D, ints(0, 5, 3, dtype=np.int32), id="Gather-int32"),
    case("GatherElements", D, ints(-4, 4, 5, 2, 3), attrs=dict(axis=1)),
    case("GatherND", D, ints(-3, 4, 2, 2), id="GatherND"),
    case("GatherND", D, ints(0, 3, 5, 2, 1), attrs=dict(batch_dims=1), id="GatherND-batch"),
    case("ScatterND", D, i64(1, 3, -1).reshape(3, 1), randn(3, 4, 3), id="ScatterND"),
    case("ScatterND", D, i64(1, 2, 1, 2).reshape(2, 2), randn(2, 3), attrs=dict(reduction="add"), opset=18,
         id="ScatterND-add"),
    case("ScatterND", D, i64(0, 1, 0, 1).reshape(2, 2), randn(2, 3), attrs=dict(reduction="mul"), opset=18,
         id="ScatterND-mul"),
    case("ScatterElements", D, i64(0, -1, 2, 1).reshape(1, 4, 1), randn(1, 4, 1), attrs=dict(axis=1),
         id="ScatterElements"),
    case("ScatterElements", D, ints(0, 5, 3, 4, 3), randn(3, 4, 3), attrs=dict(reduction="add"),
         id="ScatterElements-add"),
    case("ScatterElements", D, ints(0, 5, 3, 4, 3), randn(3, 4, 3), attrs=dict(reduction="max"),
         id="ScatterElements-max"),
    case("TopK", randn(3, 10), i64(4), outputs=2, id="TopK"),
    case("TopK", randn(6, 5), i64(2), attrs=dict(axis=0, largest=0), outputs=2, id="TopK-smallest-axis0"),
    case("TopK", ints(0, 3, 2, 8, dtype=np.int32), i64(5), outputs=2, id="TopK-ties"),
    case("ArgMax", ints(0, 4, 3, 6), attrs=dict(axis=1, keepdims=0), id="ArgMax-ties"),
    case("ArgMax", ints(0, 4, 3, 6), attrs=dict(axis=1, select_last_index=1), id="ArgMax-last"),
    case("ArgMin", randn(3, 6), attrs=dict(axis=-1), id="ArgMin"),
    case("NonZero", ints(0, 2, 3, 4).astype(np.float32) * randn(3, 4)),
    case("OneHot", i64(0, 3, -1, 7), np.array(5, np.int64), np.array([-1.0, 2.0], np.float32), id="OneHot"),
    case("OneHot", i64(1, 0, 2, 1).reshape(2, 2), np.array(3, np.int64), i64(0, 1), attrs=dict(axis=0),
         id="OneHot-axis0"),
]

R = randn(3, 4, 5)
REDUCE = [
    *(case(op, R, i64(1, -1), attrs=dict(keepdims=k), id=f"{op}-keep{k}")
      for op in ("ReduceSum", "ReduceMean", "ReduceMax", "ReduceMin", "ReduceProd", "ReduceL1", "ReduceL2",
                 "ReduceSumSquare", "ReduceLogSumExp") for k in (0, 1)),
    case("ReduceLogSum", uniform(0.5, 2, 3, 4, 5), i64(2), id="ReduceLogSum"),
    case("ReduceSum", R, i64(0, 2), opset=13, id="ReduceSum-13"),
    case("ReduceMean", R, attrs=dict(axes=[-1], keepdims=0), opset=13, id="ReduceMean-13-attr"),
    case("ReduceMax", R, id="ReduceMax-all"),
    case("ReduceSum", R, np.zeros(0, np.int64), attrs=dict(noop_with_empty_axes=1), id="ReduceSum-noop"),
    case("ReduceSumSquare", R, attrs=dict(noop_with_empty_axes=1), id="ReduceSumSquare-noop"),
    case("ReduceSum", ints(-9, 9, 3, 4, dtype=np.int32), i64(1), id="ReduceSum-int"),
    case("CumSum", R, np.array(1, np.int64), id="CumSum"),
    case("CumSum", R, np.array(-1, np.int32), attrs=dict(exclusive=1, reverse=1), id="CumSum-excl-rev"),
    case("CumSum", ints(-9, 9, 3, 4, dtype=np.int32), np.array(0, np.int64), attrs=dict(exclusive=1), id="CumSum-int"),
]

MATH = [
    case("MatMul", randn(2, 3, 8), randn(8, 5), id="MatMul-3d-2d"),
    case("MatMul", randn(2, 1, 3, 8), randn(4, 8, 5), id="MatMul-broadcast"),
    case("MatMul", randn(8), randn(2, 8, 5), id="MatMul-vec"),
    case("MatMul", randn(3, 16, dtype=np.float16), randn(16, 5, dtype=np.float16), id="MatMul-f16", **F16),
    case("Gemm", randn(3, 8), randn(8, 5), randn(5), id="Gemm"),
    case("Gemm", randn(8, 3), randn(5, 8), randn(3, 1), attrs=dict(transA=1, transB=1, alpha=0.7, beta=1.3),
         id="Gemm-trans-alpha-beta"),
    case("Gemm", randn(3, 8), randn(8, 5), id="Gemm-noC"),
    case("Einsum", randn(2, 3, 4), randn(2, 4, 5), attrs=dict(equation="bij,bjk->bik"), opset=12, id="Einsum-bmm"),
    case("Einsum", randn(3, 4), attrs=dict(equation="ij->ji"), opset=12, id="Einsum-transpose"),
]


@pytest.mark.parametrize("c", ELEMENTWISE + ACTIVATIONS + SHAPE + INDEXING + REDUCE + MATH)
def test_op_matches_onnxruntime(c):
    check_case(c)
