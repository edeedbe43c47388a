"""Creation-time fusions (runtime/fuse.py): the SwiGLU MLP (MatMul gate / up + Sigmoid + Mul + Mul) becomes one
MatMul on the concatenated weight and SiluMul; results equal onnxruntime's CPU run of the unfused graph; a chain
whose intermediate is read elsewhere, or whose weights differ in shape, is left alone; the originals are dropped."""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
from onnx import TensorProto, helper, numpy_helper

from pagedkit import InferenceSession

RNG = np.random.default_rng(7)
F = TensorProto.FLOAT


def _mlp(k=48, n=80, swap=False, leak=False, up_n=None) -> onnx.ModelProto:
    """x [T, k] -> h = silu(x @ Wg) * (x @ Wu) [T, n] (+ the gate as a second output when leak)."""
    wg = RNG.standard_normal((k, n)).astype(np.float32) * 0.2
    wu = RNG.standard_normal((k, up_n or n)).astype(np.float32) * 0.2
    act = ["g", "s"] if not swap else ["s", "g"]
    nodes = [helper.make_node("MatMul", ["x", "wg"], ["g"], name="gate"),
             helper.make_node("MatMul", ["x", "wu"], ["u"], name="up"),
             helper.make_node("Sigmoid", ["g"], ["s"], name="sig"),
             helper.make_node("Mul", act, ["a"], name="act"),
             helper.make_node("Mul", ["u", "a"] if swap else ["a", "u"], ["h"], name="mul")]
    outputs = [helper.make_tensor_value_info("h", F, ["T", n])]
    if leak:
        outputs.append(helper.make_tensor_value_info("g", F, ["T", n]))
    graph = helper.make_graph(nodes, "mlp", [helper.make_tensor_value_info("x", F, ["T", k])], outputs,
                              [numpy_helper.from_array(wg, "wg"), numpy_helper.from_array(wu, "wu")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17)])


def _check(model, rows=3):
    x = RNG.standard_normal((rows, model.graph.input[0].type.tensor_type.shape.dim[1].dim_value)).astype(np.float32)
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x})
    sess = InferenceSession(model)
    got = sess.run(None, {"x": x})
    for g, w in zip(got, want):
        assert np.abs(g - w).max() <= 1e-5 * np.abs(w).max()
    return sess


@pytest.mark.parametrize("swap", [False, True])
@pytest.mark.parametrize("rows", [1, 5])
def test_swiglu_mlp_is_fused_and_matches_onnxruntime(swap, rows):
    sess = _check(_mlp(swap=swap), rows)
    assert sess.fused == {"swiglu_mlp": 1}
    ops = [op.step.op_type for op in sess._main.ops]
    assert ops == ["MatMul", "SiluMul"]
    consts = sess._compiled.graph.consts
    assert "wg" not in consts and "wu" not in consts  # the concatenated weight replaced both


def test_a_chain_whose_gate_is_read_elsewhere_is_left_alone():
    sess = _check(_mlp(leak=True))
    assert sess.fused == {}
    assert [op.step.op_type for op in sess._main.ops].count("MatMul") == 2


def test_weights_of_different_widths_are_left_alone():
    k, n = 48, 80
    model = _mlp(k, n)
    # a broadcasting up projection [k, 1]: not the pattern (its output broadcasts)
    model.graph.initializer[1].CopyFrom(numpy_helper.from_array(RNG.standard_normal((k, 1)).astype(np.float32), "wu"))
    model.graph.output[0].type.tensor_type.shape.dim[1].dim_value = n
    sess = _check(model)
    assert sess.fused == {}


def test_teeth_swapped_halves_fail(monkeypatch):
    """SiluMul gating the wrong half (silu(up) * gate) must not pass the comparison."""
    import torch.nn.functional as tf

    from pagedkit.runtime.ops import registry

    def swapped(inputs, attrs, ctx):
        y, n = inputs[0], int(attrs["split"])
        return [tf.silu(y[..., n:]) * y[..., :n]]

    monkeypatch.setitem(registry.OPS, ("pagedkit.fused", "SiluMul"), swapped)
    with pytest.raises(AssertionError):
        _check(_mlp())
