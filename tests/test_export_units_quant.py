"""Unit tests of paged-export's quantization helpers, each against a numpy / float64 oracle on hand-built tiny
tensors: KV calibration scales and SNR (quantize.py), the tied LM head -> GatherBlockQuantized rewrite
(quantize.py), MoE experts -> QMoE (quantize_moe.py), GPTQ / AWQ unpacking into MatMulNBits' layout
(prequant.py), group-limited routing on fewer experts and the streamed / whole checkpoint loader (weights.py)."""

from __future__ import annotations

import math
from types import SimpleNamespace

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from pagedkit.exporters import prequant, quantize, quantize_moe, weights
from pagedkit.interface.genai_config import CacheSpec, LayerSpec

# ---- quantize.py: calibration scales and SNR ----------------------------------------------------------------


def _kv(seed: int = 0, n: int = 40, h: int = 2, d: int = 8) -> torch.Tensor:
    return torch.from_numpy(np.random.default_rng(seed).standard_normal((n, h, d)).astype(np.float32))


def _snr_int8_oracle(x: np.ndarray, s: np.ndarray) -> float:
    x = x.astype(np.float64)
    xq = np.clip(np.rint(x / s), -128, 127) * s
    return 10.0 * math.log10((x ** 2).sum() / ((x - xq) ** 2).sum())


def test_percentile_scales_match_numpy_quantile():
    x = _kv()
    a = np.abs(x.numpy().astype(np.float64))
    per_tensor = quantize.static_scale_of(x, "int8", "PER_TENSOR", percentile=99.0)
    assert per_tensor.shape == (1,)
    assert float(per_tensor) == pytest.approx(np.quantile(a, 0.99) / 127, rel=1e-6)
    per_channel = quantize.static_scale_of(x, "int8", "PER_CHANNEL", percentile=90.0)
    assert per_channel.shape == (2, 1, 8)
    np.testing.assert_allclose(per_channel.numpy()[:, 0], np.quantile(a, 0.90, axis=0) / 127, rtol=1e-6)
    full = quantize.static_scale_of(x, "int8", "PER_TENSOR")
    assert float(full) == pytest.approx(a.max() / 127, rel=1e-6)
    with pytest.raises(ValueError, match="PER_TOKEN"):
        quantize.static_scale_of(x, "int8", "PER_TOKEN")


def test_snr_db_is_signal_over_quantization_noise():
    x = _kv(1)
    s = np.float32(np.abs(x.numpy()).max() / 127)
    got = quantize.snr_db(x, "int8", "PER_TENSOR", torch.tensor([s]))
    assert got == pytest.approx(_snr_int8_oracle(x.numpy(), np.float64(s)), abs=1e-3)
    exact = torch.tensor([[[1.0, -2.0]]]) * torch.ones(3, 1, 2)  # multiples of the scale: no noise
    assert quantize.snr_db(exact, "int8", "PER_TENSOR", torch.tensor([1.0])) == float("inf")


def test_calibrate_reports_scales_and_snr_to_two_decimals(monkeypatch):
    k, v = _kv(2), _kv(3)
    monkeypatch.setattr(quantize, "collect_kv", lambda model, spec, seqs, bs: {0: (k, v), 1: (k, v)})
    layers = [LayerSpec(0, 2, 2, 8, k_cache=CacheSpec("int8", "PER_TENSOR"), v_cache=CacheSpec("int8", "PER_CHANNEL")),
              LayerSpec(1, 2, 2, 8)]  # float caches: no scales, no report row
    spec = SimpleNamespace(layers=layers, block_size=16)
    scales, meta = quantize.calibrate(None, spec, [[1, 2, 3], [4, 5]])
    sk, sv = scales[0]
    assert float(sk) == pytest.approx(np.abs(k.numpy()).max() / 127, rel=1e-6)
    np.testing.assert_allclose(sv.numpy()[:, 0], np.abs(v.numpy()).max(axis=0) / 127, rtol=1e-6)
    assert scales[1] == (None, None)
    assert meta["tokens"] == 5 and meta["percentile"] == 100.0 and set(meta["snr_db"]) == {"0"}
    row = meta["snr_db"]["0"]
    want_k = _snr_int8_oracle(k.numpy(), sk.numpy().astype(np.float64))
    want_v = _snr_int8_oracle(v.numpy(), sv.numpy()[:, 0].astype(np.float64))
    assert abs(row["k_snr_db"] - want_k) <= 0.0051 and abs(row["v_snr_db"] - want_v) <= 0.0051, (row, want_k, want_v)
    assert row["k_snr_db"] == round(row["k_snr_db"], 2)


