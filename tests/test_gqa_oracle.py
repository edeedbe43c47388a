"""GroupQueryAttention checked against implementations that share no code with pagedkit's references.

The GQA reference (pagedkit/kernels/gqa/reference.py) and the PagedAttention reference both use
pagedkit/kernels/attention_math.py, and GQA has no second pagedkit variant: a GQA case run through
InferenceSession, or the paged reference compared with the GQA one, checks the reference against itself.
Here the checks are:

- every case file (tests/cases) labelled "onnxruntime CPU" is re-run on onnxruntime 1.32.0's CPU kernel
  and compared with its expected outputs (the case's own tolerance and code steps);
- every GQA case file is compared with `paged_oracle.gqa_oracle`, a float64 loop oracle written from the
  operator's description (tests/paged_oracle.py, no pagedkit import): this is the only independent check
  of the cases ORT's CPU kernel rejects (QK-norm with separate q/k epsilons, fp8 caches, bf16);
- on fresh random inputs (seeds no other test uses), the GQA reference against the oracle for every
  configuration of tests/test_gqa_vs_ort.py plus QK-norm (separate and shared epsilons), fp8 caches and
  bf16; where ORT's CPU kernel runs the configuration, ORT against the oracle too;
- teeth: the reference called with a 2% wrong scale, without the softcap, a window one longer, without
  the head sink, the other rotary layout, swapped QK-norm epsilons, or a bf16 scale 5% off, fails the
  comparison; so does ORT with a 2% wrong scale against a case file.

Bounds are norm-relative, max|diff| <= tol * max|ref| over the entries the operator defines: float32
1e-5; float16 2e-3 (four units of the output's rounding, 2^-11) and bfloat16 8e-3 (two units, 2^-8), both
several times what the reference shows (4.5e-4, 2.5e-3) so that a scale a few percent off still fails;
the case files keep their own tolerance (index.json: 1e-5 / 5e-3 / 2e-2);
cache values as the cache holds them (float: the same tolerance; quantized: within one code, and at most
1% of the codes one step apart, where float32 vs float64 arithmetic lands on the other side of a tie).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from cases import compare_case, load_cases, load_index
from paged_gqa import GqaSpec, make_gqa_inputs
from paged_oracle import gqa_oracle
from pagedkit.kernels.gqa.reference import group_query_attention
from test_gqa_vs_ort import CONFIGS as ORT_CONFIGS
from test_gqa_vs_ort import W, output_names, run_ort

TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 8e-3}
GQA_CASES = [e for e in load_index() if e["op"] == "GroupQueryAttention"]
ORT_CASES = [e["name"] for e in GQA_CASES if e["expected_from"].startswith("onnxruntime CPU")]

F = dict
EXTRA: dict[str, dict] = {  # configurations onnxruntime's CPU kernel rejects (QK-norm, fp8, bf16)
    "qk_norm_separate_eps": F(past=(3, 6), seq=2, q=(2, 1), capacity=8, query_seqlens=True, qk_norm=True,
                              rotary="half", attrs={"q_norm_epsilon": 1e-3, "k_norm_epsilon": 1e-1}),
    "qk_norm_q_eps_only": F(past=(5,), seq=3, qk_norm=True, rotary="interleaved",
                            attrs={"q_norm_epsilon": 5e-2, "qk_norm_epsilon": 1e-4}),
    "qk_norm_shared_eps_prompt": F(past=(0, 0), seq=4, q=(4, 2), qk_norm=True, attrs={"qk_norm_epsilon": 1e-2}),
    "qk_norm_int4_window_cache": F(past=(9,), seq=2, capacity=6, qk_norm=True, rotary="half", cache="int4",
                                   k_quant="PER_CHANNEL", v_quant="PER_TENSOR",
                                   attrs={**W(4), "k_norm_epsilon": 1e-2}),
    "qk_norm_int8_chunked_sink": F(past=(2, 6), seq=3, q=(3, 1), capacity=9, query_seqlens=True, qk_norm=True,
                                   head_sink=True, cache="int8", k_quant="PER_TENSOR", v_quant="PER_CHANNEL",
                                   attrs={"qk_norm_epsilon": 1e-3}),
    "fp8_per_tensor_prompt": F(past=(0,), seq=4, cache="fp8", k_quant="PER_TENSOR", v_quant="PER_TENSOR"),
    "fp8_per_channel_decode_rotary": F(past=(5, 9), seq=1, cache="fp8", k_quant="PER_CHANNEL",
                                       v_quant="PER_CHANNEL", rotary="interleaved"),
    "fp8_window_cache_softcap": F(past=(11,), seq=3, capacity=6, cache="fp8", k_quant="PER_TENSOR",
                                  v_quant="PER_CHANNEL", attrs={**W(4), "softcap": 2.0}),
    "fp16_qk_norm_separate_eps": F(past=(4, 9), seq=1, dtype=torch.float16, qk_norm=True, rotary="half",
                                   attrs={"q_norm_epsilon": 1e-4, "k_norm_epsilon": 1e-3}),
    "bf16_prompt_padded": F(past=(0, 0, 0), seq=4, q=(4, 2, 3), dtype=torch.bfloat16, rotary="half"),
    "bf16_decode_features": F(past=(5, 9), seq=1, dtype=torch.bfloat16, rotary="interleaved", head_sink=True,
                              bias=(2, 1), attrs={"softcap": 3.0, "local_window_size": 5, "qk_output": 1}),
    "bf16_chunked_qk_probs": F(past=(0, 3), seq=3, q=(3, 2), capacity=8, query_seqlens=True,
                               dtype=torch.bfloat16, attrs={"qk_output": 2}),
    "bf16_window_cache_qk_norm": F(past=(8,), seq=2, capacity=5, dtype=torch.bfloat16, qk_norm=True,
                                   attrs={**W(4), "qk_norm_epsilon": 1e-5}),
    "bf16_custom_scale_smooth": F(past=(4,), seq=2, dtype=torch.bfloat16, attrs={"scale": 0.3, "smooth_softmax": 1}),
}
ORT_RUNS = set(ORT_CONFIGS)
ALL = {**ORT_CONFIGS, **EXTRA}
QUANT_FMT = {"int8": "int8", "int4": "int4", "fp8": "float8e4m3fn"}


def _seed(name: str) -> int:
    return 50_000 + sum((i + 3) * ord(c) for i, c in enumerate(name)) % 10_000


def _values(present: torch.Tensor, fmt: str | None, scale) -> np.ndarray:
    """The test's own decoding of a present [B, Hkv, C, Dc] to float64 values [B, Hkv, C, D]."""
    if fmt == "int4":
        raw = present.numpy().astype(np.int64)
        codes = np.stack((raw & 15, raw >> 4), axis=-1).reshape(*raw.shape[:-1], 2 * raw.shape[-1]) - 8
        return codes * scale
    return present.to(torch.float64).numpy() * scale


