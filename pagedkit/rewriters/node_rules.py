"""Node-level GroupQueryAttention <-> PagedAttention rules (issue 10, item 2), on onnx-ir.

Both operators share their features with identical math (design §3: same attribute names, defaults and
scale layouts). A rewrite of one node is a *rule set*: small rules, each with
  pattern  - does the feature occur on this node?
  check    - can the target operator express it exactly? (None, or the reason it cannot)
  rewrite  - move it: attributes, inputs, and helper nodes (Cast / Reshape / Gather) where layouts differ.
A node is converted only when every rule whose pattern matches passes its check; otherwise it is refused
with every reason (never half-converted, a feature is never dropped). The created attention node goes
through pagedkit's validator (`validate_node`) before it is returned.

What a node-level rule cannot know is where the *other* operator's step tensors come from (block table,
sequence lengths, caches, the packing of a padded batch): the caller says so with `PagedIO` (GQA ->
PagedAttention) or `GqaIO` (PagedAttention -> GQA). The whole-model passes (gqa_to_paged.py,
paged_to_gqa.py) build those once per model.

Padded [B, S] <-> packed [T]: with `PagedIO.token_rows` (int64 [T], index of each valid row in the flattened
[B * S] batch) the packing is a Gather of the valid rows (design §4.8: position_ids int64 [B, S] ->
query_positions int32 [T] is a Cast plus that Gather); without it, a Reshape (right only for B = 1 or an
unpadded batch, which is what the whole-model pass feeds).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

import numpy as np
import onnx_ir as ir

from pagedkit.validators import validate_node
from pagedkit.validators.contract import DOMAIN, GROUP_QUERY_ATTENTION as GQA, PAGED_ATTENTION as PA, OpContract

from ..kernels.onnx_ops.builder import Builder

F16, BF16, F32, I32, I64 = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.FLOAT, ir.DataType.INT32,
                            ir.DataType.INT64)
PAGED_T = (F16, BF16)  # PagedAttention's T (contract-decisions §6)
_BITS_TO_DTYPE = {(8, ir.DataType.INT8): "int8", (8, ir.DataType.FLOAT8E4M3FN): "float8e4m3fn",
                  (4, ir.DataType.UINT8): "int4"}
_DTYPE_TO_BITS = {"int8": 8, "float8e4m3fn": 8, "int4": 4}


class Refused(Exception):
    """A node a rule set does not convert; the message gives every reason."""


# ------------------------------------------------------------------------------------------------
# facts of a node, the target being built, rules
# ------------------------------------------------------------------------------------------------

@dataclass
class NodeFacts:
    """One source node: attributes (contract defaults filled in), present inputs and outputs by contract name."""

    name: str
    contract: OpContract
    attrs: dict
    inputs: dict  # contract input name -> ir.Value
    outputs: dict  # contract output name -> ir.Value (named outputs only)
    given: frozenset  # attribute names written on the node

    @classmethod
    def of(cls, node: ir.Node, contract: OpContract) -> "NodeFacts":
        attrs = {k: (v.value.decode() if isinstance(v.value, bytes) else v.value) for k, v in node.attributes.items()}
        ins = {n: v for n, v in zip(contract.input_names, node.inputs) if v is not None}
        outs = {n: v for n, v in zip(contract.output_names, node.outputs) if v is not None and v.name}
        return cls(node.name or contract.name, contract, contract.defaults() | attrs, ins, outs, frozenset(attrs))


@dataclass
class Target:
    """The node being built: attributes, inputs / outputs by contract name, helper nodes on `b`."""

    contract: OpContract
    b: Builder
    attrs: dict = field(default_factory=dict)
    inputs: dict = field(default_factory=dict)  # name -> ir.Value
    outputs: dict = field(default_factory=dict)  # name -> ir.Value (new values of the created node)
    after: list = field(default_factory=list)  # callables(node) run once the node exists (output adapters)
    replaces: dict = field(default_factory=dict)  # source output value -> the value that replaces it


@dataclass(frozen=True)
class Rule:
    name: str
    pattern: Callable[[NodeFacts], bool]
    check: Callable[[NodeFacts, object], str | None]
    rewrite: Callable[[NodeFacts, Target, object], None]


def _always(f):
    return True


def _ok(f, io):
    return None


def _dtype(v: ir.Value | None) -> ir.DataType | None:
    return None if v is None or v.dtype is None else v.dtype


def _dims(v: ir.Value | None) -> tuple | None:
    if v is None or v.shape is None:
        return None
    return tuple(d if isinstance(d, int) else None for d in v.shape)


def _value_info(values) -> dict:
    info = {}
    for v in values:
        if v is None or not v.name:
            continue
        shape = None if v.shape is None else tuple(d if isinstance(d, int) else (str(d) if d is not None and
                                                                                  str(d) else None) for d in v.shape)
        info[v.name] = (int(v.dtype) if v.dtype is not None else None, shape)
    return info


def _const_ints(values) -> dict:
    out = {}
    for v in values:
        if v is not None and v.const_value is not None and v.dtype in (I32, I64):
            try:
                out[v.name] = v.const_value.numpy()
            except Exception:
                pass
    return out


def _new_value(name: str, dtype: ir.DataType | None, shape) -> ir.Value:
    return ir.Value(name=name, type=ir.TensorType(dtype) if dtype is not None else None,
                    shape=ir.Shape(shape) if shape is not None else None)


def run_rules(rules: tuple[Rule, ...], f: NodeFacts, t: Target, io) -> list[str]:
    """Apply a rule set: every check first (all reasons collected), then every rewrite. Returns the names of
    the rules that matched; raises Refused with every reason when a check fails."""
    matched = [r for r in rules if r.pattern(f)]
    reasons = [f"{r.name}: {why}" for r in matched if (why := r.check(f, io))]
    if reasons:
        raise Refused("; ".join(reasons))
    for r in matched:
        r.rewrite(f, t, io)
    return [r.name for r in matched]


def make_node(t: Target, name: str) -> ir.Node:
    """The attention node of `t`, validated by pagedkit's validator (Refused with the issues otherwise)."""
    c = t.contract
    ins = [t.inputs.get(n) for n in c.input_names]
    while ins and ins[-1] is None:
        ins.pop()
    outs = []
    last = max(i for i, n in enumerate(c.output_names) if n in t.outputs)
    for n in c.output_names[: last + 1]:
        outs.append(t.outputs.get(n) or ir.Value(name=""))
    attrs = {k: v for k, v in t.attrs.items() if c.attr(k).default is None or v != c.attr(k).default}
    node = ir.Node(DOMAIN, c.name, ins, ir.convenience.convert_attributes(attrs), outputs=outs, name=name)
    proto = ir.serde.serialize_node(node)
    issues = validate_node(proto, _value_info([*ins, *outs]), _const_ints(ins))
    if issues:
        raise Refused(f"the created {c.name} node is invalid: " + "; ".join(str(i) for i in issues[:6]))
    for fn in t.after:
        fn(node)
    return node


