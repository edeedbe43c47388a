"""Matrix products: MatMul (numpy semantics), Gemm, Einsum. Computed in the input dtype, except
fp16 / bf16 on the CPU: torch's half-precision CPU matmul is ~30x slower than float32, so those
products run in float32 (rounded back to the input dtype), with a float32 copy of each large operand
(the weights) made once and reused while that tensor lives unmodified."""

from __future__ import annotations

import weakref

import torch

from .registry import register
from .util import HALF_TYPES, opt

_F32: dict[int, tuple[weakref.ref, torch.Tensor, int]] = {}  # id(tensor) -> (ref, float32 copy, version)


def _f32(t: torch.Tensor) -> torch.Tensor:
    key = id(t)
    hit = _F32.get(key)
    if hit is not None and hit[0]() is t and hit[2] == t._version:
        return hit[1]
    f = t.float()
    if t.numel() >= 1 << 16:  # weights: keep the copy for the next call
        _F32[key] = (weakref.ref(t, lambda _, k=key: _F32.pop(k, None)), f, t._version)
    return f


def _mm(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    if a.device.type == "cpu" and a.dtype in HALF_TYPES and b.dtype == a.dtype:
        return torch.matmul(_f32(a), _f32(b)).to(a.dtype)
    return torch.matmul(a, b)


@register("MatMul")
def matmul(inputs, attrs, ctx):
    return [_mm(inputs[0], inputs[1])]


@register("Gemm")
def gemm(inputs, attrs, ctx):
    a, b, c = inputs[0], inputs[1], opt(inputs, 2)  # a [M, K] (or [K, M]), b [K, N] (or [N, K]), c -> [M, N]
    out_dtype = a.dtype
    if a.device.type == "cpu" and a.dtype in HALF_TYPES:  # float32 before transposing: the copy is reused
        a, b = _f32(a), _f32(b)
        c = None if c is None else c.float()
    a = a.T if attrs.get("transA", 0) else a
    b = b.T if attrs.get("transB", 0) else b
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    y = a @ b
    if alpha != 1.0:
        y = y * alpha
    if c is not None:
        y = y + (c if beta == 1.0 else c * beta)
    return [y.to(out_dtype)]


@register("Einsum")
def einsum(inputs, attrs, ctx):
    return [torch.einsum(attrs["equation"].replace(" ", ""), *inputs)]
