"""GroupQueryAttention's windowed cache (sliding_window_cache=1) on the Triton kernels (called by gqa.py; the
pieces both share are in gqa_common.py).

A windowed present [B, Hkv, C, Dc] of capacity C and window W holds the L(T) most recent positions of entry b
at rows [0, L(T)), onnxruntime 1.32.0's resident count (kernels/gqa/cache.py): G = C - W + 1,
L(T) = T if T <= C else T - G * ceil((T - C) / G). A step of Q_b new rows after P_b = T_b - Q_b cached ones reads
the past as it was (positions [P - L(P), P) at rows [0, L(P))) plus its new rows, then keeps positions
[T - L(T), T).

All on the device, no host reads (capture-safe), in row space (row r of entry b = position P_b - L(P_b) + r; the
causal and window masks only compare positions, so they hold there too):
1. W [B, Hkv, C + S, Dc] = the present's rows, then room for the S new rows;
2. the cache-write prologue writes entry b's valid rows at rows L(P_b) + s of W (RoPE at the absolute positions);
3. the split-KV attention reads W through the BNSH accessor with past = L(P_b), attention_bias shifted to rows;
4. present rows r < L(T_b) = W rows r + (T - L(T)) - (P - L(P)); rows past L(T_b) keep their contents.
Refused: output_qk (its columns are absolute positions).
"""

from __future__ import annotations

from typing import Any

import torch

from ..attention_math import default_scale


def _resident(n: torch.Tensor, cap: int, window: int) -> torch.Tensor:
    """L(n) per entry (int64 [B])."""
    g = cap - window + 1
    return torch.where(n <= cap, n, n - g * torch.div(n - cap + g - 1, g, rounding_mode="floor"))


def _rows(bias: torch.Tensor, first: torch.Tensor, bsz: int, width: int) -> torch.Tensor:
    """attention_bias [B or 1, H or 1, S, K] indexed by absolute key position -> [B, H or 1, S, width] by row
    (row r of entry b = position first[b] + r; 0 beyond K)."""
    kb = bias.shape[3]
    col = first[:, None] + torch.arange(width, device=bias.device)[None, :]  # [B, width]
    ok = col < kb
    idx = col.clamp(max=max(kb - 1, 0))[:, None, None, :].expand(bsz, bias.shape[1], bias.shape[2], width)
    got = torch.gather(bias.expand(bsz, *bias.shape[1:]), 3, idx)
    return torch.where(ok[:, None, None, :], got, torch.zeros((), dtype=bias.dtype, device=bias.device))


def windowed(x: dict, a: dict, *, h: int, hkv: int, d: int, kf, vf, total: int, want) -> dict[str, Any]:
    """The windowed call (module docstring); x / a: gqa.py's inputs and attributes with defaults."""
    from . import ops
    from .gqa_common import _constants, _results, flat_rows, presents, sink, write

    if int(a["qk_output"]):
        raise NotImplementedError("triton_gqa: sliding_window_cache=1 with qk_output is served by the reference")
    window = int(a["local_window_size"])
    if window <= 0:
        raise ValueError(f"attribute 'local_window_size': sliding_window_cache=1 needs a window > 0, got {window}")
    query = x["query"]
    bsz, s, _ = query.shape
    dev = query.device
    past_k = x.get("past_key")
    cap = past_k.shape[2] if past_k is not None else max(window, total)
    if cap < window:
        raise ValueError(f"input 'past_key': a windowed cache holds at least local_window_size = {window} rows, "
                         f"got capacity {cap}")
    present_k, present_v = presents(x, hkv, cap, d, kf, vf)
    dck, dcv = present_k.shape[3], present_v.shape[3]
    c = _constants(dev, bsz, s, hkv * (cap + s))  # c.entry: b * Hkv * (C + S), entry b's first row in W

    # lengths (int64 [B]): T, Q, P; resident counts before (L(P)) and after (L(T)) the step
    t_len = x["seqlens_k"].to(torch.int64) + 1
    q_len = (x["query_seqlens"].to(torch.int64) if "query_seqlens" in x else torch.clamp(t_len, max=s))
    p_len = t_len - q_len
    lp, lt = _resident(p_len, cap, window), _resident(t_len, cap, window)
    first_p, first_t = p_len - lp, t_len - lt

    # 1. the step's window buffers W [B, Hkv, C + S, Dc]
    cw = cap + s
    wk = torch.empty((bsz, hkv, cw, dck), dtype=present_k.dtype, device=dev)
    wv = torch.empty((bsz, hkv, cw, dcv), dtype=present_v.dtype, device=dev)
    wk[:, :, :cap] = present_k
    wv[:, :, :cap] = present_v
    # 2. the write: entry b's valid row j to W row L(P_b) + j (flat [rows, 1, Hkv, Dc] views, explicit slots)
    flat_k, flat_v = flat_rows(wk), flat_rows(wv)
    rows = c.rows.to(torch.int64)
    valid = rows[None, :] < q_len[:, None]  # [B, S]
    slots = torch.where(valid, c.entry + lp[:, None] + rows[None, :], -1).reshape(-1)
    rope_pos = (p_len[:, None] + rows[None, :]).reshape(-1).to(torch.int32) if int(a["do_rotary"]) else None
    q, ks, vs = write(x, a, h=h, hkv=hkv, d=d, kf=kf, vf=vf, csl=c.csl, past=p_len.to(torch.int32), table=c.table,
                      flat_k=flat_k, flat_v=flat_v, slots=slots, rows=c.rows, total=total, positions=rope_pos)
    # 3. the attention over W in row space
    bias = x.get("attention_bias")
    if bias is not None:
        bias = _rows(bias, first_p, bsz, cw)
    out, _ = ops.paged_decode(
        q, wk, wv, q_len.to(torch.int32), lp.to(torch.int32), c.table, ks, vs, None, None, None,
        sink(x, a, h, query.dtype, dev), bias,
        k_fmt=kf.fmt, k_scale_mode=kf.scale, v_fmt=vf.fmt, v_scale_mode=vf.scale, num_heads=h, kv_num_heads=hkv,
        head_size=d, v_head_size=d, scale=default_scale(float(a["scale"]), d), softcap=float(a["softcap"]),
        local_window_size=window, is_causal=bool(int(a["causal"])), qk_output=0, v_rotation=False,
        max_query_len=s, max_kv_len=cw, bnsh=True, row_pad=s, bias_after_softcap=True)
    out = out.view(bsz, s, h * d)
    if s > 1:
        out = torch.where(valid[:, :, None], out, torch.zeros((), dtype=out.dtype, device=dev))
    # 4. the presents: the L(T) most recent positions at rows [0, L(T)), the other rows as they were
    r = torch.arange(cap, device=dev)
    src = (r[None, :] + (first_t - first_p)[:, None]).clamp(max=cw - 1)  # [B, C]
    keep = (r[None, :] < lt[:, None])[:, None, :, None]
    for present, wbuf, dc in ((present_k, wk, dck), (present_v, wv, dcv)):
        pv, wb = present, wbuf
        if present.dtype == torch.float8_e4m3fn:  # gather / where on the bytes
            pv, wb = present.view(torch.uint8), wbuf.view(torch.uint8)
        got = torch.gather(wb, 2, src[:, None, :, None].expand(bsz, hkv, cap, dc))
        pv.copy_(torch.where(keep, got, pv))
    return _results(out, present_k, present_v, None, want)
