"""Whole model, PagedAttention -> GroupQueryAttention (issue 10, item 3, the reverse): a paged-layout decoder
(onnxruntime-genai's builder with use_paged_attention=true, or a pagedkit export / rewrite) becomes the
builder's padded GQA layout, for edge / single-stream use and for onnxruntime CPU:

    input_ids [num_tokens] -> [batch_size, sequence_length] (Reshape to [B * S] in front of its users)
    new input attention_mask [batch_size, total_sequence_length] int64 -> seqlens_k / total_sequence_length
        (ReduceSum - 1, Shape; the builder's own subgraph)
    past_key_values.{i}.key/value [num_blocks, block_size, Hkv, D] -> [batch_size, Hkv, past_sequence_length, D]
        (same names), present.{i}.* [batch_size, Hkv, total_sequence_length, D]
    block_table(_windowed), cumulative_sequence_lengths, past_sequence_lengths, attention_metadata  removed
    logits [num_tokens, V] -> [batch_size, sequence_length, V]

Every other op is per token, so the [B * S] rows (padding included) run as the packed tokens did; each GQA
node unpacks [B * S, W] -> [B, S, W] with a Reshape, exact for any B. Windowed layers keep
local_window_size over a full-length cache (no sliding_window_cache): the same result.

onnxruntime's CPU GQA rejects fused QK-norm and bf16: by default QK-norm moves out of the node into standard
ops (RMSNorm per head in float32 before the node; unfuse_qk_norm=False keeps it fused: valid GQA that
onnxruntime's CUDA kernel runs); `cast_to=FLOAT` puts Casts around bf16 nodes.
"""

from __future__ import annotations

import numpy as np
import onnx
import onnx_ir as ir

from pagedkit.interface import names as N

from .gqa_to_paged import _attention_nodes, _input, _new_input, remove_dead_nodes
from .node_rules import GqaIO, Refused, paged_node_to_gqa
from .report import RewriteRefused, RewriteReport

I32, I64 = ir.DataType.INT32, ir.DataType.INT64
_PAGED_ONLY = (N.BLOCK_TABLE, N.BLOCK_TABLE_WINDOWED, N.CUMULATIVE_SEQUENCE_LENGTHS, N.PAST_SEQUENCE_LENGTHS,
               N.ATTENTION_METADATA)


def _node(g: ir.Graph, op: str, inputs, name: str, dtype=None, shape=None, **attrs) -> ir.Value:
    out = ir.Value(name=name, type=ir.TensorType(dtype) if dtype is not None else None,
                   shape=ir.Shape(shape) if shape is not None else None)
    g.append(ir.Node("", op, inputs, ir.convenience.convert_attributes(attrs) if attrs else (), outputs=[out],
                     name=name))
    return out


def _const(g: ir.Graph, name: str, values, dtype=I64) -> ir.Value:
    v = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape([len(values)]),
                 const_value=ir.tensor(np.array(values, dtype=dtype.numpy()), name=name))
    g.register_initializer(v)
    return v


