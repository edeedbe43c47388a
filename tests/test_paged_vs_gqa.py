"""Design §17.1: PagedAttention over contiguous block tables == GroupQueryAttention, in the references.

A ragged fp16 batch (a prompt, a decode, a chunk with past, an idle sequence) is built for
PagedAttention with each sequence's blocks contiguous and in order; tests/paged_gqa.gqa_from_paged
turns it into the equivalent padded GQA call (shared-capacity BNSH past, right-padded query_seqlens
chunk). Both references run on every shared feature; output, output_qk and the updated caches must
agree within max|diff| <= 5e-3 * max|ref| (fp16: both round Q/K/V and the output to fp16, at different
points). Paged cache rows no sequence owns and padded GQA rows are NaN, so any stray read fails.

Both references call pagedkit/kernels/attention_math.py (RMSNorm, RoPE, attend), so this checks the
conversion between the two operators (paging vs padding, cache layouts and codes, masks), not that math:
the math is checked against independent float64 oracles (tests/test_reference_paged.py for
PagedAttention, tests/test_gqa_oracle.py for GQA) and onnxruntime CPU (tests/test_gqa_vs_ort.py).

Not shared: onnxruntime's GQA adds attention_bias AFTER softcap, while PagedAttention's contract adds
it before softcap (contract-decisions §3/§7); test_bias_with_softcap_differs pins that difference.
"""

from __future__ import annotations

import pytest
import torch

from paged_gqa import gqa_from_paged, gqa_output_as_paged, gqa_present_as_paged, gqa_qk_as_paged
from pagedkit.kernels.paged.reference import paged_attention
from pagedkit.kernels.gqa.reference import group_query_attention

TOL = 5e-3
BLOCK = 16
PAST = (0, 21, 7, 12)  # tokens cached per sequence before the step
Q_LEN = (5, 1, 3, 0)  # new tokens: prompt, decode, chunk, idle
CACHE = {"float": torch.float16, "int8": torch.int8, "fp8": torch.float8_e4m3fn, "int4": torch.uint8}
STEP = {"int8": 3.0 / 127, "fp8": 3.0 / 448, "int4": 3.0 / 7}


def _randn(g, shape, scale=1.0):
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    return (torch.where(x.abs() < 1e-2, torch.full_like(x, 0.5), x) * scale)


