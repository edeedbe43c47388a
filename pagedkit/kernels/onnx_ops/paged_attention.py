"""The prologue and the attention of the PagedAttention decomposition, as standard ONNX ops (float32).

prologue: [packed QKV split] -> QK-norm (RMS over each head's channels) -> RoPE (half or interleaved, on
channels [rotary_offset, rotary_offset + rotary_dim)) -> Hadamard rotation; Q rounded to T (as the
reference's prologue workspace).
attention: per sequence b, over its queries scattered to a [B, qmax] padded layout (row b * qmax + j;
gathered back per token at the end) and its context [C] (C = block_table.shape[1] * block_size):
scores = q . k * scale (+ attention_bias) -> softcap -> mask (mapped block, k < extent, causal k <= pos,
window k >= pos - W + 1) -> softmax in float32 with the optional head_sink logit in the denominator
(a row with no admitted key gives 0) -> probabilities @ V (unreadable context rows were read as zeros,
so garbage in unwritten cache rows cannot leak as NaN * 0).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import onnx_ir as ir

from .builder import Builder
from .paged_cache import Context, TokenIndex


def _hadamard(n: int) -> np.ndarray:
    h = np.ones((1, 1), dtype=np.float64)
    while h.shape[0] < n:
        h = np.block([[h, h], [h, -h]])
    return (h / np.sqrt(n)).astype(np.float32)


def rotate(b: Builder, x: ir.Value, n: int) -> ir.Value:
    """x [..., n] @ (H_n / sqrt(n)) (symmetric: its own inverse)."""
    return b.op("MatMul", x, b.const(_hadamard(n)))


def rms_norm(b: Builder, x: ir.Value, weight: ir.Value, eps: float) -> ir.Value:
    ms = b.reduce("ReduceMean", b.op("Mul", x, x), -1)
    inv = b.op("Reciprocal", b.op("Sqrt", b.op("Add", ms, b.f32(eps))))
    return b.op("Mul", b.op("Mul", x, inv), b.f(weight))


@dataclass
class Rope:
    cos: ir.Value  # [T, 1, half] f32
    sin: ir.Value
    half: int
    interleaved: bool
    offset: int


def rope_tables(b: Builder, cos_cache: ir.Value, sin_cache: ir.Value, pos: ir.Value, half: int,
                interleaved: bool, offset: int) -> Rope:
    cos = b.unsq(b.f(b.gather(cos_cache, pos)), 1)
    sin = b.unsq(b.f(b.gather(sin_cache, pos)), 1)
    return Rope(cos, sin, half, interleaved, offset)


def apply_rope(b: Builder, x: ir.Value, r: Rope, head_size: int, t: ir.Value, heads: int) -> ir.Value:
    """x [T, heads, D] f32 -> RoPE on channels [offset, offset + 2 * half); others copied through."""
    rot, off = 2 * r.half, r.offset
    seg = b.slice(x, off, off + rot, 2)
    if r.interleaved:
        a, c = b.slice(seg, 0, rot, 2, 2), b.slice(seg, 1, rot, 2, 2)
    else:
        a, c = b.slice(seg, 0, r.half, 2), b.slice(seg, r.half, rot, 2)
    ra = b.op("Sub", b.op("Mul", a, r.cos), b.op("Mul", c, r.sin))
    rc = b.op("Add", b.op("Mul", c, r.cos), b.op("Mul", a, r.sin))
    if r.interleaved:
        pair = b.op("Concat", b.unsq(ra, 3), b.unsq(rc, 3), axis=3)
        rotated = b.reshape(pair, t, heads, rot)
    else:
        rotated = b.op("Concat", ra, rc, axis=2)
    parts = []
    if off > 0:
        parts.append(b.slice(x, 0, off, 2))
    parts.append(rotated)
    if off + rot < head_size:
        parts.append(b.slice(x, off + rot, head_size, 2))
    return b.cat(*parts, axis=2)


@dataclass
class Masking:
    causal: bool
    window: int
    softcap: float
    scale: float
    qk_mode: int


def to_padded(b: Builder, ix: TokenIndex, x: ir.Value, *row: int, zero: ir.Value | None = None) -> ir.Value:
    """Token rows x [T, *row] -> [B, qmax, *row]: token t at (seq, j); padding rows hold `zero` (0.0)."""
    zeros = b.op("Expand", zero if zero is not None else b.f32(0.0), b.shape(b.op("Mul", ix.batch, ix.qmax), *row))
    flat = b.op("ScatterND", zeros, b.unsq(ix.pidx, 1), x)
    return b.reshape(flat, ix.batch, ix.qmax, *row)


def from_padded(b: Builder, ix: TokenIndex, x: ir.Value, *row: int) -> ir.Value:
    """[B, qmax, *row] -> the token rows [T, *row]."""
    return b.gather(b.reshape(x, b.op("Mul", ix.batch, ix.qmax), *row), ix.pidx)


def allowed_mask(b: Builder, ix: TokenIndex, ctx: Context, m: Masking) -> ir.Value:
    """[B, qmax, C] bool: key position k admitted for the query at (b, j) (readable: mapped block and
    k < extent; causal k <= pos; window k >= pos - W + 1). Padding rows are computed, never gathered back."""
    kpos = b.unsq(b.op("Range", b.scalar_i64(0), b.sq(ctx.c, 0), b.scalar_i64(1)), 0, 1)  # [1, 1, C]
    pos = b.unsq(to_padded(b, ix, ix.pos, zero=b.scalar_i64(0)), 2)  # [B, qmax, 1]
    terms = [b.unsq(ctx.readable, 1)]
    if m.causal:
        terms.append(b.op("LessOrEqual", kpos, pos))
    if m.window > 0:
        terms.append(b.op("GreaterOrEqual", kpos, b.op("Sub", pos, b.scalar_i64(m.window - 1))))
    return b.and_(*terms)


def bias_rows(b: Builder, bias: ir.Value, ix: TokenIndex, c: ir.Value, qrows: ir.Value | None = None) -> ir.Value:
    """attention_bias [Bb, Hb, Qc, Kc] -> [B, Hb, qmax, C] f32 (qrows in place of qmax when given): rows
    [b or 0, :, :qmax] fit to C (cut, or
    zero-padded: positions beyond Kc are beyond the extent and masked anyway)."""
    bb = b.dim(bias, 0)
    bsel = b.op("Min", b.op("Range", b.scalar_i64(0), b.sq(ix.batch, 0), b.scalar_i64(1)),
                b.sq(b.op("Sub", bb, b.i64(1)), 0))  # Bb == 1 -> 0, Bb == B -> b
    rows = b.slice(b.gather(b.f(bias), bsel), b.i64(0), ix.qmax if qrows is None else qrows, 2)  # [B, Hb, qmax, Kc]
    pad = b.op("Max", b.op("Sub", c, b.dim(bias, 3)), b.i64(0))
    rows = b.op("Pad", rows, b.cat(b.i64(0, 0, 0, 0, 0, 0, 0), pad))  # pads: 4 begins, then ends (0, 0, 0, pad)
    return b.slice(rows, 0, c, 3)


def attend(b: Builder, q: ir.Value, k: ir.Value, v: ir.Value, allowed: ir.Value, ix: TokenIndex, ctx: Context,
           m: Masking, heads: int, kv_heads: int, head_size: int, v_head: int,
           bias: ir.Value | None, sink: ir.Value | None) -> tuple[ir.Value, ir.Value | None]:
    """q [T, H, D] (tokens), k [B, C, Hkv, D], v [B, C, Hkv, Dv] (sequences), allowed [B, qmax, C] ->
    (out [T, H, Dv] f32, qk [T, H, C] or None). Computed per sequence over its queries padded to qmax."""
    g = heads // kv_heads
    qp = b.op("Transpose", to_padded(b, ix, q, heads, head_size), perm=[0, 2, 1, 3])  # [B, H, qmax, D]
    q4 = b.reshape(qp, ix.batch, kv_heads, b.op("Mul", b.i64(g), ix.qmax), head_size)  # [B, Hkv, G*qmax, D]
    # K moved head-major in rows of D; the last-two-dims transpose before the MatMul is what onnxruntime's
    # MatMul+Transpose fusion folds into FusedMatMul(transB=1), so it is not materialized there
    kh = b.op("Transpose", k, perm=[0, 2, 1, 3])  # [B, Hkv, C, D]
    st = b.op("MatMul", q4, b.op("Transpose", kh, perm=[0, 1, 3, 2]))  # [B, Hkv, G*qmax, C]
    s = b.reshape(st, ix.batch, heads, ix.qmax, ctx.c)  # [B, H, qmax, C]
    s = b.op("Mul", s, b.f32(m.scale))
    if bias is not None:
        s = b.op("Add", s, bias_rows(b, bias, ix, ctx.c))
    if m.softcap > 0:
        s = b.op("Mul", b.op("Tanh", b.op("Div", s, b.f32(m.softcap))), b.f32(m.softcap))
    allow4 = b.unsq(allowed, 1)  # [B, 1, qmax, C]
    mx = b.reduce("ReduceMax", b.where(allow4, s, b.f32(-np.inf)), -1)  # [B, H, qmax, 1]
    sk = None
    if sink is not None:
        sk = b.reshape(b.f(sink), 1, heads, 1, 1)
        mx = b.op("Max", mx, sk)
    mx = b.where(b.op("IsInf", mx, detect_positive=0), b.f32(0.0), mx)  # no admitted key, no sink
    e = b.where(allow4, b.op("Exp", b.op("Sub", s, mx)), b.f32(0.0))
    den = b.reduce("ReduceSum", e, -1)
    if sk is not None:
        den = b.op("Add", den, b.op("Exp", b.op("Sub", sk, mx)))
    den = b.where(b.op("Greater", den, b.f32(0.0)), den, b.f32(1.0))
    p = b.op("Div", e, den)  # [B, H, qmax, C]
    vt = b.op("Transpose", v, perm=[0, 2, 1, 3])  # [B, Hkv, C, Dv]; unreadable rows are 0 (the zero row)
    p4 = b.reshape(p, ix.batch, kv_heads, b.op("Mul", b.i64(g), ix.qmax), ctx.c)
    out = b.reshape(b.op("MatMul", p4, vt), ix.batch, heads, ix.qmax, v_head)  # [B, H, qmax, Dv]
    out = from_padded(b, ix, b.op("Transpose", out, perm=[0, 2, 1, 3]), heads, v_head)  # [T, H, Dv]
    qk = None
    if m.qk_mode:
        qk = b.where(allow4, s, b.f32(0.0)) if m.qk_mode == 1 else p
        qk = from_padded(b, ix, b.op("Transpose", qk, perm=[0, 2, 1, 3]), heads, ctx.c)  # [T, H, C]
    return out, qk


def fused_refusal(m: Masking, sink: ir.Value | None) -> str | None:
    """Why one ONNX Attention node (paged_inplace, fused) cannot serve these semantics (None: it can). ONNX Attention applies softcap after the
    mask (masked keys would get -softcap, not -inf), has no sink logit, and no output_qk matching ours."""
    if m.softcap > 0:
        return "softcap"
    if sink is not None:
        return "head_sink"
    if m.qk_mode:
        return "output_qk"
    return None


__all__ = ["Masking", "allowed_mask", "apply_rope", "attend", "bias_rows", "fused_refusal", "from_padded", "rms_norm", "rope_tables", "rotate",
           "to_padded"]
