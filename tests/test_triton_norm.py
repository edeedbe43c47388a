"""The one-launch RMS norm (kernels/triton/norm.py; on CPU through Triton's interpreter) against a float64 loop
oracle: residual add (+ bias) in float32, the sum output rounded to x's dtype, y = s / rms(s) * gamma. On the
GPU (gpu mark) the norm ops of runtime/ops/norms.py route CUDA tensors to it and agree with their CPU torch
composition. Teeth: a 2% wrong gamma, or a sum without the skip, fails the same bound."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("triton")  # under CI (tests/conftest.py) a missing triton fails instead of skipping

from pagedkit.kernels.triton import norm  # noqa: E402

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
TOL = {torch.float16: 2e-3, torch.bfloat16: 1e-2, torch.float32: 1e-5}


def _oracle(x, skip, bias, gamma, eps):
    """float64 loops over rows: (y, s)."""
    xs = x.double().reshape(-1, x.shape[-1])
    out, tot = torch.empty_like(xs), torch.empty_like(xs)
    for r in range(xs.shape[0]):
        s = xs[r].clone()
        if skip is not None:
            s += skip.double().reshape(-1, x.shape[-1])[r]
        if bias is not None:
            s += bias.double()
        ms = sum(float(v) * float(v) for v in s) / s.numel()
        out[r] = s / (ms + eps) ** 0.5 * gamma.double()
        tot[r] = s
    return out.reshape(x.shape), tot.reshape(x.shape)


def _rel(a, b):
    return float((a.double().cpu() - b).abs().max() / b.abs().max())


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
@pytest.mark.parametrize("hidden,skip,bias", [(48, True, False), (96, True, True), (64, False, False)])
def test_rms_norm_matches_the_float64_oracle(dtype, hidden, skip, bias):
    g = torch.Generator().manual_seed(hidden)
    x = (torch.randn(2, 3, hidden, generator=g) * 3).to(dtype)
    sk = (torch.randn(2, 3, hidden, generator=g) * 3).to(dtype) if skip else None
    b = (torch.randn(hidden, generator=g) * 0.5).to(dtype) if bias else None
    gamma = (1 + 0.2 * torch.randn(hidden, generator=g)).to(dtype)
    eps = 1e-5
    dev = lambda t: None if t is None else t.to(DEVICE)  # noqa: E731
    y, s = norm.rms_norm(dev(x), dev(gamma), eps, skip=dev(sk), bias=dev(b), want_sum=skip)
    ref_y, ref_s = _oracle(x, sk, b, gamma, eps)
    assert y.dtype == dtype and y.shape == x.shape
    assert _rel(y, ref_y) <= TOL[dtype]
    if skip:
        assert s.dtype == dtype and _rel(s, ref_s) <= TOL[dtype]
    else:
        assert s is None
    # teeth: a 2% wrong gamma, and a sum that drops the skip, leave the bound
    y2, _ = norm.rms_norm(dev(x), dev(gamma * 1.02), eps, skip=dev(sk), bias=dev(b))
    assert _rel(y2, ref_y) > TOL[dtype]
    if skip:
        y3, _ = norm.rms_norm(dev(x), dev(gamma), eps, bias=dev(b))
        assert _rel(y3, ref_y) > TOL[dtype]


def test_unsupported_operands_are_refused_naming_them():
    x = torch.zeros(2, 8)
    assert not norm.serves(x, torch.ones(4))
    assert not norm.serves(torch.tensor(1.0), torch.ones(1))  # a 0-d x: no rows
    assert not norm.serves(x, torch.ones(8), skip=torch.zeros(1, 8))  # a broadcast skip: the torch path
    with pytest.raises(ValueError, match=r"rms_norm: unsupported operands x \[2, 8\]"):
        norm.rms_norm(x, torch.ones(4), 1e-5)


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_norm_ops_on_cuda_take_the_kernel_and_agree_with_the_cpu_ops(monkeypatch):
    from pagedkit.runtime.ops import OPS
    from pagedkit.runtime.ops.registry import MS_DOMAIN

    calls = []
    real = norm.rms_norm
    monkeypatch.setattr(norm, "rms_norm", lambda *a, **k: calls.append(1) or real(*a, **k))

    class Ctx:
        node_name, requested = "n", None

        def wants(self, i):
            return True if i in (0, 3) else False

    g = torch.Generator().manual_seed(0)
    x, sk = torch.randn(4, 2048, generator=g).half(), torch.randn(4, 2048, generator=g).half()
    gamma = (1 + 0.1 * torch.randn(2048, generator=g)).half()
    op = OPS[(MS_DOMAIN, "SkipSimplifiedLayerNormalization")]
    cpu = op([x, sk, gamma], {"epsilon": 1e-5}, Ctx())
    gpu = op([x.cuda(), sk.cuda(), gamma.cuda()], {"epsilon": 1e-5}, Ctx())
    assert calls, "the CUDA op did not take the Triton kernel"
    for i in (0, 3):
        assert _rel(gpu[i], cpu[i].double()) <= 2e-3
