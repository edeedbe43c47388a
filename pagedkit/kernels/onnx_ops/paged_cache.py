"""The paged-cache half of the PagedAttention decomposition, as standard ONNX ops.

- `token_index`: each token's sequence (from cumulative_sequence_length), its sequence-local offset, its
  derived position past_seqlens[b] + j, the positions used by RoPE / masks (query_positions when given)
  and its sequence's KV extent past_seqlens[b] + q_len[b]. All symbolic in token_count / batch_size.
- `write_slots`: slot_mapping, or block_table[b, pos // BS] * BS + pos % BS (-1 for an unmapped block);
  the tokens kept for writing (slot >= 0, and the last token of several sharing a slot).
- `encode` / `decode`: float caches (Cast), int8 / fp8 / int4 (+8-biased nibbles) with PER_TENSOR,
  PER_CHANNEL or PER_TOKEN scales, exactly as pagedkit.kernels.quant.
- `write`: ScatterND of the kept tokens into the flattened cache (with one zero row appended) -> a NEW
  cache tensor (onnxruntime does not alias outputs to inputs; the cache output is the input with the
  step's writes applied).
- `context` / `decode`: Gather of each sequence's context rows through its block_table row -> [B, C, Hkv, D]
  float32 with C = block_table.shape[1] * block_size; positions that are unmapped or beyond the extent
  read the appended zero row (so unwritten garbage never enters the math), plus that mask [B, C].
fp8 caches are handled through an exact float16 working copy: onnxruntime (opset 21-23) has no float8
Gather / ScatterND / Compress kernels, and every float8e4m3fn value is a float16 value.
"""

from __future__ import annotations

from dataclasses import dataclass

import onnx_ir as ir

from ...validators.contract import CACHE_FORMATS
from .builder import I64, Builder

FP16 = ir.DataType.FLOAT16
QMAX = {n: f.qmax for n, f in CACHE_FORMATS.items() if f.quantized}  # contract facts: 127 / 448 / 7
QMIN = {n: f.qmin for n, f in CACHE_FORMATS.items() if f.quantized}  # -128 / -448 / -8


@dataclass
class Side:
    """One physical cache (K or V) of the node, with what the decomposition needs to know statically."""

    prefix: str  # "k" or "v"
    cache: ir.Value  # [NB, BS, Hkv, Dc]
    elem: ir.DataType  # the cache tensor's element type
    fmt: str | None  # None (float cache) | "int8" | "float8e4m3fn" | "int4"
    quant: str  # NONE | PER_TENSOR | PER_CHANNEL | PER_TOKEN
    head_size: int  # logical channels D
    kv_heads: int
    scale: ir.Value | None = None  # k_scale / v_scale (static scales)
    scale_cache: ir.Value | None = None  # PER_TOKEN [NB, BS, Hkv]
    scale_elem: ir.DataType | None = None

    @property
    def width(self) -> int:
        return (self.head_size + 1) // 2 if self.fmt == "int4" else self.head_size


@dataclass
class TokenIndex:
    t: ir.Value  # [1] token_count
    tpos: ir.Value  # [T] 0..T-1
    seq: ir.Value  # [T] sequence of each token
    j: ir.Value  # [T] sequence-local query offset
    dpos: ir.Value  # [T] derived position past[b] + j (cache slot)
    pos: ir.Value  # [T] RoPE / mask position (query_positions when given)
    extent: ir.Value  # [T] KV extent of the token's sequence
    batch: ir.Value  # [1] batch_size B
    qmax: ir.Value  # [1] the longest query of the step (max q_len)
    pidx: ir.Value  # [T] row of each token in the padded [B * qmax] layout: seq * qmax + j
    extent_b: ir.Value  # [B] KV extent of each sequence


