"""Matrix products: MatMul (numpy semantics), Gemm, Einsum. Computed in the input dtype."""

from __future__ import annotations

import torch

from .registry import register
from .util import opt


@register("MatMul")
def matmul(inputs, attrs, ctx):
    return [torch.matmul(inputs[0], inputs[1])]


@register("Gemm")
def gemm(inputs, attrs, ctx):
    a, b, c = inputs[0], inputs[1], opt(inputs, 2)  # a [M, K] (or [K, M]), b [K, N] (or [N, K]), c -> [M, N]
    a = a.T if attrs.get("transA", 0) else a
    b = b.T if attrs.get("transB", 0) else b
    alpha, beta = attrs.get("alpha", 1.0), attrs.get("beta", 1.0)
    y = a @ b
    if alpha != 1.0:
        y = y * alpha
    if c is not None:
        y = y + (c if beta == 1.0 else c * beta)
    return [y]


@register("Einsum")
def einsum(inputs, attrs, ctx):
    return [torch.einsum(attrs["equation"].replace(" ", ""), *inputs)]
