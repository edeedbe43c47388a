"""The PagedAttention node of an exported layer: the shared graph inputs it reads (`GraphInputs`), its cache
inputs / outputs and quantization attributes (`cache_io`), and the node itself (`paged_attention`, built and
validated by the contract's node builder, with Casts to the node's T in float32 graphs)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from onnx import TensorProto

from ..interface import names as N
from ..interface.genai_config import LayerSpec
from .graph import GraphBuilder, cast


@dataclass
class GraphInputs:
    """Names of the shared graph inputs the attention nodes read."""

    cumulative_sequence_lengths: str = N.CUMULATIVE_SEQUENCE_LENGTHS
    past_sequence_lengths: str = N.PAST_SEQUENCE_LENGTHS
    block_table: str = N.BLOCK_TABLE
    block_table_windowed: str = N.BLOCK_TABLE_WINDOWED
    attention_metadata: str = N.ATTENTION_METADATA
    slot_mapping: str | None = None
    query_positions: str | None = None


def paged_attention(g: GraphBuilder, *, layer: int, io: GraphInputs, query: str, key: str | None,
                    value: str | None, caches: dict[str, str], windowed_table: bool, rope: tuple[str, str] | None,
                    extra_inputs: dict[str, str], attrs: dict[str, Any], out_width: int) -> str:
    """One com.microsoft PagedAttention node built (and validated) by the contract's node builder.

    caches: contract names -> tensor names for key_cache / value_cache / k_scale_cache / v_scale_cache and
    the matching *_out outputs. extra_inputs: head_sink, q_norm_weight, k_norm_weight, k_scale, v_scale.

    The node runs in `g.attn_type` (its T). When the graph's float type differs (a float32 export: T is
    float16 / bfloat16 only, contract-decisions §6), every T-typed input is brought to T first: activations
    (query / packed QKV, key, value) through a Cast `{node}/{input}/Cast`, constants (cos/sin caches,
    head_sink, norm weights, attention_bias) as initializers of T (families create them so; any other is
    converted once, `GraphBuilder.retyped`); output 0 is Cast back to the graph's float type. Returns the
    attention output in the graph's float type.
    """
    from ..validators.builders import make_paged_attention_node

    name = f"/model/layers.{layer}/attn/PagedAttention"
    t = g.attn_type
    query, key, value = (_to_attention_type(g, x, f"{name}/{role}/Cast") for x, role in
                         ((query, "query"), (key, "key"), (value, "value")))
    t_inputs = _t_inputs()
    extra_inputs = {k: _to_attention_type(g, v, f"{name}/{k}/Cast") if k in t_inputs else v
                    for k, v in extra_inputs.items()}
    if rope is not None:
        rope = (_to_attention_type(g, rope[0], f"{name}/cos_cache/Cast"),
                _to_attention_type(g, rope[1], f"{name}/sin_cache/Cast"))
    inputs = {
        "query": query, "key": key, "value": value,
        "cumulative_sequence_length": io.cumulative_sequence_lengths,
        "past_seqlens": io.past_sequence_lengths,
        "block_table": io.block_table_windowed if windowed_table else io.block_table,
        "attention_metadata": io.attention_metadata,
        "slot_mapping": io.slot_mapping,
        "query_positions": io.query_positions,
        **{k: v for k, v in caches.items() if not k.endswith("_out")},
        **extra_inputs,
    }
    if rope is not None:
        inputs["cos_cache"], inputs["sin_cache"] = rope
    out = f"{name}/output_0"
    outputs = {"output": out, **{k: v for k, v in caches.items() if k.endswith("_out")}}
    node = make_paged_attention_node(inputs, outputs, name=name, value_info=g.vi, **attrs)
    g.add(node)
    g.vi[out] = (t, (g.shape_of(query)[0], out_width))
    return cast(g, out, g.float_type, f"{name}/output/Cast")


def _t_inputs() -> frozenset[str]:
    """PagedAttention's inputs of type T (query, key, value, cos/sin, head_sink, norm weights, attention_bias),
    from the contract."""
    from ..validators.contract import PAGED_ATTENTION

    return frozenset(p.name for p in PAGED_ATTENTION.inputs if p.type_param == "T")


def _to_attention_type(g: GraphBuilder, x: str | None, cast_name: str) -> str | None:
    """x as the attention nodes' T: an initializer converted (once), an activation through a Cast."""
    if not x or g.vi[x][0] == g.attn_type:
        return x
    if g.is_initializer(x):
        return g.retyped(x, g.attn_type)
    return cast(g, x, g.attn_type, cast_name)


def cache_io(g: GraphBuilder, l: LayerSpec, static: tuple, extra: dict, attrs: dict) -> dict[str, str]:
    """Cache inputs / outputs of layer l's node (contract names -> graph names; the present caches become graph
    outputs) and its quantization attributes; `static` = the layer's calibrated (k_scale, v_scale) for
    PER_TENSOR / PER_CHANNEL caches, written as initializers into `extra`."""
    i = l.layer
    caches = {"key_cache": N.past_name("key", i), "key_cache_out": N.present_name("key", i)}
    g.output(N.present_name("key", i), *g.vi[N.past_name("key", i)])
    sides = [("k", "key", l.k_cache)]
    if l.v_cache is not None:
        caches.update(value_cache=N.past_name("value", i), value_cache_out=N.present_name("value", i))
        g.output(N.present_name("value", i), *g.vi[N.past_name("value", i)])
        sides.append(("v", "value", l.v_cache))
    for j, (s, side, cache) in enumerate(sides):
        past_scale, present_scale = N.past_name(f"{side}_scale", i), N.present_name(f"{side}_scale", i)
        if cache.dtype == "int4":
            attrs[f"{s}_cache_dtype"] = "int4"
        if cache.quant != "NONE":
            attrs[f"{s}_quant_type"] = cache.quant
        if cache.quant == "PER_TOKEN":
            caches[f"{s}_scale_cache"] = past_scale
            caches[f"{s}_scale_cache_out"] = present_scale
            g.output(present_scale, *g.vi[past_scale])
        elif cache.quant in ("PER_TENSOR", "PER_CHANNEL"):
            scale = static[j]
            if scale is None:
                raise ValueError(f"layer {i}: {side} cache {cache.quant} needs calibrated scales "
                                 "(run the export with calibration)")
            extra[f"{s}_scale"] = g.initializer(f"model.layers.{i}.attn.{s}_scale", scale, TensorProto.FLOAT)
        if cache.rotation:
            attrs["qk_rotation" if s == "k" else "v_rotation"] = 1
    return caches