def _scale(inputs: dict, name: str, qt: str, hkv: int, d: int):
    if qt == "NONE":
        return 1.0
    s = inputs[name].to(torch.float64).numpy()
    return float(s.reshape(-1)[0]) if qt == "PER_TENSOR" else s.reshape(1, hkv, 1, d)


def compare_with_oracle(got: dict, inputs: dict, attrs: dict, tol: float, exp: dict | None = None) -> dict:
    """Norm-relative errors of `got` (a kernel's outputs, torch) against the oracle; raises on a bound."""
    exp = gqa_oracle(inputs, attrs) if exp is None else exp
    h, hkv = attrs["num_heads"], attrs["kv_num_heads"]
    errs = {}
    for name, want in exp.items():
        assert name in got, name
        defined = ~np.isnan(want)
        have = got[name]
        if name.startswith("present"):
            side = "k" if name == "present_key" else "v"
            qt = attrs.get(f"{side}_quant_type", "NONE")
            d = want.shape[-1]
            fmt = None if qt == "NONE" else {torch.int8: "int8", torch.uint8: "int4",
                                             torch.float8_e4m3fn: "float8e4m3fn"}[have.dtype]
            scale = _scale(inputs, f"{side}_scale", qt, hkv, d)
            vals = _values(have.cpu(), fmt, scale)
            assert vals.shape == want.shape, (name, vals.shape, want.shape)
            w, v = want[defined], vals[np.broadcast_to(defined, vals.shape)]
            assert np.isfinite(v).all(), f"{name}: non-finite where the operator defines a value"
            if fmt is None:
                errs[name] = float(np.abs(v - w).max() / max(np.abs(w).max(), 1e-30)) if w.size else 0.0
                assert errs[name] <= tol, f"{name}: max|diff| / max|ref| = {errs[name]:.3g} > {tol}"
                continue
            step = np.broadcast_to(np.asarray(scale, np.float64), want.shape)[defined]
            if fmt == "float8e4m3fn":  # one E4M3 step: 2^-3 of the value (2^-9 x scale in the subnormals)
                step = np.maximum(np.abs(w) * 2.0 ** -3, step * 2.0 ** -9)
            off = np.abs(v - w) > 1e-9 * step
            errs[name] = float((np.abs(v - w) / step).max()) if w.size else 0.0
            assert errs[name] <= 1.0 + 1e-9, f"{name}: values differ by {errs[name]:.3g} steps"
            assert off.mean() <= 0.01, f"{name}: {off.sum()} of {off.size} codes differ by one step"
            continue
        have = have.to(torch.float64).cpu().numpy()
        assert have.shape == want.shape, (name, have.shape, want.shape)
        w, v = want[defined], have[defined]
        assert np.isfinite(v).all(), f"{name}: non-finite where the operator defines a value"
        errs[name] = float(np.abs(v - w).max() / max(np.abs(w).max(), 1e-30))
        assert errs[name] <= tol, f"{name}: max|diff| / max|ref| = {errs[name]:.3g} > {tol}"
    return errs


