"""Seeded fuzz of the validator over valid design-doc nodes of both ops.

Targeted mutations (dropped / swapped inputs, wrong ranks, wrong dtypes, bad attribute values,
perturbed dimensions, bad integer values at run time, broken pairs / outputs) each break one known
rule: the rule id must be reported, naming the mutated tensor or attribute. Chaos mutations stack
several at random (also on symbolic static views): the validator must never raise, never report an
"internal:" issue, and only report documented rule ids.
"""

from __future__ import annotations

import math
import random

import pytest
import torch

from nodes import gqa_case, paged_case, random_like
from pagedkit.validators import get_contract
from pagedkit.validators.nodeview import onnx_dtype_of, type_str
from pagedkit.validators.rules.gqa import RULE_DOCS as GQA_DOCS
from pagedkit.validators.rules.paged import RULE_DOCS as PA_DOCS

SEED = 20261130
N_TARGETED = 2000
N_CHAOS = 500

PA_CONFIGS = ["llama_gqa", "packed_qkv", "mla_deepseek_v3", "int8_per_channel", "int4_per_token_rotation",
              "all_features", "bias_output_qk", "fp8_per_tensor", "query_positions", "int4_per_tensor"]
GQA_CONFIGS = ["decode", "prompt_no_past", "packed_decode", "rotary_position_ids", "int8_per_tensor",
               "int4_per_tensor", "bias_output_qk", "sliding_window_cache", "query_seqlens_chunk", "qk_norm_fp16",
               "head_sink_softcap"]
DTYPES = [torch.float32, torch.float64, torch.float16, torch.bfloat16, torch.int64, torch.int32, torch.int16,
          torch.int8, torch.uint8, torch.bool, torch.float8_e4m3fn]


class Skip(Exception):
    """This mutation does not apply to this case."""


def _prefix(case):
    return "PA" if case.op_type == "PagedAttention" else "GQA"


def _type_ok(case, name, t):
    param = case.contract.input(name)
    return type_str(onnx_dtype_of(t)) in case.contract.allowed_types(param)


# ---- targeted mutations: each returns (rule id, names the issue's `where` may name) ----


def m_drop_required(rng, case):
    names = [p.name for p in case.contract.inputs if not p.optional and p.name in case.inputs]
    name = rng.choice(names)
    del case.inputs[name]
    return f"{_prefix(case)}-input-required", {name}


def m_bad_dtype(rng, case):
    name = rng.choice(list(case.inputs))
    bad = [d for d in DTYPES if type_str(onnx_dtype_of(torch.empty(0, dtype=d))) not in
           case.contract.allowed_types(case.contract.input(name))]
    case.inputs[name] = case.inputs[name].to(rng.choice(bad))
    return f"{_prefix(case)}-dtype-allowed", {name}


def m_bad_rank(rng, case):
    name = rng.choice([n for n in case.inputs if case.contract.input(n).rank is not None])
    allowed = case.contract.input(name).rank
    allowed = allowed if isinstance(allowed, tuple) else (allowed,)
    shape = tuple(case.inputs[name].shape)
    options = [s for s in (shape + (1,), shape[:-1], shape + (2, 1)) if len(s) not in allowed]
    case.inputs[name] = random_like(rng.choice(options), case.inputs[name].dtype, rng.randrange(99))
    return f"{_prefix(case)}-rank", {name}


