"""The planned torch PagedAttention (pagedkit.kernels.paged.torch_planned, variant "torch_planned", the
runtime's fast CPU path) against the loop-based reference, with test_torch_paged's machinery: the same
agreement (float32 output within 1e-5 x max|ref|, caches bit-identical, updated in place), NaN-poisoned
allocations and NaN in every cache slot no sequence may admit. Every configuration of test_torch_paged whose
features the variant declares runs here; the others must be refused by dispatch, naming the feature.
The plan is shared through a run scope (kernels/scope.py): a second node in the same scope reuses it, and a
step whose lengths change between runs never sees a stale plan.
"""

from __future__ import annotations

import pytest
import torch

import test_torch_paged as tp
from cases import compare_case
from pagedkit.kernels import dispatch
from pagedkit.kernels.paged import reference
from pagedkit.kernels.paged import torch_planned as planned
from pagedkit.kernels.scope import run_scope

poison_allocations = tp.poison_allocations  # the autouse fixture, here too
_FORMAT = {torch.int8: "int8", torch.float8_e4m3fn: "float8e4m3fn", torch.uint8: "int4"}


def _info(attrs: dict, inputs: dict, outputs) -> dispatch.NodeInfo:
    info = dispatch.NodeInfo("PagedAttention", dict(attrs), set(inputs), set(outputs or ()), torch.device("cpu"))
    info.k_cache_format = _FORMAT.get(inputs["key_cache"].dtype)
    if "value_cache" in inputs:
        info.v_cache_format = _FORMAT.get(inputs["value_cache"].dtype)
    return info


# What torch_planned does not serve, as data (its declared features: float caches only, no latent cache,
# slot_mapping, query_positions, head_sink, softcap, attention_bias, output_qk, Hadamard rotation): each of these
# must be refused by name, every other case served; a refusal the code starts or stops giving fails here.
REFUSED_CASE_FILES = {
    "paged_all_features_bf16", "paged_bias_probs_sink", "paged_bias_scores", "paged_fp8_per_channel",
    "paged_fp8_per_tensor", "paged_fp8_per_token", "paged_int4_per_channel", "paged_int4_per_tensor",
    "paged_int4_per_token_rotation", "paged_int8_per_channel_bf16", "paged_int8_per_tensor",
    "paged_int8_per_token_f32_scales", "paged_mla_int8_per_tensor", "paged_mla_latent",
    "paged_query_positions_shifted", "paged_rotation_float_cache", "paged_sink_window_softcap",
    "paged_slot_mapping_explicit", "paged_slot_mapping_skips"}
REFUSED_CONFIGS = {
    "all_features", "bias_probs_sink_decode", "bias_scores", "fp8_per_channel", "fp8_per_channel_decode",
    "fp8_per_tensor", "fp8_per_tensor_decode", "fp8_per_token", "fp8_per_token_decode", "int4_per_channel",
    "int4_per_channel_decode", "int4_per_tensor", "int4_per_tensor_decode", "int4_per_token",
    "int4_per_token_decode", "int8_per_channel", "int8_per_channel_decode", "int8_per_tensor",
    "int8_per_tensor_decode", "int8_per_token", "int8_per_token_decode", "int8_per_token_f32_scales_rotation",
    "latent", "latent_int4_per_token_sink_free_qk", "latent_int8_per_tensor", "qk_norm_rotation",
    "query_positions", "softcap_sink"}


def _check(case, refused: bool = False, **kw):
    refusal = planned.supports(_info(case.attrs, case.inputs, case.outputs))
    if refused:
        assert refusal is not None and ("feature" in refusal or "cache format" in refusal), refusal
        return None
    assert refusal is None, f"torch_planned should serve this case: {refusal}"
    return tp.check_against_reference(case.inputs, case.attrs, case.outputs, impl=planned.paged_attention, **kw)


@pytest.mark.parametrize("case", tp.PAGED_CASES, ids=[c.name for c in tp.PAGED_CASES])
def test_case_file(case):
    refusal = planned.supports(_info(case.attrs, case.inputs, case.expected))
    if case.name in REFUSED_CASE_FILES:
        assert refusal is not None and "feature" in refusal, refusal
        return
    assert refusal is None, f"torch_planned should serve {case.name}: {refusal}"
    got = planned.paged_attention(tp._clone(case.inputs), outputs=list(case.expected), **case.attrs)
    compare_case(case, got, code_steps=0)
    tp.check_against_reference(case.inputs, case.attrs, list(case.expected), impl=planned.paged_attention)


def test_serves_enough_case_files():
    served = [c for c in tp.PAGED_CASES if planned.supports(_info(c.attrs, c.inputs, c.expected)) is None]
    assert len(served) >= 8, [c.name for c in served]


@pytest.mark.parametrize("seed", [0, 1])
@pytest.mark.parametrize("name", sorted(tp.CONFIGS))
def test_random_configuration(name, seed):
    _check(tp._case(seed=seed, **tp.CONFIGS[name]), refused=name in REFUSED_CONFIGS)


@pytest.mark.parametrize("causal", [1, 0])
@pytest.mark.parametrize("window", [1, 7, 16, 500])
@pytest.mark.parametrize("shape", sorted(tp.WINDOW_SHAPES))
def test_window(shape, window, causal):
    _check(tp._case(seed=window + causal, attrs={"local_window_size": window, "is_causal": causal},
                    **tp.WINDOW_SHAPES[shape]))