# ------------------------------------------------------------------------------------------------
# shared rules: attributes both operators spell the same way
# ------------------------------------------------------------------------------------------------

SAME_ATTRS = ("num_heads", "kv_num_heads", "scale", "softcap", "local_window_size", "do_rotary",
              "rotary_interleaved", "qk_norm_epsilon", "qk_output")
PASS_INPUTS = ("cos_cache", "sin_cache", "head_sink", "q_norm_weight", "k_norm_weight")


def _copy_same(f, t, io):
    for k in SAME_ATTRS:
        if k in f.given:
            t.attrs[k] = f.attrs[k]


def _bias_softcap_check(f, io):
    if "attention_bias" in f.inputs and float(f.attrs.get("softcap", 0.0)) > 0:
        return ("attention_bias with softcap > 0: GroupQueryAttention adds the bias after softcap, PagedAttention "
                "before it; the converted node would compute something else")
    return None


def _activation_check(target_is_paged: bool):
    def check(f, io):
        dt = _dtype(f.inputs["query"])
        if dt is None:
            return "the element type of 'query' is unknown (run shape inference first)"
        if target_is_paged and dt not in PAGED_T and not getattr(io, "cast_to", None):
            return (f"query is {dt.name}; PagedAttention's T is float16 / bfloat16 only (contract-decisions §6): "
                    "pass cast_to=FLOAT16 to put Casts around the node")
        return None
    return check


# ------------------------------------------------------------------------------------------------
# GQA -> PagedAttention
# ------------------------------------------------------------------------------------------------

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
        if io.cast_to is not None and _dtype(src_out) not in (io.cast_to, None):
            y = b.cast(y, _dtype(src_out))
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