def _attr_table(case):
    p = _prefix(case)
    t = [("num_heads", 0, "num-heads-positive"), ("num_heads", -4, "num-heads-positive"),
         ("kv_num_heads", 0, "kv-num-heads-positive"), ("scale", -1.5, "scale"), ("scale", math.inf, "scale"),
         ("scale", math.nan, "scale"), ("softcap", -3.0, "softcap"), ("local_window_size", 0, "local-window"),
         ("local_window_size", -7, "local-window"), ("qk_norm_epsilon", 0.0, "norm-epsilon"),
         ("qk_norm_epsilon", -1e-6, "norm-epsilon"), ("do_rotary", 3, "attr-allowed"),
         ("rotary_interleaved", -1, "attr-allowed"), ("qk_output", 5, "attr-allowed"),
         ("k_quant_type", "PER_ROW", "attr-allowed"), ("v_quant_type", "int8", "attr-allowed"),
         ("num_heads", "32", "attr-type"), ("softcap", "soft", "attr-type"), ("do_rotary", 1.0, "attr-type"),
         ("k_quant_type", 1, "attr-type"), ("no_such_attribute", 1, "attr-unknown"), ("window", "x", "attr-unknown")]
    if p == "PA":
        t += [("rotary_offset", 12, "rotary-offset"), ("rotary_offset", -8, "rotary-offset"),
              ("v_head_size", -1, "v-head-size-range"), ("kv_cache_layout", "PAGED", "attr-allowed"),
              ("is_causal", 2, "attr-allowed"), ("k_cache_dtype", "uint4", "attr-allowed"),
              ("qk_rotation", 2, "attr-allowed"), ("v_rotation", -1, "attr-allowed")]
    else:
        t += [("causal", 2, "attr-allowed"), ("smooth_softmax", 3, "attr-allowed"),
              ("kv_cache_bit_width", 2, "attr-allowed"), ("sliding_window_cache", 2, "attr-allowed"),
              ("q_norm_epsilon", 0.0, "norm-epsilon"), ("k_norm_epsilon", math.inf, "norm-epsilon"),
              ("sliding_window_cache", 1, "sliding-window-needs-window")]
    return t


def m_bad_attr(rng, case):
    p = _prefix(case)
    if rng.random() < 0.1:
        name = rng.choice(["num_heads", "kv_num_heads"])
        del case.attrs[name]
        return f"{p}-attr-required", {name}
    name, value, rid = rng.choice(_attr_table(case))
    if rid == "sliding-window-needs-window":
        case.attrs.pop("local_window_size", None)
    case.attrs[name] = value
    return f"{p}-{rid}", {name}


def _perturb(rng, case, names, axis, avoid=()):
    shape = list(case.inputs[names[0]].shape)
    choices = [v for v in range(1, shape[axis] + 9) if v != shape[axis] and v not in avoid]
    shape[axis] = rng.choice(choices)
    for n in names:
        case.inputs[n] = random_like(shape, case.inputs[n].dtype, rng.randrange(99))


def _dim_table(case):
    p = _prefix(case)
    a = case.attrs
    nh = a["num_heads"]
    if p == "PA":
        return [(("key",), 0, "kv-token-count", ()), (("value",), 0, "kv-token-count", ()),
                (("key",), 1, "kv-hidden", ()), (("key_cache", "value_cache"), 2, "cache-kv-heads", ()),
                (("key_cache", "value_cache"), 3, "cache-head-size", ()), (("value_cache",), 1, "cache-shape-match", ()),
                (("past_seqlens",), 0, "past-seqlens-batch", ()), (("block_table",), 0, "block-table-batch", ()),
                (("slot_mapping",), 0, "slot-mapping-tokens", ()), (("query_positions",), 0, "query-positions-tokens", ()),
                (("head_sink",), 0, "head-sink-shape", ()), (("q_norm_weight", "k_norm_weight"), 0, "qk-norm-shape", ()),
                (("attention_bias",), 0, "bias-batch", (1,)), (("attention_bias",), 1, "bias-heads", (1,)),
                (("k_scale_cache",), 2, "scale-cache-shape", ()), (("sin_cache",), 0, "rotary-shape-match", ()),
                (("key_cache", "value_cache"), 1, "block-size", (32, 64, 128))]
    return [(("key", "value"), 0, "kv-batch", ()), (("key", "value"), 1, "kv-seq", (0,)), (("value",), 2, "kv-hidden", ()),
            (("past_key", "past_value"), 1, "past-kv-heads", ()), (("past_key", "past_value"), 3, "past-head-size", ()),
            (("past_value",), 2, "past-shape-match", ()), (("seqlens_k",), 0, "seqlens-k-batch", ()),
            (("head_sink",), 0, "head-sink-shape", ()), (("q_norm_weight", "k_norm_weight"), 0, "qk-norm-shape", ()),
            (("attention_bias",), 0, "bias-batch", (1,)), (("attention_bias",), 1, "bias-heads", (1, nh)),
            (("attention_bias",), 2, "bias-seq", ()), (("position_ids",), 0, "position-ids-shape", ()),
            (("sin_cache",), 0, "rotary-shape-match", ())]


