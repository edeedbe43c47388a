"""Hadamard qk_rotation / v_rotation in the PagedAttention reference (contract-decisions §7).

- The rotation is orthonormal, so unquantized attention is unchanged: with values the fp16 cache holds
  exactly before and after rotation, fp32 outputs and scores agree within 1e-5.
- With quantized caches it matches the float64 oracle (rotation, then quantize; output rotated back).
- On K with outlier channels, PER_TOKEN int4 / int8 caches keep a higher SNR with rotation than without.
"""

import math

import pytest
import torch

from paged_oracle import Spec, build, clone_inputs, oracle, rel_err, walsh_hadamard
from pagedkit.kernels import paged_attention

H, HKV, BS = 4, 2, 16


def _two_steps(inputs_per_step, cache_state, attrs, **kw):
    outs = []
    for x in inputs_per_step:
        outs.append(paged_attention(dict(x, **cache_state), **attrs, **kw))
    return outs


def _dyadic(g, *shape):
    """Multiples of 1/8 in [-2, 2]: exact in fp16, and so are their 16-point Hadamard rotations."""
    return (torch.randint(-16, 17, shape, generator=g).double() / 8).half()


@pytest.mark.parametrize("extra", [{}, {"softcap": 3.0, "local_window_size": 7}, {"is_causal": 0}])
def test_rotation_leaves_fp32_attention_unchanged(extra):
    d = 16
    g = torch.Generator().manual_seed(0)
    steps = []
    for q_lens, past in (([6, 9], [0, 0]), ([1, 2], [6, 9])):
        n = sum(q_lens)
        steps.append(dict(query=_dyadic(g, n, H * d), key=_dyadic(g, n, HKV * d), value=_dyadic(g, n, HKV * d),
                          cumulative_sequence_length=torch.tensor([0, q_lens[0], n], dtype=torch.int32),
                          past_seqlens=torch.tensor(past, dtype=torch.int32),
                          block_table=torch.tensor([[3, 0], [1, 2]], dtype=torch.int32),
                          head_sink=_dyadic(g, H)))
    cache = {"key_cache": torch.randn(4, BS, HKV, d, generator=g).half(),
             "value_cache": torch.randn(4, BS, HKV, d, generator=g).half()}
    base = dict(num_heads=H, kv_num_heads=HKV, qk_output=1, **extra)
    kw = dict(output_dtype=torch.float32)
    plain = _two_steps(steps, clone_inputs(cache), base, **kw)
    rotated = _two_steps(steps, clone_inputs(cache), dict(base, qk_rotation=1, v_rotation=1), **kw)
    probs_plain = _two_steps(steps, clone_inputs(cache), dict(base, qk_output=2), **kw)
    probs_rot = _two_steps(steps, clone_inputs(cache), dict(base, qk_output=2, qk_rotation=1, v_rotation=1), **kw)
    for step in range(2):
        assert rel_err(rotated[step]["output"], plain[step]["output"]) <= 1e-5
        assert rel_err(rotated[step]["output_qk"], plain[step]["output_qk"]) <= 1e-5
        assert rel_err(probs_rot[step]["output_qk"], probs_plain[step]["output_qk"]) <= 1e-5
    # the cache really holds rotated rows
    assert not torch.equal(rotated[1]["key_cache_out"], plain[1]["key_cache_out"])
    assert not torch.equal(rotated[1]["value_cache_out"], plain[1]["value_cache_out"])
    hm = walsh_hadamard(d)
    k_rows = plain[1]["key_cache_out"][3, :6].double()
    assert torch.equal(rotated[1]["key_cache_out"][3, :6].double(), k_rows @ hm)


@pytest.mark.parametrize("qk,v", [(1, 0), (0, 1), (1, 1)])
@pytest.mark.parametrize("cache,quant", [("same", "NONE"), ("int8", "PER_TENSOR"), ("int4", "PER_TOKEN"),
                                         ("float8e4m3fn", "PER_TOKEN")])
