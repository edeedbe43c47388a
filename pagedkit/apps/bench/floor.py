"""The bandwidth floor of one decode step: every weight byte and every cached KV byte of the batch read
once from device memory at the given read bandwidth (default 4.4 TB/s, an H200's achievable HBM3e read).

    bytes_per_step = weight_bytes + B x sum over layers of min(context, window) x kv_bytes_per_token(layer)
    floor_s        = bytes_per_step / bandwidth;   floor tokens/s = B / floor_s

weight_bytes: the bytes of the ONNX file's initializers (inline data, or the `length` of external data;
a whole external file when no length is given). Constant nodes and activations are not counted.
kv_bytes_per_token(layer) = Hkv x (K width + V width) x bytes per cache element (+ the PER_TOKEN scales):
widths are the caches' last dimension (CACHE_FORMATS: int4 packs two channels a byte), LATENT layers
have no value cache; windowed (sliding-window) layers read at most `window` tokens.
"""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Sequence

import numpy as np
import onnx

from ...interface import dtypes
from ...engine.model import block_bytes

DEFAULT_BANDWIDTH = 4.4e12  # bytes / s


def weight_bytes(model_path: str | Path) -> int:
    """Bytes of every initializer of the ONNX file (external data by its recorded length, without loading it)."""
    model_path = Path(model_path)
    model = onnx.load(str(model_path), load_external_data=False)
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
    itemsize = dtypes.numpy_dtype(t.data_type).itemsize if t.data_type != onnx.TensorProto.STRING else 0
    if t.data_type in (onnx.TensorProto.INT4, onnx.TensorProto.UINT4):
        return (n + 1) // 2
    return n * itemsize


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
