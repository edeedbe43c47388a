"""com.microsoft::MoE with use_sparse_mixer=1 (PhiMoE's sparsemixer, runtime/ops/moe.py `sparse_mixer`) against
an independent float64 loop oracle of Hugging Face's `sparsemixer` in eval mode (its division form
(m - s_j) / max(|s_j|, m) > 2 eps, softmax over the unmasked experts; onnxruntime's CUDA kernel multiplies
instead, the same decisions away from the threshold). The logits are built with experts on both sides of the
0.02 relative threshold in both passes; rows whose decision lies within 1e-5 of it are left out.

Teeth: a wrong threshold (jitter eps 0.005 instead of onnxruntime's 0.01) and the second pass's mask not
applied each fail the oracle comparison. Also: the whole node (experts included, float32 and float16), k != 2
refused, the delegated CPU backend keeps the node on pagedkit's kernel (onnxruntime 1.32's CPU MoE ignores the
attribute and routes softmax top-2: checked here too, the reason the PhiMoE exporter routes in standard ops)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
import torch
from onnx import TensorProto, helper, numpy_helper

from pagedkit.runtime.ops import moe as M

EPS = 0.01  # PhiMoE's router_jitter_noise == onnxruntime's constant
T, E, H, I = 96, 8, 16, 12


def _logits(seed: int = 0) -> np.ndarray:
    """[T, E] float32: a per-row level (positive, negative, near 0) plus spreads of a few percent, so that the
    masks keep 1-5 experts per pass; rows too close to a threshold decision dropped."""
    rng = np.random.default_rng(seed)
    level = rng.choice([-3.0, -0.4, 0.05, 0.5, 2.0], size=(T * 2, 1)) * rng.uniform(0.5, 1.5, (T * 2, 1))
    s = (level + np.abs(level) * rng.uniform(-0.05, 0.05, (T * 2, E))).astype(np.float32)
    s[: T // 4] = rng.standard_normal((T // 4, E)).astype(np.float32)  # spread rows: one expert per pass
    keep = [r for r in range(len(s)) if _margin(s[r]) > 1e-5]
    return s[keep[:T]]


def _margin(s: np.ndarray) -> float:
    """Smallest distance of a mask decision of either pass from the threshold 2 eps (float64)."""
    s = s.astype(np.float64)
    i1 = int(np.argmax(s))
    m2 = np.max(np.delete(s, i1))
    return min(np.abs((m - s) / np.maximum(np.abs(s), m) - 2 * EPS).min() for m in (s[i1], m2))


def oracle_route(s: np.ndarray) -> list[tuple[int, float]]:
    """HF's sparsemixer (eval) on one row, float64 loops: [(expert 1, w1), (expert 2, w2)]."""
    s = [float(v) for v in s]
    n = len(s)
    out, done = [], set()
    for _ in range(2):
        cand = [j for j in range(n) if j not in done]
        top = max(cand, key=lambda j: (s[j], -j))
        m = s[top]
        kept = [j for j in cand if not ((m - s[j]) / max(abs(s[j]), m) > 2 * EPS)]
        out.append((top, 1.0 / sum(np.exp(s[j] - m) for j in kept)))
        done.add(top)
    return out


def _swiglu_expert(fc1: np.ndarray, fc2: np.ndarray, e: int, x: np.ndarray) -> np.ndarray:
    h = fc1[e].astype(np.float64) @ x.astype(np.float64)  # [2I] interleaved gate / up
    g, u = h[0::2], h[1::2]
    return fc2[e].astype(np.float64) @ (g / (1 + np.exp(-g)) * u)


def test_route_matches_oracle():
    s = _logits()
    w, e = M.sparse_mixer(torch.from_numpy(s))
    counts = []
    for r in range(len(s)):
        ref = oracle_route(s[r])
        assert [int(v) for v in e[r]] == [j for j, _ in ref], r
        np.testing.assert_allclose(w[r].double().numpy(), [v for _, v in ref], rtol=2e-6, err_msg=str(r))
        counts.append(round(1 / ref[0][1], 3) != 1.0)
    assert 0.3 < np.mean(counts) < 0.95  # both regimes covered: several experts kept, or only the top one


@pytest.mark.parametrize("broken", ["threshold", "second_mask"])
def test_route_oracle_has_teeth(monkeypatch, broken):
    if broken == "threshold":
        monkeypatch.setattr(M, "SPARSE_MIXER_EPS", EPS / 2)
    else:
        weight = M._mixer_weight
        monkeypatch.setattr(M, "_mixer_weight", lambda s, top, ex: weight(s, top, ex) if ex is None else
                            1.0 / torch.exp(s - top).masked_fill(ex, 0.0).sum(-1, keepdim=True))
    with pytest.raises(AssertionError):
        test_route_matches_oracle()


