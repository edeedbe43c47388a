"""PagedAttention validation rules: design §15 as amended by contract-decisions.md.

`RULES` is the list `checks.run_rules` runs; each rule takes a NodeView and yields Issues. Rule ids
are stable and documented in `RULE_DOCS` (the docs generator and tests read it). Quantization,
rotation and MLA rules live in paged_quant.py, run-time value rules in paged_values.py.
"""

from __future__ import annotations

from typing import Iterator

from ..contract import BLOCK_SIZE_RULE, MIN_BLOCK_SIZE, PAGED_ATTENTION, block_size_error
from ..issues import Issue
from ..nodeview import NodeView
from .common import (
    COMMON_DOCS, VIEW_DOCS, attr_at, attribute_rules, dim, dtype_docs, dtype_rules, has_rank, head_count_rules, inp,
    int_attr, ival, outp, prefixed, presence_rules, rank_rules, scalar_attr_rules, shape_str,
)
from .common_features import (
    bias_broadcast_rules, head_sink_rules, head_size_rules, qk_norm_rules, qk_output_rules, rotary_presence_rules,
)
from .paged_dims import LATENT, PACKED, SEPARATE, paged_dims
from . import paged_quant as rules_paged_quant, paged_values as rules_paged_values

P = "PA"

_DOCS = {
    "v-head-size-range": "v_head_size must be in [0, head_size] (0 = head_size).",
    "rotary-offset": "rotary_offset must be >= 0 and a multiple of 8.",
    "input-mode": "Input presence must match a §4.6 row: SEPARATE unpacked (key, value, value_cache), "
                  "SEPARATE packed (no key, no value, value_cache), LATENT (key; no value, no value_cache).",
    "kv-token-count": "key / value dimension 0 must be token_count (query dimension 0).",
    "kv-hidden": "key / value dimension 1 must be kv_num_heads * head_size.",
    "cache-shape-match": "value_cache dimensions 0-2 must equal key_cache's (num_blocks, block_size, kv_num_heads).",
    "cache-kv-heads": "key_cache / value_cache dimension 2 must be kv_num_heads.",
    "cache-head-size": "key_cache / value_cache dimension 3 must be cache_head_size ((head_size + 1) / 2 for "
                       "int4, else head_size).",
    "block-size": f"{BLOCK_SIZE_RULE} (cache dimension 1); paged-export, paged-run and the KV manager "
                  "refuse other block sizes with the same text.",
    "csl-length": "cumulative_sequence_length dimension 0 must be >= 2 (batch_size + 1).",
    "past-seqlens-batch": "past_seqlens dimension 0 must be batch_size.",
    "block-table-batch": "block_table dimension 0 must be batch_size.",
    "slot-mapping-tokens": "slot_mapping dimension 0 must be token_count.",
    "query-positions-tokens": "query_positions dimension 0 must be token_count.",
    "metadata-length": "attention_metadata must have 2 or 3 entries.",
    "rotary-dim": "rotary_offset + rotary_dim (2 * cos_cache.shape[1]) must be <= head_size.",
    "cache-outputs-pair": "SEPARATE: key_cache_out and value_cache_out both named or both absent.",
    "latent-value-cache-out": "LATENT: output 2 (value_cache_out) must be absent.",
    "output-shape": "output must be (token_count, num_heads * effective_v_head_size).",
    "cache-out-shape": "A cache output (1-4) must have the shape of the cache input it aliases.",
    "output-qk-shape": "output_qk must be (num_heads, token_count, block_table.shape[1] * block_size).",
}

RULE_DOCS: dict[str, str] = {
    **VIEW_DOCS,
    **prefixed(P, COMMON_DOCS),
    **prefixed(P, dtype_docs(PAGED_ATTENTION)),
    **prefixed(P, _DOCS),
    **prefixed(P, rules_paged_quant.DOCS),
    **prefixed(P, rules_paged_values.DOCS),
}


