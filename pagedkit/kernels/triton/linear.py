"""Decode-sized products y = x @ W for a few rows (M <= MAX_ROWS) over a transposed weight W^T [N, K] (K
contiguous), with the op before the product folded into the loads of x:

    plain   x = a                                                  a [M, K]
    silu    x = silu(a[:, :K]) * a[:, K:]  (SiluMul, rounded)      a [M, 2K]
    rms     s = a (+ skip)  float32;  x = s * rsqrt(mean(s^2) + eps) * gamma  (rounded)   a, skip [M, K]
            (SkipSimplifiedLayerNormalization / SimplifiedLayerNormalization / RMSNormalization as kernels/triton/
            norm.py computes them; `want_sum`: s rounded to a's dtype, written once by program 0)

One program per BLOCK_N output columns reads its [BLOCK_N, K] slab of W^T once, a [BLOCK_N, BLOCK_K] tile a step,
and for each row (unrolled; rows padded to a power of two) multiplies it by that row's x tile (from the L2) and
sums over K in float32: a GEMV per row, no tensor-core tile. The x rows are rounded to the activation dtype
exactly where the unfused ops round them, so the fused product equals norm / SiluMul then the product up to the
summation order.

Why: at batch 1-8 a decode step's products are memory-bound GEMVs, and the norms and SiluMul between them are
separate launches of a few microseconds each (33 + 16 of the ~180 launches of a Llama-3.2-1B step; 95 us of
1.27 ms on an H100). Folded in, a step loses those launches, the split-K reduce cuBLAS adds to the down product,
and every product joins the Triton kernels' PDL chain: with PREFETCH, a program first requests its weight slab
into the L2 (bulk prefetch, sm_90), then waits for the previous kernel (PDL), so the weight fetch overlaps the
previous kernel's tail. Tiles: SHAPE_TILES[(kind, N, K)] where a product's shape has its own (what
`benchmarks/probes/gemv_probe.py` measures and prints), else TILES[kind] (`benchmarks/step_profile.py --sweep
lnBNxBKxWxS` sets those in-process).
"""

from __future__ import annotations

import torch

from . import common

MAX_ROWS = 8  # rows served (a GEMV per row: registers grow with the rows)
KINDS = ("plain", "silu", "rms")
# (block_n, block_k, num_warps, num_stages) per kind
TILES: dict[str, tuple[int, int, int, int]] = {"plain": (8, 512, 4, 3), "silu": (8, 512, 4, 3),
                                                "rms": (8, 512, 4, 3)}
# (kind, N, K) -> tiles of one product shape, overriding TILES[kind] (empty until measured on a GPU)
SHAPE_TILES: dict[tuple[str, int, int], tuple[int, int, int, int]] = {}
PREFETCH = True  # request the program's weight slab into the L2 before the PDL wait (sm_90; not interpreted)
PREFETCH_CHUNK = 4096  # bytes per bulk request
_ASM = f"cp.async.bulk.prefetch.L2.global [$1], {PREFETCH_CHUNK}; mov.u32 $0, 0;"

