"""Run scope: host bookkeeping shared by the attention nodes of one model run.

Every attention node of a decoder step reads the same `cumulative_sequence_length`, `past_seqlens`,
`block_table` (and usually the same cos / sin caches): what a kernel derives from them on the host (the
per-sequence extents, write slots, gather indices, masks, RoPE rows) is the same for all layers. A
session opens one scope per run (`with run_scope():`); a kernel memoizes such values with
`memo(key, build)`, the key holding `id()`s of input tensors, which stay alive for the whole run, so an id
names one tensor within a scope. Outside a scope (a kernel called directly) `memo` just builds.
"""

from __future__ import annotations

from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any, Callable, Hashable, Iterator

_SCOPE: ContextVar[dict | None] = ContextVar("pagedkit_run_scope", default=None)


@contextmanager
def run_scope() -> Iterator[dict]:
    """A fresh memo for the duration of one run (nested scopes are independent)."""
    memo_dict: dict = {}
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
