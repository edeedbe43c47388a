"""A small node builder over onnx-ir's Tape for the decompose pass: named values, constants, shapes.

Every value and node it creates is named `<prefix>/<n>` so the rewritten graph serializes with unique
names. Index arithmetic is int64; float math is float32 (the caller casts activations in and out).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np
import onnx_ir as ir

F32 = ir.DataType.FLOAT
I64 = ir.DataType.INT64


class Builder:
    """Records standard-ONNX nodes on a Tape; `op(...)` returns the (first) output value."""

    def __init__(self, prefix: str):
        self.tape = ir.tape.Tape()
        self.prefix = prefix
        self._n = 0

    def _name(self) -> str:
        self._n += 1
        return f"{self.prefix}/{self._n}"

    def op(self, op_type: str, *inputs: ir.Value | None, _domain: str = "", **attributes) -> ir.Value:
        name = self._name()
        out = self.tape.op(op_type, list(inputs), attributes or None, name=name, domain=_domain)
        out.name = f"{name}_out"
        return out

    def ops(self, op_type: str, *inputs: ir.Value | None, num_outputs: int, **attributes) -> Sequence[ir.Value]:
        name = self._name()
        outs = self.tape.op_multi_out(op_type, list(inputs), attributes or None, num_outputs=num_outputs, name=name)
        for i, o in enumerate(outs):
            o.name = f"{name}_out{i}"
        return outs

    @property
    def nodes(self) -> list[ir.Node]:
        return list(self.tape.nodes)

    # -- constants -------------------------------------------------------------------------------
    def const(self, array) -> ir.Value:
        return self.op("Constant", value=ir.tensor(np.asarray(array)))

    def i64(self, *values: int) -> ir.Value:
        """A 1-D int64 constant."""
        return self.const(np.array(values, dtype=np.int64))

    def scalar_i64(self, value: int) -> ir.Value:
        return self.const(np.array(value, dtype=np.int64))

    def f32(self, value: float) -> ir.Value:
        """A float32 scalar constant."""
        return self.const(np.array(value, dtype=np.float32))

    # -- shapes ----------------------------------------------------------------------------------
    def dim(self, x: ir.Value, axis: int) -> ir.Value:
        """x.shape[axis] as a 1-D int64 tensor of one element."""
        if axis == -1:
            return self.op("Shape", x, start=-1)
        return self.op("Shape", x, start=axis, end=axis + 1)

    def cat(self, *parts: ir.Value, axis: int = 0) -> ir.Value:
        return parts[0] if len(parts) == 1 else self.op("Concat", *parts, axis=axis)

    def shape(self, *parts: ir.Value | int) -> ir.Value:
        """A shape tensor from 1-element int64 tensors and python ints (no 0 / -1 magic needed)."""
        vals = [p if isinstance(p, ir.Value) else self.i64(int(p)) for p in parts]
        return self.cat(*vals)

    def reshape(self, x: ir.Value, *parts: ir.Value | int) -> ir.Value:
        """Reshape to explicit dims; allowzero=1: a computed 0 (an empty batch) means 0, not "copy"."""
        return self.op("Reshape", x, self.shape(*parts), allowzero=1)

    # -- short forms -----------------------------------------------------------------------------
    def cast(self, x: ir.Value, to: ir.DataType) -> ir.Value:
        return self.op("Cast", x, to=int(to))

    def f(self, x: ir.Value) -> ir.Value:
        return self.cast(x, F32)

    def unsq(self, x: ir.Value, *axes: int) -> ir.Value:
        return self.op("Unsqueeze", x, self.i64(*axes))

    def sq(self, x: ir.Value, *axes: int) -> ir.Value:
        return self.op("Squeeze", x, self.i64(*axes))

    def slice(self, x: ir.Value, start: int | ir.Value, end: int | ir.Value, axis: int, step: int = 1) -> ir.Value:
        s = start if isinstance(start, ir.Value) else self.i64(start)
        e = end if isinstance(end, ir.Value) else self.i64(end)
        return self.op("Slice", x, s, e, self.i64(axis), self.i64(step))

    def gather(self, x: ir.Value, idx: ir.Value, axis: int = 0) -> ir.Value:
        return self.op("Gather", x, idx, axis=axis)

    def where(self, c: ir.Value, a: ir.Value, b: ir.Value) -> ir.Value:
        return self.op("Where", c, a, b)

    def reduce(self, kind: str, x: ir.Value, axis: int, keepdims: int = 1) -> ir.Value:
        return self.op(kind, x, self.i64(axis), keepdims=keepdims)

    def and_(self, *xs: ir.Value) -> ir.Value:
        out = xs[0]
        for x in xs[1:]:
            out = self.op("And", out, x)
        return out

    def safe_div(self, x: ir.Value, s: ir.Value) -> ir.Value:
        """x / s where s != 0, else 0 (quant._ratio: an underflowed stored scale gives code 0)."""
        nz = self.op("Not", self.op("Equal", s, self.f32(0.0)))
        return self.where(nz, self.op("Div", x, self.where(nz, s, self.f32(1.0))), self.f32(0.0))
