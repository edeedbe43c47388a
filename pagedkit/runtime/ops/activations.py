"""Activations: ai.onnx Gelu/HardSigmoid/HardSwish/LeakyRelu/Elu/Swish/Softmax/LogSoftmax and the
com.microsoft Gelu, FastGelu, QuickGelu, BiasGelu.

Softmax and LogSoftmax upcast half types to float32, compute, and cast back (the exponent sum needs
the range); the others compute in the input dtype.
"""

from __future__ import annotations


import math

import torch
import torch.nn.functional as F

from .registry import FUSED_DOMAIN, MS_DOMAIN, register
from .util import compute_dtype, norm_axis, opt, triton_kernels


@register("Gelu")
def gelu(inputs, attrs, ctx):
    approximate = attrs.get("approximate", "none")
    if approximate not in ("none", "tanh"):
        raise ValueError(f"Gelu node {ctx.node_name!r}: approximate must be 'none' or 'tanh', got {approximate!r}")
    return [F.gelu(inputs[0], approximate=approximate)]


@register("Gelu", domain=MS_DOMAIN)
def ms_gelu(inputs, attrs, ctx):
    return [F.gelu(inputs[0])]  # exact (erf) GELU


@register("BiasGelu", domain=MS_DOMAIN)
def bias_gelu(inputs, attrs, ctx):
    return [F.gelu(inputs[0] + inputs[1])]


@register("FastGelu", domain=MS_DOMAIN)
def fast_gelu(inputs, attrs, ctx):
    x, bias = inputs[0], opt(inputs, 1)
    if bias is not None:
        x = x + bias
    return [F.gelu(x, approximate="tanh")]  # 0.5 x (1 + tanh(sqrt(2/pi) (x + 0.044715 x^3)))


@register("QuickGelu", domain=MS_DOMAIN)
def quick_gelu(inputs, attrs, ctx):
    x = inputs[0]
    return [x * torch.sigmoid(attrs.get("alpha", 1.702) * x)]


@register("Swish", max_since=24)
def swish(inputs, attrs, ctx):
    x = inputs[0]
    return [x * torch.sigmoid(attrs.get("alpha", 1.0) * x)]


@register("HardSigmoid")
def hard_sigmoid(inputs, attrs, ctx):
    x = inputs[0]
    return [torch.clamp(attrs.get("alpha", 0.2) * x + attrs.get("beta", 0.5), 0.0, 1.0)]


@register("HardSwish")
def hard_swish(inputs, attrs, ctx):
    x = inputs[0]
    return [x * torch.clamp(x / 6.0 + 0.5, 0.0, 1.0)]


@register("LeakyRelu")
def leaky_relu(inputs, attrs, ctx):
    return [F.leaky_relu(inputs[0], attrs.get("alpha", 0.01))]


@register("Elu")
def elu(inputs, attrs, ctx):
    return [F.elu(inputs[0], attrs.get("alpha", 1.0))]


def _softmax_family(fn):
    def impl(inputs, attrs, ctx):
        x = inputs[0]
        if ctx.opset >= 13:
            axis = norm_axis(attrs.get("axis", -1), x.dim())
            return [fn(x.to(compute_dtype(x.dtype)), dim=axis).to(x.dtype)]
        # opset < 13: coerce to 2D [prod(shape[:axis]), prod(shape[axis:])] and normalize each row
        axis = norm_axis(attrs.get("axis", 1), x.dim())
        x2 = x.reshape(math.prod(x.shape[:axis]), -1)
        return [fn(x2.to(compute_dtype(x.dtype)), dim=1).to(x.dtype).reshape(x.shape)]

    return impl


register("Softmax")(_softmax_family(torch.softmax))
register("LogSoftmax")(_softmax_family(torch.log_softmax))


@register("SiluMul", domain=FUSED_DOMAIN)
def silu_mul(inputs, attrs, ctx):
    """runtime/fuse.py's SwiGLU: y [..., 2N] (gate | up) -> silu(gate) * up [..., N] (attribute split = N)."""
    y, n = inputs[0], int(attrs["split"])
    tk = triton_kernels("swiglu") if y.is_cuda else None
    if tk is not None and tk.serves_silu_mul(y, n):  # one launch on CUDA (kernels/triton/swiglu.py)
        return [tk.silu_mul(y, n)]
    return [F.silu(y[..., :n]) * y[..., n:]]

