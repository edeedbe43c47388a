"""GroupQueryAttention: one negative test per rule id, valid configurations, and onnxruntime's CPU
kernel as an independent oracle (valid configs run there; negatives marked `ort` are rejected there too).

decode config: batch 2, sequence 1, H4 / Hkv2 / D16, past capacity 5, seqlens_k (5, 3), total 6.
"""

from __future__ import annotations

import math
from typing import Callable, NamedTuple

import pytest
import torch

from nodes import (
    attrs, dtype, out_add, out_rm, rm, seq, shape, unset, vals,
    GQA_CONFIGS, GQA_ORT_CPU, add_input, drop, gqa_case, run_ort_cpu, with_dtype, with_shape, with_values,
)
from pagedkit.validators.rules.gqa import RULE_DOCS


class Neg(NamedTuple):
    rule: str
    config: str
    mutate: Callable
    where: str
    expect: str
    modes: str = "rs"
    ort: bool = False  # onnxruntime's CPU kernel rejects this mutation too


def add(name, s, dt=torch.float32):
    return lambda c: add_input(c, name, s, dt)


def rebuild(config, **kw):
    return lambda c: c.__dict__.update(gqa_case(config, **kw).__dict__)


def hook(fn):
    return lambda c: setattr(c, "node_hook", fn)


I, A, O = "input '{}'".format, "attribute '{}'".format, "output '{}'".format
F16, F32 = torch.float16, torch.float32
PAST = (2, 2, 5, 16)

