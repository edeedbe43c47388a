"""The operator contracts as data: the one definition of PagedAttention and GroupQueryAttention.

Everything that needs to know an input's index, an attribute's default or a type constraint reads it
from here: the validator rules, the node builders, shape inference, schema registration and the
generated docs (docs/ops/*.md). Numbering and types follow ../shared/design/contract-decisions.md.
"""

from __future__ import annotations

from dataclasses import dataclass, field

DOMAIN = "com.microsoft"


@dataclass(frozen=True)
class Param:
    """One formal input or output, by index."""

    index: int
    name: str
    type_param: str  # a key of OpContract.type_constraints, or a literal "tensor(int64)"
    optional: bool
    rank: int | tuple[int, ...] | None  # allowed rank(s); None = any
    shape: str  # the documented shape, in words, e.g. "(num_tokens, hidden_size)"
    description: str
    shipped: bool = True  # part of the schema onnxruntime ships
    aliases: str | None = None  # outputs: the input whose buffer this output IS (updated in place)
    host: bool = False  # inputs: kept in host (CPU) memory, as onnxruntime's OrtMemTypeCPUInput
    cache_kind: str | None = None  # cache inputs: the model-level cache kind (key / value / key_scale / value_scale)


@dataclass(frozen=True)
class Attr:
    name: str
    type: str  # "int" | "float" | "string"
    default: object  # None when required or when absence has its own meaning
    description: str
    required: bool = False
    allowed: tuple | None = None  # closed value set, when there is one
    shipped: bool = True


@dataclass(frozen=True)
class OpContract:
    name: str
    domain: str
    since_version: int
    summary: str
    inputs: tuple[Param, ...]
    outputs: tuple[Param, ...]
    attributes: tuple[Attr, ...]
    type_constraints: dict[str, tuple[str, ...]]  # name -> ("tensor(float16)", ...)
    type_constraint_docs: dict[str, str]
    semantics: tuple[tuple[str, str], ...] = field(default=())  # (heading, text) for the docs

    def input(self, name: str) -> Param:
        for p in self.inputs:
            if p.name == name:
                return p
        raise KeyError(f"{self.name} has no input named {name!r}")

    def output(self, name: str) -> Param:
        for p in self.outputs:
            if p.name == name:
                return p
        raise KeyError(f"{self.name} has no output named {name!r}")

    def attr(self, name: str) -> Attr:
        for a in self.attributes:
            if a.name == name:
                return a
        raise KeyError(f"{self.name} has no attribute named {name!r}")

    def input_index(self, name: str) -> int:
        return self.input(name).index

    def output_index(self, name: str) -> int:
        return self.output(name).index

    @property
    def input_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.inputs)

    @property
    def output_names(self) -> tuple[str, ...]:
        return tuple(p.name for p in self.outputs)

    def defaults(self) -> dict[str, object]:
        return {a.name: a.default for a in self.attributes if a.default is not None}

    @property
    def cache_aliases(self) -> dict[str, str]:
        """cache output name -> the cache input it aliases (same buffer, updated in place)."""
        return {p.name: p.aliases for p in self.outputs if p.aliases}

    @property
    def cache_pairs(self) -> tuple[tuple[str, str, str], ...]:
        """(cache input, its aliased output, model-level cache kind) for every in-place cache."""
        return tuple((p.aliases, p.name, self.input(p.aliases).cache_kind) for p in self.outputs if p.aliases)

    @property
    def host_inputs(self) -> tuple[str, ...]:
        """Inputs kept in host memory (onnxruntime's CPU-memory inputs)."""
        return tuple(p.name for p in self.inputs if p.host)

    def allowed_types(self, param: Param) -> tuple[str, ...]:
        if param.type_param in self.type_constraints:
            return self.type_constraints[param.type_param]
        return (param.type_param,)


# ---------------------------------------------------------------------------------------------
# PagedAttention: inputs 0-20, outputs 0-5 (0-16 / 0-2 shipped by onnxruntime 1.31.1 / 1.32.0)
# ---------------------------------------------------------------------------------------------