# ---- the case files ------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", ORT_CASES)
def test_ort_labelled_case_vs_ort_cpu(name):
    """The expected outputs of a case labelled "onnxruntime CPU" are what onnxruntime's CPU kernel computes."""
    (case,) = load_cases([name])
    outs = list(case.expected)
    got = run_ort(case.inputs, case.attrs, outs)
    compare_case(case, {n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in got.items()})


def test_ort_case_check_has_teeth():
    """onnxruntime with a 2% wrong scale does not reproduce a case file."""
    (case,) = load_cases(["gqa_custom_scale"])
    attrs = {**case.attrs, "scale": case.attrs["scale"] * 1.02}
    got = run_ort(case.inputs, attrs, list(case.expected))
    with pytest.raises(AssertionError, match="output max") as exc:
        compare_case(case, {n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in got.items()})
    print(f"ORT, scale x1.02 vs {case.name}: {exc.value}")


@pytest.mark.parametrize("name", [e["name"] for e in GQA_CASES])
def test_case_vs_oracle(name):
    """Every GQA case file against the oracle; the entries the oracle defines are the case's defined ones."""
    (case,) = load_cases([name])
    exp = gqa_oracle(case.inputs, case.attrs)
    assert set(exp) == set(case.expected)
    for out, want in case.expected.items():
        mask = case.expected.defined.get(out)
        if mask is not None:
            mask = mask.numpy()  # per element (int4: per packed byte): compare row by row
            assert np.array_equal(mask.all(-1), mask.any(-1)), out
            assert np.array_equal(~np.isnan(exp[out]).all(-1), mask.all(-1)), out
    tol = {torch.float32: 1e-5, torch.float16: 5e-3, torch.bfloat16: 2e-2}[case.inputs["query"].dtype]
    assert tol == load_index()[[e["name"] for e in load_index()].index(name)]["tolerance"]["float"]
    errs = compare_with_oracle(dict(case.expected), case.inputs, case.attrs, tol, exp)
    print(f"{name}: {errs}")


