"""The reference kernels run on CUDA tensors too (issue 3: "in torch, on CPU and GPU"): every case file,
its inputs moved to the GPU, reproduces the expected outputs, and persistent GPU caches are updated in place."""

from __future__ import annotations

import pytest
import torch

from cases import compare_case, load_index, load_cases
from pagedkit.kernels import group_query_attention, paged_attention

KERNELS = {"PagedAttention": paged_attention, "GroupQueryAttention": group_query_attention}
pytestmark = pytest.mark.gpu


@pytest.mark.parametrize("name", [e["name"] for e in load_index()])
def test_case_on_cuda(name):
    case = load_cases([name])[0]
    inputs = {k: v.cuda() for k, v in case.inputs.items()}
    got = KERNELS[case.op](inputs, outputs=list(case.expected), **case.attrs)
    for k, v in got.items():
        assert v.device.type == "cuda", f"output '{k}' left the GPU"
    compare_case(case, {k: v.cpu() for k, v in got.items()}, code_steps=0)
    if case.op == "PagedAttention":
        for out_name, in_name in (("key_cache_out", "key_cache"), ("value_cache_out", "value_cache")):
            if out_name in got:
                assert got[out_name].data_ptr() == inputs[in_name].data_ptr(), f"{out_name} is not {in_name}"