def m_dim(rng, case):
    rows = [r for r in _dim_table(case) if all(n in case.inputs for n in r[0])]
    if case.op_type == "PagedAttention" and case.attrs.get("kv_cache_layout") == "LATENT":
        rows = [r for r in rows if r[2] != "cache-head-size"]  # one LATENT cache: dim 3 also sets head_size
    names, axis, rid, avoid = rng.choice(rows)
    batch = case.inputs["query"].shape[0]
    _perturb(rng, case, names, axis, set(avoid) | ({batch} if rid == "bias-batch" else set())
             | ({case.attrs["num_heads"]} if rid == "bias-heads" else set()))
    return f"{_prefix(case)}-{rid}", set(names)


def m_values(rng, case):
    p = _prefix(case)
    if p == "GQA":
        sk = case.inputs["seqlens_k"].clone()
        if rng.random() < 0.5:
            sk[rng.randrange(len(sk))] = -rng.randint(1, 9)
            case.inputs["seqlens_k"] = sk
            return "GQA-seqlens-k-values", {"seqlens_k"}
        sk[rng.randrange(len(sk))] = int(case.inputs["total_sequence_length"]) + rng.randint(0, 9)
        case.inputs["seqlens_k"] = sk
        return "GQA-total-seqlen-seqlens", {"seqlens_k", "total_sequence_length"}
    kinds = ["csl-start", "csl-monotonic", "csl-total", "past-seqlens-values"]
    kinds += [k for k, n in (("slot-mapping-range", "slot_mapping"), ("metadata-values", "attention_metadata"),
                             ("query-positions-values", "query_positions")) if n in case.inputs]
    kind = rng.choice(kinds)
    csl = case.inputs["cumulative_sequence_length"].clone()
    if kind == "csl-start":
        csl[0] = rng.choice([-2, 1, 3])
        name = "cumulative_sequence_length"
    elif kind == "csl-monotonic":
        i = rng.randrange(1, len(csl) - 1) if len(csl) > 2 else 1
        csl[i] = csl[i - 1] - rng.randint(1, 3) if i < len(csl) - 1 else csl[i]
        if i == len(csl) - 1:
            csl[0], csl[1] = 0, -1
        name = "cumulative_sequence_length"
    elif kind == "csl-total":
        csl[-1] = csl[-1] + rng.choice([-1, 1, 5])
        name = "cumulative_sequence_length"
    else:
        name = {"past-seqlens-values": "past_seqlens", "slot-mapping-range": "slot_mapping",
                "metadata-values": "attention_metadata", "query-positions-values": "query_positions"}[kind]
        v = case.inputs[name].clone()
        i = rng.randrange(len(v))
        if kind == "slot-mapping-range" and rng.random() < 0.5:
            kc = case.inputs["key_cache"].shape
            v[i] = kc[0] * kc[1] + rng.randint(0, 50)
        else:
            v[i] = -rng.randint(2 if kind == "slot-mapping-range" else 1, 99)
        case.inputs[name] = v
        return f"PA-{kind}", {name}
    case.inputs[name] = csl
    return f"PA-{kind}", {name}


def m_pair(rng, case):
    p = _prefix(case)
    rows = [("cos_cache", "sin_cache", "rotary-pair"), ("q_norm_weight", "k_norm_weight", "qk-norm-pair")]
    if p == "GQA":
        rows += [("key", "value", "kv-pair"), ("past_key", "past_value", "past-pair")]
    elif case.attrs.get("kv_cache_layout") != "LATENT":
        rows += [("key", "value", "input-mode")]
    rows = [r for r in rows if r[0] in case.inputs and r[1] in case.inputs]
    for side in ("k", "v"):
        qt = case.attrs.get(f"{side}_quant_type", "NONE")
        if f"{side}_scale" in case.inputs and qt != "NONE":
            rows.append((f"{side}_scale", None, "scale-missing"))
        if f"{side}_scale_cache" in case.inputs:
            rows.append((f"{side}_scale_cache", None, "scale-cache-missing"))
    a, b, rid = rng.choice(rows)
    name = a if b is None or rng.random() < 0.5 else b
    del case.inputs[name]
    return f"{p}-{rid}", {name} | ({a, b} - {None})


