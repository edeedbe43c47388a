"""kernels/triton/moe_route.py (MoE routing and the grouped GEMMs' plan in one launch), through Triton's interpreter,
against an oracle that shares no code with it: float64 softmax, top-k by a Python sort over (-p, expert id), and the
plan counted by loops (a stable bucket sort of the routes by expert). Then com.microsoft MoE with the kernel's routing
against the same op routed by torch, both over the fused expert kernel.

Cases: E 8 / 64 / 3 (not a power of two), k 1 / 2 / 6, a single token, T * k past E (experts repeat: the sort's
stability shows), normalize on / off, float16 / bfloat16 / float32 routers, a router with a row stride; refusals.
Teeth: an unstable order, counts of a neighbour expert, top-k that keeps the padded experts in play.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

route = pytest.importorskip("pagedkit.kernels.triton.moe_route")
if not route.common.HAVE_TRITON:
    pytest.skip("triton is not installed", allow_module_level=True)


def oracle(router: torch.Tensor, k: int, normalize: bool, bm: int):
    x = router.reshape(-1, router.shape[-1]).double().numpy()
    top_e, top_w = [], []
    for row in x:
        p = np.exp(row - row.max())
        p /= p.sum()
        chosen = sorted(range(len(p)), key=lambda e: (-p[e], e))[:k]
        w = np.array([p[e] for e in chosen])
        top_e.append(chosen)
        top_w.append(w / w.sum() if normalize else w)
    flat = [e for row in top_e for e in row]
    n_exp = router.shape[-1]
    buckets = [[r for r, e in enumerate(flat) if e == x] for x in range(n_exp)]  # stable: routes in order
    order = [r for b in buckets for r in b]
    counts = [len(b) for b in buckets]
    start = [sum(counts[:x]) for x in range(n_exp)]
    tiles = [-(-c // bm) for c in counts]
    tile_end = [sum(tiles[: x + 1]) for x in range(n_exp)]
    return np.array(top_e), np.array(top_w), [np.array(v) for v in (order, counts, start, tiles, tile_end)]


def _router(t, e, dtype, seed, stride_pad=0):
    g = torch.Generator().manual_seed(seed)
    full = torch.randn(t, e + stride_pad, generator=g) * 2
    return full[:, :e].to(dtype) if stride_pad else full.to(dtype)


CASES = [(1, 8, 2, True), (5, 8, 2, False), (16, 8, 2, True), (33, 64, 6, False), (7, 64, 6, True), (9, 3, 1, False),
         (12, 3, 3, True), (64, 64, 6, False), (4, 2, 1, False), (3, 1, 1, True)]


@pytest.mark.parametrize("t, e, k, normalize", CASES)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_route_plan_matches_the_oracle(t, e, k, normalize, dtype):
    router = _router(t, e, dtype, seed=t * 100 + e + k)
    assert route.serves(router, k, {}) is None
    top_e, top_w, plan = route.route_plan(router, k, normalize, 16)
    ref_e, ref_w, ref_plan = oracle(router, k, normalize, 16)
    assert top_e.dtype == torch.int64 and top_w.dtype == torch.float32 and top_e.shape == (t, k)
    assert np.array_equal(top_e.numpy(), ref_e)
    assert np.abs(top_w.double().numpy() - ref_w).max() <= 1e-6 * max(1.0, np.abs(ref_w).max())
    for name, got, ref in zip(("order", "counts", "start", "tiles", "tile_end"), plan, ref_plan):
        assert got.dtype == torch.int32 and np.array_equal(got.numpy(), ref), name


def test_matches_the_torch_plan_of_the_fused_kernel():
    """The plan equals the one moe.py's fused_moe builds with torch from the same top-k (argsort stable, ...)."""
    router = _router(40, 64, torch.float16, seed=3)
    top_e, _, plan = route.route_plan(router, 6, False, 16)
    route_e = top_e.reshape(-1)
    order = torch.argsort(route_e, stable=True).to(torch.int32)
    counts = torch.bincount(route_e, minlength=64).to(torch.int32)
    assert torch.equal(plan[0], order) and torch.equal(plan[1], counts)
    assert torch.equal(plan[2], (torch.cumsum(counts, 0) - counts).to(torch.int32))


def test_a_row_stride_and_poisoned_outputs(monkeypatch):
    router = _router(6, 8, torch.float32, seed=9, stride_pad=5)
    assert router.stride(0) == 13
    real_empty = torch.empty

    def poisoned(*a, **kw):  # every output starts as garbage: an unwritten element shows
        out = real_empty(*a, **kw)
        return out.fill_(-7 if not out.is_floating_point() else float("nan"))
    monkeypatch.setattr(torch, "empty", poisoned)
    top_e, top_w, plan = route.route_plan(router, 2, True, 4)
    monkeypatch.undo()
    ref_e, ref_w, ref_plan = oracle(router, 2, True, 4)
    assert np.array_equal(top_e.numpy(), ref_e) and np.allclose(top_w.numpy(), ref_w, rtol=1e-6)
    for got, ref in zip(plan, ref_plan):
        assert np.array_equal(got.numpy(), ref)


