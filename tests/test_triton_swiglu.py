"""The one-launch SwiGLU (kernels/triton/swiglu.py; on CPU through Triton's interpreter) against a float64
loop oracle, out[r, j] = g / (1 + exp(-g)) * u with g = y[r, j], u = y[r, N + j]. On the GPU (gpu mark) the
fused SiluMul op (runtime/ops/activations.py) routes CUDA tensors to it and agrees with the oracle. Teeth: a
swapped gate / up, or a 2% wrong result, fails the same bound."""

from __future__ import annotations

import math

import pytest
import torch

pytest.importorskip("triton")  # under CI a failure (conftest.py)
from pagedkit.kernels.triton import swiglu  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-6}


def _oracle(y: torch.Tensor, n: int) -> torch.Tensor:
    rows = y.double().reshape(-1, 2 * n).tolist()
    out = [[g / (1.0 + math.exp(-g)) * u for g, u in zip(r[:n], r[n:])] for r in rows]
    return torch.tensor(out, dtype=torch.float64).reshape(*y.shape[:-1], n)


def _rel(a, b):
    return float((a.double().cpu() - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("shape,n", [((3, 80), 40), ((2, 2, 2100), 1050), ((1, 34), 17)])
def test_silu_mul_matches_float64_oracle(dtype, shape, n):
    torch.manual_seed(sum(shape) + n)
    y = (torch.randn(shape) * 3).to(dtype).to(DEVICE)
    assert swiglu.serves_silu_mul(y, n)
    ref = _oracle(y, n)
    out = swiglu.silu_mul(y, n)
    assert out.shape == ref.shape and out.dtype == dtype
    assert _rel(out, ref) <= TOL[dtype]
    # teeth: gate and up swapped, and a 2% wrong scale, fail the same bound
    swapped = torch.cat((y[..., n:], y[..., :n]), dim=-1).contiguous()
    assert _rel(swiglu.silu_mul(swapped, n), ref) > TOL[dtype]
    assert _rel(out * 1.02, ref) > TOL[dtype]


def test_refuses_what_it_does_not_serve():
    y = torch.randn(2, 10, device=DEVICE)
    assert not swiglu.serves_silu_mul(y, 4)  # width != 2 * split
    assert not swiglu.serves_silu_mul(y.T.contiguous().T, 5)  # not contiguous
    assert not swiglu.serves_silu_mul(y.to(torch.int32), 5)


@pytest.mark.gpu
def test_fused_silumul_op_routes_cuda_to_the_kernel(monkeypatch):
    from pagedkit.runtime.ops import activations

    y = (torch.randn(8, 2 * 8192, device="cuda") * 2).half()
    calls = []
    real = swiglu.silu_mul
    monkeypatch.setattr(swiglu, "silu_mul", lambda *a: calls.append(1) or real(*a))
    out = activations.silu_mul([y], {"split": 8192}, None)[0]
    assert calls == [1]
    assert _rel(out, _oracle(y, 8192)) <= TOL[torch.float16]
