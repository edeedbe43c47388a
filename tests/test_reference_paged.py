"""PagedAttention reference vs the independent float64 oracle (tests/paged_oracle.py), feature by feature.

Each case: a ragged batch (incl. a zero-token sequence and a prefill with no past) over shuffled blocks,
fp16/bf16 activations, the reference in float32; output 0 within a norm-relative bound, the new tokens'
cache rows and (with qk_output) output_qk checked too.
"""

import dataclasses

import ml_dtypes
import numpy as np
import pytest
import torch

from paged_oracle import Spec, build, clone_inputs, oracle, rel_err
from pagedkit.kernels import paged_attention

Q_LENS, PAST = [3, 0, 5, 1], [10, 4, 0, 20]
TOL = 2e-3  # fp16 output rounding is 2**-11 of the largest element


def base(**kw) -> Spec:
    return Spec(q_lens=list(Q_LENS), past=list(PAST), **kw)


def _decode(stored: torch.Tensor, fmt: str | None, scale, d: int) -> torch.Tensor:
    """The test's own decoding of cache rows [..., Dc] -> float64 [..., D]."""
    if fmt != "int4":
        vals = stored.double()
    else:
        raw = stored.numpy()
        vals = torch.from_numpy(np.stack(((raw & 15).astype(np.int64) - 8, (raw >> 4).astype(np.int64) - 8),
                                         axis=-1).reshape(*raw.shape[:-1], d)).double()
    return vals * scale


def check_case(spec: Spec, tol: float = TOL, **call_kw):
    case = build(spec)
    exp = oracle(case)
    x = clone_inputs(case.inputs)
    res = paged_attention(x, **case.attrs, **call_kw)
    a = case.attrs
    assert res["output"].dtype == spec.dtype
    err = rel_err(res["output"], exp["output"])
    assert err <= tol, f"output rel err {err:.3g} > {tol}"
    if a.get("qk_output"):
        assert res["output_qk"].dtype == torch.float32
        assert res["output_qk"].shape == exp["output_qk"].shape
        err = rel_err(res["output_qk"], exp["output_qk"])
        assert err <= tol, f"output_qk rel err {err:.3g}"
        assert torch.equal(res["output_qk"] == 0, exp["output_qk"] == 0)  # masked / beyond extent exactly 0
    _check_cache_rows(case, x, res, exp)
    return case, res, exp