_QUANT_TYPES = ("NONE", "PER_TENSOR", "PER_CHANNEL", "PER_TOKEN")
_CACHE_DTYPES = ("", "float16", "bfloat16", "int8", "float8e4m3fn", "int4", "float4e2m1")

PAGED_ATTENTION = OpContract(
    name="PagedAttention",
    domain=DOMAIN,
    since_version=1,
    summary=(
        "Paged attention over a block-based KV cache for continuous batching. Query/key/value are packed "
        "(only real tokens, no padding); `cumulative_sequence_length` delimits the sequences, "
        "`past_seqlens` gives each sequence's cached length and `block_table` maps each sequence's "
        "logical blocks to physical blocks of the cache pool. New K/V are written into the cache "
        "in place (outputs alias the cache inputs), then every query token attends to its "
        "sequence's cached context."
    ),
    inputs=(
        Param(0, "query", "T", False, 2, "(token_count, num_heads * head_size) or packed QKV "
              "(token_count, (num_heads + 2 * kv_num_heads) * head_size)",
              "Query, or packed QKV when key and value are both absent in SEPARATE layout."),
        Param(1, "key", "T", True, 2, "(token_count, kv_num_heads * head_size)",
              "New keys. In LATENT layout the latent row (kv_lora_rank + rope dim) per token."),
        Param(2, "value", "T", True, 2, "(token_count, kv_num_heads * head_size)",
              "New values. Absent in LATENT layout."),
        Param(3, "key_cache", "T_CACHE", False, 4, "(num_blocks, block_size, kv_num_heads, cache_head_size)",
              "Block cache for K, updated in place. cache_head_size is (head_size + 1) / 2 for int4, "
              "else head_size. In LATENT layout the only cache; V is its leading v_head_size channels.",
              cache_kind="key"),
        Param(4, "value_cache", "T_CACHE", True, 4, "(num_blocks, block_size, kv_num_heads, cache_head_size)",
              "Block cache for V, same shape as key_cache, updated in place. Absent in LATENT layout.",
              cache_kind="value"),
        Param(5, "cumulative_sequence_length", "S", False, 1, "(batch_size + 1)",
              "Cumulative new-token counts: sequence b owns packed tokens [csl[b], csl[b+1])."),
        Param(6, "past_seqlens", "S", False, 1, "(batch_size)",
              "Tokens already cached per sequence (before this step)."),
        Param(7, "block_table", "S", False, 2, "(batch_size, max_blocks_per_sequence)",
              "Physical block of each logical block; entries < 0 or >= num_blocks are unmapped (masked)."),
        Param(8, "cos_cache", "T", True, 2, "(max_position, rotary_dim / 2)",
              "Rotary cosine table; required with do_rotary=1."),
        Param(9, "sin_cache", "T", True, 2, "(max_position, rotary_dim / 2)",
              "Rotary sine table; required with do_rotary=1."),
        Param(10, "slot_mapping", "S", True, 1, "(token_count)",
              "Flat write slot per token (block_id * block_size + offset); -1 skips the write. "
              "Absent: derived from past_seqlens, cumulative_sequence_length and block_table."),
        Param(11, "head_sink", "T", True, 1, "(num_heads)",
              "Per-head sink logit, added to the softmax denominator only."),
        Param(12, "q_norm_weight", "T", True, 1, "(head_size)",
              "RMSNorm gain for each query head, applied before RoPE. Together with k_norm_weight."),
        Param(13, "k_norm_weight", "T", True, 1, "(head_size)",
              "RMSNorm gain for each key head, applied before RoPE and before caching."),
        Param(14, "k_scale", "T_KV_SCALE", True, (1, 3), "(1) PER_TENSOR or (kv_num_heads, 1, head_size) PER_CHANNEL",
              "Static key-cache dequantization scale (symmetric, no zero point)."),
        Param(15, "v_scale", "T_KV_SCALE", True, (1, 3), "(1) PER_TENSOR or (kv_num_heads, 1, head_size) PER_CHANNEL",
              "Static value-cache dequantization scale (symmetric, no zero point)."),
        Param(16, "attention_metadata", "S", True, 1, "(2) or (3)",
              "CPU-resident replay-wide bounds [max_query_len_bound, max_kv_len_bound, "
              "optional max_kv_len_lower_bound]; 0 = unknown. Sizes launches only, never a mask.", host=True),
        Param(17, "k_scale_cache", "T_SCALE_CACHE", True, 3, "(num_blocks, block_size, kv_num_heads)",
              "PER_TOKEN key scales, one per cached token and KV head, written with the cache.", shipped=False,
              cache_kind="key_scale"),
        Param(18, "v_scale_cache", "T_SCALE_CACHE", True, 3, "(num_blocks, block_size, kv_num_heads)",
              "PER_TOKEN value scales, one per cached token and KV head, written with the cache.", shipped=False,
              cache_kind="value_scale"),
        Param(19, "query_positions", "S", True, 1, "(token_count)",
              "Explicit logical position of each query token, used for RoPE and the causal/window masks.",
              shipped=False),
        Param(20, "attention_bias", "T", True, 4,
              "(batch_size or 1, num_heads or 1, query_length_capacity, context_length_capacity)",
              "Additive bias indexed by sequence-local query offset and logical KV position; "
              "added after scale, before softcap.", shipped=False),
    ),
    outputs=(
        Param(0, "output", "T", False, 2, "(token_count, num_heads * effective_v_head_size)",
              "Attention output."),
        Param(1, "key_cache_out", "T_CACHE", True, 4, "same as key_cache",
              "Aliases key_cache (updated in place).", aliases="key_cache"),
        Param(2, "value_cache_out", "T_CACHE", True, 4, "same as value_cache",
              "Aliases value_cache (updated in place). Absent in LATENT layout.", aliases="value_cache"),
        Param(3, "k_scale_cache_out", "T_SCALE_CACHE", True, 3, "same as k_scale_cache",
              "Aliases k_scale_cache (PER_TOKEN).", shipped=False, aliases="k_scale_cache"),
        Param(4, "v_scale_cache_out", "T_SCALE_CACHE", True, 3, "same as v_scale_cache",
              "Aliases v_scale_cache (PER_TOKEN).", shipped=False, aliases="v_scale_cache"),
        Param(5, "output_qk", "QK", True, 3, "(num_heads, token_count, context_capacity)",
              "Scores (qk_output=1) or probabilities (qk_output=2); context_capacity = "
              "block_table.shape[1] * block_size. Masked entries are 0.", shipped=False),
    ),
    attributes=(
        Attr("num_heads", "int", None, "Number of query heads.", required=True),
        Attr("kv_num_heads", "int", None, "Number of key/value heads.", required=True),
        Attr("scale", "float", 0.0, "Score scale; 0 selects 1/sqrt(head_size). Required when v_head_size != head_size."),
        Attr("softcap", "float", 0.0, "softcap * tanh(score / softcap) when > 0."),
        Attr("local_window_size", "int", -1, "Sliding window W: admits W positions including the current one; -1 = off."),
        Attr("do_rotary", "int", 0, "Apply RoPE from cos_cache/sin_cache to Q and K.", allowed=(0, 1)),
        Attr("rotary_interleaved", "int", 0, "Interleaved (GPT-J) instead of half (GPT-NeoX) RoPE.", allowed=(0, 1)),
        Attr("is_causal", "int", 1, "1: causal; 0: query tokens of a sequence attend to each other bidirectionally.",
             allowed=(0, 1)),
        Attr("qk_norm_epsilon", "float", 1e-6, "Epsilon of the per-head Q/K RMSNorm."),
        Attr("k_quant_type", "string", "NONE", "Key cache quantization granularity.", allowed=_QUANT_TYPES),
        Attr("v_quant_type", "string", "NONE", "Value cache quantization granularity.", allowed=_QUANT_TYPES),
        Attr("k_cache_dtype", "string", "", "Logical element type of key_cache ('' = the tensor's own).",
             allowed=_CACHE_DTYPES),
        Attr("v_cache_dtype", "string", "", "Logical element type of value_cache ('' = the tensor's own).",
             allowed=_CACHE_DTYPES),
        Attr("kv_cache_layout", "string", "SEPARATE", "SEPARATE (key_cache + value_cache) or LATENT (absorbed MLA).",
             allowed=("SEPARATE", "LATENT")),
        Attr("v_head_size", "int", 0, "Value head width (LATENT only); 0 = head_size."),
        Attr("rotary_offset", "int", 0, "First channel covered by RoPE (multiple of 8)."),
        Attr("qk_output", "int", 0, "0: no output_qk; 1: scaled scores after softcap and bias; 2: probabilities.",
             allowed=(0, 1, 2), shipped=False),
        Attr("qk_rotation", "int", 0, "Rotate Q and K per head by the orthonormal Walsh-Hadamard transform.",
             allowed=(0, 1), shipped=False),
        Attr("v_rotation", "int", 0, "Rotate V before caching and rotate the output back.", allowed=(0, 1),
             shipped=False),
    ),
    type_constraints={
        "T": ("tensor(float16)", "tensor(bfloat16)"),
        "T_CACHE": ("tensor(float16)", "tensor(bfloat16)", "tensor(int8)", "tensor(float8e4m3fn)", "tensor(uint8)"),
        "T_KV_SCALE": ("tensor(float)",),
        "S": ("tensor(int32)",),
        "T_SCALE_CACHE": ("tensor(float16)", "tensor(float)"),
        "QK": ("tensor(float)", "tensor(float16)", "tensor(bfloat16)"),
    },
    type_constraint_docs={
        "T": "Activations (query, key, value, cos/sin, head_sink, norm weights, attention_bias, output).",
        "T_CACHE": "KV cache element type; uint8 only with cache dtype 'int4'.",
        "T_KV_SCALE": "Static PER_TENSOR / PER_CHANNEL scales.",
        "S": "Sequence lengths, block table, slots, positions, metadata.",
        "T_SCALE_CACHE": "PER_TOKEN scale caches (inputs 17/18, outputs 3/4).",
        "QK": "output_qk.",
    },
    semantics=(
        ("Input modes (§4.6)",
         "SEPARATE unpacked: key and value present, value_cache present. SEPARATE packed: key and value "
         "both absent, query is QKV of width (num_heads + 2 * kv_num_heads) * head_size. LATENT: key "
         "present, value and value_cache absent, kv_num_heads == 1. Any other presence pattern is invalid."),
        ("Cache writes and slot_mapping",
         "Token j of sequence b has position p = past_seqlens[b] + j and is written to slot "
         "block_table[b][p // block_size] * block_size + p % block_size, or to slot_mapping[t] when that "
         "input is present (-1: no write; the token still attends). The KV extent of sequence b is "
         "past_seqlens[b] + q_len_b. block_table entries < 0 or >= num_blocks are unmapped and masked."),
        ("Masks",
         "Causal: a query at position p admits key positions k <= p. local_window_size W > 0 additionally "
         "requires k >= p - W + 1. is_causal = 0 lets a sequence's query tokens see each other (the window "
         "then bounds the left side only)."),
        ("RoPE, QK-norm, rotation",
         "Order: QK-norm (RMSNorm per head with q/k_norm_weight) -> RoPE over channels "
         "[rotary_offset, rotary_offset + rotary_dim) with rotary_dim = 2 * cos_cache.shape[1] -> Hadamard "
         "rotation (qk_rotation) -> quantize and cache. The normalized, rotated K is what is stored. "
         "query_positions, when present, supplies the RoPE and mask position of each query token."),
        ("Quantized caches",
         "int8: q = clamp(rint(x / s), -128, 127); float8e4m3fn: clamp to +-448; int4: signed [-8, 7] stored "
         "as nibble q + 8 in a uint8 cache of last dim (head_size + 1) / 2, element 2i in the low nibble of "
         "byte i (k/v_cache_dtype = 'int4'). PER_TENSOR scale (1), PER_CHANNEL (kv_num_heads, 1, head_size), "
         "PER_TOKEN: scale = amax / qmax per written token and KV head (qmax 127 / 448 / 7; amax 0 gives 1), "
         "rounded to the scale cache's dtype before coding, stored in k/v_scale_cache at the token's slot."),
        ("Hadamard rotation",
         "qk_rotation / v_rotation apply H_n / sqrt(n) (Sylvester order, n = head_size, a power of two) per "
         "head. Q and K are rotated after QK-norm and RoPE; V before caching, and the output is multiplied "
         "by H_n^T. Rejected with LATENT and with PER_CHANNEL on the rotated side."),
        ("MLA (LATENT)",
         "One cache of width head_size (kv_lora_rank + rope dim); V is its leading v_head_size channels. "
         "kv_num_heads == 1; explicit scale required when v_head_size != head_size; no head_sink, QK-norm, "
         "value, value_cache, v_scale or v_quant_type. Output width num_heads * v_head_size."),
        ("attention_bias",
         "Element [b or 0, h or 0, j, k] is added after scale and before softcap for sequence-local query "
         "offset j and logical key position k. Capacities must cover max q_len and max KV extent. Note: "
         "onnxruntime's GroupQueryAttention adds its bias after softcap, so with softcap > 0 a GQA <-> "
         "PagedAttention rewrite of a biased node is not exact and is refused."),
        ("output_qk",
         "qk_output 1: scaled scores after softcap and bias; 2: probabilities. Shape (num_heads, token_count, "
         "block_table.shape[1] * block_size); masked and beyond-extent entries are 0. qk_output != 0 iff "
         "output 5 has a name."),
        ("attention_metadata",
         "2 or 3 int32 entries, a graph input (never produced by a node), entries >= 0, 0 = unknown. Upper "
         "bounds size launches and workspaces only and never change a result."),
    ),
)


