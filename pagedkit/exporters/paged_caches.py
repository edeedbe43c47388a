"""KV-cache options on an existing PagedAttention model (what `paged-export --via genai` applies after the
paged rewrite): cache dtype int8 / float8e4m3fn / int4 with PER_TOKEN / PER_TENSOR / PER_CHANNEL
quantization and the Walsh-Hadamard rotation, written exactly as the native route writes them
(families/base.py `cache_io`, `make_inputs`):

- `past_key_values.{i}.key/value` and `present.{i}.*`: the storage type of the format, last dim
  `cache_width(dtype, head_size)` ((head_size + 1) / 2 for int4);
- node attributes `k/v_quant_type`, `k/v_cache_dtype` "int4" (int8 / fp8 are the tensor's own type),
  `qk_rotation` / `v_rotation`;
- PER_TOKEN: float16 scale caches `past_key_values.{i}.key_scale/value_scale [num_blocks, block_size,
  kv_heads]` (and `present.{i}.*_scale`) as k/v_scale_cache in / out;
- PER_TENSOR / PER_CHANNEL: float32 initializers `model.layers.{i}.attn.k_scale / v_scale` ([1] or
  [kv_heads, 1, head_size]) as k/v_scale, calibrated on the unquantized model over the calibration text
  (quantize.calibrate: what its caches hold after QK-norm / RoPE, rotated when asked).
Every edited node is rebuilt through the contract's node builder (validated).
"""

from __future__ import annotations

from dataclasses import replace

import onnx
from onnx import TensorProto, helper, numpy_helper

from ..interface import names as N
from ..interface.genai_config import CacheSpec, LayerSpec, ModelSpec
from ..validators.contract import cache_format, cache_width


def cache_layers(layers: list[LayerSpec], kv) -> list[LayerSpec]:
    """The layers with the KVOptions' caches: a quantized dtype replaces the rewrite's float cache; the float
    dtype stays (the rewrite chose it); rotation applies to either."""
    def side(old: CacheSpec, dtype: str, quant: str) -> CacheSpec:
        if dtype and cache_format(dtype).quantized:
            return CacheSpec(dtype, quant, kv.rotate, "float16" if quant == "PER_TOKEN" else None)
        return replace(old, rotation=kv.rotate)

    return [replace(l, k_cache=side(l.k_cache, kv.k_dtype, kv.k_quant),
                    v_cache=side(l.v_cache, kv.v_dtype, kv.v_quant) if l.v_cache else None) for l in layers]


def _value_infos(graph: onnx.GraphProto) -> dict[str, onnx.ValueInfoProto]:
    return {v.name: v for v in list(graph.input) + list(graph.output)}


def _retype_cache(vi: onnx.ValueInfoProto, dtype: str, head_size: int) -> None:
    from .families.base import cache_elem_type

    tt = vi.type.tensor_type
    tt.elem_type = cache_elem_type(dtype)
    if len(tt.shape.dim) == 4:
        tt.shape.dim[3].Clear()
        tt.shape.dim[3].dim_value = cache_width(dtype, head_size)


def _scale_io(graph: onnx.GraphProto, cache_vi: onnx.ValueInfoProto, past: str, present: str, kv_heads: int) -> None:
    dims = cache_vi.type.tensor_type.shape.dim
    blocks = dims[0].dim_param or dims[0].dim_value
    shape = [blocks, "block_size", kv_heads]
    graph.input.append(helper.make_tensor_value_info(past, TensorProto.FLOAT16, shape))
    graph.output.append(helper.make_tensor_value_info(present, TensorProto.FLOAT16, shape))


