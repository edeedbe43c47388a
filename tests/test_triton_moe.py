"""kernels/triton/moe.py (the routed experts of com.microsoft MoE as two grouped GEMM launches), through Triton's
interpreter on the CPU, against a float64 loop over tokens and routes that shares no code with it or with
runtime/ops/moe.py: each route's expert FFN from the weights as given (fc1 rows interleaved / concatenated / fc3),
the activation written out, the k routes summed with their weights.

Cases: every fc1 layout and activation family, biases, swiglu's alpha / beta / limit (both orders), float16 /
bfloat16 / float32, an expert with more routes than one tile (BLOCK_M), experts with no route, a single token.
Teeth: routing weights of another route, routes paired with their neighbour's rows, fc1's halves swapped.
"""

from __future__ import annotations

import math

import pytest
import torch

moe_k = pytest.importorskip("pagedkit.kernels.triton.moe")
if not moe_k.common.HAVE_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)

TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2, torch.float32: 1e-5}


def _gelu_tanh(a):
    return 0.5 * a * (1 + torch.tanh(math.sqrt(2 / math.pi) * (a + 0.044715 * a ** 3)))


def oracle(xs, top_e, top_w, w, attrs) -> torch.Tensor:
    """float64, one token and one route at a time."""
    fc1_w, fc1_b, fc2_w, fc2_b, fc3_w, fc3_b = (t.double() if t is not None else None for t in w)
    act = attrs.get("activation_type", "relu")
    out = torch.zeros(xs.shape[0], xs.shape[1], dtype=torch.float64)
    for t in range(xs.shape[0]):
        x = xs[t].double()
        for j in range(top_e.shape[1]):
            e = int(top_e[t, j])
            h1 = fc1_w[e] @ x + (fc1_b[e] if fc1_b is not None else 0)
            h3 = fc3_w[e] @ x + (fc3_b[e] if fc3_b is not None else 0) if fc3_w is not None else None
            if act in ("swiglu", "geglu"):
                fusion = attrs.get("swiglu_fusion", 0)
                if fusion == 1:
                    g, l = h1[0::2], h1[1::2]
                elif fusion == 2:
                    g, l = h1[: h1.shape[0] // 2], h1[h1.shape[0] // 2:]
                else:
                    g, l = h1, h3
                if act == "geglu":
                    a = _gelu_tanh(g) * l
                else:
                    alpha, beta = attrs.get("activation_alpha", 1.0), attrs.get("activation_beta", 0.0)
                    lim = attrs.get("swiglu_limit", math.inf)
                    l = l.clamp(-lim, lim)
                    if attrs.get("swiglu_limit_after_activation", 0):
                        a = (g * torch.sigmoid(alpha * g)).clamp(max=lim) * (l + beta)
                    else:
                        g = g.clamp(max=lim)
                        a = g * torch.sigmoid(alpha * g) * (l + beta)
            else:
                a = {"relu": torch.relu(h1), "relu2": torch.relu(h1) ** 2, "gelu": _gelu_tanh(h1),
                     "silu": h1 * torch.sigmoid(h1), "identity": h1}[act]
                if h3 is not None:
                    a = a * h3
            y = fc2_w[e] @ a + (fc2_b[e] if fc2_b is not None else 0)
            out[t] += float(top_w[t, j]) * y
    return out


def make(n_tok=7, k=2, n_exp=5, hidden=48, inter=40, dtype=torch.float16, act="swiglu", fusion=1, fc3=False,
         bias=True, seed=0, experts_used=None):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape, scale=1.0):
        return (torch.randn(*shape, generator=g) * scale).to(dtype)

    n1 = 2 * inter if (act in ("swiglu", "geglu") and fusion in (1, 2)) else inter
    xs = rnd(n_tok, hidden)
    w = [rnd(n_exp, n1, hidden, scale=hidden ** -0.5), rnd(n_exp, n1, scale=0.1) if bias else None,
         rnd(n_exp, hidden, inter, scale=inter ** -0.5), rnd(n_exp, hidden, scale=0.1) if bias else None,
         rnd(n_exp, inter, hidden, scale=hidden ** -0.5) if fc3 else None,
         rnd(n_exp, inter, scale=0.1) if (fc3 and bias) else None]
    pool = experts_used if experts_used is not None else list(range(n_exp))
    top_e = torch.stack([torch.tensor(pool)[torch.randperm(len(pool), generator=g)[:k]] for _ in range(n_tok)])
    top_w = torch.rand(n_tok, k, generator=g) + 0.1
    attrs = {"activation_type": act, "k": k}
    if act in ("swiglu", "geglu"):
        attrs["swiglu_fusion"] = fusion
    return xs, top_e, top_w, w, attrs


