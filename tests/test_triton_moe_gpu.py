"""The MoE op on CUDA through kernels/triton/moe.py (GPU: `pytest -m gpu`): the op routes CUDA tensors to the fused
kernel at decode and prefill sizes (ROUTES says "triton") and matches the same op on the CPU (its torch path,
float32 products) and the float64 loop of tests/test_triton_moe.py; a CUDA-graph replay equals the eager call bit
for bit (no host read in the plan).
"""

from __future__ import annotations

import pytest
import torch

from test_triton_moe import TOL, make, oracle

pytestmark = pytest.mark.gpu


def _op(xs, router, w, attrs, name="moe0"):
    from pagedkit.runtime.ops.moe import moe
    from pagedkit.runtime.ops.registry import OpContext

    return moe([xs, router, *w], attrs, OpContext(node_name=name, device=xs.device))[0]


@pytest.mark.parametrize("n_tok", [1, 8, 100])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_op_routes_to_the_fused_kernel(n_tok, dtype):
    from pagedkit.runtime.ops.moe import ROUTES

    xs, _, _, w, attrs = make(n_tok=n_tok, k=6, n_exp=64, hidden=256, inter=128, dtype=dtype, seed=n_tok)
    attrs["normalize_routing_weights"] = 0
    g = torch.Generator().manual_seed(7)  # router logits without ties (bfloat16 rounds random ones onto ties at the
    router = (torch.stack([torch.randperm(64, generator=g) for _ in range(n_tok)]) * 0.07 - 2.2).to(dtype)  # top-k)
    cuda = [t.cuda() if t is not None else None for t in w]
    got = _op(xs.cuda(), router.cuda(), cuda, attrs).float().cpu()
    assert ROUTES["moe0"] == "triton"
    cpu = _op(xs, router, w, attrs, "moe_cpu").float()
    probs = torch.softmax(router.float(), -1)
    top_w, top_e = torch.topk(probs, 6, -1)
    ref = oracle(xs, top_e, top_w, w, attrs)
    scale = float(ref.abs().max())
    assert float((got.double() - ref).abs().max()) <= 2 * TOL[dtype] * scale
    assert float((got - cpu).abs().max()) <= 2 * TOL[dtype] * scale


def test_graph_replay_equals_eager():
    from pagedkit.kernels.triton.moe import fused_moe

    xs, top_e, top_w, w, attrs = make(n_tok=16, k=6, n_exp=64, hidden=256, inter=128, seed=11)
    xs, top_e, top_w = xs.cuda(), top_e.cuda(), top_w.cuda()
    w = [t.cuda() if t is not None else None for t in w]
    eager = fused_moe(xs, top_e, top_w, w, attrs)
    s = torch.cuda.Stream()
    with torch.cuda.stream(s):
        fused_moe(xs, top_e, top_w, w, attrs)  # warm-up (compiles) off the capture
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = fused_moe(xs, top_e, top_w, w, attrs)
    new_e = top_e.roll(1, 0)  # another routing in the same buffers: the replay must follow it
    top_e.copy_(new_e)
    g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, fused_moe(xs, top_e, top_w, w, attrs))
    assert not torch.equal(out, eager)


@pytest.mark.parametrize("bits,block", [(4, 32), (8, 0)])
def test_qmoe_op_takes_the_codes(bits, block):
    """QMoE on CUDA: the fused kernel dequantizes in its loads (ROUTES "triton"); equal within the float16 bound
    to the op on the CPU (the experts dequantized first, float32 products)."""
    from test_triton_moe import _packed_case

    from pagedkit.runtime.ops.moe import ROUTES, qmoe
    from pagedkit.runtime.ops.registry import OpContext

    xs, _, _, w, attrs = make(n_tok=24, k=4, n_exp=16, hidden=256, inter=128, seed=bits, bias=False)
    g = torch.Generator().manual_seed(3)
    p1, _ = _packed_case(w[0], bits, block, True, g, torch.float16)
    p2, _ = _packed_case(w[2], bits, block, True, g, torch.float16)
    for p in (p1, p2):  # 8-bit codes span 16x the 4-bit range: scales / 16 keep the products inside float16
        p.scales.mul_(16.0 / (1 << bits) if bits > 4 else 1.0)
    router = (torch.stack([torch.randperm(16, generator=g) for _ in range(24)]) * 0.3 - 2.4).half()  # no ties
    attrs = attrs | {"k": 4, "expert_weight_bits": bits, "block_size": block, "quant_type": "int"}

    def run(dev, name):
        t = lambda x: x.to(dev) if x is not None else None  # noqa: E731
        ins = [t(xs), t(router), t(p1.q), t(p1.scales), None, t(p2.q), t(p2.scales), None, None, None, None,
               t(p1.zero_points), t(p2.zero_points)]
        return qmoe(ins, attrs, OpContext(node_name=name, device=dev))[0].float().cpu()

    got = run("cuda", "qmoe_gpu")
    assert ROUTES["qmoe_gpu"] == "triton"
    ref = run("cpu", "qmoe_cpu")
    assert torch.isfinite(ref).all() and torch.isfinite(got).all()
    assert float((got - ref).abs().max()) <= 2 * TOL[torch.float16] * float(ref.abs().max())