@pytest.mark.parametrize("router, k, attrs, why", [
    (torch.zeros(4, 8), 2, {"use_sparse_mixer": 1}, "use_sparse_mixer"),
    (torch.zeros(4, 8), 9, {}, "k=9 of 8 experts"),
    (torch.zeros(4, 8, dtype=torch.int32), 2, {}, "router torch.int32"),
    (torch.zeros(600, 64), 6, {}, "600 tokens x k 6 x 64 experts"),
    (torch.zeros(100, 64), 6, {}, "100 tokens x k 6 x 64 experts"),  # the routes' cells alone exceed MAX_CELLS
])
def test_refusals(router, k, attrs, why):
    assert why in route.serves(router, k, attrs)


def test_the_largest_decode_steps_served():
    assert route.serves(torch.zeros(64, 64), 6, {}) is None  # 384 routes -> 512 x 64 cells
    assert route.serves(torch.zeros(16, 256), 8, {}) is None  # DeepSeek-V3's 256 experts, 128 routes


def test_moe_op_routed_by_the_kernel_equals_the_torch_routing(monkeypatch):
    """com.microsoft MoE (runtime/ops/moe.py) over the fused expert kernel, routed by this kernel and by torch: the
    same experts, outputs within float32 rounding of the routing weights."""
    from pagedkit.runtime.ops import moe
    from pagedkit.runtime.ops.util import triton_kernels

    monkeypatch.setattr(moe, "triton_moe_refusal", lambda xs, w, a: triton_kernels("moe").serves(xs, w, a))
    g = torch.Generator().manual_seed(4)
    t, e, h, inter, k = 11, 8, 32, 16, 2
    x = torch.randn(t, h, generator=g).half()
    router = torch.randn(t, e, generator=g).half()
    fc1 = (torch.randn(e, 2 * inter, h, generator=g) * 0.2).half()
    fc2 = (torch.randn(e, h, inter, generator=g) * 0.2).half()
    attrs = {"k": k, "activation_type": "swiglu", "swiglu_fusion": 1, "normalize_routing_weights": 1}
    ctx = type("Ctx", (), {"node_name": "moe0"})()
    inputs = [x, router, fc1, None, fc2]
    monkeypatch.setattr(moe, "ROUTE_KERNEL", True)
    got = moe.moe(inputs, attrs, ctx)[0].float()
    assert moe.ROUTES["moe0"] == "triton" and moe.ROUTED_BY["moe0"] == "kernel"
    monkeypatch.setattr(moe, "ROUTE_KERNEL", False)
    ref = moe.moe(inputs, attrs, ctx)[0].float()
    assert moe.ROUTED_BY["moe0"] == "torch"
    assert float((got - ref).abs().max() / ref.abs().max()) <= 2e-3


def test_op_routes_with_torch_once_the_kernel_fails(monkeypatch):
    """A routing kernel that fails to build or run on the device warns once, records why, and torch routes this call
    and every later one, with the same result."""
    from pagedkit.runtime.ops import moe
    from pagedkit.runtime.ops.util import triton_kernels

    monkeypatch.setattr(moe, "triton_moe_refusal", lambda xs, w, a: triton_kernels("moe").serves(xs, w, a))
    monkeypatch.setattr(moe, "ROUTE_FAILURE", [])
    monkeypatch.setattr(moe, "ROUTE_KERNEL", True)
    g = torch.Generator().manual_seed(5)
    x, router = torch.randn(3, 16, generator=g), torch.randn(3, 4, generator=g)
    fc1, fc2 = torch.randn(4, 8, 16, generator=g) * 0.3, torch.randn(4, 16, 8, generator=g) * 0.3
    attrs, ctx = {"k": 2, "activation_type": "relu"}, type("Ctx", (), {"node_name": "moe_rf"})()
    ok = moe.moe([x, router, fc1, None, fc2], attrs, ctx)[0]

    def broken(*a, **k):
        raise RuntimeError("PassManager::run failed")
    monkeypatch.setattr(route, "route_plan", broken)
    with pytest.warns(RuntimeWarning, match="routing kernel failed"):
        got = moe.moe([x, router, fc1, None, fc2], attrs, ctx)[0]
    assert moe.ROUTE_FAILURE == ["RuntimeError: PassManager::run failed"] and moe.ROUTED_BY["moe_rf"] == "torch"
    again = moe.moe([x, router, fc1, None, fc2], attrs, ctx)[0]
    assert torch.allclose(got, ok, rtol=1e-5, atol=1e-6) and torch.equal(got, again)


def test_routed_moe_logits_minus_inf_outside_the_chosen_experts():
    """exporters/moe.py `routed_moe` (DeepSeek-V3, GLM-4-MoE routing computed in the graph) feeds log(w) at the k
    chosen experts and -inf elsewhere: the kernel must pick exactly those, with softmax weights w / sum(w)."""
    g = torch.Generator().manual_seed(12)
    t, e, k = 10, 64, 6
    chosen = torch.stack([torch.randperm(e, generator=g)[:k] for _ in range(t)])
    w = torch.rand(t, k, generator=g) + 0.1
    router = torch.full((t, e), float("-inf")).scatter(1, chosen, w.log()).half()
    top_e, top_w, plan = route.route_plan(router, k, False, 16)
    ref_e, ref_w, ref_plan = oracle(router, k, False, 16)
    assert np.array_equal(top_e.numpy(), ref_e)
    assert set(map(tuple, np.sort(top_e.numpy(), 1))) == set(map(tuple, np.sort(chosen.numpy(), 1)))
    assert np.allclose(top_w.numpy(), ref_w, rtol=1e-6, atol=1e-7)
    assert all(np.array_equal(a.numpy(), b) for a, b in zip(plan, ref_plan))
