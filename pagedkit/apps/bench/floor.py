"""The bandwidth floor of one decode step: every weight byte and every cached KV byte of the batch read
once from device memory at the given read bandwidth (default 4.4 TB/s, an H200's achievable HBM3e read).

    bytes_per_step = weight_bytes + B x sum over layers of min(context, window) x kv_bytes_per_token(layer)
    floor_s        = bytes_per_step / bandwidth;   floor tokens/s = B / floor_s

weight_bytes: the bytes of the ONNX file's initializers (inline data, or the `length` of external data;
a whole external file when no length is given). Constant nodes and activations are not counted.
For a mixture-of-experts model a step reads the experts its tokens were routed to, not all of them: each MoE /
QMoE node's per-expert initializers (weights, scales, biases, zero points: every one with a row per expert) count
touched / num_experts of their bytes, `touched` the distinct experts the step's real rows chose, averaged over the
decode steps the engine ran eagerly in the warm-up (`touched_experts`; paged-bench records it beside the floor).
kv_bytes_per_token(layer) = Hkv x (K width + V width) x bytes per cache element (+ the PER_TOKEN scales):
widths are the caches' last dimension (CACHE_FORMATS: int4 packs two channels a byte), LATENT layers
have no value cache; windowed (sliding-window) layers read at most `window` tokens.

The floor of a prefill (time to first token), B prompts of T tokens each: its products at the tensor cores' peak
plus one read of the weights,

    flops    = 2 x product_weights x B x T + 2 x head_weights x B + attention
    attention = B x sum over layers of 4 x num_heads x head_size x sum_{i=1..T} min(i, window)  (causal)
    floor_s  = flops / peak (default 790 TFLOP/s, an H200's dense fp16 / bf16) + weight_bytes / bandwidth

product_weights: the elements of every constant B of a MatMul / Gemm / MatMulNBits (a token's multiply-adds);
MoE / QMoE experts count k / num_experts of their weights (the routed share). head_weights: the LM head's, counted
for one row a prompt (the engine computes the logits of the rows it samples: runtime/fuse.py `logit_rows`).
"""

from __future__ import annotations

import functools
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx

from ...interface import dtypes
from ...engine.model import block_bytes
from ...runtime.ops.moe import EXPERT_WEIGHT_INPUTS

DEFAULT_BANDWIDTH = 4.4e12  # bytes / s
DEFAULT_PEAK_FLOPS = 790e12  # dense fp16 / bf16 FLOP / s
_PRODUCTS = {"MatMul", "Gemm", "MatMulNBits"}
_EXPERTS = set(EXPERT_WEIGHT_INPUTS)


@functools.lru_cache(maxsize=4)
def _graph_of(path: str, mtime_ns: int) -> onnx.ModelProto:
    return onnx.load(path, load_external_data=False)


def _model(model_path: str | Path) -> onnx.ModelProto:
    """The ONNX file's proto without its external data, loaded once for the floors here (not to be modified)."""
    return _graph_of(str(model_path), Path(model_path).stat().st_mtime_ns)


def weight_bytes(model_path: str | Path) -> int:
    """Bytes of every initializer of the ONNX file (external data by its recorded length, without loading it)."""
    model_path = Path(model_path)
    model = _model(model_path)
    total, whole_files = 0, set()
    graphs = [model.graph]
    while graphs:  # initializers of subgraphs too (If / Loop bodies)
        g = graphs.pop()
        for t in g.initializer:
            total += _tensor_bytes(t, model_path.parent, whole_files)
        for node in g.node:
            for a in node.attribute:
                graphs += ([a.g] if a.HasField("g") else []) + list(a.graphs)
    return total


def _tensor_bytes(t: onnx.TensorProto, folder: Path, whole_files: set) -> int:
    if t.data_location == onnx.TensorProto.EXTERNAL:
        info = {e.key: e.value for e in t.external_data}
        if "length" in info:
            return int(info["length"])
        location = info.get("location", "")
        if location in whole_files:  # several tensors in one file without lengths: count the file once
            return 0
        whole_files.add(location)
        return os.path.getsize(folder / location) - int(info.get("offset", 0))
    if t.HasField("raw_data"):
        return len(t.raw_data)
    n = int(np.prod(t.dims)) if len(t.dims) else 1
    if t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return (n + 1) // 2
    itemsize = dtypes.numpy_dtype(t.data_type).itemsize if t.data_type != onnx.TensorProto.STRING else 0
    return n * itemsize


def expert_bytes(model_path: str | Path) -> dict[str, tuple[int, int]]:
    """node name -> (bytes of its per-expert initializers, number of experts) of every MoE / QMoE node of the
    main graph: the inputs past the router whose first dimension is the expert count (fc1's)."""
    model_path = Path(model_path)
    model = _model(model_path)
    inits = {t.name: t for t in model.graph.initializer}
    out, whole_files = {}, set()
    for node in model.graph.node:
        if node.op_type not in _EXPERTS:
            continue
        fc1 = inits.get(node.input[EXPERT_WEIGHT_INPUTS[node.op_type][0]])
        if fc1 is None or not len(fc1.dims):
            continue
        e = int(fc1.dims[0])
        per_expert = [inits[n] for n in node.input[2:] if n in inits and len(inits[n].dims) and inits[n].dims[0] == e]
        out[node.name] = (sum(_tensor_bytes(t, model_path.parent, whole_files) for t in per_expert), e)
    return out


