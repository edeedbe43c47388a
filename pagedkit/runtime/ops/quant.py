"""Quantization: com.microsoft MatMulNBits (2/4/8-bit blockwise weights) and ai.onnx
DequantizeLinear / QuantizeLinear (per-tensor, per-axis, blocked).

MatMulNBits: the prepack step (session creation, `prepack_matmul_nbits`) lays B out once, for the bf16 int4
CPU kernel or as an exact dequantized cache (nbits.py says which node gets which and why); without it (a
single-node call, a non-CPU device, a form no layout serves) the weight is dequantized on every call
((q - zero_point) * scale in A's dtype) and multiplied densely: exact, slow.
"""

from __future__ import annotations

import torch

from . import nbits
from .packed import PackedLinear
from .registry import MS_DOMAIN, RUNTIME, prepack, register
from .util import norm_axis, opt, torch_dtype


def unpack_bits(packed: torch.Tensor, bits: int) -> torch.Tensor:
    """uint8 [..., n] -> uint8 [..., n * 8 / bits]; the first value sits in the lowest bits of a byte."""
    per = 8 // bits
    shifts = torch.arange(0, 8, bits, dtype=torch.uint8, device=packed.device)  # [per]
    vals = (packed.unsqueeze(-1) >> shifts) & ((1 << bits) - 1)
    return vals.reshape(*packed.shape[:-1], packed.shape[-1] * per)


def nbits_zero_points(zero_points: torch.Tensor | None, bits: int, n: int, k_blocks: int,
                      dtype: torch.dtype) -> torch.Tensor | None:
    """MatMulNBits zero points as numbers [N, k_blocks] in `dtype` (None: absent, the default 2^(bits-1))."""
    if zero_points is None:
        return None
    if zero_points.dtype == torch.uint8:  # packed like B along k_blocks: [N, ceil(k_blocks * bits / 8)]
        return unpack_bits(zero_points.reshape(n, -1), bits)[:, :k_blocks].to(dtype)
    return zero_points.reshape(n, k_blocks).to(dtype)  # unpacked, A's type: [N, k_blocks]


