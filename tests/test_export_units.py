"""Unit tests of paged-export's helpers (pagedkit/exporters): external-data size parsing, slicing a lazy weight
rule by rule against eager slicing (and that the leaves are asked only for the rows needed), RoPE / MoE / graph
helpers. Fast: no model is exported here."""

from __future__ import annotations

import pytest
import torch


# ---- external.parse_size -------------------------------------------------------------------------------------

@pytest.mark.parametrize("text, want", [
    ("1gb", 1000 ** 3), ("1G", 1000 ** 3), ("2 GB", 2 * 1000 ** 3), ("1.5GiB", 3 * 1024 ** 3 // 2),
    ("500MiB", 500 * 1024 ** 2), ("512MB", 512 * 1000 ** 2), ("3m", 3 * 1000 ** 2), ("4KiB", 4096),
    ("7kb", 7000), ("1TiB", 1024 ** 4), ("2tb", 2 * 1000 ** 4), ("123", 123), ("64b", 64), (4096, 4096),
])
def test_parse_size_exact_bytes(text, want):
    from pagedkit.exporters.external import parse_size

    got = parse_size(text)
    assert got == want and isinstance(got, int), (text, got, want)


@pytest.mark.parametrize("text", [None, "", "off", "none", "0", " OFF ", 0])
def test_parse_size_off_is_one_file(text):
    from pagedkit.exporters.external import parse_size

    assert parse_size(text) is None


@pytest.mark.parametrize("text", ["gb", "MiB", "1.5xb", "12q", "abc"])
def test_parse_size_rejects_and_names_the_value(text):
    from pagedkit.exporters.external import parse_size

    with pytest.raises(ValueError, match="expected a number") as e:
        parse_size(text)
    assert repr(text) in str(e.value)


def test_parse_size_rejects_non_positive():
    from pagedkit.exporters.external import parse_size

    with pytest.raises(ValueError, match=r"'0\.0001b' must be positive"):
        parse_size("0.0001b")


# ---- slicing.narrow: rule by rule, against eager slicing and the rows each leaf is asked for ----------------

def _leaf(shape, seed, asked, tag):
    """A LazyTensor leaf over random values whose row reader (dim 0) records what it was asked."""
    from pagedkit.exporters.lazy import LazyTensor

    v = torch.randn(shape, generator=torch.Generator().manual_seed(seed))

    def slicer(d, a, b):
        asked.append((tag, d, a, b))
        return v[a:b] if d == 0 else None
    return LazyTensor(v.to("meta"), lambda: v, slicer), v


def _check(lazy_x, want, dim, a, b):
    from pagedkit.exporters import slicing

    try:
        got = slicing.narrow(lazy_x, dim, a, b)
    finally:
        slicing.clear()
    assert got.shape == want.narrow(dim, a, b - a).shape, (dim, a, b, tuple(got.shape))
    assert torch.equal(got, want.narrow(dim, a, b - a)), (dim, a, b)


def test_narrow_t_reads_source_rows():
    asked = []
    w, vw = _leaf((12, 8), 0, asked, "w")
    x = w.t()  # [8, 12]: its columns are w's rows
    _check(x, vw.t(), 1, 2, 7)
    assert asked == [("w", 0, 2, 7)]
    asked.clear()
    _check(x, vw.t(), 0, 1, 5)  # w's columns: read whole, sliced
    _check(x, vw.t(), -1, 3, 4)


@pytest.mark.parametrize("kw", [False, True])
def test_narrow_transpose_maps_the_axis(kw):
    asked = []
    a, va = _leaf((6, 4, 5), 1, asked, "a")
    x = a.transpose(dim0=2, dim1=0) if kw else a.transpose(-1, 0)  # [5, 4, 6]
    want = va.transpose(0, 2)
    _check(x, want, 2, 1, 4)
    assert asked == [("a", 0, 1, 4)]
    for d in range(3):
        _check(x, want, d, 1, 3)


def test_narrow_reshape_rows_and_merges():
    asked = []
    w, vw = _leaf((12, 8), 2, asked, "w")
    _check(w.reshape(3, 4, 8), vw.reshape(3, 4, 8), 0, 1, 3)  # each output row is 4 input rows
    assert asked == [("w", 0, 4, 12)]
    asked.clear()
    _check(w.reshape(6, 16), vw.reshape(6, 16), 0, 2, 5)
    assert asked == [("w", 0, 4, 10)]
    asked.clear()
    _check(w.reshape(24, 4), vw.reshape(24, 4), 0, 4, 10)  # two output rows per input row: aligned
    assert asked == [("w", 0, 2, 5)]
    asked.clear()
    _check(w.reshape(24, 4), vw.reshape(24, 4), 0, 3, 10)  # not aligned: whole, sliced
    assert asked == []


@pytest.mark.parametrize("dim", [0, 1, 2, -1])
def test_narrow_split_along_and_across(dim):
    asked = []
    a, va = _leaf((6, 4, 5), 3, asked, "a")
    sizes = {0: [2, 4], 1: [1, 3], 2: [2, 3], -1: [2, 3]}[dim]
    x, want = a.split(sizes, dim=dim)[1], va.split(sizes, dim=dim)[1]
    for d in range(3):
        n = want.shape[d]
        for lo, hi in ((0, 1), (1, n), (max(0, n // 2 - 1), n // 2 + 1)):
            if lo < hi:
                _check(x, want, d, lo, hi)
    if dim == 0:  # rows of the second part are rows 2.. of the source
        asked.clear()
        _check(x, want, 0, 1, 3)
        assert asked == [("a", 0, 3, 5)]


def test_narrow_split_positional_dim():
    asked = []
    a, va = _leaf((6, 4, 5), 4, asked, "a")
    x, want = torch.split(a, [2, 3], 2)[0], torch.split(va, [2, 3], 2)[0]
    _check(x, want, 2, 1, 2)
    _check(x, want, 0, 2, 5)
    assert ("a", 0, 2, 5) in asked


# ---- graph / moe building blocks, run in onnxruntime against numpy -------------------------------------------

def _run(g, outs: dict, feeds: dict) -> list:
    """Run the GraphBuilder's graph (outputs: name -> (elem_type, shape)) on CPU."""
    import onnxruntime as ort

    for name, (t, shape) in outs.items():
        g.output(name, t, shape)
    m = g.model("units", "test")
    sess = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"])
    return sess.run(list(outs), feeds)


@pytest.mark.parametrize("act", ["silu", "swish", "gelu", "gelu_pytorch_tanh", "relu", "relu2"])
def test_activation_matches_numpy(act):
    import math

    import numpy as np
    from onnx import TensorProto

    from pagedkit.exporters.graph import GraphBuilder, activation

    f32 = TensorProto.FLOAT
    g = GraphBuilder(f32)
    x = g.input("x", f32, (3, 5))
    y = activation(g, x, act, "/act")
    assert g.vi[y] == (f32, (3, 5))
    xv = np.random.default_rng(0).standard_normal((3, 5)).astype(np.float32)
    got, = _run(g, {y: (f32, (3, 5))}, {"x": xv})
    x64 = xv.astype(np.float64)
    erf = np.vectorize(math.erf)
    want = {"silu": x64 / (1 + np.exp(-x64)), "swish": x64 / (1 + np.exp(-x64)),
            "gelu": 0.5 * x64 * (1 + erf(x64 / math.sqrt(2))),
            "gelu_pytorch_tanh": 0.5 * x64 * (1 + np.tanh(math.sqrt(2 / math.pi) * (x64 + 0.044715 * x64 ** 3))),
            "relu": np.maximum(x64, 0), "relu2": np.maximum(x64, 0) ** 2}[act]
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("act", ["foo", "gelu_10", "tanh"])
def test_activation_unsupported_names_the_activation(act):
    from onnx import TensorProto

    from pagedkit.exporters.graph import GraphBuilder, activation

    g = GraphBuilder(TensorProto.FLOAT)
    x = g.input("x", TensorProto.FLOAT, (3, 5))
    with pytest.raises(NotImplementedError, match=f"hidden activation '{act}' is not supported"):
        activation(g, x, act, "/act")


@pytest.mark.parametrize("bias", [False, True])
def test_router_logits_float32_with_bias(bias):
    import numpy as np
    from onnx import TensorProto

    from pagedkit.exporters.graph import GraphBuilder
    from pagedkit.exporters.moe import router_logits

    f16, f32 = TensorProto.FLOAT16, TensorProto.FLOAT
    gen = torch.Generator().manual_seed(0)
    w, b = torch.randn(6, 8, generator=gen), torch.randn(6, generator=gen)
    g = GraphBuilder(f16)
    x = g.input("x", f16, (4, 8))
    y = router_logits(g, x, w, b if bias else None, "/r", "r")
    assert g.vi[y] == (f32, (4, 6))  # [T, E] float32: what the routing after it reads
    xv = np.random.default_rng(1).standard_normal((4, 8)).astype(np.float16)
    got, = _run(g, {y: (f32, (4, 6))}, {"x": xv})
    want = xv.astype(np.float64) @ w.double().numpy().T + (b.double().numpy() if bias else 0.0)
    np.testing.assert_allclose(got, want, rtol=1e-5, atol=1e-5)


def test_top_k_is_the_largest_sorted():
    import numpy as np
    from onnx import TensorProto

    from pagedkit.exporters.graph import GraphBuilder
    from pagedkit.exporters.moe import top_k

    f32, i64 = TensorProto.FLOAT, TensorProto.INT64
    g = GraphBuilder(f32)
    s = g.input("s", f32, (5, 7))
    v, i = top_k(g, s, 3, "/p")
    assert g.vi[v] == (f32, (5, 3)) and g.vi[i] == (i64, (5, 3))
    sv = np.random.default_rng(2).permutation(35).reshape(5, 7).astype(np.float32)  # distinct: no ties
    got_v, got_i = _run(g, {v: (f32, (5, 3)), i: (i64, (5, 3))}, {"s": sv})
    want_i = np.argsort(-sv, axis=-1)[:, :3]
    np.testing.assert_array_equal(got_i, want_i)
    np.testing.assert_array_equal(got_v, np.take_along_axis(sv, want_i, -1))



# ---- rope.py: token positions and RoPE in the graph, against numpy ---------------------------------------------

@pytest.mark.parametrize("given", [False, True])
def test_token_positions_derived_or_given(given):
    """Without query_positions: past_sequence_lengths[b] + the token's offset in its sequence b (sequences of 3, 1
    and 2 new tokens after 5, 0 and 9 cached ones); with it: query_positions itself, as int64, whatever the
    lengths say. Made once: a second call adds no node."""
    import numpy as np
    from onnx import TensorProto

    from pagedkit.exporters.attention import GraphInputs
    from pagedkit.exporters.graph import GraphBuilder
    from pagedkit.exporters.rope import token_positions
    from pagedkit.interface import names as N

    i32, i64 = TensorProto.INT32, TensorProto.INT64
    g = GraphBuilder(TensorProto.FLOAT)
    g.input(N.INPUT_IDS, i64, ("num_tokens",))
    g.input(N.CUMULATIVE_SEQUENCE_LENGTHS, i32, ("batch_size_plus_1",))
    g.input(N.PAST_SEQUENCE_LENGTHS, i32, ("batch_size",))
    feeds = {N.INPUT_IDS: np.arange(6, dtype=np.int64), N.CUMULATIVE_SEQUENCE_LENGTHS: np.array([0, 3, 4, 6], np.int32),
             N.PAST_SEQUENCE_LENGTHS: np.array([5, 0, 9], np.int32)}
    want = np.array([5, 6, 7, 0, 9, 10])
    if given:
        g.input(N.QUERY_POSITIONS, i32, ("num_tokens",))
        feeds[N.QUERY_POSITIONS] = want_q = np.array([2, 40, 7, 1, 0, 3], np.int32)
        want = want_q.astype(np.int64)
    io = GraphInputs(query_positions=N.QUERY_POSITIONS if given else None)
    pos = token_positions(g, io)
    count = len(g.nodes)
    assert token_positions(g, io) == pos and len(g.nodes) == count
    assert g.vi[pos] == (i64, ("num_tokens",))
    got, = _run(g, {pos: (i64, ("num_tokens",))}, feeds)
    assert got.dtype == np.int64
    np.testing.assert_array_equal(got, want)


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rot", [8, 4])  # every channel rotates; the first half only (partial rotary)
def test_apply_rope_matches_numpy(interleaved, rot):
    """apply_rope on x [T, heads * head_dim] float16 at positions, cos / sin tables [P, R / 2]: half-split
    pairs (i, i + R / 2) or interleaved pairs (2i, 2i + 1) rotated by angle pos * f_i, the channels past R
    unchanged, float16 out, against a float64 loop."""
    import numpy as np
    from onnx import TensorProto

    from pagedkit.exporters.graph import GraphBuilder
    from pagedkit.exporters.rope import apply_rope

    f16, i64 = TensorProto.FLOAT16, TensorProto.INT64
    heads, head_dim, t, p_max = 3, 8, 5, 32
    half = rot // 2
    freq = 10000.0 ** (-np.arange(half) * 2.0 / rot)
    ang = np.arange(p_max)[:, None] * freq[None, :]  # [P, R / 2]
    g = GraphBuilder(f16)
    x = g.input("x", f16, (t, heads * head_dim))
    pos = g.input("pos", i64, (t,))
    tabs = (g.initializer("cos", torch.from_numpy(np.cos(ang))), g.initializer("sin", torch.from_numpy(np.sin(ang))))
    y = apply_rope(g, x, heads, head_dim, tabs, pos, interleaved, "/rope")
    assert g.vi[y] == (f16, (t, heads * head_dim))
    xv = np.random.default_rng(4).standard_normal((t, heads * head_dim)).astype(np.float16)
    pv = np.array([0, 1, 7, 19, 31], np.int64)
    got, = _run(g, {y: (f16, (t, heads * head_dim))}, {"x": xv, "pos": pv})
    cos16 = np.cos(ang).astype(np.float16).astype(np.float64)  # the tables are stored in the graph's float16
    sin16 = np.sin(ang).astype(np.float16).astype(np.float64)
    x64 = xv.astype(np.float64).reshape(t, heads, head_dim)
    want = x64.copy()
    for ti in range(t):
        for h in range(heads):
            for i in range(half):
                ia, ib = (2 * i, 2 * i + 1) if interleaved else (i, i + half)
                c, s_ = cos16[pv[ti], i], sin16[pv[ti], i]
                a, b = x64[ti, h, ia], x64[ti, h, ib]
                want[ti, h, ia], want[ti, h, ib] = a * c - b * s_, b * c + a * s_
    want = want.reshape(t, -1)
    assert got.dtype == np.float16
    assert np.abs(got - want).max() <= 2e-3 * np.abs(want).max(), np.abs(got - want).max()
    if rot < head_dim:  # the unrotated channels pass through exactly
        np.testing.assert_array_equal(got.reshape(t, heads, head_dim)[..., rot:], xv.reshape(t, heads, head_dim)[..., rot:])


# ---- paged_caches.quantize_caches: per side, per layer ---------------------------------------------------------

def test_quantize_caches_per_side(tmp_path):
    """A layer whose K stays float16 while V goes int8 PER_TOKEN still gets its V side rewritten; the count of
    rewritten nodes is the layer count."""
    import onnx
    from onnx import TensorProto

    from export_utils import attention_attrs, export_tiny, tiny_model
    from pagedkit.exporters.paged_caches import quantize_caches
    from pagedkit.interface import names as N
    from pagedkit.interface.genai_config import CacheSpec, LayerSpec

    export_tiny(tiny_model("LlamaConfig", seed=3), tmp_path)
    model = onnx.load(str(tmp_path / "model.onnx"))
    k1 = next(v for v in model.graph.input if v.name == N.past_name("key", 1)).type.tensor_type.shape.dim[0]
    k1.Clear()
    k1.dim_value = 7  # a cache of fixed size: its scale cache gets the same block count
    tok = CacheSpec("int8", "PER_TOKEN", False, "float16")
    layers = [LayerSpec(0, 4, 2, 16, k_cache=CacheSpec(), v_cache=tok),
              LayerSpec(1, 4, 2, 16, k_cache=tok, v_cache=CacheSpec())]
    assert quantize_caches(model, layers) == 2
    elem = {v.name: v.type.tensor_type.elem_type for v in list(model.graph.input) + list(model.graph.output)}
    assert elem[N.past_name("value", 0)] == TensorProto.INT8 and elem[N.past_name("key", 0)] == TensorProto.FLOAT16
    assert elem[N.past_name("key", 1)] == TensorProto.INT8 and elem[N.past_name("value", 1)] == TensorProto.FLOAT16
    assert N.past_name("value_scale", 0) in elem and N.past_name("key_scale", 1) in elem
    assert N.past_name("key_scale", 0) not in elem and N.past_name("value_scale", 1) not in elem
    dims = {v.name: [d.dim_param or d.dim_value for d in v.type.tensor_type.shape.dim]
            for v in list(model.graph.input) + list(model.graph.output)}
    for side, layer, blocks in (("value_scale", 0, "num_blocks"), ("key_scale", 1, 7)):  # [blocks, block_size, kv_heads]
        assert dims[N.past_name(side, layer)] == dims[N.present_name(side, layer)] == [blocks, "block_size", 2], dims
        assert elem[N.past_name(side, layer)] == elem[N.present_name(side, layer)] == TensorProto.FLOAT16
    onnx.save(model, str(tmp_path / "model.onnx"))
    a0, a1 = attention_attrs(tmp_path / "model.onnx")
    assert a0.get("v_quant_type") == "PER_TOKEN" and a0.get("k_quant_type", "NONE") == "NONE", a0
    assert a1.get("k_quant_type") == "PER_TOKEN" and a1.get("v_quant_type", "NONE") == "NONE", a1


# ---- attention.paged_attention: layers with and without RoPE in the node --------------------------------------

def test_nope_layer_node_has_no_rope_inputs(tmp_path):
    """SmolLM3 with a NoPE layer: that layer's node has no cos / sin caches and do_rotary 0, the RoPE layer's
    has both (float32 graph: the node's T inputs are float16); the export is valid."""
    from export_utils import assert_valid_export, attention_attrs, export_tiny, tiny_model

    hf = tiny_model("SmolLM3Config", seed=5, no_rope_layers=[1, 0], use_sliding_window=False)
    export_tiny(hf, tmp_path, dtype="fp32")
    assert_valid_export(tmp_path)
    assert not (tmp_path / "model.onnx.data").exists()  # far below export.EXTERNAL_DATA_BYTES (16 MiB): inline
    a0, a1 = attention_attrs(tmp_path / "model.onnx")
    assert a0.get("do_rotary") == 1 and a0["inputs"].get("cos_cache") and a0["inputs"].get("sin_cache"), a0
    assert not a1.get("do_rotary") and not a1["inputs"].get("cos_cache") and not a1["inputs"].get("sin_cache"), a1


# ---- registry: one family per model_type -----------------------------------------------------------------------

def test_registry_refuses_a_model_type_claimed_twice(tmp_path, monkeypatch):
    import sys

    from pagedkit.exporters import families, registry

    body = ("from pagedkit.exporters.families.base import DecoderFamily\n\n"
            "class {0}(DecoderFamily):\n    model_types = ('dup_type', '{1}')\n")
    (tmp_path / "zz_units_a.py").write_text(body.format("FirstFamily", "only_a"))
    monkeypatch.setattr(families, "__path__", [str(tmp_path)])
    try:
        found = registry._families.__wrapped__()
        assert found["dup_type"].__name__ == "FirstFamily" and found["only_a"] is found["dup_type"]
        (tmp_path / "zz_units_b.py").write_text(body.format("SecondFamily", "only_b"))
        with pytest.raises(RuntimeError, match="model_type 'dup_type' is claimed by FirstFamily and SecondFamily"):
            registry._families.__wrapped__()
    finally:
        for m in ("zz_units_a", "zz_units_b"):
            sys.modules.pop(f"{families.__name__}.{m}", None)
