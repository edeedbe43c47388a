"""The routed experts of com.microsoft MoE as two grouped GEMM launches (runtime/ops/moe.py routes CUDA tensors
here): no host read at any batch, so a step holding MoE layers is CUDA-graph capturable.

    xs [T, H], routes: top_e [T, k] (expert ids), top_w [T, k] float32 (routing weights, as the op computed them)
    fc1 [E, N1, H] (+ bias [E, N1]), fc3 [E, I, H] (optional gate / up), fc2 [E, H, I] (+ bias [E, H])
    out [T, H] float32 = sum over the k routes of w * fc2(act(fc1 x[, fc3 x])) + b2

Plan (torch ops on the device, sizes static given T): the T*k routes sorted by expert (stable), each expert's count
(a scatter-add), its first sorted position, and its tiles of BLOCK_M routes; the grid covers the most tiles any
routing can need, cdiv(T*k, BLOCK_M) + E, and a program past the used tiles returns at once. Program (tile, column
block): its expert is the number of experts whose tiles end at or before it; it gathers its routes' rows of x and
multiplies them by that expert's weight, so each expert's weights are read once per BLOCK_M routes it got.
- fc1 launch: the activated hidden rows [T*k sorted, I] in x's dtype (onnxruntime's CUDA MoE also keeps them in
  the activation dtype): act(A) or act(A) * B / swiglu(A, B), where A and B are fc1's rows (2n, 2n + 1) with
  swiglu_fusion 1, (n, I + n) with fusion 2, fc1 n and fc3 n with fc3; biases added first, in float32.
- fc2 launch: each route's [H] row times its routing weight, float32, stored at the route's own index; the k routes
  of a token are then summed in route order (deterministic: a replay equals eager bit for bit).
Activations as runtime/ops/moe.py: relu, gelu (tanh), silu, identity, relu2 (gated by fc3 when given), swiglu
(alpha, beta, limit, limit after activation), geglu. Float16 / bfloat16 / float32 inputs; products accumulate in
float32.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import torch

from . import common

ACTS = {"relu": 0, "gelu": 1, "silu": 2, "identity": 3, "relu2": 4, "swiglu": 5, "geglu": 6}
GLU = ("swiglu", "geglu")
BLOCK_M = 16  # routes per tile (tl.dot's smallest M)

if common.HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _tile(tile_end_ptr, tiles_ptr, counts_ptr, start_ptr, order_ptr, t, E, EP: tl.constexpr,
              BM: tl.constexpr):
        """(expert, sorted positions [BM], route ids [BM], valid [BM]) of tile t; expert == E: an unused tile."""
        es = tl.arange(0, EP)
        ends = tl.load(tile_end_ptr + es, mask=es < E, other=2147483647)
        e = tl.sum((ends <= t).to(tl.int32), axis=0)
        e_ok = e < E
        e_c = tl.minimum(e, E - 1)
        first = tl.load(tile_end_ptr + e_c) - tl.load(tiles_ptr + e_c)
        local = (t - first) * BM + tl.arange(0, BM)
        valid = (local < tl.load(counts_ptr + e_c)) & e_ok
        pos = tl.load(start_ptr + e_c) + local
        route = tl.load(order_ptr + pos, mask=valid, other=0)
        return e, e_ok, pos, route, valid

    @triton.jit
    def _w_tile(w_ptr, s_ptr, z_ptr, e, rows, kk, K, n_ok, k_ok, w_expert, s_expert, z_expert, groups,
                BITS: tl.constexpr, GROUP: tl.constexpr, HAS_Z: tl.constexpr, UPCAST: tl.constexpr, out_dt):
        """W[e, rows, kk] as a [BK, BN] tile (kk down, rows across) in out_dt: a float weight as stored, or packed
        BITS-bit codes (the first value in the lowest bits of a byte) dequantized as (q - zero point) * scale in
        float32, with one scale per GROUP values of K (GROUP 0: one per row) and zero points packed like the codes
        (along the groups; per row: along N), else 2^(BITS - 1)."""
        m = k_ok[:, None] & n_ok[None, :]
        base = e.to(tl.int64) * w_expert
        if BITS == 0:  # (if / else, no early return: triton 3.6 compiles the code after a constexpr return)
            w = tl.load(w_ptr + base + rows[None, :] * K + kk[:, None], mask=m, other=0.0)
        else:
            PER: tl.constexpr = 8 // BITS
            MASK: tl.constexpr = (1 << BITS) - 1
            byte = tl.load(w_ptr + base + rows[None, :] * (K // PER) + (kk // PER)[:, None], mask=m, other=0)
            q = ((byte.to(tl.int32) >> ((kk % PER) * BITS)[:, None]) & MASK).to(tl.float32)
            if GROUP:
                g = kk // GROUP
            else:
                g = kk * 0
            sc = tl.load(s_ptr + e.to(tl.int64) * s_expert + rows[None, :] * groups + g[:, None], mask=m,
                         other=0.0).to(tl.float32)
            if HAS_Z:
                if GROUP:
                    zb = tl.load(z_ptr + e.to(tl.int64) * z_expert + rows[None, :] * ((groups + PER - 1) // PER)
                                 + (g // PER)[:, None], mask=m, other=0)
                    z = ((zb.to(tl.int32) >> ((g % PER) * BITS)[:, None]) & MASK).to(tl.float32)
                else:
                    zb = tl.load(z_ptr + e.to(tl.int64) * z_expert + rows // PER, mask=n_ok, other=0)
                    z = ((zb.to(tl.int32) >> ((rows % PER) * BITS)) & MASK).to(tl.float32)[None, :]
            else:
                z = (1 << (BITS - 1)) * 1.0
            w = ((q - z) * sc).to(out_dt)  # the dequantized weight in the scales' dtype, as runtime/ops/moe.py
        if UPCAST:
            w = w.to(tl.float32)
        return w

    @triton.jit
    def _mma(acc, a, b, IEEE: tl.constexpr):
        """acc + a @ b: float32 operands in full precision (not tf32) when IEEE."""
        if IEEE:
            return acc + tl.dot(a, b, input_precision="ieee")
        return acc + tl.dot(a, b)

    @triton.jit
    def _act(a, b, ACT: tl.constexpr, GATED: tl.constexpr, alpha, beta, limit, LIMIT_AFTER: tl.constexpr):
        if ACT == 5:  # swiglu
            l = tl.minimum(tl.maximum(b, -limit), limit)
            if LIMIT_AFTER:
                g = tl.minimum(a * tl.sigmoid(alpha * a), limit)
            else:
                g = tl.minimum(a, limit)
                g = g * tl.sigmoid(alpha * g)
            return g * (l + beta)
        if ACT == 0 or ACT == 4:
            h = tl.maximum(a, 0.0)
            if ACT == 4:
                h = h * h
        elif ACT == 1 or ACT == 6:  # gelu, tanh approximation: 0.5 a (1 + tanh(c (a + 0.044715 a^3)))
            u = 0.7978845608028654 * (a + 0.044715 * a * a * a)
            h = a * tl.sigmoid(2.0 * u)  # 0.5 (1 + tanh(u)) = sigmoid(2u)
        elif ACT == 2:
            h = a * tl.sigmoid(a)
        else:
            h = a
        if GATED or ACT == 6:
            h = h * b
        return h

    @triton.jit
    def _fc1_kernel(x_ptr, wa_ptr, sa_ptr, za_ptr, wb_ptr, sb_ptr, zb_ptr, ba_ptr, bb_ptr, act_ptr, tile_end_ptr,
                    tiles_ptr, counts_ptr, start_ptr, order_ptr, E, H, I, K_ROUTES, a_base, a_step, b_base, b_step,
                    wa_expert, sa_expert, za_expert, ga, wb_expert, sb_expert, zb_expert, gb, ba_expert, bb_expert,
                    alpha, beta, limit,
                    EP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, ACT: tl.constexpr,
                    GATED: tl.constexpr, HAS_BA: tl.constexpr, HAS_BB: tl.constexpr, LIMIT_AFTER: tl.constexpr,
                    IEEE: tl.constexpr, UPCAST: tl.constexpr, BITS_A: tl.constexpr, GROUP_A: tl.constexpr,
                    HAS_ZA: tl.constexpr, BITS_B: tl.constexpr, GROUP_B: tl.constexpr, HAS_ZB: tl.constexpr):
        t = tl.program_id(0)
        e, e_ok, pos, route, valid = _tile(tile_end_ptr, tiles_ptr, counts_ptr, start_ptr, order_ptr, t, E, EP, BM)
        if e_ok:
            token = (route // K_ROUTES).to(tl.int64)
            n = tl.program_id(1) * BN + tl.arange(0, BN)
            n_ok = n < I
            rows_a = (a_base + a_step * n).to(tl.int64)
            rows_b = (b_base + b_step * n).to(tl.int64)
            acc_a = tl.zeros((BM, BN), dtype=tl.float32)
            acc_b = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, H, BK):
                kk = k0 + tl.arange(0, BK)
                k_ok = kk < H
                x = tl.load(x_ptr + token[:, None] * H + kk[None, :], mask=valid[:, None] & k_ok[None, :], other=0.0)
                if UPCAST:  # the interpreter's bfloat16: float32 at once
                    x = x.to(tl.float32)
                w = _w_tile(wa_ptr, sa_ptr, za_ptr, e, rows_a, kk, H, n_ok, k_ok, wa_expert, sa_expert, za_expert,
                            ga, BITS_A, GROUP_A, HAS_ZA, UPCAST, x_ptr.dtype.element_ty)
                acc_a = _mma(acc_a, x, w, IEEE)
                if GATED:
                    w2 = _w_tile(wb_ptr, sb_ptr, zb_ptr, e, rows_b, kk, H, n_ok, k_ok, wb_expert, sb_expert,
                                 zb_expert, gb, BITS_B, GROUP_B, HAS_ZB, UPCAST, x_ptr.dtype.element_ty)
                    acc_b = _mma(acc_b, x, w2, IEEE)
            if HAS_BA:
                acc_a += tl.load(ba_ptr + e.to(tl.int64) * ba_expert + rows_a, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if HAS_BB:
                acc_b += tl.load(bb_ptr + e.to(tl.int64) * bb_expert + rows_b, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            h = _act(acc_a, acc_b, ACT, GATED, alpha, beta, limit, LIMIT_AFTER)
            tl.store(act_ptr + pos.to(tl.int64)[:, None] * I + n[None, :], h.to(act_ptr.dtype.element_ty),
                     mask=valid[:, None] & n_ok[None, :])

    @triton.jit
    def _fc2_kernel(act_ptr, w_ptr, s_ptr, z_ptr, b_ptr, rw_ptr, y_ptr, tile_end_ptr, tiles_ptr, counts_ptr,
                    start_ptr, order_ptr, E, H, I, w_expert, s_expert, z_expert, groups,
                    EP: tl.constexpr, BM: tl.constexpr, BN: tl.constexpr, BK: tl.constexpr, HAS_B: tl.constexpr,
                    IEEE: tl.constexpr, UPCAST: tl.constexpr, BITS: tl.constexpr, GROUP: tl.constexpr,
                    HAS_Z: tl.constexpr):
        t = tl.program_id(0)
        e, e_ok, pos, route, valid = _tile(tile_end_ptr, tiles_ptr, counts_ptr, start_ptr, order_ptr, t, E, EP, BM)
        if e_ok:
            n = tl.program_id(1) * BN + tl.arange(0, BN)  # output columns (hidden)
            n_ok = n < H
            acc = tl.zeros((BM, BN), dtype=tl.float32)
            for k0 in range(0, I, BK):
                kk = k0 + tl.arange(0, BK)
                k_ok = kk < I
                a = tl.load(act_ptr + pos.to(tl.int64)[:, None] * I + kk[None, :],
                            mask=valid[:, None] & k_ok[None, :], other=0.0)
                if UPCAST:
                    a = a.to(tl.float32)
                wt = _w_tile(w_ptr, s_ptr, z_ptr, e, n.to(tl.int64), kk, I, n_ok, k_ok, w_expert, s_expert,
                             z_expert, groups, BITS, GROUP, HAS_Z, UPCAST, act_ptr.dtype.element_ty)
                acc = _mma(acc, a, wt, IEEE)
            if HAS_B:
                acc += tl.load(b_ptr + e.to(tl.int64) * H + n, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            rw = tl.load(rw_ptr + route, mask=valid, other=0.0)
            tl.store(y_ptr + route.to(tl.int64)[:, None] * H + n[None, :], acc * rw[:, None],
                     mask=valid[:, None] & n_ok[None, :])


@dataclass(frozen=True)
class PackedExperts:
    """QMoE's integer expert weights as the op holds them: codes uint8 [E, N, K * bits / 8] (the first value in the
    lowest bits), scales [E, N, K / block_size] (block_size 0: [E, N]), zero points packed like the codes (along
    the groups; per row: [E, ceil(N * bits / 8)]) or None (2^(bits - 1)). Dequantized in the kernel's loads."""

    q: torch.Tensor
    scales: torch.Tensor
    zero_points: torch.Tensor | None
    bits: int
    block_size: int

    @property
    def shape(self) -> tuple[int, int, int]:
        e, n, b = self.q.shape
        return e, n, b * 8 // self.bits

    @property
    def dtype(self) -> torch.dtype:
        return self.scales.dtype

    def why_not(self) -> str | None:
        e, n, k = self.shape
        if self.bits not in (2, 4, 8) or self.q.dtype != torch.uint8:
            return f"{self.bits}-bit codes of dtype {self.q.dtype}"
        groups = k // self.block_size if self.block_size else 1
        if self.block_size and k % self.block_size:
            return f"K={k} is not a multiple of block_size {self.block_size}"
        if self.scales.numel() != e * n * groups:
            return f"scales {tuple(self.scales.shape)} for [{e}, {n}, {groups}]"
        if self.zero_points is not None and self.zero_points.dtype != torch.uint8:
            return f"zero points of dtype {self.zero_points.dtype} (packed uint8 expected)"
        per = 8 // self.bits
        z_bytes = e * n * (-(-groups // per)) if self.block_size else e * (-(-n // per))
        if self.zero_points is not None and self.zero_points.numel() != z_bytes:
            return f"zero points {tuple(self.zero_points.shape)} ({z_bytes} bytes expected)"
        return None


def _tensors(w) -> list[torch.Tensor]:
    if isinstance(w, PackedExperts):
        return [t for t in (w.q, w.scales, w.zero_points) if t is not None]
    return [w] if w is not None else []


def serves(xs: torch.Tensor, weights, attrs: dict) -> str | None:
    """None when fused_moe serves these inputs, else why not (the op then takes its torch path)."""
    fc1_w, fc1_b, fc2_w, fc2_b, fc3_w, fc3_b = weights
    act = attrs.get("activation_type", "relu")
    if not common.HAVE_TRITON:
        return "triton is not installed"
    if not (xs.is_cuda or common.INTERPRET):
        return "not a CUDA tensor"
    if act not in ACTS:
        return f"activation_type {act!r}"
    if any(w is not None and not isinstance(w, (torch.Tensor, PackedExperts)) for w in weights):
        return "expert weights of another kind"
    for w in (fc1_w, fc2_w, fc3_w):
        why = w.why_not() if isinstance(w, PackedExperts) else None
        if why:
            return why
    dts = {xs.dtype} | {w.dtype for w in weights if w is not None}
    if xs.dtype not in (torch.float16, torch.bfloat16, torch.float32) or len(dts) != 1:
        return f"dtypes {sorted(str(d) for d in dts)} (one float dtype expected)"
    if any(not t.is_contiguous() for w in list(weights) + [xs] for t in _tensors(w)):
        return "non-contiguous weights"
    e, n1, h = fc1_w.shape
    if act in GLU:
        fusion = attrs.get("swiglu_fusion", 0)
        if fusion not in (0, 1, 2) or (fusion == 0 and fc3_w is None) or (fusion and n1 % 2):
            return f"swiglu_fusion {fusion} with fc1 rows {n1}" + (" and no fc3" if fc3_w is None else "")
    if tuple(fc2_w.shape[:2]) != (e, h):
        return f"fc2 weights {tuple(fc2_w.shape)} against fc1 {tuple(fc1_w.shape)}"
    return None


def _layout(n1: int, act: str, attrs: dict, has_fc3: bool) -> tuple[int, tuple[int, int, int, int], bool, bool]:
    """(I, (a_base, a_step, b_base, b_step), gated, b from fc3) of fc1's rows for activation column n."""
    if act in GLU:
        fusion = attrs.get("swiglu_fusion", 0)
        if fusion == 1:
            return n1 // 2, (0, 2, 1, 2), True, False
        if fusion == 2:
            return n1 // 2, (0, 1, n1 // 2, 1), True, False
        return n1, (0, 1, 0, 1), True, True
    return n1, (0, 1, 0, 1), has_fc3, True


def _weight_args(w) -> tuple[list, dict]:
    """(pointer / stride arguments [w, s, z, w_expert, s_expert, z_expert, groups], constexprs) of one fc."""
    e, n, k = w.shape
    if not isinstance(w, PackedExperts):
        return [w, w, w, n * k, 0, 0, 1], dict(BITS=0, GROUP=0, HAS_Z=False)
    groups = k // w.block_size if w.block_size else 1
    z = w.zero_points
    return ([w.q, w.scales, z if z is not None else w.q, w.q[0].numel(), n * groups,
             z[0].numel() if z is not None else 0, groups],
            dict(BITS=w.bits, GROUP=w.block_size, HAS_Z=z is not None))


def fused_moe(xs: torch.Tensor, top_e: torch.Tensor, top_w: torch.Tensor, weights, attrs: dict,
              block_n: int = 64, block_k: int = 64, plan=None) -> torch.Tensor:
    """out [T, H] float32 (see the module doc; `serves` must hold). weights: (fc1_w, fc1_b, fc2_w, fc2_b, fc3_w,
    fc3_b) as runtime/ops/moe.py passes them, each weight a float tensor or PackedExperts. plan: (order, counts,
    start, tiles, tile_end) of top_e with this BLOCK_M as moe_route.py builds them (None: built here)."""
    fc1_w, fc1_b, fc2_w, fc2_b, fc3_w, fc3_b = weights
    act = attrs.get("activation_type", "relu")
    n_tok, k = top_e.shape
    e, n1, h = fc1_w.shape
    inter, (a_base, a_step, b_base, b_step), gated, b_fc3 = _layout(n1, act, attrs, fc3_w is not None)
    dev = xs.device
    routes = n_tok * k
    # plan: routes sorted by expert, per-expert counts, first sorted positions and tiles (device ops, no host read)
    if plan is not None:
        order, counts, start, tiles, tile_end = plan
    else:
        route_e = top_e.reshape(-1).to(torch.int64)
        order = torch.argsort(route_e, stable=True).to(torch.int32)
        counts = torch.zeros(e, dtype=torch.int32, device=dev).scatter_add_(
            0, route_e, torch.ones(routes, dtype=torch.int32, device=dev))
        start = (torch.cumsum(counts, 0, dtype=torch.int32) - counts).contiguous()
        tiles = (counts + (BLOCK_M - 1)) // BLOCK_M
        tile_end = torch.cumsum(tiles, 0, dtype=torch.int32)
    grid_m = triton.cdiv(routes, BLOCK_M) + e
    ep = triton.next_power_of_2(e)
    act_buf = torch.empty(max(routes, 1), inter, dtype=xs.dtype, device=dev)
    wb = fc3_w if (gated and b_fc3) else fc1_w
    bb = fc3_b if (gated and b_fc3) else fc1_b
    limit = float(attrs.get("swiglu_limit", math.inf))
    bn1 = min(block_n, triton.next_power_of_2(max(inter, 16)))
    bk1 = min(block_k, triton.next_power_of_2(max(h, 16)))
    upcast = bool(common.INTERPRET) and xs.dtype == torch.bfloat16  # the interpreter misreads bfloat16 operands
    (wa, sa, za, wa_e, sa_e, za_e, ga), ca = _weight_args(fc1_w)
    (wbp, sbp, zbp, wb_e, sb_e, zb_e, gb), cb = _weight_args(wb)
    dummy = xs
    _fc1_kernel[(grid_m, triton.cdiv(inter, bn1))](
        xs, wa, sa, za, wbp, sbp, zbp, fc1_b if fc1_b is not None else dummy, bb if bb is not None else dummy,
        act_buf, tile_end, tiles, counts, start, order, e, h, inter, k, a_base, a_step, b_base, b_step,
        wa_e, sa_e, za_e, ga, wb_e, sb_e, zb_e, gb, n1, wb.shape[1],
        float(attrs.get("activation_alpha", 1.0)), float(attrs.get("activation_beta", 0.0)),
        limit if math.isfinite(limit) else 3.0e38,
        EP=ep, BM=BLOCK_M, BN=bn1, BK=bk1, ACT=ACTS[act], GATED=gated, HAS_BA=fc1_b is not None,
        HAS_BB=gated and bb is not None, LIMIT_AFTER=bool(attrs.get("swiglu_limit_after_activation", 0)),
        IEEE=xs.dtype == torch.float32, UPCAST=upcast, BITS_A=ca["BITS"], GROUP_A=ca["GROUP"], HAS_ZA=ca["HAS_Z"],
        BITS_B=cb["BITS"], GROUP_B=cb["GROUP"], HAS_ZB=cb["HAS_Z"])
    y = torch.empty(max(routes, 1), h, dtype=torch.float32, device=dev)
    rw = top_w.reshape(-1).to(torch.float32).contiguous()
    bn2 = min(block_n, triton.next_power_of_2(max(h, 16)))
    bk2 = min(block_k, triton.next_power_of_2(max(inter, 16)))
    (w2, s2, z2, w2_e, s2_e, z2_e, g2), c2 = _weight_args(fc2_w)
    _fc2_kernel[(grid_m, triton.cdiv(h, bn2))](
        act_buf, w2, s2, z2, fc2_b if fc2_b is not None else dummy, rw, y, tile_end, tiles, counts, start, order,
        e, h, inter, w2_e, s2_e, z2_e, g2, EP=ep, BM=BLOCK_M, BN=bn2, BK=bk2, HAS_B=fc2_b is not None,
        IEEE=xs.dtype == torch.float32, UPCAST=upcast, **c2)
    return y[:routes].reshape(n_tok, k, h).sum(1)


__all__ = ["ACTS", "PackedExperts", "fused_moe", "serves"]