def dequantize_nbits(b: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
                     bits: int, block_size: int, n: int, k: int, dtype: torch.dtype) -> torch.Tensor:
    """MatMulNBits weight: B uint8 [N, k_blocks, blob], scales [N, k_blocks] -> W [N, K] in `dtype`."""
    k_blocks = -(-k // block_size)
    q = unpack_bits(b.reshape(n, k_blocks, -1), bits).to(dtype)  # [N, k_blocks, block_size]
    scales = scales.reshape(n, k_blocks).to(dtype)
    zp = nbits_zero_points(zero_points, bits, n, k_blocks, dtype)
    zp = torch.full((), float(1 << (bits - 1)), dtype=dtype, device=b.device) if zp is None else zp.unsqueeze(-1)
    w = (q - zp) * scales.unsqueeze(-1)
    return w.reshape(n, k_blocks * block_size)[:, :k]


def _nbits_refusals(attrs: dict, g_idx, where: str) -> None:
    if attrs.get("bits", 4) not in (2, 4, 8):
        raise NotImplementedError(f"{where}: bits={attrs.get('bits')} is not supported (2, 4 or 8)")
    if g_idx is not None:
        raise NotImplementedError(f"{where}: input 'g_idx' (deprecated) is not supported")
    if attrs.get("weight_prepacked", 0):
        raise NotImplementedError(f"{where}: weight_prepacked={attrs['weight_prepacked']} (EP-specific layout)")


@prepack("MatMulNBits", domain=MS_DOMAIN)
def prepack_matmul_nbits(inputs, attrs, ctx):
    """B (with its scales and zero points) as an Int4Linear or a DequantizedLinear (nbits.plan decides);
    {} when B or the scales are not constants, B is empty (omitted projection) or no layout applies."""
    b, scales, zero_points, g_idx = (opt(inputs, i) for i in (1, 2, 3, 4))
    if not isinstance(b, torch.Tensor) or not isinstance(scales, torch.Tensor) or b.numel() == 0:
        return {}
    if zero_points is RUNTIME or g_idx is RUNTIME:  # absorbed inputs must be constants too
        return {}
    _nbits_refusals(attrs, g_idx, f"MatMulNBits node {ctx.node_name!r}")
    bits, block_size, n, k = attrs.get("bits", 4), attrs["block_size"], attrs["N"], attrs["K"]
    layout = nbits.plan(attrs, scales.dtype, ctx.device)
    has_zp = zero_points is not None
    if layout == "int4":
        k_blocks = -(-k // block_size)
        q = unpack_bits(b.reshape(n, k_blocks, -1), 4).reshape(n, k_blocks * block_size)
        zp = nbits_zero_points(zero_points, 4, n, k_blocks, torch.float32)
        packed = nbits.Int4Linear(q, scales.reshape(n, k_blocks), zp, block_size, n, k, has_zp)
    elif layout == "dequantized" and nbits.fits_budget(n * k * scales.element_size()):
        w = dequantize_nbits(b, scales, zero_points, bits, block_size, n, k, scales.dtype)
        packed = nbits.DequantizedLinear(w, has_zp)
    else:
        return {}
    out = {2: nbits.Absorbed(1, "scales")} | ({3: nbits.Absorbed(1, "zero_points")} if has_zp else {})
    return out | {1: packed}  # B last: a session reporting the last replacement of a node names B's layout


@register("MatMulNBits", domain=MS_DOMAIN)
def matmul_nbits(inputs, attrs, ctx):
    a, b, scales = inputs[0], inputs[1], inputs[2]  # a [..., K]; b a tensor or a prepacked PackedLinear
    zero_points, g_idx, bias = opt(inputs, 3), opt(inputs, 4), opt(inputs, 5)
    where = f"MatMulNBits node {ctx.node_name!r}"
    bits, block_size, n, k = attrs.get("bits", 4), attrs["block_size"], attrs["N"], attrs["K"]
    _nbits_refusals(attrs, g_idx, where)
    if a.shape[-1] != k:
        raise ValueError(f"{where}: input 'A' last dimension {a.shape[-1]} != K={k}")
    if isinstance(b, PackedLinear):
        if isinstance(zero_points, torch.Tensor) and not b.has_zero_points:
            raise ValueError(f"{where}: B was prepacked without zero points, but the node got a 'zero_points' "
                             "tensor (a run-time value the prepack step could not see)")
        y = b.matmul(a)
    elif b.numel() == 0:  # omitted projection: zeros (or the bias)
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


_FP8 = (torch.float8_e4m3fn, torch.float8_e4m3fnuz, torch.float8_e5m2, torch.float8_e5m2fnuz)
_INT4 = {torch.int4: torch.int8, torch.uint4: torch.uint8}  # one value per byte (util.tensor_from_proto)


def _gbq_values(data: torch.Tensor, zero_points, bits: int, where: str):
    """(values as numbers in logical shape, zero points as numbers (scales' shape, packed ones unpacked
    and possibly padded) or the default)."""
    if data.dtype == torch.uint8:  # packed along the last axis, MatMulNBits' conventions
        if bits not in (2, 4, 8):
            raise ValueError(f"{where}: uint8 data supports bits 2, 4 or 8, got {bits}")
        values = unpack_bits(data, bits) if bits < 8 else data
        if zero_points is None:
            return values, 1 << (bits - 1)
        return values, unpack_bits(zero_points, bits) if bits < 8 else zero_points
    if data.dtype in _INT4:
        if bits != 4:
            raise ValueError(f"{where}: int4 / uint4 data needs bits=4, got {bits}")
        zp = 0 if zero_points is None else zero_points.view(_INT4[zero_points.dtype])
        return data.view(_INT4[data.dtype]), zp
    if data.dtype in _FP8:
        if zero_points is not None:
            raise ValueError(f"{where}: zero_points must not be given with {data.dtype} data (symmetric)")
        return data.to(torch.float32), 0
    raise TypeError(f"{where}: data type {data.dtype} is not supported (uint8, int4, uint4, float8)")


@register("GatherBlockQuantized", domain=MS_DOMAIN)
def gather_block_quantized(inputs, attrs, ctx):
    """Gather of block-quantized data, then (data - zero_point) * scale in float32, cast to scales' type.
    uint8 data: packed along the last axis (2/4/8 bits, low bits first), gather_axis 0, quantize_axis last,
    zero points packed like it (default 2^(bits-1)); int4 / uint4 data: zero points of the same type
    (default 0); float8 data: no zero points, block_size 0 = the whole axis, scales may broadcast (dim 1)
    on other axes. Out-of-range indices give zeros, negative ones count from the end."""
    data, indices, scales, zero_points = inputs[0], inputs[1], inputs[2], opt(inputs, 3)
    where = f"GatherBlockQuantized node {ctx.node_name!r}"
    bits, block = attrs.get("bits", 4), attrs.get("block_size", 128)
    r = data.dim()
    gaxis = norm_axis(attrs.get("gather_axis", 0), r, f"{where}: gather_axis")
    qaxis = norm_axis(attrs.get("quantize_axis", 1), r, f"{where}: quantize_axis")
    fp8 = data.dtype in _FP8
    if not (block >= 16 and block & (block - 1) == 0) and not (fp8 and block == 0):
        raise ValueError(f"{where}: block_size must be a power of 2 >= 16 (or 0 for float8 data), got {block}")
    if data.dtype == torch.uint8 and (gaxis != 0 or qaxis != r - 1 or r < 2):
        raise ValueError(f"{where}: uint8 data needs gather_axis 0 and quantize_axis the last of >= 2 axes "
                         f"(got {gaxis}, {qaxis} of rank {r})")
    pre = None  # uint8 data (gather_axis 0, packed along the last axis): gather the packed rows first, then
    if data.dtype == torch.uint8:  # unpack only those (not the whole table every call)
        dim0 = data.shape[0]
        raw = indices.to(torch.int64).reshape(-1)
        ok = (raw >= -dim0) & (raw < dim0)
        rows = torch.where(ok, torch.where(raw < 0, raw + dim0, raw), 0)
        if scales.shape[0] != dim0 or (isinstance(zero_points, torch.Tensor) and zero_points.shape[0] != dim0):
            raise ValueError(f"{where}: scales / zero_points should have {dim0} rows like data, got "
                             f"{list(scales.shape)}" + (f" / {list(zero_points.shape)}" if zero_points is not None else ""))
        data, scales = data.index_select(0, rows), scales.index_select(0, rows)
        if isinstance(zero_points, torch.Tensor):
            zero_points = zero_points.index_select(0, rows)
        pre = ok
    values, zp = _gbq_values(data, zero_points, bits, where)
    kq = values.shape[qaxis]
    block = block or kq
    n_blocks = -(-kq // block)
    for i in range(r):
        want = n_blocks if i == qaxis else values.shape[i]
        if scales.shape[i] != want and not (fp8 and i != qaxis and scales.shape[i] == 1):
            raise ValueError(f"{where}: scales shape {list(scales.shape)} does not match data "
                             f"(logical {list(values.shape)}, block {block} on axis {qaxis})")
    if isinstance(zp, torch.Tensor):
        zp = zp.narrow(qaxis, 0, n_blocks) if zp.shape[qaxis] > n_blocks else zp
        if zp.shape != scales.shape:
            raise ValueError(f"{where}: zero_points shape {list(zero_points.shape)} does not match scales "
                             f"{list(scales.shape)}")
    dim = values.shape[gaxis]
    if pre is not None:  # rows gathered already, in index order
        valid, idx = pre, torch.arange(dim, device=values.device)
    else:
        idx = indices.to(torch.int64).reshape(-1)
        valid = (idx >= -dim) & (idx < dim)
        idx = torch.where(valid, torch.where(idx < 0, idx + dim, idx), 0)
    v = values.index_select(gaxis, idx)

    def params(p):  # scales / zero points of the gathered elements, broadcastable against v
        if not isinstance(p, torch.Tensor):
            return p
        if gaxis == qaxis:
            return p.index_select(gaxis, idx // block)
        if p.shape[gaxis] != 1:
            p = p.index_select(gaxis, idx)
        return p.repeat_interleave(block, dim=qaxis).narrow(qaxis, 0, kq) if p.shape[qaxis] > 1 else p

    s, z = params(scales), params(zp)
    out = (v.to(torch.float32) - (z.to(torch.float32) if isinstance(z, torch.Tensor) else z)) * s.to(torch.float32)
    mask_shape = [1] * r
    mask_shape[gaxis] = -1
    out = torch.where(valid.reshape(mask_shape), out, 0.0).to(scales.dtype)
    return [out.reshape(*values.shape[:gaxis], *indices.shape, *values.shape[gaxis + 1:])]
