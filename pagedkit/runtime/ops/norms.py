"""Normalizations: ai.onnx LayerNormalization, RMSNormalization (opset 23), onnxruntime's
SimplifiedLayerNormalization (registered by ORT in the default domain) and the com.microsoft
SkipLayerNormalization / SkipSimplifiedLayerNormalization.

Numerics: half inputs are upcast to float32 (or the stash type), normalized, and cast back to the
output type; statistics outputs (mean, inv_std_var) are float32, shaped like the input with the
normalized dimensions kept as 1.
"""

from __future__ import annotations


import torch
import torch.nn.functional as F

from .registry import MS_DOMAIN, register
from .util import norm_axis, opt, triton_kernels


def _triton_norm(x: torch.Tensor, dtype: torch.dtype, axis: int):
    """kernels.triton.norm for a CUDA tensor normalized in float32 over its last dim (its one-launch RMS
    norms), else None (the torch composition)."""
    if not x.is_cuda or dtype != torch.float32 or axis != x.dim() - 1:
        return None
    return triton_kernels("norm")


def _stash_dtype(x: torch.Tensor, attrs: dict) -> torch.dtype:
    if x.dtype == torch.float64:
        return torch.float64
    return torch.float32 if attrs.get("stash_type", 1) == 1 else x.dtype


def _normalize(x: torch.Tensor, axis: int, eps: float, dtype: torch.dtype, center: bool):
    """(normalized x in `dtype`, mean or None, inv_std_var) over dims [axis, rank); stats keep dims."""
    xf = x.to(dtype)
    dims = tuple(range(axis, x.dim()))
    mean = xf.mean(dims, keepdim=True) if center else None
    xc = xf - mean if center else xf
    inv = torch.rsqrt(xc.square().mean(dims, keepdim=True) + eps)
    return xc * inv, mean, inv


@register("LayerNormalization")
def layer_norm(inputs, attrs, ctx):
    x, scale, bias = inputs[0], inputs[1], opt(inputs, 2)  # x [..., normalized dims], scale/bias broadcastable
    dtype = _stash_dtype(x, attrs)
    axis = norm_axis(attrs.get("axis", -1), x.dim(), "LayerNormalization axis")
    y, mean, inv = _normalize(x, axis, attrs.get("epsilon", 1e-5), dtype, center=True)
    y = y * scale.to(dtype)
    if bias is not None:
        y = y + bias.to(dtype)
    return [y.to(x.dtype), mean, inv]


@register("RMSNormalization")
def rms_norm(inputs, attrs, ctx):
    x, scale = inputs[0], inputs[1]
    dtype = _stash_dtype(x, attrs)
    axis = norm_axis(attrs.get("axis", -1), x.dim(), "RMSNormalization axis")
    tn = _triton_norm(x, dtype, axis)
    if tn is not None and tn.serves(x, scale):  # one launch on CUDA
        return [tn.rms_norm(x, scale, attrs.get("epsilon", 1e-5))[0]]
    if scale.shape == x.shape[axis:]:  # torch's fused norm over the trailing dims
        y = F.rms_norm(x.to(dtype), tuple(x.shape[axis:]), scale.to(dtype), attrs.get("epsilon", 1e-5))
        return [y.to(x.dtype)]
    y, _, _ = _normalize(x, axis, attrs.get("epsilon", 1e-5), dtype, center=False)
    return [(y * scale.to(dtype)).to(x.dtype)]


@register("SimplifiedLayerNormalization")
def simplified_layer_norm(inputs, attrs, ctx):
    x, scale = inputs[0], inputs[1]  # Y takes scale's type (V)
    dtype = _stash_dtype(x, attrs)
    axis = norm_axis(attrs.get("axis", -1), x.dim(), "SimplifiedLayerNormalization axis")
    tn = _triton_norm(x, dtype, axis)
    if not ctx.wants(1) and tn is not None and tn.serves(x, scale):  # one launch on CUDA
        return [tn.rms_norm(x, scale, attrs.get("epsilon", 1e-5), out_dtype=scale.dtype)[0], None]
    if not ctx.wants(1) and scale.shape == x.shape[axis:]:  # inv_std_var not asked for: torch's fused norm
        y = F.rms_norm(x.to(dtype), tuple(x.shape[axis:]), scale.to(dtype), attrs.get("epsilon", 1e-5))
        return [y.to(scale.dtype), None]
    y, _, inv = _normalize(x, axis, attrs.get("epsilon", 1e-5), dtype, center=False)
    return [(y * scale.to(dtype)).to(scale.dtype), inv]


def _skip_norm(center: bool):
    def impl(inputs, attrs, ctx):
        # input/skip [B, S, hidden] or [T, hidden] (skip may broadcast), gamma/beta/bias [hidden]
        x, skip, gamma = inputs[0], inputs[1], inputs[2]
        beta = opt(inputs, 3) if center else None
        bias = opt(inputs, 4 if center else 3)
        dtype = torch.float32 if x.dtype != torch.float64 else torch.float64
        tn = None if center or ctx.wants(1) or ctx.wants(2) else _triton_norm(x, dtype, x.dim() - 1)
        if tn is not None and tn.serves(x, gamma, skip, bias):  # one launch on CUDA (float32 inside)
            y, total = tn.rms_norm(x, gamma, attrs.get("epsilon", 1e-12), skip=skip, bias=bias, want_sum=ctx.wants(3))
            return [y, None, None, total]
        s = x.to(dtype) + skip.to(dtype)  # summed in float32, as onnxruntime's CPU kernel
        if bias is not None:
            s = s + bias.to(dtype)
        if not (ctx.wants(1) or ctx.wants(2)):  # no statistics asked for: torch's fused norms
            eps, shape = attrs.get("epsilon", 1e-12), (s.shape[-1],)
            g, b = gamma.to(dtype), None if beta is None else beta.to(dtype)
            y = F.layer_norm(s, shape, g, b, eps) if center else F.rms_norm(s, shape, g, eps)
            return [y.to(x.dtype), None, None, s.to(x.dtype) if ctx.wants(3) else None]
        y, mean, inv = _normalize(s, s.dim() - 1, attrs.get("epsilon", 1e-12), dtype, center)
        y = y * gamma.to(dtype)
        if beta is not None:
            y = y + beta.to(dtype)
        if mean is None:  # onnxruntime writes zeros to the simplified variant's mean output
            mean = torch.zeros_like(inv)
        return [y.to(x.dtype), mean, inv, s.to(x.dtype)]

    return impl


register("SkipLayerNormalization", domain=MS_DOMAIN)(_skip_norm(center=True))
register("SkipSimplifiedLayerNormalization", domain=MS_DOMAIN)(_skip_norm(center=False))