# ---- fresh inputs: the reference (and ORT where it runs) against the oracle ------------------------

@pytest.mark.parametrize("name", list(ALL))
def test_reference_vs_oracle(name):
    spec = GqaSpec(**ALL[name])
    inputs, attrs, _ = make_gqa_inputs(spec, _seed(name))
    exp = gqa_oracle(inputs, attrs)
    tol = TOL[spec.dtype]
    got = group_query_attention({k: v.clone() for k, v in inputs.items()}, **attrs)
    errs = compare_with_oracle(got, inputs, attrs, tol, exp)
    line = f"{name}: reference {errs}"
    if name in ORT_RUNS:  # the oracle against onnxruntime too
        ort = run_ort(inputs, attrs, output_names(attrs))
        errs = compare_with_oracle({n: torch.from_numpy(np.ascontiguousarray(a)) for n, a in ort.items()}, inputs,
                                   attrs, tol, exp)
        line += f"; onnxruntime {errs}"
    print(f"{line} (bound {tol})")


# ---- teeth ---------------------------------------------------------------------------------------------

def _wrong(inputs, attrs, *, drop=(), **changes):
    x = {k: v.clone() for k, v in inputs.items() if k not in drop}
    a = {k: v for k, v in {**attrs, **changes}.items() if v is not None}  # None: the attribute removed
    return group_query_attention(x, **a)


TEETH = {
    # name: (configuration, how the reference is called wrongly)
    "scale+2%": ("custom_scale", lambda x, a: _wrong(x, a, scale=0.3 * 1.02)),
    "default-scale+2%": ("decode_ragged", lambda x, a: _wrong(x, a, scale=1.02 / 4.0)),
    "softcap-removed": ("softcap_prompt", lambda x, a: _wrong(x, a, softcap=0.0)),
    "window+1": ("window_decode", lambda x, a: _wrong(x, a, local_window_size=5)),
    "sink-removed": ("head_sink_smooth_softmax_off", lambda x, a: _wrong(x, a, drop=("head_sink",))),
    "rotary-layout": ("rotary_half_prompt", lambda x, a: _wrong(x, a, rotary_interleaved=1)),
    "qk-norm-eps-swapped": ("qk_norm_separate_eps", lambda x, a: _wrong(x, a, q_norm_epsilon=1e-1,
                                                                         k_norm_epsilon=1e-3)),
    "qk-norm-eps-ignored": ("qk_norm_separate_eps", lambda x, a: _wrong(x, a, q_norm_epsilon=None,
                                                                         k_norm_epsilon=None)),
    "int4-scale+5%": ("int4_per_tensor_decode", lambda x, a: _wrong(
        {**x, "k_scale": x["k_scale"] * 1.05, "v_scale": x["v_scale"] * 1.05}, a)),
    "bf16-scale+5%": ("bf16_custom_scale_smooth", lambda x, a: _wrong(x, a, scale=0.3 * 1.05)),
    "fp8-per-channel-scale-heads-swapped": ("fp8_per_channel_decode_rotary", lambda x, a: _wrong(
        {**x, "k_scale": x["k_scale"].flip(1)}, a)),
}


@pytest.mark.parametrize("teeth", list(TEETH))
def test_oracle_comparison_has_teeth(teeth):
    config, call = TEETH[teeth]
    spec = GqaSpec(**ALL[config])
    inputs, attrs, _ = make_gqa_inputs(spec, _seed(config))
    exp = gqa_oracle(inputs, attrs)
    tol = TOL[spec.dtype]
    compare_with_oracle(group_query_attention({k: v.clone() for k, v in inputs.items()}, **attrs), inputs, attrs,
                        tol, exp)  # the right call passes ...
    with pytest.raises(AssertionError) as exc:  # ... the wrong one fails
        compare_with_oracle(call(inputs, attrs), inputs, attrs, tol, exp)
    print(f"teeth {teeth} ({config}): {str(exc.value).splitlines()[0]} (bound {tol})")
