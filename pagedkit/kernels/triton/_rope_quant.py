"""Triton device helpers of the cache-write prologue (cache_write.py): the per-head prologue of one token's
rows (QK-norm -> RoPE -> Walsh-Hadamard rotation, in float32) and the encoders of one cache side (float
cast, int8 / fp8 E4M3 / packed int4 codes with a static or per-token scale).

Rounding is done with plain float32 / integer arithmetic so the interpreter and the GPU give the same
bits (the interpreter's float32 -> bfloat16 cast truncates; it has no float8; libdevice rint is avoided):
- divisions by a scale: `tl.math.div_rn` (IEEE round to nearest, as numpy / torch on the CPU; the GPU's
  float32 `/` is approximate);
- `rint`: round half to even by adding and subtracting 1.5 * 2**23 (exact for |x| <= 2**22; callers clamp
  to the code range first, which commutes with rint for integer bounds);
- `bf16_bits`: float32 -> bfloat16 bit pattern, round to nearest even (stored through an int16 view);
- `fp8_bits`: float32 (clamped to +-448) -> float8 E4M3FN bit pattern, round to nearest even, subnormals
  and -0.0 as torch's `.to(torch.float8_e4m3fn)` (stored through a uint8 view).
The rotation is x @ H over channels as tl.dot K-chunks of KB channels (H_n entries +-1 built from
popcount parity, so no matrix is loaded), input_precision "tf32x3" (float32-level on tensor cores; the
interpreter multiplies in float32), then scaled by 1/sqrt(n).
"""

from __future__ import annotations

from .common import require_triton, tl, triton

require_triton()


@triton.jit
def rint(x):
    return (x + 12582912.0) - 12582912.0  # 1.5 * 2**23


@triton.jit
def bf16_bits(x):
    b = x.to(tl.int32, bitcast=True)
    b = b + 0x7FFF + ((b >> 16) & 1)
    return (b >> 16).to(tl.int16)


@triton.jit
def fp8_bits(r):
    """r float32 in [-448, 448] -> uint8 E4M3FN bits: code = (e + 7) * 8 + rint(|r| * 2**(3 - e)) - 8 with
    e = max(floor(log2 |r|), -6), continuous over the subnormal / normal boundary and mantissa carries."""
    bits = r.to(tl.int32, bitcast=True)
    e = tl.maximum(((bits >> 23) & 0xFF) - 127, -6)
    pow2 = ((130 - e) << 23).to(tl.float32, bitcast=True)  # 2 ** (3 - e), exact
    m = rint(tl.abs(r) * pow2).to(tl.int32)  # in [0, 16]
    code = (e + 7) * 8 + m - 8
    code = tl.where(bits < 0, code | 0x80, code)  # sign bit (incl. -0.0 and negative underflow)
    return code.to(tl.uint8)


@triton.jit
def hadamard_tile(rows, cols, D):
    """Sylvester H_D entries (-1) ** popcount(i & j) for i in rows [K], j in cols [C]; 0 outside [0, D)."""
    a = rows[:, None] & cols[None, :]
    a = a ^ (a >> 8)
    a = a ^ (a >> 4)
    a = a ^ (a >> 2)
    a = a ^ (a >> 1)
    h = 1.0 - 2.0 * (a & 1).to(tl.float32)
    return tl.where((rows[:, None] < D) & (cols[None, :] < D), h, 0.0)


@triton.jit
def _norm_rope(x, src, rows, cols, nrows, D, inv, w_ptr, cos_row, sin_row,
               HAS_NORM: tl.constexpr, HAS_ROPE: tl.constexpr, HALF: tl.constexpr, ROT_OFF: tl.constexpr,
               INTERLEAVED: tl.constexpr):
    """x [R, C]: the raw rows at channels cols -> QK-norm (x * inv * w) -> RoPE on [ROT_OFF, ROT_OFF + 2 HALF)."""
    if HAS_NORM:
        w = tl.load(w_ptr + cols, mask=cols < D, other=0.0).to(tl.float32)
        x = x * inv[:, None] * w[None, :]
    if HAS_ROPE:
        rel = cols - ROT_OFF
        inrot = (rel >= 0) & (rel < 2 * HALF) & (cols < D)
        if INTERLEAVED:  # pairs (2c, 2c + 1)
            first = (rel & 1) == 0
            partner = tl.where(first, cols + 1, cols - 1)
            j = rel >> 1
        else:  # pairs (c, c + HALF)
            first = rel < HALF
            partner = tl.where(first, cols + HALF, cols - HALF)
            j = tl.where(first, rel, rel - HALF)
        j = tl.where(inrot, j, 0)
        partner = tl.where(inrot, partner, 0)
        pm = (rows[:, None] < nrows) & inrot[None, :]
        xp = tl.load(src + rows[:, None] * D + partner[None, :], mask=pm, other=0.0).to(tl.float32)
        if HAS_NORM:
            wp = tl.load(w_ptr + partner, mask=inrot, other=0.0).to(tl.float32)
            xp = xp * inv[:, None] * wp[None, :]
        c = tl.load(cos_row + j, mask=inrot, other=1.0).to(tl.float32)[None, :]
        s = tl.load(sin_row + j, mask=inrot, other=0.0).to(tl.float32)[None, :]
        rotated = tl.where(first[None, :], x * c - xp * s, x * c + xp * s)
        x = tl.where(inrot[None, :], rotated, x)
    return x


