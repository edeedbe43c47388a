"""Whole model, GroupQueryAttention -> PagedAttention, for decoder models written by onnxruntime-genai's
builder (issue 10, item 3). The result has the builder's own paged layout (contract-decisions §5):

    input_ids [B, S] int64            -> input_ids [num_tokens] (packed; Unsqueeze(0) in front of its users)
    attention_mask -> seqlens_k / total_sequence_length subgraph      removed
    past_key_values.{i}.key/value [B, Hkv, P, D] -> [num_blocks, block_size, Hkv, D] (same names; fp16 when
        the source is float32, contract-decisions §6), present.{i}.* the same buffers (updated in place)
    new inputs: block_table (+ block_table_windowed for windowed layers), cumulative_sequence_lengths,
        past_sequence_lengths, attention_metadata [3]
    logits [B, S, V] -> [num_tokens, V] (every token)

Every other op of such a model is per token, so the packed tokens of all sequences run as one batch of one
row ([1, T, ...]); only attention sees the sequences, through the PagedAttention node. A float32 model (the
CPU builder's) gets Casts to float16 around each node (PagedAttention's T is float16 / bfloat16).

    model, report = gqa_to_paged(onnx.load("gqa/model.onnx"))
    config = paged_genai_config(read_genai_config("gqa"), spec_of(report))   # or rewrite_folder(...)
"""

from __future__ import annotations

import onnx
import onnx_ir as ir

from pagedkit.interface import names as N
from pagedkit.interface.genai_config import CacheSpec, LayerSpec, ModelSpec
from pagedkit.validators.contract import block_size_error

from .node_rules import F16, F32, PAGED_T, PagedIO, Refused, gqa_node_to_paged
from .report import RewriteReport, RewriteRefused

DOMAIN = "com.microsoft"


def _input(graph: ir.Graph, name: str) -> ir.Value | None:
    return next((v for v in graph.inputs if v.name == name), None)


def _attention_nodes(graph: ir.Graph, op: str) -> list[ir.Node]:
    return [n for n in graph if n.op_type == op and n.domain == DOMAIN]


def _new_input(graph: ir.Graph, name: str, dtype: ir.DataType, shape: list) -> ir.Value:
    v = ir.Value(name=name, type=ir.TensorType(dtype), shape=ir.Shape(shape))
    graph.inputs.append(v)
    return v


def remove_dead_nodes(graph: ir.Graph) -> int:
    """Remove nodes none of whose outputs is used or a graph output (repeatedly); returns how many."""
    outputs, removed = set(graph.outputs), 0
    changed = True
    while changed:
        changed = False
        for node in reversed(list(graph)):
            if all(not v.uses() and v not in outputs for v in node.outputs):
                graph.remove(node, safe=True)
                removed += 1
                changed = True
    return removed


def _layer_index(value: ir.Value | None, template: str) -> int | None:
    return None if value is None or not value.name else N.layer_of(value.name, template)