def _err(got, ref):
    assert torch.isfinite(got).all()
    return float((got.double() - ref).abs().max() / ref.abs().max())


CASES = {
    "swiglu-interleaved-fp16": dict(),  # pagedkit's export: swiglu_fusion 1, biases
    "swiglu-concat-bf16-limits": dict(dtype=torch.bfloat16, fusion=2),
    "swiglu-fc3-fp32": dict(dtype=torch.float32, fusion=0, fc3=True, bias=False),
    "relu2-fp16": dict(act="relu2", bias=False),
    "gelu-gated-by-fc3": dict(act="gelu", fc3=True),
    "silu": dict(act="silu", dtype=torch.float32),
    "identity": dict(act="identity"),
    "relu": dict(act="relu", fc3=True, bias=False),
    "geglu-concat": dict(act="geglu", fusion=2),
}


@pytest.mark.parametrize("name", list(CASES))
def test_matches_the_float64_loop(name):
    xs, top_e, top_w, w, attrs = make(**CASES[name])
    if name == "swiglu-concat-bf16-limits":
        attrs |= {"activation_alpha": 1.702, "activation_beta": 1.0, "swiglu_limit": 0.7}
    assert moe_k.serves(xs, w, attrs) is None
    got = moe_k.fused_moe(xs, top_e, top_w, w, attrs)
    assert got.shape == (xs.shape[0], xs.shape[1]) and got.dtype == torch.float32
    assert _err(got, oracle(xs, top_e, top_w, w, attrs)) <= TOL[xs.dtype]


def test_swiglu_limit_after_activation():
    xs, top_e, top_w, w, attrs = make(dtype=torch.float32, fusion=2)
    attrs |= {"activation_alpha": 1.5, "swiglu_limit": 0.3, "swiglu_limit_after_activation": 1}
    got = moe_k.fused_moe(xs, top_e, top_w, w, attrs)
    ref = oracle(xs, top_e, top_w, w, attrs)
    assert _err(got, ref) <= TOL[torch.float32]
    attrs["swiglu_limit_after_activation"] = 0  # the other order differs: the case means something
    assert _err(got, oracle(xs, top_e, top_w, w, attrs)) > 100 * TOL[torch.float32]


def test_many_routes_per_expert_and_unused_experts():
    """40 routes over experts {1, 4} of 6 (20 each: two BLOCK_M tiles), experts 0, 2, 3, 5 unused; one token."""
    xs, top_e, top_w, w, attrs = make(n_tok=20, k=2, n_exp=6, experts_used=[1, 4], seed=3)
    assert int((top_e == 1).sum()) > moe_k.BLOCK_M
    assert _err(moe_k.fused_moe(xs, top_e, top_w, w, attrs), oracle(xs, top_e, top_w, w, attrs)) <= TOL[xs.dtype]
    one = make(n_tok=1, k=3, n_exp=4, seed=4)
    assert _err(moe_k.fused_moe(*one), oracle(*one)) <= TOL[torch.float16]


def test_teeth():
    xs, top_e, top_w, w, attrs = make(n_tok=20, k=2, n_exp=3, seed=5)
    ref = oracle(xs, top_e, top_w, w, attrs)
    # routing weights of the other route
    assert _err(moe_k.fused_moe(xs, top_e, top_w.flip(1), w, attrs), ref) > 10 * TOL[xs.dtype]
    # fc1's gate and up rows swapped (fusion 1 read as [up, gate])
    swapped = list(w)
    swapped[0] = w[0].reshape(3, -1, 2, xs.shape[1]).flip(2).reshape(w[0].shape)
    swapped[1] = w[1].reshape(3, -1, 2).flip(2).reshape(w[1].shape)
    assert _err(moe_k.fused_moe(xs, top_e, top_w, swapped, attrs), ref) > 10 * TOL[xs.dtype]


def test_teeth_routes_paired_with_the_wrong_rows(monkeypatch):
    """Sorted positions paired with their neighbour's route (an off-by-one between the sort and the rows it
    orders) fail the oracle."""
    xs, top_e, top_w, w, attrs = make(n_tok=9, k=2, n_exp=3, seed=6)
    real = torch.argsort
    monkeypatch.setattr(moe_k.torch, "argsort", lambda x, **kw: real(x, **kw).roll(1))
    assert _err(moe_k.fused_moe(xs, top_e, top_w, w, attrs), oracle(xs, top_e, top_w, w, attrs)) > 10 * TOL[xs.dtype]


