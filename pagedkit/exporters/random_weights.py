"""Random weights that cost nothing until written: a Hugging Face model on the meta device whose parameters are
lazy random tensors, drawn the way the model's own `_init_weights` draws them, in parallel row blocks.

`lazy_random_model(config, dtype, seed)` returns what `AutoModelForCausalLM.from_config(config, dtype=dtype)`
would (the same module tree, the same parameter dtypes), without a byte of weights: each parameter is a
`LazyTensor` (lazy.py). Its value follows the initialization transformers (5.x) gives that parameter —
recorded once by running the model's `initialize_weights()` on the meta model with the init primitives of
`transformers.initialization` replaced by recorders (normal_ with the config's initializer_range for a
projection, ones_ for a norm, zeros_ for a bias, ...). The random numbers are fixed by (seed, parameter name,
row block): every block of BLOCK_ELEMS elements' rows draws from its own generator, so
- a tensor evaluated whole equals its row slices evaluated alone (the export writes big tensors in row chunks,
  slicing.py), whatever the order, thread count or chunk size;
- the blocks of one tensor are drawn by a thread pool (torch releases the GIL), not one serial generator: a
  full-size model (DeepSeek-V2-Lite, 15.7 B parameters) exports as fast as its file is written;
- memory holds one tensor (or one row chunk) at a time, not the model.

`materialized_random_model(config, dtype, seed)` is the same model with real tensors (the one tests and
`load_model(stream=False)` run in Hugging Face eager): equal, parameter for parameter, to the lazy one's values.

A model this cannot record (transformers 4.x, an init that copies computed values, an op with no rule here, a
parameter no init touches) is refused with `RandomInitUnsupported` naming why; weights.py then builds the model
eagerly with from_config, as before.
"""

from __future__ import annotations

import hashlib
import math
import os
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field

import torch

from .lazy import LazyTensor

BLOCK_ELEMS = 1 << 20  # rows per block: the fewest whose elements reach this (one block for a small tensor)
# elementwise fills: each row block is drawn alone (the same values whole or sliced)
_FILLS = ("normal_", "uniform_", "trunc_normal_", "constant_", "ones_", "zeros_")
# whole-tensor draws (their law depends on the shape): evaluated on the whole tensor, after the fills
_WHOLE = ("xavier_uniform_", "xavier_normal_", "kaiming_uniform_", "kaiming_normal_", "orthogonal_", "eye_")
_RANDOM = ("normal_", "uniform_", "trunc_normal_") + _WHOLE[:5]
_NEEDED = ("TORCH_INIT_FUNCTIONS", "copy_", "no_tie_weights", "no_init_weights")  # of transformers.initialization


class RandomInitUnsupported(RuntimeError):
    """This model's initialization cannot be recorded (the message says why); build it eagerly instead."""


@dataclass
class _Op:
    name: str  # an entry of _FILLS / _WHOLE
    kwargs: dict
    view: tuple | None = None  # (size, stride, storage_offset) of a view the op filled; None: the whole tensor

    @property
    def row_fill(self) -> bool:
        """An elementwise fill of the whole tensor: drawn block by block."""
        return self.view is None and self.name in _FILLS


@dataclass
class _Plan:
    name: str  # the parameter's (first) name: part of its seeds
    ops: list[_Op] = field(default_factory=list)

    def sliceable(self) -> bool:
        return all(op.row_fill for op in self.ops)


def _seed(seed: int, name: str, k: int, block: int) -> int:
    digest = hashlib.blake2b(f"{seed}/{name}/{k}/{block}".encode(), digest_size=8).digest()
    return int.from_bytes(digest, "little") & ((1 << 63) - 1)


def _threads() -> int:
    return max(1, min(32, os.cpu_count() or 1))


_POOL: ThreadPoolExecutor | None = None


def _pool() -> ThreadPoolExecutor:
    global _POOL
    if _POOL is None:
        _POOL = ThreadPoolExecutor(_threads(), thread_name_prefix="pagedkit-random")
    return _POOL


