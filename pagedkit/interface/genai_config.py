"""THE genai_config.json writer (exporters and rewriters both use it) and its readers.

The file follows onnxruntime-genai's builder for the paged layout (contract-decisions §5): decoder
`inputs` / `outputs` names, `state_groups: [{kind: paged_kv, layer_ids}]`, `sliding_window` for models
that mix windowed and full layers (those read `block_table_windowed`), `engine.dynamic_batching`.
Everything pagedkit adds (contract-decisions §8) lives under the top-level `"pagedkit"` key: per-layer
attention type and window, cache dtypes and quantization, heads and head sizes, the block size,
extension input names, rope, source. onnxruntime-genai's parser rejects unknown *objects* but ignores
unknown top-level scalars, so the section is stored as a JSON-encoded string; `read_pagedkit_section`
decodes it (and also accepts an object, for configs that are not meant for onnxruntime-genai).

Cache dtypes here are k/v_cache_dtype spellings ("float16", "bfloat16", "int8", "float8e4m3fn", "int4");
what they mean (storage type, stored width) is the cache-format table of pagedkit/validators/contract.py.
The JSON type and range of every field pagedkit reads (what the readers check) is the schema of
pagedkit/validators/genai_schema.py.
"""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any, Mapping

from . import names as N

GENAI_CONFIG = "genai_config.json"
PAGEDKIT_KEY = "pagedkit"
PAGEDKIT_CONFIG_VERSION = 1


@dataclass
class CacheSpec:
    """One cache side (K or V) of one layer."""

    dtype: str = "float16"  # k/v_cache_dtype spelling (validators.contract.CACHE_FORMATS)
    quant: str = "NONE"  # NONE | PER_TENSOR | PER_CHANNEL | PER_TOKEN
    rotation: bool = False  # Walsh-Hadamard (qk_rotation / v_rotation)
    scale_dtype: str | None = None  # PER_TOKEN scale caches: "float16" (what pagedkit writes)


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


def _scale_templates() -> tuple[dict[str, str], dict[str, str]]:
    """(decoder inputs, decoder outputs) entries naming the PER_TOKEN scale caches."""
    kinds = ("key_scale", "value_scale")
    return ({N.past_names_key(k): N.PAST_TEMPLATES[k] for k in kinds},
            {N.present_names_key(k): N.PRESENT_TEMPLATES[k] for k in kinds})


def pagedkit_section(spec: ModelSpec) -> dict[str, Any]:
    layers = []
    for l in spec.layers:
        d = {"layer": l.layer, "attention": l.attention, "window": l.window,
             "block_table": N.BLOCK_TABLE_WINDOWED if l.windowed_table else N.BLOCK_TABLE,
             "layout": l.layout, "num_heads": l.num_heads, "kv_num_heads": l.kv_num_heads,
             "head_size": l.head_size, "v_head_size": l.v_head_size or l.head_size,
             "k_cache": asdict(l.k_cache), "v_cache": asdict(l.v_cache) if l.v_cache else None,
             "cos_cache": l.rope, "sin_cache": l.rope.replace("cos", "sin", 1) if l.rope else None}
        layers.append(d)
    section: dict[str, Any] = {
        "version": PAGEDKIT_CONFIG_VERSION,
        "block_size": spec.block_size,
        "dtype": spec.dtype,
        "inputs": {k: v for k, v in ((N.SLOT_MAPPING, spec.slot_mapping),
                                     (N.QUERY_POSITIONS, spec.query_positions)) if v},
        "layers": layers,
        "rope": spec.rope,
        "vocab_size": spec.vocab_size,
        "eos_token_id": spec.eos_token_id,
    }
    if spec.per_token_scales:
        past, present = _scale_templates()
        section.update(past, **present)
    if spec.source:
        section["source"] = spec.source
    if spec.calibration:
        section["calibration"] = spec.calibration
    return section