@triton.jit
def side_rows(src, rows, nrows, D, eps, w_ptr, cos_row, sin_row,
              R: tl.constexpr, BLOCK_D: tl.constexpr, HAS_NORM: tl.constexpr, HAS_ROPE: tl.constexpr,
              HALF: tl.constexpr, ROT_OFF: tl.constexpr, INTERLEAVED: tl.constexpr,
              ROTATE: tl.constexpr, KB: tl.constexpr, INV_SQRT_D: tl.constexpr):
    """Rows (heads) `rows` [R] of one token at src (head h at src + h * D) after the prologue: float32
    [R, BLOCK_D], zero outside rows < nrows and channels < D."""
    cols = tl.arange(0, BLOCK_D)
    rmask = rows[:, None] < nrows
    inv = tl.full([R], 1.0, tl.float32)
    x = tl.zeros([R, BLOCK_D], dtype=tl.float32)
    if HAS_NORM or not ROTATE:
        x = tl.load(src + rows[:, None] * D + cols[None, :], mask=rmask & (cols[None, :] < D),
                    other=0.0).to(tl.float32)
    if HAS_NORM:
        inv = tl.rsqrt(tl.sum(x * x, axis=1) / D + eps)
    if ROTATE:  # y = sum over K-chunks of x[:, chunk] @ H[chunk, :]
        acc = tl.zeros([R, BLOCK_D], dtype=tl.float32)
        for k0 in tl.static_range(0, BLOCK_D, KB):
            kc = k0 + tl.arange(0, KB)
            xk = tl.load(src + rows[:, None] * D + kc[None, :], mask=rmask & (kc[None, :] < D),
                         other=0.0).to(tl.float32)
            xk = _norm_rope(xk, src, rows, kc, nrows, D, inv, w_ptr, cos_row, sin_row,
                            HAS_NORM, HAS_ROPE, HALF, ROT_OFF, INTERLEAVED)
            acc = tl.dot(xk, hadamard_tile(kc, cols, D), acc, input_precision="tf32x3")
        x = acc * INV_SQRT_D
    else:
        x = _norm_rope(x, src, rows, cols, nrows, D, inv, w_ptr, cos_row, sin_row,
                       HAS_NORM, HAS_ROPE, HALF, ROT_OFF, INTERLEAVED)
    return x


@triton.jit
def encode_store(x, rows, nrows, D, write, cache, cs0, cs1, cs2, cs3, blk, off,
                 scale_vec, scache, ss0, ss1, ss2,
                 R: tl.constexpr, BLOCK_D: tl.constexpr, FMT: tl.constexpr, SCALE: tl.constexpr,
                 BF16: tl.constexpr, QMAX: tl.constexpr):
    """Encode x [R, BLOCK_D] (kv heads `rows`) in the side's format and store it at (blk, off); write
    (scalar bool) gates every store, the PER_TOKEN scale included. FMT / SCALE: common.FMT_* / SCALE_*."""
    cols = tl.arange(0, BLOCK_D)
    rm = (rows < nrows) & write
    base = blk * cs0 + off * cs1 + rows.to(tl.int64) * cs2  # [R] int64
    if FMT == 0:  # float cache: a cast (bfloat16 as rounded bits through an int16 view)
        if BF16:
            val = bf16_bits(x)
        else:
            val = x.to(cache.dtype.element_ty)
        tl.store(cache + base[:, None] + cols[None, :] * cs3, val, mask=rm[:, None] & (cols[None, :] < D))
    else:
        if SCALE == 3:  # PER_TOKEN: amax / qmax (0 -> 1), rounded to the scale cache's dtype first
            amax = tl.max(tl.abs(x), axis=1)
            st = tl.where(amax > 0, tl.math.div_rn(amax, QMAX + 0.0 * amax), 1.0).to(scache.dtype.element_ty)
            tl.store(scache + blk * ss0 + off * ss1 + rows.to(tl.int64) * ss2, st, mask=rm)
            s = st.to(tl.float32)[:, None]
        elif SCALE == 1:  # PER_TENSOR: float32 [1]
            s = tl.load(scale_vec)
        else:  # PER_CHANNEL: float32 [Hkv * D]
            s = tl.load(scale_vec + rows[:, None] * D + cols[None, :],
                        mask=(rows[:, None] < nrows) & (cols[None, :] < D), other=1.0)
        # IEEE division (div_rn): the GPU's plain float32 `/` is approximate (div.full, 2 ulp), which rounds a
        # code the other way near a tie (an H200 prefill of int8 PER_TOKEN K / V: 0.7% off the reference)
        r = tl.where(s != 0, tl.math.div_rn(x, tl.where(s != 0, s, 1.0) + 0.0 * x), 0.0)
        if FMT == 1:  # int8
            code = rint(tl.minimum(tl.maximum(r, -128.0), 127.0)).to(tl.int8)
            tl.store(cache + base[:, None] + cols[None, :] * cs3, code, mask=rm[:, None] & (cols[None, :] < D))
        elif FMT == 2:  # float8 E4M3FN bits
            code = fp8_bits(tl.minimum(tl.maximum(r, -448.0), 448.0))
            tl.store(cache + base[:, None] + cols[None, :] * cs3, code, mask=rm[:, None] & (cols[None, :] < D))
        else:  # int4: nibble = code + 8, channel 2i low; channels >= D are 0 -> a zero code pads odd D
            nib = (rint(tl.minimum(tl.maximum(r, -8.0), 7.0)) + 8.0).to(tl.int32)
            lo, hi = tl.split(tl.reshape(nib, [R, BLOCK_D // 2, 2]))
            byte = (lo | (hi << 4)).to(tl.uint8)
            c2 = tl.arange(0, BLOCK_D // 2)
            tl.store(cache + base[:, None] + c2[None, :] * cs3, byte,
                     mask=rm[:, None] & (c2[None, :] < (D + 1) // 2))
