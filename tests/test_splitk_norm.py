"""Split-K products read by the RMS norm after them (kernels/triton/splitk.py, norm.rms_norm_acc) and the session
fusion that routes a decoder's O / down products there (runtime/fuse.py `splitk_skip_norm`, the fused op in
runtime/ops/norms.py). Kernels in Triton's interpreter on CPU against a float64 oracle written here
(s = a @ B + skip + bias, y = s / sqrt(mean(s^2) + eps) * gamma); bound max|diff| <= 5e-3 x max|ref| (float16
outputs). Teeth: an accumulator not zeroed between products, a 2% wrong B and a product skipped all fail it."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from pagedkit.kernels.triton import common

pytestmark = pytest.mark.skipif(not common.HAVE_TRITON, reason="needs triton")
TOL = 5e-3
EPS = 1e-6
DEVICE = "cuda" if torch.cuda.is_available() else "cpu"  # CPU: the interpreter (tests/conftest.py)
interpreter = pytest.mark.skipif(not common.INTERPRET, reason="CPU sessions on the interpreter's kernels")


def _oracle(a, b, skip, gamma, bias=None):
    a, b, skip, gamma = a.cpu(), b.cpu(), skip.cpu(), gamma.cpu()
    bias = None if bias is None else bias.cpu()
    s = a.double().reshape(-1, a.shape[-1]) @ b.double() + skip.double().reshape(-1, b.shape[1])
    if bias is not None:
        s = s + bias.double()
    y = s / torch.sqrt((s * s).mean(-1, keepdim=True) + EPS) * gamma.double()
    return y, s


def _rel(got, ref) -> float:
    got = got.cpu().double().reshape(ref.shape)
    assert torch.isfinite(got).all()
    return float((got - ref).abs().max() / ref.abs().max())


def _operands(rows, k, n, dtype=torch.float16, seed=0):
    g = torch.Generator().manual_seed(seed)
    a = torch.randn(rows, k, generator=g).to(dtype)
    b = (torch.randn(k, n, generator=g) / k ** 0.5).to(dtype)
    skip = torch.randn(rows, n, generator=g).to(dtype)
    gamma = (1 + 0.2 * torch.randn(n, generator=g)).to(dtype)
    bias = (0.1 * torch.randn(n, generator=g)).to(dtype)
    return tuple(t.to(DEVICE) for t in (a, b, skip, gamma, bias))


def _fused(a, b, skip, gamma, bias, acc_hook=None):
    from pagedkit.kernels.triton import norm, splitk

    acc = splitk.accumulate(a, b)
    if acc_hook is not None:
        acc = acc_hook(acc)
    return norm.rms_norm_acc(acc, gamma, EPS, skip=skip, bias=bias, want_sum=True)


@pytest.mark.parametrize("rows,k,n,dtype", [(1, 1024, 64, torch.float16), (3, 2048, 128, torch.float16),
                                            (5, 8192, 128, torch.bfloat16)])
def test_partials_reduced_by_the_norm(rows, k, n, dtype):
    a, b, skip, gamma, bias = _operands(rows, k, n, dtype)
    y, total = _fused(a, b, skip, gamma, bias)
    ref_y, ref_s = _oracle(a, b, skip, gamma, bias)
    tol = TOL if dtype == torch.float16 else 2e-2
    assert y.dtype == dtype and total.dtype == dtype
    assert _rel(y, ref_y) <= tol and _rel(total, ref_s) <= tol
    y2, _ = _fused(a, b, skip, gamma, bias)  # the shared accumulator was zeroed: the same again
    assert torch.equal(y2, y)


def test_serves_decode_rows_and_shapes_only():
    from pagedkit.kernels.triton import splitk

    a, b, *_ = _operands(1, 1024, 64)
    assert splitk.serves(a, b)
    assert not splitk.serves(torch.randn(33, 1024, device=DEVICE).half(), b)  # more rows than MAX_ROWS
    assert not splitk.serves(a[:, :1000], b[:1000])  # K not a multiple of SPLITS * BLOCK_K
    assert not splitk.serves(a.float(), b.float())  # float32
    with pytest.raises(ValueError, match="splitk.accumulate: unsupported operands"):
        splitk.accumulate(a.float(), b.float())


@pytest.mark.parametrize("wrong", ["not_zeroed", "b_2_percent", "no_product"])
def test_teeth(wrong):
    a, b, skip, gamma, bias = _operands(2, 1024, 64)
    ref_y, _ = _oracle(a, b, skip, gamma, bias)
    if wrong == "not_zeroed":  # the norm reads a copy, so the shared buffer keeps the first product
        _fused(a, b, skip, gamma, bias, acc_hook=torch.clone)
        y, _ = _fused(a, b, skip, gamma, bias)
        from pagedkit.kernels.triton import splitk
        splitk._ACC.clear()
    elif wrong == "b_2_percent":
        y, _ = _fused(a, (b.float() * 1.02).half(), skip, gamma, bias)
    else:
        y, _ = _fused(a, b, skip, gamma, bias, acc_hook=torch.zeros_like)
        from pagedkit.kernels.triton import splitk
        splitk._ACC.clear()
    assert _rel(y, ref_y) > TOL


# --- the session fusion --------------------------------------------------------------------------------------


def _model(k=1024, n=64, slot=0, leak=False, with_bias=True, np_dtype=np.float16):
    """y, sum = SkipSimplifiedLayerNormalization(x @ W, skip, gamma, bias) (x @ W in input `slot`), float16."""
    rng = np.random.default_rng(3)
    w = (rng.standard_normal((k, n)) / k ** 0.5).astype(np_dtype)
    gamma = (1 + 0.2 * rng.standard_normal(n)).astype(np_dtype)
    bias = (0.1 * rng.standard_normal(n)).astype(np_dtype)
    ins = ["h", "skip"] if slot == 0 else ["skip", "h"]
    nodes = [helper.make_node("MatMul", ["x", "w"], ["h"], name="o_proj"),
             helper.make_node("SkipSimplifiedLayerNormalization", [*ins, "gamma"] + (["bias"] if with_bias else []),
                              ["y", "", "", "sum"], name="norm", domain="com.microsoft", epsilon=EPS)]
    f16 = TensorProto.FLOAT16 if np_dtype == np.float16 else TensorProto.FLOAT
    outputs = [helper.make_tensor_value_info("y", f16, ["T", n]), helper.make_tensor_value_info("sum", f16, ["T", n])]
    if leak:
        outputs.append(helper.make_tensor_value_info("h", f16, ["T", n]))
    inits = [numpy_helper.from_array(w, "w"), numpy_helper.from_array(gamma, "gamma")]
    if with_bias:
        inits.append(numpy_helper.from_array(bias, "bias"))
    graph = helper.make_graph(nodes, "o_norm", [helper.make_tensor_value_info("x", f16, ["T", k]),
                                                helper.make_tensor_value_info("skip", f16, ["T", n])], outputs, inits)
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])
    return model, torch.from_numpy(w), torch.from_numpy(gamma), torch.from_numpy(bias) if with_bias else None


@pytest.fixture
def cpu_splitk(monkeypatch):
    """The fusion on CPU sessions and its kernels on CPU tensors (Triton's interpreter), as on CUDA."""
    from pagedkit.runtime import fuse
    from pagedkit.runtime.ops import norms

    monkeypatch.setattr(fuse, "SPLITK_DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(norms, "SPLITK_ON_CPU", True)
    calls = []
    real = norms.triton_kernels
    monkeypatch.setattr(norms, "triton_kernels", lambda name: calls.append(name) or real(name))
    return calls


@interpreter
@pytest.mark.parametrize("slot", [0, 1])
@pytest.mark.parametrize("with_bias", [True, False])
def test_session_fuses_and_matches_the_oracle(cpu_splitk, slot, with_bias):
    from pagedkit import InferenceSession

    model, w, gamma, bias = _model(slot=slot, with_bias=with_bias)
    sess = InferenceSession(model)
    assert sess.fused == {"splitk_skip_norm": 1}
    g = torch.Generator().manual_seed(5)
    x, skip = torch.randn(3, 1024, generator=g).half(), torch.randn(3, 64, generator=g).half()
    y, total = sess.run(["y", "sum"], {"x": x.numpy(), "skip": skip.numpy()})
    assert "splitk" in cpu_splitk  # the split-K route ran
    ref_y, ref_s = _oracle(x, w, skip, gamma, bias)
    assert _rel(torch.from_numpy(y), ref_y) <= TOL and _rel(torch.from_numpy(total), ref_s) <= TOL
    # prefill-sized rows take the product, then the norm: same values
    x40 = torch.randn(40, 1024, generator=g).half()
    s40 = torch.randn(40, 64, generator=g).half()
    y40, _ = sess.run(["y", "sum"], {"x": x40.numpy(), "skip": s40.numpy()})
    assert _rel(torch.from_numpy(y40), _oracle(x40, w, s40, gamma, bias)[0]) <= TOL


@interpreter
def test_a_product_read_elsewhere_is_not_fused(cpu_splitk):
    from pagedkit import InferenceSession

    assert InferenceSession(_model(leak=True)[0]).fused == {}


def test_cpu_sessions_are_not_fused_by_default():
    from pagedkit import InferenceSession

    assert InferenceSession(_model()[0]).fused == {}


@interpreter
def test_fused_op_matches_onnxruntime_on_the_unfused_graph(cpu_splitk):
    """pagedkit.fused::MatMulSkipNorm (its split-K route) against onnxruntime's CPU run of the graph it replaces
    (float16; onnxruntime rounds the product to float16 before the norm, the fused op does not: float16 bound)."""
    import onnxruntime as ort

    from pagedkit import InferenceSession

    model = _model()[0]
    sess = InferenceSession(model)
    assert sess.fused == {"splitk_skip_norm": 1}
    rng = np.random.default_rng(9)
    feeds = {"x": rng.standard_normal((3, 1024)).astype(np.float16),
             "skip": rng.standard_normal((3, 64)).astype(np.float16)}
    want = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(["y", "sum"], feeds)
    for got, ref in zip(sess.run(["y", "sum"], feeds), want):
        got, ref = got.astype(np.float64), ref.astype(np.float64)
        assert np.abs(got - ref).max() <= TOL * np.abs(ref).max()
    assert "splitk" in cpu_splitk


# --- the accumulator's fixed point: splits add as integers ---------------------------------------------------


def test_accumulator_holds_the_rounded_split_partials_as_integers():
    """acc = sum over splits s of round(P_s * 2**FIX_BITS), P_s = a[:, Ks] @ B[Ks, :] (float64 here): an int64 sum,
    so the order the splits arrive in cannot change it. Each split's float32 partial may round to a neighbouring
    unit, so the bound is one unit per split."""
    from pagedkit.kernels.triton import splitk

    a, b, *_ = _operands(3, 2048, 128)
    acc = splitk.accumulate(a, b)
    assert acc.dtype == torch.int64
    got = acc.cpu().clone()
    acc.zero_()  # the consumer's job
    ks = a.shape[-1] // splitk.SPLITS
    ad, bd = a.cpu().double(), b.cpu().double()
    want = sum(torch.round(ad[:, s * ks:(s + 1) * ks] @ bd[s * ks:(s + 1) * ks] * 2.0 ** splitk.FIX_BITS)
               for s in range(splitk.SPLITS)).to(torch.int64)
    # float32 partials: within a float32 ulp of each split's partial, in units
    ulp_units = (bd.abs().T @ ad.abs().T).T.max() * 2.0 ** -23 * 2.0 ** splitk.FIX_BITS
    assert (got - want).abs().max() <= splitk.SPLITS * (1 + ulp_units)
    assert not torch.equal(got, torch.zeros_like(got))


@pytest.mark.gpu
def test_split_k_product_is_bitwise_repeatable_on_cuda():
    """On CUDA the 16 splits arrive in a run-time order: with integer accumulation 40 runs (and a CUDA-graph replay
    of the same launch pair) give bit-identical norm outputs. (The earlier float32 atomics differed in the last bit
    between a graph replay and the eager step: tests/test_engine_graphs_gpu.py::test_graphs_deepseek_mla.)"""
    a, b, skip, gamma, bias = _operands(8, 8192, 2048)
    first, _ = _fused(a, b, skip, gamma, bias)
    for _ in range(40):
        y, _ = _fused(a, b, skip, gamma, bias)
        assert torch.equal(y, first)
    ref_y, _ = _oracle(a, b, skip, gamma, bias)
    assert _rel(first, ref_y) <= TOL
    from pagedkit.kernels.triton import norm, splitk

    static_y = torch.empty_like(first)
    graph = torch.cuda.CUDAGraph()
    with torch.cuda.graph(graph):
        static_y.copy_(norm.rms_norm_acc(splitk.accumulate(a, b), gamma, EPS, skip=skip, bias=bias)[0])
    for _ in range(10):
        static_y.fill_(float("nan"))
        graph.replay()
        torch.cuda.synchronize()
        assert torch.equal(static_y, first)


# --- SiluMul folded into the down product ----------------------------------------------------------------------


def _silu_oracle(y, b, skip, gamma, bias=None):
    k = b.shape[0]
    yd = y.cpu().double().reshape(-1, 2 * k)
    h = yd[:, :k] * torch.sigmoid(yd[:, :k]) * yd[:, k:]
    return _oracle(h, b, skip, gamma, bias)


@pytest.mark.parametrize("rows,k,n,dtype", [(1, 1024, 64, torch.float16), (4, 2048, 128, torch.bfloat16)])
def test_silu_operand_folded_into_the_product(rows, k, n, dtype):
    from pagedkit.kernels.triton import norm, splitk

    _, b, skip, gamma, bias = _operands(rows, k, n, dtype)
    y = (2 * torch.randn(rows, 2 * k, generator=torch.Generator().manual_seed(4))).to(dtype).to(DEVICE)
    out, total = norm.rms_norm_acc(splitk.accumulate(y, b, silu=True), gamma, EPS, skip=skip, bias=bias,
                                   want_sum=True)
    ref_y, ref_s = _silu_oracle(y, b, skip, gamma, bias)
    tol = TOL if dtype == torch.float16 else 2e-2
    assert _rel(out, ref_y) <= tol and _rel(total, ref_s) <= tol
    # teeth: the gate | up halves swapped, or the plain product of the gate half, are far off
    swapped = torch.cat((y[:, k:], y[:, :k]), dim=1).contiguous()
    bad, _ = norm.rms_norm_acc(splitk.accumulate(swapped, b, silu=True), gamma, EPS, skip=skip, bias=bias)
    assert _rel(bad, ref_y) > tol
    plain, _ = norm.rms_norm_acc(splitk.accumulate(y[:, :k].contiguous(), b), gamma, EPS, skip=skip, bias=bias)
    assert _rel(plain, ref_y) > tol


def test_silu_operand_width_is_checked():
    from pagedkit.kernels.triton import splitk

    a, b, *_ = _operands(2, 1024, 64)
    assert not splitk.serves(a, b, silu=True)  # [.., K], not [.., 2K]
    with pytest.raises(ValueError, match=r"silu: a should be \[\.\., 2K\]"):
        splitk.accumulate(a, b, silu=True)


def _mlp_model(k=1024, hidden=64, np_dtype=np.float16):
    """A gated MLP as exporters write it, then the residual norm:
    h = MatMul(Mul(Mul(g, Sigmoid(g)), u), Wd), g / u = MatMul(x, Wg / Wu); y, sum = SkipSimplifiedLayerNorm(h, skip)."""
    rng = np.random.default_rng(6)
    wg, wu = ((rng.standard_normal((hidden, k)) / hidden ** 0.5).astype(np_dtype) for _ in range(2))
    wd = (rng.standard_normal((k, hidden)) / k ** 0.5).astype(np_dtype)
    gamma = (1 + 0.2 * rng.standard_normal(hidden)).astype(np_dtype)
    nodes = [helper.make_node("MatMul", ["x", "wg"], ["g"], name="gate"),
             helper.make_node("MatMul", ["x", "wu"], ["u"], name="up"),
             helper.make_node("Sigmoid", ["g"], ["sg"], name="sig"),
             helper.make_node("Mul", ["g", "sg"], ["act"], name="act"),
             helper.make_node("Mul", ["act", "u"], ["hmid"], name="mul"),
             helper.make_node("MatMul", ["hmid", "wd"], ["h"], name="down"),
             helper.make_node("SkipSimplifiedLayerNormalization", ["h", "skip", "gamma"], ["y", "", "", "sum"],
                              name="norm", domain="com.microsoft", epsilon=EPS)]
    f16 = TensorProto.FLOAT16
    graph = helper.make_graph(
        nodes, "mlp_norm", [helper.make_tensor_value_info("x", f16, ["T", hidden]),
                            helper.make_tensor_value_info("skip", f16, ["T", hidden])],
        [helper.make_tensor_value_info("y", f16, ["T", hidden]), helper.make_tensor_value_info("sum", f16, ["T", hidden])],
        [numpy_helper.from_array(w, name) for w, name in ((wg, "wg"), (wu, "wu"), (wd, "wd"), (gamma, "gamma"))])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)])