def token_index(b: Builder, query: ir.Value, csl: ir.Value, past: ir.Value,
                query_positions: ir.Value | None) -> TokenIndex:
    csl64, past64 = b.cast(csl, I64), b.cast(past, I64)
    t = b.dim(query, 0)
    tpos = b.op("Range", b.scalar_i64(0), b.sq(t, 0), b.scalar_i64(1))
    hi = b.slice(csl64, 1, 2**62, 0)  # csl[1:]   [B]
    lo = b.slice(csl64, 0, -1, 0)  # csl[:-1]  [B]
    # token t belongs to sequence #{b >= 1 : csl[b] <= t} (zero-length sequences own no token)
    le = b.op("LessOrEqual", b.unsq(hi, 0), b.unsq(tpos, 1))  # [T, B]
    seq = b.reduce("ReduceSum", b.cast(le, I64), 1, keepdims=0)
    j = b.op("Sub", tpos, b.gather(lo, seq))
    past_t = b.gather(past64, seq)
    dpos = b.op("Add", past_t, j)
    qlen = b.op("Sub", hi, lo)  # [B]
    extent_b = b.op("Add", past64, qlen)
    extent = b.gather(extent_b, seq)
    pos = b.cast(query_positions, I64) if query_positions is not None else dpos
    qmax = b.reduce("ReduceMax", qlen, 0)  # [1]
    pidx = b.op("Add", b.op("Mul", seq, qmax), j)
    return TokenIndex(t, tpos, seq, j, dpos, pos, extent, b.dim(past, 0), qmax, pidx, extent_b)


def write_slots(b: Builder, ix: TokenIndex, block_table: ir.Value, slot_mapping: ir.Value | None,
                cache: ir.Value) -> tuple[ir.Value, ir.Value]:
    """(slots [T] int64, keep [T] bool): keep = written (slot >= 0) and no later token writes the same slot."""
    nb, bs = b.dim(cache, 0), b.dim(cache, 1)
    if slot_mapping is not None:
        slots = b.cast(slot_mapping, I64)
    else:
        bt = b.cast(block_table, I64)
        col, off = b.op("Div", ix.dpos, bs), b.op("Mod", ix.dpos, bs)
        idx = b.op("Concat", b.unsq(ix.seq, 1), b.unsq(col, 1), axis=1)  # [T, 2]; out of range: an ORT error
        blk = b.op("GatherND", bt, idx)
        ok = b.and_(b.op("GreaterOrEqual", blk, b.scalar_i64(0)), b.op("Less", blk, b.sq(nb, 0)))
        slots = b.where(ok, b.op("Add", b.op("Mul", blk, bs), off), b.scalar_i64(-1))
    written = b.op("GreaterOrEqual", slots, b.scalar_i64(0))
    # the last token of several sharing a slot wins (as the reference's in-order loop): per slot, the
    # largest writing token index (ScatterElements max), kept only by that token
    total = b.op("Mul", nb, bs)
    winner0 = b.op("ConstantOfShape", total, value=ir.tensor([-1], dtype=I64))
    wslots = b.op("Compress", slots, written, axis=0)
    winner = b.op("ScatterElements", winner0, wslots, b.op("Compress", ix.tpos, written, axis=0), reduction="max")
    safe = b.op("Max", slots, b.scalar_i64(0))
    last = b.op("Equal", b.gather(winner, safe), ix.tpos)
    return slots, b.and_(written, last)


def _static_scale(b: Builder, side: Side) -> ir.Value:
    """PER_TENSOR (1,) -> [1, 1]; PER_CHANNEL (Hkv, 1, D) -> [Hkv, D] (float32)."""
    s = b.f(side.scale)
    return b.reshape(s, 1, 1) if side.quant == "PER_TENSOR" else b.reshape(s, side.kv_heads, side.head_size)


