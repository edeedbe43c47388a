"""A split-K Triton product for decode-sized rows against cuBLAS on the H200: y [M, N] = x [M, K] @ W [K, N] as S
fp32 partials [S, M, N] (the reduction is meant for the consumer kernel, e.g. the RMS norm after the O and down
products); timed alone and with a reduce-and-cast kernel after it, L2-cold (weight copies cycled), CUDA-graph
replays. Run on the device: PYTHONPATH=$PWD python3 benchmarks/probes/splitk_probe.py [--out FILE].
The fusion built on it (kernels/triton/splitk.py, opt-in SPLITK_NORM) lost to cuBLAS in whole decode steps past
batch 1 and was removed (2026-12-05, results/step_profile_fusions.json, docs/engine.md "Tried and removed")."""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import math
import sys
from pathlib import Path

import torch
import triton
import triton.language as tl

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
time_graph = importlib.import_module("_timing").time_graph
versions = importlib.import_module("_provenance").versions
write_result = importlib.import_module("_provenance").write_result
BANDWIDTH = importlib.import_module("_attention_cases").BANDWIDTH_TB_S * 1e12

SHAPES = (("qkv", 2048, 3072), ("o", 2048, 2048), ("down", 8192, 2048), ("gate_up", 2048, 16384))


@triton.jit
def _splitk(x_ptr, w_ptr, p_ptr, M, N, stride_xm, stride_wk, K_SPLIT: tl.constexpr, BLOCK_M: tl.constexpr,
            BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr):
    n = tl.program_id(0) * BLOCK_N + tl.arange(0, BLOCK_N)
    s = tl.program_id(1)
    m = tl.arange(0, BLOCK_M)
    acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
    for kk in tl.range(0, K_SPLIT, BLOCK_K):
        k = (s * K_SPLIT + kk + tl.arange(0, BLOCK_K)).to(tl.int64)
        x = tl.load(x_ptr + m[:, None] * stride_xm + k[None, :], mask=(m < M)[:, None], other=0.0)
        w = tl.load(w_ptr + k[:, None] * stride_wk + n[None, :])
        acc = tl.dot(x, w, acc)
    tl.store(p_ptr + (s * M + m[:, None]).to(tl.int64) * N + n[None, :], acc, mask=(m < M)[:, None])


@triton.jit
def _reduce(p_ptr, y_ptr, MN, S: tl.constexpr, BLOCK: tl.constexpr):
    i = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = i < MN
    acc = tl.zeros([BLOCK], tl.float32)
    for s in tl.static_range(S):
        acc += tl.load(p_ptr + s * MN + i, mask=ok, other=0.0)
    tl.store(y_ptr + i, acc.to(y_ptr.dtype.element_ty), mask=ok)


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "splitk_probe.json")
    args = ap.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    result = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(0),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "versions": versions(),
              "what": "us per product, CUDA-graph replays, L2-cold; splitk: partials only; splitk+reduce: with a "
                      "reduce-and-cast launch (what a consumer would absorb)", "rows": []}
    for name, k, n in SHAPES:
        copies = max(2, math.ceil(2.5 * l2 / (k * n * 2)))
        ws = [torch.randn(k, n, device="cuda", dtype=torch.float16) * 0.02 for _ in range(copies)]
        for m in (1, 8, 32):
            x = torch.randn(m, k, device="cuda", dtype=torch.float16)
            ref = (x.float() @ ws[0].float())
            outs: list = []

            def cublas():
                outs.clear()
                for w in ws:
                    outs.append(x @ w)
            base = time_graph(cublas, 10, 3) * 1000 / copies
            row = {"product": name, "k": k, "n": n, "m": m, "cublas_us": base, "floor_us": k * n * 2 / BANDWIDTH * 1e6,
                   "arms": []}
            for bn, bk, splits, warps, stages in ((64, 128, 8, 4, 3), (64, 256, 8, 4, 3), (128, 128, 8, 4, 3),
                                                   (64, 128, 16, 4, 3), (32, 128, 8, 2, 3), (64, 64, 16, 4, 4),
                                                   (128, 64, 16, 4, 4), (64, 128, 4, 4, 3)):
                if k % (splits * bk) or n % bn:
                    continue
                bm = max(16, triton.next_power_of_2(m))
                part = torch.empty(splits, m, n, device="cuda", dtype=torch.float32)
                y = torch.empty(m, n, device="cuda", dtype=torch.float16)

                def sk(w):
                    _splitk[(n // bn, splits)](x, w, part, m, n, x.stride(0), w.stride(0), K_SPLIT=k // splits,
                                               BLOCK_M=bm, BLOCK_N=bn, BLOCK_K=bk, num_warps=warps,
                                               num_stages=stages)

                def run(reduce: bool):
                    def f():
                        for w in ws:
                            sk(w)
                            if reduce:
                                _reduce[(triton.cdiv(m * n, 1024),)](part, y, m * n, S=splits, BLOCK=1024)
                    return f
                try:
                    sk(ws[0])
                    _reduce[(triton.cdiv(m * n, 1024),)](part, y, m * n, S=splits, BLOCK=1024)
                    err = float((y.float() - ref).abs().max() / ref.abs().max())
                    t1 = time_graph(run(False), 10, 3) * 1000 / copies
                    t2 = time_graph(run(True), 10, 3) * 1000 / copies
                except Exception as exc:  # noqa: BLE001 - a config the compiler refuses
                    print(f"  {name} M{m} {bn}x{bk}x{splits}: {type(exc).__name__}: {str(exc)[:160]}", flush=True)
                    continue
                row["arms"].append({"block_n": bn, "block_k": bk, "splits": splits, "warps": warps, "stages": stages,
                                    "splitk_us": t1, "splitk_reduce_us": t2, "err": err})
            best = min(row["arms"], key=lambda a: a["splitk_us"]) if row["arms"] else None
            result["rows"].append(row)
            if best:
                print(f"{name:8s} M{m:<3d} cublas {base:6.2f} us | best splitk {best['splitk_us']:6.2f} "
                      f"(+reduce {best['splitk_reduce_us']:6.2f}) {best['block_n']}x{best['block_k']}x{best['splits']}"
                      f" w{best['warps']} s{best['stages']} err {best['err']:.1e} | floor {row['floor_us']:.2f}",
                      flush=True)
        del ws
        torch.cuda.empty_cache()
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