NEGATIVES = [
    Neg("unknown-input", "decode", add("past", (2,)), I("past"), "one of", "r"),
    Neg("unknown-output", "decode", out_add("present"), O("present"), "one of", "r"),
    Neg("too-many-inputs", "decode", hook(lambda n: n.input.extend([""] * (17 - len(n.input)) + ["x"])), "node",
        "at most 17", "s"),
    Neg("too-many-outputs", "decode", hook(lambda n: n.output.extend(["", "y"])), "node", "at most 4", "s"),
    Neg("GQA-attr-unknown", "decode", attrs(is_causal=1), A("is_causal"), "one of", ort=True),
    Neg("GQA-attr-required", "decode", unset("num_heads"), A("num_heads"), "attribute 'num_heads' set", ort=True),
    Neg("GQA-attr-type", "decode", attrs(softcap="x"), A("softcap"), "a float", ort=True),
    Neg("GQA-attr-allowed", "decode", attrs(qk_output=3), A("qk_output"), "[0, 1, 2]", ort=True),
    Neg("GQA-attr-allowed", "decode", attrs(smooth_softmax=2), A("smooth_softmax"), "[-1, 0, 1]"),
    Neg("GQA-attr-allowed", "decode", attrs(k_quant_type="PER_TOKEN"), A("k_quant_type"), "PER_CHANNEL"),
    Neg("GQA-num-heads-positive", "decode", attrs(num_heads=0), A("num_heads"), "num_heads > 0", ort=True),
    Neg("GQA-kv-num-heads-positive", "decode", attrs(kv_num_heads=0), A("kv_num_heads"), "kv_num_heads > 0"),
    Neg("GQA-num-heads-divisible", "decode", attrs(num_heads=3), A("num_heads"), "num_heads % kv_num_heads == 0",
        ort=True),
    Neg("GQA-scale", "decode", attrs(scale=-1.0), A("scale"), ">= 0"),
    Neg("GQA-softcap", "decode", attrs(softcap=float("nan")), A("softcap"), "finite"),
    Neg("GQA-local-window", "decode", attrs(local_window_size=-3), A("local_window_size"), "-1 or > 0"),
    Neg("GQA-norm-epsilon", "decode", attrs(q_norm_epsilon=0.0), A("q_norm_epsilon"), "> 0"),
    Neg("GQA-norm-epsilon", "qk_norm_fp16", attrs(k_norm_epsilon=math.inf), A("k_norm_epsilon"), "finite"),
    Neg("GQA-input-required", "decode", rm("total_sequence_length"), I("total_sequence_length"),
        "input 6 'total_sequence_length' present", ort=True),
    Neg("GQA-output-required", "decode", out_rm("output"), O("output"), "output 0 'output' named", ort=True),
    Neg("GQA-dtype-allowed", "decode", dtype("seqlens_k", torch.int64), I("seqlens_k"), "tensor(int32)", ort=True),
    Neg("GQA-dtype-allowed", "rotary_position_ids", dtype("position_ids", torch.int32), I("position_ids"),
        "tensor(int64)", ort=True),
    Neg("GQA-dtype-same-T", "decode", dtype("key", F16), I("key"), "tensor(float) (as 'query')", ort=True),
    Neg("GQA-dtype-same-T_CACHE", "decode", dtype("past_value", F16), I("past_value"),
        "tensor(float) (as 'past_key')", ort=True),
    Neg("GQA-rank", "decode", shape("query", 2, 64), I("query"), "rank 3", ort=True),
    Neg("GQA-rank", "decode", shape("total_sequence_length", 1, 1), I("total_sequence_length"), "rank 0 or 1"),
    Neg("GQA-head-size-divisible", "decode", shape("query", 2, 1, 66), I("query"), "multiple of num_heads (4)"),
    Neg("GQA-packed-hidden", "packed_decode", shape("query", 2, 1, 132), I("query"),
        "num_heads + 2 * kv_num_heads (8)", ort=True),
    Neg("GQA-head-size-multiple-8", "decode", seq(shape("query", 2, 1, 48), shape("key", 2, 1, 24),
                                                  shape("value", 2, 1, 24), shape("past_key", 2, 2, 5, 12),
                                                  shape("past_value", 2, 2, 5, 12)), I("query"), "head_size 12",
        ort=True),
    Neg("GQA-kv-pair", "decode", rm("value"), I("value"), "both present or both absent", ort=True),
    Neg("GQA-kv-batch", "decode", seq(shape("key", 3, 1, 32), shape("value", 3, 1, 32)), I("key"),
        "2 (batch_size)", ort=True),
    Neg("GQA-kv-seq", "decode", seq(shape("key", 2, 2, 32), shape("value", 2, 2, 32)), I("key"),
        "1 (sequence_length)", ort=True),
    Neg("GQA-kv-hidden", "decode", shape("value", 2, 1, 48), I("value"), "32 (kv_num_heads * head_size)", ort=True),
    Neg("GQA-past-pair", "decode", rm("past_value"), I("past_value"), "both present or both absent", ort=True),
    Neg("GQA-past-batch", "decode", seq(shape("past_key", 3, 2, 5, 16), shape("past_value", 3, 2, 5, 16)),
        I("past_key"), "2 (batch_size)", ort=True),
    Neg("GQA-past-kv-heads", "decode", seq(shape("past_key", 2, 1, 5, 16), shape("past_value", 2, 1, 5, 16)),
        I("past_key"), "2 (kv_num_heads)", ort=True),
    Neg("GQA-past-head-size", "decode", seq(shape("past_key", 2, 2, 5, 8), shape("past_value", 2, 2, 5, 8)),
        I("past_key"), "16 (head_size)", ort=True),
    Neg("GQA-past-head-size", "int4_per_tensor", seq(shape("past_key", *PAST), shape("past_value", *PAST)),
        I("past_key"), "8 ((head_size + 1) / 2 (4-bit))", ort=True),
    Neg("GQA-past-shape-match", "decode", shape("past_value", 2, 2, 6, 16), I("past_value"), "(2, 2, 5, 16)",
        ort=True),
    Neg("GQA-seqlens-k-batch", "decode", vals("seqlens_k", [5, 3, 1]), I("seqlens_k"), "2 (batch_size)", ort=True),
    Neg("GQA-total-seqlen-shape", "decode", vals("total_sequence_length", [6, 6]), I("total_sequence_length"),
        "a scalar or shape (1)", ort=True),
    Neg("GQA-rotary-missing", "rotary_position_ids", seq(rm("cos_cache", "sin_cache", "position_ids")),
        I("cos_cache"), "cos_cache and sin_cache", ort=True),
    Neg("GQA-rotary-pair", "rotary_position_ids", rm("sin_cache"), I("sin_cache"), "both present or both absent"),
    Neg("GQA-rotary-unused", "rotary_position_ids", attrs(do_rotary=0), I("position_ids"), "do_rotary=1"),
    Neg("GQA-rotary-shape-match", "rotary_position_ids", shape("sin_cache", 15, 8), I("sin_cache"), "(14, 8)"),
    Neg("GQA-rotary-dim", "rotary_position_ids", seq(shape("cos_cache", 14, 4), shape("sin_cache", 14, 4)),
        I("cos_cache"), "multiple of 8", ort=True),
    Neg("GQA-rotary-length", "rotary_position_ids", seq(shape("cos_cache", 4, 8), shape("sin_cache", 4, 8),
                                                        rm("position_ids")), I("cos_cache"),
        ">= 6 (total_sequence_length)", "rv", ort=True),
    Neg("GQA-position-ids-shape", "rotary_position_ids", shape("position_ids", 1, 1), I("position_ids"),
        "dimension 0 == 2 (batch_size)", ort=True),
    Neg("GQA-position-ids-shape", "rotary_position_ids", seq(rebuild("rotary_position_ids", seq=3, past=False),
                                                             shape("position_ids", 2, 1)), I("position_ids"),
        "dimension 1 >= 3 (sequence_length)", ort=True),
    Neg("GQA-position-ids-values", "rotary_position_ids", vals("position_ids", [[5], [40]]), I("position_ids"),
        "[0, 14)", "rv", ort=True),
    Neg("GQA-bias-batch", "bias_output_qk", shape("attention_bias", 3, 4, 1, 6), I("attention_bias"),
        "1 or batch_size (2)", ort=True),
    Neg("GQA-bias-heads", "bias_output_qk", shape("attention_bias", 2, 2, 1, 6), I("attention_bias"),
        "1 or num_heads (4)", ort=True),
    Neg("GQA-bias-seq", "bias_output_qk", shape("attention_bias", 2, 4, 2, 6), I("attention_bias"),
        "1 (sequence_length)", ort=True),
    Neg("GQA-bias-total", "bias_output_qk", shape("attention_bias", 1, 1, 1, 8), I("attention_bias"),
        "6 (total_sequence_length)", "rv", ort=True),
    Neg("GQA-head-sink-shape", "head_sink_softcap", shape("head_sink", 5), I("head_sink"), "(4) = (num_heads)",
        ort=True),
    Neg("GQA-qk-norm-pair", "qk_norm_fp16", rm("k_norm_weight"), I("k_norm_weight"), "both present or both absent"),
    Neg("GQA-qk-norm-shape", "qk_norm_fp16", seq(shape("q_norm_weight", 8), shape("k_norm_weight", 8)),
        I("q_norm_weight"), "(16) = (head_size)"),
    Neg("GQA-qk-output-missing", "bias_output_qk", out_rm("output_qk"), O("output_qk"), "output 3", ort=True),
    Neg("GQA-qk-output-unrequested", "decode", out_add("output_qk"), O("output_qk"), "qk_output 1 or 2"),
    Neg("GQA-scale-missing", "int8_per_tensor", rm("k_scale"), I("k_scale"), "input 'k_scale' present", ort=True),
    Neg("GQA-scale-unexpected", "decode", add("v_scale", (1,)), I("v_scale"), "absent"),
    Neg("GQA-scale-shape", "int8_per_channel", shape("k_scale", 2, 1, 15), I("k_scale"), "32 elements", ort=True),
    Neg("GQA-scale-shape", "int8_per_tensor", shape("v_scale", 2), I("v_scale"), "1 elements for PER_TENSOR"),
    Neg("GQA-bit-width-missing", "int8_per_tensor", unset("kv_cache_bit_width"), A("kv_cache_bit_width"), "4 or 8",
        ort=True),
    Neg("GQA-bit-width-unexpected", "decode", attrs(kv_cache_bit_width=8), A("kv_cache_bit_width"), "0 / unset",
        ort=True),
    Neg("GQA-bit-width-dtype", "int8_per_tensor", attrs(kv_cache_bit_width=4), A("kv_cache_bit_width"),
        "8 for a int8 cache", ort=True),
    Neg("GQA-bit-width-dtype", "int4_per_tensor", attrs(kv_cache_bit_width=8), A("kv_cache_bit_width"),
        "4 for a uint8 cache", ort=True),
    Neg("GQA-quant-needs-quantized-cache", "decode", seq(attrs(k_quant_type="PER_TENSOR", v_quant_type="PER_TENSOR",
                                                               kv_cache_bit_width=8), add("k_scale", (1,)),
                                                         add("v_scale", (1,))), I("past_key"), "int8", ort=True),
    Neg("GQA-cache-dtype-needs-quant", "int8_per_tensor", seq(unset("k_quant_type", "v_quant_type"),
                                                              rm("k_scale", "v_scale")), I("past_key"),
        "k_quant_type is NONE", ort=True),
    Neg("GQA-cache-dtype-needs-quant", "decode", seq(dtype("past_key", F16), dtype("past_value", F16)),
        I("past_value"), "element type T (float)"),
    Neg("GQA-local-window-noncausal", "decode", attrs(causal=0, local_window_size=4), A("local_window_size"),
        "-1 when causal is 0", ort=True),
    Neg("GQA-sliding-window-needs-window", "decode", attrs(sliding_window_cache=1), A("sliding_window_cache"),
        "local_window_size > 0", ort=True),
    Neg("GQA-sliding-window-capacity", "sliding_window_cache", attrs(local_window_size=8), I("past_key"),
        ">= 8 (local_window_size)", ort=True),
    Neg("GQA-query-seqlens-causal", "query_seqlens_chunk", attrs(causal=0), I("query_seqlens"), "causal=1",
        ort=True),
    Neg("GQA-query-seqlens-past", "query_seqlens_chunk", rm("past_key", "past_value"), I("query_seqlens"),
        "past_key and past_value present", ort=True),
    Neg("GQA-query-seqlens-kv-seq", "query_seqlens_chunk", seq(shape("key", 2, 2, 32), shape("value", 2, 2, 32)),
        I("query_seqlens"), "kv_sequence_length == 3", ort=True),
    Neg("GQA-query-seqlens-batch", "query_seqlens_chunk", vals("query_seqlens", [3, 2, 1]), I("query_seqlens"),
        "2 (batch_size) entries", ort=True),
    Neg("GQA-query-seqlens-values", "query_seqlens_chunk", vals("query_seqlens", [3, 4]), I("query_seqlens"),
        "query_seqlens[1] in [0, 3]", "rv", ort=True),
    Neg("GQA-seqlens-k-values", "decode", vals("seqlens_k", [-1, 3]), I("seqlens_k"), ">= 0", "rv", ort=True),
    Neg("GQA-total-seqlen-seqlens", "decode", vals("seqlens_k", [5, 8]), I("total_sequence_length"),
        ">= 9 (max(seqlens_k) + 1)", "rv", ort=True),
    Neg("GQA-total-seqlen-seq", "prompt_no_past", seq(vals("total_sequence_length", 2), vals("seqlens_k", [1, 1])),
        I("total_sequence_length"), ">= 4 (kv_sequence_length)", "rv", ort=True),
    Neg("GQA-subsequent-prompt-batch", "decode", rebuild("decode", seq=2), I("query"), "batch_size 1", "rv",
        ort=True),
]