def attributes(view: NodeView) -> Iterator[Issue]:
    yield from attribute_rules(view, P)
    yield from head_count_rules(view, P)
    yield from scalar_attr_rules(view, P, ("qk_norm_epsilon",))
    d = paged_dims(view)
    vhs = int_attr(view, "v_head_size")
    if vhs is not None and (vhs < 0 or (d.head_size is not None and vhs > d.head_size)):
        hs = d.head_size if d.head_size is not None else "head_size"
        yield view.issue(attr_at("v_head_size"), f"{P}-v-head-size-range", f"0 <= v_head_size <= {hs} (head_size)",
                         vhs, f"Attribute 'v_head_size' must be in [0, head_size ({hs})]")
    off = int_attr(view, "rotary_offset")
    if off is not None and (off < 0 or off % 8 != 0):
        yield view.issue(attr_at("rotary_offset"), f"{P}-rotary-offset", "rotary_offset >= 0 and a multiple of 8",
                         off, "Attribute 'rotary_offset' must be >= 0 and a multiple of 8")


def types_and_ranks(view: NodeView) -> Iterator[Issue]:
    yield from presence_rules(view, P)
    yield from dtype_rules(view, P)
    yield from rank_rules(view, P)


def input_mode(view: NodeView) -> Iterator[Issue]:
    """§4.6: one issue for any presence pattern outside the table, naming every offending input."""
    d = paged_dims(view)
    if d.layout is None or d.mode is not None:
        return
    key, value, vcache = view.has("key"), view.has("value"), view.has("value_cache")
    problems: list[tuple[str, str]] = []
    if d.layout == SEPARATE:
        if key != value:
            problems.append(("value" if key else "key",
                             "Input 'key' and 'value' shall be both present, or both absent in the case of packed qkv"))
        if not vcache:
            problems.append(("value_cache", "Input 'value_cache' is required when kv_cache_layout is SEPARATE"))
        expected = "key+value+value_cache (unpacked) or value_cache only (packed QKV)"
    else:
        if not key:
            problems.append(("key", "Input 'key' is required when kv_cache_layout is LATENT"))
        for name in ("value", "value_cache"):
            if view.has(name):
                problems.append((name, f"Input '{name}' must be absent when kv_cache_layout is LATENT"))
        expected = "key present, value and value_cache absent"
    got = ", ".join(f"{n} {'present' if view.has(n) else 'absent'}" for n in ("key", "value", "value_cache"))
    yield view.issue(inp(problems[0][0]), f"{P}-input-mode", f"kv_cache_layout={d.layout}: {expected}", got,
                     "; ".join(m for _, m in problems))


def qkv_shapes(view: NodeView) -> Iterator[Issue]:
    d = paged_dims(view)
    if d.mode is not None:
        yield from head_size_rules(view, P, d.hidden, d.mode == PACKED, d.nh, d.kv)
    for name in ("key", "value"):
        t = view.t(name)
        if not has_rank(t, 2):
            continue
        n0, n1 = dim(t, 0), dim(t, 1)
        if n0 is not None and d.token_count is not None and n0 != d.token_count:
            yield view.issue(inp(name), f"{P}-kv-token-count", f"{d.token_count} (token_count)", n0,
                             f"Input '{name}' dimension 0 should be token_count ({d.token_count}), got {n0}")
        if n1 is not None and d.kv is not None and d.head_size is not None and n1 != d.kv * d.head_size:
            want = d.kv * d.head_size
            yield view.issue(inp(name), f"{P}-kv-hidden", f"{want} (kv_num_heads * head_size)", n1,
                             f"Input '{name}' dimension 1 should be kv_num_heads * head_size ({want}), got {n1}")