def test_refusals():
    xs, top_e, top_w, w, attrs = make()
    assert "activation_type" in moe_k.serves(xs, w, attrs | {"activation_type": "softplus"})
    assert "dtypes" in moe_k.serves(xs.float(), w, attrs)
    assert "swiglu_fusion 0" in moe_k.serves(xs, w, attrs | {"swiglu_fusion": 0})
    bad = list(w)
    bad[2] = w[2][:, :-1].contiguous()
    assert "fc2 weights" in moe_k.serves(xs, bad, attrs)


def test_op_falls_back_when_the_kernel_fails(monkeypatch):
    """runtime/ops/moe.py: a fused kernel that fails to build or run on the device warns once, records why, and
    the call (and every later one) takes the torch path, with its result."""
    from types import SimpleNamespace

    from pagedkit.runtime.ops import moe as op
    from pagedkit.runtime.ops.registry import OpContext

    xs, _, _, w, attrs = make(dtype=torch.float32, seed=8)
    router = torch.randn(xs.shape[0], 5, generator=torch.Generator().manual_seed(9))
    ctx = OpContext(node_name="moe_fallback")
    assert op.triton_moe_refusal(xs, w, attrs) == "not a CUDA tensor"
    expected = op.moe([xs, router, *w], attrs, ctx)[0]

    def broken(*a, **k):
        raise RuntimeError("PassManager::run failed")

    monkeypatch.setattr(op, "TRITON_FAILURE", [])
    monkeypatch.setattr(op, "triton_moe_refusal", lambda *a: None if not op.TRITON_FAILURE else "failed")
    monkeypatch.setattr(op, "triton_kernels", lambda name: SimpleNamespace(fused_moe=broken) if name == "moe" else None)
    with pytest.warns(RuntimeWarning, match="PassManager::run failed"):
        got = op.moe([xs, router, *w], attrs, ctx)[0]
    assert torch.equal(got, expected) and op.ROUTES["moe_fallback"] != "triton"
    assert op.TRITON_FAILURE == ["RuntimeError: PassManager::run failed"]


