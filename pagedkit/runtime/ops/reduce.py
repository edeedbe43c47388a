"""Reductions: ReduceSum/Mean/Max/Min/Prod/L1/L2/SumSquare/LogSum/LogSumExp and CumSum.

Axes come as input 1 (ReduceSum from opset 13, the others from opset 18) or as the 'axes'
attribute (older opsets); both forms are accepted whatever the opset. No axes reduces over all
dimensions, unless noop_with_empty_axes=1, which returns the input (after the op's elementwise
pre-step for SumSquare/L1/L2, as onnxruntime does).
"""

from __future__ import annotations

import torch

from .registry import MAX_ONNX_OPSET, register
from .util import axes_from, host_scalar, norm_axis


def _prod(x: torch.Tensor, dims: list[int], keepdim: bool) -> torch.Tensor:
    for d in sorted(dims, reverse=True):
        x = torch.prod(x, dim=d, keepdim=keepdim)
    return x


# op -> (elementwise pre-step, reduction(x, dims, keepdim), post-step)
_REDUCTIONS = {
    "ReduceSum": (None, torch.sum, None),
    "ReduceMean": (None, torch.mean, None),
    "ReduceMax": (None, torch.amax, None),
    "ReduceMin": (None, torch.amin, None),
    "ReduceProd": (None, _prod, None),
    "ReduceL1": (torch.abs, torch.sum, None),
    "ReduceL2": (torch.square, torch.sum, torch.sqrt),
    "ReduceSumSquare": (torch.square, torch.sum, None),
    "ReduceLogSum": (None, torch.sum, torch.log),
    "ReduceLogSumExp": (None, torch.logsumexp, None),
}


def _make(op_type: str):
    pre, reduce, post = _REDUCTIONS[op_type]

    def impl(inputs, attrs, ctx):
        x = inputs[0]
        axes = axes_from(inputs, 1, attrs, f"{op_type} node {ctx.node_name!r} input 'axes'")
        if not axes:
            if attrs.get("noop_with_empty_axes", 0):
                return [pre(x) if pre is not None else x]
            axes = list(range(x.dim()))
        dims = sorted({norm_axis(a, x.dim(), f"{op_type} axis") for a in axes})
        y = pre(x) if pre is not None else x
        y = reduce(y, dims, keepdim=bool(attrs.get("keepdims", 1))) if dims else y
        y = post(y) if post is not None else y
        return [y.to(x.dtype)]  # torch sums integers in int64

    return impl


for _op in _REDUCTIONS:  # ReduceLogSum(Exp)-28 changes no semantics
    register(_op, max_since=28 if _op.startswith("ReduceLog") else MAX_ONNX_OPSET, host_inputs=(1,))(_make(_op))


@register("CumSum", host_inputs=(1,))
def cumsum(inputs, attrs, ctx):
    x = inputs[0]
    axis = norm_axis(int(host_scalar(inputs[1], f"CumSum node {ctx.node_name!r} input 'axis'")), x.dim(), "CumSum axis")
    reverse = bool(attrs.get("reverse", 0))
    y = x.flip(axis) if reverse else x
    c = torch.cumsum(y, dim=axis, dtype=x.dtype)
    if attrs.get("exclusive", 0):  # shift by one: [0, c0, c0+c1, ...]
        c = torch.cat([torch.zeros_like(c.narrow(axis, 0, 1)), c.narrow(axis, 0, c.shape[axis] - 1)], dim=axis)
    return [c.flip(axis) if reverse else c]
