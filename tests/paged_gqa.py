"""GroupQueryAttention inputs for tests: random ones (`make_gqa_inputs`) and ones equivalent to a
PagedAttention call (`gqa_from_paged`, design §17.1; reusable by the rewriters' tests).

Conventions (ORT 1.32.0 GQA schema): batch entry b had P_b cached tokens before the step and gets Q_b
valid new rows of a right-padded chunk of S rows; T_b = P_b + Q_b = seqlens_k[b] + 1. A full cache holds
position i at row i; a windowed one (sliding_window_cache=1, capacity C, window W) holds positions
[T - L(T), T) at rows [0, L(T)) (`resident_count`). Everything a correct kernel must not read is
poisoned: float cache rows beyond the resident ones and padded q/k/v rows are NaN, quantized rows hold
extreme codes.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import numpy as np
import torch

from pagedkit.kernels.gqa.cache import resident_count

CACHE_DTYPES = {"float": None, "int8": torch.int8, "int4": torch.uint8, "fp8": torch.float8_e4m3fn}
BITS = {"int8": 8, "int4": 4, "fp8": 8}


@dataclass
class GqaSpec:
    """One GQA call. past[b] = P_b; q[b] = Q_b (default S each); capacity = past_key's sequence length
    (default max(P): a growing cache with total = capacity + S; larger: a shared-capacity buffer;
    with sliding_window_cache: the window capacity C)."""

    past: tuple = (5,)
    seq: int = 1
    q: tuple | None = None
    num_heads: int = 4
    kv_num_heads: int = 2
    head_size: int = 16
    capacity: int | None = None
    query_seqlens: bool = False  # feed query_seqlens (right-padded chunks)
    shared_kv: bool = False  # key/value with 0 rows: the past already holds all T = P tokens
    has_past: bool = True
    packed: bool = False
    rotary: str | None = None  # "half" | "interleaved"
    rotary_dim: int | None = None
    position_ids: bool = False
    bias: tuple | None = None  # (B or 1, H or 1)
    head_sink: bool = False
    qk_norm: bool = False
    cache: str = "float"  # float | int8 | int4 | fp8
    k_quant: str = "NONE"
    v_quant: str = "NONE"
    quant_scale: float | None = None  # PER_TENSOR magnitude (default: a step fitting ~N(0,1) values)
    dtype: torch.dtype = torch.float32
    attrs: dict = field(default_factory=dict)  # softcap, local_window_size, causal, qk_output, ...

    @property
    def windowed(self) -> bool:
        return bool(self.attrs.get("sliding_window_cache", 0))


def _nonzero_randn(g: torch.Generator, shape, scale: float = 1.0) -> torch.Tensor:
    x = torch.randn(shape, generator=g, dtype=torch.float64)
    return torch.where(x.abs() < 1e-2, torch.full_like(x, 0.5), x) * scale


def _codes(g, shape, cache: str) -> torch.Tensor:
    if cache == "int4":
        return torch.randint(0, 256, shape, generator=g, dtype=torch.int32).to(torch.uint8)
    if cache == "int8":
        return torch.randint(-127, 128, shape, generator=g, dtype=torch.int32).to(torch.int8)
    return (torch.rand(shape, generator=g, dtype=torch.float64) * 400 - 200).to(torch.float8_e4m3fn)


_POISON = {"int8": lambda s: torch.full(s, -128, dtype=torch.int8), "int4": lambda s: torch.zeros(s, dtype=torch.uint8),
           "fp8": lambda s: torch.full(s, float("nan")).to(torch.float8_e4m3fn)}


def make_gqa_inputs(spec: GqaSpec, seed: int = 0):
    """-> (inputs {ONNX name: torch tensor}, attrs, meta) with meta = {"q_len", "t_len", "rows"}: valid
    query rows, tokens after the step, and the present rows the operator defines (T_b or L(T_b))."""
    g = torch.Generator().manual_seed(seed)
    h, hkv, d, s, dt = spec.num_heads, spec.kv_num_heads, spec.head_size, spec.seq, spec.dtype
    past = np.array(spec.past, np.int64)
    bsz = len(past)
    q_len = np.array(spec.q if spec.q is not None else [s] * bsz, np.int64)
    t_len = past + q_len
    if spec.shared_kv:
        t_len, q_len = past, np.minimum(past, s)
    total = int(t_len.max())
    attrs = {"num_heads": h, "kv_num_heads": hkv, **spec.attrs}

    def rows_of(shape_tail):  # [B, S, ...] with NaN-poisoned padding rows
        x = _nonzero_randn(g, (bsz, s, *shape_tail))
        for b in range(bsz):
            x[b, q_len[b]:] = float("nan")
        return x.to(dt)

    inputs = {}
    if spec.packed:
        inputs["query"] = rows_of(((h + 2 * hkv) * d,))
    else:
        inputs["query"] = rows_of((h * d,))
        inputs["key"] = rows_of((hkv * d,))[:, :0] if spec.shared_kv else rows_of((hkv * d,))
        inputs["value"] = rows_of((hkv * d,))[:, :0] if spec.shared_kv else rows_of((hkv * d,))
    if spec.has_past:
        cap = spec.capacity if spec.capacity is not None else int(past.max())
        resident = [resident_count(int(p), cap, int(spec.attrs["local_window_size"])) if spec.windowed else int(p)
                    for p in past]
        dc = (d + 1) // 2 if spec.cache == "int4" else d
        for name in ("past_key", "past_value"):
            shape = (bsz, hkv, cap, dc)
            if spec.cache == "float":
                c = _nonzero_randn(g, shape)
                for b in range(bsz):
                    c[b, :, resident[b]:] = float("nan")
                c = c.to(dt)
            else:
                c = _codes(g, shape, spec.cache)
                for b in range(bsz):
                    c[b, :, resident[b]:] = _POISON[spec.cache](c[b, :, resident[b]:].shape)
            inputs[name] = c
    inputs["seqlens_k"] = torch.tensor(t_len - 1, dtype=torch.int32)
    inputs["total_sequence_length"] = torch.tensor([total], dtype=torch.int32)
    if spec.rotary:
        rd = spec.rotary_dim or d
        max_pos = total + s + 16
        angle = torch.rand((max_pos, rd // 2), generator=g, dtype=torch.float64) * 6.28
        inputs["cos_cache"], inputs["sin_cache"] = angle.cos().to(dt), angle.sin().to(dt)
        attrs["do_rotary"] = 1
        attrs["rotary_interleaved"] = int(spec.rotary == "interleaved")
        if spec.position_ids:
            inputs["position_ids"] = torch.randint(0, total + 8, (bsz, s), generator=g, dtype=torch.int64)
    if spec.bias is not None:
        inputs["attention_bias"] = _nonzero_randn(g, (spec.bias[0], spec.bias[1], s, total)).to(dt)
    if spec.head_sink:
        inputs["head_sink"] = _nonzero_randn(g, (h,)).to(dt)
    if spec.qk_norm:
        inputs["q_norm_weight"] = (1 + 0.2 * _nonzero_randn(g, (d,))).to(dt)
        inputs["k_norm_weight"] = (1 + 0.2 * _nonzero_randn(g, (d,))).to(dt)
    if spec.k_quant != "NONE" or spec.v_quant != "NONE":
        attrs.update(k_quant_type=spec.k_quant, v_quant_type=spec.v_quant, kv_cache_bit_width=BITS[spec.cache])
        step = spec.quant_scale or {"int8": 3.0 / 127, "int4": 3.0 / 7, "fp8": 3.0 / 448}[spec.cache]
        for side, qt in (("k_scale", spec.k_quant), ("v_scale", spec.v_quant)):
            if qt == "PER_TENSOR":
                inputs[side] = torch.tensor([step], dtype=torch.float32)
            elif qt == "PER_CHANNEL":
                inputs[side] = (step * (0.5 + torch.rand((1, hkv, 1, d), generator=g))).float()
    if spec.query_seqlens:
        inputs["query_seqlens"] = torch.tensor(q_len, dtype=torch.int32)
    cap = inputs["past_key"].shape[2] if spec.has_past else 0
    rows = [resident_count(int(t), cap, int(spec.attrs["local_window_size"])) if spec.windowed else int(t)
            for t in t_len]
    return inputs, attrs, {"q_len": q_len.tolist(), "t_len": t_len.tolist(), "rows": rows}


# ---------------------------------------------------------------------------------------------
# PagedAttention -> GroupQueryAttention (design §17.1)
# ---------------------------------------------------------------------------------------------

_SHARED_ATTRS = ("num_heads", "kv_num_heads", "scale", "softcap", "local_window_size", "do_rotary",
                 "rotary_interleaved", "qk_norm_epsilon", "k_quant_type", "v_quant_type", "qk_output")


@dataclass
class PagedLayout:
    """Where the paged tokens live in the padded GQA batch."""

    sequences: list  # GQA batch entry i is paged sequence sequences[i]
    csl: list  # the paged call's cumulative_sequence_length
    past: list  # the paged call's past_seqlens
    seq: int  # S = the longest step among the chosen sequences

    def rows(self):
        """(paged token t, GQA batch entry i, row j) of every chosen token."""
        for i, b in enumerate(self.sequences):
            for j in range(self.csl[b + 1] - self.csl[b]):
                yield self.csl[b] + j, i, j


def _cache_bits(cache: torch.Tensor) -> int:
    if cache.dtype == torch.uint8:
        return 4
    return 8 if cache.dtype in (torch.int8, torch.float8_e4m3fn) else 0


def gqa_from_paged(inputs: dict, attrs: dict, sequences: list | None = None):
    """The GQA call equivalent to a SEPARATE-layout PagedAttention call without PER_TOKEN, rotation,
    slot_mapping or query_positions, for the chosen sequences (default all): (gqa_inputs, gqa_attrs,
    layout). Each sequence's context is gathered through its block_table row into a BNSH past of
    capacity max(P) + S (a shared-capacity buffer); its new tokens become a right-padded chunk (padding
    rows are NaN, never read) described by query_seqlens; attention_bias is cut to (.., S, total).
    GQA allows query_seqlens only with causal=1: an is_causal=0 call converts one sequence at a time
    (sequences=[b]), where no query_seqlens is needed."""
    csl = inputs["cumulative_sequence_length"].long().tolist()
    past_all = inputs["past_seqlens"].long().tolist()
    sequences = list(range(len(past_all))) if sequences is None else list(sequences)
    past = [past_all[b] for b in sequences]
    q_len = [csl[b + 1] - csl[b] for b in sequences]
    bsz, s = len(sequences), max(max(q_len), 1)
    causal = int(attrs.get("is_causal", 1))
    if not causal and bsz != 1:
        raise ValueError("is_causal=0 converts one sequence at a time (GQA's query_seqlens needs causal=1)")
    layout = PagedLayout(sequences, csl, past_all, s)
    t_len = [p + n for p, n in zip(past, q_len)]
    total = max(t_len)

    def pad(x):  # [N, W] -> [B, S, W]
        out = torch.full((bsz, s, x.shape[1]), float("nan"), dtype=x.dtype)
        for i, b in enumerate(sequences):
            out[i, : q_len[i]] = x[csl[b]:csl[b + 1]]
        return out

    g = {"query": pad(inputs["query"])}
    if inputs.get("key") is not None:
        g["key"], g["value"] = pad(inputs["key"]), pad(inputs["value"])
    table = inputs["block_table"].long()
    for src, dst in (("key_cache", "past_key"), ("value_cache", "past_value")):
        cache = inputs[src]  # [NB, BS, Hkv, Dc]
        bs = cache.shape[1]
        out = torch.zeros(bsz, cache.shape[2], max(past) + s, cache.shape[3], dtype=cache.dtype)
        for i, b in enumerate(sequences):
            for pos in range(past[i]):
                out[i, :, pos] = cache[table[b, pos // bs], pos % bs]
        g[dst] = out
    g["seqlens_k"] = torch.tensor([t - 1 for t in t_len], dtype=torch.int32)
    g["total_sequence_length"] = torch.tensor([total], dtype=torch.int32)
    if causal:
        g["query_seqlens"] = torch.tensor(q_len, dtype=torch.int32)
    for name in ("cos_cache", "sin_cache", "head_sink", "q_norm_weight", "k_norm_weight", "k_scale", "v_scale"):
        if inputs.get(name) is not None:
            g[name] = inputs[name]
    if inputs.get("attention_bias") is not None:
        bias = inputs["attention_bias"]
        if bias.shape[0] > 1:
            bias = bias[sequences]
        g["attention_bias"] = bias[:, :, :s, :total]
    ga = {k: attrs[k] for k in _SHARED_ATTRS if k in attrs}
    ga["causal"] = causal
    bits = _cache_bits(inputs["key_cache"])
    if bits and (attrs.get("k_quant_type", "NONE") != "NONE" or attrs.get("v_quant_type", "NONE") != "NONE"):
        ga["kv_cache_bit_width"] = bits
    return g, ga, layout


def gqa_output_as_paged(output: torch.Tensor, layout: PagedLayout, into: torch.Tensor | None = None) -> torch.Tensor:
    """GQA output [B, S, W] -> paged token order [N, W] (rows of other sequences: `into`'s, else 0)."""
    out = into.clone() if into is not None else output.new_zeros(layout.csl[-1], output.shape[-1])
    for t, i, j in layout.rows():
        out[t] = output[i, j]
    return out


def gqa_qk_as_paged(qk: torch.Tensor, layout: PagedLayout, context_capacity: int) -> torch.Tensor:
    """GQA output_qk [B, H, S, total] -> paged output_qk [H, N, context_capacity] (0 beyond total)."""
    out = qk.new_zeros(qk.shape[1], layout.csl[-1], context_capacity)
    for t, i, j in layout.rows():
        out[:, t, : qk.shape[3]] = qk[i, :, j]
    return out


def gqa_present_as_paged(present: torch.Tensor, cache: torch.Tensor, block_table: torch.Tensor,
                         layout: PagedLayout) -> torch.Tensor:
    """Scatter GQA present rows [B, Hkv, C, Dc] (positions [0, T_b)) into a copy of the paged cache
    [NB, BS, Hkv, Dc] through block_table: the cache a PagedAttention call should leave."""
    out = cache.clone()
    bs = cache.shape[1]
    for i, b in enumerate(layout.sequences):
        t = layout.past[b] + layout.csl[b + 1] - layout.csl[b]
        for pos in range(t):
            out[int(block_table[b, pos // bs]), pos % bs] = present[i, :, pos]
    return out
