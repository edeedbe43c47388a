"""The in-place form of the PagedAttention rewrite (decompose(in_place=True)): the one the CPU session runs in
onnxruntime (runtime/delegate.py), built for few nodes per layer, since onnxruntime's per-node cost, not the
arithmetic, is what a small decode step spends its time on.

- q / k / v stay in whichever layout the next node wants ([T, n*D], [T, 1, n*D] for com.microsoft
  RotaryEmbedding, [T, n, D] for QK-norm / rotations / the cache write): `_Heads` reshapes only on a change.
- each cache output is a ScatterND straight on its cache input (Segment.run binds it to the input's buffer);
  the context is gathered from it through the step's tight block table, rows [B, C, Hkv*D]; unreadable
  positions read a readable row of their sequence (`_safe_rows`), so garbage in unwritten rows never meets the
  math (NaN * 0 is NaN), without zeroing the context (a broadcast Where over it cost ~20 us a node).
- fused: the attention is one ONNX Attention node (opset 23) over the queries gathered into [B, qmax, H*D]
  (padding rows repeat a real token of their sequence: finite, computed, never gathered back) and read back
  per token by one GatherND; where its semantics differ (paged_attention.fused_refusal) the op-by-op attend().
The step's bookkeeping (token index, slots, context rows, masks, pad indices) is built once per share key
(paged.share_key) and shared by every node of the step.
"""

from __future__ import annotations

import math

import numpy as np
import onnx_ir as ir

from .builder import F32, I64, Builder
from .paged_attention import (Masking, allowed_mask, apply_rope, attend, bias_rows, fused_refusal, rms_norm,
                              rope_tables, rotate)
from .paged_cache import (FP16, Context, Side, context, decode, scatter_index, tight_table, token_index,
                          update_side_in_place, write_slots)

_SHAPES = {"2d": lambda n, d: (-1, n * d), "rows": lambda n, d: (-1, 1, n * d), "tok": lambda n, d: (-1, n, d)}


class _Heads:
    """One of q / k / v [T tokens, n heads, D channels] in one of three layouts: '2d' [T, n*D], 'rows'
    [T, 1, n*D], 'tok' [T, n, D]; `as_(layout)` adds a Reshape only when the layout changes."""

    def __init__(self, b: Builder, value: ir.Value, n: int, d: int, layout: str):
        self.b, self.v, self.n, self.d, self.layout = b, value, n, d, layout

    def as_(self, layout: str) -> ir.Value:
        if layout != self.layout:
            self.v = self.b.op("Reshape", self.v, self.b.i64(*_SHAPES[layout](self.n, self.d)))
            self.layout = layout
        return self.v

    def set(self, value: ir.Value, layout: str) -> None:
        self.v, self.layout = value, layout


def ort_rope(b: Builder, x: ir.Value, pos2: ir.Value, cos: ir.Value, sin: ir.Value, heads: int, half: int,
             interleaved: bool) -> ir.Value:
    """RoPE on channels [0, 2 * half) of each head of x [T, 1, heads*D] f32 by com.microsoft::RotaryEmbedding
    (each token its own batch row of one position, pos2 [T, 1]: onnxruntime refuses a row longer than the
    cos / sin tables [P, half] f32, so the T tokens of a step cannot be one row of T positions when T > P)."""
    return b.op("RotaryEmbedding", x, pos2, cos, sin, _domain="com.microsoft", interleaved=int(interleaved),
                num_heads=heads, rotary_embedding_dim=2 * half)


def _step(b: Builder, s, memo: dict) -> None:
    """The step's shared bookkeeping, built by the first node of a share key."""
    x = s.x
    if "ix" in memo:
        return
    ix = memo["ix"] = token_index(b, x["query"], x["cumulative_sequence_length"], x["past_seqlens"],
                                  x.get("query_positions"))
    cache = s.sides["k"].cache
    memo["slots"] = write_slots(b, ix, x["block_table"], x.get("slot_mapping"), cache)
    table = x["block_table"]
    if int(s.attrs["qk_output"]) == 0:  # output_qk's width is the whole table: no tight table then
        table = tight_table(b, ix, table, cache)
    memo["ctx"], memo["has_key"] = _safe_rows(b, ix, context(b, ix, table, cache))
    memo["where"] = scatter_index(b, cache, *memo["slots"])