def block_rows(shape: tuple[int, ...]) -> int:
    """Rows of one block of a tensor of `shape` (dim 0; a 0-d tensor is one block)."""
    row = math.prod(shape[1:]) if len(shape) > 1 else 1
    return max(1, BLOCK_ELEMS // max(1, row))


def _fill(out: torch.Tensor, op: _Op, gen: torch.Generator | None) -> None:
    from transformers.initialization import TORCH_INIT_FUNCTIONS

    kw = dict(op.kwargs)
    if op.name in _RANDOM:
        kw["generator"] = gen
    TORCH_INIT_FUNCTIONS[op.name](out, **kw)


def _draw_rows(plan: _Plan, shape: tuple[int, ...], dtype: torch.dtype, seed: int, a: int, b: int) -> torch.Tensor:
    """Rows [a, b) of the fills of `plan` (all ops whole-tensor fills), block by block in the pool."""
    if not shape:
        out = torch.empty((), dtype=dtype)
        for k, op in enumerate(plan.ops):
            _fill(out, op, torch.Generator().manual_seed(_seed(seed, plan.name, k, 0)))
        return out
    out = torch.empty((b - a,) + tuple(shape[1:]), dtype=dtype)
    rows = block_rows(shape)

    def one(block: int) -> None:
        lo, hi = max(a, block * rows), min(b, (block + 1) * rows)
        full = torch.empty((min(shape[0], (block + 1) * rows) - block * rows,) + tuple(shape[1:]), dtype=dtype)
        for k, op in enumerate(plan.ops):  # the block is drawn whole, then the asked rows kept: same values
            _fill(full, op, torch.Generator().manual_seed(_seed(seed, plan.name, k, block)))
        out[lo - a:hi - a] = full[lo - block * rows:hi - block * rows]

    blocks = range(a // rows, -(-b // rows)) if b > a else range(0)
    if len(blocks) > 1:
        list(_pool().map(one, blocks))
    else:
        for block in blocks:
            one(block)
    return out


def evaluate(plan: _Plan, shape: tuple[int, ...], dtype: torch.dtype, seed: int,
             rows: tuple[int, int] | None = None) -> torch.Tensor:
    """The value of a parameter planned by `plan` (its rows [a, b) when `rows` is given and it is sliceable)."""
    if plan.sliceable():
        a, b = rows if rows is not None else (0, shape[0] if shape else 0)
        return _draw_rows(plan, shape, dtype, seed, a, b)
    if rows is not None:
        raise ValueError(f"{plan.name}: row slices of a whole-tensor init")
    first = next((i for i, op in enumerate(plan.ops) if not op.row_fill), len(plan.ops))  # the leading fills
    out = _draw_rows(_Plan(plan.name, plan.ops[:first]), shape, dtype, seed, 0, shape[0] if shape else 0)
    for k, op in enumerate(plan.ops[first:], start=first):  # in order, on the whole tensor or the view filled
        target = out if op.view is None else out.as_strided(*op.view)
        _fill(target, op, torch.Generator().manual_seed(_seed(seed, plan.name, k, -1)))
    return out


def _record(config, dtype: torch.dtype) -> dict[str, _Plan]:
    """parameter name -> its plan, by running initialize_weights() on an untied meta twin of the model (HF
    initializes before it ties: a tied head must not re-draw the embedding and its padding row) with the
    transformers init primitives replaced by recorders."""
    try:
        from transformers import initialization as init
    except ImportError as exc:  # transformers 4.x: no recordable init primitives
        raise RandomInitUnsupported("this transformers has no transformers.initialization (5.x)") from exc
    missing = [a for a in _NEEDED if not hasattr(init, a)]
    if missing:
        raise RandomInitUnsupported(f"transformers.initialization lacks {', '.join(missing)}")
    from .checkpoint import meta_model

    with init.no_tie_weights():
        model = meta_model(config, dtype)
    names: dict[int, str] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        names.setdefault(id(p), n)
    plans = {i: _Plan(n) for i, n in names.items()}
    problems: list[str] = []

    def owner(t: torch.Tensor) -> tuple[_Plan | None, tuple | None]:
        base = t._base if t._base is not None else t
        plan = plans.get(id(base))
        if plan is None or base is t:
            return plan, None
        return plan, (tuple(t.size()), tuple(t.stride()), t.storage_offset())

    def recorder(op_name: str):
        def rec(tensor, *args, **kwargs):
            if getattr(tensor, "_is_hf_initialized", False):
                return tensor
            plan, view = owner(tensor)
            if plan is None:
                return tensor  # a buffer: not exported as a weight (computed from the config)
            kwargs.pop("generator", None)
            if args:
                params = list(_ARGS[op_name])
                kwargs.update(zip(params, args))
            if op_name not in _FILLS + _WHOLE:
                problems.append(f"{plan.name}: {op_name}")
            else:
                plan.ops.append(_Op(op_name, kwargs, view))
            return tensor
        return rec

    def copy_rec(tensor, other):
        plan, _ = owner(tensor)
        if plan is not None:
            problems.append(f"{plan.name}: copy_ of a computed value")
        return tensor

    saved = dict(init.TORCH_INIT_FUNCTIONS)
    saved_copy = init.copy_
    try:
        for k in saved:
            init.TORCH_INIT_FUNCTIONS[k] = recorder(k)
        init.copy_ = copy_rec
        with torch.no_grad():
            model.initialize_weights()
    finally:
        init.TORCH_INIT_FUNCTIONS.update(saved)
        init.copy_ = saved_copy
    problems += [f"{p.name}: no init touches it" for p in plans.values() if not p.ops]
    if problems:
        raise RandomInitUnsupported("; ".join(problems[:4]) + (" ..." if len(problems) > 4 else ""))
    return {p.name: p for p in plans.values()}


_ARGS = {"normal_": ("mean", "std"), "uniform_": ("a", "b"), "trunc_normal_": ("mean", "std", "a", "b"),
         "constant_": ("val",), "ones_": (), "zeros_": (), "eye_": (), "xavier_uniform_": ("gain",),
         "xavier_normal_": ("gain",), "kaiming_uniform_": ("a", "mode", "nonlinearity"),
         "kaiming_normal_": ("a", "mode", "nonlinearity"), "orthogonal_": ("gain",)}


def _leaves(model: torch.nn.Module, config, dtype: torch.dtype, seed: int) -> dict[int, LazyTensor]:
    """id(parameter) -> its lazy random value; a tied parameter takes the plan of its tie's source (the
    embedding of a tied head), as HF's tie_weights keeps the source's values."""
    plans = _record(config, dtype)
    sources = set((getattr(model, "all_tied_weights_keys", None) or {}).values())
    named: dict[int, list[str]] = {}
    for n, p in model.named_parameters(remove_duplicate=False):
        named.setdefault(id(p), []).append(n)
    made = {}
    for n, p in model.named_parameters():
        plan = plans[next((m for m in named[id(p)] if m in sources), n)]
        shape = tuple(p.shape)

        def read(rows=None, plan=plan, shape=shape, dtype=p.dtype):
            return evaluate(plan, shape, dtype, seed, rows)

        def slicer(dim, a, b, plan=plan, read=read, shape=shape):
            return read((a, b)) if dim == 0 and plan.sliceable() and len(shape) else None

        made[id(p)] = LazyTensor(p.detach(), read, slicer)
    return made


def lazy_random_model(config, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """The meta-device model of `config` whose parameters are lazy random tensors (module doc)."""
    from .checkpoint import install, meta_model

    model = meta_model(config, dtype)
    made = _leaves(model, config, dtype, seed)
    install(model, {n: made[id(p)] for n, p in model.named_parameters(remove_duplicate=False)}, "random weights")
    return model


def materialized_random_model(config, dtype: torch.dtype, seed: int) -> torch.nn.Module:
    """The model from_config(config) builds (buffers included), every parameter the lazy random model's value.
    Built without transformers' own draws (no_init_weights): they would be overwritten."""
    from transformers import AutoModelForCausalLM
    from transformers.initialization import no_init_weights

    lazy = lazy_random_model(config, dtype, seed)
    values = dict(lazy.named_parameters(remove_duplicate=False))
    config._attn_implementation = "eager"
    with no_init_weights():  # it skips tie_weights too (PreTrainedModel.init_weights): tied below
        model = AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
    model.tie_weights()
    if [n for n, _ in model.named_parameters()] != [n for n, _ in lazy.named_parameters()]:
        raise RandomInitUnsupported("from_config's parameters (tied ones removed) differ from the meta model's")
    with torch.no_grad():
        for name, p in model.named_parameters():
            p.copy_(values[name].materialize())
    return model.eval()
