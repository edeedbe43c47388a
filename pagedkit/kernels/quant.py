"""KV-cache quantization and the Walsh-Hadamard rotation, shared by the reference kernels, the GPU
kernels and the exporters.

Formats (contract-decisions.md §2, §3, §7), all symmetric with no zero point, x ~= code * scale:
- "int8":          code = clamp(rint(x / s), -128, 127), stored as torch.int8.
- "float8e4m3fn":  code = clamp(x / s, -448, 448) cast (round-to-nearest-even) to torch.float8_e4m3fn.
- "int4":          code = clamp(rint(x / s), -8, 7); stored packed in uint8, nibble = code + 8, element 2i
                   in the low nibble of byte i; last dim (head_size + 1) // 2 (an odd size pads a zero code).
Scales: PER_TENSOR (1,), PER_CHANNEL (kv_num_heads, 1, head_size) -> broadcast [Hkv, D]; PER_TOKEN: one
scale per (token, kv head) = amax / qmax (qmax 127 / 448 / 7, amax 0 -> 1), rounded to the scale cache's
dtype before the codes are computed with that stored scale.
Rotation: x @ (H_n / sqrt(n)) over the last dim, H_n the Sylvester Hadamard matrix (symmetric, so the
transform is its own inverse).
"""

from __future__ import annotations

import functools
import math

import torch

from ..interface import dtypes
from ..validators.contract import CACHE_FORMATS, cache_width

# the quantized formats of the contract's cache-format table (validators/contract.py CACHE_FORMATS)
QUANT_FORMATS = tuple(n for n, f in CACHE_FORMATS.items() if f.quantized)  # int8, float8e4m3fn, int4
QMAX = {n: CACHE_FORMATS[n].qmax for n in QUANT_FORMATS}  # 127, 448, 7
QMIN = {n: CACHE_FORMATS[n].qmin for n in QUANT_FORMATS}  # -128, -448, -8
STORAGE_DTYPE = {n: dtypes.torch_dtype(CACHE_FORMATS[n].storage) for n in QUANT_FORMATS}  # int4: uint8
FORMAT_OF_STORAGE = {dt: n for n, dt in STORAGE_DTYPE.items()}  # torch storage dtype -> format (uint8: int4)


def _check_format(fmt: str) -> None:
    if fmt not in QMAX:
        raise ValueError(f"unknown cache quantization format {fmt!r}; expected one of {QUANT_FORMATS}")


def stored_width(fmt: str, head_size: int) -> int:
    """Last dim of a cache holding head_size channels: (head_size + 1) // 2 for int4, else head_size."""
    return cache_width(fmt, head_size)


# ---------------------------------------------------------------------------------------------
# codes
# ---------------------------------------------------------------------------------------------


