"""Probe (H200, issue 14): a decode step's RMS norm folded into the product that follows it, in one Triton launch,
against what the engine runs today (the Triton RMS norm with the residual add, then cuBLAS, then for the MLP the
Triton SiluMul). Shapes of a Llama-3.2-1B-shaped layer: hidden 2048 -> QKV 3072, and -> gate | up 2 x 8192 with
silu(gate) * up fused; M = 1 / 8 rows. L2-cold (rotating weight copies past 2.5x the L2), CUDA-graph replays.

The fused kernel: one program per BLOCK_N output columns walks K: s = x + skip (program 0 stores s, the new
residual), acc += (s * gamma) @ W[:, cols] on the tensor cores, ss += s * s; at the end y = acc * rsqrt(ss / K +
eps) (the norm's row scale commutes with the product), for the MLP silu(gate) * up of two such accumulators.
A prototype, not in the package. Measured (H200, results/norm_gemm_probe.json at 233abbb): 3.3-6x slower than
the baseline at every row (QKV best 28.5 us against 7.7; gate | up 51 against 22.4): W [K, N] gives each program
BLOCK_N x 2-byte segments strided by the row. The W^T [N, K] arms (config ending True: K contiguous) are the
next measurement (added after that run, checked on the CPU interpreter only).

    PYTHONPATH=$PWD python3 benchmarks/probes/norm_gemm_probe.py [--out FILE]
"""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import json
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
time_graph = importlib.import_module("_timing").time_graph

EPS = 1e-5


@triton.jit
def _norm_gemm_kernel(x_ptr, skip_ptr, sum_ptr, g_ptr, w_ptr, out_ptr, M, K, N_OUT, W_COLS, eps,
                      SILU: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr,
                      NK: tl.constexpr = False):
    pid = tl.program_id(0)
    n = pid * BLOCK_N + tl.arange(0, BLOCK_N)
    n_ok = n < N_OUT
    m = tl.arange(0, BLOCK_M)
    m_ok = m < M
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    acc_u = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    ss = tl.zeros([BLOCK_M], tl.float32)
    for k0 in range(0, K, BLOCK_K):
        kk = k0 + tl.arange(0, BLOCK_K)
        xo = m[:, None].to(tl.int64) * K + kk[None, :]
        s = tl.load(x_ptr + xo, mask=m_ok[:, None], other=0.0).to(tl.float32)
        s += tl.load(skip_ptr + xo, mask=m_ok[:, None], other=0.0).to(tl.float32)
        if pid == 0:
            tl.store(sum_ptr + xo, s.to(sum_ptr.dtype.element_ty), mask=m_ok[:, None])
        ss += tl.sum(s * s, 1)
        a = (s * tl.load(g_ptr + kk).to(tl.float32)[None, :]).to(tl.float16)
        if NK:  # W^T [W_COLS, K]: the tile's K runs contiguous in memory
            wo = n[None, :].to(tl.int64) * K + kk[:, None]
            up = N_OUT * K
        else:  # W [K, W_COLS]
            wo = kk[:, None].to(tl.int64) * W_COLS + n[None, :]
            up = N_OUT
        acc = tl.dot(a, tl.load(w_ptr + wo, mask=n_ok[None, :], other=0.0), acc)
        if SILU:
            acc_u = tl.dot(a, tl.load(w_ptr + wo + up, mask=n_ok[None, :], other=0.0), acc_u)
    r = 1.0 / tl.sqrt(ss / K + eps)
    y = acc * r[:, None]
    if SILU:
        y = y / (1.0 + tl.exp(-y)) * (acc_u * r[:, None])
    tl.store(out_ptr + m[:, None] * N_OUT + n[None, :], y.to(out_ptr.dtype.element_ty),
             mask=m_ok[:, None] & n_ok[None, :])


def fused(x, skip, gamma, w, silu: bool, block_n: int, block_k: int, stages: int, warps: int, nk: bool = False):
    """w: [K, N] (nk False) or its transpose [N, K] contiguous (nk True)."""
    m, k = x.shape
    cols = w.shape[0] if nk else w.shape[1]
    n_out = cols // 2 if silu else cols
    out = torch.empty((m, n_out), dtype=x.dtype, device=x.device)
    new_sum = torch.empty_like(x)
    _norm_gemm_kernel[(triton.cdiv(n_out, block_n),)](
        x, skip, new_sum, gamma, w, out, m, k, n_out, cols, EPS, SILU=silu, BLOCK_M=16, BLOCK_N=block_n,
        BLOCK_K=block_k, NK=nk, num_stages=stages, num_warps=warps)
    return out, new_sum


