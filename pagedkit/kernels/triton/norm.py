"""RMS normalization over the last dimension in one Triton launch, with the residual add fused in: what
onnxruntime's SkipSimplifiedLayerNormalization, SimplifiedLayerNormalization and ONNX RMSNormalization compute
on a decoder's hidden states (runtime/ops/norms.py routes CUDA tensors here).

    s = x (+ skip) (+ bias)            float32, x / skip [R, H] (rows R = every leading dim), bias [H]
    y = s * rsqrt(mean(s^2) + eps) * gamma          gamma [H], y [R, H] in out_dtype
    sum output (want_sum): s rounded to x's dtype   [R, H]

One program per row holds the whole row in registers (H <= MAX_HIDDEN), so a norm is one launch instead of
the five to seven elementwise kernels of the torch composition (casts, add, norm, casts): a decode step's
norms are launch-bound, not bandwidth-bound. Statistics outputs (mean / inv_std_var) are not served here.
"""

from __future__ import annotations

import torch

from . import common

MAX_HIDDEN = 16384

if common.HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _rms_kernel(x_ptr, skip_ptr, bias_ptr, gamma_ptr, y_ptr, sum_ptr, H, eps,
                    HAS_SKIP: tl.constexpr, HAS_BIAS: tl.constexpr, WRITE_SUM: tl.constexpr, BLOCK: tl.constexpr,
                    PDL: tl.constexpr = 0):
        if PDL:
            common.pdl_gate(PDL)
        row = tl.program_id(0).to(tl.int64)
        cols = tl.arange(0, BLOCK)
        mask = cols < H
        off = row * H + cols  # x / skip / y / sum [R, H] contiguous
        s = tl.load(x_ptr + off, mask=mask, other=0.0).to(tl.float32)
        if HAS_SKIP:
            s += tl.load(skip_ptr + off, mask=mask, other=0.0).to(tl.float32)
        if HAS_BIAS:
            s += tl.load(bias_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        if WRITE_SUM:
            tl.store(sum_ptr + off, s.to(sum_ptr.dtype.element_ty), mask=mask)
        inv = 1.0 / tl.sqrt(tl.sum(s * s, axis=0) / H + eps)
        g = tl.load(gamma_ptr + cols, mask=mask, other=0.0).to(tl.float32)
        tl.store(y_ptr + off, (s * inv * g).to(y_ptr.dtype.element_ty), mask=mask)


def serves(x: torch.Tensor, gamma: torch.Tensor, skip: torch.Tensor | None = None,
           bias: torch.Tensor | None = None) -> bool:
    """Whether `rms_norm` serves these operands (else the caller keeps its torch composition)."""
    if not common.HAVE_TRITON or x.dim() < 1 or x.dtype not in (torch.float16, torch.bfloat16, torch.float32):
        return False
    h = x.shape[-1]
    if not 0 < h <= MAX_HIDDEN or gamma.shape != (h,) or not x.is_contiguous():
        return False
    if skip is not None and (skip.shape != x.shape or not skip.is_contiguous() or skip.device != x.device):
        return False
    return bias is None or bias.shape == (h,)


def rms_norm(x: torch.Tensor, gamma: torch.Tensor, eps: float, *, skip: torch.Tensor | None = None,
             bias: torch.Tensor | None = None, want_sum: bool = False, out_dtype: torch.dtype | None = None
             ) -> tuple[torch.Tensor, torch.Tensor | None]:
    """(y [.., H] in out_dtype (default x's), the sum x + skip + bias in x's dtype or None); see the module doc."""
    common.require_triton()
    if not serves(x, gamma, skip, bias):
        raise ValueError(f"rms_norm: unsupported operands x {list(x.shape)} {x.dtype}, gamma {list(gamma.shape)}, "
                         f"skip {None if skip is None else list(skip.shape)}, bias {None if bias is None else list(bias.shape)}")
    h = x.shape[-1]
    rows = x.numel() // h
    y = torch.empty(x.shape, dtype=out_dtype or x.dtype, device=x.device)
    s = torch.empty_like(x) if want_sum else None
    if rows:
        block = triton.next_power_of_2(h)
        pdl = common.pdl_launch(x.device, rows)
        gamma = gamma if gamma.is_contiguous() else gamma.contiguous()
        _rms_kernel[(rows,)](x, skip if skip is not None else x, bias if bias is not None else gamma, gamma, y,
                             s if s is not None else y, h, float(eps), HAS_SKIP=skip is not None,
                             HAS_BIAS=bias is not None, WRITE_SUM=want_sum, BLOCK=block,
                             num_warps=4 if block <= 4096 else 8, PDL=common.pdl_mode(pdl), **pdl)
    return y, s
