"""Decode attention with swapped dot operands for small query-head groups (launcher: decode.py, `swap_serves`).

One query token per sequence, a group of G <= 8 query heads per KV head. The general kernel (`_attn_kernel`)
puts the group's heads on the rows of its dots, padded to the tensor cores' 16 rows (G = 4: 3/4 of every
product, every softmax element and every accumulator register is padding). Here the keys are the rows and the
heads the columns, padded only to the 8 columns of an m16n8 product:

    scores^T [BLOCK_N, GP] = K_tile [BLOCK_N, D] @ q^T [D, GP]          (keys x heads)
    acc^T    [DV, GP]     += V_tile^T [DV, BLOCK_N] @ p^T [BLOCK_N, GP]  (channels x heads)

GP = the group padded to a power of two >= 8 (masked). Same grid, tile walk, log2-domain online softmax and
partials layout as `_attn_kernel` (grid (B, Hkv, S): split s of S takes tiles [s * ceil(T / S), ...) of the
sequence's T key tiles; with S == 1 the program normalizes and writes the output, else `_reduce_kernel` merges
[N, H, S, DV] / [N, H, S, 2]). Caches: float (T), int8 or fp8 codes (converted to float16 in registers, exact)
with no / PER_TENSOR / PER_CHANNEL scales (PER_CHANNEL K folded into q, V's applied to the output). Both
accessors: paged (block table) and GroupQueryAttention's contiguous one (stride_kz / stride_vz, PADDED rows).
No softcap, window, sink, bias, output_qk, query_positions, rotation, int4 or PER_TOKEN scales: those calls
take `_attn_kernel` (decode.swap_serves says which)."""

from __future__ import annotations

import triton
import triton.language as tl

from ._decode_kernels import LOG2E, _dot, _values
from .common import pdl_gate


