"""runtime/fuse_linear.py's `decode_linear` and its fused products (runtime/ops/linear.py, kernels/triton/linear.py)
on the CPU, the kernel through Triton's interpreter:

- the kernel against a float64 loop (norm / SiluMul / plain prologues, float16 and bfloat16, rows 1..16, N and K
  off the tile sizes, the sum output), and its refusals;
- the rewrite on the tiny Llama export (float16): every product over a constant weight becomes NormLinear (QKV,
  gate | up), SiluLinear (down) or Linear (O), the LM head and the norms' other readers untouched; decode steps
  (kernel) and prefills (the replaced ops) give the unfused session's logits within float16 noise.
Teeth: a kernel that drops the skip input, or writes no sum, fails the comparison.
"""

from __future__ import annotations

import os

os.environ.setdefault("TRITON_INTERPRET", "1")

import random

import pytest
import torch

pytest.importorskip("triton")

from pagedkit.kernels.triton import linear as L  # noqa: E402
from pagedkit.runtime import fuse_linear  # noqa: E402
from pagedkit.runtime.ops import linear as ops_linear  # noqa: E402


def _oracle(kind, a, w_nk, skip=None, gamma=None, eps=1e-6):
    """float64 loop: x as the unfused ops round it, then x @ W^T."""
    rows = a.reshape(-1, a.shape[-1])
    k = w_nk.shape[1]
    out = torch.zeros(rows.shape[0], w_nk.shape[0], dtype=torch.float64)
    sums = []
    for i in range(rows.shape[0]):
        r = rows[i].double()
        if kind == "silu":
            g, u = rows[i, :k].float(), rows[i, k:].float()
            x = (g / (1 + torch.exp(-g)) * u).to(a.dtype).double()
        elif kind == "rms":
            s = rows[i].float() + (skip.reshape(-1, k)[i].float() if skip is not None else 0)
            sums.append(s)
            inv = 1.0 / torch.sqrt((s.double() ** 2).mean() + eps)
            x = (s.double() * inv * gamma.double()).to(a.dtype).double()
        else:
            x = r
        for n in range(w_nk.shape[0]):
            out[i, n] = (x * w_nk[n].double()).sum()
    return out, sums


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind", L.KINDS)
@pytest.mark.parametrize("m,n,k", [(1, 40, 96), (5, 33, 300), (8, 48, 256), (3, 16, 2048)])
def test_kernel_matches_the_float64_loop(dtype, kind, m, n, k):
    g = torch.Generator().manual_seed(m * 1000 + n + k)
    w = (torch.randn(n, k, generator=g) / k ** 0.5).to(dtype)
    a = torch.randn(m, 2 * k if kind == "silu" else k, generator=g).to(dtype)
    skip = torch.randn(m, k, generator=g).to(dtype) if kind == "rms" else None
    gamma = (torch.rand(k, generator=g) + 0.5).to(dtype) if kind == "rms" else None
    y, s = L.linear(kind, a, w, skip=skip, gamma=gamma, eps=1e-5, want_sum=True)
    ref, sums = _oracle(kind, a, w, skip, gamma, 1e-5)
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2  # the output's rounding, plus float32 sums
    assert y.shape == (m, n) and y.dtype == dtype
    assert float((y.double() - ref).abs().max()) <= tol * float(ref.abs().max())
    if kind == "rms":
        want = torch.stack(sums)
        if dtype == torch.float16:
            assert torch.equal(s, want.to(dtype))
        else:  # the interpreter rounds float32 to bfloat16 toward zero: within one bfloat16 step
            assert bool(((s.float() - want).abs() <= want.abs() * 2 ** -7 + 1e-30).all())
    else:
        assert s is None


def test_kernel_refuses_what_it_does_not_serve():
    w = torch.randn(8, 32).half()
    assert "rows" in L.serves("plain", torch.randn(9, 32).half(), w)
    assert "dtypes" in L.serves("plain", torch.randn(2, 32), w)
    assert "K" in L.serves("silu", torch.randn(2, 32).half(), w)
    assert "gamma" in L.serves("rms", torch.randn(2, 32).half(), w)
    assert "skip" in L.serves("rms", torch.randn(2, 32).half(), w, gamma=torch.ones(32).half(),
                              skip=torch.randn(3, 32).half())
    assert L.serves("rms", torch.randn(2, 32).half(), w, gamma=torch.ones(32).half()) is None
    with pytest.raises(ValueError, match="rows"):
        L.linear("plain", torch.randn(9, 32).half(), w)


