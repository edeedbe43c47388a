"""GroupQueryAttention validation rules, following onnxruntime 1.32.0 (schema text and CPU messages).

`RULES` is the list `checks.run_rules` runs; `RULE_DOCS` documents every rule id. Shared checks
(attributes, types, rotary pairing, head_sink, QK-norm, qk_output, bias broadcast, quantization
presence) come from rules_common with the same text as PagedAttention's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator

import numpy as np

from ..contract import GROUP_QUERY_ATTENTION, cache_width
from ..issues import Issue
from ..nodeview import NodeView
from .common import (
    COMMON_DOCS, QUANTIZED_CACHE_TYPES, VIEW_DOCS, attr_at, attribute_rules, dim, dtype_docs, dtype_of, dtype_rules,
    first_known, has_rank, head_count_rules, heads, inp, int_attr, int_values, memo_dims, outp, prefixed,
    presence_rules, rank_rules, scalar_attr_rules, shape_str, str_attr, valid_attr,
)
from .common_features import (
    bias_broadcast_rules, cache_quant_rules, head_sink_rules, head_size_rules, qk_norm_rules, qk_output_rules,
    rotary_presence_rules, scale_presence_rule,
)

P = "GQA"

_DOCS = {
    "kv-pair": "key and value must be both present or both absent (packed QKV).",
    "kv-batch": "key / value dimension 0 must be batch_size.",
    "kv-seq": "key / value dimension 1 must be sequence_length (0 allowed for shared KV with past).",
    "kv-hidden": "key / value dimension 2 must be kv_num_heads * head_size.",
    "past-pair": "past_key and past_value must be both present or both absent.",
    "past-batch": "past_key / past_value dimension 0 must be batch_size.",
    "past-kv-heads": "past_key / past_value dimension 1 must be kv_num_heads (BNSH).",
    "past-head-size": "past_key / past_value dimension 3 must be head_size ((head_size + 1) / 2 for 4-bit).",
    "past-shape-match": "past_value must have the shape of past_key.",
    "seqlens-k-batch": "seqlens_k must have batch_size entries.",
    "total-seqlen-shape": "total_sequence_length must be a scalar or have shape (1).",
    "rotary-dim": "cos_cache dimension 1 must be <= head_size / 2 and a multiple of 8.",
    "rotary-length": "cos_cache dimension 0 must be >= total_sequence_length.",
    "position-ids-shape": "position_ids must be (batch_size, >= sequence_length).",
    "position-ids-values": "position_ids entries must be in [0, cos_cache.shape[0]).",
    "bias-seq": "attention_bias dimension 2 must be sequence_length.",
    "bias-total": "attention_bias dimension 3 must be total_sequence_length.",
    "scale-shape": "k/v_scale: 1 element for PER_TENSOR, kv_num_heads * head_size elements for PER_CHANNEL.",
    "bit-width-missing": "A quantized cache requires kv_cache_bit_width 4 or 8.",
    "bit-width-unexpected": "kv_cache_bit_width must be 0 / unset when the cache is not quantized.",
    "bit-width-dtype": "kv_cache_bit_width 4 requires a uint8 cache; int8 / float8e4m3fn caches require 8.",
    "local-window-noncausal": "local_window_size must be -1 when causal is 0.",
    "sliding-window-needs-window": "sliding_window_cache=1 requires local_window_size > 0.",
    "sliding-window-capacity": "sliding_window_cache=1 requires cache capacity (past_key dim 2) >= local_window_size.",
    "query-seqlens-causal": "query_seqlens requires causal=1.",
    "query-seqlens-past": "query_seqlens requires past_key and past_value.",
    "query-seqlens-kv-seq": "query_seqlens requires kv_sequence_length == sequence_length.",
    "query-seqlens-batch": "query_seqlens must have batch_size entries.",
    "query-seqlens-values": "query_seqlens[b] must be in [0, min(sequence_length, seqlens_k[b] + 1)].",
    "seqlens-k-values": "seqlens_k entries must be >= 0.",
    "total-seqlen-seqlens": "total_sequence_length must be >= max(seqlens_k) + 1.",
    "total-seqlen-seq": "total_sequence_length must be >= kv_sequence_length for a non-sliding cache.",
    "subsequent-prompt-batch": "sequence_length > 1 with past context (sequence_length != total_sequence_length) "
                               "requires batch_size == 1 unless query_seqlens is given.",
}

RULE_DOCS: dict[str, str] = {
    **VIEW_DOCS, **prefixed(P, COMMON_DOCS), **prefixed(P, dtype_docs(GROUP_QUERY_ATTENTION)), **prefixed(P, _DOCS),
}


@dataclass
class GqaDims:
    nh: int | None
    kv: int | None
    batch: int | None  # query.shape[0]
    seq: int | None  # query.shape[1]
    hidden: int | None  # query.shape[2]
    packed: bool | None  # None: key / value half present
    head_size: int | None
    cache_head_size: int | None  # (head_size + 1) // 2 for kv_cache_bit_width 4
    kv_seq: int | None  # key.shape[1]
    capacity: int | None  # past_key.shape[2]
    bits: int | None  # kv_cache_bit_width when valid and non-zero
    t_dtype: str | None
    seqlens_k: np.ndarray | None
    total: int | None  # total_sequence_length value


def gqa_dims(view: NodeView) -> GqaDims:
    """The derived dims of this view (computed once per view state)."""
    return memo_dims(view, "_gqa_dims", _derive)


def _derive(view: NodeView) -> GqaDims:
    nh, kv = heads(view)
    q, key, pk = view.t("query"), view.t("key"), view.t("past_key")
    q3 = q is not None and q.rank in (None, 3)
    hidden = dim(q, 2) if q3 else None
    packed = None if view.has("key") != view.has("value") else not view.has("key")
    bits = int_attr(view, "kv_cache_bit_width") if valid_attr(view, "kv_cache_bit_width") else None
    bits = bits or None
    head_size = None
    if hidden is not None and nh is not None and packed is not None:
        div = nh + 2 * kv if packed and kv is not None else (None if packed else nh)
        head_size = hidden // div if div and hidden % div == 0 else None
    elif hidden is None:
        head_size = None if bits == 4 else dim(pk, 3)
    head_size = head_size if head_size is not None and head_size > 0 else None
    chs = None if head_size is None else (cache_width("int4", head_size) if bits == 4 else head_size)
    t_dtype = dtype_of(q)
    if t_dtype is not None and f"tensor({t_dtype})" not in view.contract.type_constraints["T"]:
        t_dtype = None
    total_v = int_values(view.t("total_sequence_length"), want_rank=None)
    total = int(total_v[0]) if total_v is not None and len(total_v) == 1 else None
    return GqaDims(nh, kv, first_known(dim(q, 0) if q3 else None, dim(key, 0), dim(view.t("seqlens_k"), 0)),
                   dim(q, 1) if q3 else None, hidden, packed, head_size, chs,
                   dim(key, 1) if has_rank(key, 3) else None, dim(pk, 2) if has_rank(pk, 4) else None, bits,
                   t_dtype, int_values(view.t("seqlens_k")), total)


def attributes(view: NodeView) -> Iterator[Issue]:
    yield from attribute_rules(view, P)
    yield from head_count_rules(view, P)
    yield from scalar_attr_rules(view, P, ("qk_norm_epsilon", "q_norm_epsilon", "k_norm_epsilon"))
    w, causal, swc = int_attr(view, "local_window_size"), int_attr(view, "causal"), int_attr(view, "sliding_window_cache")
    if causal == 0 and w is not None and w != -1:
        yield view.issue(attr_at("local_window_size"), f"{P}-local-window-noncausal", "-1 when causal is 0", w,
                         "local_window_size must be -1 when causal is 0")
    if swc == 1 and w is not None and w <= 0:
        yield view.issue(attr_at("sliding_window_cache"), f"{P}-sliding-window-needs-window",
                         "local_window_size > 0 with sliding_window_cache=1", f"local_window_size={w}",
                         "sliding_window_cache=1 requires local_window_size > 0")


def types_and_ranks(view: NodeView) -> Iterator[Issue]:
    yield from presence_rules(view, P)
    yield from dtype_rules(view, P)
    yield from rank_rules(view, P)


def qkv(view: NodeView) -> Iterator[Issue]:
    d = gqa_dims(view)
    if d.packed is None:
        missing = "value" if view.has("key") else "key"
        yield view.issue(inp(missing), f"{P}-kv-pair", "key and value both present or both absent",
                         f"'{missing}' absent", "Input 'key' and 'value' shall be both present, or both absent in "
                         "the case of packed qkv")
    else:
        yield from head_size_rules(view, P, d.hidden, d.packed, d.nh, d.kv)
    shared_ok = view.has("past_key") and not view.has("query_seqlens")
    for name in ("key", "value"):
        t = view.t(name)
        if not has_rank(t, 3):
            continue
        n0, n1, n2 = dim(t, 0), dim(t, 1), dim(t, 2)
        if n0 is not None and d.batch is not None and n0 != d.batch:
            yield view.issue(inp(name), f"{P}-kv-batch", f"{d.batch} (batch_size)", n0,
                             f"Input 'query' and '{name}' shall have same dim 0 (batch size {d.batch}), got {n0}")
        if n1 is not None and d.seq is not None and n1 != d.seq and not (n1 == 0 and shared_ok):
            yield view.issue(inp(name), f"{P}-kv-seq", f"{d.seq} (sequence_length)", n1,
                             f"Input 'query' and '{name}' shall have same dim 1 (sequence length {d.seq}), got {n1}")
        if n2 is not None and d.kv is not None and d.head_size is not None and n2 != d.kv * d.head_size:
            want = d.kv * d.head_size
            yield view.issue(inp(name), f"{P}-kv-hidden", f"{want} (kv_num_heads * head_size)", n2,
                             f"Input '{name}' dimension 2 should be kv_num_heads * head_size ({want}), got {n2}")


def past(view: NodeView) -> Iterator[Issue]:
    d = gqa_dims(view)
    pk, pv = view.t("past_key"), view.t("past_value")
    if (pk is None) != (pv is None):
        missing = "past_value" if pv is None else "past_key"
        yield view.issue(inp(missing), f"{P}-past-pair", "past_key and past_value both present or both absent",
                         f"'{missing}' absent", "Input 'past_key' and 'past_value' shall be both present or both absent")
    for name, t in (("past_key", pk), ("past_value", pv)):
        if not has_rank(t, 4):
            continue
        for i, want, rid, what in ((0, d.batch, "past-batch", "batch_size"), (1, d.kv, "past-kv-heads", "kv_num_heads"),
                                   (3, d.cache_head_size, "past-head-size",
                                    "(head_size + 1) / 2 (4-bit)" if d.bits == 4 else "head_size")):
            got = dim(t, i)
            if got is not None and want is not None and got != want:
                yield view.issue(inp(name), f"{P}-{rid}", f"{want} ({what})", got,
                                 f"Input '{name}' dimension {i} should be same as {what} ({want}), got {got}")
    if has_rank(pk, 4) and has_rank(pv, 4) and pk.shape is not None and pv.shape is not None:
        if any(dim(pk, i) is not None and dim(pv, i) is not None and dim(pk, i) != dim(pv, i) for i in range(4)):
            yield view.issue(inp("past_value"), f"{P}-past-shape-match", f"{shape_str(pk)} (shape of past_key)",
                             shape_str(pv), "Input 'past_value' must have the same shape as 'past_key'")
    w = int_attr(view, "local_window_size")
    if int_attr(view, "sliding_window_cache") == 1 and w is not None and w > 0 and d.capacity is not None \
            and d.capacity < w:
        yield view.issue(inp("past_key"), f"{P}-sliding-window-capacity", f">= {w} (local_window_size)", d.capacity,
                         f"sliding_window_cache: KV cache capacity (input 'past_key' dimension 2 = {d.capacity}) "
                         "must be at least "
                         f"local_window_size ({w})")


def lengths(view: NodeView) -> Iterator[Issue]:
    d = gqa_dims(view)
    sk = view.t("seqlens_k")
    n = dim(sk, 0) if has_rank(sk, 1) else None
    if n is not None and d.batch is not None and n != d.batch:
        yield view.issue(inp("seqlens_k"), f"{P}-seqlens-k-batch", f"{d.batch} (batch_size) entries", n,
                         f"seqlens_k must have batch_size ({d.batch}) elements, got {n}")
    ts = view.t("total_sequence_length")
    if ts is not None and ts.rank == 1 and dim(ts, 0) is not None and dim(ts, 0) != 1:
        yield view.issue(inp("total_sequence_length"), f"{P}-total-seqlen-shape", "a scalar or shape (1)",
                         shape_str(ts), "total_sequence_length tensor must be of one element")


def rotary(view: NodeView) -> Iterator[Issue]:
    yield from rotary_presence_rules(view, P, extra_unused=("position_ids",))
    d = gqa_dims(view)
    cos = view.t("cos_cache")
    w = dim(cos, 1) if has_rank(cos, 2) else None
    if w is not None and d.head_size is not None and (w > d.head_size // 2 or w % 8 != 0):
        yield view.issue(inp("cos_cache"), f"{P}-rotary-dim", f"<= {d.head_size // 2} (head_size / 2) and a "
                         "multiple of 8", w, "cos_cache dimension 1 must be <= head_size / 2 and a multiple of 8")
    rows = dim(cos, 0) if has_rank(cos, 2) else None
    if rows is not None and d.total is not None and rows < d.total:
        yield view.issue(inp("cos_cache"), f"{P}-rotary-length", f">= {d.total} (total_sequence_length)", rows,
                         "cos_cache dimension 0 shall not be less than total_sequence_length")
    pos = view.t("position_ids")
    if has_rank(pos, 2):
        p0, p1 = dim(pos, 0), dim(pos, 1)
        if p0 is not None and d.batch is not None and p0 != d.batch:
            yield view.issue(inp("position_ids"), f"{P}-position-ids-shape", f"dimension 0 == {d.batch} (batch_size)",
                             p0, f"position_ids dimension 0 must be equal to the batch size ({d.batch}), got {p0}")
        if p1 is not None and d.seq is not None and p1 < d.seq:
            yield view.issue(inp("position_ids"), f"{P}-position-ids-shape", f"dimension 1 >= {d.seq} "
                             "(sequence_length)", p1, f"position_ids dimension 1 must be at least sequence length "
                             f"({d.seq}), got {p1}")
    vals = int_values(pos, want_rank=2)
    if vals is not None and rows is not None and len(vals) and (vals.min() < 0 or vals.max() >= rows):
        bad = int(vals[(vals < 0) | (vals >= rows)][0])
        yield view.issue(inp("position_ids"), f"{P}-position-ids-values", f"entries in [0, {rows}) (cos_cache rows)",
                         bad, f"position_ids value {bad} is out of range [0, {rows})")


def features(view: NodeView) -> Iterator[Issue]:
    d = gqa_dims(view)
    yield from head_sink_rules(view, P, d.nh)
    yield from qk_norm_rules(view, P, d.head_size)
    yield from bias_broadcast_rules(view, P, d.batch, d.nh)
    yield from qk_output_rules(view, P)
    bias = view.t("attention_bias")
    if has_rank(bias, 4):
        b2, b3 = dim(bias, 2), dim(bias, 3)
        if b2 is not None and d.seq is not None and b2 != d.seq:
            yield view.issue(inp("attention_bias"), f"{P}-bias-seq", f"{d.seq} (sequence_length)", b2,
                             f"attention_bias dimension 2 must be equal to the sequence length ({d.seq}), got {b2}")
        if b3 is not None and d.total is not None and b3 != d.total:
            yield view.issue(inp("attention_bias"), f"{P}-bias-total", f"{d.total} (total_sequence_length)", b3,
                             f"attention_bias dimension 3 must be equal to total_sequence_length ({d.total}), "
                             f"got {b3}")


def quantization(view: NodeView) -> Iterator[Issue]:
    d = gqa_dims(view)
    quant_on = False
    for side, cache, present in (("k", "past_key", "present_key"), ("v", "past_value", "present_value")):
        qt = str_attr(view, f"{side}_quant_type") if valid_attr(view, f"{side}_quant_type") else None
        quant_on |= qt not in (None, "NONE")
        yield from scale_presence_rule(view, P, side, qt, qt not in (None, "NONE"))
        where, t = (inp(cache), view.t(cache)) if view.has(cache) else (outp(present), view.out(present))
        yield from cache_quant_rules(view, P, side, where, t, qt, d.t_dtype)
        scale = view.t(f"{side}_scale")
        if scale is not None and scale.shape is not None and all(isinstance(x, int) for x in scale.shape):
            numel = int(np.prod(scale.shape)) if scale.shape else 1
            want = 1 if qt == "PER_TENSOR" else (d.kv * d.head_size if qt == "PER_CHANNEL" and d.kv and d.head_size
                                                 else None)
            if want is not None and numel != want:
                yield view.issue(inp(f"{side}_scale"), f"{P}-scale-shape", f"{want} elements for {qt}",
                                 f"{numel} elements {shape_str(scale)}",
                                 f"{side}_scale shape mismatch: expected {want} elements, got {numel}")
    cache_t = view.t("past_key") if view.has("past_key") else view.out("present_key")
    cdt = dtype_of(cache_t)
    quant_on |= cdt in QUANTIZED_CACHE_TYPES
    raw_bits = int_attr(view, "kv_cache_bit_width")
    if quant_on and d.bits not in (4, 8) and (raw_bits is None or raw_bits == 0):
        yield view.issue(attr_at("kv_cache_bit_width"), f"{P}-bit-width-missing", "4 or 8 for a quantized cache",
                         raw_bits, "kv_cache_bit_width must be 4 or 8 when quantization is enabled")
    elif not quant_on and d.bits is not None and cdt is not None:
        yield view.issue(attr_at("kv_cache_bit_width"), f"{P}-bit-width-unexpected", "0 / unset (cache not "
                         "quantized)", d.bits, f"kv_cache_bit_width must be 0 when quantization is disabled, "
                         f"got {d.bits}")
    if d.bits is not None and cdt in QUANTIZED_CACHE_TYPES:
        want = 4 if cdt == "uint8" else 8
        if d.bits != want:
            yield view.issue(attr_at("kv_cache_bit_width"), f"{P}-bit-width-dtype", f"{want} for a {cdt} cache",
                             d.bits, f"kv_cache_bit_width must be {want} for a {cdt} cache, got {d.bits}")


def query_seqlens(view: NodeView) -> Iterator[Issue]:
    if not view.has("query_seqlens"):
        return
    d = gqa_dims(view)
    name = "query_seqlens"
    if int_attr(view, "causal") == 0:
        yield view.issue(inp(name), f"{P}-query-seqlens-causal", "causal=1", "causal=0", "query_seqlens requires causal=1")
    if not (view.has("past_key") and view.has("past_value")):
        yield view.issue(inp(name), f"{P}-query-seqlens-past", "past_key and past_value present", "absent",
                         "query_seqlens requires past_key and past_value to be present")
    if d.kv_seq is not None and d.seq is not None and d.kv_seq != d.seq:
        yield view.issue(inp(name), f"{P}-query-seqlens-kv-seq", f"kv_sequence_length == {d.seq}", d.kv_seq,
                         "query_seqlens requires new key/value with kv_sequence_length == sequence_length")
    t = view.t(name)
    n = dim(t, 0) if has_rank(t, 1) else None
    if n is not None and d.batch is not None and n != d.batch:
        yield view.issue(inp(name), f"{P}-query-seqlens-batch", f"{d.batch} (batch_size) entries", n,
                         f"query_seqlens must have batch_size ({d.batch}) elements, got {n}")
    qv = int_values(t)
    if qv is not None and d.seqlens_k is not None and d.seq is not None and len(qv) == len(d.seqlens_k):
        hi = np.minimum(d.seq, d.seqlens_k + 1)
        bad = (qv < 0) | (qv > hi)
        if np.any(bad):
            b = int(np.flatnonzero(bad)[0])
            yield view.issue(inp(name), f"{P}-query-seqlens-values", f"query_seqlens[{b}] in [0, {int(hi[b])}]",
                             int(qv[b]), f"query_seqlens[{b}] = {int(qv[b])} must be in [0, min(sequence_length, "
                             f"seqlens_k[{b}] + 1)] = [0, {int(hi[b])}]")


def values(view: NodeView) -> Iterator[Issue]:
    d = gqa_dims(view)
    sk = d.seqlens_k
    if sk is not None and len(sk) and sk.min() < 0:
        b = int(np.flatnonzero(sk < 0)[0])
        yield view.issue(inp("seqlens_k"), f"{P}-seqlens-k-values", "entries >= 0", f"seqlens_k[{b}] = {int(sk[b])}",
                         f"seqlens_k[{b}] = {int(sk[b])} must be >= 0")
    if d.total is None:
        return
    if sk is not None and len(sk) and d.total < int(sk.max()) + 1:
        yield view.issue(inp("total_sequence_length"), f"{P}-total-seqlen-seqlens",
                         f">= {int(sk.max()) + 1} (max(seqlens_k) + 1)", d.total,
                         f"total_sequence_length ({d.total}) must be >= max(seqlens_k) + 1 = {int(sk.max()) + 1}")
    kv_seq = d.kv_seq if d.kv_seq is not None else (d.seq if d.packed else None)
    if int_attr(view, "sliding_window_cache") != 1 and kv_seq is not None and d.total < kv_seq:
        yield view.issue(inp("total_sequence_length"), f"{P}-total-seqlen-seq", f">= {kv_seq} (kv_sequence_length)",
                         d.total, "total_sequence_length must be at least kv_sequence_length for a non-sliding "
                         f"cache. Got {d.total} and {kv_seq}")
    if (not view.has("query_seqlens") and d.seq is not None and d.seq > 1 and d.seq != d.total
            and d.batch is not None and d.batch != 1):
        yield view.issue(inp("query"), f"{P}-subsequent-prompt-batch", "batch_size 1 (or query_seqlens)", d.batch,
                         "batch_size must be 1 when sequence_length > 1 and past context is given "
                         f"(sequence_length {d.seq} != total_sequence_length {d.total})")


RULES = [attributes, types_and_ranks, qkv, past, lengths, rotary, features, quantization, query_seqlens, values]