def make_paged(*, num_heads=4, kv_num_heads=2, head_size=16, packed=False, rotary=None, qk_norm=False,
               head_sink=False, cache="float", k_quant="NONE", v_quant="NONE", bias=None, seed=0, **attrs):
    """fp16 PagedAttention inputs over contiguous block tables; attrs are PagedAttention attributes."""
    g = torch.Generator().manual_seed(seed)
    h, hkv, d = num_heads, kv_num_heads, head_size
    n_tok = sum(Q_LEN)
    ext = [p + q for p, q in zip(PAST, Q_LEN)]
    need = [-(-e // BLOCK) for e in ext]
    max_blocks = max(need) + 1  # one unmapped (-1) entry per row at least
    table = torch.full((len(PAST), max_blocks), -1, dtype=torch.int32)
    base = 0
    for b, n in enumerate(need):
        table[b, :n] = torch.arange(base, base + n, dtype=torch.int32)
        base += n
    nb = base + 1  # a spare block no sequence owns
    a = {"num_heads": h, "kv_num_heads": hkv, **attrs}
    x = {}
    width = (h + 2 * hkv) * d if packed else h * d
    x["query"] = _randn(g, (n_tok, width)).half()
    if not packed:
        x["key"] = _randn(g, (n_tok, hkv * d)).half()
        x["value"] = _randn(g, (n_tok, hkv * d)).half()
    dc = (d + 1) // 2 if cache == "int4" else d
    for name in ("key_cache", "value_cache"):
        if cache == "float":
            c = torch.full((nb, BLOCK, hkv, dc), float("nan"), dtype=torch.float16)
        elif cache == "int4":
            c = torch.zeros((nb, BLOCK, hkv, dc), dtype=torch.uint8)
        elif cache == "int8":
            c = torch.full((nb, BLOCK, hkv, dc), -128, dtype=torch.int8)
        else:
            c = torch.full((nb, BLOCK, hkv, dc), float("nan")).to(torch.float8_e4m3fn)
        for b, p in enumerate(PAST):  # cached rows: random values / codes
            for i in range(p):
                blk, off = int(table[b, i // BLOCK]), i % BLOCK
                if cache == "float":
                    c[blk, off] = _randn(g, (hkv, dc)).half()
                elif cache == "fp8":
                    c[blk, off] = (torch.rand((hkv, dc), generator=g) * 400 - 200).to(torch.float8_e4m3fn)
                elif cache == "int8":
                    c[blk, off] = torch.randint(-127, 128, (hkv, dc), generator=g).to(torch.int8)
                else:
                    c[blk, off] = torch.randint(0, 256, (hkv, dc), generator=g).to(torch.uint8)
        x[name] = c
    x["cumulative_sequence_length"] = torch.tensor([0, *torch.tensor(Q_LEN).cumsum(0).tolist()], dtype=torch.int32)
    x["past_seqlens"] = torch.tensor(PAST, dtype=torch.int32)
    x["block_table"] = table
    if rotary:
        angle = torch.rand((max(ext) + 8, d // 2), generator=g, dtype=torch.float64) * 6.28
        x["cos_cache"], x["sin_cache"] = angle.cos().half(), angle.sin().half()
        a.update(do_rotary=1, rotary_interleaved=int(rotary == "interleaved"))
    if head_sink:
        x["head_sink"] = _randn(g, (h,)).half()
    if qk_norm:
        x["q_norm_weight"] = (1 + 0.2 * _randn(g, (d,))).half()
        x["k_norm_weight"] = (1 + 0.2 * _randn(g, (d,))).half()
    if cache != "float":
        a.update(k_quant_type=k_quant, v_quant_type=v_quant)
        if cache == "int4":
            a.update(k_cache_dtype="int4", v_cache_dtype="int4")
        for side, qt in (("k_scale", k_quant), ("v_scale", v_quant)):
            if qt == "PER_TENSOR":
                x[side] = torch.tensor([STEP[cache]], dtype=torch.float32)
            else:
                x[side] = (STEP[cache] * (0.5 + torch.rand((hkv, 1, d), generator=g))).float()
    if bias is not None:
        x["attention_bias"] = _randn(g, (bias[0], bias[1], max(Q_LEN) + 2, max(ext) + 3)).half()
    return x, a


def paged_outputs(attrs):
    return ["output", "key_cache_out", "value_cache_out"] + (["output_qk"] if attrs.get("qk_output") else [])


def run_both(x, a):
    """Paged reference once; GQA reference on the whole batch, or (is_causal=0) once per sequence with
    new tokens. Returns (paged result, [(gqa result, layout), ...])."""
    paged = paged_attention({k: v.clone() for k, v in x.items()}, outputs=paged_outputs(a), **a)
    groups = [None] if int(a.get("is_causal", 1)) else [[b] for b in range(len(PAST)) if Q_LEN[b]]
    return paged, [(group_query_attention(gx, **ga), layout)
                   for gx, ga, layout in (gqa_from_paged(x, a, grp) for grp in groups)]


def rel(got: torch.Tensor, ref: torch.Tensor) -> float:
    got, ref = got.double(), ref.double()
    assert ref.isfinite().all() and got.isfinite().all(), "a poisoned (NaN) row was read"
    return float((got - ref).abs().max() / ref.abs().max().clamp_min(1e-30))


def as_paged(x, a, runs):
    """The GQA results of `runs` in the paged layout: output, key/value caches, output_qk."""
    out = None
    caches = {"key_cache": x["key_cache"], "value_cache": x["value_cache"]}
    qk = 0
    cap = x["block_table"].shape[1] * BLOCK
    for gqa, layout in runs:
        out = gqa_output_as_paged(gqa["output"], layout, out)
        for src, pres in (("key_cache", "present_key"), ("value_cache", "present_value")):
            caches[src] = gqa_present_as_paged(gqa[pres], caches[src], x["block_table"], layout)
        if a.get("qk_output"):
            qk = qk + gqa_qk_as_paged(gqa["output_qk"].float(), layout, cap)
    return out, caches, qk


def assert_parity(x, a):
    paged, runs = run_both(x, a)
    out, caches, qk = as_paged(x, a, runs)
    errs = {"output": rel(out, paged["output"])}
    for src, name in (("key_cache", "key_cache_out"), ("value_cache", "value_cache_out")):
        want = caches[src]
        if want.dtype in (torch.float16, torch.float32):
            same = torch.equal(want.nan_to_num(7.0), paged[name].nan_to_num(7.0))
        else:  # codes (and poisoned rows) must agree bit for bit
            same = torch.equal(want.view(torch.uint8), paged[name].view(torch.uint8))
        assert same, f"{name}: the paged cache differs from the GQA present written back through block_table"
    if a.get("qk_output"):
        errs["output_qk"] = rel(qk, paged["output_qk"].float())
    assert out.abs().max() > 0
    for k, e in errs.items():
        assert e <= TOL, f"{k}: max|diff| / max|ref| = {e:.3g} > {TOL}"
    return errs


# §17.1 matrix --------------------------------------------------------------------------------

@pytest.mark.parametrize("sink", [False, True])
@pytest.mark.parametrize("window", [-1, 3])
@pytest.mark.parametrize("softcap", [0.0, 2.0])
def test_sink_window_softcap(sink, window, softcap):
    x, a = make_paged(head_sink=sink, local_window_size=window, softcap=softcap, rotary="half",
                      seed=int(sink) + 2 * (window > 0) + 4 * (softcap > 0))
    assert_parity(x, a)


@pytest.mark.parametrize("qk_norm", [False, True])
@pytest.mark.parametrize("rotary", [None, "half", "interleaved"])
def test_qk_norm_rope(qk_norm, rotary):
    x, a = make_paged(qk_norm=qk_norm, rotary=rotary, qk_norm_epsilon=1e-5, seed=10 + int(qk_norm))
    assert_parity(x, a)


@pytest.mark.parametrize("packed", [False, True])
def test_packed_vs_unpacked(packed):
    x, a = make_paged(packed=packed, rotary="interleaved", head_sink=True, seed=20)
    assert_parity(x, a)


@pytest.mark.parametrize("cache,k_quant,v_quant", [
    ("int8", "PER_TENSOR", "PER_TENSOR"), ("int8", "PER_CHANNEL", "PER_CHANNEL"),
    ("fp8", "PER_TENSOR", "PER_TENSOR"), ("fp8", "PER_CHANNEL", "PER_CHANNEL"),
    ("int4", "PER_TENSOR", "PER_TENSOR"), ("int4", "PER_CHANNEL", "PER_CHANNEL"),
    ("int8", "PER_TENSOR", "PER_CHANNEL"), ("fp8", "PER_CHANNEL", "PER_TENSOR"),
])
def test_quantized_cache(cache, k_quant, v_quant):
    x, a = make_paged(cache=cache, k_quant=k_quant, v_quant=v_quant, rotary="half", seed=30)
    assert_parity(x, a)


@pytest.mark.parametrize("bias", [(1, 1), (4, 1), (1, 4), (4, 4)])
def test_attention_bias(bias):
    x, a = make_paged(bias=bias, rotary="half", local_window_size=4, seed=40)
    assert_parity(x, a)


@pytest.mark.parametrize("mode", [1, 2])
def test_output_qk(mode):
    x, a = make_paged(qk_output=mode, head_sink=True, rotary="half", bias=(1, 4), seed=50 + mode)
    assert_parity(x, a)


def test_bidirectional_and_custom_scale_and_mqa():
    x, a = make_paged(is_causal=0, scale=0.2, num_heads=6, kv_num_heads=1, qk_output=2, seed=60)
    assert_parity(x, a)


def test_everything_together():
    x, a = make_paged(cache="int8", k_quant="PER_CHANNEL", v_quant="PER_TENSOR", packed=True, rotary="half",
                      qk_norm=True, head_sink=True, bias=(4, 4), local_window_size=5, qk_output=1, seed=70)
    assert_parity(x, a)


def test_bias_with_softcap_differs():
    """onnxruntime's GQA (CPU): softcap * tanh(s / softcap) + bias; PagedAttention (contract): bias
    before softcap. Same inputs, measurably different results: a deliberate, documented divergence."""
    x, a = make_paged(bias=(1, 4), softcap=1.0, seed=80)
    paged, runs = run_both(x, a)
    assert rel(as_paged(x, a, runs)[0], paged["output"]) > 50 * TOL
    x.pop("attention_bias")
    assert_parity(x, a)  # the same call without the bias agrees
