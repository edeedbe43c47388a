"""GroupQueryAttention -> PagedAttention, one node (rule set `GQA_TO_PAGED`, `gqa_node_to_paged`).

The caller says where the PagedAttention step tensors come from (`PagedIO`). Padded [B, S] -> packed [T]: with
`PagedIO.token_rows` (int64 [T], index of each valid row in the flattened [B * S] batch) the packing is a
Gather of the valid rows (design §4.8: position_ids int64 [B, S] -> query_positions int32 [T] is a Cast plus
that Gather), the output goes back with a ScatterND; without it, a Reshape (right only for B = 1 or an
unpadded batch, which is what the whole-model pass feeds).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from pagedkit.validators.contract import GROUP_QUERY_ATTENTION as GQA, PAGED_ATTENTION as PA

from .base import (
    BF16, F16, F32, I32, I64, PASS_INPUTS, NodeFacts, Rule, Target, _activation_check, _always, _bias_softcap_check,
    _copy_same, _dims, _dtype, _new_value, _np_dtype, _ok, _refuse, convert,
)

_BITS_TO_DTYPE = {(8, ir.DataType.INT8): "int8", (8, ir.DataType.FLOAT8E4M3FN): "float8e4m3fn",
                  (4, ir.DataType.UINT8): "int4"}


@dataclass
class PagedIO:
    """Where a converted node's PagedAttention step tensors come from (values of the target graph).

    key_cache / value_cache: the paged caches; key_cache_out / value_cache_out: names of the in-place outputs.
    token_rows: int64 [T] index of each valid row of the flattened [B * S] batch; None: B = 1 / unpadded
    (query [B, S, W] -> [T, W] is then a Reshape). cast_to: run the node in this dtype (FLOAT16 / BFLOAT16)
    when the source is float32: Casts around the node (contract-decisions §6). caches_replaced: the caller
    replaces the GQA caches by paged ones (whole-model), so a windowed `sliding_window_cache` buffer is not
    carried over (the paged cache is indexed by absolute position, design §9.3.1).
    """

    key_cache: ir.Value
    value_cache: ir.Value
    cumulative_sequence_length: ir.Value
    past_seqlens: ir.Value
    block_table: ir.Value
    key_cache_out: str
    value_cache_out: str
    attention_metadata: ir.Value | None = None
    slot_mapping: ir.Value | None = None
    token_rows: ir.Value | None = None
    cast_to: ir.DataType | None = None
    caches_replaced: bool = False
    output_shape: ir.Value | None = None  # int64 [3] shape of the GQA output (B, S, W) to restore; None: Unsqueeze


def _g2p_cast(t: Target, io: PagedIO, v: ir.Value, src: ir.DataType | None = None) -> ir.Value:
    """v cast to io.cast_to when its (or its source's) float type differs."""
    dt = src or _dtype(v)
    if io.cast_to is not None and dt not in (io.cast_to, None) and dt in (F16, BF16, F32):
        return t.b.cast(v, io.cast_to)
    return v


def _pack(t: Target, io: PagedIO, v: ir.Value) -> ir.Value:
    """[B, S, W] -> [T, W]: a Reshape (B = 1 / unpadded) or Reshape + Gather of io.token_rows."""
    flat = t.b.op("Reshape", v, t.b.cat(t.b.i64(-1), t.b.dim(v, 2)))
    return flat if io.token_rows is None else t.b.gather(flat, io.token_rows)


def _g2p_core(f: NodeFacts, t: Target, io: PagedIO):
    a = f.attrs
    t.attrs["num_heads"], t.attrs["kv_num_heads"] = a["num_heads"], a["kv_num_heads"]
    if "causal" in f.given:
        t.attrs["is_causal"] = a["causal"]
    for n in ("query", "key", "value"):
        if n in f.inputs:
            t.inputs[n] = _g2p_cast(t, io, _pack(t, io, f.inputs[n]), _dtype(f.inputs[n]))
    for n in PASS_INPUTS:
        if n in f.inputs:
            t.inputs[n] = _g2p_cast(t, io, f.inputs[n])
    t.inputs.update(key_cache=io.key_cache, value_cache=io.value_cache,
                    cumulative_sequence_length=io.cumulative_sequence_length, past_seqlens=io.past_seqlens,
                    block_table=io.block_table)
    if io.attention_metadata is not None:
        t.inputs["attention_metadata"] = io.attention_metadata
    if io.slot_mapping is not None:
        t.inputs["slot_mapping"] = io.slot_mapping
    # outputs: the attention output goes back to the source layout [B, S, W]
    src_out = f.outputs["output"]
    out_t = io.cast_to or _dtype(src_out)
    out = _new_value(f"{f.name}/paged/output", out_t, None)
    t.outputs["output"] = out
    b = t.b

    def restore(node):
        del node
        y = out
        src_t = _dtype(src_out) or _dtype(f.inputs["query"])  # an untyped output has the query's type (both ops)
        if io.cast_to is not None and src_t not in (io.cast_to, None):
            y = b.cast(y, src_t)
        if io.token_rows is None:
            shape = io.output_shape if io.output_shape is not None else None
            y = b.unsq(y, 0) if shape is None else b.op("Reshape", y, shape)
        else:
            q = f.inputs["query"]
            zeros = b.op("ConstantOfShape", b.cat(b.op("ReduceProd", b.op("Shape", q, end=2), keepdims=1),
                                                  b.dim(y, 1)),
                         value=ir.tensor(np.zeros(1, dtype=_np_dtype(_dtype(y)))))
            y = b.op("ScatterND", zeros, b.unsq(io.token_rows, 1), y)
            y = b.op("Reshape", y, b.cat(b.op("Shape", q, end=2), b.dim(y, 1)))
        t.replaces[src_out] = y
    t.after.append(restore)
    for src, dst, name in (("present_key", "key_cache_out", io.key_cache_out),
                           ("present_value", "value_cache_out", io.value_cache_out)):
        cache = io.key_cache if dst == "key_cache_out" else io.value_cache
        t.outputs[dst] = ir.Value(name=name, type=cache.type, shape=cache.shape.copy() if cache.shape else None)
        if src in f.outputs:
            t.replaces[f.outputs[src]] = t.outputs[dst]


def _g2p_quant_check(f, io):
    bits = int(f.attrs.get("kv_cache_bit_width", 0) or 0)
    if f.attrs.get("k_quant_type", "NONE") == "NONE" and f.attrs.get("v_quant_type", "NONE") == "NONE":
        return None
    cache = _dtype(io.key_cache)
    if (bits, cache) not in _BITS_TO_DTYPE:
        return (f"kv_cache_bit_width {bits} with a {cache.name if cache else 'unknown'} paged cache has no "
                "PagedAttention cache dtype (8: int8 / float8e4m3fn, 4: int4 in uint8)")
    for side in ("k", "v"):
        s = f.inputs.get(f"{side}_scale")
        if f.attrs.get(f"{side}_quant_type", "NONE") != "NONE" and s is None:
            return f"{side}_quant_type without {side}_scale"
    return None


def _g2p_quant(f, t, io):
    bits = int(f.attrs.get("kv_cache_bit_width", 0) or 0)
    fmt = _BITS_TO_DTYPE[(bits, _dtype(io.key_cache))]
    h = int(f.attrs["kv_num_heads"])
    for side in ("k", "v"):
        qt = f.attrs.get(f"{side}_quant_type", "NONE")
        if qt == "NONE":
            continue
        t.attrs[f"{side}_quant_type"] = qt
        t.attrs[f"{side}_cache_dtype"] = fmt
        s = f.inputs[f"{side}_scale"]
        if qt == "PER_TENSOR":
            s = s if _dims(s) == (1,) else t.b.op("Reshape", s, t.b.i64(1))
        else:  # PER_CHANNEL: canonical (kv_num_heads, 1, head_size) (contract-decisions §2)
            if _dims(s) is None or len(_dims(s)) != 3 or _dims(s)[1] != 1:
                s = t.b.op("Reshape", s, t.b.i64(h, 1, -1))
        t.inputs[f"{side}_scale"] = s


def _g2p_positions(f, t, io):
    b = t.b
    flat = b.op("Reshape", f.inputs["position_ids"], b.i64(-1))
    if io.token_rows is not None:
        flat = b.gather(flat, io.token_rows)
    t.inputs["query_positions"] = b.cast(flat, I32)


def _norm_eps(f) -> tuple[float, float]:
    """The epsilons GQA applies to Q and K: q_norm_epsilon / k_norm_epsilon where written, else qk_norm_epsilon
    (its contract default filled in)."""
    shared = f.attrs["qk_norm_epsilon"]
    q, k = f.attrs.get("q_norm_epsilon"), f.attrs.get("k_norm_epsilon")
    return (shared if q is None else q), (shared if k is None else k)


def _g2p_norm_eps_check(f, io):
    q, k = _norm_eps(f)
    if q != k:
        return (f"Q's epsilon {q} != K's {k} (q_norm_epsilon / k_norm_epsilon, else qk_norm_epsilon): "
                "PagedAttention has one qk_norm_epsilon")
    return None


def _g2p_norm_eps(f, t, io):
    t.attrs["qk_norm_epsilon"] = _norm_eps(f)[0]


def _g2p_smooth(f, t, io):
    """smooth_softmax=1 without head_sink adds exp(0) to the denominator: exactly a head_sink of zeros."""
    if "head_sink" in f.inputs:
        return
    h = int(f.attrs["num_heads"])
    dt = io.cast_to or _dtype(f.inputs["query"])
    t.inputs["head_sink"] = t.b.const(np.zeros(h, dtype=_np_dtype(dt)))


def _g2p_qk_check(f, io):
    if io.token_rows is not None or io.output_shape is not None:
        return "output_qk of a padded batch: only B = 1 / unpadded batches keep GQA's [B, H, S, total] layout"
    return None


def _g2p_qk(f, t, io):
    """PagedAttention output_qk [H, T, capacity] -> GQA's [1, H, S=T, total] (B = 1): Unsqueeze + Slice to
    the sequence's total length (past + new)."""
    b = t.b
    src = f.outputs["output_qk"]
    qk = _new_value(f"{f.name}/paged/output_qk", _dtype(src) if _dtype(src) in (F32, F16, BF16) else F32, None)
    t.outputs["output_qk"] = qk

    def adapt(node):
        total = b.op("Cast", b.op("Reshape", f.inputs["total_sequence_length"], b.i64(1)), to=int(I64))
        y = b.unsq(b.slice(qk, 0, total, 2), 0)
        if _dtype(src) is not None and _dtype(src) != _dtype(qk):
            y = b.cast(y, _dtype(src))
        t.replaces[src] = y
    t.after.append(adapt)


GQA_TO_PAGED: tuple[Rule, ...] = (
    Rule("activation dtype", _always, _activation_check(True), lambda f, t, io: None),
    Rule("core (heads, Q/K/V packing, caches, lengths)", _always, _ok, _g2p_core),
    Rule("shared attributes (scale, softcap, window, rotary, qk_norm_epsilon, qk_output)", _always, _ok, _copy_same),
    Rule("attention_bias", lambda f: "attention_bias" in f.inputs, _bias_softcap_check,
         lambda f, t, io: t.inputs.__setitem__("attention_bias", _g2p_cast(t, io, f.inputs["attention_bias"]))),
    Rule("q/k_norm_epsilon", lambda f: "q_norm_epsilon" in f.given or "k_norm_epsilon" in f.given,
         _g2p_norm_eps_check, _g2p_norm_eps),
    Rule("quantized cache", lambda f: f.attrs.get("k_quant_type", "NONE") != "NONE"
         or f.attrs.get("v_quant_type", "NONE") != "NONE", _g2p_quant_check, _g2p_quant),
    Rule("position_ids", lambda f: "position_ids" in f.inputs, _ok, _g2p_positions),
    Rule("smooth_softmax", lambda f: int(f.attrs.get("smooth_softmax", -1)) == 1, _ok, _g2p_smooth),
    Rule("output_qk", lambda f: "output_qk" in f.outputs, _g2p_qk_check, _g2p_qk),
    Rule("sliding_window_cache", lambda f: int(f.attrs.get("sliding_window_cache", 0)) == 1,
         lambda f, io: None if io.caches_replaced else
         "a window-sized GQA cache buffer has no paged equivalent unless the caches are replaced (whole model)",
         lambda f, t, io: None),
    Rule("missing KV cache", lambda f: "past_key" not in f.inputs and "present_key" not in f.outputs,
         _refuse("a GQA node without past/present caches: PagedAttention always caches"), lambda f, t, io: None),
)


def gqa_node_to_paged(node: ir.Node, io: PagedIO, rules: tuple[Rule, ...] = GQA_TO_PAGED) -> tuple[list, dict, list]:
    """Convert one GroupQueryAttention node: (new nodes in order, {source value: replacing value}, rules
    applied). Refused(reason) when a feature cannot be expressed exactly. The graph is not touched."""
    return convert(node, io, rules, GQA, PA, "paged")
