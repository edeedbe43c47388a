"""The dense MoE path (every expert on every token, routing weights applied after: ops/moe.py `_all_experts`,
what a CUDA decode step with more routes than experts runs, capturable) gives the grouped path's result (the
path test_ops_moe*.py checks against onnxruntime's CPU kernel). Teeth: routing weights of the wrong
experts change the result."""

from __future__ import annotations

import pytest
import torch

from pagedkit.runtime.ops import moe as M


class _Ctx:
    node_name = "moe"


@pytest.mark.parametrize("act,fusion,fc3", [("swiglu", 2, False), ("swiglu", 1, False), ("silu", 0, True),
                                             ("gelu", 0, False)])
def test_dense_experts_equal_the_grouped_path(act, fusion, fc3):
    g = torch.Generator().manual_seed(1)
    T, E, H, I, k = 12, 8, 32, 24, 3  # T * k > E: the grouped path
    x, router = torch.randn(T, H, generator=g), torch.randn(T, E, generator=g)
    wide = 2 * I if act == "swiglu" else I
    w1, w2 = torch.randn(E, wide, H, generator=g) * 0.2, torch.randn(E, H, I, generator=g) * 0.2
    b1, b2 = torch.randn(E, wide, generator=g) * 0.1, torch.randn(E, H, generator=g) * 0.1
    w3 = torch.randn(E, I, H, generator=g) * 0.2 if fc3 else None
    attrs = dict(k=k, activation_type=act, swiglu_fusion=fusion, normalize_routing_weights=1)
    weights = (w1, b1, w2, b2, w3, None)
    ref = M.moe([x, router, w1, b1, w2, b2, w3, None], attrs, _Ctx)[0]
    probs = torch.softmax(router, -1)
    top_w, top_e = torch.topk(probs, k)
    top_w = top_w / top_w.sum(-1, keepdim=True)
    y = M._all_experts(x, weights, attrs, "moe")  # [E, T, H]
    dense = torch.zeros(T, E).scatter_(1, top_e, top_w)
    got = (y * dense.T.unsqueeze(-1)).sum(0)
    assert float((got - ref).abs().max() / ref.abs().max()) <= 1e-5
    wrong = torch.zeros(T, E).scatter_(1, (top_e + 1) % E, top_w)  # teeth: the neighbouring experts
    bad = (y * wrong.T.unsqueeze(-1)).sum(0)
    assert float((bad - ref).abs().max() / ref.abs().max()) > 1e-2