def m_swap(rng, case):
    names = list(case.inputs)
    for _ in range(20):
        a, b = rng.sample(names, 2)
        ta, tb = case.inputs[a], case.inputs[b]
        expected = set()
        for dst, t in ((a, tb), (b, ta)):
            r = case.contract.input(dst).rank
            r = r if isinstance(r, tuple) or r is None else (r,)
            if r is not None and t.dim() not in r:
                expected.add((f"{_prefix(case)}-rank", dst))
            if not _type_ok(case, dst, t):
                expected.add((f"{_prefix(case)}-dtype-allowed", dst))
        if expected:
            case.inputs[a], case.inputs[b] = tb, ta
            rid, dst = rng.choice(sorted(expected))
            return rid, {dst}
    raise Skip


def m_outputs(rng, case):
    p = _prefix(case)
    if "output_qk" in case.outputs and rng.random() < 0.5:
        case.outputs.remove("output_qk")
        return f"{p}-qk-output-missing", {"output_qk"}
    if "output_qk" not in case.outputs and not case.attrs.get("qk_output"):
        case.outputs.append("output_qk")
        return f"{p}-qk-output-unrequested", {"output_qk"}
    if p == "PA" and "value_cache_out" in case.outputs:
        case.outputs.remove(rng.choice(["key_cache_out", "value_cache_out"]))
        return "PA-cache-outputs-pair", {"key_cache_out", "value_cache_out"}
    case.outputs.remove("output")
    return f"{p}-output-required", {"output"}


def m_quant(rng, case):
    """Break the quant type / cache element type / cache dtype attribute / bit width agreement."""
    p = _prefix(case)
    side = "k"
    cache = "key_cache" if p == "PA" else "past_key"
    if cache not in case.inputs:
        raise Skip
    qt = case.attrs.get(f"{side}_quant_type", "NONE")
    cdt = case.inputs[cache].dtype
    if p == "GQA":
        if qt == "NONE":
            case.attrs["kv_cache_bit_width"] = rng.choice([4, 8])
            return "GQA-bit-width-unexpected", {"kv_cache_bit_width"}
        if rng.random() < 0.5:
            del case.attrs["kv_cache_bit_width"]
            return "GQA-bit-width-missing", {"kv_cache_bit_width"}
        case.attrs["kv_cache_bit_width"] = 8 if cdt == torch.uint8 else 4
        return "GQA-bit-width-dtype", {"kv_cache_bit_width"}
    r = rng.random()
    if r < 0.25:
        case.attrs[f"{side}_cache_dtype"] = "float4e2m1"
        return "PA-cache-dtype-reserved", {f"{side}_cache_dtype"}
    if r < 0.5:
        own = type_str(onnx_dtype_of(case.inputs[cache]))[7:-1]
        case.attrs[f"{side}_cache_dtype"] = rng.choice([d for d in ("float16", "bfloat16", "int8", "float8e4m3fn")
                                                        if d != own])
        return "PA-cache-dtype-attr", {f"{side}_cache_dtype"}
    if qt == "NONE":
        case.attrs[f"{side}_quant_type"] = "PER_TENSOR"
        case.inputs[f"{side}_scale"] = torch.tensor([0.02])
        return "PA-quant-needs-quantized-cache", {cache}
    case.attrs[f"{side}_quant_type"] = "NONE"
    for n in (f"{side}_scale", f"{side}_scale_cache"):
        case.inputs.pop(n, None)
    if case.attrs.get(f"{side}_cache_dtype") == "int4":
        return "PA-int4-needs-quant", {f"{side}_quant_type"}
    return "PA-cache-dtype-needs-quant", {cache}


TARGETED = [m_quant, m_drop_required, m_bad_dtype, m_bad_rank, m_bad_attr, m_dim, m_values, m_pair, m_swap, m_outputs]


class Bases:
    """Valid base cases, built once per (op, config, seed)."""

    def __init__(self):
        self.cache = {}

    def get(self, rng):
        op = rng.choice(["PagedAttention", "GroupQueryAttention"])
        config = rng.choice(PA_CONFIGS if op == "PagedAttention" else GQA_CONFIGS)
        seed = rng.randrange(2)
        key = (op, config, seed)
        if key not in self.cache:
            self.cache[key] = paged_case(config, seed=seed) if op == "PagedAttention" else gqa_case(config, seed=seed)
        return self.cache[key].copy()