def _check_cache_rows(case, x, res, exp):
    """The step's tokens sit at their derived slots, encoded as the oracle encodes them: every value within
    one quantization step (fp16: 2**-10, fp8: 2**-3 relative), and all but a rare rounding-boundary few
    exactly equal (float32 vs float64 arithmetic may land on the other side of a rounding boundary)."""
    sp = case.spec
    fmt = None if sp.cache == "same" else sp.cache
    table, bs, d = x["block_table"], sp.block_size, sp.head_size
    csl = x["cumulative_sequence_length"].tolist()
    for side in (["k"] if sp.latent else ["k", "v"]):
        cache = res["key_cache_out" if side == "k" else "value_cache_out"]
        assert cache is x["key_cache" if side == "k" else "value_cache"]  # in place, same object
        quant = sp.k_quant if side == "k" else sp.v_quant
        exact, total = 0, 0
        for b in range(len(sp.past)):
            for t in range(csl[b], csl[b + 1]):
                p = sp.past[b] + t - csl[b]
                blk = int(table[b, p // bs])
                if quant == "PER_TOKEN":
                    stored_s = res[f"{side}_scale_cache_out"][blk, p % bs].double()
                    assert torch.allclose(stored_s, exp[f"{side}_scale_new"][t], rtol=1e-3, atol=0)
                    scale = stored_s[:, None]
                elif quant == "PER_CHANNEL":
                    scale = x[f"{side}_scale"].double().reshape(sp.kv_num_heads, d)
                elif quant == "PER_TENSOR":
                    scale = float(x[f"{side}_scale"])
                else:
                    scale = 1.0
                got = _decode(cache[blk, p % bs], fmt, scale, d)
                want = exp[f"{side}_new"][t]
                step = torch.as_tensor(scale, dtype=torch.float64) * (1.0 if fmt in ("int8", "int4") else 0.0)
                slack = torch.maximum(step, want.abs() * (2 ** -3 if fmt == "float8e4m3fn" else 2 ** -10))
                assert bool(((got - want).abs() <= slack + 1e-12).all()), f"{side} cache row of token {t}"
                exact += int(((got - want).abs() <= 1e-6 * want.abs() + 1e-12).sum())
                total += got.numel()
        assert total - exact <= max(2, total // 200), f"{side}: {total - exact} of {total} cached values differ"


# ---------------------------------------------------------------------------------------------
# features, one at a time
# ---------------------------------------------------------------------------------------------


def test_unpacked_gqa_ragged():
    check_case(base())


def test_packed_qkv():
    check_case(base(packed=True))


def test_mha_and_mqa_head_ratios():
    check_case(base(num_heads=2, kv_num_heads=2, seed=1))
    check_case(base(num_heads=4, kv_num_heads=1, seed=2))


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_rope(style):
    check_case(base(rotary=style, seed=3))


@pytest.mark.parametrize("style", ["half", "interleaved"])
def test_partial_rope_with_offset(style):
    check_case(base(head_size=32, rotary=style, rotary_offset=16, rotary_dim=8, seed=4))


def test_query_positions_drive_rope_and_masks():
    # seq 0 ahead of its derived positions, seq 2 behind (its later tokens hide from earlier ones);
    # slots and extents stay derived
    qpos = [12, 13, 15] + [0, 0, 1, 2, 4] + [25]
    check_case(base(rotary="half", query_positions=qpos, seed=5))
    check_case(base(query_positions=qpos, attrs={"local_window_size": 3}, seed=6))


def test_qk_norm_before_rope():
    check_case(base(qk_norm=True, rotary="half", seed=7))
    check_case(base(qk_norm=True, attrs={"qk_norm_epsilon": 1e-2}, seed=8))


def test_explicit_scale_and_softcap():
    check_case(base(attrs={"scale": 0.7}, seed=9))
    check_case(base(attrs={"softcap": 2.0, "scale": 0.9}, seed=10))


@pytest.mark.parametrize("window", [1, 4, 12, 1000])
def test_local_window(window):
    check_case(base(attrs={"local_window_size": window}, seed=11))


@pytest.mark.parametrize("window", [-1, 3])
def test_non_causal(window):
    check_case(base(attrs={"is_causal": 0, "local_window_size": window}, seed=12))


def test_head_sink():
    check_case(base(sink=True, seed=13))
    check_case(base(sink=True, attrs={"local_window_size": 4, "softcap": 3.0}, seed=14))


@pytest.mark.parametrize("per_b,per_h", [(False, False), (True, False), (False, True), (True, True)])
def test_attention_bias_broadcast(per_b, per_h):
    check_case(base(bias=(per_b, per_h), attrs={"softcap": 4.0}, seed=15))


@pytest.mark.parametrize("mode", [1, 2])
def test_output_qk(mode):
    check_case(base(attrs={"qk_output": mode}, bias=(True, True), sink=True, seed=16))
    check_case(base(attrs={"qk_output": mode, "local_window_size": 5, "softcap": 2.0}, seed=17))


def test_unmapped_blocks_masked():
    spec = base(extra_cols=2, unmapped=((3, 0),), seed=18)  # seq 3's positions 0..15 unmapped
    case, res, exp = check_case(spec)
    spec2 = dataclasses.replace(spec, attrs={"qk_output": 2})
    _, res2, _ = check_case(spec2)
    t = 8  # the token of seq 3
    assert float(res2["output_qk"][:, t, :16].abs().max()) == 0.0


def test_bf16():
    check_case(base(dtype=torch.bfloat16, rotary="half", qk_norm=True, seed=19), tol=1.2e-2)


# ---------------------------------------------------------------------------------------------
# quantized caches
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("fmt", ["int8", "float8e4m3fn", "int4"])
@pytest.mark.parametrize("kq,vq", [("PER_TENSOR", "PER_CHANNEL"), ("PER_CHANNEL", "PER_TENSOR")])
def test_static_quantized_caches(fmt, kq, vq):
    check_case(base(cache=fmt, k_quant=kq, v_quant=vq, rotary="half", seed=20))


@pytest.mark.parametrize("fmt", ["int8", "float8e4m3fn", "int4"])
@pytest.mark.parametrize("sdt", [torch.float16, torch.float32])
def test_per_token(fmt, sdt):
    check_case(base(cache=fmt, k_quant="PER_TOKEN", v_quant="PER_TOKEN", scale_cache_dtype=sdt,
                    qk_norm=True, rotary="interleaved", seed=21))


def test_per_token_k_with_static_v():
    case, res, _ = check_case(base(cache="int8", k_quant="PER_TOKEN", v_quant="PER_CHANNEL", seed=22))
    assert "k_scale_cache_out" in res and "v_scale_cache_out" not in res


# ---------------------------------------------------------------------------------------------
# LATENT (MLA) against the oracle (the absorbed/non-absorbed chain is in test_mla.py)
# ---------------------------------------------------------------------------------------------


def test_latent_v_is_leading_channels_of_k():
    spec = base(num_heads=4, kv_num_heads=1, head_size=40, latent=True, v_head_size=32, rotary="half",
                rotary_offset=32, rotary_dim=8, attrs={"scale": 0.11}, seed=23)
    case, res, _ = check_case(spec)
    assert res["output"].shape == (9, 4 * 32) and "value_cache_out" not in res


def test_latent_fp8_per_channel():
    spec = base(num_heads=4, kv_num_heads=1, head_size=40, latent=True, v_head_size=32, cache="float8e4m3fn",
                k_quant="PER_CHANNEL", attrs={"scale": 0.11}, seed=24)
    check_case(spec)


# ---------------------------------------------------------------------------------------------
# API behaviour
# ---------------------------------------------------------------------------------------------


def test_numpy_inputs_are_not_mutated():
    case = build(base(cache="float8e4m3fn", k_quant="PER_TENSOR", v_quant="PER_TENSOR", seed=25))
    as_np = {}
    for name, t in case.inputs.items():
        if t.dtype == torch.float8_e4m3fn:
            as_np[name] = t.view(torch.uint8).numpy().view(ml_dtypes.float8_e4m3fn).copy()
        else:
            as_np[name] = t.numpy().copy()
    before = {k: v.copy() for k, v in as_np.items()}
    res_np = paged_attention(as_np, **case.attrs)
    for k in as_np:
        assert np.array_equal(as_np[k].view(np.uint8), before[k].view(np.uint8)), k
    res_t = paged_attention(clone_inputs(case.inputs), **case.attrs)
    assert torch.equal(res_np["output"], res_t["output"])
    assert torch.equal(res_np["key_cache_out"].view(torch.uint8), res_t["key_cache_out"].view(torch.uint8))


def test_bf16_numpy_inputs():
    case = build(base(dtype=torch.bfloat16, seed=26))
    as_np = {k: (v.view(torch.int16).numpy().view(ml_dtypes.bfloat16) if v.dtype == torch.bfloat16 else v.numpy())
             for k, v in case.inputs.items()}
    res_np = paged_attention(as_np, **case.attrs)
    res_t = paged_attention(clone_inputs(case.inputs), **case.attrs)
    assert torch.equal(res_np["output"], res_t["output"])


def test_attention_metadata_never_changes_a_result():
    case = build(base(attrs={"local_window_size": 6}, seed=27))
    ref = paged_attention(clone_inputs(case.inputs), **case.attrs)
    for meta in ([0, 0], [5, 21], [5, 21, 1], [1000, 100000, 0]):
        x = clone_inputs(case.inputs) | {"attention_metadata": torch.tensor(meta, dtype=torch.int32)}
        got = paged_attention(x, **case.attrs)
        assert torch.equal(got["output"], ref["output"])
        assert torch.equal(got["key_cache_out"], ref["key_cache_out"])


def test_float64_compute_and_requested_outputs():
    case = build(base(seed=28, attrs={"qk_output": 1}))
    exp = oracle(case)
    r64 = paged_attention(clone_inputs(case.inputs), compute_dtype=torch.float64, output_dtype=torch.float64,
                          **case.attrs)
    assert r64["output"].dtype == torch.float64
    assert rel_err(r64["output"], exp["output"]) <= 1e-9
    only = paged_attention(clone_inputs(case.inputs), outputs=["output", "key_cache_out", "value_cache_out",
                                                              "output_qk"], **case.attrs)
    assert set(only) == {"output", "key_cache_out", "value_cache_out", "output_qk"}
