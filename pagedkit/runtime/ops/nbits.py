"""MatMulNBits weights laid out once (the prepack step of session creation, see packed.py).

Two layouts replace the node's B (and absorb its scales / zero points):

- `Int4Linear`: 4-bit weights in torch's CPU int4 layout (`_convert_weight_to_int4pack_for_cpu`), multiplied
  by `_weight_int4pack_mm_for_cpu` with bfloat16 activations (the kernel's fast path: 16x faster than its
  float32 path in the benchmark). The kernel computes w = (q - 8) * scale + zero in float32 from bfloat16
  scale / zero, accumulates in float32 and rounds its output to bfloat16, so MatMulNBits' (q - zp) * scale
  is expressed as scale = s, zero = (8 - zp) * s (zero = 0 exactly when zero points are absent: the default
  zero point of 4 bits is 8). N is padded to a multiple of 16 (zero weights), K to whole blocks (x padded
  with zeros), outputs sliced back. Memory: the int4 nibbles plus 4 bytes per block, as the ONNX initializers.
- `DequantizedLinear`: W = (q - zp) * scale dequantized once in A's dtype (the per-call path's exact values),
  then `a @ W.T`: exact, fast, 8x the memory of int4 weights at float32; used while the process-wide budget
  (`PAGEDKIT_DEQUANT_CACHE_MB`, default a quarter of physical memory) allows, else the weight stays packed and
  is dequantized on each call.

Choice per node (`plan`): the bfloat16 kernel where the node's `accuracy_level` allows A below float16
(3 = bf16, 4 = int8: onnxruntime's own CPU kernel quantizes A to int8 blocks there) or A is bfloat16 already,
and the form is one the kernel serves (bits 4, block 32/64/128/256, a non-empty B); the exact layout otherwise
(accuracy_level 0/1/2, bits 2/8, block 16, ...). `PAGEDKIT_MATMULNBITS` overrides: `exact` (never the bf16
kernel), `int4` (the kernel wherever the form allows, whatever accuracy_level), `off` (no prepack).
Measured figures: benchmarks/int4_matmul.py, docs/runtime-ops.md "int4 weights".
"""

from __future__ import annotations

import os
import weakref

import torch
import torch.nn.functional as F

from ... import settings
from .packed import Packed, PackedLinear

KERNEL_BLOCK_SIZES = (32, 64, 128, 256)  # the group sizes _weight_int4pack_mm_for_cpu accepts
_N_ALIGN = 16  # _convert_weight_to_int4pack_for_cpu needs N % 16 == 0


def kernel_available() -> bool:
    ops = torch.ops.aten
    return hasattr(ops, "_weight_int4pack_mm_for_cpu") and hasattr(ops, "_convert_weight_to_int4pack_for_cpu")


class Absorbed(Packed):
    """Stands in a slot whose constant another input's Packed object holds (scales, zero points of B):
    the original can be dropped. Implementations ignore it (the object in slot `into` has the values)."""

    def __init__(self, into: int, what: str):
        self.into, self.layout, self.nbytes = into, f"absorbed into input {into} ({what})", 0


