"""Kernel dispatch: variants declare themselves (pagedkit/kernels/variant.py), dispatch lists them lazily in
priority order, a session reports the serving variants of each node (creation, static facts only) and the
one that ran (per run, from the plan hint), a capturable requirement refuses non-capturable variants, the
reference fallback of contract-decisions §9, validation once at creation (validate_inputs / the env var
re-check per call), and docs/kernels.md generated from the declarations.

Oracles: the node's construction parameters (for the static facts), `validate_model` (for the issues a
session refuses at creation) and the loop-based reference kernel (for what a session computes).
"""

from __future__ import annotations

import warnings

import pytest
import torch
from onnx import helper

import dummy_variant
from nodes import make_gqa_case, make_paged_case
from pagedkit import InferenceSession
from pagedkit.kernels import dispatch
from pagedkit.kernels import docs as kernel_docs
from pagedkit.kernels.paged import prologue, reference
from pagedkit.kernels.variant import FEATURES, OP_FEATURES, KernelVariant
from pagedkit.validators import ValidationError, validate_model

DUMMY = "dummy_variant:VARIANT"
NODE = "PagedAttention_0"


@pytest.fixture
def dummy():
    variant = dispatch.register_variant(DUMMY)
    dummy_variant.CALLS.clear()
    try:
        yield variant
    finally:
        dispatch.unregister_variant(DUMMY)


def _clone(x: dict) -> dict:
    return {k: v.clone() for k, v in x.items()}


def _decode_case(**kw):
    kw = {"num_heads": 4, "kv_num_heads": 2, "head_size": 16, "past": (3, 17), "q_lens": (1, 1),
          "seed": 11} | kw
    return make_paged_case(**kw)


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max() / b.float().abs().max())


# ---- declarations ----------------------------------------------------------------------------------

def test_builtin_variants_are_declarations_in_priority_order():
    paged = dispatch.variants("PagedAttention")
    assert [v.name for v in paged] == ["triton_mla", "sdpa_prefill", "triton_paged", "torch_planned", "torch_sdpa", "reference"]
    assert [v.name for v in dispatch.variants("GroupQueryAttention")] == ["triton_gqa", "reference"]
    for v in dispatch.variants():
        assert isinstance(v, KernelVariant) and callable(v.load())
        assert set(v.features) <= set(OP_FEATURES[v.op]) <= set(FEATURES)
        assert v.capturable == (v.name.startswith("triton_") or v.name == "sdpa_prefill")  # the Triton prologue
        assert v.capturable or v.not_capturable_because
    assert [v.stages_on_cpu for v in paged] == [False, False, False, False, False, True]  # the reference is the fallback, last
    assert paged[0].devices == ("cuda",)  # never picked on the CPU
    assert len(dispatch.VARIANTS) == len(dispatch.variants())  # one "module:VARIANT" line each


