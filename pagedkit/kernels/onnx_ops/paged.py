"""`decompose`: every com.microsoft::PagedAttention node -> standard ONNX ops (opset >= 21), so that stock
onnxruntime (any execution provider) runs a paged model.

A pass in the style of onnxscript's rewriter: for each node, *match* (op type and domain), *check*
(pagedkit.validators.validate_node on what shape inference knows, plus the static facts the
decomposition needs; a node that fails is skipped with the reason, never half-rewritten) and *rewrite*
(build the replacement on an onnx-ir Tape and splice it in with the node's output names, so consumers and
graph outputs are unchanged).

The replacement computes the same outputs as pagedkit.kernels.paged_attention, cache outputs included.
onnxruntime does not alias outputs to inputs: each cache output is a NEW tensor, the input cache with the
step's writes applied (ScatterND). A caller feeds it back as the next step's cache input (as
onnxruntime-genai does with past/present when buffers are not shared). attention_metadata is ignored: its
entries are launch bounds, never part of the result (contract-decisions §2).

    model, report = decompose(onnx.load("model.onnx"))
    print(report)                           # nodes changed / skipped with the reason
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import onnx
import onnx_ir as ir

from pagedkit.validators import validate_node
from pagedkit.validators.contract import PAGED_ATTENTION

from ..onnx_facts import facts as _facts
from .builder import F32, Builder
from .paged_attention import Masking, allowed_mask, apply_rope, attend, rms_norm, rope_tables, rotate
from .paged_cache import Side, context, decode, in_place_refusal, token_index, update_side, write_slots
from .paged_inplace import rewrite_in_place

MIN_OPSET = 21
DOMAIN = "com.microsoft"
_FMT = {ir.DataType.INT8: "int8", ir.DataType.FLOAT8E4M3FN: "float8e4m3fn"}
_FLOATS = (ir.DataType.FLOAT16, ir.DataType.BFLOAT16, ir.DataType.FLOAT)


# What the rewrite implements. A contract that grows (a new attribute, input or output) makes a node that
# uses it refused by name here, never decomposed without it.
KNOWN_ATTRIBUTES = frozenset((
    "num_heads", "kv_num_heads", "scale", "softcap", "local_window_size", "do_rotary", "rotary_interleaved",
    "is_causal", "qk_norm_epsilon", "k_quant_type", "v_quant_type", "k_cache_dtype", "v_cache_dtype",
    "kv_cache_layout", "v_head_size", "rotary_offset", "qk_output", "qk_rotation", "v_rotation"))
KNOWN_INPUTS = frozenset(PAGED_ATTENTION.input_names[:21])
KNOWN_OUTPUTS = frozenset(PAGED_ATTENTION.output_names[:6])


class Refused(Exception):
    """A node the decomposition does not rewrite; the message is the reason."""


@dataclass
class DecomposeReport:
    changed: list[str] = field(default_factory=list)  # node names rewritten
    skipped: list[tuple[str, str]] = field(default_factory=list)  # (node name, reason)

    def __str__(self) -> str:
        lines = [f"decompose: {len(self.changed)} PagedAttention node(s) rewritten, {len(self.skipped)} skipped"]
        lines += [f"  rewritten: {n}" for n in self.changed]
        lines += [f"  skipped: {n}: {r}" for n, r in self.skipped]
        return "\n".join(lines)


# ------------------------------------------------------------------------------------------------
# what is known statically (shape inference on the proto)
# ------------------------------------------------------------------------------------------------

@dataclass
class Spec:
    """The static facts of one node the rewrite needs."""

    attrs: dict
    x: dict  # input name -> ir.Value (present inputs only)
    outs: dict  # output name -> ir.Value (present outputs only)
    t_elem: ir.DataType
    heads: int
    kv_heads: int
    head_size: int
    v_head: int
    latent: bool
    packed: bool
    half: int  # rotary_dim / 2 (do_rotary)
    qk_elem: ir.DataType
    sides: dict  # "k"/"v" -> Side


def _dim(info: dict, name: str, i: int):
    shape = info.get(name, (None, None))[1]
    d = shape[i] if shape is not None and len(shape) > i else None
    return d if isinstance(d, int) else None


def _elem(info: dict, name: str) -> ir.DataType | None:
    e = info.get(name, (None, None))[0]
    return ir.DataType(e) if e else None


def _t_elem(a: dict, info: dict, name_of: dict, outs: dict) -> ir.DataType | None:
    """T: query's element type, else that of any other T-typed input (often initializers: cos/sin, norm
    weights, sinks), of output 0, or of an unquantized cache (T_CACHE == T iff no quantization)."""
    for n in ("query", "key", "value", "cos_cache", "sin_cache", "head_sink", "q_norm_weight", "k_norm_weight",
              "attention_bias"):
        if n in name_of and _elem(info, name_of[n]) is not None:
            return _elem(info, name_of[n])
    if "output" in outs and _elem(info, outs["output"].name) is not None:
        return _elem(info, outs["output"].name)
    if a["k_quant_type"] == "NONE" and a["k_cache_dtype"] != "int4":
        return _elem(info, name_of["key_cache"])
    return None


def check(node: ir.Node, proto_node: onnx.NodeProto, info: dict, consts: dict) -> Spec:
    """Validate the node and collect its static facts; raises Refused(reason)."""
    issues = validate_node(proto_node, info, consts)
    if issues:
        raise Refused("invalid node: " + "; ".join(str(i) for i in issues[:4]))
    for attr in node.attributes:
        if attr not in KNOWN_ATTRIBUTES:
            raise Refused(f"attribute '{attr}' is not decomposed")
    a = PAGED_ATTENTION.defaults() | {k: v.value for k, v in node.attributes.items()}
    a = {k: (v.decode() if isinstance(v, bytes) else v) for k, v in a.items()}
    x = {n: v for n, v in zip(PAGED_ATTENTION.input_names, node.inputs) if v is not None}
    outs = {n: v for n, v in zip(PAGED_ATTENTION.output_names, node.outputs) if v is not None and v.name}
    for n in [*x, *outs]:
        if n not in KNOWN_INPUTS | KNOWN_OUTPUTS:
            raise Refused(f"input or output '{n}' is not decomposed")
    name_of = {n: v.name for n, v in x.items()}
    heads, kv_heads = int(a["num_heads"]), int(a["kv_num_heads"])
    latent = a["kv_cache_layout"] == "LATENT"
    packed = not latent and "key" not in x and "value" not in x
    t_elem = _t_elem(a, info, name_of, outs)
    if t_elem is None:
        raise Refused("the element type of input 'query' is unknown (run shape inference or declare it)")
    width = _dim(info, name_of["query"], 1)
    div = heads + 2 * kv_heads if packed else heads
    head_size = width // div if width else None
    if head_size is None:
        d3 = _dim(info, name_of["key_cache"], 3)
        head_size = (2 * d3 if a["k_cache_dtype"] == "int4" else d3) if d3 else None
    if not head_size:
        raise Refused("head_size is not known statically (query.shape[1] and key_cache.shape[3] are symbolic)")
    v_head = (int(a["v_head_size"]) or head_size) if latent else head_size
    half = 0
    if int(a["do_rotary"]):
        half = _dim(info, name_of["cos_cache"], 1) or 0
        if not half:
            raise Refused("do_rotary=1 but cos_cache.shape[1] (rotary_dim / 2) is not known statically")
    qk_elem = F32
    if "output_qk" in outs:
        qk_elem = _elem(info, outs["output_qk"].name) or F32
    sides = {}
    for p in ("k",) if latent else ("k", "v"):
        cname = "key_cache" if p == "k" else "value_cache"
        elem = _elem(info, name_of[cname])
        if elem is None:
            raise Refused(f"the element type of input '{cname}' is unknown")
        fmt = "int4" if a[f"{p}_cache_dtype"] == "int4" else _FMT.get(elem)
        if fmt is None and elem not in _FLOATS:
            raise Refused(f"input '{cname}': element type {elem.name} is not decomposed")
        side = Side(p, x[cname], elem, fmt, str(a[f"{p}_quant_type"]), head_size, kv_heads)
        if side.quant == "PER_TOKEN":
            side.scale_cache = x[f"{p}_scale_cache"]
            side.scale_elem = _elem(info, side.scale_cache.name)
            if side.scale_elem is None:
                raise Refused(f"the element type of input '{p}_scale_cache' is unknown")
        elif side.quant != "NONE":
            side.scale = x[f"{p}_scale"]
        sides[p] = side
    return Spec(a, x, outs, t_elem, heads, kv_heads, head_size, v_head, latent, packed, half, qk_elem, sides)


# ------------------------------------------------------------------------------------------------
# rewrite
# ------------------------------------------------------------------------------------------------

def _dims_key(info: dict, name: str, axes) -> tuple | None:
    """The static (int or symbolic) sizes of name's axes, None when any is unknown."""
    shape = info.get(name, (None, None))[1]
    if shape is None or len(shape) <= max(axes):
        return None
    dims = tuple(shape[i] for i in axes)
    return None if any(d is None or d == "" for d in dims) else dims


