"""Decode-sized products on the H200 by weight layout: B [K, N] (what an ONNX MatMul stores; torch.matmul, what the
runtime runs today) against B [N, K] (F.linear on the transposed copy), each under torch's cuBLAS and cuBLASLt
front ends. Shapes: a Llama-3.2-1B-shaped layer (hidden 2048, fused QKV 3072, O 2048, fused gate / up 16384, down
8192 -> 2048) and its lm_head (128256), at M = 1 / 8 / 32 rows. L2-cold: each product cycles through enough
distinct weight copies to pass 2.5x the L2; a 16-layer chain (QKV, O, gate / up, down per layer) is timed too.
All CUDA-graph replays. Run on the device: PYTHONPATH=$PWD python3 benchmarks/probes/linear_probe.py [--out FILE]."""

from __future__ import annotations

import argparse
import datetime as dt
import importlib
import math
import sys
from pathlib import Path

import torch
import torch.nn.functional as F

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # benchmarks/: the shared helpers
time_graph = importlib.import_module("_timing").time_graph
versions = importlib.import_module("_provenance").versions
write_result = importlib.import_module("_provenance").write_result
BANDWIDTH = importlib.import_module("_attention_cases").BANDWIDTH_TB_S * 1e12  # bytes / s

LAYER = (("qkv", 2048, 3072), ("o", 2048, 2048), ("gate_up", 2048, 16384), ("down", 8192, 2048))
HEAD = ("lm_head", 2048, 128256)


def weights(k: int, n: int, copies: int, layout: str) -> list[torch.Tensor]:
    shape = (k, n) if layout == "kn" else (n, k)
    return [torch.randn(shape, device="cuda", dtype=torch.float16) * 0.02 for _ in range(copies)]


def product(layout: str):
    return (lambda x, w: torch.matmul(x, w)) if layout == "kn" else (lambda x, w: F.linear(x, w))


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", type=Path, default=Path(__file__).resolve().parents[1] / "results" / "linear_probe.json")
    ap.add_argument("--rows", type=int, nargs="+", default=[1, 8, 32])
    args = ap.parse_args()
    l2 = torch.cuda.get_device_properties(0).L2_cache_size
    result = {"command": "python " + " ".join(sys.argv), "device": torch.cuda.get_device_name(0),
              "date": dt.datetime.now(dt.timezone.utc).isoformat(timespec="seconds"), "versions": versions(),
              "l2_bytes": l2, "what": "us per product (CUDA-graph replays, L2-cold), TB/s of weight bytes",
              "products": [], "chains": []}
    arms = [(layout, blas) for layout in ("kn", "nk") for blas in ("cublas", "cublaslt")]
    for name, k, n in (*LAYER, HEAD):
        nbytes = k * n * 2
        copies = max(2, math.ceil(2.5 * l2 / nbytes))
        for layout in ("kn", "nk"):
            ws = weights(k, n, copies, layout)
            fn = product(layout)
            for m in args.rows:
                x = torch.randn(m, k, device="cuda", dtype=torch.float16)
                ref = fn(x, ws[0]).float()
                for blas in ("cublas", "cublaslt"):
                    torch.backends.cuda.preferred_blas_library(blas)
                    outs: list = []

                    def run():
                        outs.clear()
                        for w in ws:
                            outs.append(fn(x, w))
                    ms = time_graph(run, 10, 3)
                    us = ms * 1000 / copies
                    err = float((fn(x, ws[0]).float() - ref).abs().max() / ref.abs().max())
                    row = {"product": name, "k": k, "n": n, "m": m, "layout": layout, "blas": blas, "us": us,
                           "tb_s": nbytes / (us * 1e-6) / 1e12, "floor_us": nbytes / BANDWIDTH * 1e6, "err": err}
                    result["products"].append(row)
                    print(f"{name:8s} M{m:<3d} {layout} {blas:9s} {us:8.2f} us  {row['tb_s']:.2f} TB/s", flush=True)
            del ws
            torch.cuda.empty_cache()
    # a 16-layer chain per arm: each product of each layer on a fixed input [M, K] (the products only, no activations)
    for m in args.rows:
        for layout, blas in arms:
            torch.backends.cuda.preferred_blas_library(blas)
            fn = product(layout)
            layers = [[weights(k, n, 1, layout)[0] for _, k, n in LAYER] for _ in range(16)]
            xs = {k: torch.randn(m, k, device="cuda", dtype=torch.float16) for k in (2048, 8192)}

            def chain():
                for ws in layers:
                    for (_, k, _n), w in zip(LAYER, ws):
                        fn(xs[k], w)
            ms = time_graph(chain, 10, 3)
            floor = 16 * sum(k * n * 2 for _, k, n in LAYER) / BANDWIDTH * 1e3
            result["chains"].append({"m": m, "layout": layout, "blas": blas, "ms": ms, "floor_ms": floor})
            print(f"chain M{m:<3d} {layout} {blas:9s} {ms * 1000:8.1f} us (floor {floor * 1000:.1f})", flush=True)
            del layers
            torch.cuda.empty_cache()
    write_result(args.out, result)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