# ---- quantize.py: tied LM head -> MatMulNBits + GatherBlockQuantized ---------------------------------------------


def _tied_model(vocab: int, hidden: int, seed: int = 0, gemm_attrs=None) -> tuple[onnx.ModelProto, np.ndarray]:
    table = np.random.default_rng(seed).standard_normal((vocab, hidden)).astype(np.float32)
    E = quantize.EMBED_TABLE
    nodes = [helper.make_node("Gather", [E, "ids"], ["emb"], name=quantize.EMBED_GATHER),
             helper.make_node("Identity", ["emb"], ["emb_out"], name="/emb/Identity"),
             helper.make_node("Gemm", ["emb", E], ["logits"], name="/lm_head/Gemm", **(gemm_attrs or {"transB": 1}))]
    g = helper.make_graph(nodes, "tied", [helper.make_tensor_value_info("ids", TensorProto.INT64, [None])],
                          [helper.make_tensor_value_info("emb_out", TensorProto.FLOAT, [None, hidden]),
                           helper.make_tensor_value_info("logits", TensorProto.FLOAT, [None, vocab])],
                          [numpy_helper.from_array(table, E)])
    return helper.make_model(g, opset_imports=[helper.make_opsetid("", 17), helper.make_opsetid("com.microsoft", 1)]), table


def test_tied_head_found_only_for_plain_transposed_gemm():
    model, _ = _tied_model(16, 32)
    assert quantize._tied_head(model).name == "/lm_head/Gemm"
    scaled, _ = _tied_model(16, 32, gemm_attrs={"transB": 1, "alpha": 2.0})
    assert quantize._tied_head(scaled) is None
    untransposed, _ = _tied_model(16, 32, gemm_attrs={"transB": 0})
    assert quantize._tied_head(untransposed) is None


def _decode_rows(b: np.ndarray, scales: np.ndarray, k: int) -> np.ndarray:
    """MatMulNBits' B [N, k_blocks, block / 2] + scales [N * k_blocks] (symmetric: zero 8) -> W [N, K] float64."""
    n, kb, half = b.shape
    q = np.empty((n, kb, 2 * half), np.float64)
    q[..., 0::2], q[..., 1::2] = b & 0xF, b >> 4  # element 2j in the low nibble, 2j + 1 in the high one
    return ((q - 8) * scales.astype(np.float64).reshape(n, kb, 1)).reshape(n, -1)[:, :k]


@pytest.mark.parametrize("hidden", [64, 48])  # whole blocks; a padded last block (sliced away)
def test_tied_embedding_reads_the_int4_lm_head(hidden):
    import onnxruntime as ort

    vocab = 24
    model, table = _tied_model(vocab, hidden, seed=hidden)
    q = quantize.quantize_weights_int4(model)
    ops = [n.op_type for n in q.graph.node]
    assert "Gather" not in ops and "Gemm" not in ops and ops.count("MatMulNBits") == 1, ops
    assert ("Slice" in ops) == (hidden % 32 != 0), ops
    assert quantize.EMBED_TABLE not in {t.name for t in q.graph.initializer}
    reshape = next(n for n in q.graph.node if n.op_type == "Reshape")
    assert reshape.input[0] == f"{quantize.TIED_HEAD_WEIGHT}_Q4"
    gbq = next(n for n in q.graph.node if n.op_type == "GatherBlockQuantized")
    assert gbq.input[2] == f"{quantize.TIED_HEAD_WEIGHT}_scales"
    inits = {t.name: numpy_helper.to_array(t) for t in q.graph.initializer}
    b, s = inits[f"{quantize.TIED_HEAD_WEIGHT}_Q4"], inits[f"{quantize.TIED_HEAD_WEIGHT}_scales"]
    kb = -(-hidden // 32)
    assert b.shape == (vocab, kb, 16) and s.size == vocab * kb
    w = _decode_rows(b, s, hidden)  # the int4 head, decoded by hand
    amax = np.abs(table).reshape(vocab, -1).max(axis=1, keepdims=True)
    assert (np.abs(w - table) <= amax / 8 * 1.01).all()  # symmetric int4: scale amax / 8, codes -8 .. 7
    ids = np.array([0, 5, 23, 5], np.int64)
    emb, logits = ort.InferenceSession(q.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"ids": ids})
    assert emb.shape == (4, hidden)
    np.testing.assert_allclose(emb, w[ids], rtol=0, atol=1e-6)
    ref = w[ids] @ w.T  # the head over the (quantized) embedding
    assert np.abs(logits - ref).max() <= 0.05 * np.abs(ref).max()


