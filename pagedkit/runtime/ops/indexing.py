"""Index-driven ai.onnx ops: Gather, GatherElements, GatherND, ScatterND, ScatterElements, TopK,
ArgMax, ArgMin, NonZero, OneHot.

Negative indices count from the end, as ONNX allows. Scatter ops return a new tensor (the data
input is never written).
"""

from __future__ import annotations

import math

import torch

from .registry import FUSED_DOMAIN, register
from .util import host_scalar, norm_axis

_REDUCE = {"add": "sum", "mul": "prod", "max": "amax", "min": "amin"}


def _wrap(idx: torch.Tensor, dim: int | torch.Tensor) -> torch.Tensor:
    """Indices as int64 with negative ones counted from the end of a dimension of size `dim`."""
    idx = idx.long()
    return torch.where(idx < 0, idx + dim, idx)


@register("Gather")
def gather(inputs, attrs, ctx):
    x, idx = inputs[0], inputs[1]
    axis = norm_axis(attrs.get("axis", 0), x.dim(), "Gather axis")
    flat = x.index_select(axis, _wrap(idx, x.shape[axis]).reshape(-1))
    return [flat.reshape(x.shape[:axis] + idx.shape + x.shape[axis + 1:])]


@register("GatherElements")
def gather_elements(inputs, attrs, ctx):
    x, idx = inputs[0], inputs[1]
    axis = norm_axis(attrs.get("axis", 0), x.dim(), "GatherElements axis")
    return [torch.gather(x, axis, _wrap(idx, x.shape[axis]))]


def _linear_index(idx: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """Tuples idx[..., k] into the leading dims `dims` ([D0, .., Dk-1]) as row-major linear indices [...]."""
    lin = torch.zeros(idx.shape[:-1], dtype=torch.int64, device=idx.device)
    for j, d in enumerate(dims):
        lin = lin * d + _wrap(idx[..., j], d)
    return lin


@register("GatherND")
def gather_nd(inputs, attrs, ctx):
    x, idx = inputs[0], inputs[1]  # x [b.., D0..Dk-1, rest..], idx [b.., m.., k]
    b, k = attrs.get("batch_dims", 0), idx.shape[-1]
    batch = math.prod(x.shape[:b])
    dims = tuple(x.shape[b:b + k])
    data = x.reshape(batch, math.prod(dims), *x.shape[b + k:])  # [B, D0*..*Dk-1, rest..]
    lin = _linear_index(idx.reshape(batch, -1, k), dims)  # [B, M]
    rows = torch.arange(batch, device=x.device).unsqueeze(1)
    out = data[rows, lin]  # [B, M, rest..]
    return [out.reshape(idx.shape[:-1] + x.shape[b + k:])]


@register("ScatterND")
def scatter_nd(inputs, attrs, ctx):
    x, idx, upd = inputs[0], inputs[1], inputs[2]  # x [D0..Dk-1, rest..], idx [m.., k], upd [m.., rest..]
    k = idx.shape[-1]
    dims, rest = tuple(x.shape[:k]), x.shape[k:]
    out = x.clone().reshape(math.prod(dims), *rest)
    lin = _linear_index(idx, dims).reshape(-1)
    upd = upd.reshape(-1, *rest)
    reduction = attrs.get("reduction", "none")
    if reduction == "none":
        out[lin] = upd
    elif reduction == "add":
        out.index_add_(0, lin, upd)
    elif reduction in _REDUCE:
        index = lin.reshape(-1, *[1] * len(rest)).expand(upd.shape)
        out.scatter_reduce_(0, index, upd, _REDUCE[reduction], include_self=True)
    else:
        raise ValueError(f"ScatterND node {ctx.node_name!r}: unknown reduction {reduction!r}")
    return [out.reshape(x.shape)]


@register("ScatterElements")
def scatter_elements(inputs, attrs, ctx):
    x, idx, upd = inputs[0], inputs[1], inputs[2]
    axis = norm_axis(attrs.get("axis", 0), x.dim(), "ScatterElements axis")
    idx = _wrap(idx, x.shape[axis])
    reduction = attrs.get("reduction", "none")
    if reduction == "none":
        return [x.scatter(axis, idx, upd)]
    if reduction not in _REDUCE:
        raise ValueError(f"ScatterElements node {ctx.node_name!r}: unknown reduction {reduction!r}")
    return [x.scatter_reduce(axis, idx, upd, _REDUCE[reduction], include_self=True)]


@register("TopK", max_since=24, host_inputs=(1,))  # TopK-24 adds bfloat16
def topk(inputs, attrs, ctx):
    x = inputs[0]
    k = host_scalar(inputs[1], f"TopK node {ctx.node_name!r} input 'K'")
    axis = norm_axis(attrs.get("axis", -1), x.dim(), "TopK axis")
    # A stable sort puts equal values in index order, as ONNX requires; sorted=0 allows any order.
    values, indices = torch.sort(x, dim=axis, descending=bool(attrs.get("largest", 1)), stable=True)
    return [values.narrow(axis, 0, k), indices.narrow(axis, 0, k)]


def _arg(fn):
    def impl(inputs, attrs, ctx):
        x = inputs[0]
        axis = norm_axis(attrs.get("axis", 0), x.dim(), "axis")
        keep = bool(attrs.get("keepdims", 1))
        if attrs.get("select_last_index", 0):
            return [x.shape[axis] - 1 - fn(x.flip(axis), dim=axis, keepdim=keep)]
        return [fn(x, dim=axis, keepdim=keep)]  # first occurrence

    return impl


register("ArgMax")(_arg(torch.argmax))
register("ArgMin")(_arg(torch.argmin))


@register("NonZero")
def nonzero(inputs, attrs, ctx):
    return [torch.nonzero(inputs[0]).T.contiguous()]  # [rank, count], row-major order


@register("OneHot", host_inputs=(1,))
def one_hot(inputs, attrs, ctx):
    idx, depth, values = inputs[0], inputs[1], inputs[2]  # values [off, on]
    depth = int(host_scalar(depth, f"OneHot node {ctx.node_name!r} input 'depth'"))
    axis = norm_axis(attrs.get("axis", -1), idx.dim() + 1, "OneHot axis")
    idx = _wrap(idx, depth).unsqueeze(axis)  # out-of-range indices match nothing: all 'off'
    shape = [1] * (idx.dim())
    shape[axis] = depth
    hot = idx == torch.arange(depth, device=idx.device).reshape(shape)
    return [torch.where(hot, values[1], values[0])]


@register("SelectRows", domain=FUSED_DOMAIN)
def select_rows(inputs, attrs, ctx):
    """runtime/fuse.py's `logit_rows`: x [T, ...] -> the rows `rows` [R] int64 names (x itself, no copy, when rows is
    absent or empty). Rows on the host are checked against T (a ValueError naming the input); rows on a device are
    not read back (no synchronization), the caller (the engine) makes them in range."""
    x, rows = inputs[0], inputs[1] if len(inputs) > 1 else None
    if rows is None or rows.numel() == 0:
        return [x]
    if rows.dim() != 1:
        raise ValueError(f"input 'pagedkit.logit_rows': expected 1-D row indices, got shape {list(rows.shape)}")
    if rows.device.type == "cpu":
        lo, hi = int(rows.min()), int(rows.max())
        if lo < 0 or hi >= x.shape[0]:
            raise ValueError(f"input 'pagedkit.logit_rows': row indices must be in [0, {x.shape[0]}), got {lo}..{hi}")
    return [x.index_select(0, rows.to(x.device, torch.int64))]
