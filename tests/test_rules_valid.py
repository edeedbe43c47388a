"""Valid nodes for the design doc's configurations validate clean: at run time (torch tensors, with and
without known outputs), statically (known shapes, symbolic dynamic axes, everything symbolic, nothing
known, integer constants known), and in the single-node model form ORT's own tests use."""

from __future__ import annotations

import onnx
import pytest

from nodes import GQA_CONFIGS, PAGED_CONFIGS, gqa_case, paged_case
from pagedkit.validators import validate_node
from pagedkit.validators.rules.paged_dims import paged_dims
from pagedkit.validators.checks import view_of_node
from pagedkit.validators.model import validate_model

ALL = [("PagedAttention", n) for n in PAGED_CONFIGS] + [("GroupQueryAttention", n) for n in GQA_CONFIGS]


def _case(op, name, seed=0):
    return paged_case(name, seed=seed) if op == "PagedAttention" else gqa_case(name, seed=seed)


def _clean(issues):
    assert issues == [], "\n".join(str(i) for i in issues)


@pytest.mark.parametrize("op,name", ALL, ids=[n for _, n in ALL])
@pytest.mark.parametrize("seed", [0, 1])
def test_valid_runtime(op, name, seed):
    case = _case(op, name, seed)
    _clean(case.runtime_issues())
    _clean(case.runtime_issues(outputs=False))


@pytest.mark.parametrize("op,name", ALL, ids=[n for _, n in ALL])
@pytest.mark.parametrize("symbolic", [None, "dynamic", "all"])
def test_valid_static(op, name, symbolic):
    case = _case(op, name)
    _clean(case.static_issues(symbolic=symbolic))
    _clean(case.static_issues(symbolic=symbolic, with_values=True))


@pytest.mark.parametrize("op,name", ALL, ids=[n for _, n in ALL])
def test_valid_with_nothing_known(op, name):
    node, _ = _case(op, name).node()
    _clean(validate_node(node))  # no shapes, no types: nothing can conflict
    _clean(validate_node(node, {n: (None, None) for n in list(node.input) + list(node.output) if n}))


@pytest.mark.parametrize("op,name", ALL, ids=[n for _, n in ALL])
def test_valid_single_node_model_form(op, name):
    """The form ORT's tests use: graph inputs feed the node, its cache outputs are graph outputs."""
    model = _case(op, name).model()
    graph = model.graph
    info = {}
    for vi in list(graph.input) + list(graph.output):
        tt = vi.type.tensor_type
        info[vi.name] = (tt.elem_type, tuple(d.dim_value if d.HasField("dim_value") else d.dim_param
                                             for d in tt.shape.dim))
    (node,) = graph.node
    _clean(validate_node(node, info))
    if op == "PagedAttention":
        assert "key_cache" in [i.name for i in graph.input]
        assert "key_cache_out" in [o.name for o in graph.output]


@pytest.mark.parametrize("name", list(PAGED_CONFIGS))
def test_validate_model_on_single_node_form(name):
    _clean(validate_model(paged_case(name).model()))


def test_mla_derived_dims():
    """DeepSeek-V3 absorbed MLA: head 576, v_head_size 512, rotary over the 64-channel suffix."""
    case = paged_case("mla_deepseek_v3")
    node, info = case.node()
    d = paged_dims(view_of_node(node, info))
    assert (d.mode, d.head_size, d.eff_v, d.kv, d.rotary_dim) == ("latent", 576, 512, 1, 64)
    assert case.out_info["output"][1] == (6, 16 * 512)


def test_int4_cache_head_size_is_packed():
    case = paged_case("int4_per_token_rotation")
    assert case.inputs["key_cache"].shape[-1] == 64
    node, info = case.node()
    d = paged_dims(view_of_node(node, info))
    assert (d.head_size, d.k_cache_head_size, d.v_cache_head_size) == (128, 64, 64)


def test_odd_head_size_int4_rounds_up():
    """(head_size + 1) // 2 for int4 when head_size is odd is only reachable through the formula (head_size % 8
    is enforced), so check the derivation directly."""
    from pagedkit.validators.rules.paged_dims import cache_head_size

    assert [cache_head_size(h, True) for h in (7, 8, 576)] == [4, 4, 288]
    assert cache_head_size(96, False) == 96


def test_block_size_has_no_upper_cap_and_no_batch_cap():
    case = paged_case("llama_gqa", block_size=1024, past=tuple(range(0, 600, 2)), q_lens=(1,) * 300,
                      num_heads=4, kv_num_heads=2, head_size=16, rotary=False)
    _clean(case.runtime_issues())
    _clean(case.static_issues(with_values=True))


def test_node_proto_round_trip_is_valid():
    node, info = paged_case("all_features").node()
    node2 = onnx.NodeProto.FromString(node.SerializeToString())
    _clean(validate_node(node2, info))