# ---- quantize_moe.py: MoE -> QMoE ---------------------------------------------------------------------------


def _moe_model(k1: int, shared_fc2: bool = False) -> onnx.ModelProto:
    rng = np.random.default_rng(7)
    fc1 = rng.standard_normal((2, 16, k1)).astype(np.float32)  # [E, N, K]
    fc2 = rng.standard_normal((2, k1, 32)).astype(np.float32)
    nodes = [helper.make_node("MoE", ["x", "router", "fc1", "", "fc2"], ["y"], name="/moe/MoE", domain="com.microsoft",
                              k=1, activation_type="relu")]
    outs = [helper.make_tensor_value_info("y", TensorProto.FLOAT, None)]
    if shared_fc2:
        nodes.append(helper.make_node("Identity", ["fc2"], ["fc2_copy"], name="/fc2/Identity"))
        outs.append(helper.make_tensor_value_info("fc2_copy", TensorProto.FLOAT, None))
    g = helper.make_graph(nodes, "moe", [helper.make_tensor_value_info("x", TensorProto.FLOAT, None),
                                         helper.make_tensor_value_info("router", TensorProto.FLOAT, None)],
                          outs, [numpy_helper.from_array(fc1, "fc1"), numpy_helper.from_array(fc2, "fc2")])
    return helper.make_model(g)


def test_moe_experts_become_qmoe_int4():
    model = _moe_model(64)
    fc1 = numpy_helper.to_array(next(t for t in model.graph.initializer if t.name == "fc1"))
    assert quantize_moe.quantize_moe_int4(model, 32) == []
    (node,) = model.graph.node
    assert node.op_type == "QMoE" and node.domain == "com.microsoft" and node.name == "/moe/MoE_Q4"
    assert list(node.input) == ["x", "router", "fc1_Q4", "fc1_scales", "", "fc2_Q4", "fc2_scales"]
    attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
    assert attrs["expert_weight_bits"] == 4 and attrs["block_size"] == 32 and attrs["weights_prepacked"] == 0
    assert attrs["k"] == 1 and attrs["activation_type"] == b"relu"
    inits = {t.name: numpy_helper.to_array(t) for t in model.graph.initializer}
    assert set(inits) == {"fc1_Q4", "fc1_scales", "fc2_Q4", "fc2_scales"}  # the float experts are dropped
    codes, scales = inits["fc1_Q4"], inits["fc1_scales"]
    assert codes.shape == (2, 16, 32) and scales.shape == (2, 16, 2) and scales.dtype == np.float32
    w = np.stack([_decode_rows(codes[e].reshape(16, 2, 16), scales[e].reshape(-1), 64) for e in range(2)])
    amax = np.abs(fc1).reshape(2, 16, 2, 32).max(axis=-1)  # per block
    err = np.abs(w - fc1).reshape(2, 16, 2, 32).max(axis=-1)
    assert (err <= amax / 8 * 1.01 + 1e-7).all()  # symmetric: the scale is the block's amax / 8