# ---------------------------------------------------------------------------------------------
# GroupQueryAttention, as onnxruntime 1.32.0 ships it: inputs 0-16, outputs 0-3
# ---------------------------------------------------------------------------------------------

GROUP_QUERY_ATTENTION = OpContract(
    name="GroupQueryAttention",
    domain=DOMAIN,
    since_version=1,
    summary=(
        "Grouped-query attention over a padded batch with a BNSH past/present KV cache (shared or "
        "separate buffers), optional rotary, local window, windowed cache, softcap, smooth softmax, "
        "head sink, attention bias, QK-norm and int8/int4/fp8 cache quantization."
    ),
    inputs=(
        Param(0, "query", "T", False, 3, "(batch_size, sequence_length, num_heads * head_size) or packed QKV",
              "Query, or packed QKV when key and value are absent."),
        Param(1, "key", "T", True, 3, "(batch_size, kv_sequence_length, kv_num_heads * head_size)", "New keys."),
        Param(2, "value", "T", True, 3, "(batch_size, kv_sequence_length, kv_num_heads * head_size)", "New values."),
        Param(3, "past_key", "T_CACHE", True, 4, "(batch_size, kv_num_heads, past_or_max_sequence_length, head_size)",
              "Past keys, BNSH; int4 packs two per uint8 (last dim (head_size + 1) / 2).", cache_kind="key"),
        Param(4, "past_value", "T_CACHE", True, 4, "(batch_size, kv_num_heads, past_or_max_sequence_length, head_size)",
              "Past values, BNSH.", cache_kind="value"),
        Param(5, "seqlens_k", "M", False, 1, "(batch_size)", "Total sequence length minus one, per batch entry."),
        Param(6, "total_sequence_length", "M", False, (0, 1), "scalar or (1)",
              "Maximum total sequence length (past + new) of the batch.", host=True),
        Param(7, "cos_cache", "T", True, 2, "(max_sequence_length, rotary_dim / 2)", "Rotary cosine table."),
        Param(8, "sin_cache", "T", True, 2, "(max_sequence_length, rotary_dim / 2)", "Rotary sine table."),
        Param(9, "position_ids", "tensor(int64)", True, 2, "(batch_size, sequence_length)",
              "Explicit rotary positions."),
        Param(10, "attention_bias", "T", True, 4,
              "(batch_size or 1, num_heads or 1, sequence_length, total_sequence_length)",
              "Additive bias on the scores, added after softcap (as onnxruntime computes it)."),
        Param(11, "head_sink", "T", True, 1, "(num_heads)", "Per-head sink logit in the softmax denominator."),
        Param(12, "k_scale", "T_KV_SCALE", True, None, "(1) PER_TENSOR or kv_num_heads * head_size elements PER_CHANNEL",
              "Key cache scale."),
        Param(13, "v_scale", "T_KV_SCALE", True, None, "(1) PER_TENSOR or kv_num_heads * head_size elements PER_CHANNEL",
              "Value cache scale."),
        Param(14, "q_norm_weight", "T", True, 1, "(head_size)", "Per-head RMSNorm gain for Q (with k_norm_weight)."),
        Param(15, "k_norm_weight", "T", True, 1, "(head_size)", "Per-head RMSNorm gain for K (with q_norm_weight)."),
        Param(16, "query_seqlens", "M", True, 1, "(batch_size)",
              "Valid (non-padded) tokens of each right-padded query chunk."),
    ),
    outputs=(
        Param(0, "output", "T", False, 3, "(batch_size, sequence_length, num_heads * head_size)", "Attention output."),
        Param(1, "present_key", "T_CACHE", True, 4, "(batch_size, kv_num_heads, present_sequence_length, head_size)",
              "Updated keys, BNSH.", aliases="past_key"),
        Param(2, "present_value", "T_CACHE", True, 4, "(batch_size, kv_num_heads, present_sequence_length, head_size)",
              "Updated values, BNSH.", aliases="past_value"),
        Param(3, "output_qk", "T", True, 4, "(batch_size, num_heads, sequence_length, total_sequence_length)",
              "QK scores (qk_output=1) or probabilities (qk_output=2)."),
    ),
    attributes=(
        Attr("num_heads", "int", None, "Number of query heads.", required=True),
        Attr("kv_num_heads", "int", None, "Number of key/value heads.", required=True),
        Attr("scale", "float", 0.0, "Score scale; 0 selects 1/sqrt(head_size)."),
        Attr("softcap", "float", 0.0, "softcap * tanh(score / softcap) when > 0."),
        Attr("local_window_size", "int", -1, "Left window W (admits W positions incl. the current); -1 = off. "
             "Must be -1 when causal is 0."),
        Attr("do_rotary", "int", 0, "Apply RoPE.", allowed=(0, 1)),
        Attr("rotary_interleaved", "int", 0, "Interleaved RoPE.", allowed=(0, 1)),
        Attr("causal", "int", 1, "Causal mask (1) or bidirectional (0).", allowed=(0, 1)),
        Attr("sliding_window_cache", "int", 0, "past/present are window-sized buffers (needs local_window_size > 0).",
             allowed=(0, 1)),
        Attr("smooth_softmax", "int", -1, "1: add exp(0) to the softmax denominator (unless head_sink is given).",
             allowed=(-1, 0, 1)),
        Attr("qk_output", "int", 0, "0: none; 1: scores before softmax; 2: probabilities.", allowed=(0, 1, 2)),
        Attr("qk_norm_epsilon", "float", 1e-6, "Epsilon of the per-head Q/K RMSNorm."),
        Attr("q_norm_epsilon", "float", None, "Overrides qk_norm_epsilon for Q (finite, > 0)."),
        Attr("k_norm_epsilon", "float", None, "Overrides qk_norm_epsilon for K (finite, > 0)."),
        Attr("kv_cache_bit_width", "int", None, "Bit width of a quantized cache: 8 or 4.", allowed=(0, 4, 8)),
        Attr("k_quant_type", "string", "NONE", "Key cache quantization.", allowed=("NONE", "PER_TENSOR", "PER_CHANNEL")),
        Attr("v_quant_type", "string", "NONE", "Value cache quantization.",
             allowed=("NONE", "PER_TENSOR", "PER_CHANNEL")),
    ),
    type_constraints={
        "T": ("tensor(float16)", "tensor(bfloat16)", "tensor(float)"),
        "T_CACHE": ("tensor(float)", "tensor(float16)", "tensor(bfloat16)", "tensor(uint8)", "tensor(int8)",
                    "tensor(float8e4m3fn)"),
        "T_KV_SCALE": ("tensor(float)",),
        "M": ("tensor(int32)",),
    },
    type_constraint_docs={
        "T": "Activations and output.",
        "T_CACHE": "KV cache; uint8 holds packed int4.",
        "T_KV_SCALE": "Cache scales.",
        "M": "seqlens_k, total_sequence_length, query_seqlens.",
    },
    semantics=(
        ("Lengths",
         "For batch entry b, T = seqlens_k[b] + 1 tokens are cached after the step; the new tokens occupy "
         "positions [T - S_b, T) with S_b = sequence_length (or query_seqlens[b]). Rotary uses those positions "
         "unless position_ids is given."),
        ("Caches",
         "past_key/past_value (BNSH) hold the previous tokens; present_* hold past + new. When past and "
         "present share one buffer (max_sequence_length capacity) the new tokens are written in place. "
         "sliding_window_cache=1: window-sized buffers with eviction as onnxruntime documents."),
        ("Masks and softmax",
         "Causal with optional local window W (W positions incl. the current). score = softcap(scale * q.k) + bias "
         "(onnxruntime adds attention_bias after softcap; PagedAttention adds it before softcap). "
         "head_sink adds exp(sink_h) to the denominator; smooth_softmax=1 without head_sink adds exp(0)."),
        ("Quantization",
         "k/v_quant_type with k/v_scale and kv_cache_bit_width (8: int8 or float8e4m3fn; 4: int4 packed "
         "two per uint8, nibble q + 8, even element low)."),
    ),
)

