"""com.microsoft MoE's routing and the grouped GEMMs' plan in one launch, for decode-sized steps (moe.py runs the
experts over that plan).

    router [T, E] (any float dtype, row stride given)
    probs  = softmax(router, float32) per token;  top-k by value (ties: the lowest expert id), in descending order;
             normalize: the k weights divided by their sum
    top_e [T, k] int64, top_w [T, k] float32                                  (what torch.topk gives runtime/ops/moe.py)
    routes r = t * k + j (token-major);  counts [E] = routes per expert;  start [E] = exclusive prefix sum of counts
    order [T * k] int32: route r at position start[e_r] + #{r' < r with e_r' = e_r}  (a stable sort by expert)
    tiles [E] = ceil(counts / BLOCK_M);  tile_end [E] = inclusive prefix sum of tiles

The torch composition this replaces (softmax, topk, the division, argsort, a scatter-add, two cumsums and the
tile arithmetic) is a dozen launches a MoE layer; here it is one program: the [T, E] probabilities and the
[routes, E] / [routes, RC] comparisons stay in registers, so it serves steps whose padded sizes fit
(`serves`: next_pow2(T * k) x next_pow2(E) <= MAX_CELLS). The top-k is written first and read back after a
barrier (one program: its own writes), so the stable ranks are counted RC routes at a time.
"""

from __future__ import annotations

import torch

from . import common

MAX_CELLS = 32768  # next_pow2(routes) x next_pow2(experts): the largest [routes, experts] comparison kept in registers
RANK_CHUNK = 64  # routes compared at a time for the stable ranks

if common.HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _route_kernel(logit_ptr, stride_t, T, E, top_e_ptr, top_w_ptr, order_ptr, counts_ptr, start_ptr, tiles_ptr,
                      tile_end_ptr, K: tl.constexpr, TP: tl.constexpr, EP: tl.constexpr, KP: tl.constexpr,
                      RP: tl.constexpr, RC: tl.constexpr, NORM: tl.constexpr, BM: tl.constexpr):
        t = tl.arange(0, TP)
        e = tl.arange(0, EP)
        t_ok = t < T
        e_ok = e < E
        cell = t_ok[:, None] & e_ok[None, :]
        x = tl.load(logit_ptr + t[:, None] * stride_t + e[None, :], mask=cell, other=0.0).to(tl.float32)
        x = tl.where(cell, x, float("-inf"))
        m = tl.max(x, axis=1)
        p = tl.where(cell, tl.exp(x - tl.where(t_ok, m, 0.0)[:, None]), 0.0)
        p = p / tl.where(t_ok, tl.sum(p, axis=1), 1.0)[:, None]  # [TP, EP] probabilities (float32)
        work = tl.where(e_ok[None, :], p, -1.0)
        kk = tl.arange(0, KP)
        sel_e = tl.zeros([TP, KP], dtype=tl.int32)
        sel_w = tl.zeros([TP, KP], dtype=tl.float32)
        for j in tl.static_range(K):  # k rounds of (max, its lowest expert id), the chosen one masked out
            mx = tl.max(work, axis=1)
            idx = tl.min(tl.where(work == mx[:, None], e[None, :], EP), axis=1)
            sel_e = tl.where(kk[None, :] == j, idx[:, None], sel_e)
            sel_w = tl.where(kk[None, :] == j, mx[:, None], sel_w)
            work = tl.where(e[None, :] == idx[:, None], -2.0, work)
        if NORM:
            total = tl.sum(tl.where(kk[None, :] < K, sel_w, 0.0), axis=1)
            sel_w = sel_w / tl.where(t_ok, total, 1.0)[:, None]
        out_ok = t_ok[:, None] & (kk[None, :] < K)
        tl.store(top_e_ptr + t[:, None] * K + kk[None, :], sel_e.to(tl.int64), mask=out_ok)
        tl.store(top_w_ptr + t[:, None] * K + kk[None, :], sel_w, mask=out_ok)
        tl.debug_barrier()  # the top-k above, read back by route below (one program: its own writes)
        R = T * K
        r = tl.arange(0, RP)
        r_ok = r < R
        er = tl.load(top_e_ptr + r, mask=r_ok, other=-1).to(tl.int32)  # [RP] the expert of each route
        hit = (er[:, None] == e[None, :]) & r_ok[:, None]  # [RP, EP]
        counts = tl.sum(hit.to(tl.int32), axis=0)  # [EP]
        start = tl.cumsum(counts, axis=0) - counts
        rank = tl.zeros([RP], dtype=tl.int32)
        for c0 in range(0, R, RC):  # earlier routes of the same expert, RC at a time
            rc = c0 + tl.arange(0, RC)
            ec = tl.load(top_e_ptr + rc, mask=rc < R, other=-2).to(tl.int32)
            same = (ec[None, :] == er[:, None]) & (rc[None, :] < r[:, None])
            rank += tl.sum(same.to(tl.int32), axis=1)
        pos = tl.sum(tl.where(hit, start[None, :], 0), axis=1) + rank
        tl.store(order_ptr + pos, r, mask=r_ok)
        tiles = (counts + (BM - 1)) // BM
        tl.store(counts_ptr + e, counts, mask=e_ok)
        tl.store(start_ptr + e, start, mask=e_ok)
        tl.store(tiles_ptr + e, tiles, mask=e_ok)
        tl.store(tile_end_ptr + e, tl.cumsum(tiles, axis=0), mask=e_ok)