def _safe_rows(b: Builder, ix, ctx: Context) -> tuple[Context, ir.Value]:
    """(ctx with every unreadable position reading its sequence's last readable row: written data, finite
    wherever the model's values are, and masked out, so no zeroing of the context is needed; a sequence with no
    readable position reads row 0, [T, 1] bool: the token's sequence has a readable position: the output of
    the others is set to 0, as the reference's for a query with no admitted key, whatever row 0 holds)."""
    kpos = b.unsq(b.op("Range", b.scalar_i64(0), b.sq(ctx.c, 0), b.scalar_i64(1)), 0)  # [1, C]
    last = b.reduce("ReduceMax", b.where(ctx.readable, kpos, b.scalar_i64(-1)), 1)  # [B, 1]
    fallback = b.op("GatherElements", ctx.rows, b.op("Max", last, b.scalar_i64(0)), axis=1)  # [B, 1]
    ok = b.op("GreaterOrEqual", last, b.scalar_i64(0))  # [B, 1]
    rows = b.where(ctx.readable, ctx.rows, b.where(ok, fallback, b.scalar_i64(0)))
    return Context(rows, ctx.readable, ctx.c), b.gather(ok, ix.seq)  # [T, 1]


def _half_prologue(s) -> bool:
    """Whether q / k / v can stay float16 from the node's inputs to the cache writes, exactly: T and both caches
    float16 (no quantization: encode is the identity, the write a float16 store), RoPE (if any) by onnxruntime's
    RotaryEmbedding, whose float16 kernel computes in float32 and rounds once (what the float32 prologue
    followed by the round to T and the cache store gives, bit for bit; tests/test_delegate.py), and nothing else
    in the prologue (QK-norm and the rotations work in float32 before one rounding). Saves the Casts T -> float32
    of q / k / v, Q's round trip to T and the two cache-store Casts: four to five nodes a layer."""
    a = s.attrs
    if s.t_elem != FP16 or "q_norm_weight" in s.x or int(a["qk_rotation"]) or int(a["v_rotation"]):
        return False
    if int(a["do_rotary"]) and int(a["rotary_offset"]) != 0:
        return False
    return all(side.fmt is None and side.elem == FP16 and side.quant == "NONE" for side in s.sides.values())


def _pad_rows(b: Builder, s, memo: dict) -> tuple[ir.Value, ir.Value]:
    """(src [B, max(qmax, 1)]: the row of [q; 0] each padded query row reads (padding: the zero row T; at
    least one row, as ONNX Attention needs), unpad [T, 2]: (sequence, offset) of each token in the padded
    layout), built once per step."""
    if "pad" not in memo:
        ix = memo["ix"]
        csl = b.cast(s.x["cumulative_sequence_length"], I64)
        lo, hi = b.slice(csl, 0, -1, 0), b.slice(csl, 1, 2**62, 0)  # [B]
        rows = b.op("Max", ix.qmax, b.i64(1))
        jr = b.unsq(b.op("Range", b.scalar_i64(0), b.sq(rows, 0), b.scalar_i64(1)), 0)  # [1, rows]
        real = b.op("Less", jr, b.unsq(b.op("Sub", hi, lo), 1))  # [B, rows]
        src = b.where(real, b.op("Add", b.unsq(lo, 1), jr), b.sq(ix.t, 0))
        unpad = b.op("Concat", b.unsq(ix.seq, 1), b.unsq(ix.j, 1), axis=1)
        memo["pad"] = (src, unpad, rows)
    return memo["pad"]


def _fit_rows(b: Builder, allowed: ir.Value, rows: ir.Value) -> ir.Value:
    """allowed [B, qmax, C] -> [B, rows, C] (rows = max(qmax, 1): an empty step's one row admits nothing)."""
    pad = b.op("Sub", rows, b.dim(allowed, 1))
    return b.op("Pad", allowed, b.cat(b.i64(0, 0, 0, 0), pad, b.i64(0)), b.const(np.array(False)))


def _memo(memo: dict, key, make):
    if key not in memo:
        memo[key] = make()
    return memo[key]


