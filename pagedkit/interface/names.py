"""Graph input / output names of a whole model: onnxruntime-genai's convention (contract-decisions §5)
plus pagedkit's optional extensions (§8). The one place these strings are spelled.

Paged layout (every int32 unless said otherwise):
    input_ids                    [num_tokens] int64
    block_table                  [batch_size, max_num_blocks]      full-attention layers
    block_table_windowed         [batch_size, max_num_blocks]      sliding-window layers (their ring)
    cumulative_sequence_lengths  [batch_size + 1]
    past_sequence_lengths        [batch_size]
    attention_metadata           [3] (host)   max_query_len_bound, max_kv_len_bound, max_kv_len_lower_bound
    slot_mapping(_windowed)      [num_tokens]  pagedkit extension, optional
    query_positions              [num_tokens]  pagedkit extension, optional
    past_key_values.%d.key/value [num_blocks, block_size, kv_heads, D_cache] -> present.%d.key/value
    past_key_values.%d.key_scale/value_scale [num_blocks, block_size, kv_heads]  (PER_TOKEN caches)
    logits                       [num_tokens, vocab]
GQA layout: input_ids [batch, seq] int64, attention_mask [batch, total_seq] int64, optional
position_ids, past_key_values.%d.key/value [batch, kv_heads, past, head_size] -> present.%d....

Per-layer cache names are `%`-templates with one `%d` for the layer index — the form genai_config.json
stores (`past_key_names: "past_key_values.%d.key"`); `layer_name(template, i)` formats one.
"""

from __future__ import annotations

import re

INPUT_IDS = "input_ids"
ATTENTION_MASK = "attention_mask"  # GQA layout
POSITION_IDS = "position_ids"  # GQA layout
BLOCK_TABLE = "block_table"
BLOCK_TABLE_WINDOWED = "block_table_windowed"
CUMULATIVE_SEQUENCE_LENGTHS = "cumulative_sequence_lengths"
PAST_SEQUENCE_LENGTHS = "past_sequence_lengths"
ATTENTION_METADATA = "attention_metadata"
SLOT_MAPPING = "slot_mapping"
SLOT_MAPPING_WINDOWED = "slot_mapping_windowed"
QUERY_POSITIONS = "query_positions"
LOGITS = "logits"

# the per-step int32 inputs every paged model reads (besides input_ids and the block tables)
STEP_INPUTS = (CUMULATIVE_SEQUENCE_LENGTHS, PAST_SEQUENCE_LENGTHS, ATTENTION_METADATA)
# pagedkit's optional whole-model inputs (contract-decisions §8), [num_tokens] int32
EXTENSION_INPUTS = (SLOT_MAPPING, QUERY_POSITIONS)

# cache kinds of one layer, in feed order; LATENT layers have "key" only, PER_TOKEN adds the scales
CACHE_KINDS = ("key", "value", "key_scale", "value_scale")
LAYER = "%d"  # the layer placeholder of a template
PAST_TEMPLATES = {kind: f"past_key_values.{LAYER}.{kind}" for kind in CACHE_KINDS}
PRESENT_TEMPLATES = {kind: f"present.{LAYER}.{kind}" for kind in CACHE_KINDS}
PAST_KEY, PAST_VALUE = PAST_TEMPLATES["key"], PAST_TEMPLATES["value"]
PAST_KEY_SCALE, PAST_VALUE_SCALE = PAST_TEMPLATES["key_scale"], PAST_TEMPLATES["value_scale"]
PRESENT_KEY, PRESENT_VALUE = PRESENT_TEMPLATES["key"], PRESENT_TEMPLATES["value"]
PRESENT_KEY_SCALE, PRESENT_VALUE_SCALE = PRESENT_TEMPLATES["key_scale"], PRESENT_TEMPLATES["value_scale"]


def past_names_key(kind: str) -> str:
    """The genai_config `decoder.inputs` key of a cache kind's template: 'past_key_names', ..."""
    _check_kind(kind)
    return f"past_{kind}_names"


def present_names_key(kind: str) -> str:
    """The genai_config `decoder.outputs` key of a cache kind's template: 'present_key_names', ..."""
    _check_kind(kind)
    return f"present_{kind}_names"


def layer_name(template: str, layer: int) -> str:
    """The name of layer `layer` from a '%d' template: layer_name('present.%d.key', 3) == 'present.3.key'."""
    check_template(template)
    return template.replace(LAYER, str(int(layer)))


def past_name(kind: str, layer: int) -> str:
    """Default graph input of one cache: past_name('key', 0) == 'past_key_values.0.key'."""
    _check_kind(kind)
    return layer_name(PAST_TEMPLATES[kind], layer)


def present_name(kind: str, layer: int) -> str:
    """Default graph output of one cache (the same buffer as its past input): 'present.0.key'."""
    _check_kind(kind)
    return layer_name(PRESENT_TEMPLATES[kind], layer)


def layer_of(name: str, template: str) -> int | None:
    """The layer index `name` has under `template` ('past_key_values.7.key' -> 7), None if it does not match."""
    check_template(template)
    m = re.fullmatch(re.escape(template).replace(re.escape(LAYER), r"(\d+)"), name)
    return int(m.group(1)) if m else None


def template_error(template: object) -> str | None:
    """Why `template` is not a per-layer name template (exactly one '%d'), or None."""
    if not isinstance(template, str) or template.count(LAYER) != 1:
        return f"a name template with exactly one '{LAYER}' for the layer index, got {template!r}"
    return None


def check_template(template: object) -> None:
    err = template_error(template)
    if err:
        raise ValueError(err)


def _check_kind(kind: str) -> None:
    if kind not in CACHE_KINDS:
        raise ValueError(f"cache kind should be one of {CACHE_KINDS}, got {kind!r}")