def test_moe_shared_expert_weight_is_kept_and_odd_sizes_stay_float():
    model = _moe_model(64, shared_fc2=True)
    assert quantize_moe.quantize_moe_int4(model, 32) == []
    names = {t.name for t in model.graph.initializer}
    assert "fc2" in names and "fc1" not in names  # fc2 still feeds the Identity
    odd = _moe_model(48)  # fc1's K = 48, fc2's N = 48: not whole blocks of 32
    assert quantize_moe.quantize_moe_int4(odd, 32) == ["/moe/MoE"]
    assert [n.op_type for n in odd.graph.node] == ["MoE"] and {t.name for t in odd.graph.initializer} == {"fc1", "fc2"}



def test_streamed_qmoe_keeps_the_expert_biases():
    """int4_stream._qmoe (the streamed --weights int4 rewrite on the builder): a MoE node's fc1 / fc2 expert
    biases move to QMoE's bias slots (the contrib schema: input, router, fc1 W, fc1 scales, fc1 bias, fc2 W,
    fc2 scales, fc2 bias), and onnxruntime's QMoE computes relu(W1 x + b1) -> W2 h + b2 with the int4 experts
    decoded by hand (k 1, renormalized: the chosen expert's weight is 1)."""
    import onnxruntime as ort

    from pagedkit.exporters.graph import GraphBuilder
    from pagedkit.exporters.int4_stream import quantize_builder_int4

    f32 = TensorProto.FLOAT
    rng = np.random.default_rng(11)
    e, hidden, inter, t = 3, 32, 64, 6
    fc1, fc2 = (rng.standard_normal(s).astype(np.float32) for s in ((e, inter, hidden), (e, hidden, inter)))
    b1, b2 = (rng.standard_normal(s).astype(np.float32) for s in ((e, inter), (e, hidden)))
    g = GraphBuilder(f32)
    ins = [g.input("x", f32, ("T", hidden)), g.input("router", f32, ("T", e))]
    ins += [g.initializer(n, torch.from_numpy(v)) for n, v in (("fc1", fc1), ("fc1_b", b1), ("fc2", fc2), ("fc2_b", b2))]
    y = g.node("MoE", ins, "/moe/MoE", domain="com.microsoft", k=1, activation_type="relu",
               normalize_routing_weights=1, out_type=f32, out_shape=("T", hidden))
    quantize_builder_int4(g, 32, 0)
    (node,) = g.nodes
    assert node.op_type == "QMoE" and node.name == "/moe/MoE_Q4"
    assert list(node.input) == ["x", "router", "fc1_Q4", "fc1_scales", "fc1_b", "fc2_Q4", "fc2_scales", "fc2_b"]
    g.output(y, f32, ("T", hidden))
    m = g.model("qmoe", "test")
    inits = {p.name: numpy_helper.to_array(p) for p in m.graph.initializer}
    w1, w2 = (np.stack([_decode_rows(inits[f"{n}_Q4"][j].reshape(-1, inits[f"{n}_scales"].shape[2], 16),
                                     inits[f"{n}_scales"][j].reshape(-1), k) for j in range(e)])
              for n, k in (("fc1", hidden), ("fc2", inter)))
    assert np.abs(w1 - fc1).max() <= np.abs(fc1).max() / 8 * 1.01 and np.abs(w2 - fc2).max() <= np.abs(fc2).max() / 8 * 1.01
    x, r = rng.standard_normal((t, hidden)).astype(np.float32), rng.standard_normal((t, e)).astype(np.float32)
    got, = ort.InferenceSession(m.SerializeToString(), providers=["CPUExecutionProvider"]).run(None, {"x": x, "router": r})
    want = np.zeros((t, hidden))
    for i in range(t):
        j = int(np.argmax(r[i]))
        want[i] = w2[j] @ np.maximum(w1[j] @ x[i].astype(np.float64) + b1[j], 0) + b2[j]
    assert np.abs(got - want).max() <= 1e-5 * np.abs(want).max(), np.abs(got - want).max()


# ---- prequant.py: GPTQ / AWQ -> MatMulNBits ------------------------------------------------------------------


class FakeIndex:
    """CheckpointIndex's interface over a dict of tensors."""

    def __init__(self, tensors: dict[str, torch.Tensor]):
        self.t = tensors

    def __contains__(self, key):
        return key in self.t

    def info(self, key):
        return list(self.t[key].shape), "I32"

    def read(self, key, rows=None):
        return self.t[key].clone()


