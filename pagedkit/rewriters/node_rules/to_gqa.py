"""PagedAttention -> GroupQueryAttention, one node (rule set `PAGED_TO_GQA`, `paged_node_to_gqa`).

The caller says where the GQA step tensors come from (`GqaIO`). Packed [T] -> padded [B, S]: a Reshape by
`GqaIO.batch_seq` (right for B = 1 or an unpadded batch), or with `GqaIO.token_rows` a ScatterND into the padded
batch (the output comes back with a Gather of the valid rows).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from pagedkit.validators.contract import GROUP_QUERY_ATTENTION as GQA, PAGED_ATTENTION as PA

from ...kernels.onnx_ops.builder import Builder
from .base import (
    BF16, F16, F32, I64, PASS_INPUTS, Rule, Target, _always, _bias_softcap_check, _copy_same, _dtype, _new_value,
    _np_dtype, _ok, _refuse, convert,
)

_DTYPE_TO_BITS = {"int8": 8, "float8e4m3fn": 8, "int4": 4}


@dataclass
class GqaIO:
    """Where a converted node's GQA step tensors come from.

    past_key / past_value: BNSH caches; present_key / present_value: output names. seqlens_k / total_length:
    int32 [B] and int32 [1]. batch_seq: int64 [2] = (B, S) of the padded batch, to unpack [T, W] -> [B, S, W]
    (a Reshape: right for B = 1 or an unpadded batch; token_rows (int64 [T], index of each packed token in
    the flattened [B * S] batch) for a padded one, with Scatter/Gather). query_positions become position_ids
    [B, S] int64 the same way. cast_to: run the GQA node in this dtype (FLOAT for onnxruntime CPU on bf16).
    """

    past_key: ir.Value
    past_value: ir.Value
    present_key: str
    present_value: str
    seqlens_k: ir.Value
    total_length: ir.Value
    batch_seq: ir.Value
    token_rows: ir.Value | None = None
    cast_to: ir.DataType | None = None
    query_seqlens: ir.Value | None = None  # int32 [B]: valid rows of each right-padded chunk (padded batches)
    unfuse_qk_norm: bool = False  # QK-norm as standard ops before the node (onnxruntime CPU rejects it fused)


def _p2g_cast(t, io, v, src=None):
    dt = src or _dtype(v)
    if io.cast_to is not None and dt not in (io.cast_to, None) and dt in (F16, BF16, F32):
        return t.b.cast(v, io.cast_to)
    return v


def _unpack(t: Target, io: GqaIO, v: ir.Value, dt: ir.DataType | None = None, fill=0.0) -> ir.Value:
    """[T, W] -> [B, S, W] (dt: v's element type when the builder has not recorded it)."""
    b = t.b
    shape = b.cat(io.batch_seq, b.dim(v, 1))
    if io.token_rows is None:
        return b.op("Reshape", v, shape)
    n = b.op("ReduceProd", io.batch_seq, keepdims=1)
    zeros = b.op("ConstantOfShape", b.cat(n, b.dim(v, 1)),
                 value=ir.tensor(np.full(1, fill, dtype=_np_dtype(dt or _dtype(v)))))
    return b.op("Reshape", b.op("ScatterND", zeros, b.unsq(io.token_rows, 1), v), shape)


def _p2g_core(f, t, io: GqaIO):
    a = f.attrs
    t.attrs["num_heads"], t.attrs["kv_num_heads"] = a["num_heads"], a["kv_num_heads"]
    if "is_causal" in f.given:
        t.attrs["causal"] = a["is_causal"]
    qkv = {n: f.inputs[n] for n in ("query", "key", "value") if n in f.inputs}
    unfused = io.unfuse_qk_norm and "q_norm_weight" in f.inputs
    if unfused:
        qkv = _unfused_qk_norm(f, t, qkv)
    for n, v in qkv.items():
        t.inputs[n] = _p2g_cast(t, io, _unpack(t, io, v, _dtype(f.inputs["query"])), _dtype(f.inputs["query"]))
    for n in PASS_INPUTS:
        if n in f.inputs and not (unfused and n in ("q_norm_weight", "k_norm_weight")):
            t.inputs[n] = _p2g_cast(t, io, f.inputs[n])
    t.inputs.update(past_key=io.past_key, past_value=io.past_value, seqlens_k=io.seqlens_k,
                    total_sequence_length=io.total_length)
    if io.query_seqlens is not None:
        t.inputs["query_seqlens"] = io.query_seqlens
    src_out = f.outputs["output"]
    out = _new_value(f"{f.name}/gqa/output", io.cast_to or _dtype(src_out), None)
    t.outputs["output"] = out
    b = t.b

    def restore(node):
        y = b.op("Reshape", out, b.cat(b.i64(-1), b.dim(out, 2)))
        if io.token_rows is not None:
            y = b.gather(y, io.token_rows)
        src_t = _dtype(src_out) or _dtype(f.inputs["query"])  # an untyped output has the query's type (both ops)
        if io.cast_to is not None and src_t not in (io.cast_to, None):
            y = b.cast(y, src_t)
        t.replaces[src_out] = y
    t.after.append(restore)
    for src, dst, name, past in (("key_cache_out", "present_key", io.present_key, io.past_key),
                                 ("value_cache_out", "present_value", io.present_value, io.past_value)):
        t.outputs[dst] = _new_value(name, _dtype(past), None)
        if src in f.outputs:
            t.replaces[f.outputs[src]] = t.outputs[dst]


def _rms(b: Builder, x: ir.Value, w: ir.Value, eps: float, dt: ir.DataType) -> ir.Value:
    """Per-head RMSNorm of x [T, heads * D] with gain w [D], computed in float32, rounded to dt."""
    rows = b.op("Reshape", b.f(x), b.cat(b.i64(-1), b.dim(w, 0)))
    ms = b.op("ReduceMean", b.op("Mul", rows, rows), b.i64(-1), keepdims=1)
    y = b.op("Mul", b.op("Div", rows, b.op("Sqrt", b.op("Add", ms, b.f32(eps)))), b.f(w))
    return b.cast(b.op("Reshape", y, b.op("Shape", x)), dt)


def _unfused_qk_norm(f, t, qkv: dict) -> dict:
    """PagedAttention's fused QK-norm (RMSNorm per head of Q and K with q/k_norm_weight, before RoPE) as
    standard ops on the packed rows, so that the GQA node runs without it (onnxruntime CPU rejects it)."""
    b, a = t.b, f.attrs
    eps, dt = float(a["qk_norm_epsilon"]), _dtype(f.inputs["query"])
    wq, wk = f.inputs["q_norm_weight"], f.inputs["k_norm_weight"]
    if "key" in qkv:
        return dict(qkv, query=_rms(b, qkv["query"], wq, eps, dt), key=_rms(b, qkv["key"], wk, eps, dt))
    d = b.dim(wq, 0)
    sizes = b.cat(b.op("Mul", d, b.i64(int(a["num_heads"]))), b.op("Mul", d, b.i64(int(a["kv_num_heads"]))),
                  b.op("Mul", d, b.i64(int(a["kv_num_heads"]))))
    q, k, v = b.ops("Split", qkv["query"], sizes, num_outputs=3, axis=1)
    return {"query": b.op("Concat", _rms(b, q, wq, eps, dt), _rms(b, k, wk, eps, dt), v, axis=1)}


def _p2g_quant_check(f, io):
    kd, vd = f.attrs.get("k_cache_dtype", ""), f.attrs.get("v_cache_dtype", "")
    for side in ("k", "v"):
        if f.attrs.get(f"{side}_quant_type", "NONE") == "PER_TOKEN":
            return "PER_TOKEN quantization: GroupQueryAttention has no per-token scale caches"
    bits = {_DTYPE_TO_BITS.get(d) for d in (kd, vd) if d}
    if len(bits) > 1:
        return f"k_cache_dtype {kd!r} and v_cache_dtype {vd!r} differ: GQA has one kv_cache_bit_width"
    return None


def _p2g_quant(f, t, io):
    fmt = f.attrs.get("k_cache_dtype") or f.attrs.get("v_cache_dtype")
    cache = _dtype(f.inputs["key_cache"])
    bits = _DTYPE_TO_BITS.get(fmt) or {ir.DataType.INT8: 8, ir.DataType.FLOAT8E4M3FN: 8, ir.DataType.UINT8: 4}.get(cache)
    if bits:
        t.attrs["kv_cache_bit_width"] = bits
    for side in ("k", "v"):
        qt = f.attrs.get(f"{side}_quant_type", "NONE")
        if qt != "NONE":
            t.attrs[f"{side}_quant_type"] = qt
            t.inputs[f"{side}_scale"] = f.inputs[f"{side}_scale"]


def _p2g_positions(f, t, io):
    b = t.b
    pos = b.cast(f.inputs["query_positions"], I64)
    t.inputs["position_ids"] = b.sq(_unpack(t, io, b.unsq(pos, 1), I64), 2)


def _p2g_window_check(f, io):
    if int(f.attrs["is_causal"]) == 0 and int(f.attrs["local_window_size"]) > 0:
        return "is_causal=0 with local_window_size > 0: GroupQueryAttention requires local_window_size -1 when causal=0"
    return None


def _p2g_qk_check(f, io):
    if io.token_rows is not None:
        return "output_qk of a padded batch: only B = 1 / unpadded batches convert [H, T, capacity]"
    return None


def _p2g_qk(f, t, io):
    """GQA output_qk [1, H, S, total] -> PagedAttention's [H, T, capacity] (B = 1): zero padded to capacity."""
    b = t.b
    src = f.outputs["output_qk"]
    qk = _new_value(f"{f.name}/gqa/output_qk", io.cast_to or _dtype(f.inputs["query"]), None)
    t.outputs["output_qk"] = qk

    def adapt(node):
        y = b.sq(qk, 0)  # [H, S, total]
        cap = b.op("Mul", b.dim(f.inputs["block_table"], 1), b.dim(f.inputs["key_cache"], 1))
        pad = b.op("Sub", cap, b.dim(y, 2))
        pads = b.cat(b.i64(0, 0, 0, 0, 0), pad)
        y = b.op("Pad", y, pads)
        y = b.cast(y, _dtype(src) or F32)
        t.replaces[src] = y
    t.after.append(adapt)


PAGED_TO_GQA: tuple[Rule, ...] = (
    Rule("core (heads, Q/K/V, caches, lengths)", _always, _ok, _p2g_core),
    Rule("shared attributes (scale, softcap, window, rotary, qk_norm_epsilon, qk_output)", _always, _ok, _copy_same),
    Rule("is_causal=0 with a window", lambda f: True, _p2g_window_check, lambda f, t, io: None),
    Rule("attention_bias", lambda f: "attention_bias" in f.inputs,
         lambda f, io: _bias_softcap_check(f, io) or
         "attention_bias capacities (q_capacity, kv_capacity) differ from GQA's (S, total): not converted",
         lambda f, t, io: None),
    Rule("quantized cache", lambda f: f.attrs.get("k_quant_type", "NONE") != "NONE"
         or f.attrs.get("v_quant_type", "NONE") != "NONE" or f.attrs.get("k_cache_dtype", "") == "int4",
         _p2g_quant_check, _p2g_quant),
    Rule("query_positions", lambda f: "query_positions" in f.inputs, _ok, _p2g_positions),
    Rule("output_qk", lambda f: "output_qk" in f.outputs, _p2g_qk_check, _p2g_qk),
    Rule("LATENT (MLA)", lambda f: f.attrs.get("kv_cache_layout") == "LATENT",
         _refuse("GroupQueryAttention has no latent (MLA) cache layout"), lambda f, t, io: None),
    Rule("rotary_offset", lambda f: int(f.attrs.get("rotary_offset", 0)) != 0,
         _refuse("GroupQueryAttention rotates from channel 0 only (no rotary_offset)"), lambda f, t, io: None),
    Rule("Hadamard rotation", lambda f: int(f.attrs.get("qk_rotation", 0)) or int(f.attrs.get("v_rotation", 0)),
         _refuse("GroupQueryAttention has no qk_rotation / v_rotation"), lambda f, t, io: None),
    Rule("slot_mapping", lambda f: "slot_mapping" in f.inputs,
         _refuse("slot_mapping writes K/V to arbitrary slots; a BNSH cache appends at each sequence's end"),
         lambda f, t, io: None),
    Rule("attention_metadata", lambda f: "attention_metadata" in f.inputs, _ok,
         lambda f, t, io: None),  # launch bounds only, never part of the result (contract-decisions §2)
)


def paged_node_to_gqa(node: ir.Node, io: GqaIO, rules: tuple[Rule, ...] = PAGED_TO_GQA) -> tuple[list, dict, list]:
    """Convert one PagedAttention node to GroupQueryAttention; as gqa_node_to_paged."""
    return convert(node, io, rules, PA, GQA, "gqa")
