"""THE genai_config.json writer (exporters and rewriters both use it) and its reader.

The file follows onnxruntime-genai's builder for the paged layout (contract-decisions §5): decoder
`inputs` / `outputs` names, `state_groups: [{kind: paged_kv, layer_ids}]`, `sliding_window` for models
that mix windowed and full layers (those read `block_table_windowed`), `engine.dynamic_batching`.
Everything pagedkit adds (contract-decisions §8) lives under the top-level `"pagedkit"` key: per-layer
attention type and window, cache dtypes and quantization, heads and head sizes, the block size,
extension input names, rope, source. onnxruntime-genai's parser rejects unknown *objects* but ignores
unknown top-level scalars, so the section is stored as a JSON-encoded string; `read_pagedkit_section`
decodes it (and also accepts an object, for configs that are not meant for onnxruntime-genai).
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

PAGEDKIT_KEY = "pagedkit"
PAGEDKIT_CONFIG_VERSION = 1

# graph I/O names (onnxruntime-genai's paged layout, plus pagedkit's extensions)
PAST_KEY = "past_key_values.%d.key"
PAST_VALUE = "past_key_values.%d.value"
PRESENT_KEY = "present.%d.key"
PRESENT_VALUE = "present.%d.value"
PAST_KEY_SCALE = "past_key_values.%d.key_scale"
PAST_VALUE_SCALE = "past_key_values.%d.value_scale"
PRESENT_KEY_SCALE = "present.%d.key_scale"
PRESENT_VALUE_SCALE = "present.%d.value_scale"

CACHE_DTYPES = ("float16", "bfloat16", "int8", "float8e4m3fn", "int4")
QUANT_TYPES = ("NONE", "PER_TENSOR", "PER_CHANNEL", "PER_TOKEN")


@dataclass
class CacheSpec:
    """One cache side (K or V) of one layer."""

    dtype: str = "float16"  # one of CACHE_DTYPES
    quant: str = "NONE"  # one of QUANT_TYPES
    rotation: bool = False  # Walsh-Hadamard (qk_rotation / v_rotation)
    scale_dtype: str | None = None  # PER_TOKEN scale caches: "float16" (what pagedkit writes)

    @property
    def quantized(self) -> bool:
        return self.dtype in ("int8", "float8e4m3fn", "int4")


@dataclass
class LayerSpec:
    """What the runtime must know about one attention layer."""

    layer: int
    num_heads: int
    kv_num_heads: int
    head_size: int
    window: int = -1  # local_window_size; -1 = full attention
    windowed_table: bool = False  # reads block_table_windowed (a ring sized to the window)
    layout: str = "SEPARATE"  # or "LATENT" (absorbed MLA: key cache only)
    v_head_size: int = 0  # LATENT: width of V (the leading channels of the key cache); 0 = head_size
    k_cache: CacheSpec = field(default_factory=CacheSpec)
    v_cache: CacheSpec | None = field(default_factory=CacheSpec)  # None in LATENT layout
    rope: str | None = "cos_cache"  # name of the cos cache (the sin cache is its "sin" twin); None = no rope

    @property
    def attention(self) -> str:
        return "sliding" if self.window > 0 else "full"

    @property
    def cache_head_size(self) -> int:
        return (self.head_size + 1) // 2 if self.k_cache.dtype == "int4" else self.head_size


@dataclass
class ModelSpec:
    """Everything genai_config.json says about an exported (or rewritten) model."""

    model_type: str  # onnxruntime-genai's "type", e.g. "llama"
    vocab_size: int
    hidden_size: int
    num_heads: int
    kv_num_heads: int
    head_size: int
    context_length: int
    layers: list[LayerSpec]
    block_size: int = 16
    dtype: str = "float16"  # activation dtype of the graph
    filename: str = "model.onnx"
    bos_token_id: int | None = None
    eos_token_id: int | list[int] | None = None
    pad_token_id: int | None = None
    slot_mapping: str | None = None  # name of the optional pagedkit inputs, when the graph has them
    query_positions: str | None = None
    rope: dict[str, Any] = field(default_factory=dict)
    source: dict[str, Any] = field(default_factory=dict)
    calibration: dict[str, Any] | None = None
    search: dict[str, Any] = field(default_factory=dict)  # overrides of the search defaults

    @property
    def windowed_layers(self) -> list[int]:
        return [l.layer for l in self.layers if l.windowed_table]

    @property
    def per_token_scales(self) -> bool:
        return any(l.k_cache.quant == "PER_TOKEN" or (l.v_cache and l.v_cache.quant == "PER_TOKEN")
                   for l in self.layers)

    @property
    def has_values(self) -> bool:
        return any(l.v_cache is not None for l in self.layers)


def genai_type_of(architectures: list[str] | None, model_type: str) -> str:
    """onnxruntime-genai's model "type": the architecture name before "For", lower-cased."""
    if architectures:
        arch = architectures[0]
        return (arch[: arch.find("For")] if "For" in arch else arch).lower()
    return model_type.replace("_", "").lower()


