"""Shape and layout ai.onnx ops: Reshape, Transpose, (Un)Squeeze, Concat, Split, Slice, Expand, Tile,
Shape, Size, ConstantOfShape, Range, Flatten, Identity, Constant, Pad, Trilu.

Shape-like inputs are read on the host with `.tolist()` (see registry.py). Many outputs are views
of the input (Reshape, Transpose, Squeeze, Unsqueeze, Slice with positive steps, Expand, Identity).
"""

from __future__ import annotations

import math

import numpy as np
import torch

from .registry import register
from .util import axes_from, host_ints, host_scalar, norm_axis, opt, tensor_from_proto


@register("Reshape", max_since=25, host_inputs=(1,))  # later versions add element types only
def reshape(inputs, attrs, ctx):
    x, shape = inputs[0], host_ints(inputs[1], f"Reshape node {ctx.node_name!r} input 'shape'")
    if not attrs.get("allowzero", 0):  # 0 copies the input's dimension
        shape = [x.shape[i] if d == 0 else d for i, d in enumerate(shape)]
    return [x.reshape(shape)]


@register("Transpose", max_since=25)  # later versions add element types only
def transpose(inputs, attrs, ctx):
    x = inputs[0]
    perm = attrs.get("perm", list(range(x.dim() - 1, -1, -1)))
    return [x.permute(perm)]


@register("Squeeze", max_since=25, host_inputs=(1,))  # later versions add element types only
def squeeze(inputs, attrs, ctx):
    x = inputs[0]
    axes = axes_from(inputs, 1, attrs, f"Squeeze node {ctx.node_name!r} input 'axes'")
    if axes is None:
        return [x.squeeze()]
    axes = [norm_axis(a, x.dim(), "Squeeze axis") for a in axes]
    for a in axes:
        if x.shape[a] != 1:
            raise ValueError(f"Squeeze node {ctx.node_name!r}: dimension {a} of shape {list(x.shape)} is not 1")
    return [x.squeeze(tuple(axes))]


@register("Unsqueeze", max_since=25, host_inputs=(1,))  # later versions add element types only
def unsqueeze(inputs, attrs, ctx):
    x = inputs[0]
    axes = axes_from(inputs, 1, attrs, f"Unsqueeze node {ctx.node_name!r} input 'axes'") or []
    out_rank = x.dim() + len(axes)
    for a in sorted(norm_axis(a, out_rank, "Unsqueeze axis") for a in axes):
        x = x.unsqueeze(a)
    return [x]


@register("Concat")
def concat(inputs, attrs, ctx):
    ts = [t for t in inputs if t is not None]
    return [torch.cat(ts, dim=norm_axis(attrs["axis"], ts[0].dim(), "Concat axis"))]


