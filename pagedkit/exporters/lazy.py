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

    @staticmethod
    def __new__(cls, meta: torch.Tensor, thunk: Callable[[], torch.Tensor]):
        t = torch.Tensor._make_subclass(cls, meta.to("meta") if meta.device.type != "meta" else meta, False)
        t._thunk = thunk
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

        return tree_unflatten([LazyTensor(x, _pick(run, j)) if isinstance(x, torch.Tensor) else x
                               for j, x in enumerate(leaves)], spec)


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
            if p is None:
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


@contextlib.contextmanager
def checkpoint_parameters(model: torch.nn.Module, folder) -> Iterator[torch.nn.Module]:
    """Within the block, every parameter and buffer of `model` (typically built on the meta device: no memory)
    that the safetensors checkpoint in `folder` holds is a LazyTensor reading that one tensor from the file when
    evaluated (single file or sharded with model.safetensors.index.json), cast to the model's dtype. Tied
    parameters (one object under two names) read the first name the checkpoint has. Checkpoints whose tensors
    transformers renames or fuses when it loads them (its conversion mapping: per-expert MoE tensors fused into
    [E, ...] parameters) are not mapped yet: the first parameter missing from the checkpoint is named
    (KeyError)."""
    import json
    from pathlib import Path

    from safetensors import safe_open

    folder = Path(folder)
    index = folder / "model.safetensors.index.json"
    if index.exists():
        where = {k: folder / f for k, f in json.loads(index.read_text())["weight_map"].items()}
    else:
        files = sorted(folder.glob("*.safetensors"))
        where = {}
        for f in files:
            with safe_open(str(f), "pt") as h:
                where.update({k: f for k in h.keys()})

    def reader(path, key: str, dtype: torch.dtype) -> Callable[[], torch.Tensor]:
        def read() -> torch.Tensor:
            with safe_open(str(path), "pt") as h:
                return h.get_tensor(key).to(dtype)
        return read

    made: dict[int, LazyTensor] = {}
    swapped = []
    named = [(n, t, "_parameters") for n, t in model.named_parameters(remove_duplicate=False)]
    named += [(n, t, "_buffers") for n, t in model.named_buffers(remove_duplicate=False)]
    for full, t, table in named:
        if t is None:
            continue
        if id(t) not in made:
            if full not in where:
                if table == "_buffers":
                    continue  # computed buffers (rotary frequencies) are not in checkpoints
                raise KeyError(f"{folder}: the checkpoint has no tensor {full!r} (transformers may store it under "
                               "other names and convert it when loading; that conversion is not applied here)")
            made[id(t)] = LazyTensor(t.detach().to("meta"), reader(where[full], full, t.dtype))
        owner, _, attr = full.rpartition(".")
        module = model.get_submodule(owner) if owner else model
        swapped.append((module, table, attr, getattr(module, table)[attr]))
        getattr(module, table)[attr] = made[id(t)]
    try:
        yield model
    finally:
        for module, table, attr, t in swapped:
            getattr(module, table)[attr] = t