if common.HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _prefetch_rows(w_ptr, rows, n_ok, K, CHUNK: tl.constexpr, ASM: tl.constexpr):
        """Request the [len(rows), K] slab of W^T into the L2, CHUNK bytes a request (rows past N: row 0)."""
        for c in range(0, (K * 2) // CHUNK):  # fp16 / bf16 rows of K * 2 bytes
            ptrs = w_ptr + tl.where(n_ok, rows, 0).to(tl.int64) * K + c * (CHUNK // 2)
            tl.inline_asm_elementwise(ASM, "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)

    @triton.jit
    def _x_row(a_ptr, s_ptr, g_ptr, r, kk, ok, K, stride_a, stride_s, rstd_r, out_dt,
               KIND: tl.constexpr, HAS_SKIP: tl.constexpr):
        """Row r of x at columns kk as out_dt (KIND 0 plain, 1 silu, 2 rms; module doc), float32."""
        if KIND == 0:
            x = tl.load(a_ptr + r * stride_a + kk, mask=ok, other=0.0).to(tl.float32)
        elif KIND == 1:
            gt = tl.load(a_ptr + r * stride_a + kk, mask=ok, other=0.0).to(tl.float32)
            up = tl.load(a_ptr + r * stride_a + K + kk, mask=ok, other=0.0).to(tl.float32)
            x = (gt / (1.0 + tl.exp(-gt)) * up).to(out_dt).to(tl.float32)
        else:
            sm = tl.load(a_ptr + r * stride_a + kk, mask=ok, other=0.0).to(tl.float32)
            if HAS_SKIP:
                sm += tl.load(s_ptr + r * stride_s + kk, mask=ok, other=0.0).to(tl.float32)
            g = tl.load(g_ptr + kk, mask=ok, other=0.0).to(tl.float32)
            x = (sm * rstd_r * g).to(out_dt).to(tl.float32)
        return x

    @triton.jit
    def _linear_kernel(a_ptr, s_ptr, g_ptr, w_ptr, y_ptr, sum_ptr, M, N, K, stride_a, stride_s, stride_y, eps,
                       KIND: tl.constexpr, HAS_SKIP: tl.constexpr, WRITE_SUM: tl.constexpr, MP: tl.constexpr,
                       BN: tl.constexpr, BK: tl.constexpr, PDL: tl.constexpr, PREFETCH: tl.constexpr,
                       CHUNK: tl.constexpr, ASM: tl.constexpr):
        pid = tl.program_id(0)
        rn = pid * BN + tl.arange(0, BN)
        n_ok = rn < N
        rm = tl.arange(0, MP)  # the rows, padded to a power of two
        m_ok = rm < M
        if PREFETCH:
            _prefetch_rows(w_ptr, rn, n_ok, K, CHUNK, ASM)
        if PDL:
            common.pdl_gate(PDL)
        out_dt = y_ptr.dtype.element_ty
        rstd = tl.zeros([MP], dtype=tl.float32)
        if KIND == 2:  # pass 1: the rows' mean square (and the sum output, program 0)
            acc_sq = tl.zeros([MP], dtype=tl.float32)
            for k0 in range(0, K, BK):
                kk = k0 + tl.arange(0, BK)
                msk = m_ok[:, None] & (kk < K)[None, :]
                s = tl.load(a_ptr + rm[:, None] * stride_a + kk[None, :], mask=msk, other=0.0).to(tl.float32)
                if HAS_SKIP:
                    s += tl.load(s_ptr + rm[:, None] * stride_s + kk[None, :], mask=msk, other=0.0).to(tl.float32)
                if WRITE_SUM:
                    tl.store(sum_ptr + rm[:, None] * K + kk[None, :], s.to(out_dt), mask=msk & (pid == 0))
                acc_sq += tl.sum(s * s, axis=1)
            rstd = 1.0 / tl.sqrt(acc_sq / K + eps)
        acc = tl.zeros([MP, BN], dtype=tl.float32)
        for k0 in range(0, K, BK):
            kk = k0 + tl.arange(0, BK)
            k_ok = kk < K
            w = tl.load(w_ptr + rn[:, None].to(tl.int64) * K + kk[None, :], mask=n_ok[:, None] & k_ok[None, :],
                        other=0.0).to(tl.float32)  # [BN, BK] of W^T: K contiguous, read once for every row
            for r in tl.static_range(MP):  # a GEMV per row (no tensor-core tile): x row [BK] from the L2
                rstd_r = tl.sum(tl.where(rm == r, rstd, 0.0), axis=0)
                x = _x_row(a_ptr, s_ptr, g_ptr, r, kk, k_ok & (r < M), K, stride_a, stride_s, rstd_r, out_dt,
                           KIND, HAS_SKIP)
                part = tl.sum(w * x[None, :], axis=1)  # [BN]
                acc += tl.where(rm[:, None] == r, part[None, :], 0.0)
        tl.store(y_ptr + rm[:, None] * stride_y + rn[None, :], acc.to(out_dt), mask=m_ok[:, None] & n_ok[None, :])


_SM90: dict[str, bool] = {}


def _sm90(device: torch.device) -> bool:
    """Compute capability >= 9.0 (bulk L2 prefetch), asked once per device."""
    key = str(device)
    if key not in _SM90:
        _SM90[key] = torch.cuda.get_device_capability(device)[0] >= 9
    return _SM90[key]


def serves(kind: str, a: torch.Tensor, w_nk: torch.Tensor, *, skip: torch.Tensor | None = None,
           gamma: torch.Tensor | None = None) -> str | None:
    """None when `linear` serves these operands, else why not."""
    if not common.HAVE_TRITON or not (a.is_cuda or common.INTERPRET):
        return "no Triton here"
    if kind not in KINDS:
        return f"kind {kind!r}"
    if a.dtype not in (torch.float16, torch.bfloat16) or w_nk.dtype != a.dtype:
        return f"dtypes {a.dtype} / {w_nk.dtype} (float16 or bfloat16, the same)"
    if w_nk.dim() != 2 or not w_nk.is_contiguous() or not a.is_contiguous():
        return "non-contiguous operands"
    n, k = w_nk.shape
    rows = a.numel() // a.shape[-1] if a.dim() else 0
    if not 1 <= rows <= MAX_ROWS:
        return f"{rows} rows (1..{MAX_ROWS} served)"
    if a.shape[-1] != (2 * k if kind == "silu" else k):
        return f"x's last dimension {a.shape[-1]} against K = {k}"
    if kind == "rms":
        if gamma is None or gamma.shape != (k,):
            return "gamma"
        if skip is not None and (skip.shape != a.shape or not skip.is_contiguous() or skip.dtype != a.dtype):
            return "skip"
    return None


def linear(kind: str, a: torch.Tensor, w_nk: torch.Tensor, *, skip: torch.Tensor | None = None,
           gamma: torch.Tensor | None = None, eps: float = 1e-6, want_sum: bool = False
           ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y [..., N] in a's dtype, the rms sum [..., K] or None); `serves` must hold (module doc)."""
    common.require_triton()
    why = serves(kind, a, w_nk, skip=skip, gamma=gamma)
    if why:
        raise ValueError(f"linear ({kind}): {why}")
    n, k = w_nk.shape
    rows = a.numel() // a.shape[-1]
    y = torch.empty((*a.shape[:-1], n), dtype=a.dtype, device=a.device)
    s = torch.empty(a.shape, dtype=a.dtype, device=a.device) if (kind == "rms" and want_sum) else None
    bn, bk, warps, stages = SHAPE_TILES.get((kind, n, k), TILES[kind])
    mp = max(1, triton.next_power_of_2(rows))
    bk = min(bk, max(16, triton.next_power_of_2(k)))
    grid = (triton.cdiv(n, bn),)
    pdl = common.pdl_launch(a.device, grid[0])
    prefetch = bool(PREFETCH and a.is_cuda and not common.INTERPRET and (2 * k) % PREFETCH_CHUNK == 0
                    and w_nk.data_ptr() % 16 == 0 and _sm90(a.device))
    _linear_kernel[grid](a, skip if skip is not None else a, gamma if gamma is not None else a, w_nk, y,
                         s if s is not None else y, rows, n, k, a.shape[-1], a.shape[-1], n, float(eps),
                         KIND=KINDS.index(kind), HAS_SKIP=skip is not None, WRITE_SUM=s is not None, MP=mp, BN=bn,
                         BK=bk, PDL=common.pdl_mode(pdl), PREFETCH=prefetch, CHUNK=PREFETCH_CHUNK, ASM=_ASM,
                         num_warps=warps, num_stages=stages, **pdl)
    return y, s