def _no_internal(issues, docs):
    internal = [str(i) for i in issues if i.rule.startswith("internal")]
    assert not internal, internal
    unknown = {i.rule for i in issues} - set(docs)
    assert not unknown, f"undocumented rule ids {unknown}"


@pytest.fixture(scope="module")
def bases():
    return Bases()


def test_fuzz_targeted_mutations_are_reported(bases):
    rng = random.Random(SEED)
    done, static_checked, per_kind = 0, 0, {}
    while done < N_TARGETED:
        case = bases.get(rng)
        mutate = rng.choice(TARGETED)
        try:
            rid, names = mutate(rng, case)
        except (Skip, IndexError, ValueError):
            continue  # not applicable to this base (e.g. nothing of that kind present)
        docs = PA_DOCS if case.op_type == "PagedAttention" else GQA_DOCS
        assert rid in docs, rid
        modes = ["runtime"]
        if mutate not in (m_values,) and rng.random() < 0.35:
            modes.append("static")
        for mode in modes:
            issues = case.runtime_issues() if mode == "runtime" else case.static_issues(with_values=True)
            _no_internal(issues, docs)
            hits = [i for i in issues if i.rule == rid and any(f"'{n}'" in i.where for n in names)]
            assert hits, (f"{mutate.__name__} on {case.name} ({mode}): expected {rid} naming {names}, got "
                          f"{[str(i) for i in issues]}")
        static_checked += len(modes) - 1
        per_kind[mutate.__name__] = per_kind.get(mutate.__name__, 0) + 1
        done += 1
    assert all(per_kind.get(m.__name__, 0) >= 100 for m in TARGETED), per_kind
    assert static_checked > 300


def _symbolic_node(rng, case):
    node, info = case.node(symbolic=rng.choice([None, "dynamic", "all"]))
    for name in list(info):  # forget some shapes / types entirely
        r = rng.random()
        if r < 0.1:
            info[name] = (None, None)
        elif r < 0.2:
            info[name] = (info[name][0], None)
    return node, info


def test_fuzz_chaos_never_raises(bases):
    from pagedkit.validators import validate_node

    rng = random.Random(SEED + 1)
    done = 0
    while done < N_CHAOS:
        case = bases.get(rng)
        for _ in range(rng.randint(1, 4)):
            try:
                rng.choice(TARGETED)(rng, case)
            except (Skip, IndexError, ValueError, KeyError):
                pass
        docs = PA_DOCS if case.op_type == "PagedAttention" else GQA_DOCS
        _no_internal(case.runtime_issues(outputs=rng.random() < 0.7), docs)
        try:
            node, info = _symbolic_node(rng, case)
        except Exception:  # onnx cannot express the mutated attribute; the runtime view was still checked
            node = None
        if node is not None:
            _no_internal(validate_node(node, info, case.constants() if rng.random() < 0.5 else None), docs)
        done += 1


def test_fuzz_contract_and_view_oddities():
    """Inputs no builder makes: scalars, python lists, unknown element types, 0-size tensors, odd attribute
    objects. Never a crash."""
    from pagedkit.validators import check_inputs

    case = paged_case("all_features")
    odd_inputs = [torch.tensor(3, dtype=torch.int32), [0, 1, 2], torch.zeros(0, dtype=torch.int32),
                  torch.zeros((2, 0), dtype=torch.float16), torch.tensor([1 + 2j]), 7, None]
    odd_attrs = [None, [1, 2], {"a": 1}, b"LATENT", 1e300, -0.0, True]
    rng = random.Random(SEED + 2)
    for name in list(case.inputs):
        for x in odd_inputs:
            inputs = dict(case.inputs, **{name: x})
            _no_internal(check_inputs(inputs, case.attrs, outputs=case.outputs), PA_DOCS)
    for attr in [a.name for a in get_contract("PagedAttention").attributes]:
        for v in odd_attrs:
            _no_internal(check_inputs(case.inputs, dict(case.attrs, **{attr: v}), outputs=None), PA_DOCS)
    g = gqa_case("rotary_position_ids")
    for name in list(g.inputs):
        for x in odd_inputs:
            issues = check_inputs(dict(g.inputs, **{name: x}), g.attrs, op_type="GroupQueryAttention",
                                  outputs=rng.choice([None, g.outputs]))
            _no_internal(issues, GQA_DOCS)
