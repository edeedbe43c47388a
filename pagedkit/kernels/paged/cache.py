"""The paged KV cache of the PagedAttention reference: encode + write new tokens, gather + decode a
sequence's context through its block_table row.

A cache is [num_blocks NB, block_size BS, kv_num_heads Hkv, Dc] with Dc = head_size D, or (D + 1) // 2
for packed int4. A flat slot is block * BS + offset. PER_TOKEN scale caches are [NB, BS, Hkv].
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Mapping

import torch

from .. import quant

# byte caches that hold codes by their own element type (uint8 is int4 only when the attribute says so)
_QUANT_DTYPES = {dt: fmt for dt, fmt in quant.FORMAT_OF_STORAGE.items() if fmt != "int4"}
_FLOAT_DTYPES = (torch.float16, torch.bfloat16, torch.float32)


@dataclass
class PagedCacheSide:
    """One physical cache (K or V) with its storage format and scales."""

    name: str  # ONNX input name, e.g. "key_cache"
    cache: torch.Tensor  # [NB, BS, Hkv, Dc], updated in place
    fmt: str | None  # None: floating cache (stored by a cast); else one of quant.QUANT_FORMATS
    quant_type: str  # NONE | PER_TENSOR | PER_CHANNEL | PER_TOKEN
    head_size: int  # logical channels D
    scale: torch.Tensor | None = None  # static scale broadcastable to [Hkv, D] (compute dtype)
    scale_cache: torch.Tensor | None = None  # [NB, BS, Hkv] PER_TOKEN scales, updated in place

    @property
    def num_blocks(self) -> int:
        return self.cache.shape[0]

    @property
    def block_size(self) -> int:
        return self.cache.shape[1]

    def encode(self, x: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor | None]:
        """x [N, Hkv, D] (compute dtype) -> (stored [N, Hkv, Dc] in the cache dtype, PER_TOKEN scales
        [N, Hkv] in the scale-cache dtype or None)."""
        if self.fmt is None:
            return x.to(self.cache.dtype), None
        if self.quant_type == "PER_TOKEN":
            s = quant.per_token_scale(x, self.fmt, self.scale_cache.dtype)  # [N, Hkv, 1], as stored
            return quant.quantize(x, s.to(x.dtype), self.fmt), s[..., 0]
        return quant.quantize(x, self.scale.to(x.dtype), self.fmt), None

    def write(self, slots: list[int], x: torch.Tensor) -> None:
        """Write token t of x [N, Hkv, D] to flat slot slots[t]; slot -1 writes nothing (nor its scale).
        Tokens are written in order, so a later token wins a shared slot."""
        stored, tok_scale = self.encode(x)
        for t, slot in enumerate(slots):
            if slot < 0:
                continue
            blk, off = divmod(slot, self.block_size)
            self.cache[blk, off] = stored[t]
            if tok_scale is not None:
                self.scale_cache[blk, off] = tok_scale[t]

    def read(self, block_row: torch.Tensor, dtype: torch.dtype) -> tuple[torch.Tensor, torch.Tensor]:
        """Context of one sequence by logical position: block_row [MB] -> (values [MB * BS, Hkv, D] in
        dtype, mapped [MB * BS] bool). Positions in unmapped blocks (< 0 or >= NB) read block 0 and are
        flagged False; callers must mask them."""
        mapped_blk = (block_row >= 0) & (block_row < self.num_blocks)
        safe = torch.where(mapped_blk, block_row, torch.zeros_like(block_row)).long()
        stored = self.cache[safe].flatten(0, 1)  # [C, Hkv, Dc]
        mapped = mapped_blk.repeat_interleave(self.block_size)
        if self.fmt is None:
            return stored.to(dtype), mapped
        if self.quant_type == "PER_TOKEN":
            scale = self.scale_cache[safe].flatten(0, 1).to(dtype)[..., None]  # [C, Hkv, 1]
        else:
            scale = self.scale.to(dtype)
        return quant.dequantize(stored, scale, self.fmt, self.head_size, dtype), mapped


def _cache_format(cache: torch.Tensor, cache_dtype_attr: str, name: str) -> str | None:
    if cache_dtype_attr == "int4":
        if cache.dtype != torch.uint8:
            raise ValueError(f"input '{name}': cache dtype 'int4' needs a uint8 cache, got {cache.dtype}")
        return "int4"
    if cache.dtype in _QUANT_DTYPES:
        return _QUANT_DTYPES[cache.dtype]
    if cache.dtype in _FLOAT_DTYPES:
        return None
    raise ValueError(f"input '{name}': unsupported cache element type {cache.dtype} "
                     f"(uint8 needs cache dtype 'int4')")


def make_side(
    x: Mapping[str, torch.Tensor],
    attrs: Mapping[str, object],
    prefix: str,
    kv_num_heads: int,
    head_size: int,
    dtype: torch.dtype,
) -> PagedCacheSide:
    """The K (prefix "k") or V (prefix "v") cache side of a call; x holds the present inputs by ONNX name."""
    name = "key_cache" if prefix == "k" else "value_cache"
    cache = x[name]
    fmt = _cache_format(cache, str(attrs[f"{prefix}_cache_dtype"]), name)
    quant_type = str(attrs[f"{prefix}_quant_type"])
    side = PagedCacheSide(name, cache, fmt, quant_type, head_size)
    if fmt is None:
        if quant_type != "NONE":
            raise ValueError(f"attribute '{prefix}_quant_type': a {cache.dtype} {name} is not quantized; "
                             f"expected NONE, got {quant_type}")
        return side
    if quant_type == "NONE":
        raise ValueError(f"attribute '{prefix}_quant_type': a quantized {name} ({fmt}) needs PER_TENSOR, "
                         f"PER_CHANNEL or PER_TOKEN, got NONE")
    if quant_type == "PER_TOKEN":
        scale_name = f"{prefix}_scale_cache"
        if scale_name not in x:
            raise ValueError(f"input '{scale_name}': required with {prefix}_quant_type PER_TOKEN")
        side.scale_cache = x[scale_name]
        return side
    scale_name = f"{prefix}_scale"
    if scale_name not in x:
        raise ValueError(f"input '{scale_name}': required with {prefix}_quant_type {quant_type}")
    side.scale = quant.static_scale(x[scale_name].to(dtype), quant_type, kv_num_heads, head_size)
    return side
