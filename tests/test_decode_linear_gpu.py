"""kernels/triton/linear.py and runtime/fuse_linear.py on the GPU (`pytest -m gpu`):

- the kernel at Llama-3.2-1B's decode products (QKV after the norm, O, gate | up after the norm, down after SiluMul;
  1, 8 and 16 rows; float16 and bfloat16; the weight slab's L2 prefetch and PDL on, as the engine runs it) against
  float64 products of the same rounded x;
- the engine's decode graphs over the tiny Llama with the rewrite on: replays bit-equal to the same padded steps run
  eagerly, and within float16 noise of the unfused engine.
"""

from __future__ import annotations

import pytest
import torch

from pagedkit.runtime import fuse_linear

pytestmark = [pytest.mark.gpu, pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("kind,n,k", [("rms", 3072, 2048), ("plain", 2048, 2048), ("rms", 16384, 2048),
                                      ("silu", 2048, 8192)])
@pytest.mark.parametrize("m", [1, 4, 8])
def test_kernel_at_the_1b_products(dtype, kind, n, k, m):
    from pagedkit.kernels.triton import linear as L

    g = torch.Generator(device="cuda").manual_seed(m + n)
    w = (torch.randn(n, k, device="cuda", generator=g) / k ** 0.5).to(dtype)
    a = torch.randn(m, 2 * k if kind == "silu" else k, device="cuda", generator=g).to(dtype)
    skip = torch.randn(m, k, device="cuda", generator=g).to(dtype) if kind == "rms" else None
    gamma = (torch.rand(k, device="cuda", generator=g) + 0.5).to(dtype) if kind == "rms" else None
    y, s = L.linear(kind, a, w, skip=skip, gamma=gamma, eps=1e-5, want_sum=kind == "rms")
    if kind == "plain":
        x = a
    elif kind == "silu":
        gt, up = a[:, :k].float(), a[:, k:].float()
        x = (gt / (1 + torch.exp(-gt)) * up).to(dtype)
    else:
        sm = a.float() + skip.float()
        assert torch.equal(s, sm.to(dtype))
        x = (sm * torch.rsqrt(sm.square().mean(-1, keepdim=True) + 1e-5) * gamma.float()).to(dtype)
    ref = x.double() @ w.double().T
    tol = 2e-3 if dtype == torch.float16 else 1.6e-2
    assert float((y.double() - ref).abs().max()) <= tol * float(ref.abs().max())


def test_engine_graphs_with_the_rewrite(tiny_llama, monkeypatch):
    import test_engine_graphs_gpu as eg

    plain = eg._models(tiny_llama)[2]
    monkeypatch.setattr(fuse_linear, "ENABLED", True)
    monkeypatch.setattr(fuse_linear, "MIN_BYTES", 1)
    graphs, padded, _ = eg._models(tiny_llama)
    assert graphs.session.fused.get("decode_linear", 0) > 0
    prompts = eg._prompts(3, 1, 144)
    got = eg._run(graphs, prompts, 8, 5, 144, grow_to=6)
    same = eg._run(padded, prompts, 8, 5, 144, grow_to=6)
    ref = eg._run(plain, prompts, 8, 5, 144, grow_to=6)
    assert graphs.graphs.stats.captured >= 2 and graphs.graphs.stats.replays >= 5
    for i, (a, b, r) in enumerate(zip(got, same, ref)):
        assert torch.equal(a, b), f"step {i}: the replay differs from the padded eager step"
        assert float((a - r).abs().max() / r.abs().max()) <= eg.REL, f"step {i}: fused vs unfused"