def cache_shapes(view: NodeView) -> Iterator[Issue]:
    d = paged_dims(view)
    kc, vc = view.t("key_cache"), view.t("value_cache")
    if has_rank(kc, 4) and has_rank(vc, 4):
        for i, role in ((0, "num_blocks"), (1, "block_size"), (2, "kv_num_heads")):
            a, b = dim(kc, i), dim(vc, i)
            if a is not None and b is not None and a != b:
                yield view.issue(inp("value_cache"), f"{P}-cache-shape-match", f"{a} (key_cache dimension {i})", b,
                                 f"Input 'value_cache' dimension {i} ({role}) should be same as key_cache's "
                                 f"({a}), got {b}")
    for name, t, chs, int4 in (("key_cache", kc, d.k_cache_head_size, d.k_int4),
                               ("value_cache", vc, d.v_cache_head_size, d.v_int4)):
        if not has_rank(t, 4):
            continue
        n2, n3 = dim(t, 2), dim(t, 3)
        if n2 is not None and d.kv is not None and n2 != d.kv:
            yield view.issue(inp(name), f"{P}-cache-kv-heads", f"{d.kv} (kv_num_heads)", n2,
                             f"Input '{name}' dimension 2 should be same as kv_num_heads ({d.kv}), got {n2}")
        if n3 is not None and chs is not None and n3 != chs:
            what = f"(head_size + 1) / 2 = {chs} for int4" if int4 else f"head_size ({chs})"
            yield view.issue(inp(name), f"{P}-cache-head-size", f"{chs} = {what}", n3,
                             f"Input '{name}' dimension 3 should be same as {what}, got {n3}")
        bs = dim(t, 1)
        if bs is not None and (name == "key_cache" or not view.has("key_cache")) and block_size_error(bs):
            yield view.issue(inp(name), f"{P}-block-size", f"a power of two >= {MIN_BLOCK_SIZE}", bs,
                             f"Input '{name}' dimension 1: {block_size_error(bs)}")


def sequence_inputs(view: NodeView) -> Iterator[Issue]:
    d = paged_dims(view)
    csl = view.t("cumulative_sequence_length")
    n = dim(csl, 0) if has_rank(csl, 1) else None
    if n is not None and n < 2:
        yield view.issue(inp("cumulative_sequence_length"), f"{P}-csl-length", ">= 2 (batch_size + 1)", n,
                         f"Input 'cumulative_sequence_length' dimension 0 must be >= 2 (batch_size + 1), got {n}")
    for name, axis_rank, rid in (("past_seqlens", 1, "past-seqlens-batch"), ("block_table", 2, "block-table-batch")):
        t = view.t(name)
        b = dim(t, 0) if has_rank(t, axis_rank) else None
        if b is not None and d.batch_size is not None and b != d.batch_size:
            yield view.issue(inp(name), f"{P}-{rid}", f"{d.batch_size} (batch_size)", b,
                             f"Input '{name}' dimension 0 should be batch_size ({d.batch_size}), got {b}")
    for name, rid in (("slot_mapping", "slot-mapping-tokens"), ("query_positions", "query-positions-tokens")):
        t = view.t(name)
        m = dim(t, 0) if has_rank(t, 1) else None
        if m is not None and d.token_count is not None and m != d.token_count:
            yield view.issue(inp(name), f"{P}-{rid}", f"{d.token_count} (token_count)", m,
                             f"Input '{name}' dimension 0 should be token_count ({d.token_count}), got {m}")
    meta = view.t("attention_metadata")
    m = dim(meta, 0) if has_rank(meta, 1) else None
    if m is not None and m not in (2, 3):
        yield view.issue(inp("attention_metadata"), f"{P}-metadata-length", "2 or 3 entries", m,
                         f"Input 'attention_metadata' dimension 0 must be 2 or 3, got {m}")


