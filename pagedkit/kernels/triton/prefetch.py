"""L2 prefetch of a byte range (a weight's head) on sm_90+: loads nothing into registers, only warms the L2.

    prefetch_l2(t, nbytes, mode="bulk")   t: a contiguous CUDA tensor; its first nbytes (rounded down to whole
                                          chunks) are requested into the L2

A decode step's small products (QKV, O at batch 1-8: 8-13 MB of weights) run at 1.4-2.2 TB/s where the device
reads 3.3-4.8: each is too short to hide the memory latency of its first tiles, and the kernels between them
(norms, the cache write, attention, its reduce) leave the memory bus idle. A prefetch launched on a side stream
during those kernels (runtime/prefetch.py decides which weights and where) brings the next product's weight
head into the L2 while nothing else reads memory; the product then reads it at L2 speed.

One program issues PER_PROGRAM requests, one per lane (one warp):
- "bulk": `cp.async.bulk.prefetch.L2.global [addr], CHUNK` (Hopper's bulk copy engine; 16 KiB per request);
- "line": `prefetch.global.L2::evict_last [addr]` per 128-byte line (any sm_70+; more instructions).
The address range never passes the tensor's end: only whole chunks are requested. Under the interpreter
(inline assembly does not run there) the kernel records the chunk indices it would request into `marks`, which
is what the CPU tests check.
"""

from __future__ import annotations

import torch

from . import common

BULK_CHUNK = 16384  # bytes per bulk request (a multiple of 16)
LINE = 128  # bytes per line request
PER_PROGRAM = 32  # requests per program (one warp: a request per lane)
MODES = ("bulk", "line")

if common.HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _prefetch_kernel(base_ptr, n_chunks, marks_ptr, CHUNK: tl.constexpr, PER: tl.constexpr,
                         ASM: tl.constexpr, RECORD: tl.constexpr):
        idx = tl.program_id(0) * PER + tl.arange(0, PER)  # chunk indices of this program
        ok = idx < n_chunks
        if RECORD:
            tl.store(marks_ptr + idx, 1, mask=ok)
        else:
            ptrs = base_ptr + tl.where(ok, idx, 0).to(tl.int64) * CHUNK  # past the end: chunk 0 again (harmless)
            tl.inline_asm_elementwise(ASM, "=r,l", [ptrs], dtype=tl.int32, is_pure=False, pack=1)


def chunk_bytes(mode: str) -> int:
    if mode not in MODES:
        raise ValueError(f"prefetch mode {mode!r}: expected one of {list(MODES)}")
    return BULK_CHUNK if mode == "bulk" else LINE


def whole_chunks(t: torch.Tensor, nbytes: int, mode: str) -> int:
    """Chunks of the first min(nbytes, t's bytes) bytes that lie wholly inside t, from its first byte."""
    total = t.numel() * t.element_size()
    return max(0, min(int(nbytes), total)) // chunk_bytes(mode)


def prefetch_l2(t: torch.Tensor, nbytes: int, mode: str = "bulk", marks: torch.Tensor | None = None) -> int:
    """Request t's first nbytes (whole chunks) into the L2 on the current stream; returns the chunks requested.
    marks (interpreter, tests): an int32 tensor of at least that many entries, set to 1 where a chunk would be
    requested (the GPU path ignores it)."""
    common.require_triton()
    if not t.is_contiguous():
        raise ValueError(f"prefetch_l2: the tensor must be contiguous, got strides {t.stride()}")
    chunk = chunk_bytes(mode)
    if t.data_ptr() % 16:
        raise ValueError(f"prefetch_l2: the tensor's address must be 16-byte aligned, got {t.data_ptr():#x}")
    n = whole_chunks(t, nbytes, mode)
    if n == 0:
        return 0
    record = bool(common.INTERPRET or not t.is_cuda)
    if record and (marks is None or marks.numel() < n or marks.dtype != torch.int32):
        raise ValueError(f"prefetch_l2 under the interpreter records into marks: an int32 tensor of >= {n} entries")
    asm = (f"cp.async.bulk.prefetch.L2.global [$1], {chunk}; mov.u32 $0, 0;" if mode == "bulk"
           else "prefetch.global.L2::evict_last [$1]; mov.u32 $0, 0;")
    base = t.reshape(-1).view(torch.uint8)
    _prefetch_kernel[(triton.cdiv(n, PER_PROGRAM),)](base, n, marks if record else base, CHUNK=chunk,
                                                     PER=PER_PROGRAM, ASM=asm, RECORD=record, num_warps=1)
    return n
