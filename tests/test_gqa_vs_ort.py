"""The GroupQueryAttention reference against onnxruntime 1.32.0's CPU GroupQueryAttention kernel.

Every configuration runs as a single-node model on ORT CPU (an independent implementation) and through
`pagedkit.kernels.gqa.reference.group_query_attention` on the same fresh seeded inputs (tests/paged_gqa.py:
NaN in every float cache row and padded q/k/v row the operator must not read, extreme codes in quantized
cache rows it must not read). Compared where the operator
defines a value: output rows [0, Q_b), output_qk rows [0, Q_b) (every column), present rows [0, T_b) (or
[0, L(T_b)) for a windowed cache). fp32: max|diff| <= 1e-5 * max|ref|; fp16 T: 2e-3 * max|ref| (the fp16
output rounding alone is up to 4.9e-4 of an element, and ORT's fp16 path rounds intermediates too).
Quantized presents must hold exactly ORT's codes on these inputs. ORT codes x * (1 / scale), the
reference clamp(rint(x / scale)) (quant.py, the contract's formula): they can differ by one step only
where the two land on different sides of a rounding tie, which test_quantization_ties_and_saturation_vs_ort
provokes and pins down; random inputs never hit it here, so no difference is tolerated elsewhere.
Configurations: float32 and float16 T with float, int8 and int4 caches (the matrix below). ORT CPU rejects
QK-norm, fp8 caches and bf16, so nothing here covers them (nor the separate q_norm_epsilon /
k_norm_epsilon): tests/test_gqa_oracle.py checks them against an independent float64 oracle.
tests/test_paged_vs_gqa.py compares this reference with the PagedAttention reference (QK-norm with one
shared epsilon, fp8; no bf16), but the two share pagedkit/kernels/attention_math.py.
"""

from __future__ import annotations

import numpy as np
import onnxruntime as ort
import pytest
import torch

from nodes import Case
from paged_gqa import GqaSpec, make_gqa_inputs
from pagedkit.kernels import quant
from pagedkit.kernels.gqa.reference import group_query_attention
from pagedkit.validators.nodeview import onnx_dtype_of

FP16 = torch.float16


def W(window: int) -> dict:
    return {"local_window_size": window, "sliding_window_cache": 1}


def Q(cache: str, qt: str, **kw) -> dict:
    return {"cache": cache, "k_quant": qt, "v_quant": qt, **kw}