def gqa_to_paged(model: onnx.ModelProto | ir.Model, *, dtype: ir.DataType = F16
                 ) -> tuple[onnx.ModelProto | ir.Model, RewriteReport, list[LayerSpec]]:
    """Rewrite a builder-layout GQA decoder into the paged layout. Returns (model of the kind given: a new
    ModelProto, or the ir.Model edited in place; the report; one LayerSpec per layer for the config).
    Raises RewriteRefused (one line, every reason) when any attention node cannot be converted exactly: no
    node is converted then (an ir.Model given in place may have new inputs and retyped caches: pass a
    ModelProto, or reload, to keep the original)."""
    as_proto = isinstance(model, onnx.ModelProto)
    irm = ir.serde.deserialize_model(model) if as_proto else model
    g = irm.graph
    report = RewriteReport("gqa -> paged")
    nodes = _attention_nodes(g, "GroupQueryAttention")
    problems = []
    if not nodes:
        problems.append("no com.microsoft::GroupQueryAttention node in the main graph")
    ids = _input(g, N.INPUT_IDS)
    if ids is None:
        problems.append(f"no graph input '{N.INPUT_IDS}' (not an onnxruntime-genai decoder)")
    if _input(g, N.POSITION_IDS) is not None:
        problems.append(f"graph input '{N.POSITION_IDS}': the paged layout takes positions from the sequence "
                        f"lengths (or the pagedkit extension '{N.QUERY_POSITIONS}'); not converted")
    logits = next((v for v in g.outputs if v.name == N.LOGITS), None)
    if logits is None:
        problems.append(f"no graph output '{N.LOGITS}'")
    for sub in (n for n in g.all_nodes() if n.graph is not g and n.op_type == "GroupQueryAttention"):
        problems.append(f"{sub.name or sub.op_type}: inside a subgraph, not rewritten")
    if problems:
        raise RewriteRefused("; ".join(problems))

    # new step inputs (int32), as the builder's paged export names and shapes them
    table = _new_input(g, N.BLOCK_TABLE, ir.DataType.INT32, ["batch_size", "max_num_blocks"])
    windowed = [n for n in nodes if int(n.attributes.get_int("local_window_size", -1)) > 0]
    mixed = windowed and len(windowed) != len(nodes)
    table_w = _new_input(g, N.BLOCK_TABLE_WINDOWED, ir.DataType.INT32, ["batch_size", "max_num_blocks"]) \
        if mixed else None
    csl = _new_input(g, N.CUMULATIVE_SEQUENCE_LENGTHS, ir.DataType.INT32, ["batch_size + 1"])
    past = _new_input(g, N.PAST_SEQUENCE_LENGTHS, ir.DataType.INT32, ["batch_size"])
    meta = _new_input(g, N.ATTENTION_METADATA, ir.DataType.INT32, [3])

    layers: list[LayerSpec] = []
    plans = []
    for i, node in enumerate(nodes):
        name = node.name or f"GroupQueryAttention_{i}"
        pk = node.inputs[3] if len(node.inputs) > 3 else None
        pv = node.inputs[4] if len(node.inputs) > 4 else None
        layer = _layer_index(pk, N.PAST_KEY)
        try:
            if layer is None or _layer_index(pv, N.PAST_VALUE) != layer or pk not in g.inputs or pv not in g.inputs:
                raise Refused(f"past_key / past_value are not the graph inputs '{N.PAST_KEY}' / '{N.PAST_VALUE}'")
            src_dt = pk.dtype
            cache_dt = src_dt if src_dt in PAGED_T else dtype
            if src_dt not in (F16, ir.DataType.BFLOAT16, F32):
                raise Refused(f"quantized ({src_dt.name}) GQA caches: the whole-model rewrite keeps float caches only")
            heads, kv_heads = node.attributes.get_int("num_heads"), node.attributes.get_int("kv_num_heads")
            head = pk.shape[3] if pk.shape is not None and isinstance(pk.shape[3], int) else None
            if head is None:
                q = node.inputs[0]
                w = q.shape[2] if q.shape is not None and isinstance(q.shape[2], int) else None
                head = w // (heads + 2 * kv_heads) if w and node.inputs[1] is None else (w // heads if w else None)
            if not head:
                raise Refused("head_size is not known statically")
            win = node.attributes.get_int("local_window_size", -1)
            ring = table_w is not None and win > 0  # the builder names the windowed pool num_blocks_windowed
            for v in (pk, pv):
                v.dtype = cache_dt
                v.shape = ir.Shape(["num_blocks_windowed" if ring else "num_blocks", "block_size", kv_heads, head])
            q_dt = node.inputs[0].dtype
            io = PagedIO(pk, pv, csl, past, table_w if (table_w is not None and win > 0) else table,
                         N.present_name("key", layer), N.present_name("value", layer), attention_metadata=meta,
                         cast_to=None if q_dt in PAGED_T else cache_dt, caches_replaced=True)
            new_nodes, replaces, applied = gqa_node_to_paged(node, io)
        except Refused as exc:
            report.skipped.append((name, str(exc)))
            continue
        plans.append((node, new_nodes, replaces))
        report.changed.append(name)
        report.rules[name] = applied
        fmt = {F16: "float16", ir.DataType.BFLOAT16: "bfloat16"}[cache_dt]
        layers.append(LayerSpec(layer, heads, kv_heads, head, window=win,
                                windowed_table=bool(table_w is not None and win > 0),
                                k_cache=CacheSpec(fmt), v_cache=CacheSpec(fmt)))
    if report.skipped:
        raise RewriteRefused("; ".join(f"{n}: {r}" for n, r in report.skipped))

    for node, new_nodes, replaces in plans:
        g.insert_before(node, new_nodes)
        for old, new in replaces.items():
            if old in g.outputs:
                idx = g.outputs.index(old)
                old.name = f"{old.name}/replaced"
                g.outputs[idx] = new
            old.replace_all_uses_with(new)
        g.remove(node, safe=True)
    # present outputs keep the builder's names (the paged node's cache outputs are named present.{i}.*)
    # input_ids [B, S] -> [num_tokens], Unsqueeze(0) for its users; logits [1, T, V] -> [T, V]
    ids.shape = ir.Shape(["num_tokens"])
    unsq_axes = ir.Value(name="/paged_rewrite/axes0", type=ir.TensorType(ir.DataType.INT64), shape=ir.Shape([1]),
                         const_value=ir.tensor([0], dtype=ir.DataType.INT64))
    g.register_initializer(unsq_axes)
    ids_2d = ir.Value(name="/paged_rewrite/input_ids_2d", type=ir.TensorType(ir.DataType.INT64),
                      shape=ir.Shape([1, "num_tokens"]))
    unsq = ir.Node("", "Unsqueeze", [ids, unsq_axes], outputs=[ids_2d], name="/paged_rewrite/input_ids/Unsqueeze")
    ids.replace_all_uses_with(ids_2d)
    unsq.replace_input_with(0, ids)
    g.insert_before(g.node(0), unsq) if len(g) else g.append(unsq)
    idx = g.outputs.index(logits)
    flat = ir.Value(name=N.LOGITS, type=logits.type, shape=ir.Shape(["num_tokens", logits.shape[-1]
                                                                     if logits.shape is not None else "vocab_size"]))
    logits.name = "/paged_rewrite/logits_3d"
    sq = ir.Node("", "Squeeze", [logits, unsq_axes], outputs=[flat], name="/paged_rewrite/logits/Squeeze")
    g.append(sq)
    g.outputs[idx] = flat
    # attention_mask and the seqlens_k / total_sequence_length subgraph go away
    mask = _input(g, N.ATTENTION_MASK)
    remove_dead_nodes(g)
    if mask is not None:
        if mask.uses():
            raise RewriteRefused(f"'{N.ATTENTION_MASK}' is still used after the rewrite (by "
                                 f"{sorted({u.node.name for u in mask.uses()})}): not a builder decoder")
        g.inputs.remove(mask)
        report.model.append(f"removed input '{N.ATTENTION_MASK}' and its seqlens_k / total_sequence_length subgraph")
    if table_w is not None and not table_w.uses():
        g.inputs.remove(table_w)
    report.model.append("input_ids [B, S] -> [num_tokens]; logits -> [num_tokens, vocab]")
    report.model.append("caches -> paged [num_blocks, block_size, kv_heads, head_size], updated in place")
    report.model.append("new inputs: " + ", ".join(v.name for v in (table, table_w, csl, past, meta) if v is not None))
    if any(n.op_type == "Cast" and "/paged/" in (n.name or "") for n in g):
        report.model.append(f"float32 source: Casts to {dtype.name.lower()} around each PagedAttention node "
                            "(PagedAttention's T is float16 / bfloat16)")
    # stale intermediate shapes (batch_size x sequence_length) are dropped; graph I/O keep theirs
    io_values = set(g.inputs) | set(g.outputs)
    for n in g:
        for v in n.outputs:
            if v not in io_values:
                v.shape = None
    layers.sort(key=lambda l: l.layer)
    return (ir.serde.serialize_model(irm) if as_proto else irm), report, layers