def share_key(s: Spec, info: dict) -> tuple | None:
    """Nodes with equal keys share the step's bookkeeping (token index, write slots, context rows, RoPE rows):
    the same sequence-length / block-table / position inputs and caches whose block count and block size are
    statically the same (equal ints or the same symbolic names); token_count is csl[-1] for every node (a
    valid input), so the first node's query gives it. None: not shared."""
    cache = _dims_key(info, s.x["key_cache"].name, (0, 1))
    if cache is None:
        return None
    names = tuple(s.x[n].name if n in s.x else "" for n in ("cumulative_sequence_length", "past_seqlens",
                                                           "block_table", "slot_mapping", "query_positions"))
    return names + cache + (int(s.attrs["qk_output"]),)  # token_count: csl[-1] (the contract) for every node


def rewrite(s: Spec, prefix: str, in_place: bool = False, shared: dict | None = None,
            key: tuple | None = None, fused: bool = False) -> tuple[Builder, dict]:
    """Build the replacement; returns the builder (its nodes) and output name -> new value. in_place: the
    cache outputs are ScatterND's straight on the cache inputs (bind each to its input's buffer) and the
    context covers only the columns the step can read (when no output_qk fixes its width). fused (with
    in_place, opset >= 23): the attention itself is one ONNX Attention node where its semantics allow
    (fused_refusal), else the op-by-op form."""
    b, x, a = Builder(prefix), s.x, s.attrs
    memo = shared.setdefault(key, {}) if shared is not None and key is not None else {}
    if in_place:
        return b, rewrite_in_place(s, b, memo, fused)
    hd, hkv, h = s.head_size, s.kv_heads, s.heads
    if "ix" not in memo:
        memo["ix"] = token_index(b, x["query"], x["cumulative_sequence_length"], x["past_seqlens"],
                                 x.get("query_positions"))
    ix = memo["ix"]
    qf = b.f(x["query"])
    if s.packed:
        q, k, v = b.ops("Split", qf, b.i64(h * hd, hkv * hd, hkv * hd), num_outputs=3, axis=1)
    else:
        q, k = qf, b.f(x["key"])
        v = None if s.latent else b.f(x["value"])
    q, k = b.reshape(q, ix.t, h, hd), b.reshape(k, ix.t, hkv, hd)
    v = None if v is None else b.reshape(v, ix.t, hkv, hd)
    # prologue: QK-norm -> RoPE -> rotation; Q rounded to T
    if "q_norm_weight" in x:
        eps = float(a["qk_norm_epsilon"])
        q, k = rms_norm(b, q, x["q_norm_weight"], eps), rms_norm(b, k, x["k_norm_weight"], eps)
    if int(a["do_rotary"]):
        rk = ("rope", x["cos_cache"].name, x["sin_cache"].name, s.half, int(a["rotary_interleaved"]),
              int(a["rotary_offset"]))
        if rk not in memo or not x["cos_cache"].name:
            memo[rk] = rope_tables(b, x["cos_cache"], x["sin_cache"], ix.pos, s.half,
                                   bool(int(a["rotary_interleaved"])), int(a["rotary_offset"]))
        r = memo[rk]
        q, k = apply_rope(b, q, r, hd, ix.t, h), apply_rope(b, k, r, hd, ix.t, hkv)
    if int(a["qk_rotation"]):
        q, k = rotate(b, q, hd), rotate(b, k, hd)
    if v is not None and int(a["v_rotation"]):
        v = rotate(b, v, hd)
    q = b.f(b.cast(q, s.t_elem))
    # cache writes (every token of the step before any attention), then the context reads
    ks = s.sides["k"]
    if "slots" not in memo:
        memo["slots"] = write_slots(b, ix, x["block_table"], x.get("slot_mapping"), ks.cache)
        memo["ctx"] = context(b, ix, x["block_table"], ks.cache)
    slots, keep = memo["slots"]
    ctx = memo["ctx"]
    new = {}
    ctx_vals = {}
    for p, val in (("k", k), ("v", v)):
        side = s.sides.get(p)
        if side is None:
            continue
        padded, out, scale_padded, scale_out = update_side(b, side, ix, slots, keep, val)
        new["key_cache_out" if p == "k" else "value_cache_out"] = out
        if scale_out is not None:
            new[f"{p}_scale_cache_out"] = scale_out
        ctx_vals[p] = decode(b, side, ix, ctx, padded, scale_padded)
    keys = ctx_vals["k"]
    values = b.slice(keys, 0, s.v_head, 3) if s.latent else ctx_vals["v"]
    scale = float(a["scale"]) or 1.0 / math.sqrt(hd)
    m = Masking(bool(int(a["is_causal"])), int(a["local_window_size"]), float(a["softcap"]), scale,
                int(a["qk_output"]))
    ak = ("allowed", m.causal, m.window)
    if ak not in memo:
        memo[ak] = allowed_mask(b, ix, ctx, m)
    allowed = memo[ak]
    out, qk = attend(b, q, keys, values, allowed, ix, ctx, m, h, hkv, hd, s.v_head,
                     x.get("attention_bias"), x.get("head_sink"))
    if "v" in s.sides and int(a["v_rotation"]):
        out = rotate(b, out, hd)
    new["output"] = b.cast(b.reshape(out, ix.t, h * s.v_head), s.t_elem)
    if qk is not None:
        new["output_qk"] = b.cast(b.op("Transpose", qk, perm=[1, 0, 2]), s.qk_elem)
    return b, new