@interpreter
def test_session_folds_silu_into_the_down_product_and_matches_onnxruntime(cpu_splitk):
    """swiglu_mlp then splitk_skip_norm: gate | up product, then one MatMulSkipNorm with silu_split (no SiluMul
    step left); against onnxruntime's CPU run of the unfused float16 graph, decode rows (split-K) and 40 rows (the
    SiluMul, product, norm fallback)."""
    import onnxruntime as ort

    from pagedkit import InferenceSession

    model = _mlp_model()
    sess = InferenceSession(model)
    assert sess.fused == {"swiglu_mlp": 1, "splitk_skip_norm": 1}
    ops = [s.op_type for s in sess._compiled.graph.steps]
    assert "SiluMul" not in ops and ops.count("MatMulSkipNorm") == 1
    peer = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"])
    rng = np.random.default_rng(10)
    for rows in (3, 40):
        feeds = {"x": rng.standard_normal((rows, 64)).astype(np.float16),
                 "skip": rng.standard_normal((rows, 64)).astype(np.float16)}
        for got, ref in zip(sess.run(["y", "sum"], feeds), peer.run(["y", "sum"], feeds)):
            got, ref = got.astype(np.float64), ref.astype(np.float64)
            assert np.abs(got - ref).max() <= TOL * np.abs(ref).max()
    assert "splitk" in cpu_splitk