class Int4Linear(PackedLinear):
    """MatMulNBits' 4-bit B as torch's CPU int4 layout; `matmul(a)` runs the bf16 int4 kernel."""

    def __init__(self, q: torch.Tensor, scales: torch.Tensor, zero_points: torch.Tensor | None,
                 block_size: int, n: int, k: int, has_zero_points: bool):
        """q: int [N, K_pad] in 0..15 (K_pad = k_blocks * block_size); scales [N, k_blocks] (A's dtype);
        zero_points [N, k_blocks] as numbers (None: the default 8)."""
        k_pad = q.shape[1]
        n_pad = -(-n // _N_ALIGN) * _N_ALIGN
        s = scales.to(torch.float32)
        z = torch.zeros_like(s) if zero_points is None else (8.0 - zero_points.to(torch.float32)) * s
        if n_pad != n:  # zero weights in the padding rows: q = 8, scale 0, zero 0
            q = torch.cat([q, q.new_full((n_pad - n, k_pad), 8)])
            s = torch.cat([s, s.new_zeros(n_pad - n, s.shape[1])])
            z = torch.cat([z, z.new_zeros(n_pad - n, z.shape[1])])
        self.weight = torch.ops.aten._convert_weight_to_int4pack_for_cpu(q.to(torch.int32).contiguous(), 1)
        self.scales_and_zeros = torch.stack([s.T, z.T], -1).to(torch.bfloat16).contiguous()  # [k_blocks, N_pad, 2]
        self.block_size, self.in_features, self.out_features, self.k_pad = block_size, k, n, k_pad
        self.has_zero_points = has_zero_points
        self.dtype = scales.dtype
        self.shape = (n, k)
        self.nbytes = self.weight.numel() * self.weight.element_size() + self.scales_and_zeros.numel() * 2
        self.layout = f"int4 CPU kernel, bf16 activations (block {block_size})"

    def matmul(self, a: torch.Tensor) -> torch.Tensor:
        lead = a.shape[:-1]
        x = a.reshape(-1, a.shape[-1]).to(torch.bfloat16)
        if x.shape[0] == 0:
            return a.new_zeros(*lead, self.out_features)
        y = self.kernel(x)[:, :self.out_features]
        return y.to(a.dtype).reshape(*lead, self.out_features)

    def kernel(self, x: torch.Tensor) -> torch.Tensor:
        """x bf16 [M, K] -> bf16 [M, N_pad]."""
        if self.k_pad != self.in_features:
            x = F.pad(x, (0, self.k_pad - self.in_features))
        return torch.ops.aten._weight_int4pack_mm_for_cpu(x.contiguous(), self.weight, self.block_size,
                                                          self.scales_and_zeros)


class DequantizedLinear(PackedLinear):
    """B dequantized once: W [N, K] in A's dtype, the values the per-call path computes."""

    def __init__(self, w: torch.Tensor, has_zero_points: bool):
        self.weight = w.contiguous()
        self.out_features, self.in_features = w.shape
        self.shape, self.dtype = tuple(w.shape), w.dtype
        self.has_zero_points = has_zero_points
        self.nbytes = w.numel() * w.element_size()
        self.layout = f"dequantized {str(w.dtype).removeprefix('torch.')}"
        reserve(self, self.nbytes)

    def matmul(self, a: torch.Tensor) -> torch.Tensor:
        return a @ self.weight.T  # the expression of the per-call path: same values


_used = [0]  # bytes held by live dequantized caches (all sessions of the process)


def _budget() -> int:
    mib = settings.read("PAGEDKIT_DEQUANT_CACHE_MB")
    if mib is not None:
        return int(mib * 2**20)
    try:
        return os.sysconf("SC_PHYS_PAGES") * os.sysconf("SC_PAGE_SIZE") // 4
    except (ValueError, OSError, AttributeError):
        return 4 << 30


def fits_budget(nbytes: int) -> bool:
    return _used[0] + nbytes <= _budget()


def reserve(obj, nbytes: int) -> None:
    """Count `nbytes` against the dequantized-cache budget while `obj` lives."""
    _used[0] += nbytes
    weakref.finalize(obj, _release, nbytes)


def _release(nbytes: int) -> None:
    _used[0] -= nbytes


def mode() -> str:
    """PAGEDKIT_MATMULNBITS: "auto", "exact", "int4" or "off" (read at each session creation)."""
    return settings.read("PAGEDKIT_MATMULNBITS")


def plan(attrs: dict, a_dtype: torch.dtype, device, mode_: str | None = None) -> str | None:
    """The layout a MatMulNBits node gets: 'int4' (bf16 kernel), 'dequantized' (exact cache, if the
    budget allows), or None (no prepack: dequantized per call)."""
    mode_ = mode_ or mode()
    if mode_ == "off" or torch.device(device).type != "cpu":
        return None
    kernel_form = (attrs.get("bits", 4) == 4 and attrs["block_size"] in KERNEL_BLOCK_SIZES and kernel_available())
    level_allows_bf16 = attrs.get("accuracy_level", 0) >= 3 or a_dtype == torch.bfloat16
    if kernel_form and mode_ != "exact" and (level_allows_bf16 or mode_ == "int4"):
        return "int4"
    return "dequantized"