F = dict
CONFIGS: dict[str, dict] = {
    # prompt / decode / chunked; growing vs shared-capacity buffers
    "prompt": F(past=(0,), seq=5),
    "prompt_padded_batch": F(past=(0, 0, 0), seq=4, q=(4, 2, 3)),
    "prompt_without_past_inputs": F(past=(0,), seq=4, has_past=False),
    "decode_ragged": F(past=(3, 6, 9), seq=1),
    "decode_shared_buffer": F(past=(3, 6, 9), seq=1, capacity=12),
    "subsequent_prompt": F(past=(5,), seq=3),
    "subsequent_prompt_shared_buffer": F(past=(5,), seq=3, capacity=10),
    "chunked_query_seqlens": F(past=(0, 3, 5), seq=4, q=(4, 2, 0), capacity=9, query_seqlens=True),
    "chunked_query_seqlens_decode_idle": F(past=(4, 2), seq=1, q=(1, 0), capacity=6, query_seqlens=True),
    "shared_kv_decode": F(past=(5, 8), seq=1, capacity=10, shared_kv=True, rotary="half"),
    "shared_kv_multi_query": F(past=(6,), seq=3, shared_kv=True, attrs={"qk_output": 2}),
    "mqa_decode": F(past=(4, 7), seq=1, num_heads=8, kv_num_heads=1),
    "mha_prompt": F(past=(0,), seq=4, num_heads=4, kv_num_heads=4),
    "packed_prompt": F(past=(0,), seq=4, packed=True),
    "packed_decode_rotary": F(past=(3, 8), seq=1, packed=True, rotary="half"),
    "packed_chunked_interleaved": F(past=(2, 6), seq=3, q=(3, 1), capacity=9, query_seqlens=True, packed=True,
                                    rotary="interleaved"),
    # rotary
    "rotary_half_prompt": F(past=(0,), seq=5, rotary="half"),
    "rotary_interleaved_decode": F(past=(4, 9), seq=1, rotary="interleaved"),
    "rotary_partial_half": F(past=(6,), seq=2, head_size=32, rotary="half", rotary_dim=16),
    "rotary_partial_interleaved": F(past=(6,), seq=2, head_size=32, rotary="interleaved", rotary_dim=16),
    "rotary_chunked": F(past=(0, 5), seq=3, q=(3, 2), capacity=8, query_seqlens=True, rotary="half"),
    # position_ids
    "position_ids_decode": F(past=(3, 7), seq=1, rotary="half", position_ids=True),
    "position_ids_subsequent_prompt": F(past=(4,), seq=3, rotary="interleaved", position_ids=True),
    "position_ids_first_prompt": F(past=(0, 0), seq=3, q=(3, 2), rotary="half", position_ids=True),
    "position_ids_chunked": F(past=(2, 5), seq=3, q=(3, 1), capacity=8, query_seqlens=True, rotary="half",
                              position_ids=True),
    # local window
    "window_prompt": F(past=(0,), seq=6, attrs={"local_window_size": 3}),
    "window_decode": F(past=(5, 9), seq=1, attrs={"local_window_size": 4}),
    "window_one": F(past=(4,), seq=3, attrs={"local_window_size": 1}),
    "window_covers_context": F(past=(4,), seq=3, attrs={"local_window_size": 50}),
    # softcap, smooth softmax, head sink, scale
    "softcap_prompt": F(past=(0,), seq=5, attrs={"softcap": 2.0}),
    "softcap_window_sink_decode": F(past=(6, 10), seq=1, head_sink=True,
                                    attrs={"softcap": 1.5, "local_window_size": 4}),
    "smooth_softmax_prompt": F(past=(0,), seq=4, attrs={"smooth_softmax": 1}),
    "smooth_softmax_decode": F(past=(3, 5), seq=1, attrs={"smooth_softmax": 1}),
    "head_sink_with_smooth_softmax": F(past=(4,), seq=2, head_sink=True, attrs={"smooth_softmax": 1}),
    "head_sink_smooth_softmax_off": F(past=(2, 8), seq=1, head_sink=True, attrs={"smooth_softmax": 0}),
    "custom_scale": F(past=(5,), seq=2, attrs={"scale": 0.3}),
    # attention_bias (broadcast over batch and/or head)
    "bias_broadcast_all": F(past=(0,), seq=4, bias=(1, 1)),
    "bias_per_batch_head_decode": F(past=(3, 6), seq=1, bias=(2, 4)),
    "bias_per_head_softcap": F(past=(4,), seq=3, bias=(1, 4), attrs={"softcap": 1.0}),
    "bias_per_batch_chunked": F(past=(0, 4), seq=3, q=(3, 2), capacity=7, query_seqlens=True, bias=(2, 1)),
    # output_qk
    "qk_scores_prompt": F(past=(0,), seq=4, attrs={"qk_output": 1}),
    "qk_probs_decode": F(past=(3, 7), seq=1, attrs={"qk_output": 2}),
    "qk_scores_softcap_bias": F(past=(4,), seq=2, bias=(1, 4), attrs={"qk_output": 1, "softcap": 1.0}),
    "qk_probs_window_sink": F(past=(6,), seq=3, head_sink=True, attrs={"qk_output": 2, "local_window_size": 3}),
    "qk_scores_padded_prompt": F(past=(0, 0), seq=4, q=(4, 2), attrs={"qk_output": 1}),
    # causal = 0
    "bidirectional_prompt": F(past=(0,), seq=5, attrs={"causal": 0}),
    "bidirectional_padded_prompt_qk": F(past=(0, 0), seq=4, q=(4, 2), bias=(1, 4), attrs={"causal": 0, "qk_output": 1}),
    "bidirectional_with_past_qk": F(past=(4,), seq=3, attrs={"causal": 0, "qk_output": 2}),
    # sliding_window_cache (capacity C >= W, resident count L(T))
    "window_cache_filling": F(past=(3,), seq=1, capacity=6, attrs=W(4)),
    "window_cache_evicting": F(past=(17,), seq=1, capacity=6, attrs=W(4)),
    "window_cache_multi_token_rotary": F(past=(9,), seq=5, capacity=6, rotary="half", attrs=W(4)),
    "window_cache_step_longer_than_capacity": F(past=(9,), seq=9, capacity=6, attrs=W(4)),
    "window_cache_prompt": F(past=(0,), seq=8, capacity=6, attrs=W(4)),
    "window_cache_position_ids": F(past=(9,), seq=3, capacity=6, rotary="half", position_ids=True, attrs=W(4)),
    "window_cache_idle_entry_rotary": F(past=(9, 4), seq=3, q=(0, 3), capacity=6, query_seqlens=True,
                                        rotary="half", attrs=W(4)),
    "window_cache_capacity_equals_window": F(past=(20,), seq=3, capacity=4, attrs=W(4)),
    "window_cache_chunked_ragged": F(past=(9, 2, 13), seq=4, q=(4, 2, 0), capacity=7, query_seqlens=True,
                                     bias=(3, 1), head_sink=True, attrs={**W(4), "softcap": 2.0}),
    # quantized caches (kv_cache_bit_width 8: int8, 4: packed int4)
    "int8_per_tensor_prompt": Q("int8", "PER_TENSOR", past=(0,), seq=4),
    "int8_per_channel_decode_rotary": Q("int8", "PER_CHANNEL", past=(4, 7), seq=1, rotary="half"),
    "int4_per_tensor_decode": Q("int4", "PER_TENSOR", past=(5, 3), seq=1),
    "int4_per_channel_prompt_interleaved": Q("int4", "PER_CHANNEL", past=(0,), seq=4, rotary="interleaved"),
    "int8_per_channel_chunked": Q("int8", "PER_CHANNEL", past=(0, 4), seq=3, q=(3, 1), capacity=8,
                                  query_seqlens=True),
    "int4_per_tensor_subsequent": Q("int4", "PER_TENSOR", past=(5,), seq=3),
    "int8_per_tensor_saturating": Q("int8", "PER_TENSOR", past=(3,), seq=2, quant_scale=0.01),
    "int8_per_channel_window_cache": Q("int8", "PER_CHANNEL", past=(5, 11), seq=3, q=(3, 2), capacity=6,
                                       query_seqlens=True, attrs=W(4)),
    "int4_per_channel_window_cache": Q("int4", "PER_CHANNEL", past=(9,), seq=2, head_size=32, capacity=6,
                                       attrs=W(4)),
    "int4_per_channel_qk_probs_window_sink": Q("int4", "PER_CHANNEL", past=(3, 6), seq=1, head_sink=True,
                                               attrs={"qk_output": 2, "local_window_size": 3}),
    "int8_packed_rotary_qk_probs": Q("int8", "PER_TENSOR", past=(2, 6), seq=1, packed=True, rotary="half",
                                     attrs={"qk_output": 2}),
    # fp16 T
    "fp16_prompt_rotary": F(past=(0,), seq=4, dtype=FP16, rotary="half"),
    "fp16_decode_features": F(past=(5, 9), seq=1, dtype=FP16, rotary="interleaved", head_sink=True, bias=(2, 1),
                              attrs={"softcap": 3.0, "local_window_size": 5, "qk_output": 1}),
    "fp16_chunked_shared_buffer": F(past=(0, 3), seq=3, q=(3, 2), capacity=8, query_seqlens=True, dtype=FP16),
    "fp16_int4_per_channel_decode": Q("int4", "PER_CHANNEL", past=(3, 6), seq=1, dtype=FP16, rotary="half"),
    "fp16_window_cache": F(past=(8,), seq=2, capacity=5, dtype=FP16, attrs=W(4)),
}