# ------------------------------------------------------------------------------------------------
# the pass
# ------------------------------------------------------------------------------------------------

def _default_opset(model: ir.Model) -> int | None:
    return model.opset_imports.get("", model.opset_imports.get("ai.onnx"))


FUSED_MIN_OPSET = 23  # ONNX Attention


def decompose(model: onnx.ModelProto | ir.Model, *, in_place: bool = False, fused: bool = False
              ) -> tuple[onnx.ModelProto | ir.Model, DecomposeReport]:
    """Rewrite every valid com.microsoft::PagedAttention node of the main graph into standard ONNX ops.

    Returns (the rewritten model, of the same kind as given: a new ModelProto, or the ir.Model edited in
    place; a report of the nodes rewritten and skipped with the reason). Nodes inside subgraphs or
    functions are reported and left alone. The default-domain opset must be >= 21 (or absent: 21 is added).
    in_place: the form the CPU session runs in onnxruntime (runtime/delegate.py): each cache output is a
    ScatterND straight on its cache input, so binding the output to the input's buffer writes only the step's
    rows; the context spans only the block-table columns the step can read; fp8 / bfloat16 caches refused.
    fused (with in_place, on a model of default opset >= 23): each node's attention is one ONNX Attention node
    where its semantics allow (no softcap, head_sink or output_qk), the op-by-op form elsewhere.
    """
    as_proto = isinstance(model, onnx.ModelProto)
    proto = model if as_proto else ir.serde.serialize_model(model)
    irm = ir.serde.deserialize_model(proto) if as_proto else model
    info, consts = _facts(proto)
    proto_nodes = {tuple(n.output): n for n in proto.graph.node}
    report = DecomposeReport()
    opset = _default_opset(irm)
    fused = fused and in_place and opset is not None and opset >= FUSED_MIN_OPSET
    shared: dict = {}  # share_key -> the step's bookkeeping values, built by the first node with that key
    for i, node in enumerate(list(irm.graph)):
        if node.op_type != "PagedAttention" or node.domain != DOMAIN:
            continue
        name = node.name or f"PagedAttention_{i}"
        try:
            if opset is not None and opset < MIN_OPSET:
                raise Refused(f"the model's default opset is {opset}; the decomposition needs >= {MIN_OPSET} "
                              "(convert the model with onnx.version_converter first)")
            key = tuple(v.name if v is not None else "" for v in node.outputs)
            pnode = proto_nodes.get(key)
            if pnode is None:
                raise Refused("node not found in the serialized model")
            spec = check(node, pnode, info, consts)
            if in_place:
                why = next((r for r in map(in_place_refusal, spec.sides.values()) if r), None)
                if why:
                    raise Refused(why)
            b, new = rewrite(spec, f"{name}/decomposed", in_place, shared, share_key(spec, info), fused)
        except Refused as exc:
            report.skipped.append((name, str(exc)))
            continue
        old = [spec.outs[n] for n in new if n in spec.outs]
        ir.convenience.replace_nodes_and_values(irm.graph, node, [node], b.nodes, old,
                                                [new[n] for n in new if n in spec.outs])
        report.changed.append(name)
    for sub in _subgraph_nodes(irm.graph):
        report.skipped.append((sub.name or sub.op_type, "inside a subgraph (If/Loop/Scan body): not rewritten"))
    for fn in irm.functions.values():
        for n in fn:
            if n.op_type == "PagedAttention" and n.domain == DOMAIN:
                report.skipped.append((n.name or n.op_type, f"inside function {fn.name}: not rewritten"))
    if report.changed and opset is None:
        irm.opset_imports[""] = MIN_OPSET
    return (ir.serde.serialize_model(irm) if as_proto else irm), report


def _subgraph_nodes(graph: ir.Graph):
    for node in graph:
        for attr in node.attributes.values():
            graphs = [attr.value] if attr.type == ir.AttributeType.GRAPH else (
                list(attr.value) if attr.type == ir.AttributeType.GRAPHS else [])
            for g in graphs:
                for n in g.all_nodes() if hasattr(g, "all_nodes") else g:
                    if n.op_type == "PagedAttention" and n.domain == DOMAIN:
                        yield n


__all__ = ["DecomposeReport", "Refused", "check", "decompose", "rewrite"]
