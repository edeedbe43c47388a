"""Decode-sized products split over K, accumulated by atomic adds into a persistent zeroed buffer
acc [R, N] = a [R, K] @ B [K, N] that the consumer kernel reads and zeroes again (norm.rms_norm_acc: the RMS norm
after a decoder's O and down products), so the product needs no reduce launch of its own.

Deterministic: each split's float32 partial is rounded to a fixed-point int64 (units of 2**-FIX_BITS) and the
splits add as integers, which is associative, so the sum does not depend on the order in which the splits arrive:
a CUDA-graph replay equals the same step run eagerly, bit for bit. (A first version added float32 partials by
float32 atomics, whose run-time order changed the last bit between runs; a second let the last split to arrive sum
stored partials in split order and was slower at batch >= 8: docs/engine.md.) Precision: 16 splits stay within
2**-25 (3e-8) of the float32 sum, finer than float16's and bfloat16's spacing at any magnitude >= 2**-13. Range:
|acc| < 2**(63 - FIX_BITS) = 3.4e10, far past float16's 65504 (larger bfloat16 products are not checked).

cuBLAS runs these products on a few column tiles: at one row, [2048, 2048] takes 32 tiles of 64 columns on the
H200's 132 SMs and streams 1.4 TB/s. Splitting K as well gives (N / BLOCK_N) x S programs, each reading a
[K / S, BLOCK_N] slab of B. H200, L2-cold, CUDA-graph replays (benchmarks/probes/splitk_probe.py,
results/splitk_probe.json): the partials alone take 4.5 us against cuBLAS's 6.0 at [2048, 2048] and 10.3 against
14.2 at [8192, 2048] (a separate reduce launch would give the gain back: hence the fused consumer). A first
version kept the S partials and let the norm sum them: one program per row then read S x N floats, and the norms
took 180 us of a batch-1 step instead of 67 (step_profile at ae4fab5, results in git history at 6225644).

The buffer of (device, R, N) is made zeroed once (`_acc`) and shared by every product of that shape: each consumer
zeroes it after reading, before the next product on the stream accumulates into it. Make it outside a CUDA-graph
capture (the engine's warm-up step does) so that it does not live in one graph's private pool.

Layouts: a [R, K] (row stride given, last dim contiguous), B [K, N] contiguous (an ONNX MatMul's constant), acc
[R, N] contiguous int64 (fixed point: value = acc * 2**-FIX_BITS); R <= MAX_ROWS (padded to >= 16 rows for the
tensor cores)."""

from __future__ import annotations

import torch

from . import common

MAX_ROWS = 32
BLOCK_K = 64
SPLITS = 16
FIX_BITS = 28  # acc's fixed point: value = acc * 2**-FIX_BITS (module docstring)
PRE_BYTES = 32 << 10  # a program's weight slab up to this size is loaded whole before the PDL gate (two tiles)