_SESSION_OPTIONS = ort.SessionOptions()
_SESSION_OPTIONS.intra_op_num_threads = 1
_SESSION_OPTIONS.inter_op_num_threads = 1


def output_names(attrs: dict) -> list[str]:
    return ["output", "present_key", "present_value"] + (["output_qk"] if attrs.get("qk_output") else [])


def run_ort(inputs: dict, attrs: dict, outputs: list[str]) -> dict[str, np.ndarray]:
    """One GroupQueryAttention node on onnxruntime's CPU execution provider."""
    cache_t = onnx_dtype_of(inputs["past_key"]) if "past_key" in inputs else onnx_dtype_of(inputs["query"])
    t = onnx_dtype_of(inputs["query"])
    info = {"output": (t, None), "output_qk": (t, None), "present_key": (cache_t, None),
            "present_value": (cache_t, None)}
    model = Case("GroupQueryAttention", attrs, inputs, outputs, info).model()
    sess = ort.InferenceSession(model.SerializeToString(), _SESSION_OPTIONS, providers=["CPUExecutionProvider"])
    return dict(zip(outputs, sess.run(outputs, {n: x.numpy() for n, x in inputs.items()})))


def rel_err(got: np.ndarray, ref: np.ndarray) -> float:
    got, ref = np.asarray(got, np.float64), np.asarray(ref, np.float64)
    return float(np.abs(got - ref).max() / max(np.abs(ref).max(), 1e-30))


