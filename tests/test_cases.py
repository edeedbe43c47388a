"""The case files (tests/cases): well-formed, small, covering every input, output and attribute of both
operators, and reproduced by the reference kernels that produced them."""

from __future__ import annotations

import pytest
import torch

from cases import HERE, load_cases, load_index, compare_case
from pagedkit.kernels.paged.reference import paged_attention
from pagedkit.kernels.gqa.reference import group_query_attention
from pagedkit.validators.contract import get_contract

INDEX = load_index()
KERNELS = {"PagedAttention": paged_attention, "GroupQueryAttention": group_query_attention}


def test_index_is_complete_and_small():
    assert len(INDEX) >= 40
    assert {e["op"] for e in INDEX} == set(KERNELS)
    assert len({e["name"] for e in INDEX}) == len(INDEX)
    files = {p.name for p in HERE.glob("*.npz")}
    assert files == {e["file"] for e in INDEX}
    assert sum(p.stat().st_size for p in HERE.iterdir() if p.is_file()) < 3_000_000


@pytest.mark.parametrize("op", sorted(KERNELS))
def test_cases_cover_every_input_output_and_attribute(op):
    contract = get_contract(op)
    entries = [e for e in INDEX if e["op"] == op]
    used_in = {t["name"] for e in entries for t in e["inputs"]}
    used_out = {t["name"] for e in entries for t in e["outputs"]}
    assert set(contract.input_names) - used_in == set()
    assert set(contract.output_names) - used_out == set()
    set_attrs = {k for e in entries for k, v in e["attributes"].items() if v != contract.attr(k).default}
    assert {a.name for a in contract.attributes} - set_attrs == set()


def test_loaded_tensors_match_the_index():
    for case, entry in zip(load_cases(), INDEX):
        assert case.name == entry["name"]
        for t in entry["inputs"]:
            assert list(case.inputs[t["name"]].shape) == t["shape"]
        for t in entry["outputs"]:
            assert list(case.expected[t["name"]].shape) == t["shape"]
            if t["name"] in case.expected.defined:
                assert case.expected.defined[t["name"]].shape == case.expected[t["name"]].shape


@pytest.mark.parametrize("name", [e["name"] for e in INDEX])
def test_reference_reproduces_case(name):
    case = load_cases([name])[0]
    before = {k: v.clone() for k, v in case.inputs.items()}
    got = KERNELS[case.op](case.inputs, outputs=list(case.expected), **case.attrs)
    compare_case(case, got, code_steps=0)
    if case.op == "GroupQueryAttention":  # GQA never writes its inputs
        for k, v in before.items():
            assert torch.equal(_bits(v), _bits(case.inputs[k])), f"input '{k}' was modified"


def _bits(t: torch.Tensor) -> torch.Tensor:
    return t.contiguous().view({1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}[t.element_size()])


def test_compare_case_catches_a_wrong_output():
    case = load_cases(["gqa_decode_ragged"])[0]
    got = group_query_attention(case.inputs, **case.attrs)
    got["output"][0, 0, 0] += 0.5
    with pytest.raises(AssertionError, match="output"):
        compare_case(case, got)
