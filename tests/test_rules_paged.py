"""One negative test per PagedAttention rule id: a valid design-doc node, one mutation, and the issue
must carry the rule id, name the offending tensor / attribute and state the expected value.

Modes: r = runtime (check_inputs on torch tensors, outputs requested), s = static (validate_node with
shapes / dtypes only), v = static with integer constants (value rules), o = static with output info.
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import pytest
import torch

from nodes import (
    attrs, dtype, out_add, out_rm, rm, seq, shape, unset, vals,
    add_input, drop, paged_case, with_dtype, with_shape, with_values,
)
from pagedkit.validators.rules.paged import RULE_DOCS


class Neg(NamedTuple):
    rule: str
    config: str
    mutate: Callable
    where: str  # exact Issue.where of the expected issue
    expect: str  # substring of str(issue): the expected value
    modes: str = "rs"
    build: dict = {}


def add(name, s, dt=torch.float16):
    return lambda c: add_input(c, name, s, dt)


def out_info(name, dt, s):
    return lambda c: c.out_info.__setitem__(name, (dt, s))


def hook(fn):
    return lambda c: setattr(c, "node_hook", fn)


I, A, O = "input '{}'".format, "attribute '{}'".format, "output '{}'".format
F16, BF16, F32 = torch.float16, torch.bfloat16, torch.float32
# llama_gqa: H32 / Hkv8 / D128, block 16, past (0, 5, 20), q_lens (3, 1, 2): 6 tokens, 3 sequences,
# 7 blocks, block_table (3, 3), cos/sin (29, 64)
KC = (7, 16, 8, 128)

NEGATIVES = [
    Neg("unknown-input", "llama_gqa", add("not_an_input", (2,)), I("not_an_input"), "one of", "r"),
    Neg("unknown-output", "llama_gqa", out_add("not_an_output"), O("not_an_output"), "one of", "r"),
    Neg("too-many-inputs", "llama_gqa", hook(lambda n: n.input.extend([""] * (21 - len(n.input)) + ["x"])),
        "node", "at most 21", "s"),
    Neg("too-many-outputs", "llama_gqa", hook(lambda n: n.output.extend(["", "", "", "", "y"])), "node",
        "at most 6", "s"),
    Neg("PA-attr-unknown", "llama_gqa", attrs(window=3), A("window"), "one of", "rs"),
    Neg("PA-attr-required", "llama_gqa", unset("kv_num_heads"), A("kv_num_heads"), "attribute 'kv_num_heads' set"),
    Neg("PA-attr-type", "llama_gqa", attrs(scale="big"), A("scale"), "a float"),
    Neg("PA-attr-type", "llama_gqa", attrs(scale=1), A("scale"), "a float", "s"),
    Neg("PA-attr-type", "llama_gqa", attrs(kv_cache_layout=3), A("kv_cache_layout"), "a string"),
    Neg("PA-attr-allowed", "llama_gqa", attrs(kv_cache_layout="PAGED"), A("kv_cache_layout"), "'LATENT'"),
    Neg("PA-attr-allowed", "llama_gqa", attrs(do_rotary=2), A("do_rotary"), "[0, 1]"),
    Neg("PA-attr-allowed", "llama_gqa", attrs(k_quant_type="PER_BLOCK"), A("k_quant_type"), "PER_TOKEN"),
    Neg("PA-num-heads-positive", "llama_gqa", attrs(num_heads=0), A("num_heads"), "num_heads > 0"),
    Neg("PA-kv-num-heads-positive", "llama_gqa", attrs(kv_num_heads=-8), A("kv_num_heads"), "kv_num_heads > 0"),
    Neg("PA-num-heads-divisible", "llama_gqa", attrs(num_heads=30), A("num_heads"), "num_heads % kv_num_heads == 0"),
    Neg("PA-scale", "llama_gqa", attrs(scale=-0.5), A("scale"), ">= 0"),
    Neg("PA-scale", "llama_gqa", attrs(scale=float("inf")), A("scale"), "finite"),
    Neg("PA-softcap", "llama_gqa", attrs(softcap=-1.0), A("softcap"), ">= 0"),
    Neg("PA-local-window", "llama_gqa", attrs(local_window_size=0), A("local_window_size"), "-1 or > 0"),
    Neg("PA-norm-epsilon", "llama_gqa", attrs(qk_norm_epsilon=0.0), A("qk_norm_epsilon"), "> 0"),
    Neg("PA-v-head-size-range", "llama_gqa", attrs(v_head_size=-64), A("v_head_size"), "0 <= v_head_size <= 128"),
    Neg("PA-v-head-size-range", "mla_deepseek_v3", attrs(v_head_size=640), A("v_head_size"), "<= 576"),
    Neg("PA-rotary-offset", "llama_gqa", attrs(rotary_offset=4), A("rotary_offset"), "multiple of 8"),
    Neg("PA-rotary-offset", "llama_gqa", attrs(rotary_offset=-8), A("rotary_offset"), ">= 0"),
    Neg("PA-input-required", "llama_gqa", rm("past_seqlens"), I("past_seqlens"), "input 6 'past_seqlens' present"),
    Neg("PA-input-required", "llama_gqa", rm("query"), I("query"), "input 0 'query' present"),
    Neg("PA-output-required", "llama_gqa", out_rm("output"), O("output"), "output 0 'output' named"),
    Neg("PA-dtype-allowed", "llama_gqa", dtype("query", F32), I("query"), "tensor(float16)"),
    Neg("PA-dtype-allowed", "llama_gqa", dtype("cumulative_sequence_length", torch.int64),
        I("cumulative_sequence_length"), "tensor(int32)"),
    Neg("PA-dtype-allowed", "int8_per_tensor", dtype("k_scale", F16), I("k_scale"), "tensor(float)"),
    Neg("PA-dtype-allowed", "bias_output_qk", out_info("output_qk", 11, (32, 6, 48)), O("output_qk"),
        "tensor(float)", "o"),
    Neg("PA-dtype-same-T", "llama_gqa", dtype("key", BF16), I("key"), "tensor(float16) (as 'query')"),
    Neg("PA-dtype-same-T", "llama_gqa", out_info("output", 16, (6, 4096)), O("output"), "as 'query'", "o"),
    Neg("PA-dtype-same-T_CACHE", "int8_per_tensor", dtype("value_cache", torch.float8_e4m3fn), I("value_cache"),
        "tensor(int8) (as 'key_cache')"),
    Neg("PA-dtype-same-T_CACHE", "int8_per_tensor", out_info("key_cache_out", 10, KC), O("key_cache_out"),
        "tensor(int8)", "o"),
    Neg("PA-dtype-same-T_SCALE_CACHE", "int4_per_token_rotation", dtype("v_scale_cache", F32), I("v_scale_cache"),
        "tensor(float16) (as 'k_scale_cache')"),
    Neg("PA-rank", "llama_gqa", shape("query", 6, 32, 128), I("query"), "rank 2"),
    Neg("PA-rank", "llama_gqa", shape("block_table", 9), I("block_table"), "rank 2"),
    Neg("PA-rank", "int8_per_tensor", shape("k_scale", 1, 1), I("k_scale"), "rank 1 or 3"),
    Neg("PA-head-size-divisible", "llama_gqa", shape("query", 6, 4100), I("query"), "multiple of num_heads (32)"),
    Neg("PA-packed-hidden", "packed_qkv", shape("query", 6, 48 * 128 + 8), I("query"),
        "num_heads + 2 * kv_num_heads (48)"),
    Neg("PA-head-size-multiple-8", "llama_gqa", seq(shape("query", 6, 32 * 12), shape("key", 6, 96),
                                                    shape("value", 6, 96)), I("query"), "head_size 12"),
    Neg("PA-input-mode", "llama_gqa", rm("value"), I("value"), "key+value+value_cache"),
    Neg("PA-input-mode", "llama_gqa", rm("value_cache"), I("value_cache"), "value_cache only"),
    Neg("PA-input-mode", "mla_deepseek_v3", add("value", (6, 576)), I("value"), "value and value_cache absent"),
    Neg("PA-input-mode", "mla_deepseek_v3", rm("key"), I("key"), "key present"),
    Neg("PA-kv-token-count", "llama_gqa", shape("key", 7, 1024), I("key"), "6 (token_count)"),
    Neg("PA-kv-hidden", "llama_gqa", shape("value", 6, 1000), I("value"), "1024 (kv_num_heads * head_size)"),
    Neg("PA-cache-shape-match", "llama_gqa", shape("value_cache", 7, 32, 8, 128), I("value_cache"),
        "16 (key_cache dimension 1)"),
    Neg("PA-cache-kv-heads", "llama_gqa", seq(shape("key_cache", 7, 16, 4, 128), shape("value_cache", 7, 16, 4, 128)),
        I("key_cache"), "8 (kv_num_heads)"),
    Neg("PA-cache-head-size", "llama_gqa", seq(shape("key_cache", 7, 16, 8, 96), shape("value_cache", 7, 16, 8, 96)),
        I("key_cache"), "head_size (128)"),
    Neg("PA-cache-head-size", "int4_per_tensor", seq(shape("key_cache", 7, 16, 8, 128)), I("key_cache"),
        "(head_size + 1) / 2 = 64"),
    Neg("PA-block-size", "llama_gqa", seq(shape("key_cache", 7, 8, 8, 128), shape("value_cache", 7, 8, 8, 128)),
        I("key_cache"), "a power of two >= 16"),
    Neg("PA-block-size", "llama_gqa", seq(shape("key_cache", 7, 24, 8, 128), shape("value_cache", 7, 24, 8, 128)),
        I("key_cache"), "a power of two >= 16"),
    Neg("PA-csl-length", "llama_gqa", vals("cumulative_sequence_length", [0]), I("cumulative_sequence_length"),
        ">= 2 (batch_size + 1)"),
    Neg("PA-past-seqlens-batch", "llama_gqa", vals("past_seqlens", [0, 5, 20, 1]), I("past_seqlens"),
        "3 (batch_size)"),
    Neg("PA-block-table-batch", "llama_gqa", shape("block_table", 2, 3), I("block_table"), "3 (batch_size)"),
    Neg("PA-slot-mapping-tokens", "all_features", shape("slot_mapping", 5), I("slot_mapping"), "6 (token_count)"),
    Neg("PA-query-positions-tokens", "query_positions", shape("query_positions", 7), I("query_positions"),
        "6 (token_count)"),
    Neg("PA-metadata-length", "all_features", vals("attention_metadata", [3, 22, 3, 0]), I("attention_metadata"),
        "2 or 3 entries"),
    Neg("PA-rotary-missing", "llama_gqa", rm("cos_cache", "sin_cache"), I("cos_cache"), "cos_cache and sin_cache"),
    Neg("PA-rotary-pair", "llama_gqa", rm("sin_cache"), I("sin_cache"), "both present or both absent"),
    Neg("PA-rotary-unused", "llama_gqa", attrs(do_rotary=0), I("cos_cache"), "do_rotary=1"),
    Neg("PA-rotary-shape-match", "llama_gqa", shape("sin_cache", 30, 64), I("sin_cache"), "(29, 64)"),
    Neg("PA-rotary-dim", "llama_gqa", seq(shape("cos_cache", 29, 72), shape("sin_cache", 29, 72)), I("cos_cache"),
        "<= head_size (128)"),
    Neg("PA-rotary-dim", "mla_deepseek_v3", attrs(rotary_offset=520), I("cos_cache"), "<= head_size (576)"),
    Neg("PA-head-sink-shape", "all_features", shape("head_sink", 33), I("head_sink"), "(32) = (num_heads)"),
    Neg("PA-qk-norm-pair", "all_features", rm("k_norm_weight"), I("k_norm_weight"), "both present or both absent"),
    Neg("PA-qk-norm-shape", "all_features", seq(shape("q_norm_weight", 64), shape("k_norm_weight", 64)),
        I("q_norm_weight"), "(128) = (head_size)"),
    Neg("PA-qk-output-missing", "bias_output_qk", out_rm("output_qk"), O("output_qk"), "output 5"),
    Neg("PA-qk-output-unrequested", "llama_gqa", out_add("output_qk"), O("output_qk"), "qk_output 1 or 2"),
    Neg("PA-bias-batch", "bias_output_qk", shape("attention_bias", 2, 32, 3, 22), I("attention_bias"),
        "1 or batch_size (3)"),
    Neg("PA-bias-heads", "bias_output_qk", shape("attention_bias", 3, 8, 3, 22), I("attention_bias"),
        "1 or num_heads (32)"),
    Neg("PA-cache-outputs-pair", "llama_gqa", out_rm("value_cache_out"), O("value_cache_out"), "both named"),
    Neg("PA-latent-value-cache-out", "mla_deepseek_v3", out_add("value_cache_out"), O("value_cache_out"),
        "absent (LATENT)"),
    Neg("PA-output-shape", "llama_gqa", out_info("output", 10, (6, 4000)), O("output"), "4096", "o"),
    Neg("PA-output-shape", "mla_deepseek_v3", out_info("output", 10, (6, 16 * 576)), O("output"), "8192", "o"),
    Neg("PA-cache-out-shape", "llama_gqa", out_info("key_cache_out", 10, (7, 16, 8, 64)), O("key_cache_out"),
        "(7, 16, 8, 128)", "o"),
    Neg("PA-output-qk-shape", "bias_output_qk", out_info("output_qk", 1, (32, 6, 40)), O("output_qk"),
        "48 (block_table.shape[1] * block_size)", "o"),
    Neg("PA-scale-missing", "int8_per_tensor", rm("k_scale"), I("k_scale"), "input 'k_scale' present"),
    Neg("PA-scale-unexpected", "llama_gqa", add("k_scale", (1,), F32), I("k_scale"), "absent"),
    Neg("PA-scale-unexpected", "int4_per_token_rotation", add("v_scale", (1,), F32), I("v_scale"), "PER_TOKEN"),
    Neg("PA-scale-shape-per-tensor", "int8_per_tensor", shape("k_scale", 2), I("k_scale"), "(1) for PER_TENSOR"),
    Neg("PA-scale-shape-per-channel", "int8_per_channel", shape("v_scale", 8, 1, 64), I("v_scale"), "(8, 1, 128)"),
    Neg("PA-scale-cache-missing", "int4_per_token_rotation", rm("k_scale_cache"), I("k_scale_cache"),
        "input 'k_scale_cache' present"),
    Neg("PA-scale-cache-unexpected", "int8_per_tensor", add("v_scale_cache", (7, 16, 8)), I("v_scale_cache"),
        "absent for v_quant_type PER_TENSOR"),
    Neg("PA-scale-cache-out-missing", "int4_per_token_rotation", out_rm("k_scale_cache_out"), O("k_scale_cache_out"),
        "named"),
    Neg("PA-scale-cache-out-unexpected", "int8_per_tensor", out_add("v_scale_cache_out"), O("v_scale_cache_out"),
        "absent for v_quant_type PER_TENSOR"),
    Neg("PA-scale-cache-shape", "int4_per_token_rotation", shape("k_scale_cache", 7, 16, 4), I("k_scale_cache"),
        "8 (kv_num_heads)"),
    Neg("PA-quant-needs-quantized-cache", "llama_gqa", seq(attrs(k_quant_type="PER_TENSOR"),
                                                           add("k_scale", (1,), F32)), I("key_cache"), "int8"),
    Neg("PA-cache-dtype-needs-quant", "int8_per_tensor", seq(unset("k_quant_type"), rm("k_scale")), I("key_cache"),
        "k_quant_type is NONE"),
    Neg("PA-cache-dtype-needs-quant", "llama_gqa", seq(dtype("key_cache", BF16), dtype("value_cache", BF16)),
        I("key_cache"), "element type T (float16)"),
    Neg("PA-cache-dtype-attr", "int8_per_tensor", attrs(k_cache_dtype="float8e4m3fn"), A("k_cache_dtype"), "'int8'"),
    Neg("PA-cache-dtype-reserved", "int8_per_tensor", attrs(v_cache_dtype="float4e2m1"), A("v_cache_dtype"),
        "supported cache dtype"),
    Neg("PA-int4-needs-uint8", "int8_per_tensor", attrs(k_cache_dtype="int4"), I("key_cache"), "a uint8"),
    Neg("PA-int4-needs-quant", "int4_per_tensor", seq(unset("k_quant_type"), rm("k_scale")), A("k_quant_type"),
        "PER_TENSOR, PER_CHANNEL or PER_TOKEN"),
    Neg("PA-uint8-needs-int4", "int4_per_tensor", attrs(v_cache_dtype=""), I("value_cache"), "'int4'"),
    Neg("PA-rotation-pow2", "llama_gqa", attrs(qk_rotation=1), A("qk_rotation"), "power of two", "rs",
        {"head_size": 96}),
    Neg("PA-rotation-latent", "mla_deepseek_v3", attrs(qk_rotation=1), A("qk_rotation"), "LATENT"),
    Neg("PA-rotation-per-channel", "int4_per_channel", attrs(v_rotation=1), A("v_rotation"), "PER_TOKEN"),
    Neg("PA-rotation-per-channel", "int8_per_channel", attrs(qk_rotation=1), A("qk_rotation"), "PER_TOKEN"),
    Neg("PA-latent-kv-heads", "mla_deepseek_v3",
        lambda c: c.__dict__.update(paged_case("mla_deepseek_v3", kv_num_heads=2).__dict__), A("kv_num_heads"),
        "1 (LATENT)"),
    Neg("PA-latent-scale", "mla_deepseek_v3", unset("scale"), A("scale"), "explicit scale"),
    Neg("PA-latent-scale", "mla_deepseek_v3", attrs(scale=0.0), A("scale"), "explicit scale"),
    Neg("PA-latent-head-sink", "mla_deepseek_v3", add("head_sink", (16,)), I("head_sink"), "absent (LATENT)"),
    Neg("PA-latent-qk-norm", "mla_deepseek_v3", seq(add("q_norm_weight", (576,)), add("k_norm_weight", (576,))),
        I("q_norm_weight"), "absent (LATENT)"),
    Neg("PA-latent-v-scale", "mla_int8_per_tensor", add("v_scale", (1,), F32), I("v_scale"), "absent (LATENT)"),
    Neg("PA-latent-v-quant", "mla_deepseek_v3", attrs(v_quant_type="PER_TENSOR"), A("v_quant_type"), "NONE"),
    Neg("PA-latent-v-cache-dtype", "mla_deepseek_v3", attrs(v_cache_dtype="int8"), A("v_cache_dtype"), "''"),
    Neg("PA-latent-v-scale-cache", "mla_deepseek_v3", add("v_scale_cache", (7, 16, 1)), I("v_scale_cache"),
        "absent (LATENT)"),
    Neg("PA-latent-v-scale-cache", "mla_deepseek_v3", out_add("v_scale_cache_out"), O("v_scale_cache_out"),
        "absent (LATENT)"),
    Neg("PA-v-head-size-separate", "llama_gqa", attrs(v_head_size=64), A("v_head_size"), "0 or head_size (128)"),
    Neg("PA-csl-start", "llama_gqa", vals("cumulative_sequence_length", [1, 4, 5, 6]),
        I("cumulative_sequence_length"), "cumulative_sequence_length[0] == 0", "rv"),
    Neg("PA-csl-monotonic", "llama_gqa", vals("cumulative_sequence_length", [0, 4, 3, 6]),
        I("cumulative_sequence_length"), "non-decreasing", "rv"),
    Neg("PA-csl-total", "llama_gqa", vals("cumulative_sequence_length", [0, 3, 4, 5]),
        I("cumulative_sequence_length"), "== 6 (token_count)", "rv"),
    Neg("PA-past-seqlens-values", "llama_gqa", vals("past_seqlens", [0, -1, 20]), I("past_seqlens"), ">= 0", "rv"),
    Neg("PA-context-capacity", "llama_gqa", vals("past_seqlens", [0, 5, 50]), I("block_table"),
        "<= 48 (block_table.shape[1] * block_size)", "rv"),
    Neg("PA-slot-mapping-range", "all_features", vals("slot_mapping", [0, 1, 2, 112, 4, 5]), I("slot_mapping"),
        "[-1, 112)", "rv"),
    Neg("PA-slot-mapping-range", "all_features", vals("slot_mapping", [0, 1, 2, -2, 4, 5]), I("slot_mapping"),
        "[-1, 112)", "rv"),
    Neg("PA-query-positions-values", "query_positions", vals("query_positions", [0, 1, -2, 5, 20, 21]),
        I("query_positions"), ">= 0", "rv"),
    Neg("PA-metadata-values", "all_features", vals("attention_metadata", [-1, 22, 3]), I("attention_metadata"),
        ">= 0", "rv"),
    Neg("PA-rotary-positions", "llama_gqa", vals("past_seqlens", [0, 5, 28]), I("cos_cache"), "< 29", "rv"),
    Neg("PA-rotary-positions", "query_positions", vals("query_positions", [0, 1, 2, 5, 20, 29]), I("cos_cache"),
        "< 29", "rv"),
    Neg("PA-bias-q-capacity", "bias_output_qk", shape("attention_bias", 3, 32, 2, 22), I("attention_bias"),
        ">= 3 (largest q_len)", "rv"),
    Neg("PA-bias-kv-capacity", "bias_output_qk", shape("attention_bias", 1, 1, 3, 21), I("attention_bias"),
        ">= 22", "rv"),
]


def _issues(case, mode):
    if mode == "r":
        return case.runtime_issues()
    return case.static_issues(with_values=(mode == "v"))


def _check(neg: Neg):
    case = paged_case(neg.config, seed=7, **neg.build)
    assert not case.runtime_issues() and not case.static_issues(), f"{neg.config} base must be valid"
    neg.mutate(case)
    for mode in neg.modes:
        issues = _issues(case, "s" if mode == "o" else mode)
        assert not [i for i in issues if i.rule.startswith("internal")], issues
        hits = [i for i in issues if i.rule == neg.rule]
        assert hits, f"[{mode}] {neg.rule} not reported; got {[str(i) for i in issues]}"
        assert any(i.where == neg.where and neg.expect in str(i) for i in hits), \
            f"[{mode}] {neg.rule}: want where={neg.where!r} and {neg.expect!r} in text; got {[str(i) for i in hits]}"
        name = neg.where.split("'")[1] if "'" in neg.where else None
        if name:  # the text names the offending tensor / attribute
            assert any(name in i.message or name in i.expected for i in hits), [str(i) for i in hits]


@pytest.mark.parametrize("neg", NEGATIVES, ids=[f"{n.rule}-{i}" for i, n in enumerate(NEGATIVES)])
def test_negative(neg):
    _check(neg)


def test_every_rule_id_has_a_negative_test():
    tested = {n.rule for n in NEGATIVES}
    assert set(RULE_DOCS) - tested == set(), "rule ids without a negative test"
    assert tested - set(RULE_DOCS) == set(), "tested ids missing from RULE_DOCS"
    assert len([r for r in RULE_DOCS if r.startswith("PA-")]) >= 60


def test_issue_text_is_ort_like():
    case = paged_case("llama_gqa")
    with_shape(case, "key_cache", (7, 16, 8, 96))
    with_shape(case, "value_cache", (7, 16, 8, 96))
    texts = [str(i) for i in case.runtime_issues() if i.rule == "PA-cache-head-size"]
    assert any("Input 'key_cache' dimension 3 should be same as head_size (128), got 96" in t for t in texts), texts
