"""Programmatic dependent launch (kernels/triton/common.py): when it is offered, what the kernels are told, and on
the GPU (gpu mark) that a chain of PDL launches captured in a CUDA graph gives bit for bit what the same kernels
give without PDL (the gate waits for the predecessor before any dependent read)."""

from __future__ import annotations

import pytest
import torch

from pagedkit.kernels.triton import common

pytest.importorskip("triton")  # under CI a failure (conftest.py)


def test_pdl_offered_only_when_on_supported_and_small_enough(monkeypatch):
    cuda = torch.device("cuda:0")
    monkeypatch.setattr(common, "INTERPRET", False)
    monkeypatch.setitem(common._PDL_DEVICES, "cuda:0", True)
    monkeypatch.setattr(common, "PDL", False)
    assert common.pdl_launch(cuda, 8) == {}
    monkeypatch.setattr(common, "PDL", True)
    assert common.pdl_launch(cuda, 8) == {"launch_pdl": True}
    assert common.pdl_launch(torch.device("cpu"), 8) == {}
    monkeypatch.setattr(common, "PDL_MAX_PROGRAMS", 8)
    assert common.pdl_launch(cuda, 8) == {"launch_pdl": True} and common.pdl_launch(cuda, 9) == {}
    monkeypatch.setitem(common._PDL_DEVICES, "cuda:0", False)  # an older GPU / a launcher without it
    assert common.pdl_launch(cuda, 8) == {}
    monkeypatch.setattr(common, "INTERPRET", True)
    monkeypatch.setitem(common._PDL_DEVICES, "cuda:0", True)
    assert common.pdl_launch(cuda, 8) == {}


def test_pdl_mode(monkeypatch):
    assert common.pdl_mode({}) == 0
    monkeypatch.setattr(common, "PDL_EARLY_RELEASE", True)
    assert common.pdl_mode({"launch_pdl": True}) == 1
    monkeypatch.setattr(common, "PDL_EARLY_RELEASE", False)
    assert common.pdl_mode({"launch_pdl": True}) == 2


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("late", [False, True])
def test_pdl_chain_in_a_graph_equals_plain_launches_gpu(monkeypatch, late):
    from pagedkit.kernels.triton import norm, swiglu

    torch.manual_seed(0)
    x = torch.randn(8, 2048, dtype=torch.float16, device="cuda")
    skip = torch.randn_like(x)
    gamma = torch.rand(2048, dtype=torch.float16, device="cuda") + 0.5
    w = (torch.randn(2048, 4096, device="cuda") / 45).half()

    def chain():  # norm -> product (cuBLAS, no PDL) -> SwiGLU -> norm with the residual: each reads the last
        h, s = norm.rms_norm(x, gamma, 1e-5, skip=skip, want_sum=True)
        a = swiglu.silu_mul(h @ w, 2048)
        return norm.rms_norm(a, gamma, 1e-5, skip=s)[0]

    monkeypatch.setattr(common, "PDL", False)
    plain = chain()
    monkeypatch.setattr(common, "PDL", True)
    monkeypatch.setattr(common, "PDL_EARLY_RELEASE", not late)
    assert common.pdl_launch(x.device, 1) == {"launch_pdl": True}
    chain()  # compile
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    with torch.cuda.graph(g):
        out = chain()
    out.fill_(float("nan"))
    for _ in range(3):
        g.replay()
    torch.cuda.synchronize()
    assert torch.equal(out, plain)