def defined_regions(name: str, x: np.ndarray, meta: dict) -> np.ndarray:
    """The values the operator defines, flattened: valid query rows / resident cache rows."""
    parts = []
    for b, (n, rows) in enumerate(zip(meta["q_len"], meta["rows"])):
        if name == "output":
            parts.append(x[b, :n].reshape(-1))
        elif name == "output_qk":
            parts.append(x[b, :, :n].reshape(-1))
        else:
            parts.append(x[b, :, :rows].reshape(-1))
    return np.concatenate(parts)


def compare_with_ort(spec: GqaSpec, seed: int, compute_dtype=torch.float32) -> dict[str, float]:
    inputs, attrs, meta = make_gqa_inputs(spec, seed)
    names = output_names(attrs)
    theirs = run_ort(inputs, attrs, names)
    ours = group_query_attention(inputs, outputs=names, compute_dtype=compute_dtype, **attrs)
    tol = 1e-5 if spec.dtype == torch.float32 else 2e-3
    errs = {}
    for name in names:
        a, b = theirs[name], ours[name]
        assert onnx_dtype_of(b) == onnx_dtype_of(a), name
        assert tuple(b.shape) == a.shape, (name, tuple(b.shape), a.shape)
        a, b = defined_regions(name, a, meta), defined_regions(name, b.float().numpy(), meta)
        assert np.isfinite(b).all(), f"{name}: NaN/inf where the operator defines a value (a poisoned row was read)"
        if name.startswith("present") and spec.cache != "float":
            mismatch = int((a.astype(np.int64) != b.astype(np.int64)).sum())
            assert mismatch == 0, f"{name}: {mismatch} cache codes differ from onnxruntime's"
            errs[name] = 0.0
            continue
        assert np.abs(b).max() > 0, f"{name} is all zeros"
        errs[name] = rel_err(b, a)
        assert errs[name] <= tol, f"{name}: max|diff| / max|ref| = {errs[name]:.3g} > {tol}"
    return errs


@pytest.mark.parametrize("name", list(CONFIGS))
def test_reference_matches_ort_cpu(name):
    compare_with_ort(GqaSpec(**CONFIGS[name]), seed=sum(map(ord, name)))


def test_float64_compute_matches_ort_cpu():
    compare_with_ort(GqaSpec(**CONFIGS["window_cache_chunked_ragged"]), seed=7, compute_dtype=torch.float64)


