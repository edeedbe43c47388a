"""`select_logit_rows`: the LM head of the CPU path computed for chosen token rows only.

A prefill computes the logits of every prompt token, yet greedy generation reads the last one: with SmolLM2's 49152 x
576 head, 61 prompt rows are about 3.5 GFLOP of a 61-token prefill's 16. The rewrite gathers the head's input rows
before it: `rows = ROWS_INPUT if it has entries else every row`, where ROWS_INPUT is a graph input backed by an
empty int64 initializer (an overridable initializer: left alone, the model computes every row, as before; fed, only
the rows given). runtime/delegate.py applies it; Generator's direct path (runtime/generate.py) feeds the last row of
each step. Applied when the logits output comes from a MatMul / Gemm / MatMulNBits on a 2-D input through row-wise
ops only (Cast, Tanh, Identity, and Mul / Div / Add by a constant: a softcap).
"""

from __future__ import annotations

import numpy as np
import onnx
from onnx import TensorProto, helper, numpy_helper

ROWS_INPUT = "pagedkit.logit_rows"
# the LM head and the row-wise ops between it and the logits (also runtime/fuse.py's `logit_rows`, the torch path)
HEADS = {"MatMul", "Gemm", "MatMulNBits"}
ROW_WISE = {"Cast", "Tanh", "Identity"}
BY_CONSTANT = {"Mul", "Div", "Add", "Sub"}


def _head(g: onnx.GraphProto, output: str):
    """The LM head node feeding `output` through row-wise ops, or None."""
    producer = {o: n for n in g.node for o in n.output if o}
    consts = {t.name for t in g.initializer} | {n.output[0] for n in g.node if n.op_type == "Constant"}
    name = output
    for _ in range(8):
        node = producer.get(name)
        if node is None:
            return None
        if node.op_type in HEADS and node.domain in ("", "ai.onnx", "com.microsoft"):
            if node.op_type == "Gemm" and any(a.name == "transA" and a.i for a in node.attribute):
                return None
            return node
        if node.op_type in ROW_WISE:
            name = node.input[0]
        elif node.op_type in BY_CONSTANT and len(node.input) == 2 and node.input[1] in consts:
            name = node.input[0]
        else:
            return None
    return None


def select_logit_rows(model: onnx.ModelProto, logits: str = "logits") -> bool:
    """Edit `model` in place (a proto of the caller's) so that feeding ROWS_INPUT selects the logits' rows; False
    (unchanged) when its head is not recognized or the logits are not declared 2-D ([tokens, vocabulary]: the
    row-wise ops keep the head input's rank, so its rows are the tokens)."""
    g = model.graph
    out = next((o for o in g.output if o.name == logits), None)
    if ROWS_INPUT in {i.name for i in g.input} or out is None:
        return False
    if not out.type.tensor_type.HasField("shape") or len(out.type.tensor_type.shape.dim) != 2:
        return False
    head = _head(g, logits)
    if head is None:
        return False
    hidden = head.input[0]
    p = f"{ROWS_INPUT}/"
    i64 = lambda name, v: numpy_helper.from_array(np.array(v, dtype=np.int64), name)  # noqa: E731
    g.initializer.extend([i64(ROWS_INPUT, np.zeros(0, np.int64)), i64(p + "zero", [0]), i64(p + "one", [1]),
                          i64(p + "zero_s", 0), i64(p + "one_s", 1)])
    g.input.append(helper.make_tensor_value_info(ROWS_INPUT, TensorProto.INT64, ["logit_rows"]))
    n = helper.make_node
    nodes = [
        n("Shape", [ROWS_INPUT], [p + "given"]),  # [R]
        n("Shape", [hidden], [p + "tokens"], start=0, end=1),  # [T]
        n("Greater", [p + "given", p + "zero"], [p + "some"]),
        n("Where", [p + "some", p + "given", p + "tokens"], [p + "count"]),
        n("Squeeze", [p + "tokens", p + "zero"], [p + "t"]),
        n("Range", [p + "zero_s", p + "t", p + "one_s"], [p + "all"]),
        n("Concat", [ROWS_INPUT, p + "all"], [p + "both"], axis=0),
        n("Slice", [p + "both", p + "zero", p + "count"], [p + "rows"]),
        n("Gather", [hidden, p + "rows"], [p + "hidden"], axis=0),
    ]
    for k, node in enumerate(nodes):
        node.name = f"{p}{k}"
    at = list(g.node).index(head)
    head.input[0] = p + "hidden"
    for k, node in enumerate(nodes):
        g.node.insert(at + k, node)
    return True


__all__ = ["BY_CONSTANT", "HEADS", "ROWS_INPUT", "ROW_WISE", "select_logit_rows"]