def _pack(codes: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 codes [..., n] (n a multiple of 8 / bits) -> bytes, the first code in the lowest bits."""
    per = 8 // bits
    c = codes.to(torch.int64).reshape(*codes.shape[:-1], -1, per)
    return sum(c[..., i] << (i * bits) for i in range(per)).to(torch.uint8)


def _packed_case(w_float: torch.Tensor, bits: int, block: int, zp: bool, g: torch.Generator, dtype):
    """Random codes, scales and zero points for a weight of w_float's shape [E, N, K]: (PackedExperts, the
    dequantized weight in float64 by hand, rounded to the scales' dtype as the op's dequantization is)."""
    e, n, k = w_float.shape
    groups = k // block if block else 1
    codes = torch.randint(0, 1 << bits, (e, n, k), generator=g)
    scales = (torch.rand(e, n, groups, generator=g) * 0.05 + 0.01).to(dtype)
    per = 8 // bits
    if zp:
        zc = torch.randint(0, 1 << bits, (e, n, groups) if block else (e, n), generator=g)
        pad = (-zc.shape[-1]) % per
        zpk = _pack(torch.cat([zc, torch.zeros(*zc.shape[:-1], pad, dtype=zc.dtype)], -1), bits)
        z = (zc if block else zc).double()
    else:
        zpk, z = None, torch.full((e, n, groups) if block else (e, n), float(1 << (bits - 1)), dtype=torch.float64)
    zz = z.reshape(e, n, -1).repeat_interleave(block if block else k, dim=-1)
    ss = scales.double().reshape(e, n, -1).repeat_interleave(block if block else k, dim=-1)
    deq = ((codes.double() - zz) * ss).to(dtype)
    return moe_k.PackedExperts(_pack(codes, bits), scales.reshape(e, n, groups) if block else scales.reshape(e, n),
                               zpk, bits, block), deq


@pytest.mark.parametrize("bits,block,zp,fusion", [(4, 32, True, 1), (8, 0, False, 2), (2, 16, True, 0),
                                                  (4, 0, True, 1), (8, 16, False, 0),
                                                  (4, 8, True, 2), (2, 8, True, 1)])  # several zero-point bytes a row
def test_packed_experts_match_the_dequantized_loop(bits, block, zp, fusion):
    """QMoE's integer experts dequantized in the kernel's loads: the float64 loop over the weights dequantized by
    hand (codes, scales and zero points packed here, the first code in the lowest bits)."""
    dtype = torch.float16
    xs, top_e, top_w, w, attrs = make(n_tok=9, k=2, n_exp=3, hidden=64, inter=32, fusion=fusion, fc3=fusion == 0,
                                      seed=bits + block)
    g = torch.Generator().manual_seed(21)
    packed, dense = list(w), list(w)
    for i in (0, 2, 4):
        if w[i] is not None:
            packed[i], dense[i] = _packed_case(w[i], bits, block, zp, g, dtype)
    assert moe_k.serves(xs, packed, attrs) is None
    got = moe_k.fused_moe(xs, top_e, top_w, packed, attrs)
    assert _err(got, oracle(xs, top_e, top_w, dense, attrs)) <= TOL[dtype]
    if zp:  # teeth: the default zero point instead of the given ones
        wrong = [moe_k.PackedExperts(p.q, p.scales, None, p.bits, p.block_size)
                 if isinstance(p, moe_k.PackedExperts) else p for p in packed]
        assert _err(moe_k.fused_moe(xs, top_e, top_w, wrong, attrs), oracle(xs, top_e, top_w, dense, attrs)) > 0.05


def test_packed_refusals():
    xs, top_e, top_w, w, attrs = make(hidden=64)
    g = torch.Generator().manual_seed(1)
    p, _ = _packed_case(w[0], 4, 32, False, g, torch.float16)
    assert "block_size 48" in moe_k.serves(xs, [moe_k.PackedExperts(p.q, p.scales, None, 4, 48)] + w[1:], attrs)
    assert "3-bit" in moe_k.serves(xs, [moe_k.PackedExperts(p.q, p.scales, None, 3, 32)] + w[1:], attrs)
    assert "scales" in moe_k.serves(xs, [moe_k.PackedExperts(p.q, p.scales[..., :1], None, 4, 32)] + w[1:], attrs)


def test_several_column_blocks():
    """fc1 columns (72) and fc2 columns (80) over more than one 64-wide column block, K over two 64-wide steps with
    a masked tail (mutants of the column offsets and their masks survived the narrower cases)."""
    for case in (dict(hidden=80, inter=72, seed=12), dict(hidden=80, inter=72, act="relu2", bias=False, seed=13),
                 dict(hidden=80, inter=72, dtype=torch.float32, fusion=2, seed=14)):
        xs, top_e, top_w, w, attrs = make(n_tok=6, k=2, n_exp=3, **case)
        got = moe_k.fused_moe(xs, top_e, top_w, w, attrs)
        assert _err(got, oracle(xs, top_e, top_w, w, attrs)) <= TOL[xs.dtype]


def test_more_refusals():
    xs, top_e, top_w, w, attrs = make(hidden=64)
    g = torch.Generator().manual_seed(2)
    p, _ = _packed_case(w[0], 4, 16, True, g, torch.float16)
    bad_s = moe_k.PackedExperts(p.q, torch.cat([p.scales, p.scales[..., :1]], -1), p.zero_points, 4, 16)
    assert "scales" in moe_k.serves(xs, [bad_s] + w[1:], attrs)
    bad_z = moe_k.PackedExperts(p.q, p.scales, torch.cat([p.zero_points, p.zero_points[..., :1]], -1), 4, 16)
    assert "zero points" in moe_k.serves(xs, [bad_z] + w[1:], attrs)
    short_z = moe_k.PackedExperts(p.q, p.scales, p.zero_points[..., :1].contiguous(), 4, 16)
    assert "zero points" in moe_k.serves(xs, [short_z] + w[1:], attrs)
    assert moe_k.serves(xs, [p] + w[1:], attrs) is None
    mixed = list(w)
    mixed[2] = w[2].float()  # fc2 in another dtype than x and fc1
    assert "dtypes" in moe_k.serves(xs, mixed, attrs)
    no_fusion = {k: v for k, v in attrs.items() if k != "swiglu_fusion"}  # the default: fc3 separate
    assert "swiglu_fusion 0" in moe_k.serves(xs, w, no_fusion)
    xs3, top_e3, top_w3, w3, attrs3 = make(fusion=0, fc3=True, seed=15)
    attrs3.pop("swiglu_fusion")
    assert moe_k.serves(xs3, w3, attrs3) is None
    got = moe_k.fused_moe(xs3, top_e3, top_w3, w3, attrs3)
    assert _err(got, oracle(xs3, top_e3, top_w3, w3, attrs3)) <= TOL[xs3.dtype]
