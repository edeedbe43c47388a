"""The @triton.jit kernel of the fused MLA (LATENT) attention (launcher, layouts and heuristics: mla.py).

`_mla_kernel` grid (B, N_SUB, S): one program per (sequence, head sub-group of G_TILE query heads, split).
The latent cache row of a key is [DL latent channels | DR rope channels] (DeepSeek: 512 | 64, one KV head);
each KV tile [BLOCK_N, DL] of latent channels is loaded once and serves both products: scores =
q_latent @ c^T + q_rope @ k_rope^T (two dots, no padding of 576 to 1024) and acc += p @ c (V is the leading DL
channels of the same tile). Rows = query tokens x heads of the sub-group (a decode step: one token, every head;
a few speculative tokens: Q_CHUNK of them per chunk). Partials (m in the log2 domain, l, unnormalized acc) go to
the fp32 workspace [N, H, S, DL] / [N, H, S, 2] that _decode_kernels._reduce_kernel merges; with S == 1 the
program writes the output itself. Storage codes (common.FMT_*): 0 float, 1 int8, 2 fp8 e4m3 (through a uint8
view); scales: 0 none, 1 tensor (one scale for K and V: the scores and the output), 3 token (per key: the
scores, and p for V, normalized by the tile's largest scale).
"""

from __future__ import annotations

import triton
import triton.language as tl

from ._decode_kernels import LOG2E, _values
from .common import mma as _dot