def _moe_graph(k: int = 2, sparse: int = 1, elem=TensorProto.FLOAT):
    rng = np.random.default_rng(5)
    fc1 = (rng.standard_normal((E, 2 * I, H)) * 0.4).astype(np.float32)
    fc2 = (rng.standard_normal((E, H, I)) * 0.4).astype(np.float32)
    node = helper.make_node("MoE", ["x", "r", "fc1", "", "fc2"], ["y"], domain="com.microsoft", k=k,
                            activation_type="swiglu", swiglu_fusion=1, activation_alpha=1.0, activation_beta=0.0,
                            normalize_routing_weights=1, use_sparse_mixer=sparse)
    np_t = np.float16 if elem == TensorProto.FLOAT16 else np.float32
    g = helper.make_graph([node], "moe", [helper.make_tensor_value_info("x", elem, ["T", H]),
                                          helper.make_tensor_value_info("r", elem, ["T", E])],
                          [helper.make_tensor_value_info("y", elem, ["T", H])],
                          [numpy_helper.from_array(fc1.astype(np_t), "fc1"),
                           numpy_helper.from_array(fc2.astype(np_t), "fc2")])
    m = helper.make_model(g, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])
    return m, fc1.astype(np_t), fc2.astype(np_t)


def _oracle_moe(x, s, fc1, fc2):
    return np.stack([sum(w * _swiglu_expert(fc1, fc2, j, x[t]) for j, w in oracle_route(s[t]))
                     for t in range(len(x))])


@pytest.mark.parametrize("elem", [TensorProto.FLOAT, TensorProto.FLOAT16], ids=["fp32", "fp16"])
@pytest.mark.parametrize("backend", ["torch", "onnxruntime"])
def test_moe_node_matches_oracle(elem, backend):
    """The whole node (normalize_routing_weights=1 set and, as onnxruntime's kernel, not applied), in pagedkit's
    session; with the onnxruntime CPU backend the node stays on pagedkit's kernel (delegate barrier)."""
    from pagedkit.runtime.session import InferenceSession

    model, fc1, fc2 = _moe_graph(elem=elem)
    np_t = np.float16 if elem == TensorProto.FLOAT16 else np.float32
    x = np.random.default_rng(7).standard_normal((T, H)).astype(np_t)
    s = _logits(3).astype(np_t)
    s = s[[r for r in range(len(s)) if _margin(s[r]) > 1e-5]]  # fp16 rounding may move a row to a threshold
    x = x[: len(s)]
    ref = _oracle_moe(x.astype(np.float64), s.astype(np.float64), fc1, fc2)
    sess = InferenceSession(model, cpu_backend=backend)
    got = sess.run(None, {"x": x, "r": s})[0].astype(np.float64)
    err = np.abs(got - ref).max() / np.abs(ref).max()
    assert err <= (2e-3 if elem == TensorProto.FLOAT16 else 1e-5), err
    plain = np.stack([sum(p * _swiglu_expert(fc1, fc2, j, xt) for j, p in zip(o, pr[o]))
                      for xt, pr, o in ((x[t].astype(np.float64), _softmax(s[t]), np.argsort(-s[t])[:2])
                                        for t in range(len(x)))])
    assert np.abs(plain - ref).max() / np.abs(ref).max() > 0.1  # softmax top-2 is far from it


def _softmax(v):
    v = v.astype(np.float64)
    p = np.exp(v - v.max())
    return p / p.sum()


def test_onnxruntime_cpu_ignores_sparse_mixer():
    """Stock onnxruntime's CPU MoE (1.32) accepts use_sparse_mixer=1 and routes softmax top-2: why pagedkit's
    PhiMoE exporter computes the sparsemixer in standard ops, and why the delegate keeps such nodes."""
    import onnxruntime as ort

    model, fc1, fc2 = _moe_graph()
    x = np.random.default_rng(7).standard_normal((T, H)).astype(np.float32)
    s = _logits(3)
    n = len(s)
    got = ort.InferenceSession(model.SerializeToString(), providers=["CPUExecutionProvider"]).run(
        None, {"x": x[:n], "r": s})[0]
    ref = _oracle_moe(x[:n], s, fc1, fc2)
    assert np.abs(got - ref).max() / np.abs(ref).max() > 0.1, f"onnxruntime {ort.__version__} honours it now"


def test_k_other_than_two_refused():
    from pagedkit.runtime.session import InferenceSession

    model, _, _ = _moe_graph(k=3)
    with pytest.raises(Exception, match="use_sparse_mixer"):
        InferenceSession(model, cpu_backend="torch").run(None, {"x": np.zeros((2, H), np.float32),
                                                                "r": np.zeros((2, E), np.float32)})