CONTRACTS: dict[str, OpContract] = {c.name: c for c in (PAGED_ATTENTION, GROUP_QUERY_ATTENTION)}


# ---------------------------------------------------------------------------------------------
# Facts beyond the schema that every layer reads (contract-decisions §2, §3)
# ---------------------------------------------------------------------------------------------

MIN_BLOCK_SIZE = 16
BLOCK_SIZE_RULE = f"block_size must be a power of two >= {MIN_BLOCK_SIZE}"


def block_size_error(block_size: object) -> str | None:
    """None when `block_size` is a block size the contract accepts (any power of two >= 16, as
    onnxruntime), else the one message every entry point prints."""
    ok = isinstance(block_size, int) and not isinstance(block_size, bool) and block_size >= MIN_BLOCK_SIZE \
        and block_size & (block_size - 1) == 0
    return None if ok else f"{BLOCK_SIZE_RULE}, got {block_size!r}"


@dataclass(frozen=True)
class CacheFormat:
    """One KV-cache storage format: the k/v_cache_dtype spelling, the ONNX element type of the cache
    tensor, and how many channels one stored element holds."""

    name: str
    storage: str  # ONNX tensor type of the cache tensor
    quantized: bool  # holds codes that need a scale (int8 / fp8 / int4)
    per_element: int = 1  # channels per stored element (2 for packed int4)
    qmax: float | None = None  # largest code magnitude (PER_TOKEN scale = amax / qmax)
    qmin: float | None = None  # smallest code (codes are clamped to [qmin, qmax])

    def width(self, head_size: int) -> int:
        """The cache's last dimension for `head_size` channels: (head_size + 1) // 2 for int4."""
        return -(-head_size // self.per_element)


CACHE_FORMATS: dict[str, CacheFormat] = {f.name: f for f in (
    CacheFormat("float16", "tensor(float16)", False),
    CacheFormat("bfloat16", "tensor(bfloat16)", False),
    CacheFormat("int8", "tensor(int8)", True, qmax=127.0, qmin=-128.0),
    CacheFormat("float8e4m3fn", "tensor(float8e4m3fn)", True, qmax=448.0, qmin=-448.0),
    CacheFormat("int4", "tensor(uint8)", True, per_element=2, qmax=7.0, qmin=-8.0),  # +8-biased nibbles, even channel low
)}


def cache_format(name: str) -> CacheFormat:
    try:
        return CACHE_FORMATS[name]
    except KeyError:
        raise ValueError(f"cache dtype should be one of {sorted(CACHE_FORMATS)}, got {name!r}") from None


def cache_width(fmt: str, head_size: int) -> int:
    """Last dimension of a cache holding `head_size` channels in format `fmt`."""
    return cache_format(fmt).width(head_size)


def get_contract(op_type: str) -> OpContract:
    try:
        return CONTRACTS[op_type]
    except KeyError:
        raise KeyError(f"no contract for op type {op_type!r}; known: {sorted(CONTRACTS)}") from None