def test_registration_is_idempotent_and_names_are_unique(dummy, tmp_path, monkeypatch):
    assert dispatch.register_variant(DUMMY) is dummy  # again: nothing changes
    assert [v.name for v in dispatch.variants("PagedAttention")].count("dummy_decode") == 1
    (tmp_path / "dummy_twin.py").write_text("from dummy_variant import VARIANT as _v\n"
                                            "import dataclasses\nVARIANT = dataclasses.replace(_v)\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    with pytest.raises(ValueError, match="already registered"):
        dispatch.register_variant("dummy_twin:VARIANT")


def test_declarations_are_checked():
    with pytest.raises(ValueError, match="unknown feature"):
        KernelVariant("x", "PagedAttention", reference.paged_attention, ("cpu",), ("float16",), True, ("warp",))
    with pytest.raises(ValueError, match="not capturable"):
        KernelVariant("x", "PagedAttention", reference.paged_attention, ("cpu",), ("float16",), False, ())


def test_node_info_carries_the_validators_static_facts():
    """NodeInfo from the model's value_info: the case's construction parameters, and no tensor values."""
    case = make_paged_case(num_heads=8, kv_num_heads=2, head_size=32, block_size=8, past=(0, 9), q_lens=(4, 1),
                           cache="int4", quant="PER_TOKEN", rotation=True, slot_mapping=True, head_sink=True,
                           packed=True, seed=2)
    node, value_info = case.node()
    info = dispatch.node_info(node, torch.device("cpu"), value_info)
    assert (info.num_heads, info.kv_num_heads, info.head_size, info.v_head_size) == (8, 2, 32, 32)
    assert info.block_size == 8 and info.max_blocks == case.inputs["block_table"].shape[1]
    assert info.num_blocks == case.inputs["key_cache"].shape[0]
    assert (info.t_dtype, info.k_cache_format, info.v_cache_format) == ("float16", "int4", "int4")
    assert (info.layout, info.input_mode) == ("SEPARATE", "packed")
    assert info.dtypes["key_cache"] == "uint8" and info.shapes["key_cache"] == tuple(case.inputs["key_cache"].shape)
    assert info.features == {"packed_qkv", "rotary", "int4_cache", "per_token_scales", "hadamard_rotation",
                             "slot_mapping", "head_sink"}
    assert not any(hasattr(info, n) for n in ("csl", "past", "values"))
    # without value_info: attributes and presence only, the dims unknown
    bare = dispatch.node_info(node, torch.device("cpu"))
    assert bare.head_size is None and bare.t_dtype is None and "rotary" in bare.features


# ---- creation: serving variants; run: the pick -----------------------------------------------------

def test_session_reports_serving_variants_and_the_one_that_ran():
    case = _decode_case()
    sess = InferenceSession(case.model())
    assert sess.attention_dispatch == {NODE: {"serving": ["torch_planned", "torch_sdpa", "reference"],
                                              "refused": {"triton_mla": "runs on cuda only, not cpu", "sdpa_prefill": "runs on cuda only, not cpu",
                                                            "triton_paged": "runs on cuda only, not cpu"}}}
    assert sess.attention_variants == {NODE: "torch_planned"}
    assert sess.last_run_variants == {}
    out = sess.run_torch(_clone(case.inputs))
    assert sess.last_run_variants == {NODE: "torch_planned"}
    ref = reference.paged_attention(_clone(case.inputs), outputs=case.outputs, **case.attrs)
    assert _rel(out["output"], ref["output"]) <= 2e-3
    with pytest.raises(ValueError, match="plan 'warp'"):
        sess.run_torch(_clone(case.inputs), plan="warp")


def test_registered_dummy_variant_is_picked_reported_refused_and_documented(dummy):
    # by default a registered variant goes before the reference of its op
    assert [v.name for v in dispatch.variants("PagedAttention")] == ["triton_mla", "sdpa_prefill", "triton_paged", "torch_planned",
                                                                      "torch_sdpa", "dummy_decode", "reference"]
    case = _decode_case()
    sess = InferenceSession(case.model())
    assert sess.attention_dispatch[NODE] == {"serving": ["torch_planned", "torch_sdpa", "dummy_decode", "reference"],
                                             "refused": {"triton_mla": "runs on cuda only, not cpu", "sdpa_prefill": "runs on cuda only, not cpu",
                                                         "triton_paged": "runs on cuda only, not cpu"}}
    sess.run_torch(_clone(case.inputs), plan="decode")  # torch_planned serves every plan and comes first
    assert sess.last_run_variants == {NODE: "torch_planned"} and dummy_variant.CALLS == []

    # placed first: a decode hint picks it, a run without a hint ("mixed") the next serving variant
    dispatch.unregister_variant(DUMMY)
    dispatch.register_variant(DUMMY, before="torch_planned")
    sess = InferenceSession(case.model())
    assert sess.attention_dispatch[NODE] == {"serving": ["dummy_decode", "torch_planned", "torch_sdpa", "reference"], "refused": {"triton_mla": "runs on cuda only, not cpu", "sdpa_prefill": "runs on cuda only, not cpu",
                                                      "triton_paged": "runs on cuda only, not cpu"}}
    assert sess.attention_variants == {NODE: "torch_planned"}  # what a run without a hint runs (checked below)
    feeds = _clone(case.inputs)
    out = sess.run_torch(feeds, plan="decode")
    assert sess.last_run_variants == {NODE: "dummy_decode"} and len(dummy_variant.CALLS) == 1
    assert dummy_variant.CALLS[0]["validate"] is False  # validated at creation, not per call
    ref = reference.paged_attention(_clone(case.inputs), outputs=case.outputs, **case.attrs)
    assert torch.equal(out["output"], ref["output"])  # the dummy is the reference behind a declaration
    assert torch.equal(feeds["key_cache"], ref["key_cache_out"])  # cache written in place
    out = sess.run_torch(_clone(case.inputs))
    assert sess.last_run_variants == {NODE: "torch_planned"} and len(dummy_variant.CALLS) == 1
    assert _rel(out["output"], ref["output"]) <= 2e-3

    # refused, with its reason, for nodes it does not serve (static facts: head size, cache format)
    wide = InferenceSession(_decode_case(head_size=64).model()).attention_dispatch[NODE]
    assert wide["serving"] == ["torch_planned", "torch_sdpa", "reference"]
    assert "head_size <= 32" in wide["refused"]["dummy_decode"] and "64" in wide["refused"]["dummy_decode"]
    quant = InferenceSession(_decode_case(cache="int8", quant="PER_TENSOR").model()).attention_dispatch[NODE]
    assert quant["refused"] == {"triton_mla": "runs on cuda only, not cpu", "sdpa_prefill": "runs on cuda only, not cpu", "sdpa_prefill": "runs on cuda only, not cpu",
                                "triton_paged": "runs on cuda only, not cpu",
                                "torch_planned": "does not serve feature(s) int8_cache",
                               "dummy_decode": "does not serve feature(s) int8_cache"}

    # the generated table lists it with its declaration
    text = kernel_docs.render()
    row = next(line for line in text.splitlines() if line.startswith("| ") and "`dummy_decode`" in line)
    assert "| cpu |" in row and "`float16` |" in row and "| yes |" in row and "| decode |" in row
    features = text.split("## PagedAttention: features served")[1].split("\n## ")[0].splitlines()
    header = [c.strip() for c in features[2].split("|")[1:-1]]
    col = header.index("`dummy_decode`")
    served = {r.split("|")[1].strip().strip("`") for r in features[4:] if r.startswith("| ")
              and r.split("|")[1:-1][col].strip() == "yes"}
    assert served == set(dummy.features)


def test_capturable_requirement_refuses_non_capturable_variants_by_name(dummy):
    dispatch.unregister_variant(DUMMY)
    case = _decode_case()
    with pytest.raises(NotImplementedError) as err:
        InferenceSession(case.model(), capturable=True)
    msg = str(err.value)
    assert NODE in msg and "torch_sdpa: not CUDA-graph capturable" in msg and "torch_planned: not CUDA-graph" in msg and "reference: not CUDA-graph" in msg
    dispatch.register_variant(DUMMY)  # declares itself capturable and serves this node
    sess = InferenceSession(case.model(), capturable=True)
    report = sess.attention_dispatch[NODE]
    assert report["serving"] == ["dummy_decode"]
    assert set(report["refused"]) == {"triton_mla", "sdpa_prefill", "triton_paged", "torch_planned", "torch_sdpa",
                                      "reference"}
    assert report["refused"]["triton_paged"] == "runs on cuda only, not cpu"
    sess.run_torch(_clone(case.inputs), plan="decode")
    assert sess.last_run_variants == {NODE: "dummy_decode"}
    with pytest.raises(ValueError, match="no serving variant serves plan None"):  # it serves decode steps only
        sess.run_torch(_clone(case.inputs))


def test_reference_fallback_on_cuda_is_allowed_with_a_warning_or_refused():
    """contract-decisions §9 at the dispatch level (no GPU needed: binding reads no tensor)."""
    gqa = make_gqa_case(seed=1)
    node, value_info = gqa.node()
    cuda = torch.device("cuda")
    with pytest.raises(NotImplementedError, match="allow_reference_fallback") as err:
        dispatch.bind(node, None, cuda, allow_reference_fallback=False, value_info=value_info)
    assert node.name in str(err.value) and "CPU copies" in str(err.value)
    dispatch._warned.discard(node.name)
    with pytest.warns(UserWarning, match="loop-based reference"):
        call = dispatch.bind(node, None, cuda, value_info=value_info)
    assert call.name == "reference" and call.report()["serving"] == ["reference"]
    paged, paged_vi = _decode_case().node()
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # torch_planned / torch_sdpa serve CUDA: no fallback, no warning
        call = dispatch.bind(paged, None, cuda, allow_reference_fallback=False, value_info=paged_vi)
    assert call.report()["serving"] == ["sdpa_prefill", "triton_paged", "torch_planned", "torch_sdpa"]  # mla: LATENT
    assert "LATENT only" in call.refused["triton_mla"]
    assert "allow_reference_fallback" in call.refused["reference"]
    assert dispatch.bind(paged, None, cuda, value_info=paged_vi).report()["serving"] == [
        "sdpa_prefill", "triton_paged", "torch_planned", "torch_sdpa", "reference"]


# ---- validation at creation --------------------------------------------------------------------------

def test_an_invalid_attention_node_fails_creation_with_every_reason():
    case = _decode_case()
    case.attrs.update(kv_num_heads=3, scale=-1.0, local_window_size=-7)  # three independent violations
    model = case.model()
    expected = [i for i in validate_model(model) if not i.rule.startswith("MODEL-")]
    assert len({i.rule for i in expected}) >= 3
    with pytest.raises(ValidationError) as err:
        InferenceSession(model)
    assert err.value.issues == expected
    for issue in expected:
        assert str(issue) in str(err.value)


def test_inputs_are_checked_per_call_only_on_request(monkeypatch):
    calls = []
    real = prologue.require_valid_inputs
    monkeypatch.setattr(prologue, "require_valid_inputs", lambda *a, **k: (calls.append(1), real(*a, **k))[1])
    case = _decode_case()
    monkeypatch.delenv("PAGEDKIT_VALIDATE_INPUTS", raising=False)
    sess = InferenceSession(case.model())
    assert sess.validate_inputs is False
    out = sess.run_torch(_clone(case.inputs))
    assert calls == []
    on = InferenceSession(case.model(), validate_inputs=True)
    checked = on.run_torch(_clone(case.inputs))
    assert calls == [1] and torch.equal(out["output"], checked["output"])
    monkeypatch.setenv("PAGEDKIT_VALIDATE_INPUTS", "1")
    assert InferenceSession(case.model()).validate_inputs is True
    assert InferenceSession(case.model(), validate_inputs=False).validate_inputs is False


@pytest.mark.parametrize("validate_inputs", [False, True])
def test_bad_values_are_a_validation_error_either_way(validate_inputs):
    """Unvalidated, the kernel's index guard trips first and the validator then names every issue."""
    case = _decode_case(slot_mapping=True)
    node, info = case.node(symbolic="dynamic")  # token / batch extents symbolic: values unknown at creation
    graph = helper.make_graph([node], "pa", [helper.make_tensor_value_info(n, *info[n]) for n in node.input if n],
                              [helper.make_tensor_value_info(n, *info[n]) for n in node.output if n])
    model = helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21),
                                                    helper.make_opsetid("com.microsoft", 1)])
    sess = InferenceSession(model, validate_inputs=validate_inputs)
    feeds = _clone(case.inputs)
    nb, bs = feeds["key_cache"].shape[:2]
    feeds["slot_mapping"][0] = nb * bs + 3
    before = feeds["key_cache"].clone()
    with pytest.raises(ValidationError, match="slot_mapping") as err:
        sess.run_torch(feeds)
    assert NODE in str(err.value) and torch.equal(feeds["key_cache"], before)


# ---- docs/kernels.md -----------------------------------------------------------------------------------

def test_committed_kernel_doc_is_current():
    assert not kernel_docs.stale(), (f"stale docs/kernels.md; regenerate it with `{kernel_docs.COMMAND}` "
                                     "and commit the result")


def test_kernel_doc_check_mode(tmp_path, capsys):
    out = tmp_path / "kernels.md"
    assert kernel_docs.main(["--out", str(out), "--check"]) == 1
    assert "regenerate with" in capsys.readouterr().out
    assert kernel_docs.main(["--out", str(out)]) == 0 and kernel_docs.main(["--out", str(out), "--check"]) == 0
    for v in dispatch.variants():
        assert f"`{v.name}`" in out.read_text()