def paged_to_gqa(model: onnx.ModelProto | ir.Model, *, cast_to: ir.DataType | None = None,
                 unfuse_qk_norm: bool = True) -> tuple[onnx.ModelProto | ir.Model, RewriteReport]:
    """Rewrite a paged-layout decoder into the padded GQA layout. Returns (model of the kind given, report);
    an ir.Model is edited in place, and on refusal may be left partly edited (pass a ModelProto to keep yours).
    unfuse_qk_norm (default): fused QK-norm becomes standard ops before each GQA node (onnxruntime CPU
    rejects it fused); False keeps q/k_norm_weight on the node. cast_to: not supported yet (refused): a bf16
    paged model becomes a bf16 GQA model, which onnxruntime's CUDA kernel runs and its CPU kernel rejects.
    Raises RewriteRefused (one line, every reason) when a node cannot be converted exactly."""
    if cast_to is not None:
        raise RewriteRefused(f"paged -> gqa: cast_to={cast_to} is not supported yet (the caches would have to change "
                             "dtype too); a bf16 model stays bf16 (onnxruntime's CUDA GQA runs it, its CPU GQA does not)")
    as_proto = isinstance(model, onnx.ModelProto)
    irm = ir.serde.deserialize_model(model) if as_proto else model
    g = irm.graph
    report = RewriteReport("paged -> gqa")
    nodes = _attention_nodes(g, "PagedAttention")
    ids = _input(g, N.INPUT_IDS)
    logits = next((v for v in g.outputs if v.name == N.LOGITS), None)
    problems = []
    if not nodes:
        problems.append("no com.microsoft::PagedAttention node in the main graph")
    if ids is None:
        problems.append(f"no graph input '{N.INPUT_IDS}' (not an onnxruntime-genai decoder)")
    if logits is None:
        problems.append(f"no graph output '{N.LOGITS}'")
    for name in (N.SLOT_MAPPING, N.SLOT_MAPPING_WINDOWED, N.QUERY_POSITIONS):
        if _input(g, name) is not None:
            problems.append(f"graph input '{name}' (a pagedkit extension) has no GQA-layout equivalent")
    if problems:
        raise RewriteRefused("; ".join(problems))

    # the padded batch: input_ids [B, S]; attention_mask [B, total] -> seqlens_k, total_sequence_length
    ids.shape = ir.Shape(["batch_size", "sequence_length"])
    mask = _new_input(g, N.ATTENTION_MASK, I64, ["batch_size", "total_sequence_length"])
    pre = "/gqa_rewrite"
    one = _const(g, f"{pre}/one", [1])
    minus1 = _const(g, f"{pre}/minus1", [-1])
    ids_flat = ir.Value(name=f"{pre}/input_ids_flat", type=ir.TensorType(I64), shape=ir.Shape(["num_tokens"]))
    ids.replace_all_uses_with(ids_flat)  # before any new user of input_ids is made
    g.append(ir.Node("", "Reshape", [ids, minus1], outputs=[ids_flat], name=f"{pre}/input_ids/Reshape"))
    batch_seq = _node(g, "Shape", [ids], f"{pre}/batch_seq", I64, [2])
    summed = _node(g, "ReduceSum", [mask, one], f"{pre}/mask_sum", I64, ["batch_size"], keepdims=0)
    seqlens = _node(g, "Cast", [_node(g, "Sub", [summed, one], f"{pre}/mask_sub", I64, ["batch_size"])],
                    f"{pre}/seqlens_k", I32, ["batch_size"], to=int(I32))
    total = _node(g, "Cast", [_node(g, "Shape", [mask], f"{pre}/total64", I64, [1], start=1, end=2)],
                  f"{pre}/total_sequence_length", I32, [1], to=int(I32))

    plans = []
    for i, node in enumerate(nodes):
        name = node.name or f"PagedAttention_{i}"
        kc = node.inputs[3] if len(node.inputs) > 3 else None
        vc = node.inputs[4] if len(node.inputs) > 4 else None
        layer = None if kc is None else N.layer_of(kc.name, N.PAST_KEY)
        try:
            if layer is None or vc is None or N.layer_of(vc.name, N.PAST_VALUE) != layer \
                    or kc not in g.inputs or vc not in g.inputs:
                raise Refused(f"key_cache / value_cache are not the graph inputs '{N.PAST_KEY}' / '{N.PAST_VALUE}'")
            hkv = node.attributes["kv_num_heads"].as_int()
            d = kc.shape[3] if kc.shape is not None else None
            for v in (kc, vc):  # BNSH before the node is built, so that the validator sees the GQA shapes
                v.shape = ir.Shape(["batch_size", hkv, "past_sequence_length", d])
            io = GqaIO(kc, vc, N.present_name("key", layer), N.present_name("value", layer), seqlens, total,
                       batch_seq, cast_to=cast_to, unfuse_qk_norm=unfuse_qk_norm)
            new_nodes, replaces, applied = paged_node_to_gqa(node, io)
        except Refused as exc:
            report.skipped.append((name, str(exc)))
            continue
        plans.append((node, new_nodes, replaces, kc, vc, hkv, d))
        report.changed.append(name)
        report.rules[name] = applied
    if report.skipped:
        raise RewriteRefused("; ".join(f"{n}: {r}" for n, r in report.skipped))

    for node, new_nodes, replaces, kc, vc, hkv, d in plans:
        g.insert_before(node, new_nodes)
        for old, new in replaces.items():
            if old in g.outputs:
                idx = g.outputs.index(old)
                old.name = f"{old.name}/replaced"
                new.shape = ir.Shape(["batch_size", hkv, "total_sequence_length", d])
                new.type = kc.type
                g.outputs[idx] = new
            old.replace_all_uses_with(new)
        if "q_norm_weight" in [p.name for p, v in zip(_gqa_inputs_pa(), node.inputs) if v is not None]:
            report.model.append(f"{node.name}: QK-norm " + ("moved out of the node into standard ops (onnxruntime "
                                "CPU rejects it fused)" if unfuse_qk_norm else "kept fused on the GQA node "
                                "(onnxruntime CPU refuses it; CUDA runs it)"))
        g.remove(node, safe=True)
    # logits [T, V] -> [B, S, V]
    idx = g.outputs.index(logits)
    vocab = logits.shape[-1] if logits.shape is not None else "vocab_size"
    logits.name = f"{pre}/logits_flat"
    vocab_v = _node(g, "Shape", [logits], f"{pre}/vocab", I64, [1], start=-1)
    shape3 = _node(g, "Concat", [batch_seq, vocab_v], f"{pre}/logits_shape", I64, [3], axis=0)
    out = _node(g, "Reshape", [logits, shape3], N.LOGITS, logits.dtype, ["batch_size", "sequence_length", vocab])
    g.outputs[idx] = out
    remove_dead_nodes(g)
    removed = []
    for name in _PAGED_ONLY:
        v = _input(g, name)
        if v is None:
            continue
        if v.uses():
            raise RewriteRefused(f"'{name}' is still used after the rewrite (by "
                                 f"{sorted({u.node.name for u in v.uses()})}): not converted")
        g.inputs.remove(v)
        removed.append(name)
    g.sort()
    io_values = set(g.inputs) | set(g.outputs)
    for n in g:
        for v in n.outputs:
            if v not in io_values and n.op_type not in ("Shape", "Concat"):
                v.shape = None
    report.model.append("input_ids [num_tokens] -> [batch_size, sequence_length]; logits -> [B, S, vocab]")
    report.model.append(f"new input '{N.ATTENTION_MASK}' -> seqlens_k / total_sequence_length (ReduceSum, Shape)")
    report.model.append("caches -> BNSH [batch_size, kv_heads, past_sequence_length, head_size]")
    report.model.append("removed inputs: " + ", ".join(removed))
    return (ir.serde.serialize_model(irm) if as_proto else irm), report


