"""The @triton.jit kernels of the split-KV paged attention (launcher, layouts and heuristics: decode.py).

- `_attn_kernel`   grid (B, Hkv * N_SUB, S * L): one program per (sequence, KV head [, head sub-group],
                   split, query-chunk lane); rows = query tokens x heads of the group; lane l of L takes the
                   sequence's query chunks l, l + L, ... (a prefill's chunks run in parallel, decode has
                   L = 1); partials (m, l, acc) or, with S == 1, the output.
- `_reduce_kernel` grid (N, H): merges the S partials of one (token, head), head_sink, V output scale,
                   V un-rotation; writes the output (T) and, for qk_output 2, the final (M, L).
- `_probs_kernel`  grid (H * N, cdiv(C, BLOCK)): raw scores -> probabilities exp(s - M) / L (-inf -> 0).

Scores run in the log2 domain (exp2, the softmax scale times log2(e) folded in); m is kept in that domain.
Storage codes (common.FMT_*): 0 float, 1 int8, 2 fp8 e4m3, 3 int4; scale modes 0 none, 1 tensor, 2 channel,
3 token. Only Triton APIs that 3.6 and 3.8 both have.
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._rope_quant import hadamard_tile
from .common import mma as _dot
from .common import pdl_gate

LOG2E = tl.constexpr(1.4426950408889634)  # a constexpr: compiled kernels read no plain globals


@triton.jit
def _tanh(x):
    e = tl.exp2(x * 2.8853900817779268)  # exp(2x)
    return 1.0 - 2.0 / (e + 1.0)


# Packed conversions of cache codes to float16, four codes per 32-bit register (GPU only). Each is elementwise
# inline asm marked impure, so Triton keeps it in the load's layout: the tile converts in registers and goes to
# shared memory as float16. (A pure conversion, asm or plain integer ops, is moved behind the shared-memory round
# trip into the dot operand's layout, where a V tile, reduced over its rows, is read back one byte per load.)
# int8: the offset-binary byte (x ^ 0x80 = x + 128) into the low mantissa byte of 1024.0 by one byte permute per
# two codes, then 1024 + 128 off by one packed subtraction; int4: the masked nibble likewise, 1024 + 8 off.
def _byte_asm(prep: str, offset: str) -> tl.constexpr:
    """Four byte codes in $2 -> four float16 in $0, $1: `prep` leaves each code's unsigned value in u's bytes, each
    byte goes under 1024.0's exponent byte (0x64), then `offset` (1024 + the code's bias, twice) is subtracted."""
    return tl.constexpr("{\n    .reg .b32 u, m;\n    " + prep + "\n"
                        "    prmt.b32 $0, u, 0x64646464, 0x4140;\n    prmt.b32 $1, u, 0x64646464, 0x4342;\n"
                        "    mov.b32 m, " + offset + ";\n    sub.f16x2 $0, $0, m;\n    sub.f16x2 $1, $1, m;\n    }")


_ASM_I8 = _byte_asm("xor.b32 u, $2, 0x80808080;", "0x64806480")  # int8 x: x ^ 0x80 = x + 128
_ASM_I4_LO = _byte_asm("and.b32 u, $2, 0x0F0F0F0F;", "0x64086408")  # nibble n = code + 8
_ASM_I4_HI = _byte_asm("shr.b32 u, $2, 4;\n    and.b32 u, u, 0x0F0F0F0F;", "0x64086408")
_ASM_FP8 = tl.constexpr("""{
    .reg .b16 lo, hi;
    mov.b32 {lo, hi}, $2;
    cvt.rn.f16x2.e4m3x2 $0, lo;
    cvt.rn.f16x2.e4m3x2 $1, hi;
    }""")


@triton.jit
def _asm_f16(x, ASM: tl.constexpr):
    return tl.inline_asm_elementwise(asm=ASM, constraints="=r,=r,r", args=[x], dtype=tl.float16, is_pure=False,
                                     pack=4)


@triton.jit
def _values(x, FMT: tl.constexpr, HIGH: tl.constexpr, DT: tl.constexpr, INTERP: tl.constexpr,
            ASM: tl.constexpr = False):
    """Loaded cache values -> DT (float16 / bfloat16; float caches pass through): codes are exact in DT, so
    this is exact. ASM (GPU, DT float16): the packed conversions above. Otherwise integer codes skip the
    integer-to-float unit (I2F is 16 lanes / clock / SM on Hopper, which made quantized decode compute-bound):
    the code goes into a float's mantissa by bit operations and the exponent's offset is subtracted (fp16 0x6400 =
    1024, fp32 0x4B000000 = 2**23). int4 (float16 only: the decode kernel's quantized dots run in float16): the
    low (HIGH False) or high nibble, minus 8; int8 as bfloat16 (the MLA kernel) goes through float32 (bf16 holds
    only 128 integers at one exponent). The interpreter (no bfloat16 arithmetic) converts plainly."""
    if ASM and FMT != 0 and DT == tl.float16 and not INTERP:
        if FMT == 1:
            return _asm_f16(x, _ASM_I8)
        elif FMT == 2:
            return _asm_f16(x, _ASM_FP8)
        elif HIGH:
            return _asm_f16(x, _ASM_I4_HI)
        else:
            return _asm_f16(x, _ASM_I4_LO)
    elif FMT == 3:
        tl.static_assert(DT == tl.float16, "int4 codes convert to float16 only")
        xi = x.to(tl.int16)  # uint8 zero-extended
        if HIGH:
            n = (xi >> 4) & 15
        else:
            n = xi & 15
        return (n | 0x6400).to(tl.float16, bitcast=True) - 1032.0  # 1024 + n - 1032 = n - 8
    elif FMT == 2:  # fp8 e4m3 cache loaded through a uint8 view (defined zero fill for masked lanes)
        if INTERP:
            return x.to(tl.float8e4nv, bitcast=True).to(tl.float32).to(DT)
        else:
            return x.to(tl.float8e4nv, bitcast=True).to(DT)
    elif FMT == 1:
        if DT == tl.float16:
            u = x.to(tl.int16) + 128  # 0 .. 255
            return (u | 0x6400).to(tl.float16, bitcast=True) - 1152.0  # 1024 + x + 128 - 1152 = x
        elif INTERP:
            return x.to(tl.float32).to(DT)
        else:
            u = x.to(tl.int32) + 128
            return ((u | 0x4B000000).to(tl.float32, bitcast=True) - 8388736.0).to(DT)  # 2**23 + 128
    else:
        return x


@triton.jit
def _dot_i8(a, b, INTERP: tl.constexpr):
    """int8 x int8 -> float32 through the integer tensor cores (int32 accumulation: exact); the interpreter
    multiplies in float32 (exact too: |sum| <= 127 * 127 * 256 < 2**24)."""
    if INTERP:
        return tl.dot(a.to(tl.float32), b.to(tl.float32))
    else:
        return tl.dot(a, b, out_dtype=tl.int32).to(tl.float32)


@triton.jit
def _split_i8(x, inv_step):
    """float32 x -> int8 (x1, x2) with x ~ (x1 + x2 / 254) / inv_step, |x * inv_step| <= 127: two int8 digits of
    the value on a grid of step / 254 (rounding error <= step / 508, finer than float16's near the max)."""
    y = x * inv_step
    x1 = tl.floor(y + 0.5)
    x2 = tl.floor((y - x1) * 254.0 + 0.5)
    return x1.to(tl.int8), x2.to(tl.int8)


@triton.jit
def _load_q(q_ptr, q_off, row_ok, ch, ch_ok, ks_ptr, ks_off, SCALED: tl.constexpr):
    """Q rows [BLOCK_M, W] at channels ch as float32; SCALED: times the per-channel K scale."""
    x = tl.load(q_ptr + q_off[:, None] + ch[None, :], mask=row_ok[:, None] & ch_ok[None, :], other=0.0)
    x = x.to(tl.float32)
    if SCALED:
        x = x * tl.load(ks_ptr + ks_off + ch, mask=ch_ok, other=0.0)[None, :]
    return x


@triton.jit
def _hi_lo(x, CT: tl.constexpr, LO: tl.constexpr):
    """float32 x -> CT (hi, lo) with x ~ hi + lo (LO; else lo = hi, unused)."""
    hi = x.to(CT)
    if LO:
        return hi, (x - hi.to(tl.float32)).to(CT)
    else:
        return hi, hi


@triton.jit
def _row_pow2(amax):
    """2 ** (floor(log2(amax)) + 1) > amax per row (1 where amax is 0 or subnormal): an exact row scale."""
    e = (amax.to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
    return tl.where(e > 0, e * 2.0, 1.0)


@triton.jit
def _attn_kernel(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, ksc_ptr, vsc_ptr,
        csl_ptr, past_ptr, bt_ptr, qpos_ptr, sink_ptr, bias_ptr,
        out_ptr, wacc_ptr, wml_ptr, qk_ptr,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh,
        stride_kscb, stride_kscs, stride_ksch, stride_vscb, stride_vscs, stride_vsch, stride_btb,
        stride_bb, stride_bh, stride_bq, stride_bk, bias_qcap, bias_kcap, stride_kz, stride_vz, kv_cap, row_pad,
        N, NB, MB, num_splits, n_lanes, sm_scale, softcap, window,
        H: tl.constexpr, G: tl.constexpr, G_TILE: tl.constexpr, N_SUB: tl.constexpr,
        Q_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
        D: tl.constexpr, KW: tl.constexpr, KW_PAD: tl.constexpr,
        DV: tl.constexpr, VW: tl.constexpr, VW_PAD: tl.constexpr,
        K_FMT: tl.constexpr, K_SCALE: tl.constexpr, V_FMT: tl.constexpr, V_SCALE: tl.constexpr,
        CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr, HAS_SOFTCAP: tl.constexpr, HAS_BIAS: tl.constexpr,
        HAS_SINK: tl.constexpr, QK_MODE: tl.constexpr, HAS_QPOS: tl.constexpr, DIRECT: tl.constexpr,
        NEED_NAT: tl.constexpr, INTERP: tl.constexpr, LANES: tl.constexpr, PADDED: tl.constexpr,
        BIAS_AFTER: tl.constexpr, I8_QK: tl.constexpr = False, I8_PV: tl.constexpr = False,
        ASM_K: tl.constexpr = False, ASM_V: tl.constexpr = False, Q_POW2: tl.constexpr = False,
        PDL: tl.constexpr = 0):
    if PDL:
        pdl_gate(PDL)
    DT = q_ptr.dtype.element_ty
    # the dots' operand type per side: quantized codes (int8 / fp8 / int4, all exact in float16) run in float16 also
    # under bfloat16 queries (q by an exact power-of-two row scale into float16's range: bf16's 8 mantissa bits fit
    # in fp16's 11; p in [0, 1] keeps 3 more bits than in bfloat16), float caches in T
    if K_FMT == 0:
        KT = DT
    else:
        KT = tl.float16
    if V_FMT == 0:
        VT = DT
    else:
        VT = tl.float16  # (Q_POW2: K quantized, q in bfloat16)
    b = tl.program_id(0)
    kvh = tl.program_id(1) // N_SUB
    sub = tl.program_id(1) % N_SUB
    if LANES:  # grid axis 2 = lane * S + split; this program's query chunks are lane, lane + n_lanes, ...
        s = tl.program_id(2) % num_splits
        c_first = tl.program_id(2) // num_splits
        c_step = n_lanes
    else:  # decode: the axis is the split and the chunk loop unit-stride, the code as before lanes (an H200
        # decode row ran 30% slower when the split index was derived through % num_splits)
        s = tl.program_id(2)
        c_first = 0
        c_step = 1
    C = MB * BS

    if PADDED:  # GroupQueryAttention's padded batch: sequence b's rows start at b * row_pad, csl holds n_q [B]
        q_start = b * row_pad
        n_q = tl.minimum(tl.maximum(tl.load(csl_ptr + b).to(tl.int32), 0), row_pad)
    else:
        q_start = tl.load(csl_ptr + b).to(tl.int32)
        n_q = tl.load(csl_ptr + b + 1).to(tl.int32) - q_start
    past = tl.load(past_ptr + b).to(tl.int32)
    kv_len = tl.minimum(tl.maximum(past + n_q, 0), kv_cap)  # clamped to the cache's capacity

    r = tl.arange(0, BLOCK_M)
    g = sub * G_TILE + r % G_TILE
    h = kvh * G + g
    head_ok = g < G
    jr = r // G_TILE
    h64 = h.to(tl.int64)

    kw = tl.arange(0, KW_PAD)
    kw_ok = kw < KW
    vw = tl.arange(0, VW_PAD)
    vw_ok = vw < VW
    if K_FMT == 3:
        kch = kw * 2
    else:
        kch = kw
    if V_FMT == 3:
        vch = vw * 2
    else:
        vch = vw
    qk_scale = sm_scale
    if K_SCALE == 1:
        qk_scale = sm_scale * tl.load(ks_ptr)  # PER_TENSOR: float32 [1]
    if HAS_SINK:
        sink2 = tl.load(sink_ptr + h, mask=head_ok, other=0.0).to(tl.float32) * LOG2E
    if DIRECT:
        if V_SCALE == 1:  # PER_TENSOR: float32 [1]
            vsa = tl.zeros([VW_PAD], tl.float32) + tl.load(vs_ptr)
            vsb = vsa
        elif V_SCALE == 2:
            vsa = tl.load(vs_ptr + kvh * D + vch, mask=vw_ok, other=0.0)
            vsb = tl.load(vs_ptr + kvh * D + vch + 1, mask=vw_ok, other=0.0)
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    k_head = kvh.to(tl.int64) * stride_kh + b.to(tl.int64) * stride_kz  # stride_kz: the BNSH accessor's batch
    v_head = kvh.to(tl.int64) * stride_vh + b.to(tl.int64) * stride_vz

    for c in range(c_first, tl.cdiv(n_q, Q_CHUNK), c_step):
        j = c * Q_CHUNK + jr
        t = q_start + j
        row_ok = head_ok & (j < n_q) & (t < N) & (t >= 0)
        t64 = t.to(tl.int64)
        if HAS_QPOS:
            pos = tl.load(qpos_ptr + t64, mask=row_ok, other=0).to(tl.int32)
        else:
            pos = past + j
        # this chunk's key range [lo, hi), then split s's share of its tiles
        if CAUSAL:
            hi = tl.minimum(kv_len, tl.max(tl.where(row_ok, pos, -1), 0) + 1)
        else:
            hi = kv_len
        lo = 0
        if HAS_WINDOW:
            lo = tl.maximum(tl.min(tl.where(row_ok, pos, 2147483647 - window), 0) - window + 1, 0)
        t_lo = lo // BLOCK_N
        t_hi = tl.cdiv(hi, BLOCK_N)
        per = tl.cdiv(tl.maximum(t_hi - t_lo, 0), num_splits)
        it0 = t_lo + s * per
        it1 = tl.minimum(it0 + per, t_hi)

        q_off = t64 * stride_qt + h64 * stride_qh
        xa = _load_q(q_ptr, q_off, row_ok, kch, kw_ok, ks_ptr, kvh * D, K_SCALE == 2)
        if K_FMT == 3:
            xb = _load_q(q_ptr, q_off, row_ok, kch + 1, kw_ok, ks_ptr, kvh * D, K_SCALE == 2)
        if Q_POW2:  # bfloat16 q to float16 dots: rows scaled into [-1, 1] by a power of two, undone on the scores
            qmax = tl.max(tl.abs(xa), 1)
            if K_FMT == 3:
                qmax = tl.maximum(qmax, tl.max(tl.abs(xb), 1))
            q_pow = _row_pow2(qmax)
            xa = xa * (1.0 / q_pow)[:, None]
            if K_FMT == 3:
                xb = xb * (1.0 / q_pow)[:, None]
        qa, qa_lo = _hi_lo(xa, KT, K_SCALE == 2)
        if K_FMT == 3:
            qb, qb_lo = _hi_lo(xb, KT, K_SCALE == 2)
        if I8_QK:  # int8 keys: q (with a PER_CHANNEL K scale) as two int8 digits per row, int8 dots on the codes
            qf = xa
            amax = tl.max(tl.abs(qf), 1)
            s_q = tl.where(amax > 0, amax / 127.0, 1.0)
            q1, q2 = _split_i8(qf, 1.0 / s_q[:, None])
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc_a = tl.zeros([BLOCK_M, VW_PAD], tl.float32)
        acc_b = tl.zeros([BLOCK_M, VW_PAD], tl.float32)
        for it in range(it0, it1):
            kp = it * BLOCK_N + tl.arange(0, BLOCK_N)
            pos_ok = kp < kv_len
            if BLOCK_N <= BS:  # the tile lies in one block
                blk = tl.load(bt_row + (it * BLOCK_N) // BS)
            else:  # a per-token block vector
                blk = tl.load(bt_row + kp // BS, mask=pos_ok, other=-1)
            mapped = (blk >= 0) & (blk < NB)
            kvalid = pos_ok & mapped
            blk = tl.where(mapped, blk, 0).to(tl.int64)
            off = (kp % BS).to(tl.int64)

            k_off = blk * stride_kb + off * stride_ks + k_head
            kt = tl.load(k_ptr + k_off[None, :] + kw[:, None], mask=kvalid[None, :] & kw_ok[:, None], other=0)
            if I8_QK:
                raw = (_dot_i8(q1, kt, INTERP) + _dot_i8(q2, kt, INTERP) * (1.0 / 254.0)) * s_q[:, None]
            else:
                kta = _values(kt, K_FMT, False, KT, INTERP, ASM_K)
                raw = _dot(qa, kta, tl.zeros([BLOCK_M, BLOCK_N], tl.float32), INTERP)
                if K_SCALE == 2:
                    raw = _dot(qa_lo, kta, raw, INTERP)
            if K_FMT == 3:
                ktb = _values(kt, K_FMT, True, KT, INTERP, ASM_K)
                raw = _dot(qb, ktb, raw, INTERP)
                if K_SCALE == 2:
                    raw = _dot(qb_lo, ktb, raw, INTERP)
            if Q_POW2:
                raw = raw * q_pow[:, None]
            if K_SCALE == 3:
                ksc = tl.load(ksc_ptr + blk * stride_kscb + off * stride_kscs + kvh * stride_ksch,
                              mask=kvalid, other=0.0).to(tl.float32)
                raw = raw * ksc[None, :]
            allowed = row_ok[:, None] & kvalid[None, :]
            if CAUSAL:
                allowed = allowed & (kp[None, :] <= pos[:, None])
            if HAS_WINDOW:
                allowed = allowed & (kp[None, :] >= pos[:, None] - window + 1)
            if NEED_NAT:
                sc = raw * qk_scale
                if HAS_BIAS:
                    b_ptr = (bias_ptr + b.to(tl.int64) * stride_bb + h64[:, None] * stride_bh
                             + j.to(tl.int64)[:, None] * stride_bq + kp.to(tl.int64)[None, :] * stride_bk)
                    b_ok = (row_ok & (j < bias_qcap))[:, None] & (kp < bias_kcap)[None, :]
                    bias = tl.load(b_ptr, mask=b_ok, other=0.0).to(tl.float32)
                    if not BIAS_AFTER:  # PagedAttention: bias before softcap
                        sc += bias
                if HAS_SOFTCAP:
                    sc = softcap * _tanh(sc / softcap)
                if HAS_BIAS:
                    if BIAS_AFTER:  # GroupQueryAttention (onnxruntime): bias after softcap
                        sc += bias
                if QK_MODE != 0:
                    if QK_MODE == 1:
                        qv = tl.where(allowed, sc, 0.0)
                    else:
                        qv = tl.where(allowed, sc, float("-inf"))
                    qk_p = qk_ptr + (h64[:, None] * N + t64[:, None]) * C + kp[None, :]
                    tl.store(qk_p, qv, mask=row_ok[:, None] & (kp < C)[None, :])
                s2 = sc * LOG2E
            else:
                s2 = raw * (qk_scale * LOG2E)
            s2 = tl.where(allowed, s2, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s2, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s2 - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new

            v_off = blk * stride_vb + off * stride_vs + v_head
            vt = tl.load(v_ptr + v_off[:, None] + vw[None, :], mask=kvalid[:, None] & vw_ok[None, :], other=0)
            if not I8_PV:
                vta = _values(vt, V_FMT, False, VT, INTERP, ASM_V)
            if V_FMT == 3:
                vtb = _values(vt, V_FMT, True, VT, INTERP, ASM_V)
            if I8_PV:  # int8 values: p (in [0, 1], times a PER_TOKEN scale / the tile's largest) as two int8 digits
                pw = p
                if V_SCALE == 3:
                    vsc = tl.load(vsc_ptr + blk * stride_vscb + off * stride_vscs + kvh * stride_vsch,
                                  mask=kvalid, other=0.0).to(tl.float32)
                    vmax = tl.max(tl.abs(vsc), 0)
                    pw = p * (vsc / tl.where(vmax > 0, vmax, 1.0))[None, :]
                p1, p2 = _split_i8(pw, 127.0)
                pv_acc = (_dot_i8(p1, vt, INTERP) + _dot_i8(p2, vt, INTERP) * (1.0 / 254.0)) * (1.0 / 127.0)
                if V_SCALE == 3:
                    pv_acc = pv_acc * vmax
                acc_a = acc_a * alpha[:, None] + pv_acc
            elif V_SCALE == 3:  # per-key V scales into p, normalized by the tile's largest (fp16 range)
                vsc = tl.load(vsc_ptr + blk * stride_vscb + off * stride_vscs + kvh * stride_vsch,
                              mask=kvalid, other=0.0).to(tl.float32)
                vmax = tl.max(tl.abs(vsc), 0)
                pv = (p * (vsc / tl.where(vmax > 0, vmax, 1.0))[None, :]).to(VT)
                zero = tl.zeros([BLOCK_M, VW_PAD], tl.float32)
                acc_a = acc_a * alpha[:, None] + _dot(pv, vta, zero, INTERP) * vmax
                if V_FMT == 3:
                    acc_b = acc_b * alpha[:, None] + _dot(pv, vtb, zero, INTERP) * vmax
            else:
                pv = p.to(VT)
                acc_a = _dot(pv, vta, acc_a * alpha[:, None], INTERP)
                if V_FMT == 3:
                    acc_b = _dot(pv, vtb, acc_b * alpha[:, None], INTERP)

        if DIRECT:  # S == 1: normalize here and write T
            l_f = l_i
            if HAS_SINK:
                m_f = tl.maximum(m_i, sink2)
                m_f = tl.where(m_f == float("-inf"), 0.0, m_f)
                f = tl.exp2(m_i - m_f)
                l_f = l_i * f + tl.exp2(sink2 - m_f)
                inv = tl.where(l_f > 0, f / tl.where(l_f > 0, l_f, 1.0), 0.0)
            else:
                inv = tl.where(l_f > 0, 1.0 / tl.where(l_f > 0, l_f, 1.0), 0.0)
            o_a = acc_a * inv[:, None]
            if V_SCALE == 1 or V_SCALE == 2:
                o_a = o_a * vsa[None, :]
            o_ptr = out_ptr + t64[:, None] * (H * DV) + h64[:, None] * DV + vch[None, :]
            o_ok = row_ok[:, None] & vw_ok[None, :]
            tl.store(o_ptr, o_a.to(DT), mask=o_ok)
            if V_FMT == 3:
                o_b = acc_b * inv[:, None]
                if V_SCALE == 1 or V_SCALE == 2:
                    o_b = o_b * vsb[None, :]
                tl.store(o_ptr + 1, o_b.to(DT), mask=o_ok)
        else:  # partials to the workspace [N, H, S, DV] / [N, H, S, 2]
            base = (t64 * H + h64) * num_splits + s
            w_ptr = wacc_ptr + base[:, None] * DV + vch[None, :]
            w_ok = row_ok[:, None] & vw_ok[None, :]
            tl.store(w_ptr, acc_a, mask=w_ok)
            if V_FMT == 3:
                tl.store(w_ptr + 1, acc_b, mask=w_ok)
            tl.store(wml_ptr + base * 2, m_i, mask=row_ok)
            tl.store(wml_ptr + base * 2 + 1, l_i, mask=row_ok)


@triton.jit
def _reduce_kernel(wacc_ptr, wml_ptr, sink_ptr, vs_ptr, out_ptr, mlf_ptr, num_splits, inv_sqrt_dv,
                   H: tl.constexpr, G: tl.constexpr, D: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
                   S_BLOCK: tl.constexpr, ROT_J: tl.constexpr, HAS_SINK: tl.constexpr, V_SCALE: tl.constexpr,
                   ROTATE: tl.constexpr, STORE_ML: tl.constexpr, PDL: tl.constexpr = 0):
    if PDL:
        pdl_gate(PDL)
    t = tl.program_id(0).to(tl.int64)
    h = tl.program_id(1)
    base = (t * H + h) * num_splits
    so = tl.arange(0, S_BLOCK)
    d = tl.arange(0, DV_PAD)
    d_ok = d < DV
    m_vec = tl.full([S_BLOCK], float("-inf"), tl.float32)
    for s0 in range(0, num_splits, S_BLOCK):
        m = tl.load(wml_ptr + (base + s0 + so) * 2, mask=s0 + so < num_splits, other=float("-inf"))
        m_vec = tl.maximum(m_vec, m)
    mx = tl.max(m_vec, 0)
    if HAS_SINK:
        sink2 = tl.load(sink_ptr + h).to(tl.float32) * LOG2E
        mx = tl.maximum(mx, sink2)
    mx = tl.where(mx == float("-inf"), 0.0, mx)
    l_vec = tl.zeros([S_BLOCK], tl.float32)
    acc = tl.zeros([S_BLOCK, DV_PAD], tl.float32)
    for s0 in range(0, num_splits, S_BLOCK):
        s_ok = s0 + so < num_splits
        m = tl.load(wml_ptr + (base + s0 + so) * 2, mask=s_ok, other=float("-inf"))
        l = tl.load(wml_ptr + (base + s0 + so) * 2 + 1, mask=s_ok, other=0.0)
        w = tl.exp2(m - mx)
        l_vec += l * w
        a = tl.load(wacc_ptr + (base + s0 + so)[:, None] * DV + d[None, :], mask=s_ok[:, None] & d_ok[None, :],
                    other=0.0)
        acc += a * w[:, None]
    den = tl.sum(l_vec, 0)
    if HAS_SINK:
        den += tl.exp2(sink2 - mx)
    o = tl.sum(acc, 0) * tl.where(den > 0, 1.0 / tl.where(den > 0, den, 1.0), 0.0)
    if V_SCALE == 1:  # PER_TENSOR: float32 [1]
        o = o * tl.load(vs_ptr)
    elif V_SCALE == 2:
        o = o * tl.load(vs_ptr + (h // G) * D + d, mask=d_ok, other=0.0)
    o_ptr = out_ptr + t * (H * DV) + h * DV
    if ROTATE:  # o @ H_n / sqrt(n), H_n[i, j] = (-1)^popcount(i & j) (Sylvester), built in registers
        for j0 in tl.static_range(0, DV_PAD, ROT_J):
            jj = j0 + tl.arange(0, ROT_J)
            oj = tl.sum(o[:, None] * hadamard_tile(d, jj, DV), 0) * inv_sqrt_dv
            tl.store(o_ptr + jj, oj.to(out_ptr.dtype.element_ty), mask=jj < DV)
    else:
        tl.store(o_ptr + d, o.to(out_ptr.dtype.element_ty), mask=d_ok)
    if STORE_ML:
        tl.store(mlf_ptr + (t * H + h) * 2, mx)
        tl.store(mlf_ptr + (t * H + h) * 2 + 1, den)


@triton.jit
def _probs_kernel(qk_ptr, mlf_ptr, N, C, H: tl.constexpr, BLOCK: tl.constexpr):
    row = tl.program_id(0).to(tl.int64)  # h * N + t
    h = row // N
    t = row % N
    mx = tl.load(mlf_ptr + (t * H + h) * 2)
    den = tl.load(mlf_ptr + (t * H + h) * 2 + 1)
    c = tl.program_id(1).to(tl.int64) * BLOCK + tl.arange(0, BLOCK)
    ok = c < C
    sc = tl.load(qk_ptr + row * C + c, mask=ok, other=float("-inf"))
    keep = sc != float("-inf")
    inv = tl.where(den > 0, 1.0 / tl.where(den > 0, den, 1.0), 0.0)
    p = tl.exp2(tl.where(keep, sc * LOG2E - mx, 0.0)) * inv
    tl.store(qk_ptr + row * C + c, tl.where(keep, p, 0.0), mask=ok)
