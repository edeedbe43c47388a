"""GroupQueryAttention's BNSH past/present caches: layout (full, shared-capacity or windowed) and
per-side quantization (NONE, or int8 / fp8 / packed int4 with PER_TENSOR / PER_CHANNEL scales).

Positions are absolute token indices of one batch entry. A full cache holds position i at row i
(past rows [0, P), present rows [0, T); a shared buffer keeps its capacity and every row beyond the
written ones). A windowed cache (sliding_window_cache=1, capacity C, window W) holds its L(T) most
recent positions at rows [0, L(T)), ORT 1.32.0's resident count:
    G = C - W + 1;  L(T) = T if T <= C else T - G * ceil((T - C) / G).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from .. import quant


def resident_count(t: int, capacity: int, window: int) -> int:
    """L(T): how many of the T most recent positions a windowed cache of capacity C holds."""
    if t <= capacity:
        return t
    g = capacity - window + 1
    return t - g * -(-(t - capacity) // g)


@dataclass(frozen=True)
class KVLayout:
    windowed: bool
    capacity: int  # C: the sequence dimension of present_key / present_value
    window: int  # W (windowed only)

    @classmethod
    def of(cls, x: dict, a: dict, total: int) -> "KVLayout":
        past_len = x["past_key"].shape[2] if x["past_key"] is not None else 0
        if a["sliding_window_cache"]:
            window = int(a["local_window_size"])
            return cls(True, past_len if x["past_key"] is not None else max(window, total), window)
        return cls(False, max(past_len, total), 0)

    def first_resident(self, t: int) -> int:
        """Absolute position held at row 0 after T tokens."""
        return t - resident_count(t, self.capacity, self.window) if self.windowed else 0


@dataclass(frozen=True)
class GqaCacheSide:
    """One of the two caches: storage dtype and quantization (scale: one value, or [Hkv, D] per channel)."""

    past: torch.Tensor | None  # [B, Hkv, Cp, Dc]
    kind: str  # "float" (unquantized) or a quant.QUANT_FORMATS entry (int4: packed two per uint8)
    storage: torch.dtype
    scale: torch.Tensor | None
    head_size: int

    @classmethod
    def of(cls, past, scale, quant_type: str, bits: int, act_dtype: torch.dtype, head_size: int) -> "GqaCacheSide":
        if quant_type == "NONE":
            return cls(past, "float", past.dtype if past is not None else act_dtype, None, head_size)
        storage = past.dtype if past is not None else (torch.uint8 if bits == 4 else torch.int8)
        kind = quant.FORMAT_OF_STORAGE[storage]
        kv_num_heads = scale.numel() // head_size if quant_type == "PER_CHANNEL" else 1
        return cls(past, kind, storage, quant.static_scale(scale, quant_type, kv_num_heads, head_size), head_size)

    @property
    def stored_size(self) -> int:
        return self.head_size if self.kind == "float" else quant.stored_width(self.kind, self.head_size)

    def encode(self, x: torch.Tensor) -> torch.Tensor:
        """x [N, Hkv, D] -> stored rows [N, Hkv, Dc]."""
        if self.kind == "float":
            return x.to(self.storage)
        return quant.quantize(x, self.scale.to(x.dtype), self.kind)

    def decode(self, rows: torch.Tensor, cd: torch.dtype) -> torch.Tensor:
        """stored rows [N, Hkv, Dc] -> values [N, Hkv, D] in the compute dtype."""
        if self.kind == "float":
            return rows.to(cd)
        return quant.dequantize(rows, self.scale.to(cd), self.kind, self.head_size, cd)

    def update(self, layout: KVLayout, new: torch.Tensor, t_len: torch.Tensor, q_len: torch.Tensor,
               cd: torch.dtype):
        """Append the valid rows new[b, :Q_b] ([B, S or 0, Hkv, D]) of every batch entry.

        Returns present [B, Hkv, C, Dc] (storage dtype; starts as a copy of past, so a shared buffer
        keeps every row it does not write), readable[b] = the dequantized cached values [n_b, Hkv, D]
        of positions [first[b], T_b) as the step reads them, and first [B] (long)."""
        bsz, _, hkv, _ = new.shape
        present = torch.zeros(bsz, hkv, layout.capacity, self.stored_size, dtype=self.storage)
        if self.past is not None:
            keep = min(self.past.shape[2], layout.capacity)
            present[:, :, :keep] = self.past[:, :, :keep]
        readable, first = [], torch.zeros(bsz, dtype=torch.long)
        for b in range(bsz):
            t, n = int(t_len[b]), int(q_len[b])
            p = t - n
            p_first = layout.first_resident(p)
            if self.past is not None:
                past_rows = self.past[b, :, : p - p_first].transpose(0, 1)  # [P - first(P), Hkv, Dc]
            else:
                past_rows = torch.zeros(0, hkv, self.stored_size, dtype=self.storage)
            rows = torch.cat([past_rows, self.encode(new[b, :n])], dim=0)  # positions [first(P), T)
            f = layout.first_resident(t)
            present[b, :, : t - f] = rows[f - p_first:].transpose(0, 1)
            readable.append(self.decode(rows, cd))
            first[b] = p_first
        return present, readable, first