@register("Split", host_inputs=(1,))
def split(inputs, attrs, ctx):
    x = inputs[0]
    axis = norm_axis(attrs.get("axis", 0), x.dim(), "Split axis")
    d = x.shape[axis]
    if opt(inputs, 1) is not None:
        sizes = host_ints(inputs[1], f"Split node {ctx.node_name!r} input 'split'")
    elif "split" in attrs:  # Split-2/11
        sizes = list(attrs["split"])
    else:
        n = attrs.get("num_outputs", ctx.num_outputs)
        if "num_outputs" in attrs:  # Split-18: ceil-sized chunks, the last one smaller
            chunk = -(-d // n)
            sizes = [chunk] * (n - 1) + [d - chunk * (n - 1)]
        elif d % n == 0:
            sizes = [d // n] * n
        else:
            sizes = []
        if not sizes or sizes[-1] < 0:
            raise ValueError(f"Split node {ctx.node_name!r}: cannot split dimension {d} into {n} outputs")
    if sum(sizes) != d:
        raise ValueError(f"Split node {ctx.node_name!r}: split sizes {sizes} do not sum to dimension {d}")
    return list(torch.split(x, sizes, dim=axis))


@register("Slice", host_inputs=(1, 2, 3, 4))
def slice_(inputs, attrs, ctx):
    x = inputs[0]
    where = f"Slice node {ctx.node_name!r}"
    if ctx.opset < 10:  # Slice-1: attributes
        starts, ends = list(attrs["starts"]), list(attrs["ends"])
        axes, steps = attrs.get("axes"), None
    else:
        starts = host_ints(inputs[1], f"{where} input 'starts'")
        ends = host_ints(inputs[2], f"{where} input 'ends'")
        axes = host_ints(inputs[3], f"{where} input 'axes'") if opt(inputs, 3) is not None else None
        steps = host_ints(inputs[4], f"{where} input 'steps'") if opt(inputs, 4) is not None else None
    axes = list(range(len(starts))) if axes is None else axes
    steps = [1] * len(starts) if steps is None else steps
    index: list[slice] = [slice(None)] * x.dim()
    reversed_axes = []
    for start, end, axis, step in zip(starts, ends, axes, steps):
        axis = norm_axis(axis, x.dim(), f"{where} axis")
        d = x.shape[axis]
        start, end = start + d if start < 0 else start, end + d if end < 0 else end
        if step > 0:
            index[axis] = slice(min(max(start, 0), d), min(max(end, 0), d), step)
        elif step < 0:
            reversed_axes.append((axis, min(max(start, 0), d - 1), min(max(end, -1), d - 1), step))
        else:
            raise ValueError(f"{where}: steps must not be 0")
    y = x[tuple(index)]
    for axis, start, end, step in reversed_axes:  # torch views cannot step backwards: gather
        y = y.index_select(axis, torch.arange(start, end, step, device=x.device))
    return [y]


@register("Expand", host_inputs=(1,))
def expand(inputs, attrs, ctx):
    x = inputs[0]
    shape = host_ints(inputs[1], f"Expand node {ctx.node_name!r} input 'shape'")
    # numpy's broadcasting rule (torch.broadcast_shapes imports torch.fx on first use: seconds)
    return [x.expand(np.broadcast_shapes(tuple(x.shape), tuple(shape)))]


@register("Tile", host_inputs=(1,))
def tile(inputs, attrs, ctx):
    return [inputs[0].repeat(host_ints(inputs[1], f"Tile node {ctx.node_name!r} input 'repeats'"))]


@register("Shape", max_since=25, host_outputs=True)  # later versions add element types only
def shape(inputs, attrs, ctx):
    x = inputs[0]
    r = x.dim()
    start, end = attrs.get("start", 0), attrs.get("end", r)
    start, end = (min(max(v + r if v < 0 else v, 0), r) for v in (start, end))
    return [torch.tensor(list(x.shape[start:end]), dtype=torch.int64)]  # a host tensor (see registry.py)


@register("Size", max_since=25, host_outputs=True)  # later versions add element types only
def size(inputs, attrs, ctx):
    return [torch.tensor(inputs[0].numel(), dtype=torch.int64)]


@register("ConstantOfShape", host_inputs=(0,))
def constant_of_shape(inputs, attrs, ctx):
    shape = host_ints(inputs[0], f"ConstantOfShape node {ctx.node_name!r} input 'input'")
    if "value" in attrs:  # a one-element host tensor: fill with its python value (no host-to-device copy)
        value = tensor_from_proto(attrs["value"]).reshape(())
        return [torch.full(shape, value.item(), dtype=value.dtype, device=ctx.device)]
    return [torch.zeros(shape, dtype=torch.float32, device=ctx.device)]


@register("Range", host_inputs=(0, 1, 2))
def range_(inputs, attrs, ctx):
    start, limit, delta = (host_scalar(t, f"Range node {ctx.node_name!r} input {i}") for i, t in enumerate(inputs[:3]))
    dtype, device = inputs[0].dtype, ctx.device
    n = max(math.ceil((limit - start) / delta), 0)
    if dtype.is_floating_point:  # start + i * delta, in float64 then rounded once
        return [(start + delta * torch.arange(n, dtype=torch.float64, device=device)).to(dtype)]
    return [(start + delta * torch.arange(n, dtype=torch.int64, device=device)).to(dtype)]


@register("Flatten", max_since=25)  # later versions add element types only
def flatten(inputs, attrs, ctx):
    x = inputs[0]
    axis = attrs.get("axis", 1)
    axis = axis + x.dim() if axis < 0 else axis
    return [x.reshape(math.prod(x.shape[:axis]), math.prod(x.shape[axis:]))]


@register("Identity", max_since=25)  # later versions add element types only
def identity(inputs, attrs, ctx):
    return [inputs[0]]


@register("Constant", max_since=25)  # later versions add element types only
def constant(inputs, attrs, ctx):
    # Copies the attribute's host data to ctx.device on every call: a session folds Constant nodes
    # into initializers once, at creation.
    dev = ctx.device
    if "value" in attrs:
        return [tensor_from_proto(attrs["value"], dev)]
    forms = {
        "value_float": torch.float32, "value_floats": torch.float32,
        "value_int": torch.int64, "value_ints": torch.int64,
    }
    for key, dtype in forms.items():
        if key in attrs:
            return [torch.tensor(attrs[key], dtype=dtype, device=dev)]
    raise NotImplementedError(
        f"Constant node {ctx.node_name!r}: only value / value_float(s) / value_int(s) are supported, "
        f"got {sorted(attrs)}")


@register("Pad", max_since=25, host_inputs=(1, 3))  # later versions add element types only
def pad(inputs, attrs, ctx):
    x = inputs[0]
    where = f"Pad node {ctx.node_name!r}"
    mode = attrs.get("mode", "constant")
    if ctx.opset < 11:  # Pad-2: pads and value are attributes
        pads, value = list(attrs["pads"]), torch.tensor(attrs.get("value", 0.0), device=x.device)
        axes = list(range(x.dim()))
    else:
        pads = host_ints(inputs[1], f"{where} input 'pads'")
        value = opt(inputs, 2)
        axes = host_ints(inputs[3], f"{where} input 'axes'") if opt(inputs, 3) is not None else list(range(x.dim()))
    if len(pads) != 2 * len(axes):
        raise ValueError(f"{where}: 'pads' has {len(pads)} values, expected 2 * {len(axes)} (begins then ends)")
    axes = [norm_axis(a, x.dim(), f"{where} axis") for a in axes]
    begins, ends = pads[: len(axes)], pads[len(axes):]
    if mode == "constant":
        # crop negative pads, then copy the rest into a tensor filled with the value
        crop = [slice(None)] * x.dim()
        out_shape = list(x.shape)
        for a, b, e in zip(axes, begins, ends):
            crop[a] = slice(max(-b, 0), x.shape[a] - max(-e, 0))
            out_shape[a] = x.shape[a] + b + e
        x = x[tuple(crop)]
        fill = value.to(x.dtype).reshape(()) if value is not None else torch.zeros((), dtype=x.dtype, device=x.device)
        out = fill.expand(out_shape).clone()
        inner = [slice(None)] * x.dim()
        for a, b in zip(axes, begins):
            inner[a] = slice(max(b, 0), max(b, 0) + x.shape[a])
        out[tuple(inner)] = x
        return [out]
    if mode not in ("edge", "reflect", "wrap"):
        raise ValueError(f"{where}: mode must be constant, edge, reflect or wrap, got {mode!r}")
    for a, b, e in zip(axes, begins, ends):  # each padded axis is a gather of source positions
        d = x.shape[a]
        idx = torch.arange(-b, d + e, device=x.device)
        if mode == "edge":
            idx = idx.clamp(0, d - 1)
        elif mode == "wrap":
            idx = idx.remainder(d)
        else:  # reflect without repeating the border
            period = 2 * (d - 1) if d > 1 else 1
            idx = idx.remainder(period)
            idx = torch.where(idx >= d, period - idx, idx)
        x = x.index_select(a, idx)
    return [x]


@register("Trilu", host_inputs=(1,))
def trilu(inputs, attrs, ctx):
    x = inputs[0]
    k = host_scalar(inputs[1], f"Trilu node {ctx.node_name!r} input 'k'") if opt(inputs, 1) is not None else 0
    return [torch.triu(x, k) if attrs.get("upper", 1) else torch.tril(x, k)]