def _read(b: Builder, side: Side, s, memo: dict, out: ir.Value, scale_out: ir.Value | None) -> ir.Value:
    """The context [B, C, Hkv*D] float32 read from the updated cache `out` (through _safe_rows)."""
    ix, ctx = memo["ix"], memo["ctx"]
    hkv = side.kv_heads
    if side.fmt is None:  # float cache: rows of Hkv*D, one Gather
        rows = b.op("Reshape", out, b.i64(-1, hkv * side.width))
        vals = b.gather(rows, ctx.rows)
        return vals if side.elem == F32 else b.f(vals)
    rows = b.op("Reshape", out, b.i64(-1, hkv, side.width))
    scale_rows = None if scale_out is None else b.op("Reshape", scale_out, b.i64(-1, hkv))
    vals = decode(b, side, ix, ctx, rows, scale_rows)  # [B, C, Hkv, D]
    return b.op("Reshape", vals, b.i64(0, 0, hkv * side.head_size))


def rewrite_in_place(s, b: Builder, memo: dict, fused: bool) -> dict:
    """The in-place replacement of one node (module docstring) -> output name -> new value."""
    x, a = s.x, s.attrs
    hd, hkv, h = s.head_size, s.kv_heads, s.heads
    half = _half_prologue(s)
    tf = (lambda v: v) if s.t_elem == F32 or half else b.f  # T -> float32 (the half prologue stays in T)
    _step(b, s, memo)
    ix = memo["ix"]
    if s.packed:
        qkv = b.op("Reshape", tf(x["query"]), b.i64(-1, 1, (h + 2 * hkv) * hd))
        q3, k3, v3 = b.ops("Split", qkv, b.i64(h * hd, hkv * hd, hkv * hd), num_outputs=3, axis=2)
        q, k, v = _Heads(b, q3, h, hd, "rows"), _Heads(b, k3, hkv, hd, "rows"), _Heads(b, v3, hkv, hd, "rows")
    else:
        q, k = _Heads(b, tf(x["query"]), h, hd, "2d"), _Heads(b, tf(x["key"]), hkv, hd, "2d")
        v = None if s.latent else _Heads(b, tf(x["value"]), hkv, hd, "2d")
    # prologue: QK-norm -> RoPE -> rotation; Q rounded to T
    if "q_norm_weight" in x:
        eps = float(a["qk_norm_epsilon"])
        q.set(rms_norm(b, q.as_("tok"), x["q_norm_weight"], eps), "tok")
        k.set(rms_norm(b, k.as_("tok"), x["k_norm_weight"], eps), "tok")
    interleaved = bool(int(a["rotary_interleaved"]))
    if int(a["do_rotary"]) and int(a["rotary_offset"]) == 0:  # onnxruntime's RotaryEmbedding, one node a side
        pos2 = _memo(memo, "pos2", lambda: b.unsq(ix.pos, 1))  # [T, 1]
        if half:  # T's own tables: onnxruntime's float16 RotaryEmbedding is float32 math rounded once to T
            tabs = (x["cos_cache"], x["sin_cache"])
        elif x["cos_cache"].name:
            tk = ("rope_f32", x["cos_cache"].name, x["sin_cache"].name)
            tabs = _memo(memo, tk, lambda: (b.f(x["cos_cache"]), b.f(x["sin_cache"])))
        else:
            tabs = (b.f(x["cos_cache"]), b.f(x["sin_cache"]))
        q.set(ort_rope(b, q.as_("rows"), pos2, *tabs, h, s.half, interleaved), "rows")
        k.set(ort_rope(b, k.as_("rows"), pos2, *tabs, hkv, s.half, interleaved), "rows")
    elif int(a["do_rotary"]):
        rk = ("rope", x["cos_cache"].name, x["sin_cache"].name, s.half, int(interleaved), int(a["rotary_offset"]))
        if rk not in memo or not x["cos_cache"].name:
            memo[rk] = rope_tables(b, x["cos_cache"], x["sin_cache"], ix.pos, s.half, interleaved,
                                   int(a["rotary_offset"]))
        q.set(apply_rope(b, q.as_("tok"), memo[rk], hd, ix.t, h), "tok")
        k.set(apply_rope(b, k.as_("tok"), memo[rk], hd, ix.t, hkv), "tok")
    if int(a["qk_rotation"]):
        q.set(rotate(b, q.as_("tok"), hd), "tok")
        k.set(rotate(b, k.as_("tok"), hd), "tok")
    if v is not None and int(a["v_rotation"]):
        v.set(rotate(b, v.as_("tok"), hd), "tok")
    if half:  # Q already in T (rounded once, after RoPE); K / V already in the float16 caches' type
        q.set(b.f(q.v), q.layout)
    elif s.t_elem != F32:
        q.set(b.f(b.cast(q.v, s.t_elem)), q.layout)
    # cache writes (every token of the step before any attention), then the context reads [B, C, Hkv*D]
    slots, keep = memo["slots"]
    new, ctx_vals = {}, {}
    for p, val in (("k", k), ("v", v)):
        side = s.sides.get(p)
        if side is None:
            continue
        out, scale_out = update_side_in_place(b, side, keep, val.as_("tok"), memo["where"], as_stored=half)
        new["key_cache_out" if p == "k" else "value_cache_out"] = out
        if scale_out is not None:
            new[f"{p}_scale_cache_out"] = scale_out
        ctx_vals[p] = _read(b, side, s, memo, out, scale_out)
    keys = ctx_vals["k"]
    if s.latent:  # V: the leading v_head channels of each head's K
        values = b.slice(keys, 0, s.v_head, 2) if hkv == 1 else b.op(
            "Reshape", b.slice(b.op("Reshape", keys, b.i64(0, 0, hkv, hd)), 0, s.v_head, 3),
            b.i64(0, 0, hkv * s.v_head))
    else:
        values = ctx_vals["v"]
    m = Masking(bool(int(a["is_causal"])), int(a["local_window_size"]), float(a["softcap"]),
                float(a["scale"]) or 1.0 / math.sqrt(hd), int(a["qk_output"]))
    ctx = memo["ctx"]
    ak = ("allowed", m.causal, m.window)
    allowed = _memo(memo, ak, lambda: allowed_mask(b, ix, ctx, m))  # [B, qmax, C]
    bias = x.get("attention_bias")
    qk = None
    if fused and fused_refusal(m, x.get("head_sink")) is None:
        src, unpad, rows = _pad_rows(b, s, memo)
        zero = b.const(np.zeros((1, h * hd), dtype=np.float32))
        qp = b.gather(b.op("Concat", q.as_("2d"), zero, axis=0), src)  # [B, rows, H*D]
        mask = _memo(memo, ("mask4",) + ak, lambda: b.unsq(_fit_rows(b, allowed, rows), 1))  # [B, 1, rows, C]
        if bias is not None:  # additive float mask: the bias where admitted, -inf elsewhere
            mask = b.where(mask, bias_rows(b, bias, ix, ctx.c, rows), b.f32(-math.inf))
        att = b.op("Attention", qp, keys, values, mask, q_num_heads=h, kv_num_heads=hkv, scale=m.scale)
        out = _Heads(b, b.op("GatherND", att, unpad), h, s.v_head, "2d")  # [T, H*Dv]
    else:
        k4 = b.op("Reshape", keys, b.i64(0, 0, hkv, hd))
        v4 = b.op("Reshape", values, b.i64(0, 0, hkv, s.v_head))
        o, qk = attend(b, q.as_("tok"), k4, v4, allowed, ix, ctx, m, h, hkv, hd, s.v_head, bias,
                       x.get("head_sink"))
        out = _Heads(b, o, h, s.v_head, "tok")
    if "v" in s.sides and int(a["v_rotation"]):
        out.set(rotate(b, out.as_("tok"), hd), "tok")
    flat = b.where(memo["has_key"], out.as_("2d"), b.f32(0.0))
    new["output"] = flat if s.t_elem == F32 else b.cast(flat, s.t_elem)
    if qk is not None:
        new["output_qk"] = b.cast(b.op("Transpose", qk, perm=[1, 0, 2]), s.qk_elem)
    return new


__all__ = ["ort_rope", "rewrite_in_place"]