@triton.jit
def _mla_kernel(
        q_ptr, c_ptr, ks_ptr, ksc_ptr, csl_ptr, past_ptr, bt_ptr, qpos_ptr, out_ptr, wacc_ptr, wml_ptr,
        stride_qt, stride_qh, stride_cb, stride_cs, stride_kscb, stride_kscs, stride_btb,
        N, NB, MB, num_splits, sm_scale, window,
        H: tl.constexpr, G_TILE: tl.constexpr, Q_CHUNK: tl.constexpr, BLOCK_M: tl.constexpr,
        BLOCK_N: tl.constexpr, BS: tl.constexpr, DL: tl.constexpr, DR: tl.constexpr,
        FMT: tl.constexpr, SCALE: tl.constexpr, CAUSAL: tl.constexpr, HAS_WINDOW: tl.constexpr,
        HAS_QPOS: tl.constexpr, DIRECT: tl.constexpr, INTERP: tl.constexpr):
    DT = q_ptr.dtype.element_ty
    b = tl.program_id(0)
    sub = tl.program_id(1)
    s = tl.program_id(2)
    C = MB * BS

    q_start = tl.load(csl_ptr + b).to(tl.int32)
    n_q = tl.load(csl_ptr + b + 1).to(tl.int32) - q_start
    past = tl.load(past_ptr + b).to(tl.int32)
    kv_len = tl.minimum(tl.maximum(past + n_q, 0), C)  # clamped to the block table's capacity

    r = tl.arange(0, BLOCK_M)
    h = sub * G_TILE + r % G_TILE
    head_ok = h < H
    jr = r // G_TILE
    h64 = h.to(tl.int64)
    cl = tl.arange(0, DL)  # latent channels (and V)
    cr = DL + tl.arange(0, DR)  # rope channels
    qk_scale = sm_scale * LOG2E
    if SCALE == 1:
        kscale = tl.load(ks_ptr)
        qk_scale = qk_scale * kscale
    bt_row = bt_ptr + b.to(tl.int64) * stride_btb

    for c in range(0, tl.cdiv(n_q, Q_CHUNK)):
        j = c * Q_CHUNK + jr
        t = q_start + j
        row_ok = head_ok & (j < n_q) & (t < N) & (t >= 0)
        t64 = t.to(tl.int64)
        if HAS_QPOS:
            pos = tl.load(qpos_ptr + t64, mask=row_ok, other=0).to(tl.int32)
        else:
            pos = past + j
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
        q_lat = tl.load(q_ptr + q_off[:, None] + cl[None, :], mask=row_ok[:, None], other=0.0)  # [M, DL]
        q_rope = tl.load(q_ptr + q_off[:, None] + cr[None, :], mask=row_ok[:, None], other=0.0)  # [M, DR]
        m_i = tl.full([BLOCK_M], float("-inf"), tl.float32)
        l_i = tl.zeros([BLOCK_M], tl.float32)
        acc = tl.zeros([BLOCK_M, DL], tl.float32)
        for it in range(it0, it1):
            kp = it * BLOCK_N + tl.arange(0, BLOCK_N)
            pos_ok = kp < kv_len
            if BLOCK_N <= BS:  # the tile lies in one block
                blk = tl.load(bt_row + (it * BLOCK_N) // BS)
            else:
                blk = tl.load(bt_row + kp // BS, mask=pos_ok, other=-1)
            mapped = (blk >= 0) & (blk < NB)
            kvalid = pos_ok & mapped
            blk = tl.where(mapped, blk, 0).to(tl.int64)
            row = blk * stride_cb + (kp % BS).to(tl.int64) * stride_cs  # [BLOCK_N]
            lat = tl.load(c_ptr + row[:, None] + cl[None, :], mask=kvalid[:, None], other=0)  # [N, DL]
            rope = tl.load(c_ptr + row[:, None] + cr[None, :], mask=kvalid[:, None], other=0)  # [N, DR]
            lat = _values(lat, FMT, False, DT, INTERP).to(DT)
            rope = _values(rope, FMT, False, DT, INTERP).to(DT)
            raw = _dot(q_lat, tl.trans(lat), tl.zeros([BLOCK_M, BLOCK_N], tl.float32), INTERP)
            raw = _dot(q_rope, tl.trans(rope), raw, INTERP)
            if SCALE == 3:
                ksc = tl.load(ksc_ptr + blk * stride_kscb + (kp % BS).to(tl.int64) * stride_kscs,
                              mask=kvalid, other=0.0).to(tl.float32)
                raw = raw * ksc[None, :]
            allowed = row_ok[:, None] & kvalid[None, :]
            if CAUSAL:
                allowed = allowed & (kp[None, :] <= pos[:, None])
            if HAS_WINDOW:
                allowed = allowed & (kp[None, :] >= pos[:, None] - window + 1)
            s2 = tl.where(allowed, raw * qk_scale, float("-inf"))
            m_new = tl.maximum(m_i, tl.max(s2, 1))
            m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
            alpha = tl.exp2(m_i - m_safe)
            p = tl.exp2(s2 - m_safe[:, None])
            l_i = l_i * alpha + tl.sum(p, 1)
            m_i = m_new
            if SCALE == 3:  # per-key V scales into p, normalized by the tile's largest (fp16 range)
                vmax = tl.max(tl.abs(ksc), 0)
                pv = (p * (ksc / tl.where(vmax > 0, vmax, 1.0))[None, :]).to(DT)
                acc = acc * alpha[:, None] + _dot(pv, lat, tl.zeros([BLOCK_M, DL], tl.float32), INTERP) * vmax
            else:
                acc = _dot(p.to(DT), lat, acc * alpha[:, None], INTERP)

        if DIRECT:  # S == 1: normalize here and write T
            o = acc * tl.where(l_i > 0, 1.0 / tl.where(l_i > 0, l_i, 1.0), 0.0)[:, None]
            if SCALE == 1:
                o = o * kscale
            o_ptr = out_ptr + t64[:, None] * (H * DL) + h64[:, None] * DL + cl[None, :]
            tl.store(o_ptr, o.to(DT), mask=row_ok[:, None])
        else:  # partials to the workspace [N, H, S, DL] / [N, H, S, 2]
            base = (t64 * H + h64) * num_splits + s
            tl.store(wacc_ptr + base[:, None] * DL + cl[None, :], acc, mask=row_ok[:, None])
            tl.store(wml_ptr + base * 2, m_i, mask=row_ok)
            tl.store(wml_ptr + base * 2 + 1, l_i, mask=row_ok)