@triton.jit
def _swap_decode_kernel(
        q_ptr, k_ptr, v_ptr, ks_ptr, vs_ptr, csl_ptr, past_ptr, bt_ptr, out_ptr, wacc_ptr, wml_ptr,
        stride_qt, stride_qh, stride_kb, stride_ks, stride_kh, stride_vb, stride_vs, stride_vh, stride_btb,
        stride_kz, stride_vz, kv_cap, row_pad, N, NB, num_splits, sm_scale,
        H: tl.constexpr, G: tl.constexpr, GP: tl.constexpr, BLOCK_N: tl.constexpr, BS: tl.constexpr,
        D: tl.constexpr, D_PAD: tl.constexpr, DV: tl.constexpr, DV_PAD: tl.constexpr,
        K_FMT: tl.constexpr, K_SCALE: tl.constexpr, V_FMT: tl.constexpr, V_SCALE: tl.constexpr,
        PADDED: tl.constexpr, CAUSAL: tl.constexpr, DIRECT: tl.constexpr, INTERP: tl.constexpr, ASM: tl.constexpr, PDL: tl.constexpr = 0):
    if PDL:
        pdl_gate(PDL)
    DT = q_ptr.dtype.element_ty
    if K_FMT == 0:
        KT = DT
    else:
        KT = tl.float16
    if V_FMT == 0:
        VT = DT
    else:
        VT = tl.float16
    b = tl.program_id(0)
    kvh = tl.program_id(1)
    s = tl.program_id(2)
    if PADDED:  # GroupQueryAttention's padded batch: sequence b's rows from b * row_pad, csl holds n_q [B]
        q_start = b * row_pad
        n_q = tl.minimum(tl.maximum(tl.load(csl_ptr + b).to(tl.int32), 0), row_pad)
    else:
        q_start = tl.load(csl_ptr + b).to(tl.int32)
        n_q = tl.load(csl_ptr + b + 1).to(tl.int32) - q_start
    past = tl.load(past_ptr + b).to(tl.int32)
    kv_all = tl.minimum(tl.maximum(past + n_q, 0), kv_cap)  # the sequence's extent, clamped to the capacity

    g = tl.arange(0, GP)
    h64 = (kvh * G + g).to(tl.int64)
    d = tl.arange(0, D_PAD)
    d_ok = d < D
    dv = tl.arange(0, DV_PAD)
    dv_ok = dv < DV

    bt_row = bt_ptr + b.to(tl.int64) * stride_btb
    k_head = kvh.to(tl.int64) * stride_kh + b.to(tl.int64) * stride_kz
    v_head = kvh.to(tl.int64) * stride_vh + b.to(tl.int64) * stride_vz
    # one query token per sequence in decode; more (a wrong host bound) are served one after another, exactly
    for j in range(0, n_q):
        t = q_start + j
        t64 = t.to(tl.int64)
        head_ok = (g < G) & (t < N) & (t >= 0)
        if CAUSAL:
            kv_len = tl.minimum(tl.maximum(past + j + 1, 0), kv_all)
        else:
            kv_len = kv_all
        # q^T [D_PAD, GP] (a PER_CHANNEL K scale folded in), in the dots' type
        qt = tl.load(q_ptr + t64 * stride_qt + h64[None, :] * stride_qh + d[:, None],
                     mask=head_ok[None, :] & d_ok[:, None], other=0.0).to(tl.float32)
        if K_SCALE == 2:
            qt = qt * tl.load(ks_ptr + kvh * D + d, mask=d_ok, other=0.0)[:, None]
        qk_scale = sm_scale * LOG2E
        if K_SCALE == 1:
            qk_scale = qk_scale * tl.load(ks_ptr + kvh * D)
        if K_FMT != 0 and DT == tl.bfloat16:  # float16 dots on the codes: q into float16's range by a power of two
            e = (tl.max(tl.max(tl.abs(qt), 1), 0).to(tl.int32, bitcast=True) & 0x7F800000).to(tl.float32, bitcast=True)
            q_pow = tl.where(e > 0, e * 2.0, 1.0)
            qt = qt * (1.0 / q_pow)
            qk_scale = qk_scale * q_pow
        qt = qt.to(KT)

        t_hi = tl.cdiv(kv_len, BLOCK_N)
        per = tl.cdiv(t_hi, num_splits)
        it0 = s * per
        it1 = tl.minimum(it0 + per, t_hi)

        m_i = tl.full([GP], float("-inf"), tl.float32)
        l_i = tl.zeros([GP], tl.float32)
        acc = tl.zeros([DV_PAD, GP], tl.float32)  # acc^T: channels x heads
        for it in range(it0, it1):
            kp = it * BLOCK_N + tl.arange(0, BLOCK_N)
            pos_ok = kp < kv_len
            if BLOCK_N <= BS:
                blk = tl.load(bt_row + (it * BLOCK_N) // BS)
            else:
                blk = tl.load(bt_row + kp // BS, mask=pos_ok, other=-1)
            mapped = (blk >= 0) & (blk < NB)
            kvalid = pos_ok & mapped
            blk = tl.where(mapped, blk, 0).to(tl.int64)
            off = (kp % BS).to(tl.int64)

            k_off = blk * stride_kb + off * stride_ks + k_head
            kt = tl.load(k_ptr + k_off[:, None] + d[None, :], mask=kvalid[:, None] & d_ok[None, :], other=0)
            s2 = _dot(_values(kt, K_FMT, False, KT, INTERP, ASM), qt, tl.zeros([BLOCK_N, GP], tl.float32), INTERP)
            s2 = tl.where(kvalid[:, None], s2 * qk_scale, float("-inf"))  # [BLOCK_N, GP], log2 domain
            m_new = tl.maximum(m_i, tl.max(s2, 0))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s2 - m_safe[None, :])
            l_i = l_i * alpha + tl.sum(p, 0)
            m_i = m_new

            v_off = blk * stride_vb + off * stride_vs + v_head
            vt = tl.load(v_ptr + v_off[None, :] + dv[:, None], mask=kvalid[None, :] & dv_ok[:, None], other=0)
            acc = _dot(_values(vt, V_FMT, False, VT, INTERP, ASM), p.to(VT), acc * alpha[None, :], INTERP)

        if DIRECT:  # one split: normalize and write T [N, H * DV]
            inv = tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)
            o = acc * inv[None, :]
            if V_SCALE == 1 or V_SCALE == 2:
                o = o * tl.load(vs_ptr + kvh * D + dv, mask=dv_ok, other=0.0)[:, None]
            o_ptr = out_ptr + t64 * (H * DV) + h64[None, :] * DV + dv[:, None]
            tl.store(o_ptr, o.to(DT), mask=head_ok[None, :] & dv_ok[:, None])
        else:  # partials [N, H, S, DV] / [N, H, S, 2] for _reduce_kernel
            base = (t64 * H + h64) * num_splits + s
            tl.store(wacc_ptr + base[None, :] * DV + dv[:, None], acc, mask=head_ok[None, :] & dv_ok[:, None])
            tl.store(wml_ptr + base * 2, m_i, mask=head_ok)
            tl.store(wml_ptr + base * 2 + 1, l_i, mask=head_ok)
