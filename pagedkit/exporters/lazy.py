"""Lazy checkpoint tensors: a family's weight transforms are recorded while the graph is built and evaluated
only when each initializer is written.

A `LazyTensor` is a meta-device tensor (shape and dtype, no data) carrying a `thunk` that produces its value.
Every torch operation on it (`w.t()`, `torch.cat`, `chunk`, `reshape`, `1.0 + w`, `.float()`, indexing, ...)
runs once on meta tensors for the result's shape and returns a new LazyTensor whose thunk repeats the
operation on the materialized inputs. An operation whose result depends on the data (`.item()`, `torch.equal`,
`bool(t)`, `.tolist()`) has no meta result: it is evaluated at once, on the materialized inputs.

So a family is written as ordinary torch code over its Hugging Face module's parameters, and is at the same
time a function from checkpoint tensors to graph initializers, evaluated per tensor when the initializer is
written (`GraphBuilder` keeps the LazyTensor; `materialize` runs it). `lazy_parameters(model)` swaps a
module tree's parameters for LazyTensors while a graph is built (tied parameters stay one object: compare
them with `is`). Where a parameter's thunk reads a checkpoint file instead of memory, the same family code
exports without ever holding the model's weights (streaming export).
"""

from __future__ import annotations

import contextlib
from typing import Any, Callable, Iterator

import torch
from torch.utils._pytree import tree_flatten, tree_map, tree_unflatten


class LazyTensor(torch.Tensor):
    """A tensor known by its meta (shape, dtype) and a thunk computing its value."""

    _thunk: Callable[[], torch.Tensor]
    # how the value was made, for evaluating a slice of it without the whole (slicing.py): the torch operation
    # (func, args, kwargs, output index) of an operation's result; None for a leaf
    _src: tuple | None = None
    # a leaf's own reader of a slice: (dim, start, stop) -> the value's [start:stop] along dim; None: none
    _slicer: Callable[[int, int, int], torch.Tensor] | None = None

    @staticmethod
    def __new__(cls, meta: torch.Tensor, thunk: Callable[[], torch.Tensor],
                slicer: Callable[[int, int, int], torch.Tensor] | None = None):
        t = torch.Tensor._make_subclass(cls, meta.to("meta") if meta.device.type != "meta" else meta, False)
        t._thunk = thunk
        t._src = None
        t._slicer = slicer
        return t

    def materialize(self) -> torch.Tensor:
        value = self._thunk()
        if tuple(value.shape) != tuple(self.shape) or value.dtype != self.dtype:
            raise RuntimeError(f"lazy tensor evaluated to {tuple(value.shape)} {value.dtype}, expected "
                               f"{tuple(self.shape)} {self.dtype}")
        return value

    def __repr__(self, *, tensor_contents=None) -> str:
        return f"LazyTensor(shape={tuple(self.shape)}, dtype={self.dtype})"

    @classmethod
    def __torch_function__(cls, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name.endswith("_") and not name.startswith("__"):
            raise RuntimeError(f"in-place {name} on a checkpoint tensor: a family's weight transforms must be "
                               "out of place (they are replayed when each initializer is written)")
        if func in _PROPERTIES:  # shape, dtype, ...: the meta tensor answers
            with torch._C.DisableTorchFunctionSubclass():
                return func(*args, **kwargs)
        try:
            with torch._C.DisableTorchFunctionSubclass():
                meta_out = func(*tree_map(_to_meta, args), **tree_map(_to_meta, kwargs))
        except (NotImplementedError, RuntimeError):  # data-dependent: evaluate now
            return func(*tree_map(materialize, args), **tree_map(materialize, kwargs))
        leaves, spec = tree_flatten(meta_out)
        if not any(isinstance(x, torch.Tensor) for x in leaves):
            return meta_out

        def run() -> list:
            return tree_flatten(func(*tree_map(materialize, args), **tree_map(materialize, kwargs)))[0]

        return tree_unflatten([_made(x, run, (func, args, kwargs, j)) if isinstance(x, torch.Tensor) else x
                               for j, x in enumerate(leaves)], spec)


def _made(meta: torch.Tensor, run: Callable[[], list], src: tuple) -> "LazyTensor":
    t = LazyTensor(meta, _pick(run, src[3]))
    t._src = src
    return t


_PROPERTIES = {torch.Tensor.shape.__get__, torch.Tensor.dtype.__get__, torch.Tensor.dim, torch.Tensor.size,
               torch.Tensor.numel, torch.Tensor.element_size, torch.Tensor.ndim.__get__,
               torch.Tensor.is_floating_point, torch.Tensor.requires_grad.__get__, torch.Tensor.__len__}


def _pick(run: Callable[[], list], j: int) -> Callable[[], torch.Tensor]:
    return lambda: run()[j]


def _to_meta(x: Any) -> Any:
    if isinstance(x, LazyTensor):
        with torch._C.DisableTorchFunctionSubclass():
            return x.as_subclass(torch.Tensor)
    if isinstance(x, torch.Tensor):
        return x.to("meta")
    return x


def materialize(x: Any) -> Any:
    """The value of a LazyTensor (anything else unchanged)."""
    return x.materialize() if isinstance(x, LazyTensor) else x


def lazy(value: torch.Tensor, thunk: Callable[[], torch.Tensor] | None = None) -> LazyTensor:
    """A LazyTensor of `value`'s shape / dtype computed by `thunk` (default: returning `value` itself)."""
    if thunk is None:
        real = value.detach()
        thunk = lambda: real  # noqa: E731
    return LazyTensor(value.detach().to("meta"), thunk)


@contextlib.contextmanager
def lazy_parameters(model: torch.nn.Module) -> Iterator[torch.nn.Module]:
    """Within the block, every parameter of `model` is a LazyTensor evaluating to the parameter (one
    LazyTensor per parameter object: tied weights stay identical); restored on exit."""
    made: dict[int, LazyTensor] = {}
    swapped = []
    for module in model.modules():
        for name, p in list(module._parameters.items()):
            if p is None or isinstance(p, LazyTensor):  # a streamed model's parameters are lazy already
                continue
            if id(p) not in made:
                made[id(p)] = lazy(p)
            swapped.append((module, name, p))
            module._parameters[name] = made[id(p)]
    try:
        yield model
    finally:
        for module, name, p in swapped:
            module._parameters[name] = p
