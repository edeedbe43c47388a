"""A slice of a lazy weight, evaluated from slices of the checkpoint tensors it is made of (streaming export).

`narrow(x, dim, start, stop)` equals `materialize(x)[..., start:stop, ...]` (along `dim`), bit for bit, but walks
the operations x was recorded with (lazy.py) and asks each input only for the part the slice needs: a
transposed weight's rows are its source's columns, a row range of `torch.stack(experts)` is a few experts, a
row range of `torch.cat([q, k, v], 1)` is the same rows of each, `reshape` keeps whole rows together, and an
elementwise operation (casts, `1 + w`, `detach`) is sliced through. At the leaves a checkpoint tensor reads the
rows asked for from its file (its `_slicer`); a slice along another axis, or an operation without a rule here,
evaluates that tensor once, keeps it in a small cache until `clear()` (the writer calls it after each
initializer) and slices it. So an initializer is written in row chunks while at most the tensors one
initializer is made of are held whole.
"""

from __future__ import annotations

import math
from typing import Any, Callable

import torch
from torch.utils._pytree import tree_map

from .lazy import LazyTensor, materialize

_whole_cache: dict[int, tuple[LazyTensor, torch.Tensor]] = {}  # id -> (tensor, value) until clear()
_chunk_memo: dict[tuple, tuple[LazyTensor, torch.Tensor]] = {}  # (id, dim, start, stop) -> slice, until end_chunk()

_ELEMENTWISE = {"to", "float", "half", "bfloat16", "double", "detach", "contiguous", "clone", "type_as", "add",
                "sub", "mul", "div", "neg", "__add__", "__radd__", "__sub__", "__rsub__", "__mul__", "__rmul__",
                "__truediv__", "__neg__", "abs", "sigmoid", "exp", "sqrt", "rsqrt", "square", "pow", "__pow__"}


def clear() -> None:
    """Forget the tensors kept whole for slicing (after each initializer)."""
    _whole_cache.clear()
    _chunk_memo.clear()


def end_chunk() -> None:
    """Forget the slices computed for one chunk (an input two outputs share — gate and up of one fused
    tensor — is sliced once per chunk)."""
    _chunk_memo.clear()


def whole(x: LazyTensor) -> torch.Tensor:
    """x evaluated once (kept until clear())."""
    hit = _whole_cache.get(id(x))
    if hit is None or hit[0] is not x:
        hit = _whole_cache[id(x)] = (x, x.materialize())
    return hit[1]


def narrow(x: Any, dim: int, start: int, stop: int) -> torch.Tensor:
    """x[start:stop] along `dim` (x a LazyTensor or a tensor), evaluated from the slices its inputs need."""
    if not isinstance(x, LazyTensor):
        return torch.as_tensor(x).narrow(dim, start, stop - start)
    dim = dim % x.dim()
    if start == 0 and stop == x.shape[dim]:
        return x.materialize()
    key = (id(x), dim, start, stop)
    hit = _chunk_memo.get(key)
    if hit is not None and hit[0] is x:
        return hit[1]
    if x._src is None:
        value = x._slicer(dim, start, stop) if x._slicer is not None else None
    else:
        func, args, kwargs, j = x._src
        rule = _RULES.get("elementwise" if _name(func) in _ELEMENTWISE else _name(func))
        value = rule(x, func, args, kwargs or {}, j, dim, start, stop) if rule is not None else None
    if value is None:
        return whole(x).narrow(dim, start, stop - start)
    want = list(x.shape)
    want[dim] = stop - start
    if list(value.shape) != want or value.dtype != x.dtype:
        raise RuntimeError(f"slice of a lazy tensor evaluated to {tuple(value.shape)} {value.dtype}, expected "
                           f"{tuple(want)} {x.dtype}")
    _chunk_memo[key] = (x, value)
    return value


def _name(func: Callable) -> str:
    return getattr(func, "__name__", "")


def _arg(args: tuple, kwargs: dict, pos: int, name: str, default: Any) -> Any:
    return args[pos] if len(args) > pos else kwargs.get(name, default)


def _elementwise(x, func, args, kwargs, j, dim, a, b):
    nd = x.dim()

    def cut(v):
        if not isinstance(v, torch.Tensor) or v.dim() == 0:
            return materialize(v)
        d = dim - (nd - v.dim())  # broadcasting aligns trailing axes
        if d < 0 or (v.shape[d] == 1 and x.shape[dim] != 1):
            return materialize(v)
        return narrow(v, d, a, b)

    if j != 0:
        return None
    return func(*tree_map(cut, args), **tree_map(cut, kwargs))


