"""The compiled execution plan (runtime/plan.py, graph.py's prepack, kernels/scope.py) and the session options.

- Prepacked products: single-node MatMul / Gemm models with a constant weight, run by pagedkit's session (which
  lays the weight out once: oneDNN-packed float32, [N, K] float16) against onnxruntime CPU, fresh random inputs,
  norm-relative bounds; the stored weight is replaced, not kept beside its packed form; teeth: a 2% wrong
  weight fails the same bound.
- The plan of a whole exported model: each weight held once (the session's constants add up to the model's
  initializers), one attention plan per run shared by every layer, a changed step (other lengths) re-planned.
- SessionOptions.intra_op_num_threads (and onnxruntime's own SessionOptions) set torch's threads; bad values
  are refused naming the field; `paged-run --threads`.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnxruntime as ort
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from pagedkit import InferenceSession, SessionOptions
from pagedkit.runtime.generate import Generator

RNG = np.random.default_rng(7)


def _product_model(op: str, w: np.ndarray, m_sym: bool = True, **attrs) -> onnx.ModelProto:
    k = w.shape[1] if attrs.get("transB") else w.shape[0]
    n = w.shape[0] if attrs.get("transB") else w.shape[1]
    elem = helper.np_dtype_to_tensor_dtype(w.dtype)
    node = helper.make_node(op, ["a", "w"], ["y"], **attrs)
    graph = helper.make_graph([node], "p", [helper.make_tensor_value_info("a", elem, ["m", k])],
                              [helper.make_tensor_value_info("y", elem, ["m", n])],
                              initializer=[numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


def _rel(got: np.ndarray, ref: np.ndarray) -> float:
    got, ref = got.astype(np.float64), ref.astype(np.float64)
    return float(np.abs(got - ref).max() / np.abs(ref).max())


CASES = [("MatMul", np.float32, {}), ("MatMul", np.float16, {}), ("Gemm", np.float32, {"transB": 1}),
         ("Gemm", np.float16, {"transB": 1}), ("Gemm", np.float32, {})]


@pytest.mark.parametrize("rows", [1, 3, 61])
@pytest.mark.parametrize("op,dtype,attrs", CASES, ids=[f"{o}-{np.dtype(d).name}-{a}" for o, d, a in CASES])
def test_prepacked_products_match_onnxruntime(op, dtype, attrs, rows):
    k, n = 96, 160
    w = (RNG.standard_normal((n, k) if attrs.get("transB") else (k, n)) / np.sqrt(k)).astype(dtype)
    model = _product_model(op, w, **attrs)
    a = RNG.standard_normal((rows, k)).astype(dtype)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"a": a})[0]
    sess = InferenceSession(model)
    layout = sess.prepacked[next(iter(sess.prepacked))]
    assert ("oneDNN" in layout) if dtype == np.float32 else ("[N, K] float16" in layout)
    assert "w" not in sess._compiled.graph.consts  # replaced, not duplicated
    got = sess.run(None, {"a": a})[0]
    tol = 1e-5 if dtype == np.float32 else 2e-3
    assert got.dtype == ref.dtype and got.shape == ref.shape
    assert _rel(got, ref) <= tol
    wrong = InferenceSession(_product_model(op, (w.astype(np.float32) * 1.02).astype(dtype), **attrs))
    assert _rel(wrong.run(None, {"a": a})[0], ref) > 5 * tol  # teeth: a 2% wrong weight fails the bound


@pytest.mark.parametrize("native", [True, False])
@pytest.mark.parametrize("rows", [1, 8, 61])
def test_half_products_on_both_paths_match_onnxruntime(native, rows, monkeypatch):
    """float16 products with and without native float16 kernels (HALF_MATMUL_NATIVE): without, 8+ rows take the
    float32 path with B converted in row slices (CONVERT_ELEMENTS small here: 4 slices, the last partial)."""
    from pagedkit.runtime.ops import math as ops_math

    monkeypatch.setattr(ops_math, "HALF_MATMUL_NATIVE", native)
    monkeypatch.setattr(ops_math, "CONVERT_ELEMENTS", 96 * 48)
    calls = []
    real = ops_math._Linear._float32_product
    monkeypatch.setattr(ops_math._Linear, "_float32_product", lambda self, a: calls.append(a.shape) or real(self, a))
    k, n = 96, 160
    w = (RNG.standard_normal((k, n)) / np.sqrt(k)).astype(np.float16)
    a = RNG.standard_normal((rows, k)).astype(np.float16)
    model = _product_model("MatMul", w)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"a": a})[0]
    got = InferenceSession(model).run(None, {"a": a})[0]
    assert bool(calls) == (not native and rows >= ops_math.HALF_ROWS)
    assert got.dtype == np.float16 and got.shape == (rows, n)
    assert _rel(got, ref) <= 2e-3
    wrong = InferenceSession(_product_model("MatMul", (w.astype(np.float32) * 1.02).astype(np.float16)))
    assert _rel(wrong.run(None, {"a": a})[0], ref) > 1e-2  # teeth: a 2% wrong weight fails the bound


def test_a_weight_shared_by_two_products_is_packed_once():
    w = RNG.standard_normal((64, 96)).astype(np.float32)
    nodes = [helper.make_node("MatMul", ["a", "w"], ["y1"]), helper.make_node("MatMul", ["b", "w"], ["y2"])]
    graph = helper.make_graph(nodes, "p", [helper.make_tensor_value_info(x, TensorProto.FLOAT, [2, 64]) for x in "ab"],
                              [helper.make_tensor_value_info(y, TensorProto.FLOAT, [2, 96]) for y in ("y1", "y2")],
                              initializer=[numpy_helper.from_array(w, "w")])
    sess = InferenceSession(helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)]))
    packed = [n for n in sess._compiled.graph.consts if n.startswith("w")]
    assert len(packed) == 1 and packed[0] != "w"
    a, b = RNG.standard_normal((2, 64)).astype(np.float32), RNG.standard_normal((2, 64)).astype(np.float32)
    y1, y2 = sess.run(None, {"a": a, "b": b})
    assert _rel(y1, a @ w) <= 1e-5 and _rel(y2, b @ w) <= 1e-5


@pytest.fixture(scope="module")
def tiny_export(tmp_path_factory):
    from export_utils import export_tiny, tiny_model

    out = tmp_path_factory.mktemp("plan") / "m"
    export_tiny(tiny_model("LlamaConfig"), out)
    return out


def test_each_weight_is_held_once(tiny_export):
    model = onnx.load(str(tiny_export / "model.onnx"))
    stored = sum(numpy_helper.to_array(t).nbytes for t in model.graph.initializer)
    sess = InferenceSession(str(tiny_export / "model.onnx"))
    held = 0
    for t in sess._compiled.graph.consts.values():
        held += t.nbytes if hasattr(t, "nbytes") and not isinstance(t, torch.Tensor) else t.numel() * t.element_size()
    assert held <= stored * 1.01, (held, stored)
    assert len(sess.prepacked) >= 4


def test_one_attention_plan_per_run_shared_by_every_layer(tiny_export, monkeypatch):
    from pagedkit.kernels.paged import torch_planned

    calls = []
    real = torch_planned._plan
    monkeypatch.setattr(torch_planned, "_plan", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    gen = Generator(tiny_export, max_seq_len=64, cpu_backend="torch")  # the torch kernels' plan
    layers = gen.config.num_layers
    assert layers >= 2 and set(gen.session.attention_variants.values()) == {"torch_planned"}
    steps = list(gen.greedy([3, 9, 4, 17, 5, 8, 2], 4, stop_at_eos=False))
    assert len(calls) == len(steps)  # one plan per run (prefill + 3 decode steps), not one per layer


def test_threads_from_session_options(monkeypatch):
    before = torch.get_num_threads()
    model = _product_model("MatMul", RNG.standard_normal((8, 8)).astype(np.float32))
    try:
        InferenceSession(model, SessionOptions(intra_op_num_threads=1))
        assert torch.get_num_threads() == 1
        opts = ort.SessionOptions()
        opts.intra_op_num_threads = 2
        InferenceSession(model, opts)  # onnxruntime's own options object reads the same
        assert torch.get_num_threads() == 2
        with pytest.raises(ValueError, match="intra_op_num_threads"):
            InferenceSession(model, SessionOptions(intra_op_num_threads=-1))
    finally:
        torch.set_num_threads(before)


def test_paged_run_threads(capsys):
    from pathlib import Path

    from pagedkit.apps.run.cli import main

    tiny = Path(__file__).resolve().parents[1] / "examples" / "tiny-paged"
    before = torch.get_num_threads()
    try:
        assert main([str(tiny), "--prompt-ids", "1,2,3", "--max-new-tokens", "2", "--threads", "1"]) == 0
        assert torch.get_num_threads() == 1
    finally:
        torch.set_num_threads(before)
    assert main([str(tiny), "--prompt-ids", "1,2,3", "--threads", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["paged-run: --threads should be >= 1, got 0"]


def test_prepack_leaves_a_node_with_run_time_zero_points_unpacked():
    """Prepack sees run-time inputs as RUNTIME, not as absent: a MatMulNBits whose zero points are a graph
    input keeps its raw weight (exact path); with constant zero points it is packed. Oracle: the weight
    dequantized by hand in numpy (onnxruntime CPU 1.32 agrees at accuracy_level 0; at level 4 with run-time
    zero points it is off by ~0.69 of max|ref| on this case, so it is not the oracle here)."""
    n, k, bs = 64, 96, 32
    kb = k // bs
    b = RNG.integers(0, 256, (n, kb, bs // 2), dtype=np.uint8)
    scales = (RNG.random(n * kb) * 0.1 + 0.01).astype(np.float32)
    zp = RNG.integers(0, 256, (n * ((kb + 1) // 2),), dtype=np.uint8)
    attrs = dict(K=k, N=n, bits=4, block_size=bs, accuracy_level=4, domain="com.microsoft")
    a = RNG.standard_normal((3, k)).astype(np.float32)

    def model(zp_input: bool):
        node = helper.make_node("MatMulNBits", ["a", "b", "s", "zp"], ["y"], **attrs)
        inits = [numpy_helper.from_array(b, "b"), numpy_helper.from_array(scales, "s")]
        inputs = [helper.make_tensor_value_info("a", TensorProto.FLOAT, [3, k])]
        if zp_input:
            inputs.append(helper.make_tensor_value_info("zp", TensorProto.UINT8, list(zp.shape)))
        else:
            inits.append(numpy_helper.from_array(zp, "zp"))
        graph = helper.make_graph([node], "q", inputs, [helper.make_tensor_value_info("y", TensorProto.FLOAT, [3, n])],
                                  initializer=inits)
        return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])

    feeds = {"a": a, "zp": zp}
    q = np.stack([b & 15, b >> 4], -1).reshape(n, kb, bs).astype(np.float64)
    z = np.stack([zp & 15, zp >> 4], -1).reshape(n, -1)[:, :kb].astype(np.float64)
    ref = a.astype(np.float64) @ ((q - z[..., None]) * scales.reshape(n, kb)[..., None]).reshape(n, k).T
    attrs["accuracy_level"] = 0
    exact = ort.InferenceSession(model(True).SerializeToString(), providers=["CPUExecutionProvider"])
    assert _rel(exact.run(None, feeds)[0], ref) <= 1e-5
    attrs["accuracy_level"] = 4
    run_time = InferenceSession(model(True))
    assert run_time.prepacked == {}
    assert _rel(run_time.run(None, feeds)[0], ref) <= 1e-5
    const = InferenceSession(model(False))
    assert len(const.prepacked) == 1
    assert _rel(const.run(None, {"a": a})[0], ref) <= 3e-2  # bf16 activations at accuracy_level 4


def _batched_model(w: np.ndarray, a_shape: list) -> onnx.ModelProto:
    elem = helper.np_dtype_to_tensor_dtype(w.dtype)
    graph = helper.make_graph([helper.make_node("MatMul", ["a", "w"], ["y"])], "p",
                              [helper.make_tensor_value_info("a", elem, a_shape)],
                              [helper.make_tensor_value_info("y", elem, None)],
                              initializer=[numpy_helper.from_array(w, "w")])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21)])


@pytest.mark.parametrize("dtype", [np.float32, np.float16])
@pytest.mark.parametrize("a_shape", [(4, 3, 64), (1, 3, 64), (3, 64), (2, 4, 5, 64)])
def test_batched_constant_products_are_prepacked_and_match_onnxruntime(dtype, a_shape):
    """B [E, K, N] (MoE experts as one MatMul, MLA's per-head projections): one packed product per entry, no
    float32 copy of a half B kept, numpy broadcasting of A's leading dims."""
    from pagedkit.runtime.ops import math as M

    w = (RNG.standard_normal((4, 64, 80)) / 8).astype(dtype)
    model = _batched_model(w, list(a_shape))
    a = RNG.standard_normal(a_shape).astype(dtype)
    ref = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"a": a})[0]
    sess = InferenceSession(model)
    assert "4 x" in next(iter(sess.prepacked.values())) and "w" not in sess._compiled.graph.consts
    M._F32.clear()
    got = sess.run(None, {"a": a})[0]
    assert got.shape == ref.shape and _rel(got, ref) <= (1e-5 if dtype == np.float32 else 2e-3)
    assert not any(f.numel() >= w[0].size for _, f, _ in M._F32.values())  # no float32 copy of B held
    wrong = InferenceSession(_batched_model((w.astype(np.float32) * 1.02).astype(dtype), list(a_shape)))
    assert _rel(wrong.run(None, {"a": a})[0], ref) > 5e-3  # teeth


def test_transpose_releasing_equals_a_plain_transpose(monkeypatch):
    from pagedkit.runtime.ops import packed

    src = torch.randn(1000, 3000).half()
    want = src.T.contiguous()
    monkeypatch.setattr(packed, "_CHUNK_BYTES", 64 << 10)  # many chunks
    got = packed.transpose_releasing(src, release_min=0)
    assert torch.equal(got, want) and got.is_contiguous()
    assert packed.transpose_releasing(want.T).data_ptr() == want.data_ptr()  # already [N, K]: no copy