def _gqa_inputs_pa():
    from pagedkit.validators.contract import PAGED_ATTENTION

    return PAGED_ATTENTION.inputs


def gqa_genai_config(source_config: dict) -> dict:
    """genai_config.json of a paged -> GQA rewrite: the source's, with the decoder I/O of the GQA layout and
    without the paged-only entries (state_groups, sliding_window, engine, pagedkit)."""
    out = {k: v for k, v in source_config.items() if k not in ("engine", "pagedkit")}
    model = dict(out.get("model", {}))
    dec = {k: v for k, v in model.get("decoder", {}).items() if k not in ("state_groups", "sliding_window")}
    dec["inputs"] = {N.INPUT_IDS: N.INPUT_IDS, N.ATTENTION_MASK: N.ATTENTION_MASK,
                     N.past_names_key("key"): N.PAST_KEY, N.past_names_key("value"): N.PAST_VALUE}
    dec["outputs"] = {N.LOGITS: N.LOGITS, N.present_names_key("key"): N.PRESENT_KEY,
                      N.present_names_key("value"): N.PRESENT_VALUE}
    dec["session_options"] = {"log_id": "onnxruntime-genai", "provider_options": []}
    model["decoder"] = dec
    out["model"] = model
    return out


__all__ = ["gqa_genai_config", "paged_to_gqa"]
