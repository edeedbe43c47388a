"""PagedAttention rules on integer contents: they run whenever values are known (run time, or
constants / initializers in a static view). block_table values are never checked: an entry < 0 or
>= num_blocks means "unmapped" (masked), not an error.
"""

from __future__ import annotations

from typing import Iterator

import numpy as np

from ..issues import Issue
from ..nodeview import NodeView
from .common import dim, has_rank, inp, int_attr, int_values
from .paged_dims import paged_dims

P = "PA"

DOCS = {
    "csl-start": "cumulative_sequence_length[0] must be 0.",
    "csl-monotonic": "cumulative_sequence_length must be non-decreasing.",
    "csl-total": "cumulative_sequence_length[-1] must equal token_count.",
    "past-seqlens-values": "past_seqlens entries must be >= 0.",
    "context-capacity": "past_seqlens[b] + q_len_b must be <= block_table.shape[1] * block_size.",
    "slot-mapping-range": "slot_mapping entries must be in [-1, num_blocks * block_size).",
    "query-positions-values": "query_positions entries must be >= 0.",
    "metadata-values": "attention_metadata entries must be >= 0 (0 = unknown).",
    "rotary-positions": "Every rotary position (past_seqlens[b] + j, or query_positions) must be < cos_cache.shape[0].",
    "bias-q-capacity": "attention_bias dimension 2 must be >= the largest q_len_b.",
    "bias-kv-capacity": "attention_bias dimension 3 must be >= the largest past_seqlens[b] + q_len_b.",
}


def _first_bad(mask: np.ndarray) -> int:
    return int(np.flatnonzero(mask)[0])


def sequence_values(view: NodeView) -> Iterator[Issue]:
    d = paged_dims(view)
    csl = d.csl
    name = "cumulative_sequence_length"
    if csl is not None and len(csl) >= 1:
        if csl[0] != 0:
            yield view.issue(inp(name), f"{P}-csl-start", f"{name}[0] == 0", int(csl[0]),
                             f"Input '{name}' must start at 0, got {name}[0] = {int(csl[0])}")
        steps = np.diff(csl)
        if np.any(steps < 0):
            b = _first_bad(steps < 0)
            yield view.issue(inp(name), f"{P}-csl-monotonic", "non-decreasing entries",
                             f"{name}[{b + 1}] = {int(csl[b + 1])} < {name}[{b}] = {int(csl[b])}",
                             f"Input '{name}' must be non-decreasing")
        if d.token_count is not None and csl[-1] != d.token_count:
            yield view.issue(inp(name), f"{P}-csl-total", f"{name}[-1] == {d.token_count} (token_count)",
                             int(csl[-1]), f"Input '{name}' must end at token_count ({d.token_count}), "
                             f"got {int(csl[-1])}")
    if d.past is not None and np.any(d.past < 0):
        b = _first_bad(d.past < 0)
        yield view.issue(inp("past_seqlens"), f"{P}-past-seqlens-values", "entries >= 0",
                         f"past_seqlens[{b}] = {int(d.past[b])}", "Input 'past_seqlens' entries must be >= 0")
    ext, cap = d.extents, d.context_capacity
    if ext is not None and cap is not None and np.any(ext > cap):
        b = _first_bad(ext > cap)
        yield view.issue(inp("block_table"), f"{P}-context-capacity",
                         f"past_seqlens[b] + q_len_b <= {cap} (block_table.shape[1] * block_size)",
                         f"sequence {b}: {int(d.past[b])} + {int(d.q_lens[b])} = {int(ext[b])}",
                         f"Sequence {b} needs {int(ext[b])} KV positions but input 'block_table' addresses "
                         f"only {d.max_blocks} blocks * block_size {d.block_size} = {cap}")


def index_values(view: NodeView) -> Iterator[Issue]:
    d = paged_dims(view)
    slots = int_values(view.t("slot_mapping"))
    if slots is not None and d.num_blocks is not None and d.block_size is not None:
        n = d.num_blocks * d.block_size
        bad = (slots < -1) | (slots >= n)
        if np.any(bad):
            t = _first_bad(bad)
            yield view.issue(inp("slot_mapping"), f"{P}-slot-mapping-range", f"entries in [-1, {n}) "
                             "(num_blocks * block_size)", f"slot_mapping[{t}] = {int(slots[t])}",
                             f"Input 'slot_mapping' entries must be -1 or a slot in [0, num_blocks * block_size "
                             f"= {n})")
    for name, rid in (("query_positions", "query-positions-values"), ("attention_metadata", "metadata-values")):
        v = int_values(view.t(name))
        if v is not None and np.any(v < 0):
            i = _first_bad(v < 0)
            yield view.issue(inp(name), f"{P}-{rid}", "entries >= 0", f"{name}[{i}] = {int(v[i])}",
                             f"Input '{name}' entries must be >= 0")


def _max_position(view: NodeView, d) -> tuple[int, str] | None:
    qpos = int_values(view.t("query_positions"))
    if qpos is not None:
        return (int(qpos.max()), "query_positions") if len(qpos) else None
    ext = d.extents
    if ext is None:
        return None
    live = d.q_lens > 0
    if not np.any(live):
        return None
    return int((ext[live] - 1).max()), "past_seqlens[b] + q_len_b - 1"


def capacity_values(view: NodeView) -> Iterator[Issue]:
    d = paged_dims(view)
    cos = view.t("cos_cache")
    rows = dim(cos, 0) if has_rank(cos, 2) else None
    if int_attr(view, "do_rotary") == 1 and rows is not None:
        mp = _max_position(view, d)
        if mp is not None and mp[0] >= rows:
            yield view.issue(inp("cos_cache"), f"{P}-rotary-positions", f"every position < {rows} "
                             "(cos_cache dimension 0)", f"position {mp[0]} (from {mp[1]})",
                             f"Input 'cos_cache' dimension 0 ({rows}) must exceed the largest rotary position "
                             f"{mp[0]}")
    bias = view.t("attention_bias")
    if has_rank(bias, 4) and d.q_lens is not None and len(d.q_lens):
        qmax = int(d.q_lens.max())
        d2 = dim(bias, 2)
        if d2 is not None and d2 < qmax:
            yield view.issue(inp("attention_bias"), f"{P}-bias-q-capacity", f">= {qmax} (largest q_len)", d2,
                             f"Input 'attention_bias' dimension 2 (query capacity) must be >= the largest "
                             f"query length {qmax}, got {d2}")
        ext = d.extents
        d3 = dim(bias, 3)
        if ext is not None and d3 is not None and d3 < int(ext.max()):
            kmax = int(ext.max())
            yield view.issue(inp("attention_bias"), f"{P}-bias-kv-capacity",
                             f">= {kmax} (largest past_seqlens[b] + q_len_b)", d3,
                             f"Input 'attention_bias' dimension 3 (context capacity) must be >= the largest "
                             f"KV extent {kmax}, got {d3}")


RULES = [sequence_values, index_values, capacity_values]