def _check(neg: Neg):
    case = gqa_case(neg.config, seed=3)
    assert not case.runtime_issues() and not case.static_issues(), f"{neg.config} base must be valid"
    neg.mutate(case)
    for mode in neg.modes:
        issues = case.runtime_issues() if mode == "r" else case.static_issues(with_values=(mode == "v"))
        assert not [i for i in issues if i.rule.startswith("internal")], issues
        hits = [i for i in issues if i.rule == neg.rule]
        assert hits, f"[{mode}] {neg.rule} not reported; got {[str(i) for i in issues]}"
        assert any(i.where == neg.where and neg.expect in str(i) for i in hits), \
            f"[{mode}] {neg.rule}: want where={neg.where!r} and {neg.expect!r}; got {[str(i) for i in hits]}"
        name = neg.where.split("'")[1] if "'" in neg.where else None
        if name:
            assert any(name in i.message or name in i.expected for i in hits), [str(i) for i in hits]
    return case


@pytest.mark.parametrize("neg", NEGATIVES, ids=[f"{n.rule}-{i}" for i, n in enumerate(NEGATIVES)])
def test_negative(neg):
    case = _check(neg)
    if neg.ort:
        with pytest.raises(Exception):
            run_ort_cpu(case)


def test_every_rule_id_has_a_negative_test():
    tested = {n.rule for n in NEGATIVES}
    assert set(RULE_DOCS) - tested == set(), "rule ids without a negative test"
    assert tested - set(RULE_DOCS) == set()
    assert len([r for r in RULE_DOCS if r.startswith("GQA-")]) >= 25


@pytest.mark.parametrize("name", GQA_ORT_CPU)
def test_valid_configs_run_on_ort_cpu(name):
    """Every configuration we call valid is accepted by onnxruntime's own CPU kernel (fp32)."""
    case = gqa_case(name, seed=5)
    assert case.runtime_issues() == [] and case.static_issues() == []
    outs = run_ort_cpu(case)
    assert len(outs) == len([o for o in case.outputs])
    out = torch.as_tensor(outs[0])
    q_valid = case.inputs.get("query_seqlens")
    rows = [out[b, : int(q_valid[b])] for b in range(out.shape[0])] if q_valid is not None else [out]
    assert all(torch.isfinite(r).all() for r in rows)  # padded query rows are unspecified


@pytest.mark.parametrize("name", list(GQA_CONFIGS))
def test_valid_configs_clean(name):
    case = gqa_case(name, seed=9)
    for issues in (case.runtime_issues(), case.runtime_issues(outputs=False), case.static_issues("dynamic"),
                   case.static_issues(with_values=True)):
        assert issues == [], [str(i) for i in issues]
