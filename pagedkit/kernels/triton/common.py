"""Facts every Triton kernel family shares: whether Triton is usable here, interpreter mode, and the
compile-time codes of a cache side's storage and scale (passed to kernels as tl.constexpr ints).

One cache side (K or V) is described by a `SideFormat`: its storage code (`FMT_*`) and scale mode
(`SCALE_*`), derived once from the cache tensor's dtype and the node's `{k,v}_cache_dtype` /
`{k,v}_quant_type` attributes (contract-decisions §2, §3, §7). Storage:
- FMT_FLOAT: float16 / bfloat16 / float32 cache, stored by a cast (scale mode SCALE_NONE);
- FMT_INT8:  int8 codes, clamp(rint(x / s), -128, 127);
- FMT_FP8:   float8e4m3fn codes, clamp(x / s, -448, 448) rounded to nearest even;
- FMT_INT4:  uint8 bytes [.., (D + 1) // 2], nibble = code + 8, channel 2i in the low nibble of byte i.
Scales: SCALE_TENSOR comes as float32 [1] (kernels read element 0), SCALE_CHANNEL as float32 [Hkv * D]; the
launchers build them (`static_scale_vector`); SCALE_TOKEN reads the scale cache [NB, BS, Hkv] at the slot.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from ... import settings

try:  # triton is optional: the CPU runtime never needs it (the interpreter tests do)
    import triton  # noqa: F401
    import triton.language as tl  # noqa: F401

    HAVE_TRITON = True
except ImportError:  # pragma: no cover - exercised on machines without triton
    triton = None
    tl = None
    HAVE_TRITON = False

# Read once at import, like triton itself: set TRITON_INTERPRET=1 before importing a kernel module.
INTERPRET = settings.read("TRITON_INTERPRET")

FMT_FLOAT, FMT_INT8, FMT_FP8, FMT_INT4 = 0, 1, 2, 3
SCALE_NONE, SCALE_TENSOR, SCALE_CHANNEL, SCALE_TOKEN = 0, 1, 2, 3

_FMT_OF_DTYPE = {torch.float16: FMT_FLOAT, torch.bfloat16: FMT_FLOAT, torch.float32: FMT_FLOAT,
                 torch.int8: FMT_INT8, torch.float8_e4m3fn: FMT_FP8}
_SCALE_OF_QUANT = {"NONE": SCALE_NONE, "PER_TENSOR": SCALE_TENSOR, "PER_CHANNEL": SCALE_CHANNEL,
                   "PER_TOKEN": SCALE_TOKEN}
QMAX = {FMT_INT8: 127.0, FMT_FP8: 448.0, FMT_INT4: 7.0}
QMIN = {FMT_INT8: -128.0, FMT_FP8: -448.0, FMT_INT4: -8.0}


@dataclass(frozen=True)
class SideFormat:
    fmt: int  # FMT_*
    scale: int  # SCALE_*

    @property
    def quantized(self) -> bool:
        return self.fmt != FMT_FLOAT


def side_format(cache: torch.Tensor, cache_dtype_attr: str, quant_type: str, name: str) -> SideFormat:
    """The storage / scale codes of one cache side; a ValueError naming the input otherwise."""
    if cache_dtype_attr == "int4":
        if cache.dtype != torch.uint8:
            raise ValueError(f"input '{name}': cache dtype 'int4' needs a uint8 cache, got {cache.dtype}")
        fmt = FMT_INT4
    elif cache.dtype in _FMT_OF_DTYPE:
        fmt = _FMT_OF_DTYPE[cache.dtype]
    else:
        raise ValueError(f"input '{name}': unsupported cache element type {cache.dtype}")
    scale = _SCALE_OF_QUANT.get(str(quant_type))
    if scale is None:
        raise ValueError(f"quant type of '{name}': expected one of {sorted(_SCALE_OF_QUANT)}, got {quant_type!r}")
    if (fmt == FMT_FLOAT) != (scale == SCALE_NONE):
        raise ValueError(f"input '{name}': a {'quantized' if fmt != FMT_FLOAT else cache.dtype} cache with "
                         f"quant type {quant_type}")
    return SideFormat(fmt, scale)


def static_scale_vector(scale: torch.Tensor | None, kv_heads: int, head_size: int) -> torch.Tensor | None:
    """k_scale / v_scale (PER_TENSOR [1] or PER_CHANNEL [Hkv * D] in any layout) -> float32 [1] (the kernels
    read a PER_TENSOR scale at element 0) or [Hkv * D], contiguous on the scale's device: a view of a float32
    scale, no launch (an expanded copy took one small kernel per side and call), no host read."""
    if scale is None:
        return None
    flat = scale.reshape(-1).to(torch.float32)
    if flat.numel() == 1:
        return flat.contiguous()
    if flat.numel() != kv_heads * head_size:
        raise ValueError(f"scale of {flat.numel()} elements: expected 1 or kv_num_heads * head_size = "
                         f"{kv_heads * head_size}")
    return flat.contiguous()


# Programmatic dependent launch (Hopper and newer): a kernel launched with `launch_pdl` may start while its
# predecessor in the stream drains; its first instruction (`pdl_gate`) waits until the predecessor has completed
# and its writes are visible, then lets the next PDL launch start early. A decode step's small launches (norms,
# cache write, attention, reduce, SwiGLU) then overlap their launch latency with the kernel before them.
# On by default (PAGEDKIT_PDL=0 turns it off), with the dependent launch released as programs exit: H200,
# Llama-3.2-1B-shaped decode, whole-step graph replays (benchmarks/results/step_profile_pdl.json): batch 1 /
# 1024 1.124 -> 1.052 ms, batch 1 / 4096 1.174 -> 1.163, batch 8 / 1024 1.228 -> 1.218, batch 8 / 4096 1.423 ->
# 1.413, batch 32 / 4096 2.182 -> 2.163 ms; released right after the wait it was 1-1.3% slower at batch 8.
# `pdl_launch(device, programs)` gives the launch options ({} where off or unsupported).
PDL = settings.read("PAGEDKIT_PDL")
# launches of more programs than this skip PDL (0: no cap); PAGEDKIT_PDL_MAX_PROGRAMS (tuning)
PDL_MAX_PROGRAMS = settings.read("PAGEDKIT_PDL_MAX_PROGRAMS")
# release the dependent launch right after the wait (True) or only when each program exits (False, the
# default); PAGEDKIT_PDL_LATE=0 releases early (tuning)
PDL_EARLY_RELEASE = not settings.read("PAGEDKIT_PDL_LATE")


def _launcher_has_pdl() -> bool:
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
    except ImportError:  # pragma: no cover - triton without the NVIDIA backend
        return False
    return "launch_pdl" in getattr(CUDAOptions, "__dataclass_fields__", {})


_PDL_DEVICES: dict[str, bool] = {}


def pdl_launch(device: torch.device, programs: int = 0) -> dict:
    """{"launch_pdl": True} when PDL is on, the launcher has it, `device` is a CUDA device of compute
    capability >= 9.0 and the grid's `programs` are within PDL_MAX_PROGRAMS; else {} (the interpreter, the CPU,
    older GPUs). Kernels take PDL=pdl_mode(result)."""
    if not PDL or INTERPRET or not HAVE_TRITON or device.type != "cuda":
        return {}
    if PDL_MAX_PROGRAMS and programs > PDL_MAX_PROGRAMS:
        return {}
    key = str(device)
    if key not in _PDL_DEVICES:
        _PDL_DEVICES[key] = _launcher_has_pdl() and torch.cuda.get_device_capability(device)[0] >= 9
    return {"launch_pdl": True} if _PDL_DEVICES[key] else {}


def pdl_mode(launch: dict) -> int:
    """The kernels' PDL constexpr for pdl_launch's result: 0 off, 1 wait then release, 2 wait only."""
    return 0 if not launch else 1 if PDL_EARLY_RELEASE else 2


if HAVE_TRITON:
    @triton.jit
    def pdl_gate(MODE: tl.constexpr):
        """Wait for the predecessor grid (its writes visible); MODE 1 then allows the dependent launch to begin
        (MODE 2: it begins as this grid's programs exit)."""
        tl.inline_asm_elementwise("griddepcontrol.wait; // $0", "=r", [], dtype=tl.int32, is_pure=False, pack=1)
        if MODE == 1:
            tl.inline_asm_elementwise("griddepcontrol.launch_dependents; // $0", "=r", [], dtype=tl.int32,
                                      is_pure=False, pack=1)


if HAVE_TRITON:
    @triton.jit
    def mma(a, b, acc, INTERP: tl.constexpr):
        """tl.dot(a, b, acc) with fp32 accumulation; the interpreter's dot cannot take bfloat16 (it multiplies the
        raw bits), so there the operands go to float32 first (same products: fp16 / bf16 values are exact)."""
        if INTERP:
            return tl.dot(a.to(tl.float32), b.to(tl.float32), acc)
        else:
            return tl.dot(a, b, acc)


def next_pow2(n: int) -> int:
    return 1 if n <= 1 else 1 << (int(n) - 1).bit_length()


def require_triton() -> None:
    if not HAVE_TRITON:
        raise RuntimeError("the Triton kernels need triton (pip install 'pagedkit[gpu]' on a CUDA machine, "
                           "or 'pagedkit[triton-cpu]' for the interpreter)")