def pagedkit_section(spec: ModelSpec) -> dict[str, Any]:
    layers = []
    for l in spec.layers:
        d = {"layer": l.layer, "attention": l.attention, "window": l.window,
             "block_table": "block_table_windowed" if l.windowed_table else "block_table",
             "layout": l.layout, "num_heads": l.num_heads, "kv_num_heads": l.kv_num_heads,
             "head_size": l.head_size, "v_head_size": l.v_head_size or l.head_size,
             "k_cache": asdict(l.k_cache), "v_cache": asdict(l.v_cache) if l.v_cache else None,
             "cos_cache": l.rope, "sin_cache": l.rope.replace("cos", "sin", 1) if l.rope else None}
        layers.append(d)
    section: dict[str, Any] = {
        "version": PAGEDKIT_CONFIG_VERSION,
        "block_size": spec.block_size,
        "dtype": spec.dtype,
        "inputs": {k: v for k, v in (("slot_mapping", spec.slot_mapping),
                                     ("query_positions", spec.query_positions)) if v},
        "layers": layers,
        "rope": spec.rope,
        "vocab_size": spec.vocab_size,
        "eos_token_id": spec.eos_token_id,
    }
    if spec.per_token_scales:
        section.update(past_key_scale_names=PAST_KEY_SCALE, past_value_scale_names=PAST_VALUE_SCALE,
                       present_key_scale_names=PRESENT_KEY_SCALE, present_value_scale_names=PRESENT_VALUE_SCALE)
    if spec.source:
        section["source"] = spec.source
    if spec.calibration:
        section["calibration"] = spec.calibration
    return section


def genai_config(spec: ModelSpec) -> dict[str, Any]:
    """The genai_config.json content (a dict; the pagedkit section JSON-encoded, see the module doc)."""
    inputs: dict[str, str] = {"input_ids": "input_ids", "block_table": "block_table"}
    if spec.windowed_layers:
        inputs["block_table_windowed"] = "block_table_windowed"
    inputs.update(cumulative_sequence_lengths="cumulative_sequence_lengths",
                  past_sequence_lengths="past_sequence_lengths", attention_metadata="attention_metadata",
                  past_key_names=PAST_KEY)
    outputs = {"logits": "logits", "present_key_names": PRESENT_KEY}
    if spec.has_values:
        inputs["past_value_names"] = PAST_VALUE
        outputs["present_value_names"] = PRESENT_VALUE
    if spec.per_token_scales:
        inputs.update(past_key_scale_names=PAST_KEY_SCALE, past_value_scale_names=PAST_VALUE_SCALE)
        outputs.update(present_key_scale_names=PRESENT_KEY_SCALE, present_value_scale_names=PRESENT_VALUE_SCALE)
    decoder: dict[str, Any] = {
        "session_options": {"log_id": "onnxruntime-genai",
                            "provider_options": [{"cuda": {"enable_cuda_graph": "0"}}]},
        "filename": spec.filename,
        "head_size": spec.head_size,
        "hidden_size": spec.hidden_size,
        "inputs": inputs,
        "outputs": outputs,
        "num_attention_heads": spec.num_heads,
        "num_hidden_layers": len(spec.layers),
        "num_key_value_heads": spec.kv_num_heads,
    }
    search = {
        "diversity_penalty": 0.0, "do_sample": False, "early_stopping": True, "length_penalty": 1.0,
        "max_length": spec.context_length, "min_length": 0, "no_repeat_ngram_size": 0, "num_beams": 1,
        "num_return_sequences": 1, "past_present_share_buffer": True, "repetition_penalty": 1.0,
        "temperature": 1.0, "top_k": 50, "top_p": 1.0,
    } | spec.search
    dynamic_batching: dict[str, Any] = {"block_size": spec.block_size, "max_batch_size": 100}
    if spec.windowed_layers:
        # as onnxruntime-genai: the windowed layers' ring holds chunk_size + window - 1 positions, so
        # prefill must be chunked; prefix caching is off for such models
        windows = {l.window for l in spec.layers if l.windowed_table}
        if len(windows) != 1:
            raise ValueError(f"windowed layers must share one window size, got {sorted(windows)}")
        decoder["sliding_window"] = {"window_size": windows.pop(), "slide_key_value_cache": False,
                                     "slide_inputs": False, "layers": spec.windowed_layers, "cache_slack": 0}
        search["chunk_size"] = spec.block_size
        dynamic_batching["prefix_caching"] = False
    dynamic_batching["gpu_utilization_factor"] = 0.6
    decoder["state_groups"] = [{"kind": "paged_kv", "layer_ids": [l.layer for l in spec.layers]}]
    model = {"bos_token_id": spec.bos_token_id, "context_length": spec.context_length, "decoder": decoder,
             "eos_token_id": spec.eos_token_id, "pad_token_id": spec.pad_token_id, "type": spec.model_type,
             "vocab_size": spec.vocab_size}
    model = {k: v for k, v in model.items() if v is not None}
    return {"model": model, "search": search, "engine": {"dynamic_batching": dynamic_batching},
            PAGEDKIT_KEY: json.dumps(pagedkit_section(spec), sort_keys=True)}


def write_genai_config(out_dir: str | os.PathLike, spec: ModelSpec) -> Path:
    """Write `out_dir/genai_config.json` for `spec`; returns its path."""
    path = Path(out_dir) / "genai_config.json"
    path.write_text(json.dumps(genai_config(spec), indent=4) + "\n", encoding="utf-8")
    return path


def read_pagedkit_section(config: Mapping[str, Any] | str | os.PathLike | None) -> dict[str, Any]:
    """The decoded `"pagedkit"` section of a genai_config (dict, or path of the file / its folder);
    {} when there is none."""
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        p = Path(config)
        config = json.loads((p / "genai_config.json" if p.is_dir() else p).read_text(encoding="utf-8"))
    section = config.get(PAGEDKIT_KEY)
    if section is None:
        return {}
    if isinstance(section, str):
        section = json.loads(section)
    if not isinstance(section, Mapping):
        raise ValueError(f"genai_config '{PAGEDKIT_KEY}' must be an object (or its JSON text), got {type(section).__name__}")
    return dict(section)


def with_decoded_pagedkit(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy of a genai_config dict whose "pagedkit" entry is an object (for in-process readers)."""
    out = dict(config)
    if PAGEDKIT_KEY in out:
        out[PAGEDKIT_KEY] = read_pagedkit_section(config)
    return out
