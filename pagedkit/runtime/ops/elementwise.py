"""Elementwise ai.onnx ops: arithmetic, comparisons, logic, unary math, Where, Clip, Cast.

All broadcast numpy-style (torch's rules are the same) and compute in the input dtype.
"""

from __future__ import annotations

import functools
from typing import Any

import torch

from .registry import OpContext, register
from .util import opt, torch_dtype


def _binary(fn):
    def impl(inputs: list, attrs: dict[str, Any], ctx: OpContext) -> list[torch.Tensor]:
        return [fn(inputs[0], inputs[1])]

    return impl


for _name, _fn in {
    "Add": torch.add,
    "Sub": torch.sub,
    "Mul": torch.mul,
    "Equal": torch.eq,
    "Less": torch.lt,
    "LessOrEqual": torch.le,
    "Greater": torch.gt,
    "GreaterOrEqual": torch.ge,
    "And": torch.logical_and,
    "Or": torch.logical_or,
    "Xor": torch.logical_xor,
}.items():
    register(_name)(_binary(_fn))


@register("Div")
def div(inputs, attrs, ctx):
    a, b = inputs[0], inputs[1]
    if a.dtype.is_floating_point:
        return [a / b]
    return [torch.div(a, b, rounding_mode="trunc")]  # C-style integer division, as onnxruntime


@register("Pow")
def pow_(inputs, attrs, ctx):
    x, y = inputs[0], inputs[1]
    return [torch.pow(x, y).to(x.dtype)]  # the result has the base's type (T), whatever the exponent's (T1)


@register("Mod")
def mod(inputs, attrs, ctx):
    a, b = inputs[0], inputs[1]
    if attrs.get("fmod", 0):
        return [torch.fmod(a, b)]  # sign of the dividend (C fmod)
    if a.dtype.is_floating_point:
        raise ValueError(f"Mod node {ctx.node_name!r}: fmod=0 is only defined for integer inputs, got {a.dtype}")
    return [torch.remainder(a, b)]  # sign of the divisor (Python %)


def _variadic(fn):
    def impl(inputs, attrs, ctx):
        return [functools.reduce(fn, [t for t in inputs if t is not None])]

    return impl


register("Max")(_variadic(torch.maximum))
register("Min")(_variadic(torch.minimum))
register("Sum")(_variadic(torch.add))


@register("Mean")
def mean(inputs, attrs, ctx):
    ts = [t for t in inputs if t is not None]
    return [functools.reduce(torch.add, ts) / len(ts)]


def _unary(fn):
    def impl(inputs, attrs, ctx):
        return [fn(inputs[0])]

    return impl


for _name, _fn in {
    "Sqrt": torch.sqrt,
    "Exp": torch.exp,
    "Log": torch.log,
    "Neg": torch.neg,
    "Abs": torch.abs,
    "Reciprocal": torch.reciprocal,
    "Floor": torch.floor,
    "Ceil": torch.ceil,
    "Round": torch.round,  # half to even, as ONNX
    "Sin": torch.sin,
    "Cos": torch.cos,
    "Tan": torch.tan,
    "Asin": torch.asin,
    "Acos": torch.acos,
    "Atan": torch.atan,
    "Sinh": torch.sinh,
    "Cosh": torch.cosh,
    "Tanh": torch.tanh,
    "Erf": torch.erf,
    "Sigmoid": torch.sigmoid,
    "Relu": torch.relu,
    "Softplus": torch.nn.functional.softplus,
    "Sign": torch.sign,
    "Not": torch.logical_not,
    "IsNaN": torch.isnan,
}.items():
    register(_name)(_unary(_fn))


@register("IsInf")
def isinf(inputs, attrs, ctx):
    x = inputs[0]
    pos, neg = attrs.get("detect_positive", 1), attrs.get("detect_negative", 1)
    if pos and neg:
        return [torch.isinf(x)]
    if pos:
        return [torch.isposinf(x)]
    if neg:
        return [torch.isneginf(x)]
    return [torch.zeros_like(x, dtype=torch.bool)]


@register("Where")
def where(inputs, attrs, ctx):
    return [torch.where(inputs[0], inputs[1], inputs[2])]


@register("Clip")
def clip(inputs, attrs, ctx):
    x = inputs[0]
    lo, hi = opt(inputs, 1), opt(inputs, 2)
    if ctx.opset < 11:  # Clip-6: bounds are attributes
        lo, hi = attrs.get("min"), attrs.get("max")
    if lo is None and hi is None:
        return [x]
    return [torch.clamp(x, lo, hi)]  # min > max gives max everywhere, as onnxruntime's min(max(x, lo), hi)


@register("Cast", max_since=25)  # 24/25 add float8e8m0/int2 types and round_mode (e8m0 only): refused by torch_dtype
def cast(inputs, attrs, ctx):
    return [inputs[0].to(torch_dtype(attrs["to"], f"Cast node {ctx.node_name!r} attribute 'to'"))]


@register("CastLike")
def cast_like(inputs, attrs, ctx):
    return [inputs[0].to(inputs[1].dtype)]