def paged_model_spec(source_config: dict, layers: list[LayerSpec], block_size: int, dtype: str) -> ModelSpec:
    """The ModelSpec of a rewrite, from the source folder's genai_config.json and the converted layers."""
    err = block_size_error(block_size)
    if err:
        raise ValueError(err)
    m = source_config.get("model", {})
    d = m.get("decoder", {})
    return ModelSpec(
        model_type=m.get("type", "decoder"), vocab_size=int(m.get("vocab_size", 0)),
        hidden_size=int(d.get("hidden_size", 0)), num_heads=int(d.get("num_attention_heads", layers[0].num_heads)),
        kv_num_heads=int(d.get("num_key_value_heads", layers[0].kv_num_heads)),
        head_size=int(d.get("head_size", layers[0].head_size)), context_length=int(m.get("context_length", 0)),
        layers=layers, block_size=block_size, dtype=dtype, filename=d.get("filename", "model.onnx"),
        bos_token_id=m.get("bos_token_id"), eos_token_id=m.get("eos_token_id"), pad_token_id=m.get("pad_token_id"),
        source={"rewrite": "gqa -> paged", "from": "onnxruntime-genai GQA layout"})


def paged_genai_config(source_config: dict, spec: ModelSpec) -> dict:
    """genai_config.json of the rewrite: the source's, with the decoder I/O, state groups, sliding window,
    engine and pagedkit section of the paged layout (interface.genai_config, the one writer)."""
    from pagedkit.interface.genai_config import genai_config

    paged = genai_config(spec)
    out = {k: v for k, v in source_config.items()}
    model = dict(out.get("model", {}))
    dec = dict(model.get("decoder", {}))
    pdec = paged["model"]["decoder"]
    for k in ("inputs", "outputs", "state_groups", "session_options"):
        dec[k] = pdec[k]
    if "sliding_window" in pdec:
        dec["sliding_window"] = pdec["sliding_window"]
    else:
        dec.pop("sliding_window", None)
    model["decoder"] = dec
    out["model"] = model
    search = dict(out.get("search", paged["search"]))
    if "chunk_size" in paged["search"]:
        search["chunk_size"] = paged["search"]["chunk_size"]
    out["search"] = search
    out["engine"] = paged["engine"]
    out["pagedkit"] = paged["pagedkit"]
    return out


__all__ = ["gqa_to_paged", "paged_genai_config", "paged_model_spec"]