def serves(router: torch.Tensor, k: int, attrs: dict) -> str | None:
    """None when `route_plan` serves this routing, else why not (the op then routes with torch)."""
    if not common.HAVE_TRITON:
        return "triton is not installed"
    if not (router.is_cuda or common.INTERPRET):
        return "not a CUDA tensor"
    if attrs.get("use_sparse_mixer", 0):
        return "use_sparse_mixer (routed by torch)"
    if router.dim() < 1 or router.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return f"router {router.dtype} (a float dtype expected)"
    n_exp = router.shape[-1]
    n_tok = router.numel() // max(n_exp, 1)
    if not 1 <= k <= n_exp:
        return f"k={k} of {n_exp} experts"
    if n_tok < 1 or common.next_pow2(n_tok * k) * common.next_pow2(n_exp) > MAX_CELLS or common.next_pow2(n_tok) * common.next_pow2(n_exp) > MAX_CELLS:
        return f"{n_tok} tokens x k {k} x {n_exp} experts (decode-sized steps: {MAX_CELLS} padded cells)"
    return None


def route_plan(router: torch.Tensor, k: int, normalize: bool, block_m: int):
    """(top_e [T, k] int64, top_w [T, k] float32, (order, counts, start, tiles, tile_end) int32): module doc;
    `serves` must hold."""
    common.require_triton()
    n_exp = router.shape[-1]
    logits = router.reshape(-1, n_exp)
    if logits.stride(-1) != 1:
        logits = logits.contiguous()
    n_tok, dev = logits.shape[0], router.device
    top_e = torch.empty(n_tok, k, dtype=torch.int64, device=dev)
    top_w = torch.empty(n_tok, k, dtype=torch.float32, device=dev)
    order = torch.empty(n_tok * k, dtype=torch.int32, device=dev)
    counts, start, tiles, tile_end = (torch.empty(n_exp, dtype=torch.int32, device=dev) for _ in range(4))
    rp = common.next_pow2(n_tok * k)
    _route_kernel[(1,)](logits, logits.stride(0), n_tok, n_exp, top_e, top_w, order, counts, start, tiles, tile_end,
                        K=k, TP=max(2, common.next_pow2(n_tok)), EP=max(2, common.next_pow2(n_exp)), KP=max(2, common.next_pow2(k)), RP=max(2, rp),
                        RC=min(RANK_CHUNK, max(2, rp)), NORM=bool(normalize), BM=block_m,
                        num_warps=4 if rp * common.next_pow2(n_exp) <= 8192 else 8)
    return top_e, top_w, (order, counts, start, tiles, tile_end)


__all__ = ["MAX_CELLS", "route_plan", "serves"]