def _np_dtype(dt: ir.DataType):
    return dt.numpy() if dt is not None else np.float32


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


def _g2p_norm_eps_check(f, io):
    q, k = f.attrs.get("q_norm_epsilon"), f.attrs.get("k_norm_epsilon")
    if q is not None and k is not None and q != k:
        return (f"q_norm_epsilon {q} != k_norm_epsilon {k}: PagedAttention has one qk_norm_epsilon")
    return None


def _g2p_norm_eps(f, t, io):
    eps = f.attrs.get("q_norm_epsilon", f.attrs.get("k_norm_epsilon"))
    if eps is not None:
        t.attrs["qk_norm_epsilon"] = eps


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


def _refuse(reason):
    return lambda f, io: reason


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


def _renamed(name: str, old: str, new: str) -> str:
    """The builder's node names end in the op type ('/model/layers.0/attn/GroupQueryAttention'): swap it."""
    return name[: -len(old)] + new if name.endswith(old) else f"{name}/{new}"


def gqa_node_to_paged(node: ir.Node, io: PagedIO, rules: tuple[Rule, ...] = GQA_TO_PAGED) -> tuple[list, dict, list]:
    """Convert one GroupQueryAttention node: (new nodes in order, {source value: replacing value}, rules
    applied). Refused(reason) when a feature cannot be expressed exactly. The graph is not touched."""
    return _convert(node, io, rules, GQA, PA, "paged")


def _convert(node: ir.Node, io, rules: tuple[Rule, ...], src, dst, tag: str) -> tuple[list, dict, list]:
    """Run `rules` on one node of op `src`, build the `dst` node: (nodes before it, it, nodes after it)."""
    f = NodeFacts.of(node, src)
    t = Target(dst, Builder(f"{f.name}/{tag}"))
    applied = run_rules(rules, f, t, io)
    pre = list(t.b.nodes)
    t.b.tape = ir.tape.Tape()
    attn = make_node(t, _renamed(f.name, src.name, dst.name))
    return [*pre, attn, *t.b.nodes], t.replaces, applied


# ------------------------------------------------------------------------------------------------
# PagedAttention -> GQA
# ------------------------------------------------------------------------------------------------

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
        if io.cast_to is not None and _dtype(src_out) not in (io.cast_to, None):
            y = b.cast(y, _dtype(src_out))
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
    return _convert(node, io, rules, PA, GQA, "gqa")



def node_pass(model: ir.Model, to: str, io_for: Callable[[ir.Node], object], rules: tuple[Rule, ...] | None = None):
    """Convert every main-graph attention node of the source operator (GroupQueryAttention for to="paged",
    PagedAttention for to="gqa") in place; `io_for(node)` gives its PagedIO / GqaIO (or raises Refused).
    A refused node is left unchanged and reported with the reason. Consumers of the old outputs and graph
    outputs are rewired to the new values. Returns a RewriteReport (changed, skipped, rules per node)."""
    from .report import RewriteReport

    if to not in ("paged", "gqa"):
        raise ValueError(f"to should be 'paged' or 'gqa', got {to!r}")
    src_op, fn = ("GroupQueryAttention", gqa_node_to_paged) if to == "paged" else ("PagedAttention", paged_node_to_gqa)
    rules = rules if rules is not None else (GQA_TO_PAGED if to == "paged" else PAGED_TO_GQA)
    g = model.graph
    report = RewriteReport(f"node pass -> {to}")
    for i, node in enumerate([n for n in g if n.op_type == src_op and n.domain == DOMAIN]):
        name = node.name or f"{src_op}_{i}"
        try:
            new_nodes, replaces, applied = fn(node, io_for(node), rules)
        except Refused as exc:
            report.skipped.append((name, str(exc)))
            continue
        g.insert_before(node, new_nodes)
        for old, new in replaces.items():
            if old in g.outputs:
                idx = g.outputs.index(old)
                keep = old.name
                old.name = f"{keep}/replaced"
                new.name = keep
                g.outputs[idx] = new
            old.replace_all_uses_with(new)
        g.remove(node, safe=True)
        report.changed.append(name)
        report.rules[name] = applied
    return report


__all__ = ["GQA_TO_PAGED", "PAGED_TO_GQA", "GqaIO", "NodeFacts", "PagedIO", "Refused", "Rule", "Target", "node_pass",
           "gqa_node_to_paged", "make_node", "paged_node_to_gqa", "run_rules"]
