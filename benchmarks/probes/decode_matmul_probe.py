"""Probe (H200): a decode step's dense products at Llama-3.2-1B shapes, cuBLAS against a Triton skinny GEMM,
and SiluMul torch against kernels/triton/swiglu.py. Wrote benchmarks/results/decode_matmul_probe.json:

    python3 benchmarks/probes/decode_matmul_probe.py OUT.json        (on the GPU machine, ~100 s)

The skinny GEMM (y [M, N] = x [M, K] @ W, W held as [N, K], every program owning BLOCK_N weight rows over the
whole K, no split-K) is defined here, not in the package: it measured no faster than cuBLAS (within +-5% at
every shape), so it was not shipped. When the probe ran (2026-12-03, at d62e72c) the two kernels sat in an
uncommitted pagedkit/kernels/triton/linear.py; the SiluMul kernel is now kernels/triton/swiglu.py (same code).
Each figure: us per call in a CUDA graph of 20 calls rotating weight copies (L2-cold), 10 replays.
"""

import itertools
import json
import sys

import torch
import torch.nn.functional as F
import triton
import triton.language as tl

from pagedkit.kernels.triton import swiglu


@triton.jit
def _skinny_kernel(x_ptr, w_ptr, y_ptr, M, N, K, stride_xm, stride_wn, stride_ym,
                   BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, EVEN_K: tl.constexpr):
    pid_n = tl.program_id(0)
    rows = tl.arange(0, BLOCK_M)
    cols = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    ks = tl.arange(0, BLOCK_K)
    row_ok, col_ok = rows < M, cols < N
    x_ptrs = x_ptr + rows[:, None].to(tl.int64) * stride_xm + ks[None, :]  # x [M, K]
    w_ptrs = w_ptr + cols[:, None].to(tl.int64) * stride_wn + ks[None, :]  # wt [N, K]
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k0 in range(0, K, BLOCK_K):
        if EVEN_K:
            x = tl.load(x_ptrs, mask=row_ok[:, None], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None], other=0.0)
        else:
            k_ok = (k0 + ks) < K
            x = tl.load(x_ptrs, mask=row_ok[:, None] & k_ok[None, :], other=0.0)
            w = tl.load(w_ptrs, mask=col_ok[:, None] & k_ok[None, :], other=0.0)
        acc += tl.dot(x, tl.trans(w))
        x_ptrs += BLOCK_K
        w_ptrs += BLOCK_K
    y_ptrs = y_ptr + rows[:, None].to(tl.int64) * stride_ym + cols[None, :]
    tl.store(y_ptrs, acc.to(y_ptr.dtype.element_ty), mask=row_ok[:, None] & col_ok[None, :])


def skinny_matmul(x, wt, block_k=256, num_warps=4, num_stages=4, block_n=None):
    m, k = x.shape
    n = wt.shape[0]
    y = torch.empty((m, n), dtype=x.dtype, device=x.device)
    bn = block_n or next((b for b in (64, 32) if n // b >= 256), 16)
    bk = min(block_k, max(16, triton.next_power_of_2(k)))
    _skinny_kernel[(triton.cdiv(n, bn),)](x, wt, y, m, n, k, x.stride(0), wt.stride(0), y.stride(0), BLOCK_M=16,
                                          BLOCK_N=bn, BLOCK_K=bk, EVEN_K=k % bk == 0, num_warps=num_warps,
                                          num_stages=num_stages)
    return y


def timeit(fn, n_calls=20, reps=10):
    """us per call: fn(i) captured n_calls times in one CUDA graph, replayed reps times."""
    fn(0)
    torch.cuda.synchronize()
    g = torch.cuda.CUDAGraph()
    s = torch.cuda.Stream()
    s.wait_stream(torch.cuda.current_stream())
    with torch.cuda.stream(s):
        for i in range(3):
            fn(i)
    torch.cuda.current_stream().wait_stream(s)
    with torch.cuda.graph(g):
        for i in range(n_calls):
            fn(i)
    g.replay()
    torch.cuda.synchronize()
    e0, e1 = torch.cuda.Event(True), torch.cuda.Event(True)
    e0.record()
    for _ in range(reps):
        g.replay()
    e1.record()
    torch.cuda.synchronize()
    return e0.elapsed_time(e1) * 1e3 / (n_calls * reps)


def main(path):
    out = {}
    for K, N in [(2048, 3072), (2048, 2048), (2048, 16384), (8192, 2048)]:
        copies = max(2, int(120e6 // (K * N * 2)))
        ws = [torch.randn(K, N, device="cuda", dtype=torch.float16) * 0.02 for _ in range(copies)]
        wts = [w.T.contiguous() for w in ws]
        nbytes = K * N * 2
        for M in (1, 8, 16, 32):
            x = torch.randn(M, K, device="cuda", dtype=torch.float16)
            ref = x.double() @ ws[0].double()
            rec = {"torch_nn": timeit(lambda i: torch.matmul(x, ws[i % copies])),
                   "torch_linear_tn": timeit(lambda i: F.linear(x, wts[i % copies]))}
            if M <= 16:
                rec["skinny_err"] = float((skinny_matmul(x, wts[0]).double() - ref).abs().max() / ref.abs().max())
                best = None
                for bn, bk, st, nw in itertools.product((16, 32, 64), (128, 256, 512), (3, 5), (4, 8)):
                    if bk == 128 and nw == 8:
                        continue
                    t = timeit(lambda i: skinny_matmul(x, wts[i % copies], bk, nw, st, bn))
                    if best is None or t < best[0]:
                        best = (t, (bn, bk, st, nw))
                rec["skinny_best"] = best
                rec["skinny_best_TBps"] = nbytes / (best[0] * 1e-6) / 1e12
                rec["skinny_default"] = timeit(lambda i: skinny_matmul(x, wts[i % copies]))
                rec["skinny_default_TBps"] = nbytes / (rec["skinny_default"] * 1e-6) / 1e12
            for k in ("torch_nn", "torch_linear_tn"):
                rec[k + "_TBps"] = nbytes / (rec[k] * 1e-6) / 1e12
            out[f"K{K}_N{N}_M{M}"] = rec
            print(f"K{K} N{N} M{M}", rec, flush=True)
    for M in (1, 8, 32):
        ys = [torch.randn(M, 16384, device="cuda", dtype=torch.float16) for _ in range(4)]
        a = timeit(lambda i: F.silu(ys[i % 4][..., :8192]) * ys[i % 4][..., 8192:])
        b = timeit(lambda i: swiglu.silu_mul(ys[i % 4], 8192))
        r = F.silu(ys[0][..., :8192].float()) * ys[0][..., 8192:].float()
        err = float((swiglu.silu_mul(ys[0], 8192).float() - r).abs().max() / r.abs().max())
        out[f"silu_mul_M{M}"] = {"torch": a, "triton": b, "err": err}
        print("silu_mul", M, a, b, err, flush=True)
    json.dump(out, open(path, "w"), indent=1)


if __name__ == "__main__":
    main(sys.argv[1])