def encode(b: Builder, side: Side, x: ir.Value) -> tuple[ir.Value, ir.Value | None]:
    """x [T, Hkv, D] f32 -> (codes [T, Hkv, Dc] as float32 values, exact in the stored type; PER_TOKEN
    scales [T, Hkv] as stored, float32, or None). `stored(...)` turns the codes into the cache type."""
    if side.fmt is None:
        return x, None
    tok_scale = None
    if side.quant == "PER_TOKEN":
        amax = b.reduce("ReduceMax", b.op("Abs", x), -1)  # [T, Hkv, 1]
        s = b.where(b.op("Greater", amax, b.f32(0.0)), b.op("Div", amax, b.f32(QMAX[side.fmt])), b.f32(1.0))
        s = b.f(b.cast(s, side.scale_elem))  # rounded to the scale cache's type; codes use the stored scale
        tok_scale = b.sq(s, 2)
    else:
        s = _static_scale(b, side)
    ratio = b.safe_div(x, s)
    lo, hi = b.f32(QMIN[side.fmt]), b.f32(QMAX[side.fmt])
    if side.fmt == "float8e4m3fn":
        return b.op("Clip", ratio, lo, hi), tok_scale
    codes = b.op("Clip", b.op("Round", ratio), lo, hi)  # Round: half to even, like rint
    if side.fmt == "int4":  # nibble = code + 8, element 2i in the low nibble of byte i
        nib = b.reshape(b.op("Add", codes, b.f32(8.0)), b.dim(x, 0), side.kv_heads, side.head_size // 2, 2)
        low, high = b.slice(nib, 0, 1, 3), b.slice(nib, 1, 2, 3)
        byte = b.op("Add", low, b.op("Mul", high, b.f32(16.0)))
        codes = b.reshape(byte, b.dim(x, 0), side.kv_heads, side.width)
    return codes, tok_scale


def work_dtype(side: Side) -> ir.DataType:
    """The element type the cache is updated and read in: its own, float16 for float8 (exact)."""
    return FP16 if side.elem == ir.DataType.FLOAT8E4M3FN else side.elem


def stored(b: Builder, side: Side, codes: ir.Value) -> ir.Value:
    """float32 codes -> the cache's working type (float8 values rounded to float8 first)."""
    if side.elem == ir.DataType.FLOAT8E4M3FN:
        return b.cast(b.cast(codes, side.elem), FP16)
    return b.cast(codes, side.elem)


def write(b: Builder, cache: ir.Value, elem: ir.DataType, slots: ir.Value, keep: ir.Value, rows: ir.Value,
          cast_rows=None) -> tuple[ir.Value, ir.Value]:
    """cache [NB, BS, *R] of type elem with rows [T, *R] written at flat slots[t] for keep[t] -> (the updated cache,
    a new tensor [NB, BS, *R]; the same rows flat with one zero row appended [NB * BS + 1, *R], the row
    unreadable context positions read). rows are compressed before `cast_rows` (Compress has no bfloat16
    kernel in onnxruntime)."""
    idx = b.unsq(b.op("Compress", slots, keep, axis=0), 1)  # [W, 1]
    upd = b.op("Compress", rows, keep, axis=0)
    if cast_rows is not None:
        upd = cast_rows(upd)
    shape, rest = b.op("Shape", cache), b.op("Shape", cache, start=2)
    flat = b.op("Reshape", cache, b.cat(b.i64(-1), rest))  # NB*BS > 0 always
    zero = b.cast(b.op("ConstantOfShape", b.cat(b.i64(1), rest)), elem)  # float 0 cast to the cache type
    padded = b.op("ScatterND", b.op("Concat", flat, zero, axis=0), idx, upd)
    total = b.op("Mul", b.dim(cache, 0), b.dim(cache, 1))
    return b.op("Reshape", b.slice(padded, 0, total, 0), shape), padded


@dataclass
class Context:
    rows: ir.Value  # [B, C] flat row of each context position; unreadable -> NB * BS (the zero row)
    readable: ir.Value  # [B, C] bool: in a mapped block and below the sequence's extent
    c: ir.Value  # [1] capacity MB * BS


def context(b: Builder, ix: TokenIndex, block_table: ir.Value, cache: ir.Value) -> Context:
    nb, bs = b.dim(cache, 0), b.dim(cache, 1)
    tb = b.cast(block_table, I64)  # [B, MB]
    c = b.op("Mul", b.dim(block_table, 1), bs)
    kpos = b.op("Range", b.scalar_i64(0), b.sq(c, 0), b.scalar_i64(1))  # [C]
    blk = b.gather(tb, b.op("Div", kpos, bs), axis=1)  # [B, C]
    ok = b.and_(b.op("GreaterOrEqual", blk, b.scalar_i64(0)), b.op("Less", blk, b.sq(nb, 0)),
                b.op("Less", b.unsq(kpos, 0), b.unsq(ix.extent_b, 1)))
    row = b.op("Add", b.op("Mul", blk, bs), b.op("Mod", kpos, bs))
    return Context(b.where(ok, row, b.sq(b.op("Mul", nb, bs), 0)), ok, c)


def decode(b: Builder, side: Side, ix: TokenIndex, ctx: Context, padded: ir.Value,
           scale_padded: ir.Value | None) -> ir.Value:
    """Each sequence's context [B, C, Hkv, D] float32 read (dequantized) from the updated cache (`padded`
    flat rows from `write`); unreadable positions read the zero row: 0, never garbage or NaN."""
    vals = b.f(b.gather(padded, ctx.rows))  # [B, C, Hkv, Dc]
    if side.fmt is None:
        return vals
    if side.fmt == "int4":
        high = b.op("Floor", b.op("Div", vals, b.f32(16.0)))
        low = b.op("Sub", vals, b.op("Mul", high, b.f32(16.0)))
        pair = b.op("Concat", b.unsq(low, 4), b.unsq(high, 4), axis=4)
        vals = b.op("Sub", b.reshape(pair, ix.batch, ctx.c, side.kv_heads, 2 * side.width), b.f32(8.0))
        if 2 * side.width != side.head_size:
            vals = b.slice(vals, 0, side.head_size, 3)
    if side.quant == "PER_TOKEN":
        return b.op("Mul", vals, b.unsq(b.f(b.gather(scale_padded, ctx.rows)), 3))
    return b.op("Mul", vals, _static_scale(b, side))


def update_side(b: Builder, side: Side, ix: TokenIndex, slots: ir.Value, keep: ir.Value, x: ir.Value):
    """Encode x [T, Hkv, D] f32 and write it -> (padded flat working rows, cache output, padded flat scale
    rows or None, scale cache output or None)."""
    codes, tok_scale = encode(b, side, x)
    wt = work_dtype(side)
    src = side.cache if wt == side.elem else b.cast(side.cache, wt)
    work, padded = write(b, src, wt, slots, keep, codes, lambda u: stored(b, side, u))
    out = work if wt == side.elem else b.cast(work, side.elem)
    scale_out = scale_padded = None
    if tok_scale is not None:
        scale_out, scale_padded = write(b, side.scale_cache, side.scale_elem, slots, keep, tok_scale,
                                        lambda u: b.cast(u, side.scale_elem))
    return padded, out, scale_padded, scale_out


def update_side_in_place(b: Builder, side: Side, keep: ir.Value, x: ir.Value, where: ir.Value,
                         as_stored: bool = False):
    """The in-place form of update_side (CPU plan, runtime/delegate.py): encode x [T, Hkv, D] f32 and ScatterND
    the kept rows straight into the cache [NB, BS, Hkv, Dc] at (block, offset) -> (cache output, scale cache
    output or None). The ScatterND's output is the node's cache output: bound to the cache input's buffer it
    writes only the step's rows. Needs the cache dtype as the working dtype (no fp8 / bfloat16 working copy):
    `in_place_refusal`. where: scatter_index(...) of the step (shared by its nodes). as_stored: x is already in
    the cache's type, unquantized (the in-place rewrite's float16 prologue): written as it is."""
    if as_stored:
        if side.fmt is not None:
            raise ValueError("as_stored needs an unquantized cache")
        return b.op("ScatterND", side.cache, where, b.op("Compress", x, keep, axis=0)), None
    codes, tok_scale = encode(b, side, x)
    out = b.op("ScatterND", side.cache, where, stored(b, side, b.op("Compress", codes, keep, axis=0)))
    scale_out = None
    if tok_scale is not None:
        upd = b.cast(b.op("Compress", tok_scale, keep, axis=0), side.scale_elem)
        scale_out = b.op("ScatterND", side.scale_cache, where, upd)
    return out, scale_out


def scatter_index(b: Builder, cache: ir.Value, slots: ir.Value, keep: ir.Value) -> ir.Value:
    """[W, 2] (block, offset) of the kept slots (distinct): ScatterND indices for update_side_in_place."""
    bs = b.dim(cache, 1)
    w = b.op("Compress", slots, keep, axis=0)  # [W]
    return b.op("Concat", b.unsq(b.op("Div", w, bs), 1), b.unsq(b.op("Mod", w, bs), 1), axis=1)


def in_place_refusal(side: Side) -> str | None:
    if work_dtype(side) != side.elem:
        return f"a {side.elem.name.lower()} cache is worked on through a copy; the in-place write needs float16, " \
               "float32, int8 or int4 storage"
    return None


def tight_table(b: Builder, ix: TokenIndex, block_table: ir.Value, cache: ir.Value) -> ir.Value:
    """block_table's first ceil(max extent / BS) columns: the context this step can read (>= 1 column)."""
    bs = b.dim(cache, 1)
    longest = b.reduce("ReduceMax", b.op("Concat", ix.extent_b, b.i64(1), axis=0), 0)  # [1]
    cols = b.op("Min", b.op("Div", b.op("Add", longest, b.op("Sub", bs, b.i64(1))), bs), b.dim(block_table, 1))
    return b.slice(block_table, 0, cols, 1)


__all__ = ["Context", "Side", "TokenIndex", "context", "decode", "in_place_refusal", "tight_table",
           "scatter_index", "token_index", "update_side", "update_side_in_place", "write_slots"]