def _words(nib: np.ndarray) -> np.ndarray:
    """[..., 8] nibbles (low first) -> int32 words."""
    w = np.zeros(nib.shape[:-1], np.uint64)
    for i in range(8):
        w |= nib[..., i].astype(np.uint64) << np.uint64(4 * i)
    return w.astype(np.uint32).view(np.int32)


def _gptq(prefix: str, n: int, k: int, group: int, seed: int, g_idx=None):
    """Tensors of a GPTQ linear, and its codes q [K, N], stored zeros z [G, N], scales s [G, N]."""
    rng = np.random.default_rng(seed)
    g = k // group
    q = rng.integers(0, 16, (k, n))
    z = rng.integers(0, 15, (g, n))
    s = (rng.random((g, n)) * 0.1 + 0.01).astype(np.float16)
    t = {f"{prefix}.qweight": torch.from_numpy(_words(q.reshape(k // 8, 8, n).transpose(0, 2, 1))),
         f"{prefix}.qzeros": torch.from_numpy(_words(z.reshape(g, n // 8, 8))),
         f"{prefix}.scales": torch.from_numpy(s)}
    if g_idx is not None:
        t[f"{prefix}.g_idx"] = torch.tensor(g_idx, dtype=torch.int32)
    return t, q, z, s


def _leaf(index, prefix, n, k, qcfg):
    return prequant.quantized_leaf(index, f"{prefix}.weight", torch.empty(n, k, dtype=torch.float16, device="meta"),
                                   qcfg)


def test_gptq_leaf_unpacks_codes_zeros_and_dequantizes():
    t, q, z, s = _gptq("m", 8, 64, 32, seed=0)
    leaf = _leaf(FakeIndex(t), "m", 8, 64, {"quant_method": "gptq", "bits": 4, "group_size": 32})
    src = leaf._int4
    assert src.method == "gptq" and src.zero_plus_one  # v1: stored zero + 1
    assert torch.equal(src.codes(0, 8), torch.from_numpy(q.T.astype(np.uint8)))
    assert torch.equal(src.codes(3, 6), torch.from_numpy(q.T[3:6].astype(np.uint8)))
    assert torch.equal(src.zeros(), torch.from_numpy(z + 1).to(torch.int16))
    gi = np.arange(64) // 32
    want = (q.T - (z + 1).T[:, gi]) * s.astype(np.float64).T[:, gi]
    np.testing.assert_allclose(src.dequantized(torch.float32).numpy(), want, rtol=1e-6, atol=1e-7)
    assert src.block(src.g_idx()) == 32
    v2 = _leaf(FakeIndex(t), "m", 8, 64, {"quant_method": "gptq", "checkpoint_format": "gptq_v2"})._int4
    assert not v2.zero_plus_one and torch.equal(v2.zeros(), torch.from_numpy(z).to(torch.int16))



def test_group_size_default_128_and_autoawq_key():
    """No group_size in the quantization config: groups of 128 rows (GPTQ's and AutoAWQ's default); AutoAWQ's
    own key q_group_size is read too. Dequantized against the float64 formula with those groups."""
    k = 256
    t, q, z, s = _gptq("m", 8, k, 128, seed=6)
    src = _leaf(FakeIndex(t), "m", 8, k, {"quant_method": "gptq", "bits": 4})._int4
    assert src.group_size == 128 and src.groups() == 2 and src.block(src.g_idx()) == 128
    gi = np.arange(k) // 128
    want = (q.T - (z + 1).T[:, gi]) * s.astype(np.float64).T[:, gi]
    np.testing.assert_allclose(src.dequantized(torch.float32).numpy(), want, rtol=1e-6, atol=1e-7)
    t64, _, _, _ = _gptq("m", 8, k, 64, seed=6)
    assert _leaf(FakeIndex(t64), "m", 8, k, {"quant_method": "gptq", "q_group_size": 64})._int4.group_size == 64


def test_awq_leaf_reads_autoawq_order():
    rng = np.random.default_rng(1)
    n, k = 16, 32
    q = rng.integers(0, 16, (k, n))
    z = rng.integers(0, 16, (1, n))
    perm = list(prequant.AWQ_ORDER)  # nibble i of word c holds column 8c + AWQ_ORDER[i]
    t = {"a.qweight": torch.from_numpy(_words(q.reshape(k, n // 8, 8)[..., perm])),
         "a.qzeros": torch.from_numpy(_words(z.reshape(1, n // 8, 8)[..., perm])),
         "a.scales": torch.ones(1, n, dtype=torch.float16)}
    src = _leaf(FakeIndex(t), "a", n, k, {"quant_method": "awq", "group_size": 32})._int4
    assert src.method == "awq" and not src.zero_plus_one
    assert torch.equal(src.codes(0, n), torch.from_numpy(q.T.astype(np.uint8)))
    assert torch.equal(src.codes(5, 13), torch.from_numpy(q.T[5:13].astype(np.uint8)))
    assert torch.equal(src.zeros(), torch.from_numpy(z).to(torch.int16))


def test_int4_method_from_qweight_shape_and_unknown_refused():
    t, _, _, _ = _gptq("m", 8, 64, 32, seed=2)
    assert _leaf(FakeIndex(t), "m", 8, 64, {"group_size": 32})._int4.method == "gptq"
    awq = {"a.qweight": torch.zeros(64, 1, dtype=torch.int32), "a.scales": torch.ones(2, 8, dtype=torch.float16)}
    src = _leaf(FakeIndex(awq), "a", 8, 64, {"group_size": 32})._int4
    assert src.method == "awq" and not src.zero_plus_one
    odd = {"o.qweight": torch.zeros(7, 8, dtype=torch.int32)}  # neither [K / 8, N] nor [K, N / 8]
    with pytest.raises(NotImplementedError, match=r"o\.qweight: unknown 4-bit"):
        _leaf(FakeIndex(odd), "o", 8, 64, {})
    with pytest.raises(NotImplementedError, match=r"m\.qweight: gptq 8-bit"):
        _leaf(FakeIndex(t), "m", 8, 64, {"quant_method": "gptq", "bits": 8})
    assert _leaf(FakeIndex(t), "x", 8, 64, {}) is None  # no x.qweight


def test_block_from_g_idx_and_act_order_refused_naming_the_tensor():
    t, _, _, _ = _gptq("m", 8, 256, 32, seed=3, g_idx=np.arange(256) // 64)
    src = _leaf(FakeIndex(t), "m", 8, 256, {"quant_method": "gptq", "group_size": 64})._int4
    assert src.block(src.g_idx()) == 64
    assert src.block(torch.zeros(256, dtype=torch.int64)) == 128  # per-channel: one group, blocks of 128
    assert src.block(torch.arange(256) // 48) == 16  # boundaries 48, 96, ...: gcd 16
    with pytest.raises(ValueError, match=r"m\.g_idx: act-order"):
        src.block(torch.tensor([0, 1, 0, 1] * 64))
    with pytest.raises(ValueError, match=r"^m: quantization groups of 8 rows"):
        src.block(torch.arange(256) // 8)


def test_take_keeps_only_overlapping_rows():
    a, b = object(), object()
    rows = [(a, 0, 4), (b, 2, 6)]
    assert prequant._take(rows, 0, 3) == [(a, 0, 3)]
    assert prequant._take(rows, 5, 8) == [(b, 3, 6)]
    assert prequant._take(rows, 3, 6) == [(a, 3, 4), (b, 2, 4)]
    # a range ending or starting exactly at a boundary touches the other linear in no row: no empty piece
    assert prequant._take(rows, 0, 4) == [(a, 0, 4)]
    assert prequant._take(rows, 4, 8) == [(b, 2, 6)]
    assert prequant._take(rows, 8, 9) == []


def _nbits_oracle(qs: list[np.ndarray], zs: list[np.ndarray], k: int, block: int):
    """B [N, k_blocks, block / 2] and zero points [N * ceil(k_blocks / 2)] packed by hand (group = block)."""
    q = np.concatenate(qs, axis=0)  # [N, K]
    kb = -(-k // block)
    q = np.pad(q, ((0, 0), (0, kb * block - k)))
    b = (q[:, 0::2] | (q[:, 1::2] << 4)).astype(np.uint8).reshape(len(q), kb, block // 2)
    z = np.concatenate(zs, axis=0)  # [N, k_blocks]
    z = np.pad(z, ((0, 0), (0, z.shape[1] % 2)))
    return b, (z[:, 0::2] | (z[:, 1::2] << 4)).astype(np.uint8).reshape(-1)


def test_packed_rows_of_two_linears_match_hand_packing():
    k = 80  # groups of 16: five blocks, an odd count (the zero points' last byte half empty)
    t1, q1, z1, s1 = _gptq("p", 8, k, 16, seed=4)
    t2, q2, z2, s2 = _gptq("r", 16, k, 16, seed=5)
    idx = FakeIndex({**t1, **t2})
    qcfg = {"quant_method": "gptq", "group_size": 16, "checkpoint_format": "gptq_v2"}
    src1, src2 = _leaf(idx, "p", 8, k, qcfg)._int4, _leaf(idx, "r", 16, k, qcfg)._int4
    rows = [(src1, 2, 8), (src2, 0, 16)]  # rows 2..8 of p, then all of r
    packed = prequant.Packed(rows, torch.float16)
    assert (packed.k, packed.n, packed.block, packed.k_blocks, packed.zero_kind) == (k, 22, 16, 5, "uint8")
    b_want, zp_want = _nbits_oracle([q1.T[2:8], q2.T], [z1.T[2:8], z2.T], k, 16)
    b = packed.b()
    assert tuple(b.shape) == (22, 5, 8)
    assert np.array_equal(b.materialize().numpy(), b_want)
    assert np.array_equal(packed.b_rows(4, 11).numpy(), b_want[4:11])  # across the two linears
    assert np.array_equal(b._slicer(0, 7, 20).numpy(), b_want[7:20])
    assert b._slicer(1, 0, 2) is None  # only rows are read by slices
    sc = packed.scales().materialize()
    assert sc.dtype == torch.float16 and np.array_equal(sc.numpy(), np.concatenate([s1.T[2:8], s2.T]).reshape(-1))
    zp = packed.zero_points()
    assert tuple(zp.shape) == (22 * 3,)
    assert np.array_equal(zp.materialize().numpy(), zp_want)


# ---- weights.py ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("experts, want", [(16, (8, 4, 8)), (12, (6, 3, 6)), (1, (1, 1, 1)), (3, (1, 1, 3))])
def test_shrink_groups_keeps_groups_dividing_the_experts(experts, want):
    cfg = SimpleNamespace(n_group=8, topk_group=4, num_experts_per_tok=8)
    weights._shrink_groups(cfg, experts, "num_experts_per_tok")
    assert (cfg.n_group, cfg.topk_group, cfg.num_experts_per_tok) == want


@pytest.mark.parametrize("stream, qcfg, streamed", [(True, None, True), (True, {"quant_method": "gptq"}, True),
                                                      (False, None, False),
                                                      (True, {"quant_method": "bitsandbytes"}, False)])
def test_from_dir_streams_unless_told_or_unreadable(stream, qcfg, streamed, monkeypatch, tmp_path):
    import warnings

    from pagedkit.exporters import checkpoint
    import transformers

    calls = []

    class Model:
        config = "cfg"

        def eval(self):
            return self

    monkeypatch.setattr(checkpoint, "streamed_model", lambda path, config, dtype: calls.append("stream") or Model())

    class Auto:
        @staticmethod
        def from_pretrained(path, **kw):
            calls.append("whole")
            return Model()

    monkeypatch.setattr(transformers, "AutoModelForCausalLM", Auto)
    config = SimpleNamespace(quantization_config=qcfg)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        got = weights._from_dir(tmp_path, "name", config, torch.float16, stream=stream)
    assert calls == ["stream" if streamed else "whole"]
    assert got.weights == "safetensors" and got.checkpoint == tmp_path.resolve() and got.config == "cfg"
    assert any("bitsandbytes checkpoints are not read" in str(w.message) for w in caught) == \
        (qcfg == {"quant_method": "bitsandbytes"})
