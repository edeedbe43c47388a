"""Run scope: host bookkeeping shared by the attention nodes of one model run.

Every attention node of a decoder step reads the same `cumulative_sequence_length`, `past_seqlens`,
`block_table` (and usually the same cos / sin caches): what a kernel derives from them on the host (the
per-sequence extents, write slots, gather indices, masks, RoPE rows) is the same for all layers. A
session opens one scope per run (`with run_scope():`); a kernel memoizes such values with
`memo(key, build)`, the key holding `id()`s of input tensors, which stay alive for the whole run, so an id
names one tensor within a scope. Outside a scope (a kernel called directly) `memo` just builds.

A scope may also carry the caller's promise `distinct_slots` (`run_scope(distinct_slots=True)`): no two tokens
of the run write the same cache slot, except rows that write only a pad block whose outputs nobody reads (every
KVCacheManager plan, padded CUDA-graph plans included). A kernel may then skip its duplicate-slot handling
(the Triton cache write's dedup, kernels/triton/cache_write.py); results are the same either way when the
promise holds. `distinct_slots()` reads it (False outside a scope).
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Hashable, Iterator

_SCOPE: ContextVar[dict | None] = ContextVar("pagedkit_run_scope", default=None)
_DISTINCT = "distinct_slots"  # the scope dict's promise flag (memo keys are tuples, never this string)


@contextmanager
def run_scope(*, distinct_slots: bool = False) -> Iterator[dict]:
    """A fresh memo for the duration of one run (nested scopes are independent); distinct_slots: the caller's
    promise (module docstring)."""
    memo_dict: dict = {_DISTINCT: True} if distinct_slots else {}
    token = _SCOPE.set(memo_dict)
    try:
        yield memo_dict
    finally:
        _SCOPE.reset(token)


def memo(key: Hashable, build: Callable[[], Any]) -> Any:
    """build() once per run scope for `key` (every call outside a scope builds)."""
    d = _SCOPE.get()
    if d is None:
        return build()
    try:
        return d[key]
    except KeyError:
        value = d[key] = build()
        return value


def distinct_slots() -> bool:
    """Whether the current run scope carries the distinct-slots promise (module docstring)."""
    d = _SCOPE.get()
    return bool(d is not None and d.get(_DISTINCT))
