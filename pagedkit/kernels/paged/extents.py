"""The one value guard an unvalidated PagedAttention call needs before it writes the caches.

A session validates each node at creation and calls the kernels with validate=False; prologue.prepare
keeps every read and write inside its tensor (slot_mapping's range, the block_table columns a write
uses), but with slot_mapping a sequence whose past_seqlens reaches beyond its block_table row is only
caught once attention reads it, after the step's K/V were written. `check_extents` checks that first, so
a bad call writes nothing (the session then diagnoses it with the full validator).
"""

from __future__ import annotations

from typing import Any, Mapping

from .prologue import as_torch, need


def check_extents(inputs: Mapping[str, Any]) -> None:
    """Every sequence's past_seqlens[b] + new tokens fits block_table.shape[1] * block_size (host ints)."""
    csl, past = inputs.get("cumulative_sequence_length"), inputs.get("past_seqlens")
    table, cache = inputs.get("block_table"), inputs.get("key_cache")
    if csl is None or past is None or table is None or cache is None or len(table.shape) != 2 or len(cache.shape) < 2:
        return  # prepare reports a malformed call itself
    csl, past = as_torch(csl).tolist(), as_torch(past).tolist()
    if len(csl) != len(past) + 1:
        return
    capacity = table.shape[1] * cache.shape[1]
    for b, p in enumerate(past):
        extent = p + csl[b + 1] - csl[b]
        need(extent <= capacity, "input 'block_table'", f"sequence {b} holds {extent} tokens but block_table covers "
             f"{capacity} ({table.shape[1]} blocks of {cache.shape[1]})")