def _t(x, func, args, kwargs, j, dim, a, b):
    src = args[0]
    if src.dim() < 2:
        return narrow(src, dim, a, b)
    return narrow(src, 1 - dim, a, b).t()


def _transpose(x, func, args, kwargs, j, dim, a, b):
    src = args[0]
    d0 = _arg(args, kwargs, 1, "dim0", None) % src.dim()
    d1 = _arg(args, kwargs, 2, "dim1", None) % src.dim()
    mapped = d1 if dim == d0 else d0 if dim == d1 else dim
    return narrow(src, mapped, a, b).transpose(d0, d1)


def _permute(x, func, args, kwargs, j, dim, a, b):
    src = args[0]
    dims = args[1:] if len(args) > 1 and isinstance(args[1], int) else _arg(args, kwargs, 1, "dims", None)
    dims = [d % src.dim() for d in dims]
    return narrow(src, dims[dim], a, b).permute(dims)


def _reshape(x, func, args, kwargs, j, dim, a, b):
    src = args[0]
    s_in, s_out = list(src.shape), list(x.shape)
    if dim >= len(s_in) or s_in[:dim] != s_out[:dim]:
        return None
    p_in, p_out = math.prod(s_in[dim + 1:]), math.prod(s_out[dim + 1:])
    if p_in == 0 or p_out == 0:
        return None
    if p_out % p_in == 0:  # each output row is r whole input rows
        r = p_out // p_in
        lo, hi = a * r, b * r
    elif p_in % p_out == 0 and a % (p_in // p_out) == 0 and b % (p_in // p_out) == 0:
        k = p_in // p_out
        lo, hi = a // k, b // k
    else:
        return None
    return narrow(src, dim, lo, hi).reshape(s_out[:dim] + [b - a] + s_out[dim + 1:])


def _split(x, func, args, kwargs, j, dim, a, b):
    src = args[0]
    c = _arg(args, kwargs, 2, "dim", 0) % src.dim()
    with torch._C.DisableTorchFunctionSubclass():
        meta_in = src.as_subclass(torch.Tensor)
        outs = func(meta_in, *args[1:], **kwargs)
    if dim != c:
        return func(narrow(src, dim, a, b), *args[1:], **kwargs)[j]
    off = sum(o.shape[c] for o in outs[:j])
    return narrow(src, c, off + a, off + b)


def _cat(x, func, args, kwargs, j, dim, a, b):
    parts = list(args[0])
    c = _arg(args, kwargs, 1, "dim", 0) % x.dim()
    if dim != c:
        return torch.cat([narrow(t, dim, a, b) for t in parts], c)
    got, off = [], 0
    for t in parts:
        n = t.shape[c]
        lo, hi = max(a - off, 0), min(b - off, n)
        if lo < hi:
            got.append(narrow(t, c, lo, hi))
        off += n
    return torch.cat(got, c)


def _stack(x, func, args, kwargs, j, dim, a, b):
    parts = list(args[0])
    c = _arg(args, kwargs, 1, "dim", 0) % x.dim()
    if dim == c:
        return torch.stack([materialize(t) for t in parts[a:b]], c)
    return torch.stack([narrow(t, dim if dim < c else dim - 1, a, b) for t in parts], c)


def _narrow_op(x, func, args, kwargs, j, dim, a, b):
    src = args[0]
    d = _arg(args, kwargs, 1, "dim", None) % src.dim()
    s, n = _arg(args, kwargs, 2, "start", None), _arg(args, kwargs, 3, "length", None)
    if d == dim:
        return narrow(src, dim, s + a, s + b)
    return narrow(src, dim, a, b).narrow(d, s, n)


def _getitem(x, func, args, kwargs, j, dim, a, b):
    src, idx = args[0], args[1]
    idx = idx if isinstance(idx, tuple) else (idx,)
    if not all(isinstance(e, (int, slice)) for e in idx):
        return None
    di = do = 0
    for k, e in enumerate(idx):
        if isinstance(e, int):
            di += 1
            continue
        if do == dim:
            start, stop, step = e.indices(src.shape[di])
            if step != 1:
                return None
            rest = idx[:k] + (slice(None),) + idx[k + 1:]
            return narrow(src, di, start + a, start + b)[rest]
        di += 1
        do += 1
    return narrow(src, di + (dim - do), a, b)[idx]


_RULES: dict[str, Callable] = {
    "elementwise": _elementwise, "t": _t, "transpose": _transpose, "swapaxes": _transpose, "permute": _permute,
    "reshape": _reshape, "view": _reshape, "chunk": _split, "split": _split, "cat": _cat, "concat": _cat,
    "concatenate": _cat, "stack": _stack, "narrow": _narrow_op, "__getitem__": _getitem,
}