@pytest.fixture
def fused_models(tiny_llama, monkeypatch):
    """(fused PagedModel, unfused PagedModel) over the tiny Llama on the torch CPU backend."""
    from pagedkit.engine import Engine

    monkeypatch.setenv("PAGEDKIT_CPU_BACKEND", "torch")
    plain = Engine(tiny_llama, "cpu", max_batch_size=8, max_num_tokens=256).model
    monkeypatch.setattr(fuse_linear, "ENABLED", True)
    monkeypatch.setattr(fuse_linear, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(fuse_linear, "MIN_BYTES", 1)
    fused = Engine(tiny_llama, "cpu", max_batch_size=8, max_num_tokens=256).model
    return fused, plain


def _logits(model, prompts, steps, seed):
    """Prefill each prompt (logits of its last row), then `steps` teacher-forced decode steps of the batch."""
    mgr, rng = model.mgr, random.Random(seed)
    sids, out = [f"s{i}" for i in range(len(prompts))], []
    for s, p in zip(sids, prompts):
        mgr.add_sequence(s, p)
        plan = model.plan([(s, p)])
        out.append(model.run(plan, p, [len(p) - 1]).float().clone())
        mgr.commit(plan)
    for _ in range(steps):
        ids = [rng.randrange(3, 144) for _ in sids]
        plan = model.plan([(s, [t]) for s, t in zip(sids, ids)])
        out.append(model.run(plan, ids).float().clone())
        mgr.commit(plan)
    for s in sids:
        mgr.free(s)
    return out


def _prompts():
    rng = random.Random(4)
    return [[rng.randrange(3, 144) for _ in range(n)] for n in (5, 23, 40)]


def test_rewrite_folds_each_product_and_keeps_the_logits(fused_models):
    fused, plain = fused_models
    kinds = [s.op_type for s in fused.session._main.graph.steps]
    layers = sum(1 for s in plain.session._main.graph.steps if s.call is not None)
    assert kinds.count("NormLinear") == 2 * layers and kinds.count("SiluLinear") == layers
    assert kinds.count("Linear") == layers + 1  # O, and this tiny model's LM head (vocabulary 144 <= MAX_N)
    assert "SiluMul" not in kinds and "MatMul" not in kinds
    assert fused.session.fused.get("decode_linear") == 4 * layers + 1
    assert kinds.count("SkipSimplifiedLayerNormalization") + kinds.count("SimplifiedLayerNormalization") == 1  # final
    graph = fused.session._main.graph
    weights = [s.inputs[-1] for s in graph.steps if s.op_type in ("Linear", "NormLinear", "SiluLinear")]
    assert all(w.endswith("::t") for w in weights)
    assert not any(w.removesuffix("::t") in graph.consts for w in weights)  # the [K, N] originals are gone
    got, ref = _logits(fused, _prompts(), 4, 9), _logits(plain, _prompts(), 4, 9)
    for i, (a, b) in enumerate(zip(got, ref)):
        rel = float((a - b).abs().max() / b.abs().max())
        assert rel <= 1e-2, f"output {i}: fused vs unfused max |diff| {rel:.3g} x max |ref|"


def test_fallback_path_keeps_the_logits(fused_models, monkeypatch):
    fused, plain = fused_models
    monkeypatch.setattr(ops_linear, "TRITON", False)
    got, ref = _logits(fused, _prompts(), 2, 3), _logits(plain, _prompts(), 2, 3)
    for a, b in zip(got, ref):
        assert float((a - b).abs().max() / b.abs().max()) <= 1e-2


@pytest.mark.parametrize("bug", ["no_skip", "no_sum"])
def test_teeth(fused_models, monkeypatch, bug):
    fused, plain = fused_models
    real = L.linear

    def broken(kind, a, w, *, skip=None, gamma=None, eps=1e-6, want_sum=False):
        if kind != "rms":
            return real(kind, a, w, skip=skip, gamma=gamma, eps=eps, want_sum=want_sum)
        y, s = real(kind, a, w, skip=None if bug == "no_skip" else skip, gamma=gamma, eps=eps, want_sum=want_sum)
        return y, (torch.zeros_like(a) if (bug == "no_sum" and s is not None) else s)

    monkeypatch.setattr(L, "linear", broken)
    got, ref = _logits(fused, _prompts(), 2, 3), _logits(plain, _prompts(), 2, 3)
    worst = max(float((a - b).abs().max() / b.abs().max()) for a, b in zip(got[3:], ref[3:]))  # decode steps
    assert worst > 5e-2, f"a kernel with {bug} went unnoticed ({worst:.3g})"


def test_limits_leave_the_head_and_small_weights_alone(tiny_llama, monkeypatch):
    """Products wider than MAX_N (an LM head) and weights under MIN_BYTES stay MatMul; float32 weights are not
    taken; with the rule off nothing changes."""
    from pagedkit.engine import Engine

    monkeypatch.setenv("PAGEDKIT_CPU_BACKEND", "torch")
    monkeypatch.setattr(fuse_linear, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(fuse_linear, "MIN_BYTES", 1)

    def steps():
        return Engine(tiny_llama, "cpu", max_batch_size=2, max_num_tokens=64).model.session._main.graph.steps

    def kinds():
        return [s.op_type for s in steps()]

    # the default, "measured", with no measured shape: nothing changes
    assert fuse_linear.ENABLED == "measured" and not L.SHAPE_TILES
    assert "Linear" not in kinds() and "NormLinear" not in kinds()
    monkeypatch.setattr(fuse_linear, "ENABLED", True)
    monkeypatch.setattr(fuse_linear, "MAX_N", 143)  # the head's N is the vocabulary, 144
    got = steps()
    head = next(s for s in got if s.inputs and s.inputs[0].endswith("::rows"))  # reads SelectRows' rows
    assert head.op_type == "MatMul" and sum(s.op_type == "Linear" for s in got) > 0
    monkeypatch.setattr(fuse_linear, "MAX_N", 144 * 8)
    assert "MatMul" not in kinds()
    monkeypatch.setattr(fuse_linear, "MIN_BYTES", 1 << 40)
    assert "Linear" not in kinds() and "NormLinear" not in kinds()


def test_measured_mode_fuses_only_the_shapes_with_tiles(tiny_llama, monkeypatch):
    """PAGEDKIT_DECODE_LINEAR=measured: a product is fused only where kernels/triton/linear.SHAPE_TILES has its
    (kind, N, K): here the down product after SwiGLU ("silu", N hidden 64, K intermediate 96) and nothing else;
    an entry of another kind at the same shape does not count."""
    from pagedkit.engine import Engine

    monkeypatch.setenv("PAGEDKIT_CPU_BACKEND", "torch")
    monkeypatch.setattr(fuse_linear, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(fuse_linear, "MIN_BYTES", 1)
    monkeypatch.setattr(fuse_linear, "ENABLED", "measured")

    def kinds():
        steps = Engine(tiny_llama, "cpu", max_batch_size=2, max_num_tokens=64).model.session._main.graph.steps
        return [s.op_type for s in steps]

    monkeypatch.setattr(L, "SHAPE_TILES", {("plain", 64, 96): (8, 64, 4, 3)})
    assert not {"Linear", "NormLinear", "SiluLinear"} & set(kinds())
    monkeypatch.setattr(L, "SHAPE_TILES", {("silu", 64, 96): (8, 64, 4, 3)})
    got = kinds()
    assert got.count("SiluLinear") == 2 and "NormLinear" not in got and "Linear" not in got  # 2 layers
    assert "SiluMul" not in got


def _norm_graph(path, k=64, n=48, f=96):
    """float16: h = SkipSimplifiedLayerNormalization(x, skip) -> q = h @ Wq; o = q[:, :k]... a block of the four
    product kinds: NormLinear (skip norm, with its sum read later; and SimplifiedLayerNormalization), SwiGLU's
    SiluLinear, plain Linear."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    rng = np.random.default_rng(2)

    def w(name, *shape):
        return numpy_helper.from_array((rng.standard_normal(shape) / shape[0] ** 0.5).astype(np.float16), name)

    inits = [w("wq", k, n), w("wo", n, k), w("wg", k, f), w("wu", k, f), w("wd", f, k),
             numpy_helper.from_array((rng.random(k) + 0.5).astype(np.float16), "g1"),
             numpy_helper.from_array((rng.random(k) + 0.5).astype(np.float16), "g2")]
    ms = "com.microsoft"
    nodes = [
        helper.make_node("SkipSimplifiedLayerNormalization", ["x", "skip", "g1"], ["h", "", "", "s"], domain=ms,
                         epsilon=1e-5),
        helper.make_node("MatMul", ["h", "wq"], ["q"]),
        helper.make_node("MatMul", ["q", "wo"], ["o"]),  # plain Linear
        helper.make_node("SimplifiedLayerNormalization", ["o", "g2"], ["h2"], epsilon=1e-5),  # axis: -1 by default
        helper.make_node("MatMul", ["h2", "wg"], ["gate"]), helper.make_node("MatMul", ["h2", "wu"], ["up"]),
        helper.make_node("Sigmoid", ["gate"], ["sg"]), helper.make_node("Mul", ["gate", "sg"], ["act"]),
        helper.make_node("Mul", ["act", "up"], ["hm"]), helper.make_node("MatMul", ["hm", "wd"], ["d"]),
        helper.make_node("Add", ["d", "s"], ["y"]),  # the skip norm's sum, read after the products
    ]
    g = helper.make_graph(nodes, "block", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["T", k]),
                                           helper.make_tensor_value_info("skip", TensorProto.FLOAT16, ["T", k])],
                          [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["T", k])], inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ms, 1)]), path)


@pytest.mark.parametrize("rows", [1, 7, 8, 9, 40])  # <= 8: the kernel (interpreter); more: the replaced ops
def test_fused_block_against_onnxruntime(tmp_path, monkeypatch, rows):
    """The three fused ops against onnxruntime's CPU kernels on the unfused graph (an independent oracle)."""
    import numpy as np

    ort = pytest.importorskip("onnxruntime")
    from pagedkit.runtime import InferenceSession

    _norm_graph(tmp_path / "m.onnx")
    monkeypatch.setattr(fuse_linear, "ENABLED", True)
    monkeypatch.setattr(fuse_linear, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(fuse_linear, "MIN_BYTES", 1)
    sess = InferenceSession(str(tmp_path / "m.onnx"), cpu_backend="torch")
    kinds = [s.op_type for s in sess._main.graph.steps]
    assert kinds.count("NormLinear") == 2 and kinds.count("SiluLinear") == 1 and kinds.count("Linear") == 1
    rng = np.random.default_rng(rows)
    x = rng.standard_normal((rows, 64)).astype(np.float16)
    skip = rng.standard_normal((rows, 64)).astype(np.float16)
    got = sess.run(None, {"x": x, "skip": skip})[0].astype(np.float64)
    ref = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(
        None, {"x": x, "skip": skip})[0].astype(np.float64)
    assert np.abs(got - ref).max() <= 1e-2 * np.abs(ref).max()


@pytest.mark.parametrize("variant", ["norm_read_twice", "skip_bias", "axis_0", "inv_std_read", "stash_double"])
def test_norms_that_must_not_fold(tmp_path, monkeypatch, variant):
    """A norm whose output another step reads, a SkipSimplifiedLayerNormalization with a bias, a norm over another
    axis, one whose inv_std_var is read, or a double stash: the product stays a plain Linear, the norm its own step;
    the session still equals onnxruntime on the graph."""
    import numpy as np
    import onnx
    from onnx import TensorProto, helper, numpy_helper

    from pagedkit.runtime import InferenceSession

    ort = pytest.importorskip("onnxruntime")
    k, n = 32, 24
    rng = np.random.default_rng(1)
    inits = [numpy_helper.from_array((rng.standard_normal((k, n)) / k ** 0.5).astype(np.float16), "w"),
             numpy_helper.from_array((rng.random(k) + 0.5).astype(np.float16), "g"),
             numpy_helper.from_array((rng.standard_normal(k) * 0.1).astype(np.float16), "b")]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT16, ["T", n])]
    ms = "com.microsoft"
    if variant == "skip_bias":
        norm = helper.make_node("SkipSimplifiedLayerNormalization", ["x", "x", "g", "b"], ["h"], domain=ms,
                                epsilon=1e-5)
    elif variant == "inv_std_read":
        norm = helper.make_node("SimplifiedLayerNormalization", ["x", "g"], ["h", "inv"], epsilon=1e-5, axis=-1)
        outs.append(helper.make_tensor_value_info("inv", TensorProto.FLOAT, ["T", 1]))
    else:
        norm = helper.make_node("SimplifiedLayerNormalization", ["x", "g"], ["h"], epsilon=1e-5,
                                axis=0 if variant == "axis_0" else -1,
                                **({"stash_type": 11} if variant == "stash_double" else {}))
    nodes = [norm, helper.make_node("MatMul", ["h", "w"], ["y"])]
    if variant == "norm_read_twice":
        outs.append(helper.make_tensor_value_info("h", TensorProto.FLOAT16, ["T", k]))
    g = helper.make_graph(nodes, "n", [helper.make_tensor_value_info("x", TensorProto.FLOAT16, ["T", k])], outs, inits)
    onnx.save(helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid(ms, 1)]),
              tmp_path / "m.onnx")
    monkeypatch.setattr(fuse_linear, "ENABLED", True)
    monkeypatch.setattr(fuse_linear, "DEVICES", ("cuda", "cpu"))
    monkeypatch.setattr(fuse_linear, "MIN_BYTES", 1)
    sess = InferenceSession(str(tmp_path / "m.onnx"), cpu_backend="torch")
    kinds = [s.op_type for s in sess._main.graph.steps]
    assert "NormLinear" not in kinds and kinds.count("Linear") == 1, kinds
    if variant in ("axis_0", "stash_double"):
        return  # onnxruntime's CPU kernels take neither
    x = rng.standard_normal((3, k)).astype(np.float16)
    got = sess.run(["y"], {"x": x})[0].astype(np.float64)
    ref = ort.InferenceSession(str(tmp_path / "m.onnx"), providers=["CPUExecutionProvider"]).run(["y"], {"x": x})[0]
    assert np.abs(got - ref).max() <= 1e-2 * np.abs(ref).max()