if common.HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _a_tile(a_ptr, r, r_ok, k, stride_ar, HALF, SILU: tl.constexpr, DT: tl.constexpr):
        """a [BLOCK_M, BLOCK_K] at columns k; SILU: silu(y[:, k]) * y[:, HALF + k] of y [R, 2 * HALF] (gate | up),
        computed in float32 and rounded to DT as the SiluMul kernel stores it (kernels/triton/swiglu.py)."""
        row = r[:, None] * stride_ar
        if SILU:
            g = tl.load(a_ptr + row + k[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32)
            u = tl.load(a_ptr + row + HALF + k[None, :], mask=r_ok[:, None], other=0.0).to(tl.float32)
            return (g / (1.0 + tl.exp(-g)) * u).to(DT)
        return tl.load(a_ptr + row + k[None, :], mask=r_ok[:, None], other=0.0)

    @triton.jit
    def _splitk_kernel(a_ptr, b_ptr, p_ptr, R, N, K, stride_ar, K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
                       BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, FIX: tl.constexpr, SILU: tl.constexpr,
                       INTERP: tl.constexpr, PDL: tl.constexpr = 0, PRE2: tl.constexpr = False):
        # acc [R, N] int64 += fixed(a [R, K] @ B [K, N]) over this program's K_SPLIT rows of B; a is y [R, 2K]
        # with SILU
        n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
        s = tl.program_id(1)
        r = tl.arange(0, BLOCK_M)
        r_ok = r < R
        dt = b_ptr.dtype.element_ty
        # the first weight tile (PRE2: the first two, a whole slab of 2 tiles) before the gate: B is a constant, so
        # it streams while the kernel before runs or drains
        k = (s * K_SPLIT + tl.arange(0, BLOCK_K)).to(tl.int64)
        b = tl.load(b_ptr + k[:, None] * N + n[None, :])
        if PRE2:
            k2 = k + BLOCK_K
            b2 = tl.load(b_ptr + k2[:, None] * N + n[None, :])
        if PDL:
            common.pdl_gate(PDL)
        acc = common.mma(_a_tile(a_ptr, r, r_ok, k, stride_ar, K, SILU, dt), b,
                         tl.zeros([BLOCK_M, BLOCK_N], tl.float32), INTERP)
        if PRE2:
            acc = common.mma(_a_tile(a_ptr, r, r_ok, k2, stride_ar, K, SILU, dt), b2, acc, INTERP)
        for kk in range((2 if PRE2 else 1) * BLOCK_K, K_SPLIT, BLOCK_K):
            k = (s * K_SPLIT + kk + tl.arange(0, BLOCK_K)).to(tl.int64)
            b = tl.load(b_ptr + k[:, None] * N + n[None, :])
            acc = common.mma(_a_tile(a_ptr, r, r_ok, k, stride_ar, K, SILU, dt), b, acc, INTERP)
        fixed = tl.floor(acc * FIX + 0.5).to(tl.int64)  # [BLOCK_M, BLOCK_N] units of 1 / FIX, rounded
        tl.atomic_add(p_ptr + r[:, None].to(tl.int64) * N + n[None, :], fixed, mask=r_ok[:, None], sem="relaxed")


def _block_n(k: int) -> int:
    return 128 if k >= 8192 else 64  # the probe's best per shape: [8192, 2048] 128 columns, [2048, N] 64


def serves(a: torch.Tensor, b: torch.Tensor, silu: bool = False) -> bool:
    """Whether `accumulate` serves a [.., K] @ b [K, N] (silu: a is y [.., 2K], the product's left operand
    silu(y[.., :K]) * y[.., K:]): float16 / bfloat16 alike, rows <= MAX_ROWS, K a multiple of SPLITS * BLOCK_K, N of
    the column tile, b contiguous."""
    if not common.HAVE_TRITON or not isinstance(b, torch.Tensor) or b.dim() != 2 or a.dim() < 1:
        return False
    k, n = b.shape
    width = 2 * k if silu else k
    return (a.dtype in (torch.float16, torch.bfloat16) and b.dtype == a.dtype and a.shape[-1] == width
            and a.device == b.device and b.is_contiguous() and a.stride(-1) == 1
            and 0 < a.numel() // width <= MAX_ROWS and k % (SPLITS * BLOCK_K) == 0 and n % _block_n(k) == 0)


_ACC: dict[tuple, torch.Tensor] = {}


def _acc(device: torch.device, rows: int, n: int) -> torch.Tensor:
    key = (str(device), rows, n)
    buf = _ACC.get(key)
    if buf is None:
        buf = _ACC[key] = torch.zeros((rows, n), dtype=torch.int64, device=device)
    return buf


def accumulate(a: torch.Tensor, b: torch.Tensor, silu: bool = False) -> torch.Tensor:
    """The shared buffer acc [R, N] int64 holding a [.., K] (R rows) @ b [K, N] in units of 2**-FIX_BITS (silu:
    a is y [.., 2K] and the left operand silu(y[.., :K]) * y[.., K:], rounded to y's dtype); the caller's consumer
    must zero it again after reading (module docstring)."""
    common.require_triton()
    if not serves(a, b, silu):
        raise ValueError(f"splitk.accumulate: unsupported operands a {list(a.shape)} {a.dtype}, "
                         f"b {list(b.shape)} {b.dtype}" + (" (silu: a should be [.., 2K])" if silu else ""))
    k, n = b.shape
    a2 = a.reshape(-1, a.shape[-1])
    rows = a2.shape[0]
    acc = _acc(a.device, rows, n)
    bn = _block_n(k)
    pdl = common.pdl_launch(a.device, (n // bn) * SPLITS)
    pre2 = k // SPLITS >= 2 * BLOCK_K and k // SPLITS * bn * b.element_size() <= PRE_BYTES
    _splitk_kernel[(n // bn, SPLITS)](a2, b, acc, rows, n, k, a2.stride(0), K_SPLIT=k // SPLITS,
                                      BLOCK_M=max(16, triton.next_power_of_2(rows)), BLOCK_N=bn, BLOCK_K=BLOCK_K,
                                      FIX=float(2 ** FIX_BITS), SILU=bool(silu), INTERP=common.INTERPRET,
                                      PRE2=pre2,
                                      num_warps=4, num_stages=4, PDL=common.pdl_mode(pdl), **pdl)
    return acc
