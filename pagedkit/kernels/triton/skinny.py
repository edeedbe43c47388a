"""Skinny products of a decode step in one Triton launch: y [M, N] = x [M, K] @ W^T for a constant weight held
as W [N, K] (runtime/ops/math.py's CUDA prepack lays it out once), M <= MAX_ROWS rows.

    x [M, K] float16 / bfloat16 (row stride K' >= K, last dim contiguous), W [N, K] contiguous in x's dtype
    y [M, N] in x's dtype, float32 accumulation, one rounding

Grid (cdiv(N, BLOCK_N), cdiv(M, BLOCK_M)): a program streams its BLOCK_N weight rows along K once (no split-K:
no partials, no second launch, the same sums in the same order in every call, so a graph replay equals the
eager call bit for bit). Under programmatic dependent launch (common.PDL) a program loads its first weight tile
before `pdl_gate` (weights never depend on the previous kernel), so the kernel starts streaming while its
predecessor drains; cuBLAS launches cannot do that, and a decode step's products are small enough (2048 x 2048
is 8 MB, ~2 us at the read bandwidth) that the launch ramp is a large part of their time.

Dispatch (`serves`): CUDA, float16 / bfloat16, 1 <= M <= MAX_ROWS, K a multiple of 16, ENABLED (PAGEDKIT_SKINNY=0
turns the route off: cuBLAS through F.linear on the same [N, K] weight). The tile comes from the shape alone
(`pick_tile`); TILE overrides it (tuning runs, PAGEDKIT_SKINNY_TILE="BNxBKxSTAGESxWARPS").
"""

from __future__ import annotations

import os

import torch

from . import common

MAX_ROWS = 32  # rows served (a decode step's batch); more rows are a prefill: cuBLAS


def _tile(value: str) -> tuple[int, int, int, int]:
    parts = tuple(int(v) for v in value.split("x"))
    if len(parts) != 4:
        raise ValueError(f"PAGEDKIT_SKINNY_TILE={value!r}: expected BNxBKxSTAGESxWARPS, e.g. 16x512x4x4")
    return parts  # type: ignore[return-value]


ENABLED = os.environ.get("PAGEDKIT_SKINNY", "1") != "0"
TILE: tuple[int, int, int, int] | None = _tile(os.environ["PAGEDKIT_SKINNY_TILE"]) if os.environ.get(
    "PAGEDKIT_SKINNY_TILE") else None

if common.HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_ym,
                       BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr,
                       PDL: tl.constexpr, INTERP: tl.constexpr):
        pid_n = tl.program_id(0)
        pid_m = tl.program_id(1)
        n = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
        m = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
        k = tl.arange(0, BLOCK_K)
        n_ok = n < N
        m_ok = m < M
        w_rows = w_ptr + n.to(tl.int64)[:, None] * K  # W [N, K]
        x_rows = x_ptr + m.to(tl.int64)[:, None] * stride_xm  # x [M, K'] (row stride)
        acc = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
        # the first weight tile before the gate: constants, never written by the previous kernel
        if EVEN_K:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None], other=0.0)
        else:
            w = tl.load(w_rows + k[None, :], mask=n_ok[:, None] & (k[None, :] < K), other=0.0)
        if PDL:
            common.pdl_gate()
        for k0 in range(0, K, BLOCK_K):
            kk = k0 + k
            if EVEN_K:
                x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None], other=0.0)
            else:
                x = tl.load(x_rows + kk[None, :], mask=m_ok[:, None] & (kk[None, :] < K), other=0.0)
            if INTERP:  # the interpreter's bfloat16 loads: float32 at once
                acc = tl.dot(x.to(tl.float32), tl.trans(w.to(tl.float32)), acc)
            else:
                acc = tl.dot(x, tl.trans(w), acc)  # [BM, BK] x [BK, BN]
            kn = kk + BLOCK_K
            if EVEN_K:
                w = tl.load(w_rows + kn[None, :], mask=n_ok[:, None] & (k0 + BLOCK_K < K), other=0.0)
            else:
                w = tl.load(w_rows + kn[None, :], mask=n_ok[:, None] & (kn[None, :] < K), other=0.0)
        y = y_ptr + m.to(tl.int64)[:, None] * stride_ym + n[None, :]
        tl.store(y, acc.to(y_ptr.dtype.element_ty), mask=m_ok[:, None] & n_ok[None, :])


def pick_tile(m: int, n: int, k: int, num_sms: int = 132) -> tuple[int, int, int, int]:
    """(block_n, block_k, num_stages, num_warps) from the shape: 16-row weight tiles while 32-row ones would
    leave SMs idle, 512-channel K tiles (256 at short K)."""
    if TILE is not None:
        return TILE
    block_n = 16 if -(-n // 32) < 2 * num_sms else 32
    block_k = 512 if k >= 1024 else max(16, common.next_pow2(k) if k < 256 else 256)
    return block_n, block_k, 1, 4


def serves(x: torch.Tensor, w_nk: torch.Tensor) -> bool:
    """Whether `skinny_matmul` serves x [..., K] against W [N, K] (else the caller runs cuBLAS)."""
    if not (ENABLED and common.HAVE_TRITON and (x.is_cuda or common.INTERPRET) and x.dim() >= 1):
        return False
    k = x.shape[-1]
    rows = x.numel() // max(k, 1)
    return (x.dtype in (torch.float16, torch.bfloat16) and w_nk.dtype == x.dtype and w_nk.dim() == 2
            and w_nk.shape[1] == k and k % 16 == 0 and 1 <= rows <= MAX_ROWS and x.stride(-1) == 1
            and w_nk.is_contiguous() and x.device == w_nk.device)


def skinny_matmul(x: torch.Tensor, w_nk: torch.Tensor, tile: tuple[int, int, int, int] | None = None) -> torch.Tensor:
    """x [..., K] @ W^T -> [..., N] in x's dtype (serves must hold); tile overrides pick_tile."""
    common.require_triton()
    k = x.shape[-1]
    n = w_nk.shape[0]
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    m = x2.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    block_n, block_k, stages, warps = tile or pick_tile(m, n, k)
    block_k = min(block_k, max(16, common.next_pow2(k)))
    block_m = 16 if m <= 16 else 32
    pdl = common.pdl_launch(x.device)
    _skinny_kernel[(triton.cdiv(n, block_n), triton.cdiv(m, block_m))](
        x2, w_nk, y, m, n, k, x2.stride(0), y.stride(0), BLOCK_M=block_m, BLOCK_N=block_n, BLOCK_K=block_k,
        EVEN_K=k % block_k == 0, PDL=bool(pdl), INTERP=common.INTERPRET, num_warps=warps, num_stages=stages, **pdl)
    return y.reshape(*x.shape[:-1], n)
