"""Row-wise argmax of a decode step's logits in two small Triton launches (the engine's greedy choices):

    logits [R, V] (float16 / bfloat16 / float32, last dim contiguous, any row stride)
    -> int64 [R], the index of each row's largest value; ties take the lowest index, NaN counts as the largest
       (torch.argmax's results)

torch.argmax of one [1, 128256] float16 row ran as a single reduction kernel of 36 us on the H200 (a
Llama-3.2-1B-shaped decode step, benchmarks/engine_timeline.py), 3% of the step. Here, pass 1 has one program
per (row, CHUNK values) reduce its chunk to one int64 key, pass 2 one program per row reduce the chunk keys.
A key packs the value's order-preserving int32 image (float32 bits, the negative ones' magnitude bits flipped;
-0.0 as +0.0; NaN above +inf) over 2**32 - 1 - index, so the largest key is the largest value at its lowest
index: integer maxima, exact and independent of the order of reduction (deterministic, capture-safe).
"""

from __future__ import annotations

import torch

from . import common

CHUNK = 2048  # values per program of pass 1 (V = 128256: 63 programs per row)

if common.HAVE_TRITON:
    import triton
    import triton.language as tl

    @triton.jit
    def _argmax_chunk_kernel(x_ptr, part_ptr, V, stride_r, n_chunks, CHUNK: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        c = tl.program_id(1)
        idx = c * CHUNK + tl.arange(0, CHUNK)
        ok = idx < V
        x = tl.load(x_ptr + r * stride_r + idx, mask=ok, other=0.0).to(tl.float32) + 0.0  # -0.0 -> +0.0
        bits = x.to(tl.int32, bitcast=True)
        key = tl.where(bits >= 0, bits, bits ^ 0x7FFFFFFF)  # order-preserving over the floats
        key = tl.where(x != x, 0x7FFFFFFF, key)  # NaN: above +inf (0x7F800000)
        packed = key.to(tl.int64) * 4294967296 + (4294967295 - idx.to(tl.int64))
        packed = tl.where(ok, packed, -9223372036854775807 - 1)
        tl.store(part_ptr + r * n_chunks + c, tl.max(packed, 0))

    @triton.jit
    def _argmax_final_kernel(part_ptr, out_ptr, n_chunks, P_PAD: tl.constexpr):
        r = tl.program_id(0).to(tl.int64)
        p = tl.arange(0, P_PAD)
        packed = tl.load(part_ptr + r * n_chunks + p, mask=p < n_chunks, other=-9223372036854775807 - 1)
        best = tl.max(packed, 0)
        tl.store(out_ptr + r, 4294967295 - (best & 4294967295))


def argmax_rows(logits: torch.Tensor) -> torch.Tensor:
    """int64 [R] argmax of logits [R, V] along V (module docstring); torch.argmax where Triton does not run (CPU
    tensors outside the interpreter, V >= 2**31, an empty tensor)."""
    if logits.dim() != 2:
        raise ValueError(f"logits: expected [R, V], got shape {tuple(logits.shape)}")
    r, v = logits.shape
    runs = common.HAVE_TRITON and (logits.is_cuda or common.INTERPRET)
    if not runs or r == 0 or v == 0 or v >= 2**31 or logits.dtype not in (torch.float16, torch.bfloat16,
                                                                            torch.float32):
        return logits.argmax(-1)
    if logits.stride(1) != 1:
        logits = logits.contiguous()
    n_chunks = -(-v // CHUNK)
    part = torch.empty((r, n_chunks), dtype=torch.int64, device=logits.device)
    out = torch.empty((r,), dtype=torch.int64, device=logits.device)
    _argmax_chunk_kernel[(r, n_chunks)](logits, part, v, logits.stride(0), n_chunks, CHUNK=CHUNK, num_warps=4)
    _argmax_final_kernel[(r,)](part, out, n_chunks, P_PAD=max(16, triton.next_power_of_2(n_chunks)), num_warps=4)
    return out