def rotary(view: NodeView) -> Iterator[Issue]:
    yield from rotary_presence_rules(view, P)
    d = paged_dims(view)
    off = int_attr(view, "rotary_offset")
    off = off if off is not None and off >= 0 else None
    if d.rotary_dim is not None and d.head_size is not None and off is not None and off + d.rotary_dim > d.head_size:
        yield view.issue(inp("cos_cache"), f"{P}-rotary-dim",
                         f"rotary_offset + rotary_dim <= head_size ({d.head_size})",
                         f"rotary_offset {off} + rotary_dim {d.rotary_dim}",
                         f"Input 'cos_cache' dimension 1 ({d.rotary_dim // 2}) gives rotary_dim {d.rotary_dim}; "
                         f"rotary_offset + rotary_dim must be <= head_size ({d.head_size})")


def optional_features(view: NodeView) -> Iterator[Issue]:
    d = paged_dims(view)
    yield from head_sink_rules(view, P, d.nh)
    yield from qk_norm_rules(view, P, d.head_size)
    yield from bias_broadcast_rules(view, P, d.batch_size, d.nh)


def outputs(view: NodeView) -> Iterator[Issue]:
    d = paged_dims(view)
    yield from qk_output_rules(view, P)
    if view.outputs is not None:
        k_out, v_out = view.has_output("key_cache_out"), view.has_output("value_cache_out")
        if d.layout == SEPARATE and k_out != v_out:
            missing = "value_cache_out" if k_out else "key_cache_out"
            yield view.issue(outp(missing), f"{P}-cache-outputs-pair", "key_cache_out and value_cache_out both "
                             "named or both absent", f"only '{'key_cache_out' if k_out else 'value_cache_out'}' named",
                             "Output 'key_cache_out' and 'value_cache_out' shall be both present or both absent")
        if d.layout == LATENT and v_out:
            yield view.issue(outp("value_cache_out"), f"{P}-latent-value-cache-out", "absent (LATENT)", "named",
                             "Output 'value_cache_out' (output 2) must be absent when kv_cache_layout is LATENT")
    yield from _output_shapes(view, d)


def _output_shapes(view: NodeView, d) -> Iterator[Issue]:
    out = view.out("output")
    if out is not None and has_rank(out, 2) and out.shape is not None:
        width = d.nh * d.eff_v if d.nh is not None and d.eff_v is not None else None
        for i, want, what in ((0, d.token_count, "token_count"), (1, width, "num_heads * effective_v_head_size")):
            got = dim(out, i)
            if got is not None and want is not None and got != want:
                yield view.issue(outp("output"), f"{P}-output-shape", f"{want} ({what})", got,
                                 f"Output 'output' dimension {i} should be {what} ({want}), got {got}")
    for oname, iname in (("key_cache_out", "key_cache"), ("value_cache_out", "value_cache"),
                         ("k_scale_cache_out", "k_scale_cache"), ("v_scale_cache_out", "v_scale_cache")):
        o, i = view.out(oname), view.t(iname)
        if o is None or i is None or o.shape is None or i.shape is None or len(o.shape) != len(i.shape):
            continue
        if any(ival(a) is not None and ival(b) is not None and a != b for a, b in zip(o.shape, i.shape)):
            yield view.issue(outp(oname), f"{P}-cache-out-shape", f"{shape_str(i)} (shape of '{iname}')",
                             shape_str(o), f"Output '{oname}' must have the shape of input '{iname}'")
    qk = view.out("output_qk")
    if qk is not None and has_rank(qk, 3) and qk.shape is not None:
        for i, want, what in ((0, d.nh, "num_heads"), (1, d.token_count, "token_count"),
                              (2, d.context_capacity, "block_table.shape[1] * block_size")):
            got = dim(qk, i)
            if got is not None and want is not None and got != want:
                yield view.issue(outp("output_qk"), f"{P}-output-qk-shape", f"{want} ({what})", got,
                                 f"Output 'output_qk' dimension {i} should be {what} ({want}), got {got}")


RULES = [
    attributes, types_and_ranks, input_mode, qkv_shapes, cache_shapes, sequence_inputs, rotary, optional_features,
    outputs, *rules_paged_quant.RULES, *rules_paged_values.RULES,
]