def _codes(present: np.ndarray, cache: str) -> torch.Tensor:
    """Signed codes [B, Hkv, C, D] of an int8 or packed-int4 present."""
    t = torch.from_numpy(present)
    return quant.unpack_int4(t, 2 * t.shape[-1]).long() if cache == "int4" else t.long()


@pytest.mark.parametrize("cache,qt", [("int8", "PER_TENSOR"), ("int4", "PER_TENSOR"), ("int8", "PER_CHANNEL"),
                                      ("int4", "PER_CHANNEL")])
def test_quantization_ties_and_saturation_vs_ort(cache, qt):
    """New K exactly half-way between two codes, and beyond the code range (clamp).

    ORT's CPU kernel codes x * (1 / scale) (float32 reciprocal, then rint with ties to even); the
    reference uses pagedkit.kernels.quant, clamp(rint(x / scale)) (the contract's formula). The two
    differ only where x / scale and x * (1 / scale) fall on different sides of a tie: there the code
    differs by exactly one step. Elsewhere (all the random configurations above) they are identical."""
    spec = GqaSpec(**Q(cache, qt, past=(0,), seq=4, num_heads=2, kv_num_heads=1))
    inputs, attrs, _ = make_gqa_inputs(spec, seed=3)
    g = torch.Generator().manual_seed(11)
    scale = inputs["k_scale"].reshape(-1)  # [1] or [Hkv * D]
    lim = 140 if cache == "int8" else 10
    x = (torch.randint(-lim, lim, inputs["key"].shape, generator=g).float() + 0.5) * scale  # [1, S, Hkv*D]
    inputs["key"] = x
    theirs = _codes(run_ort(inputs, attrs, output_names(attrs))["present_key"], cache)
    ours = _codes(group_query_attention(inputs, **attrs)["present_key"].numpy(), cache)
    lo, hi = quant.QMIN[cache], quant.QMAX[cache]
    by_division = torch.clamp(torch.round(x / scale), lo, hi).long()
    by_reciprocal = torch.clamp(torch.round(x * (1.0 / scale)), lo, hi).long()

    def bnsd(codes):  # [1, S, Hkv*D] -> [1, Hkv, S, D]
        return codes.reshape(1, 4, 1, -1).transpose(1, 2)

    assert torch.equal(theirs, bnsd(by_reciprocal))  # ORT's formula, exactly
    assert torch.equal(ours, bnsd(by_division))  # the contract's formula, exactly
    assert (ours - theirs).abs().max() <= 1  # at most one step apart ...
    assert (ours != theirs).any()  # ... and these inputs do reach the difference
    assert (by_division.abs() == hi).any() or (by_division == lo).any()  # saturation was exercised


def test_shared_buffer_keeps_rows_it_does_not_write():
    """A shared-capacity past/present buffer: rows at or beyond T_b stay exactly as they were (here NaN
    poison), rows [P_b, T_b) receive the new tokens. ORT leaves those rows unspecified in a separate
    present, so this is checked on the reference alone."""
    spec = GqaSpec(**CONFIGS["chunked_query_seqlens"])
    inputs, attrs, meta = make_gqa_inputs(spec, seed=5)
    ours = group_query_attention(inputs, **attrs)
    for name, past in (("present_key", inputs["past_key"]), ("present_value", inputs["past_value"])):
        present = ours[name]
        assert present.shape == past.shape
        for b, t in enumerate(meta["t_len"]):
            p = t - meta["q_len"][b]
            assert torch.equal(present[b, :, :p], past[b, :, :p])
            assert present[b, :, t:].isnan().all()
            assert present[b, :, p:t].isfinite().all()


def test_numpy_and_torch_inputs_agree():
    spec = GqaSpec(**CONFIGS["int4_per_tensor_decode"])
    inputs, attrs, _ = make_gqa_inputs(spec, seed=9)
    a = group_query_attention(inputs, **attrs)
    b = group_query_attention({n: x.numpy() for n, x in inputs.items()}, **attrs)
    for name in a:
        assert torch.equal(a[name].nan_to_num(0), b[name].nan_to_num(0)), name