def touched_experts(log: dict, batch: int, sizes: Sequence[int]) -> dict[str, float]:
    """node name -> the mean number of distinct experts the first `batch` rows (the real ones) chose, over the
    logged calls of a decode step (runtime/ops/moe.py ROUTE_LOG: each call's experts [T, k]) — those whose T is
    one of `sizes` (the step's batch, or the padded batch a decode graph runs)."""
    out = {}
    for name, calls in log.items():
        counts = [int(c[:batch].reshape(-1).unique().numel()) for c in calls if c.shape[0] in sizes]
        if counts:
            out[name] = sum(counts) / len(counts)
    return out


def weights_read(weights: int, experts: dict[str, tuple[int, int]], touched: dict[str, float]) -> int:
    """The weight bytes a decode step reads: all of them, less the experts no real row chose (module doc)."""
    skipped = sum(b * (1 - min(touched[n], e) / e) for n, (b, e) in experts.items() if n in touched)
    return int(round(weights - skipped))


def layer_kv_bytes_per_token(spec) -> int:
    """Cached bytes of one token in one layer (LayerCacheSpec): key + value (+ PER_TOKEN scales), from the
    very cache tensors the engine allocates (engine.model.block_bytes of a one-token block)."""
    return block_bytes((spec,), 1)


@dataclass(frozen=True)
class CacheLayer:
    """One layer's cache cost: bytes a token, and the window it reads (None = the whole context)."""

    layer_id: int
    bytes_per_token: int
    window: int | None = None


def cache_layers(groups) -> list[CacheLayer]:
    """CacheLayer of every layer of the engine's KV groups (PagedModel.groups.values())."""
    out = []
    for g in groups:
        for spec in g.layers:
            out.append(CacheLayer(spec.layer_id, layer_kv_bytes_per_token(spec), g.window if g.windowed else None))
    return sorted(out, key=lambda c: c.layer_id)


def kv_bytes(layers: Sequence[CacheLayer], batch: int, context: int) -> int:
    """KV bytes one decode step reads: batch sequences of `context` cached tokens."""
    return batch * sum(min(context, c.window) * c.bytes_per_token if c.window else context * c.bytes_per_token
                       for c in layers)


def floor_row(weights: int, layers: Sequence[CacheLayer], batch: int, context: int,
              bandwidth: float = DEFAULT_BANDWIDTH) -> dict:
    """The floor of one (batch, context) row as the JSON records it."""
    kv = kv_bytes(layers, batch, context)
    total = weights + kv
    seconds = total / bandwidth
    return {"weight_bytes": weights, "kv_bytes": kv, "bytes_per_step": total, "bandwidth_bytes_per_s": bandwidth,
            "ms_per_step": seconds * 1e3, "tokens_per_s": batch / seconds}


def product_weights(model_path: str | Path) -> tuple[int, int]:
    """(multiply-adds a token makes in the products of the main graph, the LM head's): see the module docstring."""
    from ...kernels.cpu.logits import _head

    model = _model(model_path)
    g = model.graph
    dims = {t.name: [int(d) for d in t.dims] for t in g.initializer}
    head = _head(g, "logits")
    per_token = head_elems = 0
    for node in g.node:
        attrs = {a.name: onnx.helper.get_attribute_value(a) for a in node.attribute}
        if node.op_type == "MatMulNBits":
            n = int(attrs["K"]) * int(attrs["N"])
        elif node.op_type in _PRODUCTS and len(node.input) > 1 and node.input[1] in dims:
            n = int(np.prod(dims[node.input[1]]))
        elif node.op_type in _EXPERTS:
            ws = [dims[node.input[j]] for j in EXPERT_WEIGHT_INPUTS[node.op_type]
                  if j < len(node.input) and node.input[j] in dims]
            if not ws:
                continue
            unpack = 8 // int(attrs.get("expert_weight_bits", 8)) if node.op_type == "QMoE" else 1
            n = sum(int(np.prod(w)) for w in ws) * unpack * int(attrs.get("k", 1)) // max(ws[0][0], 1)
        else:
            continue
        if head is not None and node is head:
            head_elems += n
        else:
            per_token += n
    return per_token, head_elems


def prefill_floor(weights: int, products: tuple[int, int], layers: Sequence[CacheLayer], num_heads: int,
                  head_size: int, batch: int, tokens: int, bandwidth: float = DEFAULT_BANDWIDTH,
                  peak_flops: float = DEFAULT_PEAK_FLOPS) -> dict:
    """The floor of a prefill of `batch` prompts of `tokens` tokens as the JSON records it (module docstring)."""
    per_token, head = products
    attention = 0
    for c in layers:
        w = c.window or tokens
        seen = w * (w + 1) // 2 + max(tokens - w, 0) * w  # sum over i = 1..T of min(i, w)
        attention += 4 * num_heads * head_size * seen
    flops = 2 * per_token * batch * tokens + 2 * head * batch + batch * attention
    seconds = flops / peak_flops + weights / bandwidth
    return {"flops": flops, "attention_flops": batch * attention, "weight_bytes": weights, "peak_flops": peak_flops,
            "bandwidth_bytes_per_s": bandwidth, "ms": seconds * 1e3}