def test_min_bytes_default():
    assert fuse_linear.MIN_BYTES == 1 << 20 and fuse_linear.MAX_N == 65536


def test_shape_tiles_override_the_kind_tiles_for_that_shape_only(monkeypatch):
    """kernels/triton/linear.py SHAPE_TILES[(kind, N, K)] (what gemv_probe.py measures per product) takes that
    product's tiles; other shapes keep TILES[kind]. A tile the kernel cannot take (BLOCK_N 3: not a power of two)
    shows which was used."""
    from pagedkit.kernels.triton import linear as klin

    g = torch.Generator().manual_seed(1)
    a = torch.randn(2, 64, generator=g).half()
    w_a, w_b = torch.randn(48, 64, generator=g).half(), torch.randn(40, 64, generator=g).half()
    monkeypatch.setitem(klin.SHAPE_TILES, ("plain", 48, 64), (3, 64, 4, 3))
    with pytest.raises(Exception):
        klin.linear("plain", a, w_a)
    y, _ = klin.linear("plain", a, w_b)  # another N: the kind's tiles
    ref = a.double() @ w_b.double().T
    assert float((y.double() - ref).abs().max() / ref.abs().max()) < 2e-3
    monkeypatch.setitem(klin.SHAPE_TILES, ("plain", 48, 64), (16, 32, 4, 3))
    y, _ = klin.linear("plain", a, w_a)
    ref = a.double() @ w_a.double().T
    assert float((y.double() - ref).abs().max() / ref.abs().max()) < 2e-3