def baseline(x, skip, gamma, w, silu: bool):
    from pagedkit.kernels.triton import norm, swiglu

    y, new_sum = norm.rms_norm(x, gamma, EPS, skip=skip, want_sum=True)
    p = torch.matmul(y, w)
    if silu:
        p = swiglu.silu_mul(p, w.shape[1] // 2)
    return p, new_sum


CONFIGS = {False: [(16, 256, 4, 4), (32, 256, 4, 4), (32, 512, 3, 4), (64, 128, 4, 4)],
           True: [(16, 256, 4, 4), (32, 128, 4, 4), (32, 256, 3, 4), (64, 128, 3, 8)]}
# over W^T [N, K] (a transposed copy the runtime would keep instead): the skinny GEMM over W^T of
# decode_matmul_probe.json was within 5% of cuBLAS at (32, 512, 5, 4)
CONFIGS_NK = [(32, 512, 5, 4), (16, 512, 4, 4), (32, 256, 4, 4), (64, 256, 4, 8)]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    rows = []
    for name, k, n, silu in (("norm+qkv", 2048, 3072, False), ("norm+gate_up+silu", 2048, 16384, True)):
        copies = max(2, math.ceil(2.5 * l2 / (k * n * 2)))
        ws = [torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.02 for _ in range(copies)]
        wts = [w.t().contiguous() for w in ws]
        gamma = torch.rand(k, device="cuda", dtype=torch.float16) + 0.5
        for m in (1, 8):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            skip = torch.randn(m, k, device="cuda", dtype=torch.float16)
            ref, ref_sum = baseline(x, skip, gamma, ws[0], silu)
            it = iter(range(10**9))

            def run_base():
                return baseline(x, skip, gamma, ws[next(it) % copies], silu)

            row = {"product": name, "k": k, "n": n, "m": m, "floor_us": k * n * 2 / 4.4e12 * 1e6,
                   "baseline_us": time_graph(lambda: [run_base() for _ in range(copies)], 10, 5) * 1e3 / copies,
                   "arms": []}
            for cfg in [(*c, False) for c in CONFIGS[silu]] + [(*c, True) for c in CONFIGS_NK]:
                wl = wts if cfg[-1] else ws
                try:
                    got, got_sum = fused(x, skip, gamma, wl[0], silu, *cfg)
                    err = float((got.float() - ref.float()).abs().max() / ref.float().abs().max())
                    serr = float((got_sum.float() - ref_sum.float()).abs().max())

                    def run_fused(cfg=cfg, wl=wl):
                        return [fused(x, skip, gamma, wl[j], silu, *cfg) for j in range(copies)]

                    us = time_graph(run_fused, 10, 5) * 1e3 / copies
                    row["arms"].append({"config": list(cfg), "us": us, "err": err, "sum_err": serr})
                except Exception as exc:  # noqa: BLE001 - a config that does not compile / fit
                    row["arms"].append({"config": list(cfg), "error": f"{type(exc).__name__}: {exc}"[:200]})
            best = min((a for a in row["arms"] if "us" in a), key=lambda a: a["us"], default=None)
            print(f"{name} m={m}: baseline {row['baseline_us']:.2f} us, floor {row['floor_us']:.2f}; fused "
                  + ", ".join(f"{a['config']} {a['us']:.2f} (err {a['err']:.1e})" if "us" in a else
                              f"{a['config']} {a['error'][:60]}" for a in row["arms"]), flush=True)
            row["best"] = best
            rows.append(row)
    if args.out:
        args.out.write_text(json.dumps({
            "command": "python3 " + " ".join(sys.argv), "device": torch.cuda.get_device_name(0),
            "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"),
            "what": "us per call (CUDA-graph replays of one call per weight copy, L2-cold): baseline = Triton RMS "
                    "norm with the residual add + cuBLAS (+ Triton SiluMul); fused = one Triton launch",
            "rows": rows}, indent=1) + "\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
