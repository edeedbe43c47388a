"""Every fixed attention case (tests/cases: PagedAttention and GroupQueryAttention inputs with expected
outputs from pagedkit's reference kernels), wrapped as a single-node model, gives the expected result
through pagedkit.InferenceSession: by run() with numpy feeds (bf16 / fp8 through ml_dtypes) and by
run_torch() (caches updated in place).

This checks the session (graph wrapping, feeds, dtypes, in-place caches), not the math: on this machine a
GroupQueryAttention node runs on the same reference that wrote the expected outputs (GQA has no second
pagedkit variant). The GQA math is checked by tests/test_gqa_oracle.py (onnxruntime CPU for the cases
labelled so, an independent float64 oracle for all)."""

from __future__ import annotations

import numpy as np
import onnx
import pytest
from onnx import helper

from cases import compare_case, load_cases, load_index
from pagedkit import InferenceSession
from pagedkit.runtime.tensors import to_numpy, to_torch
from pagedkit.validators.contract import get_contract
from pagedkit.validators.nodeview import onnx_dtype_of

NAMES = [e["name"] for e in load_index()]


def single_node_model(case) -> onnx.ModelProto:
    """Graph inputs / outputs are named by the contract; absent optional positions are empty names."""
    contract = get_contract(case.op)
    ins = [p.name if p.name in case.inputs else "" for p in contract.inputs]
    outs = [p.name if p.name in case.expected else "" for p in contract.outputs]
    while ins and not ins[-1]:
        ins.pop()
    while outs and not outs[-1]:
        outs.pop()
    node = helper.make_node(case.op, ins, outs, name=case.name, domain="com.microsoft", **case.attrs)
    graph = helper.make_graph(
        [node], case.name,
        [helper.make_tensor_value_info(n, onnx_dtype_of(case.inputs[n]), list(case.inputs[n].shape)) for n in ins if n],
        [helper.make_tensor_value_info(n, onnx_dtype_of(case.expected[n]), list(case.expected[n].shape))
         for n in outs if n])
    return helper.make_model(graph, opset_imports=[helper.make_opsetid("", 21), helper.make_opsetid("com.microsoft", 1)])


def test_every_case_is_listed():
    assert len(NAMES) >= 60
    assert {e["op"] for e in load_index()} == {"PagedAttention", "GroupQueryAttention"}


@pytest.mark.parametrize("name", NAMES)
def test_case_through_session(name):
    (case,) = load_cases([name])
    sess = InferenceSession(single_node_model(case))
    out_names = [o.name for o in sess.get_outputs()]
    assert set(out_names) == set(case.expected)

    feeds = {n: to_numpy(t) for n, t in case.inputs.items()}
    before = {n: a.copy() for n, a in feeds.items()}
    got = dict(zip(out_names, sess.run(None, feeds)))
    compare_case(case, {n: to_torch(a) for n, a in got.items()})
    for n, a in feeds.items():  # the numpy path copies every feed, caches included
        assert a.tobytes() == before[n].tobytes(), n

    (fresh,) = load_cases([name])
    tfeeds = dict(fresh.inputs)
    out = sess.run_torch(tfeeds)
    compare_case(fresh, out)
    for n, t in out.items():
        np.testing.assert_array_equal(to_numpy(t), got[n], err_msg=n)  # run() and run_torch() agree exactly
    aliases = {"key_cache_out": "key_cache", "value_cache_out": "value_cache", "k_scale_cache_out": "k_scale_cache",
               "v_scale_cache_out": "v_scale_cache"}
    for o, i in aliases.items():  # PagedAttention cache outputs are the cache inputs, updated in place
        if o in out:
            assert out[o] is tfeeds[i]