def test_rotation_matches_oracle(qk, v, cache, quant):
    spec = Spec(q_lens=[3, 0, 5, 1], past=[10, 4, 0, 20], num_heads=H, kv_num_heads=HKV, head_size=16,
                cache=cache, k_quant=quant, v_quant=quant, rotary="half", qk_norm=True,
                attrs={"qk_rotation": qk, "v_rotation": v, "qk_output": 1}, seed=1)
    case = build(spec)
    exp = oracle(case)
    res = paged_attention(clone_inputs(case.inputs), **case.attrs)
    assert rel_err(res["output"], exp["output"]) <= 2e-3
    assert rel_err(res["output_qk"], exp["output_qk"]) <= 2e-3


def _snr_db(x: torch.Tensor, ref: torch.Tensor) -> float:
    x, ref = x.double(), ref.double()
    return 10 * math.log10(float((ref ** 2).sum()) / float(((x - ref) ** 2).sum()))


@pytest.mark.parametrize("fmt", ["int4", "int8"])
def test_rotation_raises_per_token_snr_on_outlier_keys(fmt):
    """K with 2 outlier channels per head (x25): without rotation a per-token scale is set by the outlier
    and the other channels lose their bits; rotation spreads the outlier over all channels first."""
    d, n = 64, 48
    g = torch.Generator().manual_seed(2)
    k = torch.randn(n, HKV, d, generator=g, dtype=torch.float64)
    k[:, :, [5, 40]] *= 25
    x = dict(query=torch.randn(n, H * d, generator=g).half(), key=k.reshape(n, HKV * d).half(),
             value=torch.randn(n, HKV * d, generator=g).half(),
             cumulative_sequence_length=torch.tensor([0, n], dtype=torch.int32),
             past_seqlens=torch.tensor([0], dtype=torch.int32),
             block_table=torch.tensor([[2, 0, 1]], dtype=torch.int32))
    base = dict(num_heads=H, kv_num_heads=HKV, qk_output=1)
    ref = paged_attention(dict(x, key_cache=torch.zeros(3, BS, HKV, d).half(),
                               value_cache=torch.zeros(3, BS, HKV, d).half()), **base)
    qattrs = dict(base, k_quant_type="PER_TOKEN", v_quant_type="PER_TOKEN")
    width = d
    store = torch.int8
    if fmt == "int4":
        qattrs.update(k_cache_dtype="int4", v_cache_dtype="int4")
        width, store = d // 2, torch.uint8

    def quantized(rotate: int):
        caches = dict(key_cache=torch.zeros(3, BS, HKV, width, dtype=store),
                      value_cache=torch.zeros(3, BS, HKV, width, dtype=store),
                      k_scale_cache=torch.ones(3, BS, HKV).half(), v_scale_cache=torch.ones(3, BS, HKV).half())
        return paged_attention(dict(x, **caches), **dict(qattrs, qk_rotation=rotate))

    plain, rotated = quantized(0), quantized(1)
    snr = {name: (_snr_db(plain[name], ref[name]), _snr_db(rotated[name], ref[name]))
           for name in ("output_qk", "output")}
    print(f"\n{fmt} PER_TOKEN, K outliers: scores SNR {snr['output_qk'][0]:.1f} dB -> {snr['output_qk'][1]:.1f} dB "
          f"with rotation; output SNR {snr['output'][0]:.1f} dB -> {snr['output'][1]:.1f} dB")
    assert snr["output_qk"][1] > snr["output_qk"][0] + 6, snr
    assert snr["output"][1] > snr["output"][0], snr


def test_rotation_rejects_non_power_of_two_head_size():
    spec = Spec(q_lens=[2], past=[0], num_heads=2, kv_num_heads=2, head_size=24,
                attrs={"qk_rotation": 1}, seed=3)
    case = build(spec)
    with pytest.raises(ValueError, match="head_size"):
        paged_attention(clone_inputs(case.inputs), **case.attrs)