def test_window_with_unmapped_leading_blocks():
    case = tp._case(past=(70, 100, 3), q_lens=(1, 3, 2), seed=3, attrs={"local_window_size": 20})
    for b in range(3):
        case.inputs["block_table"][b, :max(0, int(case.inputs["past_seqlens"][b]) - 19) // 16] = -1
    _check(case)


def test_row_with_no_admitted_key_outputs_zero():
    case = tp._case(past=(10, 20, 5), q_lens=(2, 1, 1), seed=9, attrs={"local_window_size": 3})
    case.inputs["block_table"][1, 1] = -1
    got = _check(case)
    assert torch.equal(got["output"][2], torch.zeros_like(got["output"][2]))
    assert got["output"][[0, 1, 3]].abs().amax(-1).gt(0).all()


@pytest.mark.parametrize("window", [0, 9])
def test_chunked_rows_and_split_groups(monkeypatch, window):
    """A tiny budget forces prefill row chunks and several decode groups."""
    monkeypatch.setattr(planned, "BUDGET", 60)
    case = tp._case(past=(0, 30, 2, 45, 8, 19), q_lens=(41, 1, 1, 1, 18, 1), seed=5,
                    attrs={"local_window_size": window} if window else {})
    plan = planned._plan(case.inputs["cumulative_sequence_length"], case.inputs["past_seqlens"],
                         case.inputs["block_table"], 63, case.inputs["key_cache"].shape[0], 16, True, window,
                         torch.device("cpu"))
    assert sum(it.bg == 1 and 0 < it.rows < 41 for it in plan.items) >= 3
    assert sum(it.rows == 1 for it in plan.items) >= 2
    _check(case)


def test_whole_prompt_uses_is_causal_and_decode_needs_no_mask():
    prompt = tp._case(past=(0,), q_lens=(37,), seed=2)
    p = planned._plan(prompt.inputs["cumulative_sequence_length"], prompt.inputs["past_seqlens"],
                      prompt.inputs["block_table"], 37, prompt.inputs["key_cache"].shape[0], 16, True, 0,
                      torch.device("cpu"))
    assert len(p.items) == 1 and p.items[0].causal and p.items[0].mask is None and p.items[0].tok is None
    _check(prompt)
    step = tp._case(past=(52,), q_lens=(1,), seed=3)
    p = planned._plan(step.inputs["cumulative_sequence_length"], step.inputs["past_seqlens"],
                      step.inputs["block_table"], 1, step.inputs["key_cache"].shape[0], 16, True, 0,
                      torch.device("cpu"))
    assert p.items[0].mask is None and not p.items[0].causal and p.items[0].ctx == 53
    _check(step)


def test_plan_shared_in_a_scope_and_fresh_per_scope():
    """Two layers of one run share the plan (same bookkeeping tensors); the next run (another scope) with
    other lengths plans again; results equal the reference each time."""
    calls = []
    real = planned._plan

    def counting(*a, **k):
        calls.append(1)
        return real(*a, **k)

    case = tp._case(past=(5, 30), q_lens=(1, 1), seed=4)
    x = tp._clone(case.inputs)
    planned._plan = counting
    try:
        with run_scope():
            layer0 = planned.paged_attention(tp._clone(x), outputs=case.outputs, **case.attrs)
            shared = {k: x[k] for k in ("cumulative_sequence_length", "past_seqlens", "block_table")}
            second = {**tp._clone(x), **shared}
            layer1 = planned.paged_attention(second, outputs=case.outputs, **case.attrs)
            layer2 = planned.paged_attention({**tp._clone(x), **shared}, outputs=case.outputs, **case.attrs)
        assert len(calls) == 2  # layer0's inputs were clones: their own plan; layers 1 and 2 share one
        assert torch.equal(layer1["output"], layer2["output"])
        other = tp._case(past=(6, 31), q_lens=(2, 1), seed=5)
        with run_scope():
            got = planned.paged_attention(tp._clone(other.inputs), outputs=other.outputs, **other.attrs)
        assert len(calls) == 3
    finally:
        planned._plan = real
    ref = reference.paged_attention(tp._clone(other.inputs), outputs=other.outputs, **other.attrs)
    assert tp._rel(got["output"], ref["output"]) <= tp.TOL_T
    assert tp._rel(layer0["output"], layer1["output"]) == 0


def test_teeth_wrong_scale_fails():
    """The agreement check catches a 2% wrong scale in this variant."""
    case = tp._case(seed=1, **tp.CONFIGS["decode"])
    attrs = dict(case.attrs, scale=1.02 / 32 ** 0.5)

    def wrong(x, **kw):
        kw["scale"] = 1.02 / 32 ** 0.5
        return planned.paged_attention(x, **kw)

    with pytest.raises(AssertionError):
        tp.check_against_reference(case.inputs, case.attrs, case.outputs, impl=wrong)
    assert attrs["scale"] != case.attrs.get("scale", 0)


def test_dispatch_prefers_it_and_refuses_by_feature():
    plain = tp._case(seed=0, **tp.CONFIGS["decode"])
    assert planned.supports(_info(plain.attrs, plain.inputs, plain.outputs)) is None
    quant = tp._case(seed=0, **tp.CONFIGS["int8_per_tensor"])
    assert "int8_cache" in planned.supports(_info(quant.attrs, quant.inputs, quant.outputs))
    sink = tp._case(seed=0, **tp.CONFIGS["softcap_sink"])
    assert "head_sink" in planned.supports(_info(sink.attrs, sink.inputs, sink.outputs))
    # the CPU's first two (triton_paged, first overall, runs on CUDA only)
    cpu_first = [v.name for v in dispatch.variants("PagedAttention") if "cpu" in v.devices][:2]
    assert cpu_first == ["torch_planned", "torch_sdpa"]