def _ratio(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """x / scale; a zero scale (only reachable from an underflowed stored PER_TOKEN scale) gives 0."""
    s = torch.as_tensor(scale, dtype=x.dtype)
    return torch.where(s != 0, x / torch.where(s != 0, s, torch.ones_like(s)), torch.zeros((), dtype=x.dtype))


def quantize_int8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """clamp(rint(x / scale), -128, 127) as int8 (torch.round rounds half to even, like rint)."""
    return torch.clamp(torch.round(_ratio(x, scale)), -128, 127).to(torch.int8)


def quantize_fp8(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """clamp(x / scale, -448, 448) cast to float8 E4M3 (round to nearest even)."""
    return torch.clamp(_ratio(x, scale), -448.0, 448.0).to(torch.float8_e4m3fn)


def quantize_int4(x: torch.Tensor, scale: torch.Tensor | float) -> torch.Tensor:
    """Signed int4 codes clamp(rint(x / scale), -8, 7), unpacked, as int8 [..., D]."""
    return torch.clamp(torch.round(_ratio(x, scale)), -8, 7).to(torch.int8)


def pack_int4(codes: torch.Tensor) -> torch.Tensor:
    """Signed codes [..., D] in [-8, 7] -> uint8 [..., (D + 1) // 2]; nibble = code + 8, even element low."""
    if codes.dtype.is_floating_point:
        raise TypeError(f"pack_int4 expects integer codes, got {codes.dtype}")
    if codes.numel() and (int(codes.min()) < -8 or int(codes.max()) > 7):
        raise ValueError(f"int4 codes must lie in [-8, 7], got [{int(codes.min())}, {int(codes.max())}]")
    n = codes.shape[-1]
    nib = (codes.to(torch.int16) + 8).to(torch.uint8)
    if n % 2:
        pad = torch.full((*nib.shape[:-1], 1), 8, dtype=torch.uint8, device=nib.device)  # a zero code pads odd sizes
        nib = torch.cat((nib, pad), dim=-1)
    low, high = nib[..., 0::2], nib[..., 1::2]
    return low | (high << 4)


def unpack_int4(packed: torch.Tensor, head_size: int) -> torch.Tensor:
    """uint8 [..., (head_size + 1) // 2] -> signed int8 codes [..., head_size]."""
    if packed.dtype != torch.uint8:
        raise TypeError(f"unpack_int4 expects a uint8 tensor, got {packed.dtype}")
    if packed.shape[-1] != cache_width("int4", head_size):
        raise ValueError(f"packed int4 last dim should be (head_size + 1) // 2 = {cache_width('int4', head_size)} "
                         f"for head_size {head_size}, got {packed.shape[-1]}")
    low = (packed & 0x0F).to(torch.int8) - 8
    high = (packed >> 4).to(torch.int8) - 8
    return torch.stack((low, high), dim=-1).flatten(-2)[..., :head_size]


def quantize(x: torch.Tensor, scale: torch.Tensor | float, fmt: str) -> torch.Tensor:
    """x [..., D] (float) -> the stored cache form: int8 [..., D], float8_e4m3fn [..., D] or uint8 [..., (D+1)//2]."""
    _check_format(fmt)
    if fmt == "int8":
        return quantize_int8(x, scale)
    if fmt == "float8e4m3fn":
        return quantize_fp8(x, scale)
    return pack_int4(quantize_int4(x, scale))


def dequantize(stored: torch.Tensor, scale: torch.Tensor | float, fmt: str, head_size: int | None = None,
               dtype: torch.dtype = torch.float32) -> torch.Tensor:
    """Stored cache form -> code * scale in `dtype`, [..., head_size]. head_size is needed for int4 only
    (default: 2 * packed width)."""
    _check_format(fmt)
    if fmt == "int4":
        codes = unpack_int4(stored, head_size if head_size is not None else 2 * stored.shape[-1])
    else:
        codes = stored
    return codes.to(dtype) * torch.as_tensor(scale, dtype=dtype)


# ---------------------------------------------------------------------------------------------
# scales
# ---------------------------------------------------------------------------------------------


def per_token_scale(x: torch.Tensor, fmt: str, scale_dtype: torch.dtype = torch.float16) -> torch.Tensor:
    """PER_TOKEN scale of x [..., D] over its last dim: amax / qmax (amax 0 -> 1), rounded to scale_dtype.

    Returns [..., 1] in scale_dtype: exactly what the scale cache stores, and what the codes must use.
    """
    _check_format(fmt)
    amax = x.abs().amax(dim=-1, keepdim=True)
    s = torch.where(amax > 0, amax / QMAX[fmt], torch.ones_like(amax))
    return s.to(scale_dtype)


def static_scale(scale: torch.Tensor, quant_type: str, kv_num_heads: int, head_size: int) -> torch.Tensor:
    """A PER_TENSOR (1,) or PER_CHANNEL (kv_num_heads, 1, head_size) scale as a tensor broadcastable to
    [..., kv_num_heads, head_size]: [1, 1] or [kv_num_heads, head_size]."""
    if quant_type == "PER_TENSOR":
        if scale.numel() != 1:
            raise ValueError(f"PER_TENSOR scale should have 1 element, got shape {tuple(scale.shape)}")
        return scale.reshape(1, 1)
    if quant_type == "PER_CHANNEL":
        if scale.numel() != kv_num_heads * head_size:
            raise ValueError(f"PER_CHANNEL scale should have shape ({kv_num_heads}, 1, {head_size}), "
                             f"got {tuple(scale.shape)}")
        return scale.reshape(kv_num_heads, head_size)
    raise ValueError(f"static_scale: quant type should be PER_TENSOR or PER_CHANNEL, got {quant_type!r}")


# ---------------------------------------------------------------------------------------------
# Walsh-Hadamard rotation
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=32)
def _hadamard64(n: int) -> torch.Tensor:
    h = torch.ones(1, 1, dtype=torch.float64)
    while h.shape[0] < n:
        h = torch.cat((torch.cat((h, h), dim=1), torch.cat((h, -h), dim=1)), dim=0)
    return h / math.sqrt(n)


def hadamard_matrix(n: int, dtype: torch.dtype = torch.float32, what: str = "size") -> torch.Tensor:
    """Orthonormal Sylvester-ordered Walsh-Hadamard matrix H_n / sqrt(n) [n, n] (symmetric, H @ H = I).
    `what` names the size in the error for a non-power-of-two n (e.g. "head_size")."""
    if n < 1 or n & (n - 1):
        raise ValueError(f"Hadamard rotation needs a power-of-two size: {what} should be a power of two, got {n}")
    return _hadamard64(n).to(dtype)


def hadamard(x: torch.Tensor, what: str = "size") -> torch.Tensor:
    """Rotate x [..., n] by H_n / sqrt(n) over its last dim. Its own inverse (H is symmetric, orthonormal)."""
    return x @ hadamard_matrix(x.shape[-1], x.dtype, what)