def genai_config(spec: ModelSpec) -> dict[str, Any]:
    """The genai_config.json content (a dict; the pagedkit section JSON-encoded, see the module doc)."""
    inputs: dict[str, str] = {N.INPUT_IDS: N.INPUT_IDS, N.BLOCK_TABLE: N.BLOCK_TABLE}
    if spec.windowed_layers:
        inputs[N.BLOCK_TABLE_WINDOWED] = N.BLOCK_TABLE_WINDOWED
    inputs.update({n: n for n in N.STEP_INPUTS})
    inputs[N.past_names_key("key")] = N.PAST_KEY
    outputs = {N.LOGITS: N.LOGITS, N.present_names_key("key"): N.PRESENT_KEY}
    if spec.has_values:
        inputs[N.past_names_key("value")] = N.PAST_VALUE
        outputs[N.present_names_key("value")] = N.PRESENT_VALUE
    if spec.per_token_scales:
        past, present = _scale_templates()
        inputs.update(past)
        outputs.update(present)
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
    path = Path(out_dir) / GENAI_CONFIG
    path.write_text(json.dumps(genai_config(spec), indent=4) + "\n", encoding="utf-8")
    return path


def read_genai_config(path: str | os.PathLike) -> dict[str, Any]:
    """The parsed genai_config.json at `path` (the file, or the model folder holding it)."""
    p = Path(path)
    p = p / GENAI_CONFIG if p.is_dir() else p
    return json.loads(p.read_text(encoding="utf-8"))


def read_pagedkit_section(config: Mapping[str, Any] | str | os.PathLike | None) -> dict[str, Any]:
    """The decoded `"pagedkit"` section of a genai_config (dict, or path of the file / its folder);
    {} when there is none."""
    if config is None:
        return {}
    if not isinstance(config, Mapping):
        config = read_genai_config(config)
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


def _get(d: Any, *keys: str) -> Any:
    for k in keys:
        if not isinstance(d, Mapping):
            return None
        d = d.get(k)
    return d


def decoder_io(config: Mapping[str, Any] | None) -> tuple[dict[str, str], dict[str, str]]:
    """(model.decoder.inputs, model.decoder.outputs) of a genai_config dict ({} where absent)."""
    ins, outs = _get(config, "model", "decoder", "inputs"), _get(config, "model", "decoder", "outputs")
    return (dict(ins) if isinstance(ins, Mapping) else {}), (dict(outs) if isinstance(outs, Mapping) else {})


def input_name(config: Mapping[str, Any] | None, name: str) -> str:
    """The graph input a genai_config names for `name` (e.g. names.BLOCK_TABLE); `name` itself by default."""
    return str(decoder_io(config)[0].get(name) or name)


def output_name(config: Mapping[str, Any] | None, name: str) -> str:
    return str(decoder_io(config)[1].get(name) or name)


def cache_templates(config: Mapping[str, Any] | None) -> dict[str, tuple[str, str]]:
    """{cache kind: (past input template, present output template)}, each with one '%d' for the layer.

    Read from model.decoder.inputs / outputs (`past_key_names`, `present_value_scale_names`, ...), then the
    pagedkit section (scale names), else the defaults; a missing scale name is its key / value name +
    '_scale' (the defaults follow that rule too)."""
    ins, outs = decoder_io(config)
    try:
        section = read_pagedkit_section(config) if isinstance(config, Mapping) else {}
    except ValueError:  # a malformed section is the validator's finding, not a reason to fail here
        section = {}
    out: dict[str, tuple[str, str]] = {}
    for kind in ("key", "value"):
        past = ins.get(N.past_names_key(kind)) or N.PAST_TEMPLATES[kind]
        present = outs.get(N.present_names_key(kind)) or N.PRESENT_TEMPLATES[kind]
        out[kind] = (str(past), str(present))
        sk = f"{kind}_scale"
        out[sk] = (str(ins.get(N.past_names_key(sk)) or section.get(N.past_names_key(sk)) or f"{past}_scale"),
                   str(outs.get(N.present_names_key(sk)) or section.get(N.present_names_key(sk))
                       or f"{present}_scale"))
    return out
