"""Configuration of the paged KV cache: layer groups, per-layer cache tensors, capacities.

A *group* is a set of layers that share one block table (onnxruntime-genai: `block_table` for
full-attention layers, `block_table_windowed` for sliding-window layers served from a ring). Each
group has its own block pool of `num_blocks` blocks of `block_size` tokens; every layer of the group
owns one tensor per cache kind, all indexed by the same block ids:

    key cache    [NB, BS, Hkv, D_cache]   D_cache = contract.cache_width(cache_dtype, D): (D + 1) // 2 for int4
    value cache  [NB, BS, Hkv, D_cache]   absent for LATENT layers (V = leading channels of K)
    key scale    [NB, BS, Hkv]            PER_TOKEN key scales (float16 / float32), optional
    value scale  [NB, BS, Hkv]            PER_TOKEN value scales, optional

Cache element types come from the contract's cache-format table (CACHE_FORMATS) and are checked against
T_CACHE / T_SCALE_CACHE (pagedkit/validators/contract.py); nothing here restates them. Cache names are
'%d' templates (pagedkit/interface/names.py), the form genai_config.json stores.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import torch

from ...interface import dtypes
from ...interface import names as N
from ...validators.contract import CACHE_FORMATS, cache_format, cache_width, get_contract
from ...validators.contract import block_size_error

# cache kind -> graph input / output name template ('%d' = layer index)
DEFAULT_NAMES = dict(N.PAST_TEMPLATES)  # past_key_values.%d.key, ...
PRESENT_NAMES = dict(N.PRESENT_TEMPLATES)  # present.%d.key, ...


def _scale_type(name: str) -> str | None:
    """ONNX type string of a PER_TOKEN scale-cache dtype ("float16" / "float32"), None if not a dtype."""
    try:
        return dtypes.type_str(dtypes.elem_type(name))
    except KeyError:
        return None


@dataclass(frozen=True)
class LayerCacheSpec:
    """The cache tensors of one attention layer.

    cache_dtype: logical dtype ("float16", "bfloat16", "int8", "float8e4m3fn", "int4").
    key_scale_dtype / value_scale_dtype: "float16" | "float32" for PER_TOKEN caches, else None.
    latent: LATENT (absorbed MLA) layer: key cache only, kv_num_heads must be 1.
    """

    layer_id: int
    kv_num_heads: int
    head_size: int
    cache_dtype: str = "float16"
    key_scale_dtype: str | None = None
    value_scale_dtype: str | None = None
    latent: bool = False

    @property
    def cache_head_size(self) -> int:
        """D_cache: the last dimension of the cache tensors."""
        return cache_width(self.cache_dtype, self.head_size)

    def kinds(self) -> tuple[str, ...]:
        """Cache kinds this layer owns, in feed order (key, value, key_scale, value_scale)."""
        out = ["key"] if self.latent else ["key", "value"]
        if self.key_scale_dtype is not None:
            out.append("key_scale")
        if self.value_scale_dtype is not None:
            out.append("value_scale")
        return tuple(out)

    def check(self) -> list[str]:
        c = get_contract("PagedAttention").type_constraints
        errs = []
        where = f"layer {self.layer_id}"
        if self.cache_dtype not in CACHE_FORMATS:
            errs.append(f"{where}: cache_dtype should be one of {sorted(CACHE_FORMATS)}, got {self.cache_dtype!r}")
        elif CACHE_FORMATS[self.cache_dtype].storage not in c["T_CACHE"]:
            errs.append(f"{where}: cache_dtype {self.cache_dtype!r} is not in T_CACHE {c['T_CACHE']}")
        scale_names = sorted(dtypes.numpy_name(dtypes.elem_type(t)) for t in c["T_SCALE_CACHE"])
        for side, sd in (("key_scale_dtype", self.key_scale_dtype), ("value_scale_dtype", self.value_scale_dtype)):
            if sd is None:
                continue
            if sd not in scale_names or _scale_type(sd) not in c["T_SCALE_CACHE"]:
                errs.append(f"{where}: {side} should be one of {scale_names} (T_SCALE_CACHE), got {sd!r}")
        if self.kv_num_heads < 1 or self.head_size < 1:
            errs.append(f"{where}: kv_num_heads and head_size should be >= 1, got {self.kv_num_heads}, {self.head_size}")
        if None not in (self.key_scale_dtype, self.value_scale_dtype) and self.key_scale_dtype != self.value_scale_dtype:
            errs.append(f"{where}: key_scale_dtype and value_scale_dtype should be equal (one T_SCALE_CACHE type), "
                        f"got {self.key_scale_dtype!r} and {self.value_scale_dtype!r}")
        if self.latent:
            if self.kv_num_heads != 1:
                errs.append(f"{where}: a LATENT layer should have kv_num_heads == 1, got {self.kv_num_heads}")
            if self.value_scale_dtype is not None:
                errs.append(f"{where}: a LATENT layer has no value cache, so value_scale_dtype should be None")
        return errs

    def shapes(self, num_blocks: int, block_size: int) -> dict[str, tuple[tuple[int, ...], torch.dtype]]:
        """kind -> (shape, torch dtype)."""
        kv = (num_blocks, block_size, self.kv_num_heads, self.cache_head_size)
        sc = (num_blocks, block_size, self.kv_num_heads)
        storage = dtypes.torch_dtype(cache_format(self.cache_dtype).storage)  # int4: uint8
        out = {"key": (kv, storage)}
        if not self.latent:
            out["value"] = (kv, storage)
        if self.key_scale_dtype is not None:
            out["key_scale"] = (sc, dtypes.torch_dtype(self.key_scale_dtype))
        if self.value_scale_dtype is not None:
            out["value_scale"] = (sc, dtypes.torch_dtype(self.value_scale_dtype))
        return out


@dataclass(frozen=True)
class GroupConfig:
    """Layers sharing one block table.

    window: local_window_size W of the group's layers for a rolling ring (design §9.3), None for a
    full-attention group. chunk_tokens: the most tokens one sequence adds in one step that the ring
    must absorb (prefill chunk size); the ring then holds N = ceil((W + chunk_tokens - 1) / block_size)
    + 1 blocks per sequence (chunk_tokens = 1 gives the design's ceil(W / block_size) + 1).
    table_name / slot_mapping_name: model input names of this group's block table and slot mapping.
    """

    name: str
    num_blocks: int
    block_size: int
    layers: tuple[LayerCacheSpec, ...]
    window: int | None = None
    chunk_tokens: int = 1
    table_name: str | None = None  # default: names.BLOCK_TABLE / names.BLOCK_TABLE_WINDOWED
    slot_mapping_name: str | None = None  # default: names.SLOT_MAPPING / names.SLOT_MAPPING_WINDOWED

    @property
    def windowed(self) -> bool:
        return self.window is not None

    @property
    def ring_blocks(self) -> int:
        """N: blocks per sequence in the ring of a windowed group."""
        if self.window is None:
            raise ValueError(f"group {self.name!r} is not windowed; it has no ring")
        return math.ceil((self.window + self.chunk_tokens - 1) / self.block_size) + 1

    @property
    def block_table_name(self) -> str:
        return self.table_name or (N.BLOCK_TABLE_WINDOWED if self.windowed else N.BLOCK_TABLE)

    @property
    def slot_name(self) -> str:
        return self.slot_mapping_name or (N.SLOT_MAPPING_WINDOWED if self.windowed else N.SLOT_MAPPING)

    def check(self) -> list[str]:
        errs = []
        where = f"group {self.name!r}"
        if self.num_blocks < 1:
            errs.append(f"{where}: num_blocks should be >= 1, got {self.num_blocks}")
        bs = self.block_size
        bad_bs = block_size_error(bs)
        if bad_bs:
            errs.append(f"{where}: {bad_bs}")
        if not self.layers:
            errs.append(f"{where}: has no layers")
        if self.window is not None:
            if self.window < 1:
                errs.append(f"{where}: window should be >= 1 (local_window_size), got {self.window}")
            elif self.chunk_tokens < 1:
                errs.append(f"{where}: chunk_tokens should be >= 1, got {self.chunk_tokens}")
            elif self.num_blocks >= 1 and not bad_bs and self.num_blocks < self.ring_blocks:
                errs.append(f"{where}: num_blocks {self.num_blocks} cannot hold one sequence's ring of "
                            f"{self.ring_blocks} blocks (window {self.window}, chunk_tokens {self.chunk_tokens})")
        for layer in self.layers:
            errs += layer.check()
        return errs


@dataclass(frozen=True)
class KVCacheConfig:
    """The whole cache: groups plus the step capacities the persistent plan buffers are sized for.

    max_batch_size: most sequences in one step; max_num_tokens: most tokens in one step;
    max_seq_len: longest sequence (sets each group's block-table width ceil(max_seq_len / block_size)).
    bounds: fixed replay-wide attention_metadata (max_query_len_bound, max_kv_len_bound,
    max_kv_len_lower_bound) for CUDA-graph replay, or None to write each step's exact values.
    prefix_caching: reuse full blocks by hash of their token ids (full-attention groups only).
    pad_block: every group's caches get one extra block (index num_blocks, never in the pool) that the pad
    rows of a padded plan (`KVCacheManager.plan(pad_to=...)`, CUDA-graph batch buckets) write and read, so
    padding never touches a sequence's blocks.
    """

    groups: tuple[GroupConfig, ...]
    max_batch_size: int
    max_num_tokens: int
    max_seq_len: int
    device: str = "cpu"
    prefix_caching: bool = False
    bounds: tuple[int, int, int] | None = None
    pad_block: bool = False
    names: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_NAMES))
    present_names: dict[str, str] = field(default_factory=lambda: dict(PRESENT_NAMES))

    def check(self) -> list[str]:
        errs = []
        for name, v in (("max_batch_size", self.max_batch_size), ("max_num_tokens", self.max_num_tokens),
                        ("max_seq_len", self.max_seq_len)):
            if v < 1:
                errs.append(f"KVCacheConfig.{name} should be >= 1, got {v}")
        if not self.groups:
            errs.append("KVCacheConfig has no groups")
        seen_groups, seen_layers, seen_tables = set(), {}, set()
        for g in self.groups:
            errs += g.check()
            if g.name in seen_groups:
                errs.append(f"group name {g.name!r} is used twice")
            seen_groups.add(g.name)
            if g.block_table_name in seen_tables:
                errs.append(f"group {g.name!r}: block table name {g.block_table_name!r} is used by another group")
            seen_tables.add(g.block_table_name)
            for layer in g.layers:
                if layer.layer_id in seen_layers:
                    errs.append(f"layer {layer.layer_id} is in groups {seen_layers[layer.layer_id]!r} and {g.name!r}")
                seen_layers[layer.layer_id] = g.name
        if self.prefix_caching and any(g.windowed for g in self.groups):
            errs.append("prefix_caching needs every group to be full-attention: a windowed group recycles its ring "
                        f"blocks, so they cannot be shared (windowed: {[g.name for g in self.groups if g.windowed]})")
        if self.prefix_caching and len({g.block_size for g in self.groups}) > 1:
            errs.append("prefix_caching needs one block_size across groups (the hash covers one logical block), got "
                        f"{ {g.name: g.block_size for g in self.groups} }")
        if self.bounds is not None:
            if len(self.bounds) != 3 or any(int(b) < 0 for b in self.bounds):
                errs.append(f"bounds should be 3 non-negative ints (max_query_len_bound, max_kv_len_bound, "
                            f"max_kv_len_lower_bound), got {self.bounds}")
        for kind in DEFAULT_NAMES:
            for table, label in ((self.names, "names"), (self.present_names, "present_names")):
                bad = N.template_error(table.get(kind))
                if bad:
                    errs.append(f"KVCacheConfig.{label}[{kind!r}] should be {bad}")
        return errs

    def group(self, name: str) -> GroupConfig:
        for g in self.groups:
            if g.name == name:
                return g
        raise KeyError(f"no KV cache group named {name!r}; groups: {[g.name for g in self.groups]}")

    def cache_blocks(self, group: GroupConfig) -> int:
        """Blocks the group's cache tensors hold: the pool's, plus the pad block (`pad_block`)."""
        return group.num_blocks + (1 if self.pad_block else 0)

    def max_blocks_per_seq(self, group: GroupConfig) -> int:
        """Block-table width of a group: the table is indexed by absolute position (design §9.3.1)."""
        return math.ceil(self.max_seq_len / group.block_size)
