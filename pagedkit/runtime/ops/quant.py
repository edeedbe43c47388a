"""Quantization: com.microsoft MatMulNBits (2/4/8-bit blockwise weights) and ai.onnx
DequantizeLinear / QuantizeLinear (per-tensor, per-axis, blocked).

MatMulNBits dequantizes the weight on every call ((q - zero_point) * scale in A's dtype) and runs
a dense matmul: simple and exact, not fast; a fused kernel can replace it behind the same entry.
"""

from __future__ import annotations

import torch

from .registry import MS_DOMAIN, register
from .util import norm_axis, opt, torch_dtype


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., n] -> uint8 [..., n * 8 / bits]; the first value sits in the lowest bits of a byte."""
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)  # [per]
    vals = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return vals.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def dequantize_nbits(b: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
                     bits: int, block_size: int, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """MatMulNBits weight: B uint8 [N, k_blocks, blob], scales [N, k_blocks] -> W [N, K] in `dtype`."""
    k_blocks = -(-k // block_size)
    q = unpack_bits(b.reshape(n, k_blocks, -1), bits).to(dtype)  # [N, k_blocks, block_size]
    scales = scales.reshape(n, k_blocks).to(dtype)
    if zero_points is None:
        zp = torch.full((), float(1 << (bits - 1)), dtype=dtype, device=b.device)
    elif zero_points.dtype == torch.uint8:  # packed like B along k_blocks: [N, ceil(k_blocks * bits / 8)]
        zp = unpack_bits(zero_points.reshape(n, -1), bits)[:, :k_blocks].to(dtype).unsqueeze(-1)
    else:  # unpacked, A's type: [N, k_blocks]
        zp = zero_points.reshape(n, k_blocks).to(dtype).unsqueeze(-1)
    w = (q - zp) * scales.unsqueeze(-1)
    return w.reshape(n, k_blocks * block_size)[:, :k]


@register("MatMulNBits", domain=MS_DOMAIN)
def matmul_nbits(inputs, attrs, ctx):
    a, b, scales = inputs[0], inputs[1], inputs[2]  # a [..., K]
    zero_points, g_idx, bias = opt(inputs, 3), opt(inputs, 4), opt(inputs, 5)
    where = f"MatMulNBits node {ctx.node_name!r}"
    bits, block_size, n, k = attrs.get("bits", 4), attrs["block_size"], attrs["N"], attrs["K"]
    if bits not in (2, 4, 8):
        raise NotImplementedError(f"{where}: bits={bits} is not supported (2, 4 or 8)")
    if g_idx is not None:
        raise NotImplementedError(f"{where}: input 'g_idx' (deprecated) is not supported")
    if attrs.get("weight_prepacked", 0):
        raise NotImplementedError(f"{where}: weight_prepacked={attrs['weight_prepacked']} (EP-specific layout)")
    if a.shape[-1] != k:
        raise ValueError(f"{where}: input 'A' last dimension {a.shape[-1]} != K={k}")
    if b.numel() == 0:  # omitted projection: zeros (or the bias)
        y = a.new_zeros(*a.shape[:-1], n)
    else:
        y = a @ dequantize_nbits(b, scales, zero_points, bits, block_size, n, k, a.dtype).T
    return [y + bias if bias is not None else y]


_INT_RANGES = {
    torch.int8: (-128, 127), torch.uint8: (0, 255), torch.int16: (-32768, 32767), torch.uint16: (0, 65535),
    torch.int32: (-(2**31), 2**31 - 1),
}


def _param_like(p: torch.Tensor, x: torch.Tensor, axis: int, block_size: int) -> torch.Tensor:
    """Broadcast a scale / zero point (scalar, per-axis [D] or blocked [.., D/bs, ..]) against x."""
    if block_size:
        return p.repeat_interleave(block_size, dim=axis).narrow(axis, 0, x.shape[axis])
    if p.numel() == 1:
        return p.reshape(())
    shape = [1] * x.dim()
    shape[axis] = -1
    return p.reshape(shape)


@register("DequantizeLinear")
def dequantize_linear(inputs, attrs, ctx):
    x, scale, zp = inputs[0], inputs[1], opt(inputs, 2)
    axis = norm_axis(attrs.get("axis", 1), max(x.dim(), 1), "DequantizeLinear axis")
    bs = attrs.get("block_size", 0)
    out_dtype = torch_dtype(attrs["output_dtype"]) if attrs.get("output_dtype", 0) else scale.dtype
    v = x.to(torch.int32) if not x.dtype.is_floating_point else x.to(torch.float32)
    if zp is not None:
        v = v - _param_like(zp, x, axis, bs).to(v.dtype)
    return [(v.to(torch.float32) * _param_like(scale, x, axis, bs).to(torch.float32)).to(out_dtype)]


@register("QuantizeLinear")
def quantize_linear(inputs, attrs, ctx):
    x, scale, zp = inputs[0], inputs[1], opt(inputs, 2)
    axis = norm_axis(attrs.get("axis", 1), max(x.dim(), 1), "QuantizeLinear axis")
    bs = attrs.get("block_size", 0)
    if zp is not None:
        out_dtype = zp.dtype
    elif attrs.get("output_dtype", 0):
        out_dtype = torch_dtype(attrs["output_dtype"])
    else:
        out_dtype = torch.uint8
    # x / scale in float32, rounded half to even, shifted, saturated
    v = torch.round(x.to(torch.float32) / _param_like(scale, x, axis, bs).to(torch.float32))
    if zp is not None:
        v = v + _param_like(zp, x, axis, bs).to(torch.float32)
    if out_dtype in _INT_RANGES:
        lo, hi = _INT_RANGES[out_dtype]
        v = v.clamp(lo, hi)
    return [v.to(out_dtype)]
