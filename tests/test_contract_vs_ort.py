"""Our contract data must not drift from the schema onnxruntime (1.32.0) reports for the shipped part."""

import pytest

from pagedkit.validators.contract import GROUP_QUERY_ATTENTION, PAGED_ATTENTION

ort_state = pytest.importorskip("onnxruntime.capi.onnxruntime_pybind11_state")

OPTIONALITY = {"Single": False, "Optional": True}


def _ort_schema(name):
    for s in ort_state.get_all_operator_schema():
        if s.name == name and s.domain == "com.microsoft":
            return s
    pytest.skip(f"onnxruntime has no {name} schema")


def _check(contract, n_in, n_out):
    s = _ort_schema(contract.name)
    assert len(s.inputs) == n_in and len(s.outputs) == n_out
    for ours, theirs in zip(contract.inputs[:n_in], s.inputs):
        assert ours.name == theirs.name
        assert ours.optional == OPTIONALITY[theirs.option.name], ours.name
        assert ours.shipped
        assert set(contract.allowed_types(ours)) == set(
            {t.type_param_str: t.allowed_type_strs for t in s.type_constraints}.get(theirs.typeStr, [theirs.typeStr])
        ), ours.name
        assert ours.type_param == theirs.typeStr, ours.name
    for ours, theirs in zip(contract.outputs[:n_out], s.outputs):
        assert ours.name == theirs.name
        assert ours.optional == OPTIONALITY[theirs.option.name], ours.name
        assert ours.type_param == theirs.typeStr, ours.name
    assert all(not p.shipped for p in contract.inputs[n_in:] + contract.outputs[n_out:])
    shipped_attrs = {a.name for a in contract.attributes if a.shipped}
    assert shipped_attrs == set(s.attributes), shipped_attrs ^ set(s.attributes)
    for name, a in s.attributes.items():
        assert contract.attr(name).required == a.required, name
    return s


def test_paged_attention_matches_ort():
    s = _check(PAGED_ATTENTION, 17, 3)
    ort_tc = {t.type_param_str: set(t.allowed_type_strs) for t in s.type_constraints}
    for name in ("T", "T_CACHE", "T_KV_SCALE", "S"):
        assert set(PAGED_ATTENTION.type_constraints[name]) == ort_tc[name], name
    # our extensions use their own constraints, not widened shipped ones
    assert [p.index for p in PAGED_ATTENTION.inputs] == list(range(21))
    assert [p.index for p in PAGED_ATTENTION.outputs] == list(range(6))


def test_gqa_matches_ort():
    s = _check(GROUP_QUERY_ATTENTION, 17, 4)
    ort_tc = {t.type_param_str: set(t.allowed_type_strs) for t in s.type_constraints}
    assert {k: set(v) for k, v in GROUP_QUERY_ATTENTION.type_constraints.items()} == ort_tc


def test_defaults_match_ort():
    import onnx

    for contract in (PAGED_ATTENTION, GROUP_QUERY_ATTENTION):
        s = _ort_schema(contract.name)
        for name, a in s.attributes.items():
            raw = a._default_value if hasattr(a, "_default_value") else b""
            if not raw:
                continue
            proto = onnx.AttributeProto.FromString(raw)
            value = onnx.helper.get_attribute_value(proto)
            if isinstance(value, bytes):
                value = value.decode()
            assert contract.attr(name).default == pytest.approx(value), (contract.name, name)