def quantize_caches(model: onnx.ModelProto, layers: list[LayerSpec], scales: dict | None = None) -> int:
    """Edit every PagedAttention node (and the graph I/O) of `model` in place to the caches of `layers`
    (module doc); scales: {layer: (k_scale, v_scale)} torch tensors for PER_TENSOR / PER_CHANNEL sides.
    Returns how many nodes changed."""
    from ..validators.builders import make_paged_attention_node
    from ..validators.contract import PAGED_ATTENTION as P

    g, by_layer, changed = model.graph, {l.layer: l for l in layers}, 0
    vis = _value_infos(g)
    stale = set()
    for node in g.node:
        if node.op_type != "PagedAttention" or node.domain != "com.microsoft":
            continue
        ins = {P.inputs[i].name: t for i, t in enumerate(node.input) if t}
        outs = {P.outputs[i].name: t for i, t in enumerate(node.output) if t}
        attrs = {a.name: helper.get_attribute_value(a) for a in node.attribute}
        attrs = {k: v.decode() if isinstance(v, bytes) else v for k, v in attrs.items()}
        i = N.layer_of(ins["key_cache"], N.PAST_KEY)
        l = by_layer.get(i)
        if l is None:
            raise ValueError(f"{node.name}: key cache {ins['key_cache']!r} is not a past_key_values.{{i}}.key input")
        static = (scales or {}).get(i, (None, None))
        for j, (s, side, cache) in enumerate((("k", "key", l.k_cache), ("v", "value", l.v_cache))):
            if cache is None:
                continue
            if cache.rotation:
                attrs["qk_rotation" if s == "k" else "v_rotation"] = 1
            if not cache_format(cache.dtype).quantized:
                continue
            for name in (ins[f"{side}_cache"], outs[f"{side}_cache_out"]):
                _retype_cache(vis[name], cache.dtype, l.head_size)
                stale.add(name)
            if cache.dtype == "int4":
                attrs[f"{s}_cache_dtype"] = "int4"
            attrs[f"{s}_quant_type"] = cache.quant
            if cache.quant == "PER_TOKEN":
                past, present = N.past_name(f"{side}_scale", i), N.present_name(f"{side}_scale", i)
                _scale_io(g, vis[ins[f"{side}_cache"]], past, present, l.kv_num_heads)
                ins[f"{s}_scale_cache"], outs[f"{s}_scale_cache_out"] = past, present
            else:
                if static[j] is None:
                    raise ValueError(f"layer {i}: {side} cache {cache.quant} needs calibrated scales")
                name = f"model.layers.{i}.attn.{s}_scale"
                g.initializer.append(numpy_helper.from_array(static[j].float().numpy(), name))
                ins[f"{s}_scale"] = name
        node.CopyFrom(make_paged_attention_node(ins, outs, name=node.name, **attrs))
        changed += 1
    keep = [v for v in g.value_info if v.name not in stale]
    del g.value_info[:]
    g.value_info.extend(keep)
    return changed


def apply_cache_options(model: onnx.ModelProto, spec: ModelSpec, opts, calibration, tokenizer_dir, percentile: float
                        ) -> tuple[onnx.ModelProto, dict | None, str | None]:
    """The rewrite with spec's caches (spec.layers from cache_layers): calibrated first when a side is
    PER_TENSOR / PER_CHANNEL. Returns (model, calibration report or None, a summary note or None)."""
    from .quantize import calibrate, calibration_sequences, needs_calibration

    if not any(c is not None and (c.rotation or cache_format(c.dtype).quantized)
               for l in spec.layers for c in (l.k_cache, l.v_cache)):
        return model, None, None
    scales, calib, note = {}, None, None
    if needs_calibration(spec.layers):
        seqs = calibration_sequences(calibration, tokenizer_dir, spec.vocab_size)
        scales, calib = calibrate(model, spec, seqs, percentile)
        calib["text"] = str(calibration) if calibration else "pagedkit built-in calibration text"
        note = "KV quantization SNR (dB) per layer: " + ", ".join(
            f"{i}: K {r.get('k_snr_db', '-')} / V {r.get('v_snr_db', '-')}" for i, r in calib["snr_db"].items())
    quantize_caches(model, spec.layers, scales)
    return model, calib, note


__all__ = ["apply_cache_options", "cache_layers", "quantize_caches"]
